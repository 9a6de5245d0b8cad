"""The machinery of the ring-attention benchmark: cases and their FLOPs, the job's set-up (Env and
its collectives), the inputs, timing, the check, the rows, the CSV log and its ratio columns.

``benchmarks.attention`` is the command line that drives it; ``benchmarks.peers`` implements every method it
times. The methods are named here (METHODS: the CSV's ``method``, ``framework`` and ``kind`` columns, and the
order a case runs them in) and built there (``peers.BUILDERS``): a builder gets this process's Env, the
arguments, the Case, its CaseData and an ExitStack for the contexts it enters, and returns a Prepared (its
calls, what the check compares, a note, the shape), or raises Unavailable saying why it cannot run here.

Passes (``--pass``, the CSV's ``pass`` column, PASSES): ``fwd`` times the forward alone; ``fwd+bwd`` times
one training step of attention per call: the forward, then the gradients of q, k and v for that input set's
``dout`` (random normal, one per input set, drawn after q, k, v, so these are the fwd pass's inputs). How
each method takes them is in ``benchmarks.peers``.

Timing: ``--warmup`` calls (the first one on input set 0 is also timed alone: ``first_call_s``; JAX
programs are compiled ahead of it: ``compile_s``), then ``--iters`` calls rotating over
``--input-sets`` random-normal input sets. Before every call the ranks meet (an all-reduce that also
carries errors); each call is timed with CUDA events on the torch stream (JAX calls end with
``block_until_ready``, so their events span the call's dispatch and execution); the per-call times are
all-reduced with MAX (the slowest rank counts, call by call); the row reports the median and the 20/80 %
quantiles. With ``--timing stream`` (the CSV's ``timing`` column; default ``call``, the above) the ranks meet
once, then the ``--iters`` calls run back to back between two events: the mean per call, as
triton.testing.do_bench and a training step see it, where the host's work for a call overlaps the GPU's for
the one before (per-call events on an idle stream count that host work too). JAX calls are dispatched the
same way, each without waiting for the one before (``Prepared.issue``: JAX's asynchronous dispatch, a JAX
training step's pattern), and the timing waits for the last one's result (until 2026-12-04 each JAX call
blocked in this timing too, so its rows counted JAX's dispatch and wake-up per call).
With ``--timing ready`` each call is timed as with ``call`` but its second event is recorded once the call's
results are ready on the host (torch: after ``torch.cuda.synchronize()``), as a JAX call's always is: torch and
JAX then count the same things, the host's work before the launch, the kernels, and the wait for them
(with ``call`` a JAX call counts its wait's wake-up, a torch call does not).
TFLOP/s per GPU = ``4*B*H*S_local*S_global*D`` per rank (half when causal) / median time;
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

Masks (``--mask``, the CSV's ``mask`` column): ``packed``, documents packed back to back (segment
ids; their lengths drawn uniformly from ``--doc-lens`` with a fixed seed, DOC_SEED, the last one cut at the
sequence's end), and ``window``, a sliding window (``--window LEFT,RIGHT``, flash-attn's window_size), beside
``none``. Only the methods that take masks run them (MethodInfo.masks: the fused kernel, the reference rings,
flex_attention and flash-attn); the others are skipped, saying so. The one-process peers (MethodInfo.world1:
flex_attention, flash-attn) run at world size 1 only and are skipped, saying so, at more ranks. A masked row's
FLOPs count only the (query, key) pairs the mask allows, exactly (``allowed_pairs``: per rank, from the
documents' bounds and the window; tested against ``ring_core.masks.allowed``), over the world: ``4*H*D*pairs/W`` per GPU (x 3.5 in fwd+bwd), so its TFLOP/s
are *effective* (useful work per second); ``pairs_per_gpu`` holds that mean (every row has it: a dense row's
FLOPs keep the ``S_local*S_global/2`` convention, which differs from its exact causal count by 1/S_global).
Their ratio columns: ``vs_dense``, the masked fused row's TFLOP/s over the same method's unmasked row of the
same run, case and pass (run ``--mask none,packed`` for it); ``ms_vs_world1``, its time over the time of the
latest world-1 row of the same method, mask, layout, seq_local and pass anywhere in the file (the same work per
rank where the mask bounds each rank's reach: run the same command with one process). ``ring_steps``: the most
ring steps any rank's fused kernel ran in the last timed call (read from the flags the kernel left:
``ring_core.plans.LaunchPlan.ring_steps_run``); ``ring_steps_needed``: the most ring steps holding a pair the
mask allows, for any rank (``allowed_pairs``; segment ids can make it smaller than ``ring_steps``: the kernel
still waits for every chunk positions allow, ring_core/protocol/steps.py).

Several ranks may share one GPU (``python -m jax_ring.launch --nproc-per-node 4 ...`` on one GPU, see
``ring_core.runtime.gpus``): the real protocol then runs, but each rank has only its share of the SMs. Such rows
say so in ``ranks_per_gpu`` and in ``note`` (they measure the protocol's overhead, not multi-GPU speed),
and their ``scaling_eff`` compares the GPU's whole rate (ranks_per_gpu x the per-rank rate) with one
rank's rate on the global problem: 1.0 means the ring costs nothing on one GPU.

The fused kernel's spin-wait bound is lowered to 60 s here (``RING_ATTENTION_TIMEOUT_S``, unless set),
so that a rank left waiting by a peer's failure gets out quickly.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import gc
import math
import os
import platform
import time
import traceback

import numpy as np

from ring_core.runtime import gpus

AXIS = "sp"
DIFF_WARN = 0.05  # |out - anchor| above this is flagged (bf16/fp16 outputs of random-normal inputs are O(0.1))
GRAD_WARN = 0.05  # |grad - anchor| above this times max|anchor grad| is flagged (about 13 bf16 ulps of the largest)
TIMEOUT_S = "60"


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """What the CSV says of a method (its ``framework`` and ``kind`` columns) and a line about it. The kind
    steers the harness: ``reference`` methods are skipped above ``--ref-max-seq``, ``fused`` rows carry the
    ratio columns (and a failure resets the fused kernel's state); ``limit`` rows time one GPU's share."""

    framework: str  # "torch" or "jax"
    kind: str  # "fused", "reference", "peer" or "limit"
    summary: str
    masks: bool = False  # takes segment ids and windows (runs the masked cases)
    world1: bool = False  # the whole sequence in one process: runs at world size 1 only (skipped at more ranks)


# Every method a run may time, in the order a case runs them (the first ring methods serve as the check's
# anchor); each is implemented in benchmarks.peers (peers.BUILDERS, under the same name).
METHODS = {
    "torch_fused": MethodInfo("torch", "fused", "torch_bridge.ring_attention(backend='fused')", True),
    "jax_fused": MethodInfo("jax", "fused", "jax_ring.ring_attention(backend='fused') in shard_map", True),
    "jax_fused_deferred": MethodInfo("jax", "fused", "jax_fused without any per-call check "
                                                     "(jax_ring.status.left_out(); check_errors() after)", True),
    "jax_fused_call": MethodInfo("jax", "fused", "jax_fused raising each call's own failure "
                                                 "(RING_ATTENTION_ERRORS=call: a host sync per call)", True),
    "torch_fused_det": MethodInfo("torch", "fused", "torch_fused with deterministic=True", True),
    "jax_fused_det": MethodInfo("jax", "fused", "jax_fused with deterministic=True", True),
    "torch_ref": MethodInfo("torch", "reference", "torch_bridge backend='torch' (p2p ring, float32 maths)", True),
    "jax_xla": MethodInfo("jax", "reference", "jax_ring backend='xla' (ppermute ring, float32 maths)", True),
    "jax_cudnn_ring": MethodInfo("jax", "peer", "pure-JAX ppermute ring, cuDNN per block, LSE merge"),
    "torch_cp": MethodInfo("torch", "peer", "torch context_parallel over cuDNN SDPA"),
    "torch_flex": MethodInfo("torch", "peer", "torch flex_attention (torch.compile), one process, one block mask",
                             True, True),
    "torch_flash_attn": MethodInfo("torch", "peer", "flash-attn flash_attn_func / flash_attn_varlen_func, one process",
                                   True, True),
    "torch_cudnn_1gpu": MethodInfo("torch", "limit", "torch SDPA (cuDNN) on one GPU's share"),
    "jax_cudnn_1gpu": MethodInfo("jax", "limit", "jax.nn.dot_product_attention(cudnn) on one GPU's share"),
}
# The check's anchor: the first of these that ran in the case.
ANCHORS = ("torch_fused", "jax_fused", "torch_ref", "jax_xla")
# Builders taking repeat_kv=True: where torch's cuDNN SDPA refuses enable_gqa, they are retried once with K/V
# heads repeated.
GQA_RETRY = ("torch_cp", "torch_cudnn_1gpu")

# Ratio columns of the fused rows: fused TFLOP/s over the best of these methods' (same run, same case).
RATIOS = {
    "vs_cudnn_1gpu": ("torch_cudnn_1gpu", "jax_cudnn_1gpu"),
    "vs_context_parallel": ("torch_cp",),
    "vs_flex": ("torch_flex",),
    "vs_flash_attn": ("torch_flash_attn",),
    "vs_cudnn_ring": ("jax_cudnn_ring",),
    "vs_xla_ref": ("jax_xla",),
    "vs_torch_ref": ("torch_ref",),
}
CASE_KEY = ("run_id", "world", "batch", "heads", "kv_heads", "head_dim", "seq_local", "causal", "dtype", "pass",
            "mask", "layout")
SCALING_KEY = ("method", "batch", "heads", "kv_heads", "head_dim", "seq_global", "causal", "dtype", "pass", "mask",
               "layout", "timing")
# The masked rows' ratio columns (module docstring): vs_dense against the same run's unmasked row of the method,
# ms_vs_world1 against the latest world-1 row with the same work per rank.
MASK_RATIOS = ("vs_dense", "ms_vs_world1")
WORLD1_KEY = ("method", "batch", "heads", "kv_heads", "head_dim", "seq_local", "causal", "dtype", "pass", "mask",
              "layout", "timing")
MASKS = ("none", "packed", "window")
DOC_SEED = 20  # the packed documents' lengths: numpy's default_rng(DOC_SEED + batch row), the same in every run

# What one timed call does, and its FLOPs as a multiple of the forward's. The flash-attention convention:
# the backward is 2.5 forwards (five matmuls to the forward's two), so forward + backward counts 3.5.
PASSES = {"fwd": 1.0, "fwd+bwd": 3.5}
GRADS = ("dq", "dk", "dv")
# Columns added since the first CSVs, with the value a row written without them means.
LEGACY_DEFAULTS = {"pass": "fwd", "ranks_per_gpu": "1", "mask": "none", "pairs_per_gpu": "", "ring_steps": "",
                   "ring_steps_needed": "", "vs_dense": "", "ms_vs_world1": "", "timing": "call", "vs_flex": "",
                   "vs_flash_attn": ""}
# --timing: each call between its own events, the calls back to back, or each call until its results are ready
TIMINGS = ("call", "stream", "ready")
SHARED_NOTE = "RANKS SHARE GPUS: protocol overhead, not multi-GPU speed"
SM_SHARE_NOTE = "each rank on {share} % of the GPU's SMs (MPS)"

VERSION_COLUMNS = ("gpu", "python", "torch", "torch_cuda", "torch_cudnn", "triton", "jax", "jaxlib",
                   "jax_cuda_plugin", "jax_platform", "jax_cudnn")
CSV_COLUMNS = (
    "run_id", "date", "world", "ranks_per_gpu", "method", "framework", "kind",
    "batch", "heads", "kv_heads", "head_dim", "seq_local", "seq_global", "causal", "layout", "dtype", "pass", "mask",
    "flops_per_gpu", "pairs_per_gpu", "ms_median", "ms_q20", "ms_q80", "tflops_per_gpu",
    "iters", "warmup", "input_sets", "timing", "compile_s", "first_call_s", "max_abs_diff", "diff_vs",
    "ring_steps", "ring_steps_needed", *RATIOS, "scaling_eff", *MASK_RATIOS,
    "shape", "note", "error",
    *VERSION_COLUMNS, "command",
)


class Unavailable(RuntimeError):
    """The method cannot run on this stack; the message says why (it goes to the CSV's error column)."""


@dataclasses.dataclass
class Prepared:
    """What a method's builder (benchmarks.peers) returns: its calls and what the check compares of them."""

    run: object  # run(i) -> the call's result on input set i % n: out, or (out, dq, dk, dv) in fwd+bwd
    local_out: object  # result -> {name: torch [b, s_local, h, d] comparable with the anchor's} (see peers._comparable)
    note: str = ""
    compile_s: float | None = None
    shape: str = ""
    finish: object = None  # called after the timed calls (surfaces errors reported asynchronously)
    ring_steps: object = None  # fused methods: () -> the ring steps this rank's kernel ran in the last call
    issue: object = None  # issue(i): call i without waiting for its result (JAX), for ``--timing stream``; None: run


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
    mask: str = "none"  # MASKS: "packed" (segment ids, documents of doc_lens tokens) or "window" (window_size)
    window: tuple = (-1, -1)  # mask "window": flash-attn's window_size (left, right)
    doc_lens: tuple = (512, 8192)  # mask "packed": the documents' lengths, drawn uniformly from [lo, hi]
    layout: str = ""  # "contiguous" or "zigzag"; "" = zigzag when causal (balanced causal work), else contiguous

    def __post_init__(self):
        if not self.layout:
            object.__setattr__(self, "layout", "zigzag" if self.causal else "contiguous")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")

    @property
    def segmented(self) -> bool:
        return self.mask == "packed"

    @property
    def window_size(self):
        """The call's ``window_size`` (None without a window)."""
        return tuple(self.window) if self.mask == "window" else None

    @property
    def mask_label(self) -> str:
        """The CSV's ``mask`` column: none, packed(LO-HI), window(LEFT,RIGHT)."""
        if self.mask == "packed":
            return f"packed({self.doc_lens[0]}-{self.doc_lens[1]})"
        if self.mask == "window":
            return f"window({self.window[0]},{self.window[1]})"
        return "none"

    def seq_global(self, world: int) -> int:
        return self.seq_local * world

    def label(self) -> str:
        dt = {"bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype)
        lay = "" if self.layout == ("zigzag" if self.causal else "contiguous") else f" {self.layout}"
        mask = "" if self.mask == "none" else f" {self.mask_label}"
        return (f"{dt} D{self.head_dim} H{self.heads}/{self.kv_heads} B{self.batch} S_local {self.seq_local} "
                f"{'causal' if self.causal else 'full'}{lay}{mask} {self.mode}")


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool,
                    mode: str = "fwd") -> float:
    """FLOPs of one attention call: 4*B*H*S_q*S_kv*D for the forward (two matmuls), half when causal,
    times PASSES[mode] (3.5 for forward + backward)."""
    f = 4.0 * batch * heads * q_len * kv_len * head_dim * PASSES[mode]
    return f / 2 if causal else f


def flops_per_gpu(case: Case, world: int) -> float:
    """Attention FLOPs one rank does: 4*B*H*S_local*S_global*D (two matmuls), half of that when causal;
    x 3.5 for forward + backward. Masked cases count the pairs the mask allows: 4*H*D*pairs_per_gpu (x 3.5)."""
    if case.mask != "none":
        return 4.0 * case.heads * case.head_dim * pairs_per_gpu(case, world) * PASSES[case.mode]
    return attention_flops(case.batch, case.heads, case.seq_local, case.seq_global(world), case.head_dim,
                           case.causal, case.mode)


def packed_documents(case: Case, world: int) -> list:
    """Each batch row's documents as flash-attn's ``cu_seqlens`` (int64, from 0 to S_global): lengths drawn
    uniformly from ``case.doc_lens`` (numpy's ``default_rng(DOC_SEED + row)``), packed back to back, the last
    one cut at the end (no padding). The same documents in every run; a longer sequence holds the shorter one's
    documents first."""
    s_g = case.seq_global(world)
    lo, hi = case.doc_lens
    rows = []
    for b in range(case.batch):
        rng = np.random.default_rng(DOC_SEED + b)
        ends = [0]
        while ends[-1] < s_g:
            ends.append(min(s_g, ends[-1] + int(rng.integers(lo, hi + 1))))
        rows.append(np.asarray(ends, np.int64))
    return rows


def segment_ids(case: Case, world: int):
    """The case's segment ids, int32 [batch, S_global] in natural order (``packed_documents``), or None."""
    if not case.segmented:
        return None
    from ring_core.masks import segment_ids_from_cu_seqlens

    return segment_ids_from_cu_seqlens(packed_documents(case, world), case.seq_global(world))


@functools.lru_cache(maxsize=64)
def allowed_pairs(case: Case, world: int) -> np.ndarray:
    """int64 [W, W]: the (query, key) pairs the case's mask allows (ring_core.masks.allowed's rule: causal, the
    window, the documents) between rank r's queries and rank s's keys, summed over the batch, per head.

    Exact, in O(S_global * W): a query at global position i attends the keys of one run of positions, its
    document's (all, without documents) cut by the window and causality, and each rank's keys are one run of
    positions (contiguous) or two (zigzag); so each (query, rank) count is the length of the runs' overlap."""
    from ring_core import validate
    from ring_core.layout import layout_permutation

    s, s_g = case.seq_local, case.seq_global(world)
    left, right = validate.check_window(case.window_size)
    if case.causal:
        right = 0
    pos = np.arange(s_g, dtype=np.int64)
    rank_of = np.empty(s_g, np.int64)
    rank_of[layout_permutation(s_g, world, case.layout)] = np.arange(s_g) // s
    if case.layout == "zigzag":
        c = s // 2
        runs = [[(r * c, (r + 1) * c - 1), ((2 * world - 1 - r) * c, (2 * world - r) * c - 1)] for r in range(world)]
    else:
        runs = [[(r * s, (r + 1) * s - 1)] for r in range(world)]
    docs = packed_documents(case, world) if case.segmented else [np.array([0, s_g], np.int64)] * case.batch
    pairs = np.zeros((world, world), np.int64)
    for cu in docs:
        d = np.searchsorted(cu, pos, side="right") - 1  # each token's document
        lo, hi = cu[d], cu[d + 1] - 1
        if left >= 0:
            lo = np.maximum(lo, pos - left)
        if right >= 0:
            hi = np.minimum(hi, pos + right)
        for src in range(world):
            n = sum(np.clip(np.minimum(hi, b) - np.maximum(lo, a) + 1, 0, None) for a, b in runs[src])
            pairs[:, src] += np.bincount(rank_of, weights=n, minlength=world).round().astype(np.int64)
    return pairs


def pairs_per_gpu(case: Case, world: int) -> float:
    """The allowed (query, key) pairs of a rank's queries, per head, summed over the batch: the mean over ranks."""
    return float(allowed_pairs(case, world).sum()) / world


def ring_steps_needed(case: Case, world: int) -> int:
    """The most ring steps of any rank that hold a pair the mask allows (step t of rank r: rank r-t's keys)."""
    return int((allowed_pairs(case, world) > 0).sum(axis=1).max())


def summarize_times(ms) -> tuple:
    """(median, 20 % quantile, 80 % quantile) of per-call times (linear interpolation, as numpy)."""
    t = np.asarray(ms, dtype=np.float64)
    if t.size == 0:
        raise ValueError("no times to summarize")
    return float(np.median(t)), float(np.quantile(t, 0.2)), float(np.quantile(t, 0.8))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def heap_bytes_needed(cases, world: int) -> int:
    """A heap size that fits the fused kernel's receive slots for every case, the backward's (K/V and the
    float32 partial dK/dV) in fwd+bwd cases (at least the 4 GiB default)."""
    from ring_core.runtime import heap
    from ring_core import plans
    from ring_core.validate import AttentionSpec

    def need(c):
        spec = AttentionSpec(batch=c.batch, seq_local=c.seq_local, num_heads=c.heads, num_kv_heads=c.kv_heads,
                             head_dim=c.head_dim, dtype=c.dtype, scale=1.0 / math.sqrt(c.head_dim),
                             is_causal=c.causal, layout=c.layout, window=c.window_size or (-1, -1),
                             segmented=c.segmented)
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
    global problem (same batch, heads, head_dim, seq_global, causal, dtype), pass and timing. Rows with an error, or
    without TFLOP/s, are ignored as denominators.
    """
    ok = [r for r in rows if not r.get("error") and _num(r.get("tflops_per_gpu")) is not None]
    by_case = {}
    for r in ok:
        by_case.setdefault(_key(r, CASE_KEY), {}).setdefault(r["method"], []).append(_num(r["tflops_per_gpu"]))
    world1, world1_ms, tflops_of = {}, {}, {}
    for r in ok:
        if str(r.get("world")) == "1":
            world1[_key(r, SCALING_KEY)] = _num(r["tflops_per_gpu"])  # the latest row wins
            world1_ms[_key(r, WORLD1_KEY)] = _num(r.get("ms_median"))
        tflops_of[(r["method"], *_key(r, CASE_KEY))] = _num(r["tflops_per_gpu"])
    mask_at = CASE_KEY.index("mask")
    out = []
    for r in rows:
        r = dict(r)
        for col in (*RATIOS, "scaling_eff", *MASK_RATIOS):
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
            if field(r, "mask") != "none":
                dense = list(_key(r, CASE_KEY))
                dense[mask_at] = "none"
                base = tflops_of.get((r["method"], *dense))
                if base:
                    r["vs_dense"] = round(mine / base, 3)
                base_ms, ms = world1_ms.get(_key(r, WORLD1_KEY)), _num(r.get("ms_median"))
                if str(r.get("world")) != "1" and base_ms and ms:
                    r["ms_vs_world1"] = round(ms / base_ms, 3)
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
    names = {"vs_cudnn_1gpu": "cuDNN 1 GPU", "vs_context_parallel": "context_parallel", "vs_flex": "flex_attention",
             "vs_flash_attn": "flash-attn", "vs_cudnn_ring": "cuDNN ring",
             "vs_xla_ref": "xla ref", "vs_torch_ref": "torch ref", "scaling_eff": "scaling eff",
             "vs_dense": "the unmasked rate", "ms_vs_world1": "the world-1 time"}
    lines = []
    for r in rows:
        parts = [f"{_num(r[c]):.2f}x {n}" if c != "scaling_eff" else f"{n} {_num(r[c]):.2f}"
                 for c, n in names.items() if _num(r.get(c)) is not None]
        if _num(r.get("ring_steps")) is not None:
            parts.append(f"ring steps run {int(_num(r['ring_steps']))} (with allowed pairs "
                         f"{r.get('ring_steps_needed') or '?'}) of {r.get('world')}")
        if parts:
            lines.append(f"    {r['method']}: " + ", ".join(parts))
    return lines


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
        # Ranks sharing a GPU (ring_core.runtime.gpus): their rows measure the protocol, not multi-GPU speed.
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

    def timed(self, fn, ready: bool = False):
        """(milliseconds, result) of one call: CUDA events around it on the torch stream (``ready``: the second
        once the device is idle), or a host clock."""
        if self.cuda:
            return cuda_timed(self.torch, fn, ready)
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


def cuda_timed(torch, fn, ready: bool = False):
    """(milliseconds, result) of ``fn()`` between two CUDA events recorded on the current torch stream; ``ready``:
    the second recorded after ``torch.cuda.synchronize()``, once everything the call launched is done."""
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    if ready:
        torch.cuda.synchronize()
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
    that these are the fwd pass's. A packed case's segment ids (``segment_ids``, the same for every input set):
    ``local_ids``, this rank's int32 [b, s_local] in the layout's order. JAX views (zero-copy, DLPack) are made
    on first use."""

    def __init__(self, env: Env, case: Case, n_sets: int, seed: int):
        torch = env.torch
        from ring_core.layout import layout_permutation

        self.env, self.case = env, case
        dt = getattr(torch, case.dtype)
        s_g = case.seq_global(env.world)
        idx = layout_permutation(s_g, env.world, case.layout)[env.rank * case.seq_local:(env.rank + 1) * case.seq_local]
        ids = segment_ids(case, env.world)
        self.local_ids = None if ids is None else torch.as_tensor(ids[:, idx], device=env.device)
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
        """The JAX rings' per-call arguments: the local shards (and dout in fwd+bwd; then a packed case's
        segment ids) as global jax arrays sharded over the mesh axis (sequence axis 1)."""
        if self._jax_sharded is None:
            from jax.sharding import NamedSharding, PartitionSpec as P

            jax = self.env.jax
            sh = NamedSharding(self.env.mesh, P(None, AXIS))

            def glob(t):
                shape = (t.shape[0], t.shape[1] * self.env.world, *t.shape[2:])
                return jax.make_array_from_single_device_arrays(shape, sh, [self.jax_local(t)])

            ids = () if self.local_ids is None else (glob(self.local_ids),)
            self._jax_sharded = [(*(glob(t) for t in s), *ids)
                                 for s in call_args(self.local_sets, self.local_douts)]
        return self._jax_sharded


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
    ring_steps: int | None = None  # fused: the most ring steps any rank's kernel ran in the last timed call


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


def _attempt(env, args, case, name, build, data, anchor, **kw) -> Result:
    """Build (``build``: the method's builder, peers.BUILDERS), first call (checked against the anchor),
    warm-up and timed calls of one method. Every rank takes part in the same collectives whatever fails
    where, so that no rank waits for a skipped one."""
    res = Result()
    stack = contextlib.ExitStack()
    prep = err = None
    try:
        try:
            prep = build(env, args, case, data, stack, **kw)
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
        stream = getattr(args, "timing", "call") == "stream"
        if stream:
            if not env.flag_max(status):  # all ranks meet once; then the calls run back to back
                try:
                    ms, out = env.timed(lambda: _run_all(prep, args.iters))
                    del out
                    times.append(ms / args.iters)
                except Exception as e:  # noqa: BLE001
                    err, status = _fmt_exc(e), 1
        ready = getattr(args, "timing", "call") == "ready"
        for it in range(0 if stream else args.iters):
            if env.flag_max(status):  # all ranks meet before every timed call, and stop together
                break
            try:
                ms, out = env.timed(lambda: prep.run(it), ready)
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
        if prep.ring_steps is not None:  # the same builder on every rank: all of them or none take part
            steps = -1
            try:
                steps = prep.ring_steps()
            except Exception as e:  # noqa: BLE001 - a missing count is a note, not a failed timing
                res.note = f"{res.note}; ring steps unreadable: {_fmt_exc(e)}".lstrip("; ")
            steps = env.all_max([steps])[0]
            res.ring_steps = int(steps) if steps >= 0 else None
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


def _run_all(prep, iters: int):
    """``iters`` calls back to back (input sets rotating); the last one's result (the others are dropped as
    soon as the next call is issued). All but the last through ``prep.issue`` where a method has one (JAX: no
    wait for each result); the last through ``prep.run``, which waits for it as every timed call does."""
    issue = prep.issue or prep.run
    for it in range(iters - 1):
        issue(it)
    return prep.run(iters - 1)


def run_method(env, args, case, name, build, data, anchor) -> Result:
    res = _attempt(env, args, case, name, build, data, anchor)
    if (res.error and res.phase in ("build", "first call") and name in GQA_RETRY and env.cuda
            and case.heads != case.kv_heads):
        env.print(f"  {name}: with enable_gqa: {res.error}; retrying with K/V heads repeated")
        first = res.error
        res = _attempt(env, args, case, name, build, data, anchor, repeat_kv=True)
        res.note = f"{res.note}; K/V heads repeated (enable_gqa failed: {first[:160]})"
    return res


def _compared(names) -> str:
    """What the diff covers, after the anchor's name in ``diff_vs``: nothing for the output, else the gradients."""
    return "" if tuple(names) == ("out",) else f" ({','.join(names)})"


def make_row(env, args, case, name, res: Result, meta: dict, anchor_name) -> dict:
    info = METHODS[name]
    fl = flops_per_gpu(case, env.world)
    note = f"{SHARED_NOTE}; {res.note}" if env.ranks_per_gpu > 1 else res.note
    share = os.environ.get(gpus.MPS_SHARE_ENV, "")
    if share and share != "100":  # a rank held to part of the SMs (MPS): a world-1 row to compare shared ranks with
        note = f"{note}; {SM_SHARE_NOTE.format(share=share)}".lstrip("; ")
    pairs = allowed_pairs(case, env.world).sum(axis=1)
    if case.mask != "none" and pairs.max() > 1.01 * pairs.mean():
        note = f"{note}; allowed pairs per rank max/mean {pairs.max() / pairs.mean():.2f}".lstrip("; ")
    row = dict(meta, method=name, framework=info.framework, kind=info.kind, world=env.world,
               ranks_per_gpu=env.ranks_per_gpu, batch=case.batch,
               heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim, seq_local=case.seq_local,
               seq_global=case.seq_global(env.world), causal=int(case.causal), layout=case.layout, dtype=case.dtype,
               mask=case.mask_label, flops_per_gpu=f"{fl:.6g}", pairs_per_gpu=f"{pairs_per_gpu(case, env.world):.6g}",
               ring_steps_needed=ring_steps_needed(case, env.world),
               iters=args.iters, warmup=args.warmup, input_sets=args.input_sets,
               timing=getattr(args, "timing", "call"), shape=res.shape, note=note, error=res.error or "",
               **{"pass": case.mode})
    if res.ring_steps is not None:
        row["ring_steps"] = res.ring_steps
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
    """Time ``methods`` ({name: builder}, in METHODS order) on one case; rows go to ``log`` (rank 0) and back."""
    env.print(f"\n== {case.label()}, W={env.world} (S_global {case.seq_global(env.world)}), "
              f"{flops_per_gpu(case, env.world) / 1e12:.3f} TFLOP per GPU"
              + ("" if case.mask == "none" else f" (the allowed pairs only: {pairs_per_gpu(case, env.world):.4g} "
                 f"per head per GPU; ring steps holding one: {ring_steps_needed(case, env.world)} of {env.world})"))
    todo = []
    for name in methods:
        if METHODS[name].kind == "reference" and case.seq_local > args.ref_max_seq:
            env.print(f"  {name:17s} skipped: seq_local > --ref-max-seq {args.ref_max_seq}")
            continue
        if case.mask != "none" and not METHODS[name].masks:
            env.print(f"  {name:17s} skipped: takes no segment ids or windows")
            continue
        if METHODS[name].world1 and env.world > 1:
            env.print(f"  {name:17s} skipped: the whole sequence in one process (world size 1 only)")
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
        res = run_method(env, args, case, name, methods[name], data, anchor)
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
