"""torch_bridge's ring-flash-attn signatures (ring_flash_attn_func, zigzag_ring_flash_attn_func, the packed and
varlen forms) on gloo ranks, against torch.nn.functional.scaled_dot_product_attention on the whole sequence
(float64), with the local-shard conventions of ring-flash-attn. Odd shapes: 7 heads on 1 KV head, head_dim 80,
sequences whose lengths are not powers of two.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_bridge
from ring_core import testing


def _sdpa(q, k, v, causal, scale=None, window=None, segments=None):
    """Reference out [b, s, h, d] and lse [b, h, s] in float64 from sdpa (and the lse from the scores)."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allow = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allow &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            allow &= j >= i - left
        if right >= 0:
            allow &= j <= i + right
    allow = allow.expand(b, 1, s, s)
    if segments is not None:
        allow = allow & (segments[:, None, :, None] == segments[:, None, None, :]) & (segments[:, None, :, None] >= 0)
    scale = d ** -0.5 if scale is None else scale
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allow, scale=scale)
    scores = (qt @ kt.transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~allow, float("-inf")), dim=-1)
    rows = allow.any(-1)
    out = torch.where(rows[..., None], out, torch.zeros_like(out))
    return out.transpose(1, 2), lse


def _inputs(seed, b, s, h, hkv, d):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, h, d, generator=g, dtype=torch.float64),
            torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64),
            torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64))


def _split(x, layout, rank, world, axis=1):
    s = x.shape[axis] // world
    return torch_bridge.to_layout(x, layout, world, seq_axis=axis).narrow(axis, rank * s, s)


# ---------------------------------------------------------------------------------------- worker functions
def _dense_worker(rank, world, fn_name, layout, q, k, v, kw, packed):
    fn = getattr(torch_bridge, fn_name)
    ql, kl, vl = (_split(x, layout, rank, world).requires_grad_() for x in (q, k, v))
    if packed == "kv":
        out, lse, none = fn(ql, torch.stack([kl, vl], 2), **kw, return_attn_probs=True)
    elif packed == "qkv":
        out, lse, none = fn(torch.stack([ql, kl, vl], 2), **kw, return_attn_probs=True)
    else:
        out, lse, none = fn(ql, kl, vl, kw.pop("dropout_p", 0.0), kw.pop("softmax_scale", None),
                            kw.pop("causal", False), **kw, return_attn_probs=True)
    assert none is None
    out.sum().backward()
    grads = [] if packed else [x.grad.numpy() for x in (ql, kl, vl)]
    return out.detach().numpy(), lse.detach().numpy(), grads


def _varlen_worker(rank, world, fn_name, zigzag, q, k, v, cu_global, causal, scale):
    """Rank r's ring-flash-attn varlen buffer: piece r of every packed sequence (zigzag: chunks r and 2W-1-r)."""
    fn = getattr(torch_bridge, fn_name)
    pieces = []
    for a, b in zip(cu_global[:-1].tolist(), cu_global[1:].tolist()):
        idx = torch.arange(a, b)
        if zigzag:
            c = (b - a) // (2 * world)
            pieces += [idx[rank * c:(rank + 1) * c], idx[(2 * world - 1 - rank) * c:(2 * world - rank) * c]]
        else:
            c = (b - a) // world
            pieces.append(idx[rank * c:(rank + 1) * c])
    take = torch.cat(pieces)
    ql, kl, vl = (x[take] for x in (q, k, v))
    cu_local = (cu_global // world).to(torch.int32)
    out, lse, _ = fn(ql, kl, vl, cu_local, int((cu_local[1:] - cu_local[:-1]).max()), 0.0, scale, causal,
                     return_attn_probs=True)
    return take.numpy(), out.numpy(), lse.numpy()


def _raises_worker(rank, world):
    q = torch.randn(1, 4, 2, 16)
    msgs = []
    for kw in (dict(dropout_p=0.1), dict(alibi_slopes=torch.ones(2))):
        try:
            torch_bridge.zigzag_ring_flash_attn_func(q, q, q, **kw)
        except ValueError as e:
            msgs.append(str(e))
    try:
        torch_bridge.ring_flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32), 4,
                                                 window_size=(2, 0))
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def _mesh_worker(rank, world, q, k, v):
    """group= as a one-dimensional DeviceMesh (mesh["sp"]) and as (mesh, "sp"), for a function and the module."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "sp"))
    ql, kl, vl = (_split(x, "zigzag", rank, world) for x in (q, k, v))
    a = torch_bridge.zigzag_ring_flash_attn_func(ql, kl, vl, causal=True, group=mesh["sp"])
    b = torch_bridge.RingAttention(group=(mesh, "sp"), is_causal=True, layout="zigzag")(ql, kl, vl)
    errors = []
    for bad in (mesh, (mesh, "tp")):
        try:
            torch_bridge.ring_attention(ql, kl, vl, group=bad)
        except ValueError as e:
            errors.append(str(e))
    return a.numpy(), b.numpy(), errors


# ------------------------------------------------------------------------------------------------- tests
DENSE = [
    # fn, layout, world, (b, s_global, h, hkv, d), kwargs, packed
    ("ring_flash_attn_func", "contiguous", 2, (2, 18, 7, 1, 80), dict(causal=True), None),
    ("zigzag_ring_flash_attn_func", "zigzag", 2, (1, 20, 4, 2, 16), dict(causal=True, softmax_scale=0.3), None),
    ("zigzag_ring_flash_attn_func", "zigzag", 3, (1, 30, 6, 3, 24), dict(causal=True, window_size=(7, -1)), None),
    ("ring_flash_attn_func", "contiguous", 3, (1, 21, 2, 2, 16), dict(causal=False, window_size=(4, 3)), None),
    ("zigzag_ring_flash_attn_kvpacked_func", "zigzag", 2, (1, 12, 4, 1, 32), dict(causal=True), "kv"),
    ("ring_flash_attn_qkvpacked_func", "contiguous", 2, (1, 10, 3, 3, 16), dict(causal=False), "qkv"),
]


@pytest.mark.parametrize("case", DENSE, ids=[f"{c[0]}-W{c[2]}-{i}" for i, c in enumerate(DENSE)])
def test_dense_matches_sdpa(torch_group, case):
    fn, layout, world, shape, kw, packed = case
    q, k, v = _inputs(world, *shape)
    ref_out, ref_lse = _sdpa(q, k, v, kw.get("causal", False), kw.get("softmax_scale"),
                             kw.get("window_size"))
    ref_out.requires_grad_()
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    o, _ = _sdpa(qr, kr, vr, kw.get("causal", False), kw.get("softmax_scale"),
                 kw.get("window_size"))
    o.sum().backward()
    results = torch_group(world).run(_dense_worker, fn, layout, q, k, v, dict(kw), packed)
    tol = testing.TOLERANCES["float64"]
    out = torch_bridge.from_layout(torch.from_numpy(np.concatenate([r[0] for r in results], 1)), layout, world)
    lse = torch_bridge.from_layout(torch.from_numpy(np.concatenate([r[1] for r in results], 2)), layout, world,
                                   seq_axis=2)
    assert testing.max_abs_err(out, ref_out.detach()) <= tol["out"]
    assert lse.shape == ref_lse.shape and testing.max_abs_err(lse, ref_lse) <= tol["lse"]
    if not packed:
        for i, ref in enumerate((qr.grad, kr.grad, vr.grad)):
            g = torch_bridge.from_layout(torch.from_numpy(np.concatenate([r[2][i] for r in results], 1)), layout,
                                         world)
            assert testing.max_abs_err(g, ref) <= tol["grad"], "dqkv"[i + 1]


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_sdpa(torch_group, zigzag, causal):
    """Three packed sequences (lengths 12, 4, 20 on 2 ranks: multiples of 2W) in ring-flash-attn's varlen layout."""
    world = 2
    lens = [12, 4, 20]
    cu = torch.tensor([0] + np.cumsum(lens).tolist())
    q, k, v = (x[0] for x in _inputs(9, 1, int(cu[-1]), 5, 1, 80))
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None]
    ref_out, ref_lse = _sdpa(q[None], k[None], v[None], causal, None, None, seg)
    fn = "zigzag_ring_flash_attn_varlen_func" if zigzag else "ring_flash_attn_varlen_func"
    tol = testing.TOLERANCES["float64"]
    for take, out, lse in torch_group(world).run(_varlen_worker, fn, zigzag, q, k, v, cu, causal, None):
        assert lse.shape == (5, take.size)  # flash-attn varlen: [heads, total]
        assert testing.max_abs_err(out, ref_out[0][take]) <= tol["out"]
        assert testing.max_abs_err(lse, ref_lse[0][:, take]) <= tol["lse"]


def test_device_mesh_groups(torch_group):
    q, k, v = _inputs(3, 1, 12, 4, 2, 16)
    ref, _ = _sdpa(q, k, v, True)
    results = torch_group(2).run(_mesh_worker, q, k, v)
    for i in range(2):
        out = torch_bridge.from_layout(torch.from_numpy(np.concatenate([r[i] for r in results], 1)), "zigzag", 2)
        assert testing.max_abs_err(out, ref) <= testing.TOLERANCES["float64"]["out"]
    errors = results[0][2]
    assert "2 dimensions" in errors[0] and "'tp' is not a dimension" in errors[1]


def test_unsupported_arguments_raise(torch_group):
    msgs = torch_group(2).run(_raises_worker)[0]
    assert len(msgs) == 3
    assert "dropout_p" in msgs[0] and "alibi_slopes" in msgs[1] and "sliding window" in msgs[2]


def test_one_process_odd_shapes_and_signature():
    """World size 1: the positional signature of ring-flash-attn and its return convention."""
    q, k, v = _inputs(0, 2, 13, 7, 1, 80)
    ref_out, ref_lse = _sdpa(q, k, v, True)
    out = torch_bridge.ring_flash_attn_func(q, k, v, 0.0, None, True)
    assert isinstance(out, torch.Tensor)
    assert testing.max_abs_err(out, ref_out) <= testing.TOLERANCES["float64"]["out"]
    out, lse, none = torch_bridge.ring_flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), None, False, True)
    assert none is None and lse.shape == (2, 7, 13)
    assert testing.max_abs_err(lse, ref_lse) <= testing.TOLERANCES["float64"]["lse"]
    import inspect

    names = list(inspect.signature(torch_bridge.zigzag_ring_flash_attn_func).parameters)[:11]
    assert names == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "alibi_slopes",
                     "deterministic", "return_attn_probs", "group"]
