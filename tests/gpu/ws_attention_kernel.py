"""A kernel whose launch needs what jax-triton 0.3.1 does not give: a plain non-causal attention forward (one
flat loop, device-side TMA descriptors, Triton's Hopper warp specialisation), so that its compiled form has
more warps than asked for (the partitions') and needs global scratch (the descriptors). tests/cpu/test_build.py
compiles it for sm_90 on CPU and checks what ring_core.runtime.build reports; tests/gpu/gpu_checks.py (section "launch")
runs it on the GPU through jax_ring._triton_call and torch's JIT and checks both against float64.

Layout: q, k, v, out [rows = heads * seq, D] (heads stacked), one program per (query block, head).
"""

import numpy as np
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seq"])
def ws_attention_kernel(q_ptr, k_ptr, v_ptr, sm_scale, seq, out_ptr, H: tl.constexpr, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = H * seq
    dq = tl.make_tensor_descriptor(q_ptr, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    dk = tl.make_tensor_descriptor(k_ptr, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    dv = tl.make_tensor_descriptor(v_ptr, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    do = tl.make_tensor_descriptor(out_ptr, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    row0 = head * seq
    q = dq.load([row0 + pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    scale = sm_scale * 1.4426950408889634  # exp2
    for start in tl.range(0, seq, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        s = tl.dot(q, dk.load([row0 + start, 0]).T) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), dv.load([row0 + start, 0]), acc * alpha[:, None])
        m_i = m_new
    do.store([row0 + pid_m * BLOCK_M, 0], (acc / l_i[:, None]).to(q.dtype))


CONSTEXPRS = dict(BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True)
NUM_WARPS, NUM_STAGES = 4, 2


def grid(heads: int, seq: int) -> tuple:
    return (seq // CONSTEXPRS["BLOCK_M"], heads)


def reference(q, k, v, heads: int, scale: float):
    """float64 attention of [heads * seq, D] arrays, head by head."""
    q, k, v = (np.asarray(x, np.float64).reshape(heads, -1, x.shape[-1]) for x in (q, k, v))
    s = q @ k.transpose(0, 2, 1) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return ((p / p.sum(-1, keepdims=True)) @ v).reshape(-1, q.shape[-1])
