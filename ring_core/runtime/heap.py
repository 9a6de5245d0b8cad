"""The one symmetric-heap set-up both frontends use (GPU path).

One iris heap per process (one process per GPU, torch.distributed already initialised: iris exchanges
the heap handles through it). The ring-attention workspace is the first allocation on every rank, so it
sits at the same offset from every heap base; ``HeapLayout`` splits it into control words, flags and
receive slots.

Lifecycle (what the frontends' ``initialize`` / ``shutdown`` / ``reset`` do):

* ``initialize()`` creates the heap once per process; calling it again returns the same heap (asking for
  a different ``heap_size`` then raises: ``shutdown()`` first). If torch.distributed was not initialised,
  ``init_torch_distributed_from_env`` creates the process group, and this module owns it: it is destroyed
  at interpreter exit (after the heap), never earlier, so ``shutdown()`` then ``initialize()`` reuses it.
  A process group the program created itself is never destroyed here.
* A fused call before ``initialize()`` (or after ``shutdown()``) raises, saying to call ``initialize()``;
  ``backend="auto"`` then uses the reference ring instead. ``reset()`` before ``initialize()`` raises
  ``NotInitializedError``.
* ``shutdown()`` releases the heap (returns False when there was none) and runs the release hooks the
  frontends registered (``on_release``: JAX drops compiled programs that baked the old heap's addresses).
  ``initialize()`` may follow, with any size. A heap still held at exit is released at exit.

Security: the heap's memory handles travel between the processes of the job through local sockets that
iris opens; ``private_handle_passing`` (below) keeps other local users away from them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading

from dataclasses import dataclass

import numpy as np

from ring_core import plans, settings
from ring_core.protocol import control

DEFAULT_HEAP_BYTES = settings.DEFAULT_HEAP_BYTES
HEAP_ENV = settings.HEAP_BYTES

_lock = threading.RLock()
_heap = None
_release_hooks = []  # called after every shutdown() that released a heap
_owned_group = None  # the default process group, when init_torch_distributed_from_env created it
_atexit_registered = False


class NotInitializedError(RuntimeError):
    """The fused backend was used before initialize()."""


# ------------------------------------------------------------------------------ handle passing (security)
# How iris (tokenspeed-iris 0.0.0.post20261013, iris/host/distributed/fd_passing.py and
# iris/host/memory/symmetric_heap.py) shares a heap on one host: every rank exports its heap chunks as
# CUDA VMM POSIX file descriptors (ROCm: dma-buf fds) and sends them to every other rank with SCM_RIGHTS
# over AF_UNIX stream sockets. Each rank listens on a *filesystem* socket
# /tmp/iris-dmabuf-<pid>-<rank>-<n>.sock (not the abstract namespace): a predictable name in the
# world-writable /tmp, created with the process umask (srwxr-xr-x under umask 022, srwxrwxrwx under 000,
# as in many containers). The paths are published through the torch.distributed store (unauthenticated
# TCP); higher ranks connect to lower ranks and announce their rank in 4 bytes, which the listener
# believes: no peer credentials are checked, and the fds follow on those connections. So a local user who
# can connect to a listening socket (permissive umask), who binds a predictable path before its owner, or
# who rewrites a path in the store, could be handed the fds, i.e. read and write every rank's heap.
# iris offers no setting for the socket directory, so ``private_handle_passing`` wraps the two functions
# involved while our heap is created (small, restored afterwards, and refused if iris no longer has them):
#   * every listening socket is created inside a fresh directory of mode 0700 with a random name
#     (``tempfile.mkdtemp``), so no other user can reach, pre-create or replace it, whatever the umask;
#   * before any handle is sent, the peer of every connection (SO_PEERCRED) must run as this user, so a
#     path redirected through the store to someone else's socket stops the set-up instead.
# Processes of the same user are trusted (they could read this process's memory anyway); see README "Trust".
_HANDLE_DIR_PREFIX = "ring-attn-iris-"
_SUN_PATH_MAX = 107  # AF_UNIX path bytes on Linux, without the terminating NUL
_IRIS_SOCK_NAME_MAX = 64  # "iris-dmabuf-<pid>-<rank>-<n>.sock" with generous room for each number
_patch_lock = threading.Lock()


def _iris_handle_passing_modules():
    """iris's fd-passing module and the module that calls it, after checking that they still work the way
    ``private_handle_passing`` was written for (else it could not vouch for the sockets and raises)."""
    from iris.host.distributed import fd_passing
    from iris.host.memory import symmetric_heap

    setup = getattr(fd_passing, "setup_fd_infrastructure", None)
    names = getattr(getattr(setup, "__code__", None), "co_names", ())
    if not (callable(getattr(fd_passing, "make_rank_sock_path", None)) and "make_rank_sock_path" in names
            and getattr(symmetric_heap, "setup_fd_infrastructure", None) is setup):
        from importlib import metadata

        try:
            version = metadata.version("tokenspeed-iris")
        except metadata.PackageNotFoundError:
            version = "unknown version"
        raise RuntimeError(
            f"the installed iris ({version}) no longer creates its memory-handle sockets through "
            "iris.host.distributed.fd_passing.make_rank_sock_path / setup_fd_infrastructure, so "
            "ring_core.runtime.heap cannot keep other local users away from them; refusing to create the heap. "
            "Check how this iris passes handles and update ring_core.runtime.heap.private_handle_passing")
    return fd_passing, symmetric_heap


def _private_dir() -> str:
    """A new directory only this user can enter (mode 0700, random name), short enough for socket paths."""
    path = tempfile.mkdtemp(prefix=_HANDLE_DIR_PREFIX)
    if len(path) + 1 + _IRIS_SOCK_NAME_MAX > _SUN_PATH_MAX:  # a long TMPDIR: fall back to /tmp
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix=_HANDLE_DIR_PREFIX, dir="/tmp")
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise RuntimeError(f"{path} is not a private directory (mode {oct(st.st_mode)}, owner {st.st_uid})")
    return path


def peer_credentials(sock) -> tuple:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX socket (SO_PEERCRED)."""
    fmt = "3i"
    return struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt)))


def check_handle_peers(conns, uid: int | None = None) -> None:
    """Raise PermissionError (closing every connection) unless each peer in ``conns`` (rank -> connected
    AF_UNIX socket) runs as ``uid`` (default: this process's effective uid)."""
    uid = os.geteuid() if uid is None else uid
    for peer, sock in sorted((conns or {}).items()):
        pid, peer_uid, _ = peer_credentials(sock)
        if peer_uid != uid:
            for s in conns.values():
                s.close()
            raise PermissionError(
                f"the memory-handle connection to rank {peer} leads to process {pid} of user {peer_uid}, not "
                f"to a process of this job's user ({uid}); another local user is interfering with the heap "
                "set-up, so no handle was sent. Every rank of a job must run as the same user")


@contextlib.contextmanager
def private_handle_passing():
    """While iris builds a heap inside this block, its handle-passing sockets live in a private directory
    and every connection's peer must be a process of this user (see the comment above). Yields the
    directory (removed, with iris's functions restored, on exit)."""
    fd_passing, symmetric_heap = _iris_handle_passing_modules()
    make_path, setup = fd_passing.make_rank_sock_path, fd_passing.setup_fd_infrastructure
    with _patch_lock:
        sock_dir = _private_dir()

        def private_sock_path(prefix, rank, instance_id=0):
            return os.path.join(sock_dir, os.path.basename(make_path(prefix, rank, instance_id)))

        def checked_setup(cur_rank, num_ranks):
            conns = setup(cur_rank, num_ranks)
            check_handle_peers(conns)
            return conns

        fd_passing.make_rank_sock_path = private_sock_path
        symmetric_heap.setup_fd_infrastructure = checked_setup
        try:
            yield sock_dir
        finally:
            fd_passing.make_rank_sock_path = make_path
            symmetric_heap.setup_fd_infrastructure = setup
            shutil.rmtree(sock_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------ ring slots
# Each frontend has its own slots: JAX assigns them the same way in every process without communicating
# (every process lowers the same programs, and registers every ring of a mesh axis, its own or not), which
# only works if nothing else writes into its part; torch agrees on each group's slot with the group's
# members at the group's first fused call.
FRONTEND_SLOTS = {"jax": range(0, control.RING_SLOTS // 2), "torch": range(control.RING_SLOTS // 2, control.RING_SLOTS)}


class RingSlots:
    """Which slot of the heap (its control words and flags, ring_core.protocol.control.HeapLayout) each ring uses.

    A ring is its members' global ranks in ring order. Rings that share a rank need different slots (each
    slot holds one call counter per rank); rings that share none may use the same one. ``assign`` gives a
    new ring the lowest slot of its frontend's range that no registered ring sharing a member uses, nor any
    slot in ``taken``; a ring keeps its slot until the heap is released."""

    def __init__(self):
        self._slots = {}  # (frontend, members) -> slot

    def get(self, frontend: str, members) -> int | None:
        return self._slots.get((frontend, tuple(members)))

    def ring_at(self, slot: int, rank: int):
        """The registered ring of ``rank`` on ``slot`` (its members), or None."""
        return next((m for (_, m), s in self._slots.items() if s == slot and rank in m), None)

    def used_by(self, frontend: str, rank: int) -> set:
        """Slots of the registered rings of ``frontend`` that ``rank`` belongs to."""
        return {s for (f, m), s in self._slots.items() if f == frontend and rank in m}

    def assign(self, frontend: str, members, taken=()) -> int:
        members = tuple(int(m) for m in members)
        if len(set(members)) != len(members):
            raise ValueError(f"a ring lists a rank twice ({members}): every member must be another process")
        key = (frontend, members)
        if key in self._slots:
            return self._slots[key]
        busy = set(taken) | {s for (f, m), s in self._slots.items() if f == frontend and set(m) & set(members)}
        free = [s for s in FRONTEND_SLOTS[frontend] if s not in busy]
        if not free:
            raise RuntimeError(
                f"rank(s) of the ring {list(members)} already take part in {len(FRONTEND_SLOTS[frontend])} other "
                f"{frontend} rings on this heap, the most one heap serves; use fewer distinct rings (process "
                "groups / mesh axes) per process, or shutdown() and initialize() to forget them")
        self._slots[key] = free[0]
        return free[0]


def check_heap_size(heap_size):
    """None (then RING_ATTENTION_HEAP_BYTES or 4 GiB) or an int of at least twice iris's slack; returns it."""
    if heap_size is None:
        heap_size = settings.heap_bytes()
    if (isinstance(heap_size, bool) or not isinstance(heap_size, (int, np.integer))
            or heap_size < 2 * control.HEAP_SLACK):
        raise ValueError(f"heap_size must be an int of at least {2 * control.HEAP_SLACK} bytes, got {heap_size!r}")
    return int(heap_size)


class HeapRings:
    """What a fused call needs of this process's heap, given where every process maps every heap: the
    rings' slots, each ring's context array, launch plans, the first kept failure. ``SymmetricHeap`` is the
    GPU heap; tests build one over CPU buffers (``workspace`` a torch uint8 tensor starting ``base_off``
    bytes from this process's heap base)."""

    def __init__(self, rank: int, all_bases, layout: control.HeapLayout, workspace, base_off: int = 0,
                 node_size: int | None = None):
        self.rank = rank
        self.world_size = len(all_bases)
        # The heaps a process maps are those of its node (ranks node*R .. node*R + R - 1; one node: every rank):
        # [process][rank of its node]: that heap's base as mapped in the process.
        self.node_size = node_size or len(all_bases)
        self.all_bases = [[int(b) for b in bases] for bases in all_bases]
        self.layout = layout
        self.workspace = workspace
        self.base_off = base_off
        self.device = workspace.device
        self.rings = RingSlots()
        self._ctx = {}  # (members, slot) -> this process's context tensor for that ring

    def ctx_row(self, process: int, members, slot: int) -> np.ndarray:
        """The context array (ring_core.protocol.control.make_ctx) of global rank ``process`` in the ring ``members``
        (global ranks in ring order) on ring slot ``slot``, with the heap bases as mapped in *that* process.
        The same in every process (every process gathered every process's view), so a frontend can bake a
        table of rows into a program that must be the same on all processes (JAX multi-controller)."""
        members = [int(m) for m in members]
        first = process // self.node_size * self.node_size  # the first rank of the process's node
        if not all(first <= m < first + self.node_size for m in members):
            raise ValueError(f"the ring {members} spans several nodes (of {self.node_size} ranks each): a fused ring "
                             "runs within one node; across nodes the two-level ring runs (group=None / the whole "
                             "sequence axis), or use the reference backend")
        return control.make_ctx([self.all_bases[process][m - first] for m in members], members.index(process),
                               self.layout, slot)

    def ctx(self, members, slot: int):
        """This process's context tensor (on its device) for the ring ``members`` on slot ``slot``; cached. As
        int32 words, as the JAX frontend passes it (JAX without x64 has no int64 arrays; the kernels read it as
        int64 either way): the argument's type is part of the kernel's signature, so with the same type torch's
        JIT and the JAX launch compile one binary (one entry of Triton's cache), not two."""
        import torch

        key = (tuple(members), slot)
        if key not in self._ctx:
            self._ctx[key] = torch.from_numpy(self.ctx_row(self.rank, members, slot).view(np.int32)).to(self.device)
        return self._ctx[key]

    def kernel_spec(self, spec):
        """The call the fused kernels run for ``spec`` on this device (ring_core.plans.kernel_spec: the frontends pad q,
        k and v to its head_dim). At a power of two nothing is padded, and the device is not asked (a call's host
        time)."""
        if plans.block_d(spec.head_dim) == spec.head_dim:
            return spec
        return plans.kernel_spec(spec, plans.gluon_capability(self.device))

    def plan(self, spec, ring_size: int, **kw) -> plans.LaunchPlan:
        """The forward kernel's launch (ring_core.plans.plan; on a Hopper GPU the Gluon kernel where it applies,
        unless RING_ATTENTION_GLUON=0); raises HeapTooSmallError."""
        return plans.plan(spec, ring_size, self.layout, capability=plans.gluon_capability(self.device),
                          sms=plans.device_sms(self.device), **kw)

    def plan_bwd(self, spec, ring_size: int, **kw) -> plans.LaunchPlan:
        """The backward kernel's launch (ring_core.plans.plan_bwd: the frontends pass their call's
        ``deterministic``, which picks the kernel); raises HeapTooSmallError."""
        return plans.plan_bwd(spec, ring_size, self.layout, capability=plans.gluon_capability(self.device),
                              sms=plans.device_sms(self.device), **kw)

    def ring_flags(self, frontend: str, members, n: int) -> tuple:
        """(epoch, first ``n`` flag words) of the slot of the ring ``members`` (global ranks in ring order) of
        ``frontend`` ("jax" or "torch") on this rank, after its last call (``ring_core.protocol.control.ring_flags``;
        ``plans.LaunchPlan.chunks_received`` decodes them). Waits for this device first."""
        import torch

        slot = self.rings.get(frontend, members)
        if slot is None:
            raise ValueError(f"no {frontend} ring over {list(members)} has made a fused call on this heap")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return control.ring_flags(self.workspace, self.layout, slot, n, self.base_off)

    def take_error(self):
        """(status words, ring members) of the first fused call that failed on this rank since the last
        take_error() or reset(), for ring_core.protocol.control.check_status, or None; clears them. Waits for this
        device first."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
        kept = control.take_sticky(self.workspace, self.layout, self.base_off)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if kept is None:
            return None
        status, slot = kept
        return status, self.rings.ring_at(slot, self.rank)


@contextlib.contextmanager
def scoped_to_node(group, node: int):
    """While iris builds a heap inside this block, the torch.distributed calls it makes on the default group act on
    ``group`` (the ranks of node ``node``) and its rendezvous keys get a prefix of the node's: iris builds its heap
    over the default group only (tokenspeed-iris 0.0.0.post20261013: ``dist.get_rank()``, ``dist.barrier()``,
    ``dist.all_gather(_object)`` and the default store), and it maps peer memory only between the processes of one
    host, so a job of several nodes builds one heap per node. ``group`` None: nothing changes. Used inside
    ``private_handle_passing``, whose lock keeps other threads' heaps from being built meanwhile."""
    if group is None:
        yield
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    names = ("get_rank", "get_world_size", "barrier", "all_gather", "all_gather_object", "get_backend")
    saved = {n: getattr(dist, n) for n in names}
    saved_store = c10d._get_default_store
    store = dist.PrefixStore(f"ring-attention-node-{node}/", saved_store())

    def scoped(f):
        def call(*args, group=None, **kw):
            return f(*args, group=scoped_group if group is None else group, **kw)
        return call

    scoped_group = group
    for n in names:
        setattr(dist, n, scoped(saved[n]))
    c10d._get_default_store = lambda: store
    try:
        yield
    finally:
        for n in names:
            setattr(dist, n, saved[n])
        c10d._get_default_store = saved_store


class SymmetricHeap(HeapRings):
    def __init__(self, heap_size: int | None = None, nodes=None, node_group=None):
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the iris heap needs torch.distributed: call dist.init_process_group() first "
                               "(jax_ring.initialize() and torch_bridge.initialize() do this from the launcher's "
                               "environment)")
        if not torch.cuda.is_available():
            raise RuntimeError("the fused backend needs a GPU; use backend='xla' (JAX) or 'torch' (PyTorch) on CPU")
        heap_size = check_heap_size(heap_size)
        import iris

        # On NVIDIA only the vmem_chunked allocator works (torch and vmem are HIP-only); chosen here so
        # users set no environment variable.
        allocator = "torch" if torch.version.hip else "vmem_chunked"
        # Several nodes (ring_core.topology.Nodes): iris over this node's ranks (``node_group``), a heap per node.
        node = None if nodes is None or nodes.num_nodes == 1 else nodes.node_of(dist.get_rank())
        with private_handle_passing(), scoped_to_node(node_group if node is not None else None, node):
            self.iris = iris.iris(heap_size, allocator_type=allocator)
        self.heap_size = heap_size
        local, node_size = self.iris.get_rank(), self.iris.get_num_ranks()
        if node_size > control.MAX_WORLD:
            raise ValueError(f"at most {control.MAX_WORLD} ranks are supported in one node, got {node_size}")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        ws = heap_size - control.HEAP_SLACK
        workspace = self.iris.zeros(ws, dtype=torch.uint8)
        # Heap bases as mapped in *this* process: a peer's heap sits at a different virtual address in
        # every process, so each process's view is gathered (ctx_row needs all of them).
        bases = [int(b) for b in self.iris.get_heap_bases().cpu().tolist()]
        base_off = workspace.data_ptr() - bases[local]
        views = [None] * world_size
        dist.all_gather_object(views, (base_off, bases))
        if len({v[0] for v in views}) != 1:
            raise RuntimeError(f"symmetric heap workspace offsets differ across ranks: {[v[0] for v in views]}")
        super().__init__(rank, [v[1] for v in views], control.HeapLayout.for_workspace(ws, base_off), workspace,
                         base_off, node_size=node_size)
        torch.cuda.synchronize()
        dist.barrier()

    def reset(self):
        """Collective (every rank must call it, with no fused call in flight): zero the control words and
        flags, so that call counters agree again after a timeout left them out of step."""
        import torch
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.barrier()
        start, end = self.layout.protocol_region
        self.workspace[start - self.base_off:end - self.base_off].zero_()
        torch.cuda.synchronize()
        dist.barrier()

    def close(self):
        import torch

        torch.cuda.synchronize()
        self.workspace = None
        self._ctx = {}
        ctx, self.iris = self.iris, None
        if ctx is not None:
            ctx.__del__()


@dataclass(frozen=True)
class NodeRings:
    """This rank's place in a job of several nodes (the two-level ring): its node's process group (the fused
    kernel's rings and the node's heap are over it) and the between-node ring of the ranks with its local rank
    (``peers``), with this rank's neighbours there (global ranks). Both frontends take it from here."""

    nodes: object  # ring_core.topology.Nodes
    node: int
    local: int
    node_group: object
    peers: object
    next_rank: int
    prev_rank: int


_node_rings = None  # NodeRings of the job, while a heap of several nodes exists


def node_rings():
    """This rank's NodeRings while a heap of a job of several nodes exists, else None."""
    return _node_rings if _heap is not None else None


def join_nodes(nodes) -> NodeRings:
    """Collective over the job: check ``nodes`` against every rank's host (ring_core.topology.check_hosts), make
    every node's and every between-node ring's process group (every rank takes part in creating each of them, as
    torch.distributed wants)."""
    import torch.distributed as dist

    from ring_core import topology

    hosts = [None] * nodes.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    topology.check_hosts(hosts, nodes)
    rank = dist.get_rank()
    node_group, _ = dist.new_subgroups_by_enumeration([list(nodes.node_members(n)) for n in range(nodes.num_nodes)])
    peers, _ = dist.new_subgroups_by_enumeration([list(nodes.peer_members(r)) for r in range(nodes.node_size)])
    node, local = nodes.node_of(rank), nodes.local_of(rank)
    return NodeRings(nodes, node, local, node_group, peers, nodes.rank_of((node + 1) % nodes.num_nodes, local),
                     nodes.rank_of((node - 1) % nodes.num_nodes, local))


def initialize(heap_size: int | None = None, nodes=None) -> SymmetricHeap:
    """Create this process's heap, or return the one that exists.

    A second call returns the existing heap unchanged; asking it for a different ``heap_size`` raises
    RuntimeError (call ``shutdown()`` first). After ``shutdown()`` it creates a new heap. Collective: every
    rank of the job calls it (iris exchanges the heap handles). ``nodes`` (ring_core.topology.Nodes) of several
    nodes: the node rings are made (``join_nodes``, once per job) and each node builds its own heap over its node's
    process group (``node_rings()``)."""
    global _heap, _node_rings
    with _lock:
        if _heap is not None:
            if heap_size is not None and check_heap_size(heap_size) != _heap.heap_size:
                raise RuntimeError(f"the heap already exists with {_heap.heap_size} bytes; call shutdown() "
                                   f"before initialize(heap_size={heap_size})")
            return _heap
        _register_atexit()
        if nodes is None or nodes.num_nodes == 1:
            _node_rings = None
        elif _node_rings is None or _node_rings.nodes != nodes:  # (process groups are made once per job)
            _node_rings = join_nodes(nodes)
        if _node_rings is None:  # one node: the heap as it always was
            _heap = SymmetricHeap(heap_size)
        else:
            _heap = SymmetricHeap(heap_size, nodes=nodes, node_group=_node_rings.node_group)
        return _heap


def get() -> SymmetricHeap:
    if _heap is None:
        raise NotInitializedError("the fused backend needs the symmetric heap: call jax_ring.initialize() or "
                                  "torch_bridge.initialize() once per process first (one process per GPU)")
    return _heap


def is_initialized() -> bool:
    return _heap is not None


def on_release(hook) -> None:
    """Call ``hook()`` after every ``shutdown()`` that releases a heap (once per hook, however often it is
    registered). Frontends use it to forget what refers to the released heap's memory."""
    with _lock:
        if hook not in _release_hooks:
            _release_hooks.append(hook)


def shutdown() -> bool:
    """Release the heap (waits for this GPU first) and run the release hooks; returns False when there was
    none. Local: no communication. The process group stays (see the module docstring)."""
    return _release(run_hooks=True)


def _release(run_hooks: bool) -> bool:
    global _heap
    with _lock:
        if _heap is None:
            return False
        h, _heap = _heap, None
        try:
            h.close()
        finally:
            for hook in list(_release_hooks) if run_hooks else ():
                hook()
        return True


def owns_process_group() -> bool:
    """Whether the current default torch.distributed process group was created here (and so is destroyed
    here, at exit)."""
    import torch.distributed as dist

    return (_owned_group is not None and dist.is_available() and dist.is_initialized()
            and dist.distributed_c10d._get_default_group() is _owned_group)


def _register_atexit():
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True


def _at_exit():
    """At interpreter exit: release a heap still held, then destroy the process group if it is ours (so
    that NCCL does not warn that destroy_process_group() was never called). Errors are reported, not
    raised: the program is ending."""
    global _owned_group
    try:
        _release(run_hooks=False)  # nothing runs after this: no compiled program needs forgetting
    except Exception as e:  # e.g. the GPU is in an error state
        print(f"ring_core.runtime.heap: releasing the heap at exit failed: {e!r}", file=sys.stderr)
    try:
        if owns_process_group():
            import torch.distributed as dist

            dist.destroy_process_group()
    except Exception as e:
        print(f"ring_core.runtime.heap: destroying the process group at exit failed: {e!r}", file=sys.stderr)
    finally:
        _owned_group = None


def init_torch_distributed_from_env(backend: str | None = None):
    """Initialise torch.distributed from the launcher's environment if nobody did yet.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT as set by
    ``python -m jax_ring.launch`` or torchrun. The rank uses GPU ``LOCAL_RANK % visible GPUs``
    (``ring_core.runtime.gpus.placement``); the group's backend is NCCL where every rank has its own GPU and gloo
    where ranks share one (NCCL refuses that), and a rank that shares its GPU is told once what it lacks
    (``ring_core.runtime.gpus.advise_sharing``: an MPS daemon, a per-rank SM share). ``backend`` names another
    torch.distributed backend (e.g. "gloo" for a group without GPUs). A process group created here is
    owned here: destroyed at interpreter exit, not by ``shutdown()``. An existing process group is used as
    it is and never destroyed here. Returns (rank, world_size, CUDA device index of this rank)."""
    global _owned_group
    import torch
    import torch.distributed as dist

    from ring_core.runtime import gpus

    with _lock:
        if dist.is_initialized():
            # The program's own group: its ranks chose their GPUs (the heap is built on the current one).
            device = torch.cuda.current_device() if torch.cuda.is_available() else int(os.environ.get("LOCAL_RANK", 0))
            return dist.get_rank(), dist.get_world_size(), device
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"cannot join the job: {', '.join(missing)} not set. Start one process per rank with "
                "`python -m jax_ring.launch --nproc-per-node N script.py` or torchrun, or call "
                "torch.distributed.init_process_group() yourself first")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if backend is None:  # the fused backend's case: one GPU per rank, or ranks sharing GPUs
            if not torch.cuda.is_available():
                raise RuntimeError("the fused backend needs NVIDIA GPUs; on CPU use "
                                   "backend='xla' (JAX) or backend='torch' (PyTorch), which need no initialize()")
            where = gpus.placement_from_env(torch.cuda.device_count())
            if where.shared and gpus.mps_serving() and not os.environ.get(gpus.MPS_SHARE_ENV) \
                    and not torch.cuda.is_initialized():
                # Read when this process's CUDA context is created, which has not happened yet.
                os.environ[gpus.MPS_SHARE_ENV] = str(gpus.mps_share(where.ranks_per_gpu))
            gpus.advise_sharing(where)
            torch.cuda.set_device(where.device)
            device = where.device
            if where.backend == "nccl":
                dist.init_process_group("nccl", rank=rank, world_size=world,
                                        device_id=torch.device("cuda", device))
            else:
                dist.init_process_group(where.backend, rank=rank, world_size=world)
        else:
            device = int(os.environ.get("LOCAL_RANK", rank))
            dist.init_process_group(backend, rank=rank, world_size=world)
        _owned_group = dist.distributed_c10d._get_default_group()
        _register_atexit()
        return rank, world, device
