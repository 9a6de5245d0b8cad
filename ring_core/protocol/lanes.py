"""Index vectors that the protocol's vector helpers (ring_core.protocol.steps) build, in whichever language calls them.

The protocol is one ``triton.language`` source. The tl kernels call it, and so does the Gluon Hopper kernel
(ring_core.kernels.gluon_fwd), which compiles the same helpers under Gluon's semantics. There every tensor needs a
layout, and ``tl.arange`` has none (Triton 3.6 and 3.9: Gluon's ``arange`` takes one). These builtins give the
helpers their index vectors in both: ``tl.arange`` under triton.language; under Gluon, a blocked layout over the
warps that run the code (``gl.num_warps()``: a partition's own count inside ``gl.warp_specialize``), one element
per thread along a vector, rows over warps for a tile. Only the vectors' layouts differ: every value computed from
them is the same, and a tl kernel compiles to the same IR as with ``tl.arange``.
"""

import inspect

import triton.language as tl
from triton.language.core import TRITON_BUILTIN, _unwrap_if_constexpr


def _builtin(fn):
    """Mark ``fn`` a Triton builtin (the compiler calls it with ``_semantic``, the language of the caller). Unlike
    ``triton.language.core.builtin`` it may be called without one: Triton's interpreter runs jit functions as
    Python and patches only triton.language's own builtins, so there ``fn`` falls back on ``tl.arange``, which
    the interpreter has patched."""
    setattr(fn, TRITON_BUILTIN, True)
    fn.signature = inspect.signature(fn)
    return fn


def _gluon(semantic) -> bool:
    return type(semantic).__name__.startswith("Gluon")


def _warps(semantic, generator) -> int:
    return _unwrap_if_constexpr(semantic.num_warps(generator))


@_builtin
def iota(n, _semantic=None, _generator=None):
    """``tl.arange(0, n)``, in either language."""
    n = _unwrap_if_constexpr(n)
    if _semantic is None:  # the interpreter
        return tl.arange(0, n)
    if not _gluon(_semantic):
        return _semantic.arange(0, n)
    from triton.experimental.gluon import language as gl

    return _semantic.arange(0, n, gl.BlockedLayout([1], [32], [_warps(_semantic, _generator)], [0]))


@_builtin
def iota2(rows, cols, vec=1, _semantic=None, _generator=None):
    """``(tl.arange(0, rows)[:, None], tl.arange(0, cols)[None, :])``, the row and column indices of a
    [rows, cols] tile, in either language; under Gluon ``vec`` contiguous columns per thread (16-byte accesses
    where the caller knows them aligned)."""
    rows, cols, vec = (_unwrap_if_constexpr(x) for x in (rows, cols, vec))
    if _semantic is None:  # the interpreter
        return tl.arange(0, rows)[:, None], tl.arange(0, cols)[None, :]
    if not _gluon(_semantic):
        r, c = _semantic.arange(0, rows), _semantic.arange(0, cols)
    else:
        from triton.experimental.gluon import language as gl

        vec = max(1, min(vec, cols))
        across = max(1, min(32, cols // vec))
        tile = gl.BlockedLayout([1, vec], [32 // across, across], [_warps(_semantic, _generator), 1], [1, 0])
        r = _semantic.arange(0, rows, gl.SliceLayout(1, tile))
        c = _semantic.arange(0, cols, gl.SliceLayout(0, tile))
    return _semantic.expand_dims(r, 1), _semantic.expand_dims(c, 0)
