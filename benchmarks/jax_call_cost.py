"""Where a JAX fused call's per-call time goes beside torch's (the aim: JAX within 3 % of torch at seq_local
16k, timed per call by benchmarks/attention.py). Each call is timed on its own after the GPU is idle, both frameworks
on the host's clock (``perf_counter`` from the call to its result being ready: ``block_until_ready`` for JAX,
``torch.cuda.synchronize`` for torch), so that the two include the same things: the host's work before the launch,
the kernel, and the wait for it. Beside the fused forward, each framework's floor: a jitted ``x + 1`` on one element
(JAX: dispatch of a compiled program and ``block_until_ready``), and torch's ``x + 1`` with a synchronize. And what
the JAX program runs besides the kernel: its optimised HLO's instructions by kind, its custom calls by target.

That aim is a ratio of two frameworks' times, and one GPU's clock drifts by 2-3 % over a benchmark's
minutes (measured on one H200, 2026-12-03): timed one framework after the other, the ratio carries that drift.
So the two fused calls are timed in pairs, torch and JAX alternately (each pair's order swapped from the last), and
each case's ratio is torch's median over JAX's (``jax_vs_torch``, a speed ratio as the harness's ``vs_*`` columns)
beside the median of the pairs' own ratios (``pair_median``). Then the kernel's own device time under each framework
(``kernel_ms``: torch.profiler's CUDA activity, which CUPTI records for every stream of the process, XLA's too), so
that what differs is split into the kernel and each framework's dispatch and wait.

At world size 1 on one GPU, bf16, B=1, H=32, D=128, causal (zigzag) and not (contiguous), as benchmarks/attention.py's
W=1 cases:

    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.jax_call_cost --seq 16384,32768 --causal both \
        --csv OUT.csv [--hlo OUT.txt]
"""
import argparse
import collections
import re
import time

import numpy as np


def _times(fn, ready, iters: int) -> np.ndarray:
    """Microseconds of ``iters`` calls of ``fn``, each after ``ready()`` of the last (the GPU idle)."""
    out = []
    for _ in range(iters):
        ready()
        t0 = time.perf_counter()
        ready(fn())
        out.append((time.perf_counter() - t0) * 1e6)
    return np.asarray(out)


def _paired(fa, fb, ready_a, ready_b, iters: int) -> tuple:
    """Microseconds of ``iters`` calls each of ``fa`` and ``fb``, timed as ``_times`` does, in pairs whose order
    alternates (a, b; b, a; ...), so that a drift of the GPU's clock falls on both alike."""
    ta, tb = [], []
    for i in range(iters):
        for f, ready, out in ((fa, ready_a, ta), (fb, ready_b, tb))[:: 1 if i % 2 == 0 else -1]:
            out.extend(_times(f, ready, 1))
    return np.asarray(ta), np.asarray(tb)


def hlo_summary(text: str) -> dict:
    """Instruction kinds of an optimised HLO module's entry computation (and nested ones), custom calls by
    target."""
    kinds = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.-]+\s*=\s*.*?\s([a-z][a-z0-9-]*)\(", line)
        if m:
            kinds[m.group(1)] += 1
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    return {"kinds": dict(kinds.most_common(12)), "custom_calls": dict(targets)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="16384", help="seq_local values, comma-separated")
    ap.add_argument("--causal", default="yes", choices=("yes", "no", "both"),
                    help="causal (zigzag layout), non-causal (contiguous) or both")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=40, help="pairs a case (floors: calls a round)")
    ap.add_argument("--csv")
    ap.add_argument("--hlo", help="write the JAX forward's optimised HLO here")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh

    import jax_ring
    import torch_bridge
    from benchmarks.harness import write_rows

    jax_ring.initialize()
    torch_bridge.initialize()
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    dev = torch.device("cuda", torch.cuda.current_device())
    one = jax.jit(lambda x: x + 1)
    x1 = jnp.zeros((1,), jnp.float32)
    t1 = torch.zeros((1,), device=dev)

    def jready(x=None):
        if x is not None:
            jax.block_until_ready(x)

    def tready(x=None):
        torch.cuda.synchronize()

    rows = []

    def row(what, seq, causal, us, **extra):
        rows.append(dict(what=what, seq_local=seq, causal=causal, median_us=float(np.median(us)), min_us=float(us.min()),
                         q20_us=float(np.quantile(us, 0.2)), q80_us=float(np.quantile(us, 0.8)), iters=len(us),
                         **extra))
        print(f"{what:12s} seq {seq:6d} causal {causal!s:5s} median {rows[-1]['median_us']:9.1f} us  "
              f"min {rows[-1]['min_us']:9.1f}", flush=True)

    for _ in range(3):  # the floors: each framework's least call (warm-up first)
        jready(one(x1))
        tready(t1 + 1)
    for rnd in range(3):
        row("jax_floor", 0, "", _times(lambda: one(x1), jready, a.iters), round=rnd)
        row("torch_floor", 0, "", _times(lambda: t1 + 1, tready, a.iters), round=rnd)

    summary = None
    rng = np.random.default_rng(0)
    for seq in (int(x) for x in a.seq.split(",")):
        shape = (1, seq, a.heads, a.head_dim)
        host = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
        jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in host)
        tq, tk, tv = (torch.from_numpy(x).to(dev, torch.bfloat16) for x in host)
        del host
        for causal in {"yes": (True,), "no": (False,), "both": (True, False)}[a.causal]:
            layout = "zigzag" if causal else "contiguous"
            fwd = jax.jit(lambda q, k, v, c=causal, lay=layout: jax_ring.ring_attention_sharded(
                q, k, v, mesh=mesh, axis_name="sp", backend="fused", is_causal=c, layout=lay))
            if summary is None:
                text = fwd.lower(jq, jk, jv).compile().as_text()
                summary = hlo_summary(text)
                print("JAX forward's optimised HLO:", summary, flush=True)
                if a.hlo:
                    with open(a.hlo, "w") as f:
                        f.write(text)

            def jfn(f=fwd, q=jq, k=jk, v=jv):
                return f(q, k, v)

            def tfn(c=causal, lay=layout, q=tq, k=tk, v=tv):
                return torch_bridge.ring_attention(q, k, v, backend="fused", is_causal=c, layout=lay)

            with torch.no_grad():
                for _ in range(3):  # warm-up (compiles, plans)
                    jready(jfn())
                    tready(tfn())
                tj, tt = _paired(jfn, tfn, jready, tready, a.iters)
                # the kernel's own time on the device under each framework (CUPTI sees every stream of the
                # process, XLA's too): equal, the rest of the gap is each framework's dispatch and wait
                kj = kernel_ms(torch, lambda: jready(jfn()), 10)
                kt = kernel_ms(torch, lambda: tready(tfn()), 10)
            row("jax_fused", seq, causal, tj, kernel_ms=kj)
            row("torch_fused", seq, causal, tt, kernel_ms=kt)
            rows.append(dict(what="ratio", seq_local=seq, causal=causal, iters=a.iters,
                             jax_vs_torch=float(np.median(tt) / np.median(tj)),
                             pair_median=float(np.median(tt / tj)),
                             kernel_jax_vs_torch=float(kt / kj) if kj and kt else ""))
            print(f"ratio        seq {seq:6d} causal {causal!s:5s} JAX {rows[-1]['jax_vs_torch']:.3f}x torch "
                  f"(median of pairs {rows[-1]['pair_median']:.3f}); the kernel alone {kj} ms under JAX, "
                  f"{kt} ms under torch", flush=True)
    jax_ring.check_errors()
    torch_bridge.check_errors()
    if a.csv:
        rows.append(dict(what="hlo", note=str(summary)))
        write_rows(a.csv, rows)


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
    except Exception as e:  # noqa: BLE001 (a diagnostic: say why and go on)
        print(f"torch.profiler: {type(e).__name__}: {e}", flush=True)
    return ""


if __name__ == "__main__":
    main()
