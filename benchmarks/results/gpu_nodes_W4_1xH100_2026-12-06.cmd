# one H100, 4 ranks under the launcher's MPS daemon; 2 "nodes" x 2 ranks (checks with and without segment ids and
# windows, soak with segment ids, timing), then one node of 4 (timing): stage `nodes` of tools/gpu_session.py
python tools/gpu_session.py --nproc 4 --out DIR --budget 500 nodes
# which runs
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections checks,soak --out DIR
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --out DIR
RING_ATTENTION_NODE_SIZE=4 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --out DIR
