"""jax_ring.dot_product_attention (jax.nn's signature on global arrays) and jax_ring.flax.ring_attention_fn, on
CPU devices (tests/conftest.py sets --xla_force_host_platform_device_count=4), backend "xla" (the reference
ring; "auto" picks it on CPU). Results are compared with the float64 reference within the tolerance table, the
same-precision reference being jax.nn.dot_product_attention itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ring
from ring_core import reference, testing


def _mesh(shape, names):
    n = int(np.prod(shape))
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} CPU devices, have {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(shape), names)


def _inputs(seed, b, s, h, hkv, d):
    q, k, v = testing.random_inputs(seed, b, s, h, hkv, d, "float32")
    return (q, k, v), tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _check(name, got, want_lowp, q, k, v, *, is_causal, scale=None, window=None, segment_ids=None, lse=None,
           lse_lowp=None):
    """``got`` against the float64 reference, within twice jax.nn's own error plus the float32 slack."""
    out64, lse64 = reference.attention(q, k, v, is_causal=is_causal, scale=scale, window=window,
                                       segment_ids=segment_ids)
    testing.check(f"{name} out", np.asarray(got), out64, np.asarray(want_lowp), "float32", "out")
    if lse is not None:
        testing.check(f"{name} lse", np.asarray(lse), lse64, np.asarray(lse_lowp), "float32", "lse")


CASES = [
    # world, (b, s, h, hkv, d), is_causal, local_window_size, scale
    (2, (2, 18, 7, 1, 80), True, None, None),
    (3, (1, 21, 4, 2, 16), False, (4, 2), 0.3),
    (2, (1, 14, 6, 3, 24), True, 5, None),
    (4, (2, 12, 2, 2, 32), False, None, None),
]


@pytest.mark.parametrize("case", CASES, ids=[f"W{c[0]}-s{c[1][1]}-h{c[1][2]}kv{c[1][3]}d{c[1][4]}" for c in CASES])
def test_matches_jax_nn_under_jit(case):
    """Global arrays sharded along the sequence, plain jax.jit: the mesh and axis come from the sharding."""
    world, shape, causal, window, scale = case
    mesh = _mesh((world,), ("sp",))
    ref, (q, k, v) = _inputs(world, *shape)
    sh = NamedSharding(mesh, P(None, "sp"))
    qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
    kw = dict(is_causal=causal, local_window_size=window, scale=scale)
    out, res = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(q, k, v, return_residual=True, **kw))(qs, ks, vs)
    want, want_res = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    assert out.shape == want.shape and res.shape == want_res.shape
    assert out.sharding.spec[1] == "sp"
    w = None if window is None else ((window, window) if isinstance(window, int) else window)
    _check("dot_product_attention", out, want, *ref, is_causal=causal, scale=scale, window=w,
           lse=np.swapaxes(res, 1, 2), lse_lowp=np.swapaxes(want_res, 1, 2))


def test_unbatched_eager_and_set_mesh():
    """[seq, heads, head_dim] inputs, eager on sharded arrays; unsharded inputs under jax.set_mesh."""
    mesh = _mesh((2,), ("sp",))
    ref, (q, k, v) = _inputs(1, 1, 10, 3, 1, 16)
    sh = NamedSharding(mesh, P("sp"))
    out = jax_ring.dot_product_attention(*(jax.device_put(x[0], sh) for x in (q, k, v)), is_causal=True)
    want = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    _check("unbatched", np.asarray(out)[None], np.asarray(want)[None], *ref, is_causal=True)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    _check("set_mesh", out, jax.nn.dot_product_attention(q, k, v, is_causal=True), *ref, is_causal=True)


def test_dp_sp_mesh_and_segment_ids():
    """A ("dp", "sp") mesh: axis_name picks the ring's axis, the batch stays sharded over "dp"; packed rows."""
    mesh = _mesh((2, 2), ("dp", "sp"))
    ref, (q, k, v) = _inputs(2, 2, 16, 4, 2, 16)
    ids = testing.random_segment_ids(2, 2, 16)
    sh = NamedSharding(mesh, P("dp", "sp"))
    args = [jax.device_put(x, sh) for x in (q, k, v, jnp.asarray(ids))]
    # eager on sharded arrays: the batch axis keeps "dp" (under jit with Auto axes the spec is not known)
    out = jax_ring.dot_product_attention(*args[:3], is_causal=True, segment_ids=args[3], axis_name="sp")
    assert out.sharding.spec[:2] == ("dp", "sp")
    f = jax.jit(lambda q, k, v, s: jax_ring.dot_product_attention(q, k, v, is_causal=True, segment_ids=s,
                                                                  axis_name="sp"))
    np.testing.assert_array_equal(np.asarray(f(*args)), np.asarray(out))
    mask = (ids[:, None, :, None] == ids[:, None, None, :]) & (ids[:, None, :, None] >= 0)
    want = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask), is_causal=True)
    want = jnp.where(jnp.asarray(ids >= 0)[:, :, None, None], want, 0.0)  # padding rows: 0 in the ring
    _check("dp x sp", out, want, *ref, is_causal=True, segment_ids=ids)
    with pytest.raises(ValueError, match="axis_name"):
        jax.jit(lambda q, k, v: jax_ring.dot_product_attention(q, k, v))(*args[:3])


def test_gradients_match():
    mesh = _mesh((2,), ("sp",))
    ref, (q, k, v) = _inputs(4, 1, 12, 4, 2, 16)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v))
    dout = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), jnp.float32)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, is_causal=True) * dout)

    got = jax.jit(jax.grad(loss(jax_ring.dot_product_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    g64 = reference.attention_grad(*ref, np.asarray(dout, np.float64), is_causal=True)
    for n, a, b, r in zip("qkv", got, want, g64):
        testing.check(f"d{n}", np.asarray(a), r, np.asarray(b), "float32", "grad")


def test_unsupported_raise():
    mesh = _mesh((2,), ("sp",))
    _, (q, k, v) = _inputs(0, 1, 8, 2, 2, 16)
    f = jax_ring.dot_product_attention
    for kw, match in ((dict(bias=jnp.zeros((1, 2, 8, 8))), "bias"), (dict(mask=jnp.ones((1, 1, 8, 8), bool)), "mask"),
                      (dict(key_value_seq_lengths=jnp.array([6])), "segment_ids"),
                      (dict(implementation="cudnn"), "backend=")):
        with pytest.raises(ValueError, match=match):
            f(q, k, v, mesh=mesh, axis_name="sp", **kw)
    with pytest.raises(ValueError, match="no mesh"):
        jax.jit(f)(q, k, v)
    with pytest.raises(ValueError, match="not an axis"):
        f(q, k, v, mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match="seq"):
        f(q[:, :7], k[:, :7], v[:, :7], mesh=mesh, axis_name="sp")


# ------------------------------------------------------------------------------------------------- Flax
VOCAB, D_MODEL, HEADS = 61, 32, 4


def _linen_lm(attention_fn):
    import flax.linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens, mask=None):
            x = nn.Embed(VOCAB, D_MODEL)(tokens)
            for _ in range(2):
                h = nn.LayerNorm()(x)
                kw = {} if attention_fn is None else dict(attention_fn=attention_fn)
                x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, **kw)(h, mask=mask)
                x = x + nn.Dense(D_MODEL)(jax.nn.gelu(nn.Dense(2 * D_MODEL)(nn.LayerNorm()(x))))
            return nn.Dense(VOCAB)(x)

    return LM()


def test_flax_linen_training_matches_one_device():
    """A small linen LM whose MultiHeadDotProductAttention runs the ring (attention_fn), trained 3 steps under
    jax.jit with optax on a 2-device sequence mesh, against the same LM with flax's attention and a causal mask
    on one device: the same losses and weights within the float32 slack of the table."""
    import flax.linen as nn
    import optax

    mesh = _mesh((2,), ("sp",))
    ring = _linen_lm(jax_ring.flax.ring_attention_fn(is_causal=True, mesh=mesh, axis_name="sp"))
    dense = _linen_lm(None)
    rng = np.random.default_rng(0)
    data = jnp.asarray(rng.integers(0, VOCAB, (3, 2, 17)))
    params = dense.init(jax.random.key(0), data[0, :, :-1])
    opt = optax.sgd(0.5)  # linear in the gradient (Adam would magnify the rounding of near-zero gradients)

    def make_step(model, use_mask):
        def loss_fn(p, x, y):
            mask = nn.make_causal_mask(x) if use_mask else None
            logits = model.apply(p, x, mask)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        @jax.jit
        def step(p, s, x, y):
            loss, g = jax.value_and_grad(loss_fn)(p, x, y)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        return step

    sh = NamedSharding(mesh, P(None, "sp"))
    p_r, s_r, p_d, s_d = params, opt.init(params), params, opt.init(params)
    step_r, step_d = make_step(ring, False), make_step(dense, True)
    tol = testing.TOLERANCES["float32"]["grad"]
    for i in range(3):
        x, y = data[i, :, :-1], data[i, :, 1:]
        p_r, s_r, loss_r = step_r(p_r, s_r, jax.device_put(x[:, :16], sh), jax.device_put(y[:, :16], sh))
        p_d, s_d, loss_d = step_d(p_d, s_d, x[:, :16], y[:, :16])
        assert abs(float(loss_r) - float(loss_d)) <= tol, (i, float(loss_r), float(loss_d))
    drift = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p_r), jax.tree.leaves(p_d)))
    assert drift <= tol, drift


def test_flax_attention_fn_raises_on_mask_and_dropout():
    import flax.linen as nn

    mesh = _mesh((2,), ("sp",))
    fn = jax_ring.flax.ring_attention_fn(is_causal=True, mesh=mesh, axis_name="sp")
    x = jnp.ones((1, 8, 16))
    with pytest.raises(ValueError, match="is_causal=True"):
        nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn).init(jax.random.key(0), x,
                                                                          mask=nn.make_causal_mask(x[..., 0]))
    with pytest.raises(ValueError, match="dropout"):
        m = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn, dropout_rate=0.1, deterministic=False)
        m.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)


def test_flax_nnx_multi_head_attention():
    """nnx.MultiHeadAttention(attention_fn=...) equals its own attention with a causal mask (where the installed
    flax's nnx imports: flax 0.12's nnx does not on jax 0.11)."""
    nnx = pytest.importorskip("flax.nnx", reason="this flax's nnx does not import on this jax")
    mesh = _mesh((2,), ("sp",))
    fn = jax_ring.flax.ring_attention_fn(is_causal=True, mesh=mesh, axis_name="sp")
    ring = nnx.MultiHeadAttention(num_heads=4, in_features=32, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
    dense = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, 32)), jnp.float32)
    got = jax.jit(lambda x: ring(x))(jax.device_put(x, NamedSharding(mesh, P(None, "sp"))))
    want = dense(x, mask=nnx.make_causal_mask(x[..., 0]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=testing.TOLERANCES["float32"]["grad"])


def test_explicit_axes_spec_gives_the_axis():
    """A ("dp", "sp") mesh of Explicit axes: under jit the query's spec names the sequence axis (no axis_name)
    and the batch axis keeps "dp", forward and gradient."""
    from jax.sharding import AxisType

    _mesh((2, 2), ("dp", "sp"))  # skips without 4 devices
    mesh = jax.make_mesh((2, 2), ("dp", "sp"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices("cpu")[:4])
    ref, (q, k, v) = _inputs(6, 2, 12, 4, 2, 16)
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, NamedSharding(mesh, P("dp", "sp"))) for x in (q, k, v)]
        out = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(q, k, v, is_causal=True))(*args)
        assert tuple(out.sharding.spec)[:2] == ("dp", "sp")
        dq = jax.jit(jax.grad(lambda q, k, v: jax_ring.dot_product_attention(q, k, v, is_causal=True).sum()))(*args)
    _check("explicit axes", out, jax.nn.dot_product_attention(q, k, v, is_causal=True), *ref, is_causal=True)
    want = jax.grad(lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=True).sum())(q)
    g64 = reference.attention_grad(*ref, np.ones(q.shape), is_causal=True)[0]
    testing.check("explicit axes dq", np.asarray(dq), g64, np.asarray(want), "float32", "grad")
