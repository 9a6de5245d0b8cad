"""Rings over part of the job (CPU): the heap slots rings get (ring_core.runtime.heap.RingSlots), the JAX frontend's
table of context rows for a mesh axis (built when the program is lowered, one row per device), and the
real kernels running several rings at once on one simulated job."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the simulator below runs the kernels in the interpreter

import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ring_core.runtime import heap as heap_mod  # noqa: E402
from ring_core.protocol import control  # noqa: E402
from ring_core import testing  # noqa: E402
from ring_core.runtime.heap import FRONTEND_SLOTS, RingSlots  # noqa: E402


# ---------------------------------------------------------------------------------------------- slots
def test_rings_sharing_no_rank_share_a_slot_and_the_others_do_not():
    slots = RingSlots()
    assert slots.assign("jax", [0, 1]) == slots.assign("jax", [2, 3]) == 0  # dp x sp: the two sp rings at once
    assert slots.assign("jax", [0, 2]) == slots.assign("jax", [1, 3]) == 1  # the other axis: every rank again
    assert slots.assign("jax", [2, 0]) == 2  # another ring order is another ring
    assert slots.assign("jax", [0, 1]) == 0 and slots.get("jax", (0, 2)) == 1  # kept
    assert slots.used_by("jax", 0) == {0, 1, 2} and slots.used_by("jax", 3) == {0, 1}
    assert slots.assign("torch", [0, 1]) == FRONTEND_SLOTS["torch"][0]  # the frontends never share a slot
    assert set(FRONTEND_SLOTS["jax"]).isdisjoint(FRONTEND_SLOTS["torch"])
    assert set(FRONTEND_SLOTS["jax"]) | set(FRONTEND_SLOTS["torch"]) == set(range(control.RING_SLOTS))


def test_slots_run_out_with_a_clear_error():
    slots = RingSlots()
    for i in range(len(FRONTEND_SLOTS["jax"])):
        slots.assign("jax", [0, 1 + i])
    with pytest.raises(RuntimeError, match="already take part in 4 other jax rings"):
        slots.assign("jax", [0, 9])
    assert slots.assign("jax", [7, 8]) == 0  # rings away from rank 0 still get one
    with pytest.raises(ValueError, match="lists a rank twice"):
        slots.assign("jax", [3, 3])


def test_torch_members_agree_on_a_slot_from_what_each_uses():
    """torch_bridge.fused.ring_of: each member reports the slots its rings use (the processes' registries
    differ: each knows only its own rings), and all pick the lowest free for all."""
    reg = {r: RingSlots() for r in range(4)}
    for r in (0, 1):
        reg[r].assign("torch", [0, 1])
    for r in (2, 3):
        reg[r].assign("torch", [2, 3])
    taken = set().union(*(reg[m].used_by("torch", m) for m in (1, 2)))  # gathered before anyone assigns
    for r in (1, 2):  # a third group, over ranks 1 and 2, on top
        assert reg[r].assign("torch", [1, 2], taken=taken) == FRONTEND_SLOTS["torch"][1]
    taken = set().union(*(reg[m].used_by("torch", m) for m in range(4)))
    for r in range(4):  # the world ring: every rank agrees although their registries differ
        assert reg[r].assign("torch", range(4), taken=taken) == FRONTEND_SLOTS["torch"][2]


# ------------------------------------------------------------------------------- JAX: the context table
def _heap(world: int, size: int = 1 << 20):
    """A HeapRings whose process p maps rank m's heap at 1000 * p + m (fake addresses: nothing runs)."""
    import torch

    return heap_mod.HeapRings(0, [[1000 * p + m for m in range(world)] for p in range(world)],
                              control.HeapLayout.for_workspace(size), torch.zeros(8, dtype=torch.uint8))


def _mesh(process_of_position, shape, names):
    devices = np.array([types.SimpleNamespace(process_index=p, id=i) for i, p in enumerate(process_of_position)],
                       dtype=object).reshape(shape)
    return types.SimpleNamespace(devices=devices, axis_names=names, shape=dict(zip(names, shape)))


def _row(table, i, W):
    row = table[i].view(np.int64)
    return dict(bases=row[:W].tolist(), position=int(row[W]), ctl=int(row[W + 1]), flags=int(row[W + 2]),
                recv=int(row[W + 3]), members=row[W + 4:].tolist())


@pytest.mark.parametrize("axis", ["sp", "dp"])
def test_jax_table_has_one_ring_per_position_of_the_other_axes(axis):
    from jax_ring import fused

    h = _heap(4)
    # devices in mesh order belong to processes 3, 1, 0, 2 (a mesh need not list processes in order)
    procs = [3, 1, 0, 2]
    mesh = _mesh(procs, (2, 2), ("dp", "sp"))
    table = fused.ring_table(h, mesh, axis)
    assert table.dtype == np.int32 and table.shape == (4, 2 * (2 * 2 + 4))
    grid = np.array(procs).reshape(2, 2)
    rings = [list(grid[i]) for i in range(2)] if axis == "sp" else [list(grid[:, j]) for j in range(2)]
    for pos, proc in enumerate(procs):
        r = _row(table, pos, 2)
        (members,) = [ring for ring in rings if proc in ring]
        assert r["members"] == members and r["position"] == members.index(proc)
        assert r["bases"] == [1000 * proc + m for m in members]  # as mapped in that device's process
        assert r["ctl"] == h.layout.ctl_off_of(0) and r["flags"] == h.layout.flags_off_of(0)  # disjoint rings
        assert r["recv"] == h.layout.recv_off
    other = fused.ring_table(h, mesh, "dp" if axis == "sp" else "sp")  # the other axis: its rings share ranks
    assert {_row(other, i, 2)["ctl"] for i in range(4)} == {h.layout.ctl_off_of(1)}
    again = fused.ring_table(h, mesh, axis)  # lowered again: the same slots
    np.testing.assert_array_equal(again, table)


def test_jax_table_needs_one_device_per_process():
    from jax_ring import fused

    with pytest.raises(ValueError, match="one device per process"):
        fused.ring_table(_heap(2), _mesh([0, 0, 1, 1], (2, 2), ("dp", "sp")), "sp")


def test_jax_rows_are_picked_by_each_device_at_lowering(monkeypatch):
    """ring_ctx_p on a real 2 x 2 CPU mesh with its devices permuted: every device gets its own row (its
    mesh position over both axes), from the table the lowering built from the concrete mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from jax_ring import _platform, fused

    devices = jax.devices("cpu")[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices")
    h = _heap(4)
    monkeypatch.setattr(heap_mod, "_heap", h)
    monkeypatch.setattr(heap_mod, "_release_hooks", [])
    rank_of_device = {d.id: r for r, d in enumerate(devices)}
    # CPU devices all live in process 0; here device i stands for the process of rank i.
    monkeypatch.setattr(fused, "_device_rank", lambda d: rank_of_device[d.id])
    order = [devices[i] for i in (2, 0, 3, 1)]
    mesh = Mesh(np.array(order).reshape(2, 2), ("dp", "sp"))

    def body(x):
        ctx = fused.ring_ctx_p.bind(_platform.mesh_position(), axis_name="sp", ring_size=2)
        return x + ctx[None, :]

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("dp", "sp")), out_specs=P(("dp", "sp"))))(
        jnp.zeros((4, 2 * (2 * 2 + 4)), jnp.int32))
    rows = np.asarray(out)
    ranks = [rank_of_device[d.id] for d in order]  # 2, 0, 3, 1 in mesh order: rings [2, 0] and [3, 1]
    for pos, r in enumerate(ranks):
        got = _row(rows, pos, 2)
        members = ranks[2 * (pos // 2):2 * (pos // 2) + 2]
        assert got["members"] == members and got["position"] == pos % 2
        assert got["bases"] == [1000 * r + m for m in members]


def test_jax_rows_on_an_abstract_mesh_come_from_the_set_mesh(monkeypatch):
    """A shard_map over the abstract mesh a traced input carries (jax_ring.dot_product_attention and the flax
    attention_fn under jax.jit): the table is built from the mesh set with jax.set_mesh, as JAX's own lowering
    does; without one, a ValueError says how to give the devices (before anything runs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_ring import _platform, fused

    devices = jax.devices("cpu")[:2]
    if len(devices) < 2:
        pytest.skip("needs 2 CPU devices")
    monkeypatch.setattr(heap_mod, "_heap", _heap(2))
    monkeypatch.setattr(heap_mod, "_release_hooks", [])
    rank_of_device = {d.id: r for r, d in enumerate(devices)}
    monkeypatch.setattr(fused, "_device_rank", lambda d: rank_of_device[d.id])
    order = devices[::-1]
    mesh = Mesh(np.array(order), ("sp",))

    def body(x):
        return x + fused.ring_ctx_p.bind(_platform.mesh_position(), axis_name="sp", ring_size=2)[None, :]

    def outer(x):  # under jit the input's sharding carries the abstract mesh only
        return jax.shard_map(body, mesh=jax.typeof(x).sharding.mesh, in_specs=P("sp"), out_specs=P("sp"))(x)

    x = jax.device_put(jnp.zeros((2, 2 * (2 * 2 + 4)), jnp.int32), NamedSharding(mesh, P("sp")))
    with pytest.raises(ValueError, match="jax.set_mesh"):
        jax.jit(outer)(x)
    with jax.set_mesh(mesh):
        rows = np.asarray(jax.jit(outer)(x))
    ranks = [rank_of_device[d.id] for d in order]
    for pos, r in enumerate(ranks):
        got = _row(rows, pos, 2)
        assert got["members"] == ranks and got["position"] == pos
        assert got["bases"] == [1000 * r + m for m in ranks]


# ------------------------------------------------------------------- the kernels: several rings at once
def test_several_rings_at_once_and_a_rank_in_rings_of_two_axes():
    """Four simulated ranks as a 2 x 2 mesh: the two rings along one axis run at once, then the rings of the
    other axis (every rank again, another slot), then the first again; each call right against float64,
    each slot counting its own calls."""
    from ring_core.sim import interpret
    from ring_core.sim import simulate

    job = simulate._local_job(4, None)
    assert isinstance(job, interpret.SimulatedJob)
    axes = {"sp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    epochs = {"sp": 0, "dp": 0}
    for n, axis in enumerate(("sp", "dp", "sp")):
        rings = axes[axis]
        W, S = 2, 9
        inputs = [testing.sharded_inputs(40 + 10 * n + i, W, 1, S, 2, 1, 16, "float32") for i in range(len(rings))]
        specs, shards = zip(*(testing.spec_and_shards(40 + 10 * n + i, W, 1, S, 2, 1, 16, "float32", is_causal=True)
                              for i in range(len(rings))))
        q, k, v = ([None] * 4 for _ in range(3))
        for (members, (qs, ks, vs)) in zip(rings, shards):
            for pos, rank in enumerate(members):
                q[rank], k[rank], v[rank] = qs[pos], ks[pos], vs[pos]
        results = job.run(specs[0], q, k, v, rings=rings, timeout_s=60)
        epochs[axis] += 1
        for (ref, _), members in zip(inputs, rings):
            out = np.concatenate([results[r][0] for r in members], axis=1)
            testing.check_attention(f"{axis} ring {members}", out.astype(np.float64), None, *ref, "float32",
                                    is_causal=True)
            for pos, r in enumerate(members):
                control.check_status(results[r][2], pos, members=members)
                assert int(results[r][2][3]) == epochs[axis]  # this slot's call count


def test_a_ring_whose_rank_never_comes_leaves_the_other_ring_alone():
    """Rings [0, 1] and [2, 3] at once, rank 1 absent: rank 0 times out naming rank 1 (its global rank),
    ring [2, 3] completes right."""
    from ring_core.sim import simulate

    job = simulate._local_job(4, None)
    rings = [[0, 1], [2, 3]]
    spec, (qs, ks, vs) = testing.spec_and_shards(60, 2, 1, 8, 2, 1, 16, "float32", is_causal=False)
    results = job.run(spec, qs + qs, ks + ks, vs + vs, rings=rings, absent_ranks=(1,), timeout_s=3)
    with pytest.raises(control.RingAttentionTimeout, match="rank 0 .* rank 1 to start"):
        control.check_status(results[0][2], 0, 3, members=rings[0])
    for pos, r in enumerate(rings[1]):
        control.check_status(results[r][2], pos, members=rings[1])


def test_simulator_data_parallel_forward_and_gradients():
    """simulate_ring_attention(..., data_parallel=2): two rings of two ranks at once, each on half the batch."""
    from ring_core.sim.simulate import simulate_ring_attention, simulate_ring_attention_grad

    ref, (q, k, v, do) = testing.sharded_inputs(70, 2, 2, 6, 4, 2, 16, "float32", with_dout=True)
    out, lse = simulate_ring_attention(q, k, v, 2, is_causal=True, layout="zigzag", return_lse=True,
                                       data_parallel=2)
    testing.check_attention("data_parallel 2", out.astype(np.float64), lse, *ref[:3], "float32", is_causal=True)
    grads = simulate_ring_attention_grad(q, k, v, do, 2, is_causal=True, layout="zigzag", data_parallel=2)
    testing.check_grads("data_parallel 2 grads", [g.astype(np.float64) for g in grads], *ref, "float32",
                        is_causal=True)
    with pytest.raises(ValueError, match="batch \\(2\\) must be divisible by data_parallel \\(3\\)"):
        simulate_ring_attention(q, k, v, 2, data_parallel=3)


def _torch_slots_task(rank, world):
    """On every rank of a 4-process gloo job: the slots torch_bridge gives the rings of a 2 x 2 mesh's two
    axes, the world ring and a group of ranks {1, 2}, in the order a program might first use them."""
    import torch
    import torch.distributed as dist

    from torch_bridge import fused

    h = heap_mod.HeapRings(rank, [[0] * world] * world, control.HeapLayout.for_workspace(1 << 20),
                           torch.zeros(8, dtype=torch.uint8))
    groups = {name: [dist.new_group(r) for r in rs] for name, rs in
              (("sp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]]), ("mid", [[1, 2]]))}  # every rank creates all
    mine = lambda name: next((g for g in groups[name] if rank in dist.get_process_group_ranks(g)), None)  # noqa
    out = {}
    for name in ("sp", "world", "dp", "mid", "sp"):
        group = None if name == "world" else mine(name)
        if name != "world" and group is None:
            continue
        members, position, slot = fused.ring_of(h, group)
        out[name] = (list(members), position, slot)
    return out


def test_torch_groups_agree_on_their_slots(torch_group):
    per_rank = torch_group(4).run(_torch_slots_task, timeout=120)
    base = FRONTEND_SLOTS["torch"][0]
    for rank, got in enumerate(per_rank):
        assert got["sp"] == ([0, 1] if rank < 2 else [2, 3], rank % 2, base)  # disjoint rings: one slot
        assert got["world"] == ([0, 1, 2, 3], rank, base + 1)
        assert got["dp"][0] == [rank % 2, rank % 2 + 2] and got["dp"][2] == base + 2
    assert (per_rank[1]["mid"], per_rank[2]["mid"]) == (([1, 2], 0, base + 3), ([1, 2], 1, base + 3))
    assert "mid" not in per_rank[0] and "mid" not in per_rank[3]
