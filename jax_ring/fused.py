"""backend='fused' for JAX: the shared kernel (ring_core.kernel) as a jax-triton custom call.

Per-rank values (this rank's position, the heap bases as mapped in its process) reach the kernel as an
on-device array: every process holds the same table of all ranks' context arrays (a program baked with
per-process constants would differ between processes, which multi-controller JAX cannot compile: it
waits forever), and the row is picked with ``lax.axis_index(axis_name)`` inside shard_map, so no per-rank
Python scalar is baked into the compiled call. The mesh axis must list devices in process order (as
``jax.make_mesh`` / ``Mesh(jax.devices())`` do): ring position i is process i.
"""

from __future__ import annotations

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
    import os

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


def _raise_status(status, rank, timeout_s):
    launch.check_status(np.asarray(status), int(rank), timeout_s)


def forward(q, k, v, spec, axis_name, world_size: int, timeout_s: float | None = None):
    """Run the fused kernel on this rank's shards inside shard_map; returns (out, lse)."""
    jt = _import_jax_triton()
    from ring_core.kernel import ring_attn_fwd_kernel

    h = _heap.get()
    if world_size != h.world_size:
        raise ValueError(f"the mesh axis {axis_name!r} has {world_size} devices but the job has {h.world_size} "
                         "processes; the fused backend shards the sequence over all processes (one GPU each)")
    p = h.plan(spec)  # raises HeapTooSmallError at trace time, before anything runs
    table = jnp.asarray(h.ctx_table().view(np.int32))  # [W, 2 * n]; int32 pairs, read as int64 in the kernel
    rank = lax.axis_index(axis_name)
    ctx = lax.dynamic_index_in_dim(table, rank, axis=0, keepdims=False)
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
        name="ring_attn_fwd", **p.constexprs(interpret=False))
    jax.debug.callback(_raise_status, status, rank, timeout_s)
    return out, lse


def ring_attention_fused(q, k, v, *, axis_name, spec, world_size: int, return_lse: bool = False,
                         timeout_s: float | None = None):
    """Fused forward; differentiable. Its VJP currently recomputes through the xla reference ring and
    differentiates that (exact gradients; the fused backward kernel replaces it)."""
    from jax_ring.reference import ring_attention_xla

    @jax.custom_vjp
    def f(q, k, v):
        return forward(q, k, v, spec, axis_name, world_size, timeout_s)

    def f_fwd(q, k, v):
        return f(q, k, v), (q, k, v)

    def f_bwd(res, cts):
        dout, _ = cts  # lse is returned for inspection; it carries no gradient here
        _, vjp = jax.vjp(lambda q, k, v: ring_attention_xla(q, k, v, axis_name=axis_name, spec=spec), *res)
        return vjp(dout.astype(res[0].dtype))

    f.defvjp(f_fwd, f_bwd)
    out, lse = f(q, k, v)
    return (out, lse) if return_lse else out
