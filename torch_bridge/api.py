"""Public PyTorch API: ``ring_attention``, ``RingAttention``, ``to_layout`` / ``from_layout``; and the autograd
layer of the fused backend (the custom ops ``ring_attention::fwd`` / ``::bwd`` over the raw ops of
torch_bridge.fused, which torch.compile traces; eager calls take the same launches without the ops'
dispatch). The twin of jax_ring.api.

One process per rank under torch.distributed; each rank passes its own shard of the sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ring_core import plans
from ring_core.layout import inverse_permutation, layout_permutation
from ring_core.validate import (AttentionSpec, check_attention_args, check_attention_args_remembered,
                                check_deterministic, check_layout, check_layout_call, check_timeout, check_window,
                                dtype_name)
from torch_bridge import fused, lifecycle, nodes
from torch_bridge.groups import group_from_name, group_to_name, resolve_group
from torch_bridge.reference import ring_attention_torch

BACKENDS = ("auto", "fused", "torch")


def _fused_available() -> bool:
    """Whether the fused Triton + iris kernel can run here (``torch_bridge.initialize()`` done)."""
    return lifecycle.fused_available()


def _check_tensors(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}; convert it with torch.as_tensor")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}; "
            "move them with .to(device)")


def _group_info(group):
    """(rank in group, group size, (next, prev) global ranks or None); no communication."""
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        if group is not None:
            raise RuntimeError(
                "group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first (or pass group=None for a single process)")
        return 0, 1, None
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of `group`; call ring_attention only on the group's ranks")
    world = dist.get_world_size(group)
    if world == 1:
        return rank, 1, None
    peers = (dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world))
    return rank, world, peers


def _on_gpu(x) -> bool:
    """Whether ``x`` is where the fused kernel runs (a CUDA device). One function, so that the CPU tests can
    route CPU tensors to the fused launchers (the Triton interpreter) in eager and under torch.compile."""
    return x.is_cuda


def _resolve_backend(backend: str, q, spec) -> str:
    fusable = _on_gpu(q) and plans.fused_supports(spec)
    if backend == "auto":
        return "fused" if fusable and _fused_available() else "torch"
    if backend == "fused":
        if not _fused_available():
            raise RuntimeError(
                "backend='fused' needs the symmetric heap: call torch_bridge.initialize() once per process "
                "(one process per rank, started by torchrun or python -m torch_bridge.launch); or use backend='torch'")
        if not _on_gpu(q):
            raise ValueError(f"backend='fused' needs CUDA tensors, got {q.device}; move q, k, v to this rank's GPU")
        plans.check_fused(spec, "backend='torch'")
    return backend


# ---------------------------------------------------------- the fused backend's autograd: two custom ops
# ring_attention::fwd and ring_attention::bwd wrap the launchers above as torch.library custom ops, so
# that torch.compile (fullgraph too) sees two opaque ops with exact fake outputs and traces nothing of the
# launch, and eager autograd runs the same ops. Their arguments are schema types: the spec's shape fields
# and dtype come from the tensors, scale / is_causal / layout travel as they are, the window as int[] (two
# ints, (-1, -1): none), the segment ids as Tensor? (None: no ids; whether they are given is the spec's
# ``segmented``), the process group by name (torch_bridge.groups), timeout_s as float? (None:
# RING_ATTENTION_TIMEOUT_S when launched) and the call's effective ``deterministic`` as bool (the fwd op uses
# it only for the backward's heap check, and hands it to the bwd op, whose kernel it picks). The ids are an
# input of the fwd op's autograd without a gradient (integers): the backward returns None for them, and the
# bwd op gets them again from the saved tensors.
# cudagraph_unsafe: every call does host work (the status event of lifecycle.track, the check of earlier
# calls in _drain), which a CUDA graph replay would skip; inductor keeps such ops out of its CUDA graphs.
_OP_TAGS = (torch.Tag.cudagraph_unsafe,)


def _spec_of(q, k, segment_ids, scale: float, is_causal: bool, layout: str, window) -> AttentionSpec:
    """The AttentionSpec that ring_core.validate.check_attention_args gave for these arguments."""
    b, s, h, d = q.shape
    return AttentionSpec(b, s, h, k.shape[2], d, dtype_name(q.dtype), scale, is_causal, layout,
                         (int(window[0]), int(window[1])), segment_ids is not None)


def _fwd_impl(q, k, v, segment_ids, spec: AttentionSpec, group, timeout_s, deterministic: bool,
              check_backward: bool):
    """The forward launch behind both routes (the custom op, the eager Function): the one-node kernel, or the
    two-level ring (torch_bridge.nodes) where ``group`` spans several nodes."""
    if nodes.spans_nodes(group):
        return nodes.forward(q, k, v, spec, timeout_s, deterministic, check_backward, segment_ids=segment_ids)
    if check_backward:  # HeapTooSmallError before the forward runs
        fused.check_backward_fits(spec, group, deterministic=deterministic)
    return fused.forward(q, k, v, spec, group, timeout_s, segment_ids=segment_ids)


def _bwd_impl(q, k, v, out, lse, dout, dlse, segment_ids, spec: AttentionSpec, group, timeout_s,
              deterministic: bool):
    """The backward launch behind both routes."""
    if nodes.spans_nodes(group):
        return nodes.backward(q, k, v, out, lse, dout, dlse, spec, timeout_s, deterministic, segment_ids=segment_ids)
    return fused.backward(q, k, v, out, lse, dout, spec, group, timeout_s, dlse=dlse, segment_ids=segment_ids,
                          deterministic=deterministic)


@torch.library.custom_op("ring_attention::fwd", mutates_args=(), tags=_OP_TAGS)
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: Optional[torch.Tensor], scale: float,
            is_causal: bool, layout: str, window: list[int], group_name: str, timeout_s: Optional[float],
            deterministic: bool, check_backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, segment_ids, _spec_of(q, k, segment_ids, scale, is_causal, layout, window),
                     group_from_name(group_name), timeout_s, deterministic, check_backward)


@_fwd_op.register_fake
def _(q, k, v, segment_ids, scale, is_causal, layout, window, group_name, timeout_s, deterministic, check_backward):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("ring_attention::bwd", mutates_args=(), tags=_OP_TAGS)
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            dout: torch.Tensor, dlse: Optional[torch.Tensor], segment_ids: Optional[torch.Tensor], scale: float,
            is_causal: bool, layout: str, window: list[int], group_name: str, timeout_s: Optional[float],
            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(q, k, v, out, lse, dout, dlse, segment_ids,
                     _spec_of(q, k, segment_ids, scale, is_causal, layout, window), group_from_name(group_name),
                     timeout_s, deterministic)


@_bwd_op.register_fake
def _(q, k, v, out, lse, dout, dlse, segment_ids, scale, is_causal, layout, window, group_name, timeout_s,
      deterministic):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(k.shape)


def _setup_context(ctx, inputs, output):
    # The call's arguments that the bwd op takes too (scale .. deterministic), for it; not check_backward.
    q, k, v, segment_ids, *args, _ = inputs
    ctx.save_for_backward(q, k, v, segment_ids, *output)
    ctx.args = tuple(args)


def _backward(ctx, dout, dlse):
    # Autograd passes zeros for the gradient of an output that was not used (out or lse), eager and compiled.
    q, k, v, segment_ids, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(q, k, v, out, lse, dout, dlse, segment_ids, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None  # none for the segment ids (integers)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerFused(torch.autograd.Function):
    """The custom ops' autograd without their dispatch, for eager calls: the same launches (_fwd_impl,
    _bwd_impl), the same saved tensors and gradients. torch.library's custom-op dispatch costs about six times an
    autograd.Function's host time per call (75 against 12 us on a CPU, 2026-12-02: docs/performance.md; on the GPU
    machine cProfile put most of a call's 0.4-0.6 ms host issue in it), which short calls cannot hide; torch.compile
    still sees the ops."""

    @staticmethod
    def forward(ctx, q, k, v, segment_ids, spec, group, timeout_s, deterministic, check_backward):
        out, lse = _fwd_impl(q, k, v, segment_ids, spec, group, timeout_s, deterministic, check_backward)
        ctx.save_for_backward(q, k, v, segment_ids, out, lse)
        ctx.args = (spec, group, timeout_s, deterministic)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # Zeros for the gradient of an output that was not used (out or lse), as the custom op gets them.
        q, k, v, segment_ids, out, lse = ctx.saved_tensors
        dq, dk, dv = _bwd_impl(q, k, v, out, lse, dout, dlse, segment_ids, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def _eager(*tensors) -> bool:
    """Whether a call takes the eager route: not traced by torch.compile / export, plain tensors (a fake or
    other subclass tensor goes through the op and its fake implementation)."""
    return not torch.compiler.is_compiling() and all(
        x is None or type(x) in (torch.Tensor, nn.Parameter) for x in tensors)


def _ring_attention_fused(q, k, v, segment_ids=None, *, spec: AttentionSpec, group=None,
                          timeout_s: float | None = None, deterministic: bool = False):
    """(out, lse) from the fused kernel, differentiable through the fused backward kernel (from the
    gradients of out and lse); inputs already validated (``spec``). Traceable by torch.compile without a
    graph break: all it computes before the op is the group's name and whether a backward will follow, in
    which case the fwd op checks the backward's heap need before it launches (HeapTooSmallError before the
    forward runs, as in eager). Eager calls take the same launches through ``_EagerFused``."""
    padded = fused.kernel_spec(spec)
    if padded is not spec:  # the Gluon kernels at a padded head_dim (ring_core.plans.kernel_spec)
        pad = (0, padded.head_dim - spec.head_dim)
        out, lse = _ring_attention_fused(*(nn.functional.pad(x, pad) for x in (q, k, v)), segment_ids, spec=padded,
                                         group=group, timeout_s=timeout_s, deterministic=deterministic)
        return out[..., :spec.head_dim].contiguous(), lse
    check_backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if _eager(q, k, v, segment_ids):
        if not check_backward:  # no gradient to come: the launch alone (autograd's Function costs host time)
            return _fwd_impl(q, k, v, segment_ids, spec, group, timeout_s, deterministic, False)
        return _EagerFused.apply(q, k, v, segment_ids, spec, group, timeout_s, deterministic, check_backward)
    return _fwd_op(q, k, v, segment_ids, spec.scale, spec.is_causal, spec.layout, list(spec.window),
                   group_to_name(group), timeout_s, deterministic, check_backward)


def ring_attention(q, k, v, *, group=None, is_causal=False, scale=None, layout="contiguous", return_lse=False,
                   backend="auto", timeout_s=None, segment_ids=None, window_size=None, deterministic=False):
    """Softmax attention over a sequence sharded across the ranks of ``group``.

    Every rank of ``group`` calls this with its own shard: q ``[batch, seq_local, num_heads, head_dim]``,
    k and v ``[batch, seq_local, num_kv_heads, head_dim]`` (``num_heads`` a multiple of ``num_kv_heads``:
    GQA / MQA without repeating K/V). ``layout`` says which global tokens a rank holds: ``"contiguous"``
    (rank r holds tokens ``[r*S, (r+1)*S)``) or ``"zigzag"`` (chunks r and 2W-1-r of 2W; ``seq_local`` even);
    put a global tensor in that order with ``to_layout``. ``is_causal`` masks in *global* token order.
    ``scale`` multiplies the scores (default ``1/sqrt(head_dim)``).

    Returns ``out`` with q's shape and dtype; with ``return_lse=True``, ``(out, lse)`` where ``lse``
    ``[batch, num_heads, seq_local]`` is the natural log of the softmax denominator over the whole global
    sequence (float32; float64 for float64 inputs). Differentiable: ``loss.backward()`` on every rank gives
    the gradients of full attention (every rank must run backward on the same graph).

    ``backend``: ``"torch"`` (reference ring over torch.distributed point-to-point, gloo or NCCL),
    ``"fused"`` (the Triton + iris kernel; needs ``torch_bridge.initialize()`` and CUDA tensors; its
    gradients, through out and lse, come from the fused backward kernel) or ``"auto"`` (fused for
    CUDA fp16/bf16/fp32 tensors once initialised, else torch).
    Without an initialised process group (or with a group of one) it runs locally with no communication.

    Several nodes (``initialize()`` found them, or was given ``node_size``): with ``group=None`` the fused backend
    runs the two-level ring (torch_bridge.nodes: the kernel within each node, K/V between nodes over
    torch.distributed), same arguments and results, segment ids and windows too (a zigzag window that reaches
    partly across a node's two halves, i.e. wider than a node-level chunk of node_size x seq_local / 2 tokens, is
    not taken: ``backend="auto"`` runs the reference ring, ``backend="fused"`` raises; layout="contiguous" takes
    every window).

    ``timeout_s`` bounds every wait inside the fused kernel (default RING_ATTENTION_TIMEOUT_S, else 300 s);
    an expired wait raises ``ring_core.protocol.control.RingAttentionTimeout`` naming the missing rank and ring step,
    at the next call or ``check_errors()`` (at once with RING_ATTENTION_ERRORS=call). Ranks whose fused
    calls differ (shapes, dtype, flags, layout, scale) raise ``ring_core.protocol.control.RingAttentionMismatch`` the
    same way, naming both calls; the kernel finds it before any data moves. The torch ring is bounded by
    its process group's own timeout instead.

    ``segment_ids``: packed sequences: int32 ``[batch, seq_local]``, this rank's tokens' segment ids in the
    layout's order (one tensor serves this rank's queries and keys, so they cannot disagree). Query i attends
    key j only where their ids are equal; a negative id marks padding: that row attends nothing (out 0, lse
    -inf, no gradient in or out). Give it on every rank of the group or on none; ``to_layout`` reorders a
    global one and ``segment_ids_from_cu_seqlens`` makes one from flash-attn's ``cu_seqlens``. ``window_size``:
    sliding window ``(left, right)``, flash-attn's meaning in global token order (query i attends keys j with
    ``i - left <= j <= i + right``; -1 unbounded; None: no window). Every backend takes both masks; the fused
    kernels skip the work they hide (K/V rows outside the window are not sent, waited for, loaded or computed;
    those of other segments not loaded or computed: ring_core/protocol/steps.py).

    ``deterministic``: as in flash-attn. False (the default): the fastest fused backward, which may accumulate
    dQ in a nondeterministic order where a kernel does. True: the fused backend's gradients bit-identical from
    run to run and between torch and JAX (the same inputs on the same GPUs).
    ``torch.use_deterministic_algorithms(True)`` turns it on too (read at each call; under torch.compile a
    change recompiles). With False, on Hopper for fp16/bf16, head_dim 64 or 128 (windows and segment ids included:
    ring_core.plans.gluon_bwd_applies), the fused backward is the Gluon kernel whose dQ sums come in no fixed
    order (ring_core/kernels/gluon_bwd.py); with True, at head_dim 128 (padded to it included) without a window or
    segment ids, the same kernel adding dQ in a fixed order; elsewhere the deterministic tl kernel. The ``"torch"``
    backend ignores it: it runs torch's own ops, which torch.use_deterministic_algorithms governs.

    Inputs may be non-contiguous or oddly strided (transposed, sliced, expanded views): every backend
    reads them as they are or makes contiguous copies; the outputs are always contiguous.

    ``torch.compile(fullgraph=True)`` traces it on every backend without a graph break: the fused kernels
    and the torch ring's exchange are custom ops (``ring_attention::fwd``, ``::bwd``, ``::shift``).

    Example (one process; under torch.distributed each rank passes its shard):

    >>> import torch, torch_bridge
    >>> q = torch.randn(2, 8, 4, 64)
    >>> k = v = torch.randn(2, 8, 2, 64)
    >>> out, lse = torch_bridge.ring_attention(q, k, v, is_causal=True, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 8, 4, 64]), torch.Size([2, 4, 8]))
    """
    _check_tensors(q, k, v)
    group = resolve_group(group)
    if segment_ids is not None:
        if not isinstance(segment_ids, torch.Tensor):
            raise TypeError(f"segment_ids must be a torch.Tensor, got {type(segment_ids).__name__}")
        if segment_ids.device != q.device:
            raise ValueError(f"segment_ids must be on q's device ({q.device}), got {segment_ids.device}")
    # (eager calls: the specs of arguments seen before; torch.compile guards on what it reads, and traces once)
    check = check_attention_args if torch.compiler.is_compiling() else check_attention_args_remembered
    spec = check(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, is_causal=is_causal, scale=scale,
                 layout=layout, backend=backend, backends=BACKENDS, return_lse=return_lse, window_size=window_size,
                 segment_ids_shape=None if segment_ids is None else segment_ids.shape,
                 segment_ids_dtype=None if segment_ids is None else segment_ids.dtype)
    timeout_s = check_timeout(timeout_s)
    deterministic = check_deterministic(deterministic, torch.are_deterministic_algorithms_enabled())
    rank, world, peers = _group_info(group)
    asked, backend = backend, _resolve_backend(backend, q, spec)
    if backend == "fused" and asked == "auto" and nodes.spans_nodes(group) and not nodes.fused_takes(spec):
        backend = "torch"  # a zigzag window the two-level fused ring does not take: the reference ring does
    if backend == "torch":  # ignores deterministic: torch's own ops, as deterministic as torch makes them
        out, lse = ring_attention_torch(q, k, v, spec, rank, world, peers, group, segment_ids=segment_ids)
    else:  # several nodes: the same route, the launches go to torch_bridge.nodes (_fwd_impl, _bwd_impl)
        out, lse = _ring_attention_fused(q, k, v, segment_ids, spec=spec, group=group, timeout_s=timeout_s,
                                         deterministic=deterministic)
    return (out, lse) if return_lse else out


class RingAttention(nn.Module):
    """``ring_attention`` as a module; the keywords are fixed at construction.

    >>> import torch, torch_bridge
    >>> attn = torch_bridge.RingAttention(is_causal=True)
    >>> q = k = v = torch.randn(1, 6, 2, 16)
    >>> attn(q, k, v).shape
    torch.Size([1, 6, 2, 16])
    """

    def __init__(self, *, group=None, is_causal=False, scale=None, layout="contiguous", return_lse=False,
                 backend="auto", timeout_s=None, window_size=None, deterministic=False):
        super().__init__()
        # Fail at construction for what does not depend on the inputs.
        check_layout(layout)
        self.window_size = None if window_size is None else check_window(window_size)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.group = group
        self.is_causal = is_causal
        self.scale = scale
        self.layout = layout
        self.return_lse = return_lse
        self.backend = backend
        self.timeout_s = check_timeout(timeout_s)
        # The keyword only: torch.use_deterministic_algorithms is read at each call.
        self.deterministic = check_deterministic(deterministic)

    def forward(self, q, k, v, segment_ids=None):
        return ring_attention(q, k, v, group=self.group, is_causal=self.is_causal, scale=self.scale,
                              layout=self.layout, return_lse=self.return_lse, backend=self.backend,
                              timeout_s=self.timeout_s, segment_ids=segment_ids, window_size=self.window_size,
                              deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return (f"is_causal={self.is_causal}, scale={self.scale}, layout={self.layout!r}, "
                f"return_lse={self.return_lse}, backend={self.backend!r}, window_size={self.window_size}, "
                f"deterministic={self.deterministic}")


def _perm(x, layout, world_size, seq_axis, inverse):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    seq_axis = check_layout_call(layout, world_size, seq_axis, x.dim())
    perm = layout_permutation(x.shape[seq_axis], world_size, layout)
    if inverse:
        perm = inverse_permutation(perm)
    return x.index_select(seq_axis, torch.as_tensor(perm, device=x.device))


def to_layout(x, layout, world_size, seq_axis=1):
    """Reorder a global tensor (natural token order along ``seq_axis``) into ``layout`` order.

    Splitting the result into ``world_size`` equal contiguous pieces along ``seq_axis`` gives each rank
    its shard. ``from_layout`` undoes it.

    >>> import torch, torch_bridge
    >>> x = torch.arange(8).reshape(1, 8)
    >>> torch_bridge.to_layout(x, "zigzag", 2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    return _perm(x, layout, world_size, seq_axis, inverse=False)


def from_layout(x, layout, world_size, seq_axis=1):
    """Inverse of ``to_layout``: put a tensor in ``layout`` order back into natural token order.

    >>> import torch, torch_bridge
    >>> x = torch.arange(8).reshape(1, 8)
    >>> torch.equal(torch_bridge.from_layout(torch_bridge.to_layout(x, "zigzag", 2), "zigzag", 2), x)
    True
    """
    return _perm(x, layout, world_size, seq_axis, inverse=True)


def segment_ids_from_cu_seqlens(cu_seqlens, seq_len):
    """flash-attn's varlen convention to segment ids: ``cu_seqlens`` [n + 1] (0, then the end of each packed
    sequence) gives int32 [seq_len] ids 0..n-1, tokens after the last sequence -1 (padding); [batch, n + 1]
    gives [batch, seq_len]. A tensor in, a tensor on its device out.

    >>> import torch, torch_bridge
    >>> torch_bridge.segment_ids_from_cu_seqlens(torch.tensor([0, 3, 5]), 6).tolist()
    [0, 0, 0, 1, 1, -1]
    """
    import numpy as np

    from ring_core.masks import segment_ids_from_cu_seqlens as ids

    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
    host = cu_seqlens.cpu().numpy() if isinstance(cu_seqlens, torch.Tensor) else np.asarray(cu_seqlens)
    return torch.from_numpy(ids(host, seq_len)).to(device)
