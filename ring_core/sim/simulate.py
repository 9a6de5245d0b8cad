"""Run the real fused ring-attention kernels on the CPU: the Triton interpreter, one thread per simulated rank
(exported by both frontends: ``jax_ring.simulate_ring_attention``, ``torch_bridge.simulate_ring_attention``).

``simulate_ring_attention`` takes *global* arrays in natural token order, shards them over ``world_size``
simulated ranks exactly as the frontends do (``layout_permutation`` then contiguous shards), runs the fused
Triton + iris kernel of ``ring_core.kernels.tl_fwd`` on every rank through ``ring_core.sim.interpret.SimulatedJob``
(remote stores, release/acquire flags and the end barrier all run for real over CPU "heaps"), checks every
rank's status words and gathers the result back into natural order. ``SimulatedRing`` keeps the simulated
heaps across calls, so consecutive calls exercise the epoch protocol that separates them.
``simulate_ring_attention_grad`` runs the forward kernel and then the fused backward kernel
(``ring_core.kernels.tl_bwd``) the same way and returns the gradients.

No GPU, no JAX and no process group are needed. This module imports only numpy and ``ring_core``'s numpy
parts; torch, triton and iris are imported when a simulation first runs.

The Triton interpreter must be selected before ``ring_core.kernels.tl_fwd`` (and ``iris``) are first imported in a
process. If this process already compiled them for a GPU, the simulation runs in a fresh ``spawn``
subprocess with ``TRITON_INTERPRET=1`` instead (arrays travel by pickle), so it always works; a script that
can take that path must keep its top-level work under ``if __name__ == "__main__":`` like any ``spawn``
user. Note that the in-process path sets ``TRITON_INTERPRET=1`` in ``os.environ``: a process that first
simulates and then wants the fused kernel on a GPU should simulate in a subprocess.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ring_core.protocol import control
from ring_core.layout import inverse_permutation, layout_permutation
from ring_core.validate import (AttentionSpec, check_attention_args, check_fused_dtype, check_global_seq, check_layout,
                                check_timeout)

__all__ = ["simulate_ring_attention", "simulate_ring_attention_grad", "simulate_job", "SimulatedRing"]



# --------------------------------------------------------------------------------- argument handling
@dataclass(frozen=True)
class _Call:
    """One validated call: the per-rank spec, the layout permutation and the per-rank shards. With
    ``data_parallel`` = D > 1 the job runs D rings of ``world_size`` ranks at once (a D x world_size mesh),
    ring d on the d-th of D equal batch slices; rank d * world_size + s is position s of ring d."""

    spec: AttentionSpec
    world_size: int
    perm: np.ndarray
    q_shards: list
    k_shards: list
    v_shards: list
    return_lse: bool
    timeout_s: float
    dout_shards: list | None = None
    dlse_shards: list | None = None
    data_parallel: int = 1
    seg_shards: list | None = None  # per-rank segment ids (int32 [B, S], layout order), or None

    @property
    def rings(self) -> list:
        W = self.world_size
        return [list(range(d * W, (d + 1) * W)) for d in range(self.data_parallel)]

    def shard(self, x, seq_axis: int = 1) -> list:
        """A global array's per-rank shards (ring by ring), its sequence axis in layout order."""
        S, W = self.spec.seq_local, self.world_size
        x = np.take(x, self.perm, axis=seq_axis)
        return [np.ascontiguousarray(np.take(part, np.arange(s * S, (s + 1) * S), axis=seq_axis))
                for part in np.split(x, self.data_parallel, axis=0) for s in range(W)]

    def gather(self, parts, seq_axis: int = 1):
        """Inverse of ``shard``."""
        W, inv = self.world_size, inverse_permutation(self.perm)
        rings = [np.concatenate(parts[d * W:(d + 1) * W], axis=seq_axis) for d in range(self.data_parallel)]
        return np.take(np.concatenate(rings, axis=0), inv, axis=seq_axis)

    def check(self, statuses):
        """Raise the first failure a rank reported (ring positions named by the job's rank numbers)."""
        for members in self.rings:
            for position, rank in enumerate(members):
                control.check_status(statuses[rank], position, self.timeout_s, members=members)


def _check_world_size(world_size, name: str = "world_size") -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(world_size).__name__}")
    if not 1 <= int(world_size) <= control.MAX_WORLD:
        raise ValueError(f"{name} must be in 1..{control.MAX_WORLD}, got {world_size}")
    return int(world_size)


def _prepare(q, k, v, world_size, *, is_causal, scale, layout, return_lse, timeout_s, data_parallel=1,
             segment_ids=None, window_size=None) -> _Call:
    """Every check, then the layout permutation and the shards; raises before any simulation runs.
    ``segment_ids``: global int32 [batch, seq] in natural order (sharded like q), or None."""
    W = _check_world_size(world_size)
    D = _check_world_size(data_parallel, "data_parallel")
    if D * W > control.MAX_WORLD:
        raise ValueError(f"data_parallel * world_size must be at most {control.MAX_WORLD}, got {D} * {W}")
    q, k, v = (np.asarray(x) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be a global array of rank 4 [batch, seq, heads, head_dim], "
                             f"got shape {x.shape}")
    seq = q.shape[1]
    if k.shape[1] != seq or v.shape[1] != seq:
        raise ValueError(f"q, k and v must have the same global sequence length, got q {seq}, "
                         f"k {k.shape[1]}, v {v.shape[1]}")
    check_global_seq(seq, W, check_layout(layout), "the global sequence length")
    if q.shape[0] % D:
        raise ValueError(f"the batch ({q.shape[0]}) must be divisible by data_parallel ({D}): each ring takes an "
                         "equal slice of it")
    S = seq // W
    per_rank = lambda x: (x.shape[0] // D, S, x.shape[2], x.shape[3])  # noqa: E731
    seg_shape = seg_dtype = None
    if segment_ids is not None:
        segment_ids = np.asarray(segment_ids)
        if segment_ids.shape != (q.shape[0], seq):
            raise ValueError(f"segment_ids must be a global array [batch, seq] = [{q.shape[0]}, {seq}] in natural "
                             f"token order (one id per token; negative = padding), got shape {segment_ids.shape}")
        seg_shape, seg_dtype = (q.shape[0] // D, S), segment_ids.dtype
    spec = check_attention_args(per_rank(q), per_rank(k), per_rank(v), q.dtype, k.dtype, v.dtype,
                                is_causal=is_causal, scale=scale, layout=layout, backend="fused",
                                backends=("fused",), return_lse=return_lse, window_size=window_size,
                                segment_ids_shape=seg_shape, segment_ids_dtype=seg_dtype)
    check_fused_dtype(spec.dtype, "ring_core.reference.attention (or cast q, k and v, e.g. .astype(np.float32))")
    timeout_s = check_timeout(timeout_s)
    if timeout_s is None:
        timeout_s = control.timeout_ns() / 1e9  # RING_ATTENTION_TIMEOUT_S, as on GPUs
    call = _Call(spec, W, layout_permutation(seq, W, layout), [], [], [], return_lse, float(timeout_s),
                 data_parallel=D)
    return dataclasses.replace(call, q_shards=call.shard(q), k_shards=call.shard(k), v_shards=call.shard(v),
                               seg_shards=None if segment_ids is None else call.shard(segment_ids))


def _prepare_grad(q, k, v, dout, world_size, *, is_causal, scale, layout, timeout_s, dlse=None,
                  data_parallel=1, segment_ids=None, window_size=None) -> _Call:
    """``_prepare`` plus the checks and shards of ``dout`` (q's shape and dtype) and ``dlse`` (lse's shape,
    [batch, heads, seq], any float dtype; None: lse carries no gradient)."""
    call = _prepare(q, k, v, world_size, is_causal=is_causal, scale=scale, layout=layout, return_lse=False,
                    timeout_s=timeout_s, data_parallel=data_parallel, segment_ids=segment_ids,
                    window_size=window_size)
    q, dout = np.asarray(q), np.asarray(dout)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape} (the gradient of the output), got {dout.shape}")
    if dout.dtype != q.dtype:
        raise TypeError(f"dout must have q's dtype {q.dtype}, got {dout.dtype}; cast it (e.g. .astype(q.dtype))")
    dlse_shards = None
    if dlse is not None:
        dlse = np.asarray(dlse)
        want = (q.shape[0], q.shape[2], q.shape[1])
        if dlse.shape != want or not np.issubdtype(dlse.dtype, np.floating):
            raise ValueError(f"dlse must be a float array of lse's shape {want} ([batch, heads, seq]), got "
                             f"{dlse.dtype} {dlse.shape}")
        dlse_shards = call.shard(dlse.astype(np.float32), seq_axis=2)
    return dataclasses.replace(call, dout_shards=call.shard(dout), dlse_shards=dlse_shards)


def _finish(call: _Call, results):
    """Check every rank's status (raises RingAttentionTimeout), gather, undo the layout permutation."""
    call.check([r[2] for r in results])
    out = call.gather([r[0] for r in results])
    if not call.return_lse:
        return out
    return out, call.gather([r[1] for r in results], seq_axis=2).astype(np.float32, copy=False)


def _finish_grad(call: _Call, results):
    """Check every rank's forward and backward status, gather (dq, dk, dv), undo the layout permutation."""
    for which in (3, 4):
        call.check([r[which] for r in results])
    return tuple(call.gather([r[i] for r in results]) for i in range(3))


# ------------------------------------------------------------------------------------ execution
def _local_job(world_size: int, workspace_bytes: int | None):
    """A SimulatedJob in this process (the interpreter must be usable here, and gets its fixes)."""
    from ring_core.sim import interpret

    interpret.ensure_interpreter()
    return interpret.SimulatedJob(world_size, workspace_bytes=workspace_bytes)


def _worker_main(conn, world_size, workspace_bytes):
    """Body of the subprocess fallback: one SimulatedJob whose heaps live as long as the process."""
    os.environ["TRITON_INTERPRET"] = "1"
    job = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "close":
            return
        try:
            if job is None:
                job = _local_job(world_size, workspace_bytes)
            if msg[0] == "bwd":
                _, spec, args, kw = msg
                reply = ("ok", job.run_bwd(spec, *args, **kw))
            elif msg[0] == "grad":
                _, spec, qs, ks, vs, dos, dls, timeout_s, rings, segs = msg
                reply = ("ok", job.run_grad(spec, qs, ks, vs, dos, timeout_s=timeout_s, dlse_shards=dls, rings=rings,
                                            seg_shards=segs))
            else:
                _, spec, qs, ks, vs, timeout_s, rings, segs = msg
                reply = ("ok", job.run(spec, qs, ks, vs, timeout_s=timeout_s, rings=rings, seg_shards=segs))
        except BaseException as e:  # sent back and re-raised in the parent
            reply = ("err", e)
        try:
            conn.send(reply)
        except Exception as e:  # an exception that does not pickle
            conn.send(("err", RuntimeError(f"simulated ring attention failed in the subprocess: {reply[1]!r} "
                                           f"(and could not be sent back: {e!r})")))


def _shutdown_worker(proc, conn):
    try:
        conn.send(("close",))
    except Exception:
        pass
    proc.join(timeout=10)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    conn.close()


class _SubprocessJob:
    """The SimulatedJob interface (``run``), served by a fresh ``spawn`` process running the interpreter."""

    def __init__(self, world_size: int, workspace_bytes: int | None):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(child, world_size, workspace_bytes), daemon=True,
                                 name=f"simulated-ring-w{world_size}")
        # The child reads TRITON_INTERPRET from the environment it starts with, before anything it imports.
        with control.environ(TRITON_INTERPRET="1"):
            self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _shutdown_worker, self._proc, self._conn)

    def run(self, spec, q_shards, k_shards, v_shards, *, timeout_s, rings=None, seg_shards=None):
        return self._request(("run", spec, q_shards, k_shards, v_shards, timeout_s, rings, seg_shards), timeout_s)

    def run_grad(self, spec, q_shards, k_shards, v_shards, dout_shards, *, timeout_s, dlse_shards=None, rings=None,
                 seg_shards=None):
        return self._request(("grad", spec, q_shards, k_shards, v_shards, dout_shards, dlse_shards, timeout_s,
                              rings, seg_shards), 2 * timeout_s)

    def run_bwd(self, spec, *shards, timeout_s, **kw):
        return self._request(("bwd", spec, shards, dict(kw, timeout_s=timeout_s)), timeout_s)

    def _request(self, msg, timeout_s):
        self._conn.send(msg)
        guard = 10 * timeout_s + 600  # the kernel's waits are bounded; this only catches a dead child
        while not self._conn.poll(1.0):
            guard -= 1.0
            if not self._proc.is_alive() or guard < 0:
                self.close()
                raise RuntimeError("the simulated ring-attention subprocess died or stopped answering "
                                   f"(exit code {self._proc.exitcode})")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError("the simulated ring-attention subprocess died "
                               f"(exit code {self._proc.exitcode})") from None
        if kind == "err":
            raise payload
        return payload

    def close(self):
        self._finalizer()


class SimulatedRing:
    """``world_size`` simulated ranks running the fused kernel, whose heaps persist across calls.

    Call it like ``simulate_ring_attention`` (without ``world_size``)::

        ring = SimulatedRing(4)
        out = ring(q, k, v, is_causal=True)
        out, lse = ring(q2, k2, v2, layout="zigzag", return_lse=True)   # same heaps, next epoch
        ring.epoch                                                       # -> 2

    ``workspace_bytes`` fixes the per-rank workspace (default: grown to fit each call, which allocates
    fresh heaps and so restarts the epoch count); a call that needs more raises
    ``ring_core.protocol.control.HeapTooSmallError`` before anything runs. ``statuses`` holds every rank's status
    words (error code, peer rank, ring step, epoch) of the last call, ``epoch`` that call's epoch (the
    number of calls the current heaps have completed). In a process that already compiled the kernel for
    a GPU the ranks run in a spawned subprocess (``uses_subprocess``); ``close()`` stops it (also done
    when the object is garbage-collected).
    """

    def __init__(self, world_size: int, *, workspace_bytes: int | None = None, data_parallel: int = 1):
        self.world_size = _check_world_size(world_size)
        self.data_parallel = _check_world_size(data_parallel, "data_parallel")
        self.workspace_bytes = workspace_bytes
        self.statuses = None
        self._job = None
        self._lock = threading.Lock()

    @property
    def uses_subprocess(self) -> bool | None:
        """True/False once the first call chose where to run; None before."""
        return None if self._job is None else isinstance(self._job, _SubprocessJob)

    @property
    def epoch(self) -> int | None:
        return None if self.statuses is None else int(self.statuses[0][3])

    def _get_job(self):
        if self._job is None:
            from ring_core.sim import interpret

            ranks = self.world_size * self.data_parallel
            if interpret.interpreter_usable():
                self._job = _local_job(ranks, self.workspace_bytes)
            else:
                self._job = _SubprocessJob(ranks, self.workspace_bytes)
        return self._job

    def __call__(self, q, k, v, *, is_causal=False, scale=None, layout="contiguous", return_lse=False,
                 timeout_s=60.0, segment_ids=None, window_size=None):
        call = _prepare(q, k, v, self.world_size, is_causal=is_causal, scale=scale, layout=layout,
                        return_lse=return_lse, timeout_s=timeout_s, data_parallel=self.data_parallel,
                        segment_ids=segment_ids, window_size=window_size)
        return self._complete(call, _finish, 2, lambda job: job.run(
            call.spec, call.q_shards, call.k_shards, call.v_shards, timeout_s=call.timeout_s, rings=call.rings,
            seg_shards=call.seg_shards))

    def _complete(self, call, finish, status_index: int, run):
        """Run ``run(job)`` under the lock, keep every rank's last status (``status_index`` in a rank's
        results), then ``finish`` (which raises first if a rank reported an error) and check the epochs."""
        with self._lock:
            results = run(self._get_job())
            self.statuses = [np.array(r[status_index]) for r in results]
        result = finish(call, results)
        epochs = {int(s[3]) for s in self.statuses}
        if len(epochs) != 1:
            raise RuntimeError(f"simulated ranks disagree on the call epoch: {sorted(epochs)}")
        return result

    def grad(self, q, k, v, dout, *, is_causal=False, scale=None, layout="contiguous", timeout_s=60.0, dlse=None,
             segment_ids=None, window_size=None):
        """Like ``simulate_ring_attention_grad`` on these heaps: the forward and then the backward kernel
        (two calls: ``epoch`` grows by 2). Returns global ``(dq, dk, dv)``."""
        call = _prepare_grad(q, k, v, dout, self.world_size, is_causal=is_causal, scale=scale, layout=layout,
                             timeout_s=timeout_s, dlse=dlse, data_parallel=self.data_parallel,
                             segment_ids=segment_ids, window_size=window_size)
        return self._complete(call, _finish_grad, 4, lambda job: job.run_grad(
            call.spec, call.q_shards, call.k_shards, call.v_shards, call.dout_shards, timeout_s=call.timeout_s,
            dlse_shards=call.dlse_shards, rings=call.rings, seg_shards=call.seg_shards))

    def close(self):
        if isinstance(self._job, _SubprocessJob):
            self._job.close()
        self._job = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def simulate_job(world_size: int, *, workspace_bytes: int | None = None) -> SimulatedRing:
    """A ``SimulatedRing`` of ``world_size`` ranks: several calls on the same simulated heaps."""
    return SimulatedRing(world_size, workspace_bytes=workspace_bytes)


def simulate_ring_attention(q, k, v, world_size, *, is_causal=False, scale=None, layout="contiguous",
                            return_lse=False, timeout_s=60.0, data_parallel=1, segment_ids=None, window_size=None,
                            node_size=None):
    """Ring attention over ``world_size`` simulated ranks, computed by the real fused kernel on the CPU.

    Args:
      q: global queries [batch, seq, num_heads, head_dim] in natural token order (numpy, a jax array or
        anything ``np.asarray`` accepts), float16, bfloat16 (``ml_dtypes.bfloat16``) or float32.
      k, v: global keys / values [batch, seq, num_kv_heads, head_dim], same dtype; ``num_heads`` a
        multiple of ``num_kv_heads`` (GQA / MQA).
      world_size: number of simulated ranks; ``seq`` must be divisible by it (by ``2*world_size`` for
        ``layout="zigzag"``).
      is_causal, scale, layout, return_lse: as in ``jax_ring.ring_attention`` (causal in global order).
      timeout_s: bound in seconds on every wait inside the kernel (None: RING_ATTENTION_TIMEOUT_S, else
        300); a rank that never arrives raises ``ring_core.protocol.control.RingAttentionTimeout``.
      data_parallel: run that many rings of ``world_size`` ranks at once on one job's heaps (a
        ``data_parallel x world_size`` mesh: ring d takes the d-th of ``data_parallel`` equal batch slices).
      segment_ids: packed sequences: global int32 [batch, seq] in natural order (sharded like q); query i
        attends key j only where both carry the same id; a negative id is padding (out 0, lse -inf).
        ``ring_core.masks.segment_ids_from_cu_seqlens`` makes them from flash-attn's ``cu_seqlens``.
      window_size: ``(left, right)``, flash-attn's sliding window in global token order (-1: unbounded side);
        None: no window. The rule is ``ring_core.masks.allowed``'s.
      node_size: ranks per simulated node (a divisor of ``world_size``; None: one node). With several nodes the
        two-level ring of ``ring_core.nodes`` runs: the fused kernels over each node's ranks (a heap per node), the
        K/V (and their segment ids) between nodes as the frontends send them; a window as a node-step's pieces
        (``ring_core.nodes.window_pieces``).

    Returns:
      ``out`` (numpy, q's dtype, [batch, seq, num_heads, head_dim], natural order), or ``(out, lse)`` with
      ``lse`` float32 [batch, num_heads, seq] with ``return_lse=True``.

    Example (a few seconds on a CPU)::

        >>> import numpy as np
        >>> from ring_core.sim.simulate import simulate_ring_attention
        >>> from ring_core.reference import attention
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
        >>> k, v = (rng.standard_normal((1, 8, 1, 16)).astype(np.float32) for _ in range(2))
        >>> out, lse = simulate_ring_attention(q, k, v, 2, is_causal=True, layout="zigzag", return_lse=True)
        >>> ref_out, ref_lse = attention(q, k, v, is_causal=True)
        >>> bool(np.allclose(out, ref_out, atol=1e-5) and np.allclose(lse, ref_lse, atol=1e-5))
        True
    """
    if node_size is not None and _check_node_size(node_size, _check_world_size(world_size)) < world_size:
        call = _prepare(q, k, v, world_size, is_causal=is_causal, scale=scale, layout=layout, return_lse=return_lse,
                        timeout_s=timeout_s, data_parallel=data_parallel, segment_ids=segment_ids,
                        window_size=window_size)
        return _simulate_nodes(call, node_size, grad=False)
    ring = SimulatedRing(world_size, data_parallel=data_parallel)
    try:
        return ring(q, k, v, is_causal=is_causal, scale=scale, layout=layout, return_lse=return_lse,
                    timeout_s=timeout_s, segment_ids=segment_ids, window_size=window_size)
    finally:
        ring.close()


def simulate_ring_attention_grad(q, k, v, dout, world_size, *, is_causal=False, scale=None, layout="contiguous",
                                 timeout_s=60.0, dlse=None, data_parallel=1, segment_ids=None, window_size=None,
                                 node_size=None):
    """Gradients of ring attention over ``world_size`` simulated ranks, computed by the real fused
    backward kernel (``ring_core.kernels.tl_bwd``) on the CPU, after the real forward kernel.

    Args:
      q, k, v: global arrays as in ``simulate_ring_attention`` (natural token order; float16, bfloat16 or
        float32).
      dout: the gradient of the output, q's shape and dtype.
      world_size, is_causal, scale, layout, timeout_s, data_parallel, segment_ids, window_size, node_size: as in
        ``simulate_ring_attention`` (with several nodes: the backward of the two-level ring, its dK/dV partials
        travelling between nodes).
      dlse: optional gradient of the lse output ([batch, heads, seq], natural order); None: lse carries none.
        Ignored on padding rows (their lse is the constant -inf), even where it is not finite.

    Returns:
      ``(dq, dk, dv)``: numpy, the inputs' dtype and shapes, natural order; the gradients of
      ``sum(out * dout) + sum(lse * dlse)`` with ``out, lse = ring_attention(q, k, v, return_lse=True)``
      (dk/dv summed over the query heads sharing a kv head).

    Example (a few seconds on a CPU)::

        >>> import numpy as np
        >>> from ring_core.sim.simulate import simulate_ring_attention_grad
        >>> from ring_core.reference import attention_grad
        >>> rng = np.random.default_rng(0)
        >>> q, dout = (rng.standard_normal((1, 8, 2, 16)).astype(np.float32) for _ in range(2))
        >>> k, v = (rng.standard_normal((1, 8, 1, 16)).astype(np.float32) for _ in range(2))
        >>> grads = simulate_ring_attention_grad(q, k, v, dout, 2, is_causal=True, layout="zigzag")
        >>> ref = attention_grad(q, k, v, dout, is_causal=True)
        >>> all(np.allclose(g, r, atol=1e-5) for g, r in zip(grads, ref))
        True
    """
    if node_size is not None and _check_node_size(node_size, _check_world_size(world_size)) < world_size:
        call = _prepare_grad(q, k, v, dout, world_size, is_causal=is_causal, scale=scale, layout=layout,
                             timeout_s=timeout_s, dlse=dlse, data_parallel=data_parallel, segment_ids=segment_ids,
                             window_size=window_size)
        return _simulate_nodes(call, node_size, grad=True)
    ring = SimulatedRing(world_size, data_parallel=data_parallel)
    try:
        return ring.grad(q, k, v, dout, is_causal=is_causal, scale=scale, layout=layout, timeout_s=timeout_s,
                         dlse=dlse, segment_ids=segment_ids, window_size=window_size)
    finally:
        ring.close()


# ------------------------------------------------------------------------------- several nodes
# ``node_size=R`` in simulate_ring_attention(_grad): the two-level ring of ring_core.nodes over W / R simulated nodes.
# Each simulated rank runs the product's driver (ring_core.nodes.forward / backward) on a thread of its own; a node's
# one-node calls run the real fused kernels over the node's R ranks (one SimulatedJob per node: a heap per node, as
# on GPUs, where iris maps memory only within a host), and the transfer between nodes is what the frontends post:
# rank g sends to rank g + R and receives from rank g - R, each transfer matched by its order on both ranks.
class _Inboxes:
    """The transfers between nodes: ``send`` from a rank posts its arrays for the same rank of the next node and
    returns the transfer's number; ``recv`` waits (bounded) for the previous node's transfer of that number."""

    def __init__(self, world_size: int, node_size: int, timeout_s: float):
        self.W, self.R, self.timeout_s = world_size, node_size, timeout_s
        self.cv = threading.Condition()
        self.boxes = [{} for _ in range(world_size)]  # receiver -> {number: arrays}
        self.sent = [0] * world_size
        self.failed = None

    def send(self, rank: int, xs) -> int:
        with self.cv:
            n = self.sent[rank]
            self.sent[rank] += 1
            self.boxes[(rank + self.R) % self.W][n] = [np.array(x, copy=True) for x in xs]
            self.cv.notify_all()
            return n

    def recv(self, rank: int, n: int):
        with self.cv:
            if not self.cv.wait_for(lambda: n in self.boxes[rank] or self.failed is not None, self.timeout_s):
                raise control.RingAttentionTimeout(
                    f"rank {rank} waited {self.timeout_s} s for transfer {n} from rank {(rank - self.R) % self.W} "
                    "(the previous node)")
            if self.failed is not None:
                raise RuntimeError(f"simulated rank {self.failed} failed")
            return self.boxes[rank].pop(n)

    def fail(self, rank: int):
        with self.cv:
            self.failed = rank if self.failed is None else self.failed
            self.cv.notify_all()


class _NodeCalls:
    """A node's one-node calls: the node's R ranks each hand in their arguments, the last to arrive runs the call
    for all of them (``execute(kind, [per-rank arguments]) -> [per-rank results]``), each takes its own result."""

    def __init__(self, node_size: int, execute, timeout_s: float, inboxes: _Inboxes):
        self.R, self.execute, self.timeout_s, self.inboxes = node_size, execute, timeout_s, inboxes
        self.cv = threading.Condition()
        self.args = {}
        self.done = {}  # call number -> results (or the exception)
        self.number = 0

    def call(self, local: int, kind: str, args):
        with self.cv:
            n = self.number
            self.args[local] = args
            if len(self.args) == self.R:
                todo, self.args = [self.args[i] for i in range(self.R)], {}
                try:
                    self.done[n] = self.execute(kind, todo)
                except BaseException as e:  # every rank of the node raises it
                    self.done[n] = e
                self.number += 1
                self.cv.notify_all()
            elif not self.cv.wait_for(lambda: n in self.done or self.inboxes.failed is not None, self.timeout_s):
                raise control.RingAttentionTimeout(f"node rank {local} waited {self.timeout_s} s for its node's "
                                                   "other ranks to make a call")
            if n not in self.done:
                raise RuntimeError(f"simulated rank {self.inboxes.failed} failed")
            res = self.done[n]
            if isinstance(res, BaseException):
                raise res
            return res[local]


def _numpy_ops(rank: int, node_size: int, calls: _NodeCalls, inboxes: _Inboxes):
    """ring_core.nodes.Ops for one simulated rank: numpy arrays, its node's calls, the inboxes."""
    from ring_core import nodes

    def f32(x):
        return x if x.dtype == np.float64 else x.astype(np.float32)

    local = rank % node_size
    return nodes.Ops(
        xp=np, permute=np.transpose, cat=np.concatenate, flip=np.flip, astype=lambda x, like: x.astype(like.dtype),
        f32=f32, inner_fwd=lambda q, k, v, mask, ids: calls.call(local, "fwd", (q, k, v, mask, ids)),
        inner_bwd=lambda *a: calls.call(local, "bwd", a),
        send=lambda xs: inboxes.send(rank, xs), recv=lambda n: inboxes.recv(rank, n))


def run_nodes(world_size: int, node_size: int, rank_fn, execute, timeout_s: float) -> list:
    """Run ``rank_fn(rank, ops)`` on one thread per simulated rank of W / R nodes and return the per-rank results;
    ``execute(node, kind, args)`` runs node ``node``'s one-node call ``kind`` ("fwd": (q, k, v, mask, ids); "bwd":
    (q, k, v, out, lse, dout, dlse, mask, ids): ring_core.nodes.Ops) for its R ranks. A failing rank fails the
    job."""
    W, R = world_size, node_size
    inboxes = _Inboxes(W, R, timeout_s)
    calls = [_NodeCalls(R, functools.partial(execute, n), timeout_s, inboxes) for n in range(W // R)]
    results, errors = [None] * W, [None] * W

    def one(rank):
        try:
            results[rank] = rank_fn(rank, _numpy_ops(rank, R, calls[rank // R], inboxes))
        except BaseException as e:
            errors[rank] = e
            inboxes.fail(rank)

    from ring_core.sim.interpret import run_on_threads

    run_on_threads(one, range(W), timeout_s, "two-level ring")
    failed = [e for e in errors if e is not None]
    if failed:  # the cause, not a rank that stopped because of it
        raise next((e for e in failed if not str(e).startswith("simulated rank")), failed[0])
    return results


class _KernelNodes:
    """``execute`` for ``run_nodes``: the real fused kernels, one SimulatedJob of R ranks per node (calls of all
    nodes one at a time: the interpreter patches triton.language for a whole job)."""

    def __init__(self, spec, num_nodes: int, node_size: int, timeout_s: float):
        self.spec, self.R, self.timeout_s = spec, node_size, timeout_s
        self.jobs = [SimulatedRing(node_size) for _ in range(num_nodes)]
        self.lock = threading.Lock()

    def __call__(self, node: int, kind: str, args):
        from ring_core import nodes

        spec = nodes.inner_spec(self.spec, args[0][0], args[0][1], *args[0][-2:])
        col = lambda i: [np.ascontiguousarray(a[i]) for a in args]  # noqa: E731
        segs = [nodes.kernel_ids(a[-1], np.stack) for a in args]
        members = list(range(node * self.R, (node + 1) * self.R))
        with self.lock:
            job = self.jobs[node]._get_job()
            if kind == "fwd":
                res = job.run(spec, col(0), col(1), col(2), timeout_s=self.timeout_s, seg_shards=segs)
            else:
                res = job.run_bwd(spec, col(0), col(1), col(2), col(3), col(4), col(5), timeout_s=self.timeout_s,
                                  dlse_shards=[np.asarray(a[6], np.float32) for a in args], seg_shards=segs)
        for pos, r in enumerate(res):
            control.check_status(r[-1], pos, self.timeout_s, members=members)
        return [r[:-1] for r in res]

    def close(self):
        for j in self.jobs:
            j.close()


def _check_node_size(node_size, world_size: int) -> int:
    node_size = _check_world_size(node_size, "node_size")
    if world_size % node_size:
        raise ValueError(f"node_size ({node_size}) must divide world_size ({world_size}): every node holds "
                         "node_size ranks")
    return node_size


def _simulate_nodes(call: _Call, node_size: int, *, grad: bool):
    """The two-level ring over ``call``'s shards (natural-order result, as ``_finish`` / ``_finish_grad``)."""
    from ring_core import nodes

    spec, W, R = call.spec, call.world_size, node_size
    if call.data_parallel != 1:
        raise ValueError("node_size and data_parallel cannot be combined in one simulation")
    nodes.check_supported(spec, W // R, R)
    kernels = _KernelNodes(spec, W // R, R, call.timeout_s)
    kw = dict(num_nodes=W // R, is_causal=spec.is_causal, layout=spec.layout, window=spec.window, node_size=R)

    def rank_fn(rank, ops):
        q, k, v = call.q_shards[rank], call.k_shards[rank], call.v_shards[rank]
        ids = None if call.seg_shards is None else np.asarray(call.seg_shards[rank], np.int32)
        out, lse = nodes.forward(ops, q, k, v, node=rank // R, ids=ids, **kw)
        if not grad:
            return out, lse
        dlse = (np.zeros_like(lse) if call.dlse_shards is None else call.dlse_shards[rank])
        dlse = np.where(np.isneginf(lse), 0.0, dlse).astype(np.float32)
        return nodes.backward(ops, q, k, v, out, lse, call.dout_shards[rank], dlse, node=rank // R, ids=ids, **kw)

    try:
        results = run_nodes(W, R, rank_fn, kernels, call.timeout_s)
    finally:
        kernels.close()
    if grad:
        return tuple(call.gather([r[i] for r in results]) for i in range(3))
    out = call.gather([r[0] for r in results])
    if not call.return_lse:
        return out
    return out, call.gather([np.asarray(r[1], np.float32) for r in results], seq_axis=2)
