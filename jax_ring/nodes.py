"""backend='fused' across several nodes for JAX: the two-level ring of ring_core.nodes inside ``jax.shard_map``, with
the node's fused calls (jax_ring.fused over the axis's consecutive blocks of ``node_size`` devices, one block a node)
and the K/V between nodes by ``lax.ppermute`` (device i of the axis to device i + node_size), which XLA runs as an
asynchronous collective beside the fused calls. The twin of torch_bridge.nodes.

One program runs on every device, so the node index is a traced value (``axis_index // node_size``): a node-step
whose kind differs between nodes (zigzag: the K/V of an earlier node or of a later one) runs ``lax.switch`` over
the kinds (ring_core.nodes); the ranks of a node take the same branch. Why it cannot deadlock: ring_core.nodes (every
device runs the same sequence of permutes, and a node's fused calls need only its own devices).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring import _platform, fused
from ring_core.runtime import heap as _heap
from ring_core import nodes


def spans_nodes(axis_size: int) -> bool:
    """Whether a fused call over a mesh axis of ``axis_size`` devices is the two-level ring (the job has several
    nodes and the axis is longer than a node; jax_ring.fused.ring_table checks that each block of ``node_size``
    devices along it is one node's)."""
    rings = _heap.node_rings()
    if rings is None or axis_size <= rings.nodes.node_size:
        return False
    if axis_size % rings.nodes.node_size:
        raise ValueError(f"the sequence axis has {axis_size} devices, not a multiple of the {rings.nodes.node_size} "
                         "ranks of a node: lay the axis over whole nodes")
    return True


def _f32(x):
    return x if x.dtype == jnp.float64 else x.astype(jnp.float32)


def _ops(spec, axis_name: str, node_size: int, timeout_s, deterministic: bool) -> nodes.Ops:
    world = _platform.axis_size(axis_name)
    perm = [(i, (i + node_size) % world) for i in range(world)]

    def inner_fwd(q, k, v, mask, ids):
        return fused.forward(q, k, v, nodes.inner_spec(spec, q, k, mask, ids), axis_name, node_size,
                             timeout_s, segment_ids=nodes.kernel_ids(ids, jnp.stack))

    def inner_bwd(q, k, v, out, lse, dout, dlse, mask, ids):
        return fused.backward(q, k, v, out, lse, dout, dlse, nodes.inner_spec(spec, q, k, mask, ids),
                              axis_name, node_size, timeout_s, segment_ids=nodes.kernel_ids(ids, jnp.stack),
                              deterministic=deterministic)

    return nodes.Ops(xp=jnp, permute=jnp.transpose, cat=jnp.concatenate, flip=jnp.flip,
                     astype=lambda x, like: x.astype(like.dtype), f32=_f32, inner_fwd=inner_fwd, inner_bwd=inner_bwd,
                     send=lambda xs: [lax.ppermute(x, axis_name, perm) for x in xs], recv=lambda got: got,
                     switch=lax.switch)


def _geometry(spec, axis_name: str, node_size: int, segment_ids):
    world = _platform.axis_size(axis_name)
    node = _platform.axis_index(axis_name) // node_size
    ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return dict(node=node, num_nodes=world // node_size, is_causal=spec.is_causal, layout=spec.layout, ids=ids,
                window=spec.window, node_size=node_size)


# segment_ids: an array input (None, or this device's int32 ids), no gradient (jax_ring.api's _fused says why).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def two_level(q, k, v, segment_ids, spec, axis_name, node_size, timeout_s, deterministic):
    """(out, lse) of the two-level ring for this device's shards inside shard_map (``spec`` validated)."""
    ops = _ops(spec, axis_name, node_size, timeout_s, deterministic)
    return nodes.forward(ops, q, k, v, **_geometry(spec, axis_name, node_size, segment_ids))


def _fwd(q, k, v, segment_ids, spec, axis_name, node_size, timeout_s, deterministic):
    out, lse = two_level(q, k, v, segment_ids, spec, axis_name, node_size, timeout_s, deterministic)
    return (out, lse), (q, k, v, segment_ids, out, lse)


def _bwd(spec, axis_name, node_size, timeout_s, deterministic, res, cts):
    q, k, v, segment_ids, out, lse = res
    dout, dlse = cts
    ops = _ops(spec, axis_name, node_size, timeout_s, deterministic)
    dq, dk, dv = nodes.backward(ops, q, k, v, out, lse, dout.astype(q.dtype), dlse.astype(jnp.float32),
                                **_geometry(spec, axis_name, node_size, segment_ids))
    return dq, dk, dv, None


two_level.defvjp(_fwd, _bwd)


def fused_takes(spec, axis_size: int) -> bool:
    """Whether the two-level fused ring takes ``spec`` over a sequence axis of ``axis_size`` devices
    (ring_core.nodes.supports)."""
    node_size = _heap.node_rings().nodes.node_size
    return nodes.supports(spec, axis_size // node_size, node_size)


def check_fits(spec, num_nodes: int, backward: bool, deterministic: bool) -> None:
    """Raise (HeapTooSmallError; a zigzag window that reaches partly across a node's halves:
    ring_core.nodes.window_pieces) at trace time, before anything runs."""
    h = _heap.get()
    nodes.check_supported(spec, num_nodes, h.node_size)
    for sp in nodes.node_specs(spec, num_nodes, h.node_size):
        h.plan(sp, h.node_size)
        if backward:
            h.plan_bwd(sp, h.node_size, deterministic=deterministic)


def ring_attention(q, k, v, spec, axis_name: str, timeout_s=None, deterministic: bool = False, segment_ids=None):
    """(out, lse), differentiable, of the two-level ring over ``axis_name`` (inside shard_map); ``segment_ids``
    this device's (int32 [batch, seq_local]) where the call has them."""
    node_size = _heap.node_rings().nodes.node_size
    check_fits(spec, _platform.axis_size(axis_name) // node_size, True, deterministic)
    return two_level(q, k, v, segment_ids, spec, axis_name, node_size, timeout_s, deterministic)
