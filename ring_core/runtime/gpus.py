"""Which GPU a rank uses, and what ranks that share one GPU need (GPU path; no framework).

One rank per GPU is the usual job, but several ranks may share a GPU: ``python -m jax_ring.launch
--nproc-per-node 4 script.py`` on a one-GPU machine runs the real fused kernel with four ranks. Rank
``local_rank`` uses GPU ``local_rank % visible GPUs``. What sharing changes (measured on one H200, see the
README, "Several ranks on one GPU"):

* NCCL refuses two ranks on one GPU, so the process group this library creates uses gloo there (the
  iris heap only needs the group to exchange handles and addresses). Collectives of the program between
  ranks on one GPU (a torch NCCL all-reduce, a JAX psum across processes) do not work there.
* Without a CUDA MPS daemon the ranks' kernels are time-sliced: each fused call then takes seconds
  instead of milliseconds, since a rank's waiting programs keep the GPU until the driver switches. With
  MPS they run side by side; each rank should be limited to its share of the SMs
  (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/ranks per GPU``), else one rank's programs can take every SM
  while they wait for a rank that then has none (the call ends in RingAttentionTimeout). The launcher
  starts a private MPS daemon for such a job (``--mps``) and sets the share for each rank.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
MPS_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
DEFAULT_MPS_PIPE = "/tmp/nvidia-mps"  # where the MPS control daemon listens unless MPS_PIPE_ENV says otherwise


@dataclass(frozen=True)
class Placement:
    """Where rank ``local_rank`` of its node runs: CUDA device ``device`` (among the ``gpus`` visible ones);
    at most ``ranks_per_gpu`` ranks of the node share one GPU."""

    local_rank: int
    gpus: int
    device: int
    ranks_per_gpu: int

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1

    @property
    def backend(self) -> str:
        """The torch.distributed backend of a process group this library creates (NCCL refuses two ranks
        on one GPU)."""
        return "gloo" if self.shared else "nccl"

    @property
    def first_on_gpu(self) -> bool:
        """Whether this rank is the lowest local rank on its GPU (the one that reports what sharing needs)."""
        return self.local_rank < self.gpus


def placement(local_rank: int, local_world_size: int | None, gpus: int) -> Placement:
    """Rank ``local_rank`` of ``local_world_size`` on a node with ``gpus`` visible GPUs uses GPU
    ``local_rank % gpus``.

    ``local_world_size`` None (no launcher said it): every rank is assumed to have its own GPU, and a
    ``local_rank`` without one raises, since the other ranks could not tell that GPUs are shared and would
    pick another process-group backend."""
    if gpus < 1:
        raise RuntimeError("the fused backend needs an NVIDIA GPU; none is visible to this process "
                           "(CUDA_VISIBLE_DEVICES?). On CPU use backend='xla' (JAX) or backend='torch' (PyTorch)")
    if local_rank < 0 or (local_world_size is not None and not 0 <= local_rank < local_world_size):
        raise ValueError(f"LOCAL_RANK={local_rank} is not in [0, LOCAL_WORLD_SIZE={local_world_size})")
    if local_world_size is None:
        if local_rank >= gpus:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {gpus} GPU(s) are visible, and LOCAL_WORLD_SIZE is not set: "
                "ranks may share a GPU, but every rank must know that they do. Set LOCAL_WORLD_SIZE to the "
                "number of processes on this node (torchrun and python -m jax_ring.launch set it)")
        local_world_size = gpus
    return Placement(local_rank, gpus, local_rank % gpus, max(1, math.ceil(local_world_size / gpus)))


def placement_from_env(gpus: int, environ=None) -> Placement:
    """``placement`` from LOCAL_RANK (default RANK, then 0) and LOCAL_WORLD_SIZE, as torchrun and the
    launcher set them."""
    env = os.environ if environ is None else environ
    local = int(env.get("LOCAL_RANK", env.get("RANK", 0)))
    lws = env.get("LOCAL_WORLD_SIZE")
    return placement(local, int(lws) if lws else None, gpus)


def mps_share(ranks_per_gpu: int) -> int:
    """The CUDA_MPS_ACTIVE_THREAD_PERCENTAGE that gives each of ``ranks_per_gpu`` ranks its share of the SMs."""
    return max(1, 100 // ranks_per_gpu)


def mps_serving(environ=None) -> bool:
    """Whether a CUDA MPS control daemon listens where this process's CUDA clients would connect (its
    ``control`` pipe exists in CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps)."""
    env = os.environ if environ is None else environ
    return os.path.exists(os.path.join(env.get(MPS_PIPE_ENV) or DEFAULT_MPS_PIPE, "control"))


MPS_HOWTO = (
    "start a CUDA MPS daemon before the job and stop it after: `export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps "
    "CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; "
    "nvidia-cuda-mps-control -d`, run the ranks with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={share}, then "
    "`echo quit | nvidia-cuda-mps-control`; or let `python -m jax_ring.launch --mps on` do all of it")


def sharing_advice(p: Placement, environ=None) -> str | None:
    """What a rank that shares its GPU should be told (None when nothing is missing): no MPS daemon
    (calls time-sliced, seconds each), or MPS without a per-rank SM share."""
    env = os.environ if environ is None else environ
    if not p.shared:
        return None
    share = mps_share(p.ranks_per_gpu)
    if not mps_serving(env):
        return (f"{p.ranks_per_gpu} ranks share each GPU and no CUDA MPS daemon serves them: their fused kernels "
                f"are time-sliced, about 1000x slower (seconds per call). To run them side by side, "
                + MPS_HOWTO.format(share=share))
    if not env.get(MPS_SHARE_ENV):
        return (f"{p.ranks_per_gpu} ranks share each GPU under CUDA MPS without {MPS_SHARE_ENV}: one rank's "
                f"waiting programs can take every SM from a rank it waits for (the call then times out). Start "
                f"each rank with {MPS_SHARE_ENV}={share} (python -m jax_ring.launch sets it)")
    return None


def advise_sharing(p: Placement) -> None:
    """Warn once per GPU (from its lowest local rank) when ranks share it without what they need."""
    msg = sharing_advice(p)
    if msg and p.first_on_gpu:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def visible_gpus(environ=None) -> int:
    """NVIDIA GPUs this process would see, without creating a CUDA context or importing a framework:
    CUDA_VISIBLE_DEVICES when set, else the lines of ``nvidia-smi -L`` (0 without a driver)."""
    import subprocess

    env = os.environ if environ is None else environ
    vis = env.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else 0


class MpsDaemon:
    """A private CUDA MPS control daemon for one job: ``start()`` runs ``nvidia-cuda-mps-control -d`` with
    its own pipe and log directories (fresh, mode 0700) and returns the environment its clients need;
    ``stop()`` sends it ``quit`` and removes the directories. Changes no GPU setting. Used by the launcher
    (``--mps``) and the GPU test runners, which start it before the ranks and stop it after them."""

    CONTROL = "nvidia-cuda-mps-control"

    def __init__(self):
        self.pipe_dir = self.log_dir = None

    @classmethod
    def available(cls) -> bool:
        import shutil

        return shutil.which(cls.CONTROL) is not None

    def start(self, timeout_s: float = 30.0) -> dict:
        import subprocess
        import tempfile
        import time

        if not self.available():
            raise RuntimeError(f"{self.CONTROL} is not on PATH: CUDA MPS (part of the NVIDIA driver's utilities) "
                               "is needed to run several ranks side by side on one GPU")
        self.pipe_dir = tempfile.mkdtemp(prefix="ring-attn-mps-")
        self.log_dir = tempfile.mkdtemp(prefix="ring-attn-mpslog-")
        env = dict(os.environ, **self.environ())
        subprocess.run([self.CONTROL, "-d"], env=env, check=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while not mps_serving(env):
            if time.monotonic() > deadline:
                seen = sorted(os.listdir(self.pipe_dir))
                self.stop()
                raise RuntimeError(f"the MPS daemon did not start within {timeout_s:g} s (no 'control' pipe in "
                                   f"{self.pipe_dir}, which holds {seen})")
            time.sleep(0.05)
        return self.environ()

    def environ(self) -> dict:
        return {MPS_PIPE_ENV: self.pipe_dir, MPS_LOG_ENV: self.log_dir}

    def stop(self, timeout_s: float = 30.0) -> None:
        import shutil
        import subprocess

        if self.pipe_dir is None:
            return
        try:
            if mps_serving(self.environ()):
                subprocess.run([self.CONTROL], input="quit\n", text=True, env=dict(os.environ, **self.environ()),
                               timeout=timeout_s, capture_output=True)
        finally:
            for d in (self.pipe_dir, self.log_dir):
                shutil.rmtree(d, ignore_errors=True)
            self.pipe_dir = self.log_dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def mps_plan(nproc: int, gpus: int, mode: str, environ=None):
    """What a launcher of ``nproc`` ranks on ``gpus`` visible GPUs does about MPS (``mode`` "auto", "on" or
    "off"): (start a private daemon?, environment variables every rank gets). "auto" starts one only when
    ranks outnumber GPUs, no daemon serves already and the MPS control program exists; "on" always starts
    one; "off" never. Where ranks share GPUs under MPS, each rank gets its SM share unless it is set."""
    env = os.environ if environ is None else environ
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"mps must be 'auto', 'on' or 'off', got {mode!r}")
    shared = gpus > 0 and nproc > gpus
    start = mode == "on" or (mode == "auto" and shared and not mps_serving(env) and MpsDaemon.available())
    extra = {}
    if shared and (start or mps_serving(env)) and not env.get(MPS_SHARE_ENV):
        extra[MPS_SHARE_ENV] = str(mps_share(math.ceil(nproc / gpus)))
    return start, extra
