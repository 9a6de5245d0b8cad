"""The reference ring in pure JAX (``backend="xla"``): correct everywhere, differentiable, not fast.

Each rank keeps its queries and passes its K/V block around the mesh axis with ``lax.ppermute``
(rank i sends to i+1), so at step t rank r holds the K/V of source rank (r - t) mod W. Every step is one
dense block of attention in float32 (float64 for float64 inputs) masked with *global* token positions
(``ring_core.layout.global_positions``), merged into a running (max, denominator, accumulator) by online
softmax. Gradients come from JAX differentiating these ops (ppermute transposes to the reverse ring).

GQA/MQA never repeats K/V heads: q is viewed as [b, s, hkv, group, d] and contracted against k [b, s, hkv, d].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ring_core.layout import global_positions
from ring_core.validate import AttentionSpec

from jax_ring import _platform


def _compute_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def block_scores(qg, k, qpos, kpos, scale, is_causal):
    """Scaled scores [b, hkv, g, sq, sk] of grouped queries ``qg`` [b, sq, hkv, g, d] against ``k`` [b, sk, hkv, d].

    Causal masking compares global positions (``qpos`` [sq], ``kpos`` [sk]); masked entries are -inf.
    """
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, precision=lax.Precision.HIGHEST) * jnp.asarray(scale, qg.dtype)
    if is_causal:
        s = jnp.where(kpos[None, :] > qpos[:, None], -jnp.inf, s)
    return s


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


def ring_attention_xla(q, k, v, *, axis_name, spec: AttentionSpec, return_lse: bool = False):
    """Ring attention of one rank's shard; call inside ``jax.shard_map`` (arguments already validated).

    Prefer ``jax_ring.ring_attention(..., backend="xla")``, which validates and documents the arguments.
    Returns ``out`` (q's shape and dtype) and, with ``return_lse``, ``lse`` float32 [b, h, s].
    """
    world = _platform.axis_size(axis_name)
    rank = _platform.axis_index(axis_name)
    b, s, h, d = spec.batch, spec.seq_local, spec.num_heads, spec.head_dim
    hkv, g = spec.num_kv_heads, spec.group
    cdt = _compute_dtype(q.dtype)

    qg = q.astype(cdt).reshape(b, s, hkv, g, d)
    kv = (k.astype(cdt), v.astype(cdt))
    qpos = global_positions(jnp, rank, world, s, spec.layout)
    perm = [(i, (i + 1) % world) for i in range(world)]

    carry = (jnp.full((b, hkv, g, s), -jnp.inf, cdt), jnp.zeros((b, hkv, g, s), cdt),
             jnp.zeros((b, hkv, g, s, d), cdt))
    for t in range(world):
        # Send the block on before using it, so the transfer can overlap this step's compute.
        nxt = lax.ppermute(kv, axis_name, perm) if t + 1 < world else None
        src = (rank - t) % world
        kpos = global_positions(jnp, src, world, s, spec.layout)
        scores = block_scores(qg, kv[0], qpos, kpos, spec.scale, spec.is_causal)
        carry = _merge_block(carry, scores, kv[1])
        kv = nxt

    m, l, acc = carry
    has_any = l > 0  # False only for a row whose every key is masked (never under plain causal masking)
    l_safe = jnp.where(has_any, l, 1.0)
    out = acc / l_safe[..., None]  # [b, hkv, g, s, d]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, d).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(has_any, m + jnp.log(l_safe), -jnp.inf).reshape(b, h, s).astype(jnp.float32)
    return out, lse


def dense_attention(q, k, v, *, is_causal=False, scale=None):
    """Single-device dense attention in JAX (global natural order), float32 maths; returns (out, lse).

    A cross-check for the ring and a fallback for one device. Shapes as in ``jax_ring.ring_attention``.

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
    sc = block_scores(q.astype(cdt).reshape(b, s, hkv, h // hkv, d), k.astype(cdt), pos, pos, scale, is_causal)
    lse = jax.nn.logsumexp(sc, axis=-1)
    p = jnp.exp(sc - lse[..., None])
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(cdt), precision=lax.Precision.HIGHEST)
    return out.reshape(b, s, h, d).astype(q.dtype), lse.reshape(b, h, s).astype(jnp.float32)
