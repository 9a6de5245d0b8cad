"""Parity: the same numpy inputs through jax_ring (xla ring, simulated CPU devices) and torch_bridge (torch
ring, gloo processes) agree within the tolerance table, for outputs, lse and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ring
from ring_core import reference, testing
from test_torch_reference import C, Z, Case, _forward_task, _gather, _global_inputs, _grad_task, _run

AX = "sp"
JDT = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}

CASES = [
    Case(2, True, Z, 1, 12, 4, 2, 64, "bfloat16"),
    Case(4, True, C, 2, 5, 4, 1, 80, "float16"),
    Case(2, False, C, 1, 9, 2, 2, 128, "float32"),
    Case(1, True, C, 1, 17, 4, 4, 16, "bfloat16"),
    Case(4, True, Z, 1, 6, 6, 3, 40, "float32", scale=0.5),
]
GRAD_CASES = [Case(2, True, Z, 1, 8, 4, 2, 32, "float32"), Case(4, True, C, 1, 3, 2, 1, 16, "bfloat16")]


def _jax_fn(case, mesh, grad):
    def fwd(q, k, v):
        return jax_ring.ring_attention(q, k, v, axis_name=AX, is_causal=case.is_causal, layout=case.layout,
                                       scale=case.scale, return_lse=True, backend="xla")

    if not grad:
        return jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(P(None, AX),) * 3,
                                     out_specs=(P(None, AX), P(None, None, AX))))

    def loss(q, k, v, do):
        return jnp.sum(fwd(q, k, v)[0].astype(jnp.float32) * do)

    return jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(P(None, AX),) * 4,
                                 out_specs=(P(None, AX),) * 3))


def _to_jax(x, case):
    return jnp.asarray(jax_ring.to_layout(x, case.layout, case.world), dtype=JDT[case.dtype])


def _from_jax(x, case, seq_axis=1):
    return jax_ring.from_layout(np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64), case.layout,
                                case.world, seq_axis=seq_axis)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_parity(cpu_mesh, torch_group, case):
    q, k, v, _ = _global_inputs(case)
    out_j, lse_j = _jax_fn(case, cpu_mesh(case.world, AX), grad=False)(*(_to_jax(x, case) for x in (q, k, v)))
    out_j, lse_j = _from_jax(out_j, case), _from_jax(lse_j, case, seq_axis=2)
    res = _run(torch_group, case, _forward_task)
    out_t = _gather([r[0] for r in res], case)
    lse_t = _gather([r[1] for r in res], case, seq_axis=2)
    o64, l64 = reference.attention(q, k, v, is_causal=case.is_causal, scale=case.scale)
    olp, llp = reference.attention_lowp(q, k, v, case.dtype, is_causal=case.is_causal, scale=case.scale)
    testing.check_pair("out jax vs torch", out_j, out_t, o64, olp, case.dtype, "out")
    testing.check_pair("lse jax vs torch", lse_j, lse_t, l64, llp, case.dtype, "lse")
    for name, out in (("jax", out_j), ("torch", out_t)):
        testing.check(f"{name} out", out, o64, olp, case.dtype)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_gradient_parity(cpu_mesh, torch_group, case):
    q, k, v, do = _global_inputs(case)
    gj = _jax_fn(case, cpu_mesh(case.world, AX), grad=True)(*(_to_jax(x, case) for x in (q, k, v)),
                                                           _to_jax(do, case).astype(jnp.float32))
    gj = [_from_jax(g, case) for g in gj]
    res = _run(torch_group, case, _grad_task)
    gt = [_gather([r[i] for r in res], case) for i in range(3)]
    ref = reference.attention_grad(q, k, v, do, is_causal=case.is_causal, scale=case.scale)
    low = reference.attention_grad_lowp(q, k, v, do, case.dtype, is_causal=case.is_causal, scale=case.scale)
    for n, a, b, r, l in zip("qkv", gj, gt, ref, low):
        testing.check_pair(f"d{n} jax vs torch", a, b, r, l, case.dtype, "grad")
