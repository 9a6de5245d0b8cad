"""torch_bridge's two-level ring (torch_bridge.nodes) in gloo processes on the CPU: each process is a node of one
rank whose fused calls run the real kernels in the Triton interpreter on a CPU "heap", and the K/V and dK/dV
partials travel between the processes over torch.distributed, as on GPUs. What this checks beyond
test_nodes.py's simulator: the frontend's transfers (posted before each node-step's call, waited for after it),
its process groups, its autograd (gradients from out and lse), bad input before anything runs, and a rank that
never arrives becoming RingAttentionTimeout."""

import numpy as np
import pytest

from ring_core import testing
from ring_core.layout import layout_permutation
from torch_bridge.procs import LocalGroup


def _setup_rank(rank, world, node_size):
    """This process as a node rank with the fused backend in the interpreter over a CPU buffer."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import torch_bridge.api
    from ring_core import plans, topology
    from ring_core.protocol import control
    from ring_core.runtime import heap as heap_mod
    from ring_core.sim import interpret
    from torch_bridge import lifecycle

    interpret.ensure_interpreter()

    class CpuHeap(heap_mod.HeapRings):
        def __init__(self):
            self.buf = torch.zeros(8 << 20, dtype=torch.uint8)
            super().__init__(rank, [[self.buf.data_ptr()]] * world, control.HeapLayout.for_workspace(8 << 20),
                             self.buf, node_size=1)

        def plan(self, spec, ring_size, config=None):
            return super().plan(spec, ring_size, config=config, interpret=True)

        def plan_bwd(self, spec, ring_size, config=None, deterministic=False):
            return super().plan_bwd(spec, ring_size, config=config, interpret=True, deterministic=deterministic)

    heap_mod._heap = CpuHeap()
    nodes = topology.resolve_nodes(world, node_size)
    heap_mod._node_rings = heap_mod.join_nodes(nodes)
    torch_bridge.api._on_gpu = lambda x: True  # CPU tensors take backend="fused" (the interpreter)

    def check_now(status, ring, timeout_s):  # the kernel ran on the host: its status is there at once
        members, position, _ = ring
        control.check_status(status.numpy(), position, timeout_s, members=members)

    lifecycle.track = check_now


def _inputs(W, B, S, H, HKV, D, dtype, seed):
    q, k, v, dout = testing.random_inputs(seed, B, W * S, H, HKV, D, dtype, with_dout=True)
    dlse = np.random.default_rng(seed).standard_normal((B, H, W * S))
    return q, k, v, dout, dlse


def _two_level(rank, world, case, seed):
    W, B, S, H, HKV, D, dtype, causal, layout, segmented, window = case
    _setup_rank(rank, world, 1)
    import torch

    import torch_bridge

    q, k, v, dout, dlse = _inputs(W, B, S, H, HKV, D, dtype, seed)
    perm = layout_permutation(W * S, W, layout)
    rows = perm[rank * S:(rank + 1) * S]
    tdt = getattr(torch, dtype)
    mine = lambda x, ax=1: torch.from_numpy(np.ascontiguousarray(np.take(x, rows, axis=ax)))  # noqa: E731
    qt, kt, vt = (mine(x).to(tdt).requires_grad_() for x in (q, k, v))
    ids = mine(testing.crossing_documents(B, W * S)) if segmented else None
    out, lse = torch_bridge.ring_attention(qt, kt, vt, is_causal=causal, layout=layout, return_lse=True,
                                           backend="fused", timeout_s=60, segment_ids=ids, window_size=window)
    dlse_t = mine(dlse, 2).float().masked_fill(torch.isneginf(lse.detach()), 0.0)  # padding rows: lse constant
    torch.autograd.backward([out, lse], [mine(dout).to(tdt), dlse_t])
    f = lambda t: t.detach().float().numpy()  # noqa: E731
    return f(out), f(lse), f(qt.grad), f(kt.grad), f(vt.grad)


CASES = [  # W, B, S_local, H, HKV, D, dtype, causal, layout, segment ids, window
    (2, 1, 16, 4, 2, 16, "float32", True, "zigzag", False, None),
    (3, 2, 12, 3, 1, 80, "bfloat16", True, "zigzag", False, None),
    (3, 1, 8, 2, 2, 16, "float32", True, "contiguous", False, None),
    (2, 1, 10, 2, 1, 16, "float16", False, "contiguous", False, None),
    (3, 2, 12, 2, 1, 16, "bfloat16", True, "zigzag", True, None),
    (2, 1, 16, 2, 2, 16, "float32", True, "contiguous", True, None),
    (3, 1, 8, 2, 2, 16, "float32", True, "contiguous", False, (10, -1)),  # a band across nodes
    (2, 1, 16, 2, 1, 16, "bfloat16", False, "zigzag", True, (5, 3)),  # the second halves reversed
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "W{}_B{}S{}_H{}/{}_D{}_{}_{}_{}_seg{}_win{}".format(*c))
def test_two_level_ring_against_float64(case):
    W, B, S, H, HKV, D, dtype, causal, layout, segmented, window = case
    with LocalGroup(W, timeout=600) as group:
        res = group.run(_two_level, case, 5)
    q, k, v, dout, dlse = _inputs(W, B, S, H, HKV, D, dtype, 5)
    ids = testing.crossing_documents(B, W * S) if segmented else None
    inv = np.argsort(layout_permutation(W * S, W, layout))
    gather = lambda i, ax=1: np.take(np.concatenate([r[i] for r in res], axis=ax), inv, axis=ax)  # noqa: E731
    testing.check_attention(f"torch nodes {case}", gather(0), gather(1, 2), q, k, v, dtype, is_causal=causal,
                            segment_ids=ids, window=window)
    dlse = np.where(np.isneginf(gather(1, 2)), 0.0, dlse)
    testing.check_grads(f"torch nodes {case}", [gather(i) for i in (2, 3, 4)], q, k, v, dout, dtype,
                        is_causal=causal, dlse=dlse, segment_ids=ids, window=window)


def _compiled(rank, world):
    """The two-level ring inside a torch.compile(fullgraph=True)'d function: the fused route's custom op, opaque
    to the compiler, runs it; out and the gradients bitwise those of the eager call."""
    _setup_rank(rank, world, 1)
    import torch

    import torch_bridge

    g = torch.Generator().manual_seed(3 + rank)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g).requires_grad_() for _ in range(3))

    def layer(q, k, v):
        return torch_bridge.ring_attention(torch.tanh(q), k, v, is_causal=True, layout="zigzag", backend="fused",
                                           timeout_s=60) * 2

    res = []
    # aot_eager: the op and the autograd around it are traced the same on every backend; inductor would add
    # minutes of C++ compiles to a CPU test.
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        out = fn(q, k, v)
        out.sum().backward()
        res.append([t.detach().numpy().copy() for t in (out, q.grad, k.grad, v.grad)])
        for t in (q, k, v):
            t.grad = None
    return res


def test_torch_compile_fullgraph_traces_the_two_level_call_as_one_op():
    with LocalGroup(2, timeout=600) as group:
        res = group.run(_compiled)
    for eager, compiled in res:
        assert all(np.array_equal(a, b) for a, b in zip(eager, compiled))
        assert all(np.isfinite(a).all() and np.abs(a).sum() > 0 for a in eager)


def _bad(rank, world):
    _setup_rank(rank, world, 1)
    import torch

    import torch_bridge

    out = []
    q = torch.zeros(1, 8, 2, 16)
    # zigzag chunks of 4 tokens a node (one rank of 8): a window of 6 reaches partly across a node's halves
    try:
        torch_bridge.ring_attention(q, q, q, backend="fused", layout="zigzag", window_size=(6, 0))
    except NotImplementedError as e:
        out.append(str(e))
    # backend="auto" takes the reference ring for it instead
    out.append(tuple(torch_bridge.ring_attention(q, q, q, backend="auto", layout="zigzag", window_size=(6, 0)).shape))
    return out


def test_a_zigzag_window_across_a_nodes_halves_raises_before_running_or_takes_the_reference_ring():
    with LocalGroup(2) as group:
        res = group.run(_bad)
    for msgs in res:
        assert len(msgs) == 2 and "zigzag halves" in msgs[0] and "layout='contiguous'" in msgs[0]
        assert msgs[1] == (1, 8, 2, 16)


def _late(rank, world):
    _setup_rank(rank, world, 1)
    import torch

    import torch_bridge
    from ring_core.protocol.control import RingAttentionTimeout

    q = torch.zeros(1, 8, 2, 16)
    if rank == 1:
        return "absent"
    try:
        torch_bridge.ring_attention(q, q, q, backend="fused", timeout_s=3)
    except RingAttentionTimeout as e:
        return str(e)
    return "no error"


def test_a_node_that_never_arrives_is_a_timeout_naming_it():
    with LocalGroup(2, timeout=120) as group:
        res = group.run(_late)
    assert res[1] == "absent"
    assert "rank 1" in res[0] and "did not complete within 3" in res[0], res[0]
