"""Where a short call's time goes between the host and the GPU, one call at a time after the GPU was idle (as
``benchmarks/attention.py --timing call`` times them): the fused kernel through torch beside cuDNN (SDPA), world size
1, forward and forward+backward (``torch.autograd.grad`` of q, k and v for a random dout, as the benchmark).

Each call runs under the torch profiler (CUDA activity and the host's ops); per call:

* ``launch_us``: from the call's start on the host to its first kernel's start on the GPU (the host's work before the
  first launch, and the launch);
* ``gpu_us``: the call's kernels' time on the GPU, summed (``kernels``: each kernel's name and microseconds);
* ``idle_us``: the GPU's idle time between the call's first kernel's start and its last one's end (the host still
  issuing a launch after the GPU had finished the previous one);
* ``total_us``: from the call's start to its last kernel's end (what a per-call timing sees, the profiler included).

The profiler adds a few microseconds a launch; the rows are compared with each other. ``--cprofile N`` also prints
the host's functions by their own time over N fused forward+backward calls back to back (cProfile). Run with one
process:

    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.host_path --out DIR [--seq 4k] [--head-dim 128]

writes DIR/host_path.csv, DIR/host_path.png (medians) and DIR/host_path.cmd.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIELDS = ("method", "pass", "seq", "head_dim", "call", "launch_us", "gpu_us", "idle_us", "total_us", "kernels")


def _seq(text: str) -> int:
    return int(text[:-1]) * 1024 if text.lower().endswith("k") else int(text)


def _calls(torch, q, k, v, do, method: str, pass_: str):
    """A function making one call of ``method`` ("fused" or "cudnn") and ``pass_`` ("fwd" or "fwd+bwd")."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch_bridge

    def fused():
        return torch_bridge.ring_attention(q, k, v, is_causal=True, backend="fused")

    def cudnn():  # SDPA takes [B, H, S, D]; the transposes are views
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
        return out.transpose(1, 2)

    attn = fused if method == "fused" else cudnn
    if pass_ == "fwd":
        return attn
    return lambda: torch.autograd.grad(attn(), (q, k, v), do)


def profile(torch, call, n: int) -> list:
    """Per call of ``call`` (each after a synchronize): launch_us, gpu_us, idle_us, total_us and its kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, record_function

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            torch.cuda.synchronize()
            with record_function(f"host_path_call_{i}"):
                call()
            torch.cuda.synchronize()
    events = list(prof.events())
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("host_path")),
                     key=lambda e: e.time_range.start)
    starts = {e.name: e.time_range.start for e in events  # each call's start on the host
              if e.device_type == DeviceType.CPU and e.name.startswith("host_path_call_")}
    rows = []
    for i in range(n):
        start = starts.get(f"host_path_call_{i}")
        if start is None:
            continue
        end = starts.get(f"host_path_call_{i + 1}", float("inf"))
        mine = [e for e in kernels if start <= e.time_range.start < end]
        if not mine:
            continue
        first, last = mine[0].time_range.start, max(e.time_range.end for e in mine)
        busy, cursor = 0.0, first  # the union of the kernels' intervals (overlapping kernels count once)
        for e in mine:
            s, t = max(e.time_range.start, cursor), e.time_range.end
            if t > s:
                busy += t - s
                cursor = t
        rows.append(dict(call=i, launch_us=round(first - start, 1),
                         gpu_us=round(sum(e.time_range.elapsed_us() for e in mine), 1),
                         idle_us=round(last - first - busy, 1), total_us=round(last - start, 1),
                         kernels=" ".join(f"{e.name[:40].replace(' ', '_')}:{e.time_range.elapsed_us():.0f}"
                                          for e in mine)))
    return rows


def plot(rows: list, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["method"], r["pass"]) for r in rows}, key=lambda x: (x[1], x[0]))
    parts = ("launch_us", "gpu_us", "idle_us")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for j, (m, p) in enumerate(keys):
        left = 0.0
        for part, color in zip(parts, ("tab:orange", "tab:blue", "tab:gray")):
            val = statistics.median(float(r[part]) for r in rows if (r["method"], r["pass"]) == (m, p))
            ax.barh(j, val, left=left, color=color, label=part if j == 0 else None)
            left += val
    ax.set_yticks(range(len(keys)), [f"{m} {p}" for m, p in keys])
    ax.set_xlabel("microseconds (medians): launch, kernels, GPU idle between them")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"one call after an idle GPU, seq {rows[0]['seq']}, head_dim {rows[0]['head_dim']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.host_path",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for host_path.csv, .png and .cmd")
    ap.add_argument("--seq", default="4k", help="seq_local (default 4k)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--calls", type=int, default=20, help="profiled calls per row (default 20)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print cProfile's top functions over N fused forward+backward calls")
    args = ap.parse_args(argv)
    import torch

    import torch_bridge

    torch_bridge.initialize()
    os.makedirs(args.out, exist_ok=True)
    S, D, H = _seq(args.seq), args.head_dim, args.heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    rows = []
    for pass_ in ("fwd", "fwd+bwd"):
        for method in ("fused", "cudnn"):
            call = _calls(torch, q, k, v, do, method, pass_)
            for _ in range(5):
                call()
            got = profile(torch, call, args.calls)
            rows += [dict(method=method, **{"pass": pass_}, seq=S, head_dim=D, **r) for r in got]
            med = {f: statistics.median(r[f] for r in got) for f in ("launch_us", "gpu_us", "idle_us", "total_us")}
            print(f"{method:6s} {pass_:8s} S={S} D={D}: " + ", ".join(f"{f} {v:.1f}" for f, v in med.items())
                  + f"; kernels of the last call: {got[-1]['kernels']}", flush=True)
    if args.cprofile:
        import cProfile
        import pstats

        call = _calls(torch, q, k, v, do, "fused", "fwd+bwd")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.cprofile):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    path = os.path.join(args.out, "host_path.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "host_path.cmd"), "w") as f:
        f.write("python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.host_path " + " ".join(argv or sys.argv[1:])
                + "\n")
    try:
        plot(rows, os.path.join(args.out, "host_path.png"))
    except ImportError as e:
        print(f"no PNG: {e}")
    torch_bridge.shutdown()
    print(f"{len(rows)} rows in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
