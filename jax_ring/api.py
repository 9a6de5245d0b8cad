"""Public JAX entry points: ``ring_attention`` (inside ``jax.shard_map``), ``ring_attention_sharded`` (global
arrays, wraps the shard_map) and the layout helpers ``to_layout`` / ``from_layout``; and the autograd layer of
the fused backend (a ``jax.custom_vjp`` over the raw ops of jax_ring.fused). The twin of torch_bridge.api.

Every user error raises ValueError / TypeError before any work, naming the argument and the fix.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ring_core.runtime import heap as _heap
from ring_core import plans
from ring_core.layout import inverse_permutation, layout_permutation
from ring_core.validate import (check_attention_args, check_deterministic, check_global_seq, check_layout,
                                check_layout_call, check_timeout)

from jax_ring import _platform, fused, nodes
from jax_ring.reference import ring_attention_xla

JAX_BACKENDS = ("auto", "fused", "xla")


def _fused_available() -> bool:
    """Whether the fused Triton + iris kernel can run here (GPU JAX and ``jax_ring.initialize()`` done)."""
    return fused.fused_available()


def _resolve_backend(backend: str, spec) -> str:
    fusable = plans.fused_supports(spec)
    if backend == "auto":
        return "fused" if fusable and _fused_available() else "xla"
    if backend == "fused":
        if not _fused_available():
            raise RuntimeError(
                "backend='fused' needs NVIDIA GPUs and the symmetric heap: call jax_ring.initialize() once per "
                "process (one process per rank, started with python -m jax_ring.launch or torchrun) before "
                "using JAX; or use backend='xla'")
        plans.check_fused(spec, "backend='xla'")
    return backend


# --------------------------------------------------------------------------- the fused backend's autograd
# segment_ids is an array input of the custom_vjp (not a nondiff_argnum, which must be hashable and static):
# None, or this rank's int32 ids, which the backward kernel needs as the forward did. Integers carry no
# gradient: the bwd rule returns None for them, which JAX (0.10 and 0.11 alike) turns into a symbolic zero
# of their float0 cotangent type. ``deterministic`` (the call's effective value, a bool) is for the backward's
# plan only: the forward kernel is the same either way.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(q, k, v, segment_ids, spec, axis_name, world_size, timeout_s, deterministic):
    return fused.forward(q, k, v, spec, axis_name, world_size, timeout_s, segment_ids=segment_ids)


def _fused_fwd(q, k, v, segment_ids, spec, axis_name, world_size, timeout_s, deterministic):
    # A heap too small for the backward raises now, before anything runs.
    _heap.get().plan_bwd(spec, world_size, deterministic=deterministic)
    out, lse = fused.forward(q, k, v, spec, axis_name, world_size, timeout_s, segment_ids=segment_ids)
    return (out, lse), (q, k, v, segment_ids, out, lse)


def _fused_bwd(spec, axis_name, world_size, timeout_s, deterministic, res, cts):
    """The fused backward kernel from the saved q, k, v, segment ids, out and lse, with the cotangents of both
    out and lse (zeros for lse unless the caller uses it); no cotangent for the segment ids."""
    q, k, v, segment_ids, out, lse = res
    dout, dlse = cts
    dq, dk, dv = fused.backward(q, k, v, out, lse, dout.astype(q.dtype), dlse, spec, axis_name, world_size,
                                timeout_s, segment_ids=segment_ids, deterministic=deterministic)
    return dq, dk, dv, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _forget_compiled_programs():
    """Release hook (ring_core.runtime.heap.on_release): a program traced with the fused backend baked the heap's
    addresses into its constants (the context table), so after shutdown() running it again would write into
    released memory. Clearing JAX's caches makes the next call trace again, which raises without a heap and
    otherwise takes the new heap's addresses."""
    jax.clear_caches()
    _sharded_fn.cache_clear()


def _ring_attention_fused(q, k, v, segment_ids, spec, axis_name, world_size, timeout_s, deterministic):
    if _platform.under_vmap():
        raise ValueError(
            "jax_ring.ring_attention(backend='fused') does not run under jax.vmap: the kernel takes a batch axis "
            "of its own. Fold the mapped axis into the batch axis instead (q.reshape(-1, *q.shape[-3:]) and back), "
            "or use backend='xla'")
    _heap.on_release(_forget_compiled_programs)
    return _fused(q, k, v, segment_ids, spec, axis_name, world_size, timeout_s, deterministic)


# ------------------------------------------------------------------------------------------ public API
def _run(q, k, v, segment_ids, spec, *, axis_name, return_lse, backend, timeout_s, deterministic):
    """A validated call (``spec``, and ``deterministic``'s effective value) inside shard_map."""
    asked, backend = backend, _resolve_backend(backend, spec)
    world = _platform.axis_size(axis_name)  # ValueError (how to fix it) outside shard_map / wrong name
    if backend == "fused" and asked == "auto" and nodes.spans_nodes(world) and not nodes.fused_takes(spec, world):
        backend = "xla"  # a zigzag window the two-level fused ring does not take: the reference ring does
    if backend == "xla":  # ignores deterministic: XLA's own ops, as deterministic as XLA_FLAGS make them
        return ring_attention_xla(q, k, v, axis_name=axis_name, spec=spec, return_lse=return_lse,
                                  segment_ids=segment_ids)
    padded = _heap.get().kernel_spec(spec)
    if padded is not spec:  # the Gluon kernels at a padded head_dim (ring_core.plans.kernel_spec)
        pad = [(0, 0)] * 3 + [(0, padded.head_dim - spec.head_dim)]
        out, lse = _fused_call(*(jnp.pad(x, pad) for x in (q, k, v)), segment_ids, padded, axis_name, world,
                               timeout_s, deterministic)
        out = out[..., :spec.head_dim]
    else:
        out, lse = _fused_call(q, k, v, segment_ids, spec, axis_name, world, timeout_s, deterministic)
    return (out, lse) if return_lse else out


def _fused_call(q, k, v, segment_ids, spec, axis_name, world, timeout_s, deterministic):
    """(out, lse) of the fused backend over ``world`` ranks of ``axis_name``: the one-node kernel, or the two-level
    ring where the axis spans several nodes."""
    if nodes.spans_nodes(world):  # several nodes: the kernel within each, K/V between them (jax_ring.nodes)
        if _platform.under_vmap():
            raise ValueError("jax_ring.ring_attention(backend='fused') does not run under jax.vmap: fold the mapped "
                             "axis into the batch axis, or use backend='xla'")
        _heap.on_release(_forget_compiled_programs)
        return nodes.ring_attention(q, k, v, spec, axis_name, timeout_s, deterministic, segment_ids)
    return _ring_attention_fused(q, k, v, segment_ids, spec, axis_name, world, timeout_s, deterministic)


def _validate(q, k, v, segment_ids, local=lambda shape: shape, **kw):
    """The call's AttentionSpec (``local``: a global array's shape -> this rank's)."""
    return check_attention_args(local(q.shape), local(k.shape), local(v.shape), q.dtype, k.dtype, v.dtype,
                                backends=JAX_BACKENDS, **kw,
                                segment_ids_shape=None if segment_ids is None else local(segment_ids.shape),
                                segment_ids_dtype=None if segment_ids is None else segment_ids.dtype)


def ring_attention(q, k, v, *, axis_name, is_causal=False, scale=None, layout="contiguous", return_lse=False,
                   backend="auto", timeout_s=None, segment_ids=None, window_size=None, deterministic=False):
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
        denominator over the whole global sequence (scores already multiplied by ``scale``); ``-inf`` on rows
        that attend nothing (padding).
      backend: ``"auto"`` (the fused kernel where available, else ``"xla"``), ``"fused"`` (the Triton + iris
        kernel as an XLA custom call; needs ``jax_ring.initialize()`` on GPUs, one device per process in the mesh;
        its gradients, through out and lse, come from the fused backward kernel; works under shard_map's
        default check_vma; not under jax.vmap) or ``"xla"`` (the pure-JAX reference ring: K/V go round with
        ``lax.ppermute``, float32 maths).
      timeout_s: bound in seconds on every wait inside the fused kernel (default: RING_ATTENTION_TIMEOUT_S
        when traced, else 300); an expired wait raises ``ring_core.protocol.control.RingAttentionTimeout`` naming the
        missing rank and ring step. Baked into the compiled program. The xla ring has no waits of its own.
        Ranks whose fused calls differ (shapes, dtype, flags, layout, scale) raise
        ``ring_core.protocol.control.RingAttentionMismatch`` naming both calls (found before any data moves).
        By default (RING_ATTENTION_ERRORS=deferred, read when tracing) the failed call does not raise
        itself, and there is no host sync per call: a later fused call on this process reports it (its program
        fails with a ``jax.errors.JaxRuntimeError`` whose message starts with the exception's name) and
        ``jax_ring.check_errors()`` raises it as its type; what the failed call could not compute is NaN.
        RING_ATTENTION_ERRORS=call raises it from the call itself (its program fails; a host sync per call: for
        debugging).
      segment_ids: packed sequences: int32 [batch, seq_local], this rank's tokens' segment ids in the layout's
        order (as q's tokens; one array serves this rank's queries and keys, so they cannot disagree). Query i
        attends key j only where their ids are equal; a negative id marks padding: that row attends nothing
        (out 0, lse -inf, no gradient in or out). Put a global array in layout order with ``to_layout``;
        ``segment_ids_from_cu_seqlens`` makes one from flash-attn's ``cu_seqlens``. None: one segment.
      window_size: sliding window ``(left, right)``, flash-attn's meaning in global token order: query i
        attends keys j with ``i - left <= j <= i + right``; -1 unbounded on that side; None: no window. With
        ``is_causal``, keys after the query stay masked. Every backend takes both masks; the fused kernels
        skip the work they hide (K/V rows outside the window are not sent, waited for, loaded or computed;
        those of other segments not loaded or computed: ring_core/protocol/steps.py).
      deterministic: as in flash-attn. False (the default): the fastest fused backward, which may accumulate dQ in a
        nondeterministic order where a kernel does. True: the fused backend's gradients bit-identical from run to run
        and between JAX and torch (the same inputs on the same GPUs). Also turned on by
        ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` (or ``--xla_gpu_exclude_nondeterministic_ops=true``), read when
        the call is traced. With False, on Hopper for fp16/bf16, head_dim 64 or 128 (windows and segment ids included:
        ring_core.plans.gluon_bwd_applies), the fused backward is the Gluon kernel whose dQ sums come in no fixed order
        (ring_core/kernels/gluon_bwd.py); with True, at head_dim 128 (padded to it included) without a window or segment
        ids, the same kernel adding dQ in a fixed order; elsewhere the deterministic tl kernel.
        The ``"xla"`` backend ignores it: it runs XLA's own ops, which XLA_FLAGS governs.

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
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
    spec = _validate(q, k, v, segment_ids, is_causal=is_causal, scale=scale, layout=layout, backend=backend,
                     return_lse=return_lse, window_size=window_size)
    return _run(q, k, v, segment_ids, spec, axis_name=axis_name, return_lse=return_lse, backend=backend,
                timeout_s=check_timeout(timeout_s), deterministic=_deterministic(deterministic))


def ring_attention_sharded(q, k, v, *, mesh, axis_name, is_causal=False, scale=None, layout="contiguous",
                           return_lse=False, backend="auto", timeout_s=None, segment_ids=None, window_size=None,
                           deterministic=False):
    """``ring_attention`` on global arrays: shards the sequence over ``mesh`` axis ``axis_name`` and runs the ring.

    ``q``, ``k``, ``v`` (and ``segment_ids``, [batch, seq_global]) are global, [batch, seq_global, heads,
    head_dim], and must ALREADY be in ``layout`` order: for ``layout="zigzag"`` pass ``to_layout(x, "zigzag",
    W)`` and put the result back in natural order with ``from_layout(out, "zigzag", W)`` (``lse`` is [batch,
    heads, seq_global]: use ``seq_axis=2``). For ``"contiguous"`` both are the identity. ``seq_global`` must
    be a multiple of W (2W for zigzag). Other keywords as in ``ring_attention``; the shard_map uses in_specs
    ``P(None, axis_name)``, out_specs ``P(None, axis_name)`` for out and ``P(None, None, axis_name)`` for lse.

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
    check_layout(layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim == 4:  # else check_attention_args names the bad rank
            check_global_seq(x.shape[1], world, layout, f"{name} has seq_global", f" on axis {axis_name!r}")
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
    spec = _validate(q, k, v, segment_ids, local=lambda shape: (*shape[:1], shape[1] // world, *shape[2:])
                     if len(shape) >= 2 else shape, is_causal=is_causal, scale=scale, layout=layout,
                     backend=backend, return_lse=return_lse, window_size=window_size)
    timeout_s = check_timeout(timeout_s)
    deterministic = _deterministic(deterministic)  # XLA_FLAGS read at each call: a change makes a new program
    _resolve_backend(backend, spec)  # errors now, not when traced
    fn = _sharded_fn(mesh, axis_name, spec, return_lse, backend, timeout_s, deterministic, fused.error_check())
    return fn(q, k, v) if segment_ids is None else fn(q, k, v, segment_ids)


def _deterministic(deterministic) -> bool:
    """The call's effective ``deterministic``: the keyword, or XLA_FLAGS asking for deterministic GPU ops."""
    return check_deterministic(deterministic, _platform.xla_deterministic_ops())


@functools.lru_cache(maxsize=64)
def _sharded_fn(mesh, axis_name, spec, return_lse, backend, timeout_s, deterministic, errors):
    """The jitted shard_map for one validated configuration (cached: eager shard_map would dispatch op by op);
    ``errors`` (fused.error_check()) is in the key only: the program traced under another error mode is another."""

    def body(q, k, v, *segment_ids):
        return _run(q, k, v, segment_ids[0] if segment_ids else None, spec, axis_name=axis_name,
                    return_lse=return_lse, backend=backend, timeout_s=timeout_s, deterministic=deterministic)

    seq = P(None, axis_name)
    out_specs = (seq, P(None, None, axis_name)) if return_lse else seq
    in_specs = (seq,) * (4 if spec.segmented else 3)
    return jax.jit(_platform.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _take(x, idx, axis):
    if isinstance(x, np.ndarray):
        return np.take(x, idx, axis=axis)
    return jnp.take(jnp.asarray(x), jnp.asarray(idx), axis=axis)


def to_layout(x, layout, world_size, seq_axis=1):
    """Reorder a global array from natural token order into ``layout`` order along ``seq_axis``.

    Sharding the result contiguously over ``world_size`` ranks gives each rank the tokens ``layout`` assigns
    it. numpy in, numpy out; anything else becomes a jax array. ``from_layout`` undoes it. Segment ids
    ([batch, seq]) are reordered the same way.

    >>> import numpy as np
    >>> to_layout(np.arange(8)[None], "zigzag", 2).tolist()   # rank 0: chunks 0, 3; rank 1: chunks 1, 2
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    axis = check_layout_call(layout, world_size, seq_axis, np.ndim(x))
    return _take(x, layout_permutation(np.shape(x)[axis], int(world_size), layout), axis)


def from_layout(x, layout, world_size, seq_axis=1):
    """Inverse of ``to_layout``: put an array in ``layout`` order back into natural token order.

    >>> import numpy as np
    >>> from_layout(np.array([[0, 1, 6, 7, 2, 3, 4, 5]]), "zigzag", 2).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    axis = check_layout_call(layout, world_size, seq_axis, np.ndim(x))
    perm = layout_permutation(np.shape(x)[axis], int(world_size), layout)
    return _take(x, inverse_permutation(perm), axis)


def segment_ids_from_cu_seqlens(cu_seqlens, seq_len):
    """flash-attn's varlen convention to segment ids: ``cu_seqlens`` [n + 1] (0, then the end of each packed
    sequence) gives int32 [seq_len] ids 0..n-1, tokens after the last sequence -1 (padding); [batch, n + 1]
    gives [batch, seq_len]. A jax array (numpy in, numpy out).

    >>> segment_ids_from_cu_seqlens(np.array([0, 3, 5]), 6).tolist()
    [0, 0, 0, 1, 1, -1]
    """
    from ring_core.masks import segment_ids_from_cu_seqlens as ids

    out = ids(np.asarray(cu_seqlens), seq_len)
    return out if isinstance(cu_seqlens, (np.ndarray, list, tuple)) else jnp.asarray(out)
