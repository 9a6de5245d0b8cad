"""torch.compile over torch_bridge's fused path, on the CPU.

The fused forward and backward are the custom ops ``ring_attention::fwd`` / ``ring_attention::bwd``
(torch_bridge.fused). Here they run the real kernels in the Triton interpreter on one rank whose "heap" is
a CPU buffer (the ``cpu_heap`` fixture of tests/cpu/test_fused_wiring.py), and the checks are: compiled with
fullgraph=True (one graph, nothing of the launch traced), forward and gradients bit-identical to eager
(aot_eager and, where a C++ compiler exists, inductor), with segment ids and a window too, under
torch.utils.checkpoint too, with automatic dynamic shapes, the backward's heap check still raised before the
forward runs, user errors under compile, and ``opcheck`` of both ops (with and without masks).
backend="auto" on CPU without a process group (world size 1) is checked here too; the torch reference ring
over 2 ranks (its exchange, the op ``ring_attention::shift``) in test_torch_reference.py (test_compile).

The fused path needs no GPU for any of this, but one thing cannot be checked on CPU: the status copy and
event of ``torch_bridge.lifecycle.track`` (pinned memory, CUDA events) are replaced by an immediate check, as
in test_fused_wiring.py. They run inside the op's real implementation, which dynamo never traces.
"""

import dataclasses
import operator
import os
import shutil

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import torch_bridge  # noqa: E402
from ring_core.runtime import heap as heap_mod  # noqa: E402
from ring_core.protocol import control  # noqa: E402
from ring_core import testing  # noqa: E402
from test_fused_wiring import _CpuHeap, _check_now, cpu_heap, restore_torch_determinism  # noqa: E402,F401  (fixtures)
from torch_bridge import fused as tfused  # noqa: E402

FWD = torch.ops.ring_attention.fwd.default
BWD = torch.ops.ring_attention.bwd.default

# Inductor on CPU compiles C++; without a compiler only aot_eager runs.
HAVE_CXX = shutil.which(os.environ.get("CXX", "g++")) is not None
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not HAVE_CXX, reason="inductor on CPU needs a C++ compiler (g++); none found"))]


@pytest.fixture
def fused_cpu(cpu_heap, monkeypatch):
    """backend='fused' through the interpreter for CPU tensors, eager and compiled; a fresh dynamo cache."""
    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    monkeypatch.setattr(torch_bridge.api, "_on_gpu", lambda x: True)
    torch._dynamo.reset()
    yield cpu_heap
    torch._dynamo.reset()


def _inputs(seed, b, s, h, hkv, d, dtype, requires_grad=True):
    q, k, v, do = testing.random_inputs(seed, b, s, h, hkv, d, dtype, with_dout=True)
    dt = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(x).to(dt).requires_grad_(requires_grad) for x in (q, k, v))
    dl = torch.randn(b, h, s, generator=torch.Generator().manual_seed(seed))  # gradient of lse
    return q, k, v, torch.from_numpy(do).to(dt), dl


def _fwd_bwd(f, *args):
    """f's (out, lse) from the tensor inputs, and their gradients; ``args`` end with the gradients of out and
    of lse (both carry one)."""
    *inputs, do, dl = args
    for x in inputs:
        x.grad = None
    out, lse = f(*inputs)
    torch.autograd.backward([out, lse], [do, dl])
    return [out.detach(), lse.detach()] + [x.grad for x in inputs]


def _assert_identical(got, want, names):
    for n, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(a, b), f"{n}: compiled differs from eager by {(a.double() - b.double()).abs().max()}"


NAMES = ("out", "lse", "dq", "dk", "dv")


def test_fullgraph_one_graph_two_ops(fused_cpu):
    """fullgraph=True gives one dynamo graph whose only call is the fwd op (argument checks, backend choice
    and the group's name are constants by then), and AOTAutograd's backward graph calls the bwd op once."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"dynamo": [], "fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return gm.forward if kind == "dynamo" else make_boxed_func(gm.forward)
        return compiler

    def backend(gm, example_inputs):
        keep("dynamo")(gm, example_inputs)
        return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))(gm, example_inputs)

    attn = torch_bridge.RingAttention(backend="fused", is_causal=True, layout="zigzag", return_lse=True)
    args = _inputs(0, 1, 8, 4, 2, 16, "bfloat16")
    want = _fwd_bwd(attn, *args)
    got = _fwd_bwd(torch.compile(attn, fullgraph=True, backend=backend), *args)
    _assert_identical(got, want, NAMES)

    (g,) = graphs["dynamo"]
    calls = [n.target for n in g.graph.nodes if n.op == "call_function"]
    assert calls.count(FWD) == 1 and set(calls) <= {FWD, operator.getitem, operator.eq, operator.not_}, calls
    (fw,), (bw,) = graphs["fw"], graphs["bw"]
    assert [n.target for n in fw.graph.nodes if n.target in (FWD, BWD)] == [FWD]
    assert [n.target for n in bw.graph.nodes if n.target in (FWD, BWD)] == [BWD]
    fwd_node = next(n for n in fw.graph.nodes if n.target == FWD)
    # segment ids (None: none), scale, is_causal, layout, window ([-1, -1]: none), group ("" = world), timeout
    # (None: the environment's), deterministic, check_backward
    assert fwd_node.args[3:] == (None, 0.25, True, "zigzag", [-1, -1], "", None, False, True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_matches_eager(fused_cpu, backend):
    """RingAttention(backend="fused") compiled with fullgraph=True: out, lse and the gradients (from both)
    bit-identical to eager; the same heap checks and launches as eager. With aot_eager, inside a function
    that scales q (one rounding either way, so still bitwise) and passes K/V as strided views of one tensor.
    With inductor, alone: inductor's first C++ kernel in a process costs 20-35 s here (it first compiles a
    probe for each vector ISA of the CPU), and its C++ code is not what is tested."""
    attn = torch_bridge.RingAttention(backend="fused", return_lse=True, timeout_s=30)
    q, k, v, do, dl = _inputs(1, 2, 5, 2, 1, 24, "float32")
    if backend == "aot_eager":
        kv = torch.stack([k, v], 2).detach().requires_grad_()
        model, inputs, names = (lambda q, kv: attn(q * 1.5, *kv.unbind(2))), (q, kv), ("out", "lse", "dq", "dkv")
    else:
        model, inputs, names = attn, (q, k, v), NAMES
    want = _fwd_bwd(model, *inputs, do, dl)
    n = len(fused_cpu.plans)
    got = _fwd_bwd(torch.compile(model, fullgraph=True, backend=backend), *inputs, do, dl)
    _assert_identical(got, want, names)
    assert [p[0] for p in fused_cpu.plans[n:]] == ["bwd", "fwd", "bwd"]  # as eager: heap check, fwd, bwd


def test_compiled_at_a_padded_head_dim_matches_eager(fused_cpu, monkeypatch):
    """Where the kernels run at a padded head_dim (ring_core.plans.kernel_spec; here 24 -> 32, as 96 -> 128 on
    an H200), the pad and the cut trace into the graph beside the ops (fullgraph=True): out, lse and the gradients
    at the caller's head_dim, bit-identical to eager, both planned at the padded width."""
    monkeypatch.setattr(fused_cpu, "kernel_spec",
                        lambda spec: dataclasses.replace(spec, head_dim=32) if spec.head_dim == 24 else spec)
    attn = torch_bridge.RingAttention(backend="fused", is_causal=True, return_lse=True)
    q, k, v, do, dl = _inputs(5, 1, 9, 4, 2, 24, "float16")
    want = _fwd_bwd(attn, q, k, v, do, dl)
    got = _fwd_bwd(torch.compile(attn, fullgraph=True, backend="aot_eager"), q, k, v, do, dl)
    _assert_identical(got, want, NAMES)
    assert got[0].shape == q.shape and got[4].shape == v.shape
    assert {p[1].head_dim for p in fused_cpu.plans} == {32}


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_with_masks_matches_eager(fused_cpu, backend):
    """Segment ids (an input of the compiled function: documents, then padding) and a sliding window (fixed
    in the module, a constant of the graph), compiled with fullgraph=True: out, lse and the gradients
    bit-identical to eager and right against float64; the ids reach both ops as a tensor input, the window
    as [left, right], and every plan has both."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from ring_core import layout

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    attn = torch_bridge.RingAttention(backend="fused", is_causal=True, layout="zigzag", window_size=(5, 0),
                                      return_lse=True)
    q, k, v, do, dl = _inputs(7, 1, 24, 4, 2, 16, "float32")
    seg = torch.from_numpy(testing.random_segment_ids(8, 1, 24, max_len=8))
    seg[:, -3:] = -1
    model = lambda q, k, v, seg: attn(q, k, v, segment_ids=seg)  # noqa: E731
    want = _fwd_bwd(lambda q, k, v: model(q, k, v, seg), q, k, v, do, dl)
    n = len(fused_cpu.plans)
    compiler = aot_autograd(fw_compiler=keep, bw_compiler=keep) if backend == "aot_eager" else backend
    compiled = torch.compile(model, fullgraph=True, backend=compiler)
    got = _fwd_bwd(lambda q, k, v: compiled(q, k, v, seg), q, k, v, do, dl)
    _assert_identical(got, want, NAMES)
    assert [p[0] for p in fused_cpu.plans[n:]] == ["bwd", "fwd", "bwd"]
    assert all(p[1].segmented and p[1].window == (5, 0) for p in fused_cpu.plans[n:])
    if backend == "aot_eager":
        fw, bw = graphs
        fwd_node = next(node for node in fw.graph.nodes if node.target == FWD)
        bwd_node = next(node for node in bw.graph.nodes if node.target == BWD)
        assert fwd_node.args[3].meta["val"].dtype == torch.int32 and fwd_node.args[7] == [5, 0]
        assert bwd_node.args[7].meta["val"].dtype == torch.int32 and bwd_node.args[11] == [5, 0]
    # At world size 1 the zigzag order is the natural one: the float64 reference applies as it is.
    assert list(layout.layout_permutation(24, 1, "zigzag")) == list(range(24))
    x64 = [x.detach().double().numpy() for x in (q, k, v, do)]
    mask = dict(is_causal=True, segment_ids=seg.numpy(), window=(5, 0))
    testing.check_attention("compiled masks", got[0].double().numpy(), got[1].double().numpy(), *x64[:3],
                            "float32", **mask)
    testing.check_grads("compiled masks", [g.double().numpy() for g in got[2:]], *x64, "float32", dlse=dl.numpy(),
                        **mask)


def test_deterministic_under_compile(fused_cpu, restore_torch_determinism):
    """The call's effective ``deterministic`` is a constant of the graph, handed to both ops (the fwd op passes
    it on through setup_context): the keyword, or torch.use_deterministic_algorithms(True) as dynamo finds it
    when it traces; flipping that switch recompiles (dynamo guards on it), so the next backward plan gets it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def flags():
        """(fwd op's deterministic, bwd op's) in the last forward and backward graphs."""
        fwd = next(n for n in graphs[-2].graph.nodes if n.target == FWD)
        bwd = next(n for n in graphs[-1].graph.nodes if n.target == BWD)
        return fwd.args[10], bwd.args[14]

    q, k, v, do, dl = _inputs(9, 1, 4, 2, 1, 16, "float32")
    for keyword, switch, want in ((False, False, False), (True, False, True), (False, True, True)):
        torch.use_deterministic_algorithms(switch)
        f = torch.compile(lambda q, k, v: torch_bridge.ring_attention(q, k, v, backend="fused", return_lse=True,
                                                                      deterministic=keyword),
                          fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        n = len(fused_cpu.deterministic)
        _fwd_bwd(f, q, k, v, do, dl)
        assert flags() == (want, want) and fused_cpu.deterministic[n:] == [want, want], (keyword, switch)
    torch.use_deterministic_algorithms(False)  # the last function again: recompiled without the switch
    n, traced = len(fused_cpu.deterministic), len(graphs)
    _fwd_bwd(f, q, k, v, do, dl)
    assert len(graphs) == traced + 2 and flags() == (False, False) and fused_cpu.deterministic[n:] == [False, False]


def test_checkpoint_compiled(fused_cpu):
    """torch.utils.checkpoint (use_reentrant=False) around a block with fused attention, compiled with
    fullgraph=True: the gradients of eager without checkpointing, bit for bit; the forward op runs again
    in the backward (it is a collective: every rank recomputes it alike)."""

    class Block(torch.nn.Module):
        def __init__(self, dim=32, heads=2, kv_heads=1, head_dim=16):
            super().__init__()
            self.h, self.hkv, self.d = heads, kv_heads, head_dim
            self.wq = torch.nn.Linear(dim, heads * head_dim)
            self.wkv = torch.nn.Linear(dim, 2 * kv_heads * head_dim)
            self.wo = torch.nn.Linear(heads * head_dim, dim)
            self.attn = torch_bridge.RingAttention(backend="fused", is_causal=True)

        def mix(self, x):
            b, t, _ = x.shape
            q = self.wq(x).view(b, t, self.h, self.d)
            k, v = self.wkv(x).view(b, t, 2, self.hkv, self.d).unbind(2)
            return self.wo(self.attn(q, k, v).reshape(b, t, -1))

        def forward(self, x, ckpt):
            return x + (checkpoint(self.mix, x, use_reentrant=False) if ckpt else self.mix(x))

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(1, 6, 32)

    def grads(f, ckpt):
        block.zero_grad()
        y = f(x, ckpt)
        y.square().sum().backward()
        return [y.detach()] + [p.grad.clone() for p in block.parameters()]

    names = ["y"] + [n for n, _ in block.named_parameters()]
    want = grads(block, False)
    _assert_identical(grads(block, True), want, names)
    n = len(fused_cpu.plans)
    _assert_identical(grads(torch.compile(block, fullgraph=True, backend="aot_eager"), True), want, names)
    assert [p[0] for p in fused_cpu.plans[n:]] == ["bwd", "fwd", "bwd", "fwd", "bwd"]  # fwd recomputed


def test_dynamic_shapes(fused_cpu):
    """After a second sequence length dynamo recompiles with a symbolic seq_local (automatic dynamic
    shapes); the argument checks and the fake implementations hold for symbolic sizes, and a third length
    reuses that graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    attn = torch_bridge.RingAttention(backend="fused", is_causal=True, layout="zigzag")
    compiled = torch.compile(attn, fullgraph=True, backend=backend)
    for s in (8, 6, 4):
        q, k, v, do, _ = _inputs(s, 1, s, 2, 1, 16, "float32", requires_grad=False)
        assert torch.equal(compiled(q, k, v), attn(q, k, v)), s
    assert len(graphs) == 2


def test_errors_under_compile(fused_cpu, monkeypatch):
    """User errors found while dynamo traces the Python around the op (argument checks, no heap): dynamo
    raises its own Unsupported ("Observed exception") with fullgraph=True, our message inside; without
    fullgraph the frame falls back to eager, which raises our exception itself."""
    bad = (torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16))  # 3 heads, 2 kv heads
    for fullgraph, exc in ((True, torch._dynamo.exc.Unsupported), (False, ValueError)):
        torch._dynamo.reset()
        f = torch.compile(lambda q, k, v: torch_bridge.ring_attention(q, k, v, backend="fused"),
                          fullgraph=fullgraph, backend="aot_eager")
        with pytest.raises(exc, match="must be a multiple of num_kv_heads"):
            f(*bad)
    # A model compiled while the heap existed, after shutdown(): the guard on the heap fails, the new trace
    # raises saying to call initialize(); once a heap exists again it runs.
    q, k, v, *_ = _inputs(6, 1, 4, 2, 1, 16, "float32", requires_grad=False)
    want = f(q, k, v)
    monkeypatch.setattr(heap_mod, "_heap", None)
    with pytest.raises(RuntimeError, match=r"call torch_bridge.initialize\(\)"):
        f(q, k, v)
    monkeypatch.setattr(heap_mod, "_heap", fused_cpu)
    assert torch.equal(f(q, k, v), want)


def test_heap_too_small_for_backward_compiled(fused_cpu, monkeypatch):
    """As test_fused_wiring's eager test: a heap that fits the forward but not the backward raises
    HeapTooSmallError before the forward runs, also when compiled (the check runs inside the fwd op)."""
    small = _CpuHeap(size=control.RING_SLOTS * control.CTL_BYTES + (64 << 10) + 10_000)  # ~10 KB of receive space
    monkeypatch.setattr(heap_mod, "_heap", small)
    monkeypatch.setattr(tfused, "ring_of", lambda h, group: ((0, 1), 0, 4))  # two ranks: nothing is launched
    x = torch.zeros(1, 16, 1, 64, dtype=torch.float16)
    f = torch.compile(lambda q, k, v: torch_bridge.ring_attention(q, k, v, backend="fused"), fullgraph=True,
                      backend="aot_eager")
    with pytest.raises(control.HeapTooSmallError, match="backward call needs"):
        f(x.clone().requires_grad_(), x.clone(), x.clone())
    assert [p[0] for p in small.plans] == ["bwd"]


def test_opcheck(fused_cpu):
    """torch.library.opcheck on both ops: schema (no input mutated or aliased), autograd registration,
    fake tensors against the real outputs, and AOTAutograd with dynamic shapes. Every check runs."""
    q, k, v, do, dl = _inputs(3, 1, 4, 2, 1, 16, "float32")
    seg = torch.tensor([[0, 0, 1, -1]], dtype=torch.int32)
    for ids, window in ((None, [-1, -1]), (seg, [1, 0])):  # without masks; with segment ids and a window
        fwd_args = (q, k, v, ids, 0.25, True, "contiguous", window, "", None, False, True)
        with torch.no_grad():
            out, lse = FWD(*fwd_args)
        torch.library.opcheck(FWD, fwd_args)
        for dlse in (dl, None):
            torch.library.opcheck(BWD, (q.detach(), k.detach(), v.detach(), out, lse, do, dlse, ids, 0.25, True,
                                        "contiguous", window, "", 30.0, False))


def test_auto_on_cpu_compiles(monkeypatch):
    """backend="auto" on CPU tensors without a heap or a process group falls back to the torch reference at
    world size 1, which has no communication: it compiles with fullgraph=True and matches eager."""
    monkeypatch.setattr(heap_mod, "_heap", None)
    torch._dynamo.reset()
    f = lambda q, k, v: torch_bridge.ring_attention(q, k, v, is_causal=True, return_lse=True)  # noqa: E731
    args = _inputs(4, 1, 6, 4, 2, 16, "float32")
    want = _fwd_bwd(f, *args)
    got = _fwd_bwd(torch.compile(f, fullgraph=True, backend="aot_eager"), *args)
    _assert_identical(got, want, NAMES)
    torch._dynamo.reset()


def test_unused_call_is_dropped(fused_cpu):
    """The ops are functional (mutates_args=()): when no output of a call is used, AOTAutograd drops the call,
    as it drops any functional op. Every rank runs the same program, so every rank drops it alike (the
    README says so); plain dynamo (backend="eager") keeps it."""

    def f(q, k, v):
        torch_bridge.ring_attention(q, k, v, backend="fused")
        return q * 2

    q, k, v, *_ = _inputs(5, 1, 4, 2, 1, 16, "float32", requires_grad=False)
    for backend, launched in (("eager", 1), ("aot_eager", 0)):
        torch._dynamo.reset()
        n = len(fused_cpu.plans)
        torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
        assert len(fused_cpu.plans) - n == launched, backend
