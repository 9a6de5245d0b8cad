"""Every environment variable this project reads, in one table, and the functions that read them.

Each project variable is read through a function below at the moment it is needed (the column "read"), never
cached at import, so a change of ``os.environ`` between calls takes effect at the next call; the exceptions are the
two that change how the Gluon forward is built (``RING_ATTENTION_GLUON_TIMELINE``, ``RING_ATTENTION_GLUON_PINGPONG``:
constexpr globals of the kernel, read when it is defined). The variables of other tools that the project reads
(launchers, CUDA, Triton, XLA) are listed too, with where they are read; they keep their owners' meaning.

``python -m ring_core.settings --markdown`` prints the table (docs/settings.md is that output;
tests/cpu/test_settings.py checks that it is up to date and that every variable the sources read is listed).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

# ---- names (the project's own) ----------------------------------------------------------------------------------
TIMEOUT_S = "RING_ATTENTION_TIMEOUT_S"
ERRORS = "RING_ATTENTION_ERRORS"
HEAP_BYTES = "RING_ATTENTION_HEAP_BYTES"
NODE_SIZE = "RING_ATTENTION_NODE_SIZE"
GLUON = "RING_ATTENTION_GLUON"
GLUON_DETERMINISTIC = "RING_ATTENTION_GLUON_DETERMINISTIC"
GLUON_TIMELINE = "RING_ATTENTION_GLUON_TIMELINE"
GLUON_PINGPONG = "RING_ATTENTION_GLUON_PINGPONG"
COMPILE_LOG = "RING_ATTENTION_COMPILE_LOG"
COMPILE_TAG = "RING_ATTENTION_COMPILE_TAG"
PTXAS_REAL = "RING_PTXAS_REAL"
PTXAS_LOG = "RING_PTXAS_LOG"

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_HEAP_BYTES = 4 << 30
ERROR_MODES = ("call", "deferred")


@dataclass(frozen=True)
class Setting:
    name: str
    meaning: str
    default: str
    read: str  # when (and by what) it is read
    own: bool = True  # the project's own variable (False: another tool's, read here too)


SETTINGS = (
    # ---- for users
    Setting(TIMEOUT_S, "seconds a fused call's waits for a peer last before they give up and the call raises "
            "RingAttentionTimeout", "300", "at each fused call (torch) / trace (JAX)"),
    Setting(ERRORS, 'how a fused call reports a failure: "deferred" (no host sync; a later fused call, '
            '`check_errors()` or `shutdown()` raises it) or "call" (the failed call raises itself; for debugging)',
            "deferred", "at each fused call (torch) / trace (JAX)"),
    Setting(HEAP_BYTES, "bytes of the symmetric heap `initialize()` reserves when it is given no `heap_size`",
            "4294967296 (4 GiB)", "at `initialize()`"),
    Setting(NODE_SIZE, "ranks per node (host) for the two-level ring; overrides LOCAL_WORLD_SIZE and SLURM's counts, "
            "and lets several nodes share a host (to test the two-level ring on one machine)",
            "found from the launcher (LOCAL_WORLD_SIZE, SLURM)", "at `initialize()` (ring_core.topology)"),
    Setting(GLUON, '"0": every forward and backward runs the `triton.language` kernels, also on Hopper (the '
            "portable kernels, the parity reference of the Gluon ones)", "1", "at each plan"),
    Setting(GLUON_DETERMINISTIC, '"0": `deterministic=True` backwards run the `triton.language` split kernel '
            "instead of the Gluon backward's deterministic order", "1", "at each plan"),
    # ---- for diagnosing and for the GPU runner (tools/)
    Setting(GLUON_TIMELINE, '"1": the Gluon forward is built with clock stamps of each partition at each tile '
            "(world size 1; benchmarks/timeline.py)", "0", "when ring_core.kernels.gluon_fwd is imported"),
    Setting(GLUON_PINGPONG, '"1": the Gluon forward\'s two consumer warpgroups take turns issuing their MMAs '
            "(FlashAttention-3's ping-pong; for A/B runs of the forward)", "0",
            "when ring_core.kernels.gluon_fwd is imported"),
    Setting(COMPILE_LOG, "a file each compile made by ring_core.runtime.build appends one JSON line to "
            "(tools/gpu_session.py's compile log)", "unset: no log", "at each compile"),
    Setting(COMPILE_TAG, "the `tag` of those lines (the run that asked)", "empty", "at each compile"),
    Setting(PTXAS_REAL, "the real `ptxas` that ring_core.runtime.ptxas_shim hands what it does not serve",
            "the first other `ptxas` on PATH or in the CUDA roots", "at each ptxas call of the shim"),
    Setting(PTXAS_LOG, "a file the ptxas shim appends one line per call to", "unset: no log",
            "at each ptxas call of the shim"),
    # ---- other tools' variables, read here too
    Setting("RANK", "this process's rank (torchrun, `python -m jax_ring.launch`)", "-", "at `initialize()`", False),
    Setting("WORLD_SIZE", "the job's ranks", "-", "at `initialize()`", False),
    Setting("LOCAL_RANK", "this process's rank on its node: its GPU is LOCAL_RANK % visible GPUs", "RANK",
            "at `initialize()`", False),
    Setting("LOCAL_WORLD_SIZE", "ranks on this node (also the two-level ring's node size)", "WORLD_SIZE",
            "at `initialize()`", False),
    Setting("SLURM_NTASKS_PER_NODE", "SLURM's tasks per node: the node size where LOCAL_WORLD_SIZE is unset", "-",
            "at `initialize()` (ring_core.topology)", False),
    Setting("SLURM_TASKS_PER_NODE", 'SLURM\'s tasks per node as "4(x2)" or "4,4": the node size where neither of '
            "the above is set", "-", "at `initialize()` (ring_core.topology)", False),
    Setting("MASTER_ADDR", "the rendezvous host", "-", "at `initialize()`", False),
    Setting("MASTER_PORT", "the rendezvous port (JAX's coordinator: MASTER_PORT + 1)", "-", "at `initialize()`",
            False),
    Setting("JAX_COORDINATOR_PORT", "JAX's coordinator port", "MASTER_PORT + 1", "at `jax_ring.initialize()`",
            False),
    Setting("XLA_PYTHON_CLIENT_PREALLOCATE", "set to false (if unset) so that JAX leaves GPU memory to the heap",
            "false", "at `jax_ring.initialize()`", False),
    Setting("XLA_FLAGS", "`--xla_gpu_deterministic_ops=true` makes `deterministic` the default", "-",
            "at each trace (JAX)", False),
    Setting("CUDA_VISIBLE_DEVICES", "the GPUs ranks are placed on", "all", "at `initialize()` and by the launcher",
            False),
    Setting("CUDA_MPS_PIPE_DIRECTORY", "the CUDA MPS daemon ranks sharing a GPU talk to", "-",
            "at `initialize()` and by the launcher", False),
    Setting("CUDA_MPS_LOG_DIRECTORY", "the MPS daemon's log folder (the launcher's private daemon)", "-",
            "by the launcher", False),
    Setting("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "each rank's share of the SMs under MPS", "100 / ranks per GPU",
            "at `initialize()` and by the launcher", False),
    Setting("TRITON_INTERPRET", "set to 1 by the simulator (the kernels run in Triton's interpreter)", "-",
            "by the simulator", False),
    Setting("TRITON_CACHE_DIR", "Triton's cache, where the ptxas shim finds the cubins", "~/.triton/cache",
            "at each ptxas call of the shim", False),
    Setting("PATH", "where the ptxas shim looks for the real ptxas", "-", "at each ptxas call of the shim", False),
)
BY_NAME = {s.name: s for s in SETTINGS}


def raw(name: str, default: str | None = None) -> str | None:
    """The value of variable ``name`` of the table now (``default`` where unset)."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not in ring_core.settings.SETTINGS: add it there first")
    return os.environ.get(name, default)


def timeout_s() -> float:
    """RING_ATTENTION_TIMEOUT_S: seconds a wait lasts (default 300)."""
    text = raw(TIMEOUT_S)
    try:
        value = DEFAULT_TIMEOUT_S if text is None else float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_S}={text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{TIMEOUT_S} must be a positive number of seconds, got {text!r}")
    return value


def errors_mode() -> str:
    """RING_ATTENTION_ERRORS: "deferred" (the default) or "call"."""
    mode = raw(ERRORS, "deferred")
    if mode not in ERROR_MODES:
        raise ValueError(f"{ERRORS} must be one of {ERROR_MODES}, got {mode!r}")
    return mode


def heap_bytes() -> int:
    """RING_ATTENTION_HEAP_BYTES: the heap size ``initialize()`` takes without ``heap_size`` (default 4 GiB)."""
    text = raw(HEAP_BYTES)
    try:
        return DEFAULT_HEAP_BYTES if text is None else int(text)
    except ValueError:
        raise ValueError(f"{HEAP_BYTES}={text!r} is not a number of bytes") from None


def node_size() -> int | None:
    """RING_ATTENTION_NODE_SIZE: ranks per node for the two-level ring, or None where unset (then the caller finds
    it from the launcher)."""
    text = raw(NODE_SIZE)
    if text is None or text == "":
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{NODE_SIZE} must be a positive number of ranks per node, got {text!r}")
    return int(text)


def gluon() -> bool:
    """RING_ATTENTION_GLUON: False when it is "0" (the tl kernels everywhere)."""
    return raw(GLUON, "1") != "0"


def gluon_deterministic() -> bool:
    """RING_ATTENTION_GLUON_DETERMINISTIC: False when it is "0" (deterministic backwards on the tl split)."""
    return raw(GLUON_DETERMINISTIC, "1") != "0"


def gluon_timeline() -> bool:
    """RING_ATTENTION_GLUON_TIMELINE: True when it is "1" (read when the Gluon forward is defined)."""
    return raw(GLUON_TIMELINE, "0") == "1"


def gluon_pingpong() -> bool:
    """RING_ATTENTION_GLUON_PINGPONG: True when it is "1" (read when the Gluon forward is defined)."""
    return raw(GLUON_PINGPONG, "0") == "1"


def compile_log() -> tuple:
    """(RING_ATTENTION_COMPILE_LOG or None, RING_ATTENTION_COMPILE_TAG or "")."""
    return raw(COMPILE_LOG) or None, raw(COMPILE_TAG, "")


def markdown() -> str:
    """The table as Markdown (docs/settings.md)."""
    def row(s):
        return f"| `{s.name}` | {s.meaning} | {s.default} | {s.read} |"

    head = "| Variable | Meaning | Default | Read |\n|---|---|---|---|"
    own = "\n".join(row(s) for s in SETTINGS if s.own)
    other = "\n".join(row(s) for s in SETTINGS if not s.own)
    return ("# Settings\n\nEvery environment variable the project reads (`ring_core/settings.py`; this page is "
            "`python -m ring_core.settings --markdown`).\n\n## The project's own\n\n" + head + "\n" + own +
            "\n\n## Other tools' variables read here\n\n" + head + "\n" + other + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ring_core.settings", description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/settings.md)")
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown(), end="")
    else:
        width = max(len(s.name) for s in SETTINGS)
        for s in SETTINGS:  # what this environment sets
            value = os.environ.get(s.name)
            print(f"{s.name:<{width}}  {'unset' if value is None else repr(value)}  (default: {s.default})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
