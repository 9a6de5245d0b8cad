"""The kernel variants a GPU run compiles, worked out here, with no GPU, so that Triton's cache can be filled
ahead of a device call.

The GPU machine starts every call with a cold cache, and its stages compile one variant after another, each rank
on its own: most of a stage's time (the W=4 checks were compile-bound). A variant is decided by the
launch plan (ring_core.plans: constexprs, argument types, Triton's specialisation of the integer scalars), and the
plan by the spec, the world size and the heap. So the variants of a script's tables can be listed from the
tables themselves:

    python tools/gpu_variants.py --nproc 4 checks-all soak > /tmp/variants.jsonl   # or --out FILE

writes one compile-log record per variant (ring_core.runtime.build's format, tagged ``stage@nproc`` like the GPU
session's log), and ``python -m ring_core.runtime.build --warm /tmp/variants.jsonl`` compiles them into Triton's cache.
A cache filled on another machine serves the GPU machine when ``python -m ring_core.runtime.build --identity`` prints
the same line on both (same Triton wheel, same Python minor version, same ptxas); tools/gpu_session.py carries it
over (``--pack``). Variants a script compiles that are not listed here are compiled by the run, as before.

Stages are tools/gpu_session.py's: the variants of their tests/gpu/gpu_checks.py commands (with the sections those
run; not the ``launch`` section's test kernel), tests/gpu/gpu_faults.py commands (with their sections),
tests/gpu/gpu_soak.py commands (its defaults) and benchmarks/attention.py's fused methods (its cases, as its arguments
give them); other scripts' variants are compiled when they run. Plans are made as on the
GPU machine's H200 (``GPU_CAPABILITY``: the Gluon forward where it applies). The session's ``warm`` stage compiles
these too.

What stays on the GPU machine: jaxlib compiles each variant's PTX with ptxas in every process at its first JAX
launch (its Triton custom call takes PTX, not the cubin), 10-80 s a variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ring_core.runtime import build
from ring_core.protocol import control  # noqa: E402
from ring_core import plans, validate  # noqa: E402

CHECKS_SECTIONS = ("cases", "gluon", "jit", "grads", "bwd", "gluon-bwd", "gluon-bwd-masks", "masks", "kv-ids", "soak",
                   "big")
GPU_CAPABILITY = (9, 0)  # the GPU machine's H200: its plans pick the Gluon forward where it applies


def spec_of(B, S, H, HKV, D, dtype, causal, layout, *, window=None, segmented=False) -> validate.AttentionSpec:
    """The spec of a call on this rank's shards [B, S, H|HKV, D] (as both frontends validate it)."""
    return validate.check_attention_args(
        (B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dtype, dtype, dtype, is_causal=causal, scale=None, layout=layout,
        backend="fused", backends=("fused",), window_size=window,
        segment_ids_shape=(B, S) if segmented else None, segment_ids_dtype="int32" if segmented else None)


def heap_layout(heap_bytes: int) -> control.HeapLayout:
    """The layout of a heap of ``heap_bytes`` (ring_core.runtime.heap.SymmetricHeap's workspace; where the workspace
    sits in the heap does not change the capacities a plan reads)."""
    return control.HeapLayout.for_workspace(heap_bytes - control.HEAP_SLACK)


def records(calls, world: int, heap_bytes: int, tag: str) -> list:
    """One record per distinct variant of ``calls``: (spec, backward[, capability[, deterministic]]) tuples,
    planned as on the GPU machine (``GPU_CAPABILITY``; a third item None: the tl kernels, as with
    RING_ATTENTION_GLUON=0; a fourth, the backward's ``deterministic``, default False as the frontends'); a backward
    call also runs the forward."""
    lay, recs = heap_layout(heap_bytes), []
    for spec, backward, *rest in calls:
        capability = rest[0] if rest else GPU_CAPABILITY
        deterministic = rest[1] if len(rest) > 1 else False
        spec = plans.kernel_spec(spec, capability)  # as the frontends pad it
        ps = [plans.plan(spec, world, lay, capability=capability)] + (
            [plans.plan_bwd(spec, world, lay, capability=capability, deterministic=deterministic)] if backward else [])
        recs += [p.compile_record(tag=tag) for p in ps]
    return distinct(recs)


def distinct(recs) -> list:
    """``recs`` with each variant once (the first seen)."""
    out, seen = [], set()
    for rec in recs:
        key = build.variant_key(rec)
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def checks_calls(world: int, sections=CHECKS_SECTIONS, mask_cases=None) -> list:
    """(spec, backward) of the fused calls of tests/gpu/gpu_checks.py's ``sections`` (``mask_cases``: the indices
    of the masks section's cases it runs, None: all)."""
    import gpu_checks as g

    calls = []
    if "cases" in sections:
        calls += [(spec_of(*c[:8]), False) for c in g.CASES]
    if "gluon" in sections:  # the Gluon kernel, then the tl kernel on the same call (RING_ATTENTION_GLUON=0)
        calls += [(spec_of(*c[:8]), False, cap) for c in g.GLUON_CASES for cap in (GPU_CAPABILITY, None)]
        calls += [(spec_of(*c[:8], window=c[8], segmented=c[9] is not None), False, cap) for c in g.GLUON_MASK_CASES
                  for cap in (GPU_CAPABILITY, None)]
    if "jit" in sections:
        calls += [(spec_of(*c), False) for c in g.JIT_CASES]
    if "grads" in sections:
        calls.append((spec_of(*g.GRADS_CASE), True))
    if "bwd" in sections:  # its cases deterministic; the big grid with the default (the Gluon backward)
        calls += [(spec_of(*c[:8]), True, GPU_CAPABILITY, True) for c in g.BWD_CASES] + [(spec_of(*g.BWD_BIG), True)]
    if "gluon-bwd" in sections:
        calls += [(spec_of(*c[:8]), True) for c in g.GLUON_BWD_CASES]
    if "gluon-bwd-masks" in sections:  # deterministic=False: the Gluon backward
        calls += [(spec_of(*c[:8], window=c[8], segmented=c[9] is not None), True) for c in g.GLUON_BWD_MASK_CASES]
    if "masks" in sections:
        chosen = range(len(g.MASK_CASES)) if mask_cases is None else mask_cases
        calls += [(spec_of(*c[:8], window=c[8], segmented=c[9] is not None), True, GPU_CAPABILITY, True)
                  for c in (g.MASK_CASES[i] for i in chosen)]
    if "kv-ids" in sections:
        calls += [(dataclasses.replace(spec_of(*c, False, "contiguous", segmented=True), kv_ids=True), True,
                   GPU_CAPABILITY, det) for c in g.KV_IDS_CASES for det in (False, True)]  # both backwards
    if "soak" in sections:
        calls += [(spec_of(*c), False) for c in g.SOAK_SHAPES]
    if "big" in sections:
        calls.append((spec_of(*g.BIG), False))
    return calls


def soak_calls(world: int, seed: int = 2026, pool: int = 12, variants: int = 4) -> list:
    """(spec, backward) of tests/gpu/gpu_soak.py's calls with its defaults (its gradient calls are on the pool's
    first variant's configurations)."""
    import gpu_soak as s

    configs = s.plan(seed, pool, variants)
    calls = [(spec_of(*c), i % variants == 0) for i, c in enumerate(configs)]
    return calls + [(spec_of(*s.big_case(world)), False)]


def faults_calls(sections=("timeout", "mismatch", "bad_inputs", "kill")) -> list:
    """(spec, backward) of tests/gpu/gpu_faults.py's fused calls that run to the end (its sections' shapes; the
    concurrent section needs NCCL between ranks, which ranks sharing a GPU lack, and launches there only)."""
    bf = ("bfloat16",)
    calls = []
    if {"timeout", "mismatch", "kill"} & set(sections):
        calls += [(spec_of(1, 256, 4, 2, 64, *bf, False, "contiguous"), False)]
    if "mismatch" in sections:  # rank 1's JAX call is causal (mismatched: raises); its torch call has 320 rows
        calls += [(spec_of(1, 256, 4, 2, 64, *bf, True, "contiguous"), False),
                  (spec_of(1, 320, 4, 2, 64, *bf, False, "contiguous"), False)]
    if "bad_inputs" in sections:  # the right calls after each table row, strided inputs, NaN in k (batch 2)
        calls += [(spec_of(1, 64, 4, 2, 16, "float32", True, "zigzag"), False),
                  (spec_of(2, 64, 4, 2, 16, "float32", True, "zigzag"), False)]
    return calls


def nodes_calls(sections=("checks", "soak"), world: int = 4, node_size: int = 2, cases=None,
                packed: bool = False) -> list:
    """(spec, backward, capability, deterministic) of tests/gpu/gpu_nodes.py's one-node calls inside the two-level
    ring of ``world`` ranks as nodes of ``node_size`` (ring_core.nodes.node_specs of each case, ``cases`` its
    indices or None for all: the node's own K/V, another node's, the half-shard steps, a window's pieces; the
    faults section's case 0 and its non-causal call, the timing's case, with segment ids where ``packed``), each
    backward in both orders (its checks run deterministic=True too; the soak only that)."""
    import gpu_nodes

    from ring_core import nodes

    chosen = [c for i, c in enumerate(gpu_nodes.CASES) if cases is None or i in cases]
    faults = [gpu_nodes.CASES[0], gpu_nodes.CASES[0][:6] + (False, "contiguous") + gpu_nodes.CASES[0][8:]]
    cases = (chosen if "checks" in sections else []) + (faults if "faults" in sections else []) + (
        [gpu_nodes.SOAK_CASE] if "soak" in sections else []) + (
        [gpu_nodes.TIMING_CASE[:8] + (packed, None)] if "timing" in sections else [])
    return [(sp, True, GPU_CAPABILITY, det) for c in cases
            for sp in nodes.node_specs(spec_of(*c[:8], segmented=c[8], window=c[9]), world // node_size, node_size)
            for det in (False, True)]


def _option(cmd, flag: str, default=None):
    return cmd[cmd.index(flag) + 1] if flag in cmd else default


def command_records(cmd, nproc: int, tag: str) -> list:
    """The records of one command line of a GPU session stage (tools/gpu_session.py's STAGES) at ``nproc``
    ranks: tests/gpu/gpu_checks.py with its ``--sections`` and ``--mask-cases``, tests/gpu/gpu_faults.py with its
    ``--sections``, tests/gpu/gpu_soak.py with its defaults and benchmarks/attention.py's fused methods
    (``bench_records``); none for other scripts (they compile at run time). A command that names its own rank count
    (``--nproc-per-node``: LAUNCH1's one rank, bench-window-share's lone rank) is counted at that."""
    nproc = int(_option(cmd, "--nproc-per-node", nproc))
    if "tests/gpu/gpu_checks.py" in cmd:
        sections = _option(cmd, "--sections", ",".join(CHECKS_SECTIONS)).split(",")
        masks = _option(cmd, "--mask-cases")
        masks = None if masks is None else [int(i) for i in masks.split(",") if i.strip()]
        heap = int(float(_option(cmd, "--heap-gib", 8)) * (1 << 30))
        return records(checks_calls(nproc, sections, masks), nproc, heap, tag)
    if "tests/gpu/gpu_faults.py" in cmd:
        import gpu_faults

        sections = _option(cmd, "--sections", gpu_faults.DEFAULT_SECTIONS).split(",")
        heap = int(float(_option(cmd, "--heap-gib", 2)) * (1 << 30))
        return records(faults_calls(sections), nproc, heap, tag)
    if "tests/gpu/gpu_nodes.py" in cmd:  # the fused calls run over a node's ranks (RING_ATTENTION_NODE_SIZE=R)
        from ring_core import settings

        size = [a.split("=", 1)[1] for a in cmd if a.startswith(settings.NODE_SIZE + "=")]
        sections = _option(cmd, "--sections", "checks,timing,soak").split(",")
        node_size = int(size[0]) if size else nproc
        cases = _option(cmd, "--cases")
        cases = None if cases is None else {int(c) for c in cases.split(",")}
        return records(nodes_calls(sections, nproc, node_size, cases, "--packed" in cmd), node_size,
                       settings.DEFAULT_HEAP_BYTES, tag)
    if "tests/gpu/gpu_soak.py" in cmd:
        heap = int(float(_option(cmd, "--heap-gib", 4)) * (1 << 30))
        return records(soak_calls(nproc), nproc, heap, tag)
    if "benchmarks.attention" in cmd:
        gluon = f"{plans.GLUON_ENV}=0" not in cmd  # a stage that turns the Gluon forward off (env VAR=0 ...)
        return bench_records(cmd[cmd.index("benchmarks.attention") + 1:], nproc, tag,
                             GPU_CAPABILITY if gluon else None)
    return []


# Each fused method: (sticky errors, deterministic backward).
FUSED_METHODS = {"torch_fused": (False, False), "jax_fused": (False, False), "jax_fused_deferred": (True, False),
                 "jax_fused_call": (False, False), "torch_fused_det": (False, True), "jax_fused_det": (False, True)}


def bench_records(argv, nproc: int, tag: str, capability=GPU_CAPABILITY) -> list:
    """The records of benchmarks/attention.py's fused launches with these arguments at ``nproc`` ranks: its cases
    (every shape, mask and pass), through each fused method asked for (JAX with the check left out compiles with
    sticky errors; the ``_det`` ones plan the deterministic backward); the forward of every case, the backward of
    fwd+bwd ones; the forwards planned for a GPU of ``capability`` (None: the tl kernel, as with
    RING_ATTENTION_GLUON=0)."""
    from benchmarks import attention, harness

    args = attention.parse_args([a for a in argv if not a.startswith("{")] + ["--csv", "/dev/null"])
    methods = [m for m in attention.select_methods(args, nproc) if m in FUSED_METHODS]
    cases = attention.enumerate_cases(args, nproc)
    if not methods or not cases:
        return []
    lay = heap_layout(args.heap_bytes or harness.heap_bytes_needed(cases, nproc))
    recs = []
    for c in cases:
        spec = spec_of(c.batch, c.seq_local, c.heads, c.kv_heads, c.head_dim, c.dtype, c.causal, c.layout,
                       window=c.window if c.mask == "window" else None, segmented=c.segmented)
        spec = plans.kernel_spec(spec, capability)  # as the frontends pad it
        for m in methods:
            sticky, det = FUSED_METHODS[m]
            ps = [plans.plan(spec, nproc, lay, capability=capability)]
            if c.mode != "fwd":
                ps.append(plans.plan_bwd(spec, nproc, lay, capability=capability, deterministic=det))
            recs += [p.compile_record(sticky_errors=sticky, tag=tag) for p in ps]
    return distinct(recs)


def stage_records(stage: str, nproc: int) -> list:
    """The records of a GPU session stage at ``nproc`` ranks, tagged as its compile log tags them."""
    import gpu_session

    tag = gpu_session.tag(stage, nproc)
    return [r for cmd in gpu_session.commands(stage, 1.0, "OUT", nproc) for r in command_records(cmd, nproc, tag)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, action="append", required=True,
                    help="ranks (the world size is a constexpr); repeat for several")
    ap.add_argument("--stages", default="", help="comma list of tools/gpu_session.py stage names")
    ap.add_argument("more", nargs="*", help="more stage names")
    ap.add_argument("--out", default=None, help="write the records here (default: stdout)")
    a = ap.parse_args(argv)
    stages = [x for x in a.stages.split(",") if x] + a.more
    recs = [r for nproc in a.nproc for stage in stages for r in stage_records(stage, nproc)]
    lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs)
    if a.out:
        with open(a.out, "w") as f:
            f.write(lines)
    else:
        sys.stdout.write(lines)
    print(f"{len(recs)} variants of {', '.join(stages) or 'no stage'} at {a.nproc} ranks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
