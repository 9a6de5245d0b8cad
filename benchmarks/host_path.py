"""Where the host's time for one torch fused call goes, piece by piece, and what a call timed on its own pays for it
(issue 18's per-call rows). benchmarks/attention.py times each call between two CUDA events recorded on an idle
stream: the host's work between the first event and the kernel's launch counts as the call's time. cuDNN's call
issues in tens of microseconds; ours issued in 0.2-0.4 ms (benchmarks/launch_gap.py), 5-10 % of a 16k causal
forward.

At world size 1 on one GPU (``python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.host_path --csv OUT``),
bf16, B=1, H=32, seq_local 16k, causal, contiguous, for each head_dim given (forward+backward for those of
``--bwd-head-dims``):

* ``host``: microseconds of host time of one call (perf_counter; each call after a sync, so the GPU is idle as
  in per-call timing), median and min over ``--iters`` calls, for: cuDNN through
  ``scaled_dot_product_attention`` (the reference), the public ``torch_bridge.ring_attention``, the eager
  route alone, ``torch_bridge.fused.forward``, and the pieces of the latter in their order (validation, the
  launch plan and ring, the outputs, the launch itself through Triton's JIT and through the compiled kernel's
  own launcher (``torch_bridge.fused._launch``), the status's tracking, which comes after the launch);
* ``each`` / ``stream``: milliseconds of the public call (forward; forward+backward) timed per call as the
  harness does and back to back, with the compiled kernel's launcher (``direct``) and with every launch through
  the JIT (``jit``: the plans' compiled kernels forgotten before each call).
"""
import argparse
import contextlib
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dims", default="128,64,128", help="the first again last: the host times drift in a process")
    ap.add_argument("--bwd-head-dims", default="128", help="those of --head-dims also timed forward+backward")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch_bridge
    from benchmarks import harness
    from ring_core import validate
    from torch_bridge import api, fused, lifecycle

    torch_bridge.initialize()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for D in (int(x) for x in a.head_dims.split(",")):
        S, H = a.seq, a.heads
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, S, D], as the harness's cuDNN
        spec = validate.check_attention_args(
            tuple(q.shape), tuple(k.shape), tuple(v.shape), "bfloat16", "bfloat16", "bfloat16", is_causal=True,
            scale=None, layout="contiguous", backend="fused", backends=("fused",), window_size=None,
            segment_ids_shape=None, segment_ids_dtype=None)
        p, ctx, ring = fused._prepare(q, spec, None, None, backward=False)
        seg = fused._segment_ids(spec, None, dev)
        out, lse, status = fused._outputs(p, dev)
        fused._with_scratch(p)
        args = (q, k, v, seg, ctx, *p.scalars(None), out, lse, status)

        def jit_launch():
            p.kernel()[p.grid](*args, num_warps=p.config.num_warps, num_stages=p.config.num_stages, **p.constexprs())

        def track():
            lifecycle.track(status, ring, None)

        def cudnn():  # inside sdpa_kernel([CUDNN_ATTENTION]), entered once below, as the harness does
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        calls = {
            "cudnn_sdpa": cudnn,
            "public": lambda: torch_bridge.ring_attention(q, k, v, backend="fused", is_causal=True),
            "function": lambda: api._EagerFused.apply(q, k, v, None, spec, None, None, False, False),
            "fused_forward": lambda: fused.forward(q, k, v, spec),
            "validate": lambda: validate.check_attention_args(
                tuple(q.shape), tuple(k.shape), tuple(v.shape), "bfloat16", "bfloat16", "bfloat16", is_causal=True,
                scale=None, layout="contiguous", backend="fused", backends=("fused",), window_size=None,
                segment_ids_shape=None, segment_ids_dtype=None),
            "prepare": lambda: fused._prepare(q, spec, None, None, backward=False),
            "segment_ids+contiguous": lambda: (fused._segment_ids(spec, None, dev), q.contiguous(), k.contiguous(),
                                               v.contiguous()),
            "outputs": lambda: fused._outputs(p, dev),
            "with_scratch": lambda: fused._with_scratch(p),
            "launch_jit": jit_launch,
            "launch_direct": lambda: fused._launch(p, *args),
            "track (after the launch)": track,
        }
        for name, call in calls.items():
            ctx_mgr = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if name == "cudnn_sdpa" else contextlib.nullcontext()
            # a launch of its own writes the status words (the kernel's last program): zeroed first, untimed
            with ctx_mgr:
                t = host_us(torch, call, a.iters, lifecycle, before=status.zero_ if name.startswith("launch") else None)
            row = dict(kind="host", head_dim=D, seq_local=S, what=name, median_us=round(float(np.median(t)), 1),
                       min_us=round(float(np.min(t)), 1))
            rows.append(row)
            print(row, flush=True)
        lifecycle.check_errors()

        def fwd():
            return torch_bridge.ring_attention(q, k, v, backend="fused", is_causal=True)

        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

        def fwd_bwd():
            o = torch_bridge.ring_attention(qg, kg, vg, backend="fused", is_causal=True)
            return torch.autograd.grad(o, (qg, kg, vg), do)

        passes = [("fwd", fwd)] + ([("fwd+bwd", fwd_bwd)] if str(D) in a.bwd_head_dims.split(",") else [])
        for pass_, call in passes:
            for mode in ("direct", "jit"):
                timed = call if mode == "direct" else forgetting(call, fused)
                for _ in range(3):
                    timed()
                torch.cuda.synchronize()
                each = []
                for _ in range(a.iters):
                    torch.cuda.synchronize()
                    each.append(harness.cuda_timed(torch, timed)[0])
                torch.cuda.synchronize()
                stream = harness.cuda_stream_ms(torch, timed, a.iters)
                lifecycle.check_errors()
                row = dict(kind="call", head_dim=D, seq_local=S, what=f"{pass_} {mode}",
                           each_ms=round(float(np.median(each)), 4), stream_ms=round(stream, 4))
                rows.append(row)
                print(row, flush=True)
    if a.csv:
        harness.write_rows(a.csv, rows)


def forgetting(call, fused):
    """``call`` with every launch through Triton's JIT: the plans' compiled kernels forgotten first."""
    def run():
        fused._COMPILED.clear()
        return call()
    return run


def host_us(torch, call, iters: int, lifecycle, before=None) -> list:
    """Microseconds of host time of ``call``, each call after a sync (outstanding fused calls' status checked and
    dropped first, so that every call finds the same state; ``before()`` run then too, untimed)."""
    out = []
    for i in range(iters + 3):  # three untimed first
        if before is not None:
            before()
        torch.cuda.synchronize()
        lifecycle.check_errors()
        t0 = time.perf_counter()
        call()
        if i >= 3:
            out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


if __name__ == "__main__":
    main()
