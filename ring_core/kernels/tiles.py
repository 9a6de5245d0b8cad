"""What the tiles of both kernels share (ring_core.kernels.tl_fwd, ring_core.kernels.tl_bwd): the dot they use in every
dtype, the load of one K/V block, and the order tiles are taken in."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        # Triton's interpreter multiplies bf16 tensors as their raw uint16 bits; float32 operands give
        # the tensor-core result (bf16/fp16 products are exact in float32, accumulation is float32).
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
    else:
        return tl.dot(a, b)


@triton.jit
def load_kv(k_base, v_base, kv_off, row_ok, dmask, MASKED: tl.constexpr, FULL_D: tl.constexpr):
    """One K and one V block. MASKED: only rows with ``row_ok``; otherwise every row exists and needs no mask
    (a maskless load is what lets the unmasked loops vectorise and pipeline fully)."""
    if MASKED:
        k = tl.load(k_base + kv_off, mask=row_ok[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_base + kv_off, mask=row_ok[:, None] & dmask[None, :], other=0.0)
    elif FULL_D:
        k = tl.load(k_base + kv_off)
        v = tl.load(v_base + kv_off)
    else:
        k = tl.load(k_base + kv_off, mask=dmask[None, :], other=0.0)
        v = tl.load(v_base + kv_off, mask=dmask[None, :], other=0.0)
    return k, v


@triton.jit
def heavy_first(m_blk, n_m, CAUSAL: tl.constexpr):
    """Query block ``m_blk`` of ``n_m`` in the order tiles are taken. Causal: heaviest first (the work of a
    query tile grows with its local row in both layouts), so the grid's last programs are its lightest and
    the GPU's tail is short (flash-attention does the same)."""
    if CAUSAL:
        m_blk = n_m - 1 - m_blk
    return m_blk


@triton.jit
def query_tile(t, G, n_m, HKV, CAUSAL: tl.constexpr):
    """The query tile of task ``t`` (forward tiles and backward dQ tasks; G and HKV may be run-time
    values): (batch, head, kv head, query block). The heads
    sharing a kv head fastest, so the programs side by side read one kv head's K/V (L2 reuse), then the query
    blocks (``heavy_first``), then kv heads and batches."""
    g = t % G
    t = t // G
    m_blk = heavy_first(t % n_m, n_m, CAUSAL)
    t = t // n_m
    hkv = t % HKV
    return t // HKV, hkv * G + g, hkv, m_blk
