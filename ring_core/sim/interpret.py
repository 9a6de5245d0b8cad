"""Run the real fused kernels (forward ``ring_core.kernels.tl_fwd``, backward ``ring_core.kernels.tl_bwd``) in the
Triton interpreter: one thread per rank, each over a CPU "heap".

iris translates addresses between the per-rank CPU buffers exactly as it does between GPU heaps, so
remote stores, release/acquire flags and the end barrier all run for real. Two things in Triton's
interpreter are process-global and must be made safe for one thread per rank:
* the current program id (``interpreter_builder.grid_idx``/``grid_dim``): made thread-local;
* the patching of ``triton.language`` that every launch does and undoes on return: done once around the
  whole job, so one rank finishing cannot unpatch the language under another rank still running.
The kernels (and iris) must be *interpreted* functions, decided by TRITON_INTERPRET when they are
decorated; ``ensure_interpreter`` arranges that, and ``SimulatedJob`` falls back to a subprocess when
this process already compiled them for a GPU.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from ring_core.protocol import control
from ring_core import plans, validate
from ring_core.validate import AttentionSpec



def interpreter_usable() -> bool:
    """True if the kernels can be (or already are) imported as interpreted functions in this process."""
    for mod, attr in (("ring_core.kernels.tl_fwd", "ring_attn_fwd_kernel"),
                      ("ring_core.kernels.tl_bwd", "ring_attn_bwd_kernel"),
                      ("iris", "store")):
        if mod in sys.modules:
            from triton.runtime.interpreter import InterpretedFunction

            if not isinstance(getattr(sys.modules[mod], attr), InterpretedFunction):
                return False
    return True


def ensure_interpreter():
    """Switch Triton to the interpreter for this process (before the kernel is decorated) and return the
    interpreted kernel. Raises RuntimeError if the kernel was already compiled for a GPU here."""
    if not interpreter_usable():
        raise RuntimeError("ring_core.kernels.tl_fwd was imported without TRITON_INTERPRET=1 in this process")
    os.environ["TRITON_INTERPRET"] = "1"
    from ring_core.kernels import tl_bwd, tl_fwd  # noqa: F401  (both decorated as interpreted functions here)

    _make_interpreter_thread_safe()
    _serialize_interpreter_rewrites()
    _round_interpreter_bf16_to_nearest()
    _yield_interpreter_polls()
    return tl_fwd.ring_attn_fwd_kernel


def ensure_interpreter_bwd():
    """``ensure_interpreter`` for the backward kernel: returns the interpreted ``ring_attn_bwd_kernel``."""
    ensure_interpreter()
    from ring_core.kernels import tl_bwd

    return tl_bwd.ring_attn_bwd_kernel


_thread_safe_lock = threading.Lock()


def _serialize_interpreter_rewrites():
    """Workaround: make the Triton interpreter's first-call rewrite of each jit function thread-safe.

    ``InterpretedFunction.rewrite`` runs ``ast.parse`` + ``compile`` the first time a jit function (the
    kernel, and each nested helper such as ``_poll_ge`` or ``iris.store``) is called. With one thread per
    rank those first calls happen concurrently, and on CPython 3.11 concurrent ``ast.parse`` can fail with
    ``SystemError: AST constructor recursion depth mismatch`` (CPython gh-106905): that rank dies and its
    peers wait for it until their timeout. Rewrites are cached, so serializing them costs nothing later.
    Idempotent.
    """
    from triton.runtime import interpreter as interp

    cls = interp.InterpretedFunction
    with _thread_safe_lock:
        if getattr(cls.rewrite, "_ring_serialized", False):
            return
        original = cls.rewrite
        lock = threading.RLock()

        def rewrite(self):
            cached = self.rewritten_fn.get(self.fn)
            if cached is not None:
                return cached
            with lock:
                return original(self)

        rewrite._ring_serialized = True
        cls.rewrite = rewrite


def _bf16_bits_rtne(x) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest even as GPUs do; NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x40)
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)


def _round_interpreter_bf16_to_nearest():
    """Workaround: make the Triton interpreter round float32 -> bfloat16 casts to nearest even.

    The interpreter's cast (``InterpreterBuilder.cast_impl``, used by ``x.to(tl.bfloat16)`` with or without
    ``fp_downcast_rounding="rtne"``) truncates the mantissa, while the GPU rounds to nearest even. The
    kernel casts the softmax probabilities (for P@V) and the output to the input dtype, so bfloat16 results
    in the simulator were up to one bf16 ulp further from the reference than the GPU kernel's. Idempotent.
    """
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as interp

    cls = interp.InterpreterBuilder
    with _thread_safe_lock:
        if getattr(cls.cast_impl, "_ring_rtne", False):
            return
        cast_impl, fp_to_fp = cls.cast_impl, cls.create_fp_to_fp

        def is_f32_to_bf16(src, dst_type):
            return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

        def rtne_cast_impl(self, src, dst_type):
            if is_f32_to_bf16(src, dst_type):
                return interp.TensorHandle(_bf16_bits_rtne(src.data), dst_type.scalar)
            return cast_impl(self, src, dst_type)

        def rtne_fp_to_fp(self, src, dst_type, rounding_mode):
            if is_f32_to_bf16(src, dst_type) and rounding_mode == ir.ROUNDING_MODE.RTNE:
                return interp.TensorHandle(_bf16_bits_rtne(src.data), dst_type.scalar)
            return fp_to_fp(self, src, dst_type, rounding_mode)

        rtne_cast_impl._ring_rtne = True
        cls.cast_impl, cls.create_fp_to_fp = rtne_cast_impl, rtne_fp_to_fp


POLL_SLEEP_S = 2e-4


def _yield_interpreter_polls():
    """Let a spinning rank thread give the GIL to the ranks that compute.

    A bounded wait (``_poll_ge``) polls its flag with ``atomic_add(ptr, 0, sem="acquire")``. In the
    interpreter every rank is a Python thread, and a thread that polls keeps the GIL as much as one that
    computes, so with W ranks the one rank everybody waits for ran at about 1/W speed (a 4-rank backward
    took 47 s instead of 19 s). After each such poll the thread now sleeps ``POLL_SLEEP_S`` (releasing the
    GIL). The kernel bounds interpreter waits by a poll count, so a timeout now takes about twice as long
    in wall time; it stays bounded. Idempotent.
    """
    import time

    from triton._C.libtriton import ir
    from triton.runtime import interpreter as interp

    cls = interp.InterpreterBuilder
    with _thread_safe_lock:
        if getattr(cls.create_atomic_rmw, "_ring_yield", False):
            return
        rmw = cls.create_atomic_rmw

        def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
            result = rmw(self, rmwOp, ptr, val, mask, sem, scope)
            if rmwOp == ir.ATOMIC_OP.ADD and sem == ir.MEM_SEMANTIC.ACQUIRE and not np.any(val.data):
                time.sleep(POLL_SLEEP_S)
            return result

        create_atomic_rmw._ring_yield = True
        cls.create_atomic_rmw = create_atomic_rmw


def _make_interpreter_thread_safe():
    from triton.runtime import interpreter as interp

    with _thread_safe_lock:
        builder = interp.interpreter_builder
        if getattr(type(builder), "_ring_thread_local", False):
            return
        local = threading.local()

        def _prop(name):
            return property(lambda self: getattr(local, name), lambda self, value: setattr(local, name, value))

        cls = type(builder)
        builder.__class__ = type(cls.__name__ + "ThreadLocal", (cls,), {
            "_ring_thread_local": True, "grid_idx": _prop("grid_idx"), "grid_dim": _prop("grid_dim")})


def _to_torch(x: np.ndarray, dtype: str):
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.dtype(dtype)).copy())


def _to_numpy(t, dtype: str) -> np.ndarray:
    import torch

    if dtype == "bfloat16":
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def run_on_threads(target, ranks, timeout_s: float, what: str) -> None:
    """``target(r)`` for every rank r on a thread of its own, then wait for all of them. The waits inside are
    bounded by ``timeout_s``; this host-side guard only catches bugs."""
    threads = [threading.Thread(target=target, args=(r,), daemon=True, name=f"{what}-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10 * timeout_s + 600)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"simulated {what} did not finish: a bounded wait failed to bound")


class SimulatedJob:
    """``world_size`` simulated ranks whose heaps persist across calls (so the epoch protocol that
    separates consecutive calls is exercised too).

    A call runs one ring over every rank, or several rings at once (``rings``: lists of ranks in ring order,
    no rank in two), each on its own heap slot (ring_core.runtime.heap.RingSlots, assigned as the JAX frontend does);
    a rank may take part in different rings in different calls."""

    def __init__(self, world_size: int, workspace_bytes: int | None = None):
        from ring_core.runtime.heap import RingSlots

        if world_size < 1 or world_size > control.MAX_WORLD:
            raise ValueError(f"world_size must be in 1..{control.MAX_WORLD}, got {world_size}")
        self.world_size = world_size
        self.heaps = None
        self.layout = None
        self._workspace = workspace_bytes
        self.slots = RingSlots()

    def _rings(self, rings):
        """[(members, slot)] of a call's rings (default: one ring over every rank, in rank order)."""
        rings = [tuple(int(m) for m in r) for r in (rings or [range(self.world_size)])]
        flat = [m for r in rings for m in r]
        if len(set(flat)) != len(flat) or not all(0 <= m < self.world_size for m in flat):
            raise ValueError(f"rings {rings} must be disjoint lists of ranks in [0, {self.world_size})")
        return [(r, self.slots.assign("jax", r)) for r in rings]

    def ring_of(self, rings, rank: int):
        """(members, position, slot) of ``rank``'s ring among ``self._rings(rings)``."""
        for members, slot in rings:
            if rank in members:
                return members, members.index(rank), slot
        raise ValueError(f"rank {rank} is in no ring of {rings}")

    def _ensure_heaps(self, need: int):
        """Heaps whose receive region holds ``need`` bytes (fresh heaps restart the epoch count)."""
        import torch

        if self.layout is not None and self.layout.recv_capacity >= need:
            return
        size = self._workspace or (need + (2 << 20))
        self.layout = control.HeapLayout.for_workspace(size)
        self.heaps = [torch.zeros(size, dtype=torch.uint8) for _ in range(self.world_size)]

    def ctx(self, rank: int, ring):
        """The context array of ``rank`` in ``ring`` = (members, position, slot) (one address space)."""
        import torch

        members, position, slot = ring
        return torch.from_numpy(control.make_ctx([self.heaps[m].data_ptr() for m in members], position, self.layout,
                                                slot))

    def take_error(self, rank: int):
        """What ``HeapRings.take_error`` returns on GPUs, for simulated ``rank``: (status, ring members) or None."""
        kept = control.take_sticky(self.heaps[rank], self.layout)
        return None if kept is None else (kept[0], self.slots.ring_at(kept[1], rank))

    def reset(self):
        """Zero every rank's control words and flags (what ``SymmetricHeap.reset`` does on GPUs)."""
        if self.heaps is not None:
            start, end = self.layout.protocol_region
            for h in self.heaps:
                h[start:end].zero_()

    def _per_rank(self, spec):
        """One AttentionSpec per rank: ``spec`` itself, or a sequence of them (ranks that disagree)."""
        specs = list(spec) if isinstance(spec, (list, tuple)) else [spec] * self.world_size
        if len(specs) != self.world_size:
            raise ValueError(f"{len(specs)} specs for {self.world_size} ranks")
        return specs

    def _setup(self, spec, need, make_plan, absent_ranks, absent_started, rings=None):
        """(per-rank specs, per-rank plans, per-rank rings) for one call, on heaps that fit every rank's
        ``need``; publishes the signatures of ``absent_ranks`` when they ``absent_started``."""
        specs = self._per_rank(spec)
        rings = self._rings(rings)
        ring_of = [self.ring_of(rings, r) for r in range(self.world_size)]
        self._ensure_heaps(max(need(sp, len(ring[0])) for sp, ring in zip(specs, ring_of)))
        launches = [make_plan(sp, len(ring[0]), self.layout, interpret=True) for sp, ring in zip(specs, ring_of)]
        if absent_started:
            self._publish_started(launches, absent_ranks, ring_of)
        return specs, launches, ring_of

    def _ctl_words(self, rank: int, slot: int):
        """``rank``'s control words of ring slot ``slot`` (an int32 view of its heap)."""
        import torch

        off = self.layout.ctl_off_of(slot)
        return self.heaps[rank][off:off + control.CTL_BYTES].view(torch.int32)

    def _publish_started(self, launches, absent_ranks, ring_of):
        """For ranks that started the call and then stopped: write their signatures for this call into
        their ring peers' inboxes, as their kernel's first program would have (ring_core.protocol.steps.check_call)."""
        import torch

        for a in absent_ranks:
            words = launches[a].signature()
            members, position, slot = ring_of[a]
            for r in members:
                if r == a:
                    continue
                ctl = self._ctl_words(r, slot)
                words[0] = int(ctl[control.CTL_EPOCH]) + 1
                ctl[control.CTL_SIG + position * control.SIG_WORDS:][:control.SIG_WORDS] = torch.from_numpy(words)

    def _launch(self, kernel, launch_rank, absent_ranks, timeout_s):
        """Run ``launch_rank(r)`` (one kernel launch on rank r, returning that rank's results) on one
        thread per rank, except ``absent_ranks``; returns the per-rank results (None for absent ranks)."""
        import torch

        from triton.runtime import interpreter as interp

        W = self.world_size
        results = [None] * W
        errors = [None] * W

        def one_rank(r):
            try:
                results[r] = launch_rank(r)
            except BaseException as e:  # re-raised on the calling thread
                errors[r] = e
                # Tell every rank's kernel at once (their waits give up when the error word is set)
                # instead of letting them spin until their timeout.
                for h in range(self.world_size):
                    for slot in range(control.RING_SLOTS):
                        word = self._ctl_words(h, slot)[control.CTL_ERROR:][:2]
                        if int(word[0]) == control.ERR_NONE:
                            word[1] = r
                            word[0] = control.ERR_PEER_FAILED

        # Patch triton.language once for the whole job (see module docstring).
        scope = interp._patch_lang(kernel.fn)
        try:
            run_on_threads(one_rank, [r for r in range(W) if r not in absent_ranks], timeout_s, "ring attention")
        finally:
            scope.restore()
        for r, e in enumerate(errors):
            if e is not None:
                raise RuntimeError(f"simulated rank {r} failed: {e!r}") from e
        return results

    @staticmethod
    def _seg(spec, seg_shards, r):
        """Rank ``r``'s segment ids for the kernel (int32 [B, S], or [2, B, S] with ``spec.kv_ids``); a one-element
        dummy when the call has none."""
        import torch

        if not spec.segmented:
            return torch.zeros(1, dtype=torch.int32)
        if seg_shards is None or seg_shards[r] is None:
            raise ValueError(f"rank {r}'s call has segment ids (spec.segmented) but no seg_shards were given")
        seg = np.ascontiguousarray(seg_shards[r], dtype=np.int32)
        validate.check_segment_ids_given(spec, True, seg.shape)
        return torch.from_numpy(seg.copy())

    def run(self, spec, q_shards, k_shards, v_shards, *, timeout_s: float = 60.0, absent_ranks=(),
            absent_started: bool = False, sticky_errors: bool = False, rings=None, seg_shards=None):
        """Run one call on every rank (except ``absent_ranks``, to simulate a rank that never arrives; with
        ``absent_started`` they started the call, published its signature and then stopped). ``spec`` is
        an AttentionSpec, or one per rank (ranks that disagree); ``rings`` as in the class docstring (each
        rank's shard is its shard in its ring). Shards are numpy arrays in each rank's dtype; ``seg_shards``
        each rank's segment ids (int32 [B, S], layout order) where its spec is ``segmented``;
        ``sticky_errors`` as the kernel's STICKY_ERRORS. Returns per-rank (out, lse, status) numpy arrays."""
        import torch

        kernel = ensure_interpreter()
        specs, launches, ring_of = self._setup(spec, plans.recv_bytes, plans.plan, absent_ranks, absent_started,
                                               rings)

        def launch_rank(r):
            sp, plan = specs[r], launches[r]
            (o_shape, _), (l_shape, _), (s_shape, _) = plan.out_shapes
            q, k, v = (_to_torch(x[r], sp.dtype) for x in (q_shards, k_shards, v_shards))
            seg = self._seg(sp, seg_shards, r)
            ctx = self.ctx(r, ring_of[r])
            out = torch.zeros(o_shape, dtype=q.dtype)
            lse = torch.zeros(l_shape, dtype=torch.float32)
            status = torch.zeros(s_shape, dtype=torch.int32)  # zeroed, as on the GPU paths
            kernel[plan.grid](q, k, v, seg, ctx, *plan.scalars(timeout_s), out, lse, status,
                              **plan.constexprs(sticky_errors=sticky_errors))
            return _to_numpy(out, sp.dtype), lse.numpy(), status.numpy()

        return self._launch(kernel, launch_rank, absent_ranks, timeout_s)

    def run_bwd(self, spec, q_shards, k_shards, v_shards, out_shards, lse_shards, dout_shards, *,
                timeout_s: float = 60.0, absent_ranks=(), absent_started: bool = False, dlse_shards=None,
                rings=None, seg_shards=None):
        """Run one backward call on every rank (except ``absent_ranks``). ``out``/``lse`` are the forward's
        per-rank results, ``dlse`` the gradients of lse (float32; None: zeros); ``spec``,
        ``absent_started``, ``rings`` and ``seg_shards`` as in ``run``. Returns per-rank (dq, dk, dv, status)
        numpy arrays (gradients in each rank's dtype)."""
        import torch

        kernel = ensure_interpreter_bwd()
        specs, launches, ring_of = self._setup(spec, lambda sp, w: plans.bwd_recv_bytes(sp, w)[2], plans.plan_bwd,
                                            absent_ranks, absent_started, rings)

        def launch_rank(r):
            sp, plan = specs[r], launches[r]
            q, k, v, o, do = (_to_torch(x[r], sp.dtype) for x in (q_shards, k_shards, v_shards, out_shards,
                                                                  dout_shards))
            lse = _to_torch(lse_shards[r], "float32")
            dlse = torch.zeros_like(lse) if dlse_shards is None else _to_torch(dlse_shards[r], "float32")
            seg = self._seg(sp, seg_shards, r)
            ctx = self.ctx(r, ring_of[r])
            outs = [torch.zeros(shape, dtype=q.dtype if dt == sp.dtype else getattr(torch, dt))
                    for shape, dt in plan.out_shapes]  # dq, dk, dv, delta (scratch), status (zeroed, as on GPUs)
            kernel[plan.grid](q, k, v, o, do, lse, dlse, seg, ctx, *plan.scalars(timeout_s), *outs,
                              **plan.constexprs())
            dq, dk, dv, _, status = outs
            return (*(_to_numpy(x, sp.dtype) for x in (dq, dk, dv)), status.numpy())

        return self._launch(kernel, launch_rank, absent_ranks, timeout_s)

    def run_grad(self, spec: AttentionSpec, q_shards, k_shards, v_shards, dout_shards, *, timeout_s: float = 60.0,
                 dlse_shards=None, rings=None, seg_shards=None):
        """The forward then the backward kernel on every rank, on the same heaps (two epochs).
        Returns per-rank (dq, dk, dv, forward status, backward status)."""
        # Heaps that fit the backward first: growing them between the two calls would restart the epochs.
        size = max(len(members) for members, _ in self._rings(rings))
        self._ensure_heaps(max(plans.bwd_recv_bytes(spec, size)[2], plans.recv_bytes(spec, size)))
        plans.plan_bwd(spec, size, self.layout, interpret=True)  # HeapTooSmallError before any run
        fwd = self.run(spec, q_shards, k_shards, v_shards, timeout_s=timeout_s, rings=rings, seg_shards=seg_shards)
        bwd = self.run_bwd(spec, q_shards, k_shards, v_shards, [f[0] for f in fwd], [f[1] for f in fwd],
                           dout_shards, timeout_s=timeout_s, dlse_shards=dlse_shards, rings=rings,
                           seg_shards=seg_shards)
        return [(*b[:3], f[2], b[3]) for f, b in zip(fwd, bwd)]
