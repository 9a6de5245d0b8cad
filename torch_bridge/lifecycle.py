"""The fused backend's lifecycle in PyTorch: joining the job (initialize), the symmetric heap's lifetime (shutdown,
reset) and the failures of fused calls (check_errors). The twin of jax_ring.lifecycle.

Errors found by the kernel (a bounded wait that expired, ranks that disagree) come back in a small status tensor per
launch, which the kernel writes straight into pinned host memory (torch_bridge.fused._zeroed_status). Checking it at
once would cost a host sync per call, so an event is recorded after the launch and the status is read once the event has
completed: at the next fused call, at ``check_errors()`` (which waits), or at once with RING_ATTENTION_ERRORS=call
(ring_core.protocol.control.errors_mode; torch's default is "deferred"). JAX's status is an XLA buffer in device memory
instead, which jax_ring.status copies into its pinned slots with a kernel per call.
"""

from __future__ import annotations

import torch

from ring_core import topology
from ring_core.protocol import control
from ring_core.runtime import heap as _heap

_pending = []  # (event, status (pinned host memory the kernel writes), ring position, timeout_s, ring members)


def node_size() -> int:
    """Ranks per node of the job (the whole job when it is one node); needs ``initialize()``."""
    return _heap.get().node_size


def node_rings():
    """This rank's ring_core.runtime.heap.NodeRings when the job has several nodes, else None."""
    return _heap.node_rings()


def initialize(heap_size: int | None = None, group=None, node_size: int | None = None):
    """Create this process's iris symmetric heap and return it. Collective: every rank of the job calls it.

    Initialises torch.distributed from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if the program has not: NCCL where every rank has its own
    GPU, gloo where ranks share one (rank r uses GPU ``LOCAL_RANK % visible GPUs``, see ``ring_core.runtime.gpus``);
    a process group created here is destroyed at interpreter exit (never earlier), one the program
    created is left alone. The heap serves rings over any process groups within a node
    (``ring_attention(..., group=...)``); ``group`` is accepted for compatibility and unused.

    Several nodes. ``node_size`` is the number of ranks per node (host); None finds it
    (``ring_core.topology.resolve_nodes``: RING_ATTENTION_NODE_SIZE, else the launcher's LOCAL_WORLD_SIZE, else
    SLURM's tasks per node, else one node). With several nodes each node builds its own heap (iris maps memory
    only within a host) and ``ring_attention(group=None)`` runs the two-level ring (torch_bridge.nodes): the fused
    kernel inside each node, K/V between nodes over torch.distributed. The ranks of a node must share a host
    (checked here, with a clear error); several nodes may share one when ``node_size`` or RING_ATTENTION_NODE_SIZE
    says so (to test the two-level ring on one machine).

    Calling it again returns the same heap (a different ``heap_size`` raises RuntimeError: ``shutdown()``
    first); after ``shutdown()`` it creates a new heap on the same process group. Until it has run,
    ``backend="fused"`` raises and ``backend="auto"`` uses the torch reference ring.
    """
    heap_size = _heap.check_heap_size(heap_size) if heap_size is not None else None
    _, world, _ = _heap.init_torch_distributed_from_env()
    return _heap.initialize(heap_size, nodes=topology.resolve_nodes(world, node_size))


def shutdown() -> bool:
    """Wait for outstanding fused calls, release the heap, then raise the first timeout they reported (if
    any). Returns False when there was no heap, so a second call is harmless. Local: no communication. The
    process group stays (``initialize()`` may follow); fused calls raise until it does."""
    try:
        check_errors()  # a timeout still raises, after the heap is released
    finally:
        released = _heap.shutdown()
    return released


def reset():
    """Collective: after a reported timeout, call on every rank to bring the ranks' call counters back in
    step (waits for outstanding calls; their errors are dropped, they were raised or are being handled).
    Raises ``NotInitializedError`` (a RuntimeError) when there is no heap."""
    global _pending
    for ev, *_ in _pending:
        ev.synchronize()
    _pending = []
    _heap.get().reset()


def fused_available() -> bool:
    return _heap.is_initialized()


def report(wait: bool):
    """Raise the first failure of the fused calls issued so far that have finished, in the order they were issued,
    up to the first that has not (``wait``: wait for all of them first). Each call asks only that far: the calls
    still running behind the first unfinished one are not asked (back to back on one stream, a dozen of them at
    4k tokens, one H100: each ``query`` cost about a microsecond of the next call's host time); they are checked
    once it has finished."""
    global _pending
    done = 0
    first_error = None
    for ev, st, rank, timeout_s, members in _pending:
        if wait:
            ev.synchronize()
        elif not ev.query():
            break
        done += 1
        try:
            control.check_status(st.numpy(), rank, timeout_s, members=members)
        except RuntimeError as e:  # RingAttentionTimeout, or a call that never completed
            first_error = first_error or e
    _pending = _pending[done:]
    if first_error is not None:
        raise first_error


def check_errors():
    """Wait for every fused call issued so far and raise the first timeout any of them reported."""
    report(wait=True)


def track(status, ring, timeout_s):
    """Check ``status`` (the status words of a launch on ``ring``, in pinned host memory that the kernel writes) at
    the next call or check_errors() (with RING_ATTENTION_ERRORS=call: at once), without a host sync now: an event
    after the launch says when the kernel has ended and its words are there."""
    if status.device.type != "cpu":  # (pinned: checked once per block of rows, torch_bridge.fused._zeroed_status)
        raise RuntimeError("torch_bridge: a fused call's status must be pinned host memory the kernel writes "
                           f"(torch_bridge.fused._zeroed_status), got a tensor on {status.device}")
    ev = torch.cuda.Event()
    ev.record()
    members, position, _ = ring
    _pending.append((ev, status, position, timeout_s, members))
    if control.errors_mode() == "call":
        check_errors()


def is_initialized() -> bool:
    return _heap.is_initialized()
