"""Packed sequences (segment ids) and sliding windows, on the reference layer.

* the float64 numpy reference (ring_core.reference) against a brute-force loop over (query, key) pairs that
  spells the rule out on its own (forward) and against central differences of that loop (gradients);
* ring_core.masks.segment_ids_from_cu_seqlens, and bad segment ids / windows through check_attention_args;
* the xla ring (jax_ring.reference.ring_attention_xla) and the torch ring (torch_bridge.reference.
  ring_attention_torch) against the float64 reference, forward and gradients (through out and lse), world
  sizes 1-4, both layouts, GQA, odd seq_local, padding rows, windows crossing shard boundaries: every value
  and gradient NaN-free, padding rows exactly out 0 / lse -inf / zero gradients.

The rings are called directly (the public keywords are not wired yet): segment ids are put in layout order
with to_layout exactly like the tokens, and each rank gets its [batch, seq_local] shard.
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import numpy as np
import pytest

from ring_core import masks, reference, testing, validate
from ring_core.layout import global_positions, layout_permutation


# ------------------------------------------------------------------------------------ brute force
def _attends(i, j, *, is_causal, window, seg):
    """The rule written out for one (query i, key j) pair, independently of ring_core.masks."""
    if seg is not None and (seg[i] < 0 or seg[i] != seg[j]):
        return False
    if is_causal and j > i:
        return False
    left, right = window
    return not ((left != -1 and j < i - left) or (right != -1 and j > i + right))


def _brute(q, k, v, *, is_causal, window, segment_ids, scale=None):
    """(out, lse) pair by pair in float64; a row with no key: out 0, lse -inf."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out, lse = np.zeros(q.shape), np.full((b, h, s), -np.inf)
    for bi in range(b):
        seg = None if segment_ids is None else segment_ids[bi]
        for i in range(s):
            keys = [j for j in range(s) if _attends(i, j, is_causal=is_causal, window=window, seg=seg)]
            if not keys:
                continue
            for hi in range(h):
                sc = np.array([scale * q[bi, i, hi] @ k[bi, j, hi // g] for j in keys])
                mx = sc.max()
                p = np.exp(sc - mx)
                lse[bi, hi, i] = mx + np.log(p.sum())
                out[bi, i, hi] = (p / p.sum()) @ v[bi, keys, hi // g]
    return out, lse


def _seg(seed, b, s, *, padding=True, max_len=None):
    return testing.random_segment_ids(seed, b, s, padding=padding, max_len=max_len)


WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (2, 1), (1, 4), (0, -1)]
REF_CASES = [(causal, window, seg) for causal in (False, True) for window in WINDOWS for seg in ("none", "packed")]


@pytest.mark.parametrize("is_causal,window,seg", REF_CASES,
                         ids=[f"{'causal' if c else 'full'}-w{w[0]},{w[1]}-{s}" for c, w, s in REF_CASES])
def test_reference_matches_brute_force(is_causal, window, seg):
    b, s, h, hkv, d = 2, 9, 4, 2, 5
    rng_seed = zlib.crc32(f"{is_causal}{window}{seg}".encode())
    q, k, v = testing.random_inputs(rng_seed, b, s, h, hkv, d, "float64")
    seg_ids = None if seg == "none" else _seg(rng_seed, b, s, max_len=4)
    if seg_ids is not None:
        seg_ids[1, -2:] = -1  # padding at least in one row
        seg_ids[0, 2] = -3  # any negative id is padding, also between segments
    out, lse = reference.attention(q, k, v, is_causal=is_causal, window=window, segment_ids=seg_ids)
    want_out, want_lse = _brute(q, k, v, is_causal=is_causal, window=window, segment_ids=seg_ids)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-13)
    if seg_ids is not None:
        assert (out[seg_ids < 0] == 0).all() and np.isneginf(lse.transpose(0, 2, 1)[seg_ids < 0]).all()
    # the same-precision references share the masks
    for dtype in ("float32", "bfloat16"):
        lo, ll = reference.attention_lowp(q, k, v, dtype, is_causal=is_causal, window=window, segment_ids=seg_ids)
        assert np.isfinite(lo).all() and (np.isneginf(ll) == np.isneginf(want_lse)).all()
        assert testing.max_abs_err(ll, want_lse) < 5e-2 and testing.max_abs_err(lo, want_out) < 5e-2


def _central_differences(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        g[idx] = (f(xp) - f(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("is_causal,window", [(False, (-1, -1)), (True, (2, -1)), (False, (1, 2)), (True, (0, 0))])
def test_reference_grads_match_brute_force(is_causal, window):
    """attention_grad (through out and lse) against central differences of the brute-force loop, with padding
    rows whose dout is not zero and whose dlse is not even finite: their gradients must not depend on them."""
    b, s, h, hkv, d = 1, 7, 2, 1, 3
    q, k, v, dout = testing.random_inputs(3, b, s, h, hkv, d, "float64", with_dout=True)
    seg = np.array([[0, 0, 1, 1, 1, -1, -1]], np.int32)
    dlse = np.random.default_rng(4).standard_normal((b, h, s))
    dlse[:, :, 5] = np.inf  # lse is the constant -inf on a padding row: its cotangent is ignored, even inf
    kw = dict(is_causal=is_causal, window=window, segment_ids=seg)

    def loss(q, k, v):
        out, lse = _brute(q, k, v, **kw)
        return float((out * dout).sum() + np.where(np.isfinite(lse), lse * dlse, 0).sum())

    want = [_central_differences(lambda x: loss(x, k, v), q), _central_differences(lambda x: loss(q, x, v), k),
            _central_differences(lambda x: loss(q, k, x), v)]
    got = reference.attention_grad(q, k, v, dout, dlse=dlse, **kw)
    for name, a, w in zip("qkv", got, want):
        np.testing.assert_allclose(a, w, rtol=0, atol=1e-7, err_msg=f"d{name}")
        assert (a[seg < 0] == 0).all(), f"d{name} of padding rows"
    for dtype in ("float32", "bfloat16"):
        low = reference.attention_grad_lowp(q, k, v, dout, dtype, dlse=dlse, **kw)
        assert all(np.isfinite(x).all() and (x[seg < 0] == 0).all() for x in low)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float32"])
@pytest.mark.parametrize("is_causal, window, seg", [(True, None, False), (False, (5, 3), True), (True, (7, -1), True)])
def test_reference_of_some_query_rows_is_those_rows(dtype, is_causal, window, seg):
    """``q_rows`` (one rank's shard of queries, in its layout's order) gives the rows of the whole reference,
    masks included: what the GPU scripts compute per rank at 1/W of the cost."""
    q, k, v = testing.random_inputs(3, 2, 48, 4, 2, 16, "bfloat16")
    ids = testing.random_segment_ids(4, 2, 48, max_len=9, padding=True) if seg else None
    rows = layout_permutation(48, 4, "zigzag")[12:24]  # rank 1 of 4, zigzag
    kw = dict(is_causal=is_causal, window=window, segment_ids=ids)
    if dtype == "float64":
        full, part = reference.attention(q, k, v, **kw), reference.attention(q, k, v, q_rows=rows, **kw)
    else:
        full = reference.attention_lowp(q, k, v, dtype, **kw)
        part = reference.attention_lowp(q, k, v, dtype, q_rows=rows, **kw)
    # The same sums over a different batch of rows: BLAS may round float32 differently in the last bit.
    rtol = {"float64": 1e-12, "float32": 1e-6, "bfloat16": 2 ** -7}[dtype]
    np.testing.assert_allclose(part[0], full[0][:, rows], rtol=rtol, atol=rtol)
    np.testing.assert_allclose(part[1], full[1][:, :, rows], rtol=rtol, atol=rtol)
    assert np.isneginf(part[1]).sum() == np.isneginf(full[1][:, :, rows]).sum()


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float32"])
@pytest.mark.parametrize("is_causal, window, seg", [(True, None, False), (False, (5, 3), True)])
def test_gradient_reference_split_over_ranks_is_the_whole(dtype, is_causal, window, seg):
    """``attention_grad(_lowp)`` with ``q_rows`` and ``reduce``: each rank's queries' share, dk and dv summed over
    the ranks, gives the whole reference's gradients (GQA, lse gradient, masks): what tests/gpu/gpu_checks.py
    computes per rank at 1/W of the cost."""
    world, n = 4, 48
    q, k, v, dout = testing.random_inputs(6, 2, n, 4, 2, 16, "bfloat16", with_dout=True)
    dlse = np.random.default_rng(1).standard_normal((2, 4, n))
    ids = testing.random_segment_ids(4, 2, n, max_len=9, padding=True) if seg else None
    perm = layout_permutation(n, world, "zigzag")
    shares = [perm[r * n // world:(r + 1) * n // world] for r in range(world)]
    kw = dict(is_causal=is_causal, window=window, segment_ids=ids, dlse=dlse)

    def grads(**more):
        if dtype == "float64":
            return reference.attention_grad(q, k, v, dout, **kw, **more)
        return reference.attention_grad_lowp(q, k, v, dout, dtype, **kw, **more)

    full = grads()
    # The ranks' shares of dk and dv as ``reduce`` sees them, summed as an all-reduce would sum them.
    seen = []
    for rows in shares:
        grads(q_rows=rows, reduce=lambda x: seen.append(x) or x)
    total = [sum(seen[i::2]) for i in (0, 1)]
    rtol = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2 ** -7}[dtype]
    for r, rows in enumerate(shares):
        dq, dk, dv = grads(q_rows=rows, reduce=lambda x, i=iter(total): next(i).astype(x.dtype))
        np.testing.assert_allclose(dq, full[0][:, rows], rtol=rtol, atol=rtol, err_msg=f"dq of rank {r}")
        np.testing.assert_allclose(dk, full[1], rtol=rtol, atol=rtol, err_msg="dk")
        np.testing.assert_allclose(dv, full[2], rtol=rtol, atol=rtol, err_msg="dv")


def test_reference_without_masks_is_unchanged():
    """window (-1, -1) is bit for bit no window; one segment covering every token is no segment ids (up to the
    rounding of a differently laid out matmul)."""
    q, k, v, dout = testing.random_inputs(5, 1, 8, 2, 2, 4, "float64", with_dout=True)
    for causal in (False, True):
        a = reference.attention(q, k, v, is_causal=causal)
        b = reference.attention(q, k, v, is_causal=causal, window=(-1, -1))
        c = reference.attention(q, k, v, is_causal=causal, segment_ids=np.zeros((1, 8), np.int32))
        for x, y, z in zip(a, b, c):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_allclose(x, z, rtol=0, atol=1e-14)
    # causal is the window (-1, 0)
    for x, y in zip(reference.attention(q, k, v, is_causal=True), reference.attention(q, k, v, window=(-1, 0))):
        np.testing.assert_array_equal(x, y)


def test_all_padding_is_zero_and_finite():
    q, k, v, dout = testing.random_inputs(6, 1, 4, 2, 1, 4, "float64", with_dout=True)
    seg = np.full((1, 4), -1, np.int32)
    out, lse = reference.attention(q, k, v, is_causal=True, segment_ids=seg)
    assert (out == 0).all() and np.isneginf(lse).all()
    for g in reference.attention_grad(q, k, v, dout, segment_ids=seg, dlse=np.ones((1, 2, 4))):
        assert (g == 0).all()


# ------------------------------------------------------------------------------------- masks module
def test_allowed_shapes_and_no_mask():
    pos = np.arange(5)
    assert masks.allowed(pos, pos, is_causal=False) is None
    assert not masks.is_masked(is_causal=False) and masks.is_masked(is_causal=False, window=(4, -1))
    assert masks.allowed(pos, pos, is_causal=True).shape == (5, 5)
    seg = np.zeros((3, 5), np.int32)
    assert masks.allowed(pos, pos, is_causal=False, q_segment_ids=seg, k_segment_ids=seg).shape == (3, 1, 1, 5, 5)
    assert masks.allowed(pos, pos[:2], is_causal=True, q_segment_ids=seg, k_segment_ids=seg[:, :2],
                         head_axes=1).shape == (3, 1, 5, 2)
    with pytest.raises(ValueError, match="both"):
        masks.allowed(pos, pos, is_causal=False, q_segment_ids=seg)


@pytest.mark.parametrize("cu,seq_len,want", [
    ([0, 3, 5], 7, [0, 0, 0, 1, 1, -1, -1]),
    ([0, 4], 4, [0, 0, 0, 0]),
    ([0, 2, 2, 3], 4, [0, 0, 2, -1]),  # an empty sequence keeps its id
    ([0], 3, [-1, -1, -1]),
    (np.array([0, 1, 2, 3], np.int64), 3, [0, 1, 2]),
    ([0, 0], 0, []),
])
def test_segment_ids_from_cu_seqlens(cu, seq_len, want):
    got = masks.segment_ids_from_cu_seqlens(cu, seq_len)
    assert got.dtype == np.int32 and got.shape == (seq_len,)
    assert got.tolist() == want


def test_segment_ids_from_cu_seqlens_batches():
    got = masks.segment_ids_from_cu_seqlens([[0, 2, 4], [0, 1, 3]], 5)
    assert got.dtype == np.int32 and got.tolist() == [[0, 0, 1, 1, -1], [0, 1, 1, -1, -1]]
    ragged = masks.segment_ids_from_cu_seqlens([[0, 5], np.array([0, 1, 2, 3], np.int32)], 5)
    assert ragged.tolist() == [[0] * 5, [0, 1, 2, -1, -1]]
    torch = pytest.importorskip("torch")
    assert masks.segment_ids_from_cu_seqlens(torch.tensor([0, 2], dtype=torch.int32), 3).tolist() == [0, 0, -1]


@pytest.mark.parametrize("cu,seq_len,exc,fragment", [
    ([1, 3], 4, ValueError, "start at 0"),
    ([0, 3, 2], 4, ValueError, "non-decreasing"),
    ([0, 5], 4, ValueError, "seq_len=4"),
    ([0.0, 2.0], 4, TypeError, "integers"),
    ([], 4, ValueError, r"\[num_sequences \+ 1\]"),
    (np.zeros((1, 1, 2), np.int32), 4, ValueError, "1-D"),
    ([0, 2], -1, ValueError, "seq_len must be an int"),
    ([0, 2], 2.0, ValueError, "seq_len must be an int"),
])
def test_segment_ids_from_cu_seqlens_bad(cu, seq_len, exc, fragment):
    with pytest.raises(exc, match=fragment):
        masks.segment_ids_from_cu_seqlens(cu, seq_len)


def test_doctests():
    import doctest

    for mod in (masks, validate):
        res = doctest.testmod(mod)
        assert res.failed == 0 and res.attempted > 0, mod.__name__


# ------------------------------------------------------------------------------------- validation
Q, KV = (2, 6, 4, 16), (2, 6, 2, 16)


def _check(**kw):
    return validate.check_attention_args(Q, KV, KV, "float32", "float32", "float32", is_causal=True, scale=None,
                                         layout="zigzag", backend="auto", backends=("auto",), **kw)


def test_spec_defaults_mean_no_mask():
    spec = _check()
    assert spec.window == (-1, -1) and spec.segmented is False
    spec = _check(window_size=(np.int64(7), 0), segment_ids_shape=(2, 6), segment_ids_dtype=np.dtype("int32"))
    assert spec.window == (7, 0) and type(spec.window[0]) is int and spec.segmented is True
    hash(spec)  # stays usable as a static argument
    assert _check(window_size=[3, -1]).window == (3, -1)


@pytest.mark.parametrize("kw,exc,fragment", [
    (dict(window_size=5), TypeError, r"pair \(left, right\)"),
    (dict(window_size=(1, 2, 3)), TypeError, r"pair \(left, right\)"),
    (dict(window_size=(-2, 0)), ValueError, "left side must be >= -1"),
    (dict(window_size=(0, -5)), ValueError, "right side must be >= -1"),
    (dict(window_size=(1.0, 0)), TypeError, "left side must be a Python int"),
    (dict(window_size=(True, 0)), TypeError, "left side must be a Python int"),
    (dict(window_size="left"), TypeError, r"pair \(left, right\)"),
    (dict(segment_ids_shape=(2, 6), segment_ids_dtype="int64"), TypeError, "segment_ids must be int32"),
    (dict(segment_ids_shape=(2, 6), segment_ids_dtype="float32"), TypeError, "segment_ids must be int32"),
    (dict(segment_ids_shape=(6,), segment_ids_dtype="int32"), ValueError, r"\[batch, seq_local\] = \[2, 6\]"),
    (dict(segment_ids_shape=(2, 12), segment_ids_dtype="int32"), ValueError, r"got shape \(2, 12\)"),
    (dict(segment_ids_shape=(1, 6), segment_ids_dtype="int32"), ValueError, r"\[batch, seq_local\]"),
    (dict(segment_ids_dtype="int32"), TypeError, "without segment_ids_shape"),
])
def test_bad_masks_raise(kw, exc, fragment):
    with pytest.raises(exc, match=fragment):
        _check(**kw)


def test_segment_ids_dtype_names_of_frameworks():
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp

    for dt in (torch.int32, jnp.zeros(1, jnp.int32).dtype, np.dtype("int32")):
        assert _check(segment_ids_shape=(2, 6), segment_ids_dtype=dt).segmented
    with pytest.raises(TypeError, match="int32.*got dtype int64"):
        _check(segment_ids_shape=torch.zeros(2, 6, dtype=torch.int64).shape, segment_ids_dtype=torch.int64)


# ------------------------------------------------------------------------------------------ rings
class Case(NamedTuple):
    world: int
    layout: str
    is_causal: bool
    window: tuple
    heads: int
    kv_heads: int
    head_dim: int
    seq_local: int
    dtype: str
    seg: str  # none | packed (random lengths, padding at the end and inside) | pad (one sequence, then padding) | cu
    batch: int = 1

    @property
    def id(self):
        return (f"W{self.world}-{self.layout[:3]}-{'causal' if self.is_causal else 'full'}-w{self.window[0]},"
                f"{self.window[1]}-h{self.heads}kv{self.kv_heads}-d{self.head_dim}-s{self.seq_local}-{self.dtype}"
                f"-{self.seg}-b{self.batch}")


C, Z = "contiguous", "zigzag"
# Windows reach across shard boundaries (seq_local 1-7), segments too (lengths up to 1.5 shards).
RING_CASES = [
    Case(1, C, True, (3, -1), 4, 2, 16, 7, "float32", "packed", 2),
    Case(1, Z, False, (1, 2), 2, 1, 16, 6, "float32", "pad"),
    Case(2, C, False, (-1, -1), 4, 2, 16, 5, "float32", "packed"),
    Case(2, Z, True, (-1, -1), 4, 1, 16, 6, "bfloat16", "packed"),
    Case(2, C, True, (0, 0), 2, 2, 16, 3, "float32", "none"),
    Case(2, Z, False, (4, 1), 4, 2, 32, 4, "float32", "none", 2),
    Case(3, C, False, (2, 5), 2, 1, 16, 3, "float32", "cu"),
    Case(3, Z, True, (5, -1), 4, 2, 16, 4, "bfloat16", "pad"),
    Case(4, C, True, (6, -1), 4, 2, 16, 3, "float32", "packed"),
    Case(4, Z, False, (-1, 3), 2, 2, 16, 4, "float32", "packed", 2),
    Case(4, Z, True, (3, -1), 4, 1, 16, 2, "float32", "cu"),
    Case(4, C, False, (0, 0), 2, 1, 16, 1, "float32", "packed"),
]
TORCH_ONLY = [Case(2, C, True, (2, -1), 2, 1, 16, 5, "float64", "packed"),
              Case(3, Z, False, (-1, -1), 4, 2, 16, 4, "float64", "pad", 2)]


def _case_inputs(case: Case):
    """Natural-order globals: q, k, v, dout (rounded to the dtype), dlse (inf on padding rows) and the segment
    ids (None for seg="none")."""
    seed = zlib.crc32(case.id.encode())
    b, n = case.batch, case.world * case.seq_local
    q, k, v, dout = testing.random_inputs(seed, b, n, case.heads, case.kv_heads, case.head_dim, case.dtype,
                                          with_dout=True)
    dlse = np.random.default_rng(seed + 1).standard_normal((b, case.heads, n))
    rng = np.random.default_rng(seed + 2)
    if case.seg == "none":
        seg = None
    elif case.seg == "packed":
        seg = testing.random_segment_ids(seed, b, n, max_len=max(2, 3 * case.seq_local // 2))
        seg[0, -1] = -1
        if n >= 4:
            seg[-1, n // 2] = -1  # padding inside a row, on a middle rank
    elif case.seg == "pad":
        lengths = rng.integers(max(1, n // 3), n, size=b)
        seg = np.where(np.arange(n)[None] < lengths[:, None], 0, -1).astype(np.int32)
    else:  # cu: flash-attn varlen lengths, the same packing in every batch row
        cu = np.concatenate([[0], np.cumsum(rng.integers(1, case.seq_local + 2, size=n))])
        cu = cu[cu <= n - 1]
        seg = np.repeat(masks.segment_ids_from_cu_seqlens(cu, n)[None], b, 0)
    if seg is not None:  # lse is the constant -inf on padding rows: its cotangent there is ignored, even inf
        dlse = np.where((seg < 0)[:, None, :], np.inf, dlse)
    return q, k, v, dout, dlse, seg


def _spec(case: Case, backend):
    shp = lambda h: (case.batch, case.seq_local, h, case.head_dim)
    seg = case.seg != "none"
    return validate.check_attention_args(
        shp(case.heads), shp(case.kv_heads), shp(case.kv_heads), case.dtype, case.dtype, case.dtype,
        is_causal=case.is_causal, scale=None, layout=case.layout, backend=backend, backends=(backend,),
        window_size=case.window, segment_ids_shape=(case.batch, case.seq_local) if seg else None,
        segment_ids_dtype="int32" if seg else None)


def _to_layout(x, case, axis=1):
    return np.take(x, layout_permutation(x.shape[axis], case.world, case.layout), axis=axis)


def _from_layout(x, case, axis=1):
    return np.take(x, np.argsort(layout_permutation(x.shape[axis], case.world, case.layout)), axis=axis)


def _check_ring(name, case: Case, out, lse, grads):
    """Ring results (natural order, float64 numpy) against the float64 reference; padding rows exact."""
    q, k, v, dout, dlse, seg = _case_inputs(case)
    mask = dict(segment_ids=seg, window=case.window)
    for x in (out, *grads):
        assert np.isfinite(x).all(), f"{name}: NaN/Inf"
    assert not np.isnan(lse).any() and not np.isposinf(lse).any(), f"{name}: lse NaN/+Inf"
    testing.check_attention(name, out, lse, q, k, v, case.dtype, is_causal=case.is_causal, **mask)
    testing.check_grads(name, grads, q, k, v, dout, case.dtype, is_causal=case.is_causal, dlse=dlse, **mask)
    if seg is not None:
        pad = seg < 0
        assert (out[pad] == 0).all() and np.isneginf(lse.transpose(0, 2, 1)[pad]).all(), name
        assert np.isfinite(lse.transpose(0, 2, 1)[~pad]).all(), name
        for n, g in zip("qkv", grads):
            assert (g[pad] == 0).all(), f"{name}: d{n} of padding tokens not 0"
    else:
        assert np.isfinite(lse).all()


# -------------------------------------------------------------------- xla ring
def _xla_ring(mesh, case: Case):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_ring import _platform
    from jax_ring.reference import ring_attention_xla

    q, k, v, dout, dlse, seg = _case_inputs(case)
    jdt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[case.dtype]
    args = [jnp.asarray(_to_layout(x, case), jnp.float32).astype(jdt) for x in (q, k, v)]
    cots = (jnp.asarray(_to_layout(dout, case), jnp.float32).astype(jdt),
            jnp.asarray(_to_layout(dlse, case, axis=2), jnp.float32))
    spec = _spec(case, "xla")
    ax = "sp"
    if seg is None:
        seg_arg, seg_spec = (), ()
    else:
        seg_arg, seg_spec = (jnp.asarray(_to_layout(seg, case), jnp.int32),), (P(None, ax),)

    def ring(q, k, v, *seg):
        return ring_attention_xla(q, k, v, axis_name=ax, spec=spec, return_lse=True,
                                  segment_ids=seg[0] if seg else None)

    f = _platform.shard_map(ring, mesh=mesh, in_specs=(P(None, ax),) * 3 + seg_spec,
                            out_specs=(P(None, ax), P(None, None, ax)))

    @jax.jit
    def fwd_bwd(q, k, v, cots, *seg):
        (out, lse), pull = jax.vjp(lambda q, k, v: f(q, k, v, *seg), q, k, v)
        return out, lse, pull(cots)

    out, lse, grads = fwd_bwd(*args, cots, *seg_arg)
    for g, x in zip(grads, args):
        assert g.dtype == x.dtype and g.shape == x.shape
    assert out.dtype == jdt and lse.dtype == jnp.float32
    to_np = lambda x, axis=1: _from_layout(np.asarray(jnp.asarray(x, jnp.float32), np.float64), case, axis)
    return to_np(out), to_np(lse, 2), [to_np(g) for g in grads]


@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: c.id)
def test_xla_ring(cpu_mesh, case):
    out, lse, grads = _xla_ring(cpu_mesh(case.world), case)
    _check_ring(f"xla {case.id}", case, out, lse, grads)


def test_xla_dense_attention_masks():
    """jax_ring.reference.dense_attention (one device) takes the same masks; padding stays NaN-free."""
    import jax
    import jax.numpy as jnp

    from jax_ring.reference import dense_attention

    case = Case(1, C, True, (2, -1), 4, 2, 16, 8, "float32", "packed", 2)
    q, k, v, dout, dlse, seg = _case_inputs(case)
    f = lambda q, k, v: dense_attention(q, k, v, is_causal=True, window=(2, -1), segment_ids=jnp.asarray(seg))
    (out, lse), pull = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    grads = pull((jnp.asarray(dout, jnp.float32), jnp.asarray(dlse, jnp.float32)))
    as64 = lambda x: np.asarray(x, np.float64)
    _check_ring("dense", case, as64(out), as64(lse), [as64(g) for g in grads])


def test_xla_ring_segment_ids_must_match_spec(cpu_mesh):
    import jax.numpy as jnp

    from jax_ring.reference import ring_attention_xla

    case = Case(1, C, False, (-1, -1), 2, 2, 16, 4, "float32", "packed")
    x = jnp.zeros((1, 4, 2, 16))
    with pytest.raises(ValueError, match="segment_ids given but spec.segmented is False"):
        ring_attention_xla(x, x, x, axis_name="sp", spec=_spec(case._replace(seg="none"), "xla"),
                           segment_ids=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids missing"):
        ring_attention_xla(x, x, x, axis_name="sp", spec=_spec(case, "xla"))


# -------------------------------------------------------------------- torch ring
def _torch_task(rank, world, case: Case):
    import torch

    from torch_bridge.reference import ring_attention_torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[case.dtype]
    q, k, v, dout, dlse, seg = _case_inputs(case)
    sl = slice(rank * case.seq_local, (rank + 1) * case.seq_local)
    shard = lambda x, axis=1: torch.from_numpy(np.ascontiguousarray(
        np.take(_to_layout(x, case, axis), np.arange(x.shape[axis])[sl], axis=axis)))
    ql, kl, vl = (shard(x).to(dt).requires_grad_() for x in (q, k, v))
    seg_l = None if seg is None else shard(seg)
    assert seg_l is None or seg_l.dtype == torch.int32
    peers = ((rank + 1) % world, (rank - 1) % world) if world > 1 else None
    out, lse = ring_attention_torch(ql, kl, vl, _spec(case, "torch"), rank, world, peers, segment_ids=seg_l)
    assert out.dtype == dt and lse.dtype == (torch.float64 if dt == torch.float64 else torch.float32)
    torch.autograd.backward((out, lse), (shard(dout).to(dt), shard(dlse, 2).to(lse.dtype)))
    to_np = lambda t: t.detach().to(torch.float64).numpy()
    return to_np(out), to_np(lse), [to_np(t.grad) for t in (ql, kl, vl)]


@pytest.mark.parametrize("case", RING_CASES + TORCH_ONLY, ids=lambda c: c.id)
def test_torch_ring(torch_group, case):
    res = [_torch_task(0, 1, case)] if case.world == 1 else torch_group(case.world).run(_torch_task, case)
    cat = lambda i, axis=1, j=None: _from_layout(
        np.concatenate([r[i] if j is None else r[i][j] for r in res], axis=axis), case, axis)
    _check_ring(f"torch {case.id}", case, cat(0), cat(1, 2), [cat(2, 1, j) for j in range(3)])


def test_torch_ring_segment_ids_must_match_spec():
    import torch

    from torch_bridge.reference import ring_attention_torch

    case = Case(1, C, False, (-1, -1), 2, 2, 16, 4, "float32", "packed")
    x = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="segment_ids given but spec.segmented is False"):
        ring_attention_torch(x, x, x, _spec(case._replace(seg="none"), "torch"), 0, 1,
                             segment_ids=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="segment_ids missing"):
        ring_attention_torch(x, x, x, _spec(case, "torch"), 0, 1)


def _torch_partial_task(rank, world, case: Case):
    """autograd.grad for q only, then for k and v only (q not requiring grad): the riders add no backward
    exchange, so pruned graphs stay matched across ranks; both agree with a full backward."""
    import torch

    from torch_bridge.reference import ring_attention_torch

    q, k, v, dout, _, seg = _case_inputs(case)
    shard = lambda x: torch.from_numpy(np.ascontiguousarray(
        _to_layout(x, case)[:, rank * case.seq_local:(rank + 1) * case.seq_local]))
    ql, kl, vl = (shard(x).float().requires_grad_() for x in (q, k, v))
    do, seg_l = shard(dout).float(), shard(seg)
    peers = ((rank + 1) % world, (rank - 1) % world)
    call = lambda q: ring_attention_torch(q, kl, vl, _spec(case, "torch"), rank, world, peers, segment_ids=seg_l)[0]
    (dq_only,) = torch.autograd.grad((call(ql) * do).sum(), [ql])
    dk_only, dv_only = torch.autograd.grad((call(ql.detach()) * do).sum(), [kl, vl])
    (call(ql) * do).sum().backward()
    return [t.detach().numpy() for t in (dq_only, ql.grad, dk_only, kl.grad, dv_only, vl.grad)]


def test_torch_ring_partial_grads_with_segments(torch_group):
    case = Case(3, Z, True, (3, -1), 2, 1, 16, 4, "float32", "packed")
    for res in torch_group(3).run(_torch_partial_task, case, timeout=60):
        for a, b in zip(res[::2], res[1::2]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
