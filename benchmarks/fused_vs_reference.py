"""First timing: the fused kernel against the reference ring backends, one process per GPU.

    python -m jax_ring.launch --nproc-per-node 2 benchmarks/fused_vs_reference.py --csv benchmarks/results/x.csv

Per case: median and 20/80 % quantiles of the per-call time (CUDA events; the slowest rank counts),
TFLOP/s per GPU (4*B*H*S_local*S_global*D FLOPs per rank, half of that when causal), and the speed-up of
fused over the reference of the same framework. Inputs are random and rotated over 3 sets.
"""

import argparse
import csv
import datetime
import os
import platform

import numpy as np

import jax_ring


def flops_per_rank(b, s_local, world, h, d, causal):
    f = 4.0 * b * h * s_local * (s_local * world) * d
    return f / 2 if causal else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--framework", default="both", choices=["torch", "jax", "both"])
    ap.add_argument("--seq", default="4096,8192,16384")
    ap.add_argument("--ref-max-seq", type=int, default=8192, help="skip the reference above this seq_local")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    jax_ring.initialize(heap_size=16 << 30)
    import jax
    import jax.numpy as jnp
    import torch
    import torch.distributed as dist
    import triton
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import torch_bridge

    torch_bridge.initialize()
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    B, H, HKV, D = 1, a.heads, a.kv_heads, a.head_dim
    rows = []

    def timeit(fn, sets):
        for i in range(2):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
        ts = []
        for i in range(a.iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn(*sets[i % len(sets)])
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        t = torch.tensor(ts, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank counts, call by call
        t = t.cpu().numpy()
        return float(np.median(t)), float(np.quantile(t, 0.2)), float(np.quantile(t, 0.8))

    for S in [int(x) for x in a.seq.split(",")]:
        for causal, lay in ((False, "contiguous"), (True, "zigzag")):
            g = torch.Generator(device=dev).manual_seed(1234 + rank)
            mk = lambda h: torch.randn(B, S, h, D, device=dev, dtype=torch.bfloat16, generator=g)
            tsets = [(mk(H), mk(HKV), mk(HKV)) for _ in range(3)]
            fl = flops_per_rank(B, S, W, H, D, causal)
            methods = []
            if a.framework in ("torch", "both"):
                for be in ("fused", "torch"):
                    if be == "torch" and S > a.ref_max_seq:
                        continue

                    def f(q, k, v, be=be):
                        with torch.no_grad():
                            return torch_bridge.ring_attention(q, k, v, is_causal=causal, layout=lay, backend=be)
                    methods.append((f"torch_bridge/{be}", f, tsets))
            if a.framework in ("jax", "both"):
                sh = NamedSharding(mesh, P(None, "sp"))
                jsets = [tuple(jax.make_array_from_process_local_data(
                    sh, jnp.asarray(x.float().cpu().numpy(), dtype=jnp.bfloat16), (B, S * W, x.shape[2], D))
                    for x in s) for s in tsets]
                for be in ("fused", "xla"):
                    if be == "xla" and S > a.ref_max_seq:
                        continue
                    body = lambda q, k, v, be=be: jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=causal,
                                                                          layout=lay, backend=be)
                    jf = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                                               out_specs=P(None, "sp"), check_vma=False))
                    methods.append((f"jax_ring/{be}", lambda q, k, v, jf=jf: jf(q, k, v).block_until_ready(), jsets))
            res = {}
            for name, fn, sets in methods:
                med, q20, q80 = timeit(fn, sets)
                res[name] = med
                row = dict(method=name, world=W, batch=B, seq_local=S, heads=H, kv_heads=HKV, head_dim=D,
                           causal=causal, layout=lay, dtype="bfloat16", ms_median=round(med, 4),
                           ms_q20=round(q20, 4), ms_q80=round(q80, 4),
                           tflops_per_gpu=round(fl / (med * 1e-3) / 1e12, 2))
                rows.append(row)
                if rank == 0:
                    print(f"S={S:6d} causal={causal!s:5} {name:22s} {med:9.3f} ms "
                          f"[{q20:.3f}, {q80:.3f}]  {row['tflops_per_gpu']:7.1f} TFLOP/s/GPU", flush=True)
            for fw, ref in (("torch_bridge", "torch"), ("jax_ring", "xla")):
                if f"{fw}/fused" in res and f"{fw}/{ref}" in res and rank == 0:
                    print(f"    {fw}: fused is {res[f'{fw}/{ref}'] / res[f'{fw}/fused']:.2f}x the {ref} reference")
    if rank == 0 and a.csv:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, jax=jax.__version__,
                    triton=triton.__version__, python=platform.python_version(),
                    date=datetime.date.today().isoformat())
        os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(meta))
            w.writeheader()
            for r in rows:
                w.writerow({**r, **meta})
        print("wrote", a.csv)
    jax_ring.shutdown()


if __name__ == "__main__":
    main()
