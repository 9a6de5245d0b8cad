"""Shared pytest setup.

JAX section: force several host (CPU) devices *before* jax is imported anywhere, so CPU tests can build
multi-device meshes. float64 stays off (no jax_enable_x64): tests feed float32/bf16/fp16 and compute
float64 references in numpy (ring_core.reference).
"""

import os
import sys

# The repository root, so `import ring_core, jax_ring, torch_bridge` works without installing the package.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)



def gpu_script(name: str):
    """One of the GPU scripts in tests/gpu/ (gpu_faults, gpu_soak, test_gpu) or tools/ (gpu_session), imported as a
    module (the CPU tests check their host side; the GPU suite reads their tables)."""
    import importlib

    sys.path[:0] = [os.path.join(ROOT, "tests", "gpu"), os.path.join(ROOT, "tools")]
    try:
        return importlib.import_module(name)
    finally:
        del sys.path[:2]


# ---------------------------------------------------------------------------------------------- JAX
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
_flags = os.environ.get("XLA_FLAGS", "")
if _HOST_DEVICES_FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_HOST_DEVICES_FLAG}=4".strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

JAX_AXIS = "sp"


@pytest.fixture(scope="session")
def cpu_mesh():
    """``cpu_mesh(W, axis_name="sp")``: a 1-D jax Mesh over the first W CPU devices (skips if fewer exist)."""
    import jax
    from jax.sharding import Mesh

    cache = {}

    def make(world_size, axis_name=JAX_AXIS):
        devices = jax.devices("cpu")
        if len(devices) < world_size:
            pytest.skip(f"needs {world_size} CPU devices, have {len(devices)} "
                        f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r} was set after jax was imported?)")
        key = (world_size, axis_name)
        if key not in cache:
            cache[key] = Mesh(np.array(devices[:world_size]), (axis_name,))
        return cache[key]

    return make


# -------------------------------------------------------------------------------------------- torch
# (torch fixtures go here; keep the JAX section above free of torch imports)
# --- torch ---
# Never imports JAX; torch is imported lazily so that JAX-only runs do not pay for it.


@pytest.fixture(scope="session")
def torch_group():
    """``torch_group(world_size)`` -> a ``torch_bridge.procs.LocalGroup`` shared by the whole session.

    Started on first use for each world size (process start-up is paid once); replaced if an earlier
    test broke it (a hung or dead worker shuts a group down). Workers inherit sys.path (ROOT above).
    """
    from torch_bridge.procs import LocalGroup

    groups = {}

    def get(world_size: int):
        g = groups.get(world_size)
        if g is None or g.closed:
            g = groups[world_size] = LocalGroup(world_size)
        return g

    yield get
    for g in groups.values():
        g.close()
