"""GPU fault checks, one process per GPU. Run by tests/gpu/test_gpu.py (``pytest -m gpu``), or:

    python -m jax_ring.launch --nproc-per-node 2 tests/gpu/gpu_faults.py --out /tmp/gpu_faults
    python -m jax_ring.launch --nproc-per-node 2 tests/gpu/gpu_faults.py --sections kill --out /tmp/gpu_faults

Sections (default ``timeout,concurrent,bad_inputs,security``; ``kill`` must run alone: it ends rank 1):
  timeout     rank 1 skips a fused call (torch_bridge, then jax_ring with RING_ATTENTION_ERRORS=call, then
              jax_ring's default deferred check): rank 0 raises RingAttentionTimeout within the per-call
              ``timeout_s``, naming rank 1 and the ring step (deferred: the failed call returns with NaN rows,
              the next fused call raises it, check_errors() raises it as its type); then ``reset()`` on every
              rank, and the next calls through both frontends are right;
  concurrent  the fused kernel runs while an NCCL all-reduce runs on another torch stream, launched in
              the same order on every rank (fused first; all-reduce first) and in opposite orders once the
              kernel is loaded: everything completes and is right; opposite orders on a kernel variant's
              first call: completes, or (CUDA lazy loading, see section_concurrent) every waiting rank raises
              RingAttentionTimeout and reset() brings them back; and a jitted JAX program holds a psum next
              to a fused call: completes and is right;
  mismatch    rank 1's call differs (torch: seq_local; JAX: is_causal, in both error modes): every rank
              raises RingAttentionMismatch naming the field (JAX deferred: at its next right call, and from
              check_errors()); the next right calls need no reset();
  bad_inputs  the bad-input table's torch rows (tests/bad_input_cases.py) through backend="fused" with CUDA
              tensors, each followed by a right fused call; CPU tensors to the fused backend; strided CUDA
              inputs; NaN through the fused kernel (propagates, the other rows unchanged, no hang);
  security    every memory-handle connection iris kept leads to a process of this job (peer pid and uid),
              and iris's socket functions are restored after the heap set-up;
  kill        rank 1 exits right after launching a fused call: rank 0 raises RingAttentionTimeout naming
              rank 1 within ``timeout_s``, shuts down cleanly and exits 0 (torch only: jax.distributed
              would wait for the dead process at exit).

Everything is bounded: waits poll with deadlines, every fused call has ``timeout_s``, and a watchdog ends a
process that overruns ``--deadline`` (exit code 124, stacks printed). Each rank prints ``FAULT-CHECK <name>
ok|FAILED <detail>``; rank 0 writes ``gpu_faults_<sections>.json`` under ``--out``; the exit code is 0 only
if every check passed on every rank.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time

import numpy as np

SECTIONS = ("timeout", "concurrent", "mismatch", "bad_inputs", "security", "kill")
DEFAULT_SECTIONS = "timeout,concurrent,mismatch,bad_inputs,security"


# ------------------------------------------------------------------------------ helpers (no GPU needed)
class Report:
    """Checks of one rank: ``check(name)`` is a context manager recording ok / FAILED with the exception."""

    def __init__(self, rank: int, stream=None):
        self.rank = rank
        self.stream = stream or sys.stdout
        self.results = {}  # name -> dict(ok, detail, seconds)

    def record(self, name: str, ok: bool, detail: str = "", seconds: float = 0.0):
        self.results[name] = dict(ok=bool(ok), detail=detail, seconds=round(seconds, 2))
        self.stream.write(f"FAULT-CHECK rank {self.rank} {name} {'ok' if ok else 'FAILED'} "
                          f"({seconds:.1f} s) {detail}\n")
        self.stream.flush()

    def skip(self, name: str, reason: str):
        """A check that cannot run in this set-up: recorded (and printed) as skipped with its reason."""
        self.results[name] = dict(ok=True, skipped=reason, detail="", seconds=0.0)
        self.stream.write(f"FAULT-CHECK rank {self.rank} {name} SKIPPED: {reason}\n")
        self.stream.flush()

    def check(self, name: str):
        report = self

        class _Check:
            detail = ""

            def __enter__(self):
                self.t0 = time.monotonic()
                return self

            def __exit__(self, exc_type, exc, tb):
                seconds = time.monotonic() - self.t0
                if exc is None:
                    report.record(name, True, self.detail, seconds)
                else:
                    report.record(name, False, f"{exc_type.__name__}: {exc}", seconds)
                return exc is None or issubclass(exc_type, Exception)  # record and go on; never swallow exits

        return _Check()

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.results.values())


def expect_timeout_message(err: BaseException, *, rank: int, peer: int, timeout_s: float) -> str:
    """Check that ``err`` is the fused kernel's timeout, raised on ``rank`` and naming ``peer`` (and the ring
    step or the end barrier) and the limit; returns the message."""
    from ring_core.protocol.control import RingAttentionTimeout

    msg = str(err)
    if not isinstance(err, RingAttentionTimeout) and "RingAttentionTimeout" not in msg:
        raise AssertionError(f"expected RingAttentionTimeout, got {type(err).__name__}: {msg[:500]}")
    wanted = [f"on rank {rank}", f"gave up after {timeout_s:g} s", f"rank {peer}"]
    missing = [w for w in wanted if w not in msg]
    if not ("ring step" in msg or "end-of-call barrier" in msg):
        missing.append("the ring step (or the end-of-call barrier)")
    if missing:
        raise AssertionError(f"the timeout message lacks {missing}: {msg[:500]}")
    return msg


def _raises_in_time(call, a, why: str, describe) -> str:
    """Run ``call``, which must raise within ``a.timeout`` + ``a.slack`` seconds; ``describe(exception)`` checks
    what it raised (AssertionError otherwise) and returns its summary. Returns the check's detail."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - ``describe`` checks it
        elapsed = time.monotonic() - t0
        summary = describe(e)
        if elapsed > a.timeout + a.slack:
            raise AssertionError(f"raised after {elapsed:.1f} s, limit {a.timeout} s + {a.slack} s") from None
        return f"after {elapsed:.1f} s: {summary}"
    raise AssertionError(f"the call returned although {why}")


def expect_timeout(call, a, why: str) -> str:
    """Run ``call`` on rank 0, which must raise RingAttentionTimeout naming rank 1 within ``a.timeout`` +
    ``a.slack`` seconds; returns the check's detail (time and the message's first sentence)."""
    return _raises_in_time(call, a, why, lambda e: expect_timeout_message(e, rank=0, peer=1,
                                                                          timeout_s=a.timeout).split(". ")[0])


SHARED_GPU_KILL_REASON = ("ranks share a GPU under MPS: a rank that exits with its kernel in flight faults every "
                          "rank of that GPU (their CUDA contexts are lost: the job must restart; README, limits)")


def expect_error(call, a, why: str) -> str:
    """Run ``call``, which must raise RingAttentionTimeout or the CUDA error of a GPU that a dead peer's kernel
    faulted, within ``a.timeout`` + ``a.slack`` seconds; returns the check's detail."""
    from ring_core.protocol.control import RingAttentionTimeout

    def describe(e):
        if not (isinstance(e, RingAttentionTimeout) or "CUDA error" in str(e)):
            raise AssertionError(f"expected RingAttentionTimeout or a CUDA error, got {type(e).__name__}: "
                                 f"{str(e)[:500]}") from None
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"

    return _raises_in_time(call, a, why, describe)


def wait_until(done, deadline_s: float, what: str, poll_s: float = 0.01):
    """Poll ``done()`` until it is true; raise TimeoutError naming ``what`` after ``deadline_s`` seconds."""
    end = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} did not complete within {deadline_s:g} s (deadlock?)")
        time.sleep(poll_s)


def start_watchdog(deadline_s: float, rank: int):
    """End this process with code 124 (all stacks printed) if it runs longer than ``deadline_s``. A Python
    timer says why; faulthandler's C thread backs it up where the GIL is held by a stuck call."""

    def fire():
        sys.stderr.write(f"gpu_faults: WATCHDOG: rank {rank} still running after {deadline_s:g} s; stacks:\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(124)

    timer = threading.Timer(deadline_s, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(deadline_s + 30, exit=True)
    return timer


# ---------------------------------------------------------------------------------------- GPU checks
class Job:
    """What every section needs: this rank, the frontends, inputs and references."""

    def __init__(self, args, with_jax: bool):
        import torch
        import torch.distributed as dist

        import torch_bridge

        self.args = args
        self.with_jax = with_jax
        if with_jax:
            import jax_ring

            jax_ring.initialize(heap_size=int(args.heap_gib * (1 << 30)))  # before JAX touches the GPU
            self.jax_ring = jax_ring
        torch_bridge.initialize(heap_size=int(args.heap_gib * (1 << 30)))
        self.torch, self.dist, self.tb = torch, dist, torch_bridge
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dev = torch.device("cuda", torch.cuda.current_device())
        from ring_core.runtime import gpus

        # Ranks sharing a GPU (ring_core.runtime.gpus): the job's process group is gloo, NCCL cannot run between them.
        self.shared = gpus.placement_from_env(torch.cuda.device_count()).shared
        self.report = Report(self.rank)
        self._jax_fns = {}
        self._refs = {}  # (id of q, dtype, causal) -> (inputs kept alive, float64 and low-precision references)

    # ---- inputs, references
    def inputs(self, seed, B, S, H, HKV, D, dtype, layout):
        """Global float64 inputs, this rank's shard indices (layout order) and the reference on them."""
        from ring_core import layout as L
        from ring_core import testing

        q, k, v = testing.random_inputs(seed, B, S * self.world, H, HKV, D, dtype)
        idx = L.layout_permutation(S * self.world, self.world, layout)[self.rank * S:(self.rank + 1) * S]
        return (q, k, v), idx

    def check_out(self, name, out, xs, idx, dtype, is_causal, lse=None):
        from ring_core import reference, testing

        key = (id(xs[0]), dtype, is_causal)
        if key not in self._refs:  # the same inputs are checked again and again: references once
            q, k, v = xs
            self._refs[key] = (xs, reference.attention(q, k, v, is_causal=is_causal),
                               reference.attention_lowp(q, k, v, dtype, is_causal=is_causal))
        _, (o64, l64), (olp, llp) = self._refs[key]
        err = testing.check(name, np.asarray(out, np.float64), o64[:, idx], olp[:, idx], dtype, "out")
        if lse is not None:
            testing.check(name + " lse", np.asarray(lse, np.float64), l64[:, :, idx], llp[:, :, idx], dtype, "lse")
        return err

    def cuda(self, x, dtype):
        return self.torch.as_tensor(np.ascontiguousarray(x), device=self.dev).to(getattr(self.torch, dtype))

    # ---- calls
    def torch_fused(self, xs, idx, dtype, *, is_causal, layout, timeout_s=None, check=True):
        out, lse = self.tb.ring_attention(*(self.cuda(x[:, idx], dtype) for x in xs), is_causal=is_causal,
                                          layout=layout, return_lse=True, backend="fused", timeout_s=timeout_s)
        if check:
            self.tb.check_errors()
        return out, lse

    def torch_grads(self, xs, dout, idx, dtype, *, is_causal, layout, timeout_s=None):
        """(dq, dk, dv) of this rank's shards through torch autograd on backend='fused', as float32 numpy."""
        ts = [self.cuda(x[:, idx], dtype).requires_grad_() for x in xs]
        out = self.tb.ring_attention(*ts, is_causal=is_causal, layout=layout, backend="fused", timeout_s=timeout_s)
        out.backward(self.cuda(dout[:, idx], dtype))
        self.tb.check_errors()
        return [t.grad.float().cpu().numpy() for t in ts]

    def jax_grads(self, xs, dout, idx, dtype, *, is_causal, layout, timeout_s=None):
        """(dq, dk, dv) of this rank's shards through jax.grad of a loss whose d/d out is ``dout``."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        import jax_ring

        mesh, sh, glob = self._jax_mesh(idx, dtype)
        key = ("grad", xs[0].shape, xs[1].shape, dtype, is_causal, layout, timeout_s)
        if key not in self._jax_fns:
            def loss(q, k, v, do):
                o = jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", is_causal=is_causal,
                                            layout=layout, timeout_s=timeout_s)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

            self._jax_fns[key] = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                                                       in_specs=(P(None, "sp"),) * 4,
                                                       out_specs=(P(None, "sp"),) * 3))
        grads = self._jax_fns[key](*(glob(x) for x in (*xs, dout)))
        jax.effects_barrier()
        return [np.asarray(g.addressable_shards[0].data.astype(jnp.float32)) for g in grads]

    def _jax_mesh(self, idx, dtype):
        """(mesh over every process's device, this rank's sequence sharding, natural-order global numpy
        array -> the global jax array whose local shard is this rank's rows ``idx``)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("sp",))
        sh = NamedSharding(mesh, P(None, "sp"))

        def glob(x):
            local = x[:, idx]
            return jax.make_array_from_process_local_data(sh, jnp.asarray(local, dtype=getattr(jnp, dtype)),
                                                          (local.shape[0], local.shape[1] * self.world,
                                                           *local.shape[2:]))

        return mesh, sh, glob

    def jax_fused(self, xs, idx, dtype, *, is_causal, layout, timeout_s=None, errors=None):
        """One jitted shard_map over all processes; returns this rank's (out, lse) as numpy (blocks). ``errors``:
        RING_ATTENTION_ERRORS when the call is traced (None: the default, "deferred": a failure is raised by a
        later fused call or jax_ring.check_errors(); "call": by the call itself)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        import jax_ring
        from ring_core.protocol.control import ERRORS_ENV

        mesh, sh, glob = self._jax_mesh(idx, dtype)
        key = (xs[0].shape, xs[1].shape, dtype, is_causal, layout, timeout_s, errors)
        if key not in self._jax_fns:
            def body(q, k, v):
                return jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", is_causal=is_causal,
                                               layout=layout, return_lse=True, timeout_s=timeout_s)

            self._jax_fns[key] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                                                       out_specs=(P(None, "sp"), P(None, None, "sp"))))
        before = os.environ.pop(ERRORS_ENV, None)
        if errors is not None:
            os.environ[ERRORS_ENV] = errors  # read when the call is traced, at its first run
        try:
            out, lse = self._jax_fns[key](*(glob(x) for x in xs))
            out.block_until_ready()
            jax.effects_barrier()  # nothing to raise: "call" fails the program's outputs (jax_ring.fused._check_of)
        finally:
            os.environ.pop(ERRORS_ENV, None)
            if before is not None:
                os.environ[ERRORS_ENV] = before
        return (np.asarray(out.addressable_shards[0].data.astype(jnp.float32)),
                np.asarray(lse.addressable_shards[0].data))

    def agree_any(self, flag: bool) -> bool:
        """Collective: True on every rank if ``flag`` is true on any rank."""
        t = self.torch.tensor([int(bool(flag))], device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self, what: str, deadline_s: float = 120.0):
        work = self.dist.barrier(async_op=True)
        wait_until(work.is_completed, deadline_s, f"the barrier after {what}")

    def gather_reports(self):
        merged = [None] * self.world
        self.dist.all_gather_object(merged, self.report.results)
        return merged


def section_timeout(job: Job):
    """Rank 1 skips one fused call (torch, then JAX with RING_ATTENTION_ERRORS=call, then JAX's default deferred
    check): rank 0 times out naming rank 1 and the ring step (deferred: the failed call returns, its rows NaN; the
    next fused call on rank 0 raises it, and check_errors() raises it as RingAttentionTimeout); then reset()
    everywhere and the next calls through both frontends are right."""
    import functools

    a, rank = job.args, job.rank
    dtype, causal, layout = "bfloat16", False, "contiguous"  # non-causal: rank 0 needs rank 1's K/V at step 1
    xs, idx = job.inputs(1, 1, 256, 4, 2, 64, dtype, layout)
    frontends = [("torch", job.torch_fused)]
    if job.with_jax:
        frontends += [("jax-call", functools.partial(job.jax_fused, errors="call")), ("jax", job.jax_fused)]
    for fw, call in frontends:
        job.barrier(f"{fw} warm-up")
        with job.report.check(f"timeout/{fw}: a call with every rank present is right") as c:
            out, _ = call(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout)
            c.detail = f"err {job.check_out(fw, _as_np(out), xs, idx, dtype, causal):.2e}"
        job.barrier(f"{fw} good call")
        if rank == 0:
            with job.report.check(f"timeout/{fw}: rank 1 absent -> RingAttentionTimeout on rank 0") as c:
                once = lambda: call(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout)  # noqa: E731
                c.detail = (_deferred_timeout(once, a) if fw == "jax" else
                            expect_timeout(once, a, "rank 1 never called"))
        job.barrier(f"{fw} timeout", deadline_s=2 * a.timeout + a.slack + 60)
        with job.report.check(f"timeout/{fw}: reset() on every rank, then right calls through both frontends"):
            (job.tb.reset if fw == "torch" else _jax_reset)()
            for fw2, call2 in frontends:
                out, lse = call2(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout)
                job.check_out(f"after reset {fw2}", _as_np(out), xs, idx, dtype, causal, lse=_as_np(lse))
        job.barrier(f"{fw} reset")


def _deferred_timeout(call, a) -> str:
    """JAX's default mode on rank 0 with rank 1 absent: ``call()`` returns (its rows NaN: it could not compute
    them); the next ``call()`` raises the first one's RingAttentionTimeout, said to be reported by a later call,
    within two timeouts (its own kernel waits too); then jax_ring.check_errors() raises it as its own type."""
    import jax_ring
    from jax_ring import status
    from ring_core.protocol.control import RingAttentionTimeout

    t0 = time.monotonic()
    out, _ = call()
    if not np.isnan(out).any():
        raise AssertionError("the failed call returned no NaN rows")
    first = time.monotonic() - t0
    try:
        call()
    except Exception as e:  # noqa: BLE001 - checked here
        msg = expect_timeout_message(e, rank=0, peer=1, timeout_s=a.timeout)
        if status.REPORTED[:60] not in msg:
            raise AssertionError(f"the next call's error does not say it reports an earlier call: {msg[:600]}") from None
        kind = type(e).__name__
    else:
        raise AssertionError("the next fused call did not raise the failed call's timeout")
    elapsed = time.monotonic() - t0
    if elapsed > 2 * a.timeout + a.slack:
        raise AssertionError(f"raised after {elapsed:.1f} s, limit 2 x {a.timeout} s + {a.slack} s")
    try:
        jax_ring.check_errors()
    except RingAttentionTimeout as e:
        expect_timeout_message(e, rank=0, peer=1, timeout_s=a.timeout)
    else:
        raise AssertionError("check_errors() did not raise the kept timeout")
    return (f"the failed call returned after {first:.1f} s (NaN rows); the next call raised it ({kind}) after "
            f"{elapsed:.1f} s; check_errors() raised RingAttentionTimeout")


def _as_np(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.float().cpu().numpy()
    return np.asarray(x, np.float32)


def _jax_reset():
    import jax_ring

    jax_ring.reset()


def _fused_and_all_reduce(job: Job, order: str, xs, idx, timeout_s: float, side):
    """Launch this rank's fused call and a 256 MiB NCCL all-reduce on the torch stream ``side``, in ``order``
    ("fused" or "all_reduce" first); wait (bounded) until both completed. Returns (out, the seconds the
    host spent launching the fused call, the fused call's error or None)."""
    torch, dist = job.torch, job.dist
    x = torch.full((64 << 20,), float(job.rank + 1), device=job.dev)
    torch.cuda.synchronize()  # x is ready: the all-reduce's stream need not wait for the default one
    done_fused = torch.cuda.Event()
    launched = {}

    def all_reduce():
        with torch.cuda.stream(side):  # NCCL's stream then waits for `side` only, not the kernel's
            return dist.all_reduce(x, async_op=True)

    def fused():
        t0 = time.monotonic()
        out = job.tb.ring_attention(*(job.cuda(t[:, idx], "bfloat16") for t in xs), is_causal=True,
                                    layout="zigzag", backend="fused", timeout_s=timeout_s)
        launched["s"] = time.monotonic() - t0
        done_fused.record()
        return out

    if order == "fused":
        out, work = fused(), all_reduce()
    else:
        work, out = all_reduce(), fused()
    wait_until(lambda: work.is_completed() and done_fused.query(), 2 * timeout_s + job.args.slack,
               "the fused kernel and the concurrent NCCL all-reduce")
    work.wait()
    expected = job.world * (job.world + 1) / 2
    if not bool((x == expected).all()):
        raise AssertionError(f"all-reduce result {x[:4].tolist()}, expected {expected}")
    try:
        job.tb.check_errors()
    except RuntimeError as e:
        return out, launched["s"], e
    return out, launched["s"], None


CONCURRENT_CHECKS = ("concurrent/torch: same order, fused first", "concurrent/torch: same order, all-reduce first",
                     "concurrent/torch: opposite orders, kernel loaded",
                     "concurrent/torch: opposite orders, first call of a kernel variant",
                     "concurrent/jax: psum and the fused call in one jitted program")
SHARED_GPU_REASON = ("ranks share a GPU: NCCL refuses two ranks on one GPU, so no NCCL collective (torch all-reduce, "
                     "JAX psum) can run beside the fused kernel here (tests/gpu/gpu_shared_limits.py records what "
                     "does)")


def section_concurrent(job: Job):
    """The fused kernel next to NCCL work on another torch stream, and next to a psum in one jitted JAX
    program. A fused call is a collective of its own, so the rule NCCL gives for two communicators applies
    (the same order on every rank): in the same order, both orders complete; in opposite orders they
    complete once the kernel is loaded. A first call of a kernel variant in opposite orders may deadlock
    for a while, through CUDA's lazy loading (see the README): then the bounded waits turn it into
    RingAttentionTimeout on the ranks, and reset() brings them back, which is what is checked then."""
    a = job.args
    if job.shared:
        for name in CONCURRENT_CHECKS[:None if job.with_jax else -1]:
            job.report.skip(name, SHARED_GPU_REASON)
        return
    xs, idx = job.inputs(2, 1, 2048, 16, 4, 128, "bfloat16", "zigzag")  # more programs than the GPU holds
    side = job.torch.cuda.Stream()
    opposite = {0: "fused", 1: "all_reduce"}
    for name, order in (("same order, fused first", "fused"), ("same order, all-reduce first", "all_reduce"),
                        ("opposite orders, kernel loaded", opposite.get(job.rank, "fused"))):
        job.barrier(f"concurrent {name}")
        with job.report.check(f"concurrent/torch: {name}") as c:
            out, launch_s, err = _fused_and_all_reduce(job, order, xs, idx, a.timeout_concurrent, side)
            if err is not None:
                raise err
            c.detail = (f"err {job.check_out('concurrent', _as_np(out), xs, idx, 'bfloat16', True):.2e}, "
                        f"host launch {launch_s:.3f} s")
        job.tb.reset()  # collective; brings the counters back in step should this case have failed
    # A kernel variant this process has not loaded yet (other head counts), in opposite orders.
    xs2, idx2 = job.inputs(3, 1, 2048, 8, 8, 128, "bfloat16", "zigzag")
    job.barrier("concurrent first load")
    with job.report.check(CONCURRENT_CHECKS[3]) as c:
        out, launch_s, err = _fused_and_all_reduce(job, opposite.get(job.rank, "fused"), xs2, idx2, a.timeout,
                                                   side)
        if err is None:
            c.detail = (f"completed: err {job.check_out('first load', _as_np(out), xs2, idx2, 'bfloat16', True):.2e}"
                        f", host launch {launch_s:.3f} s")
        else:
            msg = str(err)
            if not isinstance(err, RuntimeError) or "gave up after" not in msg:
                raise err
            c.detail = f"timed out as documented (host launch {launch_s:.1f} s): {msg.split('. ')[0]}"
        job.barrier("concurrent first load done", deadline_s=3 * a.timeout + a.slack + 60)
        job.tb.reset()
        out = job.torch_fused(xs2, idx2, "bfloat16", is_causal=True, layout="zigzag", timeout_s=a.timeout)[0]
        err = job.check_out("after", _as_np(out), xs2, idx2, "bfloat16", True)
        c.detail += f"; after reset() right (err {err:.2e})"
    if not job.with_jax:
        return
    dtype, causal, layout = "bfloat16", True, "zigzag"
    job.barrier("concurrent jax")
    with job.report.check(CONCURRENT_CHECKS[4]) as c:
        import jax
        import jax.numpy as jnp
        from jax import lax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        import jax_ring

        mesh = Mesh(np.array(jax.devices()), ("sp",))

        def body(q, k, v, y):
            out = jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", is_causal=causal, layout=layout,
                                          timeout_s=a.timeout_concurrent)
            return out, lax.psum(y * 2.0, "sp")

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P("sp"),),
                                  out_specs=(P(None, "sp"), P())))
        sh = NamedSharding(mesh, P(None, "sp"))

        def glob(x):  # global natural-order array -> this rank's shard of a global jax array
            return jax.make_array_from_process_local_data(sh, jnp.asarray(x[:, idx], dtype=jnp.bfloat16), x.shape)

        y = jax.make_array_from_process_local_data(NamedSharding(mesh, P("sp")),
                                                   jnp.full((1 << 20,), job.rank + 1.0, jnp.float32),
                                                   ((1 << 20) * job.world,))
        out, total = f(*(glob(x) for x in xs), y)
        wait_until(lambda: out.is_ready() and total.is_ready(), a.timeout_concurrent + a.slack,
                   "the jitted program with a psum and the fused call")
        jax.effects_barrier()
        expected = 2.0 * job.world * (job.world + 1) / 2
        got = np.asarray(total.addressable_shards[0].data)
        if not np.all(got == expected):
            raise AssertionError(f"psum gave {got[:4]}, expected {expected}")
        local_out = _as_np(out.addressable_shards[0].data.astype(jnp.float32))
        c.detail = f"err {job.check_out('jax concurrent', local_out, xs, idx, dtype, causal):.2e}"


def section_mismatch(job: Job):
    """Ranks that disagree: rank 1's torch call has another seq_local, then rank 1's JAX call another is_causal
    (RING_ATTENTION_ERRORS=call, then the default deferred check). Every rank raises RingAttentionMismatch naming
    the field (the kernel finds it before any data moves; deferred: the failed call returns, the next right call
    raises it, check_errors() raises it as its type); then right calls through both frontends, without reset()."""
    from jax_ring import status
    from ring_core.protocol.control import RingAttentionMismatch

    a, rank = job.args, job.rank
    dtype, layout = "bfloat16", "contiguous"
    xs, idx = job.inputs(6, 1, 256, 4, 2, 64, dtype, layout)
    cases = [("torch", "seq_local", dict(is_causal=False)),
             ("jax-call", "flags", dict(is_causal=rank == 1, errors="call")),
             ("jax", "flags", dict(is_causal=rank == 1))][:3 if job.with_jax else 1]
    right = dict(layout=layout, timeout_s=a.timeout_concurrent)
    for fw, field, kw in cases:
        job.barrier(f"mismatch {fw}")
        with job.report.check(f"mismatch/{fw}: rank 1's call differs in {field} -> every rank raises") as c:
            t0 = time.monotonic()
            try:
                if fw == "torch":
                    ys, idy = job.inputs(7, 1, 256 if rank == 0 else 320, 4, 2, 64, dtype, layout)
                    job.torch_fused(ys, idy, dtype, **right, **kw)
                elif fw == "jax-call":
                    job.jax_fused(xs, idx, dtype, **right, **kw)
                else:
                    job.jax_fused(xs, idx, dtype, **right, **kw)  # returns: deferred
                    job.barrier("mismatch jax: the failed calls returned")
                    job.jax_fused(xs, idx, dtype, is_causal=False, **right)  # a right call raises it
            except Exception as e:  # noqa: BLE001 - checked below
                msg = str(e)
                if not (isinstance(e, RingAttentionMismatch) or "RingAttentionMismatch" in msg):
                    raise
                if f"first difference: {field}" not in msg or "no reset() needed" not in msg:
                    raise AssertionError(f"the mismatch message lacks the field or the advice: {msg[:600]}")
                if fw == "jax" and status.REPORTED[:60] not in msg:
                    raise AssertionError(f"the right call's error does not say it reports an earlier call: "
                                         f"{msg[:600]}")
                c.detail = f"after {time.monotonic() - t0:.2f} s: " + msg[msg.index("the ranks disagree"):][:160]
            else:
                raise AssertionError("the call returned although the ranks' calls differ")
        if fw == "jax":
            with job.report.check("mismatch/jax: check_errors() raises it as RingAttentionMismatch"):
                try:
                    job.jax_ring.check_errors()
                except RingAttentionMismatch as e:
                    if f"first difference: {field}" not in str(e):
                        raise AssertionError(f"check_errors() raised another mismatch: {str(e)[:400]}") from None
                else:
                    raise AssertionError("check_errors() did not raise the kept mismatch")
        job.barrier(f"mismatch {fw} raised")
        with job.report.check(f"mismatch/{fw}: then right calls through both frontends, no reset()"):
            for call in [job.torch_fused] + ([job.jax_fused] if job.with_jax else []):
                out, lse = call(xs, idx, dtype, is_causal=False, **right)
                job.check_out("after mismatch", _as_np(out), xs, idx, dtype, False, lse=_as_np(lse))


def section_bad_inputs(job: Job):
    """The table's torch rows through backend='fused' on CUDA tensors, each then a right fused call; CPU
    tensors to the fused backend; strided CUDA inputs; NaN through the fused kernel."""
    import re

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the table
    import bad_input_cases as table

    torch, tb, a = job.torch, job.tb, job.args
    good_xs, good_idx = job.inputs(3, 1, 64, 4, 2, 16, "float32", "zigzag")
    dtypes = {n: getattr(torch, n) for n in ("float16", "bfloat16", "float32", "float64", "int32", "complex64")}
    rows = [r for r in table.rows("torch") if not r.where and not r.inputs and "backend" not in r.kw]
    with job.report.check(f"bad_inputs/fused: {len(rows)} table rows raise, each followed by a right call") as c:
        failures = []
        for row in rows:
            exc, match = row.expected("torch")
            q, k, v = (torch.zeros(s, dtype=dtypes[dt], device=job.dev) for s, dt in zip(row.shapes(), row.dtypes))
            try:
                tb.ring_attention(q, k, v, backend="fused", **row.kw)
                failures.append(f"{row.id}: no error")
            except Exception as e:  # noqa: BLE001 - compared with the table
                if not (isinstance(e, exc) and re.search(match, str(e))):
                    failures.append(f"{row.id}: {type(e).__name__}: {e}")
            out, _ = job.torch_fused(good_xs, good_idx, "float32", is_causal=True, layout="zigzag", timeout_s=a.timeout)
            job.check_out(f"after {row.id}", _as_np(out), good_xs, good_idx, "float32", True)
        if failures:
            raise AssertionError("; ".join(failures))
        c.detail = f"{len(rows)} rows"
    with job.report.check("bad_inputs/fused: CPU tensors to backend='fused' raise ValueError"):
        q, k, v = (torch.zeros(s) for s in table.BY_ID["cpu-tensors-to-fused"].shapes())
        try:
            tb.ring_attention(q, k, v, backend="fused")
        except ValueError as e:
            if "backend='fused' needs CUDA tensors, got cpu" not in str(e):
                raise
        else:
            raise AssertionError("no error")
    with job.report.check("bad_inputs/fused: strided CUDA inputs give the contiguous inputs' result"):
        q, k, v = (job.cuda(x[:, good_idx], "float32") for x in good_xs)
        q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
        k_step = torch.zeros(*k.shape[:3], 2 * k.shape[3], device=job.dev)
        k_step[..., ::2] = k
        k_step = k_step[..., ::2]
        ref = tb.ring_attention(q, k, v, is_causal=True, layout="zigzag", backend="fused")
        out = tb.ring_attention(q_t, k_step, v, is_causal=True, layout="zigzag", backend="fused")
        tb.check_errors()
        if not torch.equal(out, ref):
            raise AssertionError(f"max difference {(out - ref).abs().max().item()}")
    with job.report.check("bad_inputs/fused: NaN in k propagates to the rows attending to it, no hang") as c:
        xs, idx = job.inputs(4, 2, 64, 4, 2, 16, "float32", "zigzag")
        poisoned = [x.copy() for x in xs]
        poisoned[1][0, 37, 0, 3] = np.nan  # batch 0, global token 37, kv head 0
        out, lse = job.torch_fused(poisoned, idx, "float32", is_causal=True, layout="zigzag", timeout_s=a.timeout)
        clean, _ = job.torch_fused(xs, idx, "float32", is_causal=True, layout="zigzag", timeout_s=a.timeout)
        out, clean = _as_np(out), _as_np(clean)
        attends = (idx >= 37)  # this rank's tokens (global positions) that see token 37 (causal)
        bad = ~np.isfinite(out).all(-1)  # [b, s, h]
        if not bad[0][attends][:, :2].all():
            raise AssertionError("a row attending to the NaN came out finite")
        if not (np.array_equal(out[1], clean[1]) and np.array_equal(out[0, :, 2:], clean[0, :, 2:])):
            raise AssertionError("rows independent of the NaN changed")
        job.check_out("after NaN", clean, xs, idx, "float32", True)
        c.detail = f"{int(bad.sum())} rows non-finite on this rank"


def section_security(job: Job):
    """The memory-handle connections iris kept lead to this job's processes; iris's functions restored."""
    import torch.distributed as dist
    from iris.host.distributed import fd_passing
    from iris.host.memory import symmetric_heap

    from ring_core.runtime import heap

    pids = [None] * job.world
    dist.all_gather_object(pids, os.getpid())
    with job.report.check("security: handle-passing peers are this job's processes; iris restored") as c:
        if fd_passing.make_rank_sock_path.__module__ != fd_passing.__name__ or \
                symmetric_heap.setup_fd_infrastructure is not fd_passing.setup_fd_infrastructure:
            raise AssertionError("iris's socket functions were not restored after the heap set-up")
        conns = heap.get().iris.heap.fd_conns
        if conns is None:
            c.detail = "no fd-passing connections (fabric transport)"
            return
        for peer, sock in sorted(conns.items()):
            pid, uid, _ = heap.peer_credentials(sock)
            if (pid, uid) != (pids[peer], os.geteuid()):
                raise AssertionError(f"the connection to rank {peer} leads to pid {pid} uid {uid}, expected "
                                     f"pid {pids[peer]} uid {os.geteuid()}")
        c.detail = f"peers {sorted(conns)} checked"


def section_kill(job: Job):
    """Rank 1 exits right after launching a fused call; rank 0 times out naming rank 1 and shuts down."""
    a = job.args
    dtype, causal, layout = "bfloat16", False, "contiguous"
    xs, idx = job.inputs(5, 1, 256, 4, 2, 64, dtype, layout)
    with job.report.check("kill: a call with both ranks present is right"):
        out, _ = job.torch_fused(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout)
        job.check_out("before kill", _as_np(out), xs, idx, dtype, causal)
    job.barrier("kill warm-up")
    if job.rank == 1:
        job.torch_fused(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout, check=False)
        sys.stdout.write("FAULT-CHECK rank 1 exits now, its fused call in flight\n")
        sys.stdout.flush()
        os._exit(0)  # 0: the launcher must not stop rank 0, which is the one being checked
    # Rank 1's kernel is by now waiting for rank 0 (or gone with its process): rank 0 launches late on purpose.
    time.sleep(2.0)
    call = lambda: job.torch_fused(xs, idx, dtype, is_causal=causal, layout=layout, timeout_s=a.timeout)  # noqa: E731
    if job.shared:
        # Under MPS a client that exits with its kernel in flight faults the GPU for every client: the others'
        # next CUDA call fails at once with "an illegal memory access" (measured at 2 and 3 ranks on one H200,
        # 2026-12-02), and their contexts are lost. What must hold: the survivors raise, they do not hang.
        with job.report.check("kill (shared GPU): rank 0 raises within timeout_s, no hang") as c:
            c.detail = expect_error(call, a, "rank 1 died")
        job.report.skip("kill: rank 0 shuts down cleanly (heap released, no error left)", SHARED_GPU_KILL_REASON)
        return
    with job.report.check("kill: rank 0 raises RingAttentionTimeout naming rank 1 within timeout_s") as c:
        c.detail = expect_timeout(call, a, "rank 1 died")
    with job.report.check("kill: rank 0 shuts down cleanly (heap released, no error left)") as c:
        t0 = time.monotonic()
        released = job.tb.shutdown()
        if not released:
            raise AssertionError("shutdown() found no heap")
        c.detail = f"in {time.monotonic() - t0:.1f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for the JSON summary (rank 0)")
    ap.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--timeout", type=float, default=5.0, help="timeout_s of the calls that are meant to time out")
    ap.add_argument("--timeout-concurrent", type=float, default=60.0, help="timeout_s of the concurrent calls")
    ap.add_argument("--slack", type=float, default=15.0, help="seconds a timeout may take beyond its limit")
    ap.add_argument("--deadline", type=float, default=420.0, help="watchdog: seconds this process may run")
    ap.add_argument("--heap-gib", type=float, default=2.0)
    a = ap.parse_args(argv)
    sections = [s for s in a.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    if "kill" in sections and len(sections) > 1:
        ap.error("--sections kill must run alone (it ends rank 1)")
    start_watchdog(a.deadline, int(os.environ.get("RANK", "0")))
    t0 = time.monotonic()
    job = Job(a, with_jax="kill" not in sections)
    for name in sections:
        {"timeout": section_timeout, "concurrent": section_concurrent, "mismatch": section_mismatch,
         "bad_inputs": section_bad_inputs, "security": section_security, "kill": section_kill}[name](job)
    results = [job.report.results] if "kill" in sections else job.gather_reports()
    ok = all(r["ok"] for per_rank in results for r in per_rank.values())
    if job.rank == 0 and a.out:
        os.makedirs(a.out, exist_ok=True)
        summary = dict(ok=ok, sections=sections, world=job.world, shared=job.shared,
                       seconds=round(time.monotonic() - t0, 1), gpu=job.torch.cuda.get_device_name(), checks=results)
        with open(os.path.join(a.out, f"gpu_faults_{'_'.join(sections)}.json"), "w") as f:
            json.dump(summary, f, indent=1)
    print(f"gpu_faults: rank {job.rank}: {'ALL FAULT CHECKS PASSED' if ok else 'SOME FAULT CHECKS FAILED'}",
          flush=True)
    if "kill" in sections and job.shared:
        # The survivors' CUDA contexts are lost (section_kill): the CUDA libraries' exit handlers then abort
        # the process (SIGABRT, measured at 2, 3, 4 and 8 ranks on one H200), which the launcher reports as a
        # failed rank after every check has passed. End here with the checks' verdict instead; the job must
        # restart anyway (README, limits).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)
    if "kill" not in sections:
        job.barrier("the end")
        if job.with_jax:
            import jax_ring

            jax_ring.shutdown()
        job.tb.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
