"""Flax: ring attention as an ``attention_fn`` with ``flax.linen.dot_product_attention``'s signature.

    attn = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=jax_ring.flax.ring_attention_fn(is_causal=True))
    # or flax.nnx.MultiHeadAttention(..., attention_fn=jax_ring.flax.ring_attention_fn(is_causal=True), rngs=rngs)

The returned function runs ``jax_ring.dot_product_attention`` on the module's global query/key/value
(``[batch..., seq, heads, head_dim]``): the mesh and the sequence axis come from ``mesh=`` / ``axis_name=``,
else from the inputs' sharding or the mesh set with ``jax.set_mesh`` (see jax_ring.nn). Causal masking,
windows and packing are the function's keywords (``is_causal``, ``local_window_size``), not a mask: a ``mask``
(for example from ``nn.make_causal_mask``) raises, saying to use ``is_causal=True``; so does dropout
(``dropout_rate > 0`` without ``deterministic``) and a ``bias``. Importing this module does not import flax.
"""

from __future__ import annotations

from jax_ring.nn import dot_product_attention


def ring_attention_fn(*, is_causal=False, local_window_size=None, scale=None, mesh=None, axis_name=None,
                      layout="contiguous", backend="auto", timeout_s=None, deterministic=False):
    """An ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` (and ``flax.nnx.MultiHeadAttention``)
    that runs the ring; keywords as in ``jax_ring.dot_product_attention``. ``scale`` None: ``1/sqrt(head_dim)``,
    flax's default. ``deterministic`` here is ring attention's (the backward's summation order); the returned
    function's own ``deterministic`` is flax's dropout switch."""
    bwd_deterministic = deterministic

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                     dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                     force_fp32_for_softmax=False, einsum_dot_general=None, qk_attn_weights_einsum=None,
                     attn_weights_value_einsum=None, **kwargs):
        # nnx adds ``promote_dtype`` and ``is_causal``.
        causal = kwargs.pop("is_causal", False) or is_causal
        kwargs.pop("promote_dtype", None)
        if kwargs:
            raise TypeError(f"ring attention_fn got unexpected arguments {sorted(kwargs)}")
        if mask is not None:
            raise ValueError("ring attention takes no mask (an arbitrary mask cannot be split over the ring): drop "
                             "the module's mask= (e.g. nn.make_causal_mask) and build the attention_fn with "
                             "jax_ring.flax.ring_attention_fn(is_causal=True) (or local_window_size=)")
        if dropout_rate > 0.0 and not deterministic:
            raise ValueError(f"attention dropout (dropout_rate={dropout_rate}) is not supported by ring attention: "
                             "set the module's dropout_rate=0.0 or call it with deterministic=True")
        if bias is not None:
            raise ValueError("ring attention takes no bias; pass bias=None")
        batch_shape = query.shape[:-3]
        q, k, v = (x.reshape((-1,) + x.shape[-3:]) for x in (query, key, value))
        out = dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=local_window_size,
                                    mesh=mesh, axis_name=axis_name, layout=layout, backend=backend,
                                    timeout_s=timeout_s, deterministic=bwd_deterministic)
        out = out.reshape(batch_shape + out.shape[-3:])
        return out if dtype is None else out.astype(dtype)

    return attention_fn
