"""The fused ring-attention backward for Hopper, in Gluon: the protocol of ring_core.kernels.tl_bwd, with
FlashAttention-3's backward for the math.

Why a second backward source: the tl backward (ring_core.kernels.tl_bwd) is FlashAttention-2's split, seven matmuls per
block pair where five would do, with dQ summed in a fixed order (deterministic). Five matmuls need dQ added up from
many programs; on the math warps (float atomics) that lost (0.68-0.73x cuDNN for the loop alone), and FlashAttention-3
takes the adds off them with TMA bulk reductions, which only Gluon reaches (0.85-0.89x for the loop alone at world
size 1: docs/performance.md). With DETERMINISTIC=False (the frontends' default) the adds come in any order;
with True each waits for its turn (below, a writer warp's), so dQ is bit-identical from run to run (the plans give
it ``deterministic=True``; RING_ATTENTION_GLUON_DETERMINISTIC=0 gives the tl split instead, for A/B runs). The tl
kernel also serves the interpreter, other GPUs, fp32, head_dim other than 64 and 128, and windows and segment ids with
``deterministic=True`` (``plans.gluon_bwd_applies``).

The protocol is ring_core.kernels.tl_bwd's, through ring_core.protocol.steps's own helpers (they compile under Gluon:
ring_core.protocol.lanes): the call check, the K/V pushes (every program drains the push counter before anything of it
waits), tickets, delta before the dK/dV tasks, the partial dK/dV sent back to the owner of the K/V and added there
in rank order (dK and dV stay deterministic), the end of the call. What differs is dQ:

Tasks, in ticket order (a task waits only for tasks with earlier tickets, on this rank or, for K/V and partials,
on the peers exactly as in the tl kernel: ring_core.protocol.steps's no-deadlock argument holds as it is):
1. **delta tasks** (b, h, ROW_TASK query rows: 512): delta = rowsum(dO * O) - dlse into the ``delta`` scratch, and
   the rows of the float32 dQ accumulator (the same scratch, after delta) zeroed; each counts itself in
   CTL_BWD_DELTA (release, after a CTA barrier).
2. **dK/dV tasks** (partial: peer distance d = 1..W-1, b, kv head, 128 K/V rows of rank ``rank - d``; final: the
   local K/V), after CTL_BWD_DELTA reached the delta tasks' count (acquire, then a generic-to-async proxy fence:
   the accumulator's zeros were written by ordinary stores, the adds are TMA's). ``gl.warp_specialize``:
   * a **load warp**: K and V of the block (a peer's after the bounded acquire of its chunk's flag and a proxy
     fence, as the forward's load warp), then Q and dO of every local query block the block's keys can reach
     (``configs.GLUON_BWD_Q_ROWS``: 128 rows at head_dim 64, 64 at 128), for each head of the kv group, through TMA
     into two slots;
   * two **consumer warpgroups**, 64 K/V rows each, five matmuls per query block: S^T = K Q^T and dP^T = V dO^T
     together, P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta), dV += P^T dO (P from registers), dS^T into shared
     memory, dK += dS^T Q; once both halves of dS are there (an mbarrier of two arrivals), each computes half the
     columns of dQ = dS K over the block's 128 keys, stores it into its shared buffer and adds it to the float32
     accumulator with one TMA bulk reduction (``tma_add``), issued and left running (the buffer is rewritten a step
     later, after the reduction has read it). Causal: a query block and a half-block of keys are each contiguous
     in position (S % 128, zigzag S % 256), so the mask is one number per pair of them.
   * Windows and segment ids (WINDOW, SEGMENTED; any order only): the task's steps are worked out before
     the partitions start (``protocol.bwd_task_steps``): the query blocks the mask's positions let meet the K/V block
     (the tl kernel's ``rows_within``), narrowed with segment ids to the run whose chunks' published id ranges meet the
     block's (ranges, not ids: nothing waits for them; a block of such a run holding no pair is computed with every
     pair masked, its rows being local). With KV_IDS (the keys' ids apart from the queries': the two-level ring's
     calls with another node's K/V) this rank's published chunk ranges are its keys', so the query blocks are
     narrowed by the queries' ranges per 128 rows instead, which the delta tasks of head 0 write into the words
     DETERMINISTIC's counters would take (``protocol.query_ranges``; read after CTL_BWD_DELTA's acquire, as delta
     is), and a step is unmasked by ids where the query block's own ids (loaded for the mask anyway) are all the
     K/V block's one id; the local K/V's ids, its pushes' and its published ranges are the keys'
     (``protocol.key_ids``). Whether the block comes at all, and so whether its partial goes back and its
     owner waits for that, is the one test both backwards make on every side (``protocol.block_reaches``:
     positions, then published id ranges). The load warp writes each step's word beside its lse (no mask needed, or
     the query block's first position minus the K/V block's) and, with ids, the query block's ids; a masked step applies
     ``protocol.pairs_allowed`` to P^T (the K/V half's ids read once, after its barrier: they came with the chunk,
     before its flag). Blocks read were sent whole (chunks are blocks), so dP is finite and a masked pair's dS is 0.
   * DETERMINISTIC: the adds to each query block's dQ rows (per head and half of D) come in ticket order. A counter
     per such rows (int32, after the accumulator; zeroed by the delta tasks) counts the adds made; an add waits
     (bounded) until it equals the task's turn (``_dq_turn``: the adds of earlier tickets to those rows, counted
     from positions), a proxy fence, then the add; the count after it is released once
     ``cp.async.bulk.wait_group`` says the add completed, a step later (not waiting for the add just issued).
     Those waits, fences and releases are a fifth partition's, the **dQ writer** (one warp, in the load warp's
     warpgroup; FlashAttention-3's way): the consumers store each step's dQ half into one of their two buffers
     (each freed by the writer once its add completed) and hand it over through an mbarrier, so their steps carry
     no global access (on the consumers they cost the kernel 1.5x, one H200). The writer
     follows the load warp's tasks as the consumers do (``kv_empty`` waits for it too, once it read a task's words).
     Within each (batch, kv head) the dK/dV tickets go from the last K/V block to the first: the order in which
     the tasks, each going up from its first visible query block, reach a block, so the turns seldom make anyone
     wait (causal: the lightest tasks first, a few % of tail against the heaviest first); a task trails the one
     before it by a step or two, once. Waits only for earlier tickets of this rank: the no-deadlock argument holds
     (the writer waits for the consumers' steps and for earlier tickets' adds; the consumers for buffers the writer
     frees after adds it has issued); the order is fixed, so the float sums are the same in every run.
   * After its last task each consumer waits for its reductions to complete, fences the async proxy against the
     generic one, and counts its tasks in CTL_BWD_DELTA (release): the dQ adds of the program's tasks are in memory
     once both of its consumers have counted (with DETERMINISTIC the writer does this, for both).
   * A partial task's consumers store their rows of dK/dV (float32, unscaled) into the owner's partial slot
     (``iris.store``) and, once both have (an mbarrier), the first publishes the slot's flag (release, system
     scope), after marking the owner failed if any wait of this rank gave up (as the tl kernel). A block no local
     query sees (causal) is neither computed nor sent, and its owner does not wait for it (``block_reaches``).
   * A final task's consumers wait (bounded) for every peer's partial of their block, add the partials and their own
     in rank order, and write dK (scaled) and dV; NaN if anything failed.
3. **dQ tasks** (b, h, ROW_TASK query rows), after every dK/dV task's consumers counted (CTL_BWD_DELTA reached the
   delta tasks plus twice the dK/dV tasks): dQ = sm_scale * accumulator, in the input dtype; NaN rows if the call check
   failed or any wait of this rank gave up (the error record: a superset of the tl kernel's per-task NaN rows).
Every program ends with ``end_call`` (the last resets CTL_BWD_TICKET and CTL_BWD_DELTA).

**Persistent**, as the forward (a program per task cost 24-28 us however few its steps, against cuDNN's 12-16,
one H200): a program per SM (``plans.plan_bwd``'s grid), each taking tickets until none is left. Its 4
warps run delta tasks while their tickets are delta tickets; at the first dK/dV ticket the partitions start, and the
load warp takes the later tickets itself (the next one once a task's loads are issued), passing each task to the
consumers in words of shared memory (``_task_words``) that ``kv_bar``'s arrival publishes with the task's K and V.
It loads a task's K and V as soon as both consumers are done with the last task's (``kv_empty``), so a consumer's
end of a task (its partial sent, or the final dK/dV written) runs under the next task's first loads; the slots', dS
buffers' and barriers' rounds go on from task to task. The first ticket past the dK/dV tasks ends the partitions,
and the program runs the dQ tasks from it on. The no-deadlock argument is unchanged: a program takes a ticket only
while it runs, and a task waits only for tasks of earlier tickets, each held by a running program that finishes it
without waiting for a later one (the ticket a load warp holds ahead is run after its current task, which does not
wait for it); ranks sharing a GPU under MPS run fewer programs at once than the grid, which the tickets do not mind.

The ``delta`` output of the launch is the float32 scratch [B*H*S] (delta) followed by [B, S, H, D] (the dQ
accumulator): ``plans.LaunchPlan.out_shapes``; both launchers allocate what it says.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

import iris

from ring_core.kernels import configs
from ring_core.kernels.gluon_parts import (_WORD_LAYOUT_4, _acquire_chunk, _put, _tile_word, cta_barrier, release,
                                           release_bar, tma_add, tma_load)
from ring_core.protocol import control
from ring_core.protocol.steps import (CTL_BWD_DELTA, CTL_BWD_TICKET, CTL_ERROR, KEY_PAD, QUERY_PAD, block_reaches,
                                      bwd_step_unmasked, bwd_task_steps, chunk_one_id, drain_pushes, end_call,
                                      key_ids, last_pos, pairs_allowed, poll_ge, positions, published_range,
                                      query_ranges, ranges_of, ranks_rng, receive_slots, record_error,
                                      record_peer_error, ring_context, segment_keys, start_call, visible_rows)

KV_ROWS = configs.GLUON_BWD_KV_ROWS  # K/V rows per dK/dV task (two consumers of half each)
# Query rows per step of a dK/dV task: configs.GLUON_BWD_Q_ROWS by head_dim, the plan's KV_BLOCK_M (Q_ROWS below).
ROW_TASK = configs.GLUON_BWD_ROW_TASK  # query rows of a delta or dQ task
STAGES = 2  # Q/dO slots (3 slots were no faster on one H200, and leave no room for dQ's buffers)
LOAD_WARPS, LOAD_REGS, CONSUMER_WARPS, CONSUMER_REGS = 1, 24, 4, 240
SUB_ROWS = 32  # rows per pass of a delta or dQ task's 4 warps (32 values per thread per tensor)
ROW_GROUP = 128  # a delta or dQ task's rows in groups of 128 (S % 128 == 0: gluon_bwd_applies), 4 passes each
_KV_ROWS, _HALF, _ROW_TASK = gl.constexpr(KV_ROWS), gl.constexpr(KV_ROWS // 2), gl.constexpr(ROW_TASK)
_STAGES, _SUB_ROWS, _ROW_GROUP = gl.constexpr(STAGES), gl.constexpr(SUB_ROWS), gl.constexpr(ROW_GROUP)
_LOAD_WARPS, _LOAD_REGS = gl.constexpr(LOAD_WARPS), gl.constexpr(LOAD_REGS)
_CONSUMER_WARPS, _CONSUMER_REGS = gl.constexpr(CONSUMER_WARPS), gl.constexpr(CONSUMER_REGS)
_LOG2E = gl.constexpr(1.4426950408889634)
KIND_BWD = gl.constexpr(control.KIND_BWD)
ERR_PARTIAL_TIMEOUT = gl.constexpr(control.ERR_PARTIAL_TIMEOUT)
ERR_LOCAL_TIMEOUT = gl.constexpr(control.ERR_LOCAL_TIMEOUT)
ERR_PEER_FAILED = gl.constexpr(control.ERR_PEER_FAILED)


@gluon.jit
def _proxy_fence():
    """Generic-proxy accesses to global memory ordered against the async proxy's (TMA) after it."""
    gl.inline_asm_elementwise("fence.proxy.async.global;\n mov.b32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _reductions_done():
    """This thread's TMA bulk reductions complete (their writes made, not only their shared memory read), then
    ordered before its generic accesses (the count that publishes them)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n fence.proxy.async.global;\n mov.b32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


UNMASKED = gl.constexpr(-2147483648)  # a masked backward step's word (``load_steps``) when it needs no mask
WRITER_WARPS, WRITER_REGS = 1, LOAD_REGS  # DETERMINISTIC's dQ writer (``_dq_writer``), in the load warp's warpgroup
_WRITER_WARPS, _WRITER_REGS = gl.constexpr(WRITER_WARPS), gl.constexpr(WRITER_REGS)


@gluon.jit
def _previous_step_done():
    """As ``_reductions_done``, for every TMA bulk reduction of this thread but the newest two: the dQ writer's adds
    of the step before the one it just issued (two a step, one per consumer), counted then, a step late, so that
    the writer seldom waits for the completion of an add it has just issued."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 2;\n fence.proxy.async.global;\n mov.b32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _turn_ptr(turns, i, n_m, i_lo, b, hkv, S, H: gl.constexpr, G: gl.constexpr, HALF_INDEX: gl.constexpr,
              Q_ROWS: gl.constexpr):
    """The counter of step i's dQ rows (``dkdv_steps``): int32 [B, H, S // Q_ROWS, 2] after the accumulator."""
    h, m0 = _work(i, n_m, i_lo, hkv, G, Q_ROWS)
    return turns + ((b * H + h) * (S // Q_ROWS) + m0 // Q_ROWS) * 2 + HALF_INDEX


@gluon.jit
def _seen_blocks(q_last, src, S, W: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr):
    """How many of rank ``src``'s K/V blocks add to the dQ of a query block whose last row is at ``q_last``: the
    blocks whose first key is at or before it (causal), a prefix of the shard (``visible_rows``); all of them
    otherwise."""
    if CAUSAL:
        return (visible_rows(q_last, src, S, W, ZIGZAG) + _KV_ROWS - 1) // _KV_ROWS
    else:
        return S // _KV_ROWS


@gluon.jit
def _dq_turn(m0, n_blk, d, rank, S, W: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr,
             Q_ROWS: gl.constexpr):
    """With ``DETERMINISTIC``: how many dK/dV tasks add to the dQ rows of the query block at row m0 before the task
    of K/V block ``n_blk`` at peer distance ``d``. The order is the tickets': the partial tasks by distance 1..W-1,
    then the final ones; within each, the blocks from the last to the first (the kernel's ticket order then), and
    the contributors of each source are a prefix of its blocks (``_seen_blocks``)."""
    q_last = positions(m0 + Q_ROWS - 1, rank, S, W, ZIGZAG)
    turn = _seen_blocks(q_last, (rank - d + W) % W, S, W, CAUSAL, ZIGZAG) - 1 - n_blk
    if W > 1:
        group = gl.where(d == 0, W - 1, d - 1)
        for g in gl.static_range(W - 1):
            turn += gl.where(g < group, _seen_blocks(q_last, (rank - g - 1 + W) % W, S, W, CAUSAL, ZIGZAG), 0)
    return turn


@gluon.jit
def _zero_at(i):
    """0 for a step index i >= 0 (its sign bit), computed at run time: neither LLVM nor ptxas can fold it."""
    return gl.inline_asm_elementwise("shr.u32 $0, $1, 31;", "=r,r", [i], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _row_tile(b, h, r0, S, H: gl.constexpr, D: gl.constexpr):
    """Offsets of rows [r0, r0 + SUB_ROWS) of head h in a [B, S, H, D] tensor, and of the same rows in a
    [B, H, S] one, in a blocked layout over the 4 warps."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows = r0 + gl.arange(0, _SUB_ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    off = ((b * S + rows).to(gl.int64) * H + h)[:, None] * D + cols[None, :]
    return off, (b * H + h).to(gl.int64) * S + rows


@gluon.jit
def bwd_slots(dtype: gl.constexpr, D: gl.constexpr, Q_ROWS: gl.constexpr, layout: gl.constexpr,
              acc_layout: gl.constexpr, DQ_BUFS: gl.constexpr = 2):
    """A dK/dV task's shared memory and mbarriers, initialised: STAGES slots of Q, dO (Q_ROWS rows), lse and delta;
    K and V (128 rows); two buffers of dS^T (128 x Q_ROWS); each consumer's dQ buffer (Q_ROWS x D/2, float32;
    ``DQ_BUFS`` 4 with DETERMINISTIC: two each, consumer c's 2c and 2c + 1, as the dQ writer adds a step behind); ``kv_bar``
    (K and V landed), ``part_bar`` (both consumers stored their partial), ``q_ready`` / ``q_empty`` per slot,
    ``ds_bar`` per dS buffer (both halves stored)."""
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_smem = gl.allocate_shared_memory(dtype, [_STAGES, Q_ROWS, D], layout)
    do_smem = gl.allocate_shared_memory(dtype, [_STAGES, Q_ROWS, D], layout)
    kv_smem = gl.allocate_shared_memory(dtype, [2, _KV_ROWS, D], layout)  # K, then V (``dkdv_steps``: why one)
    ds_smem = gl.allocate_shared_memory(dtype, [2, _KV_ROWS, Q_ROWS], layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, Q_ROWS, D // 2], acc_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [_STAGES, Q_ROWS], row_layout)
    dl_smem = gl.allocate_shared_memory(gl.float32, [_STAGES, Q_ROWS], row_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    part_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(part_bar, count=2)
    for i in gl.static_range(_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)
    fence_async_shared()  # the barriers' initialisation before the async proxy (TMA) uses them
    return (q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, part_bar, q_ready, q_empty,
            ds_bar)


@gluon.jit
def free_bwd_slots(kv_bar, part_bar, q_ready, q_empty, ds_bar):
    """``bwd_slots``' mbarriers invalidated, once every partition is done with them."""
    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(part_bar)
    for i in gl.static_range(_STAGES):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(q_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(ds_bar.index(i))


@gluon.jit
def _dq_bars(kv_empty, DETERMINISTIC: gl.constexpr):
    """With DETERMINISTIC, the mbarriers of each consumer's two dQ buffers, initialised: consumer 0's full (the
    consumer stored a step's dQ half) and empty (the dQ writer's add of it completed), then consumer 1's; without,
    ``kv_empty`` in their place (never read)."""
    if DETERMINISTIC:
        dq_full0 = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty0 = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full1 = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty1 = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(dq_full0.index(i), count=1)
            mbarrier.init(dq_empty0.index(i), count=1)
            mbarrier.init(dq_full1.index(i), count=1)
            mbarrier.init(dq_empty1.index(i), count=1)
    else:
        dq_full0 = kv_empty
        dq_empty0 = kv_empty
        dq_full1 = kv_empty
        dq_empty1 = kv_empty
    return dq_full0, dq_empty0, dq_full1, dq_empty1


@gluon.jit
def _free_dq_bars(dq_full0, dq_empty0, dq_full1, dq_empty1, DETERMINISTIC: gl.constexpr):
    """``_dq_bars``' mbarriers invalidated (with DETERMINISTIC), once every partition is done with them."""
    if DETERMINISTIC:
        for i in gl.static_range(2):
            mbarrier.invalidate(dq_full0.index(i))
            mbarrier.invalidate(dq_empty0.index(i))
            mbarrier.invalidate(dq_full1.index(i))
            mbarrier.invalidate(dq_empty1.index(i))


@gluon.jit
def _work(i, n_m, i_lo, hkv, G: gl.constexpr, Q_ROWS: gl.constexpr):
    """Step i of a dK/dV task: (query head, first query row): the kv group's heads in turn, each over its query
    blocks of Q_ROWS rows [i_lo, i_lo + n_m)."""
    return hkv * G + i // n_m, (i_lo + i % n_m) * Q_ROWS


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, r_desc, q_smem, do_smem, kv_smem, lse_smem, dl_smem, kv_bar,
              q_ready, q_empty, lse_ptr, delta_ptr, b, hkv, n0, d, src, S, B, n_m, i_lo, flags, n_chunks, epoch, ctl,
              timeout_ns, W: gl.constexpr, H: gl.constexpr, G: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
              CHUNK_ROWS: gl.constexpr, ids_smem=None, meta_smem=None, seg_b=None, i_full=0, i_fend=0, kv_t=0,
              rng_b=None, rank=0, k_pos_n0=0, ZIGZAG: gl.constexpr = False, SEGMENTED: gl.constexpr = False, g0=0,
              KV_IDS: gl.constexpr = False):
    """The load warp's part of one dK/dV task (module docstring), the program's tasks before it having had ``g0``
    steps: K and V of the block on ``kv_bar`` (a task without steps, n_m == 0, loads nothing: its phase of the barrier
    passes with the arrival alone), then its steps. With a window or segment ids (``meta_smem`` given) also each
    step's word and ids (``load_steps``)."""
    if n_m == 0:
        mbarrier.arrive(kv_bar, count=1)
    else:
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
        peer = d > 0
        if W == 1:
            peer = False  # no partial task at world size 1: no flag wait compiled in
        if not peer:
            tma_load(k_desc, [b * S + n0, hkv * D], kv_bar, kv_smem.index(0))
            tma_load(v_desc, [b * S + n0, hkv * D], kv_bar, kv_smem.index(1))
        else:
            c = n0 // CHUNK_ROWS
            _acquire_chunk(flags + (((d - 1) * B + b) * HKV + hkv) * n_chunks + c, epoch, ctl, timeout_ns, src, d, c)
            k_row = (((d - 1) * 2 * B + b) * HKV + hkv) * S + n0  # K rows in the receive slot; V B*HKV*S on
            tma_load(r_desc, [k_row, 0], kv_bar, kv_smem.index(0))
            tma_load(r_desc, [k_row + B * HKV * S, 0], kv_bar, kv_smem.index(1))
    if meta_smem is not None:
        load_steps(q_desc, do_desc, q_smem, do_smem, lse_smem, dl_smem, q_ready, q_empty, lse_ptr, delta_ptr, b, hkv,
                   S, n_m, i_lo, H, G, D, ids_smem, meta_smem, seg_b, i_full, i_fend, kv_t, rng_b, rank, k_pos_n0,
                   CHUNK_ROWS, W, ZIGZAG, SEGMENTED, g0, KV_IDS)
    else:
        load_steps(q_desc, do_desc, q_smem, do_smem, lse_smem, dl_smem, q_ready, q_empty, lse_ptr, delta_ptr, b, hkv,
                   S, n_m, i_lo, H, G, D, g0=g0)


@gluon.jit
def load_steps(q_desc, do_desc, q_smem, do_smem, lse_smem, dl_smem, q_ready, q_empty, lse_ptr, delta_ptr, b, hkv, S,
               n_m, i_lo, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, ids_smem=None, meta_smem=None, seg_b=None,
               i_full=0, i_fend=0, kv_t=0, rng_b=None, rank=0, k_pos_n0=0, CHUNK_ROWS: gl.constexpr = 0,
               W: gl.constexpr = 1, ZIGZAG: gl.constexpr = False, SEGMENTED: gl.constexpr = False, g0=0,
               KV_IDS: gl.constexpr = False):
    """The load warp's steps (``dkdv_steps``' inputs): Q and dO of every step through TMA, with its lse (log2 units)
    and delta, into slot (g0 + i) % STAGES once the consumers freed it (``g0``: the program's steps of its tasks
    before this one: the slots' rounds go on from task to task).
    With a window or segment ids (``meta_smem`` given), also the step's word in ``meta_smem``: UNMASKED where every
    query of the block sees every key of the task's by position (blocks [i_full, i_fend)) and, with segment ids, the
    query block's chunk and the K/V block both carry one id alone (their published ranges [kv_t, kv_t]: ``kv_t`` -2
    where the K/V block's does not); else the step needs masks and the word is the query block's first position
    minus the K/V block's (``k_pos_n0``), which the consumers' mask is relative to (made here, where time is
    free, not in their registers). With segment ids, the query block's ids in ``ids_smem`` (``seg_b``: this rank's
    ids of batch b; ``rng_b``: its published ranges). KV_IDS (the keys' ids are not the queries': this rank's
    published chunk ranges are its keys'): the query block carries one id alone where its ids' min and max are
    ``kv_t``."""
    Q_ROWS: gl.constexpr = q_smem.shape[1]
    rows = gl.arange(0, Q_ROWS, layout=gl.BlockedLayout([Q_ROWS // 32], [32], [1], [0]))
    for i in range(G * n_m):
        h, m0 = _work(i, n_m, i_lo, hkv, G, Q_ROWS)
        s = (g0 + i) % _STAGES
        mbarrier.wait(q_empty.index(s), (((g0 + i) // _STAGES) & 1) ^ 1)
        # The step's lse and delta beside its Q and dO: read by the consumers where they need them, not held in
        # their registers across the MMAs. Stored before the arrival below (release), which the consumers' wait
        # acquires.
        row = (b * H + h).to(gl.int64) * S + m0
        lse_smem.index(s).store(gl.load(lse_ptr + row + rows) * _LOG2E)
        dl_smem.index(s).store(gl.load(delta_ptr + row + rows))
        if meta_smem is not None:
            unmasked = bwd_step_unmasked(m0, i_full, i_fend, Q_ROWS)
            if SEGMENTED:
                q_ids = gl.load(seg_b + m0 + rows)
                ids_smem.index(s).store(segment_keys(q_ids, QUERY_PAD))
                if KV_IDS:
                    unmasked = unmasked & (gl.min(q_ids, 0) == kv_t) & (gl.max(q_ids, 0) == kv_t)
                else:
                    unmasked = unmasked & chunk_one_id(rng_b, m0 // CHUNK_ROWS, m0 >= 0, kv_t)
            word = gl.where(unmasked, UNMASKED, positions(m0, rank, S, W, ZIGZAG) - k_pos_n0)
            _put(meta_smem, s, word)
        mbarrier.expect(q_ready.index(s), 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [b * S + m0, h * D], q_ready.index(s), q_smem.index(s))
        tma_load(do_desc, [b * S + m0, h * D], q_ready.index(s), do_smem.index(s))


@gluon.jit
def dkdv_steps(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, q_ready, q_empty, ds_bar,
               dq_desc, b, hkv, n0, src, rank, S, n_m, i_lo, sm_scale, HALF_INDEX: gl.constexpr, W: gl.constexpr,
               H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr,
               DETERMINISTIC: gl.constexpr, ids_smem=None, meta_smem=None, seg_k=None, WINDOW: gl.constexpr = False,
               WIN_LEFT: gl.constexpr = -1, WIN_RIGHT: gl.constexpr = -1, SEGMENTED: gl.constexpr = False, g0=0,
               kv_phase=0, dq_full=None, dq_empty=None):
    """A consumer's steps on K/V rows [n0 + 64 * HALF_INDEX, + 64) of rank ``src`` (module docstring): (dK, dV) of
    those rows, float32, unscaled; dQ's reductions issued (the caller waits for them). With DETERMINISTIC the
    consumer adds nothing itself: each step's dQ half goes into buffer 2 HALF_INDEX + (g0 + i) % 2 of ``dq_smem``
    (both consumers' four; this one's two) once the dQ writer freed it (``dq_empty``), and ``dq_full`` hands it to
    the writer (``_dq_writer``), which adds it in its turn.
    With a window or segment ids (``meta_smem`` given): a step whose word (``load_steps``) says so gets the one mask
    rule of every kernel (protocol.pairs_allowed) on P^T, on positions relative to the block's first query and the
    half's first key (each contiguous: ``plans.gluon_applies``) and on the ids (the query block's from ``ids_smem``,
    the half's keys' from ``seg_k``, read once K/V landed: they came with the chunk, before its flag). A masked
    pair's P is 0, so its dS is 0 too (dP^T's rows are finite: the blocks read were sent whole).
    ``g0``: the program's steps of its tasks before this one (the slots' and dS buffers' rounds go on from task to
    task); ``kv_phase``: the phase of ``kv_bar`` that brings this task's K and V."""
    MASKS: gl.constexpr = meta_smem is not None
    gl.static_assert(not (MASKS and DETERMINISTIC), "masks run the Gluon backward in any order only")
    G: gl.constexpr = H // HKV
    dtype: gl.constexpr = q_smem.dtype
    Q_ROWS: gl.constexpr = q_smem.shape[1]
    DQ_COLS: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                       instr_shape=[16, Q_ROWS, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                        instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dk = gl.zeros([_HALF, D], gl.float32, kv_layout)
    dv = gl.zeros([_HALF, D], gl.float32, kv_layout)
    zero_s = gl.zeros([_HALF, Q_ROWS], gl.float32, s_layout)
    zero_q = gl.zeros([Q_ROWS, DQ_COLS], gl.float32, dq_layout)
    k_pos0 = positions(n0 + HALF_INDEX * _HALF, src, S, W, ZIGZAG)  # contiguous over its 64 rows (gluon_bwd_applies)
    qk_scale = sm_scale * _LOG2E
    k_rows = gl.arange(0, _HALF, layout=gl.SliceLayout(1, s_layout))  # (masks only: the causal path makes its own)
    k_ids = gl.full([_HALF], -1, gl.int32, gl.SliceLayout(1, s_layout))  # (read with segment ids only)
    if n_m > 0:
        mbarrier.wait(kv_bar, kv_phase)
        if SEGMENTED:
            k_ids = segment_keys(gl.load(seg_k + n0 + HALF_INDEX * _HALF + k_rows), KEY_PAD)
    for i in range(G * n_m):
        h, m0 = _work(i, n_m, i_lo, hkv, G, Q_ROWS)
        gi = g0 + i  # the program's step
        s = gi % _STAGES
        mbarrier.wait(q_ready.index(s), (gi // _STAGES) & 1)
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        # K and V viewed again at each step through an index the compilers cannot fold (0): their wgmma descriptors
        # are then a few uniform adds per step, where views made once before the loop were 24 64-bit values held
        # across it, which ptxas spilled and reloaded every step (``python -m benchmarks.spills --kernel bwd``).
        z = _zero_at(i)
        k_half = kv_smem.index(z).slice(HALF_INDEX * _HALF, _HALF)
        v_half = kv_smem.index(z + 1).slice(HALF_INDEX * _HALF, _HALF)
        k_cols = kv_smem.index(z).slice(HALF_INDEX * DQ_COLS, DQ_COLS, dim=1)  # dQ's B operand: D / 2 columns
        sT = warpgroup_mma(k_half, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_half, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT, ))
        pT = gl.exp2(sT * qk_scale - lse_smem.index(s).load(gl.SliceLayout(0, s_layout))[None, :])
        if MASKS:
            word = gl.max(meta_smem.index(s).load(_WORD_LAYOUT_4), axis=0)
            if word != UNMASKED:
                shift = word - HALF_INDEX * _HALF  # query minus key position at (row 0, column 0)
                cols = gl.arange(0, Q_ROWS, layout=gl.SliceLayout(0, s_layout))
                q_ids = cols  # (read with segment ids only)
                if SEGMENTED:
                    q_ids = ids_smem.index(s).load(gl.SliceLayout(0, s_layout))
                ok = pairs_allowed(cols[None, :] >= 0, cols[None, :] + shift, k_rows[:, None], q_ids[None, :],
                                   k_ids[:, None], CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, KEYED=True)
                pT = gl.where(ok, pT, 0.0)
        elif CAUSAL:
            shift = positions(m0, rank, S, W, ZIGZAG) - k_pos0  # query minus key position at (row 0, column 0)
            if shift < _HALF - 1:  # some key of the half after some query of the block
                # (the indices made here, not held across the loop: registers are what it is short of)
                key_rows = gl.arange(0, _HALF, layout=gl.SliceLayout(1, s_layout))
                cols = gl.arange(0, Q_ROWS, layout=gl.SliceLayout(0, s_layout))
                pT = gl.where(cols[None, :] + shift >= key_rows[:, None], pT, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), p_layout), do_s, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT, ))  # dV may still run
        dsT = pT * (dpT - dl_smem.index(s).load(gl.SliceLayout(0, s_layout))[None, :])
        ds_buf = ds_smem.index(gi % 2)
        ds_half = ds_buf.slice(HALF_INDEX * _HALF, _HALF)
        ds_half.store(dsT.to(dtype))
        fence_async_shared()  # this thread's stores before the async proxy (wgmma) reads them
        cta_barrier()  # every thread of this warpgroup stored and fenced before the arrival
        mbarrier.arrive(ds_bar.index(gi % 2), count=1)
        dk = warpgroup_mma(ds_half, q_s, dk, is_async=True)
        # Both halves of dS stored: dQ's columns of this consumer over all 128 K/V rows.
        mbarrier.wait(ds_bar.index(gi % 2), (gi // 2) & 1)
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, zero_q, use_acc=False, is_async=True)
        dq, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv))
        release(q_empty, s)
        if DETERMINISTIC:
            # Into a buffer the writer is done with (it adds a step behind), then to the writer: no global access,
            # fence or wait for a turn on the math warps.
            mbarrier.wait(dq_empty.index(gi % 2), ((gi // 2) & 1) ^ 1)  # (fresh: phase 1 passes)
            dq_smem.index(2 * HALF_INDEX + gi % 2).store(dq)
            fence_async_shared()  # this thread's stores before the async proxy (the writer's TMA) reads them
            cta_barrier()
            mbarrier.arrive(dq_full.index(gi % 2), count=1)
        else:
            tma.store_wait(pendings=0)  # the previous step's reduction has read the buffer
            cta_barrier()
            dq_smem.store(dq)
            fence_async_shared()
            cta_barrier()
            tma_add(dq_desc, [b * S + m0, h * D + HALF_INDEX * DQ_COLS], dq_smem)
    return dk, dv


@gluon.jit
def _consumer_task(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, kv_empty, q_ready, q_empty,
                   ds_bar, part_bar, dq_desc, dk_ptr, dv_ptr, ctx_ptr, part_off, b, hkv, n0, d, rank, S, B, n_m, i_lo,
                   timeout_ns, sm_scale, dq_full, dq_empty, ctl, g0, kv_phase, part_phase, HALF_INDEX: gl.constexpr,
                   W: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                   ZIGZAG: gl.constexpr, CHUNK_ROWS: gl.constexpr, DETERMINISTIC: gl.constexpr, sent, ids_smem=None,
                   meta_smem=None, seg_k=None, WINDOW: gl.constexpr = False, WIN_LEFT: gl.constexpr = -1,
                   WIN_RIGHT: gl.constexpr = -1, SEGMENTED: gl.constexpr = False):
    """One consumer's part of a dK/dV task (module docstring): its steps (``g0``: the program's steps before this task;
    ``kv_phase``: ``kv_bar``'s phase for its K and V), K and V freed for the next task's (``kv_empty``), then its rows'
    partial sent (``part_phase``: ``part_bar``'s phase, the program's partials so far) or final dK/dV written, while the
    next task's K and V load. ``n_m`` is 0 for a task with nothing to compute (its block unseen, or the call check
    failed). With a window or segment ids (``sent`` given, ``protocol.bwd_task_steps``): ``sent`` is nonzero for a
    partial task that sends its partial, even where no query block meets the block's ids (the owner's test); without, a
    partial task sends exactly when it has steps.
    What only the end needs (the ring's words, the partial slots) is read again there from ``ctx_ptr``, not held
    across the loop: registers are what the loop is short of. The task's dQ adds are left running: the consumer
    waits for them and counts its tasks once, after its last (``_consumer``); with DETERMINISTIC the dQ writer adds
    (``dq_full`` / ``dq_empty``: this consumer's two dQ buffers)."""
    dtype: gl.constexpr = q_smem.dtype
    MASKS: gl.constexpr = WINDOW or SEGMENTED
    if MASKS:
        dk, dv = dkdv_steps(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, q_ready,
                            q_empty, ds_bar, dq_desc, b, hkv, n0, (rank - d + W) % W, rank, S, n_m, i_lo, sm_scale,
                            HALF_INDEX, W, H, HKV, D, CAUSAL, ZIGZAG, DETERMINISTIC, ids_smem, meta_smem, seg_k,
                            WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, g0, kv_phase)
    else:
        dk, dv = dkdv_steps(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, q_ready,
                            q_empty, ds_bar, dq_desc, b, hkv, n0, (rank - d + W) % W, rank, S, n_m, i_lo, sm_scale,
                            HALF_INDEX, W, H, HKV, D, CAUSAL, ZIGZAG, DETERMINISTIC, g0=g0, kv_phase=kv_phase,
                            dq_full=dq_full, dq_empty=dq_empty)
    release_bar(kv_empty)  # every MMA of this consumer's that read K or V has completed (dkdv_steps' last wait)
    kv_layout: gl.constexpr = dk.type.layout
    n_first = n0 + HALF_INDEX * _HALF
    heap_bases, rank, ctl, flags, recv_addr, epoch = ring_context(ctx_ptr, W)  # (the epoch changes only at the end
    # of the call, after this program's)

    src = (rank - d + W) % W
    part = (recv_addr + (rank * 0 + part_off).to(gl.uint64)).to(gl.pointer_type(gl.float32), bitcast=True)
    n_kvb = S // _KV_ROWS
    n_units = (W - 1) * B * HKV * gl.cdiv(S, CHUNK_ROWS)  # the K/V flags, before the partials' (plans)
    rows = n_first + gl.arange(0, _HALF, layout=gl.SliceLayout(1, kv_layout))
    part_rows = rows[:, None].to(gl.int64) * D + gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))[None, :]
    bh = b * HKV + hkv
    # After every wait of this task; a failed call check is in it too (protocol.check_call records it).
    err = gl.atomic_add(ctl + CTL_ERROR, 0, sem="acquire", scope="gpu")
    if d > 0:
        if sent > 0:
            # Unscaled float32 partials into slot d-1 of the owner's partial region; the flag after both halves.
            slot = d - 1
            dst = ((slot * 2 * B + b).to(gl.int64) * HKV + hkv) * S * D
            iris.store(part + dst + part_rows, dk, rank, src, heap_bases, hint=(1, 2))
            iris.store(part + dst + (rank * 0 + B).to(gl.int64) * HKV * S * D + part_rows, dv, rank, src, heap_bases,
                       hint=(1, 2))
            cta_barrier()
            mbarrier.arrive(part_bar, count=1)
            if HALF_INDEX == 0:
                mbarrier.wait(part_bar, part_phase)
                if err != 0:
                    # Published anyway (the owner must not wait out its timeout), but marked untrustworthy.
                    record_peer_error(ctl, heap_bases, rank, src, ERR_PEER_FAILED, d)
                iris.atomic_xchg(flags + n_units + (slot * B * HKV + bh) * n_kvb + n0 // _KV_ROWS, epoch, rank, src,
                                 heap_bases, sem="release", scope="sys")
    else:
        # Final task: every peer's partial of this block (sent exactly when some query of that peer sees the
        # block: the test its partial task makes), then the sum in rank order, the local one at its place.
        k_pos_min = positions(n0, rank, S, W, ZIGZAG)
        n_blk = n0 // _KV_ROWS
        n_chunks = gl.cdiv(S, CHUNK_ROWS)
        rng = ranks_rng(flags, B, HKV, n_chunks, n_kvb, W)
        my_lo = n0 * 0  # the block's published id range (segment ids: what the peers' partial tasks test)
        my_hi = my_lo
        if SEGMENTED:
            my_lo, my_hi = published_range(rng, rank, b, B, n_chunks, n0 // CHUNK_ROWS)
        for r in gl.static_range(W):
            if r != rank:
                if block_reaches(n0, n0 + _KV_ROWS, k_pos_min, rank, r, rng, b, B, n_chunks, my_lo, my_hi, True, S,
                                 W, ZIGZAG, CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED):
                    rslot = (r - rank + W) % W - 1
                    if poll_ge(flags + n_units + (rslot * B * HKV + bh) * n_kvb + n_blk, epoch, ctl, timeout_ns,
                               False) == 0:
                        record_error(ctl, ERR_PARTIAL_TIMEOUT, r, rslot + 1, n_blk)
        cta_barrier()
        valid = gl.atomic_add(ctl + CTL_ERROR, 0, sem="acquire", scope="gpu") == 0  # the call check's too
        out_off = (b * S + rows)[:, None].to(gl.int64) * (HKV * D) + hkv * D + gl.arange(
            0, D, layout=gl.SliceLayout(0, kv_layout))[None, :]
        for which in gl.static_range(2):
            total = gl.zeros([_HALF, D], gl.float32, kv_layout)
            for r in gl.static_range(W):
                if r == rank:
                    if which == 0:
                        total += dk
                    else:
                        total += dv
                else:
                    if block_reaches(n0, n0 + _KV_ROWS, k_pos_min, rank, r, rng, b, B, n_chunks, my_lo, my_hi, True, S,
                                     W, ZIGZAG, CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED):
                        rslot = (r - rank + W) % W - 1
                        src_off = ((rslot * 2 * B + which * B + b).to(gl.int64) * HKV + hkv) * S * D
                        total += gl.load(part + src_off + part_rows)
            total = gl.where(valid, total, float("nan"))
            if which == 0:
                gl.store(dk_ptr + out_off, (total * sm_scale).to(dtype))
            else:
                gl.store(dv_ptr + out_off, total.to(dtype))


@gluon.jit
def _delta_task(tid, n_rows, o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_acc, turns, ctl, S, H: gl.constexpr,
                D: gl.constexpr, SEGMENTED: gl.constexpr, DETERMINISTIC: gl.constexpr, seg_ptr=None,
                KV_IDS: gl.constexpr = False):
    """Delta task ``tid`` (module docstring), by the program's 4 warps: delta = rowsum(dO * O) - dlse of its rows and
    their rows of the dQ accumulator zeroed (with DETERMINISTIC, their turn counters too; with KV_IDS, head 0's
    tasks: its rows' query id ranges, ``protocol.query_ranges``, into the counters' words, which only
    DETERMINISTIC uses), then counted in CTL_BWD_DELTA (release)."""
    bh = tid // n_rows
    b = bh // H
    h = bh % H
    r_first = (tid % n_rows) * _ROW_TASK
    for r0 in range(r_first, gl.minimum(r_first + _ROW_TASK, S), _ROW_GROUP):  # (S % 128 == 0)
        for sub in gl.static_range(_ROW_GROUP // _SUB_ROWS):
            off, row_off = _row_tile(b, h, r0 + sub * _SUB_ROWS, S, H, D)
            o = gl.load(o_ptr + off).to(gl.float32)
            do = gl.load(do_ptr + off).to(gl.float32)
            dst = delta_ptr + row_off
            rowsum = gl.sum(do * o, axis=1)
            dl = gl.load(dlse_ptr + row_off)
            if SEGMENTED:  # a padding row's lse is the constant -inf: its dlse selected away (as the tl kernel)
                dl = gl.where(gl.load(lse_ptr + row_off) == float("-inf"), 0.0, dl)
            gl.store(dst, rowsum - dl)
            gl.store(dq_acc + off, gl.zeros_like(o))
        if DETERMINISTIC:
            words = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [4], [0]))  # 2 query blocks x 2 halves
            gl.store(turns + (bh * (S // _ROW_GROUP) + r0 // _ROW_GROUP) * 4 + words, words * 0)
        if KV_IDS:
            if h == 0:
                query_ranges(seg_ptr + b.to(gl.int64) * S, turns + b * (S // _ROW_GROUP) * 2, r0, _ROW_GROUP)
    cta_barrier()  # every thread's stores before the count (cumulativity through bar.sync), then publish
    gl.atomic_add(ctl + CTL_BWD_DELTA, 1, sem="release", scope="gpu")


@gluon.jit
def _dq_task(t, n_rows, n_counts, call_ok, dq_ptr, dq_acc, sm_scale, rank, ctl, timeout_ns, S, H: gl.constexpr,
             D: gl.constexpr):
    """dQ task ``t`` (module docstring), by the program's 4 warps, once every delta and dK/dV task counted
    (CTL_BWD_DELTA reached ``n_counts``): dQ = sm_scale * accumulator in the input dtype, NaN rows after a failure."""
    bh = t // n_rows
    b = bh // H
    h = bh % H
    ok = poll_ge(ctl + CTL_BWD_DELTA, n_counts, ctl, timeout_ns, False)
    if ok == 0:
        record_error(ctl, ERR_LOCAL_TIMEOUT, rank, 0, t % n_rows)
    cta_barrier()  # every thread's loads below after the acquire above
    err = gl.atomic_add(ctl + CTL_ERROR, 0, sem="acquire", scope="gpu")
    valid = (call_ok != 0) & (err == 0)
    r_first = (t % n_rows) * _ROW_TASK
    for r0 in range(r_first, gl.minimum(r_first + _ROW_TASK, S), _ROW_GROUP):
        for sub in gl.static_range(_ROW_GROUP // _SUB_ROWS):
            off, row_off = _row_tile(b, h, r0 + sub * _SUB_ROWS, S, H, D)
            dq = gl.where(valid, gl.load(dq_acc + off) * sm_scale, float("nan"))
            gl.store(dq_ptr + off, dq.to(dq_ptr.dtype.element_ty))


@gluon.jit
def _kv_task(t, n_part, B, S, W: gl.constexpr, HKV: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """dK/dV task ``t`` (its ticket less the delta tasks'): (b, kv head, first K/V row n0, peer distance d of the
    K/V's owner, 0: local). Partial tasks first (d = 1..W-1), then the final ones. One (batch, kv head) after
    another, as their Q, dO and dQ rows then stay in L2 while its tasks run (interleaving the heads' tasks
    made the deterministic kernel 1.9x slower). Within one: the heaviest block first (causal); with DETERMINISTIC the
    last block first, the order in which the tasks, each going up from its first visible query block, reach a query
    block, so that dQ's adds, which follow the tickets (``_dq_turn``), seldom wait (causal: the lightest first)."""
    n_kvb = S // _KV_ROWS
    per_d = B * HKV * n_kvb
    is_final = t >= n_part
    d = gl.where(is_final, 0, t // per_d + 1)
    rem = gl.where(is_final, t - n_part, t % per_d)
    n_blk = rem % n_kvb
    if DETERMINISTIC:
        n_blk = n_kvb - 1 - n_blk
    return rem // n_kvb // HKV, rem // n_kvb % HKV, n_blk * _KV_ROWS, d


@gluon.jit
def _task_words(task_smem, t, n_m, i_lo, sent):
    """The load warp: the task it loads (ticket ``t``; -1 or any ticket past the dK/dV tasks: no more), its steps
    (``n_m`` query blocks from ``i_lo``) and whether its partial goes back (``sent``), for the consumers; published
    by ``kv_bar``'s arrival after it (``_producer``), read once it passed (``_tile_word``)."""
    _put(task_smem, 0, t)
    _put(task_smem, 1, n_m)
    _put(task_smem, 2, i_lo)
    _put(task_smem, 3, sent)


@gluon.jit
def _producer_tasks(tid, n_dq, n_kv, n_part, call_ok, task_smem, kv_empty, q_desc, do_desc, k_desc, v_desc, r_desc,
                    q_smem, do_smem, kv_smem, lse_smem, dl_smem, kv_bar, q_ready, q_empty, lse_ptr, delta_ptr, seg_ptr,
                    rng, ids_smem, meta_smem, rank, B, S, flags, n_chunks, epoch, ctl, timeout_ns, W: gl.constexpr,
                    H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr,
                    CHUNK_ROWS: gl.constexpr, DETERMINISTIC: gl.constexpr, WINDOW: gl.constexpr,
                    WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr, KV_IDS: gl.constexpr,
                    q_rng):
    """The load warp of the program's dK/dV tasks: from ticket ``tid`` on, each task's words (``_task_words``), K and
    V and steps (``_producer``) once the consumers are done with the last task's K and V (``kv_empty``: their
    epilogue then runs under these loads), the next ticket taken once a task's loads are issued, until one past the
    dK/dV tasks, which goes to the consumers (and after the region to the program) as the task word that ends them.
    The steps of a task: its query blocks that some key of its block can reach (a suffix, positions growing with the
    row); with a window or segment ids ``protocol.bwd_task_steps`` (positions, then the chunks' published id ranges,
    which with KV_IDS are the keys': the queries' ranges then come from ``q_rng``, which the delta tasks wrote),
    which also says whether a partial goes back; none after a failed call check."""
    G: gl.constexpr = H // HKV
    Q_ROWS: gl.constexpr = q_smem.shape[1]
    MASKS: gl.constexpr = WINDOW or SEGMENTED
    k = tid * 0  # the program's dK/dV tasks so far (kv_bar's phases)
    g = k  # their steps (the slots' rounds)
    while tid < n_dq + n_kv:
        b, hkv, n0, d = _kv_task(tid - n_dq, n_part, B, S, W, HKV, DETERMINISTIC)
        src = (rank - d + W) % W
        mbarrier.wait(kv_empty, (k & 1) ^ 1)  # (a fresh barrier passes phase 1: the first task waits for nothing)
        if MASKS:
            seg_b = seg_ptr + b.to(gl.int64) * S  # this rank's ids of batch b (segment ids only)
            rng_b = ranges_of(rng, rank, b, B, n_chunks)  # and the ranges it published for them
            if KV_IDS:  # (published: the keys'; the queries' per 128 rows from the delta tasks)
                sent, i_lo, n_m, i_full, i_fend, kv_t = bwd_task_steps(
                    n0, d, src, rank, b, B, S, rng, rng_b, n_chunks, W, _KV_ROWS, Q_ROWS, CHUNK_ROWS, CAUSAL, ZIGZAG,
                    WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, q_rng + b * (S // _ROW_GROUP) * 2, _ROW_GROUP)
            else:
                sent, i_lo, n_m, i_full, i_fend, kv_t = bwd_task_steps(
                    n0, d, src, rank, b, B, S, rng, rng_b, n_chunks, W, _KV_ROWS, Q_ROWS, CHUNK_ROWS, CAUSAL, ZIGZAG,
                    WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
            n_m = n_m * call_ok  # nothing computed, waited for or sent after a mismatch
            _task_words(task_smem, tid, n_m, i_lo, sent * call_ok)
            _producer(q_desc, do_desc, k_desc, v_desc, r_desc, q_smem, do_smem, kv_smem, lse_smem, dl_smem, kv_bar,
                      q_ready, q_empty, lse_ptr, delta_ptr, b, hkv, n0, d, src, S, B, n_m, i_lo, flags, n_chunks,
                      epoch, ctl, timeout_ns, W, H, G, HKV, D, CHUNK_ROWS, ids_smem, meta_smem, seg_b, i_full, i_fend,
                      kv_t, rng_b, rank, positions(n0, src, S, W, ZIGZAG), ZIGZAG, SEGMENTED, g, KV_IDS)
        else:
            i_lo = n0 * 0
            n_m = S // Q_ROWS
            if CAUSAL:
                k_pos_min = positions(n0, src, S, W, ZIGZAG)
                i_lo = visible_rows(k_pos_min - 1, rank, S, W, ZIGZAG) // Q_ROWS
                n_m = gl.where(k_pos_min <= last_pos(rank, S, W, ZIGZAG), n_m - i_lo, 0)
            n_m = n_m * call_ok
            _task_words(task_smem, tid, n_m, i_lo, n_m)  # without masks a partial goes back when it has steps
            _producer(q_desc, do_desc, k_desc, v_desc, r_desc, q_smem, do_smem, kv_smem, lse_smem, dl_smem, kv_bar,
                      q_ready, q_empty, lse_ptr, delta_ptr, b, hkv, n0, d, src, S, B, n_m, i_lo, flags, n_chunks,
                      epoch, ctl, timeout_ns, W, H, G, HKV, D, CHUNK_ROWS, g0=g)
        g += G * n_m
        k += 1
        tid = gl.atomic_add(ctl + CTL_BWD_TICKET, 1, sem="relaxed", scope="gpu")
    mbarrier.wait(kv_empty, (k & 1) ^ 1)
    _task_words(task_smem, tid, 0, 0, 0)
    mbarrier.arrive(kv_bar, count=1)


@gluon.jit
def _consumer(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, kv_empty, q_ready, q_empty,
              ds_bar, part_bar, task_smem, dq_desc, dk_ptr, dv_ptr, ctx_ptr, part_off, kseg_ptr, seg_recv, rank, S, B,
              n_dq, n_kv, n_part, timeout_ns, sm_scale, dq_full, dq_empty, ctl, ids_smem, meta_smem,
              HALF_INDEX: gl.constexpr,
              W: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
              ZIGZAG: gl.constexpr, CHUNK_ROWS: gl.constexpr, DETERMINISTIC: gl.constexpr, WINDOW: gl.constexpr,
              WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr):
    """One consumer warpgroup of the program's dK/dV tasks, in the load warp's order (``_task_words``, published by
    ``kv_bar``): each task's steps and end (``_consumer_task``), until the word past the dK/dV tasks; then its dQ
    adds waited for (complete, not only read) and its tasks counted in CTL_BWD_DELTA at once (release), which the
    dQ tasks wait for (with DETERMINISTIC the dQ writer does both: ``_dq_writer``). The slots' and dS buffers'
    rounds go on from task to task (``g``), and so do ``kv_bar``'s
    phases (``k``) and ``part_bar``'s (``parts``: the partials this program sent)."""
    G: gl.constexpr = H // HKV
    MASKS: gl.constexpr = WINDOW or SEGMENTED
    k = rank * 0
    g = k
    parts = k
    mbarrier.wait(kv_bar, 0)
    t = _tile_word(task_smem, 0)
    while t < n_dq + n_kv:
        n_m = _tile_word(task_smem, 1)
        i_lo = _tile_word(task_smem, 2)
        sent = _tile_word(task_smem, 3)
        b, hkv, n0, d = _kv_task(t - n_dq, n_part, B, S, W, HKV, DETERMINISTIC)
        if MASKS:
            seg_k = kseg_ptr + b.to(gl.int64) * S  # the block's keys' ids (segment ids only; a peer's came with its
            if SEGMENTED:  # chunk, before the flag)
                if d > 0:
                    seg_k = seg_recv + (((d - 1) * B + b) * HKV + hkv).to(gl.int64) * S
            _consumer_task(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, kv_empty, q_ready,
                           q_empty, ds_bar, part_bar, dq_desc, dk_ptr, dv_ptr, ctx_ptr, part_off, b, hkv, n0, d, rank,
                           S, B, n_m, i_lo, timeout_ns, sm_scale, dq_full, dq_empty, ctl, g, k & 1, parts & 1,
                           HALF_INDEX, W, H, HKV, D, CAUSAL, ZIGZAG, CHUNK_ROWS, DETERMINISTIC, sent, ids_smem,
                           meta_smem, seg_k, WINDOW,
                           WIN_LEFT, WIN_RIGHT, SEGMENTED)
        else:
            _consumer_task(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, kv_empty, q_ready,
                           q_empty, ds_bar, part_bar, dq_desc, dk_ptr, dv_ptr, ctx_ptr, part_off, b, hkv, n0, d, rank,
                           S, B, n_m, i_lo, timeout_ns, sm_scale, dq_full, dq_empty, ctl, g, k & 1, parts & 1,
                           HALF_INDEX, W, H, HKV, D, CAUSAL, ZIGZAG, CHUNK_ROWS, DETERMINISTIC, sent)
        if W > 1:
            parts += ((d > 0) & (sent > 0)).to(gl.int32)
        g += G * n_m
        k += 1
        mbarrier.wait(kv_bar, k & 1)
        t = _tile_word(task_smem, 0)
    if not DETERMINISTIC:  # (else the dQ writer's adds, which it counts)
        _reductions_done()
        cta_barrier()
        gl.atomic_add(ctl + CTL_BWD_DELTA, k, sem="release", scope="gpu")  # this consumer's dQ adds are in memory


@gluon.jit
def _step_added(turns, i, gi, n_m, i_lo, b, hkv, S, dq_empty0, dq_empty1, H: gl.constexpr, G: gl.constexpr,
                Q_ROWS: gl.constexpr):
    """The dQ writer, once task step i's adds (the program's step gi) completed: their counts released (the turns
    of later tickets' adds to those rows) and both consumers' buffers of the step freed."""
    cta_barrier()  # (the thread that waited for the adds before the one that counts them)
    for c in gl.static_range(2):
        gl.atomic_add(_turn_ptr(turns, i, n_m, i_lo, b, hkv, S, H, G, c, Q_ROWS), 1, sem="release", scope="gpu")
    mbarrier.arrive(dq_empty0.index(gi % 2), count=1)
    mbarrier.arrive(dq_empty1.index(gi % 2), count=1)


@gluon.jit
def _dq_writer(task_smem, kv_bar, kv_empty, dq_smem, dq_full0, dq_empty0, dq_full1, dq_empty1, dq_desc, turns, ctl,
               rank, S, B, n_dq, n_kv, n_part, timeout_ns, W: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr,
               D: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr):
    """DETERMINISTIC's dQ writer (one warp): the program's dK/dV tasks in the load warp's order, as the consumers
    (``_task_words``, published by ``kv_bar``; ``kv_empty`` once it read them), and of each step the two consumers'
    dQ halves (buffers ``dq_smem`` 2c + step % 2, handed over by ``dq_full`` c) added to the accumulator in their
    turn: the counter of the rows reached the turn (``_dq_turn``; bounded wait, acquire), a proxy fence, the TMA
    reduction. After a step's adds, the step before's are complete (``_previous_step_done``): their counts released
    and their buffers freed (``dq_empty`` c); a task's last step's after the task. Then the program's dQ adds are in
    memory and the writer counts its tasks, for both consumers, in CTL_BWD_DELTA (release)."""
    G: gl.constexpr = H // HKV
    Q_ROWS: gl.constexpr = dq_smem.shape[1]
    DQ_COLS: gl.constexpr = D // 2
    k = rank * 0  # tasks (kv_bar's phases)
    g = k  # their steps (the buffers' rounds)
    mbarrier.wait(kv_bar, 0)
    t = _tile_word(task_smem, 0, _WRITER_WARPS)
    while t < n_dq + n_kv:
        n_m = _tile_word(task_smem, 1, _WRITER_WARPS)
        i_lo = _tile_word(task_smem, 2, _WRITER_WARPS)
        release_bar(kv_empty)  # its words read: the load warp may write the next task's
        b, hkv, n0, d = _kv_task(t - n_dq, n_part, B, S, W, HKV, True)
        n_steps = G * n_m
        for i in range(n_steps):
            gi = g + i
            h, m0 = _work(i, n_m, i_lo, hkv, G, Q_ROWS)
            turn = _dq_turn(m0, n0 // _KV_ROWS, d, rank, S, W, CAUSAL, ZIGZAG, Q_ROWS)
            for c in gl.static_range(2):
                turn_ptr = _turn_ptr(turns, i, n_m, i_lo, b, hkv, S, H, G, c, Q_ROWS)
                if gl.atomic_add(turn_ptr, 0, sem="acquire", scope="gpu") < turn:  # (usually come: no poll)
                    if poll_ge(turn_ptr, turn, ctl, timeout_ns, False) == 0:
                        record_error(ctl, ERR_LOCAL_TIMEOUT, rank, d, m0 // Q_ROWS)
                _proxy_fence()  # the earlier adds, acquired above, before this one (the async proxy's)
                if c == 0:
                    mbarrier.wait(dq_full0.index(gi % 2), (gi // 2) & 1)
                else:
                    mbarrier.wait(dq_full1.index(gi % 2), (gi // 2) & 1)
                tma_add(dq_desc, [b * S + m0, h * D + c * DQ_COLS], dq_smem.index(2 * c + gi % 2))
            if i > 0:
                _previous_step_done()
                _step_added(turns, i - 1, gi - 1, n_m, i_lo, b, hkv, S, dq_empty0, dq_empty1, H, G, Q_ROWS)
        if n_steps > 0:
            _reductions_done()
            _step_added(turns, n_steps - 1, g + n_steps - 1, n_m, i_lo, b, hkv, S, dq_empty0, dq_empty1, H, G,
                        Q_ROWS)
        g += n_steps
        k += 1
        mbarrier.wait(kv_bar, k & 1)
        t = _tile_word(task_smem, 0, _WRITER_WARPS)
    cta_barrier()
    gl.atomic_add(ctl + CTL_BWD_DELTA, 2 * k, sem="release", scope="gpu")  # the program's dQ adds are in memory


@gluon.jit(do_not_specialize=["timeout_ns", "part_off"])
def ring_attn_bwd_gluon(
    # inputs
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, seg_ptr, ctx_ptr,
    # runtime scalars
    B, S, sm_scale, timeout_ns, part_off,
    # outputs (delta: float32 scratch, delta [B, H, S] then the dQ accumulator [B, S, H, D])
    dq_ptr, dk_ptr, dv_ptr, delta_ptr, status_ptr,
    # constexprs (the tl kernel's: ring_core.plans; those of masks and precision are not used here)
    W: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
    DQ_BLOCK_M: gl.constexpr, DQ_BLOCK_N: gl.constexpr, KV_BLOCK_N: gl.constexpr, KV_BLOCK_M: gl.constexpr,
    BLOCK_D: gl.constexpr, CHUNK_BLOCKS: gl.constexpr, PUSH_ROWS: gl.constexpr, SEG_BLOCKS: gl.constexpr,
    PUSH_VEC: gl.constexpr, PART_VEC: gl.constexpr, POLL_N: gl.constexpr,
    CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, INTERPRET: gl.constexpr, DOT_PRECISION: gl.constexpr,
    SIG_DTYPE: gl.constexpr, STICKY_ERRORS: gl.constexpr,
    WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr,
    KV_IDS: gl.constexpr, DETERMINISTIC: gl.constexpr,
):
    gl.static_assert(KV_BLOCK_N == _KV_ROWS and DQ_BLOCK_N == KV_BLOCK_M and DQ_BLOCK_M == _ROW_TASK and BLOCK_D == D,
                     "ring_core.plans: the Gluon backward's config")
    gl.static_assert(KV_BLOCK_M == 64 or KV_BLOCK_M == 128, "query rows per step: configs.GLUON_BWD_Q_ROWS")
    Q_ROWS: gl.constexpr = KV_BLOCK_M
    gl.static_assert(D == 64 or D == 128, "head_dim 64 or 128 (plans.gluon_bwd_applies)")
    MASKS: gl.constexpr = WINDOW or SEGMENTED
    gl.static_assert(not (MASKS and DETERMINISTIC), "with a window or segment ids: the tl kernel (gluon_bwd_applies)")
    CHUNK_ROWS: gl.constexpr = CHUNK_BLOCKS * _KV_ROWS
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # ---- the protocol's start: this rank's ring, the call check, a ticket, every push unit left ------------
    heap_bases, rank, ctl, flags, recv_addr, epoch = ring_context(ctx_ptr, W)
    recv, seg_recv = receive_slots(recv_addr, seg_ptr, rank, B, S, q_ptr, W, HKV, D, SEGMENTED)
    kseg_ptr = key_ids(seg_ptr, B, S, KV_IDS)  # the ids of the K/V this rank holds (segment ids only)
    n_chunks = gl.cdiv(S, CHUNK_ROWS)
    n_kvb = S // _KV_ROWS
    n_units = (W - 1) * B * HKV * n_chunks  # K/V push units; also the number of K/V flags
    rng = ranks_rng(flags, B, HKV, n_chunks, n_kvb, W)
    call_ok = start_call(ctl, heap_bases, rank, epoch, timeout_ns, seg_ptr, kseg_ptr, rng, B, S, sm_scale, n_chunks,
                         KIND_BWD, W, H, HKV, D, SIG_DTYPE, CAUSAL, ZIGZAG, CHUNK_ROWS, _KV_ROWS, WIN_LEFT, WIN_RIGHT,
                         SEGMENTED, False)
    tid = gl.atomic_add(ctl + CTL_BWD_TICKET, 1, sem="relaxed", scope="gpu")
    if W > 1:
        # Before anything of this program waits: ring_core.protocol.steps's no-deadlock argument.
        drain_pushes(ctl, n_units * call_ok, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch,
                     B, S, n_chunks, W, HKV, D, D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT,
                     WIN_RIGHT, SEGMENTED, rng, SEGMENTED)
    n_rows = gl.cdiv(S, _ROW_TASK)
    n_dq = B * H * n_rows  # delta tasks, and as many dQ tasks at the end
    n_part = (W - 1) * B * HKV * n_kvb
    n_kv = n_part + B * HKV * n_kvb  # dK/dV tasks: partial, then final
    dq_acc = delta_ptr + (rank * 0 + B).to(gl.int64) * H * S  # the float32 dQ accumulator [B, S, H, D]
    # With DETERMINISTIC, the adds made to each query block's dQ rows, per head and half of D (int32 [B, H, S // Q_ROWS,
    # 2], after the accumulator; zeroed by the delta tasks): ``dkdv_steps``. With KV_IDS (masks: never DETERMINISTIC)
    # the first B * S // 128 * 2 of those words hold the queries' id ranges (``_delta_task``).
    turns = (dq_acc + (rank * 0 + B).to(gl.int64) * S * H * D).to(gl.pointer_type(gl.int32), bitcast=True)

    # ---- every task's shared memory and barriers (one allocation for the kernel) ----------------------------
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    acc_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    (q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, part_bar, q_ready, q_empty,
     ds_bar) = bwd_slots(dtype, D, Q_ROWS, layout, acc_layout, 4 if DETERMINISTIC else 2)
    row_words: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    # The load warp's words of the task it loads (``_task_words``), published by ``kv_bar``; ``kv_empty``: both
    # consumers are done with the task's K and V and its words (and with DETERMINISTIC the dQ writer with its words).
    task_smem = gl.allocate_shared_memory(gl.int32, [4, 1], row_words)
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_empty, count=3 if DETERMINISTIC else 2)
    dq_full0, dq_empty0, dq_full1, dq_empty1 = _dq_bars(kv_empty, DETERMINISTIC)
    fence_async_shared()
    if MASKS:  # each slot's word (masked or not) and, with segment ids, its query rows' ids (``load_steps``)
        meta_smem = gl.allocate_shared_memory(gl.int32, [_STAGES, 1], row_words)
        ids_smem = gl.allocate_shared_memory(gl.int32, [_STAGES, Q_ROWS], row_words)

    # ---- the program's tasks, ticket after ticket (ring_core.protocol.steps: a task waits only for earlier tickets)
    # ----
    while tid < n_dq:
        _delta_task(tid, n_rows, o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_acc, turns, ctl, S, H, D, SEGMENTED,
                    DETERMINISTIC, seg_ptr, KV_IDS)
        tid = gl.atomic_add(ctl + CTL_BWD_TICKET, 1, sem="relaxed", scope="gpu")
    if tid < n_dq + n_kv:
        if poll_ge(ctl + CTL_BWD_DELTA, n_dq, ctl, timeout_ns, False) == 0:
            record_error(ctl, ERR_LOCAL_TIMEOUT, rank, 0, 0)
        _proxy_fence()  # the accumulator's zeros (ordinary stores) before the TMA reductions into it
        q_desc = tma.make_tensor_descriptor(q_ptr, [B * S, H * D], [H * D, 1], [Q_ROWS, D], layout)
        do_desc = tma.make_tensor_descriptor(do_ptr, [B * S, H * D], [H * D, 1], [Q_ROWS, D], layout)
        k_desc = tma.make_tensor_descriptor(k_ptr, [B * S, HKV * D], [HKV * D, 1], [_KV_ROWS, D], layout)
        v_desc = tma.make_tensor_descriptor(v_ptr, [B * S, HKV * D], [HKV * D, 1], [_KV_ROWS, D], layout)
        dq_desc = tma.make_tensor_descriptor(dq_acc, [B * S, H * D], [H * D, 1], [Q_ROWS, D // 2], acc_layout)
        if W > 1:
            r_desc = tma.make_tensor_descriptor(recv, [(W - 1) * 2 * B * HKV * S, D], [D, 1], [_KV_ROWS, D], layout)
        else:
            r_desc = k_desc  # never read: no partial task
        if not MASKS:  # (never read)
            meta_smem = task_smem
            ids_smem = task_smem
        if DETERMINISTIC:  # each consumer: all four dQ buffers (its two: ``dkdv_steps``)
            dq_bufs0 = dq_smem
            dq_bufs1 = dq_smem
        else:  # each consumer: its one
            dq_bufs0 = dq_smem.index(0)
            dq_bufs1 = dq_smem.index(1)
        # The partitions, the default first: DETERMINISTIC adds the dQ writer before the second consumer. One literal
        # list, indexed, as neither a partition function nor an argument tuple can be held in a variable of the kernel
        # (a tuple held in one turns its constexprs into tensors); its entries only name values (no code is emitted
        # however often the comprehension reads them).
        gl.warp_specialize([[
            (_consumer, (q_smem, do_smem, kv_smem, ds_smem, dq_bufs0, lse_smem, dl_smem, kv_bar, kv_empty, q_ready,
                         q_empty, ds_bar, part_bar, task_smem, dq_desc, dk_ptr, dv_ptr, ctx_ptr, part_off, kseg_ptr,
                         seg_recv, rank, S, B, n_dq, n_kv, n_part, timeout_ns, sm_scale, dq_full0, dq_empty0, ctl,
                         ids_smem, meta_smem, 0, W, H, HKV, D, CAUSAL, ZIGZAG, CHUNK_ROWS, DETERMINISTIC, WINDOW,
                         WIN_LEFT, WIN_RIGHT, SEGMENTED)),
            (_producer_tasks, (tid, n_dq, n_kv, n_part, call_ok, task_smem, kv_empty, q_desc, do_desc, k_desc, v_desc,
                               r_desc, q_smem, do_smem, kv_smem, lse_smem, dl_smem, kv_bar, q_ready, q_empty, lse_ptr,
                               delta_ptr, seg_ptr, rng, ids_smem, meta_smem, rank, B, S, flags, n_chunks, epoch, ctl,
                               timeout_ns, W, H, HKV, D, CAUSAL, ZIGZAG, CHUNK_ROWS, DETERMINISTIC, WINDOW, WIN_LEFT,
                               WIN_RIGHT, SEGMENTED, KV_IDS, turns)),
            (_dq_writer, (task_smem, kv_bar, kv_empty, dq_smem, dq_full0, dq_empty0, dq_full1, dq_empty1, dq_desc,
                          turns, ctl, rank, S, B, n_dq, n_kv, n_part, timeout_ns, W, H, HKV, D, CAUSAL, ZIGZAG)),
            (_consumer, (q_smem, do_smem, kv_smem, ds_smem, dq_bufs1, lse_smem, dl_smem, kv_bar, kv_empty, q_ready,
                         q_empty, ds_bar, part_bar, task_smem, dq_desc, dk_ptr, dv_ptr, ctx_ptr, part_off, kseg_ptr,
                         seg_recv, rank, S, B, n_dq, n_kv, n_part, timeout_ns, sm_scale, dq_full1, dq_empty1, ctl,
                         ids_smem, meta_smem, 1, W, H, HKV, D, CAUSAL, ZIGZAG, CHUNK_ROWS, DETERMINISTIC, WINDOW,
                         WIN_LEFT, WIN_RIGHT, SEGMENTED)),
        ][i] for i in ((0, 1, 2, 3) if DETERMINISTIC else (0, 1, 3))],
            [_LOAD_WARPS, _WRITER_WARPS, _CONSUMER_WARPS] if DETERMINISTIC else [_LOAD_WARPS, _CONSUMER_WARPS],
            [_LOAD_REGS, _WRITER_REGS, _CONSUMER_REGS] if DETERMINISTIC else [_LOAD_REGS, _CONSUMER_REGS])
        _free_dq_bars(dq_full0, dq_empty0, dq_full1, dq_empty1, DETERMINISTIC)
        tid = _tile_word(task_smem, 0)  # the ticket the load warp took after its last dK/dV task
    while tid < n_dq + n_kv + n_dq:
        _dq_task(tid - n_dq - n_kv, n_rows, n_dq + 2 * n_kv, call_ok, dq_ptr, dq_acc, sm_scale, rank, ctl, timeout_ns,
                 S, H, D)
        tid = gl.atomic_add(ctl + CTL_BWD_TICKET, 1, sem="relaxed", scope="gpu")
    free_bwd_slots(kv_bar, part_bar, q_ready, q_empty, ds_bar)
    mbarrier.invalidate(kv_empty)
    # ---- the protocol's end: end barrier, status, counters (the last program of this rank) -----------------
    end_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W, False, STICKY_ERRORS, True)
