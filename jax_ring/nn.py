"""``jax.nn.dot_product_attention`` on global arrays, through the ring: the shard_map is ours.

    out = jax_ring.dot_product_attention(q, k, v, is_causal=True)     # under plain jax.jit, q/k/v global

Same names and meaning as ``jax.nn.dot_product_attention`` (query ``[batch, seq, heads, head_dim]`` or
``[seq, heads, head_dim]``; key/value with ``kv_heads`` dividing ``heads``; ``scale``, ``is_causal``,
``local_window_size``; ``return_residual`` gives ``(out, logsumexp [batch, seq, heads])``). The mesh and the axis
that shards the sequence come, in this order, from the keywords ``mesh=`` / ``axis_name=``, from the query's
sharding (a sharded ``jax.Array`` outside jit; under jit, its abstract mesh, and its spec on a mesh of Explicit
axes), from the mesh set with ``jax.set_mesh``, and, when the mesh has one axis, that axis. The fused kernels need
the mesh's devices too: under jit, where an input carries only an abstract mesh, they take them from the mesh set
with ``jax.set_mesh`` (or ``mesh=``); without one the lowering raises, saying so. The batch and head
axes keep the query's sharding where it is known. What the ring cannot compute raises: ``bias``, ``mask`` (an
arbitrary mask), ``query_seq_lengths`` / ``key_value_seq_lengths`` (give ``segment_ids`` with -1 on padding),
``implementation`` (the ring picks its kernel: ``backend=``).

Extra keywords, as in ``ring_attention``: ``segment_ids`` (int32 ``[batch, seq]``, global, in the inputs' order),
``layout`` (the order of the inputs' sequence axis: ``"contiguous"``, natural order, the default; ``"zigzag"``
when the caller keeps its activations in ``to_layout(..., "zigzag", W)`` order for balanced causal work),
``backend``, ``timeout_s``, ``deterministic``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ring_core.validate import check_global_seq, check_layout

from jax_ring import _platform
from jax_ring.api import ring_attention


def _spec_of(x):
    """The NamedSharding that ``x`` is known to have here (concrete array, or traced on Explicit axes), else
    the abstract mesh it is traced on (spec unknown), else None."""
    try:  # a concrete array; a traced one has no .sharding (AttributeError)
        sh = x.sharding
    except AttributeError:
        pass
    else:
        return sh if isinstance(sh, NamedSharding) else None
    try:
        sh = jax.typeof(x).sharding
    except Exception:  # pragma: no cover - a JAX without typeof shardings
        return None
    return sh if isinstance(sh, NamedSharding) and sh.mesh.axis_names else None


def _seq_entry(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return entries


def resolve_mesh_axis(query, mesh=None, axis_name=None):
    """(mesh, axis_name, batch axes, head axes) for a global query ``[batch, seq, heads, head_dim]``."""
    sh = _spec_of(query)
    entries = _seq_entry(sh.spec, 4) if sh is not None else (None,) * 4
    if mesh is None:
        if sh is not None:
            mesh = sh.mesh
        else:
            ctx = jax.sharding.get_abstract_mesh()
            mesh = ctx if ctx.axis_names else None
    if mesh is None:
        raise ValueError(
            "no mesh: the query is not sharded and no mesh is set. Shard the inputs' sequence axis "
            "(jax.device_put(x, NamedSharding(mesh, P(None, 'sp')))), set one with jax.set_mesh(mesh), or pass "
            "mesh=... and axis_name=...")
    names = tuple(mesh.axis_names)
    if axis_name is None:
        seq = entries[1]
        if isinstance(seq, tuple):
            if len(seq) != 1:
                raise ValueError(f"the query's sequence axis is sharded over several mesh axes {seq}; the ring runs "
                                 "over one: pass axis_name=")
            seq = seq[0]
        if seq is not None:
            axis_name = seq
        elif len(names) == 1:
            axis_name = names[0]
        else:
            raise ValueError(f"which mesh axis shards the sequence? The mesh has axes {names} and the query's "
                             "sharding does not say (under jax.jit with Auto axes it is not known): pass axis_name=")
    if axis_name not in names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh (axes {names})")
    batch = entries[0] if entries[0] != axis_name else None
    heads = entries[2] if entries[2] != axis_name else None
    return mesh, axis_name, batch, heads


@functools.lru_cache(maxsize=64)
def _sharded(mesh, axis_name, batch_axes, head_axes, segmented, kw):
    kw = dict(kw)
    return_lse = kw["return_lse"]

    def body(q, k, v, *ids):
        return ring_attention(q, k, v, axis_name=axis_name, segment_ids=ids[0] if ids else None, **kw)

    x = P(batch_axes, axis_name, head_axes, None)
    ids = P(batch_axes, axis_name)
    in_specs = (x, x, x, ids) if segmented else (x, x, x)
    out_specs = (x, P(batch_axes, head_axes, axis_name)) if return_lse else x
    return jax.jit(_platform.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False, segment_ids=None, mesh=None, axis_name=None,
                          layout="contiguous", backend="auto", timeout_s=None, deterministic=False):
    """``jax.nn.dot_product_attention`` over global arrays whose sequence axis is sharded; see the module doc.

    Example (2 CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=2)::

        import jax, numpy as np, jax_ring
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
        q = jax.device_put(jax.random.normal(jax.random.key(0), (2, 64, 8, 64)), NamedSharding(mesh, P(None, "sp")))
        k = v = jax.device_put(jax.random.normal(jax.random.key(1), (2, 64, 2, 64)), NamedSharding(mesh, P(None, "sp")))
        out = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    """
    if bias is not None:
        raise ValueError("bias is not supported by ring attention (an additive bias over the whole score matrix "
                         "cannot be split over the ring); pass bias=None")
    if mask is not None:
        raise ValueError("mask is not supported by ring attention (an arbitrary mask cannot be split over the ring): "
                         "use is_causal=True, local_window_size=(left, right), or segment_ids (int32 [batch, seq], "
                         "-1 on padding) for packed sequences")
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        raise ValueError("query_seq_lengths / key_value_seq_lengths are not supported by ring attention: pass "
                         "segment_ids (int32 [batch, seq]: 0 on the tokens of each row, -1 on its padding) instead")
    if implementation is not None:
        raise ValueError(f"implementation={implementation!r} picks one of jax.nn's kernels; the ring picks its own "
                         "with backend= ('auto', 'fused', 'xla'): pass implementation=None")
    check_layout(layout)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids)[None]
    if query.ndim != 4:
        raise ValueError(f"query must be [batch, seq, heads, head_dim] or [seq, heads, head_dim], got shape "
                         f"{query.shape}")
    window = None
    if local_window_size is not None:
        window = ((int(local_window_size), int(local_window_size)) if isinstance(local_window_size, int)
                  else tuple(int(w) for w in local_window_size))
    mesh, axis_name, batch_axes, head_axes = resolve_mesh_axis(query, mesh, axis_name)
    world = int(dict(zip(mesh.axis_names, mesh.axis_sizes))[axis_name])
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim == 4:
            check_global_seq(x.shape[1], world, layout, f"{name} has seq", f" on axis {axis_name!r}")
    kw = dict(is_causal=bool(is_causal), scale=None if scale is None else float(scale), layout=layout,
              return_lse=bool(return_residual), backend=backend, timeout_s=timeout_s, window_size=window,
              deterministic=bool(deterministic))
    fn = _sharded(mesh, axis_name, batch_axes, head_axes, segment_ids is not None, tuple(sorted(kw.items())))
    args = (query, key, value) if segment_ids is None else (query, key, value, jnp.asarray(segment_ids))
    result = fn(*args)
    if return_residual:
        out, lse = result
        lse = jnp.swapaxes(lse, 1, 2)  # [batch, heads, seq] -> jax.nn's [batch, seq, heads]
        return (out[0], lse[0]) if unbatched else (out, lse)
    return result[0] if unbatched else result
