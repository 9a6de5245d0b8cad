"""Ring-attention benchmark: the fused kernel against its peers, in one run. The command line.

One process per GPU, started by the launcher; the world size is the job's (torch.distributed):

    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention --csv benchmarks/results/x.csv
    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.attention --world1 2 --csv benchmarks/results/x.csv
    python -m benchmarks.plot benchmarks/results/x.csv --out benchmarks/results/x.png --table

(``python benchmarks/attention.py`` works too, with the repository root on PYTHONPATH.) ``python -m
benchmarks.attention --self-check`` runs the harness's own checks on a CPU (benchmarks/self_check.py). The second
command runs, on one GPU, the *global* problem of every 2-GPU case (seq_local x 2), so that the scaling
efficiency of the fused kernel can be computed; it appends rows to the same CSV. ``--cpu-smoke`` runs
the whole path on CPU (gloo, XLA CPU) at tiny sizes, both passes unless ``--pass`` says otherwise;
methods that need a GPU then write their reason.

``--mask`` adds masked cases: ``packed`` (documents packed back to back, segment ids; lengths drawn
from ``--doc-lens``) and ``window`` (a sliding window, ``--window LEFT,RIGHT``), beside ``none``; only the methods
that take masks run them (the fused kernel, the reference rings), their TFLOP/s count only the pairs the mask
allows, and ratio columns compare them with the unmasked rate of the same run (``vs_dense``) and with the time
of a world-1 run of the same per-rank work (``ms_vs_world1``; the harness's docstring defines them). The masked
benchmarks, each a minute or two on 1-2 H200 (docs/performance.md has their figures):

    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention --mask none,packed --causal yes \
        --seq 16k --pass fwd --methods torch_fused --csv packed.csv           # then --pass fwd+bwd; then W=1
    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention --mask window --window 4095,0 \
        --causal yes --layout contiguous --seq 16k --pass fwd,fwd+bwd --methods torch_fused --csv window.csv

``--pass`` picks what one timed call does: ``fwd`` (default), the forward alone; ``fwd+bwd``, one training
step of attention (the forward, then the gradients of q, k and v for a random dout); ``--pass fwd,fwd+bwd``
runs both, one after the other per case.

This module parses the arguments, makes the cases (the product of the axes) and runs them, case by case.
``benchmarks.harness`` is the machinery: cases and FLOPs, the job's set-up, timing, the check, the CSV and
its columns, the ratios (its docstring defines the passes, the timing and the columns);
``benchmarks.peers`` implements every method (its docstring defines each).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

from benchmarks.harness import MASKS, METHODS, PASSES, SHARED_NOTE, TIMINGS, Case, CsvLog, run_case, setup, versions
from benchmarks.peers import BUILDERS

# The default methods with one GPU process (as in --world1 runs): the fused kernel and the single-GPU limits.
WORLD1_METHODS = ("torch_fused", "jax_fused", "torch_cudnn_1gpu", "jax_cudnn_1gpu")
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16"}
TARGET_DEFAULTS = dict(seq="4096,8192,16384,32768", heads=32, kv_heads="32", head_dim="128", dtype="bfloat16",
                       batch=1, iters=10, warmup=2, input_sets=3, ref_max_seq=8192, passes="fwd",
                       doc_lens="512-8192", window="4095,0")
SMOKE_DEFAULTS = dict(seq="64,96", heads=4, kv_heads="4,2", head_dim="32", dtype="bfloat16",
                      batch=1, iters=3, warmup=1, input_sets=2, ref_max_seq=1 << 30, passes="fwd,fwd+bwd",
                      doc_lens="8-40", window="23,0")


# -------------------------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list:
    out = []
    for tok in str(text).split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        mult = 1
        if tok.endswith("k"):
            tok, mult = tok[:-1], 1024
        try:
            val = int(tok) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer list: {text!r} (e.g. 4096,8192 or 4k,8k)") from None
        if val < 1:
            raise argparse.ArgumentTypeError(f"values must be positive, got {val} in {text!r}")
        out.append(val)
    if not out:
        raise argparse.ArgumentTypeError(f"empty list: {text!r}")
    return out


def _dtype_list(text: str) -> list:
    out = []
    for tok in str(text).split(","):
        tok = tok.strip().lower()
        if tok not in DTYPE_ALIASES:
            raise argparse.ArgumentTypeError(f"dtype must be bf16/bfloat16 or fp16/float16 (cuDNN attention), got {tok!r}")
        out.append(DTYPE_ALIASES[tok])
    return out


def _choices(text: str, flag: str, choices, joiner: str) -> list:
    """A comma list of ``choices`` (each once, in order)."""
    out = []
    for tok in str(text).split(","):
        tok = tok.strip().lower()
        if tok not in choices:
            raise argparse.ArgumentTypeError(f"{flag} takes {joiner.join(choices)} (comma list), got {tok!r}")
        if tok not in out:
            out.append(tok)
    return out


def _pass_list(text: str) -> list:
    return _choices(text, "--pass", PASSES, " and/or ")


def _mask_list(text: str) -> list:
    return _choices(text, "--mask", MASKS, ", ")


def _window(text: str) -> tuple:
    from ring_core.validate import check_window

    try:
        left, right = (int(t) for t in str(text).split(","))
        return check_window((left, right))
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (flash-attn's window_size, -1 unbounded, "
                                         f"e.g. 4095,0: a causal window of 4096 tokens), got {text!r}") from None


def _doc_lens(text: str) -> tuple:
    try:
        lo, hi = (int(t) for t in str(text).split("-"))
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--doc-lens takes LO-HI, 1 <= LO <= HI (e.g. 512-8192), got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    d = TARGET_DEFAULTS
    ap = argparse.ArgumentParser(
        prog="python -m jax_ring.launch --nproc-per-node N -m benchmarks.attention",
        description="Time the fused ring attention against its peers; one process per GPU.",
        epilog="Axes given as comma lists run as a product. Defaults: the target set (32 heads, head_dim 128, "
               "bf16, seq_local 4k-32k, causal and not).")
    ap.add_argument("--framework", default="both", choices=("jax", "torch", "both"),
                    help="which frontends' methods to run (default both)")
    ap.add_argument("--methods", default="all",
                    help=f"comma list from {','.join(METHODS)} (default: all; with one GPU process: "
                         f"{','.join(WORLD1_METHODS)})")
    ap.add_argument("--seq", default=None, help=f"seq_local values, e.g. 4k,8k (default {d['seq']})")
    ap.add_argument("--batch", type=int, default=None, help=f"batch (default {d['batch']})")
    ap.add_argument("--heads", type=int, default=None, help=f"query heads (default {d['heads']})")
    ap.add_argument("--kv-heads", default=None, help=f"kv heads, comma list, e.g. 32,8 for GQA (default {d['kv_heads']})")
    ap.add_argument("--head-dim", default=None, help=f"head dims, comma list (default {d['head_dim']})")
    ap.add_argument("--dtype", default=None, help=f"bf16 and/or fp16, comma list (default {d['dtype']})")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"),
                    help="causal (zigzag layout), non-causal (contiguous) or both (default)")
    ap.add_argument("--mask", dest="masks", default="none", metavar="MASK[,MASK]",
                    help="none, packed (documents packed back to back: segment ids) and/or window (a sliding window), "
                         "comma list (default none); only methods that take masks run the masked cases")
    ap.add_argument("--window", default=None, metavar="LEFT,RIGHT",
                    help=f"the window of --mask window: flash-attn's window_size, -1 unbounded (default "
                         f"{TARGET_DEFAULTS['window']}: a causal window of 4096 tokens)")
    ap.add_argument("--doc-lens", default=None, metavar="LO-HI",
                    help=f"--mask packed: document lengths, drawn uniformly from LO..HI with a fixed seed (default "
                         f"{TARGET_DEFAULTS['doc_lens']}; with --cpu-smoke {SMOKE_DEFAULTS['doc_lens']})")
    ap.add_argument("--layout", default="auto", choices=("auto", "contiguous", "zigzag"),
                    help="the sequence layout (default auto: zigzag when causal, else contiguous)")
    ap.add_argument("--pass", dest="passes", default=None, metavar="PASS[,PASS]",
                    help="what one timed call does: fwd, fwd+bwd (forward, then the gradients of q, k and v for a "
                         f"random dout), or both as a comma list fwd,fwd+bwd (default {d['passes']}; with "
                         f"--cpu-smoke {SMOKE_DEFAULTS['passes']})")
    ap.add_argument("--ref-max-seq", type=int, default=None,
                    help=f"run the reference rings only up to this seq_local (default {d['ref_max_seq']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"untimed calls first (default {d['warmup']})")
    ap.add_argument("--timing", default="call", choices=TIMINGS,
                    help="call: each call between its own CUDA events, the ranks meeting before it (default); "
                         "stream: the ranks meet once, then the calls run back to back and the mean counts "
                         "(the host's work overlaps the GPU's, as in do_bench or a training step); ready: as call, "
                         "each call until its results are ready on the host, torch's as JAX's always are")
    ap.add_argument("--iters", type=int, default=None, help=f"timed calls (default {d['iters']})")
    ap.add_argument("--input-sets", type=int, default=None,
                    help=f"random input sets rotated over the calls (default {d['input_sets']})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cp-rotate", default="allgather", choices=("allgather", "alltoall"),
                    help="torch context_parallel K/V rotation (torch's default: allgather)")
    ap.add_argument("--world1", type=int, default=None, metavar="W",
                    help="run with ONE process the global problems of the W-GPU cases (seq_local x W), for the "
                         "scaling efficiency; append to the W-GPU run's CSV")
    ap.add_argument("--heap-gib", type=float, default=None,
                    help="symmetric heap per GPU (default: 4 GiB, or what the largest case needs)")
    ap.add_argument("--csv", default=None,
                    help="CSV to write (rows already there are kept; default benchmarks/results/attention_<date>.csv, "
                         "none with --cpu-smoke)")
    ap.add_argument("--overwrite", action="store_true", help="replace the CSV instead of appending to it")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU only (gloo, XLA CPU), tiny default sizes; GPU-only methods write why they cannot run")
    ap.add_argument("--self-check", nargs="?", const="", default=None, metavar="NAME",
                    help="run the harness's own checks on this CPU (benchmarks/self_check.py; NAME: only the checks "
                         "whose names contain it) and exit; no launcher, no GPU")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and resolve defaults (the target set, or tiny sizes with --cpu-smoke)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    defaults = SMOKE_DEFAULTS if a.cpu_smoke else TARGET_DEFAULTS
    for key, val in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, val)
    try:
        a.seq = _int_list(a.seq)
        a.kv_heads = _int_list(a.kv_heads)
        a.head_dim = _int_list(a.head_dim)
        a.dtype = _dtype_list(a.dtype)
        a.passes = _pass_list(a.passes)
        a.masks = _mask_list(a.masks)
        a.window = _window(a.window)
        a.doc_lens = _doc_lens(a.doc_lens)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    for name in ("batch", "heads", "iters", "input_sets", "ref_max_seq"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 1:
        ap.error("--warmup must be >= 1 (the first call compiles and is checked)")
    if a.world1 is not None and a.world1 < 2:
        ap.error("--world1 W: W is the world size whose global problems to run (>= 2)")
    for hkv in a.kv_heads:
        if a.heads % hkv:
            ap.error(f"--heads {a.heads} is not a multiple of --kv-heads {hkv}")
    if a.methods.strip().lower() == "all":
        a.methods = None
    else:
        names = [m.strip() for m in a.methods.split(",") if m.strip()]
        bad = [m for m in names if m not in METHODS]
        if bad or not names:
            ap.error(f"unknown method(s) {bad or names}; choose from {', '.join(METHODS)}")
        a.methods = names
    if a.csv is None and not a.cpu_smoke:
        a.csv = os.path.join("benchmarks", "results", f"attention_{datetime.date.today().isoformat()}.csv")
    a.heap_bytes = None if a.heap_gib is None else int(a.heap_gib * (1 << 30))
    return a


def select_methods(args, world: int) -> list:
    """The methods to run, in METHODS order: --methods (or the default set) filtered by --framework."""
    if args.methods is not None:
        chosen = set(args.methods)
    elif world == 1 and not args.cpu_smoke:
        chosen = set(WORLD1_METHODS)
    else:
        chosen = set(METHODS)
    return [m for m in METHODS if m in chosen and args.framework in ("both", METHODS[m].framework)]


def enumerate_cases(args, world: int) -> list:
    """Every case of the product of the axes (the masks of one shape, and the passes of each, run one after the
    other); with --world1 W, seq_local is multiplied by W."""
    if args.world1 is not None and world != 1:
        raise SystemExit(f"--world1 needs one process (launch with --nproc-per-node 1); this job has {world}")
    mult = args.world1 or 1
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    cases = []
    for dtype in args.dtype:
        for d in args.head_dim:
            for hkv in args.kv_heads:
                for s in args.seq:
                    for c in causal:
                        layout = {"auto": "zigzag" if c else "contiguous"}.get(args.layout, args.layout)
                        if layout == "zigzag" and s * mult % 2:
                            raise SystemExit(f"the zigzag layout (causal cases' default) needs an even seq_local; "
                                             f"got {s * mult}")
                        for mask in args.masks:
                            extra = dict(window=args.window) if mask == "window" else \
                                dict(doc_lens=args.doc_lens) if mask == "packed" else {}
                            cases.extend(Case(args.batch, args.heads, hkv, d, s * mult, c, dtype, mode, mask=mask,
                                              layout=layout, **extra) for mode in args.passes)
    return cases


# ---------------------------------------------------------------------------------------------- the run


def command_line(argv, world: int) -> str:
    return shlex.join(["python", "-m", "jax_ring.launch", "--nproc-per-node", str(world), "-m", "benchmarks.attention",
                       *argv])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.self_check is not None:
        from benchmarks import self_check

        return self_check.main(args.self_check)
    world_env = int(os.environ.get("WORLD_SIZE", 1))
    methods = {m: BUILDERS[m] for m in select_methods(args, world_env)}  # name: its builder
    cases = enumerate_cases(args, world_env)
    env = setup(args, methods, cases, world_env)
    if env.world != world_env:
        raise SystemExit(f"WORLD_SIZE={world_env} but torch.distributed has {env.world} ranks")
    meta = dict(date=datetime.date.today().isoformat(), command=command_line(argv, env.world), **versions(env))
    run_id = [datetime.datetime.now().strftime("%Y%m%dT%H%M%S")]
    env.dist.broadcast_object_list(run_id, src=0)  # rank 0's clock names the run on every rank
    meta["run_id"] = run_id[0]
    log = CsvLog(args.csv, args.overwrite) if env.rank == 0 and args.csv else None
    if env.ranks_per_gpu > 1:
        env.print(f"{env.world} ranks, {env.ranks_per_gpu} per GPU: {SHARED_NOTE}")
    env.print(f"world {env.world} x {meta['gpu']}; torch {meta['torch']}, jax {meta['jax'] or '-'}, "
              f"triton {meta['triton'] or '-'}; {len(cases)} case(s); methods: {', '.join(methods)}")
    env.print(f"warm-up {args.warmup}, {args.iters} timed calls over {args.input_sets} input sets"
              f"{' back to back (--timing stream)' if args.timing == 'stream' else ''}; CSV: "
              f"{args.csv or '(none)'}{f' ({len(log.rows)} rows kept)' if log and log.rows else ''}")
    t0 = time.perf_counter()
    for case in cases:
        run_case(env, args, case, methods, log, meta)
    env.print(f"\ndone in {time.perf_counter() - t0:.0f} s" + (f"; {len(log.rows)} rows in {args.csv}" if log else ""))
    env.dist.barrier()
    if args.cpu_smoke:
        env.dist.destroy_process_group()
    else:
        import torch_bridge

        torch_bridge.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

