"""The examples run on CPU (`--cpu`: reference backends, gloo / simulated XLA devices) and check themselves (the
integration examples against one device: a non-zero exit beyond their tolerance)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("script, expect", [
    ("examples/torch_ring_attention.py", "max |ring - dense|"),
    ("examples/torch_train.py", "max |loss difference|"),
])
def test_torch_example_on_two_cpu_ranks(script, expect):
    out = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", script, "--cpu", "--seq", "256"])
    assert expect in out


def test_torch_train_data_x_sequence_parallel_on_four_cpu_ranks():
    out = _run(["-m", "torch.distributed.run", "--nproc-per-node", "4", "examples/torch_train.py", "--cpu",
                "--dp", "2", "--seq", "128", "--steps", "3"])
    assert "loss ring (2 x 2 ranks" in out and "max |loss difference| over 3 steps" in out


def test_jax_example_on_cpu():
    assert "max |ring - dense|" in _run(["examples/jax_ring_attention.py", "--cpu", "--seq", "256"])


@pytest.mark.parametrize("dp", [1, 2])
def test_flax_train_example_on_cpu(dp):
    out = _run(["examples/flax_train.py", "--cpu", "--seq", "256", "--steps", "4", "--dp", str(dp)])
    assert f"loss ring ({dp} x 2 devices" in out and "max |loss difference| over 4 steps" in out


@pytest.mark.parametrize("extra", [[], ["--model", "mistral", "--window", "24", "--layout", "contiguous"]],
                         ids=["llama-zigzag", "mistral-window-contiguous"])
def test_hf_example_on_two_cpu_ranks(extra):
    pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
    out = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/hf_llama_train.py", "--cpu",
                "--seq", "128", "--steps", "3", *extra])
    assert "max |loss difference| over 3 steps" in out


def test_flax_attention_fn_example_on_cpu():
    out = _run(["examples/flax_attention_fn.py", "--cpu", "--seq", "128", "--steps", "3"])
    assert "loss ring (2 devices, backend=xla)" in out and "max |loss difference| over 3 steps" in out
