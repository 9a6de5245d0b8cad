"""The fused ring-attention backward kernel: one Triton source, used by both frontends and the simulator.

Every rank holds its shards of q, k, v, the forward's out and lse, and dout. dQ of a local query needs
every rank's K/V; dK/dV of a rank's K/V need every rank's Q/dO. So K/V travel to every peer (as in the
forward), each rank computes the contribution of its own queries to every rank's dK/dV, and the partial
dK/dV (float32) travel back to the owner of the K/V, which adds them in rank order. One launch per call;
gradients are accumulated in float32 and written in the input dtype, in a fixed order (bit-identical from
run to run; no float atomics).

Protocol (per call; "epoch" = this rank's call counter + 1, shared with the forward: ctl[0] counts every
fused call, forward or backward, so it is equal on every rank of a job that makes the same calls)
-------------------------------------------------------------------------------------------------------
* Tasks and tickets. The grid has one program per task. A program does not take its task from its
  program id: it takes a *ticket* from an atomic counter (CTL_BWD_TICKET) when it starts, and tickets
  are handed out in this order:
    1. dQ tasks (b, h, block of DQ_BLOCK_M query rows), the kv-head group's heads side by side (causal:
       the last query blocks, which see the most keys, first);
    2. partial tasks (peer distance d = 1..W-1, b, kv head, block of KV_BLOCK_N rows of the K/V of
       source rank ``rank - d``): this rank's contribution to that block's dK/dV;
    3. final tasks (b, kv head, block of KV_BLOCK_N rows of the local K/V): the local contribution, then
       the peers' partials of the same block added in rank order; writes dK/dV.
* Push work, exactly as in the forward: the local K/V is cut into *units* (peer distance d, b, kv head,
  chunk of CHUNK_BLOCKS*KV_BLOCK_N rows) claimed through the atomic counter ctl[1]; a claimed unit is
  copied into receive slot ``d-1`` of rank ``rank+d`` with ``iris.store`` and published by writing
  ``epoch`` into its flag there (release, system scope, after a CTA barrier). Under causal masking a unit
  that the receiver can never see (its first position after the receiver's last query position) is
  claimed but neither copied nor flagged; the receiver never waits for it and masks its rows at the load.
  dQ tasks claim one unit every SEG_BLOCKS K/V blocks while they work on the local K/V; every task drains
  the counter (pushes until none is left) before its first wait.
* delta = rowsum(dO * O) - dlse (float32; dlse, the cotangent of the forward's lse, is zero unless the
  caller differentiates through lse: d lse_i / d s_ij = P_ij, so it adds P * dlse to dS; on a padding row,
  whose lse is the constant -inf, dlse is selected away, so its delta is 0 whatever dlse holds). A dQ task
  computes it for its rows before anything else, stores it in the ``delta`` scratch output and counts
  itself in CTL_BWD_DELTA (release, after a CTA barrier); partial and final tasks wait (acquire) until
  all dQ tasks have counted, before their loop over the local queries. No second launch, and each value
  of delta is computed once.
* dQ tasks: ring step 0 uses the local K/V; step t >= 1 the K/V of rank ``rank-t`` from receive slot
  t-1, after waiting for the flag of every chunk the tile can see (before the loops: see the forward).
  Positions grow with the local row in both layouts, so under causal masking the K/V rows a tile sees
  are a prefix of the source's shard and the query blocks that see a K/V block are a suffix of the local
  shard: loops run over ranges of blocks, unmasked (plain loops Triton software-pipelines) where every
  query sees every key and masked on the diagonal and the tail; hidden blocks are never touched. Windows
  and segment ids narrow the ranges as in the forward (ring_core.protocol.steps); a padding row recomputes P with
  lse 0 in place of -inf (P is masked to 0 there, never exp(inf)), so it takes and gives no gradient.
* Partial tasks wait for the flags of the chunks of their K/V block, compute the block's dK/dV over all
  local queries of the G heads sharing the kv head, store them (float32) into receive slot ``d-1`` of
  the partial region of rank ``rank-d`` with ``iris.store`` and publish them with a release flag holding
  ``epoch`` (flags after the K/V flags). A block that no local query can see (causal, window) is neither
  computed nor sent, and its owner does not wait for it (both sides evaluate the same test). It runs over
  the local query blocks within reach of its keys only; with segment ids, over those whose ids can meet
  the block's, and only if the block's chunk came at all (its ids meet this rank's: the id ranges published
  with the call check), in which case its owner waits for the partial, else neither side does.
* Final tasks compute the local contribution, then wait for the flags of the peers' partials of their
  block, and add everything in rank order (ranks 0..W-1, the local one at its place), scale dK.
* End, exactly as in the forward: the last program to finish tells every peer it is done with this
  epoch, waits for the same from every peer, copies the error record into ``status``, resets the
  counters (claim, finish, ticket, delta) and stores ``epoch`` as the new call counter.

Why it cannot deadlock, and why a call cannot race the next: ring_core.protocol.steps (the forward's arguments,
then the backward's waits: why tasks come from tickets).

Never hangs
-----------
Every wait is bounded (``_poll_ge``). A timeout records (code, peer, step, block) in the control region
(first error wins) and makes every later wait on this rank give up at once. A partial task whose inputs
are not trustworthy (one of its waits failed) still publishes its partial, so the owner does not wait
out its own timeout, and records "peer failed" on the owner, so the owner's status reports it too.
The last program copies the record into ``status``, which the host turns into an exception.

Memory ordering: every acquire is a scalar poll by one thread, followed by a CTA barrier before the loads
it guards (cumulativity through bar.sync), and none sits inside a loop Triton pipelines
(tests/cpu/test_kernel_ir.py checks the sm_90 TTGIR). Every release follows a CTA barrier after the stores
it publishes.

Numerics (FA2's backward): scores, P = exp(scale*QK^T - lse) and dS = P * (dO V^T - delta) are float32;
fp16/bf16 dots run on tensor cores with float32 accumulation, P and dS rounded to the input dtype for
the dots that take them (as flash-attention does); float32 inputs use ``input_precision=DOT_PRECISION``.
dQ, dK, dV accumulate in float32; partials travel in float32; the outputs are rounded once.
"""

import triton
import triton.language as tl

import iris

from ring_core.protocol import control
from ring_core.protocol.steps import (CTL_BWD_DELTA, CTL_BWD_TICKET, CTL_ERROR, ERR_KV_TIMEOUT, ERR_PEER_FAILED,
                                      block_reaches, block_rows, chunk_needed, claim_push, drain_pushes, end_call,
                                      in_rows, key_ids, last_pos, pairs_allowed, poll_ge, positions, published_range,
                                      ranges_of, ranks_rng, record_error, record_peer_error, receive_slots,
                                      ring_context, row_blocks, rows_within, seg_blocks, start_call, step_blocks,
                                      tile_id_parts, tile_ids, visible_rows, wait_chunks, wait_rows)
from ring_core.kernels.tiles import dot, load_kv, query_tile

KIND_BWD = tl.constexpr(control.KIND_BWD)
ERR_PARTIAL_TIMEOUT = tl.constexpr(control.ERR_PARTIAL_TIMEOUT)
ERR_LOCAL_TIMEOUT = tl.constexpr(control.ERR_LOCAL_TIMEOUT)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, lo, hi, src, S, qk_scale, offs_n, offs_d,
               lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k,
               ROW_STRIDE: tl.constexpr, W: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr,
               INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr,
               WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr, rng_src_b, a_lo, a_hi, b_lo, b_hi,
               CHUNK_ROWS: tl.constexpr, ID_SKIP: tl.constexpr):
    """dQ of one query tile over K/V blocks [lo, hi) of rank ``src``. MASKED=False: every row of every block
    exists and every query of the tile sees every key (no masks: a plain loop Triton can software-pipeline;
    query rows past the shard have q = dO = 0, so they add nothing); MASKED=True: the tail block, the causal
    diagonal and the window's and segments' edges, reading only rows the tile may attend (as the forward's
    ``_attn_blocks``: rows in [lo1, hi1) | [lo2, hi2) whose id lies in [s_lo, s_hi]; with ID_SKIP, none of a
    chunk whose published id range misses the tile's: it was not sent). Nothing in here waits: the caller
    acquired every chunk these blocks read."""
    dmask = offs_d < D
    for j in range(lo, hi):
        # Rows the tile cannot see may never have been sent: not read (CAUSAL_ROWS).
        rows_n, row_ok, k_pos, k_seg = block_rows(j, offs_n, src, S, q_pos_max, lo1, hi1, lo2, hi2, seg_k, s_lo,
                                                  s_hi, rng_src_b, a_lo, a_hi, b_lo, b_hi, W, BLOCK_N, CHUNK_ROWS,
                                                  MASKED, CAUSAL, ZIGZAG, WINDOW, SEGMENTED, ID_SKIP, True)
        # ROW_STRIDE is a constexpr so that Triton can prove alignment and vectorise (and pipeline) the loads.
        kv_off = rows_n[:, None].to(tl.int64) * ROW_STRIDE + offs_d[None, :]
        k, v = load_kv(k_base, v_base, kv_off, row_ok, dmask, MASKED, BLOCK_D == D)
        qk = dot(q, tl.trans(k), DOT_PRECISION, INTERPRET)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            valid = pairs_allowed(row_ok[None, :], q_pos[:, None], k_pos[None, :], q_seg[:, None], k_seg[None, :],
                                  CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
            p = tl.where(valid, p, 0.0)
        dp = dot(do, tl.trans(v), DOT_PRECISION, INTERPRET)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(k.dtype), k, DOT_PRECISION, INTERPRET)
    return dq


@triton.jit
def _dkdv_blocks(dk, dv, k, v, k_pos, k_seg, q_ptr, do_ptr, lse_ptr, delta_ptr, seg_q, q_base, row_base, lo, hi,
                 rank, S, qk_scale, offs_m, offs_d, H: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                 WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr):
    """The contribution of local query blocks [lo, hi) of one head (``q_base``: its offset in q/dO,
    ``row_base``: in lse/delta) to dK/dV of one K/V block. MASKED=False: every query row exists and sees
    every key of the block (K/V rows past the shard only touch their own dK/dV rows, never stored);
    MASKED=True: the causal diagonal, the window's and segments' edges and the tail block (``seg_q``: the
    local queries' ids; ``k_seg``: the block's, -1 on rows no local query can see). Nothing in here waits:
    delta was acquired before."""
    dmask = offs_d < D
    for i in range(lo, hi):
        rows = i * BLOCK_M + offs_m
        q_off = q_base + rows[:, None].to(tl.int64) * (H * D) + offs_d[None, :]
        if MASKED:
            m_valid = rows < S
            q = tl.load(q_ptr + q_off, mask=m_valid[:, None] & dmask[None, :], other=0.0)
            do = tl.load(do_ptr + q_off, mask=m_valid[:, None] & dmask[None, :], other=0.0)
            lse2 = tl.load(lse_ptr + row_base + rows, mask=m_valid, other=0.0) * _LOG2E
            if SEGMENTED:
                lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # padding rows: P = 0 below, not exp(inf) * 0
            dl = tl.load(delta_ptr + row_base + rows, mask=m_valid, other=0.0)
        else:
            if BLOCK_D == D:
                q = tl.load(q_ptr + q_off)
                do = tl.load(do_ptr + q_off)
            else:
                q = tl.load(q_ptr + q_off, mask=dmask[None, :], other=0.0)
                do = tl.load(do_ptr + q_off, mask=dmask[None, :], other=0.0)
            lse2 = tl.load(lse_ptr + row_base + rows) * _LOG2E
            dl = tl.load(delta_ptr + row_base + rows)
        qkT = dot(k, tl.trans(q), DOT_PRECISION, INTERPRET)  # [BLOCK_N, BLOCK_M]
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            q_pos = positions(rows, rank, S, W, ZIGZAG)  # unused (folded away) without CAUSAL and WINDOW
            q_seg = rows  # the local queries' ids under SEGMENTED (read only then)
            if SEGMENTED:
                q_seg = tl.load(seg_q + rows, mask=m_valid, other=-1)
            validT = pairs_allowed(m_valid[None, :], q_pos[None, :], k_pos[:, None], q_seg[None, :], k_seg[:, None],
                                   CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
            pT = tl.where(validT, pT, 0.0)
        dv += dot(pT.to(do.dtype), do, DOT_PRECISION, INTERPRET)
        dpT = dot(v, tl.trans(do), DOT_PRECISION, INTERPRET)
        dsT = pT * (dpT - dl[None, :])
        dk += dot(dsT.to(q.dtype), q, DOT_PRECISION, INTERPRET)
    return dk, dv


# The timeout is not specialised on its value (no binary per timeout); B and S are, as Triton's JIT does
# (the JAX launcher, ring_core.runtime.build, specialises them alike: one binary for both frontends).
@triton.jit
def _dq_task(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, seg_ptr, kseg_ptr, B, S, sm_scale, timeout_ns,
             dq_ptr, delta_ptr, heap_bases, rank, ctl, flags, epoch, recv, seg_recv, n_chunks, rng, n_push, B64,
             qk_scale, offs_d, dmask, tid, call_ok, W: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr,
             D: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             PUSH_ROWS: tl.constexpr, SEG_BLOCKS: tl.constexpr, PUSH_VEC: tl.constexpr, POLL_N: tl.constexpr,
             CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
             WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr,
             G: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """The dQ task ``tid`` (< n_dq): one (batch, head, DQ_BLOCK_M query rows) tile's dQ over every rank's K/V, in ring
    order, pushing this rank's K/V units between its local blocks as the forward does; NaN if a wait gave up."""
    valid = call_ok  # 0 once a wait of this task gave up: its result is then written as NaN
    b, h, hkv, m_blk = query_tile(tid, G, tl.cdiv(S, DQ_BLOCK_M), HKV, CAUSAL)
    offs_m = m_blk * DQ_BLOCK_M + tl.arange(0, DQ_BLOCK_M)
    m_valid = offs_m < S
    qmask = m_valid[:, None] & dmask[None, :]
    q_off = ((b.to(tl.int64) * S + offs_m[:, None]) * H + h) * D + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=qmask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=qmask, other=0.0)
    o = tl.load(o_ptr + q_off, mask=qmask, other=0.0)
    row_off = (b.to(tl.int64) * H + h) * S + offs_m
    # The cotangent of lse enters every dS through delta: dS = P * (dP - (rowsum(dO * O) - dlse)).
    if SEGMENTED:
        # A padding row's lse is the constant -inf: its dlse is selected away (not multiplied: it may be
        # inf or NaN there), so its delta is 0 (its out is 0) and it takes and gives no gradient.
        dlse = tl.load(dlse_ptr + row_off, mask=m_valid, other=0.0)
        dlse = tl.where(tl.load(lse_ptr + row_off, mask=m_valid, other=0.0) == float("-inf"), 0.0, dlse)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1) - dlse
    else:
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1) - tl.load(dlse_ptr + row_off, mask=m_valid,
                                                                             other=0.0)
    tl.store(delta_ptr + row_off, delta, mask=m_valid)
    # Every thread's delta stores before the count (cumulativity through bar.sync), then publish.
    tl.debug_barrier()
    tl.atomic_add(ctl + CTL_BWD_DELTA, 1, sem="release", scope="gpu")
    lse2 = tl.load(lse_ptr + row_off, mask=m_valid, other=0.0) * _LOG2E
    if SEGMENTED:
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # padding rows: P = 0 (masked), never exp(inf)
    q_pos = positions(offs_m, rank, S, W, ZIGZAG)
    q_pos_max = tl.max(tl.where(m_valid, q_pos, -1), axis=0)
    q_pos_min = tl.min(tl.where(m_valid, q_pos, 2147483647), axis=0)
    seg_q = seg_ptr + b.to(tl.int64) * S  # this rank's ids of batch b (SEGMENTED only)
    q_seg, s_lo, s_hi, t_id = tile_ids(seg_q, offs_m, m_valid, SEGMENTED)
    a_lo, a_hi, b_lo, b_hi = tile_id_parts(q_seg, offs_m, S, ZIGZAG)  # (SEGMENTED: the chunks it waits for)
    offs_n = tl.arange(0, DQ_BLOCK_N)
    dq = tl.zeros([DQ_BLOCK_M, BLOCK_D], tl.float32)
    for step in tl.static_range(W):
        src = (rank - step + W) % W
        # The K/V blocks of rank src this task visits, as a forward tile's (ring_core.protocol.steps.step_blocks);
        # with causal masking only, rows from ``seen`` on are hidden: never waited for, loaded or computed.
        j_lo, n_full_lo, n_full, n_hi, lo1, hi1, lo2, hi2, seen = step_blocks(
            m_blk * DQ_BLOCK_M, tl.minimum(m_blk * DQ_BLOCK_M + DQ_BLOCK_M, S), q_pos_min, q_pos_max, s_hi, rank,
            src, S, W, DQ_BLOCK_N, ZIGZAG, CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
        if step == 0:
            k_base = k_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            v_base = v_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            seg_k = kseg_ptr + b.to(tl.int64) * S
            if SEGMENTED:
                j_lo, n_full_lo, n_full, n_hi = seg_blocks(seg_k, j_lo, n_hi, lo1, hi1, lo2, hi2, n_full_lo,
                                                           n_full, s_lo, s_hi, t_id, DQ_BLOCK_N,
                                                           ranges_of(rng, rank, b, B, n_chunks), a_lo, a_hi, b_lo,
                                                           b_hi, CHUNK_ROWS, False)
            if WINDOW or SEGMENTED:
                dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, j_lo, n_full_lo, src,
                                S, qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, HKV * D,
                                W, D, DQ_BLOCK_N, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW,
                                WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
                dq = dq * (sm_scale * 0.0 + 1.0)  # see below (C7515)
            if W > 1:
                # Overlap: claim and push one unit of the local K/V every SEG_BLOCKS blocks; the claims
                # sit between the pipelined loops, never inside them.
                for seg in range(n_full_lo, n_full, SEG_BLOCKS):
                    claim_push(ctl, n_push, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch,
                               B, S, n_chunks, W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG,
                               WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, rng, SEGMENTED)
                    dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, seg,
                                    tl.minimum(seg + SEG_BLOCKS, n_full), src, S, qk_scale, offs_n, offs_d,
                                    lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, HKV * D, W, D, DQ_BLOCK_N,
                                    BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT,
                                    WIN_RIGHT, SEGMENTED,
                                    rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
                # dq times exactly 1 (sm_scale is finite): without a non-wgmma definition of the
                # accumulator between this loop nest and the next loop, ptxas serialises every wgmma of
                # the kernel (warning C7515): each k-step of every matmul then waits for the one before
                # (tests/cpu/test_kernel_ir.py checks that this stays away).
                dq = dq * (sm_scale * 0.0 + 1.0)
            else:
                dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, n_full_lo, n_full, src,
                                S, qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, HKV * D,
                                W, D, DQ_BLOCK_N, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW,
                                WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
            dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, n_full, n_hi, src, S,
                            qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, HKV * D, W, D,
                            DQ_BLOCK_N, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT,
                            WIN_RIGHT, SEGMENTED,
                            rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
        else:
            slot = step - 1
            k_base = recv + ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
            v_base = k_base + B64 * HKV * S * D
            seg_k = seg_recv + ((slot * B + b).to(tl.int64) * HKV + hkv) * S
            rng_src = ranges_of(rng, src, b, B, n_chunks)  # src's published id ranges of batch b
            if step == 1:
                # Every task passes here, also one that needs nothing from any peer (module docstring, (a)).
                drain_pushes(ctl, n_push, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch, B,
                             S, n_chunks, W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG,
                             WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, rng, SEGMENTED)
            # Every chunk this tile can see, before the loops that read them (protocol.wait_chunks says
            # why). Every chunk that holds a row the tile sees holds one that a query of this rank sees, so
            # its owner pushed it (protocol.chunk_needed; causal: it starts at a position the tile sees).
            flag0 = flags + (slot * B * HKV + b * HKV + hkv) * n_chunks
            if WINDOW or SEGMENTED:
                valid = valid * wait_rows(flag0, lo1, hi1, lo2, hi2, CHUNK_ROWS, epoch, ctl, timeout_ns, src,
                                          step, INTERPRET, POLL_N, rng_src, a_lo, a_hi, b_lo, b_hi, SEGMENTED)
                if SEGMENTED:  # ids travel with their chunk: read after the wait, they narrow the loops
                    j_lo, n_full_lo, n_full, n_hi = seg_blocks(seg_k, j_lo, n_hi, lo1, hi1, lo2, hi2, n_full_lo,
                                                               n_full, s_lo, s_hi, t_id, DQ_BLOCK_N, rng_src,
                                                               a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, SEGMENTED)
                dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, j_lo, n_full_lo, src,
                                S, qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, D, W, D,
                                DQ_BLOCK_N, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW,
                                WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                rng_src, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, SEGMENTED)
                dq = dq * (sm_scale * 0.0 + 1.0)  # (C7515, above)
            else:
                valid = valid * wait_chunks(flag0, 0, tl.cdiv(seen, CHUNK_ROWS), epoch, ctl, timeout_ns, src,
                                            step, INTERPRET, POLL_N, flags, s_lo, s_hi, s_lo, s_hi, False)
            dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, n_full_lo, n_full, src, S,
                            qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, D, W, D,
                            DQ_BLOCK_N, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT,
                            WIN_RIGHT, SEGMENTED,
                            rng_src, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, SEGMENTED)
            dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, q_pos_max, k_base, v_base, n_full, n_hi, src, S,
                            qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, D, W, D,
                            DQ_BLOCK_N, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT,
                            WIN_RIGHT, SEGMENTED,
                            rng_src, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, SEGMENTED)
    dq = tl.where(valid != 0, dq * sm_scale, float("nan"))  # NaN, not a wrong value, if a wait gave up
    tl.store(dq_ptr + q_off, dq.to(dq_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _dkdv_out(B, S, sm_scale, timeout_ns, dk_ptr, dv_ptr, heap_bases, rank, ctl, flags, epoch, part, n_chunks,
              n_units, rng, call_ok, n_kvb, B64, offs_d, dmask, d, n_blk, bh, b, hkv, src, inputs_ok, n0, n1, rows_n,
              n_valid, k_pos_min, bkv, my_lo, my_hi, block_needed, dk, dv, W: tl.constexpr, HKV: tl.constexpr,
              D: tl.constexpr, KV_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PART_VEC: tl.constexpr,
              CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, WINDOW: tl.constexpr,
              WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr):
    """A dK/dV task's result: a partial task's unscaled float32 dK/dV into the owner's partial slot, then its
    flag; a final task's own part plus every peer's partial, in rank order, scaled and stored (NaN if an input
    is missing or a peer failed)."""
    part_rows = rows_n[:, None].to(tl.int64) * D + offs_d[None, :]
    out_mask = n_valid[:, None] & dmask[None, :]
    if d > 0:
        if block_needed & (call_ok == 1):
            # Unscaled float32 partials into slot d-1 of the owner's partial region.
            slot = d - 1
            dst = ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
            iris.store(part + dst + part_rows, dk, rank, src, heap_bases, mask=out_mask, hint=(1, PART_VEC))
            iris.store(part + dst + B64 * HKV * S * D + part_rows, dv, rank, src, heap_bases, mask=out_mask,
                       hint=(1, PART_VEC))
            tl.debug_barrier()
            if inputs_ok == 0:
                # Published anyway (the owner must not wait out its timeout), but marked untrustworthy:
                # the owner's status will say this rank failed.
                record_peer_error(ctl, heap_bases, rank, src, ERR_PEER_FAILED, d)
            iris.atomic_xchg(flags + n_units + (slot * B * HKV + bh) * n_kvb + n_blk, epoch, rank, src,
                             heap_bases, sem="release", scope="sys")
    else:
        # Final task: wait for every peer's partial of this block before reading any of them. A peer
        # sends one exactly when some query of it sees the block (the test its partial task makes).
        for r in tl.static_range(W):
            if r != rank:
                if block_reaches(n0, n1, k_pos_min, rank, r, rng, b, B, n_chunks, my_lo, my_hi, True, S, W, ZIGZAG,
                                 CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED):
                    rslot = (r - rank + W) % W - 1
                    flag = flags + n_units + (rslot * B * HKV + bh) * n_kvb + n_blk
                    ok = poll_ge(flag, epoch, ctl, timeout_ns, INTERPRET)
                    if ok == 0:
                        record_error(ctl, ERR_PARTIAL_TIMEOUT, r, rslot + 1, n_blk)
        tl.debug_barrier()
        # Valid only if every input arrived and nothing failed: a peer that sent an untrustworthy partial
        # marked this rank's error word (ERR_PEER) before publishing it, so the acquires above see it.
        err_now = tl.atomic_add(ctl + CTL_ERROR, 0, sem="acquire", scope="gpu")
        valid = inputs_ok * call_ok * (err_now == 0).to(tl.int32)
        # Sum in rank order, the local contribution at its place: the same order on every run.
        for which in tl.static_range(2):
            if which == 0:
                local = dk
            else:
                local = dv
            total = tl.zeros([KV_BLOCK_N, BLOCK_D], tl.float32)
            for r in tl.static_range(W):
                if r == rank:
                    total += local
                else:
                    if block_reaches(n0, n1, k_pos_min, rank, r, rng, b, B, n_chunks, my_lo, my_hi, True, S, W,
                                     ZIGZAG, CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED):
                        rslot = (r - rank + W) % W - 1
                        src_off = ((rslot * 2 * B + which * B + b).to(tl.int64) * HKV + hkv) * S * D
                        total += tl.load(part + src_off + part_rows, mask=out_mask, other=0.0)
            out_off = bkv + rows_n[:, None].to(tl.int64) * (HKV * D) + offs_d[None, :]
            total = tl.where(valid != 0, total, float("nan"))
            if which == 0:
                total = total * sm_scale
                tl.store(dk_ptr + out_off, total.to(dk_ptr.dtype.element_ty), mask=out_mask)
            else:
                tl.store(dv_ptr + out_off, total.to(dv_ptr.dtype.element_ty), mask=out_mask)



@triton.jit
def _wait_block_chunks(inputs_ok, flags, epoch, ctl, timeout_ns, n0, src, rank, d, b, hkv, B, S, n_chunks, my_last,
                       W: tl.constexpr, HKV: tl.constexpr, KV_BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                       CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr,
                       WIN_RIGHT: tl.constexpr, INTERPRET: tl.constexpr):
    """A partial task's wait for the chunks holding its K/V block's rows that some local query sees (pushed: the
    pusher made the same test), from receive slot d-1; ``inputs_ok`` 0 if a wait gave up."""
    slot = d - 1
    c_end = (tl.minimum(n0 + KV_BLOCK_N, S) - 1) // CHUNK_ROWS + 1
    for c in range(n0 // CHUNK_ROWS, c_end):
        chunk_need = True
        if WINDOW:
            chunk_need = chunk_needed(c, src, rank, S, CHUNK_ROWS, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT)
        elif CAUSAL:
            chunk_need = positions(c * CHUNK_ROWS, src, S, W, ZIGZAG) <= my_last
        if chunk_need:
            flag = flags + (slot * B * HKV + b * HKV + hkv) * n_chunks + c
            ok = poll_ge(flag, epoch, ctl, timeout_ns, INTERPRET)
            if ok == 0:
                record_error(ctl, ERR_KV_TIMEOUT, src, d, c)
                inputs_ok = inputs_ok * 0
    return inputs_ok


@triton.jit
def _dkdv_task(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, seg_ptr, kseg_ptr, B, S, sm_scale, timeout_ns, dk_ptr, dv_ptr,
               delta_ptr, heap_bases, rank, ctl, flags, epoch, recv, seg_recv, part, n_chunks, n_units, rng, call_ok,
               n_push, n_kvb, n_dq, n_part, B64, my_last, qk_scale, offs_d, dmask, tid, W: tl.constexpr,
               H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, KV_BLOCK_N: tl.constexpr, KV_BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr, PUSH_ROWS: tl.constexpr, PUSH_VEC: tl.constexpr, PART_VEC: tl.constexpr,
               CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
               WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr,
               G: tl.constexpr, CHUNK_ROWS: tl.constexpr, KV_IDS: tl.constexpr):
    """The dK/dV task ``tid`` (>= n_dq): a partial one (a peer's K/V block against this rank's queries, sent back to
    its owner) or a final one (this rank's K/V block: its own part plus every peer's partial, summed in rank order)."""
    t = tid - n_dq
    per_d = B * HKV * n_kvb
    is_final = t >= n_part
    d = tl.where(is_final, 0, t // per_d + 1)  # peer distance of the K/V's owner; 0: local K/V
    rem = tl.where(is_final, t - n_part, t % per_d)
    n_blk = rem % n_kvb
    bh = rem // n_kvb
    b = bh // HKV
    hkv = bh % HKV
    src = (rank - d + W) % W
    # Never wait while push units are unclaimed (module docstring, (a)).
    drain_pushes(ctl, n_push, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch, B, S,
                 n_chunks, W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT,
                 WIN_RIGHT, SEGMENTED, rng, SEGMENTED)
    inputs_ok = poll_ge(ctl + CTL_BWD_DELTA, n_dq, ctl, timeout_ns, INTERPRET)
    if inputs_ok == 0:
        record_error(ctl, ERR_LOCAL_TIMEOUT, rank, d, n_blk)

    n0 = n_blk * KV_BLOCK_N
    n1 = tl.minimum(n0 + KV_BLOCK_N, S)
    rows_n = n0 + tl.arange(0, KV_BLOCK_N)
    n_valid = rows_n < S
    k_pos = positions(rows_n, src, S, W, ZIGZAG)
    k_pos_min = positions(n0, src, S, W, ZIGZAG)
    n_mk = tl.cdiv(S, KV_BLOCK_M)
    if WINDOW or SEGMENTED:
        # Local query rows that see some key of the block by position ([ql1, qh1) | [ql2, qh2): query
        # blocks [i_lo, i_hi)) and those that see every key ([i_full, i_fend): unmasked).
        ql1, qh1, ql2, qh2, qf_lo, qf_hi = rows_within(n0, n1, src, rank, S, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT,
                                                       False)
        i_lo, i_full, i_fend, i_hi = row_blocks(ql1, qh1, ql2, qh2, qf_lo, qf_hi, KV_BLOCK_M)
        if WINDOW:
            # Rows of this block some local query sees by position (others may not have been sent: not read).
            sl1, sh1, sl2, sh2, _, _ = rows_within(0, S, rank, src, S, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT,
                                                   True)
            row_ok = n_valid & in_rows(rows_n, sl1, sh1, sl2, sh2)
        elif CAUSAL:
            row_ok = n_valid & (k_pos <= my_last)
        else:
            row_ok = n_valid
    elif CAUSAL:
        # Local query blocks [i_lo, n_mk) see some key of this block; from i_full on, all of them.
        k_pos_max = positions(tl.minimum(n0 + KV_BLOCK_N, S) - 1, src, S, W, ZIGZAG)
        i_lo = visible_rows(k_pos_min - 1, rank, S, W, ZIGZAG) // KV_BLOCK_M
        i_full = tl.maximum(tl.cdiv(visible_rows(k_pos_max - 1, rank, S, W, ZIGZAG), KV_BLOCK_M), i_lo)
        row_ok = n_valid & (k_pos <= my_last)  # rows no local query sees: maybe never sent, not read
    else:
        i_lo = n0 * 0
        i_full = n0 * 0
        row_ok = n_valid
    bkv = b.to(tl.int64) * S * HKV * D + hkv * D
    seg_own = seg_ptr + b.to(tl.int64) * S  # this rank's ids of batch b (SEGMENTED only)
    my_lo = n0 * 0  # a final task's chunk's id range (SEGMENTED only; set below)
    my_hi = my_lo
    c_lo = my_lo  # a partial task's (SEGMENTED only)
    c_hi = my_lo
    if SEGMENTED:
        if d > 0:
            # A partial task: the K/V chunk holding this block came (and its partial goes back) only if its
            # ids meet a half of this rank's shard: the range its owner published against this rank's halves
            # as this rank publishes them (protocol.push_unit made the same test).
            c_lo, c_hi = published_range(rng, src, b, B, n_chunks, n0 // CHUNK_ROWS)
        else:
            # A final task: its chunk's range as published, for the same test from this side.
            my_lo, my_hi = published_range(rng, rank, b, B, n_chunks, n0 // CHUNK_ROWS)
    # Whether the block is here at all (and, for a partial task, its partial goes back): protocol.block_reaches,
    # the test its pusher made and its owner makes of this rank.
    block_needed = block_reaches(n0, n1, k_pos_min, src, rank, rng, b, B, n_chunks, c_lo, c_hi, d > 0, S, W,
                                 ZIGZAG, CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
    if d > 0:
        slot = d - 1
        k_base = recv + ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
        v_base = k_base + B64 * HKV * S * D
        seg_k = seg_recv + ((slot * B + b).to(tl.int64) * HKV + hkv) * S
        row_stride = rank * 0 + D
        if block_needed:
            inputs_ok = _wait_block_chunks(inputs_ok, flags, epoch, ctl, timeout_ns, n0, src, rank, d, b, hkv, B, S,
                                           n_chunks, my_last, W, HKV, KV_BLOCK_N, CHUNK_ROWS, CAUSAL, ZIGZAG, WINDOW,
                                           WIN_LEFT, WIN_RIGHT, INTERPRET)
    else:
        k_base = k_ptr + bkv
        v_base = v_ptr + bkv
        seg_k = kseg_ptr + b.to(tl.int64) * S
        row_stride = rank * 0 + HKV * D
    tl.debug_barrier()  # every thread's loads below after the acquires above (see the dQ task)
    dk = tl.zeros([KV_BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([KV_BLOCK_N, BLOCK_D], tl.float32)
    if block_needed:
        kv_off = rows_n[:, None].to(tl.int64) * row_stride + offs_d[None, :]
        kv_mask = row_ok[:, None] & dmask[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        offs_mk = tl.arange(0, KV_BLOCK_M)
        n_mfull = S // KV_BLOCK_M
        seg_q = seg_own  # the local queries' ids (SEGMENTED only)
        if SEGMENTED:
            # The block's ids (after the wait: they travel with it) narrow the local query blocks to those
            # that may hold a pair (protocol.seg_blocks).
            k_seg, s_lo, s_hi, t_id = tile_ids(seg_k, rows_n, row_ok, SEGMENTED)
            i_lo, i_full, i_fend, i_hi = seg_blocks(seg_q, i_lo, i_hi, ql1, qh1, ql2, qh2, i_full, i_fend, s_lo,
                                                    s_hi, t_id, KV_BLOCK_M,
                                                    ranges_of(rng, rank, b, B, n_chunks), s_lo, s_hi, s_lo, s_hi,
                                                    CHUNK_ROWS, False, not KV_IDS)
        else:
            k_seg = k_pos  # unused
        # Fixed order: head g of the group, then local query blocks (deterministic accumulation).
        for g in range(0, G):
            h = hkv * G + g
            q_base = b.to(tl.int64) * S * H * D + h * D
            row_base = (b.to(tl.int64) * H + h) * S
            if WINDOW or SEGMENTED:
                dk, dv = _dkdv_blocks(dk, dv, k, v, k_pos, k_seg, q_ptr, do_ptr, lse_ptr, delta_ptr, seg_q, q_base,
                                      row_base, i_lo, i_full, rank, S, qk_scale, offs_mk, offs_d, H, W, D,
                                      KV_BLOCK_M, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW,
                                      WIN_LEFT, WIN_RIGHT, SEGMENTED)
                dk, dv = _dkdv_blocks(dk, dv, k, v, k_pos, k_seg, q_ptr, do_ptr, lse_ptr, delta_ptr, seg_q, q_base,
                                      row_base, i_full, i_fend, rank, S, qk_scale, offs_mk, offs_d, H, W, D,
                                      KV_BLOCK_M, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW,
                                      WIN_LEFT, WIN_RIGHT, SEGMENTED)
                dk, dv = _dkdv_blocks(dk, dv, k, v, k_pos, k_seg, q_ptr, do_ptr, lse_ptr, delta_ptr, seg_q, q_base,
                                      row_base, i_fend, i_hi, rank, S, qk_scale, offs_mk, offs_d, H, W, D,
                                      KV_BLOCK_M, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW,
                                      WIN_LEFT, WIN_RIGHT, SEGMENTED)
            else:
                dk, dv = _dkdv_blocks(dk, dv, k, v, k_pos, k_seg, q_ptr, do_ptr, lse_ptr, delta_ptr, seg_q, q_base,
                                      row_base, i_lo, tl.minimum(i_full, n_mk), rank, S, qk_scale, offs_mk, offs_d,
                                      H, W, D, KV_BLOCK_M, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION,
                                      WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
                dk, dv = _dkdv_blocks(dk, dv, k, v, k_pos, k_seg, q_ptr, do_ptr, lse_ptr, delta_ptr, seg_q, q_base,
                                      row_base, i_full, n_mfull, rank, S, qk_scale, offs_mk, offs_d, H, W, D,
                                      KV_BLOCK_M, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW,
                                      WIN_LEFT, WIN_RIGHT, SEGMENTED)
                dk, dv = _dkdv_blocks(dk, dv, k, v, k_pos, k_seg, q_ptr, do_ptr, lse_ptr, delta_ptr, seg_q, q_base,
                                      row_base, tl.maximum(i_full, n_mfull), n_mk, rank, S, qk_scale, offs_mk,
                                      offs_d, H, W, D, KV_BLOCK_M, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET,
                                      DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)

    _dkdv_out(B, S, sm_scale, timeout_ns, dk_ptr, dv_ptr, heap_bases, rank, ctl, flags, epoch, part, n_chunks,
              n_units, rng, call_ok, n_kvb, B64, offs_d, dmask, d, n_blk, bh, b, hkv, src, inputs_ok, n0, n1, rows_n,
              n_valid, k_pos_min, bkv, my_lo, my_hi, block_needed, dk, dv, W, HKV, D, KV_BLOCK_N, BLOCK_D, PART_VEC,
              CAUSAL, ZIGZAG, INTERPRET, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)


@triton.jit(do_not_specialize=["timeout_ns", "part_off"])
def ring_attn_bwd_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, seg_ptr, ctx_ptr,
    # runtime scalars
    B, S, sm_scale, timeout_ns, part_off,
    # outputs (delta: float32 [B, H, S] scratch)
    dq_ptr, dk_ptr, dv_ptr, delta_ptr, status_ptr,
    # constexprs
    W: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr, KV_BLOCK_N: tl.constexpr, KV_BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK_BLOCKS: tl.constexpr, PUSH_ROWS: tl.constexpr, SEG_BLOCKS: tl.constexpr,
    PUSH_VEC: tl.constexpr, PART_VEC: tl.constexpr, POLL_N: tl.constexpr,
    CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SIG_DTYPE: tl.constexpr, STICKY_ERRORS: tl.constexpr,
    WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr,
    KV_IDS: tl.constexpr,  # the keys' ids are not the queries' (protocol.key_ids; ring_core.kernels.tl_fwd)
    DETERMINISTIC: tl.constexpr,  # the Gluon backward's (ring_core.kernels.gluon_bwd); this one sums in a fixed order
):
    G: tl.constexpr = H // HKV
    CHUNK_ROWS: tl.constexpr = CHUNK_BLOCKS * KV_BLOCK_N

    # ---- this rank's ring: heap bases, position, its slot's control words and flags, receive region --
    heap_bases, rank, ctl, flags, recv_addr, epoch = ring_context(ctx_ptr, W)
    recv, seg_recv = receive_slots(recv_addr, seg_ptr, rank, B, S, q_ptr, W, HKV, D, SEGMENTED)
    kseg_ptr = key_ids(seg_ptr, B, S, KV_IDS)  # the ids of the K/V this rank holds (SEGMENTED only)
    # The partial dK/dV slots: part_off is a multiple of ALIGN (ring_core.protocol.control), so their loads vectorise.
    part = (recv_addr + (rank * 0 + part_off).to(tl.uint64)).to(tl.pointer_type(tl.float32), bitcast=True)
    part = tl.multiple_of(part, 16)

    n_chunks = tl.cdiv(S, CHUNK_ROWS)
    n_units = (W - 1) * B * HKV * n_chunks  # K/V push units; also the number of K/V flags
    # With segment ids: every rank's id ranges, published with the call's signature after the K/V and partial
    # flags (ring_core.protocol.steps.publish_id_ranges): K/V chunks, and partial dK/dV, whose ids no query of the
    # receiver has are neither sent nor waited for.
    rng = ranks_rng(flags, B, HKV, n_chunks, tl.cdiv(S, KV_BLOCK_N), W)
    # Every rank must make this same call; if not, nothing is sent to a peer (no K/V push, no partial) and
    # every later wait gives up at once.
    call_ok = start_call(ctl, heap_bases, rank, epoch, timeout_ns, seg_ptr, kseg_ptr, rng, B, S, sm_scale, n_chunks,
                         KIND_BWD, W, H, HKV, D, SIG_DTYPE, CAUSAL, ZIGZAG, CHUNK_ROWS, KV_BLOCK_N, WIN_LEFT,
                         WIN_RIGHT, SEGMENTED, INTERPRET)
    n_push = n_units * call_ok  # units to push: none after a mismatch
    n_kvb = tl.cdiv(S, KV_BLOCK_N)
    n_dq = B * H * tl.cdiv(S, DQ_BLOCK_M)
    n_part = (W - 1) * B * HKV * n_kvb
    B64 = (rank * 0 + B).to(tl.int64)
    my_last = last_pos(rank, S, W, ZIGZAG)
    qk_scale = sm_scale * _LOG2E
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D

    tid = tl.atomic_add(ctl + CTL_BWD_TICKET, 1, sem="relaxed", scope="gpu")
    if tid < n_dq:
        _dq_task(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, seg_ptr, kseg_ptr, B, S, sm_scale, timeout_ns,
                 dq_ptr, delta_ptr, heap_bases, rank, ctl, flags, epoch, recv, seg_recv, n_chunks, rng, n_push, B64,
                 qk_scale, offs_d, dmask, tid, call_ok, W, H, HKV, D, DQ_BLOCK_M, DQ_BLOCK_N, BLOCK_D, PUSH_ROWS,
                 SEG_BLOCKS, PUSH_VEC, POLL_N, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT,
                 SEGMENTED, G, CHUNK_ROWS)
    else:
        _dkdv_task(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, seg_ptr, kseg_ptr, B, S, sm_scale, timeout_ns, dk_ptr,
                   dv_ptr, delta_ptr, heap_bases, rank, ctl, flags, epoch, recv, seg_recv, part, n_chunks, n_units, rng,
                   call_ok, n_push, n_kvb, n_dq, n_part, B64, my_last, qk_scale, offs_d, dmask, tid, W, H, HKV, D,
                   KV_BLOCK_N, KV_BLOCK_M, BLOCK_D, PUSH_ROWS, PUSH_VEC, PART_VEC, CAUSAL, ZIGZAG, INTERPRET,
                   DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, G, CHUNK_ROWS, KV_IDS)

    # ---- end: the last program of this rank meets every peer, reports, resets -----------------------
    end_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W, INTERPRET, STICKY_ERRORS, True)
