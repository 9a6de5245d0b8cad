"""The attention benchmark's one-process peers on the CPU, through the launcher at world size 1, read back from the
CSV (no benchmark module is imported here): torch flex_attention (compiled for the CPU, forward only: it has no
backward there) on dense, causal, packed-document and windowed cases, checked against the reference ring by the
harness's own check; flash-attn, which needs a GPU, says why it cannot run. At two ranks both are skipped
(test_bench_smoke.py)."""

import csv
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="torch.compile (inductor) on a CPU compiles C++; no compiler (g++) found")
def test_flex_attention_peer_at_world_size_1(tmp_path):
    out = tmp_path / "peers.csv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", "1", "-m", "benchmarks.attention",
           "--cpu-smoke", "--methods", "torch_ref,torch_flex,torch_flash_attn", "--mask", "none,packed,window",
           "--seq", "64", "--kv-heads", "2", "--iters", "2", "--csv", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out)))
    by = {(r["mask"], r["causal"], r["pass"], r["method"]): r for r in rows}
    masks = ("none", "packed(8-40)", "window(23,0)")
    assert len(rows) == len(by) == 3 * 2 * 2 * 3, sorted(by)
    for mask in masks:
        for causal in ("0", "1"):
            ref = by[mask, causal, "fwd", "torch_ref"]
            flex = by[mask, causal, "fwd", "torch_flex"]
            assert not flex["error"] and float(flex["tflops_per_gpu"]) > 0, flex
            assert (flex["world"], flex["seq_global"], flex["kind"], flex["framework"]) == ("1", "64", "peer", "torch")
            # the same problem as the reference: its FLOPs (the allowed pairs of a masked case), checked against it
            assert flex["flops_per_gpu"] == ref["flops_per_gpu"] and flex["pairs_per_gpu"] == ref["pairs_per_gpu"]
            assert flex["diff_vs"] == "torch_ref" and float(flex["max_abs_diff"]) < 0.05, flex
            assert "LARGE DIFF" not in flex["note"] and "torch.compile(flex_attention), enable_gqa" in flex["note"]
            masked = mask != "none" or causal == "1"
            assert ("block mask built before timing" in flex["note"]) == masked, flex["note"]
            assert flex["shape"] == ("q[1,4,64,32] kv[1,2,64,32] one process" + " causal" * (causal == "1")
                                     + ("" if mask == "none" else f" {mask}")), flex["shape"]
            step = by[mask, causal, "fwd+bwd", "torch_flex"]
            assert "Unavailable" in step["error"] and "no backward on a CPU" in step["error"], step
            for mode in ("fwd", "fwd+bwd"):
                fa = by[mask, causal, mode, "torch_flash_attn"]
                assert "Unavailable" in fa["error"] and "NVIDIA GPUs only" in fa["error"] and not fa["tflops_per_gpu"]

