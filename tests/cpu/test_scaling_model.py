"""benchmarks.scaling_model (CPU, a second): the two-level ring's performance model keeps the properties any
such model must have; no predicted number is fixed here."""

import csv
from dataclasses import replace

import pytest

from benchmarks import scaling_model as sm

GPUS = (8, 16, 32, 64, 128, 256, 512)
SEQS = (4096, 8192, 16384, 32768, 65536)


@pytest.fixture(scope="module")
def rates():
    return sm.load_rates(sm.DEFAULT_RATES, sm.DEFAULT_RING)


def _eff(rates, links=sm.Links(), **kw):
    c = sm.Case(**{"gpus": 64, "node_size": 8, "seq_local": 16384, "kv_heads": 8, **kw})
    return sm.predict(c, rates, links)


def test_inputs_are_read_from_the_committed_csvs(rates):
    for p in sm.PASSES:
        assert 0.5 < rates.ring[p] <= 1.05  # a ring keeps most of the one-GPU rate, never gains much
        for causal in (True, False):
            pts = rates.w1[(p, causal)]
            assert len(pts) >= 2 and all(100 < tf < 1000 for _, tf in pts)
    # interpolation stays between neighbours and is flat outside the measured lengths
    pts = rates.w1[("fwd", True)]
    (s0, r0), (s1, r1) = pts[0], pts[1]
    assert min(r0, r1) <= rates.w1_rate("fwd", True, (s0 * s1) ** 0.5) <= max(r0, r1)
    assert rates.w1_rate("fwd", True, pts[-1][0] * 8) == pts[-1][1] and rates.w1_rate("fwd", True, 1) == r0


@pytest.mark.parametrize("hkv", [8, 32])
def test_one_node_is_the_one_node_kernel_and_more_nodes_cost(rates, hkv):
    for s in SEQS:
        for p in sm.PASSES:
            res = _eff(rates, gpus=8, seq_local=s, kv_heads=hkv)
            one = res[p]
            assert one["eff"] == pytest.approx(1.0)
            # one node is the one-node ring: the W=1 rate times the ring factor, less any NVLink time not hidden
            assert one["eff_vs_1gpu"] <= rates.ring[p] + 1e-9
            if res["steps"]["nvlink_hidden_diag"]:
                assert one["eff_vs_1gpu"] == pytest.approx(rates.ring[p])
            for g in GPUS[1:]:
                r = _eff(rates, gpus=g, seq_local=s, kv_heads=hkv)[p]
                assert 0 < r["eff"] <= 1 and 0 < r["eff_vs_1gpu"] <= 1
        # forward: every added node adds a node-step with its merge, so efficiency never rises with the GPU count
        effs = [_eff(rates, gpus=g, seq_local=s, kv_heads=hkv)["fwd"]["eff"] for g in GPUS]
        assert all(a >= b - 1e-12 for a, b in zip(effs, effs[1:]))


@pytest.mark.parametrize("p", sm.PASSES)
@pytest.mark.parametrize("g", [16, 64, 512])
def test_longer_shards_and_fewer_kv_heads_scale_better(rates, p, g):
    for hkv in (8, 32):  # compute grows as S^2, the transfer as S
        effs = [_eff(rates, gpus=g, seq_local=s, kv_heads=hkv)[p]["eff"] for s in SEQS]
        assert all(a <= b + 1e-12 for a, b in zip(effs, effs[1:]))
    for s in SEQS:  # the same FLOPs, a quarter of the bytes
        assert _eff(rates, gpus=g, seq_local=s, kv_heads=8)[p]["eff"] >= \
            _eff(rates, gpus=g, seq_local=s, kv_heads=32)[p]["eff"] - 1e-12


@pytest.mark.parametrize("p", sm.PASSES)
def test_faster_links_never_hurt(rates, p):
    base = sm.Links()
    for s in (4096, 16384):
        slow = _eff(rates, replace(base, ib_gbit=100), seq_local=s, kv_heads=32)[p]["eff"]
        mid = _eff(rates, base, seq_local=s, kv_heads=32)[p]["eff"]
        fast = _eff(rates, replace(base, ib_gbit=1600), seq_local=s, kv_heads=32)[p]["eff"]
        assert slow <= mid <= fast
        assert _eff(rates, replace(base, overlap_cost=0.1), seq_local=s)[p]["eff"] < \
            _eff(rates, base, seq_local=s)[p]["eff"]
        assert _eff(rates, replace(base, glue_fwd=0, glue_bwd=0, glue_bwd_kv=0), seq_local=s)[p]["eff"] >= \
            _eff(rates, base, seq_local=s)[p]["eff"]


def test_backward_moves_more_and_brings_dkdv_home(rates):
    t = _eff(rates)["steps"]
    assert t["x_bwd"] > t["x_home"] > t["x_fwd"] / 2 and t["x_bwd"] > t["x_fwd"]
    # two nodes: the last dK/dV transfer is exposed once, so forward+backward time exceeds its compute by it
    r = _eff(rates, gpus=16)["fwd+bwd"]
    assert r["seconds"] >= r["compute"] + t["x_home"]


def test_smallest_hiding_shard(rates):
    c = sm.Case(gpus=64, node_size=8, seq_local=4096, kv_heads=32)
    links = sm.Links()
    for d in ("fwd", "bwd"):
        s32 = sm.smallest_hiding_seq(c, rates, links, d)
        s8 = sm.smallest_hiding_seq(replace(c, kv_heads=8), rates, links, d)
        fast = sm.smallest_hiding_seq(c, rates, replace(links, ib_gbit=800), d)
        assert s8 < s32 and fast < s32  # fewer bytes or more bandwidth: hidden at shorter shards
        assert sm.predict(replace(c, seq_local=s32), rates, links)["hidden"][d]
        assert not sm.predict(replace(c, seq_local=s32 - 256, gpus=24), rates, links)["hidden"][d]
    assert sm.smallest_hiding_seq(c, rates, replace(links, ib_gbit=1e-6), "fwd") is None


def test_command_line_writes_table_csv_plot_and_command(tmp_path, capsys):
    args = ["--gpus", "8,16,64", "--seq", "4k,16k", "--kv-heads", "8,32", "--tag", "t", "--out-dir", str(tmp_path)]
    assert sm.main(args) == 0
    out = capsys.readouterr().out
    assert "target fwd:" in out and "target fwd+bwd:" in out and "smallest S_local" in out
    rows = list(csv.DictReader(open(tmp_path / "scaling_model_t.csv")))
    assert len(rows) == 2 * 2 * 2 * 3
    assert {r["pass"] for r in rows} == set(sm.PASSES) and all(r["inputs"] for r in rows)
    assert (tmp_path / "scaling_model_t.png").stat().st_size > 10_000
    cmd = (tmp_path / "scaling_model_t.cmd").read_text().strip()
    assert cmd.startswith("python -m benchmarks.scaling_model --gpus 8,16,64")
    assert (tmp_path / "scaling_model_t.txt").read_text().strip() == out[:out.index("\nwrote")].strip()


@pytest.mark.parametrize("args,match", [
    (["--gpus", "12"], "not a whole number of nodes"),
    (["--seq", "4097"], "even"),
    (["--kv-heads", "5"], "divide"),
])
def test_bad_arguments(args, match, capsys):
    with pytest.raises(SystemExit) as e:
        sm.parse_args(args)
    assert e.value.code == 2 and match in capsys.readouterr().err
