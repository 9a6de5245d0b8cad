"""backend='fused' for PyTorch: the shared kernels (ring_core.kernel, .kernel_bwd) launched with torch tensors.

Errors found by the kernel (a bounded wait that expired) come back in a small status tensor. Checking it
at once would cost a host sync per call, so it is copied to pinned memory asynchronously and checked at
the next call, at ``check_errors()`` (which waits), or at once when RING_ATTENTION_SYNC_ERRORS=1.

Layers: ``forward`` / ``backward`` are the raw launchers; the torch.library custom ops
``ring_attention::fwd`` / ``ring_attention::bwd`` call them and carry the autograd formula (what
torch.compile sees); ``ring_attention_fused`` is what ``torch_bridge.ring_attention`` calls.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ring_core import heap as _heap
from ring_core import control
from ring_core.validate import AttentionSpec, dtype_name
from torch_bridge.groups import group_from_name, group_to_name

SYNC_ENV = "RING_ATTENTION_SYNC_ERRORS"
_pending = []  # (event, pinned status, ring position, timeout_s, ring members)
_free_pinned = []  # pinned status buffers to reuse: pinning one costs about as much as a whole small call


def ring_of(h, group):
    """(members, this rank's position, heap slot) of the ring over ``group`` (None: every process), members
    in group-rank order. The first fused call over a group agrees on its slot with the group's members (a
    collective over the group, once: ring_core.heap.RingSlots)."""
    if group is None or group is dist.group.WORLD:
        members = tuple(range(h.world_size))
    else:
        members = tuple(dist.get_process_group_ranks(group))
    slot = h.rings.get("torch", members)
    if slot is None:
        used = [h.rings.used_by("torch", h.rank)]
        if len(members) > 1:
            used = [None] * len(members)
            dist.all_gather_object(used, h.rings.used_by("torch", h.rank), group=group)
        slot = h.rings.assign("torch", members, taken=set().union(*used))
    return members, members.index(h.rank), slot


def initialize(heap_size: int | None = None, group=None):
    """Create this process's iris symmetric heap and return it. Collective: every rank of the job calls it.

    Initialises torch.distributed from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if the program has not: NCCL where every rank has its own
    GPU, gloo where ranks share one (rank r uses GPU ``LOCAL_RANK % visible GPUs``, see ``ring_core.gpus``);
    a process group created here is destroyed at interpreter exit (never earlier), one the program
    created is left alone. The heap spans every process of the job and serves rings over any process
    groups (``ring_attention(..., group=...)``); ``group`` is accepted for compatibility and unused.

    Calling it again returns the same heap (a different ``heap_size`` raises RuntimeError: ``shutdown()``
    first); after ``shutdown()`` it creates a new heap on the same process group. Until it has run,
    ``backend="fused"`` raises and ``backend="auto"`` uses the torch reference ring.
    """
    heap_size = _heap.check_heap_size(heap_size) if heap_size is not None else None
    _heap.init_torch_distributed_from_env()
    return _heap.initialize(heap_size)


def shutdown() -> bool:
    """Wait for outstanding fused calls, release the heap, then raise the first timeout they reported (if
    any). Returns False when there was no heap, so a second call is harmless. Local: no communication. The
    process group stays (``initialize()`` may follow); fused calls raise until it does."""
    try:
        check_errors()  # a timeout still raises, after the heap is released
    finally:
        released = _heap.shutdown()
    return released


def reset():
    """Collective: after a reported timeout, call on every rank to bring the ranks' call counters back in
    step (waits for outstanding calls; their errors are dropped, they were raised or are being handled).
    Raises ``NotInitializedError`` (a RuntimeError) when there is no heap."""
    global _pending
    for ev, st, *_ in _pending:
        ev.synchronize()
        _free_pinned.append(st)
    _pending = []
    _heap.get().reset()


def fused_available() -> bool:
    return _heap.is_initialized()


def _drain(wait: bool):
    global _pending
    keep = []
    first_error = None
    for ev, st, rank, timeout_s, members in _pending:
        if wait:
            ev.synchronize()
        elif not ev.query():
            keep.append((ev, st, rank, timeout_s, members))
            continue
        try:
            control.check_status(st.numpy(), rank, timeout_s, members=members)
        except RuntimeError as e:  # RingAttentionTimeout, or a call that never completed
            first_error = first_error or e
        finally:
            _free_pinned.append(st)
    _pending = keep
    if first_error is not None:
        raise first_error


def check_errors():
    """Wait for every fused call issued so far and raise the first timeout any of them reported."""
    _drain(wait=True)


def _prepare(q, spec, group, config, *, backward: bool):
    """(launch plan, context tensor, ring) for a fused launch on this rank over ``group``, after the checks
    that need the heap; reports errors of finished earlier calls. Raises HeapTooSmallError before anything
    is launched."""
    h = _heap.get()
    if q.device != h.device:
        raise ValueError(f"inputs are on {q.device} but this rank's heap is on {h.device}; move them there")
    _drain(wait=False)
    ring = members, _, slot = ring_of(h, group)
    plan = h.plan_bwd if backward else h.plan
    return plan(spec, len(members), config=config), h.ctx(members, slot), ring


def _segment_ids(spec, segment_ids, device):
    """What the kernels get as ``seg_ptr``: this rank's segment ids (int32 [batch, seq_local], layout order) when
    ``spec.segmented``, else a one-element dummy that the kernels never read (SEGMENTED=False)."""
    if spec.segmented != (segment_ids is not None):
        given = "were given" if segment_ids is not None else "were not given"
        raise ValueError(f"spec.segmented is {spec.segmented} but segment_ids {given}: pass this rank's segment ids "
                         "exactly when the spec says so")
    if segment_ids is None:
        return torch.zeros((1,), dtype=torch.int32, device=device)
    return segment_ids.to(device=device, dtype=torch.int32).contiguous()


def forward(q, k, v, spec, group=None, timeout_s: float | None = None, config=None, segment_ids=None):
    """Launch the fused kernel on this rank's shards; returns (out, lse). Inputs already validated.
    ``config`` (a ring_core.control.KernelConfig) overrides the tuned defaults: for tuning only.
    ``segment_ids``: this rank's ids (int32 [batch, seq_local], layout order) when ``spec.segmented``, else
    None; the window is ``spec.window``."""
    p, ctx, ring = _prepare(q, spec, group, config, backward=False)
    from ring_core.kernel import ring_attn_fwd_kernel

    seg = _segment_ids(spec, segment_ids, q.device)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty((spec.batch, spec.num_heads, spec.seq_local), dtype=torch.float32, device=q.device)
    status = torch.zeros((control.STATUS_WORDS,), dtype=torch.int32, device=q.device)  # see check_status
    ring_attn_fwd_kernel[p.grid](q, k, v, seg, ctx, *p.scalars(timeout_s), out, lse, status,
                                 num_warps=p.config.num_warps, num_stages=p.config.num_stages,
                                 **p.constexprs())
    _track(status, ring, timeout_s)
    return out, lse


def _track(status, ring, timeout_s):
    """Check ``status`` of a call on ``ring`` at the next call / check_errors() (at once with
    RING_ATTENTION_SYNC_ERRORS=1), without a host sync now."""
    st = _free_pinned.pop() if _free_pinned else torch.empty(status.shape, dtype=status.dtype).pin_memory()
    st.copy_(status, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    members, position, _ = ring
    _pending.append((ev, st, position, timeout_s, members))
    if os.environ.get(SYNC_ENV) == "1":
        check_errors()


def check_backward_fits(spec, group=None):
    """Raise HeapTooSmallError now if the backward of a call with ``spec`` over ``group`` would not fit the heap."""
    h = _heap.get()
    h.plan_bwd(spec, len(ring_of(h, group)[0]))


def backward(q, k, v, out, lse, dout, spec, group=None, timeout_s: float | None = None, config=None, dlse=None,
             segment_ids=None):
    """Launch the fused backward kernel (ring_core.kernel_bwd) on this rank's shards, from the forward's
    ``out`` and ``lse`` and the gradients ``dout`` and ``dlse`` (None: lse carries none); returns
    (dq, dk, dv). Same launch maths (ring_core.control.plan_bwd) and argument
    list as the JAX launcher (jax_ring.fused.backward). ``config`` (a ring_core.control.BwdKernelConfig)
    overrides the defaults: for tuning only. ``segment_ids`` as in ``forward``."""
    p, ctx, ring = _prepare(q, spec, group, config, backward=True)
    from ring_core.kernel_bwd import ring_attn_bwd_kernel

    seg = _segment_ids(spec, segment_ids, q.device)
    q, k, v, out = (x.contiguous() for x in (q, k, v, out))
    dout = dout.to(q.dtype).contiguous()
    lse = lse.to(torch.float32).contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.to(torch.float32).contiguous()
    (dq_shape, _), (dkv_shape, _), _, (delta_shape, _), (status_shape, _) = p.out_shapes
    dq = torch.empty(dq_shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(dkv_shape, dtype=q.dtype, device=q.device)
    dv = torch.empty(dkv_shape, dtype=q.dtype, device=q.device)
    delta = torch.empty(delta_shape, dtype=torch.float32, device=q.device)  # scratch: rowsum(dO * O)
    status = torch.zeros(status_shape, dtype=torch.int32, device=q.device)  # see check_status
    ring_attn_bwd_kernel[p.grid](q, k, v, out, dout, lse, dlse, seg, ctx, *p.scalars(timeout_s), dq, dk, dv, delta,
                                 status, num_warps=p.config.num_warps, num_stages=p.config.num_stages,
                                 **p.constexprs())
    _track(status, ring, timeout_s)
    return dq, dk, dv


# ---------------------------------------------------------------- the autograd layer: two custom ops
# ring_attention::fwd and ring_attention::bwd wrap the launchers above as torch.library custom ops, so
# that torch.compile (fullgraph too) sees two opaque ops with exact fake outputs and traces nothing of the
# launch, and eager autograd runs the same ops. Their arguments are schema types: the spec's shape fields
# and dtype come from the tensors, scale / is_causal / layout travel as they are, the process group by
# name (torch_bridge.groups) and timeout_s as float? (None: RING_ATTENTION_TIMEOUT_S when launched).
# cudagraph_unsafe: every call does host work (the status copy and event of _track, the check of earlier
# calls in _drain), which a CUDA graph replay would skip; inductor keeps such ops out of its CUDA graphs.
_OP_TAGS = (torch.Tag.cudagraph_unsafe,)


def _spec_of(q, k, scale: float, is_causal: bool, layout: str) -> AttentionSpec:
    """The AttentionSpec that ring_core.validate.check_attention_args gave for these arguments."""
    b, s, h, d = q.shape
    return AttentionSpec(b, s, h, k.shape[2], d, dtype_name(q.dtype), scale, is_causal, layout)


@torch.library.custom_op("ring_attention::fwd", mutates_args=(), tags=_OP_TAGS)
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool, layout: str,
            group_name: str, timeout_s: Optional[float], check_backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _spec_of(q, k, scale, is_causal, layout)
    if check_backward:
        check_backward_fits(spec, group_from_name(group_name))  # HeapTooSmallError before the forward runs
    return forward(q, k, v, spec, group_from_name(group_name), timeout_s)


@_fwd_op.register_fake
def _(q, k, v, scale, is_causal, layout, group_name, timeout_s, check_backward):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("ring_attention::bwd", mutates_args=(), tags=_OP_TAGS)
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            dout: torch.Tensor, dlse: Optional[torch.Tensor], scale: float, is_causal: bool, layout: str,
            group_name: str, timeout_s: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = _spec_of(q, k, scale, is_causal, layout)
    return backward(q, k, v, out, lse, dout, spec, group_from_name(group_name), timeout_s, dlse=dlse)


@_bwd_op.register_fake
def _(q, k, v, out, lse, dout, dlse, scale, is_causal, layout, group_name, timeout_s):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(k.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, is_causal, layout, group_name, timeout_s, _ = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (scale, is_causal, layout, group_name, timeout_s)


def _backward(ctx, dout, dlse):
    # Autograd passes zeros for the gradient of an output that was not used (out or lse), eager and compiled.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(q, k, v, out, lse, dout, dlse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention_fused(q, k, v, *, spec: AttentionSpec, group=None, timeout_s: float | None = None):
    """(out, lse) from the fused kernel, differentiable through the fused backward kernel (from the
    gradients of out and lse); inputs already validated (``spec``). Traceable by torch.compile without a
    graph break: all it computes before the op is the group's name and whether a backward will follow, in
    which case the fwd op checks the backward's heap need before it launches (HeapTooSmallError before the
    forward runs, as in eager)."""
    check_backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _fwd_op(q, k, v, spec.scale, spec.is_causal, spec.layout, group_to_name(group), timeout_s,
                   check_backward)
