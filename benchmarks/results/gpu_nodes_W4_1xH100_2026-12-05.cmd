# one H100, 4 ranks under the launcher's MPS daemon; 2 "nodes" x 2 ranks (checks, soak, timing), then one node of 4 (timing)
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections checks,soak --soak-calls 2000 --out DIR
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --out DIR
RING_ATTENTION_NODE_SIZE=4 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections timing --out DIR
