"""Packed sequences and sliding windows through both frontends' public API (CPU): ``segment_ids=`` and
``window_size=`` reach the reference rings (xla, torch) and the fused backend (its kernels in the Triton
interpreter on one rank; ``backend="auto"`` picks it where it is available, masks or not) and give the float64
reference's result; bad segment ids raise before any work; ``segment_ids_from_cu_seqlens`` in both frontends.
Both fused autograd layers with masks, JAX against torch bit for bit: tests/cpu/test_fused_wiring.py."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused-path tests below run on the interpreter's fake heap

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ring_core import reference, testing  # noqa: E402
from ring_core.masks import segment_ids_from_cu_seqlens  # noqa: E402
from test_fused_wiring import cpu_heap, jax_fused  # noqa: E402,F401  (fixtures)

CU = [0, 5, 11, 20]  # three documents in 24 tokens, then 4 tokens of padding


def _inputs(seed, S=24, H=4, HKV=2, D=16):
    q, k, v, do = testing.random_inputs(seed, 1, S, H, HKV, D, "float32", with_dout=True)
    seg = segment_ids_from_cu_seqlens(np.array(CU), S)[None].astype(np.int32)
    return q, k, v, do, seg


@pytest.mark.parametrize("layout, causal, window", [("contiguous", True, (6, 0)), ("zigzag", True, None),
                                                     ("zigzag", False, (3, 2))])
def test_jax_sharded_with_segment_ids_and_windows(cpu_mesh, layout, causal, window):
    import jax_ring

    W = 2
    q, k, v, _, seg = _inputs(1)
    mesh = cpu_mesh(W)
    args = [jax_ring.to_layout(x, layout, W) for x in (q.astype(np.float32), k.astype(np.float32),
                                                    v.astype(np.float32), seg)]
    out, lse = jax_ring.ring_attention_sharded(*args[:3], mesh=mesh, axis_name="sp", is_causal=causal, layout=layout,
                                               return_lse=True, backend="xla", segment_ids=args[3], window_size=window)
    out = jax_ring.from_layout(np.asarray(out, np.float64), layout, W)
    lse = jax_ring.from_layout(np.asarray(lse, np.float64), layout, W, seq_axis=2)
    testing.check_attention("jax sharded masks", out, lse, q, k, v, "float32", is_causal=causal, segment_ids=seg,
                            window=window)
    assert np.all(out[:, CU[-1]:] == 0) and np.all(np.isneginf(lse[:, :, CU[-1]:]))  # padding rows


def test_jax_gradients_with_masks_under_jax_defaults(cpu_mesh):
    """Inside a user's shard_map (check_vma on), the gradient taken outside."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_ring

    W = 2
    q, k, v, do, seg = _inputs(2)
    spec = P(None, "sp")
    f = jax.shard_map(lambda q, k, v, s: jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                                                 backend="xla", segment_ids=s, window_size=(7, 0)),
                      mesh=cpu_mesh(W), in_specs=(spec,) * 4, out_specs=spec)
    loss = lambda q, k, v, s: jnp.sum(f(q, k, v, s) * do.astype(np.float32))  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                                                        jnp.asarray(seg))
    testing.check_grads("jax masks grads", [np.asarray(g, np.float64) for g in grads], q, k, v, do, "float32",
                        is_causal=True, segment_ids=seg, window=(7, 0))


def _torch_masked_task(rank, world, q, k, v, do, seg, window):
    import torch

    import torch_bridge

    S = q.shape[1] // world
    sl = slice(rank * S, (rank + 1) * S)
    ts = [torch.from_numpy(np.ascontiguousarray(x[:, sl])).float().requires_grad_() for x in (q, k, v)]
    out, lse = torch_bridge.ring_attention(*ts, is_causal=True, return_lse=True, segment_ids=torch.from_numpy(
        np.ascontiguousarray(seg[:, sl])), window_size=window)
    out.backward(torch.from_numpy(np.ascontiguousarray(do[:, sl])).float())
    return [x.detach().double().numpy() for x in (out, lse, *(t.grad for t in ts))]


def test_torch_with_segment_ids_and_a_window(torch_group):
    q, k, v, do, seg = _inputs(3)
    res = torch_group(2).run(_torch_masked_task, q, k, v, do, seg, (5, 0), timeout=120)
    out, lse, dq, dk, dv = (np.concatenate([r[i] for r in res], axis=2 if i == 1 else 1) for i in range(5))
    testing.check_attention("torch masks", out, lse, q, k, v, "float32", is_causal=True, segment_ids=seg,
                            window=(5, 0))
    testing.check_grads("torch masks grads", [dq, dk, dv], q, k, v, do, "float32", is_causal=True, segment_ids=seg,
                        window=(5, 0))


def test_torch_module_takes_the_window_at_construction_and_segment_ids_per_call():
    import torch

    import torch_bridge

    q, k, v, _, seg = _inputs(4)
    attn = torch_bridge.RingAttention(is_causal=True, window_size=(4, 0))
    out = attn(*(torch.from_numpy(x).float() for x in (q, k, v)), segment_ids=torch.from_numpy(seg))
    want, _ = reference.attention(q, k, v, is_causal=True, segment_ids=seg, window=(4, 0))
    np.testing.assert_allclose(out.double().numpy(), want, atol=1e-5)
    assert "window_size=(4, 0)" in repr(attn)
    with pytest.raises(ValueError, match="window_size's left side must be >= -1"):
        torch_bridge.RingAttention(window_size=(-2, 0))


def test_fused_takes_masks_and_auto_picks_it(jax_fused, monkeypatch):
    """backend="fused" takes segment ids and windows in both frontends, and backend="auto" picks the fused
    kernels for masked calls as for plain ones, where they are available (here: the interpreter on one rank);
    the results are the float64 reference's."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    import torch_bridge
    from test_fused_wiring import _check_now

    q, k, v, _, seg = _inputs(5)
    qs, ks, vs = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def run(backend):
        f = jax.shard_map(lambda q, k, v, s: jax_ring.ring_attention(q, k, v, axis_name="sp", backend=backend,
                                                                     segment_ids=s),
                          mesh=mesh, in_specs=(P(None, "sp"),) * 4, out_specs=P(None, "sp"))
        return jax.jit(f)(qs, ks, vs, jnp.asarray(seg))

    for backend in ("fused", "auto"):
        n = len(jax_fused)
        testing.check_attention(f"jax {backend} with masks", np.asarray(run(backend), np.float64), None, q, k, v,
                                "float32", is_causal=False, segment_ids=seg)
        assert [c["name"] for c in jax_fused[n:]] == ["ring_attn_fwd"]  # the fused kernel ran
        assert jax_fused[-1]["constexprs"]["SEGMENTED"]
    monkeypatch.setattr(torch_bridge.api, "_on_gpu", lambda x: True)
    monkeypatch.setattr(torch_bridge.api, "_fused_available", lambda: True)
    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    launched = []
    monkeypatch.setattr(torch_bridge.fused, "forward", _recording(torch_bridge.fused.forward, launched))
    tq, tk, tv = (torch.from_numpy(x).float() for x in (q, k, v))
    want, _ = reference.attention(q, k, v, window=(3, 3))
    for backend in ("fused", "auto"):
        out = torch_bridge.ring_attention(tq, tk, tv, backend=backend, window_size=(3, 3))
        np.testing.assert_allclose(out.double().numpy(), want, atol=1e-5)
    assert [spec.window for spec in launched] == [(3, 3), (3, 3)]  # both calls took the fused kernel


def _recording(launcher, specs):
    def forward(q, k, v, spec, *args, **kwargs):
        specs.append(spec)
        return launcher(q, k, v, spec, *args, **kwargs)
    return forward


def test_bad_segment_ids_raise_before_any_work(cpu_mesh):
    import jax.numpy as jnp
    import torch

    import jax_ring
    import torch_bridge

    q, k, v, _, seg = _inputs(6)
    t = [torch.from_numpy(x).float() for x in (q, k, v)]
    with pytest.raises(TypeError, match="segment_ids must be int32"):
        torch_bridge.ring_attention(*t, segment_ids=torch.from_numpy(seg).long())
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_local\] = \[1, 24\]"):
        torch_bridge.ring_attention(*t, segment_ids=torch.from_numpy(seg[:, :10]))
    with pytest.raises(TypeError, match="segment_ids must be a torch.Tensor"):
        torch_bridge.ring_attention(*t, segment_ids=seg)
    with pytest.raises(TypeError, match="segment_ids must be int32"):
        jax_ring.ring_attention_sharded(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), mesh=cpu_mesh(2),
                                        axis_name="sp", segment_ids=jnp.asarray(seg, jnp.float32))


def test_segment_ids_from_cu_seqlens_in_both_frontends():
    import jax
    import torch

    import jax_ring
    import torch_bridge

    want = [0, 0, 0, 1, 1, -1]
    assert jax_ring.segment_ids_from_cu_seqlens(np.array([0, 3, 5]), 6).tolist() == want
    assert isinstance(jax_ring.segment_ids_from_cu_seqlens(jax.numpy.array([0, 3, 5]), 6), jax.Array)
    got = torch_bridge.segment_ids_from_cu_seqlens(torch.tensor([0, 3, 5]), 6)
    assert got.dtype == torch.int32 and got.tolist() == want
