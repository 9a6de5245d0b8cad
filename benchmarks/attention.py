"""Ring-attention benchmark harness (issue 4): the fused kernel against its peers, in one run.

One process per GPU, started by the launcher; the world size is the job's (torch.distributed):

    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention --csv benchmarks/results/x.csv
    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.attention --world1 2 --csv benchmarks/results/x.csv
    python -m benchmarks.plot benchmarks/results/x.csv --out benchmarks/results/x.png --table

(``python benchmarks/attention.py`` works too, with the repository root on PYTHONPATH.) The second
command runs, on one GPU, the *global* problem of every 2-GPU case (seq_local x 2), so that the scaling
efficiency of the fused kernel can be computed; it appends rows to the same CSV. ``--cpu-smoke`` runs
the whole path on CPU (gloo, XLA CPU) at tiny sizes, both passes unless ``--pass`` says otherwise;
methods that need a GPU then write their reason.

Passes (``--pass``, the CSV's ``pass`` column): ``fwd`` (default) times the forward alone, under no_grad;
``fwd+bwd`` times one training step of attention per call: the forward, then the gradients of q, k and v
for that input set's ``dout`` (random normal, one per input set, drawn after q, k, v, so these are the fwd
pass's inputs). torch methods take them with ``torch.autograd.grad(out, (q, k, v), dout)`` (no ``.grad``
accumulation); JAX methods jit ``jax.vjp`` with dout as the cotangent, returning (out, dq, dk, dv), inside
the same ``shard_map`` as their forward. ``--pass fwd,fwd+bwd`` runs both, one after the other per case.

Methods, each timed in the same process group on the same inputs:

* ``torch_fused`` / ``jax_fused``: ``torch_bridge`` / ``jax_ring`` ``backend="fused"`` (this project);
* ``jax_fused_deferred``: ``jax_fused`` traced with ``RING_ATTENTION_ERRORS=deferred``: no host callback
  after each call; ``jax_ring.check_errors()`` after the timed calls raises a kept failure (the cost of
  the per-call check is the difference to ``jax_fused``);
* ``torch_ref`` / ``jax_xla``: the reference rings (``backend="torch"``, ``backend="xla"``; float32
  maths); skipped above ``--ref-max-seq`` (slow, and they run out of memory at long sequences);
* ``jax_cudnn_ring``: what a JAX user would write by hand: K/V around the mesh axis with
  ``lax.ppermute``, each block through cuDNN flash attention *with its softmax LSE*
  (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(return_residual=True)``, float32
  LSE; if that private entry point is missing, ``jax.nn.dot_product_attention(return_residual=True)``,
  whose LSE is rounded to the input dtype, which the ``note`` column then says), blocks merged by LSE.
  Causal uses the zigzag layout and computes only the unmasked halves (as ring-flash-attn does).
  fwd+bwd is jax autodiff of that ring, which is right only if the block's LSE output carries its
  cotangent back; a probe (``check_lse_differentiates``) checks that first, and where it does not (jax's
  cuDNN attention drops the LSE's cotangent) the row's error says so instead of timing wrong gradients;
* ``torch_cp``: ``torch.distributed.tensor.experimental.context_parallel`` over
  ``F.scaled_dot_product_attention`` restricted to the cuDNN backend; causal with its head-tail load
  balancer (the zigzag layout), non-causal with it off; K/V rotation ``--cp-rotate`` (torch's default
  is ``allgather``). In fwd+bwd, dout is one of its sharded buffers, and its local q, k, v shards are the
  leaves (torch's ring backward for cuDNN SDPA);
* ``torch_cudnn_1gpu`` / ``jax_cudnn_1gpu``: the limit: single-GPU cuDNN attention (torch SDPA cuDNN
  backend; ``jax.nn.dot_product_attention(implementation="cudnn")``) on **one GPU's share** of the ring
  case, i.e. exactly the per-GPU FLOPs of the ring:

    - non-causal: all H heads, the rank's S_local queries against all S_global keys (what a rank of
      the ring computes, without the communication);
    - causal: H/W query heads (and H_kv/W kv heads) of causal attention over all S_global tokens
      (what each GPU of an ideal head-parallel split computes: the same FLOPs, 2*B*H*S_local*S_global*D,
      and the same sequence length; a single cuDNN call cannot express the zigzag rank's mask).

  The ``shape`` column gives the exact shapes of every method's call.

Where torch's cuDNN SDPA refuses ``enable_gqa`` for a GQA case, ``torch_cp`` and ``torch_cudnn_1gpu``
retry once with K/V heads repeated and say so in ``note``.

Timing: ``--warmup`` calls (the first one on input set 0 is also timed alone: ``first_call_s``; JAX
programs are compiled ahead of it: ``compile_s``), then ``--iters`` calls rotating over
``--input-sets`` random-normal input sets. Before every call the ranks meet (an all-reduce that also
carries errors); each call is timed with CUDA events on the torch stream (JAX calls end with
``block_until_ready``, so their events span the call's dispatch and execution); the per-call times are
all-reduced with MAX (the slowest rank counts, call by call); the row reports the median and the 20/80 %
quantiles. TFLOP/s per GPU = ``4*B*H*S_local*S_global*D`` per rank (half when causal) / median time;
in fwd+bwd the FLOPs are 3.5 times that (the flash-attention convention: backward = 2.5 forwards).

Checks: each method's output on input set 0 is compared with the first of torch_fused, jax_fused,
torch_ref, jax_xla that ran (``max_abs_diff``, ``diff_vs``; max over ranks). Methods whose output is
not this rank's shard (the causal limit) leave it empty. In fwd+bwd the gradients are compared instead:
``max_abs_diff`` is the largest of max|dq - dq_anchor|, max|dk - ...| and max|dv - ...|, over the
gradients both have, and ``diff_vs`` names them after the anchor, e.g. ``torch_ref (dq,dk,dv)``. The
non-causal single-GPU share has only dq in common with the ring (its dK/dV are one rank's queries' part
of the global gradient): ``(dq)``. A diff above ``DIFF_WARN`` (the output), or above ``GRAD_WARN`` times
the largest |anchor gradient| (a gradient: they shrink as the sequence grows), is flagged in ``note``.

Every method runs in its own try/except: a failure writes its ``error`` and the run goes on (errors are
agreed between ranks, so that no rank waits for a collective the others skipped). Memory is released
between methods. The CSV is rewritten after every method (a killed run keeps its finished rows); rows
already in the file are kept (``--overwrite`` starts afresh). Ratio columns (``vs_*``, ``scaling_eff``)
are speed ratios of the fused rows, fused TFLOP/s over the other method's, same run, case and pass
(``vs_cudnn_1gpu`` against the faster of the two single-GPU limits); ``scaling_eff`` divides by the
world-1 row of the same method, global problem and pass found anywhere in the file. A CSV written before
the ``pass`` column existed is read as fwd rows (and rewritten with the column).

Several ranks may share one GPU (``python -m jax_ring.launch --nproc-per-node 4 ...`` on one GPU, see
``ring_core.gpus``): the real protocol then runs, but each rank has only its share of the SMs. Such rows
say so in ``ranks_per_gpu`` and in ``note`` (they measure the protocol's overhead, not multi-GPU speed),
and their ``scaling_eff`` compares the GPU's whole rate (ranks_per_gpu x the per-rank rate) with one
rank's rate on the global problem: 1.0 means the ring costs nothing on one GPU.

The fused kernel's spin-wait bound is lowered to 60 s here (``RING_ATTENTION_TIMEOUT_S``, unless set),
so that a rank left waiting by a peer's failure gets out quickly.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import functools
import gc
import math
import os
import platform
import shlex
import sys
import time
import traceback

import numpy as np

from ring_core import gpus

AXIS = "sp"
DIFF_WARN = 0.05  # |out - anchor| above this is flagged (bf16/fp16 outputs of random-normal inputs are O(0.1))
GRAD_WARN = 0.05  # |grad - anchor| above this times max|anchor grad| is flagged (about 13 bf16 ulps of the largest)
TIMEOUT_S = "60"


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    framework: str  # "torch" or "jax"
    kind: str  # "fused", "reference", "peer" or "limit"
    summary: str


METHODS = {  # also the order in which a case runs them (the first ring methods serve as the check's anchor)
    "torch_fused": MethodInfo("torch", "fused", "torch_bridge.ring_attention(backend='fused')"),
    "jax_fused": MethodInfo("jax", "fused", "jax_ring.ring_attention(backend='fused') in shard_map"),
    "jax_fused_deferred": MethodInfo("jax", "fused", "jax_fused without the per-call host callback "
                                                     "(RING_ATTENTION_ERRORS=deferred)"),
    "torch_ref": MethodInfo("torch", "reference", "torch_bridge backend='torch' (p2p ring, float32 maths)"),
    "jax_xla": MethodInfo("jax", "reference", "jax_ring backend='xla' (ppermute ring, float32 maths)"),
    "jax_cudnn_ring": MethodInfo("jax", "peer", "pure-JAX ppermute ring, cuDNN per block, LSE merge"),
    "torch_cp": MethodInfo("torch", "peer", "torch context_parallel over cuDNN SDPA"),
    "torch_cudnn_1gpu": MethodInfo("torch", "limit", "torch SDPA (cuDNN) on one GPU's share"),
    "jax_cudnn_1gpu": MethodInfo("jax", "limit", "jax.nn.dot_product_attention(cudnn) on one GPU's share"),
}
ANCHORS = ("torch_fused", "jax_fused", "torch_ref", "jax_xla")
WORLD1_METHODS = ("torch_fused", "jax_fused", "torch_cudnn_1gpu", "jax_cudnn_1gpu")
GQA_RETRY = ("torch_cp", "torch_cudnn_1gpu")

# Ratio columns of the fused rows: fused TFLOP/s over the best of these methods' (same run, same case).
RATIOS = {
    "vs_cudnn_1gpu": ("torch_cudnn_1gpu", "jax_cudnn_1gpu"),
    "vs_context_parallel": ("torch_cp",),
    "vs_cudnn_ring": ("jax_cudnn_ring",),
    "vs_xla_ref": ("jax_xla",),
    "vs_torch_ref": ("torch_ref",),
}
CASE_KEY = ("run_id", "world", "batch", "heads", "kv_heads", "head_dim", "seq_local", "causal", "dtype", "pass")
SCALING_KEY = ("method", "batch", "heads", "kv_heads", "head_dim", "seq_global", "causal", "dtype", "pass")

# What one timed call does, and its FLOPs as a multiple of the forward's. The flash-attention convention:
# the backward is 2.5 forwards (five matmuls to the forward's two), so forward + backward counts 3.5.
PASSES = {"fwd": 1.0, "fwd+bwd": 3.5}
GRADS = ("dq", "dk", "dv")
# Columns added since the first CSVs, with the value a row written without them means.
LEGACY_DEFAULTS = {"pass": "fwd", "ranks_per_gpu": "1"}
SHARED_NOTE = "RANKS SHARE GPUS: protocol overhead, not multi-GPU speed"

VERSION_COLUMNS = ("gpu", "python", "torch", "torch_cuda", "torch_cudnn", "triton", "jax", "jaxlib",
                   "jax_cuda_plugin", "jax_platform", "jax_cudnn")
CSV_COLUMNS = (
    "run_id", "date", "world", "ranks_per_gpu", "method", "framework", "kind",
    "batch", "heads", "kv_heads", "head_dim", "seq_local", "seq_global", "causal", "layout", "dtype", "pass",
    "flops_per_gpu", "ms_median", "ms_q20", "ms_q80", "tflops_per_gpu",
    "iters", "warmup", "input_sets", "compile_s", "first_call_s", "max_abs_diff", "diff_vs",
    *RATIOS, "scaling_eff",
    "shape", "note", "error",
    *VERSION_COLUMNS, "command",
)

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16"}
TARGET_DEFAULTS = dict(seq="4096,8192,16384,32768", heads=32, kv_heads="32", head_dim="128", dtype="bfloat16",
                       batch=1, iters=10, warmup=2, input_sets=3, ref_max_seq=8192, passes="fwd")
SMOKE_DEFAULTS = dict(seq="64,96", heads=4, kv_heads="4,2", head_dim="32", dtype="bfloat16",
                      batch=1, iters=3, warmup=1, input_sets=2, ref_max_seq=1 << 30, passes="fwd,fwd+bwd")


class Unavailable(RuntimeError):
    """The method cannot run on this stack; the message says why (it goes to the CSV's error column)."""


# ------------------------------------------------------------------------------------------ cases, FLOPs


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_local: int
    causal: bool
    dtype: str
    mode: str = "fwd"  # the pass one call times: a key of PASSES (the CSV's ``pass`` column)

    @property
    def layout(self) -> str:
        return "zigzag" if self.causal else "contiguous"

    def seq_global(self, world: int) -> int:
        return self.seq_local * world

    def label(self) -> str:
        dt = {"bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype)
        return (f"{dt} D{self.head_dim} H{self.heads}/{self.kv_heads} B{self.batch} S_local {self.seq_local} "
                f"{'causal' if self.causal else 'full'} {self.mode}")


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool,
                    mode: str = "fwd") -> float:
    """FLOPs of one attention call: 4*B*H*S_q*S_kv*D for the forward (two matmuls), half when causal,
    times PASSES[mode] (3.5 for forward + backward)."""
    f = 4.0 * batch * heads * q_len * kv_len * head_dim * PASSES[mode]
    return f / 2 if causal else f


def flops_per_gpu(case: Case, world: int) -> float:
    """Attention FLOPs one rank does: 4*B*H*S_local*S_global*D (two matmuls), half of that when causal;
    x 3.5 for forward + backward."""
    return attention_flops(case.batch, case.heads, case.seq_local, case.seq_global(world), case.head_dim,
                           case.causal, case.mode)


@dataclasses.dataclass(frozen=True)
class LimitProblem:
    """One GPU's share of a ring case as a single attention call (see the module docstring)."""

    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    causal: bool
    head_offset: int  # first query head of this rank's share (kv heads start at head_offset // group)

    def flops(self, batch: int, head_dim: int, mode: str = "fwd") -> float:
        return attention_flops(batch, self.q_heads, self.q_len, self.kv_len, head_dim, self.causal, mode)

    def shapes(self, batch: int, head_dim: int) -> str:
        return (f"q[{batch},{self.q_len},{self.q_heads},{head_dim}] kv[{batch},{self.kv_len},{self.kv_heads},"
                f"{head_dim}]{' causal' if self.causal else ''}")


def limit_problem(case: Case, world: int, rank: int = 0) -> LimitProblem:
    s_g = case.seq_global(world)
    if not case.causal:
        return LimitProblem(case.heads, case.kv_heads, case.seq_local, s_g, False, 0)
    if case.heads % world or case.kv_heads % world:
        raise Unavailable(f"the causal single-GPU share takes heads/W of the heads: needs heads ({case.heads}) and "
                          f"kv_heads ({case.kv_heads}) divisible by the world size {world}")
    h = case.heads // world
    return LimitProblem(h, case.kv_heads // world, s_g, s_g, True, rank * h)


def ring_shapes(case: Case) -> str:
    b, s, d = case.batch, case.seq_local, case.head_dim
    return f"q[{b},{s},{case.heads},{d}] kv[{b},{s},{case.kv_heads},{d}] {case.layout}{' causal' if case.causal else ''}"


def summarize_times(ms) -> tuple:
    """(median, 20 % quantile, 80 % quantile) of per-call times (linear interpolation, as numpy)."""
    t = np.asarray(ms, dtype=np.float64)
    if t.size == 0:
        raise ValueError("no times to summarize")
    return float(np.median(t)), float(np.quantile(t, 0.2)), float(np.quantile(t, 0.8))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


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


def _pass_list(text: str) -> list:
    out = []
    for tok in str(text).split(","):
        tok = tok.strip().lower()
        if tok not in PASSES:
            raise argparse.ArgumentTypeError(f"--pass takes {' and/or '.join(PASSES)} (comma list), got {tok!r}")
        if tok not in out:
            out.append(tok)
    return out


def build_parser() -> argparse.ArgumentParser:
    d = TARGET_DEFAULTS
    ap = argparse.ArgumentParser(
        prog="python -m jax_ring.launch --nproc-per-node N -m benchmarks.attention",
        description="Time the fused ring attention against its peers (issue 4); one process per GPU.",
        epilog="Axes given as comma lists run as a product. Defaults are the issue-4 target set.")
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
    ap.add_argument("--pass", dest="passes", default=None, metavar="PASS[,PASS]",
                    help="what one timed call does: fwd, fwd+bwd (forward, then the gradients of q, k and v for a "
                         f"random dout), or both as a comma list fwd,fwd+bwd (default {d['passes']}; with "
                         f"--cpu-smoke {SMOKE_DEFAULTS['passes']})")
    ap.add_argument("--ref-max-seq", type=int, default=None,
                    help=f"run the reference rings only up to this seq_local (default {d['ref_max_seq']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"untimed calls first (default {d['warmup']})")
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
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and resolve defaults (the issue-4 target set, or tiny sizes with --cpu-smoke)."""
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
    """Every case of the product of the axes (the passes of one shape run one after the other); with
    --world1 W, seq_local is multiplied by W."""
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
                        if c and s * mult % 2:
                            raise SystemExit(f"causal cases use the zigzag layout, which needs an even seq_local; "
                                             f"got {s * mult}")
                        cases.extend(Case(args.batch, args.heads, hkv, d, s * mult, c, dtype, mode)
                                     for mode in args.passes)
    return cases


def heap_bytes_needed(cases, world: int) -> int:
    """A heap size that fits the fused kernel's receive slots for every case, the backward's (K/V and the
    float32 partial dK/dV) in fwd+bwd cases (at least the 4 GiB default)."""
    from ring_core import heap, plans
    from ring_core.validate import AttentionSpec

    def need(c):
        spec = AttentionSpec(batch=c.batch, seq_local=c.seq_local, num_heads=c.heads, num_kv_heads=c.kv_heads,
                             head_dim=c.head_dim, dtype=c.dtype, scale=1.0 / math.sqrt(c.head_dim),
                             is_causal=c.causal, layout=c.layout)
        fwd = plans.recv_bytes(spec, world)
        return fwd if c.mode == "fwd" else max(fwd, plans.bwd_recv_bytes(spec, world)[2])

    return max(heap.DEFAULT_HEAP_BYTES, plans.heap_bytes_for(max(need(c) for c in cases)))


# ----------------------------------------------------------------------------------------- ratios, CSV


def _num(x):
    if x is None or x == "":
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def field(row, name) -> str:
    """A CSV field as text; a column that older CSVs lack reads as what those rows meant (LEGACY_DEFAULTS)."""
    val = row.get(name)
    return LEGACY_DEFAULTS.get(name, "") if val is None or val == "" else str(val)


def upgrade_rows(rows) -> list:
    """Rows read from a CSV, with the columns older harness versions did not write filled in (a row without
    ``pass`` timed the forward)."""
    return [dict(r, **{c: field(r, c) for c in LEGACY_DEFAULTS}) for r in rows]


def _key(row, fields) -> tuple:
    return tuple(field(row, f) for f in fields)


def compute_ratios(rows) -> list:
    """Fill the ratio columns of the fused rows (copies of ``rows`` are returned; others get blanks).

    ``vs_*``: fused TFLOP/s over the best TFLOP/s of the named methods in the same run, case and pass.
    ``scaling_eff``: fused TFLOP/s per GPU over the TFLOP/s of the latest world-1 row of the same method,
    global problem (same batch, heads, head_dim, seq_global, causal, dtype) and pass. Rows with an error, or
    without TFLOP/s, are ignored as denominators.
    """
    ok = [r for r in rows if not r.get("error") and _num(r.get("tflops_per_gpu")) is not None]
    by_case = {}
    for r in ok:
        by_case.setdefault(_key(r, CASE_KEY), {}).setdefault(r["method"], []).append(_num(r["tflops_per_gpu"]))
    world1 = {}
    for r in ok:
        if str(r.get("world")) == "1":
            world1[_key(r, SCALING_KEY)] = _num(r["tflops_per_gpu"])  # the latest row wins
    out = []
    for r in rows:
        r = dict(r)
        for col in (*RATIOS, "scaling_eff"):
            r[col] = ""
        mine = _num(r.get("tflops_per_gpu"))
        if METHODS.get(r.get("method"), MethodInfo("", "", "")).kind == "fused" and not r.get("error") and mine:
            peers = by_case.get(_key(r, CASE_KEY), {})
            for col, names in RATIOS.items():
                vals = [v for n in names for v in peers.get(n, []) if v]
                if vals:
                    r[col] = round(mine / max(vals), 3)
            if str(r.get("world")) != "1":
                base = world1.get(_key(r, SCALING_KEY))
                if base:  # ranks sharing a GPU: their GPU's rate (all of them) against one rank's on it
                    r["scaling_eff"] = round(mine * int(r.get("ranks_per_gpu") or 1) / base, 3)
        out.append(r)
    return out


class CsvLog:
    """The CSV on rank 0: rows already in the file are kept; the whole file is rewritten (atomically)
    after every change, so a killed run keeps every finished row. A file written before a column was added
    (LEGACY_DEFAULTS) is read with those columns filled in, and rewritten with them."""

    def __init__(self, path: str, overwrite: bool = False):
        self.path = path
        self.rows = []
        if os.path.exists(path) and not overwrite:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                have = tuple(reader.fieldnames or ())
                if have != tuple(c for c in CSV_COLUMNS if c in have or c not in LEGACY_DEFAULTS):
                    raise SystemExit(f"{path} exists with other columns than this harness writes; pass --overwrite "
                                     "or another --csv")
                self.rows = [{c: r.get(c, "") for c in CSV_COLUMNS} for r in upgrade_rows(reader)]

    def add(self, row: dict):
        self.rows.append({c: row.get(c, "") for c in CSV_COLUMNS})
        self.flush()

    def refresh_ratios(self):
        self.rows = compute_ratios(self.rows)
        self.flush()

    def flush(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            w.writeheader()
            w.writerows(self.rows)
        os.replace(tmp, self.path)


def format_row(row: dict) -> str:
    """One line of the printed table."""
    head = f"  {row['method']:17s}"
    if row.get("error"):
        return f"{head} ERROR {row['error']}"
    ms, q20, q80 = (float(row[k]) for k in ("ms_median", "ms_q20", "ms_q80"))
    diff = row.get("max_abs_diff")
    diff = f"diff {float(diff):.1e}" if diff not in (None, "") else ""
    return (f"{head} {ms:10.3f} ms [{q20:9.3f}, {q80:9.3f}] {float(row['tflops_per_gpu']):7.4g} TFLOP/s/GPU "
            f"{diff:13s} {row.get('note', '')}")


def format_ratios(rows) -> list:
    """Printable ratio lines of the fused rows among ``rows`` (already passed through compute_ratios)."""
    names = {"vs_cudnn_1gpu": "cuDNN 1 GPU", "vs_context_parallel": "context_parallel", "vs_cudnn_ring": "cuDNN ring",
             "vs_xla_ref": "xla ref", "vs_torch_ref": "torch ref", "scaling_eff": "scaling eff"}
    lines = []
    for r in rows:
        parts = [f"{_num(r[c]):.2f}x {n}" if c != "scaling_eff" else f"{n} {_num(r[c]):.2f}"
                 for c, n in names.items() if _num(r.get(c)) is not None]
        if parts:
            lines.append(f"    {r['method']}: " + ", ".join(parts))
    return lines


def command_line(argv, world: int) -> str:
    return shlex.join(["python", "-m", "jax_ring.launch", "--nproc-per-node", str(world), "-m", "benchmarks.attention",
                       *argv])


# ------------------------------------------------------------------------- the pure-JAX cuDNN ring


def _merge(acc, lse, out_b, lse_b):
    """Merge a block's normalised output into the running one by their LSEs ([b, h, s] float32)."""
    import jax.numpy as jnp

    new = jnp.logaddexp(lse, lse_b)
    w_acc = jnp.swapaxes(jnp.exp(lse - new), 1, 2)[..., None]  # [b, s, h, 1]
    w_b = jnp.swapaxes(jnp.exp(lse_b - new), 1, 2)[..., None]
    return acc * w_acc + out_b.astype(jnp.float32) * w_b, new


def cudnn_ring_attention(q, k, v, *, axis_name, world: int, is_causal: bool, block_attention, scale=None):
    """Ring attention written the way a JAX user would with an attention kernel that returns its LSE.

    Call inside ``shard_map``: q [b, s, h, d], k/v [b, s, hkv, d] are this rank's shard (contiguous layout
    when not causal, zigzag when causal). ``block_attention(q, k, v, is_causal, scale)`` returns
    ``(out, lse)`` with lse float32 [b, h, s]. K/V travel with ``lax.ppermute`` (the next block is sent
    before this one is used, so XLA can overlap them); blocks merge by their LSEs in float32.

    Causal (zigzag: rank r holds chunks r and 2W-1-r): step 0 is plain causal attention on the local
    pair (local order is global order); a block from an earlier rank is seen fully by both local chunks
    through its first chunk only; a block from a later rank is seen fully, and only by the second local
    chunk. So each step after the first computes exactly half a rectangle, with no mask.
    """
    import jax.numpy as jnp
    from jax import lax

    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rank = lax.axis_index(axis_name)
    perm = [(i, (i + 1) % world) for i in range(world)]
    half = s // 2
    kv = (k, v)
    acc = lse = None
    for t in range(world):
        nxt = lax.ppermute(kv, axis_name, perm) if t + 1 < world else None
        kt, vt = kv
        if t == 0:
            out0, lse = block_attention(q, kt, vt, is_causal, scale)
            acc = out0.astype(jnp.float32)
        elif not is_causal:
            acc, lse = _merge(acc, lse, *block_attention(q, kt, vt, False, scale))
        else:
            def earlier(acc, lse, kt, vt):
                return _merge(acc, lse, *block_attention(q, kt[:, :half], vt[:, :half], False, scale))

            def later(acc, lse, kt, vt):
                a2, l2 = _merge(acc[:, half:], lse[:, :, half:], *block_attention(q[:, half:], kt, vt, False, scale))
                return jnp.concatenate([acc[:, :half], a2], axis=1), jnp.concatenate([lse[:, :, :half], l2], axis=2)

            acc, lse = lax.cond((rank - t) % world < rank, earlier, later, acc, lse, kt, vt)
        kv = nxt
    return acc.astype(q.dtype)


def xla_block_attention(q, k, v, is_causal, scale):
    """Stand-in for cuDNN on CPU: dense float32 attention (jax_ring.reference), same (out, lse) contract."""
    from jax_ring.reference import dense_attention

    return dense_attention(q, k, v, is_causal=is_causal, scale=scale)


def cudnn_block_attention():
    """(block_attention, note): cuDNN flash attention returning (out, float32 lse [b, h, s]), or Unavailable."""
    import inspect

    import jax
    import jax.numpy as jnp

    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        if "return_residual" not in inspect.signature(fa.dot_product_attention).parameters:
            raise ImportError("its dot_product_attention has no return_residual")
    except Exception as e:  # noqa: BLE001 - any failure of a private import means: use the public path
        private_err = f"{type(e).__name__}: {e}"
    else:
        def block(q, k, v, is_causal, scale):
            mask = fa.MaskType.CAUSAL if is_causal else fa.MaskType.NO_MASK
            out, lse = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, qkv_layout="BTNH",
                                                return_residual=True)
            return out, lse.astype(jnp.float32)

        return block, ("cuDNN fwd per block: jax._src.cudnn.fused_attention_stablehlo.dot_product_attention"
                       "(return_residual=True), float32 LSE merge")
    if "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters:
        def block(q, k, v, is_causal, scale):
            out, res = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, implementation="cudnn",
                                                    return_residual=True)
            return out, jnp.swapaxes(res, 1, 2).astype(jnp.float32)

        return block, (f"cuDNN per block via jax.nn.dot_product_attention(return_residual=True): its LSE is rounded "
                       f"to the input dtype (private float32 path unavailable: {private_err})")
    raise Unavailable(f"jax {jax.__version__} exposes no cuDNN attention returning the softmax LSE "
                      f"(private path: {private_err}; jax.nn.dot_product_attention has no return_residual)")


# --------------------------------------------------------------------------------------- runtime set-up


class Env:
    """This process's place in the job and the collectives the harness needs (torch.distributed)."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.smoke = args.cpu_smoke
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = not self.smoke
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        # Ranks sharing a GPU (ring_core.gpus): their rows measure the protocol, not multi-GPU speed.
        self.ranks_per_gpu = gpus.placement_from_env(torch.cuda.device_count()).ranks_per_gpu if self.cuda else 1
        self.jax = None
        self.mesh = None
        self.jax_device = None
        self._cp_mesh = None

    def attach_jax(self):
        import jax
        from jax.sharding import Mesh

        self.jax = jax
        self.mesh = Mesh(np.array(jax.devices()), (AXIS,))  # devices in process order: ring position = rank
        self.jax_device = jax.local_devices()[0]

    def cp_mesh(self):
        if self._cp_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._cp_mesh = init_device_mesh("cuda", (self.world,))
        return self._cp_mesh

    def flag_max(self, value: int) -> int:
        """All-reduce MAX of a small int; every rank must call it (it doubles as a barrier)."""
        t = self.torch.tensor([int(value)], dtype=self.torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return int(t.item())

    def all_max(self, values) -> list:
        t = self.torch.tensor(list(values), dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def agree(self, err):
        """Every rank learns whether any rank failed: returns the first rank's error message, or None."""
        errs = [None] * self.world
        self.dist.all_gather_object(errs, err)
        for r, e in enumerate(errs):
            if e:
                return e if self.world == 1 else f"rank {r}: {e}"
        return None

    def timed(self, fn):
        """(milliseconds, result) of one call: CUDA events around it on the torch stream, or a host clock."""
        if self.cuda:
            return cuda_timed(self.torch, fn)
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def print(self, *a):
        if self.rank == 0:
            print(*a, flush=True)


def cuda_timed(torch, fn):
    """(milliseconds, result) of ``fn()`` between two CUDA events recorded on the current torch stream."""
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1), out


def _init_cpu(args, need_jax: bool):
    """--cpu-smoke: gloo for torch, multi-process XLA CPU (gloo collectives) for JAX."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "RANK" not in os.environ:  # a plain `python -m benchmarks.attention --cpu-smoke`: a job of one
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if need_jax:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if world > 1:
            port = int(os.environ["MASTER_PORT"]) + 1
            jax.distributed.initialize(coordinator_address=f"{os.environ['MASTER_ADDR']}:{port}",
                                       num_processes=world, process_id=rank)


def setup(args, methods_wanted, cases, world: int) -> Env:
    need_jax = any(METHODS[m].framework == "jax" for m in methods_wanted)
    if args.cpu_smoke:
        _init_cpu(args, need_jax)
    else:
        os.environ.setdefault("RING_ATTENTION_TIMEOUT_S", TIMEOUT_S)
        heap = args.heap_bytes or heap_bytes_needed(cases, world)
        import torch_bridge

        if need_jax:
            import jax_ring

            jax_ring.initialize(heap_size=heap)  # torch.distributed + jax.distributed + the heap, before JAX uses the GPU
            torch_bridge.initialize()
        else:
            torch_bridge.initialize(heap_size=heap)
    env = Env(args)
    if need_jax:
        env.attach_jax()
    return env


def versions(env) -> dict:
    import importlib.metadata as md

    torch = env.torch
    v = dict(python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda or "",
             torch_cudnn="", triton="", jax="", jaxlib="", jax_cuda_plugin="", jax_platform="", jax_cudnn="")
    v["gpu"] = torch.cuda.get_device_name() if env.cuda else f"cpu ({platform.processor() or platform.machine()})"
    if env.cuda:
        v["torch_cudnn"] = str(torch.backends.cudnn.version() or "")
    with contextlib.suppress(Exception):
        import triton

        v["triton"] = triton.__version__
    if env.jax is not None:
        jax = env.jax
        v["jax"] = jax.__version__
        with contextlib.suppress(Exception):
            v["jaxlib"] = md.version("jaxlib")
        for plugin in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
            with contextlib.suppress(Exception):
                v["jax_cuda_plugin"] = f"{plugin} {md.version(plugin)}"
                break
        with contextlib.suppress(Exception):
            v["jax_platform"] = str(env.jax_device.client.platform_version)
        if env.cuda:
            with contextlib.suppress(Exception):
                from jax._src.lib import cuda_versions

                v["jax_cudnn"] = str(cuda_versions.cudnn_get_version())
    return v


# ------------------------------------------------------------------------------------------ case data


def call_args(sets, douts) -> list:
    """Per-call argument tuples: (q, k, v), with that set's dout appended where there are douts (fwd+bwd)."""
    return list(sets) if not douts else [(*s, d) for s, d in zip(sets, douts)]


class CaseData:
    """The inputs of one case: ``--input-sets`` random-normal global (q, k, v), identical on every rank
    (torch_cp and the single-GPU share need the global tensors), and this rank's shards in the case's layout.
    In fwd+bwd, each set also has a random-normal ``dout`` (the output's cotangent), drawn after q, k, v so
    that these are the fwd pass's. JAX views (zero-copy, DLPack) are made on first use."""

    def __init__(self, env: Env, case: Case, n_sets: int, seed: int):
        torch = env.torch
        from ring_core.layout import layout_permutation

        self.env, self.case = env, case
        dt = getattr(torch, case.dtype)
        s_g = case.seq_global(env.world)
        idx = layout_permutation(s_g, env.world, case.layout)[env.rank * case.seq_local:(env.rank + 1) * case.seq_local]
        idx = torch.as_tensor(idx, device=env.device)
        heads = (case.heads, case.kv_heads, case.kv_heads) + ((case.heads,) if case.mode == "fwd+bwd" else ())
        self.global_sets, self.local_sets, self.global_douts, self.local_douts = [], [], [], []
        for i in range(n_sets):
            g = torch.Generator(device=env.device).manual_seed(seed * 1000 + i)  # same on every rank
            xs = tuple(torch.randn(case.batch, s_g, h, case.head_dim, device=env.device, dtype=dt, generator=g)
                       for h in heads)
            local = tuple(x.index_select(1, idx).contiguous() for x in xs)
            self.global_sets.append(xs[:3])
            self.local_sets.append(local[:3])
            self.global_douts.extend(xs[3:])
            self.local_douts.extend(local[3:])
        self._jax_sharded = None

    def jax_local(self, t):
        return self.env.jax.dlpack.from_dlpack(t.contiguous(), device=self.env.jax_device)

    def jax_sharded(self):
        """The JAX rings' per-call arguments: the local shards (and dout in fwd+bwd) as global jax arrays
        sharded over the mesh axis (sequence axis 1)."""
        if self._jax_sharded is None:
            from jax.sharding import NamedSharding, PartitionSpec as P

            jax = self.env.jax
            sh = NamedSharding(self.env.mesh, P(None, AXIS))

            def glob(t):
                shape = (t.shape[0], t.shape[1] * self.env.world, *t.shape[2:])
                return jax.make_array_from_single_device_arrays(shape, sh, [self.jax_local(t)])

            self._jax_sharded = [tuple(glob(t) for t in s) for s in call_args(self.local_sets, self.local_douts)]
        return self._jax_sharded

    def limit_sets(self, prob: LimitProblem):
        """torch (q, k, v) [b, s, h, d] of this rank's single-GPU share (see limit_problem)."""
        if not prob.causal:
            return [(q, kg, vg) for (q, _, _), (_, kg, vg) in zip(self.local_sets, self.global_sets)]
        h0, g = prob.head_offset, self.case.heads // self.case.kv_heads
        k0 = h0 // g
        return [(q[:, :, h0:h0 + prob.q_heads].contiguous(), k[:, :, k0:k0 + prob.kv_heads].contiguous(),
                 v[:, :, k0:k0 + prob.kv_heads].contiguous()) for q, k, v in self.global_sets]

    def limit_douts(self, prob: LimitProblem):
        """The douts of the single-GPU share's output: this rank's queries' (non-causal) or its heads' (causal)."""
        if not prob.causal:
            return list(self.local_douts)
        h0 = prob.head_offset
        return [d[:, :, h0:h0 + prob.q_heads].contiguous() for d in self.global_douts]


# -------------------------------------------------------------------------------------------- methods


@dataclasses.dataclass
class Prepared:
    run: object  # run(i) -> the call's result on input set i % n: out, or (out, dq, dk, dv) in fwd+bwd
    local_out: object  # result -> {name: torch [b, s_local, h, d] comparable with the anchor's} (see _comparable)
    note: str = ""
    compile_s: float | None = None
    shape: str = ""
    finish: object = None  # called after the timed calls (surfaces errors reported asynchronously)


def _comparable(case, convert):
    """``Prepared.local_out``: what the check compares, by name: the output (``out``) in fwd, the gradients
    (``dq``, ``dk``, ``dv``) in fwd+bwd. ``convert(name, value)`` gives it as a torch tensor in the ring's
    local layout, or None where it is not this rank's shard of the ring's (then it is left out)."""

    def local_out(result):
        named = {"out": result} if case.mode == "fwd" else dict(zip(GRADS, result[1:]))
        conv = {name: convert(name, x) for name, x in named.items()}
        return {name: t for name, t in conv.items() if t is not None}

    return local_out


def _share_convert(prob: LimitProblem, to_local):
    """``convert`` of the single-GPU share: non-causal, its output and dq are this rank's (its queries against
    every key); its dK/dV are only this rank's queries' part of the global gradient, and the causal share
    (H/W heads, every token) matches no ring shard: those are not compared."""
    return lambda name, x: to_local(x) if not prob.causal and name in ("out", "dq") else None


def _torch_prepared(env, case, stack, attn, sets, douts, convert, note, shape, finish=None) -> Prepared:
    """A torch method's calls: ``attn(q, k, v)`` on input set i, under no_grad (fwd); in fwd+bwd, the output
    then ``torch.autograd.grad`` of it for q, k, v (leaves sharing the inputs' memory) with the set's dout."""
    torch, n = env.torch, len(sets)
    if case.mode == "fwd":
        stack.enter_context(torch.no_grad())

        def run(i):
            return attn(*sets[i % n])
    else:
        leaves = [tuple(x.detach().requires_grad_() for x in s) for s in sets]
        note = f"{note}; backward by torch.autograd.grad"

        def run(i):
            q, k, v = leaves[i % n]
            out = attn(q, k, v)
            return (out, *torch.autograd.grad(out, (q, k, v), douts[i % n]))

    return Prepared(run, _comparable(case, convert), note, shape=shape, finish=finish)


def _jax_step(case, fn):
    """What one JAX call runs: ``fn(q, k, v)`` (fwd), or (q, k, v, dout) -> (out, dq, dk, dv) by ``jax.vjp``
    with dout as the output's cotangent (fwd+bwd)."""
    if case.mode == "fwd":
        return fn
    import jax

    def step(q, k, v, dout):
        out, pull = jax.vjp(fn, q, k, v)
        return (out, *pull(dout))

    return step


def _jax_compiled(env, case, fn, args, convert, note, shape) -> Prepared:
    """``fn`` (already the step) jitted and compiled ahead on ``args[0]``; call i runs it on ``args[i % n]``."""
    jax = env.jax
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args[0]).compile()
    compile_s = time.perf_counter() - t0
    n = len(args)
    if case.mode != "fwd":
        note = f"{note}; backward by jax.vjp"
    return Prepared(lambda i: jax.block_until_ready(compiled(*args[i % n])), _comparable(case, convert), note,
                    compile_s, shape)


def _jax_ring(env, case, data, body, note) -> Prepared:
    from jax.sharding import PartitionSpec as P

    jax, torch = env.jax, env.torch
    spec = P(None, AXIS)
    args = data.jax_sharded()
    fn = jax.shard_map(_jax_step(case, body), mesh=env.mesh, in_specs=(spec,) * len(args[0]),
                       out_specs=spec if case.mode == "fwd" else (spec,) * 4)
    return _jax_compiled(env, case, fn, args, lambda name, x: torch.from_dlpack(x.addressable_shards[0].data),
                         note, ring_shapes(case))


_NEEDS_GPU = "the fused kernel needs NVIDIA GPUs and the iris heap (not in --cpu-smoke)"


def build_torch_ring(env, args, case, data, stack, backend, **_):
    import torch_bridge

    if backend == "fused" and not env.cuda:
        raise Unavailable(_NEEDS_GPU)

    def attn(q, k, v):
        return torch_bridge.ring_attention(q, k, v, is_causal=case.causal, layout=case.layout, backend=backend)

    return _torch_prepared(env, case, stack, attn, data.local_sets, data.local_douts, lambda name, x: x,
                           f"backend={backend}", ring_shapes(case),
                           finish=torch_bridge.check_errors if backend == "fused" else None)


def build_jax_ring(env, args, case, data, stack, backend, **_):
    import jax_ring

    if backend == "fused" and not env.cuda:
        raise Unavailable(_NEEDS_GPU)

    def body(q, k, v):
        return jax_ring.ring_attention(q, k, v, axis_name=AXIS, is_causal=case.causal, layout=case.layout,
                                       backend=backend)

    return _jax_ring(env, case, data, body, f"backend={backend}")


def build_jax_fused_deferred(env, args, case, data, stack, **_):
    """``jax_fused`` traced in the deferred error mode (read by jax_ring at trace time, which happens here):
    no host callback per call; a kept failure is raised by ``jax_ring.check_errors()`` after the timed calls."""
    import jax_ring
    from ring_core.control import ERRORS_ENV

    old = os.environ.get(ERRORS_ENV)
    os.environ[ERRORS_ENV] = "deferred"
    try:
        prep = build_jax_ring(env, args, case, data, stack, backend="fused")
    finally:
        if old is None:
            os.environ.pop(ERRORS_ENV, None)
        else:
            os.environ[ERRORS_ENV] = old
    return dataclasses.replace(prep, note=f"{prep.note}; {ERRORS_ENV}=deferred", finish=jax_ring.check_errors)


def check_lse_differentiates(env, block, q, k, v):
    """Raise Unavailable unless jax autodiff of ``block`` carries the cotangent of its LSE output. The ring
    merges blocks through their LSEs, so without it ``jax.vjp`` of the ring runs but gives wrong gradients;
    jax's cuDNN attention drops it (its backward rule keeps only the output's cotangent)."""
    jax = env.jax
    scale = 1.0 / math.sqrt(q.shape[-1])
    g = jax.jit(jax.grad(lambda q: block(q, k, v, False, scale)[1].sum()))(q)
    if not bool(jax.numpy.any(g != 0)):
        raise Unavailable("jax autodiff of this ring would give wrong gradients: the gradient of the block "
                          "attention's LSE output is zero (jax's cuDNN attention backward drops the LSE's "
                          "cotangent) and the ring merges blocks through their LSEs; a hand-written ring backward "
                          "(cuDNN backward per block from the final out and LSE) would be needed")


def build_jax_cudnn_ring(env, args, case, data, stack, **_):
    if env.cuda:
        block, note = cudnn_block_attention()
    else:
        block, note = xla_block_attention, "cpu-smoke: blocks by dense XLA attention (jax_ring.reference), not cuDNN"
    if case.mode != "fwd":
        check_lse_differentiates(env, block, *(data.jax_local(x) for x in data.local_sets[0]))
        note = f"{note}; gradients by autodiff through the LSE merge"

    def body(q, k, v):
        return cudnn_ring_attention(q, k, v, axis_name=AXIS, world=env.world, is_causal=case.causal,
                                    block_attention=block)

    return _jax_ring(env, case, data, body, note)


def _repeat_kv(sets, case, dim):
    g = case.heads // case.kv_heads
    return [(q, k.repeat_interleave(g, dim=dim), v.repeat_interleave(g, dim=dim)) for q, k, v in sets]


def _fold_kv(t, case, dim):
    """The gradient of K/V heads repeated by _repeat_kv, summed back to the kv heads."""
    return t.unflatten(dim, (case.kv_heads, case.heads // case.kv_heads)).sum(dim + 1)


def _sdpa_inputs(case, sets, douts, repeat_kv, is_causal) -> tuple:
    """(sets, douts, attn, gqa) for torch SDPA: [b, h, s, d] copies of [b, s, h, d] input sets (K/V heads
    repeated when asked) and douts, and ``attn(q, k, v)``, with ``enable_gqa`` (``gqa``) where the head
    counts differ."""
    import torch.nn.functional as F

    sets = [tuple(x.transpose(1, 2).contiguous() for x in s) for s in sets]
    if repeat_kv:
        sets = _repeat_kv(sets, case, dim=1)
    douts = [d.transpose(1, 2).contiguous() for d in douts]
    gqa = case.heads != case.kv_heads and not repeat_kv
    kw = dict(is_causal=is_causal, **({"enable_gqa": True} if gqa else {}))

    def attn(q, k, v):  # F's attribute looked up at every call: context_parallel replaces it while active
        return F.scaled_dot_product_attention(q, k, v, **kw)

    return sets, douts, attn, gqa


def build_torch_cp(env, args, case, data, stack, repeat_kv=False, **_):
    if not env.cuda:
        raise Unavailable("torch context_parallel dispatches SDPA to its CUDA ring handlers (cuDNN/flash/efficient); "
                          "not in --cpu-smoke")
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = env.cp_mesh()
    set_rotate_method(args.cp_rotate)
    # [b, h, s_global, d], natural order: context_parallel shards them in place (head-tail order when balanced);
    # dout is sharded as the output is.
    sets, douts, attn, gqa = _sdpa_inputs(case, data.global_sets, data.global_douts, repeat_kv, case.causal)
    bufs = [x for s in sets for x in s] + douts
    old_balance = _cp_options.enable_load_balance
    stack.callback(setattr, _cp_options, "enable_load_balance", old_balance)
    _cp_options.enable_load_balance = case.causal  # read on entry: head-tail balancer for causal, none otherwise
    stack.enter_context(context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * len(bufs),
                                         no_restore_buffers=set(bufs)))
    stack.enter_context(sdpa_kernel([SDPBackend.CUDNN_ATTENTION]))

    def convert(name, x):  # this rank's shard, [b, h, s_local, d] in the ring's layout
        return (_fold_kv(x, case, dim=1) if repeat_kv and name in ("dk", "dv") else x).transpose(1, 2)

    note = (f"rotate={args.cp_rotate}, load_balance={'head-tail' if case.causal else 'off'}, SDPA cuDNN"
            f"{', enable_gqa' if gqa else ''}")
    b, s_g, d = case.batch, case.seq_global(env.world), case.head_dim
    hkv = case.heads if repeat_kv else case.kv_heads
    shape = (f"global q[{b},{case.heads},{s_g},{d}] kv[{b},{hkv},{s_g},{d}] sharded by context_parallel "
             f"({'head-tail' if case.causal else 'contiguous'}){' causal' if case.causal else ''}")
    return _torch_prepared(env, case, stack, attn, sets, douts, convert, note, shape)


def build_torch_limit(env, args, case, data, stack, repeat_kv=False, **_):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    prob = limit_problem(case, env.world, env.rank)
    sets, douts, attn, gqa = _sdpa_inputs(case, data.limit_sets(prob), data.limit_douts(prob), repeat_kv, prob.causal)
    stack.enter_context(sdpa_kernel([SDPBackend.CUDNN_ATTENTION if env.cuda else SDPBackend.MATH]))
    note = "one GPU's share, SDPA cuDNN" if env.cuda else "cpu-smoke: SDPA math backend, not cuDNN"
    return _torch_prepared(env, case, stack, attn, sets, douts, _share_convert(prob, lambda x: x.transpose(1, 2)),
                           note + (", enable_gqa" if gqa else ""), prob.shapes(case.batch, case.head_dim))


def build_jax_limit(env, args, case, data, stack, **_):
    jax, torch = env.jax, env.torch
    prob = limit_problem(case, env.world, env.rank)
    call = call_args(data.limit_sets(prob), data.limit_douts(prob))
    impl = "cudnn" if env.cuda else "xla"
    fn = functools.partial(jax.nn.dot_product_attention, is_causal=prob.causal, implementation=impl)
    note = "one GPU's share, cuDNN" if env.cuda else "cpu-smoke: implementation='xla', not cuDNN"
    return _jax_compiled(env, case, _jax_step(case, fn), [tuple(data.jax_local(x) for x in a) for a in call],
                         _share_convert(prob, torch.from_dlpack), note, prob.shapes(case.batch, case.head_dim))


BUILDERS = {
    "torch_fused": functools.partial(build_torch_ring, backend="fused"),
    "jax_fused": functools.partial(build_jax_ring, backend="fused"),
    "jax_fused_deferred": build_jax_fused_deferred,
    "torch_ref": functools.partial(build_torch_ring, backend="torch"),
    "jax_xla": functools.partial(build_jax_ring, backend="xla"),
    "jax_cudnn_ring": build_jax_cudnn_ring,
    "torch_cp": build_torch_cp,
    "torch_cudnn_1gpu": build_torch_limit,
    "jax_cudnn_1gpu": build_jax_limit,
}


# ------------------------------------------------------------------------------------------- running


@dataclasses.dataclass
class Result:
    error: str | None = None
    phase: str = ""
    times: list | None = None
    note: str = ""
    shape: str = ""
    compile_s: float | None = None
    first_call_s: float | None = None
    diff: float | None = None
    diff_of: tuple = ()  # the names (out, or dq, dk, dv) the diff is the max over
    diff_excess: float = -1.0  # the worst diff over its warning bound (see max_abs_diff); above 1: flagged
    local: dict | None = None  # this rank's comparable results (copies), kept only when it may become the anchor


def _fmt_exc(e: BaseException) -> str:
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    return msg[:400]


def max_abs_diff(local: dict, anchor: dict) -> tuple:
    """(max |local - anchor| over the tensors both have, the largest ratio of a tensor's diff to its warning
    bound (above 1: flag it; the bound is DIFF_WARN for ``out``, GRAD_WARN * max|anchor| for a gradient),
    their names), or (-1.0, -1.0, ()) when they share none."""
    names = tuple(n for n in local if n in anchor)
    if not names:
        return -1.0, -1.0, ()
    diffs, excess = [], []
    for n in names:
        ref = anchor[n].float()
        diffs.append(float((local[n].float() - ref).abs().max().item()))
        bound = DIFF_WARN if n == "out" else GRAD_WARN * float(ref.abs().max().item())
        excess.append(diffs[-1] / max(bound, 1e-30))
    return max(diffs), max(excess), names


def _attempt(env, args, case, name, data, anchor, **kw) -> Result:
    """Build, first call (checked against the anchor), warm-up and timed calls of one method. Every rank
    takes part in the same collectives whatever fails where, so that no rank waits for a skipped one."""
    res = Result()
    stack = contextlib.ExitStack()
    prep = err = None
    try:
        try:
            prep = BUILDERS[name](env, args, case, data, stack, **kw)
        except Exception as e:  # noqa: BLE001 - any failure becomes this method's error row
            err = _fmt_exc(e)
            if not isinstance(e, Unavailable):
                traceback.print_exc(limit=4)
        res.error = env.agree(err)
        if res.error:
            res.phase = "build"
            return res
        res.note, res.shape, res.compile_s = prep.note, prep.shape, prep.compile_s

        diff = excess = -1.0
        try:
            t0 = time.perf_counter()
            _, out = env.timed(lambda: prep.run(0))
            res.first_call_s = time.perf_counter() - t0
            local = prep.local_out(out)
            if local and anchor is not None:
                diff, excess, res.diff_of = max_abs_diff(local, anchor)
            if local and anchor is None and name in ANCHORS:
                res.local = {n: t.clone() for n, t in local.items()}
            del out, local
        except Exception as e:  # noqa: BLE001
            err = _fmt_exc(e)
            traceback.print_exc(limit=4)
        res.error = env.agree(err)
        if res.error:
            res.phase = "first call"
            return res
        if anchor is not None:
            res.diff, res.diff_excess = env.all_max([diff, excess])
        if res.diff is not None and res.diff < 0:
            res.diff = None

        times, status = [], 0
        try:
            for i in range(1, args.warmup):
                prep.run(i)
        except Exception as e:  # noqa: BLE001
            err, status = _fmt_exc(e), 1
        for it in range(args.iters):
            if env.flag_max(status):  # all ranks meet before every timed call, and stop together
                break
            try:
                ms, out = env.timed(lambda: prep.run(it))
                del out
                times.append(ms)
            except Exception as e:  # noqa: BLE001
                err, status = _fmt_exc(e), 1
        if not env.flag_max(status) and prep.finish is not None:
            try:
                prep.finish()
            except Exception as e:  # noqa: BLE001
                err = _fmt_exc(e)
        res.error = env.agree(err)
        if res.error:
            res.phase = "timing"
            return res
        res.times = env.all_max(times)
        return res
    finally:
        try:
            stack.close()  # local: contexts the builder entered (context_parallel, sdpa_kernel, no_grad)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=4)
            res.note = f"{res.note}; leaving its contexts failed: {_fmt_exc(e)}".lstrip("; ")
        prep = None
        env.free()
        if res.error and METHODS[name].kind == "fused" and env.cuda:
            import torch_bridge

            with contextlib.suppress(Exception):
                torch_bridge.reset()  # collective: call counters back in step after a timeout


def run_method(env, args, case, name, data, anchor) -> Result:
    res = _attempt(env, args, case, name, data, anchor)
    if (res.error and res.phase in ("build", "first call") and name in GQA_RETRY and env.cuda
            and case.heads != case.kv_heads):
        env.print(f"  {name}: with enable_gqa: {res.error}; retrying with K/V heads repeated")
        first = res.error
        res = _attempt(env, args, case, name, data, anchor, repeat_kv=True)
        res.note = f"{res.note}; K/V heads repeated (enable_gqa failed: {first[:160]})"
    return res


def _compared(names) -> str:
    """What the diff covers, after the anchor's name in ``diff_vs``: nothing for the output, else the gradients."""
    return "" if tuple(names) == ("out",) else f" ({','.join(names)})"


def make_row(env, args, case, name, res: Result, meta: dict, anchor_name) -> dict:
    info = METHODS[name]
    fl = flops_per_gpu(case, env.world)
    note = f"{SHARED_NOTE}; {res.note}" if env.ranks_per_gpu > 1 else res.note
    row = dict(meta, method=name, framework=info.framework, kind=info.kind, world=env.world,
               ranks_per_gpu=env.ranks_per_gpu, batch=case.batch,
               heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim, seq_local=case.seq_local,
               seq_global=case.seq_global(env.world), causal=int(case.causal), layout=case.layout, dtype=case.dtype,
               flops_per_gpu=f"{fl:.6g}", iters=args.iters, warmup=args.warmup, input_sets=args.input_sets,
               shape=res.shape, note=note, error=res.error or "", **{"pass": case.mode})
    if res.compile_s is not None:
        row["compile_s"] = round(res.compile_s, 3)
    if res.first_call_s is not None:
        row["first_call_s"] = round(res.first_call_s, 3)
    if res.times:
        med, q20, q80 = summarize_times(res.times)
        row.update(ms_median=round(med, 4), ms_q20=round(q20, 4), ms_q80=round(q80, 4),
                   tflops_per_gpu=float(f"{tflops(fl, med):.4g}"))
    if res.local is not None:  # the case's other methods are compared with this method's output (or gradients)
        row["diff_vs"] = f"(anchor){_compared(tuple(res.local))}"
    if res.diff is not None:
        row.update(max_abs_diff=f"{res.diff:.3e}", diff_vs=f"{anchor_name}{_compared(res.diff_of)}")
        if res.diff_excess > 1:
            what = "output" if res.diff_of == ("out",) else "gradients"
            row["note"] = f"{row['note']}; LARGE DIFF vs {anchor_name}: check this method's {what}".lstrip("; ")
    return row


def run_case(env, args, case, methods, log, meta) -> list:
    env.print(f"\n== {case.label()}, W={env.world} (S_global {case.seq_global(env.world)}), "
              f"{flops_per_gpu(case, env.world) / 1e12:.3f} TFLOP per GPU")
    todo = []
    for name in methods:
        if METHODS[name].kind == "reference" and case.seq_local > args.ref_max_seq:
            env.print(f"  {name:17s} skipped: seq_local > --ref-max-seq {args.ref_max_seq}")
            continue
        todo.append(name)
    data = err = None
    try:
        data = CaseData(env, case, args.input_sets, args.seed)
    except Exception as e:  # noqa: BLE001
        err = _fmt_exc(e)
    err = env.agree(err)
    rows = []
    if err:
        env.print(f"  inputs could not be made: {err}")
        todo = []
    anchor = anchor_name = None
    for name in todo:
        res = run_method(env, args, case, name, data, anchor)
        row = make_row(env, args, case, name, res, meta, anchor_name)
        if res.local is not None:  # only returned while there is no anchor yet
            anchor, anchor_name = res.local, name
        rows.append(row)
        env.print(format_row(row))
        if log is not None:
            log.add(row)
    del data, anchor
    env.free()
    if log is not None and rows:
        log.refresh_ratios()
        for line in format_ratios(log.rows[-len(rows):]):  # this case's rows, now with their ratios
            env.print(line)
    elif env.rank == 0 and rows:
        for line in format_ratios(compute_ratios(rows)):
            env.print(line)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    world_env = int(os.environ.get("WORLD_SIZE", 1))
    methods = select_methods(args, world_env)
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
    env.print(f"warm-up {args.warmup}, {args.iters} timed calls over {args.input_sets} input sets; CSV: "
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
