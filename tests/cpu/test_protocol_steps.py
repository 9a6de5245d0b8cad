"""The masked Gluon backward's step plan (ring_core.protocol.steps.bwd_task_steps, bwd_step_unmasked, chunk_one_id), run
in Triton's interpreter against every pair the mask allows (numpy, ring_core.masks.allowed).

The Gluon backward (ring_core.kernels.gluon_bwd) cannot run on a CPU, but the rules that decide its work are protocol
helpers in triton.language, so they run here as they compile there: for each dK/dV task (a K/V block of 128 rows
of rank ``rank - d``) and each local query block of 64 or 128 rows (``configs.GLUON_BWD_Q_ROWS``: head_dim 128 and 64),
* every query row that attends some key of the block lies in the task's steps, and the block is then ``sent``
  (it reaches this rank, and its partial goes back): no pair is skipped;
* ``sent`` only where some query of this rank sees a row of the block by position (nothing sent or waited for in
  vain by position);
* a step marked unmasked holds only allowed pairs (its P is used without the mask);
* the owner of each block waits for a peer's partial exactly where that peer's task sends one
  (ring_core.protocol.steps.block_reaches asked from the owner's side, as both backwards' final tasks ask it, against
  the peer's ``sent``): no wait in vain, no partial unread.
* with the keys' ids apart from the queries' (KV_IDS: the two-level ring's calls with another node's K/V), the
  published chunk ranges are the keys' and the steps are narrowed by the queries' ranges per 128 rows
  (ring_core.protocol.steps.query_ranges, written in the interpreter as the delta tasks write them): well below
  the query blocks the positions reach.
The ranges the kernels read are built as ring_core.protocol.steps.publish_id_ranges writes them
(ring_core.testing.id_range_words: a chunk's lo counts padding as -1; the halves' ranges count ids >= 0). What the
Gluon kernel then computes with them is checked on a
GPU (tests/gpu/gpu_checks.py, section gluon-bwd-masks).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from ring_core import layout as L, masks, testing
    from ring_core.protocol import control, steps as protocol

    KV, CR = 128, 128
    QR = int(sys.argv[2])  # query rows a step


    @triton.jit
    def probe(rng, out, qseg, qrng, B, S, n_chunks, rank, W: tl.constexpr, CAUSAL: tl.constexpr,
              ZIGZAG: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr,
              SEGMENTED: tl.constexpr, QR: tl.constexpr, KV_IDS: tl.constexpr):
        t = tl.program_id(0)
        b = tl.program_id(1)
        n_kvb = S // 128
        d = t // n_kvb
        n0 = (t % n_kvb) * 128
        src = (rank - d + W) % W
        rng_b = protocol.ranges_of(rng, rank, b, B, n_chunks)
        if KV_IDS:  # the queries' ranges per 128 rows, as the Gluon backward's delta tasks write them
            q_rng_b = qrng + (t * B + b) * (S // 128) * 2  # (a table per program: no program reads another's)
            for r0 in range(0, S, 128):
                protocol.query_ranges(qseg + b * S, q_rng_b, r0, 128)
            sent, i_lo, n_m, i_full, i_fend, kv_t = protocol.bwd_task_steps(
                n0, d, src, rank, b, B, S, rng, rng_b, n_chunks, W, 128, QR, 128, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT,
                WIN_RIGHT, SEGMENTED, q_rng_b, 128)
        else:
            sent, i_lo, n_m, i_full, i_fend, kv_t = protocol.bwd_task_steps(
                n0, d, src, rank, b, B, S, rng, rng_b, n_chunks, W, 128, QR, 128, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT,
                WIN_RIGHT, SEGMENTED)
        base = out + (b * W * n_kvb + t) * (4 + S // QR + W)
        tl.store(base, sent)
        tl.store(base + 1, i_lo)
        tl.store(base + 2, n_m)
        for i in range(0, S // QR):
            m0 = i * QR
            u = protocol.bwd_step_unmasked(m0, i_full, i_fend, QR)
            if SEGMENTED:
                if KV_IDS:  # the load warp's test there: the query block's own ids all the block's one id
                    q_ids = tl.load(qseg + b * S + m0 + tl.arange(0, QR))
                    u = u & (tl.min(q_ids, axis=0) == kv_t) & (tl.max(q_ids, axis=0) == kv_t)
                else:
                    u = u & protocol.chunk_one_id(rng_b, m0 // 128, m0 >= 0, kv_t)
            tl.store(base + 4 + i, u.to(tl.int32))
        if d == 0:  # the owner's side: whether it waits for peer r's partial of this block
            my_lo, my_hi = protocol.published_range(rng, rank, b, B, n_chunks, n0 // 128)
            for r in tl.static_range(W):
                if r != rank:
                    w = protocol.block_reaches(n0, n0 + 128, protocol.positions(n0, rank, S, W, ZIGZAG), rank, r,
                                               rng, b, B, n_chunks, my_lo, my_hi, True, S, W, ZIGZAG, CAUSAL, WINDOW,
                                               WIN_LEFT, WIN_RIGHT, SEGMENTED)
                    tl.store(base + 4 + S // QR + r, w.to(tl.int32))




    out = []
    for W, B, S, causal, lay, window, seg, key_offset, kv_ids in json.loads(sys.argv[1]):
        window = tuple(window) if window else masks.NO_WINDOW
        win = masks.kernel_window(causal, window, W * S, key_offset)
        rs = np.random.default_rng(W * 100 + S + causal)
        G = None
        if seg:  # documents of 1-150 tokens, padding at the end and a run of 90 in the middle
            G = testing.random_segment_ids(int(rs.integers(1 << 20)), B, W * S, max_len=150)
            G[:, W * S // 3:W * S // 3 + 90] = -1
        Gk = G  # the keys' ids: with kv_ids another node's, whose documents share some ids with the queries'
        if kv_ids:
            Gk = testing.random_segment_ids(int(rs.integers(1 << 20)), B, W * S, max_len=400)
            Gk = np.where(Gk >= 0, Gk + int(G.max()) * 3 // 4, Gk)
            Gk[:, :W * S // 5] = G[:, W * S - W * S // 5:]  # a stretch whose ids the queries' end holds too
        pos = [L.global_positions(np, r, W, S, lay) for r in range(W)]
        local = [G[:, p] if seg else None for p in pos]
        klocal = [Gk[:, p] if seg else None for p in pos]
        words = []
        for r in range(W):
            w = testing.id_range_words(klocal[r], CR, lay == "zigzag") if seg else np.zeros((B, S // CR + 2, 2))
            if seg:  # the halves' ranges: the queries' (publish_id_ranges)
                w[:, -2:] = testing.id_range_words(local[r], CR, lay == "zigzag")[:, -2:]
            words.append(w)
        rng = torch.tensor(np.stack(words), dtype=torch.int32).reshape(-1)
        n_kvb = S // KV
        bad = []
        checked = steps = reach = 0
        per_rank = []
        for rank in range(W):
            res = torch.full((B * W * n_kvb * (4 + S // QR + W),), -7, dtype=torch.int32)
            wk = control.window_constexprs(win)
            qseg = torch.tensor(local[rank] if seg else np.zeros((B, S)), dtype=torch.int32).reshape(-1)
            qrng = torch.zeros((W * n_kvb * B * (S // 128) * 2,), dtype=torch.int32)
            probe[(W * n_kvb, B)](rng, res, qseg, qrng, B, S, S // CR, rank, W, causal, lay == "zigzag",
                                  wk["WINDOW"], wk["WIN_LEFT"], wk["WIN_RIGHT"], seg, QR, kv_ids)
            res = res.numpy().reshape(B, W * n_kvb, 4 + S // QR + W)
            per_rank.append(res)
            for b in range(B):
                for t in range(W * n_kvb):
                    d, n0 = t // n_kvb, (t % n_kvb) * KV
                    src = (rank - d) % W
                    kp = pos[src][n0:n0 + KV]
                    by_pos = masks.allowed(pos[rank], kp + key_offset, is_causal=causal, window=window)
                    by_pos = np.ones((S, KV), bool) if by_pos is None else by_pos
                    ok = by_pos
                    if seg:
                        q_ids, k_ids = local[rank][b], klocal[src][b, n0:n0 + KV]
                        ok = ok & (q_ids[:, None] == k_ids[None, :]) & (q_ids[:, None] >= 0)
                    sent, i_lo, n_m = res[b, t, :3]
                    unmasked = res[b, t, 4:4 + S // QR]
                    rows = np.nonzero(ok.any(axis=1))[0]
                    where = f"W{W} {lay} causal={causal} window={window} offset={key_offset} seg={seg} kv_ids={kv_ids} rank {rank} b {b} d {d} n0 {n0}"
                    checked += 1
                    steps += int(n_m)
                    if sent:  # the query blocks the positions let meet the block (the steps without ids)
                        reach += len(set(np.nonzero(by_pos.any(axis=1))[0] // QR))
                    if rows.size and not sent:
                        bad.append(f"{where}: rows {rows[:4]} attend the block, but it is not sent")
                    blocks = rows // QR
                    if rows.size and not ((blocks >= i_lo) & (blocks < i_lo + n_m)).all():
                        bad.append(f"{where}: query blocks {sorted(set(blocks))} outside the steps [{i_lo}, "
                                   f"{i_lo + n_m})")
                    if sent and not by_pos.any():
                        bad.append(f"{where}: sent, but no query of this rank sees it by position")
                    if not sent and n_m:
                        bad.append(f"{where}: {n_m} steps of a block not sent")
                    for i in range(i_lo, i_lo + n_m):
                        if unmasked[i] and not ok[i * QR:(i + 1) * QR].all():
                            bad.append(f"{where}: query block {i} unmasked but holds masked pairs")
        for owner in range(W):  # the owner waits for a peer's partial exactly where the peer sends it
            for b in range(B):
                for blk in range(n_kvb):
                    for r in range(W):
                        if r != owner:
                            waits = per_rank[owner][b, blk, 4 + S // QR + r]
                            sends = per_rank[r][b, ((r - owner) % W) * n_kvb + blk, 0]
                            checked += 1
                            if bool(waits) != bool(sends):
                                bad.append(f"W{W} {lay} causal={causal} window={window} offset={key_offset} seg={seg}: rank {owner} "
                                           f"block {blk} b {b}: waits for rank {r}'s partial {bool(waits)}, sent "
                                           f"{bool(sends)}")
        out.append(dict(checked=checked, bad=bad[:8], steps=steps, reach=reach))
    print(json.dumps(out))
""")

# (W, B, S, causal, layout, window, segment ids, key offset, the keys' ids apart from the queries'): every world size up to 3, both layouts, windows one-
# and two-sided and crossing shards, packed documents with padding, both masks together; bands off the diagonal
# (the two-level ring's calls with another node's K/V: keys a node's length before or after the queries, a side
# moved to exactly -1, a band that only the first rank's queries and the last rank's keys meet).
CASES = [(1, 2, 512, True, "contiguous", None, True, 0, False),
         (2, 1, 512, True, "zigzag", None, True, 0, False),
         (2, 2, 512, False, "contiguous", None, True, 0, False),
         (3, 1, 512, True, "contiguous", (300, -1), False, 0, False),
         (2, 1, 512, False, "zigzag", (200, 90), False, 0, False),
         (3, 1, 512, False, "zigzag", (200, 90), True, 0, False),
         (2, 1, 512, True, "zigzag", (150, -1), True, 0, False),
         (1, 1, 512, False, "contiguous", (64, 0), True, 0, False),
         (2, 1, 512, False, "contiguous", (300, 0), False, -1024, False),
         (2, 1, 512, False, "contiguous", (1023, -1), True, -1024, False),
         (3, 1, 512, False, "contiguous", (200, 0), False, -1536, False),
         (2, 1, 512, False, "contiguous", (0, 300), True, 1024, False),
         # calls with another node's K/V and its ids (KV_IDS): non-causal, the queries' and keys' documents apart
         # but for a stretch, with a band off the diagonal too
         (2, 2, 512, False, "contiguous", None, True, 0, True),
         (3, 1, 512, False, "contiguous", None, True, 0, True),
         (2, 1, 512, False, "contiguous", (1023, -1), True, -1024, True)]
# With KV_IDS the queries' ranges narrow the steps: at most this share of the query blocks the positions reach.
NARROWED = 0.6


@pytest.mark.parametrize("q_rows", [64, 128])
def test_masked_backward_steps_cover_every_allowed_pair_and_unmask_only_whole_blocks(q_rows):
    """The masked Gluon backward's plan of each dK/dV task (module docstring) against every pair the mask allows,
    for the cases above, each at every rank of its ring, in the interpreter, with ``q_rows`` query rows a step."""
    env = {k: v for k, v in os.environ.items()}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES), str(q_rows)], capture_output=True, text=True,
                       env=env,
                       cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == len(CASES)
    for case, g in zip(CASES, got):
        assert g["checked"] > 0 and not g["bad"], (case, g)
        if case[-1]:  # KV_IDS: narrowed by the queries' ranges, not every query block by position
            assert g["steps"] <= NARROWED * g["reach"], (case, g)



KEYED = textwrap.dedent("""
    import json
    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from ring_core import masks
    from ring_core.protocol import control, steps as protocol


    @triton.jit
    def rule(qp, kp, qs, ks, out, N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
             WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, KEYED: tl.constexpr):
        i = tl.arange(0, N)
        q_pos, k_pos, q_seg, k_seg = tl.load(qp + i), tl.load(kp + i), tl.load(qs + i), tl.load(ks + i)
        if KEYED:  # as the Gluon kernels key them: once per row and per column
            q_seg = protocol.segment_keys(q_seg, protocol.QUERY_PAD)
            k_seg = protocol.segment_keys(k_seg, protocol.KEY_PAD)
        ok = protocol.pairs_allowed(k_pos[None, :] >= 0, q_pos[:, None], k_pos[None, :], q_seg[:, None],
                                    k_seg[None, :], CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, True, KEYED)
        tl.store(out + i[:, None] * N + i[None, :], ok.to(tl.int32))


    rng = np.random.default_rng(7)
    N, bad, checked = 32, [], 0
    for trial in range(12):
        q_pos = rng.permutation(64)[:N].astype(np.int32)
        k_pos = rng.permutation(64)[:N].astype(np.int32)
        # ids with padding (several negative values), ids equal to the padding keys' numbers, large ids
        pool = np.array([-1, -2, -3, -7, 0, 1, 2, 3, 2147483647], np.int32)
        q_seg, k_seg = rng.choice(pool, N).astype(np.int32), rng.choice(pool, N).astype(np.int32)
        # windows, and one whose keys sit 9 positions before the queries' frame (a band off the diagonal)
        window, key_offset = [((-1, -1), 0), ((5, 3), 0), ((0, -1), 0), ((5, 3), -9)][trial % 4]
        causal = bool(trial % 2) and not key_offset
        want = masks.allowed(q_pos, k_pos + key_offset, is_causal=causal, window=window, q_segment_ids=q_seg[None],
                             k_segment_ids=k_seg[None])[0, 0, 0]
        wk = control.window_constexprs(masks.kernel_window(causal, window, 64, key_offset))
        for keyed in (False, True):
            out = torch.zeros((N, N), dtype=torch.int32)
            rule[(1,)](*(torch.from_numpy(x) for x in (q_pos, k_pos, q_seg, k_seg)), out, N, causal,
                       wk["WINDOW"], wk["WIN_LEFT"], wk["WIN_RIGHT"], keyed)
            checked += 1
            if not np.array_equal(out.numpy().astype(bool), want):
                bad.append([trial, keyed])
    print(json.dumps({"checked": checked, "bad": bad}))
""")


def test_keyed_segment_ids_give_the_same_rule():
    """protocol.pairs_allowed on ids keyed by protocol.segment_keys (KEYED=True, as the Gluon kernels' masked steps
    use it: one compare a pair) allows exactly the pairs of ring_core.masks.allowed, as the unkeyed rule does:
    padding of several negative values on both sides, ids equal to the keys' padding numbers, causal and windows,
    in the interpreter."""
    env = {k: v for k, v in os.environ.items()}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", KEYED], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"checked": 24, "bad": []}, got

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
