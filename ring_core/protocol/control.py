"""The host side of the ring protocol: the heap's layout, the control words and error codes the kernels
use (by these names: ring_core.protocol.steps imports them), the call signature, and turning a kernel's status
words into an exception. Its device twin is ring_core.protocol.steps; no framework here.

Heap layout (byte offsets from this rank's heap base; identical on every rank because the workspace is
the first, same-sized allocation on every rank's symmetric heap):

    [ctl_off,   +RING_SLOTS*CTL_BYTES)        control words of each ring slot: epoch, claim/finish counters,
                                              error record, barrier, signature inboxes
    [flags_off, +RING_SLOTS*flag_capacity*4)  each ring slot's int32 epoch flags (one per pushed unit); never data
    [recv_off,  +recv_capacity)               receive slots, shared by the rings: [W-1][K|V][B][HKV][S][D]
                                              (with segment ids, the peers' ids follow: [W-1][B][HKV][S] int32;
                                              the backward adds the peers' float32 partial dK/dV after them)

A ring (the ranks of one process group or mesh axis, in ring order) uses one slot: its own control words
and flags, so that several rings run on one heap, each with its own call counter (ring_core.runtime.heap.RingSlots
picks the slot; ring_core.protocol.steps explains why rings sharing a rank may share its receive region). The
kernels see only their ring: its size W, this rank's position in it, its members' heap bases and the
slot's offsets (make_ctx).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import numpy as np

from ring_core import masks, settings
from ring_core.validate import AttentionSpec

# ---- control words of a ring slot (int32 indices; the kernels use these names, ring_core.protocol.steps) ----------
MAX_WORLD = 64  # ranks in a ring
SIG_WORDS = 16  # a call's signature: see call_signature()
CTL_EPOCH = 0  # calls completed on this rank (the kernel's epoch is this + 1)
CTL_CLAIM = 1  # push-unit claim counter
CTL_FINISH = 2  # programs finished in this call
CTL_ERROR = 3  # the error record, first error wins: code (3), then
CTL_ERROR_PEER = 4  # peer rank (ring position)
CTL_ERROR_STEP = 5  # ring step (or peer distance)
CTL_ERROR_CHUNK = 6  # chunk or block
CTL_SIG_CLAIM = 7  # programs that started this call; the first one publishes the call's signature (W = 1, with
#                    segment ids: the steps of the id ranges taken, protocol.id_ranges_ready)
CTL_BARRIER = 8  # 8 + p: epoch at which peer p passed its end barrier
CTL_ERR_SIG = CTL_BARRIER + MAX_WORLD  # 72..103: on a mismatch, the peer's then this rank's signature
# With segment ids: the epoch at which this rank's own id ranges lie in its own inbox of range words (written by
# the program that claims the call's publishing, or alone, W = 1, by the programs that take their steps; every
# program waits for it before it reads a range).
CTL_RANGES = CTL_ERR_SIG + 2 * SIG_WORDS  # 104
CTL_RANGES_DONE = CTL_RANGES + 1  # W = 1: steps of the id ranges written in this call (protocol.id_ranges_ready)
CTL_PUSHERS = CTL_RANGES + 2  # the Gluon forward: programs that arrived at its pushes (protocol.is_pusher)
CTL_SIG = 128  # 128 + p * SIG_WORDS: the signature peer p published for its current call (its inbox slot)
CTL_WORDS = CTL_SIG + MAX_WORLD * SIG_WORDS
CTL_BWD_TICKET = CTL_WORDS  # backward: task tickets handed out in this call (tasks are taken in ticket order)
CTL_BWD_DELTA = CTL_WORDS + 1  # backward: dq tasks that have published their rows of delta = rowsum(dO * O)
CTL_FWD_TILE = CTL_WORDS + 2  # the persistent Gluon forward: tiles handed out in this call (in order)
CTL_FWD_DONE = CTL_WORDS + 3  # the persistent Gluon forward: its programs done with CTL_FWD_TILE (the last resets both)
# The first failed call's status words since the last read (ring_core.runtime.heap.HeapRings.take_error) or reset:
# how errors reach a program that runs without a check per call (deferred errors).
CTL_STICKY = CTL_WORDS + 8
CTL_BYTES = 8192  # one ring slot's control words

# ---- error codes (status word 0) ------------------------------------------------------------------------------
ERR_NONE = 0
ERR_KV_TIMEOUT = 1  # a peer's K/V never arrived
ERR_BARRIER_TIMEOUT = 2  # a peer never reached the end-of-call barrier
ERR_PEER_FAILED = 3  # a peer failed (its error was raised there)
ERR_PARTIAL_TIMEOUT = 4  # backward: a peer's partial dK/dV never arrived
ERR_LOCAL_TIMEOUT = 5  # backward: a wait on this rank's own programs (delta rows, dQ turns) ran out (cannot happen)
ERR_MISMATCH = 6  # a peer's call differs (shapes, dtype, flags, layout, world size or kernel): nothing was sent
ERR_EPOCH = 7  # a peer is at another call (counters apart after an earlier timeout): nothing was sent
ERR_START_TIMEOUT = 8  # a peer never published its signature: it did not start this call
STATUS_WORDS = 4 + 2 * SIG_WORDS  # status output: error code, peer rank, ring step, epoch, then the two
#                                   signatures of a mismatch (peer's, this rank's; zero otherwise)
assert CTL_ERR_SIG + 2 * SIG_WORDS <= CTL_SIG and (CTL_STICKY + STATUS_WORDS) * 4 <= CTL_BYTES

# ---- signatures ---------------------------------------------------------------------------------------------
DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3}  # signature word 8 (constexpr SIG_DTYPE)
KIND_FWD, KIND_BWD = 1, 2  # signature word 1

# ---- the heap -----------------------------------------------------------------------------------------------
RING_SLOTS = 8  # rings one heap serves, each with its own control words and flags
ALIGN = 256
MAX_FLAG_BYTES = 16 << 20
HEAP_SLACK = 8 << 20  # heap bytes left to iris for its own small allocations (outside the workspace)
POLL_N = 128  # chunk flags one vector poll covers (constexpr POLL_N)
BIG_ID = 2147483647  # above every segment id: an empty id range's lo (protocol.BIG_ID, testing.id_range_words)

# ---- waits and errors ---------------------------------------------------------------------------------------
DEFAULT_TIMEOUT_S = settings.DEFAULT_TIMEOUT_S
TIMEOUT_ENV = settings.TIMEOUT_S
ERRORS_ENV = settings.ERRORS
ERROR_MODES = settings.ERROR_MODES


class HeapTooSmallError(RuntimeError):
    """The call needs more symmetric-heap bytes than were reserved at initialize()."""


class RingAttentionTimeout(RuntimeError):
    """A bounded wait inside the fused kernel expired: a peer never arrived or ranks disagree."""


class RingAttentionMismatch(RuntimeError):
    """The ranks made different fused calls (or are at different calls): found by the kernel before any
    data moved between them."""


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the workspace's regions from the heap base. ``ctl_off`` / ``flags_off``: ring slot
    0's control words and flags (``ctl_off_of`` / ``flags_off_of`` for a slot); ``flag_capacity``: flags
    per slot."""

    workspace_bytes: int
    ctl_off: int
    flags_off: int
    flag_capacity: int
    recv_off: int
    recv_capacity: int

    @property
    def protocol_region(self) -> tuple:
        """(start, end) byte offsets of every slot's control words and flags: zeroing them (on every rank,
        with no call in flight) returns the protocol to its initial state; they never hold data."""
        return self.ctl_off, self.recv_off

    def ctl_off_of(self, slot: int) -> int:
        return self.ctl_off + self._slot(slot) * CTL_BYTES

    def flags_off_of(self, slot: int) -> int:
        return self.flags_off + self._slot(slot) * self.flag_capacity * 4

    @staticmethod
    def _slot(slot: int) -> int:
        if not 0 <= slot < RING_SLOTS:
            raise ValueError(f"ring slot {slot} is not in [0, {RING_SLOTS})")
        return slot

    @staticmethod
    def for_workspace(workspace_bytes: int, base_off: int = 0) -> "HeapLayout":
        """Split a workspace of ``workspace_bytes`` (at ``base_off`` from the heap base) into regions.
        A sixty-fourth of it (at least 64 KiB, at most 16 MiB) holds flags, shared equally by the slots."""
        slot_flag_bytes = _align(min(MAX_FLAG_BYTES, max(64 << 10, workspace_bytes // 64)) // RING_SLOTS)
        ctl_off = _align(base_off)
        flags_off = ctl_off + RING_SLOTS * CTL_BYTES
        recv_off = _align(flags_off + RING_SLOTS * slot_flag_bytes)
        recv_capacity = base_off + workspace_bytes - recv_off
        if recv_capacity <= 0:
            raise ValueError(f"workspace of {workspace_bytes} bytes is too small for the control and flag regions")
        return HeapLayout(workspace_bytes, ctl_off, flags_off, slot_flag_bytes // 4, recv_off, recv_capacity)


def make_ctx(heap_bases, rank: int, heap: HeapLayout, slot: int = 0) -> np.ndarray:
    """The context array the kernel reads on one rank of a ring (int64): the heap bases of the ring's members
    in ring order, as mapped in this rank's process; this rank's position in the ring; the offsets of the
    ring slot's control words and flags, and of the receive region."""
    bases = np.asarray(heap_bases, dtype=np.uint64).astype(np.int64)
    return np.concatenate([bases, np.array([rank, heap.ctl_off_of(slot), heap.flags_off_of(slot), heap.recv_off],
                                           np.int64)])


def timeout_ns(timeout_s: float | None = None) -> int:
    if timeout_s is None:
        timeout_s = settings.timeout_s()
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
    return int(timeout_s * 1e9)


@contextlib.contextmanager
def environ(**values):
    """Environment variables set to ``values`` for a block (read where this project reads them: at each plan, at
    each trace), then as they were."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, val in old.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val


def errors_mode() -> str:
    """How a fused call reports a failure (RING_ATTENTION_ERRORS; torch reads it at each call, JAX when it
    traces). "deferred", both frontends' default: no host sync per call; each call's status is copied to pinned
    host memory asynchronously and a failure is raised by a later fused call on that process (torch: the next
    fused call, before it launches; JAX: the next call that finds the copy landed, as the error of that
    program), by ``check_errors()`` (which waits for the copies) or at ``shutdown()``; what the failed call
    could not compute is NaN meanwhile. "call": the failed call raises itself (torch: it waits for the GPU
    after every call; JAX: a host callback after every call, 0.2-1 ms each): for debugging."""
    return settings.errors_mode()


SIG_FIELDS = ("epoch", "kernel", "world", "batch", "seq_local", "heads", "kv_heads", "head_dim", "dtype", "flags",
              "scale", "chunk_rows", "block", "window_left", "window_right")
# Word 9 ("flags"): 1 causal, 2 zigzag, 4 segment ids. Words 13, 14: the window's sides as the kernels apply them
# (masks.kernel_window), ``side_word``: 0 unbounded, a side >= 0 plus one (so a call without a window keeps the
# words it had), a negative side (a band off the diagonal: the two-level ring's calls) as it is.
NO_SIDE = -(2 ** 31)  # the kernels' WIN_LEFT / WIN_RIGHT for an unbounded side (masks.kernel_window's None)


def side_word(side) -> int:
    """A window side's signature word (the kernels' ``call_words`` write the same)."""
    return 0 if side is None else side + 1 if side >= 0 else side


def word_side(word: int):
    """``side_word``'s inverse."""
    return None if word == 0 else word - 1 if word > 0 else word


def window_constexprs(window) -> dict:
    """The kernels' WINDOW, WIN_LEFT, WIN_RIGHT for a window as ``masks.kernel_window`` gives it."""
    left, right = window
    return dict(WINDOW=tuple(window) != masks.UNBOUNDED, WIN_LEFT=NO_SIDE if left is None else left,
                WIN_RIGHT=NO_SIDE if right is None else right)


KERNEL_MIN_SCALE = 1e-30


def kernel_scale(scale: float) -> float:
    """The scale the fused kernels are given for ``scale`` (>= 0, validated): a scale of 0 as 1e-30. The kernels
    multiply masked scores (-inf) by the scale (the row max is taken before scaling; the scale and shift are one
    FMA), which for 0 gave NaN (-inf * 0). With 1e-30 every score of a float16/bfloat16/float32 input (far below
    1e28 in magnitude) gives exp2(~0) = 1 in float32, as scale 0 does: the same outputs and lse; the gradients of q
    and k are 1e-30 times finite values instead of 0."""
    return max(float(scale), KERNEL_MIN_SCALE)


def call_signature(kind: int, world_size: int, spec: AttentionSpec, chunk_rows: int, block: int) -> np.ndarray:
    """The SIG_WORDS int32 words by which ranks check, inside the kernel and before anything moves, that
    they make the same call: word 0 the epoch (the kernel fills it in), then ``SIG_FIELDS``. The kernels
    build the same words from their own arguments (ring_core.protocol.steps.call_words); ``chunk_rows`` and
    ``block`` fix how the K/V (and the backward's partials) are cut into flagged pieces. Ranks that disagree
    on segment ids would size their receive regions differently; ranks that disagree on the window would wait
    for chunks their peers never send: both are found here, before anything moves."""
    w = np.zeros(SIG_WORDS, np.int32)
    left, right = masks.kernel_window(spec.is_causal, spec.window, world_size * spec.seq_local, spec.key_offset)
    w[1:15] = [kind, world_size, spec.batch, spec.seq_local, spec.num_heads, spec.num_kv_heads, spec.head_dim,
               DTYPE_CODES[spec.dtype], int(spec.is_causal) | (int(spec.layout == "zigzag") << 1)
               | (int(spec.segmented) << 2), np.float32(kernel_scale(spec.scale)).view(np.int32), chunk_rows, block,
               side_word(left), side_word(right)]
    return w


def describe_signature(words) -> str:
    """A signature (call_signature) in words a user recognises."""
    w = [int(x) for x in np.asarray(words).reshape(-1)[:SIG_WORDS]]
    kind = {KIND_FWD: "forward", KIND_BWD: "backward"}.get(w[1], f"kernel {w[1]}")
    dtype = {v: k for k, v in DTYPE_CODES.items()}.get(w[8], f"dtype code {w[8]}")
    scale = float(np.array(w[10], np.int32).view(np.float32))
    scale = 0.0 if scale <= 2 * KERNEL_MIN_SCALE else scale  # kernel_scale's stand-in for 0
    mask = ("causal " + ("zigzag" if w[9] & 2 else "contiguous")) if w[9] & 1 else (
        "non-causal " + ("zigzag" if w[9] & 2 else "contiguous"))
    if w[13] or w[14]:
        sides = [word_side(x) for x in w[13:15]]
        if all(x is None or x >= 0 for x in sides):  # flash-attn's notation, -1 unbounded
            mask += f", window ({', '.join(str(-1 if x is None else x) for x in sides)})"
        else:  # a band off the diagonal (masks.kernel_window with a key offset)
            mask += f", window off the diagonal ({', '.join('unbounded' if x is None else str(x) for x in sides)})"
    if w[9] & 4:
        mask += ", segment ids"
    return (f"{kind} call #{w[0]}: world {w[2]}, q [{w[3]}, {w[4]}, {w[5]}, {w[7]}], k/v [{w[3]}, {w[4]}, {w[6]}, "
            f"{w[7]}] {dtype}, {mask}, scale {scale:.6g}, chunks of {w[11]} rows, blocks of {w[12]}")


def check_status(status, rank: int, timeout_s: float | None = None, members=None) -> None:
    """Turn the kernel's status words (code, peer, step, epoch, signatures) into an exception on the host.
    ``rank`` and the peer in the status are positions in the ring; ``members`` (the ring's global ranks in
    ring order) names them by their global ranks instead."""
    words = np.asarray(status).reshape(-1)
    code, peer, step, epoch = (int(x) for x in words[:4])
    if members is not None:
        rank = int(members[rank])
        peer = int(members[peer]) if 0 <= peer < len(members) else peer
    if code == ERR_NONE and epoch > 0:
        return
    if code in (ERR_MISMATCH, ERR_EPOCH):
        theirs, mine = words[4:4 + SIG_WORDS], words[4 + SIG_WORDS:4 + 2 * SIG_WORDS]
        if code == ERR_MISMATCH:
            field = SIG_FIELDS[step] if 0 < step < len(SIG_FIELDS) else f"word {step}"
            raise RingAttentionMismatch(
                f"fused ring attention on rank {rank}: the ranks disagree on call #{epoch} (first difference: "
                f"{field}). Rank {peer} made the {describe_signature(theirs)}; rank {rank} made the "
                f"{describe_signature(mine)}. Every rank must make the same calls (shapes, dtype, is_causal, "
                f"layout, scale, window, segment ids or none, forward/backward) in the same order. The kernel "
                f"found this before any data "
                f"moved between the ranks: nothing was corrupted, this call's outputs are not valid, and the "
                f"ranks are still in step (no reset() needed).")
        raise RingAttentionMismatch(
            f"fused ring attention on rank {rank}: rank {peer} is at another call (its call #{int(theirs[0])}, this "
            f"rank's #{epoch}), so the ranks' call counters are apart, as after an earlier timeout. Nothing was "
            f"sent. Call reset() (jax_ring.reset / torch_bridge.reset) on every rank before the next call.")
    if code == ERR_NONE:
        # Status is zeroed before every launch and the kernel's last program always writes epoch >= 1.
        raise RuntimeError(
            f"fused ring attention on rank {rank} did not complete: its status was never written (the kernel "
            "did not launch or stopped early); its outputs are not valid")
    limit = f"{timeout_s:g} s" if timeout_s is not None else f"the timeout ({TIMEOUT_ENV})"
    if code == ERR_KV_TIMEOUT:
        what = f"waiting for the K/V shard of rank {peer} at ring step {step}"
    elif code == ERR_BARRIER_TIMEOUT:
        what = f"waiting for rank {peer} to finish (end-of-call barrier)"
    elif code == ERR_PEER_FAILED:
        what = f"because rank {peer} failed (its error was raised there)"
    elif code == ERR_START_TIMEOUT:
        what = (f"waiting for rank {peer} to start this call (ring step 0: it never launched the kernel, or is "
                f"far behind)")
    elif code == ERR_PARTIAL_TIMEOUT:  # backward kernel
        what = f"waiting for the partial dK/dV of rank {peer} (backward)"
    elif code == ERR_LOCAL_TIMEOUT:
        what = "waiting for this rank's own backward programs (delta rows or dQ turns)"
    else:
        what = f"with unknown error code {code} (peer {peer}, step {step})"
    raise RingAttentionTimeout(
        f"fused ring attention on rank {rank} (call #{epoch}) gave up after {limit} {what}. "
        f"Every rank must make the same ring-attention calls in the same order with the same shapes; "
        f"a rank that died or is far slower causes this. Raise the limit with {TIMEOUT_ENV} if a rank is "
        f"legitimately late. The ranks' call counters may now disagree: call reset() (jax_ring.reset / "
        f"torch_bridge.reset) on every rank before the next call; the heap stays usable.")


def take_sticky(heap_bytes, heap: HeapLayout, base_off: int = 0):
    """Read and clear a rank's first kept status (CTL_STICKY), looking at the ring slots in order:
    ``heap_bytes`` is a torch uint8 tensor holding the rank's workspace, starting ``base_off`` bytes from
    the heap base. Returns (status words for check_status, ring slot), or None when no call failed since
    the last take."""
    import torch

    for slot in range(RING_SLOTS):
        start = heap.ctl_off_of(slot) - base_off + 4 * CTL_STICKY
        words = heap_bytes[start:start + 4 * STATUS_WORDS].view(torch.int32)
        status = words.cpu().numpy().copy()
        if status[0] != ERR_NONE:
            words.zero_()
            return status, slot
    return None


def ring_flags(heap_bytes, heap: HeapLayout, slot: int, n: int, base_off: int = 0) -> tuple:
    """(epoch, flags) of ring slot ``slot`` on one rank: the slot's call counter (the epoch of the last call
    that completed there) and its first ``n`` flag words (int32 numpy), read from ``heap_bytes`` as in
    ``take_sticky``. After a call, a K/V flag holding that call's epoch marks a chunk it received
    (``ring_core.plans.LaunchPlan.chunks_received`` decodes them)."""
    import torch

    ctl = heap.ctl_off_of(slot) - base_off + 4 * CTL_EPOCH
    epoch = int(heap_bytes[ctl:ctl + 4].view(torch.int32).cpu().item())
    start = heap.flags_off_of(slot) - base_off
    return epoch, heap_bytes[start:start + 4 * n].view(torch.int32).cpu().numpy().copy()
