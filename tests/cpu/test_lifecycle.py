"""Lifecycle of the fused backend's state (ring_core.runtime.heap and both frontends), on CPU.

The heap itself needs GPUs, so ``SymmetricHeap`` is replaced by a stand-in that records what is done to
it; everything around it is the real code: double ``initialize``, a call or ``reset()`` before
``initialize``, ``shutdown`` then ``initialize`` again, the release hooks (JAX forgets programs that baked
the old heap's addresses), errors still pending at ``shutdown``, and who destroys the torch.distributed
process group (the one ``initialize`` created, at exit; never one the program created), checked with gloo
processes started by the launcher.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ring_core.protocol import control
from ring_core.runtime import heap

ROOT = Path(__file__).resolve().parents[2]


class FakeHeap:
    """Stands in for ring_core.runtime.heap.SymmetricHeap (which needs GPUs and iris)."""

    made = []

    def __init__(self, heap_size=None):
        self.heap_size = heap.check_heap_size(heap_size)
        self.closed = False
        self.resets = 0
        FakeHeap.made.append(self)

    def close(self):
        self.closed = True

    def reset(self):
        self.resets += 1

    def take_error(self):
        return None  # the kernel kept no failure


@pytest.fixture
def fake_heap(monkeypatch):
    """The heap module with FakeHeap, no heap and no release hooks; restored afterwards."""
    assert not heap.is_initialized()
    FakeHeap.made = []
    monkeypatch.setattr(heap, "SymmetricHeap", FakeHeap)
    monkeypatch.setattr(heap, "_release_hooks", [])
    yield heap
    heap.shutdown()


def test_initialize_twice_returns_the_same_heap(fake_heap):
    h = heap.initialize(64 << 20)
    assert heap.initialize() is h and heap.initialize(64 << 20) is h and len(FakeHeap.made) == 1
    with pytest.raises(RuntimeError, match=rf"the heap already exists with {64 << 20} bytes; call shutdown\(\) "
                                           rf"before initialize\(heap_size={32 << 20}\)"):
        heap.initialize(32 << 20)
    assert heap.get() is h and not h.closed


def test_shutdown_then_initialize_makes_a_new_heap(fake_heap):
    assert heap.shutdown() is False  # nothing to release
    h1 = heap.initialize(64 << 20)
    assert heap.shutdown() is True and h1.closed
    assert heap.shutdown() is False and not heap.is_initialized()
    with pytest.raises(heap.NotInitializedError, match=r"call jax_ring\.initialize\(\) or torch_bridge\.initialize"):
        heap.get()
    h2 = heap.initialize(32 << 20)  # any size after shutdown
    assert h2 is not h1 and h2.heap_size == 32 << 20 and heap.get() is h2


def test_release_hooks_run_once_per_released_heap(fake_heap):
    calls = []

    def hook():
        calls.append(heap.is_initialized())

    heap.on_release(hook)
    heap.on_release(hook)  # registered once
    heap.shutdown()
    assert calls == []  # no heap, nothing released
    heap.initialize(64 << 20)
    heap.shutdown()
    assert calls == [False]  # after the heap is gone
    heap.initialize(64 << 20)
    heap.shutdown()
    assert calls == [False, False]


@pytest.mark.parametrize("size, exc, match", [
    ("4G", ValueError, r"heap_size must be an int of at least \d+ bytes, got '4G'"),
    (1 << 10, ValueError, r"heap_size must be an int of at least \d+ bytes, got 1024"),
    (True, ValueError, r"got True"),
])
def test_bad_heap_size_raises_before_joining_the_job(monkeypatch, size, exc, match):
    """Checked before torch.distributed or jax.distributed are touched (no launcher environment here)."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    import jax_ring
    import torch_bridge

    for init in (jax_ring.initialize, torch_bridge.initialize):
        with pytest.raises(exc, match=match):
            init(heap_size=size)


def test_heap_size_from_the_environment(monkeypatch):
    monkeypatch.setenv(heap.HEAP_ENV, str(64 << 20))
    assert heap.check_heap_size(None) == 64 << 20
    monkeypatch.setenv(heap.HEAP_ENV, "lots")
    with pytest.raises(ValueError, match=r"RING_ATTENTION_HEAP_BYTES='lots' is not a number of bytes"):
        heap.check_heap_size(None)


def test_reset_before_initialize_says_what_to_do(fake_heap):
    import jax_ring
    import torch_bridge

    for reset in (jax_ring.reset, torch_bridge.reset):
        with pytest.raises(heap.NotInitializedError, match=r"call jax_ring\.initialize\(\) or torch_bridge"):
            reset()
    torch_bridge.check_errors()  # nothing issued: nothing to report
    h = heap.initialize(64 << 20)
    jax_ring.reset()
    torch_bridge.reset()
    assert h.resets == 2


def test_frontends_initialize_and_shutdown(fake_heap, monkeypatch):
    """Both frontends share the one heap: initialize twice (either frontend) returns it, shutdown through
    either releases it, and initialize may follow."""
    import jax_ring
    import torch_bridge

    joined = []
    monkeypatch.setattr(heap, "init_torch_distributed_from_env", lambda: joined.append(1) or (0, 1, 0))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax_ring.initialize sets it
    h = torch_bridge.initialize(64 << 20)
    assert jax_ring.initialize() is h and torch_bridge.initialize() is h and jax_ring.is_initialized()
    assert joined == [1, 1]  # jax_ring's second initialize returns the heap before joining anything
    assert jax_ring.shutdown() is True and h.closed and not jax_ring.is_initialized()
    assert torch_bridge.shutdown() is False
    assert torch_bridge.initialize() is not h


def test_fused_call_after_shutdown_raises_and_auto_falls_back(fake_heap, monkeypatch):
    import torch

    import torch_bridge
    from torch_bridge import api

    monkeypatch.setattr(heap, "init_torch_distributed_from_env", lambda: (0, 1, 0))
    q, kv = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 1, 16)
    torch_bridge.initialize(64 << 20)
    assert api._fused_available()
    torch_bridge.shutdown()
    assert not api._fused_available()
    with pytest.raises(RuntimeError, match=r"backend='fused' needs the symmetric heap: call torch_bridge\.initialize"):
        torch_bridge.ring_attention(q, kv, kv, backend="fused")
    auto = torch_bridge.ring_attention(q, kv, kv)  # auto: the torch reference ring
    assert torch.equal(auto, torch_bridge.ring_attention(q, kv, kv, backend="torch"))


class _DoneEvent:
    def synchronize(self):
        pass

    def query(self):
        return True


def test_torch_shutdown_releases_the_heap_then_raises_a_pending_timeout(fake_heap, monkeypatch):
    import torch

    import torch_bridge
    from torch_bridge import lifecycle

    monkeypatch.setattr(heap, "init_torch_distributed_from_env", lambda: (0, 2, 0))
    h = torch_bridge.initialize(64 << 20)
    status = torch.tensor([control.ERR_KV_TIMEOUT, 1, 1, 3], dtype=torch.int32)  # as a timed-out call leaves it
    monkeypatch.setattr(lifecycle, "_pending", [(_DoneEvent(), status, 0, 5.0, (0, 1))])
    with pytest.raises(control.RingAttentionTimeout, match=r"rank 0 \(call #3\) gave up after 5 s waiting for the "
                                                          r"K/V shard of rank 1 at ring step 1"):
        torch_bridge.shutdown()
    assert h.closed and not heap.is_initialized() and lifecycle._pending == []
    assert torch_bridge.shutdown() is False


def test_jax_shutdown_releases_the_heap_then_raises_a_pending_failure(fake_heap, monkeypatch):
    """The twin of torch's: a failure found in a status copy still in flight (jax_ring.status) is raised by
    shutdown(), after the heap is released."""
    import jax_ring
    from jax_ring import status as jstatus

    monkeypatch.setattr(heap, "init_torch_distributed_from_env", lambda: (0, 1, 0))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    h = jax_ring.initialize(64 << 20)
    slots = jstatus._HostSlots(1)
    slots.words[0, :4] = (control.ERR_KV_TIMEOUT, 1, 1, 3)  # as a timed-out call leaves it
    monkeypatch.setitem(jstatus._slots, "test", slots)
    monkeypatch.setitem(jstatus._free, "test", [])
    monkeypatch.setitem(jstatus._sites, -1, (0, (4, 6), 5.0))
    jstatus._pending.append(("test", 0, -1, 0))  # (platform, slot, site, sequence number)
    with pytest.raises(control.RingAttentionTimeout, match=r"rank 4 \(call #3\) gave up after 5 s waiting for the "
                                                          r"K/V shard of rank 6 at ring step 1"):
        jax_ring.shutdown()
    assert h.closed and not heap.is_initialized() and jstatus.in_flight() == 0 and jstatus._free["test"] == [0]
    assert jax_ring.shutdown() is False


def test_jax_forgets_programs_that_baked_the_released_heap(fake_heap):
    """jax_ring.api registers a release hook when it traces a fused call (the heap's context table is
    baked into the program). After shutdown, programs trace again instead of reusing the old addresses."""
    import jax
    import jax.numpy as jnp

    from jax_ring import api

    traces = []

    @jax.jit
    def program(x):
        traces.append(heap.get().heap_size)  # what fused.forward does at trace time
        return x + 1

    heap.initialize(64 << 20)
    heap.on_release(api._forget_compiled_programs)
    program(jnp.ones(3))
    program(jnp.ones(3))
    assert traces == [64 << 20]
    heap.shutdown()
    with pytest.raises(heap.NotInitializedError):
        program(jnp.ones(3))
    heap.initialize(32 << 20)
    np.testing.assert_array_equal(program(jnp.ones(3)), 2.0)
    assert traces == [64 << 20, 32 << 20]


# ----------------------------------------------------------------------------- process-group ownership
def _launch(tmp_path, body, n=2, timeout=180):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", str(n), str(script)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


_FAKE = """
    import atexit, os
    import torch.distributed as dist
    from ring_core.runtime import heap

    rank = os.environ["RANK"]


    def say(*words):  # one write: the ranks share the launcher's stdout
        os.write(1, (" ".join(str(w) for w in words) + "\\n").encode())


    # Registered first, so it runs last at exit (atexit is last-in, first-out): what is left by then.
    atexit.register(lambda: say("AT-EXIT", rank, "group alive:", dist.is_initialized()))

    class Heap:  # a stand-in for the GPU heap that, like it, is collective
        def __init__(self, heap_size=None):
            self.heap_size = heap.check_heap_size(heap_size)
            dist.barrier()

        def close(self):
            say("HEAP-CLOSED", rank)

    heap.SymmetricHeap = Heap
"""


def test_process_group_created_by_initialize_is_reused_then_destroyed_at_exit(tmp_path):
    r = _launch(tmp_path, _FAKE + """
    heap.init_torch_distributed_from_env(backend="gloo")
    group = dist.distributed_c10d._get_default_group()
    assert heap.owns_process_group()
    h1 = heap.initialize(64 << 20)
    assert heap.shutdown()
    assert dist.is_initialized() and heap.owns_process_group()  # shutdown leaves the group for the next one
    heap.init_torch_distributed_from_env(backend="gloo")  # a second join reuses it
    h2 = heap.initialize(32 << 20)
    assert h2 is not h1 and dist.distributed_c10d._get_default_group() is group
    say("OK", rank)
    # exit holding the heap: it is released, then the group destroyed
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in "01":
        lines = [line for line in r.stdout.splitlines() if line.split()[1:2] == [rank]]
        assert lines == [f"HEAP-CLOSED {rank}", f"OK {rank}", f"HEAP-CLOSED {rank}",
                         f"AT-EXIT {rank} group alive: False"], r.stdout


def test_process_group_of_the_program_is_left_alone(tmp_path):
    r = _launch(tmp_path, _FAKE + """
    dist.init_process_group("gloo")  # the program's own group, from the launcher's environment
    heap.init_torch_distributed_from_env()  # uses it as it is (no NCCL needed: it exists)
    assert not heap.owns_process_group()
    heap.initialize(64 << 20)
    heap.shutdown()
    say("OK", rank)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in "01":
        assert f"AT-EXIT {rank} group alive: True" in r.stdout, r.stdout


def test_initialize_on_cpu_says_it_needs_gpus(tmp_path):
    r = _launch(tmp_path, """
    import torch_bridge
    try:
        torch_bridge.initialize()
    except RuntimeError as e:
        print("ERR", e)
    import torch.distributed as dist
    print("GROUP", dist.is_initialized())
    """, n=1)
    assert r.returncode == 0, r.stderr
    assert "ERR the fused backend needs NVIDIA GPUs; on CPU use backend='xla'" in r.stdout
    assert "GROUP False" in r.stdout  # nothing was created on the way


def test_jax_initialize_without_a_coordinator_port_says_what_to_set(monkeypatch):
    # A program that created its own process group (no launcher environment) and several processes:
    # jax.distributed needs a coordinator port, and the message says how to give one.
    import jax_ring.lifecycle as jd
    from ring_core.runtime import heap

    monkeypatch.setattr(heap, "is_initialized", lambda: False)
    monkeypatch.setattr(heap, "init_torch_distributed_from_env", lambda: (0, 2, 0))
    monkeypatch.setattr(jd, "_jax_distributed_ready", lambda: False)
    for var in ("MASTER_PORT", "JAX_COORDINATOR_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="JAX_COORDINATOR_PORT"):
        jd.initialize()


class _PendingEvent:
    def __init__(self):
        self.asked = 0

    def synchronize(self):
        pass

    def query(self):
        self.asked += 1
        return False


def test_torch_reports_finished_calls_in_issue_order_and_asks_no_further_than_the_first_unfinished(monkeypatch):
    """report(wait=False) checks the calls that finished, in the order they were issued, up to the first that has
    not; the ones behind it are neither asked nor checked yet (they are once it finished), and check_errors waits
    for all of them."""
    import torch

    from torch_bridge import lifecycle

    ok = torch.tensor([control.ERR_NONE, 0, 0, 1], dtype=torch.int32)
    bad = torch.tensor([control.ERR_KV_TIMEOUT, 1, 1, 3], dtype=torch.int32)
    running, later = _PendingEvent(), _PendingEvent()
    calls = [(_DoneEvent(), ok, 0, 5.0, (0, 1)), (running, ok, 0, 5.0, (0, 1)), (later, bad, 0, 5.0, (0, 1)),
             (_DoneEvent(), bad, 0, 5.0, (0, 1))]
    monkeypatch.setattr(lifecycle, "_pending", list(calls))
    lifecycle.report(wait=False)  # the failures lie behind a running call: not yet
    assert lifecycle._pending == calls[1:] and running.asked == 1 and later.asked == 0
    with pytest.raises(control.RingAttentionTimeout, match="call #3"):
        lifecycle.check_errors()
    assert lifecycle._pending == []
