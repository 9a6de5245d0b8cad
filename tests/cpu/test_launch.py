"""The launcher, the initialisation errors and the status-to-exception mapping (CPU)."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ring_core.protocol import control
from ring_core import plans

ROOT = Path(__file__).resolve().parents[2]


def _launch(tmp_path, body, n=2, timeout=120):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", str(n), str(script), "x"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def test_launcher_sets_the_rendezvous_environment(tmp_path):
    r = _launch(tmp_path, """
        import os, sys
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        # One write: with PYTHONUNBUFFERED=1, print() writes word by word and the ranks' lines interleave.
        os.write(1, (" ".join(["ENV", *[os.environ[k] for k in keys], sys.argv[1]]) + "\\n").encode())
    """, n=3)
    assert r.returncode == 0, r.stderr
    rows = sorted(l.split()[1:] for l in r.stdout.splitlines() if l.startswith("ENV"))
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert all(row[1] == "3" and row[2] == row[0] and row[3] == "3" and row[4] == "127.0.0.1" for row in rows)
    assert len({row[5] for row in rows}) == 1 and all(row[6] == "x" for row in rows)


def test_launcher_stops_the_others_and_returns_the_failing_code(tmp_path):
    r = _launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(7)
        time.sleep(600)
    """)
    assert r.returncode == 7
    assert "exited with code 7" in r.stderr


def test_initialize_without_a_launcher_says_how_to_start_one(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    import torch_bridge

    with pytest.raises(RuntimeError, match=r"jax_ring.launch --nproc-per-node N"):
        torch_bridge.initialize()


@pytest.mark.parametrize("status,fragment", [
    ((1, 1, 1, 5), "waiting for the K/V shard of rank 1 at ring step 1"),
    ((2, 3, 4, 5), "waiting for rank 3 to finish"),
    ((3, 2, 0, 5), "because rank 2 failed"),
])
def test_status_becomes_an_error_naming_rank_and_step(status, fragment):
    with pytest.raises(control.RingAttentionTimeout, match=fragment):
        control.check_status(np.array(status, np.int32), rank=0, timeout_s=1.5)


def test_status_of_a_kernel_that_never_completed_is_an_error():
    with pytest.raises(RuntimeError, match="did not complete"):
        control.check_status(np.zeros(4, np.int32), rank=1)
    control.check_status(np.array([0, 0, 0, 3], np.int32), rank=1)  # a completed call passes


@pytest.mark.parametrize("need", [1, 10 << 20, 3 << 30])
def test_suggested_heap_size_holds_the_call(need):
    """The heap size HeapTooSmallError suggests must fit: its workspace (heap minus iris's slack) must give
    at least ``need`` receive bytes, with the flag region grown for the bigger workspace."""
    from ring_core.validate import check_attention_args

    suggested = plans.heap_bytes_for(need)
    layout = control.HeapLayout.for_workspace(suggested - control.HEAP_SLACK, base_off=4096 + 17)
    assert layout.recv_capacity >= need
    spec = check_attention_args((1, 4096, 8, 128), (1, 4096, 8, 128), (1, 4096, 8, 128), "bfloat16", "bfloat16",
                                "bfloat16", is_causal=False, scale=None, layout="contiguous", backend="fused",
                                backends=("fused",))
    small = control.HeapLayout.for_workspace(1 << 20)
    with pytest.raises(control.HeapTooSmallError, match=rf"at least {plans.heap_bytes_for(plans.recv_bytes(spec, 2))}"):
        plans.plan(spec, 2, small)


def _spec(S=1024, D=128, dtype="bfloat16", layout="contiguous", window=None, segmented=False, causal=True):
    from ring_core import validate

    return validate.check_attention_args(
        (1, S, 8, D), (1, S, 2, D), (1, S, 2, D), dtype, dtype, dtype, is_causal=causal, scale=None, layout=layout,
        backend="fused", backends=("fused",), window_size=window, segment_ids_shape=(1, S) if segmented else None,
        segment_ids_dtype="int32" if segmented else None)


@pytest.mark.parametrize("kw, capability, gluon", [
    (dict(), (9, 0), True),
    (dict(D=64, dtype="float16", causal=False), (9, 0), True),
    (dict(layout="zigzag", S=512), (9, 0), True),
    (dict(layout="zigzag", S=384), (9, 0), False),  # a tile would hold rows of both zigzag halves
    (dict(D=256), (9, 0), True),
    (dict(D=256, dtype="float16", causal=False, layout="zigzag", S=256), (9, 0), True),
    (dict(D=256, layout="zigzag", S=384), (9, 0), False),  # 64-row blocks fit each half, 128-row tiles do not
    (dict(D=256, S=192), (9, 0), False),  # three 64-row blocks, one and a half tiles
    (dict(D=256, dtype="float32"), (9, 0), False),
    (dict(S=1000), (9, 0), False),
    (dict(D=80), (9, 0), False),
    (dict(dtype="float32"), (9, 0), False),
    (dict(window=(100, 0)), (9, 0), True),  # masks: the Gluon backward too, in any order only
    (dict(segmented=True), (9, 0), True),
    (dict(D=256, layout="zigzag", S=512, window=(300, -1), segmented=True), (9, 0), True),
    (dict(window=(100, 0), segmented=True, S=1000), (9, 0), False),
    (dict(), (8, 0), False),
    (dict(), (10, 0), False),
    (dict(), None, False),
])
def test_the_gluon_kernel_takes_the_forwards_it_applies_to(kw, capability, gluon):
    """ring_core.plans picks the Gluon Hopper kernel exactly where it applies (plans.gluon_applies) and the tl
    kernel everywhere else; the backward with deterministic=False (the default) likewise where head_dim is also 64 or
    128 (plans.gluon_bwd_applies; windows and segment ids included); with deterministic=True the Gluon kernel with
    its DETERMINISTIC constexpr (the same grid and scratch) at head_dim 128 with neither a window nor segment ids,
    else the tl one, which RING_ATTENTION_GLUON_DETERMINISTIC=0 gives every deterministic backward; the interpreter
    always runs the tl kernels."""
    lay = control.HeapLayout.for_workspace(1 << 30)
    spec = _spec(**kw)
    p = plans.plan(spec, 2, lay, capability=capability)
    kernel = "ring_attn_fwd_gluon" if gluon else "ring_attn_fwd_kernel"
    assert p.config.gluon is gluon and p.kernel().__name__ == kernel
    masked = spec.segmented or spec.window != (-1, -1)
    if gluon:  # head_dim 256: 64-row K/V blocks in 2 slots (shared memory), chunks of 4 blocks as at 64 and 128;
        # with segment ids chunks of one block (its published id range: which blocks a tile loads, unmasked)
        tiles = (128, 64, 2, 256) if spec.head_dim == 256 else (128, 128, 3, 512)
        if spec.segmented:
            tiles = tiles[:3] + (tiles[1], )
        assert (p.config.block_m, p.config.block_n, p.config.num_stages, p.chunk_rows) == tiles
        assert p.config.num_warps == 4 and p.block == p.config.block_n
        assert p.grid == (8 * spec.seq_local // 128,)  # without the GPU's SM count: a program per tile
        # Persistent: a program per SM (132 on an H200) where there are more tiles, a program per tile where fewer
        n_tiles = 8 * spec.seq_local // 128
        assert plans.plan(spec, 2, lay, capability=capability, sms=132).grid == (min(n_tiles, 132),)
        assert plans.plan(spec, 2, lay, capability=capability, sms=3).grid == (3,)
    else:  # the tl kernels: a program per tile whatever the GPU
        assert plans.plan(spec, 2, lay, capability=capability, sms=3).grid == p.grid
    assert not plans.plan(spec, 2, lay, capability=capability, interpret=True).config.gluon
    assert plans.plan_bwd(spec, 2, lay).kernel().__name__ == "ring_attn_bwd_kernel"
    fast = plans.plan_bwd(spec, 2, lay, capability=capability)
    assert fast.config.gluon is (gluon and spec.head_dim in (64, 128))
    assert fast.config.deterministic is not fast.config.gluon
    assert fast.kernel().__name__ == ("ring_attn_bwd_gluon" if fast.config.gluon else "ring_attn_bwd_kernel")
    if fast.config.gluon:  # its tasks: delta, partial and final dK/dV, dQ; its scratch: delta, then dQ's sums
        assert fast.grid == (2 * fast.n_dq_tasks + fast.n_partial_tasks + fast.n_final_tasks,)
        # Persistent as the forward: a program per SM where there are more tasks (each takes tickets until none is
        # left); without the SM count, a program per task
        assert plans.plan_bwd(spec, 2, lay, capability=capability, sms=132).grid == (min(fast.grid[0], 132),)
        assert plans.plan_bwd(spec, 2, lay, capability=capability, sms=3).grid == (3,)
        # (then its counters of dQ's adds: 2 per head and step of query rows, 128 at head_dim 64, 64 at 128)
        q_rows = {64: 128, 128: 64}[spec.head_dim]
        assert (fast.config.kv_block_m, fast.config.dq_block_n) == (q_rows, q_rows)
        turns = 8 * spec.seq_local // q_rows * 2
        assert fast.out_shapes[3] == ((1 * 8 * spec.seq_local * (1 + spec.head_dim) + turns,), "float32")
        assert not fast.constexprs()["DETERMINISTIC"]
    split = plans.plan_bwd(spec, 2, lay, capability=capability, deterministic=True, gluon_det=False)
    for p in (split, plans.plan_bwd(spec, 2, lay, capability=capability, interpret=True)):
        assert p.kernel().__name__ == "ring_attn_bwd_kernel" and p.config.deterministic
    with control.environ(**{plans.GLUON_DET_ENV: "0"}):  # what gluon_det=None reads
        assert plans.plan_bwd(spec, 2, lay, capability=capability, deterministic=True) == split
    assert plans.plan_bwd(spec, 2, lay, capability=capability, deterministic=True, gluon_det=False,
                          sms=3).grid == split.grid  # the tl kernels: a program per task
    det = plans.plan_bwd(spec, 2, lay, capability=capability, deterministic=True)  # (gluon_det by default)
    assert det == plans.plan_bwd(spec, 2, lay, capability=capability, deterministic=True, gluon_det=True)
    # (its deterministic order only at head_dim 128: at 64 the split is faster, plans.GLUON_BWD_DET_HEAD_DIMS)
    assert det.config.gluon is (fast.config.gluon and not masked and spec.head_dim == 128) and det.config.deterministic
    if det.config.gluon:
        assert det.constexprs()["DETERMINISTIC"] and (det.kernel(), det.grid, det.out_shapes) == (
            fast.kernel(), fast.grid, fast.out_shapes)


@pytest.mark.parametrize("kw", [dict(), dict(D=64, dtype="float16", causal=False, layout="zigzag", S=512),
                                dict(dtype="float32", window=(100, 0), segmented=True)])
def test_deterministic_reaches_the_backward_config_but_not_its_binary(kw):
    """plan_bwd / BwdKernelConfig.get_default take the caller's ``deterministic``; where no Gluon backward applies
    (no GPU capability here; on an H200, test_the_gluon_kernel_takes_the_forwards_it_applies_to) both answers run
    the split kernel (deterministic, so its config says so) with the same launch: the same grid, constexprs and
    compile record, i.e. one binary and one cache entry whatever the caller asked (default: False, as the
    frontends')."""
    lay = control.HeapLayout.for_workspace(1 << 30)
    spec = _spec(**kw)
    default, det, fast = (plans.plan_bwd(spec, 2, lay, **x) for x in (dict(), dict(deterministic=True),
                                                                         dict(deterministic=False)))
    assert default == fast
    for p in (det, fast):
        assert p.config.deterministic and p.kernel().__name__ == "ring_attn_bwd_kernel"
    assert det.config == plans.BwdKernelConfig.get_default(spec, 2, deterministic=True)
    assert (det.grid, det.constexprs(), det.compile_record()) == (fast.grid, fast.constexprs(), fast.compile_record())


def test_the_gluon_kernel_can_be_turned_off(monkeypatch):
    """RING_ATTENTION_GLUON=0: no capability reaches the plan, so every forward runs the tl kernel (for A/B runs, or
    to step around a Gluon fault); a CPU device has none either."""
    import torch

    monkeypatch.setattr(plans, "_CAPABILITY", {torch.device("cuda", 0): (9, 0)})
    assert plans.gluon_capability(torch.device("cuda", 0)) == (9, 0)
    assert plans.gluon_capability(torch.device("cpu")) is None
    monkeypatch.setenv(plans.GLUON_ENV, "0")
    assert plans.gluon_capability(torch.device("cuda", 0)) is None


DIRECT_LAUNCH = textwrap.dedent("""
    import json
    import torch
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    from ring_core.protocol import control
    from ring_core import plans, testing, validate
    from torch_bridge import fused

    driver.set_active(testing.no_gpu_driver(stream=7))  # what the JIT asks of a driver
    log = []

    class Compiled:  # a compiled kernel as the JIT returns it; its launcher records what it is given
        packed_metadata, function = ("meta",), "fn"
        def launch_metadata(self, grid, stream, *args):
            return None
        def run(self, gx, gy, gz, stream, function, meta, launch_metadata, enter, exit_, *args):
            log[-1]["launcher"] = [gx, gy, gz, stream, function, list(meta),
                                   [a.data_ptr() if hasattr(a, "data_ptr") else a for a in args],
                                   [type(a).__name__ for a in args], enter is None, exit_ is None]
    def compile_(self, key, signature, device, constexprs, options, attrs, warmup):
        log[-1]["jit"] = True
        return Compiled()
    JITFunction._do_compile = compile_  # the JIT's compile, never cached: each JIT launch shows
    lay = control.HeapLayout.for_workspace(1 << 30)
    B, S, H, HKV, D, W, dt = 1, 1024, 8, 2, 128, 2, torch.bfloat16
    spec = validate.check_attention_args(
        (B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), "bfloat16", "bfloat16", "bfloat16", is_causal=True,
        scale=None, layout="contiguous", backend="fused", backends=("fused",), window_size=None,
        segment_ids_shape=None, segment_ids_dtype=None)
    q, kv = torch.zeros(B, S, H, D, dtype=dt), torch.zeros(B, S, HKV, D, dtype=dt)
    ids, ctx = torch.zeros(1, dtype=torch.int32), torch.zeros((W + 4) * 2, dtype=torch.int32)
    rows, status = torch.zeros(B, H, S), torch.zeros(control.STATUS_WORDS, dtype=torch.int32)
    out = []
    for p in [plans.plan(spec, W, lay), plans.plan_bwd(spec, W, lay), plans.plan(spec, W, lay, capability=(9, 0)),
              plans.plan_bwd(spec, W, lay, capability=(9, 0))]:
        if p.kind == control.KIND_FWD:  # torch_bridge.fused's argument lists
            args = [q, kv, kv, ids, ctx, *p.scalars(2.5), q.clone(), rows, status]
        else:
            args = [q, kv, kv, q, q, rows, rows, ids, ctx, *p.scalars(2.5), q.clone(), kv.clone(), kv.clone(), rows,
                    status]
        unaligned = torch.zeros(q.numel() + 1, dtype=dt)[1:].view(q.shape)
        for a in (args, args, [unaligned] + args[1:], args):
            log.append({})
            fused._launch(p, *a)
        hook = lambda metadata: None  # a profiler's launch hook (proton's kind)
        knobs.runtime.launch_enter_hook.add(hook)
        log.append({})
        fused._launch(p, *args)
        knobs.runtime.launch_enter_hook.remove(hook)
        out.append([p.config.gluon, log[-5:]])
        del log[:]
    print(json.dumps(out))
""")


def test_torch_launches_reuse_the_compiled_kernel_with_the_jits_arguments():
    """torch_bridge.fused._launch: a plan's first launch goes through Triton's JIT; the next ones call the compiled
    kernel's launcher directly, with exactly the argument list (every parameter, constexprs included), grid and
    stream the JIT gave it (the tensors' pointers as integers); a launch with a pointer not 16-byte aligned
    (another specialisation) goes through the JIT again, and the aligned launch after it still reuses the kernel;
    with a launch hook set (a profiler) the direct launch passes what the JIT does. For the tl and the Gluon
    kernels, forward and backward (a stand-in driver and compile: no GPU)."""
    from ring_core import testing

    runs = testing.run_compiled(DIRECT_LAUNCH)
    assert [g for g, _ in runs] == [False, False, True, True]
    for _, (first, second, unaligned, after, hooked) in runs:
        assert first.get("jit") and not second.get("jit") and unaligned.get("jit") and not after.get("jit")
        assert not hooked.get("jit")
        assert second["launcher"][:7] == first["launcher"][:7] == after["launcher"][:7] == hooked["launcher"][:7]
        assert unaligned["launcher"][6][0] % 16 != 0
        assert first["launcher"][3] == 7  # the driver's current stream
        # The JIT passes tensors and its hooks; the direct launch the tensors' pointers as integers (no lookup in the
        # launcher) and no hooks while none is set, and tensors and hooks as the JIT once a launch hook is set.
        assert "Tensor" in first["launcher"][7] and not any(first["launcher"][8:])
        assert "Tensor" not in second["launcher"][7] and all(second["launcher"][8:])
        assert hooked["launcher"][7] == first["launcher"][7] and not any(hooked["launcher"][8:])


def test_torch_statuses_come_zeroed_aligned_and_one_per_launch():
    """torch_bridge.fused hands each launch a zeroed status (a kernel that never completes leaves it so:
    ``control.check_status`` says so) from blocks zeroed at once: every row 16-byte aligned (an unaligned pointer
    is another specialisation of the kernel), none handed out twice, and a new block once one is used up; a
    status written by a launch does not show in the next one's."""
    import torch

    from torch_bridge import fused

    fused._STATUSES.clear()
    n = control.STATUS_WORDS
    seen, live = set(), []  # (live: a freed block's memory may come back)
    for i in range(2 * fused._STATUS_ROWS + 3):
        st = fused._zeroed_status((n,), "int32", torch.device("cpu"))
        assert st.shape == (n,) and st.dtype == torch.int32 and st.is_contiguous(), i
        assert st.data_ptr() % 16 == 0 and st.data_ptr() not in seen, i
        assert not st.any(), i
        seen.add(st.data_ptr())
        live.append(st)
        st.fill_(7)  # what a launch writes
    with pytest.raises(RuntimeError, match="did not complete"):
        control.check_status(fused._zeroed_status((n,), "int32", torch.device("cpu")).numpy(), 0)


def test_torch_statuses_of_cuda_launches_are_pinned_host_rows_and_track_takes_only_those(monkeypatch):
    """For a CUDA launch the status block is pinned host memory (no device placement): the kernel stores the words
    into it through unified addressing, and lifecycle.track records only an event, no copy. A block that could not
    be pinned raises when it is made (once per block of rows, not per call); track refuses a status that is not
    host memory (a device status would be read before it is copied)."""
    import torch

    from torch_bridge import fused, lifecycle

    made = []
    real_zeros = torch.zeros

    def zeros(*shape, **kw):
        made.append(kw)
        kw = {k: v for k, v in kw.items() if k != "pin_memory"}  # (no CUDA here to pin with)
        return real_zeros(*shape, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(fused, "_STATUSES", {})
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    st = fused._zeroed_status((control.STATUS_WORDS,), "int32", torch.device("cuda", 0))
    assert made == [dict(dtype=torch.int32, pin_memory=True)] and st.device.type == "cpu" and not st.any()
    fused._zeroed_status((control.STATUS_WORDS,), "int32", torch.device("cpu"))
    assert made[1] == dict(dtype=torch.int32, device=torch.device("cpu"))
    monkeypatch.setattr(fused, "_STATUSES", {})
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    with pytest.raises(RuntimeError, match="pinned host memory for the fused calls' status could not be had"):
        fused._zeroed_status((control.STATUS_WORDS,), "int32", torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="status must be pinned host memory the kernel writes"):
        lifecycle.track(real_zeros(control.STATUS_WORDS, dtype=torch.int32, device="meta"), ((0,), 0, None), None)
    assert lifecycle._pending == []


@pytest.mark.parametrize("D, dtype, S, layout, capability, want", [
    (96, "bfloat16", 1024, "zigzag", (9, 0), 128),  # the tl kernels would compute at 128 anyway (BLOCK_D)
    (80, "float16", 384, "contiguous", (9, 0), 128),
    (112, "bfloat16", 256, "contiguous", (9, 0), 128),
    (192, "bfloat16", 512, "contiguous", (9, 0), 256),
    (48, "bfloat16", 512, "contiguous", (9, 0), 64),
    (64, "bfloat16", 512, "contiguous", (9, 0), 64),  # the Gluon kernels' own widths stay
    (128, "bfloat16", 512, "zigzag", (9, 0), 128),
    (32, "bfloat16", 512, "contiguous", (9, 0), 32),  # no Gluon tiles at 32: the tl kernel at 32
    (96, "float32", 1024, "contiguous", (9, 0), 96),  # float32: the tl kernel
    (96, "bfloat16", 384, "zigzag", (9, 0), 96),  # zigzag needs seq_local % 256 for the Gluon tiles
    (96, "bfloat16", 1024, "contiguous", (8, 0), 96),  # not Hopper
    (96, "bfloat16", 1024, "contiguous", None, 96),  # no GPU (or RING_ATTENTION_GLUON=0)
])
def test_kernel_spec_pads_to_the_gluon_width_where_the_tl_kernel_would_compute_it(D, dtype, S, layout, capability,
                                                                                 want):
    """ring_core.plans.kernel_spec: the frontends pad q, k and v to the next power of two only where the Gluon
    forward takes that width (the tl kernels compute at it anyway: their BLOCK_D); the padded spec keeps the
    caller's scale (1 / sqrt of its head_dim)."""
    spec = _spec(D=D, dtype=dtype, S=S, layout=layout, causal=layout == "zigzag")
    padded = plans.kernel_spec(spec, capability)
    assert (padded is spec) is (want == D)
    assert padded.head_dim == want and padded.scale == spec.scale == pytest.approx(D ** -0.5)
    assert dataclasses.replace(padded, head_dim=D) == spec  # nothing else changes
    if want != D:
        assert plans.block_d(D) == want and plans.gluon_applies(padded, 1, capability)


def test_keys_ids_apart_from_the_queries():
    """A call whose keys carry ids other than its queries' (the two-level ring's calls with another node's K/V,
    ring_core.nodes): the kernels read both from one int32 input [2, batch, seq_local] (KV_IDS); the Gluon forward
    and backward take it (with deterministic=True, as every masked call, the tl backward); the launchers check the
    ids' shape before anything runs."""
    from ring_core import validate

    lay = control.HeapLayout.for_workspace(1 << 30)
    spec = _spec(segmented=True)
    apart = dataclasses.replace(spec, kv_ids=True)
    assert not plans.plan(spec, 2, lay).constexprs()["KV_IDS"]
    fwd = plans.plan(apart, 2, lay, capability=(9, 0))
    assert fwd.constexprs()["KV_IDS"] and fwd.config.gluon
    assert plans.plan_bwd(spec, 2, lay, capability=(9, 0)).config.gluon
    bwd = plans.plan_bwd(apart, 2, lay, capability=(9, 0))
    assert bwd.config.gluon and bwd.constexprs()["KV_IDS"]
    det = plans.plan_bwd(apart, 2, lay, capability=(9, 0), deterministic=True)
    assert not det.config.gluon and det.constexprs()["KV_IDS"]
    assert not plans.plan(dataclasses.replace(apart, segmented=False), 2, lay).constexprs()["KV_IDS"]
    validate.check_segment_ids_given(apart, True, (2, spec.batch, spec.seq_local))
    with pytest.raises(ValueError, match="this call reads"):
        validate.check_segment_ids_given(apart, True, (spec.batch, spec.seq_local))
    with pytest.raises(ValueError, match="this call reads"):
        validate.check_segment_ids_given(spec, True, (2, spec.batch, spec.seq_local))
