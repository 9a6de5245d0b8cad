"""The one tolerance table, and the comparison every test (CPU and GPU) and the demo use.

A result in ``dtype`` passes when its error against the float64 reference is at most twice the error of
a same-precision reference (``reference.attention_lowp`` / ``attention_grad_lowp``) plus a small absolute
slack from this table:  ``err(x, ref64) <= 2 * err(lowp, ref64) + atol``.
"""

from __future__ import annotations

import numpy as np

from ring_core.protocol import control
from ring_core import masks, reference, validate

# dtype -> slack for out, for lse (always float32), for gradients.
TOLERANCES = {
    "float64": dict(out=1e-10, lse=1e-10, grad=1e-9),
    "float32": dict(out=2e-5, lse=2e-5, grad=1e-4),
    "bfloat16": dict(out=4e-3, lse=1e-4, grad=2e-2),
    "float16": dict(out=5e-4, lse=1e-4, grad=4e-3),
}


def max_abs_err(x, ref) -> float:
    """max |x - ref|; inf where ``x`` is NaN or infinite, except where ``ref`` holds the same infinity (the
    lse of a row that attends nothing is -inf in both)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {x.shape} != reference shape {ref.shape}")
    same_inf = np.isinf(ref) & (x == ref)
    if not (np.isfinite(x) | same_inf).all():
        return float("inf")
    diff = np.abs(x[~same_inf] - ref[~same_inf])
    return float(diff.max()) if diff.size else 0.0


def check(name: str, got, ref64, lowp, dtype: str, kind: str = "out") -> float:
    """Assert ``got`` is within the table's bound; return its max abs error."""
    err = max_abs_err(got, ref64)
    base = max_abs_err(lowp, ref64)
    bound = 2 * base + TOLERANCES[dtype][kind]
    if not err <= bound:
        raise AssertionError(
            f"{name}: max abs error {err:.3g} exceeds bound {bound:.3g} "
            f"(2 x same-precision error {base:.3g} + {kind} slack {TOLERANCES[dtype][kind]:.3g}, dtype {dtype})")
    return err


def check_attention(name, out, lse, q, k, v, dtype, *, is_causal, scale=None, segment_ids=None, window=None,
                    key_offset=0):
    """Compare ``out`` (and ``lse`` unless None), given in global natural order, with the references
    (``segment_ids`` [b, s], ``window`` and ``key_offset`` as in ``reference.attention``, natural order too)."""
    mask = dict(segment_ids=segment_ids, window=window, key_offset=key_offset)
    out64, lse64 = reference.attention(q, k, v, is_causal=is_causal, scale=scale, **mask)
    outl, lsel = reference.attention_lowp(q, k, v, dtype, is_causal=is_causal, scale=scale, **mask)
    err = check(f"{name} out", out, out64, outl, dtype, "out")
    if lse is not None:
        check(f"{name} lse", lse, lse64, lsel, dtype, "lse")
    return err


def check_grads(name, grads, q, k, v, dout, dtype, *, is_causal, scale=None, dlse=None, segment_ids=None,
                window=None, key_offset=0):
    mask = dict(segment_ids=segment_ids, window=window, key_offset=key_offset)
    ref = reference.attention_grad(q, k, v, dout, is_causal=is_causal, scale=scale, dlse=dlse, **mask)
    low = reference.attention_grad_lowp(q, k, v, dout, dtype, is_causal=is_causal, scale=scale, dlse=dlse, **mask)
    return max(check(f"{name} d{n}", g, r, l, dtype, "grad") for n, g, r, l in zip("qkv", grads, ref, low))


def random_inputs(seed, batch, seq, heads, kv_heads, head_dim, dtype: str, *, with_dout=False):
    """Random normal q, k, v (and dout) already rounded to ``dtype``, returned as float64 numpy arrays."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, head_dim)]
    if with_dout:
        shapes.append((batch, seq, heads, head_dim))
    return tuple(reference.round_to(rng.standard_normal(s), dtype) for s in shapes)


def random_segment_ids(seed, batch, seq, *, max_len=None, padding=True) -> np.ndarray:
    """int32 [batch, seq] segment ids in natural order: each row packs sequences of random lengths
    (1..``max_len``, default about seq/3) back to back, with ids 0, 1, ..., and, with ``padding``, ends in a
    few padding tokens (-1), sometimes none."""
    rng = np.random.default_rng(seed)
    max_len = max(1, seq // 3) if max_len is None else max_len
    rows = []
    for _ in range(batch):
        end = seq - (int(rng.integers(0, max(1, seq // 4) + 1)) if padding else 0)
        lens = []
        while sum(lens) < end:
            lens.append(min(int(rng.integers(1, max_len + 1)), end - sum(lens)))
        rows.append(masks.segment_ids_from_cu_seqlens(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), seq))
    return np.stack(rows).astype(np.int32)


def id_range_words(local_ids, chunk_rows: int, zigzag: bool) -> np.ndarray:
    """A rank's published id-range words [B][n_chunks + 2][lo, hi] for its local segment ids [B, S], as
    ring_core.protocol.steps.publish_id_ranges writes them: each chunk's [min, max] with padding counted as -1 in the
    min
    and the max at least -1, then each half's of the shard over ids >= 0 ((BIG_ID, -1) where none; zigzag: its two
    chunks, contiguous: the shard, then nothing), all stored as -1 - value."""
    B, S = local_ids.shape
    n_chunks = -(-S // chunk_rows)
    w = np.zeros((B, n_chunks + 2, 2), np.int64)
    halves = [(0, S // 2), (S // 2, S)] if zigzag else [(0, S), (S, S)]
    for b in range(B):
        for c in range(n_chunks):
            ids = local_ids[b, c * chunk_rows:(c + 1) * chunk_rows]
            w[b, c] = (np.where(ids >= 0, ids, -1).min(), max(ids.max(), -1))
        for h, (r0, r1) in enumerate(halves):
            ids = local_ids[b, r0:r1]
            ids = ids[ids >= 0]
            w[b, n_chunks + h] = (ids.min(), ids.max()) if ids.size else (control.BIG_ID, -1)
    return -1 - w


def sharded_inputs(seed, world_size, batch, seq_local, heads, kv_heads, head_dim, dtype: str, *, with_dout=False):
    """``random_inputs`` over ``world_size * seq_local`` tokens: (the float64 arrays, the same values in
    ``dtype``)."""
    ref = random_inputs(seed, batch, seq_local * world_size, heads, kv_heads, head_dim, dtype, with_dout=with_dout)
    return ref, tuple(x.astype(reference.np_dtype(dtype)) for x in ref)


def spec_and_shards(seed, world_size, batch, seq_local, heads, kv_heads, head_dim, dtype: str, *, is_causal,
                    layout="contiguous", with_dout=False):
    """The AttentionSpec of a fused call and, for each input (q, k, v[, dout]) in ``dtype``, every rank's
    shard: ``[[rank 0, rank 1, ...] per input]``."""
    spec = validate.check_attention_args((batch, seq_local, heads, head_dim), (batch, seq_local, kv_heads, head_dim),
                                         (batch, seq_local, kv_heads, head_dim), dtype, dtype, dtype,
                                         is_causal=is_causal, scale=None, layout=layout, backend="fused",
                                         backends=("fused",))
    _, xs = sharded_inputs(seed, world_size, batch, seq_local, heads, kv_heads, head_dim, dtype, with_dout=with_dout)
    return spec, [[x[:, r * seq_local:(r + 1) * seq_local] for r in range(world_size)] for x in xs]


def check_pair(name: str, a, b, ref64, lowp, dtype: str, kind: str = "out") -> float:
    """Two implementations agree: ``max|a - b|`` within the same bound each must meet against ``ref64``."""
    err = max_abs_err(a, b)
    bound = 2 * max_abs_err(lowp, ref64) + TOLERANCES[dtype][kind]
    if not err <= bound:
        raise AssertionError(f"{name}: implementations differ by {err:.3g} > bound {bound:.3g} ({kind}, {dtype})")
    return err


def case_label(W, B, S, H, HKV, D, dtype, causal, layout) -> str:
    """The common part of a simulator test case's pytest id (world size, shapes, dtype, masking, layout)."""
    return f"w{W}-b{B}-s{S}-h{H}kv{HKV}-d{D}-{dtype}-{'causal' if causal else 'full'}-{layout}"


def no_gpu_driver(stream: int = 0):
    """A stand-in for Triton's active driver (``triton.runtime.driver.set_active``) on a machine without a GPU: what
    Triton's JIT asks of a driver before it compiles or launches (an sm_90 target, device 0, ``stream``), for the CPU
    tests that drive the JIT with a stand-in compile (tests/cpu/test_build.py, tests/cpu/test_launch.py)."""
    import torch
    from triton.backends.compiler import GPUTarget

    class NoGpu:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return stream

        def get_active_torch_device(self):
            return torch.device("cpu")

    return NoGpu()


def run_compiled(script: str, cache=None):
    """The JSON that the Python ``script`` prints last, run in a process of its own from the repository's root with
    Triton compiling, not interpreting (TRITON_INTERPRET unset; ``cache``: its own TRITON_CACHE_DIR), for the CPU
    tests that compile for a GPU target or drive Triton's JIT with stand-ins (``no_gpu_driver``)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    if cache is not None:
        env.update(TRITON_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def crossing_documents(batch: int, seq: int) -> np.ndarray:
    """Segment ids (int32 [batch, seq], natural order) of packed documents whose boundaries fall inside the shards
    of small rings, so that documents cross ranks' (and nodes') boundaries: a one-token document, rows that differ,
    and padding (-1) at the end of row 0."""
    ids = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = [0, 3 + b, seq // 3, seq // 3 + 1, seq - 7 - b, seq]
        for i in range(len(cuts) - 1):
            ids[b, cuts[i]:cuts[i + 1]] = i
    ids[0, -3:] = -1
    return ids
