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

Masks (``ring_core.masks.allowed``, the one rule): causal, the sliding window ``spec.window`` and segment ids.
Each rank's segment ids ([b, s] int32, layout order) serve its queries and, riding in the same exchange as
its K/V block (``ring_shift``'s ``riders``: posted in the same ``batch_isend_irecv``, so a step is still one
matched exchange), its keys. They carry no gradient, so the backward's exchanges are exactly those above.
Segment ids must be given on every rank of the ring or on none (a rank without them would post fewer
messages). A padding row (negative id) attends nothing: out 0, lse -inf, no gradient in or out, no NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ring_core import masks
from ring_core.layout import global_positions
from ring_core.validate import AttentionSpec
from torch_bridge.groups import group_from_name, group_to_name


def _sendrecv(xs, dst: int, src: int, group) -> list:
    """Send the tensors ``xs`` to global rank ``dst`` and return what global rank ``src`` sent (same shapes and
    dtypes); every send and receive posted together. CUDA tensors travel through host memory on a gloo group
    (ranks sharing a GPU, where NCCL cannot run: gloo sends and receives only CPU tensors)."""
    xs = [x.contiguous() for x in xs]
    staged = xs[0].is_cuda and dist.get_backend(group) == "gloo"
    sends = [x.cpu() if staged else x for x in xs]
    outs = [torch.empty_like(x) for x in sends]
    ops = []
    for send, out in zip(sends, outs):  # matched in posting order: send i pairs with the peer's receive i
        ops += [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return [out.to(x.device) for out, x in zip(outs, xs)] if staged else outs


# The exchange as a custom op: dynamo cannot trace batch_isend_irecv (torch 2.11 fails inside it, on
# ProcessGroup._get_backend; torch 2.13 only with the experimental TORCHDYNAMO_ENABLE_P2P_COMPILATION=1,
# which left a send unwaited at exit), but it can put an opaque op in the graph, so the whole ring compiles
# with fullgraph=True. The shifts stay in one order on every rank under compile too: each consumes the
# previous one's output (forward) or gradient (backward). cudagraph_unsafe: the exchange is posted and
# waited for from the host. ``xs``: the tensor that carries a gradient, then its riders (which carry none).
@torch.library.custom_op("ring_attention::shift", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _shift_op(xs: list[torch.Tensor], dst: int, src: int, group_name: str) -> list[torch.Tensor]:
    return _sendrecv(xs, dst, src, group_from_name(group_name))


@_shift_op.register_fake
def _(xs, dst, src, group_name):
    return [x.new_empty(x.shape) for x in xs]


def _shift_setup_context(ctx, inputs, output):
    xs, dst, src, group_name = inputs
    ctx.back = (src, dst, group_name)  # the gradient goes the other way round
    ctx.n_riders = len(xs) - 1


def _shift_backward(ctx, grads):
    # The op again (not a bare _sendrecv), so that double backward (create_graph=True) also works; only the
    # first tensor carries a gradient, so the backward's exchange is the same on every rank.
    return [_shift_op([grads[0]], *ctx.back)[0]] + [None] * ctx.n_riders, None, None, None


_shift_op.register_autograd(_shift_backward, setup_context=_shift_setup_context)


def ring_shift(x: torch.Tensor, dst: int, src: int, group=None, riders=()):
    """Differentiable point-to-point shift; ``dst``/``src`` are *global* ranks. Every rank must call it, with
    as many riders (tensors without gradient, e.g. segment ids, sent in the same exchange) as its peers.
    Returns the received ``x``, or ``(x, *riders)`` received when riders are given."""
    outs = _shift_op([x, *riders], dst, src, group_to_name(group))
    return outs[0] if not riders else tuple(outs)


def ring_attention_torch(q, k, v, spec: AttentionSpec, rank: int, world_size: int, peers=None, group=None, *,
                         segment_ids=None):
    """Ring attention over ``world_size`` ranks; returns (out in q.dtype, lse [b, h, s]).

    ``rank`` is this process's rank in ``group``; ``peers`` = (next, prev) global ranks (unused when
    ``world_size == 1``). lse is float32, or float64 for float64 inputs; -inf on rows that attend nothing.
    ``segment_ids``: this rank's int32 [b, s] (layout order), given exactly when ``spec.segmented`` (on every
    rank); the window is ``spec.window``.
    """
    if (segment_ids is not None) != spec.segmented:
        raise ValueError(f"segment_ids {'missing' if spec.segmented else 'given'} but spec.segmented is "
                         f"{spec.segmented}: validate the call with check_attention_args(segment_ids_shape=...)")
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
    q_seg = k_seg = None if segment_ids is None else segment_ids.to(dev)
    masked = masks.is_masked(is_causal=spec.is_causal, window=spec.window, segmented=spec.segmented)

    m = torch.full((b, hkv, g, s), float("-inf"), dtype=cdt, device=dev)  # running max, no gradient
    l = torch.zeros((b, hkv, g, s), dtype=cdt, device=dev)  # running denominator
    acc = torch.zeros((b, hkv, g, s, d), dtype=cdt, device=dev)  # running numerator @ V
    for t in range(world_size):
        if t and k_seg is None:
            kv = ring_shift(kv, peers[0], peers[1], group)
        elif t:  # the block's segment ids ride with it
            kv, k_seg = ring_shift(kv, peers[0], peers[1], group, riders=(k_seg,))
        kt, vt = kv[0], kv[1]
        sc = torch.einsum("bqkgd,bskd->bkgqs", qg, kt) * spec.scale
        if masked:
            src = (rank - t) % world_size
            k_pos = global_positions(torch, src, world_size, s, spec.layout).to(dev)
            allowed = masks.allowed(q_pos, k_pos, is_causal=spec.is_causal, window=spec.window,
                                    q_segment_ids=q_seg, k_segment_ids=k_seg)
            sc = sc.masked_fill(~allowed, float("-inf"))
        # The max only stabilises exp; the result does not depend on it, so it is detached, and a row
        # masked in every block so far gets 0 instead of -inf (exp(-inf - 0) = 0, never NaN).
        m_new = torch.maximum(m, sc.detach().amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(sc - m_safe[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bkgqs,bskd->bkgqd", p, vt)
        m = m_new
    # Only a row that attends nothing (a padding row) has l = 0: out 0 and lse -inf through a safe denominator
    # of 1, so that no value and no gradient is NaN (log'(0) = inf would make 0 * inf in the backward).
    has_any = l > 0
    l_safe = torch.where(has_any, l, torch.ones_like(l))
    # contiguous(): the reshape of the permuted accumulator is a strided view, and callers .view() outputs.
    out = (acc / l_safe[..., None]).permute(0, 3, 1, 2, 4).reshape(b, s, h, d).to(q.dtype).contiguous()
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    lse = torch.where(has_any, m_safe + torch.log(l_safe), float("-inf")).reshape(b, h, s)
    return out, lse
