# one H100, 4 ranks under the launcher's MPS daemon; 2 "nodes" x 2 ranks (checks with and without segment ids and
# windows, soak with segment ids, timing at S_local 4096), then one node of 4 (timing): stage `nodes` of
# tools/gpu_session.py; then the timing at S_local 4096, 16384 and 32768, 2 x 2 and one node of 4: stage
# `nodes-timing` (nodes_timing_W4_1xH100_2026-12-06.csv)
python tools/gpu_session.py --nproc 4 --out DIR --budget 500 nodes
python tools/gpu_session.py --nproc 4 --out DIR --budget 560 nodes-timing
# which run
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections checks,soak --out DIR
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --out DIR
RING_ATTENTION_NODE_SIZE=4 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --out DIR
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --seq-local 4096,16384,32768 --iters 5 --out DIR
RING_ATTENTION_NODE_SIZE=4 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --seq-local 4096,16384,32768 --iters 5 --out DIR
# the figure and table: python -m benchmarks.plot --nodes benchmarks/results/nodes_timing_W4_1xH100_2026-12-06.csv
