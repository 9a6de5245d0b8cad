"""Ranks and GPUs (CPU): which GPU a rank uses, the process-group backend, what ranks sharing a GPU are
told, and the launcher's private MPS daemon (with stand-ins for nvidia-smi and nvidia-cuda-mps-control)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ring_core.runtime import gpus, heap

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("lws, n_gpus, devices, per_gpu, backend", [
    (4, 1, [0, 0, 0, 0], 4, "gloo"),  # four ranks on one GPU
    (8, 2, [0, 1, 0, 1, 0, 1, 0, 1], 4, "gloo"),
    (3, 2, [0, 1, 0], 2, "gloo"),  # uneven: GPU 0 holds two ranks
    (2, 2, [0, 1], 1, "nccl"),  # one GPU each, as before
    (2, 8, [0, 1], 1, "nccl"),  # fewer ranks than GPUs
])
def test_rank_to_gpu_mapping_and_backend(lws, n_gpus, devices, per_gpu, backend):
    places = [gpus.placement(r, lws, n_gpus) for r in range(lws)]
    assert [p.device for p in places] == devices
    assert {p.ranks_per_gpu for p in places} == {per_gpu}
    assert {p.backend for p in places} == {backend}  # every rank picks the same backend
    assert [p.first_on_gpu for p in places] == [r < n_gpus for r in range(lws)]  # one warning per GPU


def test_placement_without_local_world_size():
    assert gpus.placement(1, None, 2).backend == "nccl"  # assumed one GPU per rank
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE is not set"):
        gpus.placement(2, None, 2)  # this rank would share a GPU that the others think is theirs
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        gpus.placement(0, 2, 0)
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is not in"):
        gpus.placement(2, 2, 1)


def test_placement_from_env():
    p = gpus.placement_from_env(1, {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"})
    assert (p.device, p.ranks_per_gpu, p.backend) == (0, 3, "gloo")


def _mps_env(tmp_path, serving: bool, share=None):
    pipe = tmp_path / "pipe"
    pipe.mkdir(exist_ok=True)
    if serving:
        (pipe / "control").touch()
    env = {gpus.MPS_PIPE_ENV: str(pipe)}
    if share:
        env[gpus.MPS_SHARE_ENV] = share
    return env


def test_ranks_sharing_a_gpu_are_told_what_they_lack(tmp_path):
    shared = gpus.placement(0, 4, 1)
    msg = gpus.sharing_advice(shared, _mps_env(tmp_path, serving=False))
    assert "no CUDA MPS daemon" in msg and "time-sliced" in msg and "nvidia-cuda-mps-control -d" in msg
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in msg
    msg = gpus.sharing_advice(shared, _mps_env(tmp_path, serving=True))
    assert "without CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in msg and "=25" in msg
    assert gpus.sharing_advice(shared, _mps_env(tmp_path, serving=True, share="25")) is None
    assert gpus.sharing_advice(gpus.placement(0, 2, 2), _mps_env(tmp_path, serving=False)) is None


def test_mps_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus.MpsDaemon, "available", classmethod(lambda cls: True))
    (tmp_path / "idle").mkdir()
    idle, serving = _mps_env(tmp_path / "idle", serving=False), _mps_env(tmp_path, serving=True)
    assert gpus.mps_plan(4, 1, "auto", idle) == (True, {gpus.MPS_SHARE_ENV: "25"})
    assert gpus.mps_plan(4, 1, "auto", serving) == (False, {gpus.MPS_SHARE_ENV: "25"})  # use the one running
    assert gpus.mps_plan(4, 1, "auto", dict(serving, **{gpus.MPS_SHARE_ENV: "40"})) == (False, {})
    assert gpus.mps_plan(2, 2, "auto", idle) == (False, {})  # a GPU each: nothing to do
    assert gpus.mps_plan(3, 1, "off", idle) == (False, {})
    assert gpus.mps_plan(2, 2, "on", idle) == (True, {})
    assert gpus.mps_plan(4, 0, "auto", idle) == (False, {})  # no GPU visible
    monkeypatch.setattr(gpus.MpsDaemon, "available", classmethod(lambda cls: False))
    assert gpus.mps_plan(4, 1, "auto", idle) == (False, {})  # no MPS on this machine: warned at initialize
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        gpus.mps_plan(4, 1, "yes", idle)


def test_initialize_uses_gloo_and_the_mps_share_where_ranks_share_a_gpu(tmp_path, monkeypatch):
    """The fused backend's join (init_torch_distributed_from_env) with four ranks on one GPU under MPS:
    gloo, GPU 0, the SM share set before CUDA starts; with no MPS, one warning from the GPU's first rank."""
    import torch
    import torch.distributed as dist

    joined, devices = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw)))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: "group")
    monkeypatch.setattr(heap, "_owned_group", None)
    monkeypatch.setattr(heap, "_register_atexit", lambda: None)
    for k, v in dict(RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="1", **_mps_env(tmp_path, serving=True)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(gpus.MPS_SHARE_ENV, raising=False)
    assert heap.init_torch_distributed_from_env() == (2, 4, 0)
    assert joined == [("gloo", dict(rank=2, world_size=4))] and devices == [0]
    assert os.environ[gpus.MPS_SHARE_ENV] == "25"

    joined.clear()
    monkeypatch.delenv(gpus.MPS_SHARE_ENV)
    (tmp_path / "pipe" / "control").unlink()  # no MPS daemon
    for local in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local)
        monkeypatch.setenv("RANK", local)
        if local == "0":
            with pytest.warns(RuntimeWarning, match="time-sliced"):
                heap.init_torch_distributed_from_env()
        else:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")  # only the GPU's first rank says it
                heap.init_torch_distributed_from_env()
    assert [b for b, _ in joined] == ["gloo", "gloo"]
    assert gpus.MPS_SHARE_ENV not in os.environ  # without a daemon, nothing to set

    joined.clear()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a GPU each: NCCL, bound to the rank's GPU
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert heap.init_torch_distributed_from_env() == (1, 4, 3)
    assert joined[0][0] == "nccl" and joined[0][1]["device_id"] == torch.device("cuda", 3)


FAKE_SMI = """#!/bin/sh
echo "GPU 0: NVIDIA H200 (UUID: GPU-fake)"
"""
FAKE_MPS = """#!/bin/sh
# A stand-in for nvidia-cuda-mps-control: -d starts (creates the control pipe), "quit" on stdin stops.
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; echo start >> "$LOG"; exit 0; fi
read cmd; echo "$cmd" >> "$LOG"; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


def test_launcher_runs_a_private_mps_daemon_when_ranks_outnumber_gpus(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-smi", FAKE_SMI), ("nvidia-cuda-mps-control", FAKE_MPS)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "mps.log"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        os.write(1, f"RANK {os.environ['RANK']} {os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']} "
                    f"{os.path.exists(os.path.join(pipe, 'control'))} {pipe}\\n".encode())
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", LOG=str(log),
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", "4", str(script)], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = sorted(line.split()[1:] for line in r.stdout.splitlines() if line.startswith("RANK"))
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert {tuple(row[1:]) for row in rows} == {("25", "True", rows[0][3])}  # one daemon, each rank a quarter
    assert log.read_text().split() == ["start", "quit"]  # started before the ranks, stopped after them
    assert not os.path.exists(rows[0][3])  # its private directory is gone
    # --mps off, or one GPU per rank: no daemon
    r = subprocess.run([sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", "1", str(script)], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "KeyError: 'CUDA_MPS_PIPE_DIRECTORY'" in r.stderr
