"""Public JAX entry points: ``ring_attention`` (inside ``jax.shard_map``), ``ring_attention_sharded`` (global
arrays, wraps the shard_map) and the layout helpers ``to_layout`` / ``from_layout``.

Every user error raises ValueError / TypeError before any work, naming the argument and the fix.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ring_core.layout import LAYOUTS, inverse_permutation, layout_permutation
from ring_core.validate import check_attention_args, check_timeout

from jax_ring import _platform
from jax_ring.reference import ring_attention_xla

JAX_BACKENDS = ("auto", "fused", "xla")


def _fused_available() -> bool:
    """Whether the fused Triton + iris kernel can run here (GPU JAX and ``jax_ring.initialize()`` done)."""
    from jax_ring import fused

    return fused.fused_available()


def _resolve_backend(backend: str, dtype=None) -> str:
    fusable = dtype is None or jnp.dtype(dtype) != jnp.float64
    if backend == "auto":
        return "fused" if fusable and _fused_available() else "xla"
    if backend == "fused":
        if not _fused_available():
            raise RuntimeError(
                "backend='fused' needs NVIDIA GPUs and the symmetric heap: call jax_ring.initialize() once per "
                "process (one process per GPU, started with python -m jax_ring.launch or torchrun) before "
                "using JAX; or use backend='xla'")
        if not fusable:
            raise TypeError("backend='fused' supports float16, bfloat16 and float32; use backend='xla' for float64")
    return backend


def _validate(q, k, v, *, is_causal, scale, layout, backend, return_lse):
    return check_attention_args(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, is_causal=is_causal,
                                scale=scale, layout=layout, backend=backend, backends=JAX_BACKENDS,
                                return_lse=return_lse)


def ring_attention(q, k, v, *, axis_name, is_causal=False, scale=None, layout="contiguous", return_lse=False,
                   backend="auto", timeout_s=None):
    """Exact softmax attention over a sequence sharded along mesh axis ``axis_name``; call inside ``jax.shard_map``.

    Args:
      q: this rank's queries, [batch, seq_local, num_heads, head_dim].
      k, v: this rank's keys / values, [batch, seq_local, num_kv_heads, head_dim]; ``num_heads`` must be a
        multiple of ``num_kv_heads`` (GQA / MQA; K/V heads are never repeated in memory).
      axis_name: the mesh axis that shards the sequence (the world size W is its size). It may be one axis
        of several: each position along the other axes (e.g. each "dp" index of a ("dp", "sp") mesh) runs
        its own ring, all at once.
      is_causal: causal masking in *global* token order, whatever the layout.
      scale: score multiplier, default ``1/sqrt(head_dim)``.
      layout: which global tokens this rank holds: ``"contiguous"`` (rank r: tokens [r*S, (r+1)*S)) or
        ``"zigzag"`` (2W chunks of S/2; rank r holds chunk r then chunk 2W-1-r; S even). Use ``to_layout``
        to put a global array in that order before sharding it.
      return_lse: also return ``lse``, float32 [batch, num_heads, seq_local]: the natural log of the softmax
        denominator over the whole global sequence (scores already multiplied by ``scale``).
      backend: ``"auto"`` (the fused kernel where available, else ``"xla"``), ``"fused"`` (the Triton + iris
        kernel through jax-triton; needs ``jax_ring.initialize()`` on GPUs, one device per process in the mesh;
        its gradients, through out and lse, come from the fused backward kernel; works under shard_map's
        default check_vma; not under jax.vmap) or ``"xla"`` (the pure-JAX reference ring: K/V go round with
        ``lax.ppermute``, float32 maths).
      timeout_s: bound in seconds on every wait inside the fused kernel (default: RING_ATTENTION_TIMEOUT_S
        when traced, else 300); an expired wait raises ``ring_core.control.RingAttentionTimeout`` naming the
        missing rank and ring step. Baked into the compiled program. The xla ring has no waits of its own.
        Ranks whose fused calls differ (shapes, dtype, flags, layout, scale) raise
        ``ring_core.control.RingAttentionMismatch`` naming both calls (found before any data moves).
        With RING_ATTENTION_JAX_ERRORS=deferred (read when tracing) the call does not raise: the failure
        is kept for ``jax_ring.check_errors()`` and what the call could not compute is NaN.

    Returns:
      ``out`` with q's shape and dtype, or ``(out, lse)`` with ``return_lse=True``.

    Example (4 CPU devices)::

        # XLA_FLAGS=--xla_force_host_platform_device_count=4 python example.py
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_ring

        mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
        q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 4, 32))   # global, natural order
        qz, kz, vz = (jax_ring.to_layout(x, "zigzag", 4) for x in (q, k, v))

        def f(q, k, v):
            return jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=True, layout="zigzag")

        # jit it: an eager shard_map dispatches op by op
        out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))(qz, kz, vz)
        out = jax_ring.from_layout(out, "zigzag", 4)                        # back to natural order
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    spec = _validate(q, k, v, is_causal=is_causal, scale=scale, layout=layout, backend=backend,
                     return_lse=return_lse)
    timeout_s = check_timeout(timeout_s)
    backend = _resolve_backend(backend, q.dtype)
    world = _platform.axis_size(axis_name)  # ValueError (how to fix it) outside shard_map / wrong name
    if backend == "xla":
        return ring_attention_xla(q, k, v, axis_name=axis_name, spec=spec, return_lse=return_lse)
    from jax_ring.fused import ring_attention_fused

    return ring_attention_fused(q, k, v, axis_name=axis_name, spec=spec, world_size=world, return_lse=return_lse,
                                timeout_s=timeout_s)


def ring_attention_sharded(q, k, v, *, mesh, axis_name, is_causal=False, scale=None, layout="contiguous",
                           return_lse=False, backend="auto", timeout_s=None):
    """``ring_attention`` on global arrays: shards the sequence over ``mesh`` axis ``axis_name`` and runs the ring.

    ``q``, ``k``, ``v`` are global, [batch, seq_global, heads, head_dim], and must ALREADY be in ``layout``
    order: for ``layout="zigzag"`` pass ``to_layout(x, "zigzag", W)`` and put the result back in natural order
    with ``from_layout(out, "zigzag", W)`` (``lse`` is [batch, heads, seq_global]: use ``seq_axis=2``).
    For ``"contiguous"`` both are the identity. ``seq_global`` must be a multiple of W (2W for zigzag).
    Other keywords as in ``ring_attention``; the shard_map uses in_specs ``P(None, axis_name)``, out_specs
    ``P(None, axis_name)`` for out and ``P(None, None, axis_name)`` for lse.

    Example (2 CPU devices)::

        # XLA_FLAGS=--xla_force_host_platform_device_count=2 python example.py
        import jax, numpy as np
        from jax.sharding import Mesh
        import jax_ring

        mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
        q = jax.random.normal(jax.random.key(0), (2, 32, 8, 64))
        k = v = jax.random.normal(jax.random.key(1), (2, 32, 2, 64))   # GQA: 8 query heads, 2 kv heads
        args = [jax_ring.to_layout(x, "zigzag", 2) for x in (q, k, v)]
        out, lse = jax_ring.ring_attention_sharded(*args, mesh=mesh, axis_name="sp", is_causal=True,
                                                   layout="zigzag", return_lse=True)
        out = jax_ring.from_layout(out, "zigzag", 2)
        lse = jax_ring.from_layout(lse, "zigzag", 2, seq_axis=2)
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    names = tuple(getattr(mesh, "axis_names", ()))
    if axis_name not in names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh (axes {names}); "
                         "pass the name of the mesh axis that should shard the sequence")
    world = int(mesh.shape[axis_name])
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim == 4:
            need = 2 * world if layout == "zigzag" else world
            if x.shape[1] % need:
                raise ValueError(
                    f"{name} has seq_global={x.shape[1]}, not a multiple of {need} "
                    f"({'2*' if layout == 'zigzag' else ''}world_size, world_size={world} on axis {axis_name!r}); "
                    "pad the sequence")
    local = lambda x: (*x.shape[:1], x.shape[1] // world, *x.shape[2:]) if x.ndim == 4 else x.shape
    spec = check_attention_args(local(q), local(k), local(v), q.dtype, k.dtype, v.dtype, is_causal=is_causal,
                                scale=scale, layout=layout, backend=backend, backends=JAX_BACKENDS,
                                return_lse=return_lse)
    timeout_s = check_timeout(timeout_s)
    _resolve_backend(backend, q.dtype)
    # spec.scale: a hashable Python float (the caller may pass a numpy / concrete jax scalar).
    return _sharded_fn(mesh, axis_name, spec.is_causal, spec.scale, layout, return_lse, backend, timeout_s)(q, k, v)


@functools.lru_cache(maxsize=64)
def _sharded_fn(mesh, axis_name, is_causal, scale, layout, return_lse, backend, timeout_s):
    """The jitted shard_map for one configuration (cached: eager shard_map would dispatch op by op)."""

    def body(q, k, v):
        return ring_attention(q, k, v, axis_name=axis_name, is_causal=is_causal, scale=scale, layout=layout,
                              return_lse=return_lse, backend=backend, timeout_s=timeout_s)

    out_specs = (P(None, axis_name), P(None, None, axis_name)) if return_lse else P(None, axis_name)
    return jax.jit(_platform.shard_map(body, mesh=mesh, in_specs=(P(None, axis_name),) * 3, out_specs=out_specs))


def _check_layout_args(x, layout, world_size, seq_axis):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ndim = np.ndim(x)
    if not isinstance(seq_axis, (int, np.integer)) or not -ndim <= seq_axis < ndim:
        raise ValueError(f"seq_axis={seq_axis!r} is out of range for an array of rank {ndim}")
    return int(seq_axis) % ndim


def _take(x, idx, axis):
    if isinstance(x, np.ndarray):
        return np.take(x, idx, axis=axis)
    return jnp.take(jnp.asarray(x), jnp.asarray(idx), axis=axis)


def to_layout(x, layout, world_size, seq_axis=1):
    """Reorder a global array from natural token order into ``layout`` order along ``seq_axis``.

    Sharding the result contiguously over ``world_size`` ranks gives each rank the tokens ``layout`` assigns
    it. numpy in, numpy out; anything else becomes a jax array. ``from_layout`` undoes it.

    >>> import numpy as np
    >>> to_layout(np.arange(8)[None], "zigzag", 2).tolist()   # rank 0: chunks 0, 3; rank 1: chunks 1, 2
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    axis = _check_layout_args(x, layout, world_size, seq_axis)
    return _take(x, layout_permutation(np.shape(x)[axis], int(world_size), layout), axis)


def from_layout(x, layout, world_size, seq_axis=1):
    """Inverse of ``to_layout``: put an array in ``layout`` order back into natural token order.

    >>> import numpy as np
    >>> from_layout(np.array([[0, 1, 6, 7, 2, 3, 4, 5]]), "zigzag", 2).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    axis = _check_layout_args(x, layout, world_size, seq_axis)
    perm = layout_permutation(np.shape(x)[axis], int(world_size), layout)
    return _take(x, inverse_permutation(perm), axis)
