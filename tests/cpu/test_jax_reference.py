"""CPU tests of the JAX frontend's reference ring (backend="xla") against the float64 numpy reference.

Inputs come from ring_core.testing.random_inputs (global, natural order), go through jax_ring.to_layout before
sharding over a mesh of forced host devices (tests/conftest.py), and come back through from_layout.
"""

import inspect
import itertools
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import api
from ring_core import testing

AX = "sp"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _jax(x, dtype):
    """float64 numpy values already rounded to ``dtype`` -> exact jax array of ``dtype``."""
    return jnp.asarray(np.asarray(x, np.float32)).astype(DTYPES[dtype])


def _np(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _run(mesh, q, k, v, dtype, *, world, layout, **kw):
    """Run ring_attention_sharded on natural-order numpy inputs; results back in natural order."""
    args = [_jax(jax_ring.to_layout(x, layout, world), dtype) for x in (q, k, v)]
    res = jax_ring.ring_attention_sharded(*args, mesh=mesh, axis_name=AX, layout=layout, **kw)
    if kw.get("return_lse"):
        out, lse = res
        return out, jax_ring.from_layout(_np(lse), layout, world, seq_axis=2), lse
    return res, None, None


# ------------------------------------------------------------------------------------------- forward
# A pairwise covering set (checked by test_cases_cover_all_pairs) of
#   world, layout, causal, group (= heads // kv_heads), head_dim, dtype, return_lse,
# with seq_local values that are not multiples of any block size (odd ones only where the layout allows).
# world layout causal heads kv_heads head_dim seq_local dtype return_lse batch
CASES = """
1 contiguous F 2 2 16 1 float32 T 1
1 contiguous T 4 1 64 3 bfloat16 F 2
1 zigzag T 4 2 80 6 float16 T 1
1 zigzag F 3 3 128 10 float32 F 1
1 contiguous T 2 1 16 17 float16 F 1
2 contiguous F 4 2 16 3 float32 F 2
2 contiguous T 4 4 64 1 float32 T 1
2 contiguous T 4 1 80 17 bfloat16 T 1
2 contiguous F 2 1 128 6 float16 T 1
2 zigzag T 2 2 16 10 bfloat16 F 2
2 zigzag F 4 1 64 2 float16 F 1
2 zigzag T 4 2 128 6 float32 T 1
2 zigzag T 3 3 80 4 float32 T 1
4 contiguous T 2 2 16 6 float16 T 1
4 contiguous F 4 1 16 10 bfloat16 T 1
4 contiguous T 4 2 64 3 float32 F 1
4 contiguous F 3 3 80 1 bfloat16 F 2
4 contiguous T 4 1 128 17 float32 T 1
4 zigzag T 4 1 16 2 float32 T 2
4 zigzag F 2 2 64 10 float32 T 1
4 zigzag T 4 2 80 6 bfloat16 F 1
4 zigzag T 2 1 128 8 float16 T 1
4 zigzag F 4 4 16 24 float16 F 1
4 contiguous T 4 2 16 24 bfloat16 T 1
2 contiguous T 2 2 64 10 float16 F 1
4 zigzag T 4 4 64 4 bfloat16 T 1
1 contiguous F 4 2 64 24 bfloat16 T 1
2 zigzag F 4 4 80 12 float16 T 2
4 contiguous F 2 1 80 3 float16 F 1
2 contiguous F 3 3 16 17 bfloat16 T 1
1 zigzag T 2 1 16 2 bfloat16 T 1
4 contiguous T 3 3 128 1 float16 T 1
2 zigzag T 4 1 16 14 float32 F 1
4 zigzag F 4 2 128 2 bfloat16 T 1
1 contiguous T 4 4 80 6 float32 T 1
2 contiguous T 4 2 128 6 bfloat16 F 1
"""


def _parse(line):
    w, layout, causal, h, hkv, d, s, dtype, lse, b = line.split()
    return dict(world=int(w), layout=layout, is_causal=causal == "T", heads=int(h), kv_heads=int(hkv),
                head_dim=int(d), seq_local=int(s), dtype=dtype, return_lse=lse == "T", batch=int(b))


FORWARD = [_parse(line) for line in CASES.strip().splitlines()]


def _case_id(c):
    return (f"W{c['world']}-{c['layout'][:3]}-{'causal' if c['is_causal'] else 'full'}-h{c['heads']}kv{c['kv_heads']}"
            f"-d{c['head_dim']}-s{c['seq_local']}-{c['dtype']}{'-lse' if c['return_lse'] else ''}-b{c['batch']}")


def test_cases_cover_all_pairs():
    keys = ("world", "layout", "is_causal", "group", "head_dim", "dtype", "return_lse")
    rows = [dict(c, group=c["heads"] // c["kv_heads"]) for c in FORWARD]
    values = {k: {1, 2, 4} if k in ("world", "group") else {r[k] for r in rows} for k in keys}
    assert values["head_dim"] == {16, 64, 80, 128} and values["dtype"] == set(DTYPES)
    for a, b in itertools.combinations(keys, 2):
        have = {(r[a], r[b]) for r in rows}
        missing = set(itertools.product(values[a], values[b])) - have
        assert not missing, f"no case covers ({a}, {b}) = {sorted(missing, key=str)}"
    assert {c["seq_local"] for c in FORWARD} >= {1, 3, 6, 10, 17}


@pytest.mark.parametrize("c", FORWARD, ids=_case_id)
def test_forward(cpu_mesh, c):
    w, layout, dtype = c["world"], c["layout"], c["dtype"]
    q, k, v = testing.random_inputs(zlib.crc32(_case_id(c).encode()), c["batch"], w * c["seq_local"], c["heads"],
                                    c["kv_heads"], c["head_dim"], dtype)
    out, lse, lse_raw = _run(cpu_mesh(w), q, k, v, dtype, world=w, layout=layout, is_causal=c["is_causal"],
                             return_lse=c["return_lse"], backend="xla")
    assert out.dtype == DTYPES[dtype] and out.shape == q.shape
    if c["return_lse"]:
        assert lse_raw.dtype == jnp.float32 and lse_raw.shape == (c["batch"], c["heads"], w * c["seq_local"])
    out = jax_ring.from_layout(_np(out), layout, w)
    testing.check_attention(_case_id(c), out, lse, q, k, v, dtype, is_causal=c["is_causal"])


@pytest.mark.parametrize("world,layout,scale", [(2, "zigzag", 0.37), (4, "contiguous", 0.0),
                                                (2, "contiguous", np.float32(2.5))])
def test_explicit_scale(cpu_mesh, world, layout, scale):
    q, k, v = testing.random_inputs(7, 1, world * 4, 4, 2, 32, "float32")
    out, lse, _ = _run(cpu_mesh(world), q, k, v, "float32", world=world, layout=layout, is_causal=True,
                       scale=scale, return_lse=True)
    out = jax_ring.from_layout(_np(out), layout, world)
    testing.check_attention("scale", out, lse, q, k, v, "float32", is_causal=True, scale=float(scale))


def test_auto_backend_is_xla_on_cpu(cpu_mesh):
    assert api._fused_available() is False
    q, k, v = testing.random_inputs(3, 1, 8, 2, 1, 16, "float32")
    auto, _, _ = _run(cpu_mesh(2), q, k, v, "float32", world=2, layout="zigzag", is_causal=True)
    xla, _, _ = _run(cpu_mesh(2), q, k, v, "float32", world=2, layout="zigzag", is_causal=True, backend="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))


def test_numpy_inputs_accepted(cpu_mesh):
    """Plain numpy (float32) arrays go straight in, per rank and globally."""
    mesh = cpu_mesh(2)
    q, k, v = (x.astype(np.float32) for x in testing.random_inputs(4, 1, 6, 2, 2, 16, "float32"))
    out = jax_ring.ring_attention_sharded(q, k, v, mesh=mesh, axis_name=AX, is_causal=True)
    testing.check_attention("numpy", _np(out), None, q, k, v, "float32", is_causal=True)


# ----------------------------------------------------------------------------------------- gradients
GRADS = [  # world, layout, causal, heads, kv_heads, head_dim, seq_local, dtype
    (2, "contiguous", True, 2, 2, 16, 3, "float32"),
    (4, "zigzag", True, 4, 1, 64, 4, "float32"),
    (4, "contiguous", True, 4, 1, 16, 1, "float32"),  # MQA; ranks see fully masked later blocks
    (4, "contiguous", False, 4, 2, 80, 3, "bfloat16"),
    (2, "zigzag", True, 4, 2, 16, 6, "float16"),
    (1, "contiguous", True, 2, 1, 128, 5, "float32"),
]


@pytest.mark.parametrize("world,layout,causal,h,hkv,d,s,dtype", GRADS,
                         ids=[f"W{g[0]}-{g[1][:3]}-{'causal' if g[2] else 'full'}-h{g[3]}kv{g[4]}-d{g[5]}-s{g[6]}-{g[7]}"
                              for g in GRADS])
def test_grads(cpu_mesh, world, layout, causal, h, hkv, d, s, dtype):
    mesh = cpu_mesh(world)
    q, k, v, dout = testing.random_inputs(11 + world + s, 1, world * s, h, hkv, d, dtype, with_dout=True)
    args = [_jax(jax_ring.to_layout(x, layout, world), dtype) for x in (q, k, v)]
    do = jnp.asarray(jax_ring.to_layout(dout, layout, world), jnp.float32)

    def loss(q, k, v):
        out = jax_ring.ring_attention_sharded(q, k, v, mesh=mesh, axis_name=AX, is_causal=causal, layout=layout,
                                              backend="xla")
        return jnp.sum(out.astype(jnp.float32) * do)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    for g, x in zip(grads, args):
        assert g.dtype == x.dtype and g.shape == x.shape
    grads = [jax_ring.from_layout(_np(g), layout, world) for g in grads]
    testing.check_grads("grads", grads, q, k, v, dout, dtype, is_causal=causal)


def test_grads_with_lse_output_are_finite(cpu_mesh):
    """Differentiating through out and lse together (fully masked blocks included) gives no NaN."""
    mesh = cpu_mesh(4)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in testing.random_inputs(5, 1, 8, 2, 1, 16, "float32"))

    def loss(q, k, v):
        out, lse = jax_ring.ring_attention_sharded(q, k, v, mesh=mesh, axis_name=AX, is_causal=True,
                                                   return_lse=True)
        return jnp.sum(out) + jnp.sum(lse)

    for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
        assert np.isfinite(np.asarray(g)).all()


# ------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_layout_round_trip(layout, world):
    x = np.random.default_rng(0).standard_normal((2, 8 * world, 3, 5))
    y = jax_ring.to_layout(x, layout, world)
    assert isinstance(y, np.ndarray)
    np.testing.assert_array_equal(jax_ring.from_layout(y, layout, world), x)
    xj = jnp.asarray(x, jnp.float32)
    yj = jax_ring.to_layout(xj, layout, world)
    assert isinstance(yj, jax.Array)
    np.testing.assert_array_equal(np.asarray(yj), y.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(jax_ring.from_layout(yj, layout, world)), np.asarray(xj))
    lse = np.arange(2 * 3 * 8 * world).reshape(2, 3, 8 * world)
    np.testing.assert_array_equal(jax_ring.from_layout(jax_ring.to_layout(lse, layout, world, seq_axis=2), layout,
                                                       world, seq_axis=-1), lse)


def test_zigzag_ordering():
    # world 2, 8 tokens: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
    np.testing.assert_array_equal(jax_ring.to_layout(np.arange(8), "zigzag", 2, seq_axis=0),
                                  [0, 1, 6, 7, 2, 3, 4, 5])
    # world 4, 16 tokens: 8 chunks of 2: rank r holds chunk r then chunk 7 - r.
    got = np.asarray(jax_ring.to_layout(jnp.arange(16)[None], "zigzag", 4)).reshape(4, 4)
    np.testing.assert_array_equal(got, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
    np.testing.assert_array_equal(jax_ring.to_layout(np.arange(12)[None], "contiguous", 3)[0], np.arange(12))


@pytest.mark.parametrize("call,exc,fragment", [
    (lambda: jax_ring.to_layout(np.zeros((1, 6)), "zigzag", 2), ValueError, r"multiple of 2\*world_size"),
    (lambda: jax_ring.to_layout(np.zeros((1, 6)), "contiguous", 4), ValueError, "not divisible by world_size"),
    (lambda: jax_ring.to_layout(np.zeros((1, 8)), "striped", 2), ValueError, "layout must be one of"),
    (lambda: jax_ring.from_layout(np.zeros((1, 8)), "zigzag", 0), ValueError, "world_size must be a positive int"),
    (lambda: jax_ring.to_layout(np.zeros((1, 8)), "zigzag", 2, seq_axis=2), ValueError, "seq_axis"),
])
def test_layout_bad_args(call, exc, fragment):
    with pytest.raises(exc, match=fragment):
        call()


# ---------------------------------------------------------------------------- sharded wrapper, jit
@pytest.mark.parametrize("return_lse", [False, True])
def test_sharded_equals_manual_shard_map(cpu_mesh, return_lse):
    mesh = cpu_mesh(4)
    q, k, v = (jnp.asarray(jax_ring.to_layout(x, "zigzag", 4), jnp.float32)
               for x in testing.random_inputs(9, 2, 16, 4, 2, 16, "float32"))
    kw = dict(is_causal=True, layout="zigzag", return_lse=return_lse, backend="xla")
    got = jax_ring.ring_attention_sharded(q, k, v, mesh=mesh, axis_name=AX, **kw)
    out_specs = (P(None, AX), P(None, None, AX)) if return_lse else P(None, AX)
    want = jax.jit(jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name=AX, **kw), mesh=mesh,
                                 in_specs=(P(None, AX),) * 3, out_specs=out_specs))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jit_two_shapes_in_one_program(cpu_mesh):
    mesh = cpu_mesh(2)
    kw = dict(mesh=mesh, axis_name=AX, is_causal=True, layout="zigzag", backend="xla")
    a = testing.random_inputs(1, 1, 8, 4, 2, 16, "float32")
    b = testing.random_inputs(2, 2, 12, 2, 1, 32, "float32")

    @jax.jit
    def f(a, b):
        return (jax_ring.ring_attention_sharded(*a, **kw),
                jax_ring.ring_attention_sharded(*b, return_lse=True, **kw))

    to = lambda xs: [jnp.asarray(jax_ring.to_layout(x, "zigzag", 2), jnp.float32) for x in xs]
    out_a, (out_b, lse_b) = f(to(a), to(b))
    testing.check_attention("jit a", jax_ring.from_layout(_np(out_a), "zigzag", 2), None, *a, "float32",
                            is_causal=True)
    testing.check_attention("jit b", jax_ring.from_layout(_np(out_b), "zigzag", 2),
                            jax_ring.from_layout(_np(lse_b), "zigzag", 2, seq_axis=2), *b, "float32", is_causal=True)
    # The ring really passes K/V around (W - 1 = 1 permute of a (k, v) pair per call) in the compiled program.
    hlo = f.lower(to(a), to(b)).as_text()
    assert hlo.count("collective_permute") >= 2


def test_world_one_has_no_collectives(cpu_mesh):
    q = k = v = jnp.ones((1, 4, 2, 16))
    hlo = jax.jit(lambda q, k, v: jax_ring.ring_attention_sharded(q, k, v, mesh=cpu_mesh(1), axis_name=AX)
                  ).lower(q, k, v).as_text()
    assert "collective_permute" not in hlo


# ----------------------------------------------------------------------------------------- bad input
# Every bad input (shapes, dtypes, flags, layouts, scale, the mesh axis, backends) is one table run through
# both frontends and the simulator: tests/cpu/test_bad_inputs.py.


# -------------------------------------------------------------------------------------- packaging, docs
def test_import_does_not_pull_jax_triton():
    code = "import sys, jax_ring; assert 'jax_triton' not in sys.modules, 'jax_triton imported'"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root)


@pytest.mark.parametrize("fn", [jax_ring.ring_attention, jax_ring.ring_attention_sharded])
def test_docstring_example_runs(fn):
    """The example block of each public docstring is runnable (needs 4 host devices, set by conftest)."""
    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 CPU devices")
    code = textwrap.dedent(inspect.getdoc(fn).split("::\n", 1)[1])
    scope = {}
    exec(compile(code, f"<{fn.__name__} docstring>", "exec"), scope)
    assert scope["out"].shape == scope["q"].shape


def test_doctests():
    import doctest

    from jax_ring import reference

    for mod in (api, reference):
        res = doctest.testmod(mod)
        assert res.failed == 0 and res.attempted > 0, mod.__name__
