"""backend='fused' for PyTorch, the raw ops: the shared kernels (ring_core.kernels.tl_fwd, .kernel_bwd) launched with
torch tensors over the ring of a process group (``forward``, ``backward``); the autograd layer that calls them (the
custom ops torch.compile sees) is in torch_bridge.api, and the status of every launch goes to torch_bridge.lifecycle,
which raises a failure (at the next call, ``check_errors()`` or at once). The twin of jax_ring.fused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ring_core.runtime import build
from ring_core.runtime import heap as _heap
from ring_core import validate
from torch_bridge import lifecycle


def ring_of(h, group):
    """(members, this rank's position, heap slot) of the ring over ``group`` (None: every process), members
    in group-rank order. The first fused call over a group agrees on its slot with the group's members (a
    collective over the group, once: ring_core.runtime.heap.RingSlots)."""
    if group is None or group is dist.group.WORLD:
        members = tuple(range(h.world_size))
    else:
        members = tuple(dist.get_process_group_ranks(group))
    slot = h.rings.get("torch", members)
    if slot is None:
        used = [h.rings.used_by("torch", h.rank)]
        if len(members) > 1:
            used = [None] * len(members)
            dist.all_gather_object(used, h.rings.used_by("torch", h.rank), group=group)
        slot = h.rings.assign("torch", members, taken=set().union(*used))
    return members, members.index(h.rank), slot


def _prepare(q, spec, group, config, *, backward: bool, deterministic: bool = False):
    """(launch plan, context tensor, ring) for a fused launch on this rank over ``group``, after the checks
    that need the heap; reports errors of finished earlier calls. Raises HeapTooSmallError before anything
    is launched. ``deterministic`` for the backward's plan."""
    h = _heap.get()
    if q.device != h.device:
        raise ValueError(f"inputs are on {q.device} but this rank's heap is on {h.device}; move them there")
    lifecycle.report(wait=False)
    ring = members, _, slot = ring_of(h, group)
    if backward:
        p = h.plan_bwd(spec, len(members), config=config, deterministic=deterministic)
    else:
        p = h.plan(spec, len(members), config=config)
    return p, h.ctx(members, slot), ring


def kernel_spec(spec):
    """The call the fused kernels run for ``spec`` on this rank's device (ring_core.plans.kernel_spec); plain Python,
    which torch.compile traces into constants of the graph (the heap's device does not change while it lives)."""
    return _heap.get().kernel_spec(spec)


def _segment_ids(spec, segment_ids, device):
    """What the kernels get as ``seg_ptr``: this rank's segment ids (int32 [batch, seq_local], layout order; with
    ``spec.kv_ids`` [2, batch, seq_local], the queries' then the keys') when ``spec.segmented``, else a one-element
    dummy that the kernels never read (SEGMENTED=False)."""
    validate.check_segment_ids_given(spec, segment_ids is not None, None if segment_ids is None else segment_ids.shape)
    if segment_ids is None:
        if device not in _NO_IDS:  # one per device, made once (no allocation and fill launched per call)
            _NO_IDS[device] = torch.zeros((1,), dtype=torch.int32, device=device)
        return _NO_IDS[device]
    return segment_ids.to(device=device, dtype=torch.int32).contiguous()


_NO_IDS = {}  # device -> the one-element dummy of _segment_ids


def _scratch(size: int, alignment: int, stream):
    """Global scratch for a launch that needs it (the Gluon kernels' TMA descriptors, made on the device): one buffer
    per device and stream, kept (Triton asks at every launch; an allocation cost host time before the launch). The
    launches on a stream run one after another, so the next launch's descriptors never overwrite a running one's."""
    device = torch.cuda.current_device()
    key = (device, stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        buf = _SCRATCH[key] = torch.empty(max(size, 1), dtype=torch.int8, device=torch.device("cuda", device))
    return buf


_SCRATCH = {}  # (device, stream) -> its scratch buffer


def _with_scratch(p):
    """Before a launch of ``p``: give Triton an allocator for its global scratch, unless the caller set one
    (Triton keeps it per thread, in a context variable; its default raises)."""
    if p.config.gluon:
        import triton
        from triton.runtime import _allocation

        if _allocation._allocator.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
            triton.set_allocator(_scratch)


def _outputs(p, device):
    """The launch's outputs (ring_core.plans.LaunchPlan.out_shapes); the status last, zeroed: the kernel's
    last program writes it (ring_core.protocol.control.check_status)."""
    *shapes, (status_shape, status_dt) = p.out_shapes
    outs = [torch.empty(shape, dtype=getattr(torch, dt), device=device) for shape, dt in shapes]
    return [*outs, _zeroed_status(status_shape, status_dt, device)]


_STATUS_ROWS = 256  # statuses zeroed at once


def _zeroed_status(shape, dt: str, device):
    """A zeroed status tensor for one launch: a row of a block of ``_STATUS_ROWS`` zeroed at once, each row 16-byte
    aligned (an unaligned pointer is another specialisation of the kernel) and handed out once (the block lives as
    long as a row of it does). For a CUDA launch the block is pinned host memory, which the GPU reaches through
    unified addressing: the kernel's last program stores the status words straight into it, so that checking a
    call costs no copy on the stream, only an event (lifecycle.track; a cuMemcpyAsync of the status per call cost
    1.1-3.5 % of a 4k call, one H200). Rows are never reused: a row's block is freed only once
    every row of it has been checked, after its kernel ended."""
    (n,) = shape
    key = (device, n, dt)
    rows = _STATUSES.get(key)
    if not rows:
        dtype = getattr(torch, dt)
        per_16 = 16 // dtype.itemsize
        width = -(-n // per_16) * per_16  # rows of a multiple of 16 bytes
        if torch.device(device).type == "cuda":
            block = torch.zeros((_STATUS_ROWS, width), dtype=dtype, pin_memory=True)
            if not block.is_pinned():  # (lifecycle.track takes the rows as pinned)
                raise RuntimeError("torch_bridge: pinned host memory for the fused calls' status could not be had")
        else:  # (the interpreter: the kernel runs on the host)
            block = torch.zeros((_STATUS_ROWS, width), dtype=dtype, device=device)
        rows = _STATUSES[key] = list(block[:, :n].unbind(0))[::-1]  # (views made at once: popped one a call)
    return rows.pop()


_STATUSES = {}  # (device, words, dtype) -> the rows of its block not yet handed out


_COMPILED = {}  # plan -> (the compiled kernel of its last JIT launch, the device then current, _template, tensor args)


def _launch(p, *args):
    """Launch plan ``p``'s kernel over ``p.grid`` on the current stream with its runtime arguments ``args`` (inputs,
    ids, context, scalars, outputs: ``p.arg_types()``'s order; every tensor on the current device).

    A plan's first launch goes through Triton's JIT (compile or cache, specialisation, binding), which returns the
    compiled kernel; later launches call that kernel's own launcher, as the JIT's last step does, and skip the rest:
    per call the JIT binds and specialises every argument (the plan's constexprs included) and hashes its key, 35-85
    us of host time that a call timed on its own waits out before its kernel starts (one H200, calls
    timed one at a time). The binary is the one the JIT would pick: what the JIT specialises on is fixed by the plan
    (dtypes, the integer scalars batch and seq_local; timeout_ns and part_off are not specialised) but for the pointers'
    16-byte alignment, so a launch with a pointer not so aligned (a view into a buffer) goes through the JIT, and
    only launches with every pointer aligned reuse the kernel. The pointers go to the launcher as integers, which it
    takes as they are (a tensor costs it a ``data_ptr()`` call and a ``cuPointerGetAttribute`` each; the frontend
    has put every tensor on the heap's device), and no launch metadata nor hooks unless a launch hook is set (a
    profiler, e.g. proton: it gets them as from the JIT, tensors included).
    Under the interpreter the JIT returns no compiled kernel, and every launch goes through it."""
    from triton import knobs
    from triton.runtime import driver

    hit = _COMPILED.get(p)
    if hit is not None:
        ck, device, template, pointers = hit
        ptrs = [args[i].data_ptr() for i in pointers]
        if all(x % 16 == 0 for x in ptrs) and driver.active.get_current_device() == device:
            enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
            hooked = _hooked(enter) or _hooked(leave)
            vals = list(args)
            if not hooked:
                for i, x in zip(pointers, ptrs):
                    vals[i] = x
            full = [vals[i] if i >= 0 else c for i, c in template]
            stream = driver.active.get_current_stream(device)
            grid = (*p.grid, 1, 1)
            if hooked:
                ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata,
                       ck.launch_metadata(p.grid, stream, *full), enter, leave, *full)
            else:
                ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None, *full)
            return
    from triton.runtime.jit import JITCallable

    if isinstance(p.kernel(), JITCallable):  # (not under the interpreter): the keys every process computes alike
        build.settle_cache_keys()
    constexprs = p.constexprs()
    ck = p.kernel()[p.grid](*args, num_warps=p.config.num_warps, num_stages=p.config.num_stages, **constexprs)
    pointers = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if hasattr(ck, "packed_metadata") and all(args[i].data_ptr() % 16 == 0 for i in pointers):
        # a compiled kernel (None under the interpreter), for aligned pointers
        _COMPILED[p] = (ck, driver.active.get_current_device(), _template(p.kernel(), constexprs, len(args)),
                        pointers)


def _hooked(hook) -> bool:
    """Whether Triton's launch hook ``hook`` (knobs.runtime's) would call anything: None, or a HookChain with no
    hook in it (Triton 3.6's default), calls nothing."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _template(kernel, constexprs: dict, n_args: int) -> list:
    """The JIT's argument list for ``kernel`` (every parameter in order, constexprs included, as Triton's launcher
    takes them) as (index into the runtime arguments, or -1 and the constexpr's value)."""
    out, i = [], 0
    for prm in kernel.params:
        if prm.is_constexpr:
            out.append((-1, constexprs[prm.name]))
        else:
            out.append((i, None))
            i += 1
    if i != n_args:
        raise RuntimeError(f"{kernel.__name__} takes {i} runtime arguments, the launch gave {n_args}")
    return out


def forward(q, k, v, spec, group=None, timeout_s: float | None = None, config=None, segment_ids=None):
    """Launch the fused kernel on this rank's shards; returns (out, lse). Inputs already validated.
    ``config`` (a ring_core.plans.KernelConfig) overrides the tuned defaults: for tuning only.
    ``segment_ids``: this rank's ids (int32 [batch, seq_local], layout order; [2, ...] with ``spec.kv_ids``,
    the keys' after the queries') when ``spec.segmented``, else None; the window is ``spec.window``."""
    p, ctx, ring = _prepare(q, spec, group, config, backward=False)
    seg = _segment_ids(spec, segment_ids, q.device)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, lse, status = _outputs(p, q.device)
    _with_scratch(p)
    _launch(p, q, k, v, seg, ctx, *p.scalars(timeout_s), out, lse, status)
    lifecycle.track(status, ring, timeout_s)
    return out, lse


def check_fits(spec, group=None, *, backward: bool = False, deterministic: bool = False):
    """Raise HeapTooSmallError now if a call with ``spec`` over ``group`` (and, ``backward``, its backward) would not
    fit the heap."""
    h = _heap.get()
    n = len(ring_of(h, group)[0])
    h.plan(spec, n)
    if backward:
        h.plan_bwd(spec, n, deterministic=deterministic)


def check_backward_fits(spec, group=None, deterministic: bool = False):
    """Raise HeapTooSmallError now if the backward of a call with ``spec`` over ``group`` would not fit the heap
    (``deterministic``: the backward's, which picks its kernel)."""
    h = _heap.get()
    h.plan_bwd(spec, len(ring_of(h, group)[0]), deterministic=deterministic)


def backward(q, k, v, out, lse, dout, spec, group=None, timeout_s: float | None = None, config=None, dlse=None,
             segment_ids=None, deterministic: bool = False):
    """Launch the fused backward kernel (ring_core.kernels.tl_bwd, or ring_core.kernels.gluon_bwd) on this rank's
    shards, from the forward's ``out`` and ``lse`` and the gradients ``dout`` and ``dlse`` (None: lse carries none);
    returns (dq, dk, dv). Same launch maths (ring_core.plans.plan_bwd) and argument list as the JAX launcher
    (jax_ring.fused.backward). ``config`` (a ring_core.plans.BwdKernelConfig) overrides the defaults: for tuning only.
    ``segment_ids`` as in ``forward``. ``deterministic``: as torch_bridge.ring_attention's
    (torch.use_deterministic_algorithms(True), read now, turns it on too); it picks the backward's kernel
    (ring_core.plans.BwdKernelConfig.get_default)."""
    deterministic = validate.check_deterministic(deterministic, torch.are_deterministic_algorithms_enabled())
    p, ctx, ring = _prepare(q, spec, group, config, backward=True, deterministic=deterministic)
    seg = _segment_ids(spec, segment_ids, q.device)
    q, k, v, out = (x.contiguous() for x in (q, k, v, out))
    dout = dout.to(q.dtype).contiguous()
    lse = lse.to(torch.float32).contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.to(torch.float32).contiguous()
    dq, dk, dv, delta, status = _outputs(p, q.device)  # delta: scratch, rowsum(dO * O) (and the Gluon dQ sums)
    _with_scratch(p)
    _launch(p, q, k, v, out, dout, lse, dlse, seg, ctx, *p.scalars(timeout_s), dq, dk, dv, delta, status)
    lifecycle.track(status, ring, timeout_s)
    return dq, dk, dv
