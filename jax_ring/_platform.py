"""Small shims over JAX APIs that moved between releases (0.10 on CPU, 0.11 on the GPU machine).

Nothing here imports jax_triton: it refuses to import on CPU-only JAX, and ``import jax_ring`` must work there.
"""

from __future__ import annotations

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
