"""Where a fused backward's time goes, at world size 1: the product's backward kernels, each alone.

benchmarks/attention.py times forward+backward through autograd; this times the backward alone, through
``torch.autograd.grad`` on a saved forward (the way a training step runs it), with ``deterministic=False`` (the
Gluon Hopper backward, ring_core.kernels.gluon_bwd), ``True`` (the same kernel in its own deterministic order, by its dQ
writer) and ``True`` with RING_ATTENTION_GLUON_DETERMINISTIC=0 (the tl split, ring_core.kernels.tl_bwd), and
reads every CUDA kernel's own duration from torch.profiler (CUPTI): the fused kernel's, and the small ones
autograd and the launcher add (zeros for dlse, casts). benchmarks/gluon_bwd.py's probe (the same loop with delta and
dQ's conversion done by torch) runs beside them for the A/B. bf16, B=1, H=32, D=128.

    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.bwd_kernels --csv OUT.csv

With ``--doc-lens none,16384-16384,512-8192`` it times instead the causal ``deterministic=False`` backward
with segment ids: "none" is the dense call, "N-N" documents of N tokens (one per 16k shard: the dense work through
the masked path), "LO-HI" lengths drawn as benchmarks/attention.py's packed rows (``harness.packed_documents``);
each row also gives the pairs' TFLOP/s (the mask's allowed pairs, x 2.5 for the backward's five matmuls) and the
call's dK/dV tasks and their steps (``task_steps``), so that runs over several document lengths (stage
``probe-bwd-doclens``) fit a kernel time per task and per step:

    python -m benchmarks.bwd_kernels --fit RUN.csv [RUN2.csv ...]
"""
import argparse
import functools

from ring_core.protocol import control
from ring_core import plans


def launch_records(seqs=(16384,), heads: int = 32, tag: str = "", doc_lens=None) -> list:
    """The compile-log records of the fused launches ``main`` makes at world size 1 on an H200 (tools/gpu_variants.py:
    the cache filled ahead): each forward, each backward (the Gluon kernel both ways, the tl split); then the
    probe's. With ``doc_lens`` (``--doc-lens``'s list): the causal forward and ``deterministic=False`` backward,
    with segment ids where an entry is not "none"."""
    from benchmarks import gluon_bwd
    from ring_core import validate

    lay = control.HeapLayout.for_workspace(8 << 30)
    recs = []
    if doc_lens:
        for S in seqs:
            for seg in sorted({lens != "none" for lens in doc_lens}):
                shape = (1, S, heads, 128)
                spec = validate.check_attention_args(shape, shape, shape, "bfloat16", "bfloat16", "bfloat16",
                                                     is_causal=True, scale=None, layout="contiguous",
                                                     backend="fused", backends=("fused",),
                                                     segment_ids_shape=(1, S) if seg else None,
                                                     segment_ids_dtype="int32" if seg else None)
                recs += [p.compile_record(tag=tag) for p in (
                    plans.plan(spec, 1, lay, capability=(9, 0)),
                    plans.plan_bwd(spec, 1, lay, capability=(9, 0), deterministic=False))]
        return recs
    for S in seqs:
        for causal in (False, True):
            spec = validate.check_attention_args((1, S, heads, 128), (1, S, heads, 128), (1, S, heads, 128),
                                                 "bfloat16", "bfloat16", "bfloat16", is_causal=causal, scale=None,
                                                 layout="contiguous", backend="fused", backends=("fused",))
            ps = [plans.plan(spec, 1, lay, capability=(9, 0))] + [
                plans.plan_bwd(spec, 1, lay, capability=(9, 0), deterministic=d, gluon_det=g)
                for d, g in ((False, True), (True, True), (True, False))]
            recs += [p.compile_record(tag=tag) for p in ps]
    return recs + [dict(r, tag=tag) for r in gluon_bwd.launch_records(seqs)]


def _split(fn):
    """``fn`` run with RING_ATTENTION_GLUON_DETERMINISTIC=0 (read at each plan): a deterministic backward it launches
    is the tl split."""
    def run():
        with control.environ(**{plans.GLUON_DET_ENV: "0"}):
            return fn()
    return run


def plot(csv_path: str, png: str) -> None:
    """Bar chart of a run's backward kernels: the fused kernel's own milliseconds per run and shape (the probe's:
    its kernel plus torch's small ones), from ``main``'s CSV."""
    import csv

    from benchmarks.plot import grouped_bars

    per = {}
    with open(csv_path) as f:
        for r in csv.DictReader(f):
            per.setdefault(r["run"], {})[f"S={int(r['S']) // 1024}k {'causal' if r['causal'] == '1' else 'full'}"] = (
                float(r["kernels_ms"]))
    grouped_bars(per, png, ylabel="backward, GPU kernels' ms per call", figsize=(8, 4),
                 title="Backward kernels at world size 1, one H200 (bf16, H=32, D=128)")


def fit(csv_paths: list, heads: int = 32, sms: int = 132) -> tuple:
    """The fused backward kernel's time per dK/dV task and SM against its steps per task, over ``--doc-lens`` rows
    (a row without the tasks and steps columns gets them from its doc_lens: ``task_steps``), with the least-squares
    line through them: (us per task, us per step), printed with each row. Rows of one run share the same tasks (one
    per K/V block and head), so what the line's intercept holds is what a task pays however few steps it has."""
    import csv

    import numpy as np

    from benchmarks import harness

    xs, ys = [], []
    for path in csv_paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                if not r["kernel"].startswith("ring_attn_bwd_gluon") or "doc_lens=" not in r["run"]:
                    continue
                S, lens = int(r["S"]), r["run"].split("doc_lens=")[1]
                tasks, steps = r.get("tasks"), r.get("steps")
                if not tasks:
                    case = _case(S, heads, lens)
                    ids = None if lens == "none" else np.asarray(harness.segment_ids(case, 1))[0]
                    tasks, steps = heads * (S // 128), heads * task_steps(ids, S)
                tasks, steps = int(tasks), int(steps)
                xs.append(steps / tasks)
                ys.append(float(r["kernel_ms"]) * 1000 * sms / tasks)
                print(f"{path}: doc_lens {lens}: {xs[-1]:.1f} steps a task, {ys[-1]:.1f} us a task and SM")
    slope, intercept = np.polyfit(xs, ys, 1)
    print(f"fit over {len(xs)} rows: {intercept:.1f} us a task + {slope:.2f} us a step")
    return intercept, slope


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="16384")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--doc-lens", default=None, help="comma list of none | N-N | LO-HI: the masked rows")
    ap.add_argument("--plot", nargs=2, metavar=("CSV", "PNG"), help="only plot a run's CSV (no GPU)")
    ap.add_argument("--fit", nargs="+", metavar="CSV", help="only fit a --doc-lens run's CSVs (no GPU): ``fit``")
    ap.add_argument("--sms", type=int, default=132, help="--fit: the GPU's SMs (H200: 132)")
    a = ap.parse_args()
    if a.plot:
        plot(*a.plot)
        return 0
    if a.fit:
        fit(a.fit, a.heads, a.sms)
        return 0

    import torch

    import torch_bridge
    from benchmarks import gluon_bwd, harness

    torch_bridge.initialize()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    if a.doc_lens:
        for S in (int(s) for s in a.seq.split(",")):
            rows += _masked_rows(S, a.heads, a.doc_lens.split(","), a.iters)
        if a.csv:
            harness.write_rows(a.csv, rows)
        return 0
    for S in (int(s) for s in a.seq.split(",")):
        for causal in (False, True):
            g = torch.Generator(device=dev).manual_seed(S)
            q, k, v, do = (torch.randn(1, S, a.heads, 128, device=dev, dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            flops = 2.5 * 4 * a.heads * S * S * 128 * (0.5 if causal else 1.0)
            runs = []
            for det, split in ((False, False), (True, False), (True, True)):
                ts = [x.detach().requires_grad_() for x in (q, k, v)]
                out = torch_bridge.ring_attention(*ts, is_causal=causal, backend="fused", deterministic=det)
                fn = functools.partial(torch.autograd.grad, out, ts, do, retain_graph=True)
                runs.append((f"fused deterministic={det}" + (" split" if split else ""), _split(fn) if split else fn))
            o, lse = gluon_bwd._forward(q, k, v, causal)
            runs.append((f"probe {gluon_bwd.CONFIG}", lambda o=o, lse=lse: gluon_bwd.backward(q, k, v, o, lse, do,
                                                                                            causal)))
            for name, fn in runs:
                rows += _profiled(fn, a.iters, flops, dict(S=S, causal=int(causal), run=name))
    if a.csv:
        harness.write_rows(a.csv, rows)
    return 0


def _profiled(fn, iters: int, flops: float, key: dict) -> list:
    """``fn`` (a backward) timed back to back, then profiled: a row per CUDA kernel it launches, with its own ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import harness

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ms = harness.cuda_stream_ms(torch, fn, iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            kernels[e.key] = (e.count, getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))
    total = sum(t for _, t in kernels.values()) / iters / 1000
    rows = []
    for kname, (count, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        row = dict(key, ms_stream=round(ms, 3), tflops_stream=round(flops / ms / 1e9, 1),
                   kernels_ms=round(total, 3), kernel=kname[:60], calls_per_iter=count / iters,
                   kernel_ms=round(t / iters / 1000, 3))
        print(row, flush=True)
        rows.append(row)
    return rows


def _masked_rows(S: int, heads: int, doc_lens: list, iters: int) -> list:
    """The causal ``deterministic=False`` backward (the Gluon kernel at head_dim 128), dense and with each
    ``--doc-lens`` entry's segment ids; FLOPs count the mask's allowed pairs (``harness.pairs_per_gpu``)."""
    import numpy as np
    import torch

    import torch_bridge
    from benchmarks import harness

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(S)
    q, k, v, do = (torch.randn(1, S, heads, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    rows = []
    for lens in doc_lens:
        seg, ids, case = None, None, _case(S, heads, lens)
        if lens != "none":
            ids = np.asarray(harness.segment_ids(case, 1))
            seg = torch.as_tensor(ids, device=dev, dtype=torch.int32)
        flops = 2.5 * 4 * heads * 128 * (harness.pairs_per_gpu(case, 1) if seg is not None else S * (S + 1) / 2)
        ts = [x.detach().requires_grad_() for x in (q, k, v)]
        out = torch_bridge.ring_attention(*ts, is_causal=True, backend="fused", layout="contiguous",
                                          segment_ids=seg, deterministic=False)
        fn = functools.partial(torch.autograd.grad, out, ts, do, retain_graph=True)
        key = dict(S=S, causal=1, run=f"deterministic=False doc_lens={lens}", tasks=heads * (S // 128),
                   steps=heads * task_steps(None if ids is None else ids[0], S))
        rows += _profiled(fn, iters, flops, key)
    return rows


def _case(S: int, heads: int, lens: str):
    """The benchmark case of a ``--doc-lens`` entry: causal bf16 D128, dense ("none") or packed documents of
    "LO-HI" tokens (``harness.packed_documents``)."""
    from benchmarks import harness

    kw = {} if lens == "none" else dict(mask="packed", doc_lens=tuple(int(t) for t in lens.split("-")))
    return harness.Case(batch=1, heads=heads, kv_heads=heads, head_dim=128, seq_local=S, causal=True,
                        dtype="bfloat16", **kw)


def task_steps(ids, S: int, kv_rows: int = 128, q_rows: int = 64, chunk_rows: int = 128) -> int:
    """The steps (query blocks of ``q_rows``) of a head's dK/dV tasks in the Gluon backward at world size 1, causal,
    summed over its K/V blocks of ``kv_rows``: the query blocks from the block's diagonal on (positions), narrowed
    with segment ids ``ids`` (numpy [S], None: none) to those whose chunk's id range meets the K/V block's
    (``protocol.bwd_task_steps`` with the ranges ``protocol.publish_id_ranges`` writes; no padding here). With the
    kernel times of several document lengths it separates what a task costs from what a step costs."""
    import numpy as np

    n_q = S // q_rows
    total = 0
    if ids is not None:
        lo = ids.reshape(-1, chunk_rows).min(axis=1)
        hi = ids.reshape(-1, chunk_rows).max(axis=1)
    for n in range(S // kv_rows):
        first = n * kv_rows // q_rows  # the first query block holding a query at or after the block's first key
        blocks = np.arange(first, n_q)
        if ids is not None:
            k_lo, k_hi = ids[n * kv_rows:(n + 1) * kv_rows].min(), ids[n * kv_rows:(n + 1) * kv_rows].max()
            c = blocks * q_rows // chunk_rows
            met = (lo[c] <= k_hi) & (hi[c] >= k_lo)
            blocks = blocks[met]
            blocks = np.arange(blocks.min(), blocks.max() + 1) if blocks.size else blocks  # a run (met_blocks)
        total += int(blocks.size)
    return total


if __name__ == "__main__":
    raise SystemExit(main())
