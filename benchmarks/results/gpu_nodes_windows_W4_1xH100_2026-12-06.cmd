# one H100, 4 ranks under the launcher's MPS daemon; 2 "nodes" x 2 ranks: the checks of windows across nodes
# (tests/gpu/gpu_nodes.py cases 5-7), stage `nodes-windows` of tools/gpu_session.py
python tools/gpu_session.py --nproc 4 --out DIR --budget 420 nodes-windows
# which runs
RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --sections checks --cases 5,6,7 --out DIR
