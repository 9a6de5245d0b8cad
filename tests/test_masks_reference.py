"""Packed sequences (segment ids) and sliding windows (issue 20), on the reference layer.

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
    rows whose dout and dlse are not zero: their gradient must not depend on them."""
    b, s, h, hkv, d = 1, 7, 2, 1, 3
    q, k, v, dout = testing.random_inputs(3, b, s, h, hkv, d, "float64", with_dout=True)
    seg = np.array([[0, 0, 1, 1, 1, -1, -1]], np.int32)
    dlse = np.random.default_rng(4).standard_normal((b, h, s))
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
