"""CPU tests of the real fused kernel, run by ring_core.sim.simulate in the Triton interpreter (one thread per rank).

Every result is compared with the float64 numpy reference through ring_core.testing.check_attention (the one
tolerance table). The interpreter is slow, so shapes are tiny; together the cases cover world sizes 1-4,
causal or not, both layouts, GQA ratios 1/2/4 (MQA), odd head dims, seq_local 1 and not a multiple of the
interpreter's 16-row blocks, fp16/bf16/fp32, return_lse, batch 2 and non-default scales.
"""

import os

# The interpreter must be chosen before ring_core.kernels.tl_fwd / iris are first imported (tests/conftest.py is
# shared, so this module sets it itself).
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import doctest  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ring_core.sim import simulate  # noqa: E402
from ring_core.sim.simulate import SimulatedRing, simulate_job, simulate_ring_attention  # noqa: E402
from ring_core.protocol import control  # noqa: E402
from ring_core.sim import interpret  # noqa: E402
from ring_core import plans, reference, testing  # noqa: E402
from ring_core import layout as L  # noqa: E402
from ring_core.protocol.control import HeapTooSmallError, RingAttentionMismatch, RingAttentionTimeout  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(name, result, ref_inputs, dtype, *, is_causal, scale, return_lse):
    q, k, v = ref_inputs
    out, lse = result if return_lse else (result, None)
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(reference.np_dtype(dtype)) and out.shape == q.shape
    if return_lse:
        assert isinstance(lse, np.ndarray) and lse.dtype == np.float32
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    return testing.check_attention(name, out.astype(np.float64), lse, q, k, v, dtype, is_causal=is_causal,
                                   scale=scale)


# (world_size, batch, seq_local, heads, kv_heads, head_dim, dtype, is_causal, layout, return_lse, scale)
CASES = [
    (1, 1, 1, 2, 2, 8, "float32", True, "contiguous", True, None),
    (1, 2, 34, 2, 1, 16, "float16", True, "zigzag", False, None),
    (2, 1, 1, 2, 1, 16, "float16", True, "contiguous", True, None),
    (2, 1, 2, 4, 1, 24, "bfloat16", True, "zigzag", False, None),
    (2, 1, 17, 4, 2, 80, "float32", False, "contiguous", True, 0.3),
    (2, 1, 20, 4, 4, 40, "float16", True, "zigzag", True, None),
    (2, 1, 16, 2, 2, 16, "bfloat16", True, "contiguous", False, None),
    (2, 1, 33, 4, 2, 32, "float32", True, "contiguous", False, None),
    (3, 1, 1, 4, 1, 8, "bfloat16", False, "contiguous", True, None),
    (3, 1, 18, 2, 1, 80, "float16", True, "zigzag", True, None),
    (3, 1, 5, 4, 2, 24, "float32", True, "contiguous", False, 2.0),
    (3, 1, 4, 2, 2, 192, "float32", False, "zigzag", True, None),
    (3, 2, 6, 3, 3, 32, "bfloat16", True, "zigzag", False, None),
    (3, 1, 40, 2, 1, 48, "float16", True, "zigzag", True, None),
    (4, 1, 2, 2, 2, 16, "float32", True, "zigzag", True, None),
    (4, 1, 19, 4, 1, 80, "bfloat16", True, "contiguous", True, None),
    (4, 1, 8, 4, 2, 40, "float16", False, "zigzag", False, 0.5),
    (4, 2, 3, 2, 1, 8, "float32", False, "contiguous", True, None),
    (4, 1, 12, 4, 4, 64, "bfloat16", True, "zigzag", True, None),
    (4, 1, 1, 1, 1, 8, "float16", False, "contiguous", False, None),
    # 8 ranks (the world size of an 8-GPU machine), both layouts.
    (8, 1, 4, 4, 2, 16, "float32", True, "zigzag", True, None),
    (8, 1, 3, 2, 1, 24, "bfloat16", False, "contiguous", False, None),
]


def _case_id(c):
    *shape, lse, scale = c
    return testing.case_label(*shape) + ('-lse' if lse else '') + ('' if scale is None else f'-scale{scale}')


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(case):
    W, B, S, H, HKV, D, dtype, causal, layout, return_lse, scale = case
    ref, (q, k, v) = testing.sharded_inputs(len(CASES) + CASES.index(case), W, B, S, H, HKV, D, dtype)
    if W == 4 and dtype == "bfloat16" and not layout == "zigzag":
        import jax.numpy as jnp  # anything np.asarray accepts: here jax arrays (bf16 -> ml_dtypes.bfloat16)

        q, k, v = (jnp.asarray(x) for x in (q, k, v))
    result = simulate_ring_attention(q, k, v, W, is_causal=causal, scale=scale, layout=layout,
                                     return_lse=return_lse)
    _check(_case_id(case), result, ref, dtype, is_causal=causal, scale=scale, return_lse=return_lse)


def test_consecutive_calls_share_heaps():
    """Changing shapes, dtypes and flags on one set of heaps: the epoch separates the calls (flags left by
    an earlier call, of the same or another shape, never satisfy a later wait)."""
    W = 3
    ring = simulate_job(W, workspace_bytes=1 << 20)
    assert isinstance(ring, SimulatedRing) and ring.epoch is None
    calls = [  # (batch, seq_local, heads, kv_heads, head_dim, dtype, is_causal, layout, return_lse)
        (1, 5, 2, 1, 16, "float32", True, "contiguous", True),
        (1, 4, 4, 2, 24, "bfloat16", False, "zigzag", False),
        (1, 18, 2, 2, 32, "float16", True, "zigzag", True),
        (2, 3, 2, 1, 16, "float32", False, "contiguous", True),
        (1, 5, 2, 1, 16, "float32", True, "contiguous", True),  # the first shape again
    ]
    for i, (B, S, H, HKV, D, dtype, causal, layout, return_lse) in enumerate(calls):
        ref, (q, k, v) = testing.sharded_inputs(100 + i, W, B, S, H, HKV, D, dtype)
        result = ring(q, k, v, is_causal=causal, layout=layout, return_lse=return_lse)
        _check(f"call {i}", result, ref, dtype, is_causal=causal, scale=None, return_lse=return_lse)
        assert ring.uses_subprocess is False
        assert ring.epoch == i + 1
        assert [s.tolist()[:4] for s in ring.statuses] == [[0, 0, 0, i + 1]] * W
        assert not any(s[4:].any() for s in ring.statuses)  # no mismatch signatures


def _simulated_job(world_size, workspace_bytes=None):
    """A ring_core.sim.interpret.SimulatedJob, with the interpreter set up as ring_core.sim.simulate does it."""
    job = simulate._local_job(world_size, workspace_bytes)
    assert type(job).__name__ == "SimulatedJob"
    return job


def _spec_and_shards(W, B, S, H, HKV, D, dtype, *, is_causal, layout="contiguous"):
    return testing.spec_and_shards(7, W, B, S, H, HKV, D, dtype, is_causal=is_causal, layout=layout)


@pytest.mark.parametrize("is_causal, started, what", [
    (False, False, r"waiting for rank 1 to start this call \(ring step 0"),
    # Rank 1 started (published its signature) and then stopped: rank 0 waits for its K/V ...
    (False, True, r"waiting for the K/V shard of rank 1 at ring step 1"),
    # ... or, causal + contiguous (rank 0 never needs rank 1's K/V), for the end barrier.
    (True, True, r"waiting for rank 1 to finish \(end-of-call barrier\)"),
], ids=["never-started", "kv-wait", "end-barrier"])
def test_absent_rank_times_out(is_causal, started, what):
    timeout_s = 0.02  # the interpreter bounds waits by a poll count, much slower than wall time
    spec, shards = _spec_and_shards(2, 1, 4, 2, 1, 8, "float32", is_causal=is_causal)
    results = _simulated_job(2).run(spec, *shards, timeout_s=timeout_s, absent_ranks=(1,), absent_started=started)
    assert results[1] is None
    out, lse, status = results[0]
    assert status[0] != control.ERR_NONE and status[1] == 1 and status[3] == 1
    with pytest.raises(RingAttentionTimeout, match=what) as info:
        control.check_status(status, 0, timeout_s)
    assert "rank 0" in str(info.value) and "rank 1" in str(info.value) and "reset()" in str(info.value)
    if is_causal:  # rank 0's queries see only its own keys: right, although the end barrier failed
        assert np.isfinite(out).all() and np.isfinite(lse).all()
    else:  # every row needed rank 1's K/V: NaN, never a plausible wrong value
        assert np.isnan(out).all() and np.isnan(lse).all()
    # A following normal call on a new job works.
    ref, (q, k, v) = testing.sharded_inputs(8, 2, 1, 4, 2, 1, 8, "float32")
    out = simulate_ring_attention(q, k, v, 2, is_causal=is_causal)
    _check("after timeout", out, ref, "float32", is_causal=is_causal, scale=None, return_lse=False)


def test_sticky_errors_keep_the_first_failure_until_taken():
    """With STICKY_ERRORS (JAX's deferred error mode) a failed call's status stays on the heap until the
    host takes it; right calls leave nothing; without it nothing is kept."""
    spec, shards = _spec_and_shards(2, 1, 4, 2, 1, 8, "float32", is_causal=False)
    job = _simulated_job(2)
    job.run(spec, *shards, sticky_errors=True)
    assert job.take_error(0) is None and job.take_error(1) is None
    job.run(spec, *shards, timeout_s=0.02, absent_ranks=(1,))  # not sticky: nothing kept
    assert job.take_error(0) is None
    job.reset()
    odd, odd_shards = _spec_and_shards(2, 1, 6, 2, 1, 8, "float32", is_causal=False)
    res = job.run([spec, odd], [shards[0][0], odd_shards[0][1]], [shards[1][0], odd_shards[1][1]],
                  [shards[2][0], odd_shards[2][1]], timeout_s=5.0, sticky_errors=True)
    for r in range(2):
        kept, members = job.take_error(r)
        assert kept.tolist() == res[r][2].tolist() and members == (0, 1)  # the whole status, and its ring
        with pytest.raises(RingAttentionMismatch, match="first difference: seq_local"):
            control.check_status(kept, r, members=members)
        assert job.take_error(r) is None  # taken


def test_reset_brings_ranks_back_in_step_on_the_same_heaps():
    spec, shards = _spec_and_shards(2, 1, 4, 2, 1, 8, "float32", is_causal=False)
    job = _simulated_job(2)
    assert job.run(spec, *shards)[0][2][3] == 1
    job.run(spec, *shards, timeout_s=0.02, absent_ranks=(1,))  # rank 0 now one call ahead of rank 1
    res = job.run(spec, *shards, timeout_s=0.02)  # counters out of step
    # Rank 1 never publishes rank 0's epoch. Rank 1 either sees rank 0's signature of this epoch (the
    # counters are apart) or, if it looks first, rank 0's of the call it missed, which matches; but that
    # call sent nothing (rank 0's own check failed), so rank 1's K/V wait gives up. Both say: reset().
    assert int(res[0][2][0]) == control.ERR_START_TIMEOUT
    assert int(res[1][2][0]) in (control.ERR_EPOCH, control.ERR_KV_TIMEOUT)
    for r in range(2):
        with pytest.raises(RuntimeError, match=r"(?i)call reset\(\)") as e:
            control.check_status(res[r][2], r, 0.02)
        if int(res[r][2][0]) == control.ERR_EPOCH:
            assert isinstance(e.value, RingAttentionMismatch) and "rank 0 is at another call" in str(e.value)
    job.reset()
    res = job.run(spec, *shards)
    assert [int(r[2][0]) for r in res] == [0, 0] and [int(r[2][3]) for r in res] == [1, 1]
    out = np.concatenate([r[0] for r in res], axis=1)
    q, k, v = (np.concatenate(x, axis=1) for x in shards)
    o64, _ = reference.attention(q, k, v)
    olp, _ = reference.attention_lowp(q, k, v, "float32")
    testing.check("after reset", out, o64, olp, "float32")


# Ranks that disagree: rank 1's call differs from rank 0's (W=2, B=1, S=4, H=2, HKV=1, D=8, float32) in one
# field; (overrides of rank 1, the field the message names first).
MISMATCHES = [
    (dict(S=6), "seq_local"),
    (dict(H=4), "heads"),
    (dict(dtype="float16"), "dtype"),
    (dict(is_causal=True), "flags"),
    (dict(is_causal=True, layout="zigzag"), "flags"),
    (dict(scale=0.5), "scale"),
]


def _mismatched_call(job, overrides, seed=0):
    base = dict(W=2, B=1, S=4, H=2, HKV=1, D=8, dtype="float32", is_causal=False, layout="contiguous", scale=None)
    specs, shards = [], [[], [], []]
    for r in range(2):
        a = dict(base, **(overrides if r == 1 else {}))
        spec, sh = _spec_and_shards(a["W"], a["B"], a["S"], a["H"], a["HKV"], a["D"], a["dtype"],
                                    is_causal=a["is_causal"], layout=a["layout"])
        if a["scale"] is not None:
            spec = dataclasses.replace(spec, scale=a["scale"])
        specs.append(spec)
        for x, part in zip(shards, sh):
            x.append(part[r])
    return specs, job.run(specs, *shards, timeout_s=5.0)


@pytest.mark.parametrize("overrides, field", MISMATCHES,
                         ids=["seq_local", "heads", "dtype", "causal", "layout", "scale"])
def test_ranks_that_disagree_are_found_before_anything_moves(overrides, field):
    job = _simulated_job(2)
    specs, res = _mismatched_call(job, overrides)
    launches = [plans.plan(sp, 2, job.layout, interpret=True) for sp in specs]
    for r in range(2):
        status = res[r][2]
        assert int(status[0]) == control.ERR_MISMATCH and int(status[1]) == 1 - r and int(status[3]) == 1
        assert np.isnan(res[r][0].astype(np.float32)).all() and np.isnan(res[r][1]).all()  # nothing computed
        # The kernel built the same signature words as the host (control.call_signature), epoch included.
        theirs, mine = status[4:4 + control.SIG_WORDS], status[4 + control.SIG_WORDS:]
        assert mine[1:].tolist() == launches[r].signature()[1:].tolist() and mine[0] == 1
        assert theirs[1:].tolist() == launches[1 - r].signature()[1:].tolist() and theirs[0] == 1
        with pytest.raises(RingAttentionMismatch, match=rf"disagree on call #1 \(first difference: {field}\)") as e:
            control.check_status(status, r, 5.0)
        msg = str(e.value)
        assert f"Rank {1 - r} made the forward call #1" in msg and "no reset() needed" in msg
    # Nothing was pushed: no receive byte of either rank changed. The ranks are still in step: the next
    # (matching) call on the same heaps is right, without reset().
    spec, shards = _spec_and_shards(2, 1, 4, 2, 1, 8, "float32", is_causal=False)
    res = job.run(spec, *shards)
    assert [int(r[2][0]) for r in res] == [0, 0] and [int(r[2][3]) for r in res] == [2, 2]
    out = np.concatenate([r[0] for r in res], axis=1)
    q, k, v = (np.concatenate(x, axis=1) for x in shards)
    testing.check("after a mismatch", out, reference.attention(q, k, v)[0],
                  reference.attention_lowp(q, k, v, "float32")[0], "float32")


def test_one_rank_of_four_that_differs_makes_every_rank_raise():
    """Rank 2's call has other heads: ranks 0, 1 and 3 name rank 2, rank 2 names the first peer it compared
    (rank 0); all at the same call, and the next matching call is right without reset()."""
    W = 4
    base, shards = _spec_and_shards(W, 1, 4, 2, 1, 8, "float32", is_causal=True, layout="zigzag")
    odd, odd_shards = _spec_and_shards(W, 1, 4, 4, 1, 8, "float32", is_causal=True, layout="zigzag")
    specs = [odd if r == 2 else base for r in range(W)]
    mixed = [[(o if r == 2 else b)[r] for r in range(W)] for b, o in zip(shards, odd_shards)]
    job = _simulated_job(W)
    res = job.run(specs, *mixed, timeout_s=5.0)
    assert [int(r[2][0]) for r in res] == [control.ERR_MISMATCH] * W
    assert [int(r[2][1]) for r in res] == [2, 2, 0, 2] and {int(r[2][3]) for r in res} == {1}
    for r in range(W):
        with pytest.raises(RingAttentionMismatch, match=r"first difference: heads"):
            control.check_status(res[r][2], r, 5.0)
    res = job.run(base, *shards)
    assert [int(r[2][0]) for r in res] == [0] * W and {int(r[2][3]) for r in res} == {2}
    q, k, v = (np.concatenate(x, axis=1) for x in shards)
    inv = L.inverse_permutation(L.layout_permutation(4 * W, W, "zigzag"))  # shards are in layout order
    out = np.concatenate([r[0] for r in res], axis=1)[:, inv]
    qn, kn, vn = (x[:, inv] for x in (q, k, v))
    testing.check("after a mismatch, 4 ranks", out, reference.attention(qn, kn, vn, is_causal=True)[0],
                  reference.attention_lowp(qn, kn, vn, "float32", is_causal=True)[0], "float32")


def test_a_mismatch_sends_nothing():
    """A rank whose call is larger must not write past the smaller receive slots of its peer: with a
    mismatch nothing at all is written into any receive region."""
    job = _simulated_job(2, workspace_bytes=4 << 20)
    specs, _ = _mismatched_call(job, dict(S=6))  # sizes the heaps
    for h in job.heaps:
        h[job.layout.recv_off:].fill_(0x5A)
    _mismatched_call(job, dict(S=6))
    for h in job.heaps:
        assert bool((h[job.layout.recv_off:] == 0x5A).all())


def test_heap_too_small():
    W, B, S, H, HKV, D = 2, 1, 64, 2, 2, 64
    tiny = control.RING_SLOTS * control.CTL_BYTES + (64 << 10) + 10_000  # control, flags, ~10 KB of receive space
    spec, shards = _spec_and_shards(W, B, S, H, HKV, D, "float32", is_causal=False)
    need = plans.recv_bytes(spec, W)
    assert need == (W - 1) * 2 * B * HKV * S * D * 4
    job = _simulated_job(W, workspace_bytes=tiny)
    with pytest.raises(HeapTooSmallError, match=rf"needs {need} bytes.*initialize\(heap_size=\.\.\.\) with at least"):
        job.run(spec, *shards)
    assert all(int(h.sum()) == 0 for h in job.heaps)  # raised before any rank ran

    # Through the simulator: the error propagates, and a call that fits still runs on the same heaps.
    ring = SimulatedRing(W, workspace_bytes=tiny)
    _, (q, k, v) = testing.sharded_inputs(9, W, B, S, H, HKV, D, "float32")
    with pytest.raises(HeapTooSmallError, match=rf"needs {need} bytes"):
        ring(q, k, v)
    ref, (q, k, v) = testing.sharded_inputs(10, W, 1, 3, 2, 1, 8, "float32")
    _check("small after too-big", ring(q, k, v, is_causal=True), ref, "float32", is_causal=True, scale=None,
           return_lse=False)
    assert ring.epoch == 1


# Bad inputs to the simulator are rows of the one bad-input table: tests/cpu/test_bad_inputs.py.


def test_interpreter_fixes():
    """ring_core.sim.simulate works around two Triton-interpreter problems (see its docstrings): first-call
    rewrites are serialized across rank threads, and float32 -> bfloat16 casts round to nearest even (the
    interpreter truncates; the GPU rounds)."""
    import torch
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    simulate._local_job(1, None)
    assert getattr(InterpretedFunction.rewrite, "_ring_serialized", False)

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, z_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        tl.store(y_ptr + offs, x.to(tl.bfloat16))
        tl.store(z_ptr + offs, x.to(tl.bfloat16, fp_downcast_rounding="rtne"))

    x = np.random.default_rng(0).standard_normal(256).astype(np.float32) * 3
    x[:6] = [np.nan, np.inf, -np.inf, 3.4e38, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8]  # overflow, and two exact ties
    y, z = torch.empty(256, dtype=torch.bfloat16), torch.empty(256, dtype=torch.bfloat16)
    cast_kernel[(1,)](torch.from_numpy(x), y, z, 256)
    expected = x.astype(ml_dtypes.bfloat16)
    for got in (y, z):
        got = got.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        assert np.isnan(got[0].astype(np.float32))
        np.testing.assert_array_equal(got[1:].view(np.uint16), expected[1:].view(np.uint16))
    np.testing.assert_array_equal(interpret._bf16_bits_rtne(x[1:]), expected[1:].view(np.uint16))


def test_docstring_example():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(simulate.simulate_ring_attention, "simulate_ring_attention", globs={}):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted > 0
    assert runner.failures == 0


def test_module_is_light():
    """Loading ring_core/sim/simulate.py imports neither jax nor torch / triton / iris / the kernel."""
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("standalone_simulate", {simulate.__file__!r})
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        heavy = [m for m in ("jax", "torch", "triton", "iris", "ring_core.kernels.tl_fwd") if m in sys.modules]
        assert not heavy, heavy
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_falls_back_to_subprocess_when_kernel_compiled_for_gpu():
    """In a process that imported the kernel without TRITON_INTERPRET (as a GPU job does), the simulation
    runs in a spawned interpreter process, whose heaps persist across the calls of one SimulatedRing."""
    code = textwrap.dedent("""
        import numpy as np
        import ring_core.kernels.tl_fwd  # decorated for the GPU: this process cannot interpret it any more
        from ring_core.sim import interpret
        from ring_core import testing
        assert not interpret.interpreter_usable()
        from ring_core.sim.simulate import SimulatedRing, simulate_ring_attention
        q, k, v = testing.random_inputs(0, 1, 8, 2, 1, 16, "float32")
        f32 = [x.astype(np.float32) for x in (q, k, v)]
        with SimulatedRing(2) as ring:
            for i in range(2):
                out, lse = ring(*f32, is_causal=True, layout="zigzag", return_lse=True)
                testing.check_attention("subprocess", out, lse, q, k, v, "float32", is_causal=True)
                assert ring.uses_subprocess and ring.epoch == i + 1, (ring.uses_subprocess, ring.epoch)
        out = simulate_ring_attention(*f32, 4, is_causal=False)
        testing.check_attention("subprocess one-shot", out, None, q, k, v, "float32", is_causal=False)
        print("FALLBACK-OK")
    """)
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "FALLBACK-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_scale_zero_under_masks_is_uniform_attention_not_nan():
    """scale=0 (allowed): every visible key weighs the same. The kernels multiply masked scores (-inf) by the scale,
    which gave NaN for 0; they now get 1e-30 (ring_core.protocol.control.kernel_scale), the same float32 results."""
    case = (2, 1, 8, 2, 1, 16, "float32", True, "zigzag", True, 0.0)
    W, B, S, H, HKV, D, dtype, causal, layout, return_lse, scale = case
    ref, (q, k, v) = testing.sharded_inputs(77, W, B, S, H, HKV, D, dtype)
    result = simulate_ring_attention(q, k, v, W, is_causal=causal, scale=scale, layout=layout, return_lse=return_lse)
    _check(_case_id(case), result, ref, dtype, is_causal=causal, scale=scale, return_lse=return_lse)
