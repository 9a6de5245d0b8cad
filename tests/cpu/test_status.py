"""jax_ring.status, JAX's default error mode, on the CPU platform: the typed-FFI handler written in ctypes, with a
memcpy where the GPU has an asynchronous copy and an event. What runs here is the host side the GPU shares: the
handler's registration (XLA asks its FFI version), the ring of slots (full: the oldest is waited for), a failure
raised by the next call and then as its own type by take(), failures in order, a handler that fails saying why,
the primitive kept by JAX's dead-code elimination and by XLA (has_side_effect) without a JAX effect, calls from
several threads. The fused path end to end (the kernel's status through this check) is in test_fused_wiring.py;
the GPU's copies and events in tests/gpu/gpu_faults.py (stage ``faults``) and tests/gpu/gpu_status.py.
"""

import re
import threading

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jax_ring import fused, status
from ring_core.protocol import control

MEMBERS = (4, 6)  # this process's ring: global ranks 4 and 6, this process at position 0 (rank 4)


@pytest.fixture
def ring(monkeypatch):
    """A ring of two global ranks as the lowering sees it (fused.local_ring needs a heap), no failure kept."""
    table = np.arange(8, dtype=np.int32)
    monkeypatch.setattr(fused, "local_ring", lambda ctx, axis_name, ring_size: (0, np.array(MEMBERS), table))
    status.clear()
    yield
    status.clear()


def _checked(timeout_s=2.5, shape=(control.STATUS_WORDS,)):
    """A jitted function of (status words, x) that checks the words as a fused call's, inside shard_map."""
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def body(words, x):
        status.check(words.reshape(shape), "sp", 2, timeout_s)
        return x + 1

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P()))


def _words(code=control.ERR_NONE, peer=0, step=0, epoch=1):
    w = np.zeros(control.STATUS_WORDS, np.int32)
    w[:4] = (code, peer, step, epoch)
    return w


def test_a_failure_is_raised_by_the_next_call_then_by_take(ring):
    f, x = _checked(), jnp.zeros(3)
    x = f(_words(), x)
    x = jax.block_until_ready(f(_words(control.ERR_KV_TIMEOUT, peer=1, step=1, epoch=7), x))  # returns normally
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                       match=r"RingAttentionTimeout: fused ring attention on rank 4 \(call #7\) gave up after 2.5 s "
                             r"waiting for the K/V shard of rank 6 at ring step 1\..*jax_ring.check_errors\(\) raises "
                             r"it as ring_core.protocol.control.RingAttentionTimeout"):
        jax.block_until_ready(f(_words(epoch=8), x))
    x = f(_words(epoch=9), x)  # reported once
    e = status.take()
    assert isinstance(e, control.RingAttentionTimeout) and "rank 4 (call #7)" in str(e)
    assert status.take() is None and status.in_flight() == 0


def test_failures_are_reported_in_order_and_take_gives_the_first(ring):
    f, x = _checked(), jnp.zeros(3)
    sig = np.arange(1, control.SIG_WORDS + 1, dtype=np.int32)
    mismatch = _words(control.ERR_MISMATCH, peer=1, step=3, epoch=2)
    mismatch[4:4 + control.SIG_WORDS], mismatch[4 + control.SIG_WORDS:] = sig, sig + 1
    x = f(mismatch, x)
    with pytest.raises(Exception) as first:  # the CPU raises from the call, a GPU maybe when x is read
        jax.block_until_ready(f(_words(control.ERR_BARRIER_TIMEOUT, peer=1, epoch=3), x))  # reports the mismatch
    assert "RingAttentionMismatch: fused ring attention on rank 4: the ranks disagree on call #2" in str(first.value)
    with pytest.raises(Exception, match=r"RingAttentionTimeout: .*rank 4 \(call #3\).*waiting for rank 6 to finish"):
        jax.block_until_ready(f(_words(epoch=4), jnp.zeros(3)))
    assert isinstance(status.take(), control.RingAttentionMismatch)


def test_a_full_ring_of_slots_waits_for_the_oldest(ring, monkeypatch):
    """Copies that have not landed stay in flight; once SLOTS are, the next call waits for the oldest."""
    waited = []
    monkeypatch.setattr(status._HostSlots, "landed", lambda self, slot: False)
    monkeypatch.setattr(status._HostSlots, "wait", lambda self, slot: waited.append(slot))
    f, x = _checked(), jnp.zeros(3)
    for epoch in range(1, status.SLOTS + 4):
        x = f(_words(epoch=epoch), x)
    assert status.in_flight() == status.SLOTS and len(waited) == 3
    assert status.take(wait=True) is None and status.in_flight() == 0


def test_a_failing_handler_fails_the_call_saying_why(ring):
    f = _checked(shape=(2, control.STATUS_WORDS // 2))  # not the kernel's int32[STATUS_WORDS]
    with pytest.raises(Exception, match=rf"ring_attention_status handler failed: RuntimeError: "
                                        rf"ring_attention_status: the status must be int32\[{control.STATUS_WORDS}\]"):
        jax.block_until_ready(f(_words(), jnp.zeros(3)))


def test_the_check_has_no_effect_and_is_never_eliminated(ring):
    """No JAX effect (jit's C++ fast path stays), yet JAX's DCE keeps it though it has no outputs, under grad
    too, and the custom call is marked has_side_effect so that XLA keeps it."""
    def loss(x, words):
        status.check(words, "sp", 2, None)
        return jnp.sum(x ** 2)

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))
    g = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P()), out_specs=P()))
    jaxpr = jax.make_jaxpr(g)(jnp.ones(3), _words())
    assert not jaxpr.effects and "ring_attention_status" in str(jaxpr)
    hlo = g.lower(jnp.ones(3), _words()).as_text()
    assert hlo.count("@ring_attention_status") == 1 and "has_side_effect = true" in hlo
    np.testing.assert_array_equal(g(jnp.ones(3), _words()), 2 * np.ones(3))


def test_calls_from_several_threads(ring):
    f = _checked()
    errors = []

    def run():
        x = jnp.zeros(3)
        try:
            for epoch in range(1, 40):
                x = f(_words(epoch=epoch), x)
            jax.block_until_ready(x)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert status.take(wait=True) is None and status.in_flight() == 0


def test_the_site_key_is_the_same_for_the_same_program():
    table = np.arange(8, dtype=np.int32)
    assert status.site_key("sp", 2, 2.5, table) == status.site_key("sp", 2, 2.5, table.copy())
    assert len({status.site_key("sp", 2, 2.5, table), status.site_key("sp", 2, None, table),
                status.site_key("sp", 2, 2.5, table + 1), status.site_key("dp", 2, 2.5, table)}) == 4
    assert 0 <= status.site_key("sp", 2, 2.5, table) < 2 ** 63


def test_error_modes_from_the_environment(monkeypatch):
    """Both frontends default to "deferred"; RING_ATTENTION_ERRORS decides for both, read at each trace / call; a
    wrong value says the choices."""
    monkeypatch.delenv(control.ERRORS_ENV, raising=False)
    jax_mode = fused.errors_mode
    assert jax_mode() == control.errors_mode() == "deferred"
    monkeypatch.setenv(control.ERRORS_ENV, "call")
    assert jax_mode() == control.errors_mode() == "call"
    monkeypatch.setenv(control.ERRORS_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"RING_ATTENTION_ERRORS must be one of \('call', 'deferred'\)"):
        jax_mode()


def test_call_mode_reports_its_own_failure_and_keeps_an_earlier_one(ring):
    """A call with ``now`` (RING_ATTENTION_ERRORS=call) raises its own failure, which is then not kept; a failure of an
    earlier deferred call that no call has reported yet stays for the next call and for take()."""
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def checked(now):
        def body(words, x):
            status.check(words, "sp", 2, 2.5, now=now)
            return x + 1

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P()))

    deferred, now, x = checked(False), checked(True), jnp.zeros(3)
    x = jax.block_until_ready(deferred(_words(control.ERR_KV_TIMEOUT, peer=1, step=1, epoch=5), x))  # kept
    with pytest.raises(Exception, match=r"RingAttentionTimeout: .*rank 4 \(call #6\)") as e:
        jax.block_until_ready(now(_words(control.ERR_KV_TIMEOUT, peer=1, step=1, epoch=6), x))
    assert status.REPORTED[:40] not in str(e.value)
    with pytest.raises(Exception, match=r"rank 4 \(call #5\).*" + re.escape(status.REPORTED[:40])):
        jax.block_until_ready(deferred(_words(epoch=7), jnp.zeros(3)))
    first = status.take()
    assert isinstance(first, control.RingAttentionTimeout) and "call #5" in str(first)
    assert status.take() is None


def test_the_handler_reads_the_frame_it_is_given_and_refuses_other_attributes(ring):
    """The handler reads the attributes XLA gives it: a program calling the target with other attributes, or with
    ``site`` not an int64, fails saying so; the right program after them still runs, its site (the ring's members)
    and ``now`` read right."""
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def raw(**attrs):
        def body(words, x):
            jax.ffi.ffi_call(status.TARGET, (), has_side_effect=True)(words, **attrs)
            return x + 1

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P()))

    status.register("cpu")
    with pytest.raises(Exception, match=r"expected the attributes site and now, got \['site'\]"):
        jax.block_until_ready(raw(site=np.int64(1))(_words(), jnp.zeros(3)))
    with pytest.raises(Exception, match=r"the attribute 'site' is not an int64 scalar"):
        jax.block_until_ready(raw(site=np.int32(1), now=np.int64(0))(_words(), jnp.zeros(3)))
    f = _checked()
    for epoch in (1, 2):  # the same program twice
        jax.block_until_ready(f(_words(epoch=epoch), jnp.zeros(3)))
    with pytest.raises(Exception, match=r"RingAttentionTimeout: .*rank 4 \(call #3\)"):
        x = jax.block_until_ready(f(_words(control.ERR_KV_TIMEOUT, peer=1, step=1, epoch=3), jnp.zeros(3)))
        jax.block_until_ready(f(_words(epoch=4), x))
    status.clear()
