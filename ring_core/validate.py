"""Argument checks shared by both frontends: every user error raises before any work is done."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ring_core.layout import LAYOUTS

BACKENDS = ("auto", "fused", "xla", "torch")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionSpec:
    """Normalised, validated description of one ring-attention call (per rank)."""

    batch: int
    seq_local: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    scale: float
    is_causal: bool
    layout: str

    @property
    def group(self) -> int:
        """Query heads per kv head (1 for MHA, num_heads for MQA)."""
        return self.num_heads // self.num_kv_heads


def dtype_name(dtype) -> str:
    """'bfloat16' for jnp.bfloat16, np.dtype('float16'), torch.bfloat16, ..."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    return str(dtype).replace("torch.", "")


def check_attention_args(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, *, is_causal, scale, layout,
                         backend, backends, return_lse=False) -> AttentionSpec:
    """Validate one call's arguments; ``backends`` lists the backends this frontend accepts."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq_local, heads, head_dim], got shape {tuple(shape)}")
        if any(int(d) < 1 for d in shape):
            raise ValueError(f"{name} has an empty dimension (shape {tuple(shape)}); every dimension must be >= 1")
    b, s, h, d = (int(x) for x in q_shape)
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k_shape)} and v {tuple(v_shape)}")
    kb, ks, hkv, kd = (int(x) for x in k_shape)
    if kb != b:
        raise ValueError(f"batch mismatch: q has batch {b}, k/v have {kb}")
    if ks != s:
        raise ValueError(
            f"seq_local mismatch: q has {s} local tokens, k/v have {ks}; every rank holds the same tokens of q, k and v")
    if kd != d:
        raise ValueError(f"head_dim mismatch: q has {d}, k/v have {kd}")
    if h % hkv:
        raise ValueError(
            f"num_heads ({h}) must be a multiple of num_kv_heads ({hkv}) for grouped-query attention")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}")
    names = [dtype_name(t) for t in (q_dtype, k_dtype, v_dtype)]
    for arg, n in zip("qkv", names):
        if n not in FLOAT_DTYPES:
            raise TypeError(f"{arg} must be a floating dtype ({', '.join(FLOAT_DTYPES)}), got {n}")
    if len(set(names)) != 1:
        raise TypeError(f"q, k and v must share one dtype, got {names[0]}, {names[1]}, {names[2]}; cast them first")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a Python bool, got {type(return_lse).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and s % 2:
        raise ValueError(
            f"layout='zigzag' needs an even seq_local (each rank holds two chunks), got {s}; "
            "pad the sequence to a multiple of 2*world_size")
    if backend not in backends:
        raise ValueError(f"backend must be one of {backends}, got {backend!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) and not hasattr(scale, "__float__"):
            raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
        try:
            scale = float(scale)
        except Exception as e:  # a tracer, a multi-element array, ...
            raise TypeError(f"scale must be a concrete Python float or None (not a traced value): {e}") from None
        if not math.isfinite(scale) or scale < 0:
            raise ValueError(f"scale must be finite and >= 0, got {scale}")
    return AttentionSpec(b, s, h, hkv, d, names[0], scale, is_causal, layout)
