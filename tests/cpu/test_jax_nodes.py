"""jax_ring's two-level ring (jax_ring.nodes) on CPU devices: each device is a node of one rank, the K/V and the dK/dV
partials travel between them by ``lax.ppermute`` under ``jax.jit`` and ``jax.shard_map`` with JAX's defaults
(check_vma, gradients taken outside the shard_map), the node-steps whose kind differs between nodes run through
``lax.switch``. The node's fused call is replaced by dense attention on the device (with one rank a node that is
what the kernel computes; the kernels themselves are checked in test_nodes.py and on GPUs), so this checks
JAX's side of the two levels: the between-node transfers, the traced schedule, the custom VJP, against float64."""

import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_ring
from jax_ring import _platform, api
from jax_ring import nodes as jnodes
from ring_core.runtime import heap as heap_mod
from ring_core import masks, testing, topology
from ring_core.layout import layout_permutation


def _mask(spec, s, sk, segment_ids):
    """[b or 1, 1, 1, s, sk] pairs the call allows: causal and the window (the keys' positions moved by
    spec.key_offset), and the ids as the kernels take them (the queries' and, with spec.kv_ids, the keys' stacked)."""
    m = jnp.ones((1, 1, 1, s, sk), bool)
    by_pos = masks.allowed(jnp.arange(s), jnp.arange(sk) + spec.key_offset, is_causal=spec.is_causal,
                           window=spec.window)
    if by_pos is not None:
        m = m & by_pos
    if segment_ids is not None:
        qi, ki = (segment_ids[0], segment_ids[1]) if spec.kv_ids else (segment_ids, segment_ids)
        m = m & ((qi[:, :, None] == ki[:, None, :]) & (qi[:, :, None] >= 0))[:, None, None]
    return m


def _dense_fwd(q, k, v, spec, axis_name, ring_size, timeout_s, segment_ids=None):
    assert ring_size == 1
    b, s, h, d = q.shape
    hkv = k.shape[2]
    sc = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, s, hkv, h // hkv, d).astype(jnp.float32),
                    k.astype(jnp.float32)) * spec.scale
    allowed = _mask(spec, s, k.shape[1], segment_ids)
    sc = jnp.where(allowed, sc, -jnp.inf)
    lse = jax.nn.logsumexp(sc, axis=-1)
    p = jnp.where(allowed, jnp.exp(sc - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None]), 0.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
    return out.reshape(b, s, h, d).astype(q.dtype), lse.reshape(b, h, s)


def _dense_bwd(q, k, v, out, lse, dout, dlse, spec, axis_name, ring_size, timeout_s, segment_ids=None,
               deterministic=False):
    """The fused backward's meaning from the given out and lse (those of the whole sequence)."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    f = lambda x: x.astype(jnp.float32)  # noqa: E731
    qg = f(q).reshape(b, s, hkv, g, d)
    sc = jnp.einsum("bqkgd,bskd->bkgqs", qg, f(k)) * spec.scale
    lse = lse.reshape(b, hkv, g, s)
    p = jnp.where(_mask(spec, s, k.shape[1], segment_ids),
                  jnp.exp(sc - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None]), 0.0)
    do = f(dout).reshape(b, s, hkv, g, d)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", do, f(out).reshape(b, s, hkv, g, d)) - dlse.reshape(b, hkv, g, s)
    ds = p * (jnp.einsum("bqkgd,bskd->bkgqs", do, f(v)) - delta[..., None])
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, f(k)).reshape(b, s, h, d) * spec.scale
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg) * spec.scale
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


class _Heap:
    node_size = 1

    def kernel_spec(self, spec):  # (the kernels at the caller's head_dim, as on a CPU)
        return spec

    def plan(self, spec, ring_size):
        pass

    def plan_bwd(self, spec, ring_size, deterministic=False):
        pass


@pytest.fixture
def nodes_of_one(monkeypatch):
    """4 CPU devices as 4 nodes of one rank each, the node's call dense attention."""
    monkeypatch.setattr(heap_mod, "_heap", _Heap())
    monkeypatch.setattr(heap_mod, "_node_rings", types.SimpleNamespace(nodes=topology.Nodes(4, 1)))
    monkeypatch.setattr(jnodes, "fused", types.SimpleNamespace(forward=_dense_fwd, backward=_dense_bwd))
    monkeypatch.setattr(api, "_fused_available", lambda: True)
    monkeypatch.setattr(api.plans, "check_fused", lambda spec, other: None)
    return Mesh(np.array(jax.devices()[:4]), ("sp",))


@pytest.mark.parametrize("causal,layout,H,HKV,S,D,segmented,window", [
    (True, "zigzag", 4, 2, 8, 16, False, None),
    (True, "contiguous", 3, 1, 6, 8, False, None),
    (False, "zigzag", 2, 2, 10, 16, False, None),
    (True, "zigzag", 4, 2, 8, 16, True, None),
    (True, "contiguous", 2, 1, 6, 8, True, None),
    (True, "contiguous", 4, 2, 8, 16, False, (10, -1)),  # a band across nodes
    (False, "zigzag", 2, 1, 8, 16, True, (3, 2)),  # the second halves reversed, kinds that differ by node
])
def test_two_level_ring_gradients_outside_shard_map(nodes_of_one, causal, layout, H, HKV, S, D, segmented, window):
    mesh, W, B = nodes_of_one, 4, 2
    q, k, v, dout = testing.random_inputs(0, B, W * S, H, HKV, D, "float32", with_dout=True)
    dlse = np.random.default_rng(1).standard_normal((B, H, W * S)).astype(np.float32)
    ids = testing.crossing_documents(B, W * S) if segmented else None
    perm = layout_permutation(W * S, W, layout)
    lay = lambda x, ax=1: jnp.asarray(np.take(x, perm, axis=ax).astype(np.float32))  # noqa: E731

    def body(q, k, v, *seg):
        return jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=causal, layout=layout, return_lse=True,
                                       backend="fused", segment_ids=seg[0] if seg else None, window_size=window)

    seg_in = (jnp.asarray(np.take(ids, perm, axis=1)),) if segmented else ()
    f = jax.jit(_platform.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * (3 + len(seg_in)),
                                    out_specs=(P(None, "sp"), P(None, None, "sp"))))
    (out, lse), vjp = jax.vjp(lambda q, k, v: f(q, k, v, *seg_in), lay(q), lay(k), lay(v))
    grads = vjp((lay(dout), jnp.where(jnp.isneginf(lse), 0.0, lay(dlse, 2))))
    inv = np.argsort(perm)
    nat = lambda x, ax=1: np.take(np.asarray(x), inv, axis=ax)  # noqa: E731
    testing.check_attention("jax nodes", nat(out), nat(lse, 2), q, k, v, "float32", is_causal=causal,
                            segment_ids=ids, window=window)
    dlse64 = np.where(np.isneginf(nat(lse, 2)), 0.0, dlse.astype(np.float64))
    testing.check_grads("jax nodes", [nat(g) for g in grads], q, k, v, dout, "float32", is_causal=causal,
                        dlse=dlse64, segment_ids=ids, window=window)


def test_the_hop_is_a_collective_permute_to_the_next_node(nodes_of_one):
    """The program moves K/V with collective permutes by whole nodes, and a zigzag node-step runs a conditional."""
    mesh = nodes_of_one
    x = jnp.zeros((1, 32, 2, 8), jnp.float32)

    def body(q, k, v):
        return jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=True, layout="zigzag", backend="fused")

    f = jax.jit(_platform.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
    hlo = f.lower(x, x, x).as_text()
    assert "collective_permute" in hlo or "collective-permute" in hlo
    assert "case" in hlo or "conditional" in hlo


def test_masks_not_taken_across_nodes_raise_at_trace_time(nodes_of_one):
    mesh = nodes_of_one
    x = jnp.zeros((1, 32, 2, 8), jnp.float32)

    def body(q, k, v):  # zigzag chunks of 4 tokens a node: a window of 6 reaches partly across a node's halves
        return jax_ring.ring_attention(q, k, v, axis_name="sp", layout="zigzag", window_size=(6, 0),
                                       backend="fused")

    f = jax.jit(_platform.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
    with pytest.raises(NotImplementedError, match="zigzag halves"):
        f(x, x, x)
