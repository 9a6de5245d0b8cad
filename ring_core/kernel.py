"""The fused ring-attention forward kernel: one Triton source, used by both frontends and the simulator.

Every rank runs this kernel on its own Q shard; the K/V of the other ranks of its ring arrive through the
ring protocol (ring_core.protocol: call check, pushes, flags, end barrier, and why it cannot deadlock or
race), while the same programs do the attention math; the softmax is merged online across ring steps.
One launch per call.

Tiles. A program owns one (batch, head, BLOCK_M query rows) tile; the heads sharing a kv head run side by
side (L2 reuse) and, causal, the heaviest query blocks first (ring_core.tiles.heavy_first). Ring step 0
uses the local K/V and waits for nothing; during it the program claims one push unit every SEG_BLOCKS K/V
blocks (overlap; the claims sit between the software-pipelined inner loops), and before its first wait it
drains the claim counter. Ring step t >= 1 processes the K/V of rank ``rank-t`` from receive slot t-1,
after waiting (one vector poll, ``protocol.wait_chunks``) for every chunk it will read. Positions grow
with the local row in both layouts, so the K/V a tile sees is a prefix of the source's shard: blocks every
query sees whole run in an unmasked loop, the diagonal and tail in a masked one, and blocks causal masking
hides completely are neither waited for, loaded nor computed. A tile whose wait gave up, or whose call
failed the call check, writes NaN into its rows of ``out`` and ``lse``.

Numerics: scores and the softmax are float32; fp16/bf16 dots run on tensor cores with float32
accumulation, probabilities rounded to the input dtype for P@V (as flash-attention does); float32 inputs
use ``input_precision=DOT_PRECISION`` ("ieee" by default: exact float32 products, no TF32).
"""

import triton
import triton.language as tl

from ring_core import control

from ring_core.protocol import (block_range, call_words, check_call, claim_push, drain_pushes, end_call, positions,
                                ring_context, wait_chunks)
from ring_core.tiles import dot, heavy_first, load_kv

KIND_FWD = tl.constexpr(control.KIND_FWD)


@triton.jit
def _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, lo, hi, src, S, qk_scale, offs_n, offs_d,
                 ROW_STRIDE: tl.constexpr, W: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Online softmax over K/V blocks [lo, hi). MASKED=False: every row of every block exists and every
    query of the tile sees every key (no masks, so the loop is a plain one that Triton software-pipelines);
    MASKED=True: the tail block and the causal diagonal. Nothing in here waits: see the caller."""
    dmask = offs_d < D
    for j in range(lo, hi):
        rows_n = j * BLOCK_N + offs_n
        # ROW_STRIDE is a constexpr so that Triton can prove 16-byte alignment and vectorise the loads; a
        # runtime stride made bf16/fp16 loads 2-byte scalars, which cannot be pipelined as async copies.
        kv_off = rows_n[:, None].to(tl.int64) * ROW_STRIDE + offs_d[None, :]
        n_valid = rows_n < S
        k, v = load_kv(k_base, v_base, kv_off, n_valid, dmask, MASKED, BLOCK_D == D)
        qk = dot(q, tl.trans(k), DOT_PRECISION, INTERPRET)
        if MASKED:
            valid = n_valid[None, :]
            if CAUSAL:
                valid = valid & (positions(rows_n, src, S, W, ZIGZAG)[None, :] <= q_pos[:, None])
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


# Integer scalars are not specialised on their values (divisibility, == 1): one binary serves every batch
# and sequence length, and the JAX launcher (ring_core.build) compiles the same binary as torch's JIT.
@triton.jit(do_not_specialize=["B", "S", "timeout_ns"])
def ring_attn_fwd_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, ctx_ptr,
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
):
    G: tl.constexpr = H // HKV
    CHUNK_ROWS: tl.constexpr = CHUNK_BLOCKS * BLOCK_N
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    # ---- this rank's ring: heap bases, position, its slot's control words and flags, receive region --
    heap_bases, rank, ctl, flags, recv_addr, epoch = ring_context(ctx_ptr, W)
    # Heap bases are allocation-granularity aligned and the receive region starts ALIGN (256) bytes in
    # (ring_core.control); saying so lets Triton vectorise and pipeline the loads from the receive slots.
    recv = tl.multiple_of(recv_addr.to(tl.pointer_type(q_ptr.dtype.element_ty), bitcast=True), 16)

    n_m = tl.cdiv(S, BLOCK_M)
    n_chunks = tl.cdiv(S, CHUNK_ROWS)
    n_units = (W - 1) * B * HKV * n_chunks
    call_ok = epoch * 0 + 1
    if W > 1:
        # Every rank must make this same call; if not, push nothing (every later wait then gives up at once).
        words = call_words(KIND_FWD, B, S, sm_scale, W, H, HKV, D, SIG_DTYPE, CAUSAL, ZIGZAG, CHUNK_ROWS, BLOCK_N)
        call_ok = check_call(ctl, heap_bases, rank, epoch, words, timeout_ns, W, INTERPRET)
    n_units = n_units * call_ok
    valid = call_ok  # 0 once a wait of this tile gave up: its result is then not computed from the right data

    # ---- which tile: g fastest so the heads sharing one kv head run side by side (L2 reuse) --------
    pid = tl.program_id(0)
    g = pid % G
    t = pid // G
    m_blk = heavy_first(t % n_m, n_m, CAUSAL)
    t = t // n_m
    hkv = t % HKV
    b = t // HKV
    h = hkv * G + g

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < S
    dmask = offs_d < D
    q_off = ((b.to(tl.int64) * S + offs_m[:, None]) * H + h) * D + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_valid[:, None] & dmask[None, :], other=0.0)
    q_pos = positions(offs_m, rank, S, W, ZIGZAG)
    q_pos_max = tl.max(tl.where(m_valid, q_pos, -1), axis=0)

    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    q_pos_min = tl.min(tl.where(m_valid, q_pos, 2147483647), axis=0)
    for step in tl.static_range(W):
        src = (rank - step + W) % W
        # K/V blocks [0, n_full) are seen whole by every query of the tile; [n_full, n_hi) need masks;
        # blocks from n_hi on are hidden by causality: never waited for, loaded or computed.
        _, n_hi, n_full = block_range(q_pos_min, q_pos_max, src, S, W, BLOCK_N, CAUSAL, ZIGZAG)
        if step == 0:
            k_base = k_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            v_base = v_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            if W > 1:
                # Overlap: claim and push one unit of the local K/V every SEG_BLOCKS blocks. The claims
                # sit between the pipelined inner loops, never inside them.
                for seg in range(0, n_full, SEG_BLOCKS):
                    claim_push(ctl, n_units, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                                W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG)
                    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, seg,
                                                 tl.minimum(seg + SEG_BLOCKS, n_full), src, S, qk_scale, offs_n,
                                                 offs_d, HKV * D, W, D, BLOCK_N, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET,
                                                 DOT_PRECISION)
            else:
                acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, 0, n_full,
                                             src, S, qk_scale, offs_n, offs_d, HKV * D, W, D, BLOCK_N, BLOCK_D, False,
                                             CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION)
            acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, n_full, n_hi,
                                         src, S, qk_scale, offs_n, offs_d, HKV * D, W, D, BLOCK_N, BLOCK_D, True,
                                         CAUSAL, ZIGZAG, INTERPRET, DOT_PRECISION)
        else:
            slot = step - 1
            k_base = recv + ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
            v_base = k_base + (b * 0 + B).to(tl.int64) * HKV * S * D
            if step == 1:
                # Never wait while push units are unclaimed: this is what makes the protocol
                # independent of which programs are resident (ring_core.protocol).
                drain_pushes(ctl, n_units, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                              W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG)
            # Every chunk this tile will read, before the loops that read them (protocol.wait_chunks says why).
            flag0 = flags + ((step - 1) * B * HKV + b * HKV + hkv) * n_chunks
            valid = valid * wait_chunks(flag0, tl.cdiv(n_hi, CHUNK_BLOCKS), epoch, ctl, timeout_ns, src, step,
                                        INTERPRET, POLL_N)
            acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, 0, n_full, src, S, qk_scale,
                                         offs_n, offs_d, D, W, D, BLOCK_N, BLOCK_D, False, CAUSAL, ZIGZAG, INTERPRET,
                                         DOT_PRECISION)
            acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, n_full, n_hi, src, S,
                                         qk_scale, offs_n, offs_d, D, W, D, BLOCK_N, BLOCK_D, True, CAUSAL, ZIGZAG,
                                         INTERPRET, DOT_PRECISION)

    # ---- epilogue ----------------------------------------------------------------------------------
    # A tile whose waits gave up (the call failed) writes NaN, never a plausible-looking wrong value.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = tl.where(valid != 0, acc / l_safe[:, None], float("nan"))
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & dmask[None, :])
    lse = tl.where(valid != 0, (m_i + tl.math.log2(l_safe)) * LN2, float("nan"))
    tl.store(lse_ptr + (b.to(tl.int64) * H + h) * S + offs_m, lse, mask=m_valid)

    end_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W, INTERPRET, STICKY_ERRORS, False)
