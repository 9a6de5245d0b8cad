"""GPU soak, one process per GPU: many consecutive fused calls with changing shapes, flags, layouts
and dtypes through both frontends, every result checked. Run by tests/gpu/test_gpu.py (``pytest -m gpu``), or:

    python -m jax_ring.launch --nproc-per-node 2 tests/gpu/gpu_soak.py --calls 10000 --out /tmp/soak

Every call draws one configuration at random from a pool (``plan``: random valid batch, seq_local, heads,
kv heads, head_dim, dtype, causal/layout; drawn once so that compilation stays bounded) and a frontend
(torch_bridge or jax_ring), and checks the output against the float64 reference with the one tolerance
table. Every ``--big-every`` calls a larger case runs and is checked too. GPU memory (torch allocator,
and the process RSS) is sampled after the warm-up and at the end: it must not grow. Every call has a
``timeout_s`` and a watchdog bounds the run: a hang becomes an error, never a stuck job. Rank 0 prints the
figures and writes ``gpu_soak.json`` under ``--out``; the exit code is 0 only if every call on every rank
was right.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_faults import Job, start_watchdog  # noqa: E402

HEAD_DIMS = (16, 24, 32, 64, 80, 96, 128, 160, 192, 256)
BIG = (1, 4096, 16, 4, 128, "bfloat16", True, "zigzag")  # at W=2: 8k tokens, 16 heads


def big_case(world: int) -> tuple:
    """BIG at any world size: 8k tokens in all, 16 heads at W <= 2 and fewer above. Every rank computes the
    float64 reference of the whole sequence, and W processes on one machine doing so at W=2's size per rank
    ran it out of host memory (4 ranks on one GPU: a rank was killed)."""
    b, s, h, hkv, d, dtype, causal, layout = BIG
    seq_local = 2 * s // world // 2 * 2  # zigzag: even
    heads = max(hkv, h * 2 // max(world, 2) // hkv * hkv)
    return (b, seq_local, heads, hkv, d, dtype, causal, layout)


def plan(seed: int, pool: int, variants: int):
    """``pool`` random valid configurations (B, S, H, HKV, D, dtype, causal, layout), the same on every rank,
    drawn over ``variants`` random kernel variants. A variant fixes what the kernel is compiled for (heads,
    kv heads, head_dim, dtype, causal, layout, and Triton's specialisation of batch == 1 and of seq_local
    == 1 or a multiple of 16); its configurations draw batch and seq_local within that class. So the run
    compiles ``variants`` kernels per frontend (a fp32 compile takes a minute) however large the pool.
    float32 is kept to head_dim <= 64."""
    rng = random.Random(seed)
    kinds = []
    while len(kinds) < variants:
        dtype = rng.choice(("bfloat16", "float16", "float32"))
        d = rng.choice([x for x in HEAD_DIMS if dtype != "float32" or x <= 64])
        hkv = rng.choice((1, 2, 4))
        causal = rng.random() < 0.6
        layout = rng.choice(("zigzag", "contiguous")) if causal else "contiguous"
        kinds.append((hkv * rng.choice((1, 2, 4)), hkv, d, dtype, causal, layout, rng.random() < 0.5,
                      rng.choice(("one", "x16", "other"))))
    out = []
    for n in range(pool):
        h, hkv, d, dtype, causal, layout, b_one, s_class = kinds[n % variants]
        s = {"one": [1], "x16": [16, 64, 256, 512], "other": [17, 100, 255, 334, 777]}[s_class]
        s = rng.choice([x for x in s if layout != "zigzag" or x % 2 == 0] or [2])
        out.append((1 if b_one else rng.choice((2, 3)), s, h, hkv, d, dtype, causal, layout))
    return out


def main(argv=None) -> int:
    t_process = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--pool", type=int, default=12, help="distinct random configurations")
    ap.add_argument("--variants", type=int, default=4, help="distinct kernel variants they share (compiles)")
    ap.add_argument("--bwd-every", type=int, default=10,
                    help="every N-th call is a gradient call (forward + fused backward), 0: none")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop (every rank at the same call) once this process has run this long, warm-up "
                         "included; the figures then say how many calls were made")
    ap.add_argument("--big-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--timeout", type=float, default=60.0, help="timeout_s of every call")
    ap.add_argument("--deadline", type=float, default=560.0, help="watchdog: seconds this process may run")
    ap.add_argument("--heap-gib", type=float, default=4.0)
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    job = Job(a, with_jax=not a.no_jax)
    start_watchdog(a.deadline, job.rank)
    torch = job.torch
    configs = plan(a.seed, a.pool, a.variants) + [big_case(job.world)]
    from ring_core import reference, testing

    prepared = []  # (inputs, this rank's indices, float64 reference, same-precision reference) per config
    for i, c in enumerate(configs):  # references once, of this rank's rows only (the big case's take seconds)
        xs, idx = job.inputs(a.seed + i, *c[:6], c[7])
        o64, _ = reference.attention(*xs, is_causal=c[6], q_rows=idx)
        olp, _ = reference.attention_lowp(*xs, c[5], is_causal=c[6], q_rows=idx)
        prepared.append((xs, idx, o64, olp))
    # Gradient calls: on the configurations of the first variant (one more compile per frontend).
    grad_configs = [i for i in range(a.pool) if i % a.variants == 0] if a.bwd_every else []
    grad_refs = {}
    for i in grad_configs:
        xs, idx = prepared[i][:2]
        c = configs[i]
        dout = reference.round_to(np.random.default_rng(a.seed + 100 + i).standard_normal(xs[0].shape), c[5])
        g64 = reference.attention_grad(*xs, dout, is_causal=c[6])
        glp = reference.attention_grad_lowp(*xs, dout, c[5], is_causal=c[6])
        grad_refs[i] = (dout, [g[:, idx] for g in g64], [g[:, idx] for g in glp])
    frontends = ["torch"] + ([] if a.no_jax else ["jax"])
    rng = random.Random(a.seed + 1)
    bad, counts, t_calls = [], {}, {f: 0.0 for f in frontends}

    def call(i: int, n: int, fw: str, grad: bool = False) -> None:
        b, s, h, hkv, d, dtype, causal, layout = configs[i]
        xs, idx, o64, olp = prepared[i]
        t0 = time.perf_counter()
        if grad:
            dout, g64, glp = grad_refs[i]
            got = (job.torch_grads if fw == "torch" else job.jax_grads)(xs, dout, idx, dtype, is_causal=causal,
                                                                      layout=layout, timeout_s=a.timeout)
        elif fw == "torch":
            out, _ = job.torch_fused(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout)
            out = out.float().cpu().numpy()
        else:
            out, _ = job.jax_fused(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout)
        t_calls[fw] += time.perf_counter() - t0
        kind = f"{fw} grad" if grad else fw
        counts[kind] = counts.get(kind, 0) + 1
        try:
            if grad:
                for name, g, r, lo in zip(("dq", "dk", "dv"), got, g64, glp):
                    testing.check(f"soak call {n} ({kind} {name}, {configs[i]})", np.asarray(g, np.float64), r,
                                  lo, dtype, "grad")
            else:
                testing.check(f"soak call {n} ({fw}, {configs[i]})", np.asarray(out, np.float64), o64, olp, dtype,
                              "out")
        except AssertionError as e:
            bad.append(str(e)[:300])

    t_start = time.time()
    for i in range(len(configs)):  # warm-up: every configuration through every frontend (compiles)
        for fw in frontends:
            call(i, -1, fw)
            if i in grad_refs:
                call(i, -1, fw, grad=True)
    job.barrier("warm-up")
    torch.cuda.synchronize()
    mem0, rss0 = torch.cuda.memory_allocated(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_warm = time.time() - t_start
    t0 = time.time()
    made = 0
    for n in range(a.calls):
        if a.max_seconds and n % 200 == 0 and job.agree_any(time.time() - t_process > a.max_seconds):
            break
        grad = bool(grad_refs) and n % a.bwd_every == a.bwd_every - 1
        if grad:
            i = rng.choice(sorted(grad_refs))
        elif a.big_every and n % a.big_every == a.big_every - 1:
            i = len(configs) - 1
        else:
            i = rng.randrange(a.pool)
        call(i, n, frontends[rng.randrange(len(frontends))], grad=grad)
        made += 1
    torch.cuda.synchronize()
    job.barrier("soak")
    mem1, rss1 = torch.cuda.memory_allocated(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    summary = dict(rank=job.rank, calls=made, wrong=len(bad), first_wrong=bad[:5], per_frontend=counts,
                   seconds=round(time.time() - t0, 1), warmup_seconds=round(t_warm, 1),
                   call_seconds={k: round(v, 1) for k, v in t_calls.items()},
                   gpu_bytes_growth=mem1 - mem0, rss_kib_growth=rss1 - rss0, configs=configs)
    merged = [None] * job.world
    job.dist.all_gather_object(merged, summary)
    # A soak that made no calls after its warm-up (its --max-seconds spent before it, e.g. by a slow start) proves
    # nothing: it fails, saying so, instead of passing on the warm-up's calls alone.
    ok = all(m["wrong"] == 0 and m["gpu_bytes_growth"] <= (64 << 20) and m["calls"] > 0 for m in merged)
    if job.rank == 0:
        for m in merged:
            print(f"gpu_soak rank {m['rank']}: {m['calls']} calls ({m['per_frontend']}), {m['wrong']} wrong, "
                  f"{m['seconds']} s after a {m['warmup_seconds']} s warm-up, GPU memory growth "
                  f"{m['gpu_bytes_growth']} B, peak RSS growth {m['rss_kib_growth']} KiB", flush=True)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "gpu_soak.json"), "w") as f:
                json.dump(dict(ok=ok, ranks=merged), f, indent=1)
        if not all(m["calls"] for m in merged):
            print("gpu_soak: no calls after the warm-up: --max-seconds ran out before the soak began", flush=True)
        print("gpu_soak: " + ("ALL CALLS RIGHT" if ok else "FAILED"), flush=True)
    job.tb.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
