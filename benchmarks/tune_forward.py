"""Block-size sweep of the fused forward kernel (torch launcher), one process per GPU:

    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.tune_forward --csv benchmarks/results/x.csv

For every candidate KernelConfig (that fits Hopper's shared memory) and every case it checks the output
against the torch reference ring (at seq_local <= --check-max-seq) and times the call: median and 20/80 %
quantiles of the slowest rank's CUDA-event time, TFLOP/s per GPU (causal counts half). The winners become
the table in ring_core.launch.KernelConfig.get_default (the choice is cached there, never autotuned per
call). torch SDPA with the cuDNN backend on the same per-GPU work (non-causal: S_local queries against
S_global keys) is printed beside them as the limit.
"""

import argparse
import csv
import datetime
import os


import torch_bridge
from benchmarks.attention import Case, flops_per_gpu, summarize_times, tflops
from ring_core import launch, testing, validate

# (block_m, block_n, num_warps, num_stages, seg_blocks)
CANDIDATES = {
    64: [(128, 64, 4, 3, 4), (128, 128, 8, 3, 4), (128, 128, 4, 3, 4), (64, 64, 4, 3, 4), (128, 64, 4, 4, 4)],
    128: [(128, 64, 8, 3, 4), (128, 128, 8, 2, 4), (128, 128, 8, 3, 4), (128, 64, 8, 4, 4), (128, 64, 4, 3, 4),
          (64, 64, 4, 3, 4), (128, 64, 8, 3, 16), (128, 32, 4, 4, 8)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--seq", default="4096,16384")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check-max-seq", type=int, default=4096)
    ap.add_argument("--candidates", default=None,
                    help="override the candidate list for every head dim: 'bm,bn,warps,stages,seg;...'")
    a = ap.parse_args()
    cands = CANDIDATES if a.candidates is None else {
        d: [tuple(int(x) for x in c.split(",")) for c in a.candidates.split(";")] for d in (64, 128)}
    torch_bridge.initialize(heap_size=16 << 30)
    import torch
    import torch.distributed as dist
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torch_bridge import fused

    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    B, H = 1, a.heads
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
        return summarize_times(t.cpu().numpy())

    for D in [int(x) for x in a.head_dims.split(",")]:
        for S in [int(x) for x in a.seq.split(",")]:
            for causal, lay in ((False, "contiguous"), (True, "zigzag")):
                g = torch.Generator(device=dev).manual_seed(1234 + rank)
                sets = [tuple(torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
                        for _ in range(3)]
                spec = validate.check_attention_args(sets[0][0].shape, sets[0][1].shape, sets[0][2].shape,
                                                     "bfloat16", "bfloat16", "bfloat16", is_causal=causal,
                                                     scale=None, layout=lay, backend="fused", backends=("fused",))
                fl = flops_per_gpu(Case(batch=B, heads=H, kv_heads=H, head_dim=D, seq_local=S, causal=causal,
                                        dtype="bfloat16"), W)
                ref = None
                if S <= a.check_max_seq:
                    with torch.no_grad():
                        ref = torch_bridge.ring_attention(*sets[0], is_causal=causal, layout=lay, backend="torch")
                if not causal:  # the limit: cuDNN on one GPU, the same per-GPU work
                    qs = sets[0][0].transpose(1, 2)
                    kg = torch.randn(B, H, S * W, D, device=dev, dtype=torch.bfloat16)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        med, _, _ = timeit(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                           [(qs, kg, kg)])
                    if rank == 0:
                        print(f"D{D} S{S} causal={causal}: cuDNN one GPU same work {tflops(fl, med):.1f} TFLOP/s",
                              flush=True)
                for bm, bn, nw, ns, seg in cands[D]:
                    cfg = launch.KernelConfig(block_m=bm, block_n=bn, chunk_blocks=max(1, 128 // bn), push_rows=32,
                                              num_warps=nw, num_stages=ns, seg_blocks=seg)
                    row = dict(head_dim=D, seq_local=S, causal=causal, layout=lay, block_m=bm, block_n=bn,
                               num_warps=nw, num_stages=ns, seg_blocks=seg)
                    try:
                        def f(q, k, v, cfg=cfg):
                            return fused.forward(q, k, v, spec, config=cfg)[0]
                        if ref is not None:
                            out = f(*sets[0])
                            err = testing.max_abs_err(out.float().cpu().numpy(), ref.float().cpu().numpy())
                            row["max_diff_vs_ref"] = err
                            assert err < 0.05, f"config {cfg} differs from the reference by {err}"
                        med, q20, q80 = timeit(f, sets)
                        fused.check_errors()
                        row.update(ms=med, ms_q20=q20, ms_q80=q80, tflops=tflops(fl, med))
                    except Exception as e:  # noqa: BLE001 - a config that fails to compile/run is reported
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(row)
                    if rank == 0:
                        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    if rank == 0 and a.csv:
        import jax  # only for its version

        meta = dict(gpu=torch.cuda.get_device_name(), world=W, torch=torch.__version__, triton=triton.__version__,
                    jax=jax.__version__, date=datetime.date.today().isoformat(), dtype="bfloat16", heads=H, batch=B)
        keys = list(meta) + sorted({k for r in rows for k in r})
        os.makedirs(os.path.dirname(a.csv) or ".", exist_ok=True)
        with open(a.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys)
            w.writeheader()
            for r in rows:
                w.writerow({**meta, **r})
    torch_bridge.shutdown()


if __name__ == "__main__":
    main()
