"""Dense attention on whole (global) sequences in numpy: the ground truth every backend is checked against.

``attention`` computes in float64 (or in a chosen dtype pipeline, see ``attention_lowp``); ``attention_grad``
gives float64 gradients. Arrays are [batch, seq, heads, head_dim] in natural (global) token order, k and v
with ``num_kv_heads`` heads; ``lse`` is [batch, heads, seq].

Masks: ``is_causal``, ``segment_ids`` (int32 [batch, seq], natural order; negative = padding; or a pair, the
queries' ids and the keys', where they differ) and ``window`` (``(left, right)``, flash-attn's ``window_size``),
all by the one rule of ``ring_core.masks.allowed``. A row that attends nothing (a padding token) has out 0 and
lse -inf and neither takes nor gives gradient; no NaN.
"""

from __future__ import annotations

import math

import numpy as np

from ring_core import masks, validate


def _einsum(spec, *ops):
    """np.einsum through BLAS (optimize=True): unoptimised einsum loops in C, a hundred times slower at the
    sizes the GPU checks use."""
    return np.einsum(spec, *ops, optimize=True)


def np_dtype(name: str):
    """The numpy type of a dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes  # ships with jax; only needed for bf16 rounding

        return ml_dtypes.bfloat16
    return np.dtype(name)


def round_to(x, dtype: str) -> np.ndarray:
    """Round ``x`` to ``dtype`` and return it as float64 (what a kernel storing ``dtype`` sees)."""
    return np.asarray(x, dtype=np.float64).astype(np_dtype(dtype)).astype(np.float64)


def _scores(q, k, scale, is_causal, segment_ids=None, window=None, q_rows=None, key_offset=0):
    """Scaled scores [b, hkv, g, sq, sk] with -inf where ``masks.allowed`` masks (q, k in natural order; with
    ``q_rows``, q holds those tokens only). ``segment_ids``: [b, s], or a pair (the queries' ids, the keys' ids),
    each [b, s], where they differ (a call with another node's K/V: ``AttentionSpec.kv_ids``). ``key_offset``: the
    keys' positions in the queries' frame are theirs plus it (``AttentionSpec.key_offset``)."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, s, hkv, h // hkv, d)
    sc = _einsum("bqkgd,bskd->bkgqs", qg, k) * scale  # [b, hkv, g, sq, sk]
    q_seg, k_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    q_pos = np.arange(s) if q_rows is None else np.asarray(q_rows)
    mask = masks.allowed(q_pos, np.arange(k.shape[1]) + key_offset, is_causal=is_causal,
                         window=validate.check_window(window),
                         q_segment_ids=None if q_seg is None else np.asarray(q_seg)[:, q_pos],
                         k_segment_ids=None if k_seg is None else np.asarray(k_seg))
    return sc if mask is None else np.where(mask, sc, -np.inf)


def _query_rows(q, q_rows):
    """q restricted to the tokens ``q_rows`` (natural-order positions; None: all)."""
    return q if q_rows is None else np.asarray(q)[:, np.asarray(q_rows)]


def _softmax_parts(sc):
    """(p, m, l, attends): exp(sc - m) with the row max m (0 for a row that attends nothing, so that its p is
    exp(-inf) = 0, not NaN), the row sums l, and whether each row attends anything (l > 0). Keepdims."""
    m = sc.max(-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m).astype(sc.dtype)
    p = np.exp(sc - m)
    l = p.sum(-1, keepdims=True)
    return p, m, l, l > 0


def _lse(m, l, attends):
    """log-sum-exp per row, -inf for a row that attends nothing."""
    return np.where(attends, m + np.log(np.where(attends, l, 1)), -np.inf).astype(m.dtype)


def attention(q, k, v, *, is_causal=False, scale=None, compute_dtype=np.float64, segment_ids=None, window=None,
              q_rows=None, key_offset=0):
    """Dense softmax attention; returns (out [b,s,h,d], lse [b,h,s]) in ``compute_dtype``.

    ``segment_ids`` int [b, s] (natural order; negative = padding) and ``window`` (left, right) mask as in
    ``ring_core.masks`` (with the keys' positions moved by ``key_offset``: ``AttentionSpec.key_offset``); a row
    that attends nothing gets out 0 and lse -inf. ``q_rows``: the natural-order
    positions of the queries wanted (e.g. one rank's shard): out and lse then hold those rows only, in that
    order, computed at that share of the cost."""
    q, k, v = (np.asarray(x, dtype=compute_dtype) for x in (_query_rows(q, q_rows), k, v))
    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sc = _scores(q, k, compute_dtype(scale), is_causal, segment_ids, window, q_rows, key_offset)
    p, m, l, attends = _softmax_parts(sc)
    out = _einsum("bkgqs,bskd->bqkgd", p / np.where(attends, l, 1), v).reshape(b, s, h, d)
    lse = _lse(m, l, attends)[..., 0].reshape(b, h, s)
    return out, lse


def attention_lowp(q, k, v, dtype: str, *, is_causal=False, scale=None, segment_ids=None, window=None,
                   q_rows=None, key_offset=0):
    """What a careful kernel in ``dtype`` computes: float32 scores and softmax, probabilities rounded to
    ``dtype`` before P@V, float32 accumulation, output rounded to ``dtype``. Its error against ``attention``
    is the yardstick for kernel error (see ring_core.testing). Masks and ``q_rows`` as in ``attention``."""
    if dtype in ("float32", "float64"):
        out, lse = attention(q, k, v, is_causal=is_causal, scale=scale, compute_dtype=np.dtype(dtype).type,
                             segment_ids=segment_ids, window=window, q_rows=q_rows, key_offset=key_offset)
        return out.astype(np.float64), lse.astype(np.float64)
    q, k, v = (round_to(x, dtype).astype(np.float32) for x in (_query_rows(q, q_rows), k, v))
    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sc = _scores(q, k, np.float32(scale), is_causal, segment_ids, window, q_rows, key_offset)
    p, m, l, attends = _softmax_parts(sc)
    pv = _einsum("bkgqs,bskd->bqkgd", round_to(p, dtype).astype(np.float32), v)
    l_q = np.moveaxis(np.where(attends, l, 1)[..., 0], 3, 1)[..., None]  # [b, sq, hkv, g, 1]
    out = round_to((pv / l_q).reshape(b, s, h, d), dtype)
    lse = _lse(m, l, attends)[..., 0].reshape(b, h, s).astype(np.float64)
    return out, lse


def attention_grad(q, k, v, dout, *, is_causal=False, scale=None, compute_dtype=np.float64, dlse=None,
                   round_dtype=None, segment_ids=None, window=None, q_rows=None, reduce=None, key_offset=0):
    """Gradients (dq, dk, dv) of ``sum(out * dout) + sum(lse * dlse)`` with ``out, lse = attention(q, k, v)``
    (``dlse`` [b, h, s] optional: lse then carries no gradient); dk/dv summed over each kv head's group.
    ``round_dtype`` (for ``attention_grad_lowp``): round what a kernel in that dtype rounds, the output that
    delta reads and the P and dS that enter the matmuls. Masks as in ``attention``: a row that attends
    nothing has P = 0, so its dq is 0 and it gives nothing to dk/dv for any finite dout; its dlse is selected
    away, not multiplied (lse = -inf is a constant there), so even a non-finite dlse on such a row is ignored,
    as the rings' ``where`` ignores it.

    ``q_rows`` (natural-order positions, e.g. one rank's shard): only those queries' share, at that share of the
    cost: dq of those rows, in that order, and their contributions to dk and dv (all keys). ``reduce`` sums a
    share's dk or dv over every share (an all-reduce across the ranks that split the rows); the full dk and dv
    are then returned."""
    rnd = (lambda x: x) if round_dtype is None else (lambda x: round_to(x, round_dtype).astype(compute_dtype))
    if dlse is not None and q_rows is not None:
        dlse = np.asarray(dlse)[..., np.asarray(q_rows)]
    q, dout = (_query_rows(x, q_rows) for x in (q, dout))
    q, k, v, dout = (np.asarray(x, dtype=compute_dtype) for x in (q, k, v, dout))
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sc = _scores(q, k, compute_dtype(scale), is_causal, segment_ids, window, q_rows, key_offset)
    p, _, l, attends = _softmax_parts(sc)
    p /= np.where(attends, l, 1)  # [b, hkv, g, sq, sk]
    do = dout.reshape(b, s, hkv, g, d)
    p_mm = rnd(p)  # P as it enters the matmuls
    out = rnd(_einsum("bkgqs,bskd->bqkgd", p_mm, v))
    dv = _einsum("bkgqs,bqkgd->bskd", p_mm, do)
    dp = _einsum("bqkgd,bskd->bkgqs", do, v)
    delta = np.moveaxis((do * out).sum(-1), 1, 3)[..., None]  # [b, hkv, g, sq, 1]
    if dlse is not None:  # d lse_i / d s_ij = p_ij; none on a row that attends nothing
        dlse = np.asarray(dlse, dtype=compute_dtype).reshape(b, hkv, g, s)[..., None]
        delta = delta - np.where(attends, dlse, 0)
    ds = rnd(p * (dp - delta))
    dq = _einsum("bkgqs,bskd->bqkgd", ds, k).reshape(b, s, h, d) * scale
    dk = _einsum("bkgqs,bqkgd->bskd", ds, q.reshape(b, s, hkv, g, d)) * scale
    if reduce is not None:
        dk, dv = reduce(dk), reduce(dv)
    return dq, dk, dv


def attention_grad_lowp(q, k, v, dout, dtype: str, *, is_causal=False, scale=None, dlse=None, segment_ids=None,
                        window=None, q_rows=None, reduce=None, key_offset=0):
    """What a careful backward kernel in ``dtype`` computes (as flash-attention's backward does): float32
    scores, softmax and accumulation from ``dtype`` inputs (``dlse`` float32); the forward's output, P and dS
    rounded to ``dtype`` where they enter delta and the matmuls; gradients rounded to ``dtype``. Its error
    against ``attention_grad`` is the yardstick for gradient error of a ``dtype`` kernel, as
    ``attention_lowp``'s is for the forward. Masks, ``q_rows`` and ``reduce`` as in ``attention_grad`` (the
    shares' dk and dv are summed in float32, then rounded)."""
    mask = dict(segment_ids=segment_ids, window=window, q_rows=q_rows, reduce=reduce, key_offset=key_offset)
    if dtype == "float64":
        return attention_grad(q, k, v, dout, is_causal=is_causal, scale=scale, dlse=dlse, **mask)
    q, k, v, dout = (round_to(x, dtype) for x in (q, k, v, dout))
    grads = attention_grad(q, k, v, dout, is_causal=is_causal, scale=scale, compute_dtype=np.float32, dlse=dlse,
                           round_dtype=None if dtype == "float32" else dtype, **mask)
    return tuple(round_to(x, dtype) for x in grads)
