"""The bad-input table: one row per bad call, with the exception and message every frontend must give.

Run on CPU by tests/cpu/test_bad_inputs.py through each frontend a row names ("jax": ``jax_ring.ring_attention``
inside ``jax.shard_map`` over 2 CPU devices, backend auto = xla; "torch": ``torch_bridge.ring_attention`` on
every rank of a 2-process gloo group; "sim": ``jax_ring.simulate_ring_attention``, the real kernel in the
Triton interpreter, 2 ranks), and on GPUs by tests/gpu/gpu_faults.py (the "torch" rows, backend="fused", CUDA
tensors). After each bad call the next valid call must give the right answer.

Shapes are per rank, ``[batch, seq_local, heads, head_dim]``, and the JAX and simulator runners make global
arrays with ``WORLD`` times the sequence (axis 1); rows with ``where="sharded"`` give global shapes. This
module imports neither a frontend nor pytest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WORLD = 2
Q, KV = (1, 4, 4, 16), (1, 4, 2, 16)
ALL = ("jax", "torch", "sim")


@dataclass(frozen=True)
class Bad:
    """One bad call.

    ``kw``: keywords of the call. ``where`` (a runner's variant of the call): "" (the plain call),
    "sharded" (jax: ``ring_attention_sharded`` on global arrays), "outside" (jax: outside shard_map),
    "traced-scale" (jax: ``scale`` traced under jit), "local" (torch: this process, no process group),
    "mock-fused" (torch: the fused backend reports itself available, so device checks are reached).
    ``inputs``: a special input ("q-numpy", "v-list", "k-meta", "jax-other-device"). ``expect`` maps a
    frontend to its own (exception, regex) where it differs from (``exc``, ``match``).
    """

    id: str
    exc: type
    match: str
    frontends: tuple = ALL
    q: tuple = Q
    k: tuple = KV
    v: tuple | None = None  # None: k's shape
    dtypes: tuple = ("float32", "float32", "float32")
    kw: dict = field(default_factory=dict)
    where: str = ""
    inputs: str = ""
    expect: dict = field(default_factory=dict)

    def shapes(self):
        return self.q, self.k, self.k if self.v is None else self.v

    def expected(self, frontend: str):
        return self.expect.get(frontend, (self.exc, self.match))


def _dt(q, k=None, v=None):
    return (q, k or q, v or k or q)


FUSED_NOT_READY = {
    "jax": (RuntimeError, r"backend='fused' needs NVIDIA GPUs.*jax_ring\.initialize\(\)"),
    "torch": (RuntimeError, r"backend='fused' needs the symmetric heap: call torch_bridge\.initialize\(\)"),
}

TABLE = [
    # ---- ranks and shapes
    Bad("q-rank3", ValueError, r"q must .*rank 4", q=(4, 4, 16)),
    Bad("k-rank5", ValueError, r"k must .*rank 4", k=(1, 1, 4, 2, 16)),
    Bad("v-rank3", ValueError, r"v must .*rank 4", v=(1, 4, 16)),
    Bad("batch-mismatch", ValueError, r"batch mismatch: q has batch 1, k/v have 2", k=(2, 4, 2, 16)),
    Bad("seq-mismatch", ValueError, r"seq_local mismatch: q has 4 local tokens, k/v have 5", k=(1, 5, 2, 16),
        expect={"sim": (ValueError, r"same global sequence length, got q 8, k 10")}),
    Bad("head_dim-mismatch", ValueError, r"head_dim mismatch: q has 16, k/v have 32", k=(1, 4, 2, 32)),
    Bad("k-v-shapes", ValueError, r"k and v must have the same shape", v=(1, 4, 1, 16)),
    Bad("heads-not-divisible", ValueError, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)",
        q=(1, 4, 3, 16)),
    Bad("head_dim-0", ValueError, r"q is empty \(head_dim=0, .*every dimension must be >= 1", q=(1, 4, 4, 0),
        k=(1, 4, 2, 0)),
    Bad("head_dim-257", ValueError, r"head_dim must be in 1\.\.256, got 257", q=(1, 4, 4, 257), k=(1, 4, 2, 257)),
    # Empty inputs are rejected (as flash-attn rejects batch 0): see ring_core.validate.check_attention_args.
    Bad("batch-0", ValueError, r"q is empty \(batch=0, .*every dimension must be >= 1", q=(0, 4, 4, 16),
        k=(0, 4, 2, 16)),
    Bad("seq-0", ValueError, r"q is empty \(seq_local=0, .*every dimension must be >= 1", q=(1, 0, 4, 16),
        k=(1, 0, 2, 16)),
    Bad("kv-heads-0", ValueError, r"k is empty \(heads=0, .*every dimension must be >= 1", k=(1, 4, 0, 16)),
    # ---- dtypes
    Bad("int32", TypeError, r"q must be a floating dtype \(float16, bfloat16, float32, float64\), got int32",
        dtypes=_dt("int32")),
    Bad("complex64", TypeError, r"q must be a floating dtype .*got complex64", dtypes=_dt("complex64")),
    Bad("mixed-dtypes", TypeError, r"q, k and v must share one dtype, got float32, float16, float16; cast",
        dtypes=_dt("float32", "float16")),
    Bad("float64-fused", TypeError, r"fused kernel supports float16, bfloat16 and float32 inputs, got float64",
        frontends=("sim",), dtypes=_dt("float64")),
    # ---- layout
    Bad("layout-unknown", ValueError, r"layout must be one of \('contiguous', 'zigzag'\), got 'striped'",
        kw=dict(layout="striped")),
    Bad("layout-case", ValueError, r"layout must be one of .*got 'Zigzag'", kw=dict(layout="Zigzag")),
    Bad("layout-none", ValueError, r"layout must be one of .*got None", kw=dict(layout=None)),
    Bad("zigzag-odd-seq_local", ValueError, r"layout='zigzag' needs an even seq_local .*got 5", q=(1, 5, 4, 16),
        k=(1, 5, 2, 16), kw=dict(layout="zigzag"),
        expect={"sim": (ValueError, r"global sequence length=10, not a multiple of 4 \(2\*world_size, world_size=2\)")}),
    # ---- scale: a finite number >= 0 (0 gives uniform weights), or None for 1/sqrt(head_dim)
    Bad("scale-negative", ValueError, r"scale must be finite and >= 0, got -1\.0", kw=dict(scale=-1.0)),
    Bad("scale-nan", ValueError, r"scale must be finite and >= 0, got nan", kw=dict(scale=float("nan"))),
    Bad("scale-inf", ValueError, r"scale must be finite and >= 0, got inf", kw=dict(scale=float("inf"))),
    Bad("scale-str", TypeError, r"scale must be a Python float or None, got str", kw=dict(scale="0.5")),
    Bad("scale-bool", TypeError, r"scale must be a Python float or None, got bool", kw=dict(scale=True)),
    Bad("scale-vector", TypeError, r"scale must be one number .*shape \(2,\)", kw=dict(scale=np.array([0.5, 0.5]))),
    # ---- flags
    Bad("is_causal-int", TypeError, r"is_causal must be a Python bool, got int 1", kw=dict(is_causal=1)),
    Bad("is_causal-str", TypeError, r"is_causal must be a Python bool, got str 'yes'", kw=dict(is_causal="yes")),
    Bad("return_lse-str", TypeError, r"return_lse must be a Python bool, got str", kw=dict(return_lse="yes")),
    Bad("return_lse-none", TypeError, r"return_lse must be a Python bool, got NoneType", kw=dict(return_lse=None)),
    # deterministic: the frontends' keyword (the simulator always runs the one backward kernel there is)
    Bad("deterministic-int", TypeError, r"deterministic must be a Python bool, got int 1", frontends=("jax", "torch"),
        kw=dict(deterministic=1)),
    Bad("deterministic-none", TypeError, r"deterministic must be a Python bool, got NoneType",
        frontends=("jax", "torch"), kw=dict(deterministic=None)),
    Bad("sharded-deterministic-str", TypeError, r"deterministic must be a Python bool, got str 'yes'",
        frontends=("jax",), where="sharded", kw=dict(deterministic="yes")),
    # ---- timeout_s: a finite number of seconds > 0, or None
    Bad("timeout-zero", ValueError, r"timeout_s must be a finite number of seconds > 0, got 0", kw=dict(timeout_s=0)),
    Bad("timeout-nan", ValueError, r"timeout_s must be a finite number of seconds > 0, got nan",
        kw=dict(timeout_s=float("nan"))),
    Bad("timeout-str", TypeError, r"timeout_s must be a number of seconds or None, got str", kw=dict(timeout_s="5")),
    # ---- backend
    Bad("backend-unknown", ValueError, r"backend must be one of .*got 'triton'", frontends=("jax", "torch"),
        kw=dict(backend="triton")),
    Bad("backend-none", ValueError, r"backend must be one of .*got None", frontends=("jax", "torch"),
        kw=dict(backend=None)),
    Bad("jax-backend-torch", ValueError, r"backend must be one of \('auto', 'fused', 'xla'\), got 'torch'",
        frontends=("jax",), kw=dict(backend="torch")),
    Bad("torch-backend-xla", ValueError, r"backend must be one of \('auto', 'fused', 'torch'\), got 'xla'",
        frontends=("torch",), kw=dict(backend="xla")),
    Bad("fused-before-initialize", RuntimeError, "", frontends=("jax", "torch"), kw=dict(backend="fused"),
        expect=FUSED_NOT_READY),
    # ---- JAX: the mesh axis, placement, traced arguments
    Bad("axis-not-in-mesh", ValueError, r"axis_name='seq' is not a bound mesh axis.*inside jax\.shard_map",
        frontends=("jax",), kw=dict(axis_name="seq")),
    Bad("axis-none", TypeError, r"axis_name is required: the name of the mesh axis", frontends=("jax",),
        kw=dict(axis_name=None)),
    Bad("axis-int", ValueError, r"axis_name=0 is not a bound mesh axis", frontends=("jax",), kw=dict(axis_name=0)),
    Bad("outside-shard_map", ValueError, r"inside jax\.shard_map over a mesh whose axis named 'sp'",
        frontends=("jax",), where="outside"),
    Bad("scale-traced", TypeError, r"scale must be a concrete Python float or None, not a traced value",
        frontends=("jax",), where="traced-scale"),
    Bad("sharded-axis-not-in-mesh", ValueError, r"axis_name='seq' is not an axis of the mesh \(axes \('sp',\)\)",
        frontends=("jax",), where="sharded", kw=dict(axis_name="seq")),
    Bad("sharded-seq-not-multiple", ValueError, r"q has seq_global=5, not a multiple of 2 \(world_size, world_size=2 on axis 'sp'\); pad",
        frontends=("jax",), where="sharded", q=(1, 5, 4, 16), k=(1, 5, 2, 16)),
    Bad("sharded-zigzag-seq-not-multiple", ValueError, r"q has seq_global=6, not a multiple of 4 \(2\*world_size",
        frontends=("jax",), where="sharded", q=(1, 6, 4, 16), k=(1, 6, 2, 16), kw=dict(layout="zigzag")),
    Bad("sharded-heads-not-divisible", ValueError, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)",
        frontends=("jax",), where="sharded", q=(1, 8, 3, 16), k=(1, 8, 2, 16)),
    Bad("sharded-q-rank3", ValueError, r"q must have rank 4", frontends=("jax",), where="sharded", q=(8, 4, 16),
        k=(1, 8, 2, 16)),
    Bad("sharded-other-device", ValueError, r"incompatible devices", frontends=("jax",), where="sharded",
        inputs="jax-other-device"),
    # ---- torch: tensor types and devices, process group
    Bad("q-numpy", TypeError, r"q must be a torch\.Tensor, got ndarray", frontends=("torch",), inputs="q-numpy"),
    Bad("v-list", TypeError, r"v must be a torch\.Tensor, got list", frontends=("torch",), inputs="v-list"),
    Bad("k-other-device", ValueError, r"q, k and v must be on one device, got q on cpu, k on meta",
        frontends=("torch",), inputs="k-meta"),
    Bad("cpu-tensors-to-fused", ValueError, r"backend='fused' needs CUDA tensors, got cpu; move q, k, v",
        frontends=("torch",), where="mock-fused", kw=dict(backend="fused")),
    Bad("group-without-process-group", RuntimeError, r"group was given but torch\.distributed is not initialised",
        frontends=("torch",), where="local", kw=dict(group=object())),
    # ---- simulator: its own world_size argument
    Bad("sim-world_size-0", ValueError, r"world_size must be in 1\.\.64, got 0", frontends=("sim",),
        kw=dict(world_size=0)),
    Bad("sim-world_size-float", TypeError, r"world_size must be an int, got float", frontends=("sim",),
        kw=dict(world_size=2.0)),
    Bad("sim-seq-not-divisible", ValueError, r"global sequence length=8, not a multiple of 3 \(world_size, world_size=3\); pad",
        frontends=("sim",), kw=dict(world_size=3)),
]

BY_ID = {row.id: row for row in TABLE}
assert len(BY_ID) == len(TABLE), "duplicate row ids"


def rows(frontend: str):
    return [row for row in TABLE if frontend in row.frontends]
