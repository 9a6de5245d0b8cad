"""CPU tests of the real fused kernels with packed sequences (segment ids) and sliding windows, run by
ring_core.sim.simulate in the Triton interpreter (one thread per rank).

* forward and gradients against the float64 reference (ring_core.testing.check_attention / check_grads with
  ``segment_ids=`` and ``window=``): world sizes 1-4, both layouts, GQA, odd seq_local, padding rows (exactly
  out 0, lse -inf, zero gradients, an inf dlse ignored), windows crossing shard boundaries ((0, 0), causal
  sliding windows, asymmetric and one-sided ones), segments crossing shard boundaries, ids that are not
  sorted; every value NaN-free;
* ranks that disagree on the window or on segment ids are found by the call check before anything moves;
* the skipping, observed: a contiguous causal sliding window that reaches one neighbour's shard makes every
  rank receive (flags and bytes) from that neighbour only, and only the chunks its queries can see; K/V rows
  that a tile may not attend are never read (poisoned with NaN in the inputs, the outputs that may not see
  them stay finite and right): by window, within a shard and across ranks, and by segment (another document's
  rows, padding rows), forward and backward; a rank whose every token is padding waits for nothing and still
  sends its K/V.

The interpreter's tiles are 16 rows (query and K/V blocks, chunks), so shards of 16-40 rows already have
several blocks, chunks and tiles.
"""

import dataclasses
import os

# The interpreter must be chosen before ring_core.kernels.tl_fwd / iris are first imported (see test_simulate.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ring_core.sim import simulate  # noqa: E402
from ring_core.sim.simulate import (SimulatedRing, simulate_ring_attention,  # noqa: E402
                                    simulate_ring_attention_grad)
from ring_core import masks, plans, reference, testing, validate  # noqa: E402
from ring_core.protocol import control  # noqa: E402
from ring_core.protocol.control import HeapTooSmallError, RingAttentionMismatch  # noqa: E402

TILE = 16  # the interpreter's BLOCK_M / BLOCK_N / chunk rows (ring_core.plans, interpret=True)


def _segments(kind, seed, batch, seq):
    """Segment ids [batch, seq] (natural order) of a kind: None; "packed": back-to-back documents of up to
    seq/3 tokens, no padding (they cross shard boundaries); "padded": the same ending in padding (-1) tokens;
    "scattered": ids that are not runs (-1..2 at random: equal ids attend each other wherever they are)."""
    if kind is None:
        return None
    if kind == "scattered":
        return np.random.default_rng(seed).integers(-1, 3, size=(batch, seq)).astype(np.int32)
    return testing.random_segment_ids(seed, batch, seq, max_len=max(2, seq // 3), padding=kind == "padded")


def _check_padding(out, lse, ids):
    """Padding rows (id < 0): out exactly 0, lse exactly -inf."""
    if ids is None:
        return
    pad = ids < 0  # [b, s]
    assert (out.astype(np.float32)[pad] == 0).all()
    assert (np.moveaxis(lse, 1, 2)[pad] == -np.inf).all()


# (world_size, batch, seq_local, heads, kv_heads, head_dim, dtype, is_causal, layout, window, segments)
CASES = [
    (1, 1, 20, 2, 1, 16, "float32", True, "contiguous", (5, -1), None),
    (1, 2, 34, 2, 1, 16, "float16", False, "zigzag", (3, 9), "padded"),
    (2, 1, 17, 4, 2, 24, "bfloat16", True, "contiguous", (20, -1), None),  # the window crosses a shard
    (2, 1, 20, 2, 2, 16, "float32", False, "zigzag", (0, 0), None),
    (2, 1, 20, 2, 1, 16, "float32", False, "contiguous", (-1, 3), None),  # one side only, non-causal
    (2, 1, 16, 4, 1, 16, "float16", False, "contiguous", None, "packed"),
    (2, 2, 18, 2, 1, 40, "float32", True, "zigzag", None, "padded"),
    (3, 1, 19, 2, 1, 16, "float32", False, "contiguous", (7, 25), "padded"),  # asymmetric, odd seq_local
    (3, 1, 20, 4, 2, 16, "bfloat16", True, "zigzag", (13, -1), "packed"),
    (3, 1, 18, 2, 2, 32, "float16", False, "zigzag", (30, 2), None),
    (3, 1, 6, 2, 1, 8, "float32", True, "contiguous", None, "scattered"),
    (4, 1, 17, 4, 1, 16, "float32", True, "contiguous", (16, -1), None),  # reaches one neighbour's shard
    (4, 1, 18, 2, 1, 24, "float16", False, "zigzag", (5, 5), "padded"),
    (4, 1, 12, 2, 2, 16, "bfloat16", True, "zigzag", (40, -1), "packed"),
    (4, 2, 5, 2, 1, 8, "float32", False, "contiguous", None, "scattered"),
    (4, 1, 16, 2, 1, 16, "float32", True, "contiguous", (0, 0), "padded"),
    # Many chunks per shard and documents far shorter than it: the range passes narrow by the chunks' ranges.
    (1, 1, 64, 2, 1, 16, "float16", True, "contiguous", None, "packed"),
    (2, 1, 96, 2, 1, 16, "bfloat16", True, "zigzag", None, "padded"),
]


def _case_id(c):
    *shape, window, seg = c
    return (testing.case_label(*shape) + ('' if window is None else f'-win{window[0]}_{window[1]}')
            + ('' if seg is None else f'-{seg}'))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_matches_reference(case):
    W, B, S, H, HKV, D, dtype, causal, layout, window, kind = case
    seed = 200 + CASES.index(case)
    ref, (q, k, v) = testing.sharded_inputs(seed, W, B, S, H, HKV, D, dtype)
    ids = _segments(kind, seed, B, S * W)
    out, lse = simulate_ring_attention(q, k, v, W, is_causal=causal, layout=layout, return_lse=True,
                                       segment_ids=ids, window_size=window)
    assert np.isfinite(out.astype(np.float32)).all() and not np.isnan(lse).any()
    testing.check_attention(_case_id(case), out.astype(np.float64), lse, *ref, dtype, is_causal=causal,
                            segment_ids=ids, window=window)
    _check_padding(out, lse, ids)


# (world_size, batch, seq_local, heads, kv_heads, head_dim, dtype, is_causal, layout, window, segments, dlse)
GRAD_CASES = [
    (1, 1, 20, 2, 1, 16, "float32", True, "contiguous", (5, -1), "padded", True),
    (2, 1, 17, 4, 2, 24, "bfloat16", True, "contiguous", (20, -1), None, False),
    (2, 1, 20, 2, 2, 16, "float32", False, "zigzag", (3, 9), "packed", True),
    (3, 1, 19, 2, 1, 16, "float16", False, "contiguous", (7, 25), "padded", False),
    (3, 1, 18, 2, 1, 16, "float32", True, "zigzag", None, "padded", True),
    (3, 1, 6, 2, 1, 8, "float32", False, "contiguous", None, "scattered", True),
    (4, 1, 17, 4, 1, 16, "float32", True, "contiguous", (16, -1), None, False),
    (4, 1, 12, 2, 2, 16, "bfloat16", False, "zigzag", (5, 5), "padded", False),
    (1, 1, 48, 2, 1, 16, "float32", True, "contiguous", None, "padded", False),  # many chunks (as above)
    (2, 1, 64, 2, 1, 16, "float32", True, "zigzag", None, "packed", True),
]


def _grad_id(c):
    return _case_id(c[:11]) + ("-dlse" if c[11] else "")


@pytest.mark.parametrize("case", GRAD_CASES, ids=[_grad_id(c) for c in GRAD_CASES])
def test_gradients_match_reference(case):
    W, B, S, H, HKV, D, dtype, causal, layout, window, kind, with_dlse = case
    seed = 300 + GRAD_CASES.index(case)
    ref, (q, k, v, do) = testing.sharded_inputs(seed, W, B, S, H, HKV, D, dtype, with_dout=True)
    ids = _segments(kind, seed, B, S * W)
    dlse = None
    if with_dlse:
        dlse = np.random.default_rng(seed).standard_normal((B, H, S * W)).astype(np.float32)
        if ids is not None:  # a padding row's lse is the constant -inf: its dlse is ignored, even inf
            dlse[np.broadcast_to((ids < 0)[:, None, :], dlse.shape)] = np.inf
    grads = simulate_ring_attention_grad(q, k, v, do, W, is_causal=causal, layout=layout, dlse=dlse,
                                         segment_ids=ids, window_size=window)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads)
    testing.check_grads(_grad_id(case), [g.astype(np.float64) for g in grads], *ref, dtype, is_causal=causal,
                        dlse=dlse, segment_ids=ids, window=window)
    if ids is not None:  # padding tokens take and give no gradient: exactly 0
        pad = ids < 0
        for g in grads:
            assert (g.astype(np.float32)[pad] == 0).all()


def test_masked_and_plain_calls_share_heaps():
    """Calls with and without masks, of other shapes, on one set of heaps: the ids in the receive region are
    written before each chunk's flag of this call, so stale ids and K/V of earlier calls are never read."""
    W = 3
    ring = SimulatedRing(W, workspace_bytes=1 << 20)
    calls = [  # (seq_local, is_causal, layout, window, segments)
        (18, True, "zigzag", (9, -1), "padded"),
        (16, False, "contiguous", None, None),
        (18, True, "zigzag", (9, -1), "packed"),
        (20, False, "contiguous", (4, 12), "scattered"),
    ]
    for i, (S, causal, layout, window, kind) in enumerate(calls):
        ref, (q, k, v) = testing.sharded_inputs(400 + i, W, 1, S, 2, 1, 16, "float32")
        ids = _segments(kind, 400 + i, 1, S * W)
        out, lse = ring(q, k, v, is_causal=causal, layout=layout, return_lse=True, segment_ids=ids, window_size=window)
        testing.check_attention(f"call {i}", out, lse, *ref, "float32", is_causal=causal, segment_ids=ids,
                                window=window)
        assert ring.epoch == i + 1


# ------------------------------------------------------------------------------------------- the call check
def _two_rank_call(overrides, *, is_causal, window=None, segmented=False):
    """Rank 0's call and rank 1's (``overrides`` of its spec), W=2, through a SimulatedJob."""
    W, S = 2, 20
    call = simulate._prepare(*testing.sharded_inputs(7, W, 1, S, 2, 1, 16, "float32")[1], W, is_causal=is_causal,
                             scale=None, layout="contiguous", return_lse=False, timeout_s=5.0,
                             window_size=window,
                             segment_ids=_segments("padded", 7, 1, S * W) if segmented else None)
    specs = [call.spec, dataclasses.replace(call.spec, **overrides)]
    seg = call.seg_shards or [np.zeros((1, S), np.int32)] * W  # rank 1 may have ids where rank 0 has none
    job = simulate._local_job(W, None)
    res = job.run(specs, call.q_shards, call.k_shards, call.v_shards, seg_shards=seg, timeout_s=5.0)
    return job, specs, res


@pytest.mark.parametrize("overrides, is_causal, window, segmented, field", [
    (dict(window=(4, -1)), True, (8, -1), False, "window_left"),
    (dict(window=(-1, -1)), True, (8, -1), False, "window_left"),
    (dict(is_causal=False, window=(8, 3)), True, (8, -1), False, "flags"),
    (dict(segmented=True), True, None, False, "flags"),
    (dict(window=(8, 2)), False, (8, 5), True, "window_right"),
], ids=["left", "no-window", "causal-and-right", "segments", "right"])
def test_ranks_that_disagree_on_masks_are_found(overrides, is_causal, window, segmented, field):
    job, specs, res = _two_rank_call(overrides, is_causal=is_causal, window=window, segmented=segmented)
    launches = [plans.plan(sp, 2, job.layout, interpret=True) for sp in specs]
    for r in range(2):
        out, lse, status = res[r]
        assert int(status[0]) == control.ERR_MISMATCH and int(status[1]) == 1 - r
        assert np.isnan(out).all() and np.isnan(lse).all()  # nothing computed, nothing read
        mine = status[4 + control.SIG_WORDS:]
        assert mine[1:].tolist() == launches[r].signature()[1:].tolist()  # kernel and host build the same words
        with pytest.raises(RingAttentionMismatch, match=rf"first difference: {field}\)") as e:
            control.check_status(status, r, 5.0)
    msg = str(e.value)
    assert "window" in msg or "segment ids" in msg


def test_windows_that_mask_alike_make_the_same_call():
    """The signature carries the window as the kernels apply it: under causal masking the right side is moot,
    and a side that reaches the whole sequence is no bound."""
    spec = validate.check_attention_args((1, 8, 2, 16), (1, 8, 1, 16), (1, 8, 1, 16), "float32", "float32",
                                         "float32", is_causal=True, scale=None, layout="contiguous", backend="fused",
                                         backends=("fused",), window_size=(3, 0))
    heap = control.HeapLayout.for_workspace(1 << 20)
    sig = lambda **kw: plans.plan(dataclasses.replace(spec, **kw), 4, heap, interpret=True).signature()  # noqa
    np.testing.assert_array_equal(sig(), sig(window=(3, 7)))
    np.testing.assert_array_equal(sig(window=(-1, 2)), sig(window=(31, -1)))  # 4 x 8 tokens: 31 reaches all
    assert plans.plan(dataclasses.replace(spec, window=(31, 5)), 4, heap).constexprs()["WINDOW"] is False
    assert sig()[13:15].tolist() == [4, 0] and sig(is_causal=False)[13:15].tolist() == [4, 1]
    assert "window (3, -1)" in control.describe_signature(sig())


def test_heap_need_counts_the_segment_ids():
    W, B, S, HKV, D = 3, 2, 40, 2, 16
    spec = validate.check_attention_args((B, S, 4, D), (B, S, HKV, D), (B, S, HKV, D), "bfloat16", "bfloat16",
                                         "bfloat16", is_causal=False, scale=None, layout="contiguous",
                                         backend="fused", backends=("fused",), segment_ids_shape=(B, S),
                                         segment_ids_dtype="int32")
    kv = (W - 1) * 2 * B * HKV * S * D * 2
    ids = (W - 1) * B * HKV * S * 4
    assert plans.recv_bytes(spec, W) == kv + ids
    assert plans.recv_bytes(dataclasses.replace(spec, segmented=False), W) == kv
    _, part_off, need = plans.bwd_recv_bytes(spec, W)
    assert part_off >= kv + ids and part_off % control.ALIGN == 0
    assert need == part_off + 2 * kv  # the partials in float32: twice the bf16 K/V
    heap = control.HeapLayout.for_workspace(control.RING_SLOTS * control.CTL_BYTES + (64 << 10) + kv + 300)
    assert heap.recv_capacity >= kv
    with pytest.raises(HeapTooSmallError, match=rf"needs {kv + ids} bytes.*segment ids: {ids} bytes"):
        plans.plan(spec, W, heap)


# ----------------------------------------------------------------------------------------------- skipping
def _run_job(W, S, *, is_causal, layout, window=None, ids=None, poison=None, seed=0, B=1, H=2, HKV=1, D=16,
             workspace_bytes=None):
    """One forward call through a SimulatedJob (so the heaps can be inspected): returns (job, call, results,
    the clean float64 inputs). ``poison(k, v)`` may overwrite global natural-order K/V before sharding."""
    ref, (q, k, v) = testing.sharded_inputs(seed, W, B, S, H, HKV, D, "float32")
    if poison is not None:
        k, v = k.copy(), v.copy()
        poison(k, v)
    call = simulate._prepare(q, k, v, W, is_causal=is_causal, scale=None, layout=layout, return_lse=True,
                             timeout_s=30.0, segment_ids=ids, window_size=window)
    job = simulate._local_job(W, workspace_bytes)
    if workspace_bytes is not None:
        job._ensure_heaps(plans.recv_bytes(call.spec, W))
        for h in job.heaps:
            h[job.layout.recv_off:].fill_(0x5A)  # every receive byte marked: what is never written stays so
    res = job.run(call.spec, call.q_shards, call.k_shards, call.v_shards, seg_shards=call.seg_shards,
                  timeout_s=30.0)
    call.check([r[2] for r in res])
    return job, call, res, ref


def _flags(job, rank, W, n):
    """The first ``n`` flag words of ``rank`` in this ring's slot: the K/V flags [peer distance d - 1][b][kv
    head][chunk], then (backward) the partials' [d - 1][b][kv head][block] (ring_core.protocol.steps)."""
    import torch

    off = job.layout.flags_off_of(job.slots.get("jax", tuple(range(W))))
    return job.heaps[rank][off:off + 4 * n].view(torch.int32).numpy()


def _kv_flags(job, rank, W, n_chunks, B=1, HKV=1):
    return _flags(job, rank, W, (W - 1) * B * HKV * n_chunks).reshape(W - 1, B, HKV, n_chunks)


@pytest.mark.parametrize("left, chunks", [(32, [0, 1]), (16, [1]), (5, [1])])
def test_causal_sliding_window_receives_from_one_neighbour(left, chunks):
    """Contiguous layout, causal window of at most one shard (32 tokens): rank r's queries see keys of rank
    r-1 and no other peer, so only rank r-1 sends to rank r, and only the chunks (16 rows) its queries can
    see: the others are neither flagged nor written (their receive bytes keep their marks)."""
    W, S = 4, 32
    job, call, res, ref = _run_job(W, S, is_causal=True, layout="contiguous", window=(left, -1),
                                   workspace_bytes=1 << 20)
    testing.check_attention("window", call.gather([r[0] for r in res]), None, *ref, "float32", is_causal=True,
                            window=(left, -1))
    epoch = int(res[0][2][3])
    kv_slot = 2 * 1 * 1 * S * 16 * 4  # one peer's K and V: [K|V][B][HKV][S][D] float32
    for r in range(W):
        flags = _kv_flags(job, r, W, S // TILE)
        got = [c for c in range(S // TILE) if flags[0, 0, 0, c] == epoch]  # from rank r-1
        assert got == (chunks if r > 0 else []), (r, flags)
        assert not (flags[1:] == epoch).any()  # nothing from ranks r-2, r-3
        recv = job.heaps[r][job.layout.recv_off:].numpy()
        assert (recv[kv_slot:3 * kv_slot] == 0x5A).all()  # receive slots of distance 2 and 3: never written
        if r == 0:
            assert (recv[:kv_slot] == 0x5A).all()  # rank 3 is after rank 0: nothing at all
        else:
            rows = np.zeros(S, bool)
            for c in chunks:
                rows[c * TILE:(c + 1) * TILE] = True
            k_slot = recv[:kv_slot // 2].reshape(S, 16 * 4)
            assert (k_slot[~rows] == 0x5A).all() and not (k_slot[rows] == 0x5A).all()


def test_causal_sliding_window_backward_exchanges_with_one_neighbour():
    """The backward of the same window (5 tokens, shards of 32): rank r receives from rank r-1 only the chunk of
    rows 16..31 (the K/V its dQ and partial tasks read), and sends rank r-1 only the partial dK/dV of that
    block (the only block of rank r-1's K/V its queries see); the owner waits for exactly those."""
    # W=3 (was 4), for time: the expected flags below are written for any W; rank 2 still has a peer two steps
    # back (rank 0) that it must neither receive from nor send partials to, and S=32 keeps two chunks per shard
    # of which the window (5) reaches only the last.
    W, S, left = 3, 32, 5
    ref, xs = testing.sharded_inputs(9, W, 1, S, 2, 1, 16, "float32", with_dout=True)
    call = simulate._prepare_grad(*xs, W, is_causal=True, scale=None, layout="contiguous", timeout_s=30.0,
                                  window_size=(left, -1))
    job = simulate._local_job(W, None)
    res = job.run_grad(call.spec, call.q_shards, call.k_shards, call.v_shards, call.dout_shards, timeout_s=30.0)
    testing.check_grads("window backward", simulate._finish_grad(call, res), *ref, "float32", is_causal=True,
                        window=(left, -1))
    epoch = int(res[0][4][3])
    assert epoch == 2
    n_blk = S // TILE  # chunks and K/V blocks alike (16 rows)
    for r in range(W):
        kv, part = np.split(_flags(job, r, W, 2 * (W - 1) * n_blk).reshape(2, W - 1, n_blk) == epoch, 2)
        assert kv[0].tolist() == [[False, r > 0]] + [[False, False]] * (W - 2), (r, kv)  # from rank r-1
        assert part[0].tolist() == [[False, r < W - 1]] + [[False, False]] * (W - 2), (r, part)  # from r+1


def test_window_never_reads_rows_outside_it():
    """K/V rows that a tile's window excludes are never read: poisoned with NaN (global keys 0..42: all of
    rank 0's shard and rows 0..10 of rank 1's), the queries at positions >= 48 (window 5: keys >= 43) are
    finite and right, and so, in the backward, are their dq and the dk/dv of the keys >= 48 (attended by those
    queries only). Rank 1's second tile skips rows 0..10 of its own shard inside a block it reads; ranks 2 and
    3 never touch rank 0's K/V (not sent to them: nothing to read); the dK/dV tasks of keys >= 48 never take
    the query rows < 48, whose lse and delta are NaN."""
    # W=3 (was 4), for time: the same poisoned rows and checked queries (>= 48: rank 1's second tile and all of
    # rank 2); rank 2 is still two ranks after rank 0 and never touches its K/V (as ranks 2 and 3 did with W=4).
    W, S, left = 3, 32, 5

    def poison(k, v):
        k[:, :43] = np.nan
        v[:, :43] = np.nan

    job, call, res, ref = _run_job(W, S, is_causal=True, layout="contiguous", window=(left, -1), poison=poison)
    out = call.gather([r[0] for r in res])
    lse = call.gather([r[1] for r in res], seq_axis=2)
    out64, lse64 = reference.attention(*ref, is_causal=True, window=(left, -1))
    assert np.isfinite(out[:, 48:]).all()
    np.testing.assert_allclose(out[:, 48:], out64[:, 48:], atol=2e-5)
    np.testing.assert_allclose(lse[:, :, 48:], lse64[:, :, 48:], atol=2e-5)

    # Backward: dq of those queries, dk/dv of the keys >= 48, from the same poisoned K/V.
    q, k, v, do = (x.astype(np.float32) for x in testing.random_inputs(5, 1, W * S, 2, 1, 16, "float32",
                                                                        with_dout=True))
    kp, vp = k.copy(), v.copy()
    poison(kp, vp)
    grads = simulate_ring_attention_grad(q, kp, vp, do, W, is_causal=True, window_size=(left, -1))
    ref_grads = reference.attention_grad(q, k, v, do, is_causal=True, window=(left, -1))
    for name, g, r in zip("qkv", grads, ref_grads):
        assert np.isfinite(g[:, 48:]).all(), name
        np.testing.assert_allclose(g[:, 48:], r[:, 48:], atol=1e-4, err_msg=f"d{name}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the tiles that do read the poisoned rows: NaN, as expected
def test_segments_never_read_other_documents_rows():
    """A tile reads no K/V row whose segment id lies outside its own ids' range, and no padding row: the K/V
    of one document and of the padding poisoned with NaN, every query tile (16 rows, in layout order) whose
    documents all differ from it is finite and right; padding rows are out 0 / lse -inf; zigzag, W=3."""
    W, S, layout = 3, 32, "zigzag"
    seq = W * S
    lens = [20, 9, 30, 7, 15, 9]  # documents crossing shard and chunk boundaries, then 6 padding tokens
    ids = masks.segment_ids_from_cu_seqlens(np.cumsum([0] + lens), seq)[None]
    poisoned = 2  # document 2: tokens 29..58

    def poison(k, v):
        bad = (ids[0] == poisoned) | (ids[0] < 0)
        k[:, bad] = np.nan
        v[:, bad] = np.nan

    job, call, res, ref = _run_job(W, S, is_causal=False, layout=layout, ids=ids, poison=poison)
    out = call.gather([r[0] for r in res])
    lse = call.gather([r[1] for r in res], seq_axis=2)
    out64, lse64 = reference.attention(*ref, segment_ids=ids)
    # The query tiles that must not have read document 2: their non-padding ids' range excludes 2.
    clean = np.zeros(seq, bool)
    tiles = np.concatenate(call.shard(ids), axis=1)[0].reshape(-1, TILE)  # layout order, by tile
    positions = call.perm.reshape(-1, TILE)
    for tile_ids, pos in zip(tiles, positions):
        real = tile_ids[tile_ids >= 0]
        if real.size == 0 or not (real.min() <= poisoned <= real.max()):
            clean[pos] = True
    assert clean.sum() >= seq // 2  # the test looks at most of the sequence
    assert np.isfinite(out[:, clean]).all()
    np.testing.assert_allclose(out[:, clean], out64[:, clean], atol=2e-5)
    np.testing.assert_allclose(lse[:, :, clean], lse64[:, :, clean], atol=2e-5)
    _check_padding(out, lse, ids)

    # Backward with only the padding rows' K/V poisoned (no query may attend them): every gradient finite and
    # right, except dk/dv of the poisoned rows themselves.
    q, k, v, do = (x.astype(np.float32) for x in testing.random_inputs(6, 1, seq, 2, 1, 16, "float32",
                                                                        with_dout=True))
    pad = ids[0] < 0
    kp, vp = k.copy(), v.copy()
    kp[:, pad] = np.nan
    vp[:, pad] = np.nan
    grads = simulate_ring_attention_grad(q, kp, vp, do, W, layout=layout, segment_ids=ids)
    ref_grads = reference.attention_grad(q, k, v, do, segment_ids=ids)
    for name, g, r in zip("qkv", grads, ref_grads):
        rows = slice(None) if name == "q" else ~pad
        assert np.isfinite(g[:, rows]).all(), name
        np.testing.assert_allclose(g[:, rows], r[:, rows], atol=1e-4, err_msg=f"d{name}")
    assert (grads[0][:, pad] == 0).all()


def test_a_rank_of_padding_waits_for_nothing_and_sends_nothing():
    """Every token of rank 1 is padding, rank 0's one document and rank 2's another: no query attends a key of
    another rank, and the id ranges published with the call check say so, so no K/V chunk travels at all (no
    flag set anywhere) and no tile waits; the call completes, every padding row gives out 0 and lse -inf."""
    W, S = 3, 20
    ids = np.zeros((1, W * S), np.int32)
    ids[0, S:2 * S] = -1
    ids[0, 2 * S:] = 1
    job, call, res, ref = _run_job(W, S, is_causal=False, layout="contiguous", ids=ids)
    out = call.gather([r[0] for r in res])
    lse = call.gather([r[1] for r in res], seq_axis=2)
    testing.check_attention("padding rank", out, lse, *ref, "float32", is_causal=False, segment_ids=ids)
    _check_padding(out, lse, ids)
    epoch = int(res[0][2][3])
    n_chunks = -(-S // TILE)
    for r in range(W):
        assert not (_kv_flags(job, r, W, n_chunks) == epoch).any(), r


def _expected_chunks(ids_local, W, S, B, *, is_causal, layout):
    """[dst][d - 1][b][c]: whether rank dst - d pushes chunk c of batch b to rank dst, by the rule of
    ring_core.protocol.steps.push_unit (no window): causal masking lets some query of dst see the chunk's first row,
    and the chunk's published [min, max] (its padding counted as -1 in the min: protocol.publish_id_ranges) meets
    the [min, max] of the non-padding ids of a half of dst's shard (zigzag: its two chunks of the layout;
    contiguous: the shard)."""
    from ring_core import layout as lay

    n_chunks = -(-S // TILE)
    pos = [lay.global_positions(np, r, W, S, layout) for r in range(W)]

    def rng(a):
        a = a[a >= 0]
        return (int(a.min()), int(a.max())) if a.size else None

    exp = np.zeros((W, W - 1, B, n_chunks), bool)
    for dst in range(W):
        for d in range(1, W):
            src = (dst - d) % W
            for b in range(B):
                own = ids_local[dst][b]
                halves = [rng(own[:S // 2]), rng(own[S // 2:])] if layout == "zigzag" else [rng(own)]
                for c in range(n_chunks):
                    if is_causal and pos[src][c * TILE] > pos[dst].max():
                        continue
                    ids = ids_local[src][b, c * TILE:(c + 1) * TILE]
                    chunk = rng(ids)
                    if chunk is not None and (ids < 0).any():
                        chunk = (-1, chunk[1])
                    exp[dst, d - 1, b, c] = chunk is not None and any(
                        h is not None and chunk[0] <= h[1] and chunk[1] >= h[0] for h in halves)
    return exp


@pytest.mark.parametrize("kind, is_causal, layout, W, B", [
    ("packed", True, "zigzag", 3, 2),
    ("padded", False, "contiguous", 3, 2),
    # batch 1 (was 2), for time: W=4 keeps peers at distances 1-3 (chunks that straddle a zigzag half reach
    # far peers: 7 of the 10 flags set are at distance >= 2), and the per-batch flags and id ranges stay
    # checked with batch 2 by the other cases (same rule, same code).
    ("packed", False, "zigzag", 4, 1),
    ("scattered", True, "contiguous", 2, 2),
])
def test_segment_ids_decide_which_chunks_travel(kind, is_causal, layout, W, B):
    """A K/V chunk reaches a peer iff positions allow it and its ids meet the peer's (the ranges each rank
    publishes with the call check): the flags a call leaves are exactly those, and the results stay right.
    Packed documents of at most 8 tokens in shards of 48: most chunks stay home."""
    S = 48
    ids = (testing.random_segment_ids(50 + W, B, S * W, max_len=8, padding=kind == "padded")
           if kind != "scattered" else _segments(kind, 50, B, S * W))
    job, call, res, ref = _run_job(W, S, is_causal=is_causal, layout=layout, ids=ids, B=B, seed=W)
    testing.check_attention(f"{kind} W={W}", call.gather([r[0] for r in res]),
                            call.gather([r[1] for r in res], seq_axis=2), *ref, "float32", is_causal=is_causal,
                            segment_ids=ids)
    epoch = int(res[0][2][3])
    n_chunks = -(-S // TILE)
    exp = _expected_chunks(call.seg_shards, W, S, B, is_causal=is_causal, layout=layout)
    got = np.stack([_kv_flags(job, r, W, n_chunks, B=B)[:, :, 0] == epoch for r in range(W)])
    np.testing.assert_array_equal(got, exp)
    if kind == "packed":
        assert 0 < exp.sum() < exp.size // 2  # documents crossing shard ends travel; most chunks do not


@pytest.mark.parametrize("kind, is_causal, layout, W, S", [
    ("packed", True, "zigzag", 3, 48),
    # seq_local 32 (was 48), for time: scattered ids (-1..2 anywhere) make every chunk's range meet every peer's,
    # so all chunks and partials travel at any length; 32 rows still give two chunks / K/V blocks per shard.
    ("scattered", False, "contiguous", 2, 32),
])
def test_segment_ids_decide_which_chunks_and_partials_travel_backward(kind, is_causal, layout, W, S):
    """The backward by the same rule: a K/V chunk reaches a peer iff the forward's rule says so, and the peer's
    partial dK/dV of that block comes back iff the chunk went (blocks are chunks here); the owner waits for
    exactly those. Gradients against float64."""
    B = 2
    ids = (testing.random_segment_ids(70 + W, B, S * W, max_len=8, padding=False) if kind == "packed"
           else _segments(kind, 70, B, S * W))
    ref, xs = testing.sharded_inputs(80 + W, W, B, S, 2, 1, 16, "float32", with_dout=True)
    call = simulate._prepare_grad(*xs, W, is_causal=is_causal, scale=None, layout=layout, timeout_s=30.0,
                                  segment_ids=ids)
    job = simulate._local_job(W, None)
    res = job.run_grad(call.spec, call.q_shards, call.k_shards, call.v_shards, call.dout_shards, timeout_s=30.0,
                       seg_shards=call.seg_shards)
    testing.check_grads(f"{kind} W={W} backward", simulate._finish_grad(call, res), *ref, "float32",
                        is_causal=is_causal, segment_ids=ids)
    epoch = int(res[0][4][3])
    n = S // TILE  # chunks and K/V blocks alike
    exp = _expected_chunks(call.seg_shards, W, S, B, is_causal=is_causal, layout=layout)
    for r in range(W):
        kv, part = _flags(job, r, W, 2 * (W - 1) * B * n).reshape(2, W - 1, B, n) == epoch
        np.testing.assert_array_equal(kv, exp[r], err_msg=f"K/V chunks received by rank {r}")
        # Partials of rank r's blocks from rank r + d: exactly where r's chunk went to r + d.
        sent = np.stack([exp[(r + d) % W][d - 1] for d in range(1, W)])
        np.testing.assert_array_equal(part, sent, err_msg=f"partials received by rank {r}")
    if kind == "packed":
        assert 0 < exp.sum() < exp.size // 2


# W=3 (was 4) in the first three, for time: their steps are written for any W, and with 3 ranks a step is still
# skipped (rank 2 skips step 2 under the window; ranks 0 and 1 skip steps under causal masking) or, in the zigzag,
# none is. The zigzag window keeps W=4: only there does a middle rank skip a step (step 2 of ranks 1 and 2).
@pytest.mark.parametrize("is_causal, layout, window, steps, W", [
    (True, "contiguous", (5, -1), lambda r, W: [0] if r == 0 else [0, 1], 3),  # one neighbour's last chunk
    (True, "contiguous", None, lambda r, W: list(range(r + 1)), 3),  # causal: only the ranks before
    (True, "zigzag", None, lambda r, W: list(range(W)), 3),  # zigzag: every rank sees some of every peer
    # zigzag: rank r holds chunks r and 2W-1-r, whose neighbours are held by ranks r-1 and r+1 (step 1 and W-1)
    (False, "zigzag", (3, 3), lambda r, W: [0] + [1] * (r > 0) + [W - 1] * (r < W - 1), 4),
])
def test_ring_steps_run_read_from_the_flags(is_causal, layout, window, steps, W):
    """``LaunchPlan.chunks_received`` / ``ring_steps_run`` (what the benchmark reports as the ring steps the
    kernel ran) decode the flags a call leaves, read through ``HeapRings.ring_flags``: forward and backward,
    they name exactly the steps that mask positions reach (steps skipped receive nothing at all)."""
    from ring_core.runtime import heap as heap_mod

    S = 32
    job, call, res, ref = _run_job(W, S, is_causal=is_causal, layout=layout, window=window)
    members = tuple(range(W))
    views = [heap_mod.HeapRings(r, [[h.data_ptr() for h in job.heaps]] * W, job.layout, job.heaps[r])
             for r in range(W)]
    for v in views:
        v.rings = job.slots  # the slot the simulated call used
    fwd = plans.plan(call.spec, W, job.layout, interpret=True)
    for r in range(W):
        epoch, words = views[r].ring_flags("jax", members, fwd.kv_flags)
        assert epoch == int(res[r][2][3]) == 1
        got = fwd.chunks_received(words, epoch)
        assert got[0] == 0 and [t for t in range(W) if t == 0 or got[t]] == steps(r, W), (r, got)
        assert fwd.ring_steps_run(words, epoch) == len(steps(r, W))
        if layout == "contiguous" and not window:  # causal: every chunk of every rank before this one
            assert all(got[t] == fwd.n_chunks for t in steps(r, W)[1:])
    # A gradient call on the same heaps, forward (epoch 2) then backward (epoch 3): the backward's K/V chunks
    # are the first flags too.
    _, xs = testing.sharded_inputs(5, W, 1, S, 2, 1, 16, "float32", with_dout=True)
    gcall = simulate._prepare_grad(*xs, W, is_causal=is_causal, scale=None, layout=layout, timeout_s=30.0,
                                   window_size=window)
    job.run_grad(gcall.spec, gcall.q_shards, gcall.k_shards, gcall.v_shards, gcall.dout_shards, timeout_s=30.0)
    bwd = plans.plan_bwd(gcall.spec, W, job.layout, interpret=True)
    for r in range(W):
        epoch, words = views[r].ring_flags("jax", members, bwd.kv_flags)
        assert epoch == 3 and bwd.ring_steps_run(words, epoch) == len(steps(r, W))
    with pytest.raises(ValueError, match="no torch ring"):
        views[0].ring_flags("torch", members, 1)
