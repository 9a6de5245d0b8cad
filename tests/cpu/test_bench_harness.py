"""The attention benchmark's harness on the CPU, through its programs only (no benchmark module is imported here):
``python -m benchmarks.attention --self-check`` (the harness's own checks: FLOPs, exact mask pair counts, cases,
ratios, the CSV log, the gradient check's bookkeeping, timing modes, the plot's grouping, the pure-JAX ring against
dense attention), the command line's refusals, and ``python -m benchmarks.plot`` on committed result files. The
whole benchmark through the launcher is in test_bench_smoke.py."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _run(*args, timeout=300, **env):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **env)
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)


def test_self_check_passes_every_check():
    """Every check of benchmarks/self_check.py passes (each prints ``ok NAME``); a failed one fails the program."""
    proc = _run("benchmarks.attention", "--self-check", timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    m = re.search(r"self-check: (\d+) of (\d+) checks passed", proc.stdout)
    assert m and m.group(1) == m.group(2), out[-3000:]
    names = re.findall(r"^ok   (\w+)", proc.stdout, re.M)
    assert len(names) == int(m.group(2)) >= 30 and "FAIL" not in proc.stdout
    for part in ("allowed_pairs_are_exact", "csv_log", "ratios", "cudnn_style_ring", "plot_groups"):
        assert any(part in n for n in names), (part, names)
    one = _run("benchmarks.attention", "--self-check", "allowed_pairs")  # NAME: those checks only
    assert one.returncode == 0 and "1 of 1 checks passed" in one.stdout, one.stdout + one.stderr


@pytest.mark.parametrize("argv, message", [
    (["--methods", "nope"], "unknown method"), (["--dtype", "fp32"], "dtype must be"),
    (["--heads", "32", "--kv-heads", "5"], "not a multiple"), (["--pass", "bwd"], "--pass takes"),
    (["--mask", "sparse"], "--mask takes"), (["--window=-2,0"], "--window takes"),
])
def test_the_command_line_refuses_bad_arguments_before_any_work(argv, message):
    proc = _run("benchmarks.attention", *argv, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
    assert "usage: python -m jax_ring.launch" in proc.stderr


def test_plot_draws_and_tabulates_committed_results(tmp_path):
    """``python -m benchmarks.plot``: the figure and markdown tables of a committed run (a CSV from before the
    ``pass`` column: read as forward rows), and the A/B figures (``--runs``) of the tile tables and of the packed
    forward against dense in its own run."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "two_gpus.png"
    proc = _run("benchmarks.plot", os.path.join(RESULTS, "attention_2xH200_2026-11-30.csv"), "--out", str(png),
                "--table")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 10_000 and re.search(r"wrote .* \(\d+ panels?\)", proc.stdout)
    table = proc.stdout[proc.stdout.index("### fwd"):]
    assert "### fwd+bwd" not in table and "| torch_fused | 2 |" in table and "vs_context_parallel" in table
    runs = [os.path.join(RESULTS, f"attention_w1_fwd_tiles-{r}_1xH200_2026-12-02.csv") for r in ("base", "s4")]
    png = tmp_path / "runs.png"
    proc = _run("benchmarks.plot", "--runs", *runs, "--out", str(png))
    assert proc.returncode == 0 and png.stat().st_size > 10_000, proc.stderr[-3000:]
    runs = [os.path.join(RESULTS, f"ab_packed_{t}_W1_1xH200_2026-12-04.csv") for t in ("current", "late")]
    png = tmp_path / "runs_dense.png"
    proc = _run("benchmarks.plot", "--runs", "--ratio", "vs_dense", *runs, "--out", str(png))
    assert proc.returncode == 0 and png.stat().st_size > 10_000, proc.stderr[-3000:]
    png = tmp_path / "nodes.png"  # the two-level ring's timing against the flat ring's
    proc = _run("benchmarks.plot", "--nodes", os.path.join(RESULTS, "nodes_timing_W4_1xH100_2026-12-06.csv"),
                "--out", str(png))
    assert proc.returncode == 0 and png.stat().st_size > 10_000, proc.stderr[-3000:]
    assert "| 32k | none | fwd | 2 x 2 |" in proc.stdout
