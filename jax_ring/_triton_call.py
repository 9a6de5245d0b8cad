"""The fused kernels as XLA custom calls: our own lowering onto jaxlib's Triton custom call
(``triton_kernel_call``, the one jax-triton uses), launching exactly the kernel that ``ring_core.runtime.build``
compiled.

Why not jax-triton's ``triton_call`` (0.3.1): it compiles outside Triton's cache (every process compiles every
kernel again, each time it starts) and launches ``num_warps`` as asked, not the compiled kernel's total (a
warp-specialised kernel has more) and with no global scratch (device-side TMA descriptors need it). Here:

* the kernel is compiled when the call is traced, through ``triton.compile`` and its on-disk cache
  (ring_core.runtime.build), for this process's GPU; the result (``Binary``) is a static parameter of the primitive;
* the launch has the binary's total warps and shared memory; when the binary needs global scratch, the call
  gets one more output, a byte buffer of ``Binary.scratch_bytes(grid)``, passed as the argument after the
  kernel's own, where the compiled kernel takes its scratch pointer (jaxlib appends two null pointers for the
  scratch and profiling arguments; with ours in front, the kernel reads ours and ignores the trailing null);
* pointers are checked 16-byte aligned at launch (jaxlib; the binary assumes it), the scratch buffer to the
  binary's alignment; outputs named in ``zeroed_outputs`` are zeroed before the launch.

The call's interface is jax-triton's ``triton_call`` (positional inputs and scalars, ``out_shape``, ``grid``,
constexprs as keywords), plus ``scalar_types`` (the Triton types of the scalars, from the launch plan).
Outputs are typed as the same on every device, as jax-triton's; jax_ring.fused types them for check_vma.
"""

from __future__ import annotations

import zlib

import numpy as np

import jax
from jax.interpreters import mlir

from ring_core.runtime import build

try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - older JAX
    from jax.core import Primitive

from jax._src import core as _core
from jax._src import dispatch as _dispatch

_SCALAR = (bool, int, float, np.integer, np.floating)


def _gpu_triton():
    """jaxlib's Triton custom-call library (a GPU build of JAX has it; CPU builds do not)."""
    from jax._src.lib import gpu_triton

    if not hasattr(gpu_triton, "TritonKernelCall"):
        raise RuntimeError("backend='fused' needs a GPU (CUDA) build of JAX: jaxlib has no Triton custom call here")
    return gpu_triton


def capability() -> int:
    """Compute capability of this process's first local GPU, as Triton's target (90 for sm_90)."""
    cc = jax.local_devices()[0].compute_capability
    major, minor = str(cc).split(".")
    return int(major) * 10 + int(minor)


def _abstract(*avals, out_shapes, binary, grid, **_):
    outs = [_core.ShapedArray(s.shape, s.dtype) for s in out_shapes]
    if binary.global_scratch:
        outs.append(_core.ShapedArray((binary.scratch_bytes(grid),), np.dtype(np.uint8)))
    return outs


def kernel_params(lib, *, layout, n_inputs, out_shapes, zeroed_outputs, scalars, binary):
    """jaxlib's parameter list for one launch (``lib``: jaxlib's gpu_triton). ``layout``: for each kernel
    argument, "a" (the next array: the inputs, then the outputs), the index of its scalar in ``scalars``
    ((value, Triton type) pairs), or None (a scalar the binary has as a constexpr); then the global scratch
    buffer, if the binary needs one."""
    params, arrays = [], 0
    for slot in layout:
        if slot is None:  # a scalar compiled into the binary
            continue
        if slot != "a":
            params.append(lib.create_scalar_parameter(*scalars[slot]))
            continue
        k = arrays - n_inputs  # >= 0: an output
        zero = 0
        if k in zeroed_outputs:
            zero = int(np.prod(out_shapes[k].shape)) * np.dtype(out_shapes[k].dtype).itemsize
        params.append(lib.create_array_parameter(zero, 16))
        arrays += 1
    if binary.global_scratch:
        params.append(lib.create_array_parameter(0, max(16, binary.global_scratch_align)))
    return params


def _lowering(ctx, *arrays, out_shapes, binary, grid, scalars, layout, zeroed_outputs, name):
    lib = _gpu_triton()
    params = kernel_params(lib, layout=layout, n_inputs=len(arrays), out_shapes=out_shapes,
                           zeroed_outputs=zeroed_outputs, scalars=scalars, binary=binary)
    kernel = lib.TritonKernel(binary.name, binary.num_warps, binary.num_ctas, binary.shared, binary.ptx, "",
                              binary.capability)
    call = lib.TritonKernelCall(kernel, *(list(grid) + [1, 1])[:3], params)
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2,
                                backend_config=zlib.compress(call.to_proto(name, b"")))
    return rule(ctx, *arrays)


ring_kernel_call_p = Primitive("ring_attention_kernel_call")
ring_kernel_call_p.multiple_results = True
ring_kernel_call_p.def_impl(lambda *args, **params: _dispatch.apply_primitive(ring_kernel_call_p, *args, **params))
ring_kernel_call_p.def_abstract_eval(_abstract)
mlir.register_lowering(ring_kernel_call_p, _lowering, platform="cuda")


def _arg_type(x) -> str:
    return "*" + build.TRITON_TYPES[str(np.dtype(x.dtype))]


def describe(args, out_shape, scalar_types):
    """(arrays, scalars, layout, Triton types of the kernel's runtime arguments) of a launch on ``args`` (arrays
    and scalars in the kernel's argument order, the outputs left out) writing ``out_shape``."""
    is_scalar = [isinstance(a, _SCALAR) for a in args]
    if sum(is_scalar) != len(scalar_types):
        raise ValueError(f"{sum(is_scalar)} scalars but {len(scalar_types)} scalar types")
    arrays, scalars, layout, types = [], [], [], []
    for a, s in zip(args, is_scalar):
        if s:
            ty = scalar_types[len(scalars)]
            layout.append(len(scalars))
            scalars.append((a.item() if isinstance(a, np.generic) else a, ty))
        else:
            arrays.append(a)
            layout.append("a")
            ty = _arg_type(a)
        types.append(ty)
    layout += ["a"] * len(out_shape)
    types += [_arg_type(o) for o in out_shape]
    return arrays, tuple(scalars), tuple(layout), types


def triton_call(*args, kernel, out_shape, grid, name: str, num_warps: int, num_stages: int,
                scalar_types, zeroed_outputs=(), **constexprs):
    """Launch ``kernel`` (a Triton JITFunction) on ``args`` (arrays and scalars, in the kernel's argument order,
    the outputs' arguments left out: they follow the inputs) and return its outputs (``out_shape``, a list of
    jax.ShapeDtypeStruct). ``scalar_types``: the Triton type of each scalar, in order."""
    arrays, scalars, layout, types = describe(args, out_shape, scalar_types)
    values = [None if slot == "a" else scalars[slot][0] for slot in layout]
    binary = build.binary(kernel, types, constexprs, num_warps=num_warps, num_stages=num_stages,
                          capability=capability(), values=values)
    # Scalars equal to 1 were compiled in (Triton's JIT specialisation, ring_core.runtime.build): not passed.
    names = build.runtime_arg_names(kernel)
    layout = tuple(None if names[i] in binary.folded else slot for i, slot in enumerate(layout))
    outs = ring_kernel_call_p.bind(
        *arrays, out_shapes=tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_shape), binary=binary,
        grid=tuple(int(g) for g in grid), scalars=scalars, layout=layout, zeroed_outputs=tuple(zeroed_outputs),
        name=name)
    return list(outs[:len(out_shape)])  # without the scratch buffer
