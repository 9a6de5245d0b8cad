"""backend='fused' for PyTorch: the shared kernel (ring_core.kernel) launched with torch tensors.

Errors found by the kernel (a bounded wait that expired) come back in a small status tensor. Checking it
at once would cost a host sync per call, so it is copied to pinned memory asynchronously and checked at
the next call, at ``check_errors()`` (which waits), or at once when RING_ATTENTION_SYNC_ERRORS=1.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ring_core import heap as _heap
from ring_core import launch

SYNC_ENV = "RING_ATTENTION_SYNC_ERRORS"
_pending = []  # (event, pinned status, rank, timeout_s)


def _check_group(group):
    if group is not None and group is not dist.group.WORLD:
        raise ValueError("the fused backend runs over the default (world) process group; pass group=None")


def initialize(heap_size: int | None = None, group=None):
    """Create this process's iris symmetric heap (idempotent). Initialises torch.distributed (NCCL) from
    the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) if needed.

    The fused backend runs over all processes of the job: ``group`` must be None or the default group.
    """
    _check_group(group)
    _heap.init_torch_distributed_from_env()
    return _heap.initialize(heap_size)


def shutdown() -> bool:
    """Wait for outstanding calls, report their errors, and release the heap."""
    try:
        check_errors()  # a timeout still raises, after the heap is released
    finally:
        released = _heap.shutdown()
    return released


def reset():
    """Collective: after a reported timeout, call on every rank to bring the ranks' call counters back in
    step (waits for outstanding calls; their errors are dropped, they were raised or are being handled)."""
    global _pending
    for ev, *_ in _pending:
        ev.synchronize()
    _pending = []
    _heap.get().reset()


def fused_available() -> bool:
    return _heap.is_initialized()


def _drain(wait: bool):
    global _pending
    keep = []
    first_error = None
    for ev, st, rank, timeout_s in _pending:
        if wait:
            ev.synchronize()
        elif not ev.query():
            keep.append((ev, st, rank, timeout_s))
            continue
        try:
            launch.check_status(st.numpy(), rank, timeout_s)
        except launch.RingAttentionTimeout as e:
            first_error = first_error or e
    _pending = keep
    if first_error is not None:
        raise first_error


def check_errors():
    """Wait for every fused call issued so far and raise the first timeout any of them reported."""
    _drain(wait=True)


def forward(q, k, v, spec, group=None, timeout_s: float | None = None):
    """Launch the fused kernel on this rank's shards; returns (out, lse). Inputs already validated."""
    h = _heap.get()
    _check_group(group)
    if q.device != h.device:
        raise ValueError(f"inputs are on {q.device} but this rank's heap is on {h.device}; move them there")
    _drain(wait=False)
    p = h.plan(spec)  # raises HeapTooSmallError before anything is launched
    from ring_core.kernel import ring_attn_fwd_kernel

    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty((spec.batch, spec.num_heads, spec.seq_local), dtype=torch.float32, device=q.device)
    status = torch.zeros((launch.STATUS_WORDS,), dtype=torch.int32, device=q.device)  # see check_status
    ring_attn_fwd_kernel[p.grid](q, k, v, h.ctx, *p.scalars(timeout_s), out, lse, status,
                                 num_warps=p.config.num_warps, num_stages=p.config.num_stages,
                                 **p.constexprs(interpret=False))
    st = torch.empty_like(status, device="cpu").pin_memory()
    st.copy_(status, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    _pending.append((ev, st, h.rank, timeout_s))
    if os.environ.get(SYNC_ENV) == "1":
        check_errors()
    return out, lse
