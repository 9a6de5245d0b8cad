"""backend='fused' for JAX: the shared kernels (ring_core.kernel, ring_core.kernel_bwd) as jax-triton custom calls.

Per-rank values (this rank's position, the heap bases as mapped in its process) reach the kernel as an
on-device array: every process holds the same table of all ranks' context arrays (a program baked with
per-process constants would differ between processes, which multi-controller JAX cannot compile: it
waits forever), and the row is picked with ``lax.axis_index(axis_name)`` inside shard_map, so no per-rank
Python scalar is baked into the compiled call. The mesh axis must list devices in process order (as
``jax.make_mesh`` / ``Mesh(jax.devices())`` do): ring position i is process i.
"""

from __future__ import annotations

import os

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from ring_core import heap as _heap
from ring_core import launch


def fused_available() -> bool:
    if not _heap.is_initialized():
        return False
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def _import_jax_triton():
    """Import jax_triton without its side effect on the process: at import it sets TRITON_CACHE_DIR to "",
    after which every later Triton compile outside jax-triton (the torch frontend's launches) fails with
    "Could not create or locate cache dir"."""
    before = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ImportError as e:  # jax-triton refuses to import without GPU support in JAX
        raise RuntimeError(f"backend='fused' needs jax-triton with a GPU build of JAX: {e}") from None
    finally:
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before
    return jax_triton


def _forget_compiled_programs():
    """Release hook (ring_core.heap.on_release): a program traced with the fused backend baked the heap's
    addresses into its constants (the context table), so after shutdown() running it again would write into
    released memory. Clearing JAX's caches makes the next call trace again, which raises without a heap and
    otherwise takes the new heap's addresses."""
    from jax_ring import api

    jax.clear_caches()
    api._sharded_fn.cache_clear()


def _raise_status(status, rank, timeout_s):
    launch.check_status(np.asarray(status), int(rank), timeout_s)


ERRORS_ENV = "RING_ATTENTION_JAX_ERRORS"


def errors_deferred() -> bool:
    """How a fused call traced now reports a failure (read at trace time, from RING_ATTENTION_JAX_ERRORS):
    "call" (default): a host callback after every call raises from the call; "deferred": no callback (it
    costs 0.1-0.9 ms a call): the kernel keeps the first failure on the heap, ``jax_ring.check_errors()``
    raises it, and the outputs a failed call could not compute are NaN meanwhile."""
    mode = os.environ.get(ERRORS_ENV, "call")
    if mode not in ("call", "deferred"):
        raise ValueError(f"{ERRORS_ENV} must be 'call' or 'deferred', got {mode!r}")
    return mode == "deferred"


def _launch_context(spec, axis_name, world_size: int, *, backward: bool):
    """(launch plan, this rank's index, this rank's context row) for a fused launch inside shard_map."""
    h = _heap.get()
    _heap.on_release(_forget_compiled_programs)  # the table below is baked into the program
    if world_size != h.world_size:
        raise ValueError(f"the mesh axis {axis_name!r} has {world_size} devices but the job has {h.world_size} "
                         "processes; the fused backend shards the sequence over all processes (one GPU each)")
    p = h.plan_bwd(spec) if backward else h.plan(spec)  # HeapTooSmallError at trace time, before anything runs
    table = jnp.asarray(h.ctx_table().view(np.int32))  # [W, 2 * n]; int32 pairs, read as int64 in the kernel
    rank = lax.axis_index(axis_name)
    return p, rank, lax.dynamic_index_in_dim(table, rank, axis=0, keepdims=False)


def forward(q, k, v, spec, axis_name, world_size: int, timeout_s: float | None = None):
    """Run the fused kernel on this rank's shards inside shard_map; returns (out, lse)."""
    jt = _import_jax_triton()
    from ring_core.kernel import ring_attn_fwd_kernel

    p, rank, ctx = _launch_context(spec, axis_name, world_size, backward=False)
    deferred = errors_deferred()
    b, s, hq, d = q.shape
    scal = p.scalars(timeout_s)
    scal = (scal[0], scal[1], np.float32(scal[2]), scal[3])  # float32 scale, as the torch launch passes it
    out, lse, status = jt.triton_call(
        q, k, v, ctx, *scal,
        kernel=ring_attn_fwd_kernel,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, s), jnp.float32),
                   jax.ShapeDtypeStruct((launch.STATUS_WORDS,), jnp.int32)],
        grid=p.grid, num_warps=p.config.num_warps, num_stages=p.config.num_stages,
        zeroed_outputs=(2,),  # status: all zero unless the kernel's last program wrote it (check_status)
        name="ring_attn_fwd", **p.constexprs(interpret=False, sticky_errors=deferred))
    if not deferred:  # else the kernel keeps a failure for jax_ring.check_errors()
        jax.debug.callback(_raise_status, status, rank, timeout_s)
    return out, lse


def backward(q, k, v, out, lse, dout, dlse, spec, axis_name, world_size: int, timeout_s: float | None = None):
    """Run the fused backward kernel (ring_core.kernel_bwd) on this rank's shards inside shard_map, from the
    forward's ``out`` and ``lse`` and the cotangents ``dout`` and ``dlse``; returns (dq, dk, dv). Same
    context-table row, launch maths (ring_core.launch.plan_bwd) and argument list as the torch launcher
    (torch_bridge.fused.backward)."""
    jt = _import_jax_triton()
    from ring_core.kernel_bwd import ring_attn_bwd_kernel

    p, rank, ctx = _launch_context(spec, axis_name, world_size, backward=True)
    deferred = errors_deferred()
    scal = p.scalars(timeout_s)
    scal = (scal[0], scal[1], np.float32(scal[2]), *scal[3:])  # float32 scale, as the torch launch passes it
    dq, dk, dv, _, status = jt.triton_call(
        q, k, v, out, dout, lse, dlse.astype(jnp.float32), ctx, *scal,
        kernel=ring_attn_bwd_kernel,
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for shape, dt in p.out_shapes],
        grid=p.grid, num_warps=p.config.num_warps, num_stages=p.config.num_stages,
        zeroed_outputs=(4,),  # status: all zero unless the kernel's last program wrote it (check_status)
        name="ring_attn_bwd", **p.constexprs(interpret=False, sticky_errors=deferred))
    if not deferred:  # else the kernel keeps a failure for jax_ring.check_errors()
        jax.debug.callback(_raise_status, status, rank, timeout_s)
    return dq, dk, dv


def ring_attention_fused(q, k, v, *, axis_name, spec, world_size: int, return_lse: bool = False,
                         timeout_s: float | None = None):
    """Fused forward; differentiable: the VJP runs the fused backward kernel from the saved q, k, v, out
    and lse, with the cotangents of both out and lse (zeros for lse unless the caller uses it)."""

    @jax.custom_vjp
    def f(q, k, v):
        return forward(q, k, v, spec, axis_name, world_size, timeout_s)

    def f_fwd(q, k, v):
        _heap.get().plan_bwd(spec)  # a heap too small for the backward raises now, before anything runs
        out, lse = forward(q, k, v, spec, axis_name, world_size, timeout_s)
        return (out, lse), (q, k, v, out, lse)

    def f_bwd(res, cts):
        q, k, v, out, lse = res
        dout, dlse = cts
        return backward(q, k, v, out, lse, dout.astype(q.dtype), dlse, spec, axis_name, world_size, timeout_s)

    f.defvjp(f_fwd, f_bwd)
    out, lse = f(q, k, v)
    return (out, lse) if return_lse else out
