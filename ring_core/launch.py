"""Launch maths for the fused kernel, in one place for both frontends and the simulator.

Heap layout (byte offsets from this rank's heap base; identical on every rank because the workspace is
the first, same-sized allocation on every rank's symmetric heap):

    [ctl_off,   +RING_SLOTS*CTL_BYTES)        control words of each ring slot: epoch, claim/finish counters,
                                              error record, barrier, signature inboxes
    [flags_off, +RING_SLOTS*flag_capacity*4)  each ring slot's int32 epoch flags (one per pushed unit); never data
    [recv_off,  +recv_capacity)               receive slots, shared by the rings: [W-1][K|V][B][HKV][S][D]

A ring (the ranks of one process group or mesh axis, in ring order) uses one slot: its own control words
and flags, so that several rings run on one heap, each with its own call counter (ring_core.heap.RingSlots
picks the slot; ring_core.kernel explains why rings sharing a rank may share its receive region). The
kernels see only their ring: its size W, this rank's position in it, its members' heap bases and the
slot's offsets (make_ctx).

Kernel argument order (what jax-triton passes, and the torch launcher passes the same list):
    q, k, v, ctx | B, S, sm_scale, timeout_ns | out, lse, status | constexprs
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ring_core.validate import AttentionSpec

# Control region (int32 words). The kernel uses these indices as literals.
CTL_EPOCH = 0  # calls completed on this rank (the kernel's epoch is this + 1)
CTL_CLAIM = 1  # push-unit claim counter
CTL_FINISH = 2  # programs finished in this call
CTL_ERROR = 3  # 3..6: error code, peer rank, ring step, chunk (first error wins)
CTL_SIG_CLAIM = 7  # programs that started this call; the first one publishes the call's signature
CTL_BARRIER = 8  # 8 + p: epoch at which peer p passed its end barrier
MAX_WORLD = 64
SIG_WORDS = 16  # a call's signature: see call_signature()
CTL_ERR_SIG = CTL_BARRIER + MAX_WORLD  # 72..103: on a mismatch, the peer's then this rank's signature
CTL_SIG = 128  # 128 + p * SIG_WORDS: the signature peer p published for its current call (its inbox slot)
CTL_WORDS = CTL_SIG + MAX_WORLD * SIG_WORDS
ERR_NONE, ERR_KV_TIMEOUT, ERR_BARRIER_TIMEOUT, ERR_PEER_FAILED = 0, 1, 2, 3
ERR_MISMATCH = 6  # a peer's call differs (shapes, dtype, flags, layout, world size or kernel): nothing was sent
ERR_EPOCH = 7  # a peer is at another call (counters apart after an earlier timeout): nothing was sent
ERR_START_TIMEOUT = 8  # a peer never published its signature: it did not start this call
STATUS_WORDS = 4 + 2 * SIG_WORDS  # status output: error code, peer rank, ring step, epoch, then the two
#                                   signatures of a mismatch (peer's, this rank's; zero otherwise)
CTL_BYTES = 8192  # one ring slot's control words
RING_SLOTS = 8  # rings one heap serves, each with its own control words and flags
ALIGN = 256
MAX_FLAG_BYTES = 16 << 20
HEAP_SLACK = 8 << 20  # heap bytes left to iris for its own small allocations (outside the workspace)
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
DEFAULT_TIMEOUT_S = 300.0
POLL_N = 128  # chunk flags one vector poll covers
TIMEOUT_ENV = "RING_ATTENTION_TIMEOUT_S"
assert CTL_WORDS * 4 <= CTL_BYTES and CTL_ERR_SIG + 2 * SIG_WORDS <= CTL_SIG
DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3}  # signature word 8 (launch constexpr SIG_DTYPE)
KIND_FWD, KIND_BWD = 1, 2  # signature word 1


class HeapTooSmallError(RuntimeError):
    """The call needs more symmetric-heap bytes than were reserved at initialize()."""


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


@dataclass(frozen=True)
class KernelConfig:
    """Tuning knobs (hashable: usable as a static argument)."""

    block_m: int
    block_n: int
    chunk_blocks: int
    push_rows: int
    num_warps: int
    num_stages: int
    seg_blocks: int = 4  # K/V blocks computed between two push claims in ring step 0

    @staticmethod
    def get_default(spec: AttentionSpec, world_size: int, *, interpret: bool = False) -> "KernelConfig":
        if interpret:
            # Small tiles: many blocks, chunks and push units even at the tiny sizes CI can afford.
            return KernelConfig(block_m=16, block_n=16, chunk_blocks=1, push_rows=16, num_warps=4, num_stages=1,
                                seg_blocks=2)
        # Measured on 2xH200 (benchmarks/tune.py, results/tune_forward_2xH200_2026-11-30.csv, bf16,
        # 32 heads, seq_local 4k/16k, causal and not): the best or within 1-2 % of the best candidate.
        # fp32 tiles take twice the shared memory: fewer stages keep them under Hopper's 227 KiB
        # (fp32, D=128, 3 stages measured 224.5 KiB when compiled for sm_90).
        wide = spec.dtype == "float32"
        if spec.head_dim <= 64:
            if wide:
                return KernelConfig(block_m=128, block_n=64, chunk_blocks=2, push_rows=64, num_warps=4, num_stages=2)
            return KernelConfig(block_m=128, block_n=64, chunk_blocks=2, push_rows=64, num_warps=4, num_stages=4)
        if spec.head_dim <= 128:
            if wide:
                return KernelConfig(block_m=128, block_n=64, chunk_blocks=2, push_rows=32, num_warps=8, num_stages=2)
            # 128x128 tiles, 3 stages: 224 KiB of shared memory for D=128 (fits; one CTA per SM).
            return KernelConfig(block_m=128, block_n=128, chunk_blocks=1, push_rows=32, num_warps=8, num_stages=3,
                                seg_blocks=8)
        return KernelConfig(block_m=64, block_n=32, chunk_blocks=4, push_rows=16, num_warps=4,
                            num_stages=1 if wide else 2)


@dataclass(frozen=True)
class LaunchPlan:
    spec: AttentionSpec
    world_size: int
    config: KernelConfig
    chunk_blocks: int
    grid: tuple
    recv_bytes: int
    flags_needed: int

    def constexprs(self, *, interpret: bool, sticky_errors: bool = False) -> dict:
        """The kernel's constexprs; ``sticky_errors``: keep a failed call's status on the heap for the host
        (JAX programs traced without a host callback per call)."""
        s = self.spec
        return dict(
            W=self.world_size, H=s.num_heads, HKV=s.num_kv_heads, D=s.head_dim,
            BLOCK_M=self.config.block_m, BLOCK_N=self.config.block_n, BLOCK_D=block_d(s.head_dim),
            CHUNK_BLOCKS=self.chunk_blocks, PUSH_ROWS=self.config.push_rows, SEG_BLOCKS=self.config.seg_blocks,
            POLL_N=POLL_N, VEC=push_hint(s.head_dim, s.dtype),
            CAUSAL=s.is_causal, ZIGZAG=s.layout == "zigzag", INTERPRET=interpret,
            DOT_PRECISION="ieee", SIG_DTYPE=DTYPE_CODES[s.dtype], STICKY_ERRORS=sticky_errors,
        )

    def signature(self) -> np.ndarray:
        """This call's signature words (call_signature), as the kernel builds them."""
        return call_signature(KIND_FWD, self.world_size, self.spec, self.chunk_blocks * self.config.block_n,
                              self.config.block_n)

    def scalars(self, timeout_s: float | None = None) -> tuple:
        s = self.spec
        return (s.batch, s.seq_local, float(s.scale), timeout_ns(timeout_s))

    @property
    def out_shapes(self):
        """(shape, dtype name) of out, lse, status."""
        s = self.spec
        return ((s.batch, s.seq_local, s.num_heads, s.head_dim), s.dtype), \
               ((s.batch, s.num_heads, s.seq_local), "float32"), ((STATUS_WORDS,), "int32")


def push_hint(head_dim: int, dtype: str) -> int:
    """The alignment hint for pushed rows (iris.store's ``hint``: 16-byte divisibility and 16 contiguous
    elements per group along head_dim). A row of K/V starts 16-byte aligned only when
    head_dim * itemsize is a multiple of 16; otherwise 1 (no claim)."""
    return 16 if (head_dim * ELEM_BYTES[dtype]) % 16 == 0 else 1


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def timeout_ns(timeout_s: float | None = None) -> int:
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
    return int(timeout_s * 1e9)


def heap_bytes_for(recv_need: int) -> int:
    """A heap size (``initialize(heap_size=...)``) whose workspace holds ``recv_need`` receive bytes: the
    receive slots plus the largest flag region, the control words, alignment and iris's slack, in MiB."""
    total = recv_need + RING_SLOTS * CTL_BYTES + MAX_FLAG_BYTES + 2 * ALIGN + HEAP_SLACK
    return -(-total // (1 << 20)) << 20


def recv_bytes(spec: AttentionSpec, world_size: int) -> int:
    return (world_size - 1) * 2 * spec.batch * spec.num_kv_heads * spec.seq_local * spec.head_dim * ELEM_BYTES[spec.dtype]


def plan(spec: AttentionSpec, world_size: int, heap: HeapLayout, *, interpret: bool = False,
         config: KernelConfig | None = None) -> LaunchPlan:
    """Everything a launch needs; raises HeapTooSmallError (before anything runs) when the heap is short."""
    if spec.dtype not in ELEM_BYTES:
        raise TypeError(f"the fused kernel supports float16, bfloat16 and float32 inputs, got {spec.dtype}; "
                        "use a reference backend for float64")
    cfg = config or KernelConfig.get_default(spec, world_size, interpret=interpret)
    need = recv_bytes(spec, world_size)
    if need > heap.recv_capacity:
        raise HeapTooSmallError(
            f"this call needs {need} bytes of symmetric-heap receive space ({world_size - 1} peers x K and V of "
            f"[{spec.batch}, {spec.seq_local}, {spec.num_kv_heads}, {spec.head_dim}] {spec.dtype}) but the heap "
            f"reserves {heap.recv_capacity}; call initialize(heap_size=...) with at least {heap_bytes_for(need)} bytes "
            f"(before the first call, or after shutdown())")
    n_blocks = math.ceil(spec.seq_local / cfg.block_n)
    chunk_blocks = cfg.chunk_blocks
    while True:
        n_chunks = math.ceil(n_blocks / chunk_blocks)
        flags = (world_size - 1) * spec.batch * spec.num_kv_heads * n_chunks
        if flags <= heap.flag_capacity:
            break
        chunk_blocks *= 2
    grid = (spec.batch * spec.num_heads * math.ceil(spec.seq_local / cfg.block_m),)
    return LaunchPlan(spec, world_size, cfg, chunk_blocks, grid, need, flags)


def make_ctx(heap_bases, rank: int, heap: HeapLayout, slot: int = 0) -> np.ndarray:
    """The context array the kernel reads on one rank of a ring (int64): the heap bases of the ring's members
    in ring order, as mapped in this rank's process; this rank's position in the ring; the offsets of the
    ring slot's control words and flags, and of the receive region."""
    bases = np.asarray(heap_bases, dtype=np.uint64).astype(np.int64)
    return np.concatenate([bases, np.array([rank, heap.ctl_off_of(slot), heap.flags_off_of(slot), heap.recv_off],
                                           np.int64)])


class RingAttentionTimeout(RuntimeError):
    """A bounded wait inside the fused kernel expired: a peer never arrived or ranks disagree."""


class RingAttentionMismatch(RuntimeError):
    """The ranks made different fused calls (or are at different calls): found by the kernel before any
    data moved between them."""


SIG_FIELDS = ("epoch", "kernel", "world", "batch", "seq_local", "heads", "kv_heads", "head_dim", "dtype", "flags",
              "scale", "chunk_rows", "block")


def call_signature(kind: int, world_size: int, spec: AttentionSpec, chunk_rows: int, block: int) -> np.ndarray:
    """The SIG_WORDS int32 words by which ranks check, inside the kernel and before anything moves, that
    they make the same call: word 0 the epoch (the kernel fills it in), then ``SIG_FIELDS``. The kernels
    build the same words from their own arguments (ring_core.kernel._call_words); ``chunk_rows`` and
    ``block`` fix how the K/V (and the backward's partials) are cut into flagged pieces."""
    w = np.zeros(SIG_WORDS, np.int32)
    w[1:13] = [kind, world_size, spec.batch, spec.seq_local, spec.num_heads, spec.num_kv_heads, spec.head_dim,
               DTYPE_CODES[spec.dtype], int(spec.is_causal) | (int(spec.layout == "zigzag") << 1),
               np.float32(spec.scale).view(np.int32), chunk_rows, block]
    return w


def describe_signature(words) -> str:
    """A signature (call_signature) in words a user recognises."""
    w = [int(x) for x in np.asarray(words).reshape(-1)[:SIG_WORDS]]
    kind = {KIND_FWD: "forward", KIND_BWD: "backward"}.get(w[1], f"kernel {w[1]}")
    dtype = {v: k for k, v in DTYPE_CODES.items()}.get(w[8], f"dtype code {w[8]}")
    scale = float(np.array(w[10], np.int32).view(np.float32))
    mask = ("causal " + ("zigzag" if w[9] & 2 else "contiguous")) if w[9] & 1 else (
        "non-causal " + ("zigzag" if w[9] & 2 else "contiguous"))
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
                f"layout, scale, forward/backward) in the same order. The kernel found this before any data "
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
    elif code == ERR_PARTIAL_TIMEOUT:  # backward kernel (defined in the backward section below)
        what = f"waiting for the partial dK/dV of rank {peer} (backward)"
    elif code == ERR_LOCAL_TIMEOUT:
        what = "waiting for this rank's own backward programs (delta rows)"
    else:
        what = f"with unknown error code {code} (peer {peer}, step {step})"
    raise RingAttentionTimeout(
        f"fused ring attention on rank {rank} (call #{epoch}) gave up after {limit} {what}. "
        f"Every rank must make the same ring-attention calls in the same order with the same shapes; "
        f"a rank that died or is far slower causes this. Raise the limit with {TIMEOUT_ENV} if a rank is "
        f"legitimately late. The ranks' call counters may now disagree: call reset() (jax_ring.reset / "
        f"torch_bridge.reset) on every rank before the next call; the heap stays usable.")


# ======================================================================================================
# Backward kernel (ring_core.kernel_bwd): launch maths and heap need.
# Kept apart from the forward's KernelConfig / plan above; both frontends and the simulator take the
# backward's grid, block sizes, scalars and constexprs from here.
#
# Heap use of one backward call (inside the same workspace, regions of HeapLayout):
#     control words  ctl[0..8+MAX_WORLD) shared with the forward (epoch, claim/finish counters, error
#                    record, barrier), plus the two backward counters below
#     flags          [K/V push flags: (W-1)*B*HKV*n_chunks][partial flags: (W-1)*B*HKV*n_kv_blocks]
#     receive region [0, kv_bytes)            K/V of the peers: [W-1][K|V][B][HKV][S][D], input dtype
#                    [part_off, +part_bytes)  partial dK/dV from the peers: [W-1][dK|dV][B][HKV][S][D] fp32
#
# Kernel argument order (what jax-triton passes, and the torch launcher passes the same list):
#     q, k, v, out, dout, lse, dlse, ctx | B, S, sm_scale, timeout_ns, part_off | dq, dk, dv, delta, status |
#     constexprs    (dlse: the cotangent of lse, float32 [B, H, S]; zeros when lse carries no gradient)
# ======================================================================================================
CTL_BWD_TICKET = CTL_WORDS  # task tickets handed out in this call (tasks are taken in ticket order)
CTL_BWD_DELTA = CTL_WORDS + 1  # dq tasks that have published their rows of delta = rowsum(dO * O)
assert (CTL_BWD_DELTA + 1) * 4 <= CTL_BYTES
# The first failed call's status words since the last read (ring_core.heap.SymmetricHeap.take_error) or
# reset: how errors reach a JAX program that runs without a host callback per call.
CTL_STICKY = CTL_WORDS + 8
assert (CTL_STICKY + STATUS_WORDS) * 4 <= CTL_BYTES


def take_sticky(heap_bytes, heap: HeapLayout, base_off: int = 0):
    """Read and clear a rank's first kept status (CTL_STICKY), looking at the ring slots in order:
    ``heap_bytes`` is a torch uint8 tensor holding the rank's workspace, starting ``base_off`` bytes from
    the heap base. Returns the status words (for check_status) or None when no call failed since the last
    take."""
    import torch

    for slot in range(RING_SLOTS):
        start = heap.ctl_off_of(slot) - base_off + 4 * CTL_STICKY
        words = heap_bytes[start:start + 4 * STATUS_WORDS].view(torch.int32)
        status = words.cpu().numpy().copy()
        if status[0] != ERR_NONE:
            words.zero_()
            return status
    return None
ERR_PARTIAL_TIMEOUT = 4  # status code: a peer's partial dK/dV never arrived
ERR_LOCAL_TIMEOUT = 5  # status code: this rank's own delta rows never all arrived (cannot happen but bounded)


@dataclass(frozen=True)
class BwdKernelConfig:
    """Tuning knobs of the backward kernel (hashable: usable as a static argument).

    dq tasks take ``dq_block_m`` query rows and step over the K/V in ``dq_block_n`` rows; dK/dV tasks take
    ``kv_block_n`` K/V rows and step over the local queries in ``kv_block_m`` rows (FA2's split).
    K/V travel in chunks of ``chunk_blocks * kv_block_n`` rows, ``push_rows`` rows per store; a dQ task
    claims one push unit every ``seg_blocks`` blocks of its local K/V."""

    dq_block_m: int
    dq_block_n: int
    kv_block_n: int
    kv_block_m: int
    chunk_blocks: int
    push_rows: int
    num_warps: int
    num_stages: int
    seg_blocks: int = 4

    @staticmethod
    def get_default(spec: AttentionSpec, world_size: int, *, interpret: bool = False) -> "BwdKernelConfig":
        if interpret:
            # Small tiles: several blocks, chunks and tasks even at the tiny sizes CI can afford.
            return BwdKernelConfig(16, 16, 16, 16, chunk_blocks=1, push_rows=16, num_warps=4, num_stages=1,
                                   seg_blocks=2)
        # Other head dims and fp32: not tuned on a GPU yet. Shared memory when compiled for sm_90 with Triton
        # 3.6 (tests/test_kernel_ir.py checks <= 227 KiB), every loop with a dot software-pipelined: D64 fp32
        # 80 KiB, fp16 65 KiB; D128 bf16 161 KiB, fp32 145 KiB; D256 bf16 99 KiB, fp32 132 KiB.
        stages = 2 if spec.dtype == "float32" else 3
        if spec.head_dim <= 64:
            return BwdKernelConfig(64, 64, 64, 64, chunk_blocks=2, push_rows=64, num_warps=4, num_stages=stages)
        if spec.head_dim <= 128 and spec.dtype != "float32":
            # Measured on 2xH200 (benchmarks/tune.py --kernel bwd, bf16 D128 H32 seq_local 16k), after the wgmma
            # fix (results/tune_backward_2xH200_2026-11-30b.csv): the best of seven, 60 ms (full) and 31 ms
            # (causal) against 68 and 36 with 2 stages; 81 and 37 before the fix (..._2026-11-30.csv).
            return BwdKernelConfig(128, 64, 128, 64, chunk_blocks=1, push_rows=32, num_warps=8, num_stages=3)
        if spec.head_dim <= 128:
            return BwdKernelConfig(64, 64, 64, 64, chunk_blocks=2, push_rows=32, num_warps=8, num_stages=stages)
        return BwdKernelConfig(32, 32, 32, 32, chunk_blocks=4, push_rows=16, num_warps=4, num_stages=stages)


@dataclass(frozen=True)
class BwdLaunchPlan:
    spec: AttentionSpec
    world_size: int
    config: BwdKernelConfig
    chunk_blocks: int
    grid: tuple
    n_dq_tasks: int
    n_partial_tasks: int
    n_final_tasks: int
    kv_bytes: int
    part_off: int
    recv_bytes: int
    flags_needed: int

    def constexprs(self, *, interpret: bool, sticky_errors: bool = False) -> dict:
        """As LaunchPlan.constexprs."""
        s, c = self.spec, self.config
        return dict(
            W=self.world_size, H=s.num_heads, HKV=s.num_kv_heads, D=s.head_dim,
            DQ_BLOCK_M=c.dq_block_m, DQ_BLOCK_N=c.dq_block_n, KV_BLOCK_N=c.kv_block_n, KV_BLOCK_M=c.kv_block_m,
            BLOCK_D=block_d(s.head_dim), CHUNK_BLOCKS=self.chunk_blocks, PUSH_ROWS=c.push_rows,
            SEG_BLOCKS=c.seg_blocks, PUSH_VEC=bwd_store_hint(s.head_dim, ELEM_BYTES[s.dtype]),
            PART_VEC=bwd_store_hint(s.head_dim, 4),
            CAUSAL=s.is_causal, ZIGZAG=s.layout == "zigzag", INTERPRET=interpret, DOT_PRECISION="ieee",
            SIG_DTYPE=DTYPE_CODES[s.dtype], STICKY_ERRORS=sticky_errors,
        )

    def signature(self) -> np.ndarray:
        """This call's signature words (call_signature), as the kernel builds them."""
        return call_signature(KIND_BWD, self.world_size, self.spec, self.chunk_blocks * self.config.kv_block_n,
                              self.config.kv_block_n)

    def scalars(self, timeout_s: float | None = None) -> tuple:
        s = self.spec
        return (s.batch, s.seq_local, float(s.scale), timeout_ns(timeout_s), self.part_off)

    @property
    def out_shapes(self):
        """(shape, dtype name) of dq, dk, dv, delta (scratch), status."""
        s = self.spec
        q = (s.batch, s.seq_local, s.num_heads, s.head_dim)
        kv = (s.batch, s.seq_local, s.num_kv_heads, s.head_dim)
        return ((q, s.dtype), (kv, s.dtype), (kv, s.dtype), ((s.batch, s.num_heads, s.seq_local), "float32"),
                ((STATUS_WORDS,), "int32"))


def bwd_store_hint(head_dim: int, itemsize: int) -> int:
    """iris.store's alignment hint for rows of ``head_dim`` elements of ``itemsize`` bytes written into a
    peer's receive region (K/V pushes, float32 partials): 16 (16-byte aligned groups of 16 contiguous
    elements) when every row starts 16-byte aligned, else 1 (no claim)."""
    return 16 if (head_dim * itemsize) % 16 == 0 else 1


def bwd_recv_bytes(spec: AttentionSpec, world_size: int) -> tuple:
    """(K/V bytes, byte offset of the partial-dK/dV region, total receive bytes) of one backward call."""
    per_peer = spec.batch * spec.num_kv_heads * spec.seq_local * spec.head_dim
    kv = (world_size - 1) * 2 * per_peer * ELEM_BYTES[spec.dtype]
    part_off = _align(kv)
    part = (world_size - 1) * 2 * per_peer * 4
    return kv, part_off, (part_off + part) if world_size > 1 else 0


def plan_bwd(spec: AttentionSpec, world_size: int, heap: HeapLayout, *, interpret: bool = False,
             config: BwdKernelConfig | None = None) -> BwdLaunchPlan:
    """Everything a backward launch needs; raises HeapTooSmallError (before anything runs) when the heap
    is short of receive space or flags."""
    if spec.dtype not in ELEM_BYTES:
        raise TypeError(f"the fused kernel supports float16, bfloat16 and float32 inputs, got {spec.dtype}; "
                        "use a reference backend for float64")
    cfg = config or BwdKernelConfig.get_default(spec, world_size, interpret=interpret)
    kv, part_off, need = bwd_recv_bytes(spec, world_size)
    if need > heap.recv_capacity:
        raise HeapTooSmallError(
            f"this backward call needs {need} bytes of symmetric-heap receive space ({world_size - 1} peers x "
            f"K and V of [{spec.batch}, {spec.seq_local}, {spec.num_kv_heads}, {spec.head_dim}] {spec.dtype}: "
            f"{kv} bytes, plus their partial dK and dV in float32: {need - part_off} bytes) but the heap "
            f"reserves {heap.recv_capacity}; call initialize(heap_size=...) with at least {heap_bytes_for(need)} "
            f"bytes (before the first call, or after shutdown())")
    S, W = spec.seq_local, world_size
    n_kv_blocks = math.ceil(S / cfg.kv_block_n)
    part_flags = (W - 1) * spec.batch * spec.num_kv_heads * n_kv_blocks
    chunk_blocks = cfg.chunk_blocks
    while True:
        n_chunks = math.ceil(n_kv_blocks / chunk_blocks)
        kv_flags = (W - 1) * spec.batch * spec.num_kv_heads * n_chunks
        if kv_flags + part_flags <= heap.flag_capacity or n_chunks == 1:
            break
        chunk_blocks *= 2
    flags = kv_flags + part_flags
    if flags > heap.flag_capacity:
        raise HeapTooSmallError(
            f"this backward call needs {flags} flags ({flags * 4} bytes: one per K/V block of every peer) but "
            f"a ring's flag region holds {heap.flag_capacity}; call initialize(heap_size=...) with a larger heap "
            f"(the flag region is 1/64 of it, at most {MAX_FLAG_BYTES} bytes, shared by {RING_SLOTS} ring slots), "
            "or use fewer tokens per call")
    n_dq = spec.batch * spec.num_heads * math.ceil(S / cfg.dq_block_m)
    n_part = (W - 1) * spec.batch * spec.num_kv_heads * n_kv_blocks
    n_final = spec.batch * spec.num_kv_heads * n_kv_blocks
    return BwdLaunchPlan(spec, W, cfg, chunk_blocks, (n_dq + n_part + n_final,), n_dq, n_part, n_final, kv,
                         part_off, need, flags)
