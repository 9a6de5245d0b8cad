"""Where a JAX fused call's per-call time goes beside torch's (issue 18's target: JAX within 3 % of torch at seq_local
16k, timed per call by benchmarks/attention.py). Each call is timed on its own after the GPU is idle, both frameworks
on the host's clock (``perf_counter`` from the call to its result being ready: ``block_until_ready`` for JAX,
``torch.cuda.synchronize`` for torch), so that the two include the same things: the host's work before the launch,
the kernel, and the wait for it. Beside the fused forward, each framework's floor: a jitted ``x + 1`` on one element
(JAX: dispatch of a compiled program and ``block_until_ready``), and torch's ``x + 1`` with a synchronize. And what
the JAX program runs besides the kernel: its optimised HLO's instructions by kind, its custom calls by target.

At world size 1 on one GPU, bf16, B=1, H=32, D=128, causal, zigzag (benchmarks/attention.py's W=1 cases):

    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.jax_call_cost --csv OUT.csv [--hlo OUT.txt]
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
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=40)
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
    shape = (1, a.seq, a.heads, a.head_dim)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in host)
    dev = torch.device("cuda", torch.cuda.current_device())
    tq, tk, tv = (torch.from_numpy(x).to(dev, torch.bfloat16) for x in host)

    fwd = jax.jit(lambda q, k, v: jax_ring.ring_attention_sharded(q, k, v, mesh=mesh, axis_name="sp",
                                                                  backend="fused", is_causal=True, layout="zigzag"))
    one = jax.jit(lambda x: x + 1)
    x1 = jnp.zeros((1,), jnp.float32)
    t1 = torch.zeros((1,), device=dev)
    text = fwd.lower(jq, jk, jv).compile().as_text()
    summary = hlo_summary(text)
    print("JAX forward's optimised HLO:", summary, flush=True)
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write(text)

    def jready(x=None):
        if x is not None:
            jax.block_until_ready(x)

    def tready(x=None):
        torch.cuda.synchronize()

    cases = {
        "jax_floor": (lambda: one(x1), jready),
        "torch_floor": (lambda: t1 + 1, tready),
        "jax_fused": (lambda: fwd(jq, jk, jv), jready),
        "torch_fused": (lambda: torch_bridge.ring_attention(tq, tk, tv, backend="fused", is_causal=True,
                                                            layout="zigzag"), tready),
    }
    rows = []
    with torch.no_grad():
        for name, (fn, ready) in cases.items():  # warm-up (compiles, plans)
            for _ in range(3):
                ready(fn())
        for rnd in range(3):  # rounds, so that drift shows
            for name, (fn, ready) in cases.items():
                us = _times(fn, ready, a.iters)
                rows.append(dict(round=rnd, what=name, seq_local=a.seq, median_us=float(np.median(us)),
                                 min_us=float(us.min()), q20_us=float(np.quantile(us, 0.2)),
                                 q80_us=float(np.quantile(us, 0.8)), iters=a.iters))
                print(f"round {rnd} {name:12s} median {rows[-1]['median_us']:9.1f} us  min {rows[-1]['min_us']:9.1f}",
                      flush=True)
    jax_ring.check_errors()
    torch_bridge.check_errors()
    if a.csv:
        rows.append(dict(what="hlo", note=str(summary)))
        write_rows(a.csv, rows)


if __name__ == "__main__":
    main()
