"""jax_ring.status on one GPU, no ring and no heap (JAX's default error mode): what the CPU tests cannot
see, the CUDA side of the handler (XLA's stream, the copy into pinned slots, events) and that it does not
sync. One process:

    python tests/gpu/gpu_status.py --out $OUT

Checks, each printed ``STATUS-CHECK <name> ok|FAILED <detail>``; exit code 0 only if all pass:
  registered  the handler registers for CUDA (XLA asked its FFI version) and the jitted program holds the call;
  async       a call behind ~50 ms of GPU work returns to the host in well under that (no sync in the handler),
              and its copy lands after the work (in_flight() then 0 after take(wait=True));
  next-call   a status that says "timed out" (written on the device) is raised by the next call, message and all,
              and take() gives it as RingAttentionTimeout; the calls after run;
  slots       3 x SLOTS calls back to back (the ring of slots wraps, the host waits for the oldest when it is
              SLOTS calls ahead), then nothing failed and nothing is left in flight;
  cost        per-call host time of the check (dispatch) and the time of a call with and without it, back to
              back (median of 5 x 200 calls), also with the main thread busy in Python meanwhile (the handler
              takes the GIL: if XLA runs it on its own thread, it waits for the GIL up to the switch interval,
              5 ms; on our CPU, jax 0.10, XLA ran it on its own threads), written to ``gpu_status.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--n", type=int, default=4096, help="matmul size of the stand-in work (small for a CPU run)")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_ring import status
    from ring_core.protocol import control

    results, failed = {}, []

    def record(name, ok, detail=""):
        results[name] = dict(ok=ok, detail=detail)
        print(f"STATUS-CHECK {name} {'ok' if ok else 'FAILED'} {detail}", flush=True)
        if not ok:
            failed.append(name)

    def words(code=control.ERR_NONE, peer=0, step=0, epoch=1):
        w = np.zeros(control.STATUS_WORDS, np.int32)
        w[:4] = (code, peer, step, epoch)
        return jnp.asarray(w)

    def make(reps, check=True):
        def f(w, x):
            y = x
            for _ in range(reps):  # GPU work before the status is "written" (a stand-in for the kernel)
                y = jnp.tanh(y @ x)
            st = w + (y[0, 0] != y[0, 0]).astype(jnp.int32)  # depends on the work: lands after it
            if check:
                status.check(st, None, 1, 2.5)
            return y
        return jax.jit(f)

    x = jax.random.normal(jax.random.key(0), (a.n, a.n), jnp.bfloat16) / np.sqrt(a.n)
    ok = words()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)

    try:
        f0 = make(1)
        hlo = f0.lower(ok, x).as_text()
        jax.block_until_ready(f0(ok, x))
        record("registered", "@ring_attention_status" in hlo and status.register(jax.default_backend()) is None,
               f"in_flight {status.in_flight()}")
    except Exception as e:  # noqa: BLE001 - the first thing that can fail on a GPU
        record("registered", False, f"{type(e).__name__}: {e}")
        return 1

    long = make(200)  # ~0.25 ms a matmul on an H200: ~50 ms
    jax.block_until_ready(long(ok, x))
    t0 = time.perf_counter()
    y = long(ok, x)
    dispatch = time.perf_counter() - t0
    jax.block_until_ready(y)
    total = time.perf_counter() - t0
    pending_after = status.take(wait=True), status.in_flight()
    record("async", dispatch < 0.2 * total and pending_after == (None, 0),
           f"dispatch {dispatch * 1e3:.2f} ms, call {total * 1e3:.1f} ms")

    try:
        jax.block_until_ready(f0(words(control.ERR_KV_TIMEOUT, 1, 1, 7), x))
        try:
            jax.block_until_ready(f0(ok, x))
            raised = "nothing"
        except Exception as e:  # noqa: BLE001 - checked below
            raised = f"{type(e).__name__}: {e}"
        kept = status.take(wait=True)
        jax.block_until_ready(f0(ok, x))
        good = ("RingAttentionTimeout: fused ring attention on rank 0 (call #7) gave up after 2.5 s" in raised
                and status.REPORTED[:60] in raised and isinstance(kept, control.RingAttentionTimeout))
        record("next-call", good, raised[:300])
    except Exception as e:  # noqa: BLE001
        record("next-call", False, f"{type(e).__name__}: {e}")

    f1 = make(1)
    ys = [f1(ok, x) for _ in range(3 * status.SLOTS)]
    jax.block_until_ready(ys)
    record("slots", status.take(wait=True) is None and status.in_flight() == 0, f"{3 * status.SLOTS} calls")

    def timed(fn, n=200, spin=False):
        """Per call, back to back; ``spin``: the main thread busy in Python until the calls are done (it holds the
        GIL, which the handler needs where XLA runs it on a thread of its own)."""
        runs = []
        for _ in range(5):
            jax.block_until_ready(fn(ok, x))
            t0 = time.perf_counter()
            ys = [fn(ok, x) for _ in range(n)]
            while spin and not ys[-1].is_ready():
                pass
            jax.block_until_ready(ys)
            runs.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(runs)

    bare = make(1, check=False)
    us = dict(with_check=timed(f1), without=timed(bare), with_check_spin=timed(f1, spin=True),
              without_spin=timed(bare, spin=True))
    disp = []
    for _ in range(200):
        t0 = time.perf_counter()
        f1(ok, x)
        disp.append((time.perf_counter() - t0) * 1e6)
    jax.block_until_ready(f1(ok, x))
    us["dispatch_with_check"] = statistics.median(disp)
    record("cost", True, ", ".join(f"{k} {v:.1f} us" for k, v in us.items()))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_status.json"), "w") as f:
            json.dump(dict(results=results, us_per_call=us, jax=jax.__version__), f, indent=1)
    print(f"gpu_status: {'ALL STATUS CHECKS PASSED' if not failed else 'FAILED: ' + ', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
