"""Which ranks share a node: the two-level ring's topology (no framework; numpy only).

A job of W = N x R ranks is N nodes of R ranks each; the ranks of node n are ``n*R .. n*R + R - 1`` (the order
torchrun, ``python -m jax_ring.launch --nnodes N`` and SLURM's block distribution give). Inside a node the fused
kernel rings over the node's R ranks (iris maps peer memory only between the processes of one host); between
nodes rank (n, r) passes K/V to rank (n + 1, r), so the between-node rings are ``Nodes.peer_members(r)``.

How R is found (``resolve_nodes``), first match wins:

1. ``node_size=`` given by the caller;
2. ``RING_ATTENTION_NODE_SIZE`` (an override: e.g. 2 "nodes" of 2 ranks on one 4-GPU host, to test the
   between-node path without a second host);
3. ``LOCAL_WORLD_SIZE`` (torchrun, ``python -m jax_ring.launch``);
4. ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE`` (``"4(x2)"``, ``"4,4"``; a job with different task
   counts per node, ``"4(x2),2"``, is an error: the ring needs equal nodes);
5. nothing set: one node of W ranks.

A launcher's count (3 and 4) above W is clamped to W: a process group smaller than the job (a subgroup inside one
node) is then one node. An explicit count (1 and 2) must divide W. ``check_hosts`` then compares the result with
the host name of every rank.

>>> nodes = resolve_nodes(8, env={"LOCAL_WORLD_SIZE": "4"})
>>> nodes
Nodes(num_nodes=2, node_size=4)
>>> nodes.node_members(1), nodes.peer_members(3)
((4, 5, 6, 7), (3, 7))
>>> check_hosts(["a"] * 4 + ["b"] * 4, nodes)
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ring_core import settings

OVERRIDE = settings.NODE_SIZE
# The variables looked at, in order; the first set one wins (the module docstring).
ENV_ORDER = (OVERRIDE, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
# Sources that name the node size on purpose: several nodes may then share a host (the test mode).
EXPLICIT = ("node_size", OVERRIDE)


def _count(value, what: str) -> int:
    """A positive int, or TypeError / ValueError naming ``what``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got the bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    return n


@dataclass(frozen=True)
class Nodes:
    """N nodes of R ranks: global rank ``g`` is local rank ``g % R`` of node ``g // R``.

    ``source`` says where R came from (``"node_size"``, an environment variable's name, or ``"one node"``); it
    takes no part in equality.

    >>> n = Nodes(num_nodes=3, node_size=2)
    >>> n.world_size, n.node_of(5), n.local_of(5), n.rank_of(2, 1)
    (6, 2, 1, 5)
    >>> n.node_members(1), n.peer_members(0)
    ((2, 3), (0, 2, 4))
    """

    num_nodes: int
    node_size: int
    source: str = field(default="node_size", compare=False, repr=False)

    def __post_init__(self):
        _count(self.num_nodes, "num_nodes")
        _count(self.node_size, "node_size")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.node_size

    @property
    def explicit(self) -> bool:
        """True when the node size was asked for (``node_size=`` or RING_ATTENTION_NODE_SIZE), not found from a
        launcher's variables: several nodes may then share a host."""
        return self.source in EXPLICIT

    def _rank(self, rank) -> int:
        r = operator.index(rank)
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank {r} is outside 0..{self.world_size - 1}")
        return r

    def node_of(self, rank) -> int:
        return self._rank(rank) // self.node_size

    def local_of(self, rank) -> int:
        return self._rank(rank) % self.node_size

    def rank_of(self, node, local) -> int:
        node, local = operator.index(node), operator.index(local)
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is outside 0..{self.num_nodes - 1}")
        if not 0 <= local < self.node_size:
            raise ValueError(f"local rank {local} is outside 0..{self.node_size - 1}")
        return node * self.node_size + local

    def node_members(self, node) -> tuple[int, ...]:
        """The global ranks of node ``node``: the fused kernel's ring."""
        return tuple(self.rank_of(node, r) for r in range(self.node_size))

    def peer_members(self, local) -> tuple[int, ...]:
        """Ranks (0, local), (1, local), ...: the ring between nodes that local rank ``local`` takes part in."""
        return tuple(self.rank_of(n, local) for n in range(self.num_nodes))


def _parse_tasks_per_node(text: str) -> int:
    """SLURM_TASKS_PER_NODE (``"4"``, ``"4(x2)"``, ``"4,4"``, ``"4(x2),2"``) -> the one count of every node."""
    counts = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x\s*(\d+)\s*\))?\s*", part)
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r} is not of SLURM's form (e.g. '4(x2)' or '4,4')")
        counts.add(int(m.group(1)))
    if len(counts) != 1:
        raise ValueError(
            f"SLURM_TASKS_PER_NODE={text!r}: the nodes run different numbers of tasks ({sorted(counts)}); the ring "
            f"needs the same number of ranks on every node: ask SLURM for it (--ntasks-per-node) or set "
            f"{OVERRIDE}")
    return counts.pop()


def _from_env(world_size: int, env: Mapping[str, str] | None):
    """(node size or None, the variable it came from)."""
    get = settings.raw if env is None else env.get  # (the variables are in ring_core.settings' table)
    for name in ENV_ORDER:
        text = get(name)
        if text is None or not str(text).strip():
            continue
        text = str(text).strip()
        if name == "SLURM_TASKS_PER_NODE":
            n = _parse_tasks_per_node(text)
        else:
            try:
                n = int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"{name}={text!r} must be >= 1")
        if name != OVERRIDE:
            n = min(n, world_size)  # a group smaller than the job, inside one node
        return n, name
    return None, None


def node_size_from_env(world_size: int, env: Mapping[str, str] | None = None) -> int | None:
    """Ranks per node from the environment (``os.environ`` unless ``env`` is given), or None when nothing says.

    >>> node_size_from_env(16, {"SLURM_TASKS_PER_NODE": "8(x2)"})
    8
    >>> node_size_from_env(2, {"LOCAL_WORLD_SIZE": "8"})  # a group of 2 inside a node of 8
    2
    >>> node_size_from_env(8, {}) is None
    True
    """
    world_size = _count(world_size, "world_size")
    return _from_env(world_size, env)[0]


def resolve_nodes(world_size: int, node_size: int | None = None, *, env: Mapping[str, str] | None = None) -> Nodes:
    """The Nodes of a group of ``world_size`` ranks: ``node_size`` if given, else the environment (module
    docstring), else one node.

    >>> resolve_nodes(8, 2)
    Nodes(num_nodes=4, node_size=2)
    >>> resolve_nodes(8, env={})
    Nodes(num_nodes=1, node_size=8)
    >>> resolve_nodes(6, env={"RING_ATTENTION_NODE_SIZE": "4"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: RING_ATTENTION_NODE_SIZE=4 does not divide the world size 6: ... to a divisor of 6 (the ranks per host)
    """
    world_size = _count(world_size, "world_size")
    if node_size is not None:
        n, source = _count(node_size, "node_size"), "node_size"
        if n > world_size:
            raise ValueError(f"node_size={n} is larger than the world size {world_size}; set node_size to the "
                             f"ranks per host (a divisor of {world_size})")
    else:
        n, source = _from_env(world_size, env)
        if n is None:
            return Nodes(1, world_size, source="one node")
    if world_size % n:
        what = "node_size" if source == "node_size" else source
        raise ValueError(
            f"{what}={n} does not divide the world size {world_size}: every node needs the same number of ranks; "
            f"set node_size= or {OVERRIDE} to a divisor of {world_size} (the ranks per host)")
    return Nodes(world_size // n, n, source=source)


def check_hosts(hostnames: Sequence[str], nodes: Nodes) -> None:
    """Check ``nodes`` against the host of every rank (``hostnames[rank]``, e.g. gathered ``socket.gethostname()``).

    Raises ValueError when one node's ranks are on several hosts (iris cannot map their memory), or when two nodes
    share a host while the node size came from a launcher's variables (the job's nodes are then not the hosts);
    with ``node_size=`` or RING_ATTENTION_NODE_SIZE set, nodes may share a host on purpose (testing several nodes
    on one machine).

    >>> check_hosts(["a", "a", "b", "b"], Nodes(2, 2, source="LOCAL_WORLD_SIZE"))
    >>> check_hosts(["a", "a", "a", "a"], Nodes(2, 2, source="RING_ATTENTION_NODE_SIZE"))
    >>> check_hosts(["a", "b", "a", "b"], Nodes(2, 2))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the ranks of node 0 (ranks 0..1) are on several hosts (rank 0 on 'a', rank 1 on 'b'); ...
    """
    hosts = [str(h) for h in hostnames]
    if len(hosts) != nodes.world_size:
        raise ValueError(f"got {len(hosts)} host names for {nodes.world_size} ranks ({nodes.num_nodes} nodes of "
                         f"{nodes.node_size}); pass the host name of every rank, in rank order")
    owner = {}  # host -> the first node seen on it

    def first(n):
        m = nodes.node_members(n)
        return f"{m[0]}..{m[-1]}"

    for node in range(nodes.num_nodes):
        members = nodes.node_members(node)
        seen = {}
        for r in members:
            seen.setdefault(hosts[r], r)
        if len(seen) > 1:
            where = ", ".join(f"rank {r} on {h!r}" for h, r in seen.items())
            raise ValueError(
                f"the ranks of node {node} (ranks {members[0]}..{members[-1]}) are on several hosts ({where}); "
                f"a node's ranks must share one host: set node_size= or {OVERRIDE} to the ranks per host")
        host = next(iter(seen))
        if host in owner and not nodes.explicit:
            other = owner[host]
            raise ValueError(
                f"nodes {other} (ranks {first(other)}) and {node} (ranks {first(node)}) are both on host "
                f"{host!r}, but the node size {nodes.node_size} came from {nodes.source}: the job's nodes are not "
                f"its hosts. Set node_size= or {OVERRIDE} to the ranks per host ({OVERRIDE} also allows several "
                f"nodes on one host on purpose, for testing)")
        owner.setdefault(host, node)
