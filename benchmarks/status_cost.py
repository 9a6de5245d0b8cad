"""What JAX's per-call error check costs the real fused call (the budget: at most 2 % at seq_local 4k), timed
so that drift between methods cannot pass for a cost: rounds of interleaved runs, the methods in a new random
order each round, and the ratio to the unchecked program taken within each round.

Methods (the same kernel; the error mode is read when a program is traced, so each has its own program):

* ``none``: the check left out (``jax_ring.status.left_out()``: the kernel keeps a failure on the heap for
  ``check_errors()``), the floor;
* ``deferred``: JAX's default, ``RING_ATTENTION_ERRORS=deferred`` (``jax_ring.status``: an asynchronous copy of
  the status per call, a failure raised by a later call);
* ``call``: ``RING_ATTENTION_ERRORS=call`` (the same handler waiting for the call's own status: a host sync).

A round runs ``--calls`` calls of each method back to back (input sets rotating), then waits for the last
(``block_until_ready``), a training loop's pattern: the host issues call i + 1 while the GPU runs call i.
Per round and method: milliseconds per call (host clock), and the host's own: how long issuing the round's calls
took, per call (``host_ms_*``; when it nears the GPU's time per call, the host is what the round waits for).
Printed and written (``--csv``): per method the median and 20/80 % quantiles over rounds, and of the per-round
ratio to ``none``; ``--png``: those ratios (``--plot CSV PNG`` redraws it from a CSV).

    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.status_cost --csv OUT_DIR/status_cost.csv \\
        --png OUT_DIR/status_cost.png
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import random
import threading
import time
from unittest import mock

import numpy as np

MODES = ("none", "deferred", "call")
# ``--probe``: where the default check's cost goes. The deferred program run with its handler changed at run time
# (the handler is Python, looked up at each call; the compiled program is the same): "deferred-nocopy" records the
# event but copies nothing (the slot is marked right by hand), "deferred-noop" returns at once (what is left: XLA
# calling a host handler between the kernel and the rest of the program). Measurement only: such a handler checks
# nothing. "deferred-kernel" and "deferred-pdl" are real checks, the slots filled by jax_ring.status's one-warp copy
# kernel launched plainly or as a programmatic dependent launch (Hopper; "deferred" is the default's). Each row's
# ``copy`` says which copy ran.
# "deferred-timed" is "deferred" with its handler's host time taken (perf_counter around ``_execute``, whose total
# per call is printed and written as ``handler_us``): what the handler's Python costs on this machine; and the share
# of its calls that ran on the main thread (``handler_on_main``; else on a thread of XLA's).
# "deferred-parts" times the handler's parts in place (its functions and the driver's calls, each wrapped), written
# as ``parts``: microseconds a call of each.
PROBES = ("deferred-nocopy", "deferred-noop", "deferred-kernel", "deferred-pdl", "deferred-timed", "deferred-parts")
_handler_s = []  # "deferred-timed": seconds of each handler call
_handler_main = []  # "deferred-timed": whether each ran on the main thread
_parts = {}  # "deferred-parts": part -> seconds, summed
PARTS = ("_execute", "_status_pointer", "_attributes", "_stream", "_poll", "_current", "cuLaunchKernel",
         "cuEventRecord", "cuEventQuery")


def _timing(name, fn):
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _parts[name] = _parts.get(name, 0.0) + time.perf_counter() - t0

    return timed


def _probe(mode):
    """The handler's change for ``mode`` (PROBES) while a round runs; nothing for the other modes."""
    from jax_ring import status

    if mode == "deferred-nocopy":
        def copy(self, slot, src, stream):
            self.words[slot] = 0
            self.words[slot, 3] = 1  # a call that completed without failure
            self._current()
            self._ok(self.cu.cuEventRecord(self.events[slot], stream), "cuEventRecord")

        return mock.patch.object(status._CudaSlots, "copy", copy)
    if mode in ("deferred-kernel", "deferred-pdl"):
        return mock.patch.object(status._slots["cuda"], "mode", mode.split("-")[1])  # made by the first runs
    if mode == "deferred-noop":
        return mock.patch.object(status, "_execute", lambda frame, platform: None)
    if mode == "deferred-timed":
        execute = status._execute

        def timed(frame, platform):
            t0 = time.perf_counter()
            try:
                return execute(frame, platform)
            finally:
                _handler_s.append(time.perf_counter() - t0)
                _handler_main.append(threading.current_thread() is threading.main_thread())

        return mock.patch.object(status, "_execute", timed)
    if mode == "deferred-parts":
        slots = status._slots["cuda"]
        stack = contextlib.ExitStack()
        for name in PARTS[:5]:
            stack.enter_context(mock.patch.object(status, name, _timing(name, getattr(status, name))))
        stack.enter_context(mock.patch.object(slots, "_current", _timing("_current", slots._current)))
        for name in PARTS[6:]:
            stack.enter_context(mock.patch.object(slots.fast, name, _timing(name, getattr(slots.fast, name))))
        return stack
    return contextlib.nullcontext()


def _trace_context(mode):
    from jax_ring import status
    from ring_core.protocol import control

    if mode == "none":
        return status.left_out()
    return control.environ(**{control.ERRORS_ENV: mode})


def build(mode, mesh, pass_, causal, q, k, v, do):
    """A jitted program of ``pass_`` ("fwd" or "fwd+bwd") traced (and run once) under ``mode``'s error check."""
    import jax
    import jax.numpy as jnp

    import jax_ring

    def attn(a, b, c):
        # Causal in the zigzag layout, as benchmarks/attention.py runs it (at world size 1 the same token order):
        # the same kernel variants, which tools/gpu_variants.py lists from that script's cases.
        return jax_ring.ring_attention_sharded(a, b, c, mesh=mesh, axis_name="sp", backend="fused", is_causal=causal,
                                               layout="zigzag" if causal else "contiguous")

    if pass_ == "fwd":
        fn = jax.jit(attn)
    else:
        fn = jax.jit(jax.grad(lambda a, b, c: jnp.sum(attn(a, b, c).astype(jnp.float32) * do), argnums=(0, 1, 2)))
    with _trace_context(mode):
        jax.block_until_ready(fn(q, k, v))
    return fn


# ``--frontend torch``: the same rounds through torch_bridge (its check: torch_bridge.lifecycle.track, an event per
# call; the kernel writes the status into pinned host memory itself. Until 2026-12-04 track also copied the status
# into pinned memory by cuMemcpyAsync). "none" leaves the tracking out (no event); "deferred-nocopy" records
# the event only (since the change, what "deferred" does); "call" is RING_ATTENTION_ERRORS=call (a host sync).
TORCH_MODES = ("none", "deferred", "call")
TORCH_PROBES = ("deferred-nocopy",)


def _torch_mode(mode):
    """What ``mode`` changes in torch's tracking while a round runs (torch reads the error mode at each call)."""
    from ring_core.protocol import control
    from torch_bridge import lifecycle

    if mode == "none":
        return mock.patch.object(lifecycle, "track", lambda status, ring, timeout_s: None)
    if mode == "deferred-nocopy":
        import torch

        def track(status, ring, timeout_s):
            torch.cuda.Event().record()

        return mock.patch.object(lifecycle, "track", track)
    return control.environ(**{control.ERRORS_ENV: mode})


def build_torch(pass_, causal, do):
    """``pass_`` ("fwd" or "fwd+bwd") through torch_bridge's fused backend, as a function of (q, k, v)."""
    import torch

    import torch_bridge

    def fn(q, k, v):
        if pass_ == "fwd":
            with torch.no_grad():
                return torch_bridge.ring_attention(q, k, v, is_causal=causal, backend="fused",
                                                   layout="zigzag" if causal else "contiguous")
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = torch_bridge.ring_attention(q, k, v, is_causal=causal, backend="fused",
                                          layout="zigzag" if causal else "contiguous")
        out.backward(do)
        return q.grad

    return fn


def plot(csv_path: str, png: str) -> None:
    """Each case's ratio to the unchecked program (median over rounds, bars from the 20 % to the 80 % quantile)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["mode"] != "none"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        sel = [r for r in rows if r["mode"] == mode]
        x = np.arange(len(sel)) + 0.15 * i
        med = np.array([float(r["ratio_median"]) for r in sel])
        err = [med - [float(r["ratio_q20"]) for r in sel], [float(r["ratio_q80"]) for r in sel] - med]
        ax.errorbar(x, med, yerr=err, fmt="o", capsize=3, label=mode)
        ax.set_xticks(np.arange(len(sel)) + 0.1,
                      [f"{r['pass_']} {'causal' if r['causal'] == '1' else 'full'}" for r in sel])
    ax.axhline(1.02, color="r", ls="--", lw=1, label="target 1.02 (deferred)")
    ax.axhline(1.0, color="k", lw=0.5)
    r0 = rows[0]
    ax.set_ylabel("ms per call / no check (per round)")
    ax.set_title(f"{r0.get('frontend', 'jax')} per-call error check, seq_local {r0['seq_local']}, bf16 "
                 f"H{r0['heads']} D{r0['head_dim']}, world 1 ({r0['rounds']} rounds x {r0['calls']} calls)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", default="no,yes")
    ap.add_argument("--pass", dest="passes", default="fwd,fwd+bwd")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--sets", type=int, default=3, help="input sets, rotating")
    ap.add_argument("--csv")
    ap.add_argument("--png")
    ap.add_argument("--plot", nargs=2, metavar=("CSV", "PNG"), help="only plot an earlier run's CSV")
    ap.add_argument("--probe", action="store_true", help=f"also time {', '.join(PROBES)} (see PROBES)")
    ap.add_argument("--frontend", choices=("jax", "torch"), default="jax")
    a = ap.parse_args(argv)
    if a.plot:
        return plot(*a.plot)

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import jax_ring
    from jax_ring import status

    jax_ring.initialize()
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    rng = np.random.default_rng(0)
    shape = (1, a.seq, a.heads, a.head_dim)
    torch_ = a.frontend == "torch"
    if torch_:
        import torch

        dev = torch.device("cuda", torch.cuda.current_device())
        sets = [[torch.as_tensor(rng.standard_normal(shape), dtype=torch.bfloat16, device=dev) for _ in range(3)]
                for _ in range(a.sets)]
        do = torch.as_tensor(rng.standard_normal(shape), dtype=torch.bfloat16, device=dev)
        ready = lambda out: torch.cuda.synchronize()  # noqa: E731
    else:
        sets = [[jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3)] for _ in range(a.sets)]
        do = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        ready = jax.block_until_ready
    order = random.Random(0)
    rows = []
    for pass_ in a.passes.split(","):
        for causal in (c == "yes" for c in a.causal.split(",")):
            if torch_:
                fn1 = build_torch(pass_, causal, do)
                fns = {m: fn1 for m in TORCH_MODES}
                modes = TORCH_MODES + (TORCH_PROBES if a.probe else ())
                for m in modes:
                    with _torch_mode(m):
                        ready(fn1(*sets[0]))
            else:
                fns = {m: build(m, mesh, pass_, causal, *sets[0], do) for m in MODES}
                modes = MODES + (PROBES if a.probe else ())
            times = {m: [] for m in modes}
            host = {m: [] for m in modes}
            handler_us = {m: [] for m in modes}
            on_main = {m: [] for m in modes}
            copy = {}
            _parts.clear()
            for _ in range(a.rounds):
                modes = list(modes)
                order.shuffle(modes)
                for m in modes:
                    out = None
                    fn = fns[m.split("-")[0]]
                    n = len(_handler_s)
                    with _torch_mode(m) if torch_ else _probe(m):
                        copy[m] = ("" if m == "none" else "torch" if torch_
                                   else getattr(status._slots.get("cuda"), "mode", "host"))
                        t0 = time.perf_counter()
                        for i in range(a.calls):
                            out = fn(*sets[i % a.sets])
                        t1 = time.perf_counter()
                        ready(out)
                        times[m].append((time.perf_counter() - t0) * 1e3 / a.calls)
                        host[m].append((t1 - t0) * 1e3 / a.calls)
                    handler_us[m].extend(x * 1e6 for x in _handler_s[n:])
                    on_main[m].extend(_handler_main[n:])
            if torch_:
                import torch_bridge

                torch_bridge.check_errors()
            else:
                jax_ring.check_errors()
            case = f"{pass_} {'causal' if causal else 'full'}"
            for m in times:
                ms = np.asarray(times[m])
                ratio = ms / np.asarray(times["none"])
                rows.append(dict(frontend=a.frontend, pass_=pass_, causal=int(causal), seq_local=a.seq,
                                 heads=a.heads, head_dim=a.head_dim,
                                 mode=m, copy=copy.get(m, ""), rounds=a.rounds, calls=a.calls, ms_median=np.median(ms),
                                 ms_q20=np.quantile(ms, 0.2), ms_q80=np.quantile(ms, 0.8),
                                 ratio_median=np.median(ratio), ratio_q20=np.quantile(ratio, 0.2),
                                 ratio_q80=np.quantile(ratio, 0.8), host_ms_median=np.median(host[m]),
                                 host_ms_q80=np.quantile(host[m], 0.8),
                                 handler_us=np.median(handler_us[m]) if handler_us[m] else "",
                                 handler_on_main=np.mean(on_main[m]) if on_main[m] else "",
                                 parts=";".join(f"{k}:{v * 1e6 / (a.rounds * a.calls):.1f}" for k, v in _parts.items())
                                 if m == "deferred-parts" else ""))
                r = rows[-1]
                print(f"{case:16s} {m:9s} ({r['copy'] or '-'}) "
                      f"{r['ms_median']:.4f} ms [{r['ms_q20']:.4f}, {r['ms_q80']:.4f}]  "
                      f"x none {r['ratio_median']:.4f} [{r['ratio_q20']:.4f}, {r['ratio_q80']:.4f}]  "
                      f"host {r['host_ms_median']:.4f} ms [q80 {r['host_ms_q80']:.4f}]"
                      + (f"  handler {r['handler_us']:.1f} us, {r['handler_on_main']:.0%} on the main thread"
                         if r["handler_us"] != "" else "") + (f"  us a call: {r['parts']}" if r["parts"] else ""),
                      flush=True)
    if a.csv:
        os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["command"])
            w.writeheader()
            for r in rows:
                w.writerow({**r, "command": "python -m benchmarks.status_cost " + " ".join(argv or [])})
    if a.png and a.csv:
        plot(a.csv, a.png)
    jax_ring.shutdown()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
