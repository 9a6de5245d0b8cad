"""benchmarks/timeline.py's reading of the Gluon forward's timeline words, through its program (``--summarize``, no
GPU): words made here as the kernel lays them out (ring_core.kernels.gluon_fwd's TIMELINE_* constants), and the
words of the committed run, whose figures the run's own CSV holds."""
import csv
import os
import subprocess
import sys

import numpy as np
import pytest

from ring_core.kernels import gluon_fwd as gk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "benchmarks", "results", "timeline_W1_1xH200_2026-12-04")


def _summarize(npz, out_csv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.timeline", "--summarize", str(npz), "--csv",
                           str(out_csv)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rows = list(csv.DictReader(open(out_csv))) if proc.returncode == 0 else []
    return proc, rows


def _words(programs, plan_lead=None):
    """Timeline words [programs, TIMELINE_TILES, TIMELINE_EVENTS] (-1: never written) for ``programs``: per program,
    its tiles' block counts. Each consumer spends 1000 + 500 x blocks cycles in a tile's blocks, 100 storing its
    rows and 200 waiting for the next tile; the load warp takes a tile 50 cycles before Q lands; with
    ``plan_lead`` the planner published it that long before."""
    ev = gk.TIMELINE_EVENT
    w = np.full((len(programs), gk.TIMELINE_TILES, gk.TIMELINE_EVENTS), -1, np.int64)
    for p, blocks in enumerate(programs):
        t = 10_000 * (p + 1)
        w[p, 0, ev["program_start"]] = t - 300
        for i, n in enumerate(blocks):
            w[p, i, ev["tile"]] = 7 * p + i
            w[p, i, ev["blocks"]] = n
            w[p, i, ev["load_tile"]] = t - 50
            if plan_lead is not None:
                w[p, i, ev["plan_published"]] = t - 50 - plan_lead
            for c in (0, 1):
                w[p, i, 3 * c + ev["q"]] = t
                w[p, i, 3 * c + ev["done"]] = t + 1000 + 500 * n
                w[p, i, 3 * c + ev["stored"]] = t + 1100 + 500 * n
            w[p, i, ev["err_back"]] = t + 1030 + 500 * n  # consumer 0's epilogue: 30 + 60 + 10
            w[p, i, ev["out_issued"]] = t + 1090 + 500 * n
            t += 1300 + 500 * n
        w[p, 0, ev["program_end"]] = t - 200 + 400
        w[p, 0, ev["entry_ns"]], w[p, 0, ev["checked_ns"]] = 1000 * p, 1000 * p + 500  # ns: entries 1 us apart
        w[p, 0, ev["joined_ns"]], w[p, 0, ev["exit_ns"]] = 1000 * p + 9000, 1000 * p + 9300
    return w


def test_summary_separates_a_blocks_cost_from_a_tiles_and_the_waits_between_tiles(tmp_path):
    progs = [[4, 1, 9], [2, 6]]
    words = _words(progs, plan_lead=700)
    npz = tmp_path / "timeline.npz"  # as a run saves them: cut to the tiles run
    np.savez(npz, **{"made|stream|0|words": words[:, :3], "made|stream|0|compute": np.zeros(3),
                     "plain|call|1|words": _words([[3, 3]])[:, :2]})
    proc, rows = _summarize(npz, tmp_path / "out.csv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures, plain = ({k: float(v) if k not in ("case", "timing") and v != "" else v for k, v in r.items()}
                      for r in rows)
    assert (figures["case"], figures["timing"], figures["repeat"]) == ("made", "stream", 0)
    assert (plain["case"], plain["timing"], plain["repeat"]) == ("plain", "call", 1)
    assert (figures["programs"], figures["tiles"], figures["blocks"]) == (2, 5, 22)
    assert figures["block_cycles"] == pytest.approx(500) and figures["tile_cycles"] == pytest.approx(1000)
    assert figures["gap_cycles"] == 200 and figures["epilogue_cycles"] == 100
    assert figures["plan_lead_cycles"] == 700
    assert plain["plan_lead_cycles"] == ""  # no planner: no plan lead
    assert (figures["err_cycles"], figures["rows_cycles"], figures["lse_cycles"]) == (30, 60, 10)
    assert (figures["kernel_us"], figures["entry_spread_us"], figures["check_us"], figures["partitions_us"],
            figures["tail_us"]) == (10.3, 1.0, 0.5, 8.5, 0.3)
    assert figures["join_spread_us"] == 1.0 and figures["join_over_mean"] == pytest.approx(10 / 9.5)  # 9, 10 us
    spans = [300 + sum(1300 + 500 * n for n in blocks) + 200 for blocks in progs]
    assert figures["clock_mhz"] == pytest.approx(np.median([sp / 9000 for sp in spans]) * 1e3)
    # the consumers' time outside their blocks over the programs' spans
    busy = sum(2 * (1000 + 500 * n) for blocks in progs for n in blocks)
    assert figures["idle_share"] == pytest.approx(1 - busy / (2 * sum(spans)))
    assert "case=made  timing=stream  repeat=0  programs=2  tiles=5  blocks=22" in proc.stdout


def test_summary_refuses_a_full_timeline(tmp_path):
    """A program that filled every tile the timeline has room for may have run more: no figures, but the fix."""
    npz = tmp_path / "full.npz"
    np.savez(npz, **{"full|stream|0|words": _words([[1] * gk.TIMELINE_TILES])})
    proc, _ = _summarize(npz, tmp_path / "out.csv")
    assert proc.returncode != 0 and "raise ring_core.kernels.gluon_fwd.TIMELINE_TILES" in proc.stderr, proc.stderr


def test_summary_of_the_committed_run_gives_its_figures(tmp_path):
    """The committed run's saved words (each case's first repeat) sum up to the figures its CSV holds."""
    proc, rows = _summarize(RUN + ".npz", tmp_path / "again.csv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = {(r["case"], r["timing"]): r for r in csv.DictReader(open(RUN + ".csv")) if r["repeat"] == "0"}
    assert len(rows) == len(run) == 8
    for r in rows:
        want = run[r["case"], r["timing"]]
        for key, val in r.items():
            if key in ("case", "timing", "repeat") or val == want[key] == "":
                continue
            assert float(val) == pytest.approx(float(want[key]), rel=1e-9), (r["case"], r["timing"], key)
