"""What a host callback after every call costs a JAX program on one GPU, and where it goes (the JAX
frontend's per-call error check: a ``jax.debug.callback`` on the kernel's status words cost 14-18 % of the fused
forward at 16k tokens against deferred errors, one H200, 2026-12-01; the budget is 2 % at 4k).

No ring, no Triton: a jitted stand-in for the fused call (a chain of bf16 matmuls taking about ``--work-ms``)
that also returns a status array of the fused kernel's size (``control.STATUS_WORDS`` int32), run

* ``none``: as is (what ``RING_ATTENTION_ERRORS=deferred`` gives);
* ``debug``: with ``jax.debug.callback(check, status, ctx)``, an earlier "call" mode of ``jax_ring.fused``;
* ``debug_status``: the same with the status only (is the second operand's copy the cost?);
* ``debug_concat``: the status and the context in one operand (a device concatenation first), what
  ``jax_ring.fused`` does now;
* ``io``: ``jax.experimental.io_callback(check, None, status, ordered=False)``;
* ``io_ordered``: the same, ordered (a token threads the calls);
* ``status``: ``jax_ring.status.check(status, None, ...)``, JAX's default error mode: a
  typed-FFI handler in ctypes that starts an asynchronous copy of the status to pinned memory and an event on
  XLA's stream, and checks earlier calls' copies that have landed (no sync, no JAX effect);

each timed three ways: ``sync`` (every call followed by ``block_until_ready``, as benchmarks/attention.py
times calls), ``dispatch`` (host time until the call returns, the GPU still busy) and ``pipelined`` (``--depth``
calls dispatched back to back, then one ``block_until_ready``: a training loop's pattern; per call).

    python -m benchmarks.callback_cost --out OUT_DIR/callback_cost.csv

Predictions for ``status`` (written before any GPU run; on our CPU, jax 0.10.2, its handler takes 7-9 us of host
time and a jitted call 15 us more in all): ``dispatch`` +0.01-0.03 ms over ``none`` (the handler runs when XLA
enqueues the call, plus the CUDA driver calls); ``pipelined`` within 0.01 ms of ``none`` at 0.7 ms of work (the
host stays ahead; the 144-byte copy on the stream costs the GPU a few microseconds); ``sync`` +0.01-0.04 ms.
If ``pipelined`` pays much more, XLA runs the handler on a thread that waits for the GIL (the Python main thread
holding it), or the copy is slower than expected: compare ``dispatch`` and ``sync``.

Predictions (before any measurement): the callback's own work is a 144-byte copy to the host and a few
microseconds of Python, so if that were all, every variant would cost under 0.1 ms per call. The session-3 figures
(1.6 ms at 16k, 0.8 ms at 32k, about 1.5 ms per callback in fwd+bwd) say otherwise; the suspect is dispatch:
a program with a callback has a side effect, which may keep JAX off its C++ fast path (``dispatch`` then grows by
the difference, ``sync`` with it), and a synchronous copy in the callback's thunk that stalls the stream. If
``dispatch`` carries the difference, ``pipelined`` hides it behind the GPU's work (a training loop would not pay
it) and the benchmark's synchronous timing overstates the cost; if ``pipelined`` pays it too, the stall is on the
GPU's side.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("none", "debug", "debug_status", "debug_concat", "io", "io_ordered", "status")


def _program(variant: str, n: int, reps: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ring_core.protocol import control

    def check(status, ctx=None):
        s = np.asarray(status)
        if s[0] != 0:
            raise RuntimeError(f"status {s[:4]}")

    def f(x, ctx):
        y = x
        for _ in range(reps):
            y = jnp.tanh(y @ x)  # a chain the GPU runs for a while (not fused away)
        status = (jnp.zeros((control.STATUS_WORDS,), jnp.int32).at[3].set(1)  # epoch 1: a call that completed
                  + (y[0, 0] != y[0, 0]).astype(jnp.int32))
        if variant == "debug":
            jax.debug.callback(check, status, ctx)
        elif variant == "debug_status":
            jax.debug.callback(check, status)
        elif variant == "debug_concat":  # one operand, as jax_ring.fused passes them
            jax.debug.callback(check, jnp.concatenate([status, ctx.astype(jnp.int32)]))
        elif variant in ("io", "io_ordered"):
            jax.experimental.io_callback(check, None, status, ordered=variant == "io_ordered")
        elif variant == "status":  # JAX's default error mode: jax_ring.status
            from jax_ring import status as jstatus

            jstatus.check(status, None, 1, None)
        return y

    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16) / np.sqrt(n)
    ctx = jnp.arange(16, dtype=jnp.int64) if jax.config.jax_enable_x64 else jnp.arange(16, dtype=jnp.int32)
    return jax.jit(f), x, ctx


def _time(fn, x, ctx, iters: int, depth: int) -> dict:
    import jax

    jax.block_until_ready(fn(x, ctx))  # compile and warm up
    jax.block_until_ready(fn(x, ctx))
    sync, dispatch = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn(x, ctx)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        sync.append(t2 - t0)
    piped = []
    for _ in range(max(1, iters // depth)):
        t0 = time.perf_counter()
        outs = [fn(x, ctx) for _ in range(depth)]
        jax.block_until_ready(outs)
        piped.append((time.perf_counter() - t0) / depth)
    ms = lambda v: 1e3 * statistics.median(v)  # noqa: E731
    return {"sync_ms": ms(sync), "dispatch_ms": ms(dispatch), "pipelined_ms": ms(piped)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="callback_cost.csv")
    ap.add_argument("--work-ms", default="0.7,3,10", help="stand-in call lengths to try (ms, roughly)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--depth", type=int, default=10, help="calls in flight in the pipelined timing")
    ap.add_argument("--n", type=int, default=4096, help="matmul size of the stand-in (small for a CPU smoke run)")
    a = ap.parse_args(argv)
    import jax

    dev = jax.devices()[0]
    print(f"{dev.platform} {getattr(dev, 'device_kind', '')}, jax {jax.__version__}", flush=True)
    n = a.n
    # one 4096^3 bf16 matmul is about 0.14 TFLOP: about 0.25 ms on an H200
    rows = []
    for target in (float(w) for w in a.work_ms.split(",")):
        reps = max(1, round(target / 0.25))
        base = None
        for variant in VARIANTS:
            fn, x, ctx = _program(variant, n, reps)
            r = _time(fn, x, ctx, a.iters, a.depth)
            base = base or r
            row = {"variant": variant, "work_ms_target": target, "reps": reps, **{k: round(v, 4) for k, v in r.items()},
                   **{f"{k[:-3]}_extra_ms": round(v - base[k], 4) for k, v in r.items()}}
            rows.append(row)
            print(f"{target:5.1f} ms {variant:13s} sync {r['sync_ms']:8.3f}  dispatch {r['dispatch_ms']:7.3f}  "
                  f"pipelined {r['pipelined_ms']:8.3f}   extra: sync {row['sync_extra_ms']:+.3f} "
                  f"pipelined {row['pipelined_extra_ms']:+.3f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
