"""The two-level ring (ring_core.nodes) on the CPU: the layout identity it rests on, its schedule, the head moves,
and the whole ring over W = N x R simulated ranks with the real fused kernels in the Triton interpreter inside
each node (simulate_ring_attention(_grad)(node_size=R)), against float64 with the one tolerance table."""

import numpy as np
import pytest

from ring_core import masks, nodes, reference, testing, validate
from ring_core.protocol import control
from ring_core.sim import simulate
from ring_core.layout import global_positions, layout_permutation


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("N,R", [(1, 4), (2, 1), (2, 2), (3, 2), (2, 4), (4, 2), (8, 1)])
def test_flat_layout_is_node_layout_then_local_layout(layout, N, R):
    """Global positions of rank n*R + r in the flat layout over W = N*R ranks = node n's positions in the node-level
    layout (N nodes of R*S tokens) at the local layout's positions of rank r over R ranks: the identity that lets
    node-step 0 be the one-node call."""
    S = 6
    W = N * R
    for g in range(W):
        n, r = divmod(g, R)
        node_pos = global_positions(np, n, N, R * S, layout)  # the node's R*S tokens, node-level layout
        local = global_positions(np, r, R, S, layout)  # rank r's rows among the node's, local layout
        np.testing.assert_array_equal(global_positions(np, g, W, S, layout), node_pos[local])


@pytest.mark.parametrize("N", [2, 3, 5])
def test_step_kinds_match_the_causal_mask(N):
    """Each kind says exactly which (query, key) pairs of the two nodes causal masking allows."""
    R, S = 2, 4
    W = N * R
    for layout in ("contiguous", "zigzag"):
        for n in range(N):
            for m in range(N):
                kind = nodes.step_kind(n, m, is_causal=True, layout=layout)
                qp = np.concatenate([global_positions(np, n * R + r, W, S, layout) for r in range(R)])
                kp = [global_positions(np, m * R + r, W, S, layout) for r in range(R)]
                seen = qp[:, None] >= np.concatenate(kp)[None, :]
                if kind == nodes.SKIP:
                    assert not seen.any()
                elif kind == nodes.FULL:
                    assert seen.all()
                elif kind == nodes.K_EARLY:  # every query sees exactly the first halves of the K/V shards
                    first = np.concatenate([np.arange(S) < S // 2 for _ in range(R)])
                    assert (seen == first[None, :]).all()
                elif kind == nodes.Q_LATE:  # the second halves of the query shards see everything
                    late = np.concatenate([np.arange(S) >= S // 2 for _ in range(R)])
                    assert (seen == late[:, None]).all()
                else:
                    assert kind == nodes.DIAG and n == m


def _np_ops():
    return nodes.Ops(xp=np, permute=np.transpose, cat=np.concatenate, flip=np.flip,
                     astype=lambda x, like: x.astype(like.dtype),
                     f32=lambda x: x, inner_fwd=None, inner_bwd=None, send=None, recv=None)


def test_head_moves_are_inverse_and_keep_gqa_groups():
    ops = _np_ops()
    rng = np.random.default_rng(0)
    b, s, hkv, g, d = 2, 6, 3, 2, 5
    x = rng.standard_normal((b, s, hkv * g, d))
    y = nodes.halves_to_heads(ops, x, hkv)
    np.testing.assert_array_equal(nodes.heads_to_halves(ops, y, hkv), x)
    for h2 in range(2 * hkv * g):  # head h2 of the moved array reads kv head h2 // (2g), as GQA's grouping does
        kv, half, j = h2 // (2 * g), (h2 % (2 * g)) // g, h2 % g
        np.testing.assert_array_equal(y[:, :, h2], x[:, half * s // 2:(half + 1) * s // 2, kv * g + j])
    lse = rng.standard_normal((b, hkv * g, s))
    np.testing.assert_array_equal(nodes.lse_heads_to_halves(ops, nodes.lse_halves_to_heads(ops, lse, hkv), hkv), lse)
    kv = rng.standard_normal((b, s, hkv, d))
    np.testing.assert_array_equal(nodes.kv_heads_to_halves(ops, nodes.kv_halves_to_heads(ops, kv)), kv)
    t = nodes.twice_as_heads(ops, x, hkv)
    for h2 in range(2 * hkv * g):
        np.testing.assert_array_equal(t[:, :, h2], x[:, :, (h2 // (2 * g)) * g + h2 % g])


def test_merge_of_nothing_is_nothing_and_of_parts_is_the_whole():
    ops = _np_ops()
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 2, 8))
    k, v = (rng.standard_normal((1, 8, 2, 8)) for _ in range(2))
    o1, l1 = reference.attention(q, k[:, :3], v[:, :3])
    o2, l2 = reference.attention(q, k[:, 3:], v[:, 3:])
    out, lse = nodes.merge(ops, o1, l1, o2, l2)
    ro, rl = reference.attention(q, k, v)
    np.testing.assert_allclose(out, ro, atol=1e-12)
    np.testing.assert_allclose(lse, rl, atol=1e-12)
    none_o, none_l = np.zeros_like(o1), np.full_like(l1, -np.inf)
    out, lse = nodes.merge(ops, none_o, none_l, none_o, none_l)
    assert (out == 0).all() and np.isneginf(lse).all()


def _bwd_given_out_lse(q, k, v, out, lse, dout, dlse, mask, scale):
    """The fused backward's meaning in float64: the gradients of one call's keys and values (and its share of dQ)
    from the *given* ``out`` and ``lse`` (the whole sequence's), with delta = rowsum(dout * out) - dlse; ``mask`` a
    ring_core.nodes.Mask (positions in the call's natural order, the keys' moved by its key_offset)."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    scale = 1 / np.sqrt(d) if scale is None else scale
    qg = q.reshape(b, s, hkv, g, d)
    sc = np.einsum("bqkgd,bskd->bkgqs", qg, k) * scale
    lse_g = lse.reshape(b, hkv, g, s)
    p = np.exp(sc - lse_g[..., None])
    allowed = masks.allowed(np.arange(s), np.arange(k.shape[1]) + mask.key_offset, is_causal=mask.is_causal,
                            window=mask.window)
    if allowed is not None:
        p = p * allowed
    do = dout.reshape(b, s, hkv, g, d)
    delta = np.einsum("bqkgd,bqkgd->bkgq", do, out.reshape(b, s, hkv, g, d)) - dlse.reshape(b, hkv, g, s)
    dp = np.einsum("bqkgd,bskd->bkgqs", do, v)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bkgqs,bskd->bqkgd", ds, k).reshape(b, s, h, d) * scale
    dk = np.einsum("bkgqs,bqkgd->bskd", ds, qg) * scale
    dv = np.einsum("bkgqs,bqkgd->bskd", p, do)
    return dq, dk, dv


def _reference_execute(spec_scale):
    """run_nodes' ``execute`` with float64 dense attention over the node's R shards (the one-node call's meaning),
    for quick checks of the driver at sizes the interpreter would take long over."""

    def execute(node, kind, args):
        R = len(args)
        q, k, v = (np.concatenate([a[i] for a in args], axis=1) for i in range(3))
        mask, ids = args[0][-2:]
        assert ids is None  # (segment ids: test_segment_ids_across_nodes_against_float64, the kernels)
        S = args[0][0].shape[1]
        perm = layout_permutation(R * S, R, mask.layout)  # node-local natural order of the concatenated rows
        inv = np.argsort(perm)
        nat = lambda x, ax=1: np.take(x, inv, axis=ax)  # noqa: E731
        lay = lambda x, ax=1: np.take(x, perm, axis=ax)  # noqa: E731
        if kind == "fwd":
            o, l = reference.attention(nat(q), nat(k), nat(v), is_causal=mask.is_causal, scale=spec_scale,
                                       window=mask.window, key_offset=mask.key_offset)
            o, l = lay(o), lay(l, 2)
            return [(o[:, r * S:(r + 1) * S].astype(args[0][0].dtype), l[:, :, r * S:(r + 1) * S]) for r in range(R)]
        out, dout = (np.concatenate([a[i] for a in args], axis=1) for i in (3, 5))
        lse, dlse = (np.concatenate([a[i] for a in args], axis=2) for i in (4, 6))
        g = _bwd_given_out_lse(nat(q), nat(k), nat(v), nat(out), nat(lse, 2), nat(dout), nat(dlse, 2), mask,
                               spec_scale)
        g = [lay(x) for x in g]
        return [tuple(x[:, r * S:(r + 1) * S] for x in g) for r in range(R)]

    return execute


def _driver_against_float64(layout, causal, N, R, S=8, window=masks.NO_WINDOW, HKV=2):
    """The driver with a float64 dense one-node call: out, lse and the gradients (with an lse gradient) of the
    whole sequence."""
    W, H, D = N * R, 2 * HKV, 8
    rng = np.random.default_rng(N * 10 + R)
    q, dout = (rng.standard_normal((2, W * S, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((2, W * S, HKV, D)) for _ in range(2))
    dlse = rng.standard_normal((2, H, W * S))
    perm = layout_permutation(W * S, W, layout)
    shard = lambda x, ax=1: [np.take(np.take(x, perm, axis=ax), np.arange(r * S, (r + 1) * S), axis=ax)  # noqa: E731
                             for r in range(W)]
    qs, ks, vs, ds = shard(q), shard(k), shard(v), shard(dout)
    ls = shard(dlse, 2)
    kw = dict(num_nodes=N, is_causal=causal, layout=layout, window=window, node_size=R)

    def rank_fn(rank, ops):
        out, lse = nodes.forward(ops, qs[rank], ks[rank], vs[rank], node=rank // R, **kw)
        return (out, lse, *nodes.backward(ops, qs[rank], ks[rank], vs[rank], out, lse, ds[rank], ls[rank],
                                          node=rank // R, **kw))

    spec = validate.check_attention_args(
        (2, S, H, D), (2, S, HKV, D), (2, S, HKV, D), "float32", "float32", "float32", is_causal=causal, scale=None,
        layout=layout, backend="fused", backends=("fused",), window_size=window)
    made, execute = set(), _reference_execute(None)

    def recording(node, kind, args):  # every one-node call's spec, to be among node_specs'
        made.add(nodes.inner_spec(spec, args[0][0], args[0][1], *args[0][-2:]))
        return execute(node, kind, args)

    res = simulate.run_nodes(W, R, rank_fn, recording, 60.0)
    assert made <= set(nodes.node_specs(spec, N, R)), made - set(nodes.node_specs(spec, N, R))
    inv = np.argsort(perm)
    gather = lambda i, ax=1: np.take(np.concatenate([r[i] for r in res], axis=ax), inv, axis=ax)  # noqa: E731
    ro, rl = reference.attention(q, k, v, is_causal=causal, window=window)
    np.testing.assert_allclose(gather(0), ro, atol=1e-10)
    np.testing.assert_allclose(gather(1, 2), rl, atol=1e-10)
    for i, r in zip((2, 3, 4), reference.attention_grad(q, k, v, dout, is_causal=causal, dlse=dlse, window=window)):
        np.testing.assert_allclose(gather(i), r, atol=1e-9)


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("zigzag", False)])
@pytest.mark.parametrize("N,R", [(2, 2), (3, 2), (4, 1), (2, 3), (5, 1)])
def test_driver_against_float64(layout, causal, N, R):
    """At up to 5 nodes."""
    _driver_against_float64(layout, causal, N, R)


@pytest.mark.parametrize("HKV", [1, 3])
def test_driver_own_kv_heads(HKV):
    """The backward's calls on the node's own K/V: one kv head (one call, made last) and three (halves of 1 and 2
    kv heads, GQA 2 query heads each)."""
    assert nodes.own_heads(HKV, 3) == ([(0, 1)] if HKV == 1 else [(0, 1), (1, 3)])
    _driver_against_float64("zigzag", True, 3, 2, HKV=HKV)


# Windows: narrower than a rank's shard, than a node, reaching several nodes, one-sided either way, a side of 0,
# ones that move a side of a band to exactly -1 (left 7 / 15 with S 8: the next rank's first key / node's).
WINDOWS = [(5, -1), (3, 2), (0, 7), (15, 0), (7, 3), (-1, 4), (40, -1)]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N,R", [(2, 2), (3, 2), (4, 1), (2, 3)])
def test_driver_with_windows_against_float64(layout, causal, N, R):
    """Windows across nodes (node-steps as pieces: ring_core.nodes.window_pieces), at up to 4 nodes, against the
    whole sequence's float64 attention; a zigzag window that reaches partly across a node's halves raises before
    anything runs."""
    S = 8
    ran = 0
    for window in WINDOWS:
        try:
            for n in range(N):
                for m in range(N):
                    nodes.window_pieces(n, m, num_nodes=N, node_len=R * S, is_causal=causal, layout=layout,
                                        window=window)
        except nodes.WindowAcrossChunksError:
            assert layout == "zigzag" and max(window) > R * S // 2  # wider than a node-level chunk
            with pytest.raises(nodes.WindowAcrossChunksError, match="layout='contiguous'"):
                _driver_against_float64(layout, causal, N, R, S, window)
            continue
        _driver_against_float64(layout, causal, N, R, S, window)
        ran += 1
    assert ran >= 3


def test_window_pieces_meet_exactly_the_pairs_the_window_allows():
    """Every (query, key) pair of two nodes lies in exactly one piece where the window allows it (and in a piece's
    band exactly then), and in none where it does not: each piece's rows, reversal and band, read back as global
    positions."""
    for layout in ("contiguous", "zigzag"):
        for N, R, S in ((3, 2, 4), (4, 1, 6)):
            W = N * R
            for causal in (True, False):
                for window in WINDOWS:
                    for n in range(N):
                        qp = np.concatenate([global_positions(np, n * R + r, W, S, layout) for r in range(R)])
                        for m in range(N):
                            kp = np.concatenate([global_positions(np, m * R + r, W, S, layout) for r in range(R)])
                            want = masks.allowed(qp, kp, is_causal=causal, window=window)
                            want = np.ones((qp.size, kp.size), bool) if want is None else want
                            try:
                                pieces = nodes.window_pieces(n, m, num_nodes=N, node_len=R * S, is_causal=causal,
                                                             layout=layout, window=window)
                            except nodes.WindowAcrossChunksError:
                                continue
                            got = np.zeros(want.shape, int)
                            for p in pieces:
                                qi, ki = _piece_rows(p.q_half, p.flip, R, S), _piece_rows(p.k_half, p.flip, R, S)
                                mk = p.mask
                                # the call's own positions: its R ranks' rows in its layout
                                pos = np.concatenate([global_positions(np, r, R, qi.size // R, mk.layout)
                                                      for r in range(R)])
                                band = masks.allowed(pos, pos + mk.key_offset, is_causal=mk.is_causal,
                                                     window=mk.window)
                                band = np.ones((qi.size, ki.size), bool) if band is None else band
                                got[np.ix_(qi, ki)] += band
                            assert (got == want).all(), (layout, N, R, causal, window, n, m)


def _piece_rows(half, flip, R, S):
    """Indices, into the node's rows (rank by rank), of a piece's rows in the order the call sees them."""
    if half is None:
        return np.arange(R * S)
    h = S // 2
    rows = [r * S + half * h + np.arange(h) for r in range(R)]
    return np.concatenate([x[::-1] if flip else x for x in rows])


# The real kernels in the interpreter inside each node. W = N x R up to 8, R in 1..4, both layouts, GQA, odd
# shapes (head_dim 80, 3 heads, seq_local not a multiple of the block), every fused dtype.
KERNEL_CASES = [
    # W, R, B, S_local, H, HKV, D, dtype, causal, layout
    (4, 2, 1, 16, 4, 2, 16, "float32", True, "zigzag"),
    (4, 2, 2, 8, 2, 1, 16, "bfloat16", True, "contiguous"),
    (6, 3, 1, 12, 3, 3, 80, "float16", True, "zigzag"),
    (8, 4, 1, 8, 2, 2, 16, "float32", True, "zigzag"),
    (8, 2, 1, 6, 4, 1, 8, "bfloat16", False, "contiguous"),
    (3, 1, 1, 10, 2, 2, 16, "float32", True, "zigzag"),
    (4, 4, 1, 8, 2, 2, 16, "float32", True, "zigzag"),  # one node: the one-node kernel alone
]


def _case_inputs(case, seed):
    W, R, B, S, H, HKV, D, dtype, causal, layout = case
    q, k, v, dout = testing.random_inputs(seed, B, W * S, H, HKV, D, dtype, with_dout=True)
    cast = lambda x: x.astype(reference.np_dtype(dtype))  # noqa: E731
    return [cast(x) for x in (q, k, v, dout)], (q, k, v, dout)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "W{}R{}_B{}S{}_H{}/{}_D{}_{}_{}_{}".format(*c))
def test_kernels_in_nodes_against_float64(case):
    W, R, B, S, H, HKV, D, dtype, causal, layout = case
    (q, k, v, dout), exact = _case_inputs(case, seed=W * 100 + R)
    out, lse = simulate.simulate_ring_attention(q, k, v, W, is_causal=causal, layout=layout, return_lse=True,
                                                node_size=R)
    testing.check_attention(f"nodes {case}", out, lse, *exact[:3], dtype, is_causal=causal)


GRAD_CASES = [KERNEL_CASES[0], KERNEL_CASES[1], KERNEL_CASES[2], KERNEL_CASES[4], KERNEL_CASES[5]]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "W{}R{}_B{}S{}_H{}/{}_D{}_{}_{}_{}".format(*c))
def test_kernel_gradients_in_nodes_against_float64(case):
    W, R, B, S, H, HKV, D, dtype, causal, layout = case
    (q, k, v, dout), exact = _case_inputs(case, seed=W * 100 + R + 7)
    rng = np.random.default_rng(3)
    dlse = rng.standard_normal((B, H, W * S)).astype(np.float32)
    grads = simulate.simulate_ring_attention_grad(q, k, v, dout, W, is_causal=causal, layout=layout, dlse=dlse,
                                                  node_size=R)
    testing.check_grads(f"nodes {case}", grads, *exact, dtype, is_causal=causal, dlse=dlse.astype(np.float64))


def test_bad_node_sizes_and_masks_raise_before_running():
    q = np.zeros((1, 16, 2, 8), np.float32)
    with pytest.raises(ValueError, match="must divide world_size"):
        simulate.simulate_ring_attention(q, q, q, 4, node_size=3)
    with pytest.raises(ValueError, match="node_size must be in"):
        simulate.simulate_ring_attention(q, q, q, 4, node_size=0)
    with pytest.raises(nodes.WindowAcrossChunksError, match="layout='contiguous'"):  # chunks of 8, a window of 12
        simulate.simulate_ring_attention(q, q, q, 4, node_size=2, layout="zigzag", window_size=(12, 0))


SEGMENT_CASES = [  # the K/V's ids travel with them; another node's K/V meet this node's queries' ids in the kernels
    (4, 2, 1, 16, 2, 1, 16, "float32", True, "zigzag"),  # K_EARLY and Q_LATE: the halves in the batch axis
    (4, 2, 2, 8, 2, 1, 16, "bfloat16", True, "zigzag"),
    (4, 2, 1, 12, 2, 2, 80, "float16", True, "contiguous"),  # the earlier node's K/V whole, the later's skipped
    (4, 2, 1, 8, 2, 1, 16, "float32", False, "zigzag"),
]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=lambda c: "W{}R{}_B{}S{}_H{}/{}_D{}_{}_{}_{}".format(*c))
def test_segment_ids_across_nodes_against_float64(case):
    W, R, B, S, H, HKV, D, dtype, causal, layout = case
    (q, k, v, dout), exact = _case_inputs(case, seed=W * 100 + R + 11)
    ids = testing.crossing_documents(B, W * S)
    dlse = np.random.default_rng(5).standard_normal((B, H, W * S)).astype(np.float32)
    out, lse = simulate.simulate_ring_attention(q, k, v, W, is_causal=causal, layout=layout, return_lse=True,
                                                node_size=R, segment_ids=ids)
    testing.check_attention(f"nodes, ids {case}", out, lse, *exact[:3], dtype, is_causal=causal, segment_ids=ids)
    dlse = np.where(np.isneginf(lse), 0.0, dlse).astype(np.float32)  # padding rows: lse is a constant there
    grads = simulate.simulate_ring_attention_grad(q, k, v, dout, W, is_causal=causal, layout=layout, dlse=dlse,
                                                  node_size=R, segment_ids=ids)
    testing.check_grads(f"nodes, ids {case}", grads, *exact, dtype, is_causal=causal, dlse=dlse.astype(np.float64),
                        segment_ids=ids)


def test_batch_moves_are_inverse_and_node_specs_fold_the_halves_into_the_batch_with_ids():
    ops = _np_ops()
    x = np.arange(2 * 6 * 3).reshape(2, 6, 3)
    y = nodes.halves_to_batch(ops, x)
    assert y.shape == (4, 3, 3) and (y[1] == x[1, :3]).all() and (y[2] == x[0, 3:]).all()
    np.testing.assert_array_equal(nodes.batch_to_halves(ops, y), x)
    lse = np.arange(2 * 2 * 6).reshape(2, 2, 6)
    np.testing.assert_array_equal(nodes.batch_to_halves(ops, nodes.halves_to_batch(ops, lse, 2), 2), lse)
    np.testing.assert_array_equal(nodes.batch_sum(nodes.twice_in_batch(ops, x)), 2 * x)
    spec = validate.check_attention_args(
        (1, 8, 4, 16), (1, 8, 2, 16), (1, 8, 2, 16), "bfloat16", "bfloat16", "bfloat16", is_causal=True, scale=None,
        layout="zigzag", backend="fused", backends=("fused",), segment_ids_shape=(1, 8), segment_ids_dtype="int32")
    specs = nodes.node_specs(spec)
    assert [(s.batch, s.seq_local, s.num_heads, s.num_kv_heads, s.is_causal, s.kv_ids) for s in specs] == [
        (1, 8, 4, 2, True, False), (1, 8, 4, 2, False, True), (2, 4, 4, 2, False, True),
        (1, 8, 2, 1, True, False)]  # (the last: the backward's calls on the node's own K/V, a kv head each)


def test_a_call_with_the_keys_ids_apart_against_float64():
    """The kernels with the keys' segment ids apart from the queries' (KV_IDS: [2, batch, seq_local], as the
    two-level ring's calls with another node's K/V make them), forward and backward at 2 ranks, against the float64
    reference with the pair of ids."""
    import dataclasses

    W, B, S, H, HKV, D, dtype = 2, 2, 24, 2, 1, 16, "float32"
    q, k, v, dout = testing.random_inputs(7, B, W * S, H, HKV, D, dtype, with_dout=True)
    qi = testing.crossing_documents(B, W * S)
    ki = np.roll(qi, 7, axis=1)  # other ids for the keys: documents that start elsewhere
    spec = dataclasses.replace(validate.check_attention_args(
        (B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dtype, dtype, dtype, is_causal=False, scale=None,
        layout="contiguous", backend="fused", backends=("fused",), segment_ids_shape=(B, S),
        segment_ids_dtype="int32"), kv_ids=True)
    rows = [np.arange(r * S, (r + 1) * S) for r in range(W)]
    col = lambda x: [np.ascontiguousarray(x[:, r].astype(np.float32)) for r in rows]  # noqa: E731
    segs = [np.stack([qi[:, r], ki[:, r]]) for r in rows]
    ring = simulate.SimulatedRing(W)
    try:
        job = ring._get_job()
        fwd = job.run(spec, col(q), col(k), col(v), seg_shards=segs)
        outs, lses = [f[0] for f in fwd], [f[1] for f in fwd]
        bwd = job.run_bwd(spec, col(q), col(k), col(v), outs, lses, col(dout), seg_shards=segs)
    finally:
        ring.close()
    out, lse = np.concatenate(outs, 1), np.concatenate(lses, 2)
    testing.check_attention("keys' ids apart", out, lse, q, k, v, dtype, is_causal=False, segment_ids=(qi, ki))
    grads = [np.concatenate([b[i] for b in bwd], 1) for i in range(3)]
    testing.check_grads("keys' ids apart", grads, q, k, v, dout, dtype, is_causal=False, segment_ids=(qi, ki))
    same = reference.attention(q, k, v, segment_ids=(qi, qi))
    np.testing.assert_array_equal(same[0], reference.attention(q, k, v, segment_ids=qi)[0])


WINDOW_CASES = [  # windows across nodes: a node-step's pieces, the band moved by a node's length in the kernels
    # W, R, B, S_local, H, HKV, D, dtype, causal, layout, window, segment ids
    (4, 2, 1, 16, 2, 1, 16, "float32", True, "contiguous", (20, -1), False),
    (4, 2, 1, 16, 4, 2, 16, "bfloat16", True, "zigzag", (12, -1), False),  # the second halves reversed
    (6, 2, 1, 8, 2, 2, 80, "float16", False, "contiguous", (9, 5), False),
    (4, 2, 2, 12, 2, 1, 16, "float32", False, "zigzag", (7, 11), True),
    (4, 2, 1, 16, 2, 2, 16, "bfloat16", True, "contiguous", (31, -1), True),  # a band side moved to exactly -1
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "W{}R{}_B{}S{}_H{}/{}_D{}_{}_{}_{}_{}_{}".format(*c))
def test_windows_across_nodes_against_float64(case):
    """The fused kernels in each simulated node under a window that crosses nodes: out, lse and the gradients (with
    an lse gradient), against float64 through the tolerance table."""
    W, R, B, S, H, HKV, D, dtype, causal, layout, window, segmented = case
    (q, k, v, dout), exact = _case_inputs(case[:10], seed=W * 100 + R + 13)
    ids = testing.crossing_documents(B, W * S) if segmented else None
    kw = dict(is_causal=causal, layout=layout, node_size=R, segment_ids=ids, window_size=window)
    out, lse = simulate.simulate_ring_attention(q, k, v, W, return_lse=True, **kw)
    mask = dict(is_causal=causal, segment_ids=ids, window=window)
    testing.check_attention(f"nodes, window {case}", out, lse, *exact[:3], dtype, **mask)
    dlse = np.random.default_rng(5).standard_normal((B, H, W * S))
    dlse = np.where(np.isneginf(lse), 0.0, dlse).astype(np.float32)
    grads = simulate.simulate_ring_attention_grad(q, k, v, dout, W, dlse=dlse, **kw)
    testing.check_grads(f"nodes, window {case}", grads, *exact, dtype, dlse=dlse.astype(np.float64), **mask)


# A K/V block's rows past the shard's end (loaded as zeros) meet, by position, rows that attend nothing (lse -inf):
# their P is inf in the interpreter's float64 matmuls, in rows of dK/dV that are never stored.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("window,key_offset,segmented", [
    ((30, -1), -48, False),  # keys a node before: a band above the diagonal, rows that see nothing
    ((47, 0), -48, True),  # the left side moved to exactly -1 (keys strictly after the query's own position)
    ((0, 30), 48, False),  # keys a node after: below the diagonal
    ((10, 10), -20, True),
])
def test_a_call_with_a_band_off_the_diagonal_against_float64(window, key_offset, segmented):
    """The kernels on a call whose keys sit ``key_offset`` positions from the queries' frame
    (AttentionSpec.key_offset: the two-level ring's calls with another node's K/V under a window), forward and
    backward at 2 ranks, against the float64 reference with the keys' positions moved alike; the backward from the
    call's own out and lse, rows that attend nothing included."""
    import dataclasses

    W, B, S, H, HKV, D, dtype = 2, 1, 24, 2, 1, 16, "float32"
    q, k, v, dout = testing.random_inputs(3, B, W * S, H, HKV, D, dtype, with_dout=True)
    qi = testing.crossing_documents(B, W * S) if segmented else None
    ki = None if qi is None else np.roll(qi, 5, axis=1)
    spec = dataclasses.replace(validate.check_attention_args(
        (B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dtype, dtype, dtype, is_causal=False, scale=None,
        layout="contiguous", backend="fused", backends=("fused",), window_size=window,
        segment_ids_shape=(B, S) if segmented else None, segment_ids_dtype="int32" if segmented else None),
        key_offset=key_offset, kv_ids=segmented)
    rows = [np.arange(r * S, (r + 1) * S) for r in range(W)]
    col = lambda x: [np.ascontiguousarray(x[:, r].astype(np.float32)) for r in rows]  # noqa: E731
    segs = [np.stack([qi[:, r], ki[:, r]]) for r in rows] if segmented else None
    ring = simulate.SimulatedRing(W)
    try:
        job = ring._get_job()
        fwd = job.run(spec, col(q), col(k), col(v), seg_shards=segs)
        for r, f in enumerate(fwd):
            control.check_status(f[-1], r, 60.0)
        outs, lses = [f[0] for f in fwd], [f[1] for f in fwd]
        bwd = job.run_bwd(spec, col(q), col(k), col(v), outs, lses, col(dout), seg_shards=segs)
        for r, b in enumerate(bwd):
            control.check_status(b[-1], r, 60.0)
    finally:
        ring.close()
    out, lse = np.concatenate(outs, 1), np.concatenate(lses, 2)
    mask = dict(is_causal=False, window=window, key_offset=key_offset,
                segment_ids=None if qi is None else (qi, ki))
    assert np.isneginf(lse).any() and np.isfinite(lse).any()  # rows out of the band's reach, and rows in it
    testing.check_attention("band", out, lse, q, k, v, dtype, **mask)
    grads = [np.concatenate([b[i] for b in bwd], 1) for i in range(3)]
    testing.check_grads("band", grads, q, k, v, dout, dtype, **mask)
