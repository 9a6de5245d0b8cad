"""CPU tests of the benchmark harness's logic (benchmarks/attention.py, benchmarks/plot.py): FLOP counts and
the single-GPU share, quantiles, arguments and cases, ratios, the CSV log, the plot's grouping, and the
pure-JAX cuDNN-style ring (its LSE merging, run here with dense XLA blocks) against dense attention."""

import csv

import numpy as np
import pytest

from benchmarks import attention as bench
from benchmarks import plot as bplot


# ------------------------------------------------------------------------------------------ FLOPs


def test_flops_per_gpu_counts_the_rank_rectangle_and_half_when_causal():
    full = bench.Case(1, 32, 32, 128, 4096, False, "bfloat16")
    assert bench.flops_per_gpu(full, 2) == 4 * 32 * 4096 * 8192 * 128
    causal = bench.Case(1, 32, 8, 128, 4096, True, "bfloat16")
    assert bench.flops_per_gpu(causal, 2) == 2 * 32 * 4096 * 8192 * 128  # GQA does not change the FLOPs


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [32, 8])
def test_single_gpu_share_has_the_ring_rank_flops(world, causal, kv_heads):
    case = bench.Case(1, 32, kv_heads, 64, 2048, causal, "float16")
    for rank in range(world):
        prob = bench.limit_problem(case, world, rank)
        assert prob.flops(case.batch, case.head_dim) == bench.flops_per_gpu(case, world)
        assert prob.causal == causal and prob.q_heads // prob.kv_heads == 32 // kv_heads
        if causal:  # H/W heads over the whole sequence; rank r takes the r-th slice of heads
            assert (prob.q_len, prob.kv_len, prob.head_offset) == (2048 * world, 2048 * world, rank * 32 // world)
        else:  # the rank's own queries against every key
            assert (prob.q_len, prob.kv_len, prob.q_heads) == (2048, 2048 * world, 32)


def test_causal_share_needs_heads_divisible_by_world():
    with pytest.raises(bench.Unavailable, match="divisible"):
        bench.limit_problem(bench.Case(1, 32, 1, 64, 1024, True, "bfloat16"), 2)  # MQA: 1 kv head for 2 GPUs


def test_summarize_times_median_and_quantiles():
    med, q20, q80 = bench.summarize_times([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (med, q20, q80) == (3.0, 1.8, 4.2)
    assert bench.tflops(1e12, 1000.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bench.summarize_times([])


# ---------------------------------------------------------------------------------- arguments, cases


def test_defaults_are_the_issue_4_target_set():
    a = bench.parse_args([])
    cases = bench.enumerate_cases(a, 2)
    assert len(cases) == 8
    assert {(c.batch, c.heads, c.kv_heads, c.head_dim, c.dtype) for c in cases} == {(1, 32, 32, 128, "bfloat16")}
    assert sorted({c.seq_local for c in cases}) == [4096, 8192, 16384, 32768]
    assert {c.causal for c in cases} == {False, True}
    assert {c.layout for c in cases if c.causal} == {"zigzag"}
    assert (a.warmup, a.iters, a.input_sets, a.ref_max_seq) == (2, 10, 3, 8192)
    assert a.csv.startswith("benchmarks/results/attention_")
    assert bench.select_methods(a, 2) == list(bench.METHODS)
    assert bench.select_methods(a, 1) == [m for m in bench.METHODS if m in bench.WORLD1_METHODS]


def test_every_axis_is_selectable():
    a = bench.parse_args(["--seq", "4k,8k", "--kv-heads", "32,8", "--head-dim", "64,128", "--dtype", "bf16,fp16",
                          "--causal", "yes", "--methods", "jax_fused,torch_cp,torch_fused", "--framework", "torch"])
    cases = bench.enumerate_cases(a, 2)
    assert len(cases) == 2 * 2 * 2 * 2
    assert {c.seq_local for c in cases} == {4096, 8192} and all(c.causal for c in cases)
    assert {c.dtype for c in cases} == {"bfloat16", "float16"} and {c.kv_heads for c in cases} == {32, 8}
    assert bench.select_methods(a, 2) == ["torch_fused", "torch_cp"]  # METHODS order, jax filtered out


@pytest.mark.parametrize("argv", [["--methods", "nope"], ["--dtype", "fp32"], ["--heads", "32", "--kv-heads", "5"],
                                  ["--seq", "4x"], ["--warmup", "0"], ["--world1", "1"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_world1_runs_the_global_problems_on_one_process():
    a = bench.parse_args(["--world1", "2", "--causal", "no"])
    assert [c.seq_local for c in bench.enumerate_cases(a, 1)] == [8192, 16384, 32768, 65536]
    with pytest.raises(SystemExit, match="one process"):
        bench.enumerate_cases(a, 2)


def test_odd_causal_seq_is_refused():
    with pytest.raises(SystemExit, match="even"):
        bench.enumerate_cases(bench.parse_args(["--seq", "4097", "--causal", "yes"]), 2)


def test_cpu_smoke_defaults_are_tiny_and_run_every_method():
    a = bench.parse_args(["--cpu-smoke"])
    assert max(c.seq_local for c in bench.enumerate_cases(a, 2)) <= 128 and a.csv is None
    assert bench.select_methods(a, 1) == list(bench.METHODS)


def test_heap_covers_the_largest_case():
    from ring_core import heap, launch

    small = [bench.Case(1, 32, 32, 128, 4096, False, "bfloat16")]
    assert bench.heap_bytes_needed(small, 2) == heap.DEFAULT_HEAP_BYTES
    big = [bench.Case(1, 32, 32, 128, 1 << 20, False, "bfloat16")]
    need = 2 * (1 << 20) * 32 * 128 * 2
    assert bench.heap_bytes_needed(big, 2) == launch.heap_bytes_for(need) > need


# ------------------------------------------------------------------------------------- ratios, CSV


def _row(method, tflops, world=2, seq_local=4096, run="r1", error=""):
    return dict(run_id=run, world=str(world), method=method, batch="1", heads="32", kv_heads="32", head_dim="128",
                seq_local=str(seq_local), seq_global=str(seq_local * world), causal="1", dtype="bfloat16",
                tflops_per_gpu="" if tflops is None else str(tflops), error=error)


def test_ratios_same_run_and_case_and_scaling_from_world1_rows():
    rows = [_row("torch_fused", 300), _row("jax_fused", 240), _row("torch_cudnn_1gpu", 600),
            _row("jax_cudnn_1gpu", 500), _row("torch_cp", 200), _row("jax_xla", 60), _row("torch_ref", None, error="OOM"),
            _row("torch_cp", 999, run="r0"),  # another run: never a denominator here
            _row("torch_fused", 310, world=1, seq_local=8192, run="r9"),  # world-1 run of the same global problem
            _row("torch_fused", 320, world=1, seq_local=8192, run="r10")]  # ... again: the latest counts
    out = {(r["run_id"], r["method"], r["world"]): r for r in bench.compute_ratios(rows)}
    tf = out["r1", "torch_fused", "2"]
    assert tf["vs_cudnn_1gpu"] == 0.5  # against the faster single-GPU limit
    assert tf["vs_context_parallel"] == 1.5 and tf["vs_xla_ref"] == 5.0
    assert tf["vs_torch_ref"] == "" and tf["vs_cudnn_ring"] == ""  # failed / absent
    assert tf["scaling_eff"] == round(300 / 320, 3)
    jf = out["r1", "jax_fused", "2"]
    assert jf["vs_cudnn_1gpu"] == 0.4 and jf["scaling_eff"] == ""  # no world-1 jax_fused row
    assert all(out["r1", "torch_cp", "2"][c] == "" for c in bench.RATIOS)  # only fused rows carry ratios
    assert out["r10", "torch_fused", "1"]["scaling_eff"] == ""
    assert rows[0].get("vs_cudnn_1gpu") is None  # inputs untouched
    lines = bench.format_ratios([tf])
    assert lines and "0.50x cuDNN 1 GPU" in lines[0] and "scaling eff 0.94" in lines[0]


def test_csv_log_rewrites_after_every_row_and_keeps_earlier_runs(tmp_path):
    path = tmp_path / "sub" / "bench.csv"
    log = bench.CsvLog(str(path))
    log.add(_row("torch_fused", 300))
    assert len(list(csv.DictReader(open(path)))) == 1  # on disk at once
    log.add(_row("torch_cp", 200))
    log.refresh_ratios()
    again = bench.CsvLog(str(path))  # a second run appends
    assert [r["method"] for r in again.rows] == ["torch_fused", "torch_cp"]
    assert again.rows[0]["vs_context_parallel"] == "1.5"
    assert tuple(csv.DictReader(open(path)).fieldnames) == bench.CSV_COLUMNS
    assert bench.CsvLog(str(path), overwrite=True).rows == []
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="other columns"):
        bench.CsvLog(str(other))


def test_format_row_and_command_line():
    ok = dict(method="torch_fused", ms_median=10.0, ms_q20=9.5, ms_q80=11.0, tflops_per_gpu=123.4, max_abs_diff="",
              note="n")
    assert "123.4 TFLOP/s/GPU" in bench.format_row(ok)
    assert "ERROR boom" in bench.format_row(dict(method="torch_cp", error="boom"))
    cmd = bench.command_line(["--seq", "4k", "--csv", "a b.csv"], 2)
    assert cmd == "python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention --seq 4k --csv 'a b.csv'"


# -------------------------------------------------------------------------------------------- plot


def test_plot_groups_panels_lines_and_keeps_the_latest_row(tmp_path):
    rows = [_row("torch_fused", 100, seq_local=4096), _row("torch_fused", 120, seq_local=4096, run="r2"),
            _row("torch_fused", 200, seq_local=8192), _row("torch_cudnn_1gpu", 600, seq_local=4096),
            _row("torch_fused", 310, world=1, seq_local=8192), _row("torch_cp", None, error="x")]
    rows.append(dict(_row("torch_fused", 90), causal="0"))
    data = bplot.panels(rows)
    assert set(data) == {("1", "bfloat16", "128", "32", "32", "1"), ("0", "bfloat16", "128", "32", "32", "1")}
    lines = data["1", "bfloat16", "128", "32", "32", "1"]
    assert lines["torch_fused (W=2)"] == [(8192, 120.0), (16384, 200.0)]  # x = global length; the rerun wins
    assert lines["torch_fused (W=1)"] == [(8192, 310.0)] and lines["torch_cudnn_1gpu (share of W=2)"] == [(8192, 600.0)]
    assert not any(label.startswith("torch_cp") for label in lines)  # failed: not plotted
    assert bplot.panels(rows, x="local")["1", "bfloat16", "128", "32", "32", "1"]["torch_fused (W=2)"][0] == (4096, 120.0)
    md = bplot.table(rows)
    assert "| torch_fused | 2 | causal (zigzag), bfloat16, D=128, H=32/32 | 8192 | 200.0 |" in md
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    assert bplot.plot(rows, str(out)) == 2
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- the pure-JAX ring


@pytest.mark.parametrize("world,causal", [(2, False), (4, True)])
def test_cudnn_style_ring_merges_blocks_exactly(cpu_mesh, world, causal):
    """The hand-written ring (LSE merge, zigzag half-blocks) with dense XLA blocks equals dense attention."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_ring
    from jax_ring.reference import dense_attention

    mesh = cpu_mesh(world)
    s_g, h, hkv, d = 16 * world, 4, 2, 16
    rng = np.random.default_rng(world + 10 * causal)
    q = rng.standard_normal((2, s_g, h, d), dtype=np.float32)
    k, v = (rng.standard_normal((2, s_g, hkv, d), dtype=np.float32) for _ in range(2))
    layout = "zigzag" if causal else "contiguous"

    def body(q, k, v):
        return bench.cudnn_ring_attention(q, k, v, axis_name="sp", world=world, is_causal=causal,
                                          block_attention=bench.xla_block_attention)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                              check_vma=False))
    out = f(*(jax_ring.to_layout(x, layout, world) for x in (q, k, v)))
    out = np.asarray(jax_ring.from_layout(np.asarray(out), layout, world))
    ref, _ = dense_attention(q, k, v, is_causal=causal)
    np.testing.assert_allclose(out, np.asarray(ref), atol=2e-6, rtol=1e-5)
