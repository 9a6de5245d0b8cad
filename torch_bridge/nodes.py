"""backend='fused' across several nodes for PyTorch: the two-level ring of ring_core.nodes, with this rank's node's
fused calls (torch_bridge.fused over the node's process group) and the K/V between nodes over torch.distributed
point-to-point (NCCL; gloo where ranks share a GPU, staged through host memory). The twin of jax_ring.nodes.

``torch_bridge.initialize()`` finds the nodes (ring_core.runtime.heap.NodeRings); ``ring_attention(group=None)``
then comes here when the job has several. Each transfer posts its send to the same local rank of the next node and
its receive from the previous node's together (``batch_isend_irecv``), before the node-step's fused call is
launched, and is waited for after it: the transfer of node-step s + 1 runs while node-step s computes. NCCL runs it
on its own stream; with gloo a thread of the process sends and receives pinned host copies, made and copied back on
a copy stream, while the GPU computes (``_Transfer``).

Why it cannot deadlock, and what a late or dead node does: ring_core.nodes.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import queue
import threading

import torch
import torch.distributed as dist

from ring_core import nodes
from ring_core.protocol import control
from ring_core.validate import AttentionSpec
from ring_core.runtime import heap as _heap
from torch_bridge import fused, lifecycle


def fused_takes(spec: AttentionSpec) -> bool:
    """Whether the two-level fused ring takes ``spec`` on this job's nodes (ring_core.nodes.supports)."""
    rings = lifecycle.node_rings()
    return nodes.supports(spec, rings.nodes.num_nodes, rings.nodes.node_size)


def spans_nodes(group) -> bool:
    """Whether a fused call over ``group`` is the two-level ring (the job has several nodes and ``group`` is the
    whole job); a group of several nodes that is not the whole job raises."""
    rings = lifecycle.node_rings()
    if rings is None:
        return False
    if group is None or group is dist.group.WORLD:
        return True
    members = dist.get_process_group_ranks(group)
    if len({rings.nodes.node_of(m) for m in members}) == 1:
        return False  # a ring inside one node: the one-node kernel
    if sorted(members) == list(range(rings.nodes.world_size)):
        return True
    raise NotImplementedError(
        f"the fused backend runs a process group within one node, or the whole job across nodes; this group "
        f"({members}) spans several nodes of {rings.nodes.node_size} ranks but not the whole job: pass group=None, "
        "or use backend='torch'")


class _Transfer:
    """One posted exchange between nodes: this rank's tensors to the same local rank of the next node, the previous
    node's into new tensors (``wait``).

    NCCL takes device tensors and runs on its own stream: the exchange is posted here, on the caller's thread. gloo
    (ranks that share a GPU, where NCCL cannot run; the CPU tests) runs on the process's transfer thread
    (``_transfer_thread``), one exchange after another in the order they were posted, which is the same on every
    rank (ring_core.nodes makes every rank post the same exchanges). With CUDA tensors the exchange is staged
    through pinned host memory and nothing of it holds up the caller or the GPU: the copies to the host go on a
    copy stream once the caller's stream has made the tensors; the thread waits for them, sends, receives and
    issues the copies back on another (``_copy_streams``); ``wait`` makes the caller's stream wait for those. So a
    node-step's fused call runs while its transfer is copied, sent and copied back. A tensor that arrived here
    travels on from its host copy (no copy back from the GPU)."""

    def __init__(self, xs, rings: _heap.NodeRings, timeout_s: float):
        self.rings, self.timeout_s = rings, timeout_s
        self.device = xs[0].device
        gloo = dist.get_backend(rings.peers) == "gloo"
        if not (gloo and xs[0].is_cuda):  # NCCL, or gloo on CPU tensors: nothing to stage
            sends = [x.detach().contiguous() for x in xs]
            outs = [torch.empty_like(s) for s in sends]
            if gloo:
                self.job = _transfer_thread().submit(_exchange, sends, outs, rings, timeout_s, None)
            else:
                self.sends, self.outs, self.works, self.job = sends, outs, _post(sends, outs, rings), None
            return
        stream = torch.cuda.current_stream(self.device)
        copy, back = _copy_streams(self.device)
        copy.wait_stream(stream)  # the tensors made
        back.wait_stream(stream)  # the outputs' memory free of earlier users
        sends = []
        with torch.cuda.stream(copy):
            for x in xs:
                host = getattr(x, "_host_copy", None)
                if host is None:
                    x = x.detach().contiguous()
                    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                    host.copy_(x, non_blocking=True)
                    x.record_stream(copy)  # (x may be freed by the caller while the copy runs)
                sends.append(host)
        staged = torch.cuda.Event()
        staged.record(copy)
        outs = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in sends]
        self.got = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in sends]
        self.job = _transfer_thread().submit(_exchange, sends, outs, rings, timeout_s, (staged, back, self.got))

    def wait(self):
        """The previous node's tensors (after the exchange completed; on the GPU, ready for the caller's stream)."""
        try:
            if self.job is None:
                for w in self.works:
                    w.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
                return self.outs
            outs, landed = self.job.result()
        except RuntimeError as e:
            raise control.RingAttentionTimeout(
                f"rank {dist.get_rank()}: the transfer from rank {self.rings.prev_rank} (the previous node) did not "
                f"complete within {self.timeout_s} s: {e}") from e
        if landed is None:
            return outs
        torch.cuda.current_stream(self.device).wait_event(landed)
        for x, host in zip(self.got, outs):
            x._host_copy = host
        return self.got


def _post(sends, outs, rings: _heap.NodeRings):
    """Each send to the next node's rank and each receive from the previous node's, posted together, matched in
    posting order on both ranks."""
    ops = []
    for send, out in zip(sends, outs):
        ops += [dist.P2POp(dist.isend, send, rings.next_rank, rings.peers),
                dist.P2POp(dist.irecv, out, rings.prev_rank, rings.peers)]
    return dist.batch_isend_irecv(ops)


def _exchange(sends, outs, rings: _heap.NodeRings, timeout_s: float, staging):
    """The transfer thread's part of a gloo exchange (``_Transfer``): (the received host tensors, the event after
    which their device copies are in ``staging``'s tensors, or None without staging)."""
    if staging is not None:
        staged, back, got = staging
        staged.synchronize()  # the host copies of what is sent
    for w in _post(sends, outs, rings):
        w.wait(timeout=datetime.timedelta(seconds=timeout_s))
    if staging is None:
        return outs, None
    with torch.cuda.device(back.device), torch.cuda.stream(back):
        for x, host in zip(got, outs):
            x.copy_(host, non_blocking=True)
            x.record_stream(back)  # (freed unwaited for, e.g. after an error, it stays until the copy is done)
        landed = torch.cuda.Event()
        landed.record(back)
    return outs, landed


class _TransferThread:
    """The process's transfer thread: runs what is submitted one at a time, in order, each result a Future. A
    daemon: an exchange whose peer never comes (its wait bounded by the timeout) does not hold up the process's
    exit."""

    def __init__(self):
        self.queue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="ring-transfer", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        job = concurrent.futures.Future()
        self.queue.put((job, fn, args))
        return job

    def _run(self):
        while True:
            job, fn, args = self.queue.get()
            try:
                job.set_result(fn(*args))
            except BaseException as e:  # (raised by the caller's ``result()``)
                job.set_exception(e)


_THREAD = []  # the process's _TransferThread, made at its first gloo exchange
_COPY_STREAMS = {}  # device -> the streams of the staging copies (_copy_streams)


def _transfer_thread() -> _TransferThread:
    if not _THREAD:
        _THREAD.append(_TransferThread())
    return _THREAD[0]


def _copy_streams(device):
    """(the stream of the copies to the host, the stream of the copies back): two, so that a copy back (the
    next node-step's K/V) does not queue behind a copy out that waits for the GPU's compute (the dK/dV partials)."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _COPY_STREAMS[device]


def _f32(x):
    return x if x.dtype == torch.float64 else x.float()


def _ops(spec: AttentionSpec, rings: _heap.NodeRings, timeout_s, deterministic: bool) -> nodes.Ops:
    group = rings.node_group
    wait_s = control.timeout_ns(timeout_s) / 1e9

    def inner_fwd(q, k, v, mask, ids):
        return fused.forward(q, k, v, nodes.inner_spec(spec, q, k, mask, ids), group, timeout_s,
                             segment_ids=nodes.kernel_ids(ids, torch.stack))

    def inner_bwd(q, k, v, out, lse, dout, dlse, mask, ids):
        return fused.backward(q, k, v, out, lse, dout, nodes.inner_spec(spec, q, k, mask, ids), group,
                              timeout_s, dlse=dlse, segment_ids=nodes.kernel_ids(ids, torch.stack),
                              deterministic=deterministic)

    return nodes.Ops(xp=torch, permute=lambda x, axes: x.permute(*axes), cat=lambda xs, axis: torch.cat(xs, axis),
                     flip=lambda x, axis: torch.flip(x, (axis,)), astype=lambda x, like: x.to(like.dtype), f32=_f32, inner_fwd=inner_fwd, inner_bwd=inner_bwd,
                     send=lambda xs: _Transfer(xs, rings, wait_s), recv=lambda t: t.wait())


def check_fits(spec: AttentionSpec, backward: bool, deterministic: bool) -> None:
    """Raise HeapTooSmallError (or the bad-input error) now, before anything runs, for a two-level call."""
    rings = lifecycle.node_rings()
    nodes.check_supported(spec, rings.nodes.num_nodes, rings.nodes.node_size)
    for sp in nodes.node_specs(spec, rings.nodes.num_nodes, rings.nodes.node_size):
        fused.check_fits(sp, rings.node_group, backward=backward, deterministic=deterministic)


def _ops_and_geometry(spec: AttentionSpec, timeout_s, deterministic: bool, segment_ids):
    """(this rank's ring_core.nodes.Ops, the keywords of its place in the two-level ring and its ids)."""
    rings = lifecycle.node_rings()
    ids = None if segment_ids is None else segment_ids.to(dtype=torch.int32).contiguous()
    return _ops(spec, rings, timeout_s, deterministic), dict(node=rings.node, num_nodes=rings.nodes.num_nodes,
                                                             is_causal=spec.is_causal, layout=spec.layout, ids=ids,
                                                             window=spec.window, node_size=rings.nodes.node_size)


def forward(q, k, v, spec: AttentionSpec, timeout_s, deterministic: bool, check_backward: bool, segment_ids=None):
    """(out, lse) of the two-level ring over the whole job for this rank's shards (validated ``spec``; this rank's
    ``segment_ids`` where it has them); raises before anything runs where the call cannot run (a zigzag window
    that reaches partly across a node's halves: ring_core.nodes.window_pieces; the heap too small for it, or, with
    ``check_backward``, for the backward to come). torch_bridge.api's fused
    route calls it (its eager Function and its custom op, which torch.compile sees as one opaque op) when the group
    spans several nodes."""
    check_fits(spec, check_backward, deterministic)
    ops, geometry = _ops_and_geometry(spec, timeout_s, deterministic, segment_ids)
    return nodes.forward(ops, q, k, v, **geometry)


def backward(q, k, v, out, lse, dout, dlse, spec: AttentionSpec, timeout_s, deterministic: bool, segment_ids=None):
    """(dq, dk, dv) of the two-level ring from the final out and lse (ring_core.nodes.backward: the float32
    partial dK/dV travel between nodes)."""
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float()
    dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype)
    ops, geometry = _ops_and_geometry(spec, timeout_s, deterministic, segment_ids)
    return nodes.backward(ops, q, k, v, out, lse, dout, dlse, **geometry)
