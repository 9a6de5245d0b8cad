"""torch_bridge, backend="torch": the reference ring over gloo, checked against ring_core.reference.

Multi-rank cases run in a session-wide LocalGroup per world size (tests/conftest.py); world size 1 runs in
this process without torch.distributed being initialised. Worker functions are top level so they pickle.
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import pytest
import torch

import torch_bridge
from ring_core import testing
from ring_core.layout import global_positions
from torch_bridge.procs import LocalGroup, WorkerError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


class Case(NamedTuple):
    world: int
    is_causal: bool
    layout: str
    batch: int
    seq_local: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    return_lse: bool = True
    scale: float | None = None
    seed: int = 0

    @property
    def id(self):
        c = "causal" if self.is_causal else "full"
        s = "" if self.scale is None else f"-scale{self.scale}"
        return (f"W{self.world}-{c}-{self.layout}-b{self.batch}s{self.seq_local}-h{self.heads}kv{self.kv_heads}"
                f"-d{self.head_dim}-{self.dtype}{'-lse' if self.return_lse else ''}{s}")


C, Z = "contiguous", "zigzag"
F32, BF16, F16, F64 = "float32", "bfloat16", "float16", "float64"

FORWARD_CASES = [
    Case(1, False, C, 2, 1, 2, 2, 16, F32),
    Case(1, True, C, 1, 17, 4, 1, 64, BF16, False),
    Case(1, True, Z, 1, 10, 4, 2, 80, F16),
    Case(1, False, C, 2, 3, 4, 4, 128, F32, False),
    Case(1, True, C, 1, 6, 4, 2, 16, F64),
    Case(2, False, C, 1, 1, 1, 1, 16, F32),
    Case(2, True, C, 1, 3, 2, 2, 16, F32),
    Case(2, True, Z, 2, 6, 4, 2, 64, F32),
    Case(2, True, Z, 1, 10, 4, 1, 80, BF16),
    Case(2, False, Z, 1, 6, 4, 4, 128, F16, False),
    Case(2, True, C, 2, 17, 4, 2, 80, F16),
    Case(2, False, C, 1, 10, 4, 1, 64, BF16, False),
    Case(2, True, C, 1, 24, 2, 1, 128, BF16),
    Case(2, True, Z, 1, 2, 2, 2, 16, F32),  # zigzag chunks of one token
    Case(2, False, C, 2, 6, 4, 2, 16, F16),
    Case(2, True, Z, 1, 6, 2, 1, 16, F64),
    Case(2, True, C, 1, 6, 4, 2, 64, F32, scale=0.3),
    Case(2, False, Z, 1, 4, 2, 1, 16, F32, scale=0.0),  # uniform weights
    Case(3, True, Z, 1, 6, 4, 2, 64, F32),
    Case(3, True, C, 1, 5, 2, 1, 16, BF16),
    Case(4, True, C, 1, 1, 2, 2, 16, F32),
    Case(4, False, C, 1, 3, 4, 1, 64, F32),
    Case(4, True, Z, 2, 6, 4, 2, 80, F32),
    Case(4, True, Z, 1, 10, 4, 4, 16, BF16),
    Case(4, False, Z, 1, 2, 2, 1, 128, F16),
    Case(4, True, C, 1, 17, 4, 2, 128, F16, False),
    Case(4, True, Z, 1, 24, 4, 1, 64, BF16),
    Case(4, False, C, 2, 10, 2, 2, 80, BF16),
    Case(4, True, C, 1, 6, 4, 4, 64, F16),
    Case(4, True, Z, 1, 4, 4, 2, 16, F32, False, scale=2.0),
]

GRAD_CASES = [
    Case(1, True, C, 1, 10, 4, 2, 64, F32),
    Case(2, True, Z, 1, 6, 4, 2, 64, F32),
    Case(2, False, C, 2, 5, 4, 1, 80, BF16),
    Case(2, True, Z, 1, 4, 4, 2, 16, BF16),
    Case(3, True, C, 1, 3, 2, 2, 16, F32),
    Case(4, True, Z, 1, 6, 4, 2, 16, F32),
    Case(4, True, C, 1, 3, 4, 4, 128, F16),  # rank 0 sees only masked blocks after step 0
    Case(4, False, C, 1, 2, 4, 1, 16, F64),
]


# ---------------------------------------------------------------- helpers (run in workers and here)

def _global_inputs(case: Case):
    """q, k, v, dout over the whole global sequence, float64 numpy, rounded to the case's dtype."""
    return testing.random_inputs(case.seed, case.batch, case.seq_local * case.world, case.heads, case.kv_heads,
                                 case.head_dim, case.dtype, with_dout=True)


def _shard(x, case: Case, rank: int, requires_grad=False):
    """This rank's shard (layout order) of a global float64 array, as a tensor of the case's dtype."""
    t = torch_bridge.to_layout(torch.from_numpy(x).to(DTYPES[case.dtype]), case.layout, case.world)
    t = t.chunk(case.world, dim=1)[rank].contiguous()
    return t.requires_grad_(requires_grad)


def _np(t):
    return t.detach().to(torch.float64).numpy()


def _gather(shards, case: Case, seq_axis=1):
    """Concatenate per-rank shards along the sequence and put them back in natural order."""
    x = torch.from_numpy(np.concatenate(shards, axis=seq_axis))
    return torch_bridge.from_layout(x, case.layout, case.world, seq_axis=seq_axis).numpy()


def _call(case, q, k, v, **kw):
    kw.setdefault("return_lse", case.return_lse)
    return torch_bridge.ring_attention(q, k, v, is_causal=case.is_causal, layout=case.layout, scale=case.scale,
                                       backend="torch", **kw)


def _forward_task(rank, world, case: Case):
    assert world == case.world
    q, k, v, _ = _global_inputs(case)
    res = _call(case, *(_shard(x, case, rank) for x in (q, k, v)))
    out, lse = res if case.return_lse else (res, None)
    assert out.dtype == DTYPES[case.dtype] and out.shape == (case.batch, case.seq_local, case.heads, case.head_dim)
    if lse is not None:
        assert lse.dtype == (torch.float64 if case.dtype == F64 else torch.float32)
        assert lse.shape == (case.batch, case.heads, case.seq_local)
    return _np(out), None if lse is None else _np(lse)


def _grad_task(rank, world, case: Case):
    q, k, v, dout = _global_inputs(case)
    ql, kl, vl = (_shard(x, case, rank, requires_grad=True) for x in (q, k, v))
    out = _call(case, ql, kl, vl, return_lse=False)
    (out.double() * _shard(dout, case, rank).double()).sum().backward()
    return [_np(t.grad) for t in (ql, kl, vl)]


def _run(torch_group, case: Case, fn, *args):
    if case.world == 1:  # in this process, torch.distributed not initialised
        return [fn(0, 1, case, *args)]
    return torch_group(case.world).run(fn, case, *args)


# ---------------------------------------------------------------- numerics

@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: c.id)
def test_forward(torch_group, case):
    res = _run(torch_group, case, _forward_task)
    out = _gather([r[0] for r in res], case)
    lse = _gather([r[1] for r in res], case, seq_axis=2) if case.return_lse else None
    q, k, v, _ = _global_inputs(case)
    testing.check_attention(case.id, out, lse, q, k, v, case.dtype, is_causal=case.is_causal, scale=case.scale)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_grad(torch_group, case):
    res = _run(torch_group, case, _grad_task)
    grads = [_gather([r[i] for r in res], case) for i in range(3)]
    q, k, v, dout = _global_inputs(case)
    testing.check_grads(case.id, grads, q, k, v, dout, case.dtype, is_causal=case.is_causal, scale=case.scale)


def _lse_grad_task(rank, world, case: Case):
    """Gradients of a loss using both out and lse, against dense float64 torch autograd on the full sequence."""
    q, k, v, dout = _global_inputs(case)
    dlse = np.random.default_rng(1).standard_normal((case.batch, case.heads, case.seq_local * world))
    ql, kl, vl = (_shard(x, case, rank, requires_grad=True) for x in (q, k, v))
    dlse_l = torch_bridge.to_layout(torch.from_numpy(dlse), case.layout, world, seq_axis=2).chunk(world, 2)[rank]
    out, lse = _call(case, ql, kl, vl, return_lse=True)
    ((out * _shard(dout, case, rank)).sum() + (lse * dlse_l).sum()).backward()
    ring = [_np(t.grad) for t in (ql, kl, vl)]

    qg, kg, vg = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    rep = case.heads // case.kv_heads
    kr, vr = kg.repeat_interleave(rep, 2), vg.repeat_interleave(rep, 2)  # fine in a test reference
    sc = torch.einsum("bqhd,bshd->bhqs", qg, kr) / math.sqrt(case.head_dim)
    if case.is_causal:
        n = sc.shape[-1]
        sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    dense_lse = torch.logsumexp(sc, -1)
    dense_out = torch.einsum("bhqs,bshd->bqhd", torch.softmax(sc, -1), vr)
    ((dense_out * torch.from_numpy(dout)).sum() + (dense_lse * torch.from_numpy(dlse)).sum()).backward()
    dense = [_np(_shard(t.grad.numpy(), case, rank)) for t in (qg, kg, vg)]
    return ring, dense


@pytest.mark.parametrize("case", [Case(1, True, C, 1, 5, 4, 2, 16, F64), Case(2, True, Z, 1, 6, 4, 2, 16, F64),
                                  Case(4, True, C, 1, 3, 2, 1, 16, F64)], ids=lambda c: c.id)
def test_lse_is_differentiable(torch_group, case):
    for rank, (ring, dense) in enumerate(_run(torch_group, case, _lse_grad_task)):
        for name, a, b in zip("qkv", ring, dense):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"rank {rank} d{name}")


def _partial_grad_task(rank, world, case: Case):
    """autograd.grad for q only (prunes the K/V shifts on every rank) must agree with a full backward."""
    q, k, v, dout = _global_inputs(case)
    ql, kl, vl = (_shard(x, case, rank, requires_grad=True) for x in (q, k, v))
    do = _shard(dout, case, rank)
    (dq_only,) = torch.autograd.grad((_call(case, ql, kl, vl, return_lse=False) * do).sum(), [ql])
    (_call(case, ql, kl, vl, return_lse=False) * do).sum().backward()
    # k/v only, with q not requiring grad at all
    q2 = ql.detach()
    dk_only, dv_only = torch.autograd.grad((_call(case, q2, kl, vl, return_lse=False) * do).sum(), [kl, vl])
    return [_np(x) for x in (dq_only, ql.grad, dk_only, kl.grad, dv_only, vl.grad)]


def test_partial_grads_do_not_deadlock(torch_group):
    case = Case(4, True, C, 1, 3, 4, 2, 16, F32)
    for res in torch_group(4).run(_partial_grad_task, case, timeout=60):
        for a, b in zip(res[::2], res[1::2]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _module_task(rank, world, case: Case):
    q, k, v, _ = _global_inputs(case)
    ql, kl, vl = (_shard(x, case, rank) for x in (q, k, v))
    mod = torch_bridge.RingAttention(is_causal=case.is_causal, layout=case.layout, scale=case.scale,
                                     return_lse=True, backend="torch")
    out_m, lse_m = mod(ql, kl, vl)
    out_f, lse_f = _call(case, ql, kl, vl, return_lse=True)
    out_plain = torch_bridge.RingAttention(is_causal=case.is_causal, layout=case.layout, scale=case.scale)(ql, kl, vl)
    return torch.equal(out_m, out_f) and torch.equal(lse_m, lse_f) and torch.equal(out_plain, out_f)


@pytest.mark.parametrize("world", [1, 2])
def test_module_equals_function(torch_group, world):
    case = Case(world, True, Z, 1, 6, 4, 2, 16, F32, scale=0.5)
    assert all(_run(torch_group, case, _module_task))


def _compile_task(rank, world, case: Case):
    """torch.compile(fullgraph=True) over a layer around the torch ring: one graph with the W-1 exchanges as
    ring_attention::shift ops; out and the gradients bit-identical to eager; opcheck of the shift op (its
    checks run the exchange, alike on every rank)."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    q, k, v, dout = _global_inputs(case)
    do = _shard(dout, case, rank)

    def f(q, k, v):
        return _call(case, q * 2, k, v, return_lse=False).relu()

    def run(g):
        ql, kl, vl = (_shard(x, case, rank, requires_grad=True) for x in (q, k, v))
        out = g(ql, kl, vl)
        out.backward(do)
        return [out.detach()] + [x.grad for x in (ql, kl, vl)]

    shifts = []

    def count(gm, example_inputs):
        shifts.append(sum(n.target == torch.ops.ring_attention.shift.default for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    want = run(f)
    got = run(torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=count, bw_compiler=count)))
    x = _shard(k, case, rank, requires_grad=True)
    torch.library.opcheck(torch.ops.ring_attention.shift.default, ([x], (rank + 1) % world, (rank - 1) % world, ""))
    torch._dynamo.reset()
    return all(torch.equal(a, b) for a, b in zip(want, got)), shifts


def test_compile(torch_group):
    """torch.compile over backend='torch': dynamo cannot trace batch_isend_irecv, so each exchange is the
    custom op ring_attention::shift, and the ring compiles whole (fullgraph=True), forward and backward."""
    case = Case(2, True, Z, 1, 4, 4, 2, 16, F32)
    for same, shifts in _run(torch_group, case, _compile_task):
        assert same, "compiled differs from eager"
        assert shifts == [case.world - 1] * 2, shifts  # forward graph, backward graph


def _double_backward_task(rank, world):
    from torch_bridge.reference import ring_shift

    x = (torch.arange(4.0) + 10 * rank).requires_grad_()
    y = ring_shift(x, (rank + 1) % world, (rank - 1) % world)
    (g,) = torch.autograd.grad((y ** 3).sum(), x, create_graph=True)  # 3 y^2, sent back to x's rank
    (h,) = torch.autograd.grad(g.sum(), x)  # the gradient of sum(3 x^2): 6 x
    return torch.equal(y, (torch.arange(4.0) + 10 * ((rank - 1) % world))), torch.equal(h, 6 * x.detach())


def test_shift_double_backward(torch_group):
    """The shift's backward is the shift op again, so a second derivative through it works."""
    assert torch_group(2).run(_double_backward_task) == [(True, True)] * 2


def test_module_repr_and_early_checks():
    m = torch_bridge.RingAttention(is_causal=True, layout="zigzag")
    assert "zigzag" in repr(m) and "is_causal=True" in repr(m) and "deterministic=False" in repr(m)
    with pytest.raises(ValueError, match="layout must be one of"):
        torch_bridge.RingAttention(layout="striped")
    with pytest.raises(ValueError, match="backend must be one of"):
        torch_bridge.RingAttention(backend="xla")
    with pytest.raises(TypeError, match="deterministic must be a Python bool, got str 'True'"):
        torch_bridge.RingAttention(deterministic="True")


# ---------------------------------------------------------------- layouts

@pytest.mark.parametrize("layout", [C, Z])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_round_trip(layout, world):
    x = torch.randn(2, 4 * world, 3)
    for axis in (1, -2):
        y = torch_bridge.to_layout(x, layout, world, seq_axis=axis)
        assert torch.equal(torch_bridge.from_layout(y, layout, world, seq_axis=axis), x)
    pos = torch_bridge.to_layout(torch.arange(4 * world), layout, world, seq_axis=0).chunk(world)
    for r in range(world):  # shard r of the reordered sequence holds exactly rank r's global tokens
        assert pos[r].tolist() == global_positions(np, r, world, 4, layout).tolist()
    z = torch.randn(4 * world, 5)
    assert torch.equal(torch_bridge.from_layout(torch_bridge.to_layout(z, layout, world, 0), layout, world, 0), z)


def test_layout_errors():
    with pytest.raises(ValueError, match="2\\*world_size"):
        torch_bridge.to_layout(torch.zeros(1, 6), "zigzag", 2)
    with pytest.raises(ValueError, match="not divisible"):
        torch_bridge.to_layout(torch.zeros(1, 5), "contiguous", 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        torch_bridge.from_layout(torch.zeros(1, 4), "ring", 2)
    with pytest.raises(ValueError, match="seq_axis"):
        torch_bridge.to_layout(torch.zeros(1, 4), "contiguous", 2, seq_axis=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        torch_bridge.to_layout(np.zeros((1, 4)), "contiguous", 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        torch_bridge.to_layout(torch.zeros(1, 4), "contiguous", 0)


# ---------------------------------------------------------------- bad input
# The table of bad inputs (both frontends and the simulator) is tests/cpu/test_bad_inputs.py.

Q, KV = (1, 4, 4, 16), (1, 4, 2, 16)


def test_scale_accepts_numbers_and_backend_auto():
    q, kv = torch.randn(*Q), torch.randn(*KV)
    ref = torch_bridge.ring_attention(q, kv, kv, scale=0.25, backend="torch")
    assert torch.equal(torch_bridge.ring_attention(q, kv, kv, scale=np.float32(0.25)), ref)
    assert torch.equal(torch_bridge.ring_attention(q, kv, kv, scale=torch.tensor(0.25)), ref)
    assert torch.equal(torch_bridge.ring_attention(q, kv, kv, scale=1 / 4), ref)


def _bad_input_task(rank, world):
    """Every rank passes bad input: all raise before communicating, and the group stays usable."""
    q, kv = torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 3, 16)
    try:
        torch_bridge.ring_attention(q, kv, kv)
    except ValueError as e:
        caught = str(e)
    else:
        caught = None
    # non-member of a sub-group: new_group is collective, so every rank creates it
    sub = torch.distributed.new_group([0])
    try:
        torch_bridge.ring_attention(q, torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16), group=sub)
        member_err = None
    except ValueError as e:
        member_err = str(e)
    return caught, member_err


def test_bad_input_in_group_raises_before_communication(torch_group):
    res = torch_group(2).run(_bad_input_task, timeout=60)
    assert all("multiple of num_kv_heads" in r[0] for r in res)
    assert res[0][1] is None and "not a member" in res[1][1]
    test_forward(torch_group, Case(2, True, C, 1, 3, 2, 2, 16, F32))  # the group still works


def _subgroup_task(rank, world, case: Case):
    """Ring over global ranks 1 and 2 of a 3-process world (group ranks 0 and 1); rank 0 stays idle."""
    sub = torch.distributed.new_group([1, 2])
    if rank == 0:
        return None
    grank = torch.distributed.get_rank(sub)
    assert grank == rank - 1
    q, k, v, _ = _global_inputs(case)
    out, lse = _call(case, *(_shard(x, case, grank) for x in (q, k, v)), group=sub)
    return grank, _np(out), _np(lse)


def test_subgroup_translates_ranks(torch_group):
    case = Case(2, True, Z, 1, 4, 4, 2, 16, F32)
    res = sorted(r for r in torch_group(3).run(_subgroup_task, case, timeout=60) if r is not None)
    out = _gather([r[1] for r in res], case)
    lse = _gather([r[2] for r in res], case, seq_axis=2)
    q, k, v, _ = _global_inputs(case)
    testing.check_attention("subgroup", out, lse, q, k, v, F32, is_causal=True)


def test_import_does_not_pull_jax():
    code = ("import sys, torch_bridge, torch_bridge.procs, torch_bridge.reference; "
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'jax_ring'))]; "
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ---------------------------------------------------------------- LocalGroup

def _echo(rank, world, x):
    return rank, world, x


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")
    return rank


def _sleep(rank, world, seconds):
    time.sleep(seconds)


def _die(rank, world):
    os._exit(3)


def test_local_group_runs_and_propagates_errors(torch_group):
    g = torch_group(2)
    assert g.run(_echo, "x") == [(0, 2, "x"), (1, 2, "x")]
    assert g.run_each(_echo, [("a",), ("b",)]) == [(0, 2, "a"), (1, 2, "b")]
    with pytest.raises(WorkerError, match="boom on rank 1") as info:
        g.run(_fail_on_rank_1)
    assert "Traceback" in str(info.value) and "_fail_on_rank_1" in str(info.value)
    assert not g.closed and g.run(_echo, 1)[1] == (1, 2, 1)  # every rank answered: still usable
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        g.run(lambda rank, world: rank)
    with pytest.raises(ValueError, match="args_per_rank"):
        g.run_each(_echo, [(1,)])


def test_local_group_hung_and_dead_workers():
    with LocalGroup(1, timeout=1.0) as g:
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="no result within"):
            g.run(_sleep, 60)
        assert time.monotonic() - t < 10 and g.closed
        with pytest.raises(RuntimeError, match="closed"):
            g.run(_echo, 0)
    with LocalGroup(1) as g:
        with pytest.raises(WorkerError, match="exit code 3"):
            g.run(_die)
        assert g.closed
