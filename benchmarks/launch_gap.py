"""How much of a timed call is the host's (issue 20's packed rows): benchmarks/attention.py times each call between
two CUDA events recorded on an idle stream, so the host's work between the first event and the launch (the custom
op's dispatch, validation, launch plan, Triton's launcher) counts as GPU time. For a call of a few ms that can be a
large share. This times the same torch_fused call four ways, at world size 1 on one GPU:

* ``each``: as the harness does, one call between two events, then a sync (host gap included);
* ``stream``: N calls back to back between two events, one sync at the end (the GPU time when the host keeps
  ahead, as triton.testing.do_bench and a training step see it);
* ``host``: the host's own time to issue one call (perf_counter, no sync, after a sync);
* ``kernel``: the fused kernel's own duration on the device, from torch.profiler (CUPTI), per call.

Each three ways (``route``): the public ``torch_bridge.ring_attention``; the eager route alone
(``torch_bridge.api._EagerFused``, an autograd.Function); the ``torch.library`` op that torch.compile sees.

    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.launch_gap --csv OUT.csv

bf16, B=1, H=32, D=128, seq_local 16k, causal, forward; dense, and packed documents of the given lengths.
"""
import argparse
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--doc-lens", default="none,16384-16384,512-8192,1024-1024",
                    help="comma list: none (dense) or LO-HI (16384-16384: one document, the dense blocks with ids)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also print where the host's issue time goes (cProfile over --iters calls, each after a sync)")
    a = ap.parse_args()

    import torch

    import torch_bridge
    from benchmarks import harness
    from ring_core import validate
    from torch_bridge import api

    torch_bridge.initialize()
    dev = torch.device("cuda", torch.cuda.current_device())
    S, H, D = a.seq, a.heads, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    rows = []
    for lens in a.doc_lens.split(","):
        seg = None
        if lens != "none":
            lo, hi = (int(t) for t in lens.split("-"))
            case = harness.Case(batch=1, heads=H, kv_heads=H, head_dim=D, seq_local=S, causal=True,
                                dtype="bfloat16", mask="packed", doc_lens=(lo, hi))
            seg = torch.as_tensor(np.asarray(harness.segment_ids(case, 1)), device=dev, dtype=torch.int32)

        # The spec the public call validates to; the two lower routes take it ready-made, as
        # torch_bridge.api._ring_attention_fused does.
        spec = validate.check_attention_args(
            tuple(q.shape), tuple(k.shape), tuple(v.shape), "bfloat16", "bfloat16", "bfloat16", is_causal=True,
            scale=None, layout="zigzag", backend="fused", backends=("fused",), window_size=None,
            segment_ids_shape=None if seg is None else tuple(seg.shape),
            segment_ids_dtype=None if seg is None else "int32")
        routes = {
            # the public call, as a user makes it (validation, then the eager route below)
            "public": lambda: torch_bridge.ring_attention(q, k, v, backend="fused", is_causal=True,
                                                          layout="zigzag", segment_ids=seg),
            # the eager route alone: torch_bridge.api._EagerFused (an autograd.Function)
            # (group None, timeout None, deterministic False, check_backward False)
            "function": lambda: api._EagerFused.apply(q, k, v, seg, spec, None, None, False, False),
            # the torch.library op that torch.compile sees (eager calls took it before _EagerFused)
            "custom_op": lambda: api._fwd_op(q, k, v, seg, spec.scale, True, "zigzag", list(spec.window),
                                             api.group_to_name(None), None, False, False),
        }
        for route, call in routes.items():
            row = time_route(torch, call, a, lens, S, H, route)
            rows.append(row)
            print(row, flush=True)
    if a.csv:
        harness.write_rows(a.csv, rows)


def time_route(torch, call, a, lens: str, S: int, H: int, route: str) -> dict:
    """One CSV row: ``call`` timed the four ways of the module's docstring."""
    from benchmarks import harness

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    each = [harness.cuda_timed(torch, call)[0] for _ in range(a.iters)]
    torch.cuda.synchronize()
    stream = harness.cuda_stream_ms(torch, call, a.iters)
    host = []
    for _ in range(a.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    if a.profile:
        host_profile(torch, call, a.iters, f"{lens}, {route}")
    return dict(doc_lens=lens, route=route, seq_local=S, heads=H, each_ms=round(float(np.median(each)), 4),
                stream_ms=round(stream, 4), host_ms=round(float(np.median(host)), 4),
                host_min_ms=round(float(np.min(host)), 4), kernel_ms=kernel_ms(torch, call, a.iters))


def host_profile(torch, call, iters: int, label: str, top: int = 25):
    """Print the functions that take the host's issue time of ``call`` (cProfile; each call after a sync, as
    ``host`` is timed), by their own time and by cumulative time: what differs between the dense and the packed call."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(iters):
        torch.cuda.synchronize()
        prof.enable()
        call()
        prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    print(f"---- host profile, doc_lens {label}, {iters} calls\n{buf.getvalue()}", flush=True)


def kernel_ms(torch, call, iters: int):
    """The fused forward kernel's mean device time per call (ms), from torch.profiler's CUDA activity; "" if the
    profiler gives none here (the other columns stand without it)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                call()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if "ring_attn_fwd" in ev.key:
                total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                return round(total / max(ev.count, 1) / 1e3, 4)
    except Exception as e:  # noqa: BLE001 (a probe: say why and go on)
        print(f"torch.profiler: {type(e).__name__}: {e}", flush=True)
    return ""


if __name__ == "__main__":
    main()
