"""GPU suite (``pytest -m gpu``): launches one process per GPU running tests/gpu_checks.py.

Environment: RING_GPU_SOAK_CALLS (default 1000), RING_GPU_OUT (keep the JSON summary there).
Skipped, saying why, where fewer than 2 NVIDIA GPUs are visible. Run on the GPU machine (nvidia-h200-x2).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([l for l in out.stdout.splitlines() if l.strip()]) if out.returncode == 0 else 0


@pytest.mark.gpu
def test_fused_on_two_gpus(tmp_path):
    n = _gpu_count()
    if n < 2:
        pytest.skip(f"the fused ring needs 2 NVIDIA GPUs (one process each); nvidia-smi sees {n}")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    calls = os.environ.get("RING_GPU_SOAK_CALLS", "1000")
    out = Path(os.environ.get("RING_GPU_OUT") or tmp_path)  # where gpu_checks.json is written
    r = subprocess.run([sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", "2",
                        str(ROOT / "tests" / "gpu_checks.py"), "--out", str(out), "--calls", calls],
                       env=env, cwd=ROOT, timeout=1500)
    assert r.returncode == 0, "a GPU check failed (its output is above)"
    summary = json.loads((out / "gpu_checks.json").read_text())
    assert summary["ok"] and summary["soak_bad"] == 0 and summary["cases"] >= 10
