"""Tile sizes and launch plans: everything a launch of either kernel needs, in one place for both frontends
and the simulator (grid, block sizes, constexprs, scalars and their types, output shapes, heap need).

Kernel argument order (what both launchers pass, jax_ring._triton_call and torch's JIT launch: inputs, runtime
scalars, outputs, constexprs):

    forward:  q, k, v, seg, ctx | B, S, sm_scale, timeout_ns | out, lse, status | constexprs
    backward: q, k, v, out, dout, lse, dlse, seg, ctx | B, S, sm_scale, timeout_ns, part_off |
              dq, dk, dv, delta, status | constexprs
              (dlse: the cotangent of lse, float32 [B, H, S]; zeros when lse carries no gradient;
              seg: this rank's segment ids, int32 [B, S] in layout order, read only with SEGMENTED (else any
              int32 array: the launchers pass a one-element dummy))

The window is a pair of constexprs (WIN_LEFT, WIN_RIGHT, as ring_core.masks.kernel_window gives them, an
unbounded side control.NO_SIDE; WINDOW says whether there is one), not runtime scalars: a kernel is compiled per
window, which is one or two per model (a local and a global layer type; across nodes a few more per layer type,
the bands moved by a node's length: ring_core.nodes), and in exchange every test on an unbounded side folds away.

Heap use of one call (regions of ring_core.protocol.control.HeapLayout; flags in the ring's slot):
    forward   receive region [W-1][K|V][B][HKV][S][D] (input dtype), with segment ids then the peers' ids
              [W-1][B][HKV][S] int32 (each pushed chunk carries its rows' ids); a flag per pushed chunk, then
              with segment ids every rank's id ranges (``id_range_words``)
    backward  the same K/V (and ids), then from ``part_off`` the peers' partial dK/dV [W-1][dK|dV][B][HKV][S][D]
              in float32; a flag per pushed chunk, then one per partial block, then (segment ids) the id ranges
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from ring_core import masks, settings
from ring_core.kernels.configs import (GLUON_BWD_DET_HEAD_DIMS, GLUON_BWD_HEAD_DIMS, GLUON_BWD_KV_ROWS,
                                       GLUON_BWD_Q_ROWS, GLUON_BWD_ROW_TASK, GLUON_TILES)
from ring_core.protocol import control
from ring_core.runtime import build
from ring_core.protocol.control import HeapLayout, HeapTooSmallError
from ring_core.validate import FUSED_DTYPES, AttentionSpec, check_fused_dtype

ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


# ------------------------------------------------------------------------------------------- tile configs
@dataclass(frozen=True)
class KernelConfig:
    """Tuning knobs of the forward kernel (hashable: usable as a static argument)."""

    block_m: int
    block_n: int
    chunk_blocks: int
    push_rows: int
    num_warps: int
    num_stages: int
    seg_blocks: int = 4  # K/V blocks computed between two push claims in ring step 0
    gluon: bool = False  # the Hopper kernel (ring_core.kernels.gluon_fwd) instead of the tl one (kernels.tl_fwd)

    @staticmethod
    def get_default(spec: AttentionSpec, world_size: int, *, interpret: bool = False,
                    capability: tuple | None = None) -> "KernelConfig":
        """The tuned tiles for ``spec``; on a GPU of compute ``capability`` where ``gluon_applies``, the Gluon kernel's
        (ring_core.kernels.gluon_fwd): its query rows per tile, K/V rows per block and K/V slots at this head_dim
        (``GLUON_TILES``; ``num_stages``: the slots), 4 warps per partition, chunks of 4 blocks per flag; with segment
        ids chunks of one block, whose published id ranges then say which blocks a tile loads and which it computes
        unmasked (ring_core.kernels.gluon_fwd reads blocks whole: its skipping is as fine as the ranges)."""
        if not interpret and gluon_applies(spec, world_size, capability):
            block_m, block_n, slots, _ = GLUON_TILES[spec.head_dim]
            return KernelConfig(block_m=block_m, block_n=block_n, chunk_blocks=1 if spec.segmented else 4,
                                push_rows=32, num_warps=4, num_stages=slots, gluon=True)
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


GLUON_ENV = settings.GLUON  # "0": the tl kernel on every GPU (read at each plan)
GLUON_DET_ENV = settings.GLUON_DETERMINISTIC  # "0": deterministic backwards on the tl split (each plan)
_CAPABILITY = {}  # torch device -> (major, minor)


def gluon_capability(device):
    """The compute capability of torch ``device`` where the Gluon kernel may run on it (None: a CPU device, or
    RING_ATTENTION_GLUON=0)."""
    if getattr(device, "type", None) != "cuda" or not settings.gluon():
        return None
    if device not in _CAPABILITY:
        import torch

        _CAPABILITY[device] = tuple(torch.cuda.get_device_capability(device))
    return _CAPABILITY[device]


_SMS = {}  # torch device -> streaming multiprocessors


def device_sms(device) -> int | None:
    """The streaming multiprocessors of torch ``device`` (None: not a CUDA device): the persistent Gluon kernels'
    programs (``plan``). Ranks sharing a GPU under MPS see the whole GPU's count; each rank's programs then run in as
    many waves as its share of the SMs asks, the protocol being indifferent to how many are resident (a program pushes
    every unit left before it waits: ring_core.protocol.steps)."""
    if getattr(device, "type", None) != "cuda":
        return None
    if device not in _SMS:
        import torch

        _SMS[device] = int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _SMS[device]


def gluon_applies(spec: AttentionSpec, world_size: int, capability) -> bool:
    """Whether the Gluon Hopper kernel (ring_core.kernels.gluon_fwd) takes the forward of ``spec`` over ``world_size``
    ranks on a GPU of compute ``capability`` ((major, minor); None: no GPU, or the Gluon kernel turned off): Hopper
    (9.x), fp16/bf16, head_dim 64, 128 or 256 (``GLUON_TILES``), seq_local a multiple of the tile's query rows and of
    the K/V block's (128; zigzag: of twice that, 256, so that each half of the shard holds whole tiles and blocks: the
    masks are positions relative to one number per block, which needs a tile's and a block's positions contiguous);
    windows and segment ids too. Everything else runs the tl kernel (ring_core.kernels.tl_fwd)."""
    if capability is None or tuple(capability)[0] != 9 or spec.head_dim not in GLUON_TILES:
        return False
    block_m, block_n, _, _ = GLUON_TILES[spec.head_dim]
    rows = math.lcm(block_m, block_n) * (2 if spec.layout == "zigzag" else 1)
    return spec.dtype in ("float16", "bfloat16") and spec.seq_local % rows == 0




def kernel_spec(spec: AttentionSpec, capability) -> AttentionSpec:
    """The call the fused kernels run for ``spec`` on a GPU of compute ``capability``: ``spec`` itself, or ``spec`` at
    the next power of two of its head_dim where the tl kernels would compute at that width anyway (their BLOCK_D:
    ``block_d``) and the Gluon Hopper forward takes it (``gluon_applies``; head_dim 80 and 96 run at 128, 192 at 256,
    48 at 64). Both frontends then pad q, k and v with zero columns up to it and cut the output back: the zeros add
    nothing to Q K^T, so the scores and lse are the caller's; the output's and the gradients' extra columns are cut
    off; the scale is the caller's (1 / sqrt of its head_dim by default, resolved in ``spec``). It costs the padded
    copies of q, k and v (kept for the backward) and the output's cut, against the Gluon kernels' speed at that
    width."""
    width = block_d(spec.head_dim)
    if width == spec.head_dim or width not in GLUON_TILES:
        return spec
    padded = dataclasses.replace(spec, head_dim=width)
    return padded if gluon_applies(padded, 1, capability) else spec


def gluon_bwd_applies(spec: AttentionSpec, world_size: int, capability, deterministic: bool = False) -> bool:
    """Whether the Gluon Hopper backward (ring_core.kernels.gluon_bwd) may take the backward of ``spec``
    (BwdKernelConfig.get_default): where the Gluon forward applies (``gluon_applies``) and head_dim is 64 or 128
    (``GLUON_BWD_HEAD_DIMS``: its dQ is split between two consumers by halves of D; at 256 a consumer's dK and dV
    accumulators alone would take 256 registers a thread); with a window or segment
    ids only in its any-order mode (``deterministic`` False: its deterministic order counts each query block's
    contributors by position, which masks change; those run the tl backward); in its deterministic order only at
    ``GLUON_BWD_DET_HEAD_DIMS`` (elsewhere the tl split is faster). Where the keys' segment ids are not the queries'
    (``spec.kv_ids``) its load warp steps over the query blocks by position alone (this rank's published chunk
    ranges are its keys' there)."""
    unmasked = (masks.kernel_window(spec.is_causal, spec.window, world_size * spec.seq_local, spec.key_offset)
                == masks.UNBOUNDED and not spec.segmented)
    return (gluon_applies(spec, world_size, capability) and spec.head_dim in GLUON_BWD_HEAD_DIMS
            and (not deterministic or (unmasked and spec.head_dim in GLUON_BWD_DET_HEAD_DIMS)))


@dataclass(frozen=True)
class BwdKernelConfig:
    """Tuning knobs of the backward kernel (hashable: usable as a static argument).

    dq tasks take ``dq_block_m`` query rows and step over the K/V in ``dq_block_n`` rows; dK/dV tasks take
    ``kv_block_n`` K/V rows and step over the local queries in ``kv_block_m`` rows (FA2's split).
    K/V travel in chunks of ``chunk_blocks * kv_block_n`` rows, ``push_rows`` rows per store; a dQ task
    claims one push unit every ``seg_blocks`` blocks of its local K/V.

    ``deterministic``: whether the kernel this config runs gives bit-identical gradients from run to run (and so between
    the frontends, which launch it alike). The split kernel (ring_core.kernels.tl_bwd) always does: every dQ, dK and dV
    block is summed in a fixed order. The Gluon kernel (``gluon``: ring_core.kernels.gluon_bwd) adds dQ up in the order
    its contributions arrive when False, and in the tickets' order (each add waiting for its turn) when True. The
    constexpr DETERMINISTIC of both kernels; the split kernel ignores it (always True for it: one binary whatever the
    caller asked for)."""

    dq_block_m: int
    dq_block_n: int
    kv_block_n: int
    kv_block_m: int
    chunk_blocks: int
    push_rows: int
    num_warps: int
    num_stages: int
    seg_blocks: int = 4
    deterministic: bool = True
    gluon: bool = False  # the Hopper kernel (ring_core.kernels.gluon_bwd) instead of the tl one (kernels.tl_bwd)

    @staticmethod
    def get_default(spec: AttentionSpec, world_size: int, *, interpret: bool = False,
                    deterministic: bool = False, capability: tuple | None = None,
                    gluon_det: bool = True) -> "BwdKernelConfig":
        """The tiles for ``spec``. ``deterministic``: the caller needs bit-identical gradients from run to run (the
        frontends' ``deterministic``, or the framework's switch for deterministic algorithms). Without it, the Gluon
        Hopper kernel takes the call where it applies on a GPU of compute ``capability`` (``gluon_bwd_applies``;
        ring_core.kernels.gluon_bwd: dQ added up by TMA reductions in no fixed order), with its tiles (128 K/V rows
        per dK/dV task, ``GLUON_BWD_Q_ROWS`` query rows per step, 512 rows per delta or dQ task, one K/V block per
        flag). With it, the same kernel in its own deterministic order (DETERMINISTIC: dQ's adds in ticket order, by
        a writer warp; 0.87-0.95x cuDNN forward+backward against the split's 0.80 at head_dim 128, docs/performance.md)
        where it applies (``gluon_bwd_applies``: without masks, at ``GLUON_BWD_DET_HEAD_DIMS``), else the split kernel;
        ``gluon_det`` False (RING_ATTENTION_GLUON_DETERMINISTIC=0, read by ``plan_bwd``) gives the split for A/B
        runs."""
        if (not interpret and (gluon_det or not deterministic)
                and gluon_bwd_applies(spec, world_size, capability, deterministic)):
            q_rows = GLUON_BWD_Q_ROWS[spec.head_dim]
            return BwdKernelConfig(dq_block_m=GLUON_BWD_ROW_TASK, dq_block_n=q_rows,
                                   kv_block_n=GLUON_BWD_KV_ROWS, kv_block_m=q_rows, chunk_blocks=1,
                                   push_rows=32, num_warps=4, num_stages=2, deterministic=deterministic, gluon=True)
        if interpret:
            # Small tiles: several blocks, chunks and tasks even at the tiny sizes CI can afford.
            return BwdKernelConfig(16, 16, 16, 16, chunk_blocks=1, push_rows=16, num_warps=4, num_stages=1,
                                   seg_blocks=2)
        # Other head dims and fp32: not tuned on a GPU yet. Shared memory when compiled for sm_90 with Triton
        # 3.6 (tests/cpu/test_kernel_ir.py checks <= 227 KiB), every loop with a dot software-pipelined: D64 fp32
        # 80 KiB, fp16 65 KiB; D128 bf16 161 KiB, fp32 145 KiB; D256 bf16 99 KiB, fp32 132 KiB.
        stages = 2 if spec.dtype == "float32" else 3
        if spec.head_dim <= 64:
            return BwdKernelConfig(64, 64, 64, 64, chunk_blocks=2, push_rows=64, num_warps=4, num_stages=stages)
        if spec.head_dim <= 128 and spec.dtype != "float32":
            # Measured on 2xH200 (benchmarks/tune.py --kernel bwd, bf16 D128 H32 seq_local 16k), after the wgmma
            # fix (results/tune_backward_parallel-matmuls_2xH200_2026-11-30.csv): the best of seven, 60 ms (full) and 31 ms
            # (causal) against 68 and 36 with 2 stages; 81 and 37 before the fix (..._2026-11-30.csv).
            return BwdKernelConfig(128, 64, 128, 64, chunk_blocks=1, push_rows=32, num_warps=8, num_stages=3)
        if spec.head_dim <= 128:
            return BwdKernelConfig(64, 64, 64, 64, chunk_blocks=2, push_rows=32, num_warps=8, num_stages=stages)
        if spec.dtype != "float32":
            # Measured on one H100 (benchmarks/tune.py --kernel bwd --head-dims 256 --seq 16384,
            # results/tune_backward_d256_1xH100_2026-12-06.csv): the best of seven, 54 ms (causal) and 115 ms (full)
            # against 68 and 132 with the 32-row tiles below, gradients bit-identical to theirs. 192 runs here padded.
            return BwdKernelConfig(128, 32, 64, 32, chunk_blocks=2, push_rows=16, num_warps=8, num_stages=2)
        return BwdKernelConfig(32, 32, 32, 32, chunk_blocks=4, push_rows=16, num_warps=4, num_stages=stages)


# --------------------------------------------------------------------------------------------- launch plans
@dataclass(frozen=True)
class LaunchPlan:
    """One launch of either kernel (``kind``: control.KIND_FWD or KIND_BWD), made by ``plan`` / ``plan_bwd``:
    grid, tiles, how the K/V travel (chunks of ``chunk_blocks`` blocks of ``block`` rows), the heap's need,
    and the kernel's constexprs, scalars (with their Triton types) and outputs. ``interpret``: the code paths
    of the Triton interpreter (no %globaltimer, float32 dots)."""

    kind: int
    spec: AttentionSpec
    world_size: int
    config: KernelConfig | BwdKernelConfig
    chunk_blocks: int
    block: int
    grid: tuple
    recv_bytes: int
    flags_needed: int
    interpret: bool = False
    part_off: int = 0  # backward: byte offset of the partial dK/dV region in the receive region
    n_dq_tasks: int = 0  # backward: tasks of each kind, in ticket order
    n_partial_tasks: int = 0
    n_final_tasks: int = 0

    @property
    def chunk_rows(self) -> int:
        return self.chunk_blocks * self.block

    @property
    def kv_bytes(self) -> int:
        """Receive bytes of the peers' K/V (then their segment ids, if any; the backward's partials follow from
        ``part_off``)."""
        return kv_bytes(self.spec, self.world_size)

    @property
    def window(self) -> tuple:
        """(left, right) as the kernels apply it (ring_core.masks.kernel_window): (None, None) when nothing is
        masked by position beyond ``is_causal``."""
        return masks.kernel_window(self.spec.is_causal, self.spec.window, self.world_size * self.spec.seq_local,
                                   self.spec.key_offset)

    @property
    def n_chunks(self) -> int:
        """K/V chunks of one (batch, kv head) of a shard: each is pushed (or not) and flagged as one unit."""
        return math.ceil(self.spec.seq_local / self.chunk_rows)

    @property
    def kv_flags(self) -> int:
        """Flag words of the K/V chunks, the first of the ring slot's flags: [W-1][B][HKV][n_chunks] (peer
        distance d - 1 first), in both kernels (the backward's partial-dK/dV flags follow them)."""
        return (self.world_size - 1) * self.spec.batch * self.spec.num_kv_heads * self.n_chunks

    def chunks_received(self, flag_words, epoch: int):
        """What this rank's kernel received in the call of ``epoch``, from the slot's first ``kv_flags`` flag
        words after the call (``ring_core.protocol.control.ring_flags``; ``HeapRings.ring_flags`` on a GPU heap): a
        numpy array [W] whose entry t >= 1 counts the K/V chunks (over batch and kv heads) that came from rank
        ``rank - t``, i.e. at ring step t. Entry 0 is 0 (step 0 uses the local K/V).

        This is where the kernels' decisions show: which chunks travel is decided on the device, chunk by
        chunk, by causal masking and the window (``ring_core.protocol.steps.chunk_needed``: a chunk is pushed iff
        some query of the receiver sees one of its rows by position) and by the segment ids' ranges
        (``ring_core.protocol.steps.push_unit``), and a tile waits for, loads and computes
        exactly the chunks of its ring steps that reach its rows, all of which were pushed. So the ring steps a
        rank runs (some tile waits, loads or computes there) are step 0 and those with a chunk received:
        ``ring_steps_run``. Segment ids decide too, in both kernels: a chunk travels only if its ids meet the
        receiver's (the id ranges published with the call check)."""
        w = self.world_size
        flags = np.asarray(flag_words)[:self.kv_flags].reshape(w - 1, self.kv_flags // max(w - 1, 1))
        return np.concatenate([[0], (flags == epoch).sum(axis=1)]).astype(np.int64)

    def ring_steps_run(self, flag_words, epoch: int) -> int:
        """How many of the W ring steps this rank's kernel ran in the call of ``epoch`` (``chunks_received``):
        1 + the steps whose K/V reached it."""
        return 1 + int(np.count_nonzero(self.chunks_received(flag_words, epoch)[1:]))

    def constexprs(self, *, sticky_errors: bool = False) -> dict:
        """The kernel's constexprs; ``sticky_errors``: keep a failed call's status on the heap for the host
        (deferred errors, ring_core.protocol.control.errors_mode). A new dict each time, built once per plan (the torch
        launcher asks for it at every call)."""
        return dict(_cached_constexprs(self, sticky_errors))

    def _constexprs(self, sticky_errors: bool) -> dict:
        s, c = self.spec, self.config
        shared = dict(
            W=self.world_size, H=s.num_heads, HKV=s.num_kv_heads, D=s.head_dim, BLOCK_D=block_d(s.head_dim),
            CHUNK_BLOCKS=self.chunk_blocks, PUSH_ROWS=c.push_rows, SEG_BLOCKS=c.seg_blocks, POLL_N=control.POLL_N,
            PUSH_VEC=store_hint(s.head_dim, ELEM_BYTES[s.dtype]), CAUSAL=s.is_causal, ZIGZAG=s.layout == "zigzag",
            INTERPRET=self.interpret, DOT_PRECISION="ieee", SIG_DTYPE=control.DTYPE_CODES[s.dtype],
            STICKY_ERRORS=sticky_errors, **control.window_constexprs(self.window), SEGMENTED=bool(s.segmented),
            KV_IDS=bool(s.segmented and s.kv_ids),
        )
        if self.kind == control.KIND_FWD:
            return dict(shared, BLOCK_M=c.block_m, BLOCK_N=c.block_n)
        return dict(shared, DQ_BLOCK_M=c.dq_block_m, DQ_BLOCK_N=c.dq_block_n, KV_BLOCK_N=c.kv_block_n,
                    KV_BLOCK_M=c.kv_block_m, PART_VEC=store_hint(s.head_dim, 4), DETERMINISTIC=c.deterministic)

    def signature(self):
        """This call's signature words (ring_core.protocol.control.call_signature), as the kernel builds them."""
        return control.call_signature(self.kind, self.world_size, self.spec, self.chunk_rows, self.block)

    def scalars(self, timeout_s: float | None = None) -> tuple:
        """The runtime scalars, in argument order; their Triton types are ``scalar_types``."""
        s = self.spec
        base = (s.batch, s.seq_local, control.kernel_scale(s.scale), control.timeout_ns(timeout_s))
        return base if self.kind == control.KIND_FWD else (*base, self.part_off)

    @property
    def scalar_types(self) -> tuple:
        """Triton types of ``scalars`` (what the JAX launcher compiles and passes them as; ring_core.runtime.build)."""
        base = ("i32", "i32", "fp32", "i64")
        return base if self.kind == control.KIND_FWD else (*base, "i32")

    def arg_types(self) -> list:
        """Triton types of the kernel's runtime arguments, in argument order (the module docstring): what both
        launchers pass (inputs, scalars, outputs), as ring_core.runtime.build compiles them."""
        t = "*" + build.TRITON_TYPES[self.spec.dtype]
        ids = ["*i32", "*i32"]  # seg, ctx
        outs = [f"*{build.TRITON_TYPES[dt]}" for _, dt in self.out_shapes]
        inputs = [t] * 3 if self.kind == control.KIND_FWD else [t] * 5 + ["*fp32"] * 2
        return [*inputs, *ids, *self.scalar_types, *outs]

    def kernel(self):
        """The Triton kernel this plan launches (imported on first use)."""
        if self.kind == control.KIND_FWD:
            if self.config.gluon:
                from ring_core.kernels.gluon_fwd import ring_attn_fwd_gluon
                return ring_attn_fwd_gluon
            from ring_core.kernels.tl_fwd import ring_attn_fwd_kernel
            return ring_attn_fwd_kernel
        if self.config.gluon:
            from ring_core.kernels.gluon_bwd import ring_attn_bwd_gluon
            return ring_attn_bwd_gluon
        from ring_core.kernels.tl_bwd import ring_attn_bwd_kernel
        return ring_attn_bwd_kernel

    def compile_record(self, *, sticky_errors: bool = False, timeout_s: float | None = None, tag: str = "") -> dict:
        """The compile-log record (ring_core.runtime.build.record) of the binary this launch runs: what a cache filled
        ahead of the launch (``python -m ring_core.runtime.build --warm``) needs, on a machine with no GPU."""
        n_in = len(self.arg_types()) - len(self.scalar_types) - len(self.out_shapes)
        values = [None] * n_in + list(self.scalars(timeout_s)) + [None] * len(self.out_shapes)
        return build.record(self.kernel(), self.arg_types(), self.constexprs(sticky_errors=sticky_errors),
                            num_warps=self.config.num_warps, num_stages=self.config.num_stages, values=values,
                            tag=tag)

    @property
    def out_shapes(self):
        """(shape, dtype name) of the outputs, in argument order: forward out, lse, status; backward dq, dk,
        dv, delta (scratch: [B, H, S]; the Gluon kernel's, flat, with its float32 dQ accumulator [B, S, H, D]
        after it, then its int32 counters of dQ's adds [B, H, S // query rows a step, 2]), status."""
        s = self.spec
        q = (s.batch, s.seq_local, s.num_heads, s.head_dim)
        rows = (s.batch, s.num_heads, s.seq_local)
        status = ((control.STATUS_WORDS,), "int32")
        if self.kind == control.KIND_FWD:
            return (q, s.dtype), (rows, "float32"), status
        kv = (s.batch, s.seq_local, s.num_kv_heads, s.head_dim)
        if self.config.gluon:
            turns = s.batch * s.num_heads * (s.seq_local // self.config.kv_block_m) * 2
            rows = (math.prod(rows) + math.prod(q) + turns,)
        return (q, s.dtype), (kv, s.dtype), (kv, s.dtype), (rows, "float32"), status


@functools.lru_cache(maxsize=512)
def _cached_constexprs(p: LaunchPlan, sticky_errors: bool) -> dict:
    """``LaunchPlan.constexprs``, cached per (plan, sticky_errors): plans are frozen, hashable and small."""
    return p._constexprs(sticky_errors)


def store_hint(head_dim: int, itemsize: int) -> int:
    """iris.store's alignment hint for rows of ``head_dim`` elements of ``itemsize`` bytes written into a
    peer's receive region (K/V pushes, float32 partials): 16 (16-byte aligned groups of 16 contiguous
    elements) when every row starts 16-byte aligned, else 1 (no claim). Without it the remote stores were
    2-byte scalars over NVLink."""
    return 16 if (head_dim * itemsize) % 16 == 0 else 1


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def heap_bytes_for(recv_need: int) -> int:
    """A heap size (``initialize(heap_size=...)``) whose workspace holds ``recv_need`` receive bytes: the
    receive slots plus the largest flag region, the control words, alignment and iris's slack, in MiB."""
    total = recv_need + control.RING_SLOTS * control.CTL_BYTES + control.MAX_FLAG_BYTES + 2 * control.ALIGN \
        + control.HEAP_SLACK
    return -(-total // (1 << 20)) << 20


def kv_bytes(spec: AttentionSpec, world_size: int) -> int:
    """Receive bytes of the peers' K/V."""
    return ((world_size - 1) * 2 * spec.batch * spec.num_kv_heads * spec.seq_local * spec.head_dim
            * ELEM_BYTES[spec.dtype])


def seg_bytes(spec: AttentionSpec, world_size: int) -> int:
    """Receive bytes of the peers' segment ids (0 without): int32 [W-1][B][HKV][S], right after the K/V. Each
    pushed K/V chunk carries its rows' ids (so one acquire covers both); per kv head, so that a chunk's ids
    are written by the unit that flags it, at 4 / (4 * head_dim) of the K/V's bytes or less."""
    return (world_size - 1) * spec.batch * spec.num_kv_heads * spec.seq_local * 4 if spec.segmented else 0


def recv_bytes(spec: AttentionSpec, world_size: int) -> int:
    """Receive bytes of one forward call: the peers' K/V and, with segment ids, theirs."""
    return kv_bytes(spec, world_size) + seg_bytes(spec, world_size)


def bwd_recv_bytes(spec: AttentionSpec, world_size: int) -> tuple:
    """(K/V bytes, byte offset of the partial-dK/dV region, total receive bytes) of one backward call (the
    segment ids, if any, between the K/V and the partials)."""
    kv = kv_bytes(spec, world_size)
    part_off = control._align(kv + seg_bytes(spec, world_size))
    part = (world_size - 1) * 2 * spec.batch * spec.num_kv_heads * spec.seq_local * spec.head_dim * 4
    return kv, part_off, (part_off + part) if world_size > 1 else 0


def id_range_words(spec: AttentionSpec, world_size: int, n_chunks: int) -> int:
    """Words of the segment-id ranges in the ring slot's flag region, after the K/V (and partial) flags (0 without
    segment ids): per rank of the ring, this one included, [B][n_chunks + 2][lo, hi] (each K/V chunk's, then each
    half's of the shard; ring_core.protocol.steps.publish_id_ranges)."""
    if not spec.segmented:
        return 0
    return world_size * spec.batch * (n_chunks + 2) * 2


def fused_supports(spec: AttentionSpec) -> bool:
    """Whether the fused kernels take this call: float16, bfloat16 or float32 (every mask they take: causal,
    windows, segment ids)."""
    return spec.dtype in FUSED_DTYPES


def check_fused(spec: AttentionSpec, reference: str) -> None:
    """Raise, naming ``reference`` (what to use instead), where ``fused_supports(spec)`` is False (TypeError)."""
    check_fused_dtype(spec.dtype, reference)


def _chunking(what: str, n_blocks: int, chunk_blocks: int, flags_for, capacity: int) -> tuple:
    """(chunk_blocks, flags): the chunk size doubled until the flags the call needs (``flags_for(n_chunks)``)
    fit a ring slot's ``capacity``; HeapTooSmallError when even one chunk needs too many."""
    while True:
        n_chunks = math.ceil(n_blocks / chunk_blocks)
        flags = flags_for(n_chunks)
        if flags <= capacity:
            return chunk_blocks, flags
        if n_chunks == 1:
            raise HeapTooSmallError(
                f"this {what} needs {flags} flags ({flags * 4} bytes: one per K/V block of every peer) but a "
                f"ring's flag region holds {capacity}; call initialize(heap_size=...) with a larger heap (the "
                f"flag region is 1/64 of it, at most {control.MAX_FLAG_BYTES} bytes, shared by "
                f"{control.RING_SLOTS} ring slots), or use fewer tokens per call")
        chunk_blocks *= 2


def _too_small(what: str, need: int, have: int, spec: AttentionSpec, world_size: int, detail: str):
    if spec.segmented:
        detail = f"{detail}, and their segment ids: {seg_bytes(spec, world_size)} bytes"
    return HeapTooSmallError(
        f"this {what} needs {need} bytes of symmetric-heap receive space ({world_size - 1} peers x K and V of "
        f"[{spec.batch}, {spec.seq_local}, {spec.num_kv_heads}, {spec.head_dim}] {spec.dtype}{detail}) but the "
        f"heap reserves {have}; call initialize(heap_size=...) with at least {heap_bytes_for(need)} bytes "
        f"(before the first call, or after shutdown())")


@functools.lru_cache(maxsize=512)
def plan(spec: AttentionSpec, world_size: int, heap: HeapLayout, *, interpret: bool = False,
         config: KernelConfig | None = None, capability: tuple | None = None, sms: int | None = None) -> LaunchPlan:
    """The forward's launch; raises HeapTooSmallError (before anything runs) when the heap is short. Cached
    (every argument is frozen and hashable; the torch launcher plans at every call); errors are not.
    ``capability``: the GPU's, where the Gluon kernel may run (``gluon_applies``); ``sms``: its streaming
    multiprocessors (``device_sms``), the Gluon kernel's programs: it is persistent, each program taking tiles in
    order from the call's tile counter (ring_core.kernels.gluon_fwd) until none is left (None: a program per tile, e.g.
    planned without a GPU)."""
    check_fused(spec, "a reference backend")
    cfg = config or KernelConfig.get_default(spec, world_size, interpret=interpret, capability=capability)
    need = recv_bytes(spec, world_size)
    if need > heap.recv_capacity:
        raise _too_small("call", need, heap.recv_capacity, spec, world_size, "")
    per_chunk = (world_size - 1) * spec.batch * spec.num_kv_heads
    chunk_blocks, flags = _chunking("call", math.ceil(spec.seq_local / cfg.block_n), cfg.chunk_blocks,
                                    lambda n_chunks: per_chunk * n_chunks + id_range_words(spec, world_size, n_chunks),
                                    heap.flag_capacity)
    n_tiles = spec.batch * spec.num_heads * math.ceil(spec.seq_local / cfg.block_m)
    grid = (min(n_tiles, sms) if cfg.gluon and sms else n_tiles,)
    return LaunchPlan(control.KIND_FWD, spec, world_size, cfg, chunk_blocks, cfg.block_n, grid, need, flags,
                      interpret)


def plan_bwd(spec: AttentionSpec, world_size: int, heap: HeapLayout, *, interpret: bool = False,
             config: BwdKernelConfig | None = None, deterministic: bool = False,
             capability: tuple | None = None, gluon_det: bool | None = None, sms: int | None = None) -> LaunchPlan:
    """The backward's launch; raises HeapTooSmallError (before anything runs) when the heap is short of
    receive space or flags. Cached, as ``plan``. ``deterministic``: the caller needs bit-identical gradients
    (``BwdKernelConfig.get_default``; the default, False, is the frontends' default); ``capability``: the GPU's,
    where the Gluon backward may run (``gluon_bwd_applies``); ``gluon_det``: ``get_default``'s (None: unless
    RING_ATTENTION_GLUON_DETERMINISTIC is "0", read here at each plan); ``sms``: the GPU's streaming multiprocessors
    (``device_sms``), the Gluon backward's programs, each taking tasks by ticket until none is left (None: a program
    per task, which the kernel runs the same way)."""
    if gluon_det is None:
        gluon_det = settings.gluon_deterministic()
    return _plan_bwd(spec, world_size, heap, interpret, config, deterministic, capability, gluon_det, sms)


@functools.lru_cache(maxsize=512)
def _plan_bwd(spec, world_size, heap, interpret, config, deterministic, capability, gluon_det, sms) -> LaunchPlan:
    check_fused(spec, "a reference backend")
    cfg = config or BwdKernelConfig.get_default(spec, world_size, interpret=interpret, deterministic=deterministic,
                                                capability=capability, gluon_det=gluon_det)
    kv, part_off, need = bwd_recv_bytes(spec, world_size)
    if need > heap.recv_capacity:
        raise _too_small("backward call", need, heap.recv_capacity, spec, world_size,
                         f": {kv} bytes, plus their partial dK and dV in float32: {need - part_off} bytes")
    S, W = spec.seq_local, world_size
    n_kv_blocks = math.ceil(S / cfg.kv_block_n)
    per_chunk = (W - 1) * spec.batch * spec.num_kv_heads
    part_flags = per_chunk * n_kv_blocks
    chunk_blocks, flags = _chunking("backward call", n_kv_blocks, cfg.chunk_blocks,
                                    lambda n_chunks: per_chunk * n_chunks + part_flags
                                    + id_range_words(spec, W, n_chunks), heap.flag_capacity)
    n_dq = spec.batch * spec.num_heads * math.ceil(S / cfg.dq_block_m)
    n_part = (W - 1) * spec.batch * spec.num_kv_heads * n_kv_blocks
    n_final = spec.batch * spec.num_kv_heads * n_kv_blocks
    # The Gluon kernel ends with as many dQ tasks as it starts with delta tasks, and is persistent: a program per SM
    # (ring_core.kernels.gluon_bwd).
    tasks = n_dq + n_part + n_final + (n_dq if cfg.gluon else 0)
    grid = (min(tasks, sms) if cfg.gluon and sms else tasks,)
    return LaunchPlan(control.KIND_BWD, spec, W, cfg, chunk_blocks, cfg.kv_block_n, grid, need, flags, interpret,
                      part_off, n_dq, n_part, n_final)
