"""The one symmetric-heap set-up both frontends use (GPU path).

One iris heap per process (one process per GPU, torch.distributed already initialised: iris exchanges
the heap handles through it). The ring-attention workspace is the first allocation on every rank, so it
sits at the same offset from every heap base; ``HeapLayout`` splits it into control words, flags and
receive slots. The heap lives until ``shutdown()``.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ring_core import launch

DEFAULT_HEAP_BYTES = 4 << 30
HEAP_ENV = "RING_ATTENTION_HEAP_BYTES"

_lock = threading.Lock()
_heap = None


class NotInitializedError(RuntimeError):
    """The fused backend was used before initialize()."""


class SymmetricHeap:
    def __init__(self, heap_size: int | None = None):
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the iris heap needs torch.distributed: call dist.init_process_group() first "
                               "(jax_ring.initialize() and torch_bridge.initialize() do this from the launcher's "
                               "environment)")
        if not torch.cuda.is_available():
            raise RuntimeError("the fused backend needs a GPU; use backend='xla' (JAX) or 'torch' (PyTorch) on CPU")
        if heap_size is None:
            heap_size = int(os.environ.get(HEAP_ENV, DEFAULT_HEAP_BYTES))
        if not isinstance(heap_size, int) or heap_size < 2 * launch.HEAP_SLACK:
            raise ValueError(f"heap_size must be an int of at least {2 * launch.HEAP_SLACK} bytes, "
                             f"got {heap_size!r}")
        import iris

        # On NVIDIA only the vmem_chunked allocator works (torch and vmem are HIP-only); chosen here so
        # users set no environment variable.
        allocator = "torch" if torch.version.hip else "vmem_chunked"
        self.iris = iris.iris(heap_size, allocator_type=allocator)
        self.heap_size = heap_size
        self.rank = self.iris.get_rank()
        self.world_size = self.iris.get_num_ranks()
        if self.world_size > launch.MAX_WORLD:
            raise ValueError(f"at most {launch.MAX_WORLD} ranks are supported, got {self.world_size}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        ws = heap_size - launch.HEAP_SLACK
        self.workspace = self.iris.zeros(ws, dtype=torch.uint8)
        # Heap bases as mapped in *this* process: a peer's heap sits at a different virtual address in
        # every process, so each process's view is gathered (ctx_table needs all of them).
        self.bases = [int(b) for b in self.iris.get_heap_bases().cpu().tolist()]
        base_off = self.workspace.data_ptr() - self.bases[self.rank]
        views = [None] * self.world_size
        dist.all_gather_object(views, (base_off, self.bases))
        if len({v[0] for v in views}) != 1:
            raise RuntimeError(f"symmetric heap workspace offsets differ across ranks: {[v[0] for v in views]}")
        self.all_bases = [v[1] for v in views]
        self.base_off = base_off
        self.layout = launch.HeapLayout.for_workspace(ws, base_off)
        self.ctx = torch.from_numpy(launch.make_ctx(self.bases, self.rank, self.layout)).to(self.device)
        torch.cuda.synchronize()
        dist.barrier()

    def ctx_table(self) -> np.ndarray:
        """Every rank's context array (row r: rank r's own view of the heap bases), [world_size, n] int64.

        Identical in every process, so a frontend can bake it into a program that must be the same on
        all processes (JAX multi-controller) and pick the row on device."""
        return np.stack([launch.make_ctx(self.all_bases[r], r, self.layout) for r in range(self.world_size)])

    def reset(self):
        """Collective (every rank must call it, with no fused call in flight): zero the control words and
        flags, so that call counters agree again after a timeout left them out of step."""
        import torch
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.barrier()
        start, end = self.layout.protocol_region
        self.workspace[start - self.base_off:end - self.base_off].zero_()
        torch.cuda.synchronize()
        dist.barrier()

    def plan(self, spec, **kw) -> launch.LaunchPlan:
        return launch.plan(spec, self.world_size, self.layout, **kw)

    def close(self):
        import torch

        torch.cuda.synchronize()
        self.workspace = None
        self.ctx = None
        ctx, self.iris = self.iris, None
        if ctx is not None:
            ctx.__del__()


def initialize(heap_size: int | None = None) -> SymmetricHeap:
    """Create the process's heap once; a second call returns it (a different heap_size then raises)."""
    global _heap
    with _lock:
        if _heap is not None:
            if heap_size is not None and heap_size != _heap.heap_size:
                raise RuntimeError(f"the heap already exists with {_heap.heap_size} bytes; call shutdown() "
                                   f"before initialize(heap_size={heap_size})")
            return _heap
        _heap = SymmetricHeap(heap_size)
        return _heap


def get() -> SymmetricHeap:
    if _heap is None:
        raise NotInitializedError("the fused backend needs the symmetric heap: call jax_ring.initialize() or "
                                  "torch_bridge.initialize() once per process first (one process per GPU)")
    return _heap


def is_initialized() -> bool:
    return _heap is not None


def shutdown() -> bool:
    """Release the heap; returns False when there was none."""
    global _heap
    with _lock:
        if _heap is None:
            return False
        h, _heap = _heap, None
        h.close()
        return True


def init_torch_distributed_from_env():
    """Initialise torch.distributed (NCCL) from the launcher's environment if nobody did yet.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as set by ``python -m jax_ring.launch``
    or torchrun, and binds this process to GPU LOCAL_RANK. Returns (rank, world_size, local_rank)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        return dist.get_rank(), dist.get_world_size(), local
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"cannot join the job: {', '.join(missing)} not set. Start one process per GPU with "
            "`python -m jax_ring.launch --nproc-per-node N script.py` or torchrun, or call "
            "torch.distributed.init_process_group() yourself first")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
    return rank, world, local
