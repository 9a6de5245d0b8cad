"""The ring protocol on the device: the Triton functions both kernels (ring_core.kernel, ring_core.kernel_bwd)
build their calls from, and the arguments for why a call cannot deadlock, race the next call or corrupt
silently. The control words and error codes are named in ring_core.control (its host twin, which also lays
out the heap and turns status words into exceptions).

K/V shards reach the other ranks of a ring through iris remote stores issued from inside the kernel,
signalled with release/acquire flags, while the same programs do the attention math. One launch per call.

Protocol (per call; "epoch" = this rank's call counter + 1, equal on every rank of a job)
----------------------------------------------------------------------------------------
* Call check. Before anything is pushed or waited for, every rank checks that every peer makes the same
  call: the first program of the call publishes the call's signature (kernel, world size, shapes, dtype,
  causal/layout, scale, chunking; ``call_words``) into its inbox slot on every peer, and every program
  waits (bounded) for every peer's signature of this epoch and compares (``check_call``). On a
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
  of the receiver waits for it.
* Compute. A program owns one (batch, head, BLOCK_M query rows) tile. Ring step 0 uses the local K/V and
  waits for nothing; during it the program claims one push unit every SEG_BLOCKS K/V blocks (overlap;
  the claims sit between the software-pipelined inner loops). Before its first wait a program drains the
  claim counter (pushes until no unit is left). Ring step t >= 1 processes the K/V of rank ``rank-t``:
  before its loops over K/V blocks it waits (acquire; one vector poll over the chunk flags) until the
  flag of every chunk it will read equals ``epoch`` (not inside the loops: see the comment there).
  Positions grow with the local row in both layouts, so the K/V a tile sees is a prefix of the source's
  shard: blocks every query sees whole run in an unmasked loop, the diagonal and tail in a masked one,
  and blocks causal masking hides completely are neither waited for, loaded nor computed.
* End. The last program to finish (atomic finish counter) tells every peer "I am done with this epoch"
  (release flag in the peer's barrier slot), waits for the same from every peer, copies the error record
  into ``status``, resets the claim/finish counters and stores ``epoch`` as the new call counter.

Why it cannot deadlock
----------------------
A program waits only for (0) the peers' signatures, (a) flags of units pushed by the source rank, and
(b) the end barrier. (0) A signature is published by whichever program of the peer's kernel claims the
publishing first, before it waits for anything; so it is published as soon as any program there runs.
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

Several rings on one heap
-------------------------
A ring is the ranks of one process group (torch) or one mesh axis (JAX: one ring per position along the
other axes), in ring order; the kernel sees only its own ring (``W``, ``rank`` = its position, the members'
heap bases, offsets: ring_core.control.make_ctx). Each ring has a *slot* of the heap: its own control words
(epoch, counters, error record, barrier, signature inboxes) and flags (ring_core.heap.RingSlots gives rings
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
does the same for dq, dk and dv (``ring_core.kernel_bwd``).

Never hangs
-----------
Every wait is bounded: by ``timeout_ns`` of %globaltimer on the GPU, by a poll count in the Triton
interpreter. A timeout writes (code, peer rank, ring step, chunk) into the control region (first error
wins), makes every later wait on this rank give up at once, and the last program copies the record into
``status``, which the host turns into an exception.

The backward's waits (ring_core.kernel_bwd): why they cannot deadlock
----------------------------------------------------------------------
Waits: (a) K/V flags (dQ and partial tasks), (b) the delta count (partial and final tasks), (c) partial
flags (final tasks), (d) the end barrier. Producers never wait on a final task; nothing waits on work
that is assigned to one particular program.
(a) As in the forward: claiming and pushing never wait, and every task drains the claim counter before
its first wait, so all units of rank s are pushed as soon as any program of the kernel on s runs.
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

from ring_core import control

try:  # %globaltimer for the bounded waits on NVIDIA; never traced in the interpreter (INTERPRET=True)
    from triton.language.extra.cuda import globaltimer as _globaltimer
except ImportError:  # pragma: no cover
    _globaltimer = None

# The control words and error codes (ring_core.control), as constants of the Triton functions below.
CTL_EPOCH = tl.constexpr(control.CTL_EPOCH)
CTL_CLAIM = tl.constexpr(control.CTL_CLAIM)
CTL_FINISH = tl.constexpr(control.CTL_FINISH)
CTL_ERROR = tl.constexpr(control.CTL_ERROR)
CTL_ERROR_PEER = tl.constexpr(control.CTL_ERROR_PEER)
CTL_ERROR_STEP = tl.constexpr(control.CTL_ERROR_STEP)
CTL_ERROR_CHUNK = tl.constexpr(control.CTL_ERROR_CHUNK)
CTL_SIG_CLAIM = tl.constexpr(control.CTL_SIG_CLAIM)
CTL_BARRIER = tl.constexpr(control.CTL_BARRIER)
CTL_ERR_SIG = tl.constexpr(control.CTL_ERR_SIG)
CTL_SIG = tl.constexpr(control.CTL_SIG)
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
    """This rank's view of its ring, from its context array (ring_core.control.make_ctx): (the members' heap
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
    first = tl.min(tl.where(short, tl.arange(0, N), N), axis=0)
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
               CHUNK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This call's signature words 1..12 (word 0, the epoch, is left 0): ring_core.control.call_signature
    builds the same words on the host, which is how the host describes a mismatch."""
    i = tl.arange(0, SIG_WORDS)
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
    w = tl.where(i == 10, (zero.to(tl.float32) + sm_scale).to(tl.int32, bitcast=True), w)  # scale's bits
    w = tl.where(i == 11, CHUNK_ROWS, w)
    w = tl.where(i == 12, BLOCK, w)
    return w


@triton.jit
def check_call(ctl, heap_bases, rank, epoch, words, timeout_ns, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Before anything is pushed to or read from a peer: make sure every rank makes the same call.

    The first program of the call on this rank publishes the signature ``words`` (see call_words) into
    this rank's inbox slot on every peer (words, then the epoch with a release). Every program then waits
    (bounded) for every peer's slot to hold this epoch and compares. Returns 1 if all agree. Otherwise
    records ERR_MISMATCH (a field differs; detail: index of the first differing word), ERR_EPOCH (a peer
    is at another call) or ERR_START_TIMEOUT, with both signatures for the host's message, and returns
    0: the caller then sends nothing, so a peer's differently sized buffers are never written.

    A peer overwrites its slot here only for its next call, which it starts after the end barrier of
    this one, i.e. after every program of this rank has finished: a slot never changes while read."""
    i = tl.arange(0, SIG_WORDS)
    mine = tl.where(i == 0, epoch, words)
    if tl.atomic_add(ctl + CTL_SIG_CLAIM, 1, sem="relaxed", scope="gpu") == 0:
        for p in tl.static_range(W):
            if p != rank:
                iris.store(ctl + CTL_SIG + rank * SIG_WORDS + i, mine, rank, p, heap_bases, mask=i > 0)
        tl.debug_barrier()  # every thread's words before the epoch (cumulativity through bar.sync)
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
def finish_call(ctl, status_ptr, heap_bases, rank, epoch, timeout_ns, W: tl.constexpr, INTERPRET: tl.constexpr,
                STICKY_ERRORS: tl.constexpr):
    """The end of a call, run by the last program of this rank once every other one has finished: tell
    every peer, wait for every peer (the end barrier), copy the error record into ``status``, reset the
    shared counters and store ``epoch`` as the new call counter. With STICKY_ERRORS (JAX programs traced
    without a host callback per call) the first failed call's status is also kept in the control region
    until the host takes it (ring_core.heap.HeapRings.take_error).

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
    sig = tl.arange(0, 2 * SIG_WORDS)
    tl.store(status_ptr + 4 + sig, tl.load(ctl + CTL_ERR_SIG + sig, volatile=True))
    tl.store(ctl + CTL_ERR_SIG + sig, sig * 0)
    final = tl.where(first, held, code)
    if STICKY_ERRORS and final != 0:
        if tl.atomic_cas(ctl + CTL_STICKY, 0, final, sem="acq_rel", scope="gpu") == 0:
            tl.debug_barrier()  # this program's status stores above before the loads below
            words = tl.arange(0, 64)
            keep = (words > 0) & (words < STATUS_WORDS)
            tl.store(ctl + CTL_STICKY + words, tl.load(status_ptr + words, mask=keep, volatile=True), mask=keep)
    tl.atomic_xchg(ctl + CTL_ERROR_CHUNK, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctl + CTL_CLAIM, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctl + CTL_SIG_CLAIM, 0, sem="relaxed", scope="gpu")
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


@triton.jit
def push_unit(u, k_ptr, v_ptr, recv_ptr, flags_ptr, heap_bases, rank, epoch, B, S, n_chunks,
              W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
              CHUNK_ROWS: tl.constexpr, PUSH_ROWS: tl.constexpr, PUSH_VEC: tl.constexpr,
              CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr):
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
    if CAUSAL:
        # The receiver sees a row only if its position is <= the receiver's last query position.
        needed = positions(c * CHUNK_ROWS, rank, S, W, ZIGZAG) <= last_pos(peer, S, W, ZIGZAG)
    if needed:
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
            # hint: rows start 16-byte aligned in the peer's slot (ring_core.plans.store_hint), so the remote
            # stores are 16-byte vectors; Triton cannot see that through iris's address translation.
            kt = tl.load(k_ptr + src, mask=m)
            iris.store(recv_ptr + dst_k + dst, kt, rank, peer, heap_bases, mask=m, hint=(1, PUSH_VEC))
            vt = tl.load(v_ptr + src, mask=m)
            iris.store(recv_ptr + dst_v + dst, vt, rank, peer, heap_bases, mask=m, hint=(1, PUSH_VEC))
        # Every thread's stores must be ordered before the release below (cumulativity through bar.sync).
        tl.debug_barrier()
        iris.atomic_xchg(flags_ptr + (slot * B * HKV + bh) * n_chunks + c, epoch, rank, peer, heap_bases,
                         sem="release", scope="sys")


@triton.jit
def claim_push(ctl, n_units, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
               W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               CHUNK_ROWS: tl.constexpr, PUSH_ROWS: tl.constexpr, VEC: tl.constexpr, CAUSAL: tl.constexpr,
               ZIGZAG: tl.constexpr):
    """Claim one push unit, if any is left, and push it (overlap in ring step 0; never waits)."""
    u0 = tl.atomic_add(ctl + CTL_CLAIM, 1, sem="relaxed", scope="gpu")
    if u0 < n_units:
        push_unit(u0, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                  W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, VEC, CAUSAL, ZIGZAG)


@triton.jit
def drain_pushes(ctl, n_units, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                 W: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 CHUNK_ROWS: tl.constexpr, PUSH_ROWS: tl.constexpr, PUSH_VEC: tl.constexpr,
                 CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr):
    """Push until no unit is left unclaimed. Called before a task's first wait (see the module docstring)."""
    u = tl.atomic_add(ctl + CTL_CLAIM, 1, sem="relaxed", scope="gpu")
    while u < n_units:
        push_unit(u, k_ptr, v_ptr, recv, flags, heap_bases, rank, epoch, B, S, n_chunks,
                  W, HKV, D, BLOCK_D, CHUNK_ROWS, PUSH_ROWS, PUSH_VEC, CAUSAL, ZIGZAG)
        u = tl.atomic_add(ctl + CTL_CLAIM, 1, sem="relaxed", scope="gpu")



@triton.jit
def wait_chunks(flag0, n_need, epoch, ctl, timeout_ns, src, step, INTERPRET: tl.constexpr, POLL_N: tl.constexpr):
    """Wait (acquire) until the flags ``flag0[0:n_need]`` hold ``epoch``: the chunks of rank ``src``'s K/V that
    a tile of ring step ``step`` reads, POLL_N flags per vector poll (one round trip for many chunks; polled
    one after another they cost about a microsecond each). Call it *before* the loops that read the chunks,
    never inside them: Triton's software pipeliner issues a loop's loads several iterations ahead, so an
    acquire inside the loop would not order the loads of later iterations (an earlier version did that, and
    its pipelined fp32 loop read slots still holding the previous call's data; tests/test_kernel_ir.py checks
    this never recurs). Returns 1, or 0 after recording ERR_KV_TIMEOUT (a wait gave up)."""
    ok_all = epoch * 0 + 1
    offs = tl.arange(0, POLL_N)
    for c0 in range(0, n_need, POLL_N):
        ok, first = poll_all_ge(flag0 + c0 + offs, c0 + offs < n_need, epoch, ctl, timeout_ns, INTERPRET, POLL_N)
        if ok == 0:
            record_error(ctl, ERR_KV_TIMEOUT, src, step, c0 + first)
            ok_all = ok_all * 0
    # Each flag was acquired by one thread; the barrier orders every thread's loads after all of those
    # acquires (cumulativity through bar.sync).
    tl.debug_barrier()
    return ok_all


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
