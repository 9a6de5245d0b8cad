"""A Gluon attention backward for Hopper, single GPU, no ring: FlashAttention-3's structure.

Why: the backward is about 80 % of a forward+backward call now that the forward runs at cuDNN speed
(docs/performance.md). The tl backward (ring_core/kernels/tl_bwd.py) is FlashAttention-2's split: dK/dV
tasks (four matmuls per block pair) and dQ tasks (three, two of them recomputed), seven where five would do, and
capped near 0.67x cuDNN by that count. The five-matmul version in plain Triton lost: its
dQ float atomics sat on the math warps. This probe measures FlashAttention-3's answer in Gluon 3.6 without the ring
protocol, as benchmarks/gluon_fwd.py does for the forward.

* One program per (batch, kv head, 128 rows of K/V): dK and dV of those rows over every query block of the kv
  group's heads (causal: from the diagonal on; the heaviest K/V blocks first).
* Its loop is the product's (ring_core.kernels.gluon_bwd: ``load_steps`` in the load warp, ``dkdv_steps`` in two consumer
  warpgroups, ``bwd_slots`` for the shared memory): five matmuls per block pair, dQ added by TMA bulk reductions.
  What this probe leaves out is the ring's protocol and the kernel's own delta, zeroing and conversion tasks: delta
  = rowsum(dO * O) comes from torch here, and the float32 dQ accumulator is zeroed and converted by torch, all
  timed with the kernel. The A/B with the product (benchmarks/bwd_kernels.py) is what the protocol costs.
* Measured on one H200 (2026-12-02): a version added dQ with float atomics from the consumers (0.68-0.73x
  cuDNN); without dQ the loop ran at 1.3x cuDNN's rate; dQ through shared memory and TMA reductions reached
  0.85-0.89x.

Layout as the product's: q, k, v, out, dout ``[B, S, H, D]`` (k, v with HKV heads), lse ``[B, H, S]`` (natural
log), seen by TMA as 2-D ``[B*S, heads*D]``. ``S % 128 == 0``, D 128 (the dQ split slices K's shared memory in
halves of 64 columns, one 128-byte swizzle atom), fp16/bf16.

On the GPU machine (one process, the whole GPU):

    python -m benchmarks.gluon_bwd --out OUT_DIR/gluon_bwd.csv

checks dQ, dK, dV against float32 autograd (torch) and times the backward against cuDNN's (bf16, B=1, H=32,
D=128, S 16k and 32k, causal and not). ``compile_for_sm90`` compiles it on a CPU machine.
"""
from __future__ import annotations

import math
import time

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from benchmarks.gluon_fwd import probe_args, timed_row, tma_desc
from ring_core import plans
from ring_core.kernels.gluon_bwd import (CONSUMER_REGS, CONSUMER_WARPS, LOAD_REGS, LOAD_WARPS, bwd_slots, dkdv_steps,
                                         free_bwd_slots, load_steps)
from ring_core.kernels.gluon_parts import tma_load as _tma_load

BLOCK_N = plans.GLUON_BWD_KV_ROWS  # K/V rows per program (two consumers of half each)
BLOCK_M = plans.GLUON_BWD_Q_ROWS  # query rows per step of the loop
# The configurations measured and dropped (dQ by float atomics from the consumers, no dQ at all, 3 slots) are in
# git history; what is left is the
# product's loop (ring_core.kernels.gluon_bwd: dQ by TMA reductions, 2 slots) without the protocol.
CONFIG = "product-loop"
# As the kernel reads them (a @gluon.jit function reads constexpr globals only).
_BLOCK_N, _BLOCK_M = gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_M)
_PARTITIONS = gl.constexpr([LOAD_WARPS, CONSUMER_WARPS])
_REGS = gl.constexpr([LOAD_REGS, CONSUMER_REGS])


@gluon.jit
def _probe_producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, kv_smem, lse_smem, dl_smem, kv_bar,
                    q_ready, q_empty, lse_ptr, delta_ptr, b, hkv, n0, S, n_m, m_start, H: gl.constexpr,
                    G: gl.constexpr, D: gl.constexpr):
    """The load warp: K and V once, then the product's steps (ring_core.kernels.gluon_bwd.load_steps)."""
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [b * S + n0, hkv * D], kv_bar, kv_smem.index(0))
    _tma_load(v_desc, [b * S + n0, hkv * D], kv_bar, kv_smem.index(1))
    load_steps(q_desc, do_desc, q_smem, do_smem, lse_smem, dl_smem, q_ready, q_empty, lse_ptr, delta_ptr, b, hkv, S,
               n_m, m_start, H, G, D)


@gluon.jit
def _probe_consumer(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, q_ready, q_empty,
                    ds_bar, dq_desc, dk_ptr, dv_ptr, b, hkv, n0, S, n_m, m_start, sm_scale, H: gl.constexpr,
                    HKV: gl.constexpr, D: gl.constexpr, HALF_INDEX: gl.constexpr, CAUSAL: gl.constexpr):
    """One consumer: the product's steps (ring_core.kernels.gluon_bwd.dkdv_steps, at world size 1), then its rows of dK
    (scaled) and dV."""
    dk, dv = dkdv_steps(q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, q_ready,
                        q_empty, ds_bar, dq_desc, b, hkv, n0, 0, 0, S, n_m, m_start, sm_scale, HALF_INDEX, 1, H,
                        HKV, D, CAUSAL, False, False)  # (no ring; dQ's adds in no fixed order)
    tma.store_wait(pendings=0)  # the last reduction has read the buffer before the kernel's shared memory goes
    kv_layout: gl.constexpr = dk.type.layout
    rows = (b * S + n0 + HALF_INDEX * _BLOCK_N // 2 + gl.arange(0, _BLOCK_N // 2, layout=gl.SliceLayout(1, kv_layout)))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
    kv_off = (rows.to(gl.int64) * HKV + hkv)[:, None] * D + cols[None, :]
    gl.store(dk_ptr + kv_off, (dk * sm_scale).to(q_smem.dtype))
    gl.store(dv_ptr + kv_off, dv.to(q_smem.dtype))


@gluon.jit
def gluon_attn_bwd(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, S, sm_scale,
                   H: gl.constexpr, HKV: gl.constexpr, CAUSAL: gl.constexpr):
    """dK, dV (``[B, S, HKV, D]``) and the float32 dQ accumulator (``[B, S, H, D]``, zeroed by the caller, unscaled)
    of one program's 128 K/V rows (``dq_ptr``: not read; the reductions go through ``dq_desc``)."""
    D: gl.constexpr = q_desc.block_type.shape[1]
    G: gl.constexpr = H // HKV
    n_kvb = S // _BLOCK_N
    pid = gl.program_id(0)
    b = pid // (n_kvb * HKV)
    hkv = (pid // n_kvb) % HKV
    n0 = (pid % n_kvb) * _BLOCK_N  # causal: block 0 sees every query block, the heaviest first
    m_start = 0
    if CAUSAL:
        m_start = n0 // _BLOCK_M  # query blocks before the block's first key see none of it
    n_m = S // _BLOCK_M - m_start
    layout: gl.constexpr = q_desc.layout
    acc_layout: gl.constexpr = dq_desc.layout
    (q_smem, do_smem, kv_smem, ds_smem, dq_smem, lse_smem, dl_smem, kv_bar, part_bar, q_ready, q_empty,
     ds_bar) = bwd_slots(q_desc.dtype, D, layout, acc_layout)
    gl.warp_specialize([
        (_probe_consumer, (q_smem, do_smem, kv_smem, ds_smem, dq_smem.index(0), lse_smem, dl_smem, kv_bar,
                           q_ready, q_empty, ds_bar, dq_desc, dk_ptr, dv_ptr, b, hkv, n0, S, n_m, m_start, sm_scale, H,
                           HKV, D, 0, CAUSAL)),
        (_probe_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, kv_smem, lse_smem, dl_smem, kv_bar,
                           q_ready, q_empty, lse_ptr, delta_ptr, b, hkv, n0, S, n_m, m_start, H, G, D)),
        (_probe_consumer, (q_smem, do_smem, kv_smem, ds_smem, dq_smem.index(1), lse_smem, dl_smem, kv_bar,
                           q_ready, q_empty, ds_bar, dq_desc, dk_ptr, dv_ptr, b, hkv, n0, S, n_m, m_start, sm_scale, H,
                           HKV, D, 1, CAUSAL)),
    ], _PARTITIONS, _REGS)
    free_bwd_slots(kv_bar, part_bar, q_ready, q_empty, ds_bar)


def check_shapes(q, k):
    B, S, H, D = q.shape
    HKV = k.shape[2]
    if S % BLOCK_N or D != 128 or H % HKV:
        raise ValueError(f"gluon_bwd takes S % {BLOCK_N} == 0, D 128, H % HKV == 0; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    return B, S, H, HKV, D


def backward(q, k, v, out, lse, dout, causal: bool, scale: float | None = None):
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
        tma_desc(dq_acc, BLOCK_M, D // 2), lse, delta, dq_acc, dk, dv, S, scale, H=H, HKV=HKV, CAUSAL=causal,
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


def _constexprs(H: int, HKV: int, causal: bool) -> dict:
    return {"H": H, "HKV": HKV, "CAUSAL": causal}


def compile_for_sm90(dtype: str = "bfloat16", H: int = 32, HKV: int = 32, causal: bool = True):
    """Compile for sm_90 without a GPU; Triton's CompiledKernel (``asm``: TTGIR, PTX; ``metadata``)."""
    from ring_core.runtime import build

    return build.compile_kernel(gluon_attn_bwd, _arg_types(dtype, 128), _constexprs(H, HKV, causal),
                                num_warps=CONSUMER_WARPS, num_stages=3, capability=90)


# (B, S, H, HKV, causal, dtype) of the check against float32 autograd: batch 2, GQA, MQA, both dtypes.
CHECKS = [(2, 512, 4, 2, True, "bfloat16"), (1, 1024, 4, 4, False, "float16"), (1, 768, 4, 1, True, "bfloat16"),
          (1, 384, 2, 2, False, "bfloat16")]
TIMED_HEADS = 32
FORWARD_CONFIG = (128, 3, True, True)  # benchmarks/gluon_fwd.py's (block_n, stages, pipelined, split): the product's


def launch_records(seqs=(16384, 32768)) -> list:
    """The compile-log records of every launch ``main`` makes (tools/gpu_variants.py: the cache filled ahead)."""
    from ring_core.runtime import build

    from benchmarks import gluon_fwd

    shapes = CHECKS + [(1, s, TIMED_HEADS, TIMED_HEADS, c, "bfloat16") for s in seqs for c in (False, True)]
    # The forwards that give out and lse: the product's loop (split consumers, 3 slots).
    out = gluon_fwd.launch_records(shapes=[(B, S, H, HKV, 128, c, dt) for (B, S, H, HKV, c, dt) in shapes],
                                   configs=[FORWARD_CONFIG])
    for (B, S, H, HKV, causal, dt) in shapes:
        out.append(build.record(gluon_attn_bwd, _arg_types(dt, 128), _constexprs(H, HKV, causal),
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

    from benchmarks.harness import write_rows

    a = probe_args(argv, __doc__)
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
        row = dict(kind="check", config=CONFIG, B=B, S=S, H=H, HKV=HKV, D=128, causal=int(causal),
                   dtype=str(dt).split(".")[-1])
        try:
            t0 = time.perf_counter()
            grads = backward(q, k, v, out, lse, dout, causal)
            torch.cuda.synchronize()
            errs = [_rel_err(x, r) for x, r in zip(grads, refs)]
            row.update(err_dq=f"{errs[0]:.2e}", err_dk=f"{errs[1]:.2e}", err_dv=f"{errs[2]:.2e}",
                       ok=int(max(errs) < 2e-2), first_call_s=round(time.perf_counter() - t0, 2))
        except Exception as e:  # noqa: BLE001 (a probe: the timings below say what failing costs)
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
            runs = [(f"gluon_bwd {CONFIG}", lambda: backward(q, k, v, out, lse, dout, causal))]
            for name, fn in runs + [("torch_cudnn", cudnn)]:
                if name != "torch_cudnn" and not all(r["ok"] for r in rows if r.get("config") == name.split()[-1]):
                    continue  # timed only once it computes the right thing
                row = timed_row(torch, fn, a.iters, name, S, causal, flops, warm=2)
                if name != "torch_cudnn":
                    errs = [_rel_err(x, r) for x, r in zip(fn(), refs)]
                    row.update(err=f"{max(errs):.2e}", ok=int(max(errs) < 2e-2))
                print(row, flush=True)
                rows.append(row)
    if a.out:
        write_rows(a.out, rows)
    return 0 if all(r.get("ok", 1) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
