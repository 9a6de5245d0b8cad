"""backend='fused' for JAX, the raw ops: the shared kernels (ring_core.kernels.tl_fwd, ring_core.kernels.tl_bwd) as XLA
custom calls (``forward``, ``backward``; jax_ring._triton_call: compiled by ring_core.runtime.build, launched by
jaxlib's Triton custom call); the autograd layer that calls them is in jax_ring.api. The twin of torch_bridge.fused.

Per-rank values (this rank's position in its ring, the heap bases of the ring's members as mapped in its
process) reach the kernel as an on-device array: a program baked with per-process constants would differ
between processes, which multi-controller JAX cannot compile (it waits forever). So every process bakes the
same table, one row per device of the mesh, and each device picks its own row with its mesh position
(``lax.axis_index`` of every mesh axis). The table is built where the concrete mesh is known, when the
program is lowered (``ring_ctx_p``): a ring is the devices along ``axis_name`` at one position of the other
mesh axes (a ``("dp", "sp")`` mesh has one ring per dp index), each device in its own process; every ring
gets a slot of the heap (ring_core.runtime.heap.RingSlots), assigned alike in every process.

Under shard_map's default check_vma, the kernels' outputs are typed like values computed from their inputs
(varying along the inputs' axes and the ring's axis): the custom call types them as the same on every device.
"""

from __future__ import annotations

import warnings

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

from jax_ring import _platform
from jax_ring import status as _status
from ring_core.runtime import heap as _heap
from ring_core.protocol import control
from ring_core import validate

try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - older JAX
    from jax.core import Primitive


def fused_available() -> bool:
    if not _heap.is_initialized():
        return False
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def _kernel_call():
    """The custom call that launches a kernel (jax_ring._triton_call.triton_call: our lowering onto jaxlib's
    Triton custom call); imported when first used, since it needs a GPU build of JAX."""
    from jax_ring import _triton_call

    return _triton_call.triton_call


def _raise_status(words, ring_size: int, timeout_s):
    """Host callback: raise the failure in the status words, naming ranks by their global ranks (from the ring's
    members, which the context row carries after what the kernel reads). ``words``: the status, then the context
    row, in one array: a callback pays a fixed cost per operand it copies to the host (docs/performance.md)."""
    words = np.asarray(words)
    status, row = words[:control.STATUS_WORDS], words[control.STATUS_WORDS:].view(np.int64)
    control.check_status(status, int(row[ring_size]), timeout_s, members=row[ring_size + 4:2 * ring_size + 4])


def errors_mode() -> str:
    """How a fused call traced now reports a failure (ring_core.protocol.control.errors_mode; JAX's default "deferred"):
    "deferred": its status is checked by jax_ring.status (copied to the host without a sync, raised by a later
    fused call on this process or by ``jax_ring.check_errors()``), and the kernel also keeps it on the heap;
    "call": jax_ring.status waits for the call's own status and fails the call's program with it (a host sync
    per call)."""
    return control.errors_mode()


# ---------------------------------------------------------------------------- the ring's context row
_process_ranks = {}  # JAX process index -> global rank of the heap (jax_ring.initialize fills it)


def set_process_ranks(mapping: dict) -> None:
    _process_ranks.clear()
    _process_ranks.update(mapping)


def _device_rank(device) -> int:
    """The global rank (of the heap's job) of the process that owns ``device``."""
    return _process_ranks.get(device.process_index, device.process_index)


def ring_table(h, mesh, axis_name, ring_size: int | None = None) -> np.ndarray:
    """[devices of ``mesh``, n] int32: row i is the context of the device ``mesh.devices.flat[i]`` for the
    ring along ``axis_name`` through it (``h.ctx_row``: heap bases as mapped in its process, its position in
    the ring, its ring's slot, then the ring's global ranks). Registers every ring of the axis (in the same
    order in every process, so every process assigns the same slots). ``ring_size`` shorter than the axis: the
    rings are the axis's consecutive blocks of that many devices (the two-level ring's node rings,
    jax_ring.nodes), each of which must lie within one node."""
    devices = np.asarray(mesh.devices)
    names = list(mesh.axis_names)
    ax = names.index(axis_name)
    ring_size = ring_size or devices.shape[ax]
    ranks = np.vectorize(_device_rank, otypes=[np.int64])(devices)
    if len(set(ranks.flat)) != ranks.size:
        raise ValueError(f"the fused backend needs one device per process in the mesh ({dict(mesh.shape)}), "
                         "each process's own GPU (jax_ring.initialize gives each process one); use backend='xla'")
    rings = np.moveaxis(ranks, ax, -1).reshape(-1, ring_size)
    for members in rings:
        h.rings.assign("jax", members)
    rows = []
    for pos in range(devices.size):
        coords = np.unravel_index(pos, devices.shape)
        first = coords[ax] // ring_size * ring_size
        members = ranks[coords[:ax] + (slice(first, first + ring_size),) + coords[ax + 1:]]
        slot = h.rings.get("jax", members)
        rows.append(np.concatenate([h.ctx_row(int(ranks[coords]), members, slot), members.astype(np.int64)]))
    return np.stack(rows).view(np.int32)


def _ring_ctx_abstract(pos, *, axis_name, ring_size):
    # Varies along every mesh axis, as ``pos`` does: each device has its own row.
    return pos.update(shape=(2 * (2 * ring_size + 4),), dtype=jnp.dtype(jnp.int32))


def _lowering_mesh(ctx):
    """The concrete mesh the program is lowered on. A shard_map over an abstract mesh (the mesh a traced input
    carries under jax.jit) takes the mesh set with ``jax.set_mesh``, as JAX's own shard_map lowering does; without
    one, which process holds which mesh position is not known here, so the ring cannot be built."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None:
        raise ValueError("the fused backend must run inside jax.shard_map over a mesh of devices (the program is "
                         "lowered without one)")
    if isinstance(mesh, jax.sharding.AbstractMesh):
        concrete = _platform.concrete_mesh()
        if concrete is None or concrete.abstract_mesh.shape_tuple != mesh.shape_tuple:
            raise ValueError(
                f"the fused backend needs the devices of the mesh it runs on, and this program knows only an abstract "
                f"mesh {dict(mesh.shape)} (under jax.jit an input's sharding carries no devices): set the mesh with "
                "jax.set_mesh(mesh) around the jitted call (or for the program), or pass mesh=mesh to "
                "jax_ring.dot_product_attention / jax_ring.flax.ring_attention_fn, or give jax.shard_map the Mesh "
                "itself")
        mesh = concrete
    return mesh


def local_ring(ctx, axis_name, ring_size: int):
    """(position in its ring, the ring's global ranks, the whole ring table) of this process's device, for a
    lowering inside shard_map (jax_ring.status names a failure's ranks with them)."""
    mesh = _lowering_mesh(ctx)
    table = ring_table(_heap.get(), mesh, axis_name, ring_size)
    mine = [i for i, d in enumerate(np.asarray(mesh.devices).flat) if d.process_index == jax.process_index()]
    if len(mine) != 1:
        raise ValueError(f"the fused backend needs exactly one device of this process in the mesh, found {len(mine)}")
    row = table[mine[0]].view(np.int64)
    return int(row[ring_size]), row[ring_size + 4:2 * ring_size + 4].copy(), table


_status.ring_of = lambda ctx, axis_name, ring_size: local_ring(ctx, axis_name, ring_size)


def _ring_ctx_lowering(ctx, pos, *, axis_name, ring_size):
    table = ring_table(_heap.get(), _lowering_mesh(ctx), axis_name, ring_size)
    row = lambda i: lax.dynamic_index_in_dim(jnp.asarray(table), i, axis=0, keepdims=False)  # noqa: E731
    return mlir.lower_fun(row, multiple_results=False)(ctx, pos)


# This device's context row, from its mesh position; the table is made when the program is lowered, where
# the mesh's devices (hence each device's process and ring) are known.
ring_ctx_p = Primitive("ring_attention_context")
ring_ctx_p.def_abstract_eval(_ring_ctx_abstract)
mlir.register_lowering(ring_ctx_p, _ring_ctx_lowering)


def _launch_context(spec, axis_name, world_size: int, *, backward: bool, deterministic: bool = False):
    """(launch plan, this device's context row) for a fused launch inside shard_map; ``deterministic`` for the
    backward's plan."""
    h = _heap.get()
    # HeapTooSmallError at trace time
    p = h.plan_bwd(spec, world_size, deterministic=deterministic) if backward else h.plan(spec, world_size)
    ctx = ring_ctx_p.bind(_platform.mesh_position(), axis_name=axis_name, ring_size=world_size)
    return p, ctx


def _scalars(p, timeout_s):
    """The plan's runtime scalars; fp32 ones as numpy float32, so that they read as scalars of that type
    wherever they go (the custom call takes their Triton types from the plan, ``scalar_types``)."""
    return [np.float32(v) if t == "fp32" else v for v, t in zip(p.scalars(timeout_s), p.scalar_types)]


def _segment_ids(spec, segment_ids):
    """What the kernels get as ``seg_ptr``: this rank's segment ids (int32 [batch, seq_local], layout order; with
    ``spec.kv_ids`` [2, batch, seq_local], the queries' then the keys') when ``spec.segmented``, else a one-element
    dummy that the kernels never read (SEGMENTED=False)."""
    validate.check_segment_ids_given(spec, segment_ids is not None, None if segment_ids is None else segment_ids.shape)
    if segment_ids is None:
        return jnp.zeros((1,), jnp.int32)
    return segment_ids.astype(jnp.int32)


def _out_shapes(p):
    """The launch's outputs (ring_core.plans.LaunchPlan.out_shapes), the last one the status (zeroed_outputs)."""
    return [jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for shape, dt in p.out_shapes]


def _typed_like(outs, inputs, axis_name):
    """The kernel's outputs typed as computed from ``inputs`` over the ring: varying along every axis an
    input varies along, and along the ring's axis (see the module docstring)."""
    axes = {axis_name}.union(*(_platform.varying_axes(x) for x in inputs))
    return [_platform.vary(o, axes) for o in outs]


def _launch(name: str, inputs, spec, axis_name, world_size: int, timeout_s, *, backward: bool,
            deterministic: bool = False):
    """One fused launch inside shard_map: the inputs, this device's context row and the plan's scalars in
    the kernel's argument order (ring_core.plans); the outputs (the status last, zeroed: the kernel's last
    program writes it), checked as ``errors_mode()`` says."""
    call = _kernel_call()
    p, ctx = _launch_context(spec, axis_name, world_size, backward=backward, deterministic=deterministic)
    check = _check_of(errors_mode())
    *outs, status = call(
        *inputs, ctx, *_scalars(p, timeout_s), kernel=p.kernel(), out_shape=_out_shapes(p), grid=p.grid,
        num_warps=p.config.num_warps, num_stages=p.config.num_stages, scalar_types=p.scalar_types,
        zeroed_outputs=(len(p.out_shapes) - 1,), name=name, **p.constexprs(sticky_errors=check is None))
    if check in ("status", "now"):
        _status.check(status, axis_name, world_size, timeout_s, now=check == "now")
    elif check == "callback":
        jax.debug.callback(_raise_status, jnp.concatenate([status, ctx]), world_size, timeout_s)
    return outs


def error_check() -> tuple:
    """What decides how a launch traced now is checked (``errors_mode()``, and whether the check is left out):
    hashable, for the caches of traced programs (jax_ring.api)."""
    return errors_mode(), _status.is_left_out()


def _check_of(mode: str):
    """How a launch traced now is checked: "status" (jax_ring.status, mode "deferred"), "now" (jax_ring.status
    waiting for this call's status, mode "call"), "callback" (a host callback: where XLA would not take the status
    check's handler, said once), or None (the check left out, ``jax_ring.status.left_out()``: the kernel keeps a
    failure on the heap for ``check_errors()`` instead).

    Why mode "call" is not a host callback where the handler exists: a failed ``jax.debug.callback`` fails the
    program's runtime token, not its outputs, so the call does not raise by itself on a GPU (only
    ``jax.effects_barrier()`` raises it), and JAX keeps that failed token (its ``RuntimeTokenSet.block_until_ready``
    raises before it clears): every later ``effects_barrier()`` raised the same failure again until another program
    with host callbacks ran (seen on an H200, jax 0.11.2: tests/gpu/gpu_faults.py's mismatch section). The status
    handler's error fails the program's outputs, like any XLA error, and leaves no token behind."""
    if mode == "deferred" and _status.is_left_out():
        return None
    err = _status.register(jax.default_backend())
    if err is not None:
        warnings.warn(f"jax_ring: RING_ATTENTION_ERRORS={mode} needs the status check's XLA handler, which could not "
                      f"be registered ({err}); fused calls are checked by a host callback instead (a host round "
                      f"trip per call; a failure is raised by jax.effects_barrier())", RuntimeWarning, stacklevel=4)
        return "callback"
    return "now" if mode == "call" else "status"


def forward(q, k, v, spec, axis_name, world_size: int, timeout_s: float | None = None, segment_ids=None):
    """Run the fused kernel on this rank's shards inside shard_map; returns (out, lse). ``segment_ids``: this
    rank's ids (int32 [batch, seq_local], layout order; [2, ...] with ``spec.kv_ids``, the keys' after the
    queries') when ``spec.segmented``, else None; the window is ``spec.window``."""
    out, lse = _launch("ring_attn_fwd", (q, k, v, _segment_ids(spec, segment_ids)), spec, axis_name, world_size,
                       timeout_s, backward=False)
    return tuple(_typed_like((out, lse), (q, k, v), axis_name))


def backward(q, k, v, out, lse, dout, dlse, spec, axis_name, world_size: int, timeout_s: float | None = None,
             segment_ids=None, deterministic: bool = False):
    """Run the fused backward kernel (ring_core.kernels.tl_bwd, or ring_core.kernels.gluon_bwd) on this rank's shards
    inside shard_map, from the forward's ``out`` and ``lse`` and the cotangents ``dout`` and ``dlse``; returns (dq, dk,
    dv), typed as q, k and v. Same context row, launch maths (ring_core.plans.plan_bwd) and argument list as the torch
    launcher (torch_bridge.fused.backward). ``segment_ids`` as in ``forward`` (no gradient: ids are ints).
    ``deterministic``: as jax_ring.ring_attention's (XLA_FLAGS=--xla_gpu_deterministic_ops=true, read now, turns it on
    too); it picks the backward's kernel (ring_core.plans.BwdKernelConfig.get_default)."""
    deterministic = validate.check_deterministic(deterministic, _platform.xla_deterministic_ops())
    dq, dk, dv, _ = _launch("ring_attn_bwd",
                            (q, k, v, out, dout, lse, dlse.astype(jnp.float32), _segment_ids(spec, segment_ids)),
                            spec, axis_name, world_size, timeout_s, backward=True,
                            deterministic=deterministic)  # _: delta, scratch
    return tuple(_platform.vary(g, _platform.varying_axes(x)) for g, x in ((dq, q), (dk, k), (dv, v)))
