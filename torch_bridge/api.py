"""Public PyTorch API: ``ring_attention``, ``RingAttention``, ``to_layout`` / ``from_layout``.

One process per rank under torch.distributed; each rank passes its own shard of the sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ring_core.layout import LAYOUTS, inverse_permutation, layout_permutation
from ring_core.validate import check_attention_args, check_timeout
from torch_bridge.reference import ring_attention_torch

BACKENDS = ("auto", "fused", "torch")


def _fused_available() -> bool:
    """Whether the fused Triton + iris kernel can run here (GPU and ``torch_bridge.initialize()``)."""
    from torch_bridge import fused

    return fused.fused_available()


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
    fusable = _on_gpu(q) and spec.dtype != "float64"
    if backend == "auto":
        return "fused" if fusable and _fused_available() else "torch"
    if backend == "fused":
        if not _fused_available():
            raise RuntimeError(
                "backend='fused' needs the symmetric heap: call torch_bridge.initialize() once per process "
                "(one process per GPU, started by torchrun or python -m jax_ring.launch); or use backend='torch'")
        if not _on_gpu(q):
            raise ValueError(f"backend='fused' needs CUDA tensors, got {q.device}; move q, k, v to this rank's GPU")
        if spec.dtype == "float64":
            raise TypeError("backend='fused' supports float16, bfloat16 and float32; use backend='torch' for float64")
    return backend


def ring_attention(q, k, v, *, group=None, is_causal=False, scale=None, layout="contiguous", return_lse=False,
                   backend="auto", timeout_s=None):
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

    ``timeout_s`` bounds every wait inside the fused kernel (default RING_ATTENTION_TIMEOUT_S, else 300 s);
    an expired wait raises ``ring_core.control.RingAttentionTimeout`` naming the missing rank and ring step,
    at the next call or ``check_errors()`` (at once with RING_ATTENTION_SYNC_ERRORS=1). Ranks whose fused
    calls differ (shapes, dtype, flags, layout, scale) raise ``ring_core.control.RingAttentionMismatch`` the
    same way, naming both calls; the kernel finds it before any data moves. The torch ring is bounded by
    its process group's own timeout instead.

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
    spec = check_attention_args(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, is_causal=is_causal,
                                scale=scale, layout=layout, backend=backend, backends=BACKENDS,
                                return_lse=return_lse)
    timeout_s = check_timeout(timeout_s)
    rank, world, peers = _group_info(group)
    backend = _resolve_backend(backend, q, spec)
    if backend == "torch":
        out, lse = ring_attention_torch(q, k, v, spec, rank, world, peers, group)
    else:
        from torch_bridge import fused

        out, lse = fused.ring_attention_fused(q, k, v, spec=spec, group=group, timeout_s=timeout_s)
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
                 backend="auto", timeout_s=None):
        super().__init__()
        # Fail at construction for what does not depend on the inputs.
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.group = group
        self.is_causal = is_causal
        self.scale = scale
        self.layout = layout
        self.return_lse = return_lse
        self.backend = backend
        self.timeout_s = check_timeout(timeout_s)

    def forward(self, q, k, v):
        return ring_attention(q, k, v, group=self.group, is_causal=self.is_causal, scale=self.scale,
                              layout=self.layout, return_lse=self.return_lse, backend=self.backend,
                              timeout_s=self.timeout_s)

    def extra_repr(self) -> str:
        return (f"is_causal={self.is_causal}, scale={self.scale}, layout={self.layout!r}, "
                f"return_lse={self.return_lse}, backend={self.backend!r}")


def _perm(x, layout, world_size, seq_axis, inverse):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(seq_axis, bool) or not isinstance(seq_axis, int) or not -x.dim() <= seq_axis < x.dim():
        raise ValueError(f"seq_axis={seq_axis!r} is out of range for a tensor of rank {x.dim()}")
    seq_axis %= x.dim()
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
