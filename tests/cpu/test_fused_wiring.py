"""The GPU wiring of backend="fused" (forward and backward), run on the CPU: both frontends' launchers
(torch_bridge.fused and the custom call of jax_ring.fused) drive the real kernels in the Triton
interpreter, on one rank whose "heap" is a CPU buffer.

What this checks that the simulator does not: the autograd layers (the register_autograd of the torch custom ops
ring_attention::fwd/bwd, jax.custom_vjp) save what the backward needs and return the gradients in the right places; both
frontends pass the kernels the same argument lists, scalars, output shapes and zeroed status, from the one plan in
ring_core.plans; and so JAX and torch give bit-identical gradients. The custom call itself (jax_ring._triton_call) needs
a GPU: here its ``triton_call`` is replaced by a host callback that launches the kernel with exactly the arguments it
was given, with the GPU's default tile sizes. One rank only: the interpreter runs one kernel at a time per callback, so
ranks could not meet. The multi-rank protocol is tested by test_simulate*.py.
"""

import contextlib
import dataclasses
import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ring_core.runtime import heap as heap_mod  # noqa: E402
from ring_core.protocol import control  # noqa: E402
from ring_core.sim import interpret  # noqa: E402
from ring_core import plans, reference, testing  # noqa: E402

TORCH_DTYPES = {}  # filled on first use (torch is imported lazily)


class _CpuHeap(heap_mod.HeapRings):
    """ring_core.runtime.heap.SymmetricHeap's view for the frontends (rings, contexts, plans, kept errors) over one
    CPU buffer (world size 1); records the plans asked for, and the ``deterministic`` of each backward plan."""

    def __init__(self, size=4 << 20):
        import torch

        self.buf = torch.zeros(size, dtype=torch.uint8)
        super().__init__(0, [[self.buf.data_ptr()]], control.HeapLayout.for_workspace(size), self.buf)
        self.plans = []
        self.deterministic = []

    def plan(self, spec, ring_size, config=None):
        """The interpreter's code paths with the GPU's default tiles (not the simulator's small ones)."""
        self.plans.append(("fwd", spec))
        return super().plan(spec, ring_size, config=config or plans.KernelConfig.get_default(spec, ring_size),
                            interpret=True)

    def plan_bwd(self, spec, ring_size, config=None, deterministic=False):
        self.plans.append(("bwd", spec))
        self.deterministic.append(deterministic)
        cfg = config or plans.BwdKernelConfig.get_default(spec, ring_size, deterministic=deterministic)
        return super().plan_bwd(spec, ring_size, config=cfg, interpret=True, deterministic=deterministic)


@pytest.fixture
def cpu_heap(monkeypatch):
    interpret.ensure_interpreter()
    h = _CpuHeap()
    monkeypatch.setattr(heap_mod, "_heap", h)
    monkeypatch.setattr(heap_mod, "_release_hooks", [])
    return h


def _check_now(status, ring, timeout_s):
    """torch_bridge.lifecycle.track without the deferral: raise a failed call's status at once."""
    members, position, _ = ring
    control.check_status(status.numpy(), position, timeout_s, members=members)


def _torch_dtypes():
    import torch

    TORCH_DTYPES.update(float32=torch.float32, float16=torch.float16, bfloat16=torch.bfloat16, int32=torch.int32)


def _fake_kernel_call(launches, status=None):
    """A stand-in for jax_ring._triton_call.triton_call: launches the interpreted kernel from a host callback with
    the arguments it was given. ``status``: status words to return instead of the kernel's (a failure one rank
    cannot cause), or an iterator of them, one per launch."""
    import jax
    import torch

    _torch_dtypes()

    def triton_call(*args, kernel, out_shape, grid, name="", num_warps=None, num_stages=None, zeroed_outputs=(),
                    scalar_types=(), **constexprs):
        scalar = [isinstance(a, (bool, int, float, np.float32)) for a in args]
        assert len(scalar_types) == sum(scalar), (scalar_types, args)
        arrays = [a for a, s in zip(args, scalar) if not s]
        launches.append(dict(name=name, grid=grid, num_warps=num_warps, num_stages=num_stages,
                             zeroed=tuple(zeroed_outputs), out=[(o.shape, str(o.dtype)) for o in out_shape],
                             inputs=[(tuple(a.shape), str(a.dtype)) for a in arrays],
                             scalars=[a for a, s in zip(args, scalar) if s], constexprs=constexprs))

        def host(*arrs):
            it = iter(arrs)
            call = []
            for a, s in zip(args, scalar):
                if s:
                    call.append(float(a) if isinstance(a, np.float32) else a)
                else:
                    x = np.asarray(next(it))
                    call.append(interpret._to_torch(x, str(x.dtype)))
            outs = [torch.zeros(o.shape, dtype=TORCH_DTYPES[str(np.dtype(o.dtype))]) for o in out_shape]
            kernel[grid](*call, *outs, **constexprs)
            if status is not None:
                words = status if isinstance(status, np.ndarray) else next(status)
                outs[-1] = torch.from_numpy(np.asarray(words, np.int32))
            return tuple(interpret._to_numpy(o, str(np.dtype(od.dtype))) for o, od in zip(outs, out_shape))

        return list(jax.pure_callback(host, tuple(out_shape), *arrays))

    return triton_call


class _LaunchRecorder:
    """Stands in for a Triton kernel object: ``[grid](*args, **kw)`` records the arrays' dtypes, in argument order,
    then launches the real kernel."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append((self.name, [str(a.dtype).replace("torch.", "") for a in args if hasattr(a, "dtype")]))
            return self.kernel[grid](*args, **kw)
        return run


@pytest.mark.parametrize("dtype, causal, H, HKV, S, D, use_lse, deterministic, width", [
    ("bfloat16", True, 4, 2, 19, 24, False, False, None),
    ("float32", False, 2, 1, 7, 40, True, True, None),  # the loss uses lse too: its gradient flows through the kernel
    ("float16", True, 4, 1, 21, 40, True, False, 64),  # the kernels at a padded head_dim (plans.kernel_spec)
])
def test_jax_and_torch_fused_gradients(cpu_heap, monkeypatch, dtype, causal, H, HKV, S, D, use_lse, deterministic,
                                       width):
    """With ``deterministic=True`` (the second case) the keyword reaches every backward plan of both frontends,
    torch's gradients are bit-identical over two calls, and JAX's to torch's (as they are by default, today).
    ``width``: the heap says to run the kernels at that head_dim (as ring_core.plans.kernel_spec does for 80, 96
    and 192 on an H200): both frontends pad q, k and v with zeros, plan at the width, and cut the output and the
    gradients back to D, with the results of the call at D."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    import torch_bridge
    from jax_ring import fused as jfused
    from torch_bridge import fused as tfused

    launches = []
    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call(launches))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    monkeypatch.setattr(torch_bridge.api, "_fused_available", lambda: True)
    from ring_core.kernels import tl_fwd as kfwd, tl_bwd as kbwd

    torch_launches = []
    monkeypatch.setattr(kfwd, "ring_attn_fwd_kernel", _LaunchRecorder(kfwd.ring_attn_fwd_kernel, "ring_attn_fwd",
                                                                     torch_launches))
    monkeypatch.setattr(kbwd, "ring_attn_bwd_kernel", _LaunchRecorder(kbwd.ring_attn_bwd_kernel, "ring_attn_bwd",
                                                                     torch_launches))

    def pad_to_width():
        if width is not None:
            monkeypatch.setattr(cpu_heap, "kernel_spec",
                                lambda spec: dataclasses.replace(spec, head_dim=width) if spec.head_dim == D else spec)

    pad_to_width()
    ref = testing.random_inputs(3, 1, S, H, HKV, D, dtype, with_dout=True)
    q, k, v, do = (x.astype(reference.np_dtype(dtype)) for x in ref)
    kw = dict(is_causal=causal, scale=None, deterministic=deterministic)
    dl = (np.random.default_rng(4).standard_normal((1, H, S)) if use_lse else np.zeros((1, H, S))).astype(np.float32)

    # ---- torch: the custom ops and torch_bridge.fused's launchers (CPU tensors, interpreter)
    def torch_grads():
        tq, tk, tv = (interpret._to_torch(x, dtype).requires_grad_() for x in (q, k, v))
        out, lse = torch_bridge.ring_attention(tq, tk, tv, backend="fused", return_lse=True, **kw)
        if use_lse:
            torch.autograd.backward([out, lse], [interpret._to_torch(do, dtype), torch.from_numpy(dl)])
        else:
            out.backward(interpret._to_torch(do, dtype))
        return [interpret._to_numpy(x.grad, dtype) for x in (tq, tk, tv)]

    monkeypatch.setattr(torch_bridge.api, "_on_gpu", lambda x: True)  # let backend="fused" through
    t_grads = torch_grads()
    calls = 2 if deterministic else 1
    if deterministic:  # bit-identical from run to run
        for n, a, b in zip("qkv", torch_grads(), t_grads):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"torch d{n}, second call")
    monkeypatch.undo()  # _on_gpu and the rest; the heap again for JAX below
    monkeypatch.setattr(heap_mod, "_heap", cpu_heap)
    monkeypatch.setattr(heap_mod, "_release_hooks", [])
    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call(launches))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    pad_to_width()
    # The backward's heap need checked first; every backward plan got the call's deterministic.
    assert [p[0] for p in cpu_heap.plans] == ["bwd", "fwd", "bwd"] * calls
    assert cpu_heap.deterministic == [deterministic] * 2 * calls
    assert {p[1].head_dim for p in cpu_heap.plans} == {width or D}
    testing.check_grads("torch fused", [g.astype(np.float64) for g in t_grads], *ref, dtype, is_causal=causal,
                        dlse=dl)

    # ---- JAX: custom_vjp and the custom calls (one CPU device, the kernel in a host callback)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def loss(q, k, v, do, dl):
        o, lse = jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", return_lse=True, **kw)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(lse * dl)

    grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                                 in_specs=(P(None, "sp"),) * 4 + (P(None, None, "sp"),),
                                 out_specs=(P(None, "sp"),) * 3))
    j_grads = [np.asarray(g) for g in grad(*(jnp.asarray(x) for x in (q, k, v, do, dl)))]
    names = [entry["name"] for entry in launches]
    assert names == ["ring_attn_fwd", "ring_attn_bwd"], names
    assert cpu_heap.deterministic == [deterministic] * 2 * (calls + 1)  # the heap check in _fused_fwd, the backward
    fwd_call, bwd_call = launches
    assert bwd_call["zeroed"] == (4,) and bwd_call["out"][4] == ((control.STATUS_WORDS,), "int32")
    assert bwd_call["out"][3] == ((1, H, S), "float32")  # delta scratch
    assert isinstance(bwd_call["scalars"][2], np.float32)  # the scale travels as float32 in both frontends
    # The GPU's default tiles (not the simulator's small ones) ran here, in the interpreter.
    spec = cpu_heap.plans[-1][1]
    assert bwd_call["grid"] == plans.plan_bwd(spec, 1, cpu_heap.layout).grid
    assert bwd_call["constexprs"]["KV_BLOCK_N"] == plans.BwdKernelConfig.get_default(spec, 1).kv_block_n
    # Torch's launches pass arrays of the same dtypes in the same order (the context as int32 words too), so its
    # JIT compiles the signature the JAX launch compiles (ring_core.runtime.build): one binary, one cache entry.
    jax_types = [(c["name"], [dt for _, dt in c["inputs"]] + [dt for _, dt in c["out"]]) for c in launches]
    assert [t for t in torch_launches if t[0] == "ring_attn_fwd"][:1] == jax_types[:1]
    assert [t for t in torch_launches if t[0] == "ring_attn_bwd"][:1] == jax_types[1:]

    # ---- the same kernel with the same arguments: bit-identical gradients
    for n, a, b in zip("qkv", j_grads, t_grads):
        assert a.dtype == b.dtype == np.dtype(reference.np_dtype(dtype))
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"jax vs torch d{n}")


NAMES = ("out", "lse", "dq", "dk", "dv")


@pytest.mark.parametrize("dtype, causal, layout, window, H, HKV, S, D", [
    ("float32", True, "contiguous", (37, 0), 4, 2, 150, 16),  # a causal sliding window over several K/V blocks
    ("bfloat16", False, "zigzag", (9, 70), 2, 1, 136, 32),  # asymmetric, non-causal
])
def test_jax_and_torch_fused_with_masks(cpu_heap, monkeypatch, dtype, causal, layout, window, H, HKV, S, D):
    """Segment ids (packed documents crossing K/V blocks, then padding) and a sliding window through both
    frontends' fused autograd layers (the ids an array input of jax.custom_vjp and a Tensor? of the torch
    custom ops, the window in the spec): out, lse and the gradients right against float64, padding rows out 0,
    lse -inf and zero gradients, and JAX and torch bit-identical. Both launches get SEGMENTED / WINDOW and
    the ids themselves (int32 [batch, seq_local]), with the GPU's default tiles (several blocks here)."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    import torch_bridge
    from jax_ring import fused as jfused

    launches = []
    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    monkeypatch.setattr(torch_bridge.api, "_fused_available", lambda: True)
    monkeypatch.setattr(torch_bridge.api, "_on_gpu", lambda x: True)
    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call(launches))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)

    ref = testing.random_inputs(11, 1, S, H, HKV, D, dtype, with_dout=True)
    q, k, v, do = (x.astype(reference.np_dtype(dtype)) for x in ref)
    seg = testing.random_segment_ids(12, 1, S, max_len=S // 3)
    seg[:, -7:] = -1  # padding, whatever random_segment_ids chose
    pad = seg[0] < 0
    dl = np.random.default_rng(13).standard_normal((1, H, S)).astype(np.float32)
    kw = dict(is_causal=causal, layout=layout, window_size=window)
    mask = dict(is_causal=causal, segment_ids=seg, window=window)

    # ---- torch: the custom ops with segment_ids (Tensor?) and the window (int[])
    tq, tk, tv = (interpret._to_torch(x, dtype).requires_grad_() for x in (q, k, v))
    t_out, t_lse = torch_bridge.ring_attention(tq, tk, tv, backend="fused", return_lse=True,
                                               segment_ids=torch.from_numpy(seg), **kw)
    torch.autograd.backward([t_out, t_lse], [interpret._to_torch(do, dtype), torch.from_numpy(dl)])
    t_res = [interpret._to_numpy(x.detach(), dtype) for x in (t_out,)] + [t_lse.detach().numpy()] + \
        [interpret._to_numpy(x.grad, dtype) for x in (tq, tk, tv)]
    assert [p[0] for p in cpu_heap.plans] == ["bwd", "fwd", "bwd"]
    assert all(p[1].segmented and p[1].window == window for p in cpu_heap.plans)
    testing.check_attention("torch fused masks", t_res[0].astype(np.float64), t_res[1].astype(np.float64),
                            *ref[:3], dtype, **mask)
    testing.check_grads("torch fused masks", [g.astype(np.float64) for g in t_res[2:]], *ref, dtype, dlse=dl,
                        **mask)

    # ---- JAX: the custom_vjp with the ids as an array input, the custom calls
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def body(q, k, v, s, do, dl):
        attn = lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused",  # noqa: E731
                                                        return_lse=True, segment_ids=s, **kw)
        (out, lse), pull = jax.vjp(attn, q, k, v)
        return (out, lse, *pull((do, dl)))

    seq, rows = P(None, "sp"), P(None, None, "sp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 5 + (rows,), out_specs=(seq, rows) + (seq,) * 3))
    j_res = [np.asarray(x) for x in f(*(jnp.asarray(x) for x in (q, k, v, seg, do, dl)))]
    assert [c["name"] for c in launches] == ["ring_attn_fwd", "ring_attn_bwd"]
    want = plans.plan_bwd(cpu_heap.plans[-1][1], 1, cpu_heap.layout).constexprs()
    for c, at in zip(launches, (3, 7)):  # the ids after q, k, v (forward) / q, k, v, out, dout, lse, dlse
        assert c["inputs"][at] == ((1, S), "int32"), c["inputs"]
        assert c["constexprs"]["SEGMENTED"] and c["constexprs"]["WINDOW"]
        assert (c["constexprs"]["WIN_LEFT"], c["constexprs"]["WIN_RIGHT"]) == (want["WIN_LEFT"], want["WIN_RIGHT"])
    testing.check_attention("jax fused masks", j_res[0].astype(np.float64), j_res[1].astype(np.float64),
                            *ref[:3], dtype, **mask)

    # ---- padding rows, and the same kernels with the same arguments: bit-identical
    assert (t_res[0][0, pad].astype(np.float32) == 0).all() and (t_res[1][0][:, pad] == -np.inf).all()
    assert all((g[0, pad].astype(np.float32) == 0).all() for g in t_res[2:])
    for n, a, b in zip(NAMES, j_res, t_res):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"jax vs torch {n}")


def test_torch_fused_checks_backward_heap_before_forward(cpu_heap, monkeypatch):
    """A heap that fits the forward but not the backward: with inputs that need gradients the call raises
    HeapTooSmallError before the forward runs."""
    import torch

    import torch_bridge
    from torch_bridge import fused as tfused

    small = _CpuHeap(size=control.RING_SLOTS * control.CTL_BYTES + (64 << 10) + 10_000)  # ~10 KB of receive space
    monkeypatch.setattr(heap_mod, "_heap", small)
    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    monkeypatch.setattr(torch_bridge.api, "_fused_available", lambda: True)
    monkeypatch.setattr(torch_bridge.api, "_on_gpu", lambda x: True)
    monkeypatch.setattr(tfused, "ring_of", lambda h, group: ((0, 1), 0, 4))  # two ranks: nothing is launched
    x = torch.zeros(1, 16, 1, 64, dtype=torch.float16)  # K/V 4 KiB fit the 10 KB; + float32 partials do not
    with pytest.raises(control.HeapTooSmallError, match="backward call needs"):
        torch_bridge.ring_attention(x.clone().requires_grad_(), x.clone(), x.clone(), backend="fused")
    assert small.plans == [("bwd", small.plans[0][1])]


def test_torch_eager_calls_skip_the_custom_op_dispatch(cpu_heap, monkeypatch):
    """Eager fused calls launch through torch_bridge.api._EagerFused (the custom ops' launches and autograd
    without their dispatch: docs/performance.md); the ops themselves are what torch.compile traces
    (tests/cpu/test_torch_compile.py: one graph with the two ops, compiled bit-identical to eager). Here: forward
    and backward in eager never enter the ops, and give the ops' own results bit for bit."""
    import torch

    import torch_bridge
    from torch_bridge import api

    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    monkeypatch.setattr(api, "_fused_available", lambda: True)
    monkeypatch.setattr(api, "_on_gpu", lambda x: True)
    q, k, v, do = (torch.as_tensor(x).float() for x in testing.random_inputs(3, 1, 40, 4, 2, 32, "float32",
                                                                                with_dout=True))

    def grads(route):
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = route(qs, ks, vs)
        ((out * do).sum() + lse.sum()).backward()
        return [out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad]

    ops = (api._fwd_op, api._bwd_op)
    monkeypatch.setattr(api, "_fwd_op", lambda *a: pytest.fail("eager call entered ring_attention::fwd"))
    monkeypatch.setattr(api, "_bwd_op", lambda *a: pytest.fail("eager backward entered ring_attention::bwd"))
    eager = grads(lambda a, b, c: torch_bridge.ring_attention(a, b, c, is_causal=True, backend="fused",
                                                              return_lse=True))
    monkeypatch.setattr(api, "_fwd_op", ops[0])
    monkeypatch.setattr(api, "_bwd_op", ops[1])
    through_ops = grads(lambda a, b, c: ops[0](a, b, c, None, 32 ** -0.5, True, "contiguous", [-1, -1],
                                              api.group_to_name(None), None, False, True))
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), eager, through_ops):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("mode", ["call", "deferred", "left_out"])
def test_jax_error_modes(cpu_heap, monkeypatch, mode):
    """RING_ATTENTION_ERRORS: "deferred" (the default) puts the status check of jax_ring.status after every fused launch
    (no JAX effect: jit keeps its fast path; never dead-code eliminated, not even under grad, whose forward's status
    nothing reads); "call" the same check told to wait for the call's own status (``now``), no host callback (whose
    failure would fail JAX's runtime token, not the call); both launch the kernels torch launches. With the check left
    out (jax_ring.status.left_out(), for benchmarks) the kernel keeps a failure on the heap instead, which
    jax_ring.check_errors() raises once."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    from jax_ring import fused as jfused
    from jax_ring import status as jstatus

    launches = []
    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call(launches))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    if mode == "call":
        monkeypatch.setenv(control.ERRORS_ENV, mode)
    else:
        monkeypatch.delenv(control.ERRORS_ENV, raising=False)  # the default
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def loss(q, k, v):
        return jnp.sum(jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", is_causal=True))

    f = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                      out_specs=(P(None, "sp"),) * 3)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in testing.random_inputs(5, 1, 8, 2, 1, 16, "float32"))
    with jstatus.left_out() if mode == "left_out" else contextlib.nullcontext():
        jaxpr = jax.make_jaxpr(f)(q, k, v)
        hlo = jax.jit(f).lower(q, k, v).as_text()
        jax.block_until_ready(jax.jit(f)(q, k, v))
    text = str(jaxpr)
    assert "debug_callback" not in text, text[:2000]
    checks = 0 if mode == "left_out" else 2  # fwd, bwd
    assert text.count("ring_attention_status") == checks, text[:2000]
    assert text.count("now=True") == (checks if mode == "call" else 0), text[:2000]
    assert hlo.count("@ring_attention_status") == checks
    assert hlo.count("now = 1 : i64") == (checks if mode == "call" else 0), hlo[-3000:]
    assert not jaxpr.effects  # an effect would take jit's calls off its C++ fast path
    assert [c["constexprs"]["STICKY_ERRORS"] for c in launches] == [mode == "left_out"] * 2  # fwd, bwd
    jax_ring.check_errors()  # nothing failed
    # A failure kept by the kernel (here written by hand: one rank cannot fail) is raised once.
    status = np.zeros(control.STATUS_WORDS, np.int32)
    status[:4] = (control.ERR_KV_TIMEOUT, 1, 1, 7)
    start = cpu_heap.layout.ctl_off + 4 * control.CTL_STICKY
    cpu_heap.buf[start:start + 4 * control.STATUS_WORDS] = torch.from_numpy(status.view(np.uint8).copy())
    with pytest.raises(control.RingAttentionTimeout, match=r"call #7\) gave up .* K/V shard of rank 1"):
        jax_ring.check_errors()
    jax_ring.check_errors()


def test_jax_error_mode_is_read_at_each_trace_not_cached(cpu_heap, monkeypatch):
    """RING_ATTENTION_ERRORS is read when a call is traced, also where jax_ring caches a traced program: the same
    configuration through ring_attention_sharded (whose jitted shard_map is cached per configuration) under
    "call", then the default, then "call" again gets each mode's check, not the first one's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import jax_ring
    from jax_ring import fused as jfused

    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call([]))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in testing.random_inputs(6, 1, 8, 2, 1, 16, "float32"))
    for mode in ("call", None, "call"):
        if mode is None:
            monkeypatch.delenv(control.ERRORS_ENV, raising=False)
        else:
            monkeypatch.setenv(control.ERRORS_ENV, mode)
        text = str(jax.make_jaxpr(lambda a, b, c: jax_ring.ring_attention_sharded(
            a, b, c, mesh=mesh, axis_name="sp", backend="fused", is_causal=True))(q, k, v))
        assert "ring_attention_status" in text, (mode, text[:1500])
        assert ("now=True" in text) == (mode == "call"), (mode, text[:1500])


def test_jax_deferred_falls_back_to_the_callback_where_xla_refuses_the_handler(cpu_heap, monkeypatch):
    """A jaxlib that would not take the status check's handler: the deferred mode says so and checks each call by
    the host callback instead (errors still raised, at a round trip's cost)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    from jax_ring import fused as jfused
    from jax_ring import status as jstatus

    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call([]))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    monkeypatch.setattr(jstatus, "register", lambda platform: RuntimeError("UNIMPLEMENTED: API version 9"))
    monkeypatch.delenv(control.ERRORS_ENV, raising=False)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    f = jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused"),
                      mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in testing.random_inputs(5, 1, 8, 2, 1, 16, "float32"))
    with pytest.warns(RuntimeWarning, match=r"could not be registered \(UNIMPLEMENTED: API version 9\); fused calls "
                                            r"are checked by a host callback instead"):
        text = str(jax.make_jaxpr(f)(q, k, v))
    assert "debug_callback" in text and "ring_attention_status" not in text


def test_jax_deferred_check_raises_at_the_next_call(cpu_heap, monkeypatch):
    """The default mode on the CPU platform (the copy a memcpy): a failed call returns normally; the next fused
    call on this process fails with the failure's message (naming global ranks, from the ring's members), later
    calls run again, and jax_ring.check_errors() raises the failure as its own type, once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    from jax_ring import fused as jfused
    from jax_ring import status as jstatus

    bad = np.zeros(control.STATUS_WORDS, np.int32)
    bad[:4] = (control.ERR_KV_TIMEOUT, 0, 1, 7)
    good = np.zeros(control.STATUS_WORDS, np.int32)
    good[3] = 8
    statuses = iter([good, bad, good, good, good])
    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call([], statuses))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    monkeypatch.delenv(control.ERRORS_ENV, raising=False)
    jstatus.clear()
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    f = jax.jit(jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused",
                                                                      timeout_s=2.5),
                              mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in testing.random_inputs(5, 1, 8, 2, 1, 16, "float32"))
    jax.block_until_ready(f(q, k, v))  # good
    jax.block_until_ready(f(q, k, v))  # bad: does not raise itself
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                       match=r"RingAttentionTimeout: fused ring attention on rank 0 \(call #7\) gave up after 2.5 s "
                             r"waiting for the K/V shard of rank 0 at ring step 1.*jax_ring.check_errors\(\) raises it"):
        jax.block_until_ready(f(q, k, v))
    jax.block_until_ready(f(q, k, v))  # reported once
    with pytest.raises(control.RingAttentionTimeout, match=r"rank 0 \(call #7\) gave up after 2.5 s"):
        jax_ring.check_errors()
    jax.block_until_ready(f(q, k, v))
    jax_ring.check_errors()
    assert jstatus.in_flight() == 0


@pytest.mark.parametrize("route", ["status", "callback"])
def test_jax_per_call_check_raises_the_kernels_status(cpu_heap, monkeypatch, route):
    """In "call" mode the failed call raises itself, naming ranks by their global ranks, and the next calls run
    again. ``status``: jax_ring.status waits for the call's own status and fails its program (its outputs: no
    effects_barrier() needed, none left failing), the failure then not kept for check_errors(). ``callback``: where
    XLA refuses that handler, a host callback gets the status words and the context row in one operand and raises
    it (through effects_barrier())."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    from jax_ring import fused as jfused
    from jax_ring import status as jstatus

    bad = np.zeros(control.STATUS_WORDS, np.int32)
    bad[:4] = (control.ERR_KV_TIMEOUT, 0, 1, 7)
    good = np.zeros(control.STATUS_WORDS, np.int32)
    good[3] = 8
    statuses = iter([good, bad, good, good])
    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call([], statuses))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    if route == "callback":
        monkeypatch.setattr(jstatus, "register", lambda platform: RuntimeError("UNIMPLEMENTED: API version 9"))
    monkeypatch.setenv(control.ERRORS_ENV, "call")
    jstatus.clear()
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    f = jax.jit(jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused",
                                                                      timeout_s=2.5),
                              mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in testing.random_inputs(5, 1, 8, 2, 1, 16, "float32"))
    with pytest.warns(RuntimeWarning) if route == "callback" else contextlib.nullcontext():
        jax.block_until_ready(f(q, k, v))
    with pytest.raises(Exception, match=r"RingAttentionTimeout: fused ring attention on rank 0 \(call #7\) gave up "
                                        r"after 2.5 s waiting for the K/V shard of rank 0 at ring step 1") as e:
        jax.block_until_ready(f(q, k, v))
        if route == "callback":
            jax.effects_barrier()
    assert jstatus.REPORTED[:40] not in str(e.value)  # this call's own failure, not an earlier one's
    jax.block_until_ready(f(q, k, v))
    jax.effects_barrier()
    if route == "status":
        jax_ring.check_errors()  # raised by the call: not kept
        assert jstatus.in_flight() == 0


@pytest.fixture
def jax_fused(cpu_heap, monkeypatch):
    """jax_ring's fused path on the CPU heap: the custom call replaced by the interpreter in a host callback (whose
    outputs, like the custom call's, are typed the same on every device). Returns the list of launches."""
    from jax_ring import fused as jfused

    launches = []
    monkeypatch.setattr(jfused, "_kernel_call", lambda: _fake_kernel_call(launches))
    monkeypatch.setattr(jfused, "fused_available", lambda: True)
    return launches


@pytest.mark.parametrize("width", [None, 32])
def test_jax_fused_under_jax_defaults(jax_fused, cpu_heap, monkeypatch, width):
    """shard_map's default check_vma: outputs and gradients typed like q, k, v (varying along the ring's
    axis); gradients taken outside the shard_map (as model code does), inside it with jax.vjp, through
    jax.checkpoint and jax.value_and_grad, all equal and right against float64. ``width``: the kernels run at a
    padded head_dim (ring_core.plans.kernel_spec, as for 96 on an H200), the pad and the cut inside the shard_map."""
    if width is not None:
        monkeypatch.setattr(cpu_heap, "kernel_spec",
                            lambda spec: dataclasses.replace(spec, head_dim=width) if spec.head_dim == 16 else spec)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    from jax_ring import _platform

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    ref = testing.random_inputs(8, 1, 24, 4, 2, 16, "float32", with_dout=True)
    q, k, v, do = (jnp.asarray(x) for x in ref)
    seen = {}

    def attn(q, k, v):
        out, lse = jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", is_causal=True, return_lse=True)
        seen["out"], seen["lse"] = _platform.varying_axes(out), _platform.varying_axes(lse)
        return out

    spec = P(None, "sp")
    f = jax.shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)  # check_vma: JAX's default
    loss = lambda q, k, v: jnp.sum(f(q, k, v) * do)  # noqa: E731
    outside = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert seen == {"out": {"sp"}, "lse": {"sp"}}
    testing.check_grads("grad outside shard_map", [np.asarray(g, np.float64) for g in outside], *ref, "float32",
                        is_causal=True)

    def body_vjp(q, k, v, do):
        _, pull = jax.vjp(attn, q, k, v)
        return pull(do)

    inside = jax.jit(jax.shard_map(body_vjp, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3))(q, k, v, do)
    remat = jax.shard_map(jax.checkpoint(attn), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    value, again = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(remat(q, k, v) * do), argnums=(0, 1, 2)))(q, k, v)
    for a, b, c in zip(outside, inside, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert np.isclose(float(value), float(loss(q, k, v)))
    assert {s.head_dim for _, s in cpu_heap.plans} == {width or 16}


def test_jax_fused_segment_ids_carry_no_gradient(jax_fused):
    """The segment ids are an array input of the custom_vjp, without a gradient: asked for one anyway
    (allow_int), JAX gives float0 zeros of their shape, and the other gradients are those of a call that
    does not ask (the bwd rule returns None for the ids)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in testing.random_inputs(10, 1, 16, 2, 1, 16, "float32",
                                                                               with_dout=True))
    seg = jnp.asarray(np.repeat([0, 1, 2, -1], 4)[None], jnp.int32)
    f = jax.shard_map(lambda q, k, v, s: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused",
                                                                 segment_ids=s, window_size=(5, 5)),
                      mesh=mesh, in_specs=(P(None, "sp"),) * 4, out_specs=P(None, "sp"))
    loss = lambda q, k, v, s: jnp.sum(f(q, k, v, s) * do)  # noqa: E731
    *grads, ds = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True))(q, k, v, seg)
    assert ds.dtype == jax.dtypes.float0 and ds.shape == seg.shape
    for a, b in zip(grads, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, seg)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [c["name"] for c in jax_fused] == ["ring_attn_fwd", "ring_attn_bwd"] * 2


def test_jax_fused_under_vmap_says_what_to_do(jax_fused):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    x = jnp.zeros((3, 1, 8, 2, 16), jnp.float32)  # a mapped axis in front of [batch, seq, heads, dim]
    f = jax.shard_map(lambda q: jax_ring.ring_attention(q, q, q, axis_name="sp", backend="fused"), mesh=mesh,
                      in_specs=P(None, None, "sp"), out_specs=P(None, None, "sp"))
    with pytest.raises(ValueError, match="does not run under jax.vmap.*Fold the mapped axis into the batch axis"):
        jax.vmap(f)(x)
    assert not jax_fused  # raised before any launch


def test_jax_fused_on_a_mesh_of_two_axes(jax_fused):
    """A ("dp", "sp") mesh: the context row is picked by the device's position over both axes (1 x 1 here:
    one CPU device; tests/cpu/test_rings.py builds the table of larger meshes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring

    mesh = Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("dp", "sp"))
    ref = testing.random_inputs(9, 2, 16, 2, 1, 8, "float32")
    spec = P("dp", "sp")
    f = jax.jit(jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused"),
                              mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    out = np.asarray(f(*(jnp.asarray(x) for x in ref)), np.float64)
    testing.check_attention("dp x sp mesh", out, None, *ref, "float32", is_causal=False)


# ------------------------------------------------------------------------------------------ deterministic
# What reaches the backward's plan (cpu_heap.deterministic: the heap check before the forward, then the backward):
# the keyword (default False, as in flash-attn) or the framework's switch for deterministic algorithms, read at the
# call (torch) or when the call is traced (JAX). Which kernel that picks is ring_core.plans' business
# (tests/cpu/test_launch.py); here the value only has to arrive.


def _det_inputs():
    """Small float32 q, k, v (numpy)."""
    return [x.astype(np.float32) for x in testing.random_inputs(6, 1, 8, 2, 1, 16, "float32")]


@pytest.fixture
def restore_torch_determinism():
    """torch.use_deterministic_algorithms as it was before the test (a process-wide switch)."""
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("how, want", [("default", False), ("keyword", True), ("module", True),
                                       ("use_deterministic_algorithms", True), ("warn_only", True)])
def test_torch_deterministic_reaches_the_backward_plan(cpu_heap, monkeypatch, restore_torch_determinism, how, want):
    import torch

    import torch_bridge

    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    monkeypatch.setattr(torch_bridge.api, "_fused_available", lambda: True)
    monkeypatch.setattr(torch_bridge.api, "_on_gpu", lambda x: True)
    if how == "use_deterministic_algorithms":
        torch.use_deterministic_algorithms(True)
    elif how == "warn_only":  # still asks for deterministic algorithms; only a missing one warns instead of raising
        torch.use_deterministic_algorithms(True, warn_only=True)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _det_inputs())
    if how == "module":
        attn = torch_bridge.RingAttention(backend="fused", deterministic=True)
        assert "deterministic=True" in repr(attn)
    else:
        attn = functools.partial(torch_bridge.ring_attention, backend="fused",
                                 **(dict(deterministic=True) if how == "keyword" else {}))
    attn(q, k, v).sum().backward()
    assert cpu_heap.deterministic == [want, want]


def _jax_fused_grad(**kw):
    """A fresh jitted gradient of jax_ring.ring_attention(backend="fused") over a one-device mesh (traced at its
    first call, so it reads XLA_FLAGS then)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def loss(q, k, v):
        return jnp.sum(jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", **kw))

    return jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                                 out_specs=(P(None, "sp"),) * 3))


@pytest.mark.parametrize("how, want", [("default", False), ("keyword", True), ("xla_flags", True),
                                       ("xla_flags_false", False)])
def test_jax_deterministic_reaches_the_backward_plan(jax_fused, cpu_heap, monkeypatch, how, want):
    import jax

    jax.devices("cpu")  # XLA has read XLA_FLAGS already: what is set below is for jax_ring alone
    flag = {"xla_flags": "=true", "xla_flags_false": "=false"}.get(how)
    if flag:
        monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops{flag}")
    f = _jax_fused_grad(**(dict(deterministic=True) if how == "keyword" else {}))
    jax.block_until_ready(f(*_det_inputs()))
    assert cpu_heap.deterministic == [want, want]


def test_jax_sharded_reads_xla_flags_at_each_call(jax_fused, cpu_heap, monkeypatch):
    """ring_attention_sharded keeps one jitted program per configuration: XLA_FLAGS is part of it (read at each
    call), so setting the flag between two calls makes the second one deterministic."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import jax_ring

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    grad = jax.grad(lambda q, k, v: jnp.sum(jax_ring.ring_attention_sharded(q, k, v, mesh=mesh, axis_name="sp",
                                                                            backend="fused")), argnums=(0, 1, 2))
    x = _det_inputs()
    jax.block_until_ready(grad(*x))
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true")
    jax.block_until_ready(grad(*x))
    assert cpu_heap.deterministic == [False, False, True, True]


@pytest.mark.parametrize("flags, want", [
    (None, False),  # XLA_FLAGS not set
    ("", False),
    ("--xla_force_host_platform_device_count=4", False),
    ("--xla_force_host_platform_device_count=4 --xla_gpu_deterministic_ops=true --xla_dump_to=/tmp/d", True),
    ("  --xla_gpu_deterministic_ops=true\t", True),
    ("--xla_gpu_deterministic_ops", True),  # a bool flag alone is true
    ("--xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=True", True),  # XLA (tsl's flag parser): true / false in any case, 1 / 0
    ("--xla_gpu_deterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops=0", False),
    ("--xla_gpu_deterministic_ops=yes", False),  # a value XLA refuses: the flag keeps its default
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),  # the last one wins
    ("--xla_gpu_deterministic_ops=false --xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_exclude_nondeterministic_ops=true", True),
    ("--xla_gpu_exclude_nondeterministic_ops=true --xla_gpu_deterministic_ops=false", True),  # either flag
    ("--xla_gpu_deterministic_ops_extra=true", False),  # another name
    ("-xla_gpu_deterministic_ops=true", False),  # XLA's flags take two dashes
    ("--xla_dump_to='/tmp/a b' --xla_gpu_deterministic_ops=true", True),  # a quoted value is one word
    ("--xla_dump_to=/tmp/d stray --xla_gpu_deterministic_ops=true", False),  # XLA stops at the first non-flag
])
def test_xla_flags_that_ask_for_deterministic_ops(monkeypatch, flags, want):
    from jax_ring import _platform

    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    assert _platform.xla_deterministic_ops() is want
    if flags is not None:
        assert _platform.xla_deterministic_ops(flags) is want


def test_xla_flags_from_a_file(tmp_path):
    """XLA_FLAGS that does not start with "-" names a file of flags (XLA reads it the same way)."""
    from jax_ring import _platform

    path = tmp_path / "flags"
    path.write_text("--xla_dump_to=/tmp/d\n--xla_gpu_deterministic_ops=true\n")
    assert _platform.xla_deterministic_ops(str(path))
    assert not _platform.xla_deterministic_ops(str(tmp_path / "missing"))
