"""The fused backend's lifecycle in JAX: joining a job of one process per rank (one GPU each, or ranks sharing
GPUs), the symmetric heap's lifetime (initialize, shutdown, reset) and the failures of fused calls (check_errors;
GPU path). The twin of torch_bridge.lifecycle.

Errors found by the kernel (a bounded wait that expired, ranks that disagree) come back in a small status array
per launch. Checking it from the call would cost a host round trip per call, so by default
(RING_ATTENTION_ERRORS=deferred) jax_ring.status copies it to pinned memory asynchronously and a later fused
call on this process raises it, as do ``check_errors()`` (which waits) and ``shutdown()``;
RING_ATTENTION_ERRORS=call raises it from the call itself (ring_core.protocol.control.errors_mode).
"""

from __future__ import annotations

import os

from jax_ring import status as _status
from ring_core import topology
from ring_core.protocol import control
from ring_core.runtime import heap as _heap


def initialize(heap_size: int | None = None, node_size: int | None = None):
    """Prepare this process for ``backend="fused"``; returns the heap. Collective: every rank calls it.

    In a job of one process per rank (``python -m jax_ring.launch --nproc-per-node N script.py`` or
    torchrun), this initialises torch.distributed (iris exchanges heap handles through it) and
    ``jax.distributed`` (one local device: this process's GPU, ``LOCAL_RANK % visible GPUs``; ranks may
    share a GPU, see ``ring_core.runtime.gpus``), each only if not done yet, then creates the
    iris symmetric heap of ``heap_size`` bytes (default 4 GiB or RING_ATTENTION_HEAP_BYTES). Call it before
    JAX touches the GPU, so that XLA does not preallocate the memory the heap needs.

    Several nodes: ``node_size`` ranks per node (host); None finds it (``ring_core.topology.resolve_nodes``:
    RING_ATTENTION_NODE_SIZE, else the launcher's LOCAL_WORLD_SIZE, else SLURM's tasks per node, else one node).
    With several nodes each node builds its own heap (iris maps memory only within a host), and a fused call over a
    mesh axis longer than a node runs the two-level ring (jax_ring.nodes: the kernel within each node's devices of
    the axis, K/V between nodes by ``lax.ppermute``). As torch_bridge.initialize.

    Calling it again returns the same heap (a different ``heap_size`` raises RuntimeError: ``shutdown()``
    first). After ``shutdown()`` it creates a new heap, reusing the process group and ``jax.distributed``
    (JAX cannot initialise those twice). A torch.distributed process group created here is destroyed at
    interpreter exit; one the program created is left alone. Until it has run, ``backend="fused"`` raises
    and ``backend="auto"`` uses the xla reference ring.

    Example (2 GPUs)::

        # python -m jax_ring.launch --nproc-per-node 2 my_script.py
        import jax_ring
        jax_ring.initialize()
    """
    heap_size = _heap.check_heap_size(heap_size) if heap_size is not None else None
    if _heap.is_initialized():
        h = _heap.initialize(heap_size)
        _map_processes()
        return h
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    rank, world, device = _heap.init_torch_distributed_from_env()
    import jax

    if world == 1:
        # One process: JAX would otherwise open every visible GPU and leave the last one current, so
        # torch's NCCL calls then find their tensors on a device the process group was not bound to.
        jax.config.update("jax_cuda_visible_devices", str(device))
    if world > 1 and not _jax_distributed_ready():
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if "JAX_COORDINATOR_PORT" not in os.environ and "MASTER_PORT" not in os.environ:
            raise RuntimeError(
                "jax_ring.initialize needs a port for jax.distributed's coordinator: set JAX_COORDINATOR_PORT "
                "(or MASTER_PORT, whose next port is used) to the same free port on every process, or call "
                "jax.distributed.initialize(..., local_device_ids=[this process's GPU]) yourself first")
        port = int(os.environ.get("JAX_COORDINATOR_PORT", int(os.environ.get("MASTER_PORT", 0)) + 1))
        jax.distributed.initialize(coordinator_address=f"{addr}:{port}", num_processes=world, process_id=rank,
                                   local_device_ids=[device])
    h = _heap.initialize(heap_size, nodes=topology.resolve_nodes(world, node_size))
    _map_processes()
    return h


def node_size() -> int:
    """Ranks per node of the job (the whole job when it is one node); needs ``initialize()``."""
    return _heap.get().node_size


def _map_processes():
    """Tell the fused launcher which global rank (of the heap's job) each JAX process has (collective):
    a ring is made of a mesh axis's devices, each named by its process (jax_ring.fused.ring_table)."""
    import jax
    import torch.distributed as dist

    from jax_ring import fused

    pairs = [(jax.process_index(), 0)]  # no process group: a job of one
    if dist.is_available() and dist.is_initialized():
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, (jax.process_index(), dist.get_rank()))
    fused.set_process_ranks(dict(pairs))


def _jax_distributed_ready() -> bool:
    import jax

    is_init = getattr(jax.distributed, "is_initialized", None)
    if is_init is not None:
        return bool(is_init())
    return jax.process_count() > 1


def shutdown() -> bool:
    """Wait for outstanding fused calls, release the symmetric heap, then raise the first failure they reported
    that ``check_errors()`` has not raised (if any). Returns False if there was no heap (so a second call is
    harmless). Local: no communication, but every rank should shut down before any re-initialises.

    Programs already compiled with ``backend="fused"`` refer to the released heap, so every JAX compilation
    cache is cleared: the next call of such a program traces again, and raises until ``initialize()`` made
    a new heap. torch.distributed and ``jax.distributed`` stay up (``initialize()`` may follow)."""
    try:
        if _heap.is_initialized():
            check_errors()  # a failure still raises, after the heap is released
    finally:
        released = _heap.shutdown()
    return released


def reset():
    """Collective: after a fused call raised a timeout, call on every rank (no call in flight) to zero
    the protocol state so that the ranks' call counters agree again; the heap stays allocated. Failures of
    earlier calls not yet raised are dropped (they were raised or are being handled). Raises
    ``NotInitializedError`` (a RuntimeError) when there is no heap."""
    h = _heap.get()
    _status.clear()
    h.reset()  # zeroes the kernel's kept failure too


def check_errors():
    """Raise the first failure of a fused call on this rank since the last ``check_errors()`` or ``reset()``
    (ring_core.protocol.control.RingAttentionTimeout / RingAttentionMismatch, naming global ranks); waits for this GPU's
    calls first. Local: call it on every rank, e.g. once per training step.

    With RING_ATTENTION_ERRORS=deferred (the default) a failed call does not raise by itself: a later fused call
    on this process does (its program fails with a ``jax.errors.JaxRuntimeError`` whose message starts with
    the exception's name), and this raises the failure as its own type, whether a call reported it already or
    not. What a failed call could not compute is NaN. With RING_ATTENTION_ERRORS=call the calls raise
    themselves and there is nothing kept here."""
    h = _heap.get()
    first = _status.take(wait=True)
    kept = h.take_error()  # programs traced under jax_ring.status.left_out(): the kernel kept it on the heap
    if first is not None:
        raise first
    if kept is not None:
        status, members = kept
        control.check_status(status, members.index(h.rank) if members else h.rank, members=members)


def is_initialized() -> bool:
    return _heap.is_initialized()
