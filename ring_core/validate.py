"""Argument checks shared by both frontends: every user error raises before any work is done."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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
    # Masks beyond causal (ring_core.masks); the defaults mean none, so every caller that predates them works.
    window: tuple = (-1, -1)  # (left, right) in global token order, -1 = unbounded (ring_core.validate.check_window)
    segmented: bool = False  # whether segment ids come with the call (int32 [batch, seq_local] per rank)
    # With segment ids: whether the keys' ids differ from the queries' (int32 [2, batch, seq_local], the queries'
    # then the keys'): the two-level ring's calls with another node's K/V (ring_core.nodes), not a user's call.
    kv_ids: bool = False
    # Where the keys sit in the queries' frame of global positions (a key at the call's position j is at
    # j + key_offset there; ring_core.masks.kernel_window): the two-level ring's calls with another node's K/V
    # under a window (ring_core.nodes), non-causal; 0 for every call a user makes.
    key_offset: int = 0

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


def _type_name(x) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_flag(name: str, value) -> bool:
    """A Python bool (numpy's bool_ too); not an int, a string or a traced value."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a Python bool, got {_type_name(value)} {value!r}")


def check_deterministic(deterministic, forced: bool = False) -> bool:
    """A call's effective ``deterministic``: the keyword (a Python bool, default False as in flash-attn), or True
    where the framework asks every operation for deterministic results (``forced``: the frontend reads
    torch.use_deterministic_algorithms / XLA_FLAGS=--xla_gpu_deterministic_ops=true), so that a program made
    deterministic that way needs no change of ours. TypeError for anything but a bool, before any work."""
    return _check_flag("deterministic", deterministic) or bool(forced)


def check_timeout(timeout_s):
    """None (then RING_ATTENTION_TIMEOUT_S, default 300 s, is read when the fused kernel is launched) or a
    finite number of seconds > 0; returns it as a float (or None)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout_s must be a number of seconds or None, got {_type_name(timeout_s)} {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s}")
    return float(timeout_s)


def check_window(window_size) -> tuple:
    """flash-attn's ``window_size=(left, right)``: query i attends keys j with i - left <= j <= i + right in
    global token order, -1 = unbounded on that side; None = (-1, -1), no window. Returns two Python ints.

    >>> check_window(None), check_window((128, 0))
    ((-1, -1), (128, 0))
    """
    if window_size is None:
        return (-1, -1)
    how = ("pass window_size=(left, right) with two Python ints >= -1 (-1 = unbounded on that side; "
           "e.g. (255, 0) for a causal sliding window of 256 tokens), or None for no window")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {_type_name(window_size)} {window_size!r}; "
                        f"{how}")
    sides = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window_size's {side} side must be a Python int, got {_type_name(w)} {w!r}; {how}")
        if w < -1:
            raise ValueError(f"window_size's {side} side must be >= -1, got {int(w)}; {how}")
        sides.append(int(w))
    return tuple(sides)


def check_segment_ids(shape, dtype, batch: int, seq_local: int, what: str = "segment_ids") -> None:
    """Segment ids are int32 ``[batch, seq_local]``: one id per token of this rank's shard, in the shard's
    (layout) order, serving both its queries and its keys; a negative id marks a padding token."""
    name = dtype_name(dtype)
    if name != "int32":
        raise TypeError(f"{what} must be int32 (one segment id per token; negative = padding), got dtype {name}; "
                        "cast it (torch: .to(torch.int32), jax/numpy: .astype('int32'))")
    shape = tuple(int(n) for n in shape)
    if shape != (batch, seq_local):
        raise ValueError(f"{what} must have shape [batch, seq_local] = [{batch}, {seq_local}] (this rank's tokens, "
                         f"in the layout's order, like q's first two dimensions), got shape {shape}")


_DIM_NAMES = ("batch", "seq_local", "heads", "head_dim")


def check_attention_args(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, *, is_causal, scale, layout,
                         backend, backends, return_lse=False, window_size=None, segment_ids_shape=None,
                         segment_ids_dtype=None) -> AttentionSpec:
    """Validate one call's arguments; ``backends`` lists the backends this frontend accepts.

    ``window_size`` as in ``check_window``; ``segment_ids_shape`` / ``segment_ids_dtype``: those of the call's
    segment ids (None: no segment ids), checked by ``check_segment_ids``. The defaults mean no mask beyond
    ``is_causal``.

    Empty inputs (any dimension 0) are rejected, as flash-attn rejects batch 0: in a ring an empty shard
    means the sequence was split wrongly, and one rank skipping the exchange would leave its peers waiting.
    """
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq_local, heads, head_dim], got shape {tuple(shape)}")
        empty = [f"{dim}=0" for dim, n in zip(_DIM_NAMES, shape) if int(n) < 1]
        if empty:
            raise ValueError(f"{name} is empty ({', '.join(empty)}, shape {tuple(shape)}): every dimension must be "
                             ">= 1; empty inputs are rejected, not passed through")
    b, s, h, d = (int(x) for x in q_shape)
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k_shape)} and v {tuple(v_shape)}")
    kb, ks, hkv, kd = (int(x) for x in k_shape)
    if kb != b:
        raise ValueError(f"batch mismatch: q has batch {b}, k/v have {kb}")
    if ks != s:
        raise ValueError(
            f"seq_local mismatch: q has {s} local tokens, k/v have {ks}; every rank holds the same tokens of q, k "
            "and v")
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
    is_causal = _check_flag("is_causal", is_causal)
    _check_flag("return_lse", return_lse)
    check_layout(layout)
    if layout == "zigzag" and s % 2:
        raise ValueError(
            f"layout='zigzag' needs an even seq_local (each rank holds two chunks), got {s}; "
            "pad the sequence to a multiple of 2*world_size")
    if not isinstance(backend, str) or backend not in backends:
        raise ValueError(f"backend must be one of {backends}, got {backend!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        # >= 0: a negative scale would turn the causal mask's -inf into +inf in a kernel that scales the
        # masked scores; 0 is fine (uniform weights).
        if (isinstance(scale, (bool, np.bool_))
                or not isinstance(scale, (int, float)) and not hasattr(scale, "__float__")):
            raise TypeError(f"scale must be a Python float or None, got {_type_name(scale)}")
        if getattr(scale, "ndim", 0) != 0:
            raise TypeError(f"scale must be one number (a Python float or a 0-d array) or None, "
                            f"got a {_type_name(scale)} of shape {tuple(scale.shape)}")
        try:
            scale = float(scale)
        except Exception as e:  # a traced JAX value
            raise TypeError(f"scale must be a concrete Python float or None, not a traced value ({_type_name(scale)}); "
                            f"pass it as a static Python number: {str(e).splitlines()[0]}") from None
        if not math.isfinite(scale) or scale < 0:
            raise ValueError(f"scale must be finite and >= 0, got {scale}")
    window = check_window(window_size)
    segmented = segment_ids_shape is not None
    if segmented:
        check_segment_ids(segment_ids_shape, segment_ids_dtype, b, s)
    elif segment_ids_dtype is not None:
        raise TypeError("segment_ids_dtype was given without segment_ids_shape; pass both (or neither)")
    return AttentionSpec(b, s, h, hkv, d, names[0], scale, is_causal, layout, window, segmented)


def check_attention_args_remembered(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, *, is_causal, scale,
                                    layout, backend, backends, return_lse=False, window_size=None,
                                    segment_ids_shape=None, segment_ids_dtype=None) -> AttentionSpec:
    """``check_attention_args`` for a frontend that checks a call at every call (torch, eager), where these checks
    were a fifth of a call's host time before the launch (one H200): arguments seen before
    give the spec they gave (``_SPECS``). Only arguments of exact plain types are remembered, so that a value a
    check rejects by its type (``is_causal=1``, a numpy scalar, a traced value) is never taken for an equal one that
    passed. Not under a tracer that guards on what it reads (torch.compile: a global dict would recompile)."""
    key = _spec_key(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, is_causal, scale, layout, backend,
                    backends, return_lse, window_size, segment_ids_shape, segment_ids_dtype)
    try:
        spec = _SPECS.get(key) if key is not None else None
    except TypeError:  # an unhashable shape or dtype (a list): the long way
        spec = key = None
    if spec is None:
        spec = check_attention_args(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, is_causal=is_causal,
                                    scale=scale, layout=layout, backend=backend, backends=backends,
                                    return_lse=return_lse, window_size=window_size,
                                    segment_ids_shape=segment_ids_shape, segment_ids_dtype=segment_ids_dtype)
        if key is not None:
            if len(_SPECS) >= 1024:  # a long-running process with ever new shapes: start over
                _SPECS.clear()
            _SPECS[key] = spec
    return spec


_SPECS = {}  # _spec_key(...) -> the AttentionSpec that check_attention_args gave


def _spec_key(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, is_causal, scale, layout, backend, backends,
              return_lse, window_size, segment_ids_shape, segment_ids_dtype):
    """``check_attention_args``' arguments as a key of ``_SPECS``, or None where one whose check depends on its
    type (the flags, the scale, the window, the strings) is not of an exact plain type: checked the long way. The
    shapes and dtypes are checked by value alone (``int(n)``, ``dtype_name``)."""
    if not (type(is_causal) is bool and type(return_lse) is bool and type(scale) in _SCALE_TYPES
            and type(layout) is str and type(backend) is str and type(backends) is tuple):
        return None
    if window_size is not None and not (type(window_size) is tuple and len(window_size) == 2
                                        and type(window_size[0]) is int and type(window_size[1]) is int):
        return None
    return (q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, is_causal, type(scale), scale, layout, backend,
            backends, return_lse, window_size, segment_ids_shape, segment_ids_dtype)


_SCALE_TYPES = (type(None), float, int)


FUSED_DTYPES = ("float16", "bfloat16", "float32")


def check_fused_dtype(dtype, reference: str) -> None:
    """The fused kernels take float16, bfloat16 and float32; TypeError naming ``reference`` (what to use for
    float64) otherwise."""
    name = dtype_name(dtype)
    if name not in FUSED_DTYPES:
        raise TypeError(f"the fused kernel supports float16, bfloat16 and float32 inputs, got {name}; use {reference} "
                        f"for {name}")


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_layout_call(layout, world_size, seq_axis, ndim: int) -> int:
    """The arguments of ``to_layout`` / ``from_layout`` (both frontends); returns ``seq_axis`` as a
    non-negative axis of an array of rank ``ndim``."""
    check_layout(layout)
    if isinstance(world_size, (bool, np.bool_)) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(seq_axis, (bool, np.bool_)) or not isinstance(seq_axis, (int, np.integer)) \
            or not -ndim <= seq_axis < ndim:
        raise ValueError(f"seq_axis={seq_axis!r} is out of range for an array of rank {ndim}")
    return int(seq_axis) % ndim


def check_global_seq(seq: int, world_size: int, layout: str, what: str = "the global sequence length",
                     where: str = "") -> int:
    """A global sequence of ``seq`` tokens splits over ``world_size`` ranks (into 2 * world_size chunks for
    zigzag); returns seq_local. ``what`` / ``where`` name the array and the mesh axis in the message."""
    need = 2 * world_size if layout == "zigzag" else world_size
    if seq % need:
        raise ValueError(f"{what}={seq}, not a multiple of {need} ({'2*' if layout == 'zigzag' else ''}world_size, "
                         f"world_size={world_size}{where}); pad the sequence")
    return seq // world_size


def check_segment_ids_given(spec: "AttentionSpec", given: bool, shape=None) -> None:
    """The launchers' guard: segment ids are passed exactly when the (validated) spec says the call has them, in
    the shape the kernels read (``shape``, when given: [batch, seq_local], or [2, batch, seq_local] with
    ``spec.kv_ids``)."""
    if spec.segmented != bool(given):
        raise ValueError(f"spec.segmented is {spec.segmented} but segment_ids {'were' if given else 'were not'} "
                         "given: pass this rank's segment ids exactly when the spec says so")
    want = (2,) * bool(spec.kv_ids) + (spec.batch, spec.seq_local)
    if given and shape is not None and tuple(shape) != want:
        raise ValueError(f"the segment ids have shape {tuple(shape)}; this call reads {want}")
