# one H100, 4 ranks under the launcher's MPS daemon; 2 "nodes" x 2 ranks: the two-level ring's fault checks (a call
# it cannot take, a late node, an absent rank), stage `nodes-faults` of tools/gpu_session.py
python tools/gpu_session.py --nproc 4 --out DIR --budget 240 nodes-faults
# which runs
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections faults --out DIR
