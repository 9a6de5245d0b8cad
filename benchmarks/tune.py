"""Block-size sweep of the fused forward or backward kernel (torch launcher), one process per GPU:

    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.tune --kernel fwd --csv benchmarks/results/x.csv
    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.tune --kernel bwd --csv benchmarks/results/y.csv

For every candidate config (KernelConfig, or BwdKernelConfig for the backward; all fit Hopper's shared
memory, tests/cpu/test_kernel_ir.py) and every case it checks the result and times the call: median and 20/80 %
quantiles of the slowest rank's CUDA-event time, TFLOP/s per GPU (causal counts half; the backward alone
counts 2.5 forwards). The forward is checked against the torch reference ring (at seq_local <=
--check-max-seq), the backward's dq/dk/dv against those of the backward's default config (the default itself
is checked against float64 by tests/gpu/gpu_checks.py). The winners become the tables in
ring_core.plans.KernelConfig.get_default and BwdKernelConfig.get_default (the choice is cached there, never
autotuned per call). torch SDPA with the cuDNN backend on the same per-GPU work (non-causal: S_local queries
against S_global keys; forward, or backward alone) is printed beside them as the limit.
"""

import argparse
import csv
import datetime
import os


import torch_bridge
from benchmarks.harness import Case, cuda_timed, flops_per_gpu, summarize_times, tflops
from ring_core import plans, validate

# Forward: (block_m, block_n, num_warps, num_stages, seg_blocks)
CANDIDATES = {
    64: [(128, 64, 4, 3, 4), (128, 128, 8, 3, 4), (128, 128, 4, 3, 4), (64, 64, 4, 3, 4), (128, 64, 4, 4, 4)],
    128: [(128, 64, 8, 3, 4), (128, 128, 8, 2, 4), (128, 128, 8, 3, 4), (128, 64, 8, 4, 4), (128, 64, 4, 3, 4),
          (64, 64, 4, 3, 4), (128, 64, 8, 3, 16), (128, 32, 4, 4, 8)],
    # bf16 D256: the default (64 x 32, 4 warps) compiles with ptxas warning C7515 (every wgmma serialised),
    # 64 x 64 with 8 warps does not; measured, the default is still the fastest of the three
    # (results/tune_forward_d256_2xH200_2026-11-30.csv).
    256: [(64, 32, 4, 2, 4), (64, 64, 8, 2, 4), (64, 32, 8, 2, 4)],
}
# Backward: (dq_block_m, dq_block_n, kv_block_n, kv_block_m, chunk_blocks, push_rows, num_warps, num_stages)
BWD_CANDIDATES = {
    64: [(64, 64, 64, 64, 2, 64, 4, 3), (128, 32, 128, 32, 1, 64, 4, 3), (128, 64, 128, 64, 1, 64, 8, 2),
         (64, 32, 128, 32, 1, 64, 4, 3), (128, 32, 64, 64, 2, 64, 4, 3)],
    # Since the wgmma fix of 2026-11-30 (no C7515; tests/cpu/test_kernel_ir.py): eight-warp configs whose sm_90
    # compile spills least (ptxas -v: 48-900 bytes; four warps spill 2-4 KiB). The second won and is the default.
    128: [(128, 64, 128, 64, 1, 32, 8, 2), (128, 64, 128, 64, 1, 32, 8, 3), (128, 64, 128, 32, 1, 32, 8, 2),
          (128, 64, 128, 32, 1, 32, 8, 3), (128, 32, 128, 32, 1, 32, 8, 3), (128, 64, 64, 64, 2, 32, 8, 2),
          (128, 128, 128, 64, 1, 32, 8, 2)],
    # D256 (and 192, which runs padded to 256): the default (32-row blocks, 4 warps) and the configs whose sm_90
    # compile fits the shared memory and spills least (ptxas -v, Triton 3.6: 0-1.1 KiB; 64-row K/V blocks with 4 warps
    # spill 5 KiB).
    256: [(32, 32, 32, 32, 4, 16, 4, 3), (32, 32, 32, 32, 4, 16, 8, 3), (64, 32, 32, 64, 4, 16, 8, 2),
          (64, 32, 32, 64, 4, 16, 8, 3), (64, 32, 64, 32, 2, 16, 8, 2), (128, 32, 64, 32, 2, 16, 8, 2),
          (64, 64, 64, 32, 2, 32, 8, 2)],
}
# The D128 sweep of the first tuning (2026-11-30, results/tune_backward_2xH200_2026-11-30.csv), kept to repeat it:
# (64, 64, 64, 64, 2, 32, 8, 3), (128, 32, 128, 32, 1, 32, 4, 3), (128, 32, 128, 32, 1, 32, 8, 3),
# (128, 64, 128, 64, 1, 32, 8, 2), (64, 32, 128, 32, 1, 32, 4, 3), (128, 32, 128, 32, 1, 32, 4, 2)


def _config(kernel: str, c: tuple):
    if kernel == "fwd":
        bm, bn, nw, ns, seg = c
        return plans.KernelConfig(block_m=bm, block_n=bn, chunk_blocks=max(1, 128 // bn), push_rows=32,
                                   num_warps=nw, num_stages=ns, seg_blocks=seg)
    return plans.BwdKernelConfig(*c)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--seq", default="4096,16384")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check-max-seq", type=int, default=4096)
    ap.add_argument("--candidates", default=None,
                    help="override the candidate list for every head dim, ';'-separated tuples of ints as in "
                         "CANDIDATES (fwd) or BWD_CANDIDATES (bwd)")
    a = ap.parse_args()
    bwd = a.kernel == "bwd"
    cands = (BWD_CANDIDATES if bwd else CANDIDATES) if a.candidates is None else {
        int(d): [tuple(int(x) for x in c.split(",")) for c in a.candidates.split(";")] for d in a.head_dims.split(",")}
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
            ts.append(cuda_timed(torch, lambda: fn(*sets[i % len(sets)]))[0])
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
                                        dtype="bfloat16"), W) * (2.5 if bwd else 1.0)
                ref = None
                if bwd:  # saved forward results and an output gradient per input set; the default's gradients
                    sets = [(q, k, v, *fused.forward(q, k, v, spec)[:2], torch.randn_like(q)) for q, k, v in sets]
                    with torch.no_grad():
                        ref = fused.backward(*sets[0][:5], sets[0][5], spec)
                    torch_bridge.check_errors()
                elif S <= a.check_max_seq:
                    with torch.no_grad():
                        ref = (torch_bridge.ring_attention(*sets[0], is_causal=causal, layout=lay, backend="torch"),)
                if not causal:  # the limit: cuDNN on one GPU, the same per-GPU work
                    qs = sets[0][0].transpose(1, 2)
                    kg = torch.randn(B, H, S * W, D, device=dev, dtype=torch.bfloat16)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        if bwd:
                            qg, kgg = qs.detach().requires_grad_(), kg.detach().requires_grad_()
                            og = torch.nn.functional.scaled_dot_product_attention(qg, kgg, kgg)
                            go = torch.randn_like(og)
                            med, _, _ = timeit(lambda: torch.autograd.grad(og, (qg, kgg), go, retain_graph=True),
                                               [()])
                        else:
                            med, _, _ = timeit(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                                q, k, v), [(qs, kg, kg)])
                    if rank == 0:
                        print(f"{a.kernel} D{D} S{S} causal={causal}: cuDNN one GPU same work "
                              f"{tflops(fl, med):.1f} TFLOP/s", flush=True)
                for c in cands[D]:
                    cfg = _config(a.kernel, c)
                    row = dict(kernel=a.kernel, head_dim=D, seq_local=S, causal=causal, layout=lay,
                               **{k: getattr(cfg, k) for k in cfg.__dataclass_fields__})
                    try:
                        if bwd:
                            def f(q, k, v, o, lse, do, cfg=cfg):
                                return fused.backward(q, k, v, o, lse, do, spec, config=cfg)
                        else:
                            def f(q, k, v, cfg=cfg):
                                return (fused.forward(q, k, v, spec, config=cfg)[0],)
                        if ref is not None:
                            got = f(*sets[0])
                            err = max((x.float() - r.float()).abs().max().item() for x, r in zip(got, ref))
                            row["max_diff_vs_ref"] = err
                            assert err < 0.05, f"config {cfg} differs from the reference by {err}"
                        med, q20, q80 = timeit(f, sets)
                        torch_bridge.check_errors()
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
