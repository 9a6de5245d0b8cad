"""The fused ring-attention forward kernel: one Triton source, used by both frontends and the simulator.

Every rank runs this kernel on its own Q shard; the K/V of the other ranks of its ring arrive through the
ring protocol (ring_core.protocol.steps: call check, pushes, flags, end barrier, and why it cannot deadlock or
race), while the same programs do the attention math; the softmax is merged online across ring steps.
One launch per call.

Tiles. A program owns one (batch, head, BLOCK_M query rows) tile; the heads sharing a kv head run side by
side (L2 reuse) and, causal, the heaviest query blocks first (ring_core.kernels.tiles.heavy_first). Ring step 0
uses the local K/V and waits for nothing; during it the program claims one push unit every SEG_BLOCKS K/V
blocks (overlap; the claims sit between the software-pipelined inner loops), and before its first wait it
drains the claim counter. Ring step t >= 1 processes the K/V of rank ``rank-t`` from receive slot t-1,
after waiting (one vector poll, ``protocol.wait_chunks``) for every chunk it will read. Positions grow
with the local row in both layouts, so the K/V a tile sees is a prefix of the source's shard: blocks every
query sees whole run in an unmasked loop, the diagonal and tail in a masked one, and blocks causal masking
hides completely are neither waited for, loaded nor computed. A tile whose wait gave up, or whose call
failed the call check, writes NaN into its rows of ``out`` and ``lse``.

Masks beyond causal (constexprs WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED; ring_core.protocol.steps says what
travels, what is skipped and what is still waited for): with a window the rows a tile sees form at most two
runs per source, whose blocks run masked at their edges and unmasked inside, and nothing else is waited for
or read; with segment ids a K/V chunk travels and is waited for only where its ids meet the receiver's (the
id ranges every rank publishes with the call check), and a range pass over the K/V blocks' ids (after the
wait: they travel with the chunk) narrows the loops to the blocks that can hold a pair, and unmasks those
that hold the tile's one document only. A padding row (negative id) attends nothing: out 0, lse -inf (l = 0,
m = -inf: the masked loop shifts such rows by 0, so no NaN). KV_IDS: the keys' ids are not the queries' (the
two-level ring's calls with another node's K/V, ring_core.nodes; protocol.key_ids). WINDOW = SEGMENTED = False
compiles to the kernel without them.

Numerics: scores and the softmax are float32; fp16/bf16 dots run on tensor cores with float32
accumulation, probabilities rounded to the input dtype for P@V (as flash-attention does); float32 inputs
use ``input_precision=DOT_PRECISION`` ("ieee" by default: exact float32 products, no TF32).
"""

import triton
import triton.language as tl

from ring_core.protocol import control

from ring_core.protocol.steps import (block_rows, claim_push, drain_pushes, end_call, key_ids, pairs_allowed,
                                      positions, ranges_of, ranks_rng, receive_slots, ring_context, seg_blocks,
                                      start_call,
                                      step_blocks, tile_id_parts, tile_ids, wait_chunks, wait_rows)
from ring_core.kernels.tiles import dot, load_kv, query_tile

KIND_FWD = tl.constexpr(control.KIND_FWD)


@triton.jit
def _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, lo, hi, src, S, qk_scale, offs_n, offs_d,
                 lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k,
                 ROW_STRIDE: tl.constexpr, W: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr,
                 SEGMENTED: tl.constexpr, rng_src_b, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS: tl.constexpr,
                 ID_SKIP: tl.constexpr):
    """Online softmax over K/V blocks [lo, hi). MASKED=False: every row of every block exists and every
    query of the tile sees every key (no masks, so the loop is a plain one that Triton software-pipelines);
    MASKED=True: the tail block, the causal diagonal and the window's and segments' edges. With a window or
    segment ids, a masked block reads only rows some query of the tile may attend: rows in [lo1, hi1) |
    [lo2, hi2) (by position; other rows may not have been sent) whose segment id (at ``seg_k``) lies in the
    tile's [s_lo, s_hi]; the other rows load as 0, so no value of a row the tile cannot attend reaches it. With
    ID_SKIP (received K/V, segment ids), rows of a chunk whose published id range misses the tile's are not read
    (it was not sent: protocol.push_unit). Nothing in here waits: see the caller."""
    dmask = offs_d < D
    for j in range(lo, hi):
        rows_n, n_valid, k_pos, k_seg = block_rows(j, offs_n, src, S, 0, lo1, hi1, lo2, hi2, seg_k, s_lo, s_hi,
                                                   rng_src_b, a_lo, a_hi, b_lo, b_hi, W, BLOCK_N, CHUNK_ROWS, MASKED,
                                                   CAUSAL, ZIGZAG, WINDOW, SEGMENTED, ID_SKIP, False)
        # ROW_STRIDE is a constexpr so that Triton can prove 16-byte alignment and vectorise the loads; a
        # runtime stride made bf16/fp16 loads 2-byte scalars, which cannot be pipelined as async copies.
        kv_off = rows_n[:, None].to(tl.int64) * ROW_STRIDE + offs_d[None, :]
        k, v = load_kv(k_base, v_base, kv_off, n_valid, dmask, MASKED, BLOCK_D == D)
        qk = dot(q, tl.trans(k), DOT_PRECISION, INTERPRET)
        if MASKED:
            valid = pairs_allowed(n_valid[None, :], q_pos[:, None], k_pos[None, :], q_seg[:, None], k_seg[None, :],
                                  CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
            qk = tl.where(valid, qk, float("-inf"))
        # scale >= 0 (validated), so max(qk) * scale is the maximum of the scaled scores.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        if MASKED:
            # Rows with nothing visible yet keep m = -inf; shift them by 0 so exp2 gives 0, not NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new  # every row saw a finite score
        p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, INTERPRET)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _received_step(acc, l_i, m_i, valid, q, q_pos, offs_n, offs_d, q_seg, s_lo, s_hi, t_id, a_lo, a_hi, b_lo, b_hi,
                   j_lo, n_full_lo, n_full, n_hi, lo1, hi1, lo2, hi2, b, hkv, rank, src, B, S, qk_scale, n_units,
                   n_chunks, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, ctl, rng, epoch, timeout_ns,
                   STEP: tl.constexpr, W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, CHUNK_BLOCKS: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                   PUSH_ROWS: tl.constexpr, PUSH_VEC: tl.constexpr, POLL_N: tl.constexpr, CAUSAL: tl.constexpr,
                   ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                   WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr):
    """Ring step STEP >= 1 of a tile: the K/V of rank ``src`` from receive slot STEP - 1, the blocks that
    ``step_blocks`` gave ([n_full_lo, n_full) unmasked, [j_lo, n_full_lo) and [n_full, n_hi) masked), after waiting
    for every chunk they lie in (at step 1 after the push units are drained). Returns the online softmax's state and
    ``valid``, 0 once the wait gave up."""
    slot = STEP - 1
    k_base = recv + ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
    v_base = k_base + (b * 0 + B).to(tl.int64) * HKV * S * D
    seg_k = seg_recv + ((slot * B + b).to(tl.int64) * HKV + hkv) * S
    rng_src = ranges_of(rng, src, b, B, n_chunks)  # src's published id ranges of batch b
    if STEP == 1:
        # Never wait, nor end, while push units are unclaimed: this is what makes the protocol independent of which
        # programs are resident (ring_core.protocol.steps). Every program passes here, also one that needs nothing
        # from any peer.
        drain_pushes(ctl, n_units, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch, B, S,
                     n_chunks, W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT,
                     WIN_RIGHT, SEGMENTED, rng, SEGMENTED)
    # Every chunk this tile will read, before the loops that read them (protocol.wait_chunks says why).
    flag0 = flags + ((STEP - 1) * B * HKV + b * HKV + hkv) * n_chunks
    if WINDOW or SEGMENTED:
        # The chunks holding rows the tile may see by position (none: no wait): each was pushed, since its rows are
        # seen by a query of this rank (protocol.chunk_needed); with segment ids only those whose published id range
        # meets the tile's, which were pushed too (protocol.push_unit). The ids themselves are read after the wait
        # (they travel with the chunk): they narrow the loops.
        valid = valid * wait_rows(flag0, lo1, hi1, lo2, hi2, CHUNK_ROWS, epoch, ctl, timeout_ns, src, STEP, INTERPRET,
                                  POLL_N, rng_src, a_lo, a_hi, b_lo, b_hi, SEGMENTED)
        if SEGMENTED:
            j_lo, n_full_lo, n_full, n_hi = seg_blocks(seg_k, j_lo, n_hi, lo1, hi1, lo2, hi2, n_full_lo, n_full, s_lo,
                                                       s_hi, t_id, BLOCK_N, rng_src, a_lo, a_hi, b_lo, b_hi,
                                                       CHUNK_ROWS, SEGMENTED)
        acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, j_lo, n_full_lo, src, S, qk_scale,
                                     offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, D, W, D, BLOCK_N,
                                     BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT,
                                     WIN_RIGHT, SEGMENTED, rng_src, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, SEGMENTED)
    else:
        valid = valid * wait_chunks(flag0, 0, tl.cdiv(n_hi, CHUNK_BLOCKS), epoch, ctl, timeout_ns, src, STEP,
                                    INTERPRET, POLL_N, rng_src, a_lo, a_hi, b_lo, b_hi, False)
    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, n_full_lo, n_full, src, S, qk_scale, offs_n,
                                 offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, D, W, D, BLOCK_N, BLOCK_D,
                                 False, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT,
                                 SEGMENTED, rng_src, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, SEGMENTED)
    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, n_full, n_hi, src, S, qk_scale, offs_n,
                                 offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, D, W, D, BLOCK_N, BLOCK_D, True,
                                 CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                 rng_src, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, SEGMENTED)
    return acc, l_i, m_i, valid


# The timeout is not specialised on its value (no binary per timeout); B and S are, as Triton's JIT does
# (the JAX launcher, ring_core.runtime.build, specialises them alike: one binary for both frontends).
@triton.jit(do_not_specialize=["timeout_ns"])
def ring_attn_fwd_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, seg_ptr, ctx_ptr,
    # runtime scalars
    B, S, sm_scale, timeout_ns,
    # outputs
    out_ptr, lse_ptr, status_ptr,
    # constexprs
    W: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr, PUSH_ROWS: tl.constexpr, SEG_BLOCKS: tl.constexpr, POLL_N: tl.constexpr,
    PUSH_VEC: tl.constexpr,
    CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SIG_DTYPE: tl.constexpr, STICKY_ERRORS: tl.constexpr,
    WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr,
    KV_IDS: tl.constexpr,
):
    G: tl.constexpr = H // HKV
    CHUNK_ROWS: tl.constexpr = CHUNK_BLOCKS * BLOCK_N
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    # ---- this rank's ring: heap bases, position, its slot's control words and flags, receive region --
    heap_bases, rank, ctl, flags, recv_addr, epoch = ring_context(ctx_ptr, W)
    recv, seg_recv = receive_slots(recv_addr, seg_ptr, rank, B, S, q_ptr, W, HKV, D, SEGMENTED)
    kseg_ptr = key_ids(seg_ptr, B, S, KV_IDS)  # the ids of the K/V this rank holds (SEGMENTED only)

    n_m = tl.cdiv(S, BLOCK_M)
    n_chunks = tl.cdiv(S, CHUNK_ROWS)
    n_units = (W - 1) * B * HKV * n_chunks
    # With segment ids: every rank's id ranges (per batch, each K/V chunk's and each half's of the shard), published
    # with the call's signature, after the K/V flags: a chunk whose ids no query of the receiver has is neither
    # sent nor waited for (protocol.publish_id_ranges, push_unit, wait_chunks).
    rng = ranks_rng(flags, B, HKV, n_chunks, 0, W)
    # Every rank must make this same call; if not, push nothing (every later wait then gives up at once).
    call_ok = start_call(ctl, heap_bases, rank, epoch, timeout_ns, seg_ptr, kseg_ptr, rng, B, S, sm_scale, n_chunks,
                         KIND_FWD, W, H, HKV, D, SIG_DTYPE, CAUSAL, ZIGZAG, CHUNK_ROWS, BLOCK_N, WIN_LEFT, WIN_RIGHT,
                         SEGMENTED, INTERPRET)
    n_units = n_units * call_ok
    valid = call_ok  # 0 once a wait of this tile gave up: its result is then not computed from the right data

    # ---- which tile: g fastest so the heads sharing one kv head run side by side (L2 reuse) --------
    b, h, hkv, m_blk = query_tile(tl.program_id(0), G, n_m, HKV, CAUSAL)

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < S
    dmask = offs_d < D
    q_off = ((b.to(tl.int64) * S + offs_m[:, None]) * H + h) * D + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_valid[:, None] & dmask[None, :], other=0.0)
    q_pos = positions(offs_m, rank, S, W, ZIGZAG)
    q_pos_max = tl.max(tl.where(m_valid, q_pos, -1), axis=0)
    seg_q = seg_ptr + b.to(tl.int64) * S  # this rank's ids of batch b (SEGMENTED only)
    q_seg, s_lo, s_hi, t_id = tile_ids(seg_q, offs_m, m_valid, SEGMENTED)
    a_lo, a_hi, b_lo, b_hi = tile_id_parts(q_seg, offs_m, S, ZIGZAG)  # (SEGMENTED only: which chunks it waits for)
    rng_own = ranges_of(rng, rank, b, B, n_chunks)  # this rank's published id ranges of batch b (SEGMENTED)

    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    q_pos_min = tl.min(tl.where(m_valid, q_pos, 2147483647), axis=0)
    for step in tl.static_range(W):
        src = (rank - step + W) % W
        # The K/V blocks of rank src this tile visits (ring_core.protocol.steps.step_blocks, shared with the backward's
        # dQ tasks): [n_full_lo, n_full) unmasked, [j_lo, n_full_lo) and [n_full, n_hi) masked.
        j_lo, n_full_lo, n_full, n_hi, lo1, hi1, lo2, hi2, _ = step_blocks(
            m_blk * BLOCK_M, tl.minimum(m_blk * BLOCK_M + BLOCK_M, S), q_pos_min, q_pos_max, s_hi, rank, src, S, W,
            BLOCK_N, ZIGZAG, CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
        if step == 0:
            k_base = k_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            v_base = v_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            seg_k = kseg_ptr + b.to(tl.int64) * S
            if SEGMENTED:
                j_lo, n_full_lo, n_full, n_hi = seg_blocks(seg_k, j_lo, n_hi, lo1, hi1, lo2, hi2, n_full_lo, n_full,
                                                           s_lo, s_hi, t_id, BLOCK_N, rng_own, a_lo, a_hi, b_lo,
                                                           b_hi, CHUNK_ROWS, False)
            if WINDOW or SEGMENTED:
                acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, j_lo, n_full_lo, src, S,
                                             qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k,
                                             HKV * D, W, D, BLOCK_N, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET,
                                             DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                             rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
            if W > 1:
                # Overlap: claim and push one unit of the local K/V every SEG_BLOCKS blocks. The claims
                # sit between the pipelined inner loops, never inside them.
                for seg in range(n_full_lo, n_full, SEG_BLOCKS):
                    claim_push(ctl, n_units, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch,
                               B, S, n_chunks, W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG,
                               WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, rng, SEGMENTED)
                    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, seg,
                                                 tl.minimum(seg + SEG_BLOCKS, n_full), src, S, qk_scale, offs_n,
                                                 offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k, HKV * D, W, D,
                                                 BLOCK_N, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION,
                                                 WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                                 rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
            else:
                acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, n_full_lo, n_full,
                                             src, S, qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi,
                                             seg_k, HKV * D, W, D, BLOCK_N, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET,
                                             DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                             rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
            acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, n_full, n_hi,
                                         src, S, qk_scale, offs_n, offs_d, lo1, hi1, lo2, hi2, q_seg, s_lo, s_hi, seg_k,
                                         HKV * D, W, D, BLOCK_N, BLOCK_D, True, CAUSAL, ZIGZAG, INTERPRET,
                                         DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED,
                                         rng, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS, False)
        else:
            acc, l_i, m_i, valid = _received_step(
                acc, l_i, m_i, valid, q, q_pos, offs_n, offs_d, q_seg, s_lo, s_hi, t_id, a_lo, a_hi, b_lo, b_hi, j_lo,
                n_full_lo, n_full, n_hi, lo1, hi1, lo2, hi2, b, hkv, rank, src, B, S, qk_scale, n_units, n_chunks,
                k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, ctl, rng, epoch, timeout_ns, step, W, HKV,
                D, BLOCK_N, BLOCK_D, CHUNK_BLOCKS, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, POLL_N, CAUSAL, ZIGZAG,
                INTERPRET, DOT_PRECISION, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)

    # ---- epilogue ----------------------------------------------------------------------------------
    # A tile whose waits gave up (the call failed) writes NaN, never a plausible-looking wrong value. A row that
    # attended nothing (padding) has l = 0 and m = -inf: out 0, lse -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = tl.where(valid != 0, acc / l_safe[:, None], float("nan"))
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & dmask[None, :])
    lse = tl.where(valid != 0, (m_i + tl.math.log2(l_safe)) * LN2, float("nan"))
    tl.store(lse_ptr + (b.to(tl.int64) * H + h) * S + offs_m, lse, mask=m_valid)

    end_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W, INTERPRET, STICKY_ERRORS, False)
