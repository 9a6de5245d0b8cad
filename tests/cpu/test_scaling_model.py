"""benchmarks/scaling_model.py (CPU, seconds), through its program: the two-level ring's performance model keeps the
properties any such model must have (``--self-check``, on the committed rates; no predicted number is fixed here), a
run writes its table, CSV, plot and command, and bad arguments are refused."""

import csv
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "benchmarks.scaling_model", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_self_check_holds_on_the_committed_rates():
    proc = _run("--self-check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"self-check: (\d+) of (\d+) checks passed", proc.stdout)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) >= 6 and "FAIL" not in proc.stdout, proc.stdout
    assert "ok   one_node_is_the_one_node_kernel_and_more_nodes_cost" in proc.stdout


def test_command_line_writes_table_csv_plot_and_command(tmp_path):
    """The plot where matplotlib (the bench extra) is installed; the rest in any case."""
    drawn = importlib.util.find_spec("matplotlib") is not None
    args = ["--gpus", "8,16,64", "--seq", "4k,16k", "--kv-heads", "8,32", "--tag", "t", "--out-dir", str(tmp_path)]
    proc = _run(*args, *([] if drawn else ["--no-plot"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "target fwd:" in out and "target fwd+bwd:" in out and "smallest S_local" in out
    rows = list(csv.DictReader(open(tmp_path / "scaling_model_t.csv")))
    assert len(rows) == 2 * 2 * 2 * 3
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd"} and all(r["inputs"] for r in rows)
    assert {int(r["gpus"]) for r in rows} == {8, 16, 64}
    assert all(0 < float(r["eff"]) <= 1 for r in rows)
    assert not drawn or (tmp_path / "scaling_model_t.png").stat().st_size > 10_000
    cmd = (tmp_path / "scaling_model_t.cmd").read_text().strip()
    assert cmd.startswith("python -m benchmarks.scaling_model --gpus 8,16,64")
    assert (tmp_path / "scaling_model_t.txt").read_text().strip() == out[:out.index("\nwrote")].strip()


@pytest.mark.parametrize("args,match", [
    (["--gpus", "12"], "not a whole number of nodes"),
    (["--seq", "4097"], "even"),
    (["--kv-heads", "5"], "divide"),
])
def test_bad_arguments(args, match):
    proc = _run(*args)
    assert proc.returncode == 2 and match in proc.stderr, proc.stderr
