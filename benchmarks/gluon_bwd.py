"""A Gluon attention backward for Hopper (issue 19), single GPU, no ring yet: FlashAttention-3's structure.

Why: the backward is about 80 % of a forward+backward call now that the forward runs at cuDNN speed
(benchmarks/NOTES.md, session 8). The tl backward (ring_core/kernel_bwd.py) is FlashAttention-2's split: dK/dV
tasks (four matmuls per block pair) and dQ tasks (three, two of them recomputed), seven where five would do, and
capped near 0.67x cuDNN by that count (NOTES v1d). The five-matmul version in plain Triton lost (NOTES v1e): its
dQ float atomics sat on the math warps. This probe measures FlashAttention-3's answer in Gluon 3.6 before it
moves into the ring protocol, as benchmarks/gluon_fwd.py did for the forward.

* One program per (batch, kv head, 128 rows of K/V): dK and dV of those rows over every query block of the kv
  group's heads (causal: from the diagonal on; the heaviest K/V blocks first).
* A **load partition** (one warp): K and V once, then Q and dO of each query block (64 rows) through TMA into
  ``STAGES`` slots (mbarriers ``q_ready`` / ``q_empty`` as the forward's).
* Two **consumer partitions** (one warpgroup each, on 64 of the 128 K/V rows apiece), per query block:
  S^T = K Q^T and dP^T = V dO^T (both asynchronous, together), P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta),
  dV += P^T dO (P from registers), dS^T into shared memory, dK += dS^T Q (from shared memory), then, once both
  halves of dS are in shared memory (an mbarrier of two arrivals: Gluon has no named barrier across partitions),
  each computes half the columns (D / 2) of dQ = dS K over all 128 K/V rows and adds it to a float32 dQ
  accumulator in global memory with relaxed float atomics (``red.global.add``). Five matmuls per block pair;
  the dQ adds move 64 x D float32 per pair once (not once per warpgroup), FlashAttention-3's traffic.
* ``DQ_MODE``: 0 as above; 2 skips dQ (its matmul, barrier and adds: a diagnostic of what dQ costs, not a
  backward).
* delta = rowsum(dO * O) comes from torch here, and the float32 dQ accumulator is zeroed and converted by torch;
  all three are timed with the kernel (in the product the kernel's own tasks do them).

Layout as the product's: q, k, v, out, dout ``[B, S, H, D]`` (k, v with HKV heads), lse ``[B, H, S]`` (natural
log), seen by TMA as 2-D ``[B*S, heads*D]``. ``S % 128 == 0``, D 128 (the dQ split slices K's shared memory in
halves of 64 columns, one 128-byte swizzle atom), fp16/bf16.

On the GPU machine (one process, the whole GPU):

    python -m benchmarks.gluon_bwd --out $OUT/gluon_bwd.csv

checks dQ, dK, dV against float32 autograd (torch) and times the backward against cuDNN's (bf16, B=1, H=32,
D=128, S 16k and 32k, causal and not). ``compile_for_sm90`` compiles it on a CPU machine.
"""
from __future__ import annotations

import argparse
import math
import time

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from benchmarks.gluon_fwd import tma_desc
from ring_core.gluon_kernel import cta_barrier, release, tma_add
from ring_core.gluon_kernel import tma_load as _tma_load

BLOCK_N = 128  # K/V rows per program (two consumers of 64)
BLOCK_M = 64  # query rows per step of the loop
HALF = BLOCK_N // 2
LOAD_WARPS, LOAD_REGS, CONSUMER_REGS = 1, 24, 240
CONSUMER_WARPS = 4
# (slots, dQ mode) of each configuration timed.
CONFIGS = ((2, 0), (2, 1), (3, 1), (2, 2))
_BLOCK_N, _BLOCK_M, _HALF = gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_M), gl.constexpr(HALF)
_LOAD_WARPS, _LOAD_REGS, _CONSUMER_REGS = gl.constexpr(LOAD_WARPS), gl.constexpr(LOAD_REGS), gl.constexpr(CONSUMER_REGS)
_CONSUMER_WARPS = gl.constexpr(CONSUMER_WARPS)
_LOG2E = gl.constexpr(1.4426950408889634)


def config_name(stages: int, dq_mode: int) -> str:
    return f"s{stages}" + ("" if dq_mode == 0 else f"-dq{dq_mode}")


@gluon.jit
def _work(i, n_m, m_start, hkv, G: gl.constexpr):
    """Step i of a program's loop: (query head, first query row): the group's heads in turn, each over query blocks
    [m_start, m_start + n_m)."""
    return hkv * G + i // n_m, (m_start + i % n_m) * _BLOCK_M


@gluon.jit
def _bwd_producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, b,
                  hkv, n0, S, n_m, m_start, G: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """The load partition: K and V once, then Q and dO of every step into slot i % STAGES once it is free."""
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [b * S + n0, hkv * D], kv_bar, k_smem)
    _tma_load(v_desc, [b * S + n0, hkv * D], kv_bar, v_smem)
    for i in range(G * n_m):
        h, m0 = _work(i, n_m, m_start, hkv, G)
        s = i % STAGES
        mbarrier.wait(q_empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(s), 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [b * S + m0, h * D], q_ready.index(s), q_smem.index(s))
        _tma_load(do_desc, [b * S + m0, h * D], q_ready.index(s), do_smem.index(s))


@gluon.jit
def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_ready, q_empty, ds_bar, lse_ptr,
                  delta_ptr, dq_ptr, dq_desc, dk_ptr, dv_ptr, b, hkv, n0, S, n_m, m_start, sm_scale, H: gl.constexpr, HKV: gl.constexpr,
                  G: gl.constexpr, D: gl.constexpr, HALF_INDEX: gl.constexpr, CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr, DQ_MODE: gl.constexpr):
    """One consumer on K/V rows [n0 + 64 * HALF_INDEX, + 64): see the module docstring."""
    dtype: gl.constexpr = q_smem.dtype
    DQ_COLS: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                       instr_shape=[16, _BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                        instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    k_half = k_smem.slice(HALF_INDEX * _HALF, _HALF)
    v_half = v_smem.slice(HALF_INDEX * _HALF, _HALF)
    k_cols = k_smem.slice(HALF_INDEX * DQ_COLS, DQ_COLS, dim=1)  # dQ's B operand: this consumer's D / 2 columns
    dk = gl.zeros([_HALF, D], gl.float32, kv_layout)
    dv = gl.zeros([_HALF, D], gl.float32, kv_layout)
    zero_s = gl.zeros([_HALF, _BLOCK_M], gl.float32, s_layout)
    zero_q = gl.zeros([_BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    key_rows = gl.arange(0, _HALF, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    dq_rows = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = HALF_INDEX * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    n_first = n0 + HALF_INDEX * _HALF  # this consumer's first K/V row
    qk_scale = sm_scale * _LOG2E
    mbarrier.wait(kv_bar, 0)
    for i in range(G * n_m):
        h, m0 = _work(i, n_m, m_start, hkv, G)
        s = i % STAGES
        row = (b * H + h).to(gl.int64) * S + m0
        lse2 = gl.load(lse_ptr + row + cols) * _LOG2E
        dl = gl.load(delta_ptr + row + cols)
        mbarrier.wait(q_ready.index(s), (i // STAGES) & 1)
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        sT = warpgroup_mma(k_half, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_half, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT, ))
        pT = gl.exp2(sT * qk_scale - lse2[None, :])
        if CAUSAL:
            if m0 < n_first + _HALF:  # the diagonal: keys after some query of the block
                pT = gl.where(cols[None, :] + m0 >= key_rows[:, None] + n_first, pT, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), p_layout), do_s, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT, ))  # dV may still run
        dsT = pT * (dpT - dl[None, :])
        ds_buf = ds_smem.index(i % 2)
        ds_half = ds_buf.slice(HALF_INDEX * _HALF, _HALF)
        ds_half.store(dsT.to(dtype))
        fence_async_shared()  # this thread's stores before the async proxy (wgmma) reads them
        if DQ_MODE != 2:
            cta_barrier()  # every thread of this warpgroup stored and fenced before the arrival
            mbarrier.arrive(ds_bar.index(i % 2), count=1)
        else:
            cta_barrier()  # every thread stored before the wgmma reads dS
        dk = warpgroup_mma(ds_half, q_s, dk, is_async=True)
        if DQ_MODE != 2:
            # Both halves of dS stored: dQ's columns of this consumer over all 128 K/V rows.
            mbarrier.wait(ds_bar.index(i % 2), (i // 2) & 1)
            dq = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, zero_q, use_acc=False, is_async=True)
            dq, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv))
            if DQ_MODE == 0:
                q_rows = (b * S + m0 + dq_rows).to(gl.int64) * H + h
                gl.atomic_add(dq_ptr + q_rows[:, None] * D + dq_cols[None, :], dq, sem="relaxed", scope="gpu")
            else:
                # Through shared memory and one TMA bulk reduction, issued here and left to run: the buffer is
                # rewritten only after the previous reduction has read it.
                tma.store_wait(pendings=0)
                cta_barrier()
                dq_smem.store(dq)
                fence_async_shared()
                cta_barrier()
                tma_add(dq_desc, [b * S + m0, h * D + HALF_INDEX * DQ_COLS], dq_smem)
        else:
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        release(q_empty, s)
    if DQ_MODE == 1:
        tma.store_wait(pendings=0)  # the last reduction has read the buffer before the kernel's shared memory goes
    kv_rows = (b * S + n_first + gl.arange(0, _HALF, layout=gl.SliceLayout(1, kv_layout))).to(gl.int64) * HKV + hkv
    kv_off = kv_rows[:, None] * D + gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))[None, :]
    gl.store(dk_ptr + kv_off, (dk * sm_scale).to(dtype))
    gl.store(dv_ptr + kv_off, dv.to(dtype))


@gluon.jit
def gluon_attn_bwd(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, S, sm_scale,
                   H: gl.constexpr, HKV: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                   DQ_MODE: gl.constexpr):
    """dK, dV (``[B, S, HKV, D]``) and the float32 dQ accumulator (``[B, S, H, D]``, zeroed by the caller, unscaled)
    of one program's 128 K/V rows."""
    D: gl.constexpr = q_desc.block_type.shape[1]
    G: gl.constexpr = H // HKV
    n_kvb = S // _BLOCK_N
    pid = gl.program_id(0)
    n_blk = pid % n_kvb  # causal: block 0 sees every query block, the heaviest first
    b = pid // (n_kvb * HKV)
    hkv = (pid // n_kvb) % HKV
    n0 = n_blk * _BLOCK_N
    m_start = 0
    if CAUSAL:
        m_start = n0 // _BLOCK_M  # query blocks before the block's first key see none of it
    n_m = S // _BLOCK_M - m_start

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [_BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [_BLOCK_N, D], k_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ds_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_N, _BLOCK_M], ds_layout)
    if DQ_MODE == 1:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, _BLOCK_M, D // 2], dq_desc.layout)  # one per consumer
    else:
        dq_smem = ds_smem  # not used
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(0), kv_bar, q_ready, q_empty, ds_bar,
                         lse_ptr, delta_ptr, dq_ptr, dq_desc, dk_ptr, dv_ptr, b, hkv, n0, S, n_m, m_start, sm_scale, H,
                         HKV, G, D, 0,
                         CAUSAL, STAGES, DQ_MODE)),
        (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                         b, hkv, n0, S, n_m, m_start, G, D, STAGES)),
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(1), kv_bar, q_ready, q_empty, ds_bar,
                         lse_ptr, delta_ptr, dq_ptr, dq_desc, dk_ptr, dv_ptr, b, hkv, n0, S, n_m, m_start, sm_scale, H,
                         HKV, G, D, 1,
                         CAUSAL, STAGES, DQ_MODE)),
    ], [_LOAD_WARPS, _CONSUMER_WARPS], [_LOAD_REGS, _CONSUMER_REGS])
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(q_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(ds_bar.index(i))


def check_shapes(q, k):
    B, S, H, D = q.shape
    HKV = k.shape[2]
    if S % BLOCK_N or D != 128 or H % HKV:
        raise ValueError(f"gluon_bwd takes S % {BLOCK_N} == 0, D 128, H % HKV == 0; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    return B, S, H, HKV, D


def backward(q, k, v, out, lse, dout, causal: bool, scale: float | None = None, stages: int = 2, dq_mode: int = 0):
    """(dq, dk, dv) of softmax attention from the forward's out and lse (natural log, [B, H, S], float32)."""
    import torch

    B, S, H, HKV, D = check_shapes(q, k)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, H, S]
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    gluon_attn_bwd[(B * HKV * (S // BLOCK_N),)](
        tma_desc(q, BLOCK_M), tma_desc(k, BLOCK_N), tma_desc(v, BLOCK_N), tma_desc(dout, BLOCK_M),
        tma_desc(dq_acc, BLOCK_M, D // 2), lse, delta,
        dq_acc, dk, dv, S, scale, H=H, HKV=HKV, CAUSAL=causal, STAGES=stages, DQ_MODE=dq_mode,
        num_warps=CONSUMER_WARPS)
    return (dq_acc * scale).to(q.dtype), dk, dv


def _arg_types(dtype: str, D: int) -> list:
    """Triton types of the kernel's runtime arguments; no torch (Triton's MockTensor gives the descriptors their
    element type), so that the GPU machine's Triton compiles it on a CPU machine too."""
    import triton.language as tl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import MockTensor, mangle_type

    el, name = (tl.bfloat16, "bf16") if dtype == "bfloat16" else (tl.float16, "fp16")

    def desc(el, rows, cols):
        t = MockTensor(el, shape=[256, 2 * D])
        return mangle_type(TensorDescriptor(t, [256, 2 * D], [2 * D, 1], [rows, cols],
                                            gl.NVMMASharedLayout.get_default_for([rows, cols], el)))

    return ([desc(el, rows, D) for rows in (BLOCK_M, BLOCK_N, BLOCK_N, BLOCK_M)] + [desc(tl.float32, BLOCK_M, D // 2)]
            + ["*fp32", "*fp32", "*fp32", f"*{name}", f"*{name}", "i32", "fp32"])


def _constexprs(H: int, HKV: int, causal: bool, stages: int, dq_mode: int) -> dict:
    return {"H": H, "HKV": HKV, "CAUSAL": causal, "STAGES": stages, "DQ_MODE": dq_mode}


def compile_for_sm90(dtype: str = "bfloat16", H: int = 32, HKV: int = 32, causal: bool = True, stages: int = 2,
                     dq_mode: int = 0):
    """Compile for sm_90 without a GPU; Triton's CompiledKernel (``asm``: TTGIR, PTX; ``metadata``)."""
    from ring_core import build

    return build.compile_kernel(gluon_attn_bwd, _arg_types(dtype, 128), _constexprs(H, HKV, causal, stages, dq_mode),
                                num_warps=CONSUMER_WARPS, num_stages=3, capability=90)


# (B, S, H, HKV, causal, dtype) of the check against float32 autograd: batch 2, GQA, MQA, both dtypes.
CHECKS = [(2, 512, 4, 2, True, "bfloat16"), (1, 1024, 4, 4, False, "float16"), (1, 768, 4, 1, True, "bfloat16"),
          (1, 384, 2, 2, False, "bfloat16")]
TIMED_HEADS = 32
FORWARD_CONFIG = (128, 3, True, True)  # benchmarks/gluon_fwd.py's (block_n, stages, pipelined, split): the product's


def launch_records(seqs=(16384, 32768)) -> list:
    """The compile-log records of every launch ``main`` makes (tests/gpu_variants.py: the cache filled ahead)."""
    from ring_core import build

    from benchmarks import gluon_fwd

    shapes = CHECKS + [(1, s, TIMED_HEADS, TIMED_HEADS, c, "bfloat16") for s in seqs for c in (False, True)]
    # The forwards that give out and lse: the product's loop (split consumers, 3 slots).
    out = gluon_fwd.launch_records(shapes=[(B, S, H, HKV, 128, c, dt) for (B, S, H, HKV, c, dt) in shapes],
                                   configs=[FORWARD_CONFIG])
    for (B, S, H, HKV, causal, dt) in shapes:
        for stages, dq_mode in CONFIGS:
            out.append(build.record(gluon_attn_bwd, _arg_types(dt, 128), _constexprs(H, HKV, causal, stages, dq_mode),
                                    num_warps=CONSUMER_WARPS, num_stages=3, values=[None] * 10 + [S, None]))
    return out


def _forward(q, k, v, causal: bool):
    """(out, lse) from benchmarks/gluon_fwd.py's forward in the product's configuration."""
    from benchmarks.gluon_fwd import attention

    block_n, stages, pipelined, split = FORWARD_CONFIG
    return attention(q, k, v, causal, block_n=block_n, stages=stages, pipelined=pipelined, split=split)


def _rel_err(x, ref) -> float:
    return ((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.harness import cuda_stream_ms, write_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="CSV of the check and the timings")
    ap.add_argument("--seq", default="16384,32768")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for (B, S, H, HKV, causal, dt) in ((*c[:5], getattr(torch, c[5])) for c in CHECKS):
        g = torch.Generator(device=dev).manual_seed(S + H)
        q, dout = (torch.randn(B, S, H, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
        k, v = (torch.randn(B, S, HKV, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
        out, lse = _forward(q, k, v, causal)
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        rep = lambda x: x.transpose(1, 2).repeat_interleave(H // x.shape[2], dim=1)  # noqa: E731 (kv heads)
        ref = F.scaled_dot_product_attention(rep(qf), rep(kf), rep(vf), is_causal=causal).transpose(1, 2)
        refs = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
        for stages, dq_mode in CONFIGS:
            row = dict(kind="check", config=config_name(stages, dq_mode), B=B, S=S, H=H, HKV=HKV, D=128,
                       causal=int(causal), dtype=str(dt).split(".")[-1])
            try:
                t0 = time.perf_counter()
                grads = backward(q, k, v, out, lse, dout, causal, stages=stages, dq_mode=dq_mode)
                torch.cuda.synchronize()
                errs = [_rel_err(x, r) for x, r in zip(grads, refs)]
                if dq_mode != 0:
                    errs[0] = 0.0  # no dQ in this diagnostic
                row.update(err_dq=f"{errs[0]:.2e}", err_dk=f"{errs[1]:.2e}", err_dv=f"{errs[2]:.2e}",
                           ok=int(max(errs) < 2e-2), first_call_s=round(time.perf_counter() - t0, 2))
            except Exception as e:  # noqa: BLE001 (a probe: one config failing must not hide the others)
                row.update(ok=0, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(row, flush=True)
            rows.append(row)
    for S in (int(s) for s in a.seq.split(",")):
        for causal in (False, True):
            q, k, v, dout = (torch.randn(1, S, TIMED_HEADS, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
            flops = 2.5 * 4 * TIMED_HEADS * S * S * 128 * (0.5 if causal else 1.0)  # five matmuls
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            dout_t = dout.transpose(1, 2)

            def cudnn():
                return torch.autograd.grad(ref_out, (qt, kt, vt), dout_t, retain_graph=True)

            out, lse = _forward(q, k, v, causal)
            refs = [x.transpose(1, 2).float() for x in cudnn()]
            runs = [(f"gluon_bwd {config_name(*c)}", lambda c=c: backward(q, k, v, out, lse, dout, causal, stages=c[0],
                                                                           dq_mode=c[1])) for c in CONFIGS]
            for name, fn in runs + [("torch_cudnn", cudnn)]:
                if name != "torch_cudnn" and not all(r["ok"] for r in rows if r.get("config") == name.split()[-1]):
                    continue  # timed only once it computes the right thing
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
                ms = cuda_stream_ms(torch, fn, a.iters)
                row = dict(kind="time", method=name, B=1, S=S, H=32, HKV=32, D=128, causal=int(causal),
                           dtype="bfloat16", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                if name != "torch_cudnn":
                    errs = [_rel_err(x, r) for x, r in zip(fn(), refs)]
                    if name.endswith("dq2"):
                        errs[0] = 0.0
                    row.update(err=f"{max(errs):.2e}", ok=int(max(errs) < 2e-2))
                print(row, flush=True)
                rows.append(row)
    if a.out:
        write_rows(a.out, rows)
    return 0 if all(r.get("ok", 1) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
