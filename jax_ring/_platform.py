"""Small shims over JAX APIs that moved between releases (0.10 on CPU, 0.11 on the GPU machine), and what JAX's
environment asks of every program (``xla_deterministic_ops``).

Nothing here imports jax_triton: it refuses to import on CPU-only JAX, and ``import jax_ring`` must work there.
"""

from __future__ import annotations

import os
import shlex

import jax
from jax import lax


def shard_map(f, *, mesh, in_specs, out_specs, check_vma=True):
    """``jax.shard_map`` where it exists (jax >= 0.7), else ``jax.experimental.shard_map.shard_map``."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    from jax.experimental.shard_map import shard_map as _legacy  # pragma: no cover - old JAX only

    return _legacy(f, mesh, in_specs, out_specs, check_rep=check_vma)


def _unbound(axis_name, err) -> ValueError:
    return ValueError(
        f"axis_name={axis_name!r} is not a bound mesh axis here ({err}). ring_attention must be called inside "
        f"jax.shard_map over a mesh whose axis named {axis_name!r} shards the sequence, e.g. "
        f"jax.shard_map(f, mesh=Mesh(devices, ({axis_name!r},)), in_specs=P(None, {axis_name!r}), ...); "
        "or call jax_ring.ring_attention_sharded on global arrays")


def axis_size(axis_name) -> int:
    """Static number of devices along ``axis_name``; ValueError (saying how to fix it) when it is unbound."""
    if axis_name is None:
        raise TypeError("axis_name is required: the name of the mesh axis that shards the sequence "
                        "(e.g. axis_name='sp' inside jax.shard_map over Mesh(devices, ('sp',)))")
    try:
        if hasattr(lax, "axis_size"):
            n = lax.axis_size(axis_name)
        else:  # pragma: no cover - old JAX only
            n = lax.psum(1, axis_name)
    except (NameError, ValueError, TypeError) as e:  # unbound name; a non-name (an int) reads as a position
        raise _unbound(axis_name, e) from None
    try:
        return int(n)
    except Exception as e:  # pragma: no cover - would mean a traced size, which JAX never gives here
        raise ValueError(f"could not get a static size for axis {axis_name!r}: {e}") from None


def axis_index(axis_name):
    """``lax.axis_index`` with the same ValueError as ``axis_size`` when the name is unbound."""
    try:
        return lax.axis_index(axis_name)
    except NameError as e:
        raise _unbound(axis_name, e) from None


def varying_axes(x) -> frozenset:
    """The mesh axes along which ``x`` varies inside shard_map (its "vma": ``aval.vma`` in some JAX releases,
    ``aval.manual_axis_type.varying`` in others); empty outside shard_map or without check_vma."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else x.aval  # pragma: no branch
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def vary(x, axes):
    """``x`` marked as varying along ``axes`` too (what it already varies along stays). A no-op at run time:
    how a value computed outside JAX's view of the mesh (a custom kernel's output, whose type says
    "the same on every device") gets the type shard_map's check_vma needs."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # pragma: no cover - JAX releases before pcast


def concrete_mesh():
    """The mesh set with ``jax.set_mesh`` (devices included), else None; readable while a program is traced or
    lowered, where ``jax.sharding.get_mesh`` refuses (JAX's shard_map lowering reads the same setting)."""
    try:
        from jax._src.mesh import get_concrete_mesh
    except ImportError:  # pragma: no cover - a JAX that moved it: only the explicit forms are left
        return None
    mesh = get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def mesh_position():
    """This device's position in the mesh of the enclosing shard_map, row-major over its axes (so that
    ``mesh.devices.flat[position]`` is this device), as a traced int32. Every mesh axis must be manual."""
    mesh = jax.sharding.get_abstract_mesh()
    pos = 0
    for name, size in zip(mesh.axis_names, mesh.axis_sizes):
        try:
            idx = lax.axis_index(name)
        except Exception as e:  # an axis the shard_map left automatic (axis_names=...)
            raise ValueError(
                f"the fused backend needs every mesh axis manual inside jax.shard_map, but {name!r} is not "
                f"({e}); call shard_map over all mesh axes (the default), or use backend='xla'") from None
        pos = pos * size + idx
    return pos


def under_vmap() -> bool:
    """Whether this trace runs under jax.vmap (where the JAX release can say; else False)."""
    from jax._src import core

    probe = getattr(core, "unsafe_am_i_under_a_vmap", None)
    return bool(probe()) if probe is not None else False


# XLA's switches for deterministic GPU programs: "guarantees run-to-run determinism on GPU" and "excludes
# non-deterministic ops from compiled executables" (their help texts). Either asks our backward not to accumulate
# in arrival order.
XLA_DETERMINISTIC_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def xla_deterministic_ops(xla_flags: str | None = None) -> bool:
    """Whether XLA_FLAGS (``xla_flags``; None: the environment's, read now, i.e. when a call is traced) turns on
    one of ``XLA_DETERMINISTIC_FLAGS``. Read as XLA reads it (xla/parse_flags_from_env.cc and tsl's
    command_line_flags.cc): words split at whitespace (a quoted value kept whole), up to the first that is not a
    flag; ``--name`` alone or ``--name=true`` / ``=1`` turns a flag on, ``=false`` / ``=0`` off (true and false in
    any case), and the last setting of a flag wins; a value that does not start with "-" names a file of flags.

    >>> xla_deterministic_ops("--xla_force_host_platform_device_count=4 --xla_gpu_deterministic_ops=true")
    True
    >>> xla_deterministic_ops("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false")
    False
    """
    text = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    if text.strip() and not text.lstrip().startswith("-"):
        try:
            with open(text) as f:
                text = f.read()
        except OSError:  # XLA itself stops the process at start-up
            return False
    try:
        words = shlex.split(text)
    except ValueError:  # an unclosed quote: XLA reads on to the end
        words = text.split()
    on = dict.fromkeys(XLA_DETERMINISTIC_FLAGS, False)
    for word in words:
        if not word.startswith("-"):
            break
        name, eq, value = word.removeprefix("--").partition("=")
        if name in on and word.startswith("--"):
            if not eq or value.lower() in ("true", "1"):
                on[name] = True
            elif value.lower() in ("false", "0"):
                on[name] = False  # anything else: XLA refuses the value and keeps the flag's
    return any(on.values())
