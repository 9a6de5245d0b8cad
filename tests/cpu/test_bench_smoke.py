"""The attention benchmark end to end on the CPU (``--cpu-smoke``: gloo between the ranks, XLA's CPU platform), through
the launcher as on the GPU machine, read back from the CSV it writes (no benchmark module is imported here): every
method in both passes, the masked cases, each row checked against the harness's anchor."""

import csv
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PASS_FLOPS = {"fwd": 1.0, "fwd+bwd": 3.5}  # the flash-attention convention the CSV's flops_per_gpu follows
# The methods of a two-rank run: the ones that need a GPU (and the iris heap) write why they cannot run here.
GPU_ONLY = ("torch_fused", "jax_fused", "jax_fused_deferred", "jax_fused_call", "torch_fused_det", "jax_fused_det",
            "torch_cp")
ON_CPU = ("torch_ref", "jax_xla", "jax_cudnn_ring", "torch_cudnn_1gpu", "jax_cudnn_1gpu")
LIMITS = ("torch_cudnn_1gpu", "jax_cudnn_1gpu")  # one GPU's share of the ring's work
WORLD1_ONLY = ("torch_flex", "torch_flash_attn")  # the whole sequence in one process (test_bench_peers.py)


def _launch(nproc, args, out, timeout=400, **env):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **env)
    e.pop("XLA_FLAGS", None)  # conftest's forced host devices would give each process 4 JAX devices
    cmd = [sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", str(nproc), "-m", "benchmarks.attention",
           "--cpu-smoke", *args, "--csv", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out, newline="") as f:
        return proc, list(csv.DictReader(f))


def test_cpu_smoke_both_passes_through_the_launcher(tmp_path):
    """Two processes run every method in fwd and fwd+bwd (the one-process peers are skipped, saying why); GPU-only
    methods write why they cannot; the others are timed, counted (fwd+bwd: 3.5 forwards) and compared with the
    first reference ring that ran (the anchor): outputs in fwd, gradients in fwd+bwd (the non-causal single-GPU
    share: dq only; the causal one: nothing)."""
    proc, rows = _launch(2, ["--pass", "fwd,fwd+bwd", "--seq", "64", "--kv-heads", "2", "--iters", "2"],
                         tmp_path / "smoke.csv")
    for method in WORLD1_ONLY:  # skipped, no row
        assert f"{method:17s} skipped: the whole sequence in one process (world size 1 only)" in proc.stdout
    by = {(r["pass"], r["causal"], r["method"]): r for r in rows}
    assert len(rows) == len(by) == 2 * 2 * len(GPU_ONLY + ON_CPU), sorted(by)
    assert {m for _, _, m in by} == set(GPU_ONLY + ON_CPU)
    for (mode, causal, method), r in by.items():
        assert (r["world"], r["seq_global"], r["kv_heads"], r["timing"]) == ("2", "128", "2", "call")
        assert r["command"].startswith("python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention")
        if method in GPU_ONLY:
            assert "Unavailable" in r["error"] and not r["tflops_per_gpu"], r
            continue
        assert not r["error"] and float(r["tflops_per_gpu"]) > 0, r
        assert float(r["ms_q20"]) <= float(r["ms_median"]) <= float(r["ms_q80"]), r
        fwd = by["fwd", causal, method]
        assert float(r["flops_per_gpu"]) == pytest.approx(PASS_FLOPS[mode] * float(fwd["flops_per_gpu"]), rel=1e-5)
        if method == "torch_ref":  # the first ring that ran is the anchor
            assert r["diff_vs"] == ("(anchor)" if mode == "fwd" else "(anchor) (dq,dk,dv)")
            continue
        if method in LIMITS and causal == "1":  # other heads over every token: nothing to compare
            assert r["diff_vs"] == r["max_abs_diff"] == ""
            continue
        want = "torch_ref" + ("" if mode == "fwd" else " (dq)" if method in LIMITS else " (dq,dk,dv)")
        assert r["diff_vs"] == want and float(r["max_abs_diff"]) < 0.1 and "LARGE DIFF" not in r["note"], r
        if mode == "fwd+bwd":
            assert "backward by" in r["note"]
    # B=1, H=4, D=32, 128 tokens over 2 ranks: 4*B*H*S_local*S_global*D a rank, half when causal
    assert float(by["fwd", "0", "torch_ref"]["flops_per_gpu"]) == pytest.approx(4 * 4 * 64 * 128 * 32, rel=1e-5)
    assert float(by["fwd", "1", "torch_ref"]["flops_per_gpu"]) == pytest.approx(2 * 4 * 64 * 128 * 32, rel=1e-5)


def _window_pairs(world, seq_local, left):
    """The pairs a causal window of ``left`` + 1 tokens allows, per rank, contiguous layout: ring_core.masks's rule."""
    from ring_core import masks
    from ring_core.layout import global_positions

    got = []
    for r in range(world):
        qp = global_positions(np, r, world, seq_local, "contiguous")
        kp = np.arange(world * seq_local)
        got.append(int(masks.allowed(qp, kp, is_causal=True, window=(left, -1)).sum()))
    return got


def test_cpu_smoke_with_masks_through_the_launcher(tmp_path):
    """The masked cases (2 processes): the reference rings run packed documents and a causal window in both passes,
    checked against each other, with the effective FLOPs of the allowed pairs; methods without masks are skipped
    (no row); the fused kernel says why it cannot run here. Timed back to back (``--timing stream``): one mean per
    row (JAX's calls dispatched without waiting, the last one waited for). With an MPS SM share in the environment
    (as bench-window-share's lone rank has), every row's note says so."""
    proc, rows = _launch(2, ["--mask", "packed,window", "--causal", "yes", "--layout", "contiguous", "--seq", "64",
                             "--kv-heads", "2", "--iters", "2", "--methods", "torch_fused,torch_ref,jax_xla,torch_cp",
                             "--timing", "stream"], tmp_path / "smoke_masks.csv",
                        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="50")
    assert "torch_cp          skipped: takes no segment ids or windows" in proc.stdout
    by = {(r["mask"], r["pass"], r["method"]): r for r in rows}
    assert len(rows) == len(by) == 2 * 2 * 3 and not any(m == "torch_cp" for _, _, m in by)
    window = sum(_window_pairs(2, 64, 23)) / 2  # the mean over the ranks
    dense = 64 * 128 / 2  # the causal dense convention's pairs a rank
    for (label, mode, method), r in by.items():
        assert label in ("packed(8-40)", "window(23,0)") and r["layout"] == "contiguous", r
        assert "each rank on 50 % of the GPU's SMs (MPS)" in r["note"], r["note"]
        pairs = float(r["pairs_per_gpu"])
        if label == "window(23,0)":
            assert pairs == pytest.approx(window, rel=1e-6)
        else:  # documents of 8-40 tokens: a small share of the causal pairs
            assert 0 < pairs < 0.5 * dense
        assert int(r["ring_steps_needed"]) == 2
        if method == "torch_fused":
            assert "Unavailable" in r["error"] and r["ring_steps"] == ""
            continue
        assert not r["error"] and float(r["tflops_per_gpu"]) > 0, r
        assert r["timing"] == "stream" and r["ms_q20"] == r["ms_median"] == r["ms_q80"], r  # one mean
        assert float(r["flops_per_gpu"]) == pytest.approx(4 * 4 * 32 * pairs * PASS_FLOPS[mode], rel=1e-5)
        if method == "jax_xla":  # checked against the first ring that ran (torch_ref): outputs, or gradients
            assert r["diff_vs"].startswith("torch_ref") and float(r["max_abs_diff"]) < 0.1, r
    # the packed documents are the same on both passes and both methods
    assert len({by["packed(8-40)", m, x]["pairs_per_gpu"] for m in PASS_FLOPS for x in ("torch_ref", "jax_xla")}) == 1
