"""ring_core.topology: nodes of a job, found from the arguments or the launcher's environment, checked against
the hosts (CPU, no framework)."""

import doctest

import numpy as np
import pytest

from ring_core import topology
from ring_core.topology import Nodes, check_hosts, node_size_from_env, resolve_nodes


def test_doctests():
    assert doctest.testmod(topology).failed == 0


@pytest.mark.parametrize("N,R", [(1, 1), (1, 8), (2, 4), (3, 5), (8, 8), (64, 8)])
def test_rank_maps_are_inverse_and_cover_the_world(N, R):
    n = Nodes(N, R)
    assert n.world_size == N * R
    for g in range(n.world_size):
        assert n.rank_of(n.node_of(g), n.local_of(g)) == g
    by_node = [r for node in range(N) for r in n.node_members(node)]
    assert by_node == list(range(N * R))  # contiguous blocks, in order
    by_peer = sorted(r for local in range(R) for r in n.peer_members(local))
    assert by_peer == list(range(N * R))
    for local in range(R):  # the between-node ring of a local rank: one rank a node, same local rank
        ring = n.peer_members(local)
        assert [n.node_of(r) for r in ring] == list(range(N)) and {n.local_of(r) for r in ring} == {local}


def test_bad_ranks_and_nodes():
    n = Nodes(2, 3)
    for bad in (-1, 6):
        with pytest.raises(ValueError, match="outside"):
            n.node_of(bad)
    with pytest.raises(ValueError, match="node 2"):
        n.rank_of(2, 0)
    with pytest.raises(ValueError, match="local rank 3"):
        n.rank_of(0, 3)
    with pytest.raises(ValueError, match="num_nodes"):
        Nodes(0, 3)
    with pytest.raises(TypeError, match="bool"):
        Nodes(2, True)


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),
    ({"LOCAL_WORLD_SIZE": " 4 "}, 4),
    ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
    ({"SLURM_TASKS_PER_NODE": "4"}, 4),
    ({"SLURM_TASKS_PER_NODE": "4(x2)"}, 4),
    ({"SLURM_TASKS_PER_NODE": "4,4"}, 4),
    ({"SLURM_TASKS_PER_NODE": "4(x3),4"}, 4),
    # the order: override, torchrun / our launcher, SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE
    ({"RING_ATTENTION_NODE_SIZE": "2", "LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "8"}, 2),
    ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "8", "SLURM_TASKS_PER_NODE": "1(x8)"}, 4),
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "4(x2)"}, 2),
    ({"LOCAL_WORLD_SIZE": "", "SLURM_TASKS_PER_NODE": "2(x4)"}, 2),  # an empty variable counts as unset
    ({"LOCAL_WORLD_SIZE": "16"}, 8),  # a launcher's count above the group's size: clamped (a subgroup)
    ({"SLURM_TASKS_PER_NODE": "16(x2)"}, 8),
])
def test_node_size_from_env(env, expected):
    assert node_size_from_env(8, env) == expected


def test_node_size_from_env_reads_os_environ(monkeypatch):
    for k in topology.ENV_ORDER:
        monkeypatch.delenv(k, raising=False)
    assert node_size_from_env(8) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_size_from_env(8) == 2
    assert resolve_nodes(8) == Nodes(4, 2) and resolve_nodes(8).source == "LOCAL_WORLD_SIZE"


@pytest.mark.parametrize("env,match", [
    ({"SLURM_TASKS_PER_NODE": "4(x2),2"}, r"different numbers of tasks \(\[2, 4\]\).*--ntasks-per-node"),
    ({"SLURM_TASKS_PER_NODE": "4,2"}, "different numbers of tasks"),
    ({"SLURM_TASKS_PER_NODE": "4[x2]"}, "not of SLURM's form"),
    ({"LOCAL_WORLD_SIZE": "four"}, "LOCAL_WORLD_SIZE='four' is not an integer"),
    ({"RING_ATTENTION_NODE_SIZE": "2.0"}, "not an integer"),
    ({"SLURM_NTASKS_PER_NODE": "0"}, ">= 1"),
    ({"RING_ATTENTION_NODE_SIZE": "-2"}, ">= 1"),
])
def test_bad_environment(env, match):
    with pytest.raises(ValueError, match=match):
        node_size_from_env(8, env)
    with pytest.raises(ValueError, match=match):
        resolve_nodes(8, env=env)


def test_resolve_nodes_order_and_one_node():
    env = {"LOCAL_WORLD_SIZE": "4", "RING_ATTENTION_NODE_SIZE": "2"}
    assert resolve_nodes(8, 8, env=env) == Nodes(1, 8)  # the argument wins
    got = resolve_nodes(8, env=env)
    assert got == Nodes(4, 2) and got.source == "RING_ATTENTION_NODE_SIZE" and got.explicit
    got = resolve_nodes(8, env={"LOCAL_WORLD_SIZE": "4"})
    assert got == Nodes(2, 4) and not got.explicit
    got = resolve_nodes(8, env={})
    assert got == Nodes(1, 8) and not got.explicit
    assert resolve_nodes(3, env={"LOCAL_WORLD_SIZE": "8"}) == Nodes(1, 3)  # clamped to the group
    assert resolve_nodes(np.int64(8), np.int32(4)) == Nodes(2, 4)  # numpy integers are ints


@pytest.mark.parametrize("world,node_size,env,exc,match", [
    (8, True, {}, TypeError, "bool"),
    (8, 2.0, {}, TypeError, "node_size must be an int, got float"),
    (8, "4", {}, TypeError, "node_size must be an int, got str"),
    (8, 0, {}, ValueError, "node_size must be >= 1"),
    (8, 3, {}, ValueError, r"node_size=3 does not divide the world size 8.*RING_ATTENTION_NODE_SIZE"),
    (8, 16, {}, ValueError, "larger than the world size 8"),
    (6, None, {"LOCAL_WORLD_SIZE": "4"}, ValueError, "LOCAL_WORLD_SIZE=4 does not divide the world size 6"),
    (8, None, {"RING_ATTENTION_NODE_SIZE": "16"}, ValueError, "RING_ATTENTION_NODE_SIZE=16 does not divide"),
    (8, None, {"SLURM_TASKS_PER_NODE": "3(x3)"}, ValueError, "SLURM_TASKS_PER_NODE=3 does not divide"),
    (0, None, {}, ValueError, "world_size must be >= 1"),
    (False, None, {}, TypeError, "world_size must be an int"),
])
def test_resolve_nodes_bad_inputs(world, node_size, env, exc, match):
    with pytest.raises(exc, match=match):
        resolve_nodes(world, node_size, env=env)


def test_check_hosts_accepts_nodes_that_are_hosts():
    check_hosts(["h0"] * 4 + ["h1"] * 4, resolve_nodes(8, env={"LOCAL_WORLD_SIZE": "4"}))
    check_hosts(["h0"] * 8, resolve_nodes(8, env={}))  # one node, one host
    check_hosts(["h"], Nodes(1, 1))


def test_check_hosts_rejects_a_node_on_several_hosts():
    nodes = resolve_nodes(8, env={})  # nothing set: one node, but the ranks are on two hosts
    with pytest.raises(ValueError, match=r"node 0 \(ranks 0\.\.7\) are on several hosts \(rank 0 on 'h0', rank 4 "
                                         r"on 'h1'\).*RING_ATTENTION_NODE_SIZE to the ranks per host"):
        check_hosts(["h0"] * 4 + ["h1"] * 4, nodes)
    # explicit node sizes are checked the same way: a node must never span hosts
    with pytest.raises(ValueError, match=r"node 1 \(ranks 2\.\.3\)"):
        check_hosts(["a", "a", "b", "c"], Nodes(2, 2))


@pytest.mark.parametrize("var", ["LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
def test_check_hosts_rejects_nodes_sharing_a_host_when_found_from_a_launcher(var):
    nodes = resolve_nodes(8, env={var: "2"})
    hosts = ["h0"] * 4 + ["h1"] * 4  # 4 ranks a host, the launcher said 2
    with pytest.raises(ValueError, match=rf"nodes 0 \(ranks 0\.\.1\) and 1 \(ranks 2\.\.3\) are both on host 'h0'.*"
                                         rf"came from {var}.*RING_ATTENTION_NODE_SIZE"):
        check_hosts(hosts, nodes)


def test_check_hosts_allows_several_nodes_on_one_host_when_asked():
    hosts = ["h0"] * 4 + ["h1"] * 4
    check_hosts(hosts, resolve_nodes(8, 2))
    check_hosts(hosts, resolve_nodes(8, env={"RING_ATTENTION_NODE_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}))
    check_hosts(["x"] * 8, resolve_nodes(8, env={"RING_ATTENTION_NODE_SIZE": "1"}))


def test_check_hosts_wants_every_rank():
    with pytest.raises(ValueError, match="got 3 host names for 4 ranks"):
        check_hosts(["a", "a", "b"], Nodes(2, 2))
