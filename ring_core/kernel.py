"""The fused ring-attention forward kernel: one Triton source, used by both frontends and the simulator.

Every rank runs this kernel on its own Q shard. K/V shards reach the other ranks through iris remote
stores issued from inside the kernel, signalled with release/acquire flags, while the same programs do
the attention math; the softmax is merged online across ring steps. One launch per call.

Protocol (per call; "epoch" = this rank's call counter + 1, equal on every rank of a job)
----------------------------------------------------------------------------------------
* Push work. The local K/V is cut into *units* (peer distance d in 1..W-1, batch, kv head, chunk of
  CHUNK_BLOCKS*BLOCK_N rows), ordered nearest ring neighbour first. Programs *claim* units through an
  atomic counter in the control region and copy a claimed unit into the receive slot ``d-1`` of rank
  ``rank+d`` with ``iris.store``; then they publish it by writing ``epoch`` into that unit's flag on the
  receiver with a release ``iris.atomic_xchg`` (system scope, after a CTA barrier so every thread's stores
  are ordered before it).
* Compute. A program owns one (batch, head, BLOCK_M query rows) tile. Ring step 0 uses the local K/V and
  waits for nothing; during it the program claims one push unit per K/V block (overlap). Before its first
  wait a program drains the claim counter (pushes until no unit is left). Ring step t >= 1 processes the
  K/V of rank ``rank-t``: before its loop over K/V blocks it waits (acquire) until the flag of every chunk
  it will read equals ``epoch`` (not inside the loop: see the comment there). Blocks that causal masking
  hides completely are neither waited for nor computed.
* End. The last program to finish (atomic finish counter) tells every peer "I am done with this epoch"
  (release flag in the peer's barrier slot), waits for the same from every peer, copies the error record
  into ``status``, resets the claim/finish counters and stores ``epoch`` as the new call counter.

Why it cannot deadlock
----------------------
A program waits only for (a) flags of units pushed by the source rank, and (b) the end barrier.
(a) Units are pushed by programs that claimed them; claiming and pushing never wait on anything, and
every program drains the claim counter before its first wait. So all units of rank s are pushed as soon
as *any* program of the kernel on rank s runs; no wait depends on a particular program being resident.
Hence it holds for any grid size, however many CTAs the GPU holds at once, in whatever order the hardware
dispatches them, and while other kernels occupy SMs (they delay but cannot block us unless they
themselves wait for this kernel on another rank, which is a program-order bug the timeout reports).
(b) Every program finishes once its (a)-waits are met, so each rank's last program reaches the barrier.
No cycle exists, and in the Triton interpreter (programs of a rank run one after another) the first
program pushes everything before waiting, so one thread per rank completes too.

Why a call cannot race the next call on the same buffers and flags
------------------------------------------------------------------
Receive slots and flags of rank t are written by peers during call N+1 only after they passed the end
barrier of call N, which t's last program enters only after all of t's programs (the only readers of
those slots) finished. Flags hold epochs, which only grow, so a flag left from an earlier call (or by a
call of another shape) never satisfies a later wait; the flag region never holds data. The claim and
finish counters are reset by the last program, after every other program of the call is done, and the
next kernel on this rank starts after this one completes (same stream).

Never hangs
-----------
Every wait is bounded: by ``timeout_ns`` of %globaltimer on the GPU, by a poll count in the Triton
interpreter. A timeout writes (code, peer rank, ring step, chunk) into the control region (first error
wins), makes every later wait on this rank give up at once, and the last program copies the record into
``status``, which the host turns into an exception.

Numerics: scores and the softmax are float32; fp16/bf16 dots run on tensor cores with float32
accumulation, probabilities rounded to the input dtype for P@V (as flash-attention does); float32 inputs
use ``input_precision=DOT_PRECISION`` ("ieee" by default: exact float32 products, no TF32).
"""

import triton
import triton.language as tl

import iris

try:  # %globaltimer for the bounded waits on NVIDIA; never traced in the interpreter (INTERPRET=True)
    from triton.language.extra.cuda import globaltimer as _globaltimer
except ImportError:  # pragma: no cover
    _globaltimer = None

# Control-region word indices and error codes are documented in ring_core.launch (CTL_*, ERR_*).


@triton.jit
def _poll_ge(ptr, target, ctl, timeout_ns, INTERPRET: tl.constexpr):
    """Spin (acquire, system scope) until ``*ptr >= target``; returns 1 if met, 0 on timeout or if this
    rank already recorded an error (then nothing downstream is trustworthy, so give up at once)."""
    val = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    err = tl.atomic_add(ctl + 3, 0, sem="relaxed", scope="gpu")
    ok = (err == 0).to(tl.int32)
    polls = ok * 0
    if not INTERPRET:
        t0 = _globaltimer()
    while (val < target) & (ok == 1):
        val = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        polls += 1
        if (polls % 64) == 0:
            if tl.atomic_add(ctl + 3, 0, sem="relaxed", scope="gpu") != 0:
                ok = ok * 0  # an error was recorded on this rank: nothing downstream can be trusted
            if not INTERPRET:
                if _globaltimer() - t0 > timeout_ns:
                    ok = ok * 0
        if INTERPRET:
            # No clock in the interpreter: count polls. One costs about 0.3 ms of host time on the
            # 2-core CI machines (measured 0.38 ms), so the limit is approximate there.
            if polls > timeout_ns // 300000:
                ok = ok * 0
    return ok & (val >= target).to(tl.int32)


@triton.jit
def _record_error(ctl, code, peer, step, chunk):
    won = tl.atomic_cas(ctl + 3, 0, code, sem="acq_rel", scope="gpu")
    if won == 0:
        tl.atomic_xchg(ctl + 4, peer, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctl + 5, step, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctl + 6, chunk, sem="relaxed", scope="gpu")


@triton.jit
def _push_unit(u, k_ptr, v_ptr, recv_ptr, flags_ptr, heap_bases, rank, epoch, B, S, n_chunks,
               W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               CHUNK_ROWS: tl.constexpr, PUSH_ROWS: tl.constexpr):
    per_peer = B * HKV * n_chunks
    d = u // per_peer + 1
    rem = u % per_peer
    bh = rem // n_chunks  # b * HKV + hkv
    c = rem % n_chunks
    b = bh // HKV
    hkv = bh % HKV
    peer = (rank + d) % W
    slot = d - 1
    offs_r = tl.arange(0, PUSH_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    src_base = b.to(tl.int64) * S * HKV * D + hkv * D
    dst_k = ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
    dst_v = dst_k + (b * 0 + B).to(tl.int64) * HKV * S * D  # B may arrive as a Python int (== 1)
    r_end = tl.minimum(S, (c + 1) * CHUNK_ROWS)
    for r0 in range(c * CHUNK_ROWS, r_end, PUSH_ROWS):
        rows = r0 + offs_r
        m = (rows < r_end)[:, None] & dmask[None, :]
        src = src_base + rows[:, None].to(tl.int64) * (HKV * D) + offs_d[None, :]
        dst = rows[:, None].to(tl.int64) * D + offs_d[None, :]
        kt = tl.load(k_ptr + src, mask=m)
        iris.store(recv_ptr + dst_k + dst, kt, rank, peer, heap_bases, mask=m)
        vt = tl.load(v_ptr + src, mask=m)
        iris.store(recv_ptr + dst_v + dst, vt, rank, peer, heap_bases, mask=m)
    # Every thread's stores must be ordered before the release below (cumulativity through bar.sync).
    tl.debug_barrier()
    iris.atomic_xchg(flags_ptr + (slot * B * HKV + bh) * n_chunks + c, epoch, rank, peer, heap_bases,
                     sem="release", scope="sys")


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        # Triton's interpreter multiplies bf16 tensors as their raw uint16 bits; float32 operands give
        # the tensor-core result (bf16/fp16 products are exact in float32, accumulation is float32).
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
    else:
        return tl.dot(a, b)


@triton.jit
def _positions(rows, rank, S, W: tl.constexpr, ZIGZAG: tl.constexpr):
    if ZIGZAG:
        c = S // 2
        return tl.where(rows < c, rank * c + rows, (2 * W - 1 - rank) * c + (rows - c))
    else:
        return rank * S + rows


@triton.jit
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
    CHUNK_BLOCKS: tl.constexpr, PUSH_ROWS: tl.constexpr,
    CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    G: tl.constexpr = H // HKV
    CHUNK_ROWS: tl.constexpr = CHUNK_BLOCKS * BLOCK_N
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    # ---- per-rank context: heap bases, rank, heap layout -------------------------------------------
    ctx = ctx_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    heap_bases = ctx_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    rank = tl.load(ctx + W).to(tl.int32)
    my_base = tl.load(heap_bases + rank)
    ctl = (my_base + tl.load(ctx + W + 1).to(tl.uint64)).to(tl.pointer_type(tl.int32), bitcast=True)
    flags = (my_base + tl.load(ctx + W + 2).to(tl.uint64)).to(tl.pointer_type(tl.int32), bitcast=True)
    recv = (my_base + tl.load(ctx + W + 3).to(tl.uint64)).to(tl.pointer_type(q_ptr.dtype.element_ty),
                                                            bitcast=True)
    epoch = tl.load(ctl + 0) + 1

    n_m = tl.cdiv(S, BLOCK_M)
    n_n = tl.cdiv(S, BLOCK_N)
    n_chunks = tl.cdiv(S, CHUNK_ROWS)
    n_units = (W - 1) * B * HKV * n_chunks

    # ---- which tile: g fastest so the heads sharing one kv head run side by side (L2 reuse) --------
    pid = tl.program_id(0)
    g = pid % G
    t = pid // G
    m_blk = t % n_m
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
    q_pos = _positions(offs_m, rank, S, W, ZIGZAG)
    q_pos_max = tl.max(tl.where(m_valid, q_pos, -1), axis=0)

    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    kv_row_stride = HKV * D
    for step in tl.static_range(W):
        src = (rank - step + W) % W
        if step == 0:
            k_base = k_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            v_base = v_ptr + b.to(tl.int64) * S * HKV * D + hkv * D
            row_stride = kv_row_stride
        else:
            slot = step - 1
            k_base = recv + ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
            v_base = k_base + (b * 0 + B).to(tl.int64) * HKV * S * D
            row_stride = D
            if step == 1:
                # Never wait while push units are unclaimed: this is what makes the protocol
                # independent of which programs are resident (see module docstring).
                u = tl.atomic_add(ctl + 1, 1, sem="relaxed", scope="gpu")
                while u < n_units:
                    _push_unit(u, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                               W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS)
                    u = tl.atomic_add(ctl + 1, 1, sem="relaxed", scope="gpu")
            # Wait for every chunk this tile will read *before* the loop that reads them. Triton's software
            # pipeliner issues a loop's loads several iterations ahead, so an acquire inside the loop would
            # not order the loads of later iterations: they could read a slot before its data arrived.
            # The sm_90 TTGIR of the earlier version shows it (async copies of iterations j+1, j+2 issued
            # before iteration j+1's acquire; tests/test_kernel_ir.py now checks this never recurs), and
            # it explains a wrong fp32 result on 2xH200 whose slots held an earlier call's bf16 data
            # (the interpreter, which does not pipeline, was right; not yet re-run on a GPU).
            # Outside the loop, the acquire precedes every load of the loop, prologue included.
            offs_c = tl.arange(0, CHUNK_ROWS)
            for c in range(0, n_chunks):
                chunk_needed = True
                if CAUSAL:
                    rows_c = c * CHUNK_ROWS + offs_c
                    pos_c = _positions(rows_c, src, S, W, ZIGZAG)
                    chunk_needed = tl.min(tl.where(rows_c < S, pos_c, 2147483647), axis=0) <= q_pos_max
                if chunk_needed:
                    flag = flags + ((step - 1) * B * HKV + b * HKV + hkv) * n_chunks + c
                    ok = _poll_ge(flag, epoch, ctl, timeout_ns, INTERPRET)
                    if ok == 0:
                        _record_error(ctl, 1, src, step, c)
        for j in range(0, n_n):
            if step == 0:
                if n_units > 0:
                    u0 = tl.atomic_add(ctl + 1, 1, sem="relaxed", scope="gpu")
                    if u0 < n_units:
                        _push_unit(u0, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                                   W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS)
            rows_n = j * BLOCK_N + offs_n
            n_valid = rows_n < S
            k_pos = _positions(rows_n, src, S, W, ZIGZAG)
            needed = True
            if CAUSAL:
                k_pos_min = tl.min(tl.where(n_valid, k_pos, 2147483647), axis=0)
                needed = k_pos_min <= q_pos_max
            if needed:
                kv_off = rows_n[:, None].to(tl.int64) * row_stride + offs_d[None, :]
                kv_mask = n_valid[:, None] & dmask[None, :]
                k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
                v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
                qk = _dot(q, tl.trans(k), DOT_PRECISION, INTERPRET) * qk_scale
                valid = n_valid[None, :]
                if CAUSAL:
                    valid = valid & (k_pos[None, :] <= q_pos[:, None])
                qk = tl.where(valid, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                # Rows with nothing visible yet keep m = -inf; shift them by 0 so exp2 gives 0, not NaN.
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(qk - m_use[:, None])
                alpha = tl.math.exp2(m_i - m_use)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, INTERPRET)
                m_i = m_new

    # ---- epilogue ----------------------------------------------------------------------------------
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & dmask[None, :])
    lse = (m_i + tl.math.log2(l_safe)) * LN2
    tl.store(lse_ptr + (b.to(tl.int64) * H + h) * S + offs_m, lse, mask=m_valid)

    tl.debug_barrier()
    done = tl.atomic_add(ctl + 2, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        # Last program of this rank: every program here has finished reading its receive slots.
        for p in tl.static_range(W):
            if p != rank:
                iris.atomic_xchg(ctl + 8 + rank, epoch, rank, p, heap_bases, sem="release", scope="sys")
        for p in tl.static_range(W):
            if p != rank:
                ok = _poll_ge(ctl + 8 + p, epoch, ctl, timeout_ns, INTERPRET)
                if ok == 0:
                    _record_error(ctl, 2, p, W, -1)
        code = tl.atomic_xchg(ctl + 3, 0, sem="acq_rel", scope="gpu")
        tl.store(status_ptr + 0, code)
        tl.store(status_ptr + 1, tl.atomic_xchg(ctl + 4, 0, sem="relaxed", scope="gpu"))
        tl.store(status_ptr + 2, tl.atomic_xchg(ctl + 5, 0, sem="relaxed", scope="gpu"))
        tl.store(status_ptr + 3, epoch)
        tl.atomic_xchg(ctl + 6, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctl + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctl + 2, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctl + 0, epoch, sem="release", scope="gpu")
