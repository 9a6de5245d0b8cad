"""GPU suite (``pytest -m gpu``): launches one process per rank running tests/gpu/gpu_checks.py,
tests/gpu/gpu_faults.py (faults: a missing or killed rank, concurrent NCCL work, bad inputs on the fused path)
and tests/gpu/gpu_soak.py.

Environment: RING_GPU_RANKS (ranks; default: the visible GPUs, at least 2: with fewer GPUs than ranks the
ranks share them, under the CUDA MPS daemon the launcher starts, see ring_core.runtime.gpus), RING_GPU_SOAK_CALLS
(default 1000; gpu_checks' soak), RING_GPU_SOAK_LONG_CALLS (default 10000; tests/gpu/gpu_soak.py),
RING_GPU_OUT (keep the JSON summaries there). Skipped, saying why, where no NVIDIA GPU is visible.
E.g. four ranks on one H200: ``RING_GPU_RANKS=4 pytest -m gpu``.
The scripts' host-side logic is checked on CPU by tests/cpu/test_gpu_scripts.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpu_script

ROOT = Path(__file__).resolve().parents[2]


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([l for l in out.stdout.splitlines() if l.strip()]) if out.returncode == 0 else 0


def ranks(n_gpus: int) -> int:
    """How many ranks the suite runs: RING_GPU_RANKS, else one per visible GPU, at least 2."""
    return int(os.environ.get("RING_GPU_RANKS") or max(2, n_gpus))


def _launch(what, script, tmp_path, args, timeout, env_extra=None, **kw):
    """Run ``tests/<script>`` with ``ranks()`` processes (sharing GPUs where there are fewer: the launcher
    runs them under a CUDA MPS daemon), skipping, saying why, without a GPU; returns (completed process,
    the folder its JSON summary goes to)."""
    n = _gpu_count()
    if n < 1:
        pytest.skip(f"{what} needs an NVIDIA GPU; nvidia-smi sees none")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(env_extra or {})
    out = Path(os.environ.get("RING_GPU_OUT") or tmp_path)  # where the JSON summary is written
    r = subprocess.run([sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", str(ranks(n)),
                        str(ROOT / "tests" / "gpu" / script), "--out", str(out), *args],
                       env=env, cwd=ROOT, timeout=timeout, **kw)
    return r, out


@pytest.mark.gpu
def test_fused_on_gpus(tmp_path):
    calls = os.environ.get("RING_GPU_SOAK_CALLS", "1000")
    r, out = _launch("the fused ring", "gpu_checks.py", tmp_path, ["--calls", calls], timeout=2100)
    assert r.returncode == 0, "a GPU check failed (its output is above)"
    summary = json.loads((out / "gpu_checks.json").read_text())
    assert summary["ok"] and summary["soak_bad"] == 0 and summary["cases"] >= 10 and summary["mask_cases"] >= 6


# ---------------------------------------------------------------------------------------------- faults
FAULT_RUNS = {  # --sections -> the checks rank 0 must report (the concurrent ones: gpu_faults.CONCURRENT_CHECKS)
    "timeout,concurrent,mismatch,bad_inputs,security": [
        "timeout/torch: rank 1 absent -> RingAttentionTimeout on rank 0",
        "timeout/torch: reset() on every rank, then right calls through both frontends",
        "timeout/jax: rank 1 absent -> RingAttentionTimeout on rank 0",
        "timeout/jax: reset() on every rank, then right calls through both frontends",
        "mismatch/torch: then right calls through both frontends, no reset()",
        "mismatch/jax: then right calls through both frontends, no reset()",
        "bad_inputs/fused: CPU tensors to backend='fused' raise ValueError",
        "bad_inputs/fused: NaN in k propagates to the rows attending to it, no hang",
        "security: handle-passing peers are this job's processes; iris restored",
    ],
    "kill": [
        "kill: rank 0 raises RingAttentionTimeout naming rank 1 within timeout_s",
        "kill: rank 0 shuts down cleanly (heap released, no error left)",
    ],
}
# Where ranks share a GPU (under MPS), a killed rank faults the GPU for all: what is checked instead.
KILL_SHARED = ["kill (shared GPU): rank 0 raises within timeout_s, no hang",
               "kill: rank 0 shuts down cleanly (heap released, no error left)"]


def expected_fault_checks(sections: str, shared: bool) -> tuple:
    """(the checks rank 0 must report, those that may be reported as skipped) for a run of ``sections``."""
    gf = gpu_script("gpu_faults")
    if sections == "kill":
        return (KILL_SHARED, {KILL_SHARED[1]}) if shared else (FAULT_RUNS["kill"], set())
    return FAULT_RUNS[sections] + list(gf.CONCURRENT_CHECKS), set(gf.CONCURRENT_CHECKS) if shared else set()


@pytest.mark.gpu
@pytest.mark.parametrize("sections", list(FAULT_RUNS))
def test_faults_on_gpus(tmp_path, sections):
    r, out = _launch("the fault checks", "gpu_faults.py", tmp_path,
                         ["--sections", sections, "--timeout", "5", "--deadline", "420"], timeout=540,
                         # bounds every fused call the script does not bound itself
                         env_extra={"RING_ATTENTION_TIMEOUT_S": "60"}, capture_output=True, text=True)
    sys.stdout.write(r.stdout[-30000:])
    sys.stderr.write(r.stderr[-30000:])
    assert r.returncode == 0, f"a fault check failed (exit code {r.returncode}; its output is above)"
    summary = json.loads((out / f"gpu_faults_{sections.replace(',', '_')}.json").read_text())
    assert summary["ok"]
    rank0 = summary["checks"][0]
    wanted, may_skip = expected_fault_checks(sections, summary["shared"])
    assert not set(wanted) - set(rank0), sorted(rank0)
    skipped = {name for name, c in rank0.items() if c.get("skipped")}
    # Only where ranks share a GPU: the checks that need NCCL between ranks, and the clean shutdown after a kill.
    assert skipped <= may_skip, skipped
    # A process group created by initialize() is destroyed at exit, even after a peer died.
    assert "destroy_process_group() was not called" not in r.stderr


# ------------------------------------------------------------------------------------------------ soak
@pytest.mark.gpu
def test_soak_on_gpus(tmp_path):
    """RING_GPU_SOAK_LONG_CALLS (default 10000) random-configuration calls through both frontends."""
    calls = os.environ.get("RING_GPU_SOAK_LONG_CALLS", "10000")
    r, out = _launch("the soak", "gpu_soak.py", tmp_path, ["--calls", calls], timeout=1500)
    assert r.returncode == 0, "the soak failed (its output is above)"
    summary = json.loads((out / "gpu_soak.json").read_text())
    assert summary["ok"] and all(m["wrong"] == 0 and m["calls"] == int(calls) for m in summary["ranks"])


