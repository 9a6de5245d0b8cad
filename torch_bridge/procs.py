"""Local multi-process runner: ``world_size`` gloo processes on this machine, for tests and CPU demos.

>>> from torch_bridge.procs import LocalGroup
>>> def hello(rank, world_size, greeting):           # top level, so that it pickles
...     return f"{greeting} from {rank}/{world_size}"
>>> with LocalGroup(2) as group:                    # doctest: +SKIP
...     group.run(hello, "hi")
['hi from 0/2', 'hi from 1/2']

Workers are started with the 'spawn' context; each joins one gloo process group (TCP rendezvous on a free
127.0.0.1 port) and then runs the tasks the parent sends, in order. A function defined in a script's
``__main__`` is found because spawn re-imports the main module in every worker; keep heavy imports (JAX)
out of that module's top level so that worker start-up stays cheap.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback

_READY = -1  # task id of the start-up report


class WorkerError(RuntimeError):
    """A task raised in one or more workers; the message holds each failing worker's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, timeout_s, tasks, results):
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and shuts workers down
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        results.put((_READY, rank, False, traceback.format_exc()))
        return
    results.put((_READY, rank, True, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, payload = task
        try:
            fn, args = pickle.loads(payload)
            out, ok = pickle.dumps(fn(rank, world_size, *args)), True
        except BaseException:
            out, ok = traceback.format_exc(), False
        results.put((task_id, rank, ok, out))
    dist.destroy_process_group()


class LocalGroup:
    """``world_size`` local worker processes in one gloo process group; a context manager.

    ``run(fn, *args)`` calls ``fn(rank, world_size, *args)`` in every worker and returns the per-rank
    results as a list; ``run_each(fn, args_per_rank)`` gives rank r the arguments ``args_per_rank[r]``.
    ``fn`` must be a picklable top-level function and its results picklable (numpy arrays, not tensors
    with autograd state). An exception in a worker is re-raised in the parent as ``WorkerError`` with the
    worker's traceback; a worker that dies, or gives no result within ``timeout`` seconds, raises in the
    parent (``WorkerError`` / ``TimeoutError``) and shuts the group down (``closed`` becomes True).
    """

    def __init__(self, world_size: int, *, timeout: float = 300.0, start_timeout: float = 120.0,
                 error_grace: float = 5.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.error_grace = float(error_grace)
        self._task_id = 0
        self._closed = False
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.timeout, self._tasks[r], self._results),
                        name=f"LocalGroup-rank{r}", daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        try:
            self._collect(_READY, start_timeout, what="start-up")
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, fn, *args, timeout: float | None = None) -> list:
        """Call ``fn(rank, world_size, *args)`` in every worker; return the list of results by rank."""
        return self.run_each(fn, [args] * self.world_size, timeout=timeout)

    def run_each(self, fn, args_per_rank, timeout: float | None = None) -> list:
        """Call ``fn(rank, world_size, *args_per_rank[rank])`` in every worker; return the results by rank."""
        if self._closed:
            raise RuntimeError("this LocalGroup is closed (shut down or broken by an earlier failure); start a new one")
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"args_per_rank has {len(args_per_rank)} entries for {self.world_size} ranks")
        payloads = [pickle.dumps((fn, tuple(a))) for a in args_per_rank]  # pickling errors surface here
        self._task_id += 1
        for q, payload in zip(self._tasks, payloads):
            q.put((self._task_id, payload))
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(self._task_id, self.timeout if timeout is None else timeout, what=name)

    def _collect(self, task_id, timeout, what):
        deadline = time.monotonic() + timeout
        done, errors = {}, {}
        error_deadline = None
        while len(done) + len(errors) < self.world_size:
            now = time.monotonic()
            pending = [r for r in range(self.world_size) if r not in done and r not in errors]
            if error_deadline is not None and now > error_deadline:
                break  # others are probably blocked on the failed rank
            if now > deadline:
                self._shutdown(graceful=False)
                raise TimeoutError(
                    f"LocalGroup {what}: rank(s) {pending} gave no result within {timeout:g} s "
                    "(hung worker?); the group was shut down")
            try:
                tid, rank, ok, out = self._results.get(timeout=min(0.2, max(deadline - now, 0.01)))
            except queue.Empty:
                dead = [(r, self._procs[r].exitcode) for r in pending if not self._procs[r].is_alive()]
                if dead:
                    self._shutdown(graceful=False)
                    msg = ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
                    raise WorkerError(f"LocalGroup {what}: worker {msg} died; the group was shut down") from None
                continue
            if tid != task_id:
                continue  # a late reply to an abandoned task
            if ok:
                done[rank] = out
            else:
                errors[rank] = out
                if error_deadline is None:
                    error_deadline = time.monotonic() + self.error_grace
        if errors:
            missing = [r for r in range(self.world_size) if r not in done and r not in errors]
            note = ""
            if missing:
                self._shutdown(graceful=False)
                note = f"\nrank(s) {missing} were still running (waiting on a failed rank?); the group was shut down"
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorkerError(f"LocalGroup {what} failed on rank(s) {sorted(errors)}:\n{text}{note}")
        if task_id == _READY:
            return None
        return [pickle.loads(done[r]) for r in range(self.world_size)]

    def _shutdown(self, graceful: bool, join_timeout: float = 10.0):
        if self._closed:
            return
        self._closed = True
        if graceful:
            for q in self._tasks:
                try:
                    q.put(None)
                except Exception:
                    pass
            end = time.monotonic() + join_timeout
            for p in self._procs:
                p.join(max(end - time.monotonic(), 0.0))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (*self._tasks, self._results):
            q.cancel_join_thread()
            q.close()

    def close(self, join_timeout: float = 10.0):
        """Ask workers to leave the process group and exit; terminate any that do not within the timeout."""
        self._shutdown(graceful=True, join_timeout=join_timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"LocalGroup(world_size={self.world_size}, closed={self._closed})"
