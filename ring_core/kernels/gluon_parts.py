"""Gluon primitives both Hopper kernels (ring_core.kernels.gluon_fwd, gluon_bwd) use: Triton-version shims of the TMA
copies and the CTA barrier, one-word buffers between partitions, the bounded acquire of a chunk's flag, and freeing a
slot's barrier."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ring_core.protocol.steps import ERR_KV_TIMEOUT, poll_ge, record_error

# Gluon's TMA copies were renamed after Triton 3.6 (async_copy_global_to_shared -> async_load, ...); the GPU
# machine runs 3.6, CI 3.9.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # (3.9 / 3.6)
if hasattr(tma, "async_atomic_add"):
    tma_add = tma.async_atomic_add  # a shared-memory tile added into global memory by a TMA bulk reduction
else:  # Triton 3.6 builds the op (ttng.async_tma_reduce) but its Gluon language has no function for it yet
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

_WORD_LAYOUT_1 = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # the load partition's one warp
_WORD_LAYOUT_4 = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # a consumer's warpgroup


@gluon.jit
def _acquire_chunk(flag, epoch, ctl, timeout_ns, src, step, c):
    """The bounded acquire of one chunk's flag (the protocol's ``poll_ge``; a wait that gives up is recorded as the
    tl kernel's are), then the generic proxy ordered before the async one (TMA) that reads the chunk."""
    if poll_ge(flag, epoch, ctl, timeout_ns, False) == 0:
        record_error(ctl, ERR_KV_TIMEOUT, src, step, c)
    gl.inline_asm_elementwise("fence.proxy.async.global;\n mov.b32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _put(words, k, value):
    """Word ``k`` of ``words`` (a [n, 1] int32 buffer) = ``value``, from a one-warp partition (the load warp, the
    planner): what ``_tile_word`` reads once the barrier after it has passed."""
    words.index(k).store(gl.full([1], value, gl.int32, _WORD_LAYOUT_1))


@gluon.jit
def _tile_word(tword, k, WARPS: gl.constexpr = 4):
    """Word ``k`` of ``tword`` (``_load_q``), in a partition of ``WARPS`` warps after the barrier that published it:
    a consumer's warpgroup (``_WORD_LAYOUT_4``), or the backward's one-warp dQ writer (``_WORD_LAYOUT_1``)."""
    return gl.max(tword.index(k).load(gl.BlockedLayout([1], [32], [WARPS], [0])), axis=0)


@gluon.jit
def release(kv_empty, s):
    """This consumer partition is done with slot s (it waited for its own MMAs): one thread frees its share of it
    (Gluon's arrive is thread 0's), and the producer may refill it once every consumer has."""
    release_bar(kv_empty.index(s))


@gluon.jit
def release_bar(bar):
    """``release`` of one barrier (e.g. a half of Q's buffer): this partition is done with what ``bar`` guards."""
    cta_barrier()  # within a partition: a named barrier of its warps only
    mbarrier.arrive(bar, count=1)
