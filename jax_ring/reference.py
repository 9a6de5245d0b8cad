"""The reference ring in pure JAX (``backend="xla"``): correct everywhere, differentiable, not fast.

Each rank keeps its queries and passes its K/V block around the mesh axis with ``lax.ppermute``
(rank i sends to i+1), so at step t rank r holds the K/V of source rank (r - t) mod W. Every step is one
dense block of attention in float32 (float64 for float64 inputs) masked with *global* token positions
(``ring_core.layout.global_positions``), merged into a running (max, denominator, accumulator) by online
softmax. Gradients come from JAX differentiating these ops (ppermute transposes to the reverse ring).

Masks (``ring_core.masks.allowed``, the one rule): causal, the sliding window ``spec.window`` and segment ids.
Each rank's segment ids ([b, s] int32, in its layout order) serve its queries and, travelling around the
ring in the same ``ppermute`` as its K/V block, its keys. A padding row (negative id) attends nothing: out 0,
lse -inf, and no gradient in or out; nothing is NaN forward or backward (``_merge_block`` shifts an empty
row by 0, so its p is exp(-inf) = 0, and the final division and log read a safe denominator of 1).

GQA/MQA never repeats K/V heads: q is viewed as [b, s, hkv, group, d] and contracted against k [b, s, hkv, d].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ring_core import masks
from ring_core.layout import global_positions
from ring_core.validate import AttentionSpec, check_window

from jax_ring import _platform


def _compute_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def block_scores(qg, k, qpos, kpos, scale, is_causal, *, window=masks.NO_WINDOW, qseg=None, kseg=None):
    """Scaled scores [b, hkv, g, sq, sk] of grouped queries ``qg`` [b, sq, hkv, g, d] against ``k`` [b, sk, hkv, d].

    Masking (``ring_core.masks.allowed``) compares global positions (``qpos`` [sq], ``kpos`` [sk]) and the
    tokens' segment ids (``qseg`` [b, sq], ``kseg`` [b, sk], or None); masked entries are -inf.
    """
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, precision=lax.Precision.HIGHEST) * jnp.asarray(scale, qg.dtype)
    mask = masks.allowed(qpos, kpos, is_causal=is_causal, window=window, q_segment_ids=qseg, k_segment_ids=kseg)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _merge_block(carry, s, v):
    """One online-softmax step. ``m`` is a stop-gradient shift: the result is the same for any finite shift,
    so holding it constant gives exact gradients and keeps max() out of the backward pass. Rows with every
    score masked (so far) keep m = -inf; shifting them by 0 instead makes their p and alpha exactly 0, not NaN.
    """
    m, l, acc = carry
    m_new = jnp.maximum(m, lax.stop_gradient(jnp.max(s, axis=-1)))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    l = l * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p, v, precision=lax.Precision.HIGHEST)
    return m_new, l, acc


def _finish(carry, dtype):
    """(out [b, s, h, d] in ``dtype``, lse float32 [b, h, s]) from the merged (m, l, acc) [b, hkv, g, s(, d)].
    A row whose every key is masked (a padding row) has l = 0: out 0 and lse -inf through a safe denominator
    of 1, so that neither the values nor their gradients are NaN."""
    m, l, acc = carry
    b, hkv, g, s, d = acc.shape
    has_any = l > 0
    l_safe = jnp.where(has_any, l, 1.0)
    out = acc / l_safe[..., None]  # [b, hkv, g, s, d]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, hkv * g, d).astype(dtype)
    lse = jnp.where(has_any, m + jnp.log(l_safe), -jnp.inf).reshape(b, hkv * g, s).astype(jnp.float32)
    return out, lse


def ring_attention_xla(q, k, v, *, axis_name, spec: AttentionSpec, return_lse: bool = False, segment_ids=None):
    """Ring attention of one rank's shard; call inside ``jax.shard_map`` (arguments already validated).

    Prefer ``jax_ring.ring_attention(..., backend="xla")``, which validates and documents the arguments.
    ``segment_ids``: this rank's int32 [b, s] (layout order), given exactly when ``spec.segmented``; the
    window is ``spec.window``. Returns ``out`` (q's shape and dtype) and, with ``return_lse``, ``lse`` float32
    [b, h, s] (-inf on rows that attend nothing).
    """
    if (segment_ids is not None) != spec.segmented:
        raise ValueError(f"segment_ids {'missing' if spec.segmented else 'given'} but spec.segmented is "
                         f"{spec.segmented}: validate the call with check_attention_args(segment_ids_shape=...)")
    world = _platform.axis_size(axis_name)
    rank = _platform.axis_index(axis_name)
    b, s, d = spec.batch, spec.seq_local, spec.head_dim
    hkv, g = spec.num_kv_heads, spec.group
    cdt = _compute_dtype(q.dtype)

    qg = q.astype(cdt).reshape(b, s, hkv, g, d)
    # The block's segment ids travel with its K/V (one ppermute of the three).
    kv = (k.astype(cdt), v.astype(cdt)) + (() if segment_ids is None else (segment_ids,))
    qpos = global_positions(jnp, rank, world, s, spec.layout)
    perm = [(i, (i + 1) % world) for i in range(world)]

    carry = (jnp.full((b, hkv, g, s), -jnp.inf, cdt), jnp.zeros((b, hkv, g, s), cdt),
             jnp.zeros((b, hkv, g, s, d), cdt))
    for t in range(world):
        # Send the block on before using it, so the transfer can overlap this step's compute.
        nxt = lax.ppermute(kv, axis_name, perm) if t + 1 < world else None
        src = (rank - t) % world
        kpos = global_positions(jnp, src, world, s, spec.layout)
        scores = block_scores(qg, kv[0], qpos, kpos, spec.scale, spec.is_causal, window=spec.window,
                              qseg=segment_ids, kseg=kv[2] if segment_ids is not None else None)
        carry = _merge_block(carry, scores, kv[1])
        kv = nxt

    out, lse = _finish(carry, q.dtype)
    return (out, lse) if return_lse else out


def dense_attention(q, k, v, *, is_causal=False, scale=None, segment_ids=None, window=None):
    """Single-device dense attention in JAX (global natural order), float32 maths; returns (out, lse).

    A cross-check for the ring and a fallback for one device. Shapes as in ``jax_ring.ring_attention``;
    ``segment_ids`` int32 [b, s] (natural order, negative = padding) and ``window`` (left, right) mask as in
    ``ring_core.masks`` (rows that attend nothing: out 0, lse -inf, no gradient, no NaN).

    >>> import jax.numpy as jnp
    >>> q = k = v = jnp.ones((1, 4, 2, 8))
    >>> out, lse = dense_attention(q, k, v, is_causal=True)
    >>> out.shape, lse.shape
    ((1, 4, 2, 8), (1, 2, 4))
    """
    b, s, h, d = q.shape
    hkv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / d ** 0.5 if scale is None else scale
    pos = jnp.arange(s)
    sc = block_scores(q.astype(cdt).reshape(b, s, hkv, h // hkv, d), k.astype(cdt), pos, pos, scale, is_causal,
                      window=check_window(window), qseg=segment_ids, kseg=segment_ids)
    if segment_ids is None:  # every row attends at least its own token
        lse = jax.nn.logsumexp(sc, axis=-1)
        p = jnp.exp(sc - lse[..., None])
    else:  # a padding row attends nothing: one block through the ring's merge (safe shift and denominator)
        rows = sc.shape[:-1]
        return _finish(_merge_block((jnp.full(rows, -jnp.inf, cdt), jnp.zeros(rows, cdt), jnp.zeros((*rows, d), cdt)),
                                    sc, v.astype(cdt)), q.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(cdt), precision=lax.Precision.HIGHEST)
    return out.reshape(b, s, h, d).astype(q.dtype), lse.reshape(b, h, s).astype(jnp.float32)
