"""A first Gluon attention forward for Hopper (explicit partitions), single GPU, no ring.

Why: Triton's automatic warp specialisation cannot take the fused kernel's protocol at world size > 1
(docs/design.md, "Kernels"), hence the Gluon
fast path. This is its attention loop alone, to learn what Gluon 3.6 reaches on an H200 without
the ring protocol: FlashAttention-3's shape, simplified.

* One program per (128 query rows, batch x head), in the tl kernel's order: a kv group's heads fastest, then
  the query tiles (one kv head's K/V shared in L2), causal each head's heaviest tiles first. A **load
  partition** (one warp) brings Q once, then K and V blocks of 128 rows through TMA into ``STAGES``
  shared-memory slots, each guarded by a pair of mbarriers (``ready``: the TMA bytes landed; ``empty``: the
  consumers are done with the slot).
* The **default partition** (8 warps, two warpgroups on the 128 rows) runs the online softmax: S = Q K^T and
  O += P V with asynchronous warpgroup MMAs (P from registers), then frees the slot. Plain: each block's two MMAs
  in turn; causal, the blocks below the diagonal unmasked, then the diagonal ones masked (two loops, one phase
  counter). Split: two consumer partitions of one warpgroup each on 64 rows apiece, each pipelined
  (FlashAttention-3's intra-warpgroup overlap: S of block j and P V of block j-1 issued together, block j's softmax
  while P V is on the tensor cores), each releasing the K/V slots on its own (no barrier between them per block:
  one's softmax can run beside the other's MMAs, the scheduling FlashAttention-3's ping-pong enforces with named
  barriers); each writes its rows of O into its half of Q's buffer, and one TMA store follows the join. These
  consumers are the product's (ring_core.kernels.gluon_fwd), run here at world size 1 with no error record.
* Epilogue: O / l through shared memory and a TMA store (Q's buffer, free by then); lse (natural log) by plain
  stores.

Layout as the product's: q, k, v and out ``[B, S, H, D]`` (k, v with HKV heads: GQA reads the kv head in place),
seen by TMA as 2-D ``[B*S, heads*D]`` with ``[128, D]`` blocks at column ``head*D``. This first version asks
``S % 128 == 0`` (TMA would otherwise read the next batch's rows) and D in (64, 128); fp16/bf16.

Run on one H200 (2026-12-02: 0.97-1.04x cuDNN at world size 1); it compiles for sm_90 on a CPU machine too
(``compile_for_sm90``). On the GPU machine (one process, the whole GPU):

    python -m benchmarks.gluon_fwd --out OUT_DIR/gluon_fwd.csv

checks it against float32 attention (torch) and times it against torch SDPA's cuDNN backend (bf16, B=1, H=32,
D=128, S 16k and 32k, causal and not), the calls back to back.
"""
from __future__ import annotations

import argparse
import csv
import math
import time

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ring_core.protocol import control
from ring_core.kernels.gluon_fwd import _consumer as consumer  # the product's split consumer partition
from ring_core.kernels.gluon_fwd import free_slots as _free_slots
from ring_core.kernels.gluon_fwd import free_turns, turns
from ring_core.kernels.gluon_fwd import online_softmax, slots
from ring_core.kernels.gluon_parts import release as _release
from ring_core.kernels.gluon_parts import tma_load as _tma_load
from ring_core.kernels.gluon_parts import tma_store as _tma_store
from ring_core.kernels.tiles import query_tile

BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8  # the default partition: two warpgroups over the 128 query rows
STAGES = 2
# (K/V block rows, slots, pipelined, split) of the probe: 128-row blocks in 2 slots (160 KiB of shared memory at
# D128), each block's MMAs in turn, the baseline; and the split consumers ("x": two partitions of one warpgroup
# each, on 64 query rows apiece, FlashAttention-3's overlap of S_j with P_{j-1} V, releasing the slots separately)
# in 3 slots, which is the product's loop: its consumers are ring_core.kernels.gluon_fwd's own. The configurations
# measured and dropped (64-row blocks; the overlap in one partition of two warpgroups, 2 and 3 slots;
# the split in 2 slots; one H200, 2026-12-02) are in git history.
CONFIGS = ((BLOCK_N, STAGES, False, False), (BLOCK_N, 3, True, True))
LOAD_WARPS, LOAD_REGS = 1, 24
SPLIT_WARPS, SPLIT_REGS = 4, 232  # each split consumer: one warpgroup; registers of the worker one (setmaxnreg)
# The same, as the kernel reads them (a @gluon.jit function reads constexpr globals only).
_LOAD_WARPS, _LOAD_REGS, _SPLIT_REGS = gl.constexpr(LOAD_WARPS), gl.constexpr(LOAD_REGS), gl.constexpr(SPLIT_REGS)


def config_name(block_n: int, stages: int, pipelined: bool, split: bool = False) -> str:
    return f"n{block_n}s{stages}" + ("x" if split else "p" if pipelined else "")


def consumer_warps(split: bool) -> int:
    """The launch's num_warps: the default partition's warps (the kernel's NUM_WARPS)."""
    return SPLIT_WARPS if split else NUM_WARPS


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, row_q, row_kv,
                    col_q, col_kv, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer: Q once, then K and V block j into slot j % STAGES once the consumers freed it."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [row_q, col_q], q_bar, q_smem)
    for j in range(n_blocks):
        s = j % STAGES
        # Round r of a slot waits for the consumers' release of round r - 1: parity (r & 1) ^ 1, which a fresh
        # barrier already satisfies for r = 0.
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [row_kv + j * BLOCK_N, col_kv], kv_ready.index(s), k_smem.index(s))
        _tma_load(v_desc, [row_kv + j * BLOCK_N, col_kv], kv_ready.index(s), v_smem.index(s))


@gluon.jit
def _attend(acc, l_i, m_i, q_smem, k_smem, v_smem, kv_ready, kv_empty, j_lo, j_hi, q0, qk_scale,
            s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, MASKED: gl.constexpr):
    """Blocks [j_lo, j_hi) of the online softmax; MASKED: keys after the query (causal) are dropped."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    for j in range(j_lo, j_hi):
        s = j % STAGES
        mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
        qk = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)),
                           gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        p, alpha, m_new, l_i = _softmax_step(qk, m_i, l_i, j, j_lo, rows, qk_scale, s_layout, BLOCK_N,
                                             "all" if MASKED else "none")
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _release(kv_empty, s)
        m_i = m_new
    return acc, l_i, m_i


@gluon.jit
def _softmax_step(qk, m_i, l_i, j, n_full, rows, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  MASK: gl.constexpr, col_shift=0):
    """Block j's scores -> (P unnormalised, alpha = the old rows' rescale, new max, new sum). Causal mask (keys
    after the query dropped), ``MASK``: "none", "all" (a loop over diagonal blocks), "from" (blocks from
    ``n_full`` on: one loop over all blocks; the block's keys are local block ``j - col_shift``, as in the ring
    kernel, whose peers' blocks come before the local diagonal ones)."""
    qk = qk * qk_scale  # log2 units
    if MASK == "all":
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        qk = gl.where(cols[None, :] <= rows[:, None], qk, float("-inf"))
    elif MASK == "from":
        if j >= n_full:
            cols = (j - col_shift) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            qk = gl.where(cols[None, :] <= rows[:, None], qk, float("-inf"))
    return online_softmax(qk, m_i, l_i, False)  # every row of a probe tile sees a key in every block


@gluon.jit
def _compute_partition(q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, n_full, n_blocks, q0, qk_scale,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The plain configuration's consumers (8 warps on the 128 rows): the online softmax over the blocks, each
    block's MMAs in turn, the unmasked blocks, then (causal) the diagonal ones."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    mbarrier.wait(q_bar, 0)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_smem, k_smem, v_smem, kv_ready, kv_empty, 0, n_full, q0, qk_scale,
                            s_layout, o_layout, BLOCK_M, BLOCK_N, STAGES, False)
    if CAUSAL:
        acc, l_i, m_i = _attend(acc, l_i, m_i, q_smem, k_smem, v_smem, kv_ready, kv_empty, n_full, n_blocks,
                                q0, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, STAGES, True)
    return acc, l_i, m_i


@gluon.jit
def _finish_rows(acc, l_i, m_i, o_smem, lse_rows):
    """A consumer's rows of the result: O / l into ``o_smem`` (Q's buffer or its half: every MMA reading it has
    completed), fenced for the TMA store that follows, and lse (natural log) at ``lse_rows``."""
    o_layout: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o_smem.store((acc / l_o[:, None]).to(o_smem.dtype))
    fence_async_shared()  # these generic-proxy stores before the TMA store (async proxy)
    rows = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, o_layout))
    lse = (gl.convert_layout(m_i, gl.SliceLayout(1, o_layout)) + gl.log2(l_o)) * 0.6931471805599453
    gl.store(lse_rows + rows, lse)


@gluon.jit
def _tile(S, H, HKV, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """This program's tile: (batch, head, kv head, first query row, local K/V blocks every query sees whole, local
    K/V blocks it visits). The tl kernels' order, from their own helper (ring_core.kernels.tiles.query_tile, scalar maths
    that compiles in Gluon too): the heads of one kv group fastest, then the query tiles, so the programs side by
    side share one kv head's K and V (L2); causal, each head's heaviest tiles first. With (batch x head) fastest
    instead (3c8ce48: 32 heads' K/V at once), non-causal fell from 511/510 to 473/455 TFLOP/s at 16k/32k
    (2026-12-02)."""
    b, h, hkv, pid_m = query_tile(gl.program_id(0), H // HKV, S // BLOCK_M, HKV, CAUSAL)
    q0 = pid_m * BLOCK_M
    if CAUSAL:
        n_full = q0 // BLOCK_N  # wholly below the diagonal
        n_blocks = gl.cdiv(q0 + BLOCK_M, BLOCK_N)
    else:
        n_full = S // BLOCK_N
        n_blocks = n_full
    return b, h, hkv, q0, n_full, n_blocks


@gluon.jit
def _slots(q_desc, k_desc, v_desc, STAGES: gl.constexpr, RELEASERS: gl.constexpr):
    """Shared memory and mbarriers for Q and ``STAGES`` K/V slots (ring_core.kernels.gluon_fwd.slots), in the
    descriptors' blocks and layout."""
    layout: gl.constexpr = q_desc.layout  # as a constexpr: Triton 3.6 cannot pass a bare layout to a jit function
    return slots(q_desc.dtype, q_desc.block_type.shape[0], k_desc.block_type.shape[0], q_desc.block_type.shape[1],
                 layout, STAGES, RELEASERS, 1)


@gluon.jit
def gluon_attn_fwd(q_desc, k_desc, v_desc, o_desc, lse_ptr, ctl_ptr, S, H, HKV, sm_scale,
                   CAUSAL: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr):
    """``ctl_ptr``: int32 zeros that the product's consumers read as the ring's error record (none here)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    b, h, hkv, q0, n_full, n_blocks = _tile(S, H, HKV, BLOCK_M, BLOCK_N, CAUSAL)
    row_q = b * S + q0
    row_kv = b * S
    col_q = h * D
    col_kv = hkv * D
    q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty = _slots(q_desc, k_desc, v_desc, STAGES, 2 if SPLIT else 1)

    qk_scale = sm_scale * 1.4426950408889634
    lse_row = lse_ptr + (b * H + h).to(gl.int64) * S + q0
    if SPLIT:
        HALF: gl.constexpr = BLOCK_M // 2
        pp = turns()
        # Without masks the consumer reads neither its block words (q_bar stands in) nor ids (ctl_ptr stands in).
        gl.warp_specialize([
            (consumer, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, pp, q_bar, n_blocks, qk_scale, lse_row,
                        ctl_ptr, 1, S * 0, 1, S, q0, q0 + BLOCK_M - 1, ctl_ptr, ctl_ptr,
                        0, 1, 1, D, CAUSAL, False, False, -1, -1, False)),  # world size 1: rank 0, contiguous
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, row_q,
                               row_kv, col_q, col_kv, n_blocks, BLOCK_N, STAGES)),
            (consumer, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, pp, q_bar, n_blocks, qk_scale, lse_row,
                        ctl_ptr, 1, S * 0, 1, S, q0, q0 + BLOCK_M - 1, ctl_ptr, ctl_ptr,
                        1, 1, 1, D, CAUSAL, False, False, -1, -1, False)),
        ], [_LOAD_WARPS, NUM_WARPS], [_LOAD_REGS, _SPLIT_REGS])
        _tma_store(o_desc, [row_q, col_q], q_smem)  # both halves written (the partitions joined)
        tma.store_wait(pendings=0)
        free_turns(pp)
    else:  # one consumer partition of two warpgroups over the whole tile
        acc, l_i, m_i = gl.warp_specialize([
            (_compute_partition, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, n_full, n_blocks, q0, qk_scale,
                                  BLOCK_M, BLOCK_N, D, STAGES, CAUSAL, NUM_WARPS)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, row_q,
                               row_kv, col_q, col_kv, n_blocks, BLOCK_N, STAGES)),
        ], [_LOAD_WARPS], [_LOAD_REGS])
        _finish_rows(acc, l_i, m_i, q_smem, lse_row)
        _tma_store(o_desc, [row_q, col_q], q_smem)
        tma.store_wait(pendings=0)
    _free_slots(q_bar, kv_ready, kv_empty, STAGES)


def tma_desc(x, rows: int, cols: int | None = None):
    """The host TMA descriptor of a [B, S, heads, D] tensor (fp16, bf16, fp32) seen as [B*S, heads*D], with
    [rows, cols] blocks (cols: D unless given). Also benchmarks/gluon_bwd.py's."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    el = {"bfloat16": gl.bfloat16, "float16": gl.float16, "float32": gl.float32}[str(x.dtype).split(".")[-1]]
    b, s, heads, d = x.shape
    block = [rows, d if cols is None else cols]
    layout = gl.NVMMASharedLayout.get_default_for(block, el)
    return TensorDescriptor(x, [b * s, heads * d], [heads * d, 1], block, layout)


def descriptors(q, k, v, out, block_n: int = BLOCK_N):
    """TMA descriptors of q, k, v, out (Q and out 128-row blocks, K and V ``block_n``)."""
    return tma_desc(q, BLOCK_M), tma_desc(k, block_n), tma_desc(v, block_n), tma_desc(out, BLOCK_M)


def check_shapes(q, k):
    B, S, H, D = q.shape
    HKV = k.shape[2]
    if S % BLOCK_M or D not in (64, 128) or H % HKV:
        raise ValueError(f"gluon_fwd takes S % {BLOCK_M} == 0, D in (64, 128), H % HKV == 0; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    return B, S, H, HKV, D


def attention(q, k, v, causal: bool, scale: float | None = None, block_n: int = BLOCK_N, stages: int = STAGES,
              pipelined: bool = False, split: bool = False):
    """(out, lse) of softmax attention, q [B, S, H, D], k and v [B, S, HKV, D] (CUDA, fp16/bf16); ``block_n``
    (64 or 128: it divides BLOCK_M) K/V rows per block, ``stages`` slots; ``pipelined``: S of block j computed
    while P V of block j-1 runs; ``split``: two consumer warpgroups on 64 rows each, decoupled (pipelined)."""
    import torch

    B, S, H, HKV, D = check_shapes(q, k)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    ctl = torch.zeros(control.CTL_ERROR + 1, dtype=torch.int32, device=q.device)
    gluon_attn_fwd[(B * H * (S // BLOCK_M),)](*descriptors(q, k, v, out, block_n), lse, ctl, S, H, HKV, scale,
                                              **_constexprs(causal, stages, pipelined, split),
                                              num_warps=consumer_warps(split))
    return out, lse


def _arg_types(dtype: str, D: int, block_n: int) -> list:
    """Triton types of the kernel's runtime arguments (the descriptors' from CPU tensors of the dtype and D)."""
    import torch
    from triton.runtime.jit import mangle_type

    t = torch.zeros((1, 256, 2, D), dtype=getattr(torch, dtype))
    return [mangle_type(d) for d in descriptors(t, t, t, t, block_n)] + ["*fp32", "*i32", "i32", "i32", "i32", "fp32"]


def _constexprs(causal: bool, stages: int, pipelined: bool = False, split: bool = False) -> dict:
    return {"CAUSAL": causal, "STAGES": stages, "NUM_WARPS": consumer_warps(split),
            "SPLIT": split}


def compile_for_sm90(dtype: str = "bfloat16", D: int = 128, causal: bool = True, block_n: int = BLOCK_N,
                     stages: int = STAGES, pipelined: bool = False, split: bool = False):
    """Compile the kernel for sm_90 without a GPU (CPU tensors only give the descriptors their types); returns
    Triton's CompiledKernel (its ``asm`` has the TTGIR and PTX)."""
    from ring_core.runtime import build

    return build.compile_kernel(gluon_attn_fwd, _arg_types(dtype, D, block_n),
                                _constexprs(causal, stages, pipelined, split), num_warps=consumer_warps(split),
                                num_stages=DEFAULT_NUM_STAGES, capability=90)


# (B, S, H, HKV, D, causal, dtype) of the check, against float32 attention: odd head counts, GQA, MQA-like groups.
CHECKS = [(2, 512, 4, 2, 128, True, "bfloat16"), (1, 1024, 8, 8, 64, False, "float16"), (1, 768, 4, 1, 128, False,
                                                                                         "bfloat16")]
TIMED_HEADS = 32  # the timed shapes: bf16, B=1, H=32 (kv 32), D=128, --seq lengths, causal and not
DEFAULT_NUM_STAGES = 3  # Triton's default: what the JIT launch compiles with (the kernel pipelines by hand)


def launch_records(seqs=(16384, 32768), shapes=None, configs=CONFIGS) -> list:
    """The compile-log records (ring_core.runtime.build.record) of every launch ``main`` makes: each check shape and each
    timed length, through every configuration; for a cache filled ahead of the GPU run (tools/gpu_variants.py).
    ``shapes`` / ``configs``: other (B, S, H, HKV, D, causal, dtype) and configurations (benchmarks/gluon_bwd.py's
    forwards)."""
    from ring_core.runtime import build

    if shapes is None:
        shapes = CHECKS + [(1, s, TIMED_HEADS, TIMED_HEADS, 128, c, "bfloat16") for s in seqs for c in (False, True)]
    out = []
    for (B, S, H, HKV, D, causal, dt) in shapes:
        for block_n, stages, pipelined, split in configs:
            values = [None] * 6 + [S, H, HKV, None]
            out.append(build.record(gluon_attn_fwd, _arg_types(dt, D, block_n),
                                    _constexprs(causal, stages, pipelined, split), num_warps=consumer_warps(split),
                                    num_stages=DEFAULT_NUM_STAGES, values=values))
    return out


def _shape(r) -> tuple:
    return int(r["S"]), int(r["causal"])


def _shape_label(shape) -> str:
    return f"S={shape[0] // 1024}k {'causal' if shape[1] else 'full'}"


def plot(csv_path: str, png: str, extra=(), shape=_shape, label=_shape_label,
         title="Gluon forward against cuDNN, one H200, calls back to back") -> None:
    """Bar chart of a run's timed rows (TFLOP/s per method and shape); ``extra``: more (label, S, causal, TFLOP/s)
    rows to show beside them (e.g. the fused tl kernel of the same day, same timing). ``shape``: a row's x
    position key (sorted), ``label``: its tick label."""
    from benchmarks.plot import grouped_bars

    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "time"]
    bars = {}
    for r in rows:
        bars.setdefault(r["method"], {})[shape(r)] = float(r["tflops"])
    for name, S, causal, tf in extra:
        bars.setdefault(name, {})[(S, causal)] = tf
    grouped_bars(bars, png, ylabel="TFLOP/s (bf16, B=1, H=32, D=128)", title=title, label=label)


def probe_args(argv, doc: str):
    """The Gluon probes' command line (this one's and benchmarks/gluon_bwd.py's): --out, --seq, --iters."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="CSV of the check and the timings")
    ap.add_argument("--seq", default="16384,32768")
    ap.add_argument("--iters", type=int, default=10)
    return ap.parse_args(argv)


def timed_row(torch, fn, iters: int, name: str, S: int, causal: bool, flops: float, warm: int = 3) -> dict:
    """The probes' timing row of ``fn`` (``warm`` calls first, then ``iters`` back to back on the stream; bf16, B=1,
    H=32, D=128), with its TFLOP/s for ``flops`` per call."""
    from benchmarks.harness import cuda_stream_ms

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ms = cuda_stream_ms(torch, fn, iters)
    return dict(kind="time", method=name, B=1, S=S, H=32, HKV=32, D=128, causal=int(causal), dtype="bfloat16",
                ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.harness import write_rows

    a = probe_args(argv, __doc__)
    dev = torch.device("cuda")
    rows = []
    # Check: small odd-ish shapes against float32 attention.
    for (B, S, H, HKV, D, causal, dt) in ((*c[:6], getattr(torch, c[6])) for c in CHECKS):
        g = torch.Generator(device=dev).manual_seed(S + H)
        q = torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(B, S, HKV, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(B, S, HKV, D, device=dev, dtype=dt, generator=g)
        rep = lambda x: x.float().transpose(1, 2).repeat_interleave(H // x.shape[2], dim=1)  # noqa: E731 (kv heads)
        ref = F.scaled_dot_product_attention(rep(q), rep(k), rep(v), is_causal=causal).transpose(1, 2)
        for block_n, stages, pipelined, split in CONFIGS:
            row = dict(kind="check", config=config_name(block_n, stages, pipelined, split), B=B, S=S, H=H, HKV=HKV,
                       D=D, causal=int(causal), dtype=str(dt).split(".")[-1])
            try:
                t0 = time.perf_counter()
                out, lse = attention(q, k, v, causal, block_n=block_n, stages=stages, pipelined=pipelined,
                                     split=split)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                err = (out.float() - ref).abs().max().item()
                row.update(max_abs_err=f"{err:.3e}", ok=int(err < 2e-2), first_call_s=round(first, 2))
            except Exception as e:  # noqa: BLE001 (a probe: one config failing must not hide the others)
                row.update(ok=0, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(row, flush=True)
            rows.append(row)
    # Timing: bf16 B=1 H=32 D=128, back to back, against cuDNN.
    for S in (int(s) for s in a.seq.split(",")):
        for causal in (False, True):
            q, k, v = (torch.randn(1, S, TIMED_HEADS, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * TIMED_HEADS * S * S * 128 * (0.5 if causal else 1.0)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            runs = [(f"gluon_fwd {config_name(*c)}",
                     lambda c=c: attention(q, k, v, causal, block_n=c[0], stages=c[1], pipelined=c[2], split=c[3]))
                    for c in CONFIGS] + [("torch_cudnn", cudnn)]
            # The timed shapes checked too (the small checks cover a few K/V blocks; a slot or phase race could
            # show only over hundreds): every config's out against cuDNN's, both bf16 (bound: 2e-2, as above).
            ref = cudnn().transpose(1, 2).float()
            for name, fn in runs:
                if name != "torch_cudnn" and not all(r["ok"] for r in rows if r.get("config") == name.split()[-1]):
                    continue  # timed only once it computes the right thing
                row = timed_row(torch, fn, a.iters, name, S, causal, flops)
                if name != "torch_cudnn":
                    err = (fn()[0].float() - ref).abs().max().item()
                    row.update(max_abs_err=f"{err:.3e}", ok=int(err < 2e-2))
                print(row, flush=True)
                rows.append(row)
    if a.out:
        write_rows(a.out, rows)
    return 0 if all(r.get("ok", 1) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
