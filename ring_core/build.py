"""The compile of a fused launch for a GPU, for launchers that do not go through Triton's JIT (the JAX frontend):
a kernel, the Triton types of its runtime arguments and its constexprs -> ``Binary``: the PTX and what a launch
of it needs (entry name, shared memory, *total* warps, global scratch per program).

It goes through ``triton.compile``, so through Triton's on-disk cache (``TRITON_CACHE_DIR``): a kernel compiled
once on a machine (by any rank, any frontend, an earlier process) is not compiled again. Pointers are declared
16-byte aligned, as Triton's JIT specialises the aligned tensors torch passes, and the integer scalars are not
specialised on their values: the kernels mark them ``do_not_specialize``, so torch's JIT compiles the same
binary (and one binary serves every batch and sequence length).

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


def runtime_arg_names(kernel) -> list:
    """The kernel's non-constexpr argument names, in order (what a launch passes)."""
    return [p.name for p in kernel.params if not p.is_constexpr]


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

    def scratch_bytes(self, grid) -> int:
        """Bytes of global scratch a launch over ``grid`` needs (Triton's launcher: per program x programs)."""
        n = 1
        for g in grid:
            n *= int(g)
        return self.global_scratch * n * self.num_ctas


def signature(kernel, arg_types, constexprs: dict):
    """(signature, attrs) for ``triton.compile``: ``arg_types`` are the Triton types ("*bf16", "i32", "fp32",
    ...) of ``runtime_arg_names(kernel)``, in order; pointers are 16-byte aligned."""
    names = runtime_arg_names(kernel)
    if len(arg_types) != len(names):
        raise ValueError(f"{kernel.__name__} takes {len(names)} runtime arguments {names}, got {len(arg_types)} types")
    sig = dict(zip(names, arg_types))
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{kernel.__name__}: constexprs {missing} not given")
    sig.update({k: "constexpr" for k in constexprs})
    order = [p.name for p in kernel.params]
    sig = {k: sig[k] for k in order if k in sig}
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    return sig, attrs


def compile_kernel(kernel, arg_types, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90):
    """Triton's CompiledKernel for an NVIDIA GPU of compute ``capability`` (90: Hopper), through its cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = signature(kernel, arg_types, constexprs)
    src = ASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def binary(kernel, arg_types, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90) -> Binary:
    """``compile_kernel``, as a ``Binary``; raises where the compiled kernel needs a launch feature that a plain
    launch does not give (profiling scratch, cooperative grids, programmatic dependent launch, clusters)."""
    ck = compile_kernel(kernel, arg_types, constexprs, num_warps=num_warps, num_stages=num_stages,
                        capability=capability)
    md = ck.metadata
    unsupported = {"profile_scratch_size": getattr(md, "profile_scratch_size", 0) or 0,
                   "launch_cooperative_grid": bool(getattr(md, "launch_cooperative_grid", False)),
                   "launch_pdl": bool(getattr(md, "launch_pdl", False)),
                   "num_ctas > 1": getattr(md, "num_ctas", 1) > 1}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise NotImplementedError(f"{kernel.__name__} compiled to a kernel whose launch needs {bad}")
    return Binary(name=md.name, num_warps=md.num_warps, num_ctas=getattr(md, "num_ctas", 1), shared=md.shared,
                  global_scratch=md.global_scratch_size or 0, global_scratch_align=md.global_scratch_align or 1,
                  capability=capability, key=ck.hash, ptx=ck.asm["ptx"])
