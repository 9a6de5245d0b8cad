"""The reference ring (``backend="torch"``): K/V travel around the ring over torch.distributed point-to-point.

Built from one differentiable communication op (``ring_shift``: the custom op ``ring_attention::shift`` with
its autograd formula) and ordinary torch ops, so autograd gives the gradients of full attention, and
torch.compile (fullgraph=True too) traces the whole ring. Blockwise attention runs in float32
(float64 for float64 inputs) and blocks are merged by online softmax.

Why the backward pass cannot deadlock: every rank builds the same graph (same number of ``ring_shift`` nodes,
same ops; the rank only changes mask *values*, never which ops run). The shift at step t consumes the K/V
of step t-1, so autograd must run the shifts' backwards strictly in the order W-1, ..., 1 on every rank; each
one posts its send (to rank-1) and its receive (from rank+1) together through ``batch_isend_irecv``
before waiting. So the ranks meet in the same sequence of matched exchanges, forward and backward.
Skipping fully masked blocks on some ranks only would break this: autograd would prune the unused
shifts on those ranks while their neighbours wait for them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ring_core.layout import global_positions
from ring_core.validate import AttentionSpec
from torch_bridge.groups import group_from_name, group_to_name


def _sendrecv(x: torch.Tensor, dst: int, src: int, group) -> torch.Tensor:
    """Send ``x`` to global rank ``dst`` and return what global rank ``src`` sent; both posted together.
    CUDA tensors travel through host memory on a gloo group (ranks sharing a GPU, where NCCL cannot run:
    gloo sends and receives only CPU tensors)."""
    x = x.contiguous()
    staged = x.is_cuda and dist.get_backend(group) == "gloo"
    send = x.cpu() if staged else x
    out = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out.to(x.device) if staged else out


# The exchange as a custom op: dynamo cannot trace batch_isend_irecv (torch 2.11 fails inside it, on
# ProcessGroup._get_backend; torch 2.13 only with the experimental TORCHDYNAMO_ENABLE_P2P_COMPILATION=1,
# which left a send unwaited at exit), but it can put an opaque op in the graph, so the whole ring compiles
# with fullgraph=True. The shifts stay in one order on every rank under compile too: each consumes the
# previous one's output (forward) or gradient (backward). cudagraph_unsafe: the exchange is posted and
# waited for from the host.
@torch.library.custom_op("ring_attention::shift", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _shift_op(x: torch.Tensor, dst: int, src: int, group_name: str) -> torch.Tensor:
    return _sendrecv(x, dst, src, group_from_name(group_name))


@_shift_op.register_fake
def _(x, dst, src, group_name):
    return x.new_empty(x.shape)


def _shift_setup_context(ctx, inputs, output):
    _, dst, src, group_name = inputs
    ctx.back = (src, dst, group_name)  # the gradient goes the other way round


def _shift_backward(ctx, grad):
    # The op again (not a bare _sendrecv), so that double backward (create_graph=True) also works.
    return _shift_op(grad, *ctx.back), None, None, None


_shift_op.register_autograd(_shift_backward, setup_context=_shift_setup_context)


def ring_shift(x: torch.Tensor, dst: int, src: int, group=None) -> torch.Tensor:
    """Differentiable point-to-point shift; ``dst``/``src`` are *global* ranks. Every rank must call it."""
    return _shift_op(x, dst, src, group_to_name(group))


def ring_attention_torch(q, k, v, spec: AttentionSpec, rank: int, world_size: int, peers=None, group=None):
    """Ring attention over ``world_size`` ranks; returns (out in q.dtype, lse [b, h, s]).

    ``rank`` is this process's rank in ``group``; ``peers`` = (next, prev) global ranks (unused when
    ``world_size == 1``). lse is float32, or float64 for float64 inputs.
    """
    b, s, h, d = q.shape
    hkv, g = spec.num_kv_heads, spec.group
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    # GQA without repeating K/V: the q heads of one kv head form a group axis.
    qg = q.to(cdt).reshape(b, s, hkv, g, d)
    # K and V travel together (one message per step) and in the compute dtype, so that their gradients
    # also travel and accumulate across steps in float32 rather than in bf16/fp16.
    kv = torch.stack([k.to(cdt), v.to(cdt)])
    q_pos = global_positions(torch, rank, world_size, s, spec.layout).to(dev)

    m = torch.full((b, hkv, g, s), float("-inf"), dtype=cdt, device=dev)  # running max, no gradient
    l = torch.zeros((b, hkv, g, s), dtype=cdt, device=dev)  # running denominator
    acc = torch.zeros((b, hkv, g, s, d), dtype=cdt, device=dev)  # running numerator @ V
    for t in range(world_size):
        if t:
            kv = ring_shift(kv, peers[0], peers[1], group)
        kt, vt = kv[0], kv[1]
        sc = torch.einsum("bqkgd,bskd->bkgqs", qg, kt) * spec.scale
        if spec.is_causal:
            src = (rank - t) % world_size
            k_pos = global_positions(torch, src, world_size, s, spec.layout).to(dev)
            sc = sc.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        # The max only stabilises exp; the result does not depend on it, so it is detached, and a row
        # masked in every block so far gets 0 instead of -inf (exp(-inf - 0) = 0, never NaN).
        m_new = torch.maximum(m, sc.detach().amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(sc - m_safe[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bkgqs,bskd->bkgqd", p, vt)
        m = m_new
    # Every row sees at least its own token over the whole ring, so l > 0 here.
    # contiguous(): the reshape of the permuted accumulator is a strided view, and callers .view() outputs.
    out = (acc / l[..., None]).permute(0, 3, 1, 2, 4).reshape(b, s, h, d).to(q.dtype).contiguous()
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    lse = (m_safe + torch.log(l)).reshape(b, h, s)
    return out, lse
