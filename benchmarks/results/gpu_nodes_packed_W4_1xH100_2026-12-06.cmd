# one H100, 4 ranks under the launcher's MPS daemon: the timing with segment ids of packed documents (512-8192
# tokens), 2 "nodes" x 2 ranks and one node of 4, S_local 16384 and 32768: stage `nodes-timing-packed` of
# tools/gpu_session.py (nodes_timing_packed_W4_1xH100_2026-12-06.csv, log gpu_nodes_packed_W4_1xH100_2026-12-06.txt)
python tools/gpu_session.py --nproc 4 --out DIR --budget 200 nodes-timing-packed
# which runs
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --seq-local 16384,32768 --iters 5 --packed --out DIR
RING_ATTENTION_NODE_SIZE=4 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --seq-local 16384,32768 --iters 5 --packed --out DIR
# the same stage on the tree before the Hopper backward narrowed KV_IDS calls by the queries' ranges (commit 660ee82,
# its ring_core, torch_bridge and jax_ring exported into .old; the scripts of this tree), on the same warm machine:
PYTHONPATH=$PWD/.old:$PYTHONPATH python tools/gpu_session.py --nproc 4 --out DIR --budget 200 nodes-timing-packed
# -> nodes_timing_packed_before_W4_1xH100_2026-12-06.csv
# the figure and table: python -m benchmarks.plot --nodes benchmarks/results/nodes_timing_packed_W4_1xH100_2026-12-06.csv
