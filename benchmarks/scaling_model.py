"""A performance model of the two-level ring (``ring_core.nodes``) from 8 to 512 GPUs: forward and
forward+backward scaling efficiency, built from measured one-GPU kernel rates and link bandwidths.

    python -m benchmarks.scaling_model                       # the defaults below; table, CSV, PNG, .cmd
    python -m benchmarks.scaling_model --ib-gbit 200 --tag ib200

What it predicts. A job of W = N x R GPUs (N nodes of R = ``--node-size`` GPUs), one rank a GPU, bf16, batch 1,
H query heads, Hkv K/V heads, head_dim D, S = seq_local tokens a rank, causal, zigzag. Node-step s (s = 0..N-1) is
one call of the one-node fused ring over the node's R ranks against the K/V of node n - s: every rank computes its
S queries against the node's R*S keys, half of the pairs (zigzag balances causal work: S x RS/2 at every node-step,
the diagonal one included), in R intra-node ring steps of S^2/2 pairs each. Meanwhile the K/V shard of the next
node-step travels from rank (n-1, r) over InfiniBand (posted before the call, waited for after it).

Assumptions (each a flag where it is a number):

1. Kernel rate. The one-GPU (W=1) rate of the fused kernel, torch frontend, bf16, H32 Hkv32 D128, timed back to
   back (``timing`` stream), read from ``--rates`` CSVs (``benchmarks/attention.py`` rows; where two files hold the
   same case, the newer ``date`` wins): per pass (fwd, fwd+bwd) and causal/non-causal, interpolated in log2(seq)
   between measured lengths and held flat outside them (the defaults measure 2k-32k; a 64k rank's node call runs
   at the 32k rate). The rate of a ring call of R ranks is the W=1 rate at the same global length (R*S for the
   diagonal node-step; R*S/2 for the off-diagonal ones, which are non-causal calls on half shards with the heads
   doubled, ``ring_core.nodes.K_EARLY`` / ``Q_LATE``) times the ring factor (2). The Hkv=8 rows reuse the Hkv=32
   rates (the FLOPs depend on H, not Hkv; at W=1 the GQA 32/8 forward ran 0.97-1.07x MHA's rate at 16k and 32k,
   ``attention_w1_fwd_1xH200_2026-12-04.csv``, so this errs low if anything).
2. Ring factor: what the fused ring over R ranks keeps of the W=1 rate, from ``--ring`` (the same dense call at two
   ranks sharing one GPU, ``ranks_per_gpu`` 2: the GPU's rate is 2x a rank's) over the W=1 rate at that global
   length: 0.903 forward and 0.918 forward+backward in the default files. Measured at R=2 and S=16k causal only;
   taken for every R, S and for the non-causal node-steps. Intra-node transfers overlap compute as measured (the
   one-GPU ring moves its K/V too), except where NVLink is slower than an intra-node step: a step then takes the
   NVLink time (``--nvlink-gbs`` a direction per GPU at ``--nvlink-eff``: forward K/V bf16, backward K/V bf16 and
   dK/dV float32 a step).
3. Between nodes, per node-step and rank: forward the K/V shard, 2 * S * Hkv * D * 2 bytes; backward the K/V again
   plus the float32 dK/dV partials one node-step behind them, 2 * S * Hkv * D * (2 + 4) bytes; at ``--ib-gbit``
   per GPU (one 400 Gb/s NIC a GPU, as DGX/HGX H100 and H200 nodes have) times ``--ib-eff`` (0.8: NCCL
   point-to-point over NDR reaches roughly 80-90 % of line rate for messages of tens of MB; 0.8 errs low), plus
   ``--latency-us`` per transfer. Full duplex: a rank's send and receive do not share bandwidth.
4. Overlap. The transfer of node-step s+1 runs during node-step s (and its merge), so a step takes
   max(compute + merge, transfer); the first transfer is posted before node-step 0 and hides behind it like every
   other, so the first step exposes max(0, transfer - compute). The last node-step has nothing to wait for.
   Backward (``ring_core.nodes.backward``): the node's own K/V's call is split over halves of the kv heads (one
   kv head: one call, made last); the first half runs under the first K/V transfer, the other node-steps under
   the next K/V (bf16) and the partials of the step before (2 * S * Hkv * D * 4 bytes) sharing the link, and the
   second half under the last partials' transfer home.
   ``--overlap-cost`` slows the kernel while NCCL runs beside it (SMs and memory bandwidth NCCL's kernels take):
   0 by default, which the two-GPU measurement has not yet checked (none lent); a persistent kernel that keeps every
   SM may delay NCCL's kernels, which this model does not see.
5. Merge and glue, on the compute stream after each node-step but the first (eager framework ops in
   ``ring_core.nodes``: the half-shard permutes, float32 casts, the log-sum-exp merge of three element-wise
   kernels): ``--glue-fwd`` bytes of HBM traffic per element of the S x H x D output (48), backward ``--glue-bwd``
   per element of dQ (40) plus ``--glue-bwd-kv`` per element of dK and of dV (26), at ``--hbm-tbs`` (H200: 4.8 TB/s)
   times ``--hbm-eff`` (0.8).
6. FLOPs: 4 * D per query-key pair and head forward; forward+backward 3.5x (the harness's convention), so the
   backward's time is the forward+backward time less the forward's.

Outputs, per (pass, Hkv, S, GPUs): ``eff`` = the node-steps' compute (without ``--overlap-cost``) over the
predicted time (what the between-node ring, the merges and the last exposed transfer cost on top of the one-node
kernel), and
``eff_vs_1gpu`` = one GPU's time for the per-GPU share of the work at the W=1 causal rate over the predicted time
(``eff`` times the ring factor and the rate difference of the half-shard calls). ``hidden`` says whether every
between-node transfer hides behind its node-step's call alone (the merge not counted); the smallest hiding S is
searched in multiples of 256 tokens.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import sys
from dataclasses import dataclass, replace
from datetime import datetime, timezone

if __package__ in (None, ""):  # run as a script path: make `benchmarks` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_RATES = ("benchmarks/results/attention_w1_stream_1xH200_2026-12-04.csv",
                 "benchmarks/results/tiles_W1_1xH200_2026-12-03.csv")
DEFAULT_RING = "benchmarks/results/masks_packed_stream_W2_1xH200_2026-12-04.csv"
PASSES = ("fwd", "fwd+bwd")
FWD_BWD_FLOPS = 3.5  # forward+backward FLOPs over the forward's (benchmarks/harness.py)


# ------------------------------------------------------------------------------------------ measured inputs
def _case(row, heads=32, head_dim=128) -> bool:
    return (row.get("method") == "torch_fused" and row.get("dtype") in ("bf16", "bfloat16")
            and int(row.get("heads", 0)) == heads and int(row.get("head_dim", 0)) == head_dim
            and int(row.get("kv_heads", 0)) == heads and (row.get("mask") or "none") == "none"
            and (row.get("layout") or "zigzag") in ("zigzag", "contiguous") and not row.get("error"))


def _read(path):
    """Rows of a CSV; a relative path that is not found from here is taken from the repository root."""
    if not os.path.exists(path) and not os.path.isabs(path):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True)
class Rates:
    """W=1 TFLOP/s per (pass, causal) at measured sequence lengths, and the ring factor per pass."""

    w1: dict  # (pass, causal) -> sorted [(seq, tflops)]
    ring: dict  # pass -> factor
    sources: str

    def w1_rate(self, pass_: str, causal: bool, seq: float) -> float:
        """TFLOP/s at ``seq`` (log2 interpolation, flat outside the measured lengths)."""
        pts = self.w1[(pass_, bool(causal))]
        if seq <= pts[0][0]:
            return pts[0][1]
        if seq >= pts[-1][0]:
            return pts[-1][1]
        for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
            if s0 <= seq <= s1:
                t = (math.log2(seq) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return r0 + t * (r1 - r0)
        raise AssertionError("unreachable")


def load_rates(rate_paths, ring_path) -> Rates:
    """The W=1 rates from ``rate_paths`` (newest ``date`` wins per case) and the ring factor from ``ring_path``."""
    best = {}  # (pass, causal, seq) -> (date, tflops)
    for path in rate_paths:
        for r in _read(path):
            if r.get("world") != "1" or r.get("ranks_per_gpu", "1") not in ("1", "") or not _case(r):
                continue
            key = (r.get("pass") or "fwd", r["causal"] in ("1", "True", "true"), int(r["seq_local"]))
            date = r.get("date", "")
            if key not in best or date > best[key][0]:
                best[key] = (date, float(r["tflops_per_gpu"]))
    w1 = {}
    for (p, c, s), (_, tf) in best.items():
        w1.setdefault((p, c), []).append((s, tf))
    for p in PASSES:
        for c in (True, False):
            if (p, c) not in w1:
                what = "causal" if c else "non-causal"
                raise ValueError(f"no W=1 torch_fused bf16 H32 D128 {p} {what} rows in {', '.join(rate_paths)}; "
                                 f"pass --rates files from benchmarks/attention.py that hold them")
            w1[(p, c)].sort()
    ring = {}
    for r in _read(ring_path):
        if not _case(r) or r.get("causal") not in ("1", "True", "true"):
            continue
        world, per_gpu = int(r["world"]), int(r.get("ranks_per_gpu") or 1)
        if world < 2 or per_gpu != world:  # every rank on one GPU: the GPU's rate against W=1's
            continue
        p = r.get("pass") or "fwd"
        gpu_rate = float(r["tflops_per_gpu"]) * per_gpu
        w1_rows = dict(w1[(p, True)])
        seq_global = int(r["seq_local"]) * world
        if seq_global not in w1_rows:
            continue
        ring[p] = gpu_rate / w1_rows[seq_global]
    for p in PASSES:
        if p not in ring:
            raise ValueError(f"no {p} causal ring rows with every rank on one GPU in {ring_path} whose global length "
                             f"has a W=1 row in --rates; pass --ring with such rows")
    return Rates(w1, ring, sources=" ".join(list(rate_paths) + [ring_path]))


# ------------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class Links:
    ib_gbit: float = 400.0
    ib_eff: float = 0.8
    nvlink_gbs: float = 450.0
    nvlink_eff: float = 0.8
    latency_us: float = 20.0
    hbm_tbs: float = 4.8
    hbm_eff: float = 0.8
    glue_fwd: float = 48.0
    glue_bwd: float = 40.0
    glue_bwd_kv: float = 26.0
    overlap_cost: float = 0.0

    @property
    def ib_bytes_s(self) -> float:
        return self.ib_gbit / 8 * 1e9 * self.ib_eff

    @property
    def nvlink_bytes_s(self) -> float:
        return self.nvlink_gbs * 1e9 * self.nvlink_eff

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tbs * 1e12 * self.hbm_eff


@dataclass(frozen=True)
class Case:
    gpus: int
    node_size: int
    seq_local: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def num_nodes(self) -> int:
        return self.gpus // self.node_size


def _step_times(c: Case, rates: Rates, links: Links) -> dict:
    """Per node-step seconds: compute of the diagonal (0) and off-diagonal (1) steps, forward and backward, glue,
    and the transfers."""
    S, H, Hkv, D, R = c.seq_local, c.heads, c.kv_heads, c.head_dim, c.node_size
    pairs = S * S / 2  # per intra-node ring step, every step (zigzag)
    f_fwd = 4.0 * D * H * pairs
    slow = 1.0 + links.overlap_cost if c.num_nodes > 1 else 1.0
    out = {}
    for kind, causal, seq in (("diag", True, R * S), ("off", False, R * S / 2)):
        rf = rates.w1_rate("fwd", causal, seq) * 1e12 * rates.ring["fwd"]
        rfb = rates.w1_rate("fwd+bwd", causal, seq) * 1e12 * rates.ring["fwd+bwd"]
        t_f = f_fwd / rf
        t_b = max(FWD_BWD_FLOPS * f_fwd / rfb - t_f, 0.0)
        kv = 2 * S * Hkv * D
        nv_f = kv * 2 / links.nvlink_bytes_s if R > 1 else 0.0
        nv_b = kv * (2 + 4) / links.nvlink_bytes_s if R > 1 else 0.0
        out[f"fwd_{kind}"] = R * max(t_f * slow, nv_f)
        out[f"bwd_{kind}"] = R * max(t_b * slow, nv_b)
        out[f"fwd_{kind}_alone"], out[f"bwd_{kind}_alone"] = R * max(t_f, nv_f), R * max(t_b, nv_b)  # no NCCL beside
        out[f"nvlink_hidden_{kind}"] = nv_f <= t_f and nv_b <= t_b
    kv = 2 * S * Hkv * D
    lat = links.latency_us * 1e-6
    out["x_fwd"] = kv * 2 / links.ib_bytes_s + lat
    out["x_bwd"] = kv * (2 + 4) / links.ib_bytes_s + lat
    out["x_home"] = kv * 4 / links.ib_bytes_s + lat
    out["glue_fwd"] = S * H * D * links.glue_fwd / links.hbm_bytes_s
    out["glue_bwd"] = (S * H * D * links.glue_bwd + kv * links.glue_bwd_kv) / links.hbm_bytes_s
    return out


def _backward_time(t: dict, N: int, kv_heads: int):
    """(seconds, compute seconds, whether every transfer hides behind a call alone) of the backward on N > 1 nodes
    (module docstring, 4): the own K/V's halves first and last, the other node-steps between them."""
    first = t["bwd_diag"] / 2 if kv_heads >= 2 else 0.0
    last = t["bwd_diag"] - first
    total, hidden = max(first, t["x_fwd"]), t["x_fwd"] <= first  # the first K/V transfer (the forward's bytes)
    for s in range(1, N):
        kv = t["x_fwd"] if s < N - 1 else 0.0  # the next node-step's K/V
        part = t["x_home"] if s >= 2 else 0.0  # the partials of the step before (none before node-step 2)
        x = t["x_bwd"] if kv and part else kv + part  # sharing the link: both as one transfer of both's bytes
        total += max(t["bwd_off"] + t["glue_bwd"], x)
        hidden = hidden and x <= t["bwd_off"]
    total += max(last + t["glue_bwd"], t["x_home"])  # the last partials home
    hidden = hidden and t["x_home"] <= last
    return total, t["bwd_diag_alone"] + (N - 1) * t["bwd_off_alone"], hidden


def predict(c: Case, rates: Rates, links: Links) -> dict:
    """Predicted seconds and efficiencies of one call (module docstring)."""
    if c.gpus % c.node_size:
        raise ValueError(f"{c.gpus} GPUs are not whole nodes of {c.node_size}")
    t = _step_times(c, rates, links)
    N = c.num_nodes
    res = {}
    hidden_dir = {}
    for p in PASSES:
        total = comp = 0.0
        for d in ("fwd", "bwd") if p == "fwd+bwd" else ("fwd",):
            if d == "bwd" and N > 1:
                t_bwd, c_bwd, hidden_dir[d] = _backward_time(t, N, c.kv_heads)
                total, comp = total + t_bwd, comp + c_bwd
                continue
            hidden = True
            steps = [t[f"{d}_diag"]] + [t[f"{d}_off"]] * (N - 1)
            alone = [t[f"{d}_diag_alone"]] + [t[f"{d}_off_alone"]] * (N - 1)
            glue = [0.0] + [t[f"glue_{d}"]] * (N - 1)
            x = t[f"x_{d}"]
            for s in range(N):
                work = steps[s] + glue[s]
                if s < N - 1:  # the transfer for node-step s + 1 runs during this one
                    total += max(work, x)  # the merge overlaps the transfer too
                    hidden = hidden and x <= steps[s]  # hides behind the call alone
                else:
                    total += work
                comp += alone[s]
            hidden_dir[d] = hidden
        # one GPU's time for this GPU's share of the work: W * S^2 / 2 pairs at the W=1 causal rate
        share = 4.0 * c.head_dim * c.heads * c.gpus * c.seq_local ** 2 / 2
        rate = rates.w1_rate(p, True, c.gpus * c.seq_local) * 1e12
        ideal = (FWD_BWD_FLOPS if p == "fwd+bwd" else 1.0) * share / rate
        res[p] = dict(seconds=total, compute=comp, eff=comp / total, eff_vs_1gpu=ideal / total,
                      hidden=all(hidden_dir.values()))
    res["steps"], res["hidden"] = t, hidden_dir
    return res


def smallest_hiding_seq(c: Case, rates: Rates, links: Links, direction: str, step: int = 256,
                        limit: int = 1 << 20):
    """The smallest multiple of ``step`` tokens a rank from which on (up to ``limit``) every between-node transfer
    of the ``direction`` ("fwd" or "bwd") pass hides behind its node-step's call: checked at four nodes, which
    hold every kind of node-step (the own K/V's; the others with the next K/V in flight, with the partials before,
    with both); the condition is per step, the same for every N >= 4."""
    c3 = replace(c, gpus=4 * c.node_size)
    if not predict(replace(c3, seq_local=limit), rates, links)["hidden"][direction]:
        return None
    for s in range(limit - step, 0, -step):
        if not predict(replace(c3, seq_local=s), rates, links)["hidden"][direction]:
            return s + step
    return step


# ------------------------------------------------------------------------------------------ command line
def _ints(text):
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scaling_model", description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default=",".join(DEFAULT_RATES),
                    help="comma-separated benchmark CSVs with the W=1 torch_fused rows (default: %(default)s)")
    ap.add_argument("--ring", default=DEFAULT_RING,
                    help="benchmark CSV with ring rows of every rank on one GPU (default: %(default)s)")
    ap.add_argument("--gpus", default="8,16,32,64,128,256,512", type=_ints)
    ap.add_argument("--node-size", default=8, type=int, help="GPUs (ranks) per node")
    ap.add_argument("--seq", default="4k,8k,16k,32k,64k", type=_ints, help="seq_local values")
    ap.add_argument("--kv-heads", default="8,32", type=_ints)
    ap.add_argument("--heads", default=32, type=int)
    ap.add_argument("--head-dim", default=128, type=int)
    for f in Links.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default)
    ap.add_argument("--target-gpus", default=64, type=int)
    ap.add_argument("--target-seq", default="16k", type=lambda s: _ints(s)[0])
    ap.add_argument("--target-eff", default=0.9, type=float)
    ap.add_argument("--tag", default=None, help="name part of the outputs (default: the UTC date)")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--self-check", action="store_true",
                    help="check the model's properties on these rates (no output files) and exit")
    a = ap.parse_args(argv)
    for g in a.gpus:
        if g < 1 or g % a.node_size:
            ap.error(f"--gpus {g} is not a whole number of nodes of --node-size {a.node_size}")
    if any(s < 2 or s % 2 for s in a.seq):
        ap.error("--seq values must be even (zigzag halves)")
    if any(a.heads % h for h in a.kv_heads):
        ap.error(f"--kv-heads must divide --heads {a.heads}")
    return a


def run(a) -> list:
    rates = load_rates([p for p in a.rates.split(",") if p], a.ring)
    links = Links(**{k: getattr(a, k) for k in Links.__dataclass_fields__})
    rows = []
    for hkv in a.kv_heads:
        for s in a.seq:
            for g in a.gpus:
                c = Case(gpus=g, node_size=a.node_size, seq_local=s, heads=a.heads, kv_heads=hkv,
                         head_dim=a.head_dim)
                res = predict(c, rates, links)
                st = res["steps"]
                for p in PASSES:
                    r = res[p]
                    rows.append(dict(
                        pass_=p, gpus=g, nodes=c.num_nodes, node_size=a.node_size, seq_local=s, heads=a.heads,
                        kv_heads=hkv, head_dim=a.head_dim, ms=r["seconds"] * 1e3, compute_ms=r["compute"] * 1e3,
                        eff=r["eff"], eff_vs_1gpu=r["eff_vs_1gpu"], ib_hidden=r["hidden"] if g > a.node_size else "",
                        node_step_ms=(st["fwd_off"] if p == "fwd" else st["fwd_off"] + st["bwd_off"]) * 1e3,
                        ib_ms=(st["x_fwd"] if p == "fwd" else st["x_fwd"] + st["x_bwd"]) * 1e3,
                        nvlink_hidden=st["nvlink_hidden_diag"] and st["nvlink_hidden_off"],
                        ring_factor=rates.ring[p], ib_gbit=links.ib_gbit, ib_eff=links.ib_eff,
                        nvlink_gbs=links.nvlink_gbs, overlap_cost=links.overlap_cost, inputs=rates.sources))
    hiding = []
    for hkv in a.kv_heads:
        c = Case(gpus=3 * a.node_size, node_size=a.node_size, seq_local=4096, heads=a.heads, kv_heads=hkv,
                 head_dim=a.head_dim)
        hiding.append((hkv, {d: smallest_hiding_seq(c, rates, links, d) for d in ("fwd", "bwd")}))
    return rows, hiding, rates


def _fmt_seq(s):
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


def table(rows, a) -> str:
    lines = []
    for p in PASSES:
        for hkv in a.kv_heads:
            lines.append(f"\n{p}, H{a.heads} Hkv{hkv} D{a.head_dim}, {a.node_size} GPUs a node: eff (eff_vs_1gpu)")
            lines.append("| S_local | " + " | ".join(f"{g} GPUs" for g in a.gpus) + " |")
            lines.append("|---" * (len(a.gpus) + 1) + "|")
            for s in a.seq:
                cells = [f"{r['eff']:.3f} ({r['eff_vs_1gpu']:.3f})" for g in a.gpus for r in rows
                         if r["pass_"] == p and r["kv_heads"] == hkv and r["seq_local"] == s and r["gpus"] == g]
                lines.append(f"| {_fmt_seq(s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(rows, hiding, a) -> list:
    out = []
    for p in PASSES:
        sel = [r for r in rows if r["pass_"] == p and r["gpus"] == a.target_gpus and r["seq_local"] >= a.target_seq]
        if not sel:
            continue
        worst = min(sel, key=lambda r: r["eff"])
        met = worst["eff"] >= a.target_eff
        out.append(f"target {p}: eff >= {a.target_eff} at {a.target_gpus} GPUs for S_local >= "
                   f"{_fmt_seq(a.target_seq)}: {'met' if met else 'NOT met'} (lowest {worst['eff']:.3f} at Hkv "
                   f"{worst['kv_heads']}, S_local {_fmt_seq(worst['seq_local'])}; eff_vs_1gpu there "
                   f"{worst['eff_vs_1gpu']:.3f})")
    for hkv, h in hiding:
        names = {"fwd": "forward", "bwd": "backward"}
        out.append(f"smallest S_local whose between-node transfers hide behind the node-step's call (Hkv {hkv}): "
                   + ", ".join(f"{names[d]} {h[d] if h[d] is not None else 'none up to 1M'}" for d in h)
                   + " (forward+backward: the larger)")
    return out


def plot(rows, a, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PASSES), len(a.kv_heads), figsize=(5.5 * len(a.kv_heads), 4.2 * len(PASSES)),
                             squeeze=False, sharey=True)
    for i, p in enumerate(PASSES):
        for j, hkv in enumerate(a.kv_heads):
            ax = axes[i][j]
            for s in a.seq:
                sel = sorted((r for r in rows if r["pass_"] == p and r["kv_heads"] == hkv and r["seq_local"] == s),
                             key=lambda r: r["gpus"])
                x = [r["gpus"] for r in sel]
                line, = ax.plot(x, [r["eff"] for r in sel], "o-", label=f"S_local {_fmt_seq(s)}")
                ax.plot(x, [r["eff_vs_1gpu"] for r in sel], ":", color=line.get_color())
            ax.axhline(a.target_eff, color="gray", lw=0.8, ls="--")
            ax.axvline(a.target_gpus, color="gray", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xticks(a.gpus, [str(g) for g in a.gpus])
            ax.set_title(f"{p}, H{a.heads} Hkv{hkv} D{a.head_dim}, causal zigzag")
            ax.set_xlabel(f"GPUs ({a.node_size} a node)")
            ax.set_ylabel("predicted efficiency")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, title="solid: eff; dotted: vs 1 GPU", title_fontsize=8)
    fig.suptitle(f"Two-level ring, model: InfiniBand {a.ib_gbit:g} Gb/s x {a.ib_eff:g} a GPU, NVLink "
                 f"{a.nvlink_gbs:g} GB/s x {a.nvlink_eff:g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def self_check(a) -> int:
    """The properties any such model must have, checked on the rates of ``a`` (no predicted number is fixed here):
    the inputs read, one node is the one-node kernel, more nodes never help the forward, longer shards and fewer K/V
    heads scale better, faster links never hurt, the backward moves more and brings dK/dV home, and the smallest
    shard that hides the transfer. Prints each check; 0 if all hold."""
    gpus, seqs = (8, 16, 32, 64, 128, 256, 512), (4096, 8192, 16384, 32768, 65536)
    rates = load_rates([p for p in a.rates.split(",") if p], a.ring)
    base = Links()

    def eff(links=base, **kw):
        return predict(Case(**{"gpus": 64, "node_size": 8, "seq_local": 16384, "kv_heads": 8, **kw}), rates, links)

    def inputs():
        for p in PASSES:
            assert 0.5 < rates.ring[p] <= 1.05, rates.ring  # a ring keeps most of the one-GPU rate, never gains much
            for causal in (True, False):
                pts = rates.w1[(p, causal)]
                assert len(pts) >= 2 and all(100 < tf < 1000 for _, tf in pts), pts
        # interpolation stays between neighbours and is flat outside the measured lengths
        pts = rates.w1[("fwd", True)]
        (s0, r0), (s1, r1) = pts[0], pts[1]
        assert min(r0, r1) <= rates.w1_rate("fwd", True, (s0 * s1) ** 0.5) <= max(r0, r1)
        assert rates.w1_rate("fwd", True, pts[-1][0] * 8) == pts[-1][1] and rates.w1_rate("fwd", True, 1) == r0

    def one_node_is_the_one_node_kernel_and_more_nodes_cost():
        for hkv in (8, 32):
            for s in seqs:
                for p in PASSES:
                    res = eff(gpus=8, seq_local=s, kv_heads=hkv)
                    one = res[p]
                    assert abs(one["eff"] - 1.0) < 1e-9, one
                    # one node is the one-node ring: the W=1 rate times the ring factor, less NVLink time not hidden
                    assert one["eff_vs_1gpu"] <= rates.ring[p] + 1e-9
                    if res["steps"]["nvlink_hidden_diag"]:
                        assert abs(one["eff_vs_1gpu"] - rates.ring[p]) < 1e-9
                    for g in gpus[1:]:
                        r = eff(gpus=g, seq_local=s, kv_heads=hkv)[p]
                        assert 0 < r["eff"] <= 1 and 0 < r["eff_vs_1gpu"] <= 1, (g, s, hkv, p, r)
                # forward: every added node adds a node-step with its merge, so efficiency never rises with GPUs
                effs = [eff(gpus=g, seq_local=s, kv_heads=hkv)["fwd"]["eff"] for g in gpus]
                assert all(x >= y - 1e-12 for x, y in zip(effs, effs[1:])), (s, hkv, effs)

    def longer_shards_and_fewer_kv_heads_scale_better():
        for p in PASSES:
            for g in (16, 64, 512):
                for hkv in (8, 32):  # compute grows as S^2, the transfer as S
                    effs = [eff(gpus=g, seq_local=s, kv_heads=hkv)[p]["eff"] for s in seqs]
                    assert all(x <= y + 1e-12 for x, y in zip(effs, effs[1:])), (p, g, hkv, effs)
                for s in seqs:  # the same FLOPs, a quarter of the bytes
                    assert eff(gpus=g, seq_local=s, kv_heads=8)[p]["eff"] >= \
                        eff(gpus=g, seq_local=s, kv_heads=32)[p]["eff"] - 1e-12

    def faster_links_never_hurt():
        for p in PASSES:
            for s in (4096, 16384):
                slow, mid, fast = (eff(replace(base, ib_gbit=b), seq_local=s, kv_heads=32)[p]["eff"]
                                   for b in (100, base.ib_gbit, 1600))
                assert slow <= mid <= fast, (p, s, slow, mid, fast)
                assert eff(replace(base, overlap_cost=0.1), seq_local=s)[p]["eff"] < \
                    eff(base, seq_local=s)[p]["eff"]
                assert eff(replace(base, glue_fwd=0, glue_bwd=0, glue_bwd_kv=0), seq_local=s)[p]["eff"] \
                    >= eff(base, seq_local=s)[p]["eff"]

    def backward_moves_more_and_brings_dkdv_home():
        t = eff()["steps"]
        assert t["x_bwd"] > t["x_home"] > t["x_fwd"] / 2 and t["x_bwd"] > t["x_fwd"], t
        # two nodes: the last dK/dV transfer runs under the second half of the own K/V's call, so forward+backward
        # time exceeds its compute by what that half does not hide, and by all of it with one kv head (made last)
        r = eff(gpus=16)["fwd+bwd"]
        assert r["seconds"] >= r["compute"] + max(0.0, t["x_home"] - t["bwd_diag"] / 2) - 1e-12, r
        one = eff(gpus=16, kv_heads=1)
        assert one["fwd+bwd"]["seconds"] >= one["fwd+bwd"]["compute"] + one["steps"]["x_fwd"] - 1e-12, one

    def smallest_hiding_shard():
        c = Case(gpus=64, node_size=8, seq_local=4096, kv_heads=32)
        for d in ("fwd", "bwd"):
            s32 = smallest_hiding_seq(c, rates, base, d)
            s8 = smallest_hiding_seq(replace(c, kv_heads=8), rates, base, d)
            fast = smallest_hiding_seq(c, rates, replace(base, ib_gbit=800), d)
            assert s8 < s32 and fast < s32, (d, s8, s32, fast)  # fewer bytes or more bandwidth: shorter shards
            assert predict(replace(c, seq_local=s32), rates, base)["hidden"][d]
            assert not predict(replace(c, seq_local=s32 - 256, gpus=32), rates, base)["hidden"][d]
        assert smallest_hiding_seq(c, rates, replace(base, ib_gbit=1e-6), "fwd") is None

    failed = 0
    checks = (inputs, one_node_is_the_one_node_kernel_and_more_nodes_cost,
              longer_shards_and_fewer_kv_heads_scale_better, faster_links_never_hurt,
              backward_moves_more_and_brings_dkdv_home, smallest_hiding_shard)
    for fn in checks:
        try:
            fn()
        except AssertionError as e:
            failed += 1
            print(f"FAIL {fn.__name__}: {e!r}", flush=True)
        else:
            print(f"ok   {fn.__name__}", flush=True)
    print(f"self-check: {len(checks) - failed} of {len(checks)} checks passed", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.self_check:
        return self_check(a)
    rows, hiding, rates = run(a)
    tag = a.tag or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    base = os.path.join(a.out_dir, f"scaling_model_{tag}")
    os.makedirs(a.out_dir, exist_ok=True)
    report = [f"inputs: {rates.sources}",
              "W=1 rates (TFLOP/s) " + "; ".join(
                  f"{p} {'causal' if c else 'non-causal'}: " + ", ".join(f"{_fmt_seq(s)} {tf:g}" for s, tf in pts)
                  for (p, c), pts in sorted(rates.w1.items())),
              "ring factor (one GPU, every rank on it): " + ", ".join(f"{p} {f:.3f}" for p, f in rates.ring.items()),
              table(rows, a), "", *target_lines(rows, hiding, a)]
    print("\n".join(report))
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k.rstrip("_") for k in rows[0]])
        w.writeheader()
        for r in rows:
            w.writerow({k.rstrip("_"): (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    with open(base + ".cmd", "w") as f:
        f.write(shlex.join(["python", "-m", "benchmarks.scaling_model", *argv]) + "\n")
    with open(base + ".txt", "w") as f:
        f.write("\n".join(report) + "\n")
    if not a.no_plot:
        plot(rows, a, base + ".png")
    print(f"\nwrote {base}.csv, .txt, .cmd" + ("" if a.no_plot else ", .png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
