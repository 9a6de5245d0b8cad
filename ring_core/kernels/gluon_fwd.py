"""The fused ring-attention forward for Hopper, in Gluon: the same protocol as ring_core.kernels.tl_fwd, with
FlashAttention-3's explicit partitions for the attention math.

Why a second kernel source: Triton's automatic warp specialisation takes only one flat loop per program, with no
``while`` anywhere in the kernel (docs/performance.md), which the ring protocol's waits and pushes cannot meet;
Gluon's explicit partitions can (the loop alone measured 0.97-1.04x cuDNN at world size 1 and the ring steps' waits
as free: docs/performance.md). The tl kernel (ring_core.kernels.tl_fwd) stays the kernel of the
interpreter, of other GPUs, of fp32, of D other than 64, 128 and 256, and the parity reference of this one
(tests/gpu/gpu_checks.py compares both against float64). ``ring_core.plans`` picks this kernel where it applies
(``KernelConfig.get_default``, ``plans.gluon_applies``).

The protocol is not copied: every protocol step below is a call of ring_core.protocol.steps's own ``triton.language``
helpers, which compile under Gluon (their index vectors come from ring_core.protocol.lanes): the call check
(``start_call``), the pushes (``drain_pushes``), the bounded waits (``poll_ge``, ``record_error``) and the end
of the call (``end_call``: end barrier, status words, counters). The no-deadlock argument of ring_core.protocol.steps
holds as it is: the programs that push (``is_pusher``: the first quarter of the grid to arrive) drain the push
counter before anything of them waits (here: before the partitions start), and every program waits only for
flags that pushes set.

Persistent: a program per SM (``ring_core.plans.plan``'s grid), each taking tiles of (batch, head, BLOCK_M query rows)
from the call's tile counter (CTL_FWD_TILE) in the tl kernel's order (ring_core.kernels.tiles.query_tile: the programs
running at once share K/V in L2, the heaviest tiles go first; a static round-robin lost 8-15 % on causal rows,
one H200), so that what a program pays however few blocks its tile has (the call check, the descriptors, the
barriers, the end count: about 11 us) is paid once per SM, and a tile's first loads overlap the last tile's end. The
pushes never depend on how many programs are resident (ranks sharing a GPU under MPS run fewer at once than the grid
holds): the pushers are the first programs to arrive, and each pushes every unit left before anything of it waits, while
the other three quarters start on their tiles, whose ring step 0 (local K/V) needs no push; the units go kv head by kv
head, the order the tiles take (until 2026-12-04 every program pushed before its first tile, so no compute overlapped
the pushes). The last program done resets the counters for the next call. The tiles depend on head_dim, set in one place
(``ring_core.kernels.configs.GLUON_TILES``, passed as BLOCK_M / BLOCK_N, the slots read by ``kv_slots`` and
``kv_rings``): 128 query rows, K/V blocks of 128 rows in 3 slots at D64 / D128, of 64 rows in 2 slots at D256, there
with K and V in rings of their own (shared memory: Q and the slots 224 KiB at D128, 192 KiB at D256).
* Prologue (the kernel's 4 warps), once per program: ring context, call check, push every unclaimed unit
  (``drain_pushes``), TMA descriptors made on the device (global scratch: the launchers pass it), shared memory for
  Q (a half per consumer, ``q_halves``) and ``STAGES`` K/V slots with their mbarriers.
* The **load partition** (one warp), tile after tile: the tile's first K/V block, then each half of its Q once that
  half's consumer has freed it, then the rest of its blocks, every ring step's in order, each through TMA into a
  slot (the slots' rounds go on from tile to tile). Step 0 reads the local K/V; step t >= 1 reads the receive slot
  of rank ``rank - t``, each chunk after a bounded acquire of its flag (``poll_ge``; a wait that gives up records
  ERR_KV_TIMEOUT and the loads go on, so the consumers never stall) and a generic-to-async proxy fence (the flag is
  acquired by ordinary loads, the chunk read by TMA: PTX ISA, memory consistency model, proxies). The blocks a tile
  visits per step are the tl kernel's (``protocol.block_range``: every block below the causal frontier whole, the
  frontier's masked, the hidden ones neither waited for nor loaded).
* Two **consumer partitions** (one warpgroup each, 64 query rows apiece), tile after tile: FlashAttention-3's
  pipelined online softmax (S of block j and P V of block j-1 in flight together), each releasing the slots on its
  own. They follow the producer's block order with scalar bookkeeping (``_next_block``), which gives each block's
  causal mask as one number: query minus key position at the tile's first row and the block's first key (positions
  are contiguous within a tile and a block: ``plans.gluon_applies`` asks S % 128 == 0, zigzag S % 256 == 0, so that
  each half of a zigzag shard holds whole tiles and whole blocks). With 64-row blocks (D256) the first consumer sees
  nothing of the diagonal's last block (its mask drops every column: m and l stay as they were). Each frees its
  half of Q's buffer for the next tile's Q (``q_empty``) as soon as the tile's last S = Q K^T is done, and at the
  end of the tile stores its rows of O / l and their lse straight from registers to global memory, or NaN rows if
  the call check failed or any wait of this rank gave up (the error record: a superset of the tl kernel's per-tile
  NaN rows; the call's status raises either way).
* Epilogue: ``end_call``.

Windows and segment ids (constexprs WINDOW, SEGMENTED; KV_IDS: the keys' ids are not the queries', as in the tl
kernel, ``protocol.key_ids``): the blocks come from the tl kernel's rules
(``protocol.step_blocks``: positions, windows included) narrowed by the id ranges every rank publishes per chunk
with the call check (chunks of one block with segment ids: ``plans.KernelConfig``), which say whether a block can
hold a pair the tile attends and whether it needs masks (``protocol.block_met``; unmasked: every query sees every
key by position and the tile's rows and the block's all carry one id). A fourth partition, the **planner** (one
warp, ``_planner``), takes the tiles from the counter in the load partition's stead and works out each tile's plan
ahead of it (``_tile_plan``: the tile's ids, each ring step's run of blocks, ``make_plan``, and their count) into
one of two slots of shared-memory words, each published by a barrier and given back by the load partition once that
tile's loads are issued (a segmented tile cost about 6 us of an SM more than a dense one, the plan at its start on
the load warp about 1.3 us of that, one H200). The load partition (``_producer_planned``)
counts the blocks for the consumers (in a word per half, published with Q), then (``_tile_loads_masked``) walks the
runs, skips a block no query of the tile attends (not sent, not waited for, not loaded: only blocks sent whole are
read, as TMA reads whole blocks) and passes each block's word (ring step, block, masked) to the consumers through a
word per slot; the consumers apply the one mask rule (``protocol.pairs_allowed``, on ids keyed once per row and
column) to masked blocks. The ids come through shared memory, as the backward's do: the load partition writes a
masked block's keyed ids beside its slot and the tile's with its Q, and the consumers read them while S = Q K^T runs
(loaded from global memory in the consumers' loop they came in waves, each waiting out the load's latency); the
ids of a block of a later ring step are read after its chunk's acquire. The planner waits only for its two slots,
which the load partition frees without waiting for anything of the planner's but the words themselves, so the
partitions' waits stay acyclic and the no-deadlock argument above is unchanged (the planner reads only the ids and
the published ranges, which the call check acquired before the partitions start). A tile of padding rows has no
block (out 0, lse -inf). Without them the kernel is the one above (three partitions, the same binary as before).
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ring_core import settings
from ring_core.kernels import configs
from ring_core.protocol import control
from ring_core.protocol.lanes import iota
from ring_core.protocol.steps import (BIG_ID, CTL_ERROR, CTL_PUSHERS, KEY_PAD, QUERY_PAD, block_met, block_range,
                                      chunk_ranges, drain_pushes, end_call, ids_summary, is_pusher, key_ids, met_blocks,
                                      pairs_allowed, positions, ranges_of, ranks_rng, receive_slots, ring_context,
                                      segment_keys, start_call, step_blocks)
from ring_core.kernels.gluon_parts import (_WORD_LAYOUT_1, _WORD_LAYOUT_4, _acquire_chunk, _put, _tile_word, release,
                                           release_bar, tma_load)
from ring_core.kernels.tiles import query_tile


# The tiles (query rows per tile, K/V rows per block, K/V slots) depend on head_dim:
# ring_core.kernels.configs.GLUON_TILES,
# which the plans pass as BLOCK_M / BLOCK_N and the kernel reads for its slots (``kv_slots``).
CONSUMER_WARPS = 4  # a consumer partition: one warpgroup on 64 rows; also the prologue's (num_warps)
LOAD_WARPS, LOAD_REGS, CONSUMER_REGS = 1, 24, 232
# As the kernel reads them (a @gluon.jit function reads constexpr globals only).
_CONSUMER_WARPS = gl.constexpr(CONSUMER_WARPS)
_LOAD_WARPS = gl.constexpr(LOAD_WARPS)
_LOAD_REGS, _CONSUMER_REGS = gl.constexpr(LOAD_REGS), gl.constexpr(CONSUMER_REGS)
CTL_FWD_TILE = gl.constexpr(control.CTL_FWD_TILE)
CTL_FWD_DONE = gl.constexpr(control.CTL_FWD_DONE)
_UNMASKED = gl.constexpr(1 << 30)  # the mask number of a block every query of the tile sees whole
# FlashAttention-3's ping-pong: the two consumer warpgroups take turns issuing their MMAs (a pair of mbarriers passes
# the turn), so that one's softmax runs while the other's MMAs hold the tensor cores. Read at import (a constexpr
# global: part of the kernel's cache key); RING_ATTENTION_GLUON_PINGPONG=1 turns it on, for A/B runs.
PINGPONG_ENV = settings.GLUON_PINGPONG
_PINGPONG = gl.constexpr(settings.gluon_pingpong())
# A diagnostic timeline of the persistent forward (world size 1 only; benchmarks/timeline.py reads it): with
# RING_ATTENTION_GLUON_TIMELINE=1 at import, each partition writes %clock64 stamps at its events of each tile into
# int64 words [program][tile][event] (TIMELINE_TILES tiles a program, the last one's words shared by any after it)
# at the start of the receive region, which no ring step uses at world size 1. Off (the default), no code: the
# binaries are those without it (a constexpr global: part of the kernel's cache key).
TIMELINE_ENV = settings.GLUON_TIMELINE
_TIMELINE = gl.constexpr(settings.gluon_timeline())
TIMELINE_TILES, TIMELINE_EVENTS = 64, 20
_TL_TILES, _TL_EVENTS = gl.constexpr(TIMELINE_TILES), gl.constexpr(TIMELINE_EVENTS)
# Events (a tile's words; consumer c's three at 3 c + 0, 1, 2): its Q landed and its tile known, its blocks done (the
# last P V waited for), its rows stored; the load warp's tile known, its loads issued; the planner's start of the
# tile's plan, the plan published; the tile's index and (consumer 0) its block count as values; the program's start
# and end (tile 0's words); consumer 0's epilogue split: the error record back (the clock read after it), its rows
# of O issued; and in %globaltimer nanoseconds, comparable between SMs (tile 0's words): the program's entry, its call
# check done, its partitions joined, its exit.
TIMELINE_EVENT = dict(q=0, done=1, stored=2, load_tile=6, load_issued=7, plan_start=8, plan_published=9, tile=10,
                      blocks=11, program_start=12, program_end=13, err_back=14, out_issued=15, entry_ns=16,
                      checked_ns=17, joined_ns=18, exit_ns=19)
TL_Q, TL_DONE, TL_STORED, TL_LOAD_TILE, TL_LOAD_ISSUED, TL_PLAN_START, TL_PLAN_PUBLISHED, TL_TILE, TL_BLOCKS, \
    TL_PROGRAM_START, TL_PROGRAM_END, TL_ERR_BACK, TL_OUT_ISSUED, TL_ENTRY_NS, TL_CHECKED_NS, TL_JOINED_NS, \
    TL_EXIT_NS = (gl.constexpr(v) for v in TIMELINE_EVENT.values())


# ring_core.kernels.configs.GLUON_TILES as a constexpr global: read by name in ``kv_slots`` / ``kv_rings``, its value is
# part of the kernel's cache key (Triton hashes the constexpr globals a jit function and its callees read), so a binary
# compiled for other tiles is never taken from the cache.
_TILES = gl.constexpr(configs.GLUON_TILES)


@triton.constexpr_function
def kv_slots(head_dim, block_m, block_n):
    """The K/V slots of the tiles at ``head_dim`` (ring_core.kernels.configs.GLUON_TILES), whose query and K/V block
    rows the plans pass (``block_m``, ``block_n``: checked against the table here)."""
    tile_m, tile_n, slots, _ = _TILES.value[head_dim]
    assert (block_m, block_n) == (tile_m, tile_n), f"ring_core.plans: the Gluon tiles at head_dim {head_dim}"
    return slots


@triton.constexpr_function
def kv_rings(head_dim):
    """1: a K/V block's K and V share a slot and its barriers; 2: K and V have rings of their own (the slots'
    barriers ``[RINGS * STAGES]``: V's from ``STAGES`` on), at ``head_dim`` (ring_core.kernels.configs.GLUON_TILES)."""
    return _TILES.value[head_dim][3]


@gluon.jit
def slots(dtype: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, layout: gl.constexpr,
          STAGES: gl.constexpr, RELEASERS: gl.constexpr, RINGS: gl.constexpr):
    """Shared memory for Q (``BLOCK_M`` rows of D) and its mbarrier ``q_bar`` (Q landed), and ``kv_slots_smem``'s
    K/V slots, one tile per program. The consumers and the load
    partitions read the tiles and the rings back from these buffers' shapes."""
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, v_smem, kv_ready, kv_empty = kv_slots_smem(dtype, BLOCK_N, D, layout, STAGES, RELEASERS, RINGS)
    return q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty


@gluon.jit
def kv_slots_smem(dtype: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, layout: gl.constexpr,
                  STAGES: gl.constexpr, RELEASERS: gl.constexpr, RINGS: gl.constexpr):
    """``STAGES`` K/V slots (``BLOCK_N`` rows of D each) and their mbarriers, initialised: ``kv_ready`` (a slot's
    bytes landed), ``kv_empty`` (a slot freed by its ``RELEASERS`` consumer partitions); ``RINGS`` 2: K and V in rings
    of their own, each slot's V with the barriers ``STAGES`` on (``kv_rings``)."""
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RINGS * STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=RELEASERS)
    fence_async_shared()  # the barriers' initialisation before the async proxy (TMA) uses them
    return k_smem, v_smem, kv_ready, kv_empty


@gluon.jit
def q_halves(dtype: gl.constexpr, HALF: gl.constexpr, D: gl.constexpr, layout: gl.constexpr):
    """The persistent kernel's Q buffer, a half of the tile's rows per consumer partition (``HALF`` rows of D
    each), with a pair of mbarriers per half: ``q_ready`` (the half landed), ``q_empty`` (its consumer is done with
    it: the tile's last S = Q K^T done)."""
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, D], layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    return q_smem, q_ready, q_empty


@gluon.jit
def free_slots(q_bar, kv_ready, kv_empty, STAGES: gl.constexpr):
    """``slots``' mbarriers invalidated, once every partition is done with them (``STAGES``: RINGS * STAGES)."""
    mbarrier.invalidate(q_bar)
    free_slots_kv(kv_ready, kv_empty, STAGES)


@gluon.jit
def free_slots_kv(kv_ready, kv_empty, STAGES: gl.constexpr):
    """``kv_slots_smem``'s mbarriers invalidated (``STAGES``: RINGS * STAGES)."""
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))


@gluon.jit
def free_q_halves(q_ready, q_empty):
    """``q_halves``' mbarriers invalidated, once every partition is done with them."""
    for i in gl.static_range(2):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(q_empty.index(i))


@gluon.jit
def _load_q(q_desc, q_smem, q_ready, q_empty, tword, row, col, i, tile, n_blocks, qids=None, seg_q=None):
    """The load partition: the program's ``i``-th tile's Q (tile ``tile``, rows from ``row``), each half once its
    consumer is done with the last tile's (its last S done), after the tile and its block count (masks only) in the
    half's words ``tword``, which the half's barrier publishes (the consumers' loop needs both). With segment ids
    (``seg_q``: the tile's, else None) the half's rows' ids too, keyed (``segment_keys``), into ``qids`` (a row a
    half), loaded before the waits (the consumers read their half's once, at the tile's start)."""
    HALF: gl.constexpr = q_smem.shape[1]
    if seg_q is not None:
        ids_layout: gl.constexpr = gl.BlockedLayout([HALF // 32], [32], [1], [0])
        ids0 = segment_keys(gl.load(seg_q + gl.arange(0, HALF, layout=ids_layout)), QUERY_PAD)
        ids1 = segment_keys(gl.load(seg_q + HALF + gl.arange(0, HALF, layout=ids_layout)), QUERY_PAD)
    for half in gl.static_range(2):
        mbarrier.wait(q_empty.index(half), (i & 1) ^ 1)
        _put(tword, 2 * half, tile)
        _put(tword, 2 * half + 1, n_blocks)
        if seg_q is not None:
            qids.index(half).store(ids0 if half == 0 else ids1)
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
        tma_load(q_desc, [row + half * HALF, col], q_ready.index(half), q_smem.index(half))


@gluon.jit
def _no_more_tiles(q_ready, q_empty, tword, i):
    """The load partition, after the program's ``i`` tiles: tile -1 to each consumer, once it is done with the last
    (published by the half's barrier, with no bytes to wait for)."""
    for half in gl.static_range(2):
        mbarrier.wait(q_empty.index(half), (i & 1) ^ 1)
        _put(tword, 2 * half, -1)
        mbarrier.arrive(q_ready.index(half), count=1)


@gluon.jit
def _stamp(tln, i, e: gl.constexpr, value=None, after=None, NS: gl.constexpr = False):
    """The timeline (``_TIMELINE``): the program's ``i``-th tile's word ``e``, the SM's clock (read once the int32
    scalar ``after`` is there, if given; ``NS``: %globaltimer), or ``value``."""
    if _TIMELINE:
        if value is None:
            if NS:
                value = _now_ns()
            elif after is None:
                value = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64,
                                                  is_pure=False, pack=1)
            else:
                value = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [after], dtype=gl.int64,
                                                  is_pure=False, pack=1)
        gl.store(tln + (gl.program_id(0) * _TL_TILES + gl.minimum(i, _TL_TILES - 1)) * _TL_EVENTS + e,
                 value.to(gl.int64))


@gluon.jit
def _now_ns():
    """The timeline's %globaltimer (nanoseconds, the same clock on every SM), or 0 without the timeline."""
    if _TIMELINE:
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)
    else:
        return 0


@gluon.jit
def _producer(q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, meta,
              tword, rank, B, S, seg_ptr, flags, n_chunks, epoch, ctl, tln, timeout_ns, rng, H: gl.constexpr,
              W: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, CHUNK_BLOCKS: gl.constexpr, CAUSAL: gl.constexpr,
              ZIGZAG: gl.constexpr, WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
              SEGMENTED: gl.constexpr):
    """The load partition without masks (with them: ``_producer_planned``): the program's tiles one after another, each
    one's Q and blocks (``_tile_loads``; the slots' rounds go on from tile to tile), then tile -1 to the consumers.
    Every tile is taken from the call's tile counter (CTL_FWD_TILE; the next one fetched while the tile before is
    loaded), so the tiles start in ring_core.kernels.tiles.query_tile's order, as a program per tile would: the programs
    running at once share K/V in L2, the heaviest tiles go first, and where fewer programs are resident than launched
    (ranks sharing a GPU under MPS) none of them keeps a tile of its own for when it starts."""
    BLOCK_M: gl.constexpr = 2 * q_smem.shape[1]
    n_tiles = B * H * (S // BLOCK_M)
    tile = gl.atomic_add(ctl + CTL_FWD_TILE, 1, sem="relaxed", scope="gpu")
    j = tile * 0
    i = j
    while tile < n_tiles:
        nxt = gl.atomic_add(ctl + CTL_FWD_TILE, 1, sem="relaxed", scope="gpu")
        b, h, hkv, m_blk = query_tile(tile, H // HKV, S // BLOCK_M, HKV, CAUSAL)
        q0 = m_blk * BLOCK_M
        q_pos_min = positions(q0, rank, S, W, ZIGZAG)
        q_pos_max = positions(q0 + BLOCK_M - 1, rank, S, W, ZIGZAG)
        gl.static_assert(not (WINDOW or SEGMENTED), "with masks the load partition is _producer_planned")
        _stamp(tln, i, TL_LOAD_TILE)
        _stamp(tln, i, TL_TILE, tile)
        j = _tile_loads(q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready,
                        kv_empty, tword, tile, b, h, hkv, q0, q_pos_min, q_pos_max, i, j, rank, B, S, flags,
                        n_chunks, epoch, ctl, timeout_ns, W, HKV, D, CHUNK_BLOCKS, CAUSAL, ZIGZAG)
        _stamp(tln, i, TL_LOAD_ISSUED)
        i += 1
        tile = nxt
    _no_more_tiles(q_ready, q_empty, tword, i)


@gluon.jit
def _tile_loads(q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, tword,
                tile, b, h, hkv, q0, q_pos_min, q_pos_max, i, j, rank, B, S, flags, n_chunks, epoch, ctl, timeout_ns,
                W: gl.constexpr,
                HKV: gl.constexpr, D: gl.constexpr, CHUNK_BLOCKS: gl.constexpr, CAUSAL: gl.constexpr,
                ZIGZAG: gl.constexpr):
    """One tile's loads (tile ``tile``, the program's ``i``-th; ``j``: the slots' count of blocks so far, returned
    with this tile's added): every ring step's blocks (see the module docstring), Q after the first (which may fill
    a slot while the consumers finish the last tile); K and V in rings of their own (RINGS 2): a block's K, then its
    V once its V slot is free."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    j_first = j
    for step in gl.static_range(W):
        src = (rank - step + W) % W
        _, n_hi, _ = block_range(q_pos_min, q_pos_max, src, S, W, BLOCK_N, CAUSAL, ZIGZAG)
        flag0 = flags + (((step - 1) * B + b) * HKV + hkv) * n_chunks
        k_row = (((step - 1) * 2 * B + b) * HKV + hkv) * S  # step >= 1: K rows in the receive slot; V B*HKV*S on
        for jb in range(0, n_hi):
            if step > 0:
                if jb % CHUNK_BLOCKS == 0:
                    _acquire_chunk(flag0 + jb // CHUNK_BLOCKS, epoch, ctl, timeout_ns, src, step, jb // CHUNK_BLOCKS)
            s = j % STAGES
            # Round r of a slot waits for the consumers' release of round r - 1 (a fresh barrier passes round 0).
            mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
            _load_block(k_desc, v_desc, r_desc, k_smem, v_smem, kv_ready, kv_empty, s, j // STAGES, step, b, hkv, jb,
                        k_row, B, S, HKV, D)
            if j == j_first:
                _load_q(q_desc, q_smem, q_ready, q_empty, tword, b * S + q0, h * D, i, tile, j_first * 0)
            j += 1
    return j


@gluon.jit
def _tile_plan(tile, rank, B, S, seg_ptr, n_chunks, rng, H: gl.constexpr, W: gl.constexpr, HKV: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK_ROWS: gl.constexpr, CAUSAL: gl.constexpr,
               ZIGZAG: gl.constexpr, WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
               SEGMENTED: gl.constexpr):
    """With a window or segment ids, a tile's plan (the planner partition, ``_planner``): its ids' summary (s_hi, t_id
    and the two parts [a_lo, a_hi], [b_lo, b_hi]) and ``make_plan``'s runs and count of blocks loaded."""
    b, h, hkv, m_blk = query_tile(tile, H // HKV, S // BLOCK_M, HKV, CAUSAL)
    q0 = m_blk * BLOCK_M
    q_pos_min = positions(q0, rank, S, W, ZIGZAG)
    q_pos_max = positions(q0 + BLOCK_M - 1, rank, S, W, ZIGZAG)
    s_hi = q0 * 0
    t_id = s_hi
    a_lo, a_hi, b_lo, b_hi = s_hi, s_hi, s_hi, s_hi
    if SEGMENTED:  # the tile's ids (protocol.tile_ids)
        rows_q = q0 + iota(BLOCK_M)
        s_lo, s_hi, t_id = ids_summary(gl.load(seg_ptr + b.to(gl.int64) * S + rows_q), rows_q < S)
        # protocol.tile_id_parts without its reductions: a tile lies in one half of the shard
        # (plans.gluon_applies), so its ids are that half's part and the other part is empty.
        a_lo, a_hi, b_lo, b_hi = s_lo, s_hi, s_lo * 0 + BIG_ID, s_hi * 0 - 1
        if ZIGZAG:
            if q0 >= S // 2:
                a_lo, a_hi, b_lo, b_hi = b_lo, b_hi, a_lo, a_hi
    plan, n_blocks = make_plan(q0, q_pos_min, q_pos_max, s_hi, rank, S, rng, b, B, n_chunks, a_lo, a_hi, b_lo, b_hi, W,
                               BLOCK_M, BLOCK_N, CHUNK_ROWS, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
    return s_hi, t_id, a_lo, a_hi, b_lo, b_hi, plan, n_blocks


# The planner's words of a tile (``_planner`` -> ``_producer_planned``), in one of two slots of plan_words(W) words:
# the tile (-1: no more), its block count, s_hi, t_id, a_lo, a_hi, b_lo, b_hi, then each ring step's [first, end).
_P_TILE, _P_N, _P_SHI, _P_TID = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)
_P_ALO, _P_AHI, _P_BLO, _P_BHI = gl.constexpr(4), gl.constexpr(5), gl.constexpr(6), gl.constexpr(7)
_P_RUNS = gl.constexpr(8)


@triton.constexpr_function
def plan_words(W):
    return 8 + 2 * W  # _P_RUNS + 2 W


@gluon.jit
def _planner(pwords, p_full, p_empty, rank, B, S, seg_ptr, n_chunks, ctl, tln, rng, H: gl.constexpr,
             W: gl.constexpr, HKV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK_ROWS: gl.constexpr,
             CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr,
             WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr):
    """With a window or segment ids, the planner partition (one warp): the program's tiles from the call's tile counter,
    as ``_producer`` takes them without masks, each one's plan (``_tile_plan``: global loads of the tile's ids and of
    the chunks' published ranges, a scan of the blocks by position) worked out ahead of the load warp into one of two
    slots of words (``pwords``, plan_words(W) each), each slot published by its ``p_full`` barrier and given back by the
    load warp's ``p_empty`` once that tile's loads are issued, a tile taken from the counter only once its slot is free
    (taken earlier, the program would hold tiles that an idle program could run at the call's end); then tile -1. The
    load warp's own path is then each block's test and loads only (the plan on it had cost about 1.3 us of an SM a tile:
    packed documents, one H200). It waits only for its slots (freed by the load warp, which waits for
    nothing of it but these words), so the partitions' waits stay acyclic."""
    PW: gl.constexpr = plan_words(W)
    n_tiles = B * H * (S // BLOCK_M)
    k = rank * 0
    mbarrier.wait(p_empty.index(0), 1)  # (a fresh barrier passes round 0)
    tile = gl.atomic_add(ctl + CTL_FWD_TILE, 1, sem="relaxed", scope="gpu")
    while tile < n_tiles:
        _stamp(tln, k, TL_PLAN_START)
        s_hi, t_id, a_lo, a_hi, b_lo, b_hi, plan, n_blocks = _tile_plan(
            tile, rank, B, S, seg_ptr, n_chunks, rng, H, W, HKV, BLOCK_M, BLOCK_N, CHUNK_ROWS, CAUSAL, ZIGZAG, WINDOW,
            WIN_LEFT, WIN_RIGHT, SEGMENTED)
        slot = k % 2
        base = slot * PW
        _put(pwords, base + _P_TILE, tile)
        _put(pwords, base + _P_N, n_blocks)
        _put(pwords, base + _P_SHI, s_hi)
        _put(pwords, base + _P_TID, t_id)
        _put(pwords, base + _P_ALO, a_lo)
        _put(pwords, base + _P_AHI, a_hi)
        _put(pwords, base + _P_BLO, b_lo)
        _put(pwords, base + _P_BHI, b_hi)
        for step in gl.static_range(W):
            first, end = plan_at(plan, step)
            _put(pwords, base + _P_RUNS + 2 * step, first)
            _put(pwords, base + _P_RUNS + 2 * step + 1, end)
        mbarrier.arrive(p_full.index(slot), count=1)
        _stamp(tln, k, TL_PLAN_PUBLISHED)
        k += 1
        mbarrier.wait(p_empty.index(k % 2), ((k // 2) & 1) ^ 1)  # a fresh barrier passes round 0
        tile = gl.atomic_add(ctl + CTL_FWD_TILE, 1, sem="relaxed", scope="gpu")
    slot = k % 2  # (its slot free: waited for above)
    _put(pwords, slot * PW + _P_TILE, -1)
    mbarrier.arrive(p_full.index(slot), count=1)


@gluon.jit
def _producer_planned(q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                      meta, tword, pwords, p_full, p_empty, qids, kids, rank, B, S, seg_ptr, seg_recv, flags, n_chunks,
                      epoch, ctl, tln, timeout_ns, rng, H: gl.constexpr, W: gl.constexpr, HKV: gl.constexpr,
                      D: gl.constexpr, CHUNK_BLOCKS: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr,
                      WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr,
                      KV_IDS: gl.constexpr):
    """``_producer`` with a window or segment ids: the tiles and their plans as the planner partition publishes them
    (``_planner``; tile -1: no more), each one's Q and blocks (``_tile_loads_masked``; with segment ids the tile's and
    the masked blocks' ids into ``qids`` / ``kids``), its slot of words given back once they are issued; then tile -1
    to the consumers."""
    BLOCK_M: gl.constexpr = 2 * q_smem.shape[1]
    PW: gl.constexpr = plan_words(W)
    k = rank * 0
    j = k
    mbarrier.wait(p_full.index(0), 0)
    tile = _tile_word(pwords, _P_TILE, 1)
    while tile >= 0:
        slot = k % 2
        b, h, hkv, m_blk = query_tile(tile, H // HKV, S // BLOCK_M, HKV, CAUSAL)
        q0 = m_blk * BLOCK_M
        q_pos_min = positions(q0, rank, S, W, ZIGZAG)
        q_pos_max = positions(q0 + BLOCK_M - 1, rank, S, W, ZIGZAG)
        _stamp(tln, k, TL_LOAD_TILE)
        _stamp(tln, k, TL_TILE, tile)
        j = _tile_loads_masked(q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready,
                               kv_empty, meta, tword, pwords, slot * PW, qids, kids, tile, b, h, hkv, q0, q_pos_min,
                               q_pos_max, k, j, rank, B, S, seg_ptr, seg_recv, flags, n_chunks, epoch, ctl, timeout_ns,
                               rng, W, HKV, D, CHUNK_BLOCKS, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED,
                               KV_IDS)
        release_bar(p_empty.index(slot))  # every word of the slot read
        _stamp(tln, k, TL_LOAD_ISSUED)
        k += 1
        mbarrier.wait(p_full.index(k % 2), (k // 2) & 1)
        tile = _tile_word(pwords, (k % 2) * PW + _P_TILE, 1)
    _no_more_tiles(q_ready, q_empty, tword, k)


@gluon.jit
def _tile_loads_masked(q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                       meta, tword, pwords, pbase, qids, kids, tile, b, h, hkv, q0, q_pos_min, q_pos_max, i, j, rank, B,
                       S, seg_ptr, seg_recv, flags, n_chunks, epoch, ctl, timeout_ns, rng, W: gl.constexpr,
                       HKV: gl.constexpr, D: gl.constexpr, CHUNK_BLOCKS: gl.constexpr, CAUSAL: gl.constexpr,
                       ZIGZAG: gl.constexpr, WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
                       SEGMENTED: gl.constexpr, KV_IDS: gl.constexpr):
    """``_tile_loads`` with a window or segment ids: the tile's plan as the planner worked it out (its words from
    ``pbase`` in ``pwords``: ``_tile_plan``, each ring step's run [first, end) and the count of blocks loaded, which
    goes to the consumers with Q), then the blocks the plan holds, each tested again (``block_met``: a block no query
    of the tile may attend is neither waited for nor loaded; its chunk may not have been sent), and for each block
    loaded its word in ``meta`` (``block_word``) before the slot's barrier: which step and block, and whether it
    needs masks (not when every query of the tile sees every key by position and, with segment ids, the tile's rows
    and the block's all carry one id: the chunk's published range is [t, t], padding counted). With segment ids, the
    tile's ids go with its Q (``_load_q``) and a masked block's ids, keyed (``segment_keys``), into the slot's row of
    ``kids`` before the slot's barrier: the consumers read them from shared memory (global loads in their loop came
    in waves, each waiting out the load's latency, one H200). A tile with no block (padding
    rows) gets Q alone."""
    BLOCK_M: gl.constexpr = 2 * q_smem.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    CHUNK_ROWS: gl.constexpr = CHUNK_BLOCKS * BLOCK_N
    n_blocks = _tile_word(pwords, pbase + _P_N, 1)
    s_hi = _tile_word(pwords, pbase + _P_SHI, 1)
    t_id = _tile_word(pwords, pbase + _P_TID, 1)
    a_lo = _tile_word(pwords, pbase + _P_ALO, 1)
    a_hi = _tile_word(pwords, pbase + _P_AHI, 1)
    b_lo = _tile_word(pwords, pbase + _P_BLO, 1)
    b_hi = _tile_word(pwords, pbase + _P_BHI, 1)
    j_first = j
    for step in gl.static_range(W):
        src = (rank - step + W) % W
        _, nf_lo, nf_hi, _, lo1, hi1, lo2, hi2, _ = step_blocks(q0, q0 + BLOCK_M, q_pos_min, q_pos_max, s_hi, rank,
                                                                src, S, W, BLOCK_N, ZIGZAG, CAUSAL, WINDOW,
                                                                WIN_LEFT, WIN_RIGHT, SEGMENTED)
        first = _tile_word(pwords, pbase + _P_RUNS + 2 * step, 1)
        end = _tile_word(pwords, pbase + _P_RUNS + 2 * step + 1, 1)
        rng_src = ranges_of(rng, src, b, B, n_chunks)
        flag0 = flags + (((step - 1) * B + b) * HKV + hkv) * n_chunks
        k_row = (((step - 1) * 2 * B + b) * HKV + hkv) * S  # step >= 1: as _tile_loads
        if step == 0:  # the blocks' ids: this rank's K/V's (batch b's: key_ids), or those that came with the chunk
            seg_k = key_ids(seg_ptr, B, S, KV_IDS) + b.to(gl.int64) * S
        else:
            seg_k = seg_recv + ((((step - 1) * B + b) * HKV + hkv).to(gl.int64) * S)
        c_done = first * 0 - 1
        for jb in range(first, end):
            c_lo, c_hi = jb, jb  # (unused without ids)
            if SEGMENTED:
                c_lo, c_hi = chunk_ranges(rng_src, (jb * BLOCK_N) // CHUNK_ROWS, jb >= 0)
            if block_met(jb, lo1, hi1, lo2, hi2, c_lo, c_hi, a_lo, a_hi, b_lo, b_hi, BLOCK_N, SEGMENTED):
                # Unmasked where every query sees every key by position and, with ids, the block's rows all carry
                # the tile's one id (t_id: -2 where the tile's rows do not).
                unmasked = (jb >= nf_lo) & (jb < nf_hi)
                if SEGMENTED:
                    unmasked = unmasked & (c_lo == t_id) & (c_hi == t_id)
                if step > 0:
                    c = jb // CHUNK_BLOCKS
                    if c != c_done:
                        _acquire_chunk(flag0 + c, epoch, ctl, timeout_ns, src, step, c)
                        c_done = c
                s = j % STAGES
                if SEGMENTED:  # (loaded before the slot's wait, after the chunk's acquire)
                    ids_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
                    ids = gl.full([BLOCK_N], -1, gl.int32, ids_layout)
                    if not unmasked:
                        ids = gl.load(seg_k + jb * BLOCK_N + gl.arange(0, BLOCK_N, layout=ids_layout))
                mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
                if SEGMENTED:
                    if not unmasked:
                        kids.index(s).store(segment_keys(ids, KEY_PAD))
                # (not _put: through it the compilers order this store's address arithmetic otherwise, and the
                # PTX is no longer the binary the GPU checks passed)
                meta.index(s).store(gl.full([1], block_word(step, jb, unmasked), gl.int32, _WORD_LAYOUT_1))
                _load_block(k_desc, v_desc, r_desc, k_smem, v_smem, kv_ready, kv_empty, s, j // STAGES, step, b, hkv,
                            jb, k_row, B, S, HKV, D)
                if j == j_first:
                    _tile_q(q_desc, q_smem, q_ready, q_empty, tword, qids, seg_ptr, b, h, q0, S, D, i, tile, n_blocks,
                            SEGMENTED)
                j += 1
    if j == j_first:  # no block: out 0, lse -inf
        _tile_q(q_desc, q_smem, q_ready, q_empty, tword, qids, seg_ptr, b, h, q0, S, D, i, tile, n_blocks, SEGMENTED)
    return j


@gluon.jit
def _tile_q(q_desc, q_smem, q_ready, q_empty, tword, qids, seg_ptr, b, h, q0, S, D: gl.constexpr, i, tile, n_blocks,
            SEGMENTED: gl.constexpr):
    """``_load_q`` of a tile at (b, h, q0) in the masked load partition, with the tile's ids where SEGMENTED."""
    if SEGMENTED:
        _load_q(q_desc, q_smem, q_ready, q_empty, tword, b * S + q0, h * D, i, tile, n_blocks, qids,
                seg_ptr + b.to(gl.int64) * S + q0)
    else:
        _load_q(q_desc, q_smem, q_ready, q_empty, tword, b * S + q0, h * D, i, tile, n_blocks)


# A block's word (``_tile_loads_masked`` -> the consumers, through the slot's ``meta``): ring step, block, and bit 0 set
# where the block needs masks (then the whole rule is applied: the positions' alone for the diagonal of a tile of one
# document measured no faster, its separate path made the consumers spill).

@gluon.jit
def block_word(step, jb, unmasked):
    return (step << 24) | (jb << 1) | (1 - unmasked.to(gl.int32))


@triton.constexpr_function
def pow2(n):
    """The least power of 2 >= n, at least 2 (a shared buffer's dimensions are powers of 2)."""
    return max(2, triton.next_power_of_2(n))


@gluon.jit
def make_plan(q0, q_pos_min, q_pos_max, s_hi, rank, S, rng, b, B, n_chunks, a_lo, a_hi, b_lo, b_hi, W: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK_ROWS: gl.constexpr, CAUSAL: gl.constexpr,
              ZIGZAG: gl.constexpr, WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
              SEGMENTED: gl.constexpr):
    """With a window or segment ids, in the planner partition (``_tile_plan``), a tile ahead: per ring step the run of
    blocks [first, end) holding every block the tile loads (``protocol.met_blocks``, 32 blocks at a time, a lane
    each: by position, ``step_blocks``, and by the chunks' published id ranges, which the call check acquired), as
    a vector (``plan_at`` reads it), and the number of blocks loaded, which the consumers' loop needs: (plan,
    n_blocks)."""
    n: gl.constexpr = pow2(2 * W)
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, n, layout=lay)
    words = gl.zeros([n], gl.int32, lay)
    n_blocks = q0 * 0
    for step in gl.static_range(W):
        src = (rank - step + W) % W
        j_lo, _, _, n_hi, lo1, hi1, lo2, hi2, _ = step_blocks(q0, q0 + BLOCK_M, q_pos_min, q_pos_max, s_hi, rank, src,
                                                              S, W, BLOCK_N, ZIGZAG, CAUSAL, WINDOW, WIN_LEFT,
                                                              WIN_RIGHT, SEGMENTED)
        first, end, count = met_blocks(j_lo, n_hi, lo1, hi1, lo2, hi2, ranges_of(rng, src, b, B, n_chunks), a_lo,
                                       a_hi, b_lo, b_hi, BLOCK_N, CHUNK_ROWS, SEGMENTED, 32)
        words = gl.where(i == 2 * step, first, gl.where(i == 2 * step + 1, end, words))
        n_blocks += count
    return words, n_blocks


@gluon.jit
def plan_at(plan, step):
    """Ring step ``step``'s run of blocks [first, end) in the tile's plan (``make_plan``)."""
    i = gl.arange(0, plan.shape[0], layout=plan.type.layout)
    return gl.sum(gl.where(i == 2 * step, plan, 0), axis=0), gl.sum(gl.where(i == 2 * step + 1, plan, 0), axis=0)


@gluon.jit
def _load_block(k_desc, v_desc, r_desc, k_smem, v_smem, kv_ready, kv_empty, s, rnd, step: gl.constexpr, b, hkv, jb,
                k_row, B, S, HKV: gl.constexpr, D: gl.constexpr):
    """Block ``jb`` of ring step ``step`` into slot ``s`` (its round ``rnd``, the slot already free): step 0 from this
    rank's K and V, a later step from its receive slot (``k_row``: its K rows' first row there, V's B * HKV * S on);
    K and V together on the slot's barrier, or (``kv_rings`` 2) apart (``_load_apart``)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    if kv_ready.shape[0] // STAGES == 1:
        if step == 0:
            mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma_load(k_desc, [b * S + jb * BLOCK_N, hkv * D], kv_ready.index(s), k_smem.index(s))
            tma_load(v_desc, [b * S + jb * BLOCK_N, hkv * D], kv_ready.index(s), v_smem.index(s))
        else:
            mbarrier.expect(kv_ready.index(s), 2 * r_desc.block_type.nbytes)
            tma_load(r_desc, [k_row + jb * BLOCK_N, 0], kv_ready.index(s), k_smem.index(s))
            tma_load(r_desc, [k_row + B * HKV * S + jb * BLOCK_N, 0], kv_ready.index(s), v_smem.index(s))
    else:
        if step == 0:
            _load_apart(k_desc, v_desc, [b * S + jb * BLOCK_N, hkv * D], [b * S + jb * BLOCK_N, hkv * D],
                        k_smem.index(s), v_smem.index(s), kv_ready, kv_empty, s, rnd, STAGES)
        else:
            _load_apart(r_desc, r_desc, [k_row + jb * BLOCK_N, 0], [k_row + B * HKV * S + jb * BLOCK_N, 0],
                        k_smem.index(s), v_smem.index(s), kv_ready, kv_empty, s, rnd, STAGES)


@gluon.jit
def _load_apart(k_desc, v_desc, k_at, v_at, k_dst, v_dst, kv_ready, kv_empty, s, rnd, STAGES: gl.constexpr):
    """One block's K and V through rings of their own (``kv_rings`` 2), slot ``s`` in its round ``rnd``: K (its
    slot already free: the caller waited), then V once the consumers freed its slot's last round, each on its own
    barrier (V's ``STAGES`` on)."""
    mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes)
    tma_load(k_desc, k_at, kv_ready.index(s), k_dst)
    mbarrier.wait(kv_empty.index(STAGES + s), (rnd & 1) ^ 1)
    mbarrier.expect(kv_ready.index(STAGES + s), v_desc.block_type.nbytes)
    tma_load(v_desc, v_at, kv_ready.index(STAGES + s), v_dst)


@gluon.jit
def _next_block(t, jb, n_hi, n_full, rank, S, q_pos_min, q_pos_max, W: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr):
    """The tile's next block, in the producer's order (ring step ``t``, its block ``jb``; ``n_hi`` / ``n_full``: the
    step's blocks and its blocks every query sees whole, ``protocol.block_range``): the new (t, jb, n_hi, n_full)
    and the block's mask number, query minus key position at the tile's first row and the block's first key
    (positions are contiguous in both: ``plans.gluon_applies``), or ``_UNMASKED``. Scalars only: nothing in the
    consumers' loop waits for the producer's bookkeeping."""
    jb += 1
    while (jb >= n_hi) & (t < W - 1):  # steps whose blocks the tile does not see are skipped, as the producer does
        t += 1
        _, n_hi, n_full = block_range(q_pos_min, q_pos_max, (rank - t + W) % W, S, W, BLOCK_N, CAUSAL, ZIGZAG)
        jb = jb * 0
    d = jb * 0 + _UNMASKED
    if CAUSAL:
        if jb >= n_full:
            d = q_pos_min - positions(jb * BLOCK_N, (rank - t + W) % W, S, W, ZIGZAG)
    return t, jb, n_hi, n_full, d


@gluon.jit
def _softmax_block(qk, m_i, l_i, d, row0, qk_scale, CAUSAL: gl.constexpr):
    """One block's scores -> (P unnormalised, alpha: the old rows' rescale, new max, new sum). Causal: keys after
    the query dropped where the block's mask number ``d`` (``_next_block``; ``row0``: the consumer's first row in
    the tile) says some are; rows that see nothing yet keep m = -inf and are shifted by 0, so exp2 gives 0, not
    NaN. The masks' indices are made here, not kept across the loop: held in registers they made the consumers
    spill. The softmax's scale is folded into exp2's argument (``online_softmax``: one FFMA per score)."""
    if CAUSAL:
        if d != _UNMASKED:
            s_layout: gl.constexpr = qk.type.layout
            last = row0 + d + gl.arange(0, qk.shape[0], layout=gl.SliceLayout(1, s_layout))  # each row's last key
            cols = gl.arange(0, qk.shape[1], layout=gl.SliceLayout(0, s_layout))
            qk = gl.where(cols[None, :] <= last[:, None], qk, float("-inf"))
    return online_softmax(qk, m_i, l_i, CAUSAL, qk_scale)


@gluon.jit
def online_softmax(qk, m_i, l_i, SAFE: gl.constexpr, qk_scale=1.0):
    """One block of scores into the running max and sum, in log2 units once multiplied by ``qk_scale`` (> 0: a scale
    of 0 comes as 1e-30, ring_core.protocol.control.kernel_scale; 1.0 where ``qk`` is scaled already): (P unnormalised,
    alpha: the old rows' rescale, new max, new sum). The row max is taken on the raw scores and then scaled (the
    scale is positive), so each score's scale and shift are one fused multiply-add in exp2's argument. SAFE (masked
    scores, -inf): a row with nothing visible yet keeps m = -inf and is shifted by 0, so exp2 gives 0, not NaN."""
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    if SAFE:
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = gl.exp2(qk * qk_scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def turns():
    """The two consumer partitions' turns for ping-pong (``_PINGPONG``): a pair of mbarriers, the first consumer's
    first turn given (unused otherwise)."""
    pp = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if _PINGPONG:
        mbarrier.init(pp.index(0), count=1)
        mbarrier.init(pp.index(1), count=1)
        mbarrier.arrive(pp.index(0), count=1)
    return pp


@gluon.jit
def free_turns(pp):
    if _PINGPONG:
        mbarrier.invalidate(pp.index(0))
        mbarrier.invalidate(pp.index(1))


@gluon.jit
def _turn(pp, g, HALF_INDEX: gl.constexpr):
    """Ping-pong (``_PINGPONG``): wait for this warpgroup's turn to issue the MMAs of its ``g``-th group."""
    if _PINGPONG:
        mbarrier.wait(pp.index(HALF_INDEX), g & 1)


@gluon.jit
def _pass_turn(pp, HALF_INDEX: gl.constexpr):
    """Ping-pong: this warpgroup's MMAs of the group are issued; the other warpgroup's turn."""
    if _PINGPONG:
        mbarrier.arrive(pp.index(1 - HALF_INDEX), count=1)


@gluon.jit
def _block_ids(w, kids, s, BLOCK_N: gl.constexpr, layout: gl.constexpr, SEGMENTED: gl.constexpr):
    """With segment ids, the keyed ids (``segment_keys``) of the block of word ``w`` (``block_word``) in slot ``s``
    where it needs masks (else -1, unread): the slot's row of ``kids``, which the load partition wrote before the
    slot's barrier (``_tile_loads_masked``), read before the slot is freed."""
    ids = gl.full([BLOCK_N], -1, gl.int32, layout)
    if SEGMENTED:
        if (w & 1) != 0:
            ids = kids.index(s).load(layout)
    return ids


@gluon.jit
def _softmax_masked(qk, m_i, l_i, w, q_ids, k_ids, row0, q_pos_min, rank, S, qk_scale, W: gl.constexpr,
                    CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr,
                    WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr):
    """``_softmax_block`` of a block of word ``w`` (``block_word``) with a window or segment ids: where the block
    needs masks, the one mask rule of every kernel (protocol.pairs_allowed) on positions relative to the block's
    first key (contiguous in a tile and in a block: ``plans.gluon_applies``) and on the ids (``q_ids`` the rows',
    ``k_ids`` the block's); rows that see nothing keep m = -inf (a padding row: out 0, lse -inf)."""
    if (w & 1) != 0:
        s_layout: gl.constexpr = qk.type.layout
        t = w >> 24
        jb = (w >> 1) & 0x7FFFFF
        d = q_pos_min - positions(jb * qk.shape[1], (rank - t + W) % W, S, W, ZIGZAG)
        q_rel = row0 + d + gl.arange(0, qk.shape[0], layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, qk.shape[1], layout=gl.SliceLayout(0, s_layout))
        ok = pairs_allowed(cols[None, :] >= 0, q_rel[:, None], cols[None, :], q_ids[:, None], k_ids[None, :], CAUSAL,
                           WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, KEYED=True)
        qk = gl.where(ok, qk, float("-inf"))
    return _softmax_block(qk, m_i, l_i, _UNMASKED, row0, qk_scale, True)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, pp, meta, n_blocks, qk_scale, lse_row, ctl, call_ok,
              rank, B, S, q_pos_min, q_pos_max, qids, kids, HALF_INDEX: gl.constexpr, W: gl.constexpr,
              HKV: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, WINDOW: gl.constexpr,
              WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr):
    """One consumer partition of a program of one tile on
    its half of the tile's query rows (64): the pipelined online softmax over the tile's ``n_blocks`` blocks
    (``_blocks``), then its rows of O / l (NaN rows after a failure) into its half of Q's buffer and its lse
    (``_rows_out``). No window nor segment ids. The product's kernel is persistent: ``_consumer_tiles``."""
    gl.static_assert(not (WINDOW or SEGMENTED), "the probes' consumer has no masks")
    HALF: gl.constexpr = q_smem.shape[0] // 2
    q_half = q_smem.slice(HALF_INDEX * HALF, HALF)
    acc, m_i, l_i = _rows_init(HALF, D, k_smem.shape[1])
    acc, m_i, l_i, err = _blocks(q_half, k_smem, v_smem, kv_ready, kv_empty, pp, meta, n_blocks, qk_scale, rank, B,
                                 S, q_pos_min, q_pos_max, qids, kids, acc, m_i, l_i, ctl, HALF_INDEX,
                                 W, HKV, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, q_bar, 0, 0, 0)
    out, lse = _rows_out(acc, m_i, l_i, err, call_ok)
    q_half.store(out.to(q_half.dtype))  # every MMA reading Q has completed
    fence_async_shared()  # these generic-proxy stores before the TMA store (async proxy) after the join
    gl.store(lse_row + HALF_INDEX * HALF + gl.arange(0, HALF, layout=lse.type.layout), lse)


@gluon.jit
def _consumer_tiles(q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, pp, meta, tword, out_ptr, lse_ptr,
                    qk_scale, ctl, tln, call_ok, rank, B, S, qids, kids, HALF_INDEX: gl.constexpr,
                    H: gl.constexpr, W: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                    ZIGZAG: gl.constexpr, WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
                    SEGMENTED: gl.constexpr):
    """One consumer partition of the persistent kernel, on its half of each of the program's tiles (64 query rows,
    ``q_smem.index(HALF_INDEX)``), the tiles as the load partition takes them (each one's index in the half's word,
    published with its Q; -1: no more): the pipelined online softmax over the tile's blocks (``_blocks``; their
    count: without masks the tl kernel's rules, with a window or segment ids the load partition's plan, in the
    half's second word), its half of Q's buffer freed once the tile's last S is done (the next tile's Q loads while
    the last P V runs), then its rows of O / l (NaN rows after a failure: ``_rows_out``) stored from registers,
    straight to global memory (no shared memory is left for them at D128, and a TMA store from Q's buffer would hold
    it until the store had read it). A tile with no block (padding rows, masks only): out 0, lse -inf. The slots'
    rounds and the ping-pong's turns go on from tile to tile."""
    HALF: gl.constexpr = q_smem.shape[1]
    BLOCK_M: gl.constexpr = 2 * HALF
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    MASKS: gl.constexpr = WINDOW or SEGMENTED
    q_half = q_smem.index(HALF_INDEX)
    j0 = rank * 0  # the blocks of the program's tiles so far (the slots' rounds)
    g0 = j0  # the ping-pong's turns so far
    i = j0  # the program's tiles so far (Q's rounds)
    mbarrier.wait(q_ready.index(HALF_INDEX), 0)
    tile = _tile_word(tword, 2 * HALF_INDEX)
    while tile >= 0:
        _stamp(tln, i, 3 * HALF_INDEX + TL_Q)
        b, h, hkv, m_blk = query_tile(tile, H // HKV, S // BLOCK_M, HKV, CAUSAL)
        q0 = m_blk * BLOCK_M
        q_pos_min = positions(q0, rank, S, W, ZIGZAG)
        q_pos_max = positions(q0 + BLOCK_M - 1, rank, S, W, ZIGZAG)
        acc, m_i, l_i = _rows_init(HALF, D, BLOCK_N)
        if MASKS:
            n_blocks = _tile_word(tword, 2 * HALF_INDEX + 1)
            if n_blocks > 0:
                acc, m_i, l_i, err = _blocks(q_half, k_smem, v_smem, kv_ready, kv_empty, pp, meta, n_blocks, qk_scale,
                                             rank, B, S, q_pos_min, q_pos_max, qids, kids, acc,
                                             m_i, l_i, ctl,
                                             HALF_INDEX, W, HKV, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT,
                                             SEGMENTED, None, 0, j0, g0, q_empty.index(HALF_INDEX))
                g0 += n_blocks + 1
            else:  # (Q unread)
                release_bar(q_empty.index(HALF_INDEX))
                err = gl.atomic_add(ctl + CTL_ERROR, 0, sem="relaxed", scope="gpu")
        else:
            n_blocks = q0 * 0
            for step in gl.static_range(W):
                _, n_hi, _ = block_range(q_pos_min, q_pos_max, (rank - step + W) % W, S, W, BLOCK_N, CAUSAL, ZIGZAG)
                n_blocks += n_hi
            acc, m_i, l_i, err = _blocks(q_half, k_smem, v_smem, kv_ready, kv_empty, pp, meta, n_blocks, qk_scale,
                                         rank, B, S, q_pos_min, q_pos_max, qids, kids, acc, m_i, l_i, ctl, HALF_INDEX,
                                         W, HKV, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, None, 0, j0,
                                         g0, q_empty.index(HALF_INDEX))
            g0 += n_blocks + 1
        _stamp(tln, i, 3 * HALF_INDEX + TL_DONE)
        if HALF_INDEX == 0:
            _stamp(tln, i, TL_BLOCKS, n_blocks)
        # The tile's place again from its index (b, h and q0 above would do as well: no fewer spills either way,
        # but other PTX; this one is the binary the GPU checks passed).
        b, h, _, m_blk = query_tile(tile, H // HKV, S // BLOCK_M, HKV, CAUSAL)
        row0 = b * S + m_blk * BLOCK_M + HALF_INDEX * HALF  # the half's first row of [B * S] (O), its first lse
        if HALF_INDEX == 0:
            _stamp(tln, i, TL_ERR_BACK, after=err)
        out, lse = _rows_out(acc, m_i, l_i, err, call_ok)
        _store_rows(out_ptr + (row0.to(gl.int64) * H + h) * D, out, H * D)
        if HALF_INDEX == 0:
            _stamp(tln, i, TL_OUT_ISSUED)
        gl.store(lse_ptr + ((b * H + h).to(gl.int64) * S + m_blk * BLOCK_M + HALF_INDEX * HALF) +
                 gl.arange(0, HALF, layout=lse.type.layout), lse)
        _stamp(tln, i, 3 * HALF_INDEX + TL_STORED)
        j0 += n_blocks
        i += 1
        mbarrier.wait(q_ready.index(HALF_INDEX), i & 1)
        tile = _tile_word(tword, 2 * HALF_INDEX)


@gluon.jit
def _rows_init(HALF: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr):
    """A consumer's running (acc, m, l) at the start of a tile, in the layouts of ``_blocks``."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF, D], gl.float32, o_layout)
    return acc, m_i, l_i


# A consumer's rows of O, 16 bytes a store (``_store_rows``): the accumulator's layout gives each thread 4 bytes of a
# row in each group of 8 columns (a quad of threads holds the group: ``gl.to_linear_layout`` of the layout), so that a
# plain store writes 4 bytes a thread and 8 rows of 16 bytes a warp instruction. Per 4 groups (32 columns), the 4
# threads of a quad trade their pairs (a 4 x 4 transpose in two butterfly steps of shuffles, ``%laneid``'s two low
# bits choosing what each thread sends and keeps), after which thread q of the quad holds group 4 k + q of its row,
# 16 contiguous bytes, and stores them with one st.global.v4. One asm per 16 elements (4 groups, the thread's two rows:
# 8 registers of two 16-bit elements), the pointers of elements 0 and 2 being those of its row's and its row + 8's
# 16 bytes (``_dealt``). Outputs tied to the inputs (no moves); 16-bit elements only (the Gluon kernel's dtypes).
def _butterfly(lo, hi, out_lo, out_hi, pred, dist):
    """PTX of one pairwise exchange between lanes ``dist`` apart: a thread whose lane bit (``pred``) is set sends
    ``lo`` and keeps ``hi``, the other sends ``hi`` and keeps ``lo``; what arrives takes the place of what was sent."""
    return (f"selp.b32 %s, {lo}, {hi}, {pred};\n"
            f"shfl.sync.bfly.b32 %r, %s, {dist}, 0x1f, 0xffffffff;\n"
            f"selp.b32 {out_lo}, %r, {lo}, {pred};\n"
            f"selp.b32 {out_hi}, {hi}, %r, {pred};\n")


_STORE_ROWS_ASM = gl.constexpr(
    "{\n.reg .pred %pa, %pb;\n.reg .b32 %q, %s, %r, %t<8>, %u<8>;\nmov.u32 %q, %laneid;\n"
    "and.b32 %s, %q, 1;\nsetp.ne.u32 %pa, %s, 0;\nand.b32 %s, %q, 2;\nsetp.ne.u32 %pb, %s, 0;\n"
    # step 1 (lanes 1 apart): the row's pairs $8 $10 $12 $14 -> %t0-3, the row + 8's $9 $11 $13 $15 -> %t4-7
    + "".join(_butterfly(f"${8 + 4 * i + r}", f"${10 + 4 * i + r}", f"%t{4 * r + 2 * i}", f"%t{4 * r + 2 * i + 1}",
                         "%pa", 1) for r in (0, 1) for i in (0, 1))
    # step 2 (lanes 2 apart): pairs 0-2 and 1-3 of each row -> %u
    + "".join(_butterfly(f"%t{4 * r + i}", f"%t{4 * r + i + 2}", f"%u{4 * r + i}", f"%u{4 * r + i + 2}", "%pb", 2)
              for r in (0, 1) for i in (0, 1))
    + "st.global.v4.b32 [$16], {%u0, %u1, %u2, %u3};\nst.global.v4.b32 [$18], {%u4, %u5, %u6, %u7};\n}")
_STORE_ROWS_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + [str(i) for i in range(8)] + ["l"] * 16))


@gluon.jit
def _dealt(cols):
    """The column whose 16 bytes' first pair an element at column ``cols`` of the accumulator's layout stands for
    after ``_store_rows``'s exchange: within each 32 columns, the group (bits 3-4) and the pair (bits 1-2) swap."""
    return (cols // 32) * 32 + ((cols % 8) // 2) * 8 + ((cols // 8) % 4) * 2 + cols % 2


@gluon.jit
def _store_rows(row_ptr, out, stride):
    """Store ``out`` ([rows, D] float32 in a consumer's accumulator layout: version-3 NVMMA, the register order
    ``_STORE_ROWS_ASM`` assumes; D a multiple of 32) as the pointer's 16-bit element type at ``row_ptr`` + row *
    ``stride`` + column, 16 bytes a store."""
    gl.static_assert(out.shape[1] % 32 == 0, "_store_rows: 4 groups of 8 columns an asm")
    gl.static_assert(row_ptr.dtype.element_ty.primitive_bitwidth == 16, "_store_rows: 16-bit elements")
    layout: gl.constexpr = out.type.layout
    rows = gl.arange(0, out.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = row_ptr + (rows[:, None] * stride + _dealt(cols)[None, :])
    gl.inline_asm_elementwise(_STORE_ROWS_ASM, _STORE_ROWS_CONSTRAINTS,
                              [out.to(row_ptr.dtype.element_ty), ptrs.to(gl.int64)],
                              dtype=row_ptr.dtype.element_ty, is_pure=False, pack=16)


@gluon.jit
def _rows_out(acc, m_i, l_i, err, call_ok):
    """A consumer's rows of O (acc times a row's 1 / l, in the accumulator's layout) and their lse (-inf where a row
    saw nothing), or NaN rows if the call check failed or any wait of this rank gave up (``err``: the error record,
    read once every wait of the tile had come, ``_blocks``): the NaN is a row's factor, selected once a row, not once
    an element."""
    o_layout: gl.constexpr = acc.type.layout
    valid = (call_ok != 0) & (err == 0)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    l_safe = gl.where(l_o == 0.0, 1.0, l_o)
    out = acc * gl.where(valid, 1.0 / l_safe, float("nan"))[:, None]
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    lse = gl.where(valid, (m_o + gl.log2(l_safe)) * 0.6931471805599453, float("nan"))
    return out, lse


@gluon.jit
def _blocks(q_half, k_smem, v_smem, kv_ready, kv_empty, pp, meta, n_blocks, qk_scale, rank, B, S, q_pos_min,
            q_pos_max, qids, kids, acc, m_i, l_i, ctl, HALF_INDEX: gl.constexpr, W: gl.constexpr,
            HKV: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, WINDOW: gl.constexpr,
            WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr, q_bar, q_phase, j0, g0,
            q_free=None):
    """The pipelined online softmax of one consumer over the tile's ``n_blocks`` (>= 1) blocks (block j's S = Q K^T
    beside block j-1's O += P V): (acc, m, l, err), ``err`` the error record (``ctl``) read while the last P V runs,
    when every wait of the tile has come (each came before its block's barrier). ``q_free``: the barrier that frees
    this consumer's half of Q's buffer, released once its last S is done (the next tile's Q may load during the last
    P V and the rows' output), or None. The tiles are the buffers' (``slots``). K and V in rings of their own
    (RINGS 2): block j's K freed once S_j is done, its V once P_j V_j is, each waited for just before its MMA.
    Without masks the blocks follow the producer's order by scalar bookkeeping (``_next_block``; ``q_bar``: Q's
    barrier, waited for here in its phase ``q_phase``, or None where the caller waited); with a window or segment
    ids each block's word comes with its slot (``meta``, ``_tile_loads_masked``), read once the slot's barrier passed
    (Q's waited for by the caller).
    ``j0``: the blocks of the program's tiles before this one (the slots' rounds go on), ``g0``: the ping-pong's
    turns before it."""
    MASKS: gl.constexpr = WINDOW or SEGMENTED
    HALF: gl.constexpr = q_half.shape[0]
    D: gl.constexpr = q_half.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    RINGS: gl.constexpr = kv_ready.shape[0] // STAGES
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    s0 = j0 % STAGES  # the tile's first block's slot
    if MASKS:
        row_ids: gl.constexpr = gl.SliceLayout(1, s_layout)
        q_ids = gl.full([HALF], -1, gl.int32, row_ids)
        if SEGMENTED:
            q_ids = qids.index(HALF_INDEX).load(row_ids)  # the half's rows' keyed ids, with Q (_load_q)
        mbarrier.wait(kv_ready.index(s0), (j0 // STAGES) & 1)
        w = gl.max(meta.index(s0).load(_WORD_LAYOUT_4), axis=0)
    else:
        _, n_hi, n_full = block_range(q_pos_min, q_pos_max, rank, S, W, BLOCK_N, CAUSAL, ZIGZAG)  # step 0: local K/V
        t, jb, n_hi, n_full, d = _next_block(rank * 0, rank * 0 - 1, n_hi, n_full, rank, S, q_pos_min, q_pos_max, W,
                                             BLOCK_N, CAUSAL, ZIGZAG)
        if q_bar is not None:
            mbarrier.wait(q_bar, q_phase)
        mbarrier.wait(kv_ready.index(s0), (j0 // STAGES) & 1)
    _turn(pp, g0, HALF_INDEX)
    qk = warpgroup_mma(q_half, k_smem.index(s0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _pass_turn(pp, HALF_INDEX)
    if MASKS:  # (read while S runs)
        k_ids = _block_ids(w, kids, s0, BLOCK_N, gl.SliceLayout(0, s_layout), SEGMENTED)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
    if RINGS > 1:
        release(kv_empty, s0)  # K_0
    if MASKS:
        p, alpha, m_i, l_i = _softmax_masked(qk, m_i, l_i, w, q_ids, k_ids, HALF_INDEX * HALF, q_pos_min, rank, S,
                                             qk_scale, W, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
    else:
        p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, d, HALF_INDEX * HALF, qk_scale, CAUSAL)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # acc is 0: no rescale for block 0
    for j in range(j0 + 1, j0 + n_blocks):
        s = j % STAGES
        sp = (j - 1) % STAGES
        if not MASKS:
            t, jb, n_hi, n_full, d = _next_block(t, jb, n_hi, n_full, rank, S, q_pos_min, q_pos_max, W, BLOCK_N,
                                                 CAUSAL, ZIGZAG)
        mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
        if MASKS:
            w = gl.max(meta.index(s).load(_WORD_LAYOUT_4), axis=0)
        _turn(pp, g0 + j - j0, HALF_INDEX)
        qk = warpgroup_mma(q_half, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if RINGS > 1:
            mbarrier.wait(kv_ready.index(STAGES + sp), ((j - 1) // STAGES) & 1)  # V_{j-1}
        acc = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
        _pass_turn(pp, HALF_INDEX)
        if MASKS:
            k_ids = _block_ids(w, kids, s, BLOCK_N, gl.SliceLayout(0, s_layout), SEGMENTED)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))  # S done; P V may still run
        if RINGS > 1:
            release(kv_empty, s)  # K_j
        if MASKS:
            p, alpha, m_i, l_i = _softmax_masked(qk, m_i, l_i, w, q_ids, k_ids, HALF_INDEX * HALF, q_pos_min, rank,
                                                 S, qk_scale, W, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT,
                                                 SEGMENTED)
        else:
            p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, d, HALF_INDEX * HALF, qk_scale, CAUSAL)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if RINGS > 1:
            release(kv_empty, STAGES + sp)  # V_{j-1}
        else:
            release(kv_empty, sp)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    if q_free is not None:  # every S of the tile done: Q's half is free
        release_bar(q_free)
    sp = (j0 + n_blocks - 1) % STAGES
    if RINGS > 1:
        mbarrier.wait(kv_ready.index(STAGES + sp), ((j0 + n_blocks - 1) // STAGES) & 1)
    _turn(pp, g0 + n_blocks, HALF_INDEX)
    acc = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
    _pass_turn(pp, HALF_INDEX)
    err = gl.atomic_add(ctl + CTL_ERROR, 0, sem="relaxed", scope="gpu")  # (while P V runs)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if RINGS > 1:
        release(kv_empty, STAGES + sp)
    else:
        release(kv_empty, sp)
    return acc, m_i, l_i, err


@gluon.jit(do_not_specialize=["timeout_ns"])
def ring_attn_fwd_gluon(
    # inputs
    q_ptr, k_ptr, v_ptr, seg_ptr, ctx_ptr,
    # runtime scalars
    B, S, sm_scale, timeout_ns,
    # outputs
    out_ptr, lse_ptr, status_ptr,
    # constexprs (the tl kernel's: ring_core.plans; those of masks and precision are not used here)
    W: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    CHUNK_BLOCKS: gl.constexpr, PUSH_ROWS: gl.constexpr, SEG_BLOCKS: gl.constexpr, POLL_N: gl.constexpr,
    PUSH_VEC: gl.constexpr,
    CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, INTERPRET: gl.constexpr, DOT_PRECISION: gl.constexpr,
    SIG_DTYPE: gl.constexpr, STICKY_ERRORS: gl.constexpr,
    WINDOW: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SEGMENTED: gl.constexpr,
    KV_IDS: gl.constexpr,
):
    STAGES: gl.constexpr = kv_slots(D, BLOCK_M, BLOCK_N)  # ring_core.kernels.configs.GLUON_TILES
    RINGS: gl.constexpr = kv_rings(D)
    gl.static_assert(BLOCK_D == D, "ring_core.plans: the Gluon config")
    MASKS: gl.constexpr = WINDOW or SEGMENTED
    CHUNK_ROWS: gl.constexpr = CHUNK_BLOCKS * BLOCK_N
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # ---- the protocol's start: this rank's ring, the call check, every push unit left --------------------
    t_entry = _now_ns()
    heap_bases, rank, ctl, flags, recv_addr, epoch = ring_context(ctx_ptr, W)
    recv, seg_recv = receive_slots(recv_addr, seg_ptr, rank, B, S, q_ptr, W, HKV, D, SEGMENTED)
    kseg_ptr = key_ids(seg_ptr, B, S, KV_IDS)  # the ids of the K/V this rank holds (SEGMENTED only)
    if _TIMELINE:  # (the receive region, unused at world size 1)
        gl.static_assert(W == 1, "the timeline (RING_ATTENTION_GLUON_TIMELINE) is for world size 1")
        tln = recv_addr.to(gl.pointer_type(gl.int64), bitcast=True)
        _stamp(tln, 0, TL_ENTRY_NS, t_entry)
        _stamp(tln, 0, TL_PROGRAM_START)
    else:
        tln = ctl  # never written
    n_chunks = gl.cdiv(S, CHUNK_ROWS)
    rng = ranks_rng(flags, B, HKV, n_chunks, 0, W)
    call_ok = start_call(ctl, heap_bases, rank, epoch, timeout_ns, seg_ptr, kseg_ptr, rng, B, S, sm_scale, n_chunks,
                         control.KIND_FWD, W, H, HKV, D, SIG_DTYPE, CAUSAL, ZIGZAG, CHUNK_ROWS, BLOCK_N, WIN_LEFT,
                         WIN_RIGHT, SEGMENTED, False)
    _stamp(tln, 0, TL_CHECKED_NS, NS=True)
    if W > 1:
        # The first quarter of the grid to arrive pushes every unit, each before anything of it waits (the
        # partitions), while the others compute ring step 0 meanwhile: ring_core.protocol.steps's no-deadlock argument.
        if is_pusher(ctl, gl.num_programs(0)):
            drain_pushes(ctl, (W - 1) * B * HKV * n_chunks * call_ok, k_ptr, v_ptr, kseg_ptr, recv, seg_recv, flags,
                         heap_bases, rank, epoch, B, S, n_chunks, W, HKV, D, D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC,
                         CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, rng, SEGMENTED)

    # ---- TMA descriptors and shared memory, once for the program's tiles -----------------------------------
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_desc = tma.make_tensor_descriptor(q_ptr, [B * S, H * D], [H * D, 1], [HALF, D], layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, [B * S, HKV * D], [HKV * D, 1], [BLOCK_N, D], layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, [B * S, HKV * D], [HKV * D, 1], [BLOCK_N, D], layout)
    if W > 1:
        r_desc = tma.make_tensor_descriptor(recv, [(W - 1) * 2 * B * HKV * S, D], [D, 1], [BLOCK_N, D], layout)
    else:
        r_desc = k_desc  # never read: no ring step reads a receive slot
    q_smem, q_ready, q_empty = q_halves(dtype, HALF, D, layout)
    # Each slot released by both consumer partitions.
    k_smem, v_smem, kv_ready, kv_empty = kv_slots_smem(dtype, BLOCK_N, D, layout, STAGES, 2, RINGS)
    pp = turns()
    # Each half's tile and block count (``_load_q``); with masks each slot's block word (``_tile_loads_masked``).
    tword = gl.allocate_shared_memory(gl.int32, [4, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if MASKS:
        meta = gl.allocate_shared_memory(gl.int32, [pow2(STAGES), 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        # The planner's two slots of a tile's plan (``_planner``), each with a barrier either way.
        pwords = gl.allocate_shared_memory(gl.int32, [pow2(2 * plan_words(W)), 1],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(2):
            mbarrier.init(p_full.index(slot), count=1)
            mbarrier.init(p_empty.index(slot), count=1)
    else:
        meta = q_ready  # never read
    if SEGMENTED:  # the keyed ids of each half's rows (with Q) and of each slot's block where masked
        ids_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # (a row's: .index)
        qids = gl.allocate_shared_memory(gl.int32, [2, HALF], ids_layout)
        kids = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], ids_layout)
    else:
        qids, kids = q_ready, q_ready  # never read

    # ---- the program's tiles, from the call's tile counter (ring_core.kernels.tiles.query_tile's order) -------------
    qk_scale = sm_scale * 1.4426950408889634
    if MASKS:  # (Gluon takes a literal list of partitions: the one with the planner repeats the others)
        gl.warp_specialize([
            (_consumer_tiles, (q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, pp, meta, tword, out_ptr,
                               lse_ptr, qk_scale, ctl, tln, call_ok, rank, B, S, qids, kids, 0, H, W, HKV, D,
                               CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)),
            (_producer_planned, (q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready,
                                 kv_empty, meta, tword, pwords, p_full, p_empty, qids, kids, rank, B, S, seg_ptr,
                                 seg_recv, flags, n_chunks, epoch, ctl, tln, timeout_ns, rng, H, W, HKV, D,
                                 CHUNK_BLOCKS, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED, KV_IDS)),
            (_consumer_tiles, (q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, pp, meta, tword, out_ptr,
                               lse_ptr, qk_scale, ctl, tln, call_ok, rank, B, S, qids, kids, 1, H, W, HKV, D,
                               CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)),
            (_planner, (pwords, p_full, p_empty, rank, B, S, seg_ptr, n_chunks, ctl, tln, rng, H, W, HKV, BLOCK_M,
                        BLOCK_N, CHUNK_ROWS, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)),
        ], [_LOAD_WARPS, _CONSUMER_WARPS, _LOAD_WARPS], [_LOAD_REGS, _CONSUMER_REGS, _LOAD_REGS])
        for slot in gl.static_range(2):
            mbarrier.invalidate(p_full.index(slot))
            mbarrier.invalidate(p_empty.index(slot))
    else:
        gl.warp_specialize([
            (_consumer_tiles, (q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, pp, meta, tword, out_ptr,
                               lse_ptr, qk_scale, ctl, tln, call_ok, rank, B, S, qids, kids, 0, H, W, HKV, D,
                               CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)),
            (_producer, (q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                         meta, tword, rank, B, S, seg_ptr, flags, n_chunks, epoch, ctl, tln, timeout_ns, rng, H, W,
                         HKV, D, CHUNK_BLOCKS, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)),
            (_consumer_tiles, (q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, pp, meta, tword, out_ptr,
                               lse_ptr, qk_scale, ctl, tln, call_ok, rank, B, S, qids, kids, 1, H, W, HKV, D,
                               CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)),
        ], [_LOAD_WARPS, _CONSUMER_WARPS], [_LOAD_REGS, _CONSUMER_REGS])
    free_q_halves(q_ready, q_empty)
    free_slots_kv(kv_ready, kv_empty, RINGS * STAGES)
    free_turns(pp)
    _stamp(tln, 0, TL_PROGRAM_END)
    _stamp(tln, 0, TL_JOINED_NS, NS=True)
    # The last program done with the tile counter resets it for the next call (which starts after this one ends),
    # and the pushers' count (every program took its place at the start).
    if gl.atomic_add(ctl + CTL_FWD_DONE, 1, sem="acq_rel", scope="gpu") == gl.num_programs(0) - 1:
        gl.atomic_xchg(ctl + CTL_FWD_TILE, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(ctl + CTL_FWD_DONE, 0, sem="relaxed", scope="gpu")
        if W > 1:
            gl.atomic_xchg(ctl + CTL_PUSHERS, 0, sem="relaxed", scope="gpu")

    # ---- the protocol's end: end barrier, status, counters (the last program of this rank) -----------------
    end_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W, False, STICKY_ERRORS, False)
    _stamp(tln, 0, TL_EXIT_NS, NS=True)
