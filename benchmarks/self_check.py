"""The attention benchmark's own checks, on a CPU, no GPU and no launcher: ``python -m benchmarks.attention
--self-check`` (tests/cpu/test_bench_harness.py runs it).

What a GPU run's numbers rest on and a CPU can check: FLOP counts and the single-GPU share, quantiles, the exact
count of the pairs a mask allows (against ring_core.masks.allowed, the one rule), the packed documents, arguments
and cases, the heap size, ratio columns (keyed by pass, timing and mask), the CSV log (and CSVs older than its newer
columns), the gradient check's bookkeeping, how the torch peers call SDPA, the plot's grouping and table, the timing
modes' order of events, and the pure-JAX cuDNN-style ring (its LSE merge and its autodiff, here with dense XLA
blocks) against dense attention on a mesh of host devices.

Each check prints ``ok NAME`` or ``FAIL NAME`` with the assertion that failed; the last line counts them, and the exit
status is 1 if any failed. ``--self-check NAME`` runs the checks whose names contain NAME.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import math
import os
import re
import sys
import tempfile
import time
import traceback
import types

import numpy as np

HOST_DEVICES = 4  # the mesh checks' largest world: XLA's host platform is asked for this many devices
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def approx(a, b, rel=1e-6, abs_=1e-12) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=abs_)


@contextlib.contextmanager
def raises(exc, match: str | None = None):
    """Like pytest.raises: the block must raise ``exc`` (its message matching ``match``); argparse's usage
    message on stderr is swallowed."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    except exc as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{type(e).__name__}({e}) does not match {match!r}") from None
        return
    raise AssertionError(f"{exc.__name__} not raised")


def _modules():
    from benchmarks import attention, harness, peers, plot

    return attention, harness, peers, plot


# ------------------------------------------------------------------------------------------ FLOPs


@check
def flops_per_gpu_counts_the_rank_rectangle_and_half_when_causal():
    _, harness, _, _ = _modules()
    full = harness.Case(1, 32, 32, 128, 4096, False, "bfloat16")
    assert harness.flops_per_gpu(full, 2) == 4 * 32 * 4096 * 8192 * 128
    causal = harness.Case(1, 32, 8, 128, 4096, True, "bfloat16")
    assert harness.flops_per_gpu(causal, 2) == 2 * 32 * 4096 * 8192 * 128  # GQA does not change the FLOPs


@check
def single_gpu_share_has_the_ring_rank_flops():
    _, harness, peers, _ = _modules()
    for world in (1, 2, 4):
        for causal in (False, True):
            for kv_heads in (32, 8):
                case = harness.Case(1, 32, kv_heads, 64, 2048, causal, "float16")
                for rank in range(world):
                    prob = peers.limit_problem(case, world, rank)
                    assert prob.flops(case.batch, case.head_dim) == harness.flops_per_gpu(case, world)
                    assert prob.causal == causal and prob.q_heads // prob.kv_heads == 32 // kv_heads
                    if causal:  # H/W heads over the whole sequence; rank r takes the r-th slice of heads
                        assert (prob.q_len, prob.kv_len, prob.head_offset) == (2048 * world, 2048 * world,
                                                                                rank * 32 // world)
                    else:  # the rank's own queries against every key
                        assert (prob.q_len, prob.kv_len, prob.q_heads) == (2048, 2048 * world, 32)
    with raises(harness.Unavailable, match="divisible"):
        peers.limit_problem(harness.Case(1, 32, 1, 64, 1024, True, "bfloat16"), 2)  # MQA: 1 kv head for 2 GPUs


@check
def fwd_bwd_counts_three_and_a_half_forwards():
    _, harness, peers, _ = _modules()
    for causal in (False, True):
        fwd = harness.Case(2, 32, 8, 128, 4096, causal, "bfloat16")
        step = harness.Case(2, 32, 8, 128, 4096, causal, "bfloat16", "fwd+bwd")
        assert harness.flops_per_gpu(step, 2) == 3.5 * harness.flops_per_gpu(fwd, 2)
        assert harness.flops_per_gpu(step, 2) == 3.5 * 4 * 2 * 32 * 4096 * 8192 * 128 / (2 if causal else 1)
        for rank in range(2):  # the single-GPU share keeps the ring rank's FLOPs in fwd+bwd too
            prob = peers.limit_problem(step, 2, rank)
            assert prob.flops(step.batch, step.head_dim, step.mode) == harness.flops_per_gpu(step, 2)
        assert "fwd+bwd" in step.label() and step.label().replace("fwd+bwd", "fwd") == fwd.label()


@check
def summarize_times_median_and_quantiles():
    _, harness, _, _ = _modules()
    assert harness.summarize_times([5.0, 1.0, 4.0, 2.0, 3.0]) == (3.0, 1.8, 4.2)
    assert approx(harness.tflops(1e12, 1000.0), 1.0)
    with raises(ValueError):
        harness.summarize_times([])


# ------------------------------------------------------------------------------- masks: exact pair counts


def _pairs_by_rule(harness, case, world):
    """[W, W] allowed pairs counted from ring_core.masks.allowed's boolean mask (the one rule), rank by rank."""
    from ring_core import masks, validate
    from ring_core.layout import global_positions

    ids = harness.segment_ids(case, world)
    out = np.zeros((world, world), np.int64)
    for r in range(world):
        qp = global_positions(np, r, world, case.seq_local, case.layout)
        for s in range(world):
            kp = global_positions(np, s, world, case.seq_local, case.layout)
            m = masks.allowed(qp, kp, is_causal=case.causal, window=validate.check_window(case.window_size),
                              q_segment_ids=None if ids is None else ids[:, qp],
                              k_segment_ids=None if ids is None else ids[:, kp])
            out[r, s] = (qp.size * kp.size * case.batch if m is None
                         else int(np.broadcast_to(m, (case.batch, 1, 1, qp.size, kp.size) if ids is not None
                                                  else m.shape).sum() * (1 if ids is not None else case.batch)))
    return out


@check
def allowed_pairs_are_exact():
    """The benchmark's pair count (its FLOPs for masked cases, its ring_steps_needed) equals the count of
    ring_core.masks.allowed's mask, for every (query rank, key rank), batch rows with their own documents."""
    _, harness, _, _ = _modules()
    masked = [(True, "packed", (-1, -1), (5, 40)), (False, "packed", (-1, -1), (1, 70)),
              (True, "window", (23, 0), (5, 40)), (False, "window", (30, 7), (5, 40)),
              (False, "window", (-1, 0), (5, 40)), (True, "none", (-1, -1), (5, 40)),
              (False, "none", (-1, -1), (5, 40))]
    for world in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            for causal, mask, window, doc_lens in masked:
                case = harness.Case(2, 4, 2, 16, 36, causal, "bfloat16", mask=mask, window=window, doc_lens=doc_lens,
                                    layout=layout)
                got = harness.allowed_pairs(case, world)
                assert got.dtype == np.int64 and got.shape == (world, world)
                np.testing.assert_array_equal(got, _pairs_by_rule(harness, case, world), err_msg=case.label())
                assert harness.pairs_per_gpu(case, world) == got.sum() / world
                assert harness.ring_steps_needed(case, world) == (got > 0).sum(axis=1).max()


@check
def packed_documents_are_fixed_and_counted_into_the_flops():
    _, harness, _, _ = _modules()
    case = harness.Case(2, 32, 8, 128, 16384, True, "bfloat16", mask="packed")
    docs = harness.packed_documents(case, 2)
    assert len(docs) == 2 and all(d[0] == 0 and d[-1] == 32768 for d in docs)
    lens = np.concatenate([np.diff(d)[:-1] for d in docs])  # the last one of a row is cut at the end
    assert lens.min() >= 512 and lens.max() <= 8192
    assert not np.array_equal(docs[0][:3], docs[1][:3])  # each row its own documents ...
    again = harness.packed_documents(case, 2)
    assert all(np.array_equal(a, b) for a, b in zip(docs, again))  # ... the same in every run
    w1 = harness.packed_documents(dataclasses.replace(case, batch=1), 1)[0]  # a shorter sequence: a prefix
    np.testing.assert_array_equal(w1[:-1], docs[0][:len(w1) - 1])
    ids = harness.segment_ids(case, 2)
    assert ids.shape == (2, 32768) and ids.dtype == np.int32 and (ids >= 0).all()
    assert harness.segment_ids(dataclasses.replace(case, mask="none"), 2) is None
    # Effective FLOPs: 4 * H * D * (allowed pairs per rank, mean over ranks), x 3.5 in fwd+bwd
    pairs = harness.allowed_pairs(case, 2)
    assert harness.flops_per_gpu(case, 2) == 4 * 32 * 128 * pairs.sum() / 2
    step = dataclasses.replace(case, mode="fwd+bwd")
    assert approx(harness.flops_per_gpu(step, 2), 3.5 * harness.flops_per_gpu(case, 2))
    dense = dataclasses.replace(case, mask="none")
    assert harness.flops_per_gpu(dense, 2) == 2 * 2 * 32 * 16384 * 32768 * 128  # B=2; the dense convention is kept
    share = harness.flops_per_gpu(case, 2) / harness.flops_per_gpu(dense, 2)
    assert 0.1 < share < 0.3  # documents of 512-8192 tokens keep a small share of 32k causal pairs
    assert "packed(512-8192)" in case.label() and case.mask_label == "packed(512-8192)"
    assert case.layout == "zigzag" and case.window_size is None and case.segmented


@check
def causal_window_per_rank_work_and_ring_steps():
    """A causal window of 4096 tokens, contiguous, seq_local 16k: every rank but the first holds 16384 x 4096 pairs
    (+ the diagonal) and reaches one neighbour; a world of one does less (its first 4096 queries see fewer keys)."""
    _, harness, _, _ = _modules()
    case = harness.Case(1, 32, 32, 128, 16384, True, "bfloat16", mask="window", window=(4095, 0), layout="contiguous")
    for world in (2, 4, 8):
        pairs = harness.allowed_pairs(case, world)
        assert pairs[1].sum() == 16384 * 4096 and pairs[1, 0] == 4095 * 4096 // 2  # 1 + ... + 4095 from rank 0
        assert harness.ring_steps_needed(case, world) == 2
    one = harness.allowed_pairs(case, 1).sum()
    assert one == 4096 * 4097 // 2 + (16384 - 4096) * 4096
    assert approx(16384 * 4096 / one, 1.143, rel=0, abs_=1e-3)
    assert case.window_size == (4095, 0) and "contiguous window(4095,0)" in case.label()
    assert harness.ring_steps_needed(dataclasses.replace(case, layout="zigzag"), 4) == 3  # both zigzag neighbours


# ---------------------------------------------------------------------------------- arguments, cases


@check
def mask_arguments():
    cli, harness, _, _ = _modules()
    a = cli.parse_args(["--mask", "none, packed,none", "--doc-lens", "100-200", "--window", "63,0", "--seq", "1k",
                        "--causal", "yes", "--pass", "fwd,fwd+bwd"])
    cases = cli.enumerate_cases(a, 2)
    assert [(c.mask, c.mode) for c in cases] == [("none", "fwd"), ("none", "fwd+bwd"), ("packed", "fwd"),
                                                 ("packed", "fwd+bwd")]
    assert cases[2].doc_lens == (100, 200) and cases[0].doc_lens == (512, 8192) and cases[0].layout == "zigzag"
    w = cli.enumerate_cases(cli.parse_args(["--mask", "window", "--layout", "contiguous", "--seq", "1001",
                                            "--causal", "yes"]), 2)
    assert [(c.mask, c.window_size, c.layout, c.seq_local) for c in w] == [("window", (4095, 0), "contiguous", 1001)]
    assert cli.parse_args(["--cpu-smoke"]).doc_lens == (8, 40) and cli.parse_args([]).masks == ["none"]
    with raises(SystemExit, match="even"):
        cli.enumerate_cases(cli.parse_args(["--mask", "window", "--layout", "zigzag", "--seq", "1001"]), 2)
    for bad in (["--mask", "sparse"], ["--window", "4096"], ["--window", "-2,0"], ["--doc-lens", "9-3"],
                ["--doc-lens", "x"], ["--layout", "ring"]):
        with raises(SystemExit):
            cli.parse_args(bad)
    assert {m for m, i in harness.METHODS.items() if i.masks} == {
        "torch_fused", "jax_fused", "jax_fused_deferred", "jax_fused_call", "torch_fused_det", "jax_fused_det",
        "torch_ref", "jax_xla", "torch_flex", "torch_flash_attn"}
    assert {m for m, i in harness.METHODS.items() if i.world1} == {"torch_flex", "torch_flash_attn"}


@check
def defaults_are_the_target_set():
    cli, harness, _, _ = _modules()
    a = cli.parse_args([])
    cases = cli.enumerate_cases(a, 2)
    assert len(cases) == 8
    assert {(c.batch, c.heads, c.kv_heads, c.head_dim, c.dtype) for c in cases} == {(1, 32, 32, 128, "bfloat16")}
    assert sorted({c.seq_local for c in cases}) == [4096, 8192, 16384, 32768]
    assert {c.causal for c in cases} == {False, True}
    assert {c.layout for c in cases if c.causal} == {"zigzag"}
    assert (a.warmup, a.iters, a.input_sets, a.ref_max_seq) == (2, 10, 3, 8192)
    assert a.passes == ["fwd"] and {c.mode for c in cases} == {"fwd"}
    assert a.csv.startswith("benchmarks/results/attention_")
    assert cli.select_methods(a, 2) == list(harness.METHODS)
    assert cli.select_methods(a, 1) == [m for m in harness.METHODS if m in cli.WORLD1_METHODS]


@check
def every_axis_is_selectable():
    cli, _, _, _ = _modules()
    a = cli.parse_args(["--seq", "4k,8k", "--kv-heads", "32,8", "--head-dim", "64,128", "--dtype", "bf16,fp16",
                        "--causal", "yes", "--methods", "jax_fused,torch_cp,torch_fused", "--framework", "torch"])
    cases = cli.enumerate_cases(a, 2)
    assert len(cases) == 2 * 2 * 2 * 2
    assert {c.seq_local for c in cases} == {4096, 8192} and all(c.causal for c in cases)
    assert {c.dtype for c in cases} == {"bfloat16", "float16"} and {c.kv_heads for c in cases} == {32, 8}
    assert cli.select_methods(a, 2) == ["torch_fused", "torch_cp"]  # METHODS order, jax filtered out


@check
def pass_option_runs_each_shape_in_each_pass():
    cli, _, _, _ = _modules()
    a = cli.parse_args(["--seq", "4k,16k", "--causal", "yes", "--pass", "fwd, fwd+bwd,fwd"])
    assert a.passes == ["fwd", "fwd+bwd"]  # spaces and repeats tolerated
    cases = cli.enumerate_cases(a, 2)
    assert [(c.seq_local, c.mode) for c in cases] == [(4096, "fwd"), (4096, "fwd+bwd"), (16384, "fwd"),
                                                      (16384, "fwd+bwd")]
    assert [c.mode for c in cli.enumerate_cases(cli.parse_args(["--pass", "fwd+bwd"]), 2)] == ["fwd+bwd"] * 8
    assert "--pass" in cli.build_parser().format_help()


@check
def bad_arguments_are_refused():
    cli, _, _, _ = _modules()
    for argv in (["--methods", "nope"], ["--dtype", "fp32"], ["--heads", "32", "--kv-heads", "5"], ["--seq", "4x"],
                 ["--warmup", "0"], ["--world1", "1"], ["--pass", "bwd"], ["--pass", "fwd,"], ["--pass", ""]):
        with raises(SystemExit):
            cli.parse_args(argv)


@check
def world1_runs_the_global_problems_on_one_process():
    cli, _, _, _ = _modules()
    a = cli.parse_args(["--world1", "2", "--causal", "no"])
    assert [c.seq_local for c in cli.enumerate_cases(a, 1)] == [8192, 16384, 32768, 65536]
    with raises(SystemExit, match="one process"):
        cli.enumerate_cases(a, 2)
    with raises(SystemExit, match="even"):
        cli.enumerate_cases(cli.parse_args(["--seq", "4097", "--causal", "yes"]), 2)


@check
def cpu_smoke_defaults_are_tiny_and_run_every_method():
    cli, harness, _, _ = _modules()
    a = cli.parse_args(["--cpu-smoke"])
    assert max(c.seq_local for c in cli.enumerate_cases(a, 2)) <= 128 and a.csv is None
    assert a.passes == ["fwd", "fwd+bwd"]  # the smoke covers the backward path too
    assert cli.select_methods(a, 1) == list(harness.METHODS)


@check
def heap_covers_the_largest_case():
    from ring_core import plans
    from ring_core.runtime import heap

    _, harness, _, _ = _modules()
    small = [harness.Case(1, 32, 32, 128, 4096, False, "bfloat16")]
    assert harness.heap_bytes_needed(small, 2) == heap.DEFAULT_HEAP_BYTES
    big = [harness.Case(1, 32, 32, 128, 1 << 20, False, "bfloat16")]
    need = 2 * (1 << 20) * 32 * 128 * 2
    assert harness.heap_bytes_needed(big, 2) == plans.heap_bytes_for(need) > need
    # the backward also receives float32 partial dK/dV: K/V (2 bytes) + partials (4 bytes) per element
    big_step = [harness.Case(1, 32, 32, 128, 1 << 20, False, "bfloat16", "fwd+bwd")]
    with_step = harness.heap_bytes_needed(big + big_step, 2)
    assert with_step >= plans.heap_bytes_for(need * 3) > harness.heap_bytes_needed(big, 2)


# ------------------------------------------------------------------------------------- ratios, CSV


def _row(method, tflops, world=2, seq_local=4096, run="r1", error="", mode=None):
    row = dict(run_id=run, world=str(world), method=method, batch="1", heads="32", kv_heads="32", head_dim="128",
               seq_local=str(seq_local), seq_global=str(seq_local * world), causal="1", dtype="bfloat16",
               tflops_per_gpu="" if tflops is None else str(tflops), error=error)
    if mode is not None:  # None: a row from before the pass column
        row["pass"] = mode
    return row


@check
def ratios_same_run_and_case_and_scaling_from_world1_rows():
    _, harness, _, _ = _modules()
    rows = [_row("torch_fused", 300), _row("jax_fused", 240), _row("torch_cudnn_1gpu", 600),
            _row("jax_cudnn_1gpu", 500), _row("torch_cp", 200), _row("jax_xla", 60),
            _row("torch_ref", None, error="OOM"),
            _row("torch_cp", 999, run="r0"),  # another run: never a denominator here
            _row("torch_fused", 310, world=1, seq_local=8192, run="r9"),  # world-1 run of the same global problem
            _row("torch_fused", 320, world=1, seq_local=8192, run="r10")]  # ... again: the latest counts
    out = {(r["run_id"], r["method"], r["world"]): r for r in harness.compute_ratios(rows)}
    tf = out["r1", "torch_fused", "2"]
    assert tf["vs_cudnn_1gpu"] == 0.5  # against the faster single-GPU limit
    assert tf["vs_context_parallel"] == 1.5 and tf["vs_xla_ref"] == 5.0
    assert tf["vs_torch_ref"] == "" and tf["vs_cudnn_ring"] == ""  # failed / absent
    assert tf["scaling_eff"] == round(300 / 320, 3)
    jf = out["r1", "jax_fused", "2"]
    assert jf["vs_cudnn_1gpu"] == 0.4 and jf["scaling_eff"] == ""  # no world-1 jax_fused row
    assert all(out["r1", "torch_cp", "2"][c] == "" for c in harness.RATIOS)  # only fused rows carry ratios
    assert out["r10", "torch_fused", "1"]["scaling_eff"] == ""
    assert rows[0].get("vs_cudnn_1gpu") is None  # inputs untouched
    lines = harness.format_ratios([tf])
    assert lines and "0.50x cuDNN 1 GPU" in lines[0] and "scaling eff 0.94" in lines[0]


@check
def ratios_only_compare_rows_of_the_same_pass():
    _, harness, _, _ = _modules()
    rows = [_row("torch_fused", 300, mode="fwd"), _row("torch_cp", 200),  # no pass column: fwd
            _row("torch_fused", 210, mode="fwd+bwd"), _row("torch_cp", 300, mode="fwd+bwd"),
            _row("jax_cudnn_1gpu", 250, mode="fwd+bwd"), _row("torch_cudnn_1gpu", 600, mode="fwd"),
            _row("torch_fused", 240, world=1, seq_local=8192, run="r9", mode="fwd+bwd")]
    out = {(r["method"], harness.field(r, "pass"), r["world"]): r for r in harness.compute_ratios(rows)}
    fwd, step = out["torch_fused", "fwd", "2"], out["torch_fused", "fwd+bwd", "2"]
    assert (fwd["vs_context_parallel"], fwd["vs_cudnn_1gpu"], fwd["scaling_eff"]) == (1.5, 0.5, "")
    assert (step["vs_context_parallel"], step["vs_cudnn_1gpu"], step["scaling_eff"]) == (0.7, 0.84, 0.875)
    assert harness.field({"pass": ""}, "pass") == harness.field({}, "pass") == "fwd"
    assert harness.field({"pass": "fwd+bwd"}, "pass") == "fwd+bwd" and harness.field({}, "note") == ""


@check
def scaling_compares_rows_of_the_same_timing():
    """A row timed back to back (--timing stream) scales against a world-1 row timed so, never against one timed
    call by call (a row without the column was timed call by call)."""
    _, harness, _, _ = _modules()
    call_w1 = _row("torch_fused", 400, world=1, seq_local=8192, run="r9")
    stream_w1 = dict(_row("torch_fused", 500, world=1, seq_local=8192, run="r8"), timing="stream")
    stream = dict(_row("torch_fused", 450), timing="stream")
    by_timing = {harness.field(r, "timing"): r for r in harness.compute_ratios([stream_w1, call_w1, stream])
                 if r["world"] == "2"}
    assert by_timing["stream"]["scaling_eff"] == 0.9 and harness.field({}, "timing") == "call"
    (plain,) = [r for r in harness.compute_ratios([stream_w1, call_w1, _row("torch_fused", 300)]) if r["world"] == "2"]
    assert plain["scaling_eff"] == 0.75


@check
def masked_ratios_and_ring_steps_in_the_rows():
    _, harness, _, _ = _modules()

    def row(method, tflops, mask="packed(512-8192)", world=2, run="r1", ms=None, mode="fwd"):
        return dict(_row(method, tflops, world=world, seq_local=16384, run=run, mode=mode), mask=mask,
                    layout="zigzag", ms_median="" if ms is None else str(ms))
    rows = [row("torch_fused", 300, "none", ms=20.0), row("torch_fused", 250, ms=8.0), row("jax_fused", 240, ms=8.2),
            row("torch_ref", 30, ms=80.0), row("torch_fused", 280, "none", mode="fwd+bwd"),
            row("torch_fused", 230, mode="fwd+bwd"), row("torch_fused", 270, world=1, run="r2", ms=6.0),
            row("torch_fused", 999, "none", world=1, run="r2", ms=1.0)]
    out = {(r["method"], r["mask"], r["world"], r["pass"]): r for r in harness.compute_ratios(rows)}
    packed = out["torch_fused", "packed(512-8192)", "2", "fwd"]
    assert packed["vs_dense"] == round(250 / 300, 3)  # the same method's unmasked row of the same run and pass
    assert packed["ms_vs_world1"] == round(8.0 / 6.0, 3)  # the world-1 run of the same per-rank work
    assert out["torch_fused", "packed(512-8192)", "2", "fwd+bwd"]["vs_dense"] == round(230 / 280, 3)
    assert out["jax_fused", "packed(512-8192)", "2", "fwd"]["vs_dense"] == ""  # no unmasked jax row
    dense = out["torch_fused", "none", "2", "fwd"]
    assert dense["vs_dense"] == dense["ms_vs_world1"] == ""
    assert out["torch_ref", "packed(512-8192)", "2", "fwd"]["vs_dense"] == ""  # fused rows only
    assert out["torch_fused", "packed(512-8192)", "1", "fwd"]["ms_vs_world1"] == ""
    line = harness.format_ratios([dict(packed, ring_steps="2", ring_steps_needed="2", world="2")])[0]
    assert "0.83x the unmasked rate" in line and "1.33x the world-1 time" in line and "ring steps run 2" in line


@check
def ranks_sharing_a_gpu_are_labelled_and_scaled_by_the_whole_gpu():
    _, harness, _, _ = _modules()
    shared = dict(_row("torch_fused", 150), ranks_per_gpu="2")  # two ranks on one GPU, each at 150
    rows = [shared, _row("torch_fused", 320, world=1, seq_local=8192, run="r10")]
    out = {r["world"]: r for r in harness.compute_ratios(rows)}
    assert out["2"]["scaling_eff"] == round(2 * 150 / 320, 3)  # the GPU's rate against one rank's on it
    assert harness.field({}, "ranks_per_gpu") == "1"  # rows written before the column: a GPU per rank


def _old_csv(harness, path, rows, dropped):
    """``rows`` written with the harness's columns less ``dropped`` (a CSV of an older harness)."""
    cols = [c for c in harness.CSV_COLUMNS if c not in dropped]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows([{c: r.get(c, "") for c in cols} for r in rows])


@check
def csv_log_rewrites_after_every_row_and_keeps_earlier_runs():
    _, harness, _, plot = _modules()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sub", "bench.csv")
        log = harness.CsvLog(path)
        log.add(_row("torch_fused", 300))
        assert len(list(csv.DictReader(open(path)))) == 1  # on disk at once
        log.add(_row("torch_cp", 200))
        log.refresh_ratios()
        again = harness.CsvLog(path)  # a second run appends
        assert [r["method"] for r in again.rows] == ["torch_fused", "torch_cp"]
        assert again.rows[0]["vs_context_parallel"] == "1.5"
        assert tuple(csv.DictReader(open(path)).fieldnames) == harness.CSV_COLUMNS
        assert harness.CsvLog(path, overwrite=True).rows == []
        other = os.path.join(tmp, "other.csv")
        with open(other, "w") as f:
            f.write("a,b\n1,2\n")
        with raises(SystemExit, match="other columns"):
            harness.CsvLog(other)
        # a CSV written before some columns existed: read with what its rows meant, rewritten with the columns
        old = os.path.join(tmp, "old.csv")
        _old_csv(harness, old, [_row("torch_fused", 300)], ("pass", "ranks_per_gpu"))
        assert [(r["pass"], r["ranks_per_gpu"]) for r in harness.CsvLog(old).rows] == [("fwd", "1")]
        _old_csv(harness, old, [_row("torch_fused", 300), _row("torch_cp", 200)], ("pass",))
        log = harness.CsvLog(old)
        assert [r["pass"] for r in log.rows] == ["fwd", "fwd"]
        assert [r["pass"] for r in plot.load_rows([old])] == ["fwd", "fwd"]
        log.add(_row("torch_fused", 150, mode="fwd+bwd"))
        log.add(_row("torch_cp", 100, mode="fwd+bwd"))
        log.refresh_ratios()  # rewritten with the new column; the old rows' ratios stay within their pass
        with open(old, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        assert tuple(reader.fieldnames) == harness.CSV_COLUMNS
        assert [(r["pass"], r["vs_context_parallel"]) for r in rows] == [("fwd", "1.5"), ("fwd", ""),
                                                                        ("fwd+bwd", "1.5"), ("fwd+bwd", "")]
    # the committed results of the forward-only harness load as fwd rows
    results = os.path.join(os.path.dirname(harness.__file__), "results", "attention_2xH200_2026-11-30.csv")
    assert {r["pass"] for r in harness.CsvLog(results).rows} == {"fwd"}
    assert plot.table(plot.load_rows([results])).startswith("### fwd\n")


@check
def format_row_and_command_line():
    cli, harness, _, _ = _modules()
    ok = dict(method="torch_fused", ms_median=10.0, ms_q20=9.5, ms_q80=11.0, tflops_per_gpu=123.4, max_abs_diff="",
              note="n")
    assert "123.4 TFLOP/s/GPU" in harness.format_row(ok)
    assert "ERROR boom" in harness.format_row(dict(method="torch_cp", error="boom"))
    cmd = cli.command_line(["--seq", "4k", "--csv", "a b.csv"], 2)
    assert cmd == "python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention --seq 4k --csv 'a b.csv'"


# ------------------------------------------------------------------------------------ the check, torch peers


@check
def gradient_check_bookkeeping():
    import torch

    _, harness, peers, _ = _modules()
    a = {n: torch.ones(1, 4, 2, 8) for n in harness.GRADS}
    a["dq"][0, 0, 0, 0] = 2.0
    b = {"dq": a["dq"] + 0.05, "dk": a["dk"].clone()}  # no dv: compared over the names both have
    b["dk"][0, 1, 1, 3] -= 0.5
    diff, excess, names = harness.max_abs_diff(b, a)
    assert approx(diff, 0.5) and names == ("dq", "dk")
    assert approx(excess, 0.5 / (harness.GRAD_WARN * 1.0))  # relative to each gradient's largest value
    assert approx(harness.max_abs_diff({"dq": b["dq"]}, a)[1], 0.05 / (harness.GRAD_WARN * 2.0))  # < 1: fine
    out_excess = harness.max_abs_diff({"out": b["dq"]}, {"out": a["dq"]})[1]
    assert approx(out_excess, 0.05 / harness.DIFF_WARN)  # the output's bound is absolute
    assert harness.max_abs_diff({"out": a["dq"]}, a) == (-1.0, -1.0, ())
    assert harness._compared(("out",)) == "" and harness._compared(("dq",)) == " (dq)"
    step, fwd = (harness.Case(1, 2, 2, 8, 4, False, "bfloat16", m) for m in ("fwd+bwd", "fwd"))
    grads = peers._comparable(step, lambda name, x: x * 2)(("out", 1, 2, 3))
    assert grads == {"dq": 2, "dk": 4, "dv": 6}  # fwd+bwd compares the gradients, not the output
    assert peers._comparable(fwd, lambda name, x: x)(7) == {"out": 7}
    share = peers._share_convert(peers.limit_problem(step, 2), lambda x: -x)
    assert peers._comparable(step, share)(("out", 1, 2, 3)) == {"dq": -1}  # its dK/dV are partial sums
    causal = harness.Case(1, 2, 2, 8, 4, True, "bfloat16", "fwd+bwd")
    assert peers._comparable(causal, peers._share_convert(peers.limit_problem(causal, 2), lambda x: x))(
        ("out", 1, 2, 3)) == {}
    rep = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32).reshape(2, 4, 3, 5)  # [b, h=4, s, d], kv_heads 2
    gqa = harness.Case(1, 4, 2, 5, 3, False, "float16")
    (_, k2, _), = peers._repeat_kv([(None, rep[:, :2], rep[:, :2])], gqa, dim=1)
    assert torch.equal(peers._fold_kv(k2, gqa, dim=1), 2 * rep[:, :2])  # each kv head was used twice


@check
def sdpa_methods_call_the_sdpa_current_at_call_time():
    """torch_cp's calls must reach the SDPA that context_parallel patches in while active, not the original."""
    from unittest import mock

    import torch
    import torch.nn.functional as F

    _, harness, peers, _ = _modules()
    case = harness.Case(1, 4, 2, 8, 6, True, "float32", "fwd+bwd")
    q, do = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4, 8)
    k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    sets, douts, attn, gqa = peers._sdpa_inputs(case, [(q, k, v)], [do], False, True)
    assert gqa and [x.shape for x in (*sets[0], douts[0])] == [(1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8),
                                                                (1, 4, 6, 8)]
    seen = []
    with mock.patch.object(F, "scaled_dot_product_attention", lambda *a, **kw: seen.append(kw) or a[0]):
        attn(*sets[0])
        assert seen == [{"is_causal": True, "enable_gqa": True}]
        sets, _, attn, gqa = peers._sdpa_inputs(case, [(q, k, v)], [do], True, False)  # the GQA retry: repeated
        attn(*sets[0])
    assert not gqa and sets[0][1].shape == (1, 4, 6, 8) and seen[-1] == {"is_causal": False}


@check
def flex_mask_is_the_ring_core_rule():
    """torch_flex's mask_mod allows exactly the pairs ring_core.masks.allowed allows: causal or not, the packed
    documents of a batch of two rows, windows on one side and on both; nothing to mask gives no mask."""
    import torch

    from ring_core import masks, validate

    _, harness, peers, _ = _modules()
    for causal, mask, window in ((True, "none", (-1, -1)), (False, "none", (-1, -1)), (True, "packed", (-1, -1)),
                                 (False, "packed", (-1, -1)), (True, "window", (23, 0)), (False, "window", (30, 7)),
                                 (False, "window", (-1, 0)), (False, "window", (5, -1))):
        case = harness.Case(2, 4, 2, 16, 96, causal, "float32", mask=mask, window=window, doc_lens=(5, 40))
        ids = harness.segment_ids(case, 1)
        mod = peers.flex_mask_mod(case, None if ids is None else torch.as_tensor(ids))
        pos = np.arange(96)
        want = masks.allowed(pos, pos, is_causal=causal, window=validate.check_window(case.window_size),
                             q_segment_ids=ids, k_segment_ids=ids, head_axes=1)
        if want is None:
            assert mod is None, case.label()
            continue
        want = np.broadcast_to(want, (2, 1, 96, 96) if ids is not None else (96, 96))
        q, k = torch.arange(96)[:, None], torch.arange(96)[None, :]
        for b in range(2):
            got = mod(torch.tensor(b), torch.tensor(0), q, k).numpy()
            np.testing.assert_array_equal(got, want[b, 0] if ids is not None else want, err_msg=case.label())


@check
def flash_attn_peer_calls_flash_attn_as_documented():
    """torch_flash_attn with a stand-in ``flash_attn`` module (the real one needs a GPU): dense and windowed cases
    call ``flash_attn_func`` on [b, s, h, d] with ``causal`` and ``window_size``; packed documents call
    ``flash_attn_varlen_func`` on [b * s, h, d] with int32 ``cu_seqlens`` of every row's documents (which reproduce
    the harness's segment ids) and the longest document, and its output comes back as [b, s, h, d]. Without
    ``flash_attn`` the method is unavailable, saying so."""
    from unittest import mock

    import torch

    _, harness, peers, _ = _modules()
    calls = []

    def func(q, k, v, *, causal, window_size):
        calls.append(("func", tuple(q.shape), tuple(k.shape), causal, tuple(window_size)))
        return q + 1

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal):
        calls.append(("varlen", tuple(q.shape), tuple(k.shape), cu_q, cu_k, max_q, max_k, causal))
        return q + 1

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_func, fake.flash_attn_varlen_func = func, varlen
    env = types.SimpleNamespace(torch=torch, world=1, rank=0, device=torch.device("cpu"), cuda=True)
    with mock.patch.dict(sys.modules, {"flash_attn": fake}):
        for causal, mask, window in ((True, "window", (23, 0)), (False, "none", (-1, -1)),
                                     (True, "packed", (-1, -1))):
            case = harness.Case(2, 4, 2, 16, 96, causal, "float32", mask=mask, window=window, doc_lens=(5, 40))
            data = harness.CaseData(env, case, 1, 0)
            with contextlib.ExitStack() as stack:
                prep = peers.build_torch_flash_attn(env, None, case, data, stack)
                out = prep.local_out(prep.run(0))["out"]
            q = data.local_sets[0][0]
            assert torch.equal(out, q + 1) and out.shape == (2, 96, 4, 16), case.label()
            call = calls.pop()
            if mask != "packed":
                assert call == ("func", (2, 96, 4, 16), (2, 96, 2, 16), causal, case.window_size or (-1, -1)), call
                continue
            _, qs, ks, cu_q, cu_k, max_q, max_k, c = call
            assert (qs, ks, c) == ((192, 4, 16), (192, 2, 16), causal) and cu_q is cu_k and cu_q.dtype == torch.int32
            bounds = cu_q.numpy()
            assert bounds[0] == 0 and bounds[-1] == 192 and (np.diff(bounds) > 0).all() and 96 in bounds
            assert max_q == max_k == np.diff(bounds).max() <= 40
            doc = np.searchsorted(bounds, np.arange(192), side="right") - 1  # each token's document
            ids = harness.segment_ids(case, 1)
            for r in range(2):  # the same documents as the harness's segment ids, row by row
                same = doc[r * 96:(r + 1) * 96]
                np.testing.assert_array_equal(same[:, None] == same[None, :], ids[r][:, None] == ids[r][None, :])
    with mock.patch.dict(sys.modules, {"flash_attn": None}):  # import flash_attn fails
        case = harness.Case(1, 4, 2, 16, 96, True, "float32")
        with raises(harness.Unavailable, match="flash_attn is not importable"):
            peers.build_torch_flash_attn(env, None, case, None, contextlib.ExitStack())
    with raises(harness.Unavailable, match="world size 1 only"):
        peers.build_torch_flash_attn(types.SimpleNamespace(**dict(vars(env), world=2)), None, case, None,
                                     contextlib.ExitStack())


# ------------------------------------------------------------------------------------------- timing


@check
def ready_timing_records_the_second_event_once_the_device_is_idle():
    """--timing ready (harness.cuda_timed): the call, then torch.cuda.synchronize(), then the second event, so a
    torch call counts the wait for its kernels as a JAX call (block_until_ready) does; --timing call records the
    second event right after the call returns."""
    _, harness, _, _ = _modules()
    order = []

    class Event:
        def __init__(self, enable_timing=False):
            self.name = f"e{sum(1 for x in order if x.startswith('new'))}"
            order.append("new")

        def record(self):
            order.append(f"record {self.name}")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.5

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, synchronize=lambda: order.append("sync")))
    for ready, want in ((True, ["record e0", "call", "sync", "record e1"]),
                        (False, ["record e0", "call", "record e1"])):
        order.clear()
        ms, out = harness.cuda_timed(fake, lambda: order.append("call") or 7, ready)
        assert (ms, out) == (1.5, 7) and [x for x in order if x != "new"] == want, (ready, order)
    assert "ready" in harness.TIMINGS


@check
def stream_timing_issues_jax_calls_without_waiting_and_waits_for_the_last():
    """--timing stream (harness._run_all): calls 0..n-2 through ``Prepared.issue`` (JAX: dispatched, not blocked),
    the last through ``run`` (blocked); a method without ``issue`` (torch) runs every call through ``run``. And the
    JAX builder's ``issue`` does not block while its ``run`` does (block_until_ready on the compiled call)."""
    _, harness, peers, _ = _modules()
    calls = []
    prep = harness.Prepared(run=lambda i: calls.append(("run", i)) or i, local_out=None,
                            issue=lambda i: calls.append(("issue", i)))
    assert harness._run_all(prep, 4) == 3
    assert calls == [("issue", 0), ("issue", 1), ("issue", 2), ("run", 3)]
    calls.clear()
    torch_like = harness.Prepared(run=lambda i: calls.append(("run", i)) or i, local_out=None)
    assert harness._run_all(torch_like, 3) == 2 and calls == [("run", 0), ("run", 1), ("run", 2)]

    blocked = []
    fake_jax = types.SimpleNamespace(jit=lambda fn: types.SimpleNamespace(
        lower=lambda *a: types.SimpleNamespace(compile=lambda: lambda *a: ("out", a))),
        block_until_ready=lambda x: blocked.append(x) or x)
    env = types.SimpleNamespace(jax=fake_jax)
    case = harness.Case(batch=1, heads=2, kv_heads=2, head_dim=8, seq_local=16, causal=False, dtype="float32")
    p = peers._jax_compiled(env, case, None, [(1,), (2,)], None, "", "")
    assert p.issue(1) == ("out", (2,)) and blocked == []
    assert p.run(0) == ("out", (1,)) and blocked == [("out", (1,))]


# -------------------------------------------------------------------------------------------- plot


@check
def plot_groups_panels_lines_and_keeps_the_latest_row():
    _, _, _, plot = _modules()
    rows = [_row("torch_fused", 100, seq_local=4096), _row("torch_fused", 120, seq_local=4096, run="r2"),
            _row("torch_fused", 200, seq_local=8192), _row("torch_cudnn_1gpu", 600, seq_local=4096),
            _row("torch_fused", 310, world=1, seq_local=8192), _row("torch_cp", None, error="x")]
    rows.append(dict(_row("torch_fused", 90), causal="0"))
    rows.append(_row("torch_fused", 70, seq_local=4096, run="r3", mode="fwd+bwd"))  # another pass: its own panel
    data = plot.panels(rows)
    key = ("fwd", "1", "bfloat16", "128", "32", "32", "1", "none", "")
    assert set(data) == {key, ("fwd", "0") + key[2:], ("fwd+bwd",) + key[1:]}
    lines = data[key]
    assert lines["torch_fused (W=2)"] == [(8192, 120.0), (16384, 200.0)]  # x = global length; the rerun wins
    assert lines["torch_fused (W=1)"] == [(8192, 310.0)] and lines["torch_cudnn_1gpu (share of W=2)"] == [(8192, 600.0)]
    assert not any(label.startswith("torch_cp") for label in lines)  # failed: not plotted
    assert data[("fwd+bwd",) + key[1:]] == {"torch_fused (W=2)": [(8192, 70.0)]}
    assert plot.panels(rows, x="local")[key]["torch_fused (W=2)"][0] == (4096, 120.0)
    assert plot.panel_title(("fwd+bwd", "1", "bfloat16", "128", "32", "8", "1", "none", "zigzag")) == \
        "fwd+bwd: causal (zigzag), bfloat16, D=128, H=32/8"
    assert plot.panel_title(("fwd", "1", "bfloat16", "128", "32", "8", "1", "window(4095,0)", "contiguous")) == \
        "fwd: causal (contiguous), bfloat16, D=128, H=32/8, window(4095,0)"
    md = plot.table(rows)
    fwd_md, step_md = md.split("### fwd+bwd")  # one table per pass, fwd first
    assert fwd_md.startswith("### fwd\n")
    assert "| torch_fused | 2 | causal (zigzag), bfloat16, D=128, H=32/32 | 8192 | 200.0 |" in fwd_md
    assert "| 70.0 |" in step_md and "| 70.0 |" not in fwd_md
    assert plot.table([_row("torch_cp", 1.0)]) == "(no timed fused rows)"
    try:
        import matplotlib  # noqa: F401 - the figure needs it (the bench extra); the grouping and table above do not
    except ImportError:
        print("     (matplotlib not installed: the figure is not drawn)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p.png")
        assert plot.plot(rows, out) == 3
        with open(out, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- the pure-JAX ring


def _mesh(world):
    import jax
    from jax.sharding import Mesh

    devices = jax.devices("cpu")
    if len(devices) < world:
        raise AssertionError(f"needs {world} host devices, have {len(devices)} (jax imported before the self-check "
                             f"could set XLA_FLAGS?)")
    return Mesh(np.array(devices[:world]), ("sp",))


@check
def cudnn_style_ring_merges_blocks_exactly():
    """The hand-written ring (LSE merge, zigzag half-blocks) with dense XLA blocks equals dense attention."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_ring
    from jax_ring.reference import dense_attention

    _, _, peers, _ = _modules()
    for world, causal in ((2, False), (4, True)):
        s_g, h, hkv, d = 16 * world, 4, 2, 16
        rng = np.random.default_rng(world + 10 * causal)
        q = rng.standard_normal((2, s_g, h, d), dtype=np.float32)
        k, v = (rng.standard_normal((2, s_g, hkv, d), dtype=np.float32) for _ in range(2))
        layout = "zigzag" if causal else "contiguous"

        def body(q, k, v, world=world, causal=causal):
            return peers.cudnn_ring_attention(q, k, v, axis_name="sp", world=world, is_causal=causal,
                                              block_attention=peers.xla_block_attention)

        f = jax.jit(jax.shard_map(body, mesh=_mesh(world), in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
        out = f(*(jax_ring.to_layout(x, layout, world) for x in (q, k, v)))
        out = np.asarray(jax_ring.from_layout(np.asarray(out), layout, world))
        ref, _ = dense_attention(q, k, v, is_causal=causal)
        np.testing.assert_allclose(out, np.asarray(ref), atol=2e-6, rtol=1e-5)


@check
def cudnn_style_ring_gradients_by_autodiff_equal_dense():
    """What fwd+bwd times for jax_cudnn_ring: jax.vjp of the hand-written ring (the harness's own step function,
    inside shard_map) gives the gradients of dense attention when the blocks' LSEs differentiate."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_ring
    from jax_ring.reference import dense_attention

    _, harness, peers, _ = _modules()
    for world, causal in ((2, True), (4, False)):
        s_g, h, hkv, d = 8 * world, 4, 2, 16
        rng = np.random.default_rng(7 + world)
        q, dout = (rng.standard_normal((1, s_g, h, d), dtype=np.float32) for _ in range(2))
        k, v = (rng.standard_normal((1, s_g, hkv, d), dtype=np.float32) for _ in range(2))
        layout = "zigzag" if causal else "contiguous"
        case = harness.Case(1, h, hkv, d, s_g // world, causal, "float32", "fwd+bwd")

        def body(q, k, v, world=world, causal=causal):
            return peers.cudnn_ring_attention(q, k, v, axis_name="sp", world=world, is_causal=causal,
                                              block_attention=peers.xla_block_attention)

        spec = P(None, "sp")
        f = jax.jit(jax.shard_map(peers._jax_step(case, body), mesh=_mesh(world), in_specs=(spec,) * 4,
                                  out_specs=(spec,) * 4))
        got = f(*(jax_ring.to_layout(x, layout, world) for x in (q, k, v, dout)))
        got = [np.asarray(jax_ring.from_layout(np.asarray(x), layout, world)) for x in got]
        out, pull = jax.vjp(lambda q, k, v, causal=causal: dense_attention(q, k, v, is_causal=causal)[0], q, k, v)
        for g, want in zip(got, (out, *pull(dout))):
            np.testing.assert_allclose(g, np.asarray(want), atol=2e-5, rtol=1e-4)


@check
def lse_probe_refuses_blocks_whose_lse_carries_no_gradient():
    """jax's cuDNN attention drops its LSE's cotangent; the probe must catch that (here: a stop_gradient)."""
    import jax

    _, harness, peers, _ = _modules()
    env = types.SimpleNamespace(jax=jax)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 4, 16), dtype=np.float32)
    k, v = (rng.standard_normal((1, 8, 2, 16), dtype=np.float32) for _ in range(2))
    peers.check_lse_differentiates(env, peers.xla_block_attention, q, k, v)  # dense XLA blocks: fine

    def dropped(q, k, v, is_causal, scale):
        out, lse = peers.xla_block_attention(q, k, v, is_causal, scale)
        return out, jax.lax.stop_gradient(lse)

    with raises(harness.Unavailable, match="LSE"):
        peers.check_lse_differentiates(env, dropped, q, k, v)


# ------------------------------------------------------------------------------------------ the run


def main(only: str | None = None) -> int:
    """Run the checks (those whose names contain ``only``); 0 if every one passed."""
    flag = "--xla_force_host_platform_device_count"
    if "jax" not in sys.modules and flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={HOST_DEVICES}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ran = failed = 0
    t0 = time.perf_counter()
    for fn in CHECKS:
        name = fn.__name__
        if only and only not in name:
            continue
        ran += 1
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - every failure is reported, the other checks still run
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"ok   {name} ({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"self-check: {ran - failed} of {ran} checks passed in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed or not ran else 0
