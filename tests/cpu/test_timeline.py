"""benchmarks/timeline.py's reading of the Gluon forward's timeline words (no GPU: words made here as the kernel
lays them out, ring_core.kernels.gluon_fwd's TIMELINE_* constants)."""
import numpy as np
import pytest

from benchmarks import timeline
from ring_core.kernels import gluon_fwd as gk


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


def test_summary_separates_a_blocks_cost_from_a_tiles_and_the_waits_between_tiles():
    progs = [[4, 1, 9], [2, 6]]
    figures, arrays = timeline.summarize(_words(progs, plan_lead=700), gk.TIMELINE_EVENT)
    assert (figures["programs"], figures["tiles"], figures["blocks"]) == (2, 5, 22)
    assert figures["block_cycles"] == pytest.approx(500) and figures["tile_cycles"] == pytest.approx(1000)
    assert figures["gap_cycles"] == 200 and figures["epilogue_cycles"] == 100
    assert figures["plan_lead_cycles"] == 700
    assert (figures["err_cycles"], figures["rows_cycles"], figures["lse_cycles"]) == (30, 60, 10)
    assert (figures["kernel_us"], figures["entry_spread_us"], figures["check_us"], figures["partitions_us"],
            figures["tail_us"]) == (10.3, 1.0, 0.5, 8.5, 0.3)
    assert figures["join_spread_us"] == 1.0 and figures["join_over_mean"] == pytest.approx(10 / 9.5)  # 9, 10 us
    spans = [300 + sum(1300 + 500 * n for n in blocks) + 200 for blocks in progs]
    assert figures["clock_mhz"] == pytest.approx(np.median([sp / 9000 for sp in spans]) * 1e3)
    # the consumers' time outside their blocks over the programs' spans
    busy = sum(2 * (1000 + 500 * n) for blocks in progs for n in blocks)
    spans = sum(300 + sum(1300 + 500 * n for n in blocks) + 200 for blocks in progs)
    assert figures["idle_share"] == pytest.approx(1 - busy / (2 * spans))
    assert sorted(arrays["blocks"].tolist()) == sorted(2 * [n for blocks in progs for n in blocks])


def test_summary_without_a_planner_reports_no_plan_lead_and_refuses_a_full_timeline():
    figures, _ = timeline.summarize(_words([[3, 3]]), gk.TIMELINE_EVENT)
    assert "plan_lead_cycles" not in figures
    with pytest.raises(RuntimeError, match="TIMELINE_TILES"):
        timeline.summarize(_words([[1] * gk.TIMELINE_TILES]), gk.TIMELINE_EVENT)
