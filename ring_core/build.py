"""The compile of a fused launch for a GPU, for launchers that do not go through Triton's JIT (the JAX frontend):
a kernel, the Triton types of its runtime arguments and its constexprs -> ``Binary``: the PTX and what a launch
of it needs (entry name, shared memory, *total* warps, global scratch per program).

It goes through ``triton.compile``, so through Triton's on-disk cache (``TRITON_CACHE_DIR``): a kernel compiled
once on a machine (by any rank, any frontend, an earlier process) is not compiled again. It specialises as
Triton's JIT does for the arguments torch passes, so that torch's JIT launch and this one compile the same
binary (the same cache entry): pointers 16-byte aligned; an integer scalar (unless the kernel marks it
``do_not_specialize``) known divisible by 16 when it is, and folded into a constexpr when it is 1. The
sequence length matters here: the backward compiled for a length known divisible by 16 spills half as much
(ptxas, sm_90, bf16 D128: 284 against 496 bytes of spill stores).

What a launcher must honour (Triton's own launcher does; jax-triton 0.3.1 does neither):
* ``num_warps`` is the compiled kernel's total: Hopper warp specialisation adds partitions' warps to the
  ``num_warps`` asked for (Triton records the total in the module, ``ttg.total-num-warps``);
* ``global_scratch`` bytes per program (aligned to ``global_scratch_align``), one buffer for the grid, passed
  as the argument after the kernel's own: device-side TMA descriptors live there. Zero for kernels that need
  none.

Runs without a GPU: Triton compiles for a GPU target on any machine (tests/test_build.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64",
                "uint8": "u8", "int8": "i8", "uint32": "u32"}


def _params(kernel) -> list:
    """The kernel's parameters (Triton's KernelParam: name, is_constexpr, do_not_specialize), also for a kernel
    the interpreter holds (TRITON_INTERPRET=1 wraps it without them: rebuilt from the same decorator flags)."""
    if hasattr(kernel, "params"):
        return kernel.params
    from triton.runtime.jit import JITFunction

    return JITFunction(kernel.fn, **kernel.kwargs).params


def runtime_arg_names(kernel) -> list:
    """The kernel's non-constexpr argument names, in order (what a launch passes)."""
    return [p.name for p in _params(kernel) if not p.is_constexpr]


@dataclass(frozen=True)
class Binary:
    """A compiled kernel as a launcher outside Triton needs it. Hashable and compared by its cache key, so that
    it can be a static parameter of a JAX primitive; its repr is short (it shows in jaxprs)."""

    name: str
    num_warps: int  # total warps per program, warp-specialised partitions included
    num_ctas: int
    shared: int  # bytes of dynamic shared memory
    global_scratch: int  # bytes per program (0: none)
    global_scratch_align: int
    capability: int
    key: str  # Triton's cache hash of the compile
    ptx: str = field(repr=False, compare=False)
    folded: tuple = ()  # integer scalars equal to 1, compiled in as constexprs: not passed at launch

    def scratch_bytes(self, grid) -> int:
        """Bytes of global scratch a launch over ``grid`` needs (Triton's launcher: per program x programs)."""
        n = 1
        for g in grid:
            n *= int(g)
        return self.global_scratch * n * self.num_ctas


INT_TYPES = ("i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")


def specialize(kernel, arg_types, values=None):
    """Triton's JIT specialisation of the integer scalars: (arg_types with the scalars equal to 1 as "constexpr",
    {name: 1} of those, names known divisible by 16). ``values``: the runtime arguments, in the order of
    ``runtime_arg_names(kernel)`` (None, or None for an array: nothing specialised)."""
    names = runtime_arg_names(kernel)
    params = {p.name: p for p in _params(kernel)}
    types, ones, divisible = list(arg_types), {}, set()
    for i, (name, ty) in enumerate(zip(names, arg_types)):
        v = None if values is None else values[i]
        if ty not in INT_TYPES or v is None or isinstance(v, bool) or params[name].do_not_specialize:
            continue
        if int(v) == 1:
            types[i] = "constexpr"
            ones[name] = 1
        elif int(v) % 16 == 0:
            divisible.add(name)
    return types, ones, divisible


def signature(kernel, arg_types, constexprs: dict, divisible=()):
    """(signature, attrs) for ``triton.compile``: ``arg_types`` are the Triton types ("*bf16", "i32", "fp32",
    "constexpr" for a scalar folded in, ...) of ``runtime_arg_names(kernel)``, in order; pointers are 16-byte
    aligned, and so are the integer scalars named in ``divisible`` (known divisible by 16)."""
    names = runtime_arg_names(kernel)
    if len(arg_types) != len(names):
        raise ValueError(f"{kernel.__name__} takes {len(names)} runtime arguments {names}, got {len(arg_types)} types")
    sig = dict(zip(names, arg_types))
    missing = [p.name for p in _params(kernel) if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{kernel.__name__}: constexprs {missing} not given")
    sig.update({k: "constexpr" for k in constexprs})
    order = [p.name for p in _params(kernel)]
    sig = {k: sig[k] for k in order if k in sig}
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in divisible}
    return sig, attrs


def compile_kernel(kernel, arg_types, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90,
                   values=None):
    """Triton's CompiledKernel for an NVIDIA GPU of compute ``capability`` (90: Hopper), through its cache;
    ``values``: the runtime arguments (as in ``specialize``), for the integer scalars' specialisation."""
    return _compile(kernel, specialize(kernel, arg_types, values), constexprs, num_warps, num_stages, capability)


def _compile(kernel, specialized, constexprs: dict, num_warps: int, num_stages: int, capability: int):
    """``compile_kernel`` from ``specialize``'s result."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types, ones, divisible = specialized
    consts = dict(constexprs, **ones)
    sig, attrs = signature(kernel, types, consts, divisible)
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def binary(kernel, arg_types, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90,
           values=None) -> Binary:
    """``compile_kernel``, as a ``Binary``; raises where the compiled kernel needs a launch feature that a plain
    launch does not give (profiling scratch, cooperative grids, programmatic dependent launch, clusters)."""
    specialized = specialize(kernel, arg_types, values)
    ck = _compile(kernel, specialized, constexprs, num_warps, num_stages, capability)
    md = ck.metadata
    unsupported = {"profile_scratch_size": getattr(md, "profile_scratch_size", 0) or 0,
                   "launch_cooperative_grid": bool(getattr(md, "launch_cooperative_grid", False)),
                   "launch_pdl": bool(getattr(md, "launch_pdl", False)),
                   "num_ctas > 1": getattr(md, "num_ctas", 1) > 1}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise NotImplementedError(f"{kernel.__name__} compiled to a kernel whose launch needs {bad}")
    folded = tuple(specialized[1])
    return Binary(name=md.name, num_warps=md.num_warps, num_ctas=getattr(md, "num_ctas", 1), shared=md.shared,
                  global_scratch=md.global_scratch_size or 0, global_scratch_align=md.global_scratch_align or 1,
                  capability=capability, key=ck.hash, ptx=ck.asm["ptx"], folded=folded)
