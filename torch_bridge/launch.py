"""``python -m torch_bridge.launch --nproc-per-node N script.py [args]``: start one process per rank
(ring_core.runtime.spawn, which both frontends share: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; ranks may share GPUs, under a private CUDA MPS daemon)."""

import sys

from ring_core.runtime.spawn import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m torch_bridge.launch"))
