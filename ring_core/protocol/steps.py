"""The ring protocol on the device: the Triton functions the kernels (ring_core.kernels.tl_fwd,
ring_core.kernels.tl_bwd, and the Gluon Hopper forward ring_core.kernels.gluon_fwd, which compiles the same functions
under Gluon: their index vectors come from ring_core.protocol.lanes) build their calls from, and the arguments for why a
call cannot deadlock, race the next call or corrupt silently. The control words and error codes are named in
ring_core.protocol.control (its host twin, which also lays out the heap and turns status words into exceptions).

K/V shards reach the other ranks of a ring through iris remote stores issued from inside the kernel,
signalled with release/acquire flags, while the same programs do the attention math. One launch per call.

Protocol (per call; "epoch" = this rank's call counter + 1, equal on every rank of a job)
----------------------------------------------------------------------------------------
* Call check. Before anything is pushed or waited for, every rank checks that every peer makes the same
  call: the first program of the call publishes the call's signature (kernel, world size, shapes, dtype,
  causal/layout/segment ids, scale, chunking, window; ``call_words``) into its inbox slot on every peer, and
  every program waits (bounded) for every peer's signature of this epoch and compares (``check_call``). On a
  difference (or a peer at another epoch) the rank records the error with both signatures and pushes
  nothing, so a peer's differently sized receive slots are never written; every later wait gives up at
  once. Every rank sees the difference, so every rank raises, and the epochs stay in step.
* Push work. The local K/V is cut into *units* (peer distance d in 1..W-1, batch, kv head, chunk of
  CHUNK_BLOCKS*BLOCK_N rows), ordered nearest ring neighbour first. Programs *claim* units through an
  atomic counter in the control region and copy a claimed unit into the receive slot ``d-1`` of rank
  ``rank+d`` with ``iris.store``; then they publish it by writing ``epoch`` into that unit's flag on the
  receiver with a release ``iris.atomic_xchg`` (system scope, after a CTA barrier so every thread's stores
  are ordered before it). Under causal masking a unit that the receiver can never see (its first
  position after the receiver's last query position) is claimed but neither copied nor flagged: no tile
  of the receiver waits for it. With a window, the same for a unit none of whose rows any query of the
  receiver sees by position (``chunk_needed``). With segment ids, a unit also carries its rows' ids.
* Compute. A program owns one (batch, head, BLOCK_M query rows) tile. Ring step 0 uses the local K/V and
  waits for nothing; during it the program claims one push unit every SEG_BLOCKS K/V blocks (overlap;
  the claims sit between the software-pipelined inner loops). Before its first wait a program drains the
  claim counter (pushes until no unit is left), and every program drains it at ring step 1 whether or not
  it then waits (a tile may need nothing from any peer). Ring step t >= 1 processes the K/V of rank ``rank-t``:
  before its loops over K/V blocks it waits (acquire; one vector poll over the chunk flags) until the
  flag of every chunk it will read equals ``epoch`` (not inside the loops: see the comment there).
  Positions grow with the local row in both layouts, so the K/V a tile sees is a prefix of the source's
  shard: blocks every query sees whole run in an unmasked loop, the diagonal and tail in a masked one,
  and blocks causal masking hides completely are neither waited for, loaded nor computed (windows and
  segment ids: below).
* End. The last program to finish (atomic finish counter) tells every peer "I am done with this epoch"
  (release flag in the peer's barrier slot), waits for the same from every peer, copies the error record
  into ``status``, resets the claim/finish counters and stores ``epoch`` as the new call counter.

Windows and segment ids: what travels, what is skipped, what is still waited for
-----------------------------------------------------------------------------------------
The rule is ring_core.masks.allowed's, in global positions. The window is a pair of constexprs (as
ring_core.masks.kernel_window normalises it: a side that masks nothing is NO_SIDE, the right side under causal
masking too). A call whose keys sit elsewhere than its queries (the two-level ring's calls with another node's
K/V: ``AttentionSpec.key_offset``) has its sides moved by the offset, so its band need not contain the diagonal
(a side may be negative); nothing below assumes that it does: the runs of a shard the band misses are empty,
and a query that sees no key ends with out 0 and lse -inf, as a padding row does. Segment ids are an int32 input, this rank's tokens in layout order, serving its queries and
its keys (with KV_IDS the keys' ids follow the queries' in the same input: a call whose K/V are another node's,
``key_ids``; what follows reads "the chunk's ids" as the keys', "the tile's" and "the halves'" as the queries').

* Windows are positions, known to every rank without data, like causal masking. Positions grow with the
  local row in both layouts, so the keys of a source shard within reach of one run of consecutive query
  positions are one run of rows (``span_rows``); a tile's rows are one run of positions (contiguous) or two
  (a zigzag tile that holds rows of both chunks of its shard: ``query_intervals``), so the rows it may see
  are at most two runs [lo1, hi1) | [lo2, hi2), and those every one of its queries sees one run
  (``rows_within``). Blocks within the latter run unmasked (the plain pipelined loop), blocks that meet the
  former but not wholly the latter masked (a masked loop before the unmasked one and one after it), no other
  block is waited for, loaded or computed, and a masked block loads only rows of the runs (the others may not
  have been sent, and no value of a row the tile cannot attend should reach it). A tile waits for exactly the
  chunks that hold rows of its runs (``wait_rows``): none at all for a ring step it does not need.
  Pushes: a chunk is sent and flagged iff some query of the receiver sees one of its rows (``chunk_needed``,
  the runs of the receiver's whole shard). A tile's runs lie within its shard's (the runs are monotone in the
  query positions), so every chunk a tile waits for is pushed. The backward applies the same tests to dQ
  tiles; a partial task computes and sends its K/V block's partial iff some local query sees a row of the
  block (``rows_seen``), the owner's final task waits for it iff the same function of (owner, peer) says so;
  the partial task reads only the block's rows that local queries see (the chunks it waits for are those the
  pusher sent by the same test), and runs over the local query blocks within reach of the block's keys
  (``span_rows`` transposed: masked edges, unmasked middle).
* Segment ids are values: a rank knows its own, not its peers'. They travel with the K/V: each pushed chunk
  carries its rows' ids into an int32 part of the receive region ([W-1][B][HKV][S], after the K/V: one copy
  per kv head, so that the unit that flags a chunk wrote its ids, 1/D of the K/V's bytes), stored before the
  chunk's release flag, so the acquire that covers the K/V covers the ids. What segment ids skip without
  data not yet there: a tile of padding rows only (its own ids: it attends nothing, waits for nothing, loads
  nothing). What they skip once the chunk has arrived: compute and loads. Before a ring step's loops a range
  pass (``seg_blocks``, vectorised over 2048 ids at a time) takes each K/V block's [min, max] of non-padding
  ids against the tile's [s_lo, s_hi]: a block whose range does not meet the tile's holds no attended pair,
  and the loops run only over the blocks from the first that meets it to the last; blocks (of the position-
  whole ones) whose every row carries the tile's one id, when it has one, run unmasked. With ids
  non-decreasing in position (packed sequences, ``segment_ids_from_cu_seqlens``) this is exact: the blocks
  that meet a tile are one run, so are those of its one id; with any other ids the masked loop still masks
  every pair, it only skips less. In a masked block, rows whose id lies outside [s_lo, s_hi] (padding too)
  load as 0. The backward's dK/dV tasks do the same over the local query blocks against their K/V block's
  ids.
  What ids decide before any data moves: which chunks travel and are waited for. With the call's
  signature, the publishing program of every rank also writes into its inbox on every peer the [min, max] of
  the non-padding ids of each of its K/V chunks and of each half of its shard, per batch (``publish_id_ranges``:
  zigzag halves are the layout's two chunks, far apart in position; contiguous, the shard and an empty
  range), before the signature's release; every program of every rank acquires every peer's signature before
  it pushes or waits (``check_call``), so after the check every rank holds the same ranges of everyone. A
  chunk is pushed iff the positions allow it (above) and its range meets the range of a half of the
  receiver's shard (``push_unit``: the pusher reads its chunk's range from its own inbox, the words it
  published). A tile waits for a chunk iff the positions allow it and the
  chunk's published range meets the range of the tile's rows in either half (``tile_id_parts``,
  ``wait_chunks``): each part of the tile lies within its half, so every chunk a tile waits for was pushed.
  The range pass and the masked loops do not read rows of a chunk whose range misses the tile's (it was not
  sent; its receive bytes hold an older call's data). With packed documents a chunk then travels only where a
  document crosses into the receiver's half: most stay home. Range words live after the K/V flags in the
  ring slot's flag region (``plans.id_range_words``), stored as -1 - value (<= 0), so no flag wait, which needs
  an epoch >= 1, is ever met by a range word a call of another shape left there.
  The backward uses the same ranges (``check_call`` publishes them there too, after the partial flags): its
  K/V pushes and dQ tasks' waits as above; a partial task computes, and sends its partial dK/dV back, only
  for a chunk that came (the owner's published chunk range meets a half of this rank's, as this rank published
  them), and the owner's final task waits for exactly those partials (``meets_halves``: its chunk's range, as
  published, against the peer's published halves). Ids then narrow the loops after the waits, as in the
  forward.
  A rank's own ranges lie in its own inbox too: the publishing program writes them there with the peers'
  copies, then releases CTL_RANGES = epoch (alone, W = 1, the programs of the call share the chunks' ranges, 2048
  ids a step taken from a counter, and the one that counts the last step done releases it); every program
  acquires it (``id_ranges_ready``) before it reads a range. So a pusher, a partial or final task
  reads its own chunk's and halves' ranges (one word each) instead of recomputing them from the ids, and each
  range pass (``seg_blocks``) first narrows its blocks by the owner's chunk ranges (one vector of words), then
  reads the ids of that run only: a tile's cost no longer grows with seq_local where its documents are short.
  Those are the very words the peers read, so every test still agrees between the two sides. The publishing
  program (W = 1: each program that took a step) writes them before it waits for anything, so the other programs'
  wait for them ends (bounded).

Why it cannot deadlock
----------------------
A program waits only for (0) the peers' signatures, (a) flags of units pushed by the source rank, and
(b) the end barrier. (0) A signature is published by whichever program of the peer's kernel claims the
publishing first, before it waits for anything; so it is published as soon as any program there runs.
(a) Units are pushed by programs that claimed them; claiming and pushing never wait on anything, and every program
drains the claim counter before its first wait, and before it ends even if it never waits (a tile of padding rows, or
one whose window sees no peer, waits for nothing). So all units of rank s are pushed as soon as *any* program of the
kernel on rank s runs; no wait depends on a particular program being resident.
The persistent Gluon forward drains in its first programs only (``is_pusher``: the first quarter of its grid
to *arrive*, counted on CTL_PUSHERS), so that its other programs compute ring step 0 meanwhile: a pusher is
a running program by construction (it took its place by arriving), it drains the counter until no unit is
left before it waits for anything, and the first program to arrive is always one; so again every unit is
claimed and pushed by running programs that wait for nothing first, whichever programs are resident.
Hence it holds for any grid size, however many CTAs the GPU holds at once, in whatever order the hardware
dispatches them, and while other kernels occupy SMs (they delay but cannot block us unless they
themselves wait for this kernel on another rank, which is a program-order bug the timeout reports).
With a window or segment ids, no unit that is waited for goes unpushed: a tile waits only for chunks that hold
a row its queries see by position, and the pusher sends every chunk that holds a row some query of the
receiver sees by position (``chunk_needed``; a tile's queries are some of its shard's, and the rows within
reach grow with the query positions). Both depend on positions and constexprs only, never on data, and the
call check makes every rank use the same window and chunking. With segment ids, both also depend on
the id ranges, which every rank publishes unconditionally before its signature's release (no wait before it,
like the signature) and every program reads only after acquiring that signature; the pusher's test (chunk meets
a half of the receiver) contains the tile's (chunk meets the tile's part in a half, a sub-range of that half's),
so again no waited unit goes unpushed. The ids themselves (rows' values) are read only after the wait that
covers them and narrow only the loops after it. Alone (W = 1) a program waits for its rank's own ranges, whose
steps are taken from a counter by running programs, each written before its taker waits for anything: as (a).
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

Several rings on one heap
-------------------------
A ring is the ranks of one process group (torch) or one mesh axis (JAX: one ring per position along the
other axes), in ring order; the kernel sees only its own ring (``W``, ``rank`` = its position, the members'
heap bases, offsets: ring_core.protocol.control.make_ctx). Each ring has a *slot* of the heap: its own control words
(epoch, counters, error record, barrier, signature inboxes) and flags (ring_core.runtime.heap.RingSlots gives rings
that share a rank different slots). Rings with no rank in common touch disjoint memory, so they run at once
(a 2 x 2 mesh's two sequence rings) and each argument above holds for each of them. Rings that share a rank
t also share t's receive region, yet never write it at the same time: a peer pushes into t only after its
call check saw t's signature of *this* ring's current call (``check_call``: no unit is pushed before it
passes), which t publishes when its kernel for that call starts, i.e. after t's previous kernel, of any ring,
completed (one stream per rank); and a completed kernel of t has passed its end barrier, after which the
peers of that ring push into t again only for their next call, which waits for t's next signature in that
ring. So at any time only the ring whose call t runs writes t's receive region, and flags, holding epochs of
their own slot's counter, are never confused between rings. Deadlock: a wait in a ring depends only on the
ring's own members making the same call (the argument above), so rings cannot wait on each other, unless a
program issues its ring calls in orders that differ between ranks (NCCL's rule; the timeout reports it).
(Two frontends in one process use different slots and must not run their calls at the same time: keep them
on one stream or synchronise between them.)

Never corrupts silently
-----------------------
A tile whose wait gave up, or whose call failed the call check, writes NaN into its rows of ``out`` and
``lse``: a failed call is always raised on the host, and (torch reports it at the next call) whatever
reads the outputs before that sees NaN, never a plausible wrong value. Tiles that got all they needed
write their right result even when the call failed elsewhere (e.g. at the end barrier). The backward
does the same for dq, dk and dv (``ring_core.kernels.tl_bwd``).

Never hangs
-----------
Every wait is bounded: by ``timeout_ns`` of %globaltimer on the GPU, by a poll count in the Triton
interpreter. A timeout writes (code, peer rank, ring step, chunk) into the control region (first error
wins), makes every later wait on this rank give up at once, and the last program copies the record into
``status``, which the host turns into an exception.

The backward's waits (ring_core.kernels.tl_bwd): why they cannot deadlock
----------------------------------------------------------------------
Waits: (a) K/V flags (dQ and partial tasks), (b) the delta count (partial and final tasks), (c) partial
flags (final tasks), (d) the end barrier. Producers never wait on a final task; nothing waits on work
that is assigned to one particular program.
(a) As in the forward: claiming and pushing never wait, and every task drains the claim counter before
its first wait (dQ tasks at ring step 1 whether or not they wait), so all units of rank s are pushed as soon
as any program of the kernel on s runs. A dQ or partial task waits only for chunks the pusher sends (the same
position test as the forward); a final task waits for a peer's partial iff the peer's partial task sends it
(one function, ``rows_seen``, of the same arguments on both sides; with segment ids also one range test,
``meets_halves``, of the same published range words on both sides).
(b) A task waiting for delta holds a ticket later than every dQ ticket, so every dQ task is held by a
program that has started (tickets are taken at program start); a dQ task publishes delta before its
first wait, so the count completes whatever else is waiting.
(c) A final task on rank s waits for partial tasks on rank r. On r, partial tickets come before final
tickets, and partial tasks wait only on (a) and (b), which complete; so r's programs finish every dQ and
partial task they hold and take the next tickets until every partial task has run, whether or not
final tasks of r are resident and waiting. This is why tasks come from tickets and not from program
ids: with program ids, final programs could fill every SM of both ranks, each waiting for partial
programs that the GPU never gets to run (the dispatch order of program ids is not guaranteed). With
tickets, any program that runs holds the lowest task not yet taken (the argument of CUB's decoupled
look-back, which takes tile ids the same way).
(d) Every program finishes once (a)-(c) are met, so each rank's last program reaches the barrier.
Hence it holds for any grid size, SM occupancy or dispatch order, and while other kernels occupy SMs.
In the Triton interpreter (a rank's programs run one after another, tickets in program-id order) the
first program pushes everything, dQ programs precede the rest, and partial tasks of every rank precede
its final tasks, so one thread per rank completes too.

... and why its calls cannot race
---------------------------------
As in the forward: receive slots (K/V and partials) and flags of rank t are written by peers during call
N+1 only after they passed the end barrier of call N, which t's last program enters only after all of
t's programs (the only readers of those slots) finished. Flags hold epochs, which only grow (forward and
backward calls share the counter), so a flag left by an earlier call of either kind never satisfies a
later wait. The counters are reset by the last program, after every other program of the call is done.
delta is an output of this call, so no call reads another's.
"""

import triton
import triton.language as tl

import iris

from ring_core.protocol import control
from ring_core.protocol.lanes import iota, iota2

try:  # %globaltimer for the bounded waits on NVIDIA; never traced in the interpreter (INTERPRET=True)
    from triton.language.extra.cuda import globaltimer as _globaltimer
except ImportError:  # pragma: no cover
    _globaltimer = None

# The control words and error codes (ring_core.protocol.control), as constants of the Triton functions below.
CTL_EPOCH = tl.constexpr(control.CTL_EPOCH)
CTL_CLAIM = tl.constexpr(control.CTL_CLAIM)
CTL_FINISH = tl.constexpr(control.CTL_FINISH)
CTL_ERROR = tl.constexpr(control.CTL_ERROR)
CTL_ERROR_PEER = tl.constexpr(control.CTL_ERROR_PEER)
CTL_ERROR_STEP = tl.constexpr(control.CTL_ERROR_STEP)
CTL_ERROR_CHUNK = tl.constexpr(control.CTL_ERROR_CHUNK)
CTL_SIG_CLAIM = tl.constexpr(control.CTL_SIG_CLAIM)
CTL_PUSHERS = tl.constexpr(control.CTL_PUSHERS)
CTL_BARRIER = tl.constexpr(control.CTL_BARRIER)
CTL_ERR_SIG = tl.constexpr(control.CTL_ERR_SIG)
CTL_SIG = tl.constexpr(control.CTL_SIG)
CTL_RANGES = tl.constexpr(control.CTL_RANGES)
CTL_RANGES_DONE = tl.constexpr(control.CTL_RANGES_DONE)
CTL_STICKY = tl.constexpr(control.CTL_STICKY)
CTL_BWD_TICKET = tl.constexpr(control.CTL_BWD_TICKET)
CTL_BWD_DELTA = tl.constexpr(control.CTL_BWD_DELTA)
SIG_WORDS = tl.constexpr(control.SIG_WORDS)
STATUS_WORDS = tl.constexpr(control.STATUS_WORDS)
ERR_KV_TIMEOUT = tl.constexpr(control.ERR_KV_TIMEOUT)
ERR_BARRIER_TIMEOUT = tl.constexpr(control.ERR_BARRIER_TIMEOUT)
ERR_PEER_FAILED = tl.constexpr(control.ERR_PEER_FAILED)
ERR_MISMATCH = tl.constexpr(control.ERR_MISMATCH)
ERR_EPOCH = tl.constexpr(control.ERR_EPOCH)
ERR_START_TIMEOUT = tl.constexpr(control.ERR_START_TIMEOUT)


@triton.jit
def ring_context(ctx_ptr, W: tl.constexpr):
    """This rank's view of its ring, from its context array (ring_core.protocol.control.make_ctx): (the members' heap
    bases as mapped here, this rank's position, its control words and flags (its ring's slot), the address
    of its receive region, this call's epoch)."""
    ctx = ctx_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    heap_bases = ctx_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    rank = tl.load(ctx + W).to(tl.int32)
    my_base = tl.load(heap_bases + rank)
    ctl = (my_base + tl.load(ctx + W + 1).to(tl.uint64)).to(tl.pointer_type(tl.int32), bitcast=True)
    flags = (my_base + tl.load(ctx + W + 2).to(tl.uint64)).to(tl.pointer_type(tl.int32), bitcast=True)
    recv_addr = my_base + tl.load(ctx + W + 3).to(tl.uint64)
    epoch = tl.load(ctl + CTL_EPOCH) + 1
    return heap_bases, rank, ctl, flags, recv_addr, epoch


@triton.jit
def receive_slots(recv_addr, seg_ptr, rank, B, S, elem_ptr, W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                  SEGMENTED: tl.constexpr):
    """Typed pointers into this rank's receive region (``ring_context``'s ``recv_addr``): the peers' K/V
    slots [W-1][K, V][B][HKV][S][D] of ``elem_ptr``'s element type, and, with segment ids, the ids that travel
    with them, [W-1][B][HKV][S] int32 right after (ring_core.plans.seg_bytes; without: ``seg_ptr``, never read).
    Heap bases are allocation-granularity aligned and the region starts ALIGN (256) bytes in
    (ring_core.protocol.control): saying so lets Triton vectorise and pipeline the loads from the slots."""
    recv = tl.multiple_of(recv_addr.to(tl.pointer_type(elem_ptr.dtype.element_ty), bitcast=True), 16)
    if SEGMENTED:
        seg_recv = (recv + (rank * 0 + B).to(tl.int64) * (2 * (W - 1) * HKV * D) * S).to(
            tl.pointer_type(tl.int32), bitcast=True)
    else:
        seg_recv = seg_ptr
    return recv, seg_recv


@triton.jit
def key_ids(seg_ptr, B, S, KV_IDS: tl.constexpr):
    """Where the ids of the K/V this rank holds are: with KV_IDS ([2][B][S] at ``seg_ptr``: a call whose K/V are
    another node's, ring_core.nodes) after its queries' ids; else the queries' own (a rank's tokens serve its
    queries and its keys). Everything about keys reads them here: the local step, the pushes (the ids travel with
    the K/V), the chunks' published ranges; everything about queries reads ``seg_ptr``: tiles, the halves' ranges."""
    if KV_IDS:
        return seg_ptr + (S * 0 + B).to(tl.int64) * S
    else:
        return seg_ptr


@triton.jit
def start_clock(INTERPRET: tl.constexpr):
    if INTERPRET:
        return 0  # no clock in the interpreter: still_waiting counts polls instead
    else:
        return _globaltimer()


@triton.jit
def still_waiting(ok, polls, t0, ctl, timeout_ns, INTERPRET: tl.constexpr):
    """The bound of every spin-wait, after ``polls`` polls: 0 once this rank has recorded an error (nothing
    downstream can be trusted) or ``timeout_ns`` has passed since ``t0``; else ``ok`` unchanged."""
    if (polls % 64) == 0:
        if tl.atomic_add(ctl + CTL_ERROR, 0, sem="relaxed", scope="gpu") != 0:
            ok = ok * 0
        if not INTERPRET:
            if _globaltimer() - t0 > timeout_ns:
                ok = ok * 0
    if INTERPRET:
        # No clock in the interpreter: count polls. One costs about 0.3 ms of host time on the 2-core CI
        # machines (measured 0.38 ms), so the limit is approximate there.
        if polls > timeout_ns // 300000:
            ok = ok * 0
    return ok


@triton.jit
def poll_ge(ptr, target, ctl, timeout_ns, INTERPRET: tl.constexpr):
    """Spin (acquire, system scope) until ``*ptr >= target``; returns 1 if met, 0 on timeout or if this
    rank already recorded an error (then nothing downstream is trustworthy, so give up at once)."""
    val = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    err = tl.atomic_add(ctl + CTL_ERROR, 0, sem="relaxed", scope="gpu")
    ok = (err == 0).to(tl.int32)
    polls = ok * 0
    t0 = start_clock(INTERPRET)
    while (val < target) & (ok == 1):
        val = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        polls += 1
        ok = still_waiting(ok, polls, t0, ctl, timeout_ns, INTERPRET)
    return ok & (val >= target).to(tl.int32)


@triton.jit
def poll_all_ge(ptrs, mask, target, ctl, timeout_ns, INTERPRET: tl.constexpr, N: tl.constexpr):
    """Vector form of ``poll_ge``: spin until every masked ``*ptrs >= target``, polling all of them in one
    round trip (the threads of the CTA share the N flags) instead of one flag after another: a tile reads up
    to hundreds of chunks per ring step, and sequential polls cost about a microsecond each. Returns
    (1 if met else 0, index of the first flag still short)."""
    val = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
    short = mask & (val < target)
    n_short = tl.sum(short.to(tl.int32), axis=0)
    err = tl.atomic_add(ctl + CTL_ERROR, 0, sem="relaxed", scope="gpu")
    ok = (err == 0).to(tl.int32)
    polls = ok * 0
    t0 = start_clock(INTERPRET)
    while (n_short > 0) & (ok == 1):
        val = tl.atomic_add(ptrs, 0, mask=short, sem="acquire", scope="sys")
        short = short & (val < target)
        n_short = tl.sum(short.to(tl.int32), axis=0)
        polls += 1
        ok = still_waiting(ok, polls, t0, ctl, timeout_ns, INTERPRET)
    first = tl.min(tl.where(short, iota(N), N), axis=0)
    return ok & (n_short == 0).to(tl.int32), first


@triton.jit
def record_error(ctl, code, peer, step, chunk):
    """Record (code, peer, step, chunk) unless an error is already recorded (first error wins); returns
    whether this one was recorded."""
    won = tl.atomic_cas(ctl + CTL_ERROR, 0, code, sem="acq_rel", scope="gpu")
    if won == 0:
        tl.atomic_xchg(ctl + CTL_ERROR_PEER, peer, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctl + CTL_ERROR_STEP, step, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctl + CTL_ERROR_CHUNK, chunk, sem="relaxed", scope="gpu")
    return won == 0


@triton.jit
def call_words(KIND: tl.constexpr, B, S, sm_scale, W: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr,
               D: tl.constexpr, SIG_DTYPE: tl.constexpr, CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr,
               CHUNK_ROWS: tl.constexpr, BLOCK: tl.constexpr, WIN_LEFT: tl.constexpr,
               WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr):
    """This call's signature words 1..14 (word 0, the epoch, is left 0): ring_core.protocol.control.call_signature
    builds the same words on the host, which is how the host describes a mismatch."""
    i = iota(SIG_WORDS)
    zero = i * 0
    w = tl.where(i == 1, KIND, zero)
    w = tl.where(i == 2, W, w)
    w = tl.where(i == 3, zero + B, w)  # B, S: runtime scalars (or the constant 1 Triton specialised)
    w = tl.where(i == 4, zero + S, w)
    w = tl.where(i == 5, H, w)
    w = tl.where(i == 6, HKV, w)
    w = tl.where(i == 7, D, w)
    w = tl.where(i == 8, SIG_DTYPE, w)
    if CAUSAL:
        w = tl.where(i == 9, w + 1, w)
    if ZIGZAG:
        w = tl.where(i == 9, w + 2, w)
    if SEGMENTED:
        w = tl.where(i == 9, w + 4, w)
    w = tl.where(i == 10, (zero.to(tl.float32) + sm_scale).to(tl.int32, bitcast=True), w)  # scale's bits
    w = tl.where(i == 11, CHUNK_ROWS, w)
    w = tl.where(i == 12, BLOCK, w)
    if WIN_LEFT != NO_SIDE:  # the window's sides as control.side_word: 0 (no word written) is unbounded
        if WIN_LEFT >= 0:
            w = tl.where(i == 13, WIN_LEFT + 1, w)
        else:
            w = tl.where(i == 13, WIN_LEFT, w)
    if WIN_RIGHT != NO_SIDE:
        if WIN_RIGHT >= 0:
            w = tl.where(i == 14, WIN_RIGHT + 1, w)
        else:
            w = tl.where(i == 14, WIN_RIGHT, w)
    return w


@triton.jit
def check_call(ctl, heap_bases, rank, epoch, words, timeout_ns, W: tl.constexpr, INTERPRET: tl.constexpr,
               seg_ptr, kseg_ptr, rng, B, S, n_chunks, CHUNK_ROWS: tl.constexpr, ZIGZAG: tl.constexpr,
               ID_RANGES: tl.constexpr):
    """Before anything is pushed to or read from a peer: make sure every rank makes the same call.

    The first program of the call on this rank publishes the signature ``words`` (see call_words) into
    this rank's inbox slot on every peer (words, then the epoch with a release; with ID_RANGES, the
    segment-id ranges before them, ``publish_id_ranges``, which the same acquire covers). Every program then waits
    (bounded) for every peer's slot to hold this epoch and compares. Returns 1 if all agree. Otherwise
    records ERR_MISMATCH (a field differs; detail: index of the first differing word), ERR_EPOCH (a peer
    is at another call) or ERR_START_TIMEOUT, with both signatures for the host's message, and returns
    0: the caller then sends nothing, so a peer's differently sized buffers are never written.

    A peer overwrites its slot here only for its next call, which it starts after the end barrier of
    this one, i.e. after every program of this rank has finished: a slot never changes while read."""
    i = iota(SIG_WORDS)
    mine = tl.where(i == 0, epoch, words)
    if tl.atomic_add(ctl + CTL_SIG_CLAIM, 1, sem="relaxed", scope="gpu") == 0:
        for p in tl.static_range(W):
            if p != rank:
                iris.store(ctl + CTL_SIG + rank * SIG_WORDS + i, mine, rank, p, heap_bases, mask=i > 0)
        if ID_RANGES:
            publish_id_ranges(seg_ptr, kseg_ptr, rng, heap_bases, rank, B, S, n_chunks, W, CHUNK_ROWS, ZIGZAG)
        tl.debug_barrier()  # every thread's words before the epoch (cumulativity through bar.sync)
        if ID_RANGES:  # this rank's own ranges, for its other programs (id_ranges_ready)
            tl.atomic_xchg(ctl + CTL_RANGES, epoch, sem="release", scope="gpu")
        for p in tl.static_range(W):
            if p != rank:
                iris.atomic_xchg(ctl + CTL_SIG + rank * SIG_WORDS, epoch, rank, p, heap_bases, sem="release",
                                 scope="sys")
    ok = epoch * 0 + 1
    for p in tl.static_range(W):
        if p != rank:
            slot = ctl + CTL_SIG + p * SIG_WORDS
            if poll_ge(slot, epoch, ctl, timeout_ns, INTERPRET) == 0:
                record_error(ctl, ERR_START_TIMEOUT, p, 0, -1)
                ok = ok * 0
            else:
                tl.debug_barrier()  # the loads below after the acquire (cumulativity through bar.sync)
                theirs = tl.load(slot + i, volatile=True)
                diff = (theirs != mine) & (i > 0)
                their_epoch = tl.sum(tl.where(i == 0, theirs, 0), axis=0)
                code = tl.where(their_epoch != epoch, ERR_EPOCH,
                                tl.where(tl.sum(diff.to(tl.int32), axis=0) > 0, ERR_MISMATCH, 0))
                if code != 0:
                    if record_error(ctl, code, p, tl.min(tl.where(diff, i, SIG_WORDS), axis=0), 0):
                        tl.store(ctl + CTL_ERR_SIG + i, theirs)
                        tl.store(ctl + CTL_ERR_SIG + SIG_WORDS + i, mine)
                    ok = ok * 0
    return ok


@triton.jit
def start_call(ctl, heap_bases, rank, epoch, timeout_ns, seg_ptr, kseg_ptr, rng, B, S, sm_scale, n_chunks,
               KIND: tl.constexpr, W: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
               SIG_DTYPE: tl.constexpr, CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, CHUNK_ROWS: tl.constexpr,
               BLOCK: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Every program of either kernel, before anything is sent or read: 1 if every rank makes this same call
    (``check_call`` on the signature ``call_words``; with W = 1 nothing to check) and, with segment ids (the
    queries' at ``seg_ptr``, the keys' at ``kseg_ptr``: ``key_ids``), this rank's own published id ranges are
    ready (``id_ranges_ready``: the range passes and pushes read them); else 0, and the caller sends nothing to a
    peer (every later wait then gives up at once)."""
    call_ok = epoch * 0 + 1
    if W > 1:
        words = call_words(KIND, B, S, sm_scale, W, H, HKV, D, SIG_DTYPE, CAUSAL, ZIGZAG, CHUNK_ROWS, BLOCK,
                           WIN_LEFT, WIN_RIGHT, SEGMENTED)
        call_ok = check_call(ctl, heap_bases, rank, epoch, words, timeout_ns, W, INTERPRET, seg_ptr, kseg_ptr, rng,
                             B, S, n_chunks, CHUNK_ROWS, ZIGZAG, SEGMENTED)
    if SEGMENTED:
        call_ok = call_ok * id_ranges_ready(ctl, kseg_ptr, rng, heap_bases, rank, epoch, timeout_ns, B, S, n_chunks, W,
                                            CHUNK_ROWS, ZIGZAG, INTERPRET)
    return call_ok


@triton.jit
def finish_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W: tl.constexpr, INTERPRET: tl.constexpr,
                STICKY_ERRORS: tl.constexpr):
    """The end of a call, run by the last program of this rank once every other one has finished: tell
    every peer, wait for every peer (the end barrier), copy the error record into ``status``, reset the
    shared counters and store ``epoch`` as the new call counter. With STICKY_ERRORS (JAX programs traced
    without a host callback per call) the first failed call's status is also kept in the control region
    until the host takes it (ring_core.runtime.heap.HeapRings.take_error).

    After an error every wait gives up at once, the barrier's too, except after a mismatch: the peers are
    alive and in the same call then (they published its signature), so the barrier waits for them as
    usual (bounded). Otherwise a rank could start its next call and overwrite its signature while a peer
    still compared it with this call's, and that peer would report the ranks' counters apart instead of
    the mismatch every rank reports."""
    tl.debug_barrier()  # every thread's loads below after the acquiring finish count
    held = tl.atomic_xchg(ctl + CTL_ERROR, 0, sem="acq_rel", scope="gpu")  # the error record, out of the way ...
    held_peer = tl.atomic_add(ctl + CTL_ERROR_PEER, 0, sem="relaxed", scope="gpu")
    held_step = tl.atomic_add(ctl + CTL_ERROR_STEP, 0, sem="relaxed", scope="gpu")
    if (held != 0) & (held != ERR_MISMATCH):
        tl.atomic_xchg(ctl + CTL_ERROR, held, sem="relaxed", scope="gpu")  # ... unless the barrier must give up
    for p in tl.static_range(W):
        if p != rank:
            iris.atomic_xchg(ctl + CTL_BARRIER + rank, epoch, rank, p, heap_bases, sem="release", scope="sys")
    for p in tl.static_range(W):
        if p != rank:
            ok = poll_ge(ctl + CTL_BARRIER + p, epoch, ctl, timeout_ns, INTERPRET)
            if ok == 0:
                record_error(ctl, ERR_BARRIER_TIMEOUT, p, W, -1)
    code = tl.atomic_xchg(ctl + CTL_ERROR, 0, sem="acq_rel", scope="gpu")
    peer = tl.atomic_xchg(ctl + CTL_ERROR_PEER, 0, sem="relaxed", scope="gpu")
    step = tl.atomic_xchg(ctl + CTL_ERROR_STEP, 0, sem="relaxed", scope="gpu")
    first = held != 0  # the first error wins
    tl.store(status_ptr + 0, tl.where(first, held, code))
    tl.store(status_ptr + 1, tl.where(first, held_peer, peer))
    tl.store(status_ptr + 2, tl.where(first, held_step, step))
    tl.store(status_ptr + 3, epoch)
    sig = iota(2 * SIG_WORDS)
    tl.store(status_ptr + 4 + sig, tl.load(ctl + CTL_ERR_SIG + sig, volatile=True))
    tl.store(ctl + CTL_ERR_SIG + sig, sig * 0)
    final = tl.where(first, held, code)
    if STICKY_ERRORS and final != 0:
        if tl.atomic_cas(ctl + CTL_STICKY, 0, final, sem="acq_rel", scope="gpu") == 0:
            tl.debug_barrier()  # this program's status stores above before the loads below
            words = iota(64)
            keep = (words > 0) & (words < STATUS_WORDS)
            tl.store(ctl + CTL_STICKY + words, tl.load(status_ptr + words, mask=keep, volatile=True), mask=keep)
    tl.atomic_xchg(ctl + CTL_ERROR_CHUNK, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctl + CTL_CLAIM, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctl + CTL_SIG_CLAIM, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctl + CTL_RANGES_DONE, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctl + CTL_FINISH, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctl + CTL_EPOCH, epoch, sem="release", scope="gpu")


@triton.jit
def positions(rows, rank, S, W: tl.constexpr, ZIGZAG: tl.constexpr):
    if ZIGZAG:
        c = S // 2
        return tl.where(rows < c, rank * c + rows, (2 * W - 1 - rank) * c + (rows - c))
    else:
        return rank * S + rows


@triton.jit
def visible_rows(x, src, S, W: tl.constexpr, ZIGZAG: tl.constexpr):
    """How many of rank ``src``'s local rows have a global position <= ``x``. Positions increase with the
    local row in both layouts (zigzag: chunk ``src`` comes before chunk ``2W-1-src``), so these rows are
    a prefix of the shard; causal work is a prefix of K/V blocks, and no block beyond it is touched."""
    if ZIGZAG:
        c = S // 2
        n1 = tl.minimum(tl.maximum(x - src * c + 1, 0), c)
        n2 = tl.minimum(tl.maximum(x - (2 * W - 1 - src) * c + 1, 0), c)
        return n1 + n2
    else:
        return tl.minimum(tl.maximum(x - src * S + 1, 0), S)


@triton.jit
def last_pos(rank, S, W: tl.constexpr, ZIGZAG: tl.constexpr):
    """Global position of ``rank``'s last local row: the largest, positions grow with the row index."""
    return positions(rank * 0 + S - 1, rank, S, W, ZIGZAG)


@triton.jit
def block_range(q_pos_min, q_pos_max, src, S, W: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                ZIGZAG: tl.constexpr):
    """For queries at positions [q_pos_min, q_pos_max] against rank ``src``'s K/V: (rows any of them sees,
    blocks to visit, blocks every one of them sees whole). Blocks [n_full, n_hi) need masks."""
    if CAUSAL:
        seen = visible_rows(q_pos_max, src, S, W, ZIGZAG)
        n_full = visible_rows(q_pos_min, src, S, W, ZIGZAG) // BLOCK_N
    else:
        seen = S
        n_full = S // BLOCK_N
    return seen, tl.cdiv(seen, BLOCK_N), n_full


# ---- masks beyond causal: windows by position, segment ids by value ---------------------------------------------
BIG_ID = tl.constexpr(control.BIG_ID)
NO_SIDE = tl.constexpr(control.NO_SIDE)  # an unbounded side of the window


@triton.jit
def query_intervals(r0, r1, rank, S, W: tl.constexpr, ZIGZAG: tl.constexpr):
    """The global positions of ``rank``'s local rows [r0, r1) (r0 < r1) as two runs of consecutive positions,
    [a1, b1] then [a2, b2], either empty (a > b): zigzag, the rows in the shard's first chunk, then those in its
    second; contiguous, one run (the second empty)."""
    if ZIGZAG:
        c = S // 2
        a1 = rank * c + r0
        b1 = rank * c + tl.minimum(r1, c) - 1
        base2 = (2 * W - 2 - rank) * c  # position of row r >= c: base2 + r
        a2 = base2 + tl.maximum(r0, c)
        b2 = base2 + r1 - 1
    else:
        a1 = rank * S + r0
        b1 = rank * S + r1 - 1
        a2 = a1 * 0 + 1
        b2 = a1 * 0
    return a1, b1, a2, b2


@triton.jit
def span_rows(a, b, src, S, W: tl.constexpr, ZIGZAG: tl.constexpr, CAUSAL: tl.constexpr, WIN_LEFT: tl.constexpr,
              WIN_RIGHT: tl.constexpr, KEYS: tl.constexpr):
    """Rows [lo, hi) of rank ``src``'s shard within reach of positions a..b (hi <= lo: none). Positions grow with
    the local row in both layouts, so the rows at positions in an interval are one run.
    KEYS: src's keys within reach of queries at a..b, positions [a - left, b + right] (right = 0 under causal
    masking; an unbounded side, -1, reaches the shard's end). For a <= b those are the keys *some* query in
    a..b sees; called with a = the largest query position and b = the smallest, those *every* one sees.
    Not KEYS, the transpose: src's queries within reach of keys at a..b, positions [a - right, b + left]."""
    lo = a * 0
    hi = a * 0 + S
    if KEYS:
        if WIN_LEFT != NO_SIDE:
            lo = visible_rows(a - WIN_LEFT - 1, src, S, W, ZIGZAG)
        if CAUSAL:
            hi = visible_rows(b, src, S, W, ZIGZAG)
        elif WIN_RIGHT != NO_SIDE:
            hi = visible_rows(b + WIN_RIGHT, src, S, W, ZIGZAG)
    else:
        if CAUSAL:
            lo = visible_rows(a - 1, src, S, W, ZIGZAG)
        elif WIN_RIGHT != NO_SIDE:
            lo = visible_rows(a - WIN_RIGHT - 1, src, S, W, ZIGZAG)
        if WIN_LEFT != NO_SIDE:
            hi = visible_rows(b + WIN_LEFT, src, S, W, ZIGZAG)
    return lo, hi


@triton.jit
def rows_within(r0, r1, owner, other, S, W: tl.constexpr, ZIGZAG: tl.constexpr, CAUSAL: tl.constexpr,
                WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, KEYS: tl.constexpr):
    """For the tokens of ``owner``'s local rows [r0, r1) (KEYS: queries; else keys), the rows of rank ``other``
    (KEYS: its keys; else its queries) that the mask's positions let meet them: ``[lo1, hi1) | [lo2, hi2)``,
    the rows some token of each run (``query_intervals``) reaches, each (0, 0) when empty, the first run's
    before the second's (lo1 <= lo2, hi1 <= hi2); and ``[f_lo, f_hi)`` ((0, 0) when empty), the rows every
    token of [r0, r1) reaches. Causal masking and the window only: segment ids are values, not positions."""
    a1, b1, a2, b2 = query_intervals(r0, r1, owner, S, W, ZIGZAG)
    lo1, hi1 = span_rows(a1, b1, other, S, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT, KEYS)
    ne1 = (hi1 > lo1) & (a1 <= b1)
    lo2, hi2 = span_rows(a2, b2, other, S, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT, KEYS)
    ne2 = (hi2 > lo2) & (a2 <= b2)
    first = tl.where(a1 <= b1, a1, a2)
    last = tl.where(a2 <= b2, b2, b1)
    f_lo, f_hi = span_rows(last, first, other, S, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT, KEYS)
    nef = f_hi > f_lo
    return (tl.where(ne1, lo1, 0), tl.where(ne1, hi1, 0), tl.where(ne2, lo2, 0), tl.where(ne2, hi2, 0),
            tl.where(nef, f_lo, 0), tl.where(nef, f_hi, 0))


@triton.jit
def overlaps(r0, r1, lo, hi):
    """Whether rows [r0, r1) meet the run [lo, hi)."""
    return (hi > lo) & (r0 < hi) & (r1 > lo)


@triton.jit
def in_rows(rows, lo1, hi1, lo2, hi2):
    return ((rows >= lo1) & (rows < hi1)) | ((rows >= lo2) & (rows < hi2))


@triton.jit
def row_blocks(lo1, hi1, lo2, hi2, f_lo, f_hi, BLOCK: tl.constexpr):
    """(j_lo, nf_lo, nf_hi, j_hi): blocks of BLOCK rows [j_lo, j_hi) cover the rows [lo1, hi1) | [lo2, hi2)
    (``rows_within``); the blocks [nf_lo, nf_hi), inside them, lie whole within [f_lo, f_hi). Between j_lo
    and j_hi, blocks outside [nf_lo, nf_hi) need masks."""
    lo = tl.where(hi1 > lo1, lo1, lo2)
    hi = tl.where(hi2 > lo2, hi2, hi1)
    j_lo = lo // BLOCK
    j_hi = tl.maximum(tl.cdiv(hi, BLOCK), j_lo)
    nf_lo = tl.minimum(tl.maximum(tl.cdiv(f_lo, BLOCK), j_lo), j_hi)
    nf_hi = tl.maximum(tl.minimum(f_hi // BLOCK, j_hi), nf_lo)
    return j_lo, nf_lo, nf_hi, j_hi


@triton.jit
def step_blocks(m_lo, m_hi, q_pos_min, q_pos_max, s_hi, rank, src, S, W: tl.constexpr, BLOCK_N: tl.constexpr,
                ZIGZAG: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr,
                WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr):
    """Which of rank ``src``'s K/V blocks (BLOCK_N rows) a query tile (local rows [m_lo, m_hi), positions
    [q_pos_min, q_pos_max], largest segment id ``s_hi``) visits at one ring step, for a forward tile and a
    backward dQ task alike: (j_lo, n_full_lo, n_full, n_hi, lo1, hi1, lo2, hi2, seen). Blocks [n_full_lo,
    n_full) run unmasked, [j_lo, n_full_lo) and [n_full, n_hi) masked; no other block is waited for, loaded or
    computed. With a window or segment ids: the rows some query sees by position, [lo1, hi1) | [lo2, hi2) (two
    runs for a zigzag tile holding rows of both chunks), every query [f_lo, f_hi) (``rows_within``); a tile of
    padding rows (s_hi < 0) sees none; ``seen`` is then 0. Otherwise (causal or nothing) the blocks of
    ``block_range``, ``seen`` its visible rows, no row runs."""
    if WINDOW or SEGMENTED:
        lo1, hi1, lo2, hi2, f_lo, f_hi = rows_within(m_lo, m_hi, rank, src, S, W, ZIGZAG, CAUSAL, WIN_LEFT,
                                                     WIN_RIGHT, True)
        if SEGMENTED:
            keep = (s_hi >= 0).to(tl.int32)  # a tile of padding rows attends nothing: no wait, no load
            lo1, hi1, lo2, hi2, f_lo, f_hi = (lo1 * keep, hi1 * keep, lo2 * keep, hi2 * keep, f_lo * keep,
                                              f_hi * keep)
        j_lo, n_full_lo, n_full, n_hi = row_blocks(lo1, hi1, lo2, hi2, f_lo, f_hi, BLOCK_N)
        seen = n_hi * 0
    else:
        seen, n_hi, n_full = block_range(q_pos_min, q_pos_max, src, S, W, BLOCK_N, CAUSAL, ZIGZAG)
        j_lo = n_full * 0
        n_full_lo = j_lo
        lo1, hi1, lo2, hi2 = j_lo, j_lo, j_lo, j_lo
    return j_lo, n_full_lo, n_full, n_hi, lo1, hi1, lo2, hi2, seen


@triton.jit
def block_rows(j, offs_n, src, S, q_pos_max, lo1, hi1, lo2, hi2, seg_k, s_lo, s_hi, rng_src_b, a_lo, a_hi, b_lo, b_hi,
               W: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, WINDOW: tl.constexpr, SEGMENTED: tl.constexpr,
               ID_SKIP: tl.constexpr, CAUSAL_ROWS: tl.constexpr):
    """Which rows of rank ``src``'s K/V block ``j`` a query tile reads, for a forward tile and a backward dQ task
    alike: (rows, row_ok, k_pos, k_seg). Unmasked (MASKED=False): every row of the block exists and is read.
    Masked: rows within the shard; with a window or segment ids only rows [lo1, hi1) | [lo2, hi2) (other rows
    may not have been sent); with CAUSAL_ROWS (the backward, whose pushes send a chunk's visible rows only) and
    causal masking alone, rows at positions <= ``q_pos_max``; with ID_SKIP none of a chunk whose published id
    range misses the tile's (it was not sent: ``push_unit``); with segment ids, rows whose id (read from
    ``seg_k`` once the row is known to be there) lies in [s_lo, s_hi]. ``k_pos``: the rows' global positions
    (unused, hence folded away, without CAUSAL and WINDOW); ``k_seg``: their ids under SEGMENTED."""
    rows = j * BLOCK_N + offs_n
    row_ok = rows < S
    k_pos = rows
    k_seg = rows  # the block's ids under SEGMENTED (read only then)
    if MASKED:
        k_pos = positions(rows, src, S, W, ZIGZAG)
        if WINDOW or SEGMENTED:
            row_ok = row_ok & in_rows(rows, lo1, hi1, lo2, hi2)
        elif CAUSAL_ROWS and CAUSAL:
            row_ok = row_ok & (k_pos <= q_pos_max)
        if ID_SKIP:  # a block lies within one chunk (chunks are whole blocks)
            met = id_range_meets(rng_src_b, (j * BLOCK_N) // CHUNK_ROWS, a_lo, a_hi, b_lo, b_hi)
            row_ok = tl.where(met, row_ok, False)  # (block & scalar: the interpreter mistypes the mask)
        if SEGMENTED:
            k_seg = tl.load(seg_k + rows, mask=row_ok, other=-1)
            row_ok = row_ok & (k_seg >= s_lo) & (k_seg <= s_hi)
    return rows, row_ok, k_pos, k_seg


@triton.jit
def rows_seen(r0, r1, src, dst, S, W: tl.constexpr, ZIGZAG: tl.constexpr, CAUSAL: tl.constexpr,
              WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr):
    """With a window: whether some query of rank ``dst`` sees, by position, a row of rank ``src``'s K/V rows
    [r0, r1). Both sides of every skipped transfer decide with it: the pusher whether to send and flag a chunk
    and a receiving task whether to wait for it (``chunk_needed``); a backward partial task whether to compute
    and send its block's partial, and the block's owner whether to wait for it. One function, so the sides
    agree."""
    lo1, hi1, lo2, hi2, _, _ = rows_within(0, S, dst, src, S, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT, True)
    return overlaps(r0, r1, lo1, hi1) | overlaps(r0, r1, lo2, hi2)


@triton.jit
def chunk_needed(c, src, dst, S, CHUNK_ROWS, W: tl.constexpr, ZIGZAG: tl.constexpr, CAUSAL: tl.constexpr,
                 WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr):
    """With a window: whether rank ``src`` pushes chunk ``c`` of its K/V to rank ``dst`` (``rows_seen``)."""
    return rows_seen(c * CHUNK_ROWS, tl.minimum(S, c * CHUNK_ROWS + CHUNK_ROWS), src, dst, S, W, ZIGZAG, CAUSAL,
                     WIN_LEFT, WIN_RIGHT)


@triton.jit
def pairs_allowed(valid, q_pos, k_pos, q_seg, k_seg, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr,
                  WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr, KEYED: tl.constexpr = False):
    """``valid`` and ring_core.masks.allowed, in the kernels: query positions ``q_pos`` and ids ``q_seg`` against
    key positions ``k_pos`` and ids ``k_seg``, already broadcast against each other ([M, 1] x [1, N] or the
    transpose). An argument a setting does not use is never read (the positions without CAUSAL and WINDOW, the
    ids without SEGMENTED). A padding key (id < 0) is attended by nobody, a padding query attends nothing.
    KEYED: the ids come as ``segment_keys`` made them (each side's padding one negative number of its own), and the
    segment test is their equality alone: one compare a pair instead of two (the Gluon kernels' masked steps: 15 %
    fewer instructions in the backward's, no change in time measured, one H200)."""
    if CAUSAL:
        valid = valid & (k_pos <= q_pos)
    if WINDOW:
        if WIN_LEFT != NO_SIDE:
            valid = valid & (k_pos >= q_pos - WIN_LEFT)
        if WIN_RIGHT != NO_SIDE:
            valid = valid & (k_pos <= q_pos + WIN_RIGHT)
    if SEGMENTED:
        if KEYED:
            valid = valid & (q_seg == k_seg)
        else:
            valid = valid & (q_seg == k_seg) & (k_seg >= 0)
    return valid


QUERY_PAD = tl.constexpr(-2)  # a padding query's key (segment_keys)
KEY_PAD = tl.constexpr(-3)  # a padding key's: no query's


@triton.jit
def segment_keys(ids, PAD: tl.constexpr):
    """Segment ids as ``pairs_allowed(..., KEYED=True)`` takes them: every padding id (< 0) replaced by ``PAD``,
    ``QUERY_PAD`` for queries' ids and ``KEY_PAD`` for keys', so that a query's key equals a key's exactly where the
    ids are equal and the key's is not padding (the rule's two compares), and a padding query meets no key. Made once
    per row or column (a vector), not per pair."""
    return tl.where(ids >= 0, ids, PAD)


@triton.jit
def tile_ids(seg_base, rows, row_ok, SEGMENTED: tl.constexpr):
    """A tile's segment ids and what the skipping needs of them: (ids (-1 where not ``row_ok``), s_lo, s_hi, t):
    [s_lo, s_hi] bounds its non-padding ids (s_hi < 0: every row is padding, the tile attends nothing); t is its
    one id when every row carries the same id >= 0, else -2. Without segment ids (SEGMENTED=False): zeros, never
    read (nothing is loaded)."""
    if SEGMENTED:
        ids = tl.load(seg_base + rows, mask=row_ok, other=-1)
        s_lo, s_hi, t = ids_summary(ids, row_ok)
    else:
        ids = rows * 0
        s_lo = tl.program_id(0) * 0
        s_hi = s_lo
        t = s_lo
    return ids, s_lo, s_hi, t


@triton.jit
def ids_summary(ids, row_ok):
    """``tile_ids``' (s_lo, s_hi, t) of ids already loaded (-1 where not ``row_ok``)."""
    s_lo = tl.min(tl.where(ids >= 0, ids, BIG_ID), axis=0)
    s_hi = tl.max(ids, axis=0)
    u_lo = tl.min(tl.where(row_ok, ids, BIG_ID), axis=0)
    return s_lo, s_hi, tl.where((u_lo == s_hi) & (u_lo >= 0), u_lo, -2)


@triton.jit
def seg_blocks(seg_base, j_lo, j_hi, lo1, hi1, lo2, hi2, nf_lo, nf_hi, s_lo, s_hi, t, BLOCK: tl.constexpr,
               rng_src_b, a_lo, a_hi, b_lo, b_hi, CHUNK_ROWS: tl.constexpr, ID_SKIP: tl.constexpr,
               NARROW: tl.constexpr = True):
    """The range pass of segment ids, before a loop over blocks [j_lo, j_hi) of BLOCK rows of the other side
    (keys for a query tile, queries for a K/V block), whose ids are at ``seg_base`` and which may be read only
    in rows [lo1, hi1) | [lo2, hi2) (rows another rank did not send are never read). A block whose non-padding
    ids all lie outside [s_lo, s_hi] (the tile's, ``tile_ids``) holds no pair the tile attends. Returns
    (first, f_first, f_end, end): every block that may hold one lies in [first, end), so the loops skip the
    rest (neither loaded nor computed); [f_first, f_end) within it are the blocks of [nf_lo, nf_hi) (whole
    by position) whose every row carries the tile's one id t: no mask, the plain loop. Exact for packed
    sequences (ids non-decreasing with the position: the blocks that meet the tile are one run, and so are
    those of its one id); for any other ids the loops still mask each pair, they only skip less.

    First the published ranges of the rows' owner (``rng_src_b``: its CHUNK_ROWS-row chunks' [min, max], batch
    b; this rank's own once ``id_ranges_ready``) narrow [j_lo, j_hi) to the chunks from the first whose range
    meets the tile's parts ([a_lo, a_hi] | [b_lo, b_hi], which lie within [s_lo, s_hi]) to the last: one vector
    of words instead of every id, so the id pass below reads only the run near the tile's documents. A block of
    a chunk whose range misses the tile's holds no pair either, so the result is the same as without it
    (NARROW=False: without it, where the published ranges are not the rows': a backward's local queries, whose
    chunks' ranges are the keys' under KV_IDS, ``key_ids``). With
    ID_SKIP (received K/V, segment ids), rows of chunks whose published range misses the tile's
    (``tile_id_parts``) are not read: such a chunk was not sent (``push_unit``), and none of its rows can hold a
    pair."""
    RC: tl.constexpr = 256  # chunks per vector step of the narrowing
    offs_c = tl.arange(0, RC)
    r_hi = tl.maximum(tl.where(hi2 > lo2, hi2, 0), tl.where(hi1 > lo1, hi1, 0))  # rows that may be read: < r_hi
    c_lo = (j_lo * BLOCK) // CHUNK_ROWS
    c_hi = tl.where(j_hi > j_lo, tl.cdiv(tl.minimum(j_hi * BLOCK, r_hi), CHUNK_ROWS), c_lo)
    if NARROW:
        c_first = c_hi
        c_end = c_lo
        for c0 in range(c_lo, c_hi, RC):
            c = c0 + offs_c
            hit = id_ranges_meet(rng_src_b, c, a_lo, a_hi, b_lo, b_hi, c < c_hi)
            c_first = tl.minimum(c_first, tl.min(tl.where(hit, c, c_hi), axis=0))
            c_end = tl.maximum(c_end, tl.max(tl.where(hit, c + 1, c_lo), axis=0))
        j_lo = tl.maximum(j_lo, (c_first * CHUNK_ROWS) // BLOCK)
        j_hi = tl.maximum(tl.minimum(j_hi, tl.cdiv(c_end * CHUNK_ROWS, BLOCK)), j_lo)
    RB: tl.constexpr = 2048 // BLOCK  # blocks per vector step (2048 ids)
    offs_b = tl.arange(0, RB)
    offs_r = tl.arange(0, BLOCK)
    first = j_hi
    end = j_lo
    f_first = j_hi
    f_end = j_lo
    n_full = j_lo * 0
    for j0 in range(j_lo, j_hi, RB):
        blk = j0 + offs_b
        rows = blk[:, None] * BLOCK + offs_r[None, :]
        ok = in_rows(rows, lo1, hi1, lo2, hi2) & (blk < j_hi)[:, None]
        if ID_SKIP:
            ok = ok & id_ranges_meet(rng_src_b, (blk * BLOCK) // CHUNK_ROWS, a_lo, a_hi, b_lo, b_hi,
                                     blk < j_hi)[:, None]
        ids = tl.load(seg_base + rows, mask=ok, other=-1)
        mine = ok & (ids >= 0)
        k_min = tl.min(tl.where(mine, ids, BIG_ID), axis=1)
        k_max = tl.max(tl.where(mine, ids, -1), axis=1)
        a_min = tl.min(tl.where(ok, ids, BIG_ID), axis=1)
        hit = (k_min <= s_hi) & (k_max >= s_lo)
        full = hit & (a_min == t) & (k_max == t) & (blk >= nf_lo) & (blk < nf_hi)
        first = tl.minimum(first, tl.min(tl.where(hit, blk, j_hi), axis=0))
        end = tl.maximum(end, tl.max(tl.where(hit, blk + 1, j_lo), axis=0))
        f_first = tl.minimum(f_first, tl.min(tl.where(full, blk, j_hi), axis=0))
        f_end = tl.maximum(f_end, tl.max(tl.where(full, blk + 1, j_lo), axis=0))
        n_full += tl.sum(full.to(tl.int32), axis=0)
    end = tl.maximum(end, first)
    one_run = (n_full > 0) & (n_full == f_end - f_first)
    return first, tl.where(one_run, f_first, end), tl.where(one_run, f_end, end), end


@triton.jit
def block_met(blk, lo1, hi1, lo2, hi2, c_lo, c_hi, a_lo, a_hi, b_lo, b_hi, BLOCK: tl.constexpr,
              SEGMENTED: tl.constexpr):
    """For a tile that reads whole blocks of BLOCK rows (the Gluon forward, ring_core.kernels.gluon_fwd): whether it
    loads block ``blk`` (a scalar or a vector) of the other side's K/V: the block meets the rows some query of the
    tile sees by position, [lo1, hi1) | [lo2, hi2) (``step_blocks``), and, with segment ids, its chunk's published
    range [c_lo, c_hi] (``chunk_ranges``) meets the tile's ids (``tile_id_parts``). Such a block was sent whole
    (chunks are whole blocks, and ``push_unit`` sends a chunk that a query of the receiver sees by position and whose
    range meets a half of the receiver's, which holds the tile's part), so a block read whole holds no row left by an
    earlier call."""
    r0 = blk * BLOCK
    met = overlaps(r0, r0 + BLOCK, lo1, hi1) | overlaps(r0, r0 + BLOCK, lo2, hi2)
    if SEGMENTED:
        met = met & ranges_meet(c_lo, c_hi, a_lo, a_hi, b_lo, b_hi)
    return met


@triton.jit
def chunk_ranges(rng_src_b, c, mask):
    """The published [lo, hi] of chunks ``c`` (a scalar or a vector; rank src's, batch b: ``rng_src_b``), (BIG_ID,
    -1) where not ``mask``, by ordinary loads (cached: the words do not change during a call): only after the program
    acquired them (``start_call``: the call check's acquire, or ``id_ranges_ready``'s, and a barrier after it)."""
    lo = -1 - tl.load(rng_src_b + c * 2, mask=mask, other=-1 - BIG_ID)
    hi = -1 - tl.load(rng_src_b + c * 2 + 1, mask=mask, other=0)
    return lo, hi


@triton.jit
def met_blocks(j_lo, j_hi, lo1, hi1, lo2, hi2, rng_src_b, a_lo, a_hi, b_lo, b_hi, BLOCK: tl.constexpr,
               CHUNK_ROWS: tl.constexpr, SEGMENTED: tl.constexpr, RB: tl.constexpr = 256):
    """``block_met`` over blocks [j_lo, j_hi), a vector of them at a time: (first, end, count), every block met
    lies in [first, end) (first = end: none), ``count`` of them, RB blocks per vector step. The Gluon forward's plan
    of a ring step: its consumers need the count before the loop, its load partition the run to test block by
    block."""
    offs = iota(RB)
    first = j_hi
    end = j_lo
    count = j_lo * 0
    for j0 in range(j_lo, j_hi, RB):
        blk = j0 + offs
        c_lo, c_hi = blk, blk  # (unused without ids)
        if SEGMENTED:
            c_lo, c_hi = chunk_ranges(rng_src_b, (blk * BLOCK) // CHUNK_ROWS, blk < j_hi)
        met = block_met(blk, lo1, hi1, lo2, hi2, c_lo, c_hi, a_lo, a_hi, b_lo, b_hi, BLOCK, SEGMENTED) & (blk < j_hi)
        first = tl.minimum(first, tl.min(tl.where(met, blk, j_hi), axis=0))
        end = tl.maximum(end, tl.max(tl.where(met, blk + 1, j_lo), axis=0))
        count += tl.sum(met.to(tl.int32), axis=0)
    return first, tl.maximum(end, first), count


@triton.jit
def bwd_task_steps(n0, d, src, rank, b, B, S, rng, rng_b, n_chunks, W: tl.constexpr, KV_ROWS: tl.constexpr,
                   Q_ROWS: tl.constexpr, CHUNK_ROWS: tl.constexpr, CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr,
                   WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr,
                   q_rng_b=None, Q_RANGE_ROWS: tl.constexpr = 128):
    """With a window or segment ids, for a backward that reads whole K/V blocks of KV_ROWS rows (chunks of one block)
    and steps over the local queries in blocks of Q_ROWS (the Gluon backward, ring_core.kernels.gluon_bwd): a dK/dV
    task's steps for K/V block [n0, n0 + KV_ROWS) of rank ``src`` (peer distance ``d``; ``rng_b``: this rank's published
    ranges of batch b, ``ranges_of``): (sent, i_lo, n_m, i_full, i_fend, kv_t).
    ``sent``: the block reaches this rank at all (``block_reaches``, the tl kernel's test too): some local query sees
    a row of it by position (the test its pusher made, chunks being blocks) and, with segment ids, its chunk's
    published id range meets a half of this rank's (the pusher's test again; the final task's own block always). A
    partial task sends its partial exactly then, the owner waits for it exactly then (``block_reaches`` from its
    side), whatever the steps below.
    The steps: query blocks [i_lo, i_lo + n_m) (0 unless sent) hold every local query the mask's positions let meet
    the block (``rows_within``, ``row_blocks``), narrowed with segment ids to the run of those whose chunk's
    published range meets the block's (``met_blocks``: ranges, not ids, so nothing waits here). A call whose keys'
    ids are not its queries' (KV_IDS) publishes its keys' chunk ranges: it gives ``q_rng_b``, its queries' ranges
    of batch b per Q_RANGE_ROWS rows in the same words (``query_ranges``), which narrow the blocks instead;
    in the run, blocks
    that hold no pair are computed with every pair masked (local queries: their rows are there; the block's keys
    were sent whole). [i_full, i_fend): the blocks whose every query sees every key by position; ``kv_t``: the
    block's one id where its published range is [t, t] (no padding), else -2 (``bwd_step_unmasked``,
    ``chunk_one_id``).
    tests/cpu/test_protocol_steps.py checks both against every pair the mask allows, in the interpreter."""
    ql1, qh1, ql2, qh2, qf_lo, qf_hi = rows_within(n0, n0 + KV_ROWS, src, rank, S, W, ZIGZAG, CAUSAL, WIN_LEFT,
                                                   WIN_RIGHT, False)
    i_lo, i_full, i_fend, i_hi = row_blocks(ql1, qh1, ql2, qh2, qf_lo, qf_hi, Q_ROWS)
    kv_t = n0 * 0 - 2
    c_lo = kv_t  # (read with segment ids only)
    c_hi = kv_t
    if SEGMENTED:
        c_lo, c_hi = published_range(rng, src, b, B, n_chunks, n0 // CHUNK_ROWS)
        kv_t = tl.where((c_lo == c_hi) & (c_lo >= 0), c_lo, -2)
    sent = block_reaches(n0, n0 + KV_ROWS, positions(n0, src, S, W, ZIGZAG), src, rank, rng, b, B, n_chunks, c_lo,
                         c_hi, d > 0, S, W, ZIGZAG, CAUSAL, WINDOW, WIN_LEFT, WIN_RIGHT, SEGMENTED)
    # The block's non-padding ids lie in [max(c_lo, 0), c_hi] (its lo counts padding as -1; a padding key is
    # attended by nobody): all padding, an empty range, no step.
    if SEGMENTED and q_rng_b is None:
        i_lo, i_hi, _ = met_blocks(i_lo, i_hi, ql1, qh1, ql2, qh2, rng_b, tl.maximum(c_lo, 0), c_hi, n0 * 0 + BIG_ID,
                                   n0 * 0 - 1, Q_ROWS, CHUNK_ROWS, SEGMENTED, 128)
    if SEGMENTED and q_rng_b is not None:
        i_lo, i_hi, _ = met_blocks(i_lo, i_hi, ql1, qh1, ql2, qh2, q_rng_b, tl.maximum(c_lo, 0), c_hi,
                                   n0 * 0 + BIG_ID, n0 * 0 - 1, Q_ROWS, Q_RANGE_ROWS, SEGMENTED, 128)
    sent = sent.to(tl.int32)
    return sent, i_lo, tl.where(sent != 0, i_hi - i_lo, 0), i_full, i_fend, kv_t


@triton.jit
def bwd_step_unmasked(m0, i_full, i_fend, Q_ROWS: tl.constexpr):
    """Whether a step of ``bwd_task_steps``' task over the query block at local row ``m0`` needs no mask by
    position: the block lies in [i_full, i_fend), where every query sees every key. With segment ids it also takes
    ``chunk_one_id`` of the block's chunk and the task's ``kv_t`` (the block's one id; no padding either)."""
    blk = m0 // Q_ROWS
    return (blk >= i_full) & (blk < i_fend)


@triton.jit
def chunk_one_id(rng_b, c, mask, t):
    """Whether chunk ``c``'s published range (``rng_b``: one rank's and batch's, ``ranges_of``) is [t, t]: every row
    of it carries id t (t = -2: never), read where ``mask``."""
    lo, hi = chunk_ranges(rng_b, c, mask)
    return (lo == t) & (hi == t)


# ---- segment-id ranges: what lets ids decide pushes and waits ----------------------------------------------------
# With segment ids the call check carries, with each rank's signature, the [min, max] of the non-padding ids of each
# of its K/V chunks and of each half of its shard (zigzag: the two chunks of the layout; contiguous: the shard, then
# an empty range), per batch (``publish_id_ranges``), into the ring slot's flag words after the K/V (and, backward,
# partial) flags: per rank p, [B][n_chunks + 2][lo, hi]. Words are stored as -1 - value (<= 0; an empty range is
# (BIG_ID, -1)), so no flag wait (>= an epoch >= 1) is ever met by a range word that a call of another shape left
# where its flags now lie. A chunk's lo counts its padding as -1 (a chunk with padding has lo = -1, one of padding
# only (-1, -1), which meets no tile's ids), so that lo = hi = t says every row of the chunk carries id t: a chunk
# of one document and no padding, which a tile of that one document attends unmasked (the Gluon forward,
# ring_core.kernels.gluon_fwd). Every test of these words is a meet of ranges (``ranges_meet``), which a lower lo only
# widens: a chunk with padding may be sent and waited for where none of its ids is attended, never the reverse,
# and sender and receiver still read the same words. The halves' ranges count ids >= 0 only (``id_range``).
@triton.jit
def id_range(seg_b, r0, r1, RP: tl.constexpr, PADDED: tl.constexpr):
    """[lo, hi] of the non-padding ids in rows [r0, r1) of one batch's ids at ``seg_b`` (lo > hi: none; hi >= -1),
    RP rows at a time; PADDED (a chunk's published range): a padding row counts as -1 in lo. Exact (integer min /
    max): whoever computes it for the same rows gets the same range."""
    offs = iota(RP)
    lo = r0 * 0 + BIG_ID
    hi = r0 * 0 - 1
    for a in range(r0, r1, RP):
        rows = a + offs
        ids = tl.load(seg_b + rows, mask=rows < r1, other=-1)
        if PADDED:
            ids_lo = tl.where(ids >= 0, ids, tl.where(rows < r1, -1, BIG_ID))
        else:
            ids_lo = tl.where(ids >= 0, ids, BIG_ID)
        lo = tl.minimum(lo, tl.min(ids_lo, axis=0))
        hi = tl.maximum(hi, tl.max(ids, axis=0))
    return lo, hi


@triton.jit
def half_rows(h, S, ZIGZAG: tl.constexpr):
    """Rows [r0, r1) of half ``h`` (0 or 1) of a shard: zigzag, its two chunks of S // 2 rows (positions apart);
    contiguous, the whole shard, then nothing."""
    if ZIGZAG:
        return h * (S // 2), S // 2 + h * (S - S // 2)
    else:
        return h * S, S


@triton.jit
def range_steps(n_chunks, CHUNK_ROWS: tl.constexpr):
    """How many steps of ``write_chunk_ranges`` write one batch's chunk ranges: one per 2048 ids (a vector of
    chunks), or one per chunk where a chunk has more rows."""
    if CHUNK_ROWS <= 2048:
        return (n_chunks + 2048 // CHUNK_ROWS - 1) // (2048 // CHUNK_ROWS)
    else:
        return n_chunks


@triton.jit
def write_chunk_ranges(seg_b, inbox, heap_bases, rank, S, n_chunks, step, W: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """Step ``step`` (of ``range_steps``) of one batch's chunk ranges (ids at ``seg_b``): the chunks of its 2048 ids
    (or its one chunk), written into ``inbox`` (this rank's, ``ranges_of``) on every rank of the ring."""
    if CHUNK_ROWS <= 2048:
        NC: tl.constexpr = 2048 // CHUNK_ROWS  # chunks per step
        c_col, offs_r = iota2(NC, CHUNK_ROWS)  # [NC, 1], [1, CHUNK_ROWS]
        c = step * NC + c_col
        rows = c * CHUNK_ROWS + offs_r
        ids = tl.load(seg_b + rows, mask=rows < S, other=-1)
        lo = tl.min(tl.where(ids >= 0, ids, tl.where(rows < S, -1, BIG_ID)), axis=1)  # padding: -1
        hi = tl.maximum(tl.max(ids, axis=1), -1)  # as id_range: >= -1, so every word is <= 0
        for p in tl.static_range(W):  # (lo and hi apart: one layout under Gluon, the chunks')
            iris.store(inbox + c * 2, -1 - lo[:, None], rank, p, heap_bases, mask=c < n_chunks)
            iris.store(inbox + c * 2 + 1, -1 - hi[:, None], rank, p, heap_bases, mask=c < n_chunks)
    else:
        _, two = iota2(1, 2)  # [1, 2]: lo, hi
        lo, hi = id_range(seg_b, step * CHUNK_ROWS, tl.minimum(S, step * CHUNK_ROWS + CHUNK_ROWS), 2048, True)
        words = -1 - tl.where(two == 0, lo, hi)
        for p in tl.static_range(W):
            iris.store(inbox + step * 2 + two, words, rank, p, heap_bases)


@triton.jit
def query_ranges(seg_b, q_rng_b, r0, ROWS: tl.constexpr):
    """The range words (``chunk_ranges``' encoding) of query rows [r0, r0 + ROWS) into entry r0 // ROWS of
    ``q_rng_b`` (one batch's table, local to the call): what ``bwd_task_steps`` narrows a KV_IDS call's query
    blocks with. The rule of ``write_chunk_ranges``: padding counts as -1 in lo, hi at least -1."""
    ids = tl.load(seg_b + r0 + iota(ROWS))
    lo = tl.min(tl.where(ids >= 0, ids, -1), axis=0)
    hi = tl.maximum(tl.max(ids, axis=0), -1)
    entry = q_rng_b + (r0 // ROWS) * 2
    tl.store(entry, -1 - lo)
    tl.store(entry + 1, -1 - hi)


@triton.jit
def publish_id_ranges(seg_ptr, kseg_ptr, rng, heap_bases, rank, B, S, n_chunks, W: tl.constexpr,
                      CHUNK_ROWS: tl.constexpr, ZIGZAG: tl.constexpr):
    """Write this rank's id ranges (per batch: each K/V chunk's, from the keys' ids at ``kseg_ptr``, then each
    half's, from the queries' at ``seg_ptr``: ``key_ids``) into its inbox of the range words on every rank of the
    ring, its own too (its programs read them there: the range pass, pushes, the backward's partial tests). Run by
    the program that publishes the call's signature (W > 1), before the signature's release (a peer that acquired
    the signature reads them after it) and before CTL_RANGES' release (this rank's programs, ``id_ranges_ready``;
    alone, W = 1, the programs share the chunks' steps there)."""
    four = iota(4)
    for b in range(B):
        seg_b = seg_ptr + (rank * 0 + b).to(tl.int64) * S  # the queries' (b may be a Python int in the interpreter)
        kseg_b = kseg_ptr + (rank * 0 + b).to(tl.int64) * S  # the keys'
        inbox = ranges_of(rng, rank, b, B, n_chunks)
        for step in range(range_steps(n_chunks, CHUNK_ROWS)):
            write_chunk_ranges(kseg_b, inbox, heap_bases, rank, S, n_chunks, step, W, CHUNK_ROWS)
        h0_lo, h0_hi, h1_lo, h1_hi = own_halves(seg_b, S, ZIGZAG)
        halves = tl.where(four == 0, h0_lo, tl.where(four == 1, h0_hi, tl.where(four == 2, h1_lo, h1_hi)))
        words = -1 - halves  # entries n_chunks and n_chunks + 1: [h0_lo, h0_hi, h1_lo, h1_hi]
        for p in tl.static_range(W):
            iris.store(inbox + n_chunks * 2 + four, words, rank, p, heap_bases)


@triton.jit
def id_ranges_ready(ctl, kseg_ptr, rng, heap_bases, rank, epoch, timeout_ns, B, S, n_chunks, W: tl.constexpr,
                    CHUNK_ROWS: tl.constexpr, ZIGZAG: tl.constexpr, INTERPRET: tl.constexpr):
    """With segment ids, before a program reads a range (its own rank's too): wait (acquire, bounded) until this
    rank's own ranges lie in its own inbox, CTL_RANGES = epoch. With peers the program that publishes the call's
    signature wrote them (``check_call``). Alone (W = 1) the programs of the call share the work: each takes steps
    of ``write_chunk_ranges`` (B x ``range_steps`` of them: 2048 ids each) from a counter (CTL_SIG_CLAIM, which no call
    check uses at W = 1) until none is left, counts each one done (CTL_RANGES_DONE, acq_rel), and whoever counts
    the last releases CTL_RANGES = epoch; the halves' ranges are not written at W = 1, where nothing reads them
    (they decide what reaches a peer: ``meets_halves``, always of another rank). Either way a program waits only
    for steps that running programs took before they wait for anything, so the wait ends. Returns 1, or 0 after
    recording ERR_START_TIMEOUT (or at once if an error is already recorded). A program that finds them published
    already (one acquire: epochs only grow, and CTL_RANGES = epoch is this call's) neither takes nor polls."""
    ok = epoch * 0
    if W == 1:
        ok = (tl.atomic_add(ctl + CTL_RANGES, 0, sem="acquire", scope="gpu") >= epoch).to(tl.int32)
        if ok == 0:
            per_b = range_steps(n_chunks, CHUNK_ROWS)
            n_steps = B * per_b
            t = tl.atomic_add(ctl + CTL_SIG_CLAIM, 1, sem="relaxed", scope="gpu")
            while t < n_steps:
                b = t // per_b
                write_chunk_ranges(kseg_ptr + b.to(tl.int64) * S, ranges_of(rng, rank, b, B, n_chunks), heap_bases,
                                   rank, S, n_chunks, t - b * per_b, W, CHUNK_ROWS)
                tl.debug_barrier()  # every thread's words before the count (cumulativity through bar.sync)
                if tl.atomic_add(ctl + CTL_RANGES_DONE, 1, sem="acq_rel", scope="gpu") == n_steps - 1:
                    tl.atomic_xchg(ctl + CTL_RANGES, epoch, sem="release", scope="gpu")  # every step's words seen
                t = tl.atomic_add(ctl + CTL_SIG_CLAIM, 1, sem="relaxed", scope="gpu")
    if ok == 0:
        ok = poll_ge(ctl + CTL_RANGES, epoch, ctl, timeout_ns, INTERPRET)
        if ok == 0:
            record_error(ctl, ERR_START_TIMEOUT, rank, 0, -1)
    tl.debug_barrier()  # every thread's range loads after the acquire (cumulativity through bar.sync)
    return ok


@triton.jit
def ranges_meet(lo, hi, a_lo, a_hi, b_lo, b_hi):
    """Whether [lo, hi] meets [a_lo, a_hi] or [b_lo, b_hi]; every range here is of ids >= 0 or empty (BIG_ID, -1),
    so an empty one meets nothing."""
    return (lo <= hi) & (((lo <= a_hi) & (hi >= a_lo)) | ((lo <= b_hi) & (hi >= b_lo)))


@triton.jit
def id_ranges_meet(rng_src_b, c, a_lo, a_hi, b_lo, b_hi, mask):
    """Whether the published ranges of chunks ``c`` (a vector; rank src's, batch b: ``rng_src_b``) meet
    [a_lo, a_hi] or [b_lo, b_hi] (a tile's ids, ``tile_id_parts``); False where not ``mask`` (nothing read)."""
    lo = -1 - tl.load(rng_src_b + c * 2, mask=mask, other=-1 - BIG_ID, volatile=True)
    hi = -1 - tl.load(rng_src_b + c * 2 + 1, mask=mask, other=0, volatile=True)
    return ranges_meet(lo, hi, a_lo, a_hi, b_lo, b_hi) & mask


@triton.jit
def id_range_meets(rng_src_b, c, a_lo, a_hi, b_lo, b_hi):
    """``id_ranges_meet`` of one chunk ``c``."""
    lo, hi = range_at(rng_src_b, c)
    return ranges_meet(lo, hi, a_lo, a_hi, b_lo, b_hi)


@triton.jit
def tile_id_parts(ids, rows, S, ZIGZAG: tl.constexpr):
    """A tile's ids (``tile_ids``: -1 where no row) as two ranges, (a_lo, a_hi, b_lo, b_hi): those of its rows in
    each half of the shard (``half_rows``; contiguous: all, then an empty range). Each lies within the range its
    rank published for that half, so a chunk meeting either was sent (``push_unit``)."""
    if ZIGZAG:
        first = rows < S // 2
    else:
        first = rows >= 0
    a_lo = tl.min(tl.where(first & (ids >= 0), ids, BIG_ID), axis=0)
    a_hi = tl.max(tl.where(first, ids, -1), axis=0)
    b_lo = tl.min(tl.where(~first & (ids >= 0), ids, BIG_ID), axis=0)
    b_hi = tl.max(tl.where(~first, ids, -1), axis=0)
    return a_lo, a_hi, b_lo, b_hi


@triton.jit
def ranges_of(rng, r, b, B, n_chunks):
    """Where the range words rank ``r`` published for batch ``b`` start: [n_chunks + 2][lo, hi], its chunks', then
    its halves' (the layout of ``publish_id_ranges``; ``rng``: ``ranks_rng``)."""
    return rng + (r * B + b) * (n_chunks + 2) * 2


@triton.jit
def range_at(rng_r_b, c):
    """[lo, hi] at entry ``c`` of one rank's and batch's range words (``ranges_of``), decoded (stored as -1 - value)."""
    return -1 - tl.load(rng_r_b + c * 2, volatile=True), -1 - tl.load(rng_r_b + c * 2 + 1, volatile=True)


@triton.jit
def published_range(rng, src, b, B, n_chunks, c):
    """[lo, hi] that rank ``src`` published for batch ``b``: its chunk ``c``'s, or (c = n_chunks, n_chunks + 1)
    a half's of its shard."""
    return range_at(ranges_of(rng, src, b, B, n_chunks), c)


@triton.jit
def meets_halves(rng, dst, b, B, n_chunks, lo, hi):
    """Whether [lo, hi] meets the range rank ``dst`` published for a half of its shard (batch ``b``): what decides,
    with the positions, whether K/V rows (or their partial gradients) with ids [lo, hi] reach ``dst``."""
    h0_lo, h0_hi = published_range(rng, dst, b, B, n_chunks, n_chunks)
    h1_lo, h1_hi = published_range(rng, dst, b, B, n_chunks, n_chunks + 1)
    return ranges_meet(lo, hi, h0_lo, h0_hi, h1_lo, h1_hi)


@triton.jit
def block_reaches(n0, n1, k_pos_min, src, dst, rng, b, B, n_chunks, lo, hi, ids, S, W: tl.constexpr,
                  ZIGZAG: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr,
                  WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr):
    """A backward's one test of whether K/V block [n0, n1) of rank ``src`` (first position ``k_pos_min``) reaches rank
    ``dst``: some query of ``dst`` sees a row of it by position (``rows_seen``; causal: its first key at or before
    ``dst``'s last query) and, with segment ids where ``ids`` is true (a peer's block; a rank's own block is always at
    hand), its chunk's published range [lo, hi] meets a half of ``dst``'s (``meets_halves``). A partial task asks it of
    its block (is the block there, does its partial go back: ring_core.kernels.tl_bwd, ``bwd_task_steps``) and the
    block's owner of each peer (does it wait for that peer's partial), from the same published words, so the two sides
    agree."""
    reach = n0 * 0 == 0  # (true, and folded as such: no window, not causal)
    if WINDOW:
        reach = rows_seen(n0, n1, src, dst, S, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT)
    elif CAUSAL:
        reach = k_pos_min <= last_pos(dst, S, W, ZIGZAG)
    if SEGMENTED:
        if ids:
            reach = reach & meets_halves(rng, dst, b, B, n_chunks, lo, hi)
    return reach


@triton.jit
def own_halves(seg_b, S, ZIGZAG: tl.constexpr):
    """This rank's ranges of the two halves of its shard (batch ``seg_b``), as it publishes them."""
    r0, r1 = half_rows(0, S, ZIGZAG)
    h0_lo, h0_hi = id_range(seg_b, r0, r1, 2048, False)
    r0, r1 = half_rows(1, S, ZIGZAG)
    h1_lo, h1_hi = id_range(seg_b, r0, r1, 2048, False)
    return h0_lo, h0_hi, h1_lo, h1_hi


@triton.jit
def ranks_rng(flags, B, HKV, n_chunks, n_part_blocks, W: tl.constexpr):
    """The range words of the ring slot: after the K/V flags [W-1][B][HKV][n_chunks] and (backward) the partials'
    [W-1][B][HKV][n_part_blocks] (0 in the forward)."""
    return flags + (W - 1) * B * HKV * (n_chunks + n_part_blocks)


@triton.jit
def push_unit(u, k_ptr, v_ptr, seg_ptr, recv_ptr, seg_recv, flags_ptr, heap_bases, rank, epoch, B, S, n_chunks,
              W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
              CHUNK_ROWS: tl.constexpr, PUSH_ROWS: tl.constexpr, PUSH_VEC: tl.constexpr,
              CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr,
              WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr, rng, ID_SKIP: tl.constexpr):
    per_peer = B * HKV * n_chunks
    d = u // per_peer + 1
    rem = u % per_peer
    bh = rem // n_chunks  # b * HKV + hkv
    c = rem % n_chunks
    b = bh // HKV
    hkv = bh % HKV
    peer = (rank + d) % W
    slot = d - 1
    needed = True
    if WINDOW:
        needed = chunk_needed(c, rank, peer, S, CHUNK_ROWS, W, ZIGZAG, CAUSAL, WIN_LEFT, WIN_RIGHT)
    elif CAUSAL:
        # The receiver sees a row only if its position is <= the receiver's last query position.
        needed = positions(c * CHUNK_ROWS, rank, S, W, ZIGZAG) <= last_pos(peer, S, W, ZIGZAG)
    if ID_SKIP:
        # ... and some query of the receiver may attend one of its rows by id: the chunk's ids meet those of a
        # half of the receiver's shard (published with its signature; its tiles wait by the same ranges).
        lo, hi = published_range(rng, rank, b, B, n_chunks, c)  # as this rank published it (id_ranges_ready)
        needed = needed & meets_halves(rng, peer, b, B, n_chunks, lo, hi)
    if needed:
        offs_r, offs_d = iota2(PUSH_ROWS, BLOCK_D, PUSH_VEC)  # [PUSH_ROWS, 1], [1, BLOCK_D]
        dmask = offs_d < D
        src_base = b.to(tl.int64) * S * HKV * D + hkv * D
        dst_k = ((slot * 2 * B + b).to(tl.int64) * HKV + hkv) * S * D
        dst_v = dst_k + (b * 0 + B).to(tl.int64) * HKV * S * D  # B may arrive as a Python int (== 1)
        r_end = tl.minimum(S, (c + 1) * CHUNK_ROWS)
        for r0 in range(c * CHUNK_ROWS, r_end, PUSH_ROWS):
            rows = r0 + offs_r
            m = (rows < r_end) & dmask
            src = src_base + rows.to(tl.int64) * (HKV * D) + offs_d
            dst = rows.to(tl.int64) * D + offs_d
            # hint: rows start 16-byte aligned in the peer's slot (ring_core.plans.store_hint), so the remote
            # stores are 16-byte vectors; Triton cannot see that through iris's address translation.
            kt = tl.load(k_ptr + src, mask=m)
            iris.store(recv_ptr + dst_k + dst, kt, rank, peer, heap_bases, mask=m, hint=(1, PUSH_VEC))
            vt = tl.load(v_ptr + src, mask=m)
            iris.store(recv_ptr + dst_v + dst, vt, rank, peer, heap_bases, mask=m, hint=(1, PUSH_VEC))
            if SEGMENTED:
                # The rows' segment ids ride with them, before the same release: one acquire covers both.
                rows1 = r0 + iota(PUSH_ROWS)
                ids = tl.load(seg_ptr + b.to(tl.int64) * S + rows1, mask=rows1 < r_end)
                dst_s = ((slot * B + b).to(tl.int64) * HKV + hkv) * S
                iris.store(seg_recv + dst_s + rows1, ids, rank, peer, heap_bases, mask=rows1 < r_end)
        # Every thread's stores must be ordered before the release below (cumulativity through bar.sync).
        tl.debug_barrier()
        iris.atomic_xchg(flags_ptr + (slot * B * HKV + bh) * n_chunks + c, epoch, rank, peer, heap_bases,
                         sem="release", scope="sys")


@triton.jit
def claim_push(ctl, n_units, k_ptr, v_ptr, seg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
               W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               CHUNK_ROWS: tl.constexpr, PUSH_ROWS: tl.constexpr, VEC: tl.constexpr, CAUSAL: tl.constexpr,
               ZIGZAG: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr,
               SEGMENTED: tl.constexpr, rng, ID_SKIP: tl.constexpr):
    """Claim one push unit, if any is left, and push it (overlap in ring step 0; never waits)."""
    u0 = tl.atomic_add(ctl + CTL_CLAIM, 1, sem="relaxed", scope="gpu")
    if u0 < n_units:
        push_unit(u0, k_ptr, v_ptr, seg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                  W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, VEC, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT,
                  SEGMENTED, rng, ID_SKIP)


@triton.jit
def is_pusher(ctl, n_programs):
    """Whether this program is one of the first quarter of the grid (at least one) to arrive here in this call:
    those drain the pushes (``drain_pushes``) while the others start computing (the persistent Gluon forward;
    see "Why it cannot deadlock"). Counted on CTL_PUSHERS, which that kernel's last program resets."""
    return tl.atomic_add(ctl + CTL_PUSHERS, 1, sem="relaxed", scope="gpu") < tl.maximum(n_programs // 4, 1)


@triton.jit
def drain_pushes(ctl, n_units, k_ptr, v_ptr, seg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch, B, S,
                 n_chunks, W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 CHUNK_ROWS: tl.constexpr, PUSH_ROWS: tl.constexpr, PUSH_VEC: tl.constexpr,
                 CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, WINDOW: tl.constexpr, WIN_LEFT: tl.constexpr,
                 WIN_RIGHT: tl.constexpr, SEGMENTED: tl.constexpr, rng, ID_SKIP: tl.constexpr):
    """Push until no unit is left unclaimed. Called by every task before its first wait and before it ends,
    whether or not it waits at all (see the module docstring)."""
    u = tl.atomic_add(ctl + CTL_CLAIM, 1, sem="relaxed", scope="gpu")
    while u < n_units:
        push_unit(u, k_ptr, v_ptr, seg_ptr, recv, seg_recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                  W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG, WINDOW, WIN_LEFT, WIN_RIGHT,
                  SEGMENTED, rng, ID_SKIP)
        u = tl.atomic_add(ctl + CTL_CLAIM, 1, sem="relaxed", scope="gpu")



@triton.jit
def wait_chunks(flag0, c_lo, c_hi, epoch, ctl, timeout_ns, src, step, INTERPRET: tl.constexpr, POLL_N: tl.constexpr,
                rng_src_b, a_lo, a_hi, b_lo, b_hi, ID_SKIP: tl.constexpr):
    """Wait (acquire) until the flags ``flag0[c_lo:c_hi]`` hold ``epoch``: the chunks of rank ``src``'s K/V that
    a tile of ring step ``step`` reads, POLL_N flags per vector poll (one round trip for many chunks; polled
    one after another they cost about a microsecond each). Call it *before* the loops that read the chunks,
    never inside them: Triton's software pipeliner issues a loop's loads several iterations ahead, so an
    acquire inside the loop would not order the loads of later iterations (an earlier version did that, and
    its pipelined fp32 loop read slots still holding the previous call's data; tests/cpu/test_kernel_ir.py checks
    this never recurs). With ID_SKIP (received K/V, segment ids) only the chunks whose published id range
    (``rng_src_b``) meets the tile's (``tile_id_parts``): the sender pushed those (``push_unit``), and no other
    can hold a key the tile attends. Returns 1, or 0 after recording ERR_KV_TIMEOUT (a wait gave up)."""
    ok_all = epoch * 0 + 1
    offs = tl.arange(0, POLL_N)
    for c0 in range(c_lo, c_hi, POLL_N):
        mask = c0 + offs < c_hi
        if ID_SKIP:
            mask = id_ranges_meet(rng_src_b, c0 + offs, a_lo, a_hi, b_lo, b_hi, mask)
        ok, first = poll_all_ge(flag0 + c0 + offs, mask, epoch, ctl, timeout_ns, INTERPRET, POLL_N)
        if ok == 0:
            record_error(ctl, ERR_KV_TIMEOUT, src, step, c0 + first)
            ok_all = ok_all * 0
    # Each flag was acquired by one thread; the barrier orders every thread's loads after all of those
    # acquires (cumulativity through bar.sync).
    tl.debug_barrier()
    return ok_all


@triton.jit
def wait_rows(flag0, lo1, hi1, lo2, hi2, CHUNK_ROWS: tl.constexpr, epoch, ctl, timeout_ns, src, step,
              INTERPRET: tl.constexpr, POLL_N: tl.constexpr, rng_src_b, a_lo, a_hi, b_lo, b_hi,
              ID_SKIP: tl.constexpr):
    """``wait_chunks`` for the chunks that hold rows [lo1, hi1) | [lo2, hi2) (``rows_within``: empty runs are
    (0, 0), the first before the second): those and no others, each once."""
    c1_lo = lo1 // CHUNK_ROWS
    c1_hi = tl.where(hi1 > lo1, tl.cdiv(hi1, CHUNK_ROWS), c1_lo)
    c2_lo = tl.maximum(lo2 // CHUNK_ROWS, c1_hi)
    c2_hi = tl.maximum(tl.where(hi2 > lo2, tl.cdiv(hi2, CHUNK_ROWS), c2_lo), c2_lo)
    ok = wait_chunks(flag0, c1_lo, c1_hi, epoch, ctl, timeout_ns, src, step, INTERPRET, POLL_N, rng_src_b, a_lo, a_hi,
                     b_lo, b_hi, ID_SKIP)
    return ok * wait_chunks(flag0, c2_lo, c2_hi, epoch, ctl, timeout_ns, src, step, INTERPRET, POLL_N, rng_src_b, a_lo,
                            a_hi, b_lo, b_hi, ID_SKIP)


@triton.jit
def record_peer_error(ctl, heap_bases, rank, peer, code, step):
    """Record (code, this rank, step) in ``peer``'s error record unless one is there (first error wins): how a
    rank that sends a peer something untrustworthy (the backward's partials after a failed wait) makes that
    peer report the failure too."""
    won = iris.atomic_cas(ctl + CTL_ERROR, 0, code, rank, peer, heap_bases, sem="acq_rel", scope="sys")
    if won == 0:
        iris.atomic_xchg(ctl + CTL_ERROR_PEER, rank, rank, peer, heap_bases, sem="relaxed", scope="sys")
        iris.atomic_xchg(ctl + CTL_ERROR_STEP, step, rank, peer, heap_bases, sem="relaxed", scope="sys")


@triton.jit
def end_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W: tl.constexpr, INTERPRET: tl.constexpr,
             STICKY_ERRORS: tl.constexpr, BACKWARD: tl.constexpr):
    """Every program, once its work is done: count itself finished; the last one of this rank (every other
    one has finished reading its receive slots) resets the backward's counters and ends the call
    (``finish_call``)."""
    tl.debug_barrier()
    done = tl.atomic_add(ctl + CTL_FINISH, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        if BACKWARD:
            tl.atomic_xchg(ctl + CTL_BWD_TICKET, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(ctl + CTL_BWD_DELTA, 0, sem="relaxed", scope="gpu")
        finish_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W, INTERPRET, STICKY_ERRORS)
