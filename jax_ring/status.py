"""The fused calls' status checked without stalling the stream: JAX's default error mode, "deferred" (the twin of
torch_bridge.lifecycle's pinned copies; ring_core.protocol.control.errors_mode).

Every fused launch writes its status words (ring_core.protocol.control.check_status) to a small device array. After the
launch, one more custom call, ``ring_attention_status`` (XLA's typed FFI, its handler written here in Python
through ctypes: no compiled extension), runs on the host when XLA *enqueues* it, not when the GPU reaches it:

1. it reads the statuses of earlier calls that have landed (pinned host slots, one CUDA event each, queried in
   the order they were issued); if one failed, it returns an XLA error carrying the failure's message, so the
   program making this later call fails: ``jax.errors.JaxRuntimeError`` (a RuntimeError; jit's C++ dispatch may
   raise it as ValueError) whose message reads ``RingAttentionTimeout: fused ring attention on rank ...``;
2. it enqueues a copy of this call's status into the next free slot, and an event, on XLA's stream: a one-warp
   kernel storing the words into the slots, pinned host memory mapped into the GPU's address space; on Hopper and
   later launched as a programmatic dependent launch (PDL: scheduled as the fused kernel ends, it waits on the GPU
   for that kernel's completion and memory), elsewhere as a plain launch after it.

So a call's failure is raised by a later fused call on this process, or by ``jax_ring.check_errors()`` / ``shutdown()``,
which wait for the copies and raise it as its own type (RingAttentionTimeout / RingAttentionMismatch). Per call: the
handler's host time (~45-50 us of Python on the GPU machine, an H200 with jax 0.11) and the tiny copy kernel on the
stream, no sync. Measured 2026-12-02 to 2026-12-04 on one H200, seq_local 4k, calls back to back, the 0.28 ms causal
forward against no check: the PDL copy +1.6-1.7 % (three runs; +0.2-1.6 % in the probe runs), the plain copy kernel
+2.5-5.3 % (six runs), the DMA copy +2.5-3.9 %, a handler that copies nothing within 0.5 % (docs/performance.md, "The
per-call error check's cost").

RING_ATTENTION_ERRORS=call sets the call's attribute ``now``: the handler then waits for the copy it enqueued (a
host sync per call: the host waits for the GPU to finish the call) and fails this call's program with this call's
failure, which is then not kept for check_errors(), as torch's call mode consumes it.

Where XLA may run it. The handler has no JAX effect (an effect would take jit's calls off its C++ fast path:
+0.1-0.2 ms a call on our CPU), so JAX's own dead-code elimination is told to keep it (``dce_rules``); XLA keeps
and orders it because it has the status as operand and ``has_side_effect``. It is registered without the
command-buffer trait, so XLA never captures it into a CUDA graph (where a host handler would run only when the
graph is recorded). Like jax.debug.callback's handler, it takes the GIL, on whichever thread XLA runs it: XLA's
CPU client runs it on threads of its own (jax 0.10), and there a main thread busy in Python meanwhile delays
each call's handler (tests/gpu/gpu_status.py, on our CPU: 70 us a call without the check, 96 us with it, 231 us
with it while the main thread spins in Python). Where a GPU client runs it is measured by tests/gpu/gpu_status.py.
So the handler takes the GIL once and keeps it: the driver's and XLA's functions it calls per call keep the GIL
(PyDLL, PYFUNCTYPE) instead of releasing it around each call, where a busy main thread would take it each time.
On the GPU machine (an H200, jax 0.11) the handler ran on the dispatching thread itself, where that changes
nothing measurable; it took ~45-50 us a call there, most of it Python, which runs several times slower on that
machine than on a development CPU.

On the CPU platform the same handler runs with a memcpy for the copy (a slot lands at once): that is how the
tests check the host side (the ring of slots, the message, raising at the next call) without a GPU.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading
import zlib
from ctypes import POINTER, Structure, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_void_p

import numpy as np

import jax
from jax.interpreters import mlir

from ring_core.protocol import control

try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - older JAX
    from jax.core import Primitive

TARGET = "ring_attention_status"
SLOTS = 64  # statuses in flight per process; a call that finds none free waits for the oldest
_STATUS_BYTES = 4 * control.STATUS_WORDS
REPORTED = ("a failure of an earlier fused call on this process, reported by a later one "
            "(RING_ATTENTION_ERRORS=deferred). The program making that later call stopped there: if it has fused "
            "calls after that one, they did not run on this rank, so call jax_ring.reset() on every rank")


# ---------------------------------------------------------------------------- XLA's FFI, as much as we read
# xla/ffi/api/c_api.h (API 0.3 in jaxlib 0.10, 0.4 in 0.11: these structs are the same in both).
class _Version(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("major", c_int), ("minor", c_int)]


class _Extension(Structure):
    _fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", c_void_p)]


class _Metadata(Structure):
    _fields_ = [("struct_size", c_size_t), ("api_version", _Version), ("traits", c_uint32),
                ("state_type_id", c_int64)]


class _MetadataExtension(Structure):
    _fields_ = [("base", _Extension), ("metadata", POINTER(_Metadata))]


class _List(Structure):  # XLA_FFI_Args / XLA_FFI_Rets
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", POINTER(c_int)), ("items", POINTER(c_void_p))]


class _Attrs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", POINTER(c_int)), ("names", c_void_p), ("items", POINTER(c_void_p))]


class _Api(Structure):  # the leading fields of XLA_FFI_Api
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("api_version", _Version),
                ("internal_api", c_void_p), ("error_create", c_void_p), ("error_get_message", c_void_p),
                ("error_destroy", c_void_p), ("handler_register", c_void_p), ("stream_get", c_void_p)]


class _CallFrame(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(_Extension)), ("api", POINTER(_Api)),
                ("ctx", c_void_p), ("stage", c_int), ("args", _List), ("rets", _List), ("attrs", _Attrs),
                ("future", c_void_p)]


class _Buffer(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("dtype", c_int), ("data", c_void_p),
                ("rank", c_int64), ("dims", POINTER(c_int64))]


class _ByteSpan(Structure):
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]


class _Scalar(Structure):
    _fields_ = [("dtype", c_int), ("value", c_void_p)]


class _ErrorArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("message", c_char_p), ("errc", c_int)]


class _StreamArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p), ("stream", c_void_p)]


_EXT_METADATA, _STAGE_EXECUTE, _ATTR_SCALAR, _S32, _S64, _ERR_INTERNAL = 1, 3, 3, 4, 5, 13
_FFI_VERSION = (0, 3)  # the API these structs follow; XLA accepts handlers of 0.1 and newer (jaxlib 0.10, 0.11)
_HANDLER = ctypes.CFUNCTYPE(c_void_p, POINTER(_CallFrame))
# XLA's functions that the handler calls keep the GIL (PYFUNCTYPE; see _CudaSlots on why).
_ERROR_CREATE = ctypes.PYFUNCTYPE(c_void_p, POINTER(_ErrorArgs))
_STREAM_GET = ctypes.PYFUNCTYPE(c_void_p, POINTER(_StreamArgs))


def _ffi_error(frame, message: str):
    args = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, message.encode("utf-8", "replace"), _ERR_INTERNAL)
    return _ERROR_CREATE(frame.api.contents.error_create)(ctypes.byref(args))


def _answer_metadata(frame) -> bool:
    """XLA calls a handler once when it is registered, with a metadata extension, to learn its FFI version and
    traits (no traits: not command-buffer compatible). True if this was that call."""
    ext = frame.extension_start
    if not ext or ext.contents.type != _EXT_METADATA:
        return False
    md = ctypes.cast(ext, POINTER(_MetadataExtension)).contents.metadata.contents
    md.api_version.major, md.api_version.minor = _FFI_VERSION
    md.traits = 0
    return True


# ---------------------------------------------------------------------------- the slots: pinned host + events
_memmove = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_void_p, c_size_t)(ctypes.cast(ctypes.memmove, c_void_p).value)


class _HostSlots:
    """The CPU platform's slots: ``copy`` is a memcpy, so a slot has landed as soon as it is written."""

    def __init__(self, n: int):
        self.words = np.zeros((n, control.STATUS_WORDS), np.int32)
        self.address = [self.words.ctypes.data + i * _STATUS_BYTES for i in range(n)]

    def copy(self, slot: int, src: int, stream) -> None:
        _memmove(self.address[slot], src, _STATUS_BYTES)

    def landed(self, slot: int) -> bool:
        return True

    def wait(self, slot: int) -> None:
        pass


# A kernel of one warp's worth of threads that copies ``n`` int32 words from device memory to pinned host memory
# mapped into the device's address space (zero-copy): what ``_CudaSlots`` uses instead of cuMemcpyDtoHAsync (the
# copy engine's small transfer held the next kernel about 10 us; this kernel about 4).
# PTX for sm_70 and later, compiled by the driver when the slots are made.
_COPY_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry ring_status_copy(.param .u64 src, .param .u64 dst, .param .u32 n)
{
  .reg .pred %p<2>;
  .reg .b32 %r<4>;
  .reg .b64 %rd<6>;
  ld.param.u64 %rd1, [src];
  ld.param.u64 %rd2, [dst];
  ld.param.u32 %r1, [n];
  mov.u32 %r2, %tid.x;
  setp.ge.u32 %p1, %r2, %r1;
  @%p1 bra DONE;
  mul.wide.u32 %rd3, %r2, 4;
  add.s64 %rd4, %rd1, %rd3;
  ld.global.u32 %r3, [%rd4];
  add.s64 %rd5, %rd2, %rd3;
  st.global.u32 [%rd5], %r3;
DONE:
  ret;
}
"""
# The same kernel for Hopper and later, launched as a programmatic dependent launch (PDL): it may be scheduled while
# the fused kernel before it is still ending, and waits for that kernel's completion and memory (``griddepcontrol.
# wait``) before it reads the status: the copy's launch overlaps the fused kernel's tail instead of following it.
_COPY_PTX_PDL = (_COPY_PTX.replace(b".version 7.0", b".version 7.8").replace(b".target sm_70", b".target sm_90")
                 .replace(b"  mov.u32 %r2, %tid.x;", b"  griddepcontrol.wait;\n  mov.u32 %r2, %tid.x;"))
_LIBCUDA = "libcuda.so.1"


class _LaunchAttribute(Structure):  # CUlaunchAttribute: an id, then a union of 64 bytes
    _fields_ = [("id", c_uint32), ("pad", c_uint32), ("value", c_uint32 * 16)]


class _LaunchConfig(Structure):  # CUlaunchConfig
    _fields_ = [("grid", c_uint32 * 3), ("block", c_uint32 * 3), ("shared", c_uint32), ("stream", c_void_p),
                ("attrs", POINTER(_LaunchAttribute)), ("num_attrs", c_uint32)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _CudaSlots:
    """Pinned host slots filled on XLA's stream, each followed by an event (CUDA driver API through ctypes: libcuda
    is there wherever a GPU is): by a one-warp kernel that stores the words into the slots mapped into the device's
    address space, launched as a programmatic dependent launch (``mode`` "pdl"; Hopper and later) or plainly
    ("kernel": before Hopper, or a driver without cuLaunchKernelEx)."""

    def __init__(self, n: int, stream):
        # Two views of the driver: ``cu`` (CDLL) releases the GIL around each call, for what may block (waiting for
        # a copy, setting up); ``fast`` (PyDLL) keeps it, for the quick calls each handler makes (the copy's launch,
        # its event, a query). Where XLA runs the handler on a thread of its own (its CPU client does), every
        # release is a chance for a main thread busy in Python to take the GIL, and the handler waits to get it
        # back. (On the GPU machine, jax 0.11, the handler ran on the dispatching thread: no change there.)
        self.cu = cu = ctypes.CDLL(_LIBCUDA)
        self.fast = fast = ctypes.PyDLL(_LIBCUDA)
        for lib in (cu, fast):
            for name in ("cuCtxGetCurrent", "cuStreamGetCtx", "cuCtxSetCurrent", "cuCtxPushCurrent_v2",
                         "cuCtxPopCurrent_v2", "cuMemHostAlloc", "cuEventCreate", "cuEventRecord", "cuEventQuery",
                         "cuEventSynchronize", "cuMemcpyDtoHAsync_v2", "cuMemHostGetDevicePointer_v2",
                         "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel"):
                getattr(lib, name).restype = c_int
            lib.cuStreamGetCtx.argtypes = (c_void_p, POINTER(c_void_p))
            lib.cuMemcpyDtoHAsync_v2.argtypes = (c_void_p, ctypes.c_uint64, c_size_t, c_void_p)
            lib.cuLaunchKernel.argtypes = (c_void_p, c_uint32, c_uint32, c_uint32, c_uint32, c_uint32, c_uint32,
                                           c_uint32, c_void_p, POINTER(c_void_p), c_void_p)
            lib.cuEventRecord.argtypes = (c_void_p, c_void_p)
            lib.cuEventQuery.argtypes = (c_void_p,)
            lib.cuEventSynchronize.argtypes = (c_void_p,)
        self.context, self._cur = c_void_p(), c_void_p()
        self._cur_ref = ctypes.byref(self._cur)
        self._ok(cu.cuStreamGetCtx(c_void_p(stream), ctypes.byref(self.context)), "cuStreamGetCtx")
        self._current()
        host = c_void_p()
        self._ok(cu.cuMemHostAlloc(ctypes.byref(host), c_size_t(n * _STATUS_BYTES), c_uint32(1 | 2)),
                 "cuMemHostAlloc")  # 1: CU_MEMHOSTALLOC_PORTABLE, 2: DEVICEMAP
        self.words = np.ctypeslib.as_array(ctypes.cast(host, POINTER(ctypes.c_int32)),
                                           shape=(n, control.STATUS_WORDS))
        self.address = [host.value + i * _STATUS_BYTES for i in range(n)]
        mapped = ctypes.c_uint64()
        self._ok(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(mapped), host, c_uint32(0)), "cuMemHostGetDevicePointer")
        self.mapped = [mapped.value + i * _STATUS_BYTES for i in range(n)]
        module, self.kernel = c_void_p(), c_void_p()
        self._ok(cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_COPY_PTX)), "cuModuleLoadData")
        self._ok(cu.cuModuleGetFunction(ctypes.byref(self.kernel), module, b"ring_status_copy"), "cuModuleGetFunction")
        self.mode = "pdl"
        self.pdl = self._pdl_launch(stream)
        if self.pdl is None:  # before Hopper, or a driver without cuLaunchKernelEx
            self.mode = "kernel"
        self.events = []
        for _ in range(n):
            ev = c_void_p()
            self._ok(cu.cuEventCreate(ctypes.byref(ev), c_uint32(2)), "cuEventCreate")  # 2: DISABLE_TIMING
            self.events.append(ev)
        # The copy kernel's parameters, made once per slot (making them per call cost ~7 us of Python): a launch
        # reads the values when it is enqueued, so a slot's source is set just before its launch.
        self._src = [ctypes.c_uint64() for _ in range(n)]
        self._dst = [ctypes.c_uint64(m) for m in self.mapped]
        self._n = c_uint32(control.STATUS_WORDS)
        self._params = [(c_void_p * 3)(ctypes.addressof(src), ctypes.addressof(dst), ctypes.addressof(self._n))
                        for src, dst in zip(self._src, self._dst)]

    def _pdl_launch(self, stream):
        """The PDL copy's kernel and launch configuration (the stream set per call), or None where it cannot run."""
        fn = getattr(self.fast, "cuLaunchKernelEx", None)
        module, kernel = c_void_p(), c_void_p()
        if fn is None or self.cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_COPY_PTX_PDL)) != 0:
            return None  # (the driver refuses sm_90 PTX on an older GPU)
        self._ok(self.cu.cuModuleGetFunction(ctypes.byref(kernel), module, b"ring_status_copy"), "cuModuleGetFunction")
        fn.restype, fn.argtypes = c_int, (c_void_p, c_void_p, POINTER(c_void_p), c_void_p)
        attr = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        config = _LaunchConfig((1, 1, 1), (64, 1, 1), 0, None, ctypes.pointer(attr), 1)
        return fn, kernel, config, ctypes.addressof(config), attr

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    def _current(self) -> None:
        """Make the context of XLA's stream current on this thread (XLA's threads normally have it already; called
        under the module's lock, so one ``_cur`` serves every thread)."""
        self.fast.cuCtxGetCurrent(self._cur_ref)
        if self._cur.value != self.context.value:
            self._ok(self.fast.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def copy(self, slot: int, src: int, stream) -> None:
        self._current()
        if self.mode == "kernel":
            self._src[slot].value = src
            rc = self.fast.cuLaunchKernel(self.kernel, 1, 1, 1, 64, 1, 1, 0, stream, self._params[slot], None)
            self._ok(rc, "cuLaunchKernel")
        elif self.mode == "pdl":
            self._src[slot].value = src
            fn, kernel, config, address, _ = self.pdl
            config.stream = stream
            self._ok(fn(address, kernel, self._params[slot], None), "cuLaunchKernelEx")
        else:
            raise ValueError(f"status copy mode {self.mode!r}: 'pdl' or 'kernel'")
        self._ok(self.fast.cuEventRecord(self.events[slot], stream), "cuEventRecord")

    def landed(self, slot: int) -> bool:
        rc = self.fast.cuEventQuery(self.events[slot])
        if rc == 600:  # CUDA_ERROR_NOT_READY
            return False
        self._ok(rc, "cuEventQuery")
        return True

    def wait(self, slot: int) -> None:
        self._ok(self.cu.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
        try:
            self._ok(self.cu.cuEventSynchronize(self.events[slot]), "cuEventSynchronize")
        finally:
            self.cu.cuCtxPopCurrent_v2(ctypes.byref(c_void_p()))


# ---------------------------------------------------------------------------- what this process has in flight
_lock = threading.RLock()
_sites = {}  # site key -> (ring position, ring members (global ranks), timeout_s) of this process's device
_slots = {}  # platform -> _HostSlots / _CudaSlots, made at the first call
_free = {}  # platform -> free slot indices
_pending = collections.deque()  # (platform, slot, site key, sequence number), in the order the calls were enqueued
_unreported = collections.deque()  # (sequence number, failure) found, not yet returned to XLA by a call
_issued = 0  # sequence numbers of the calls' statuses
_first = None  # the first failure since the last take(): what check_errors() raises


def _check(words, site: int) -> None:
    """Raise the failure in one call's status words (ring_core.protocol.control.check_status), naming global ranks."""
    if words[0] == control.ERR_NONE and words[3] > 0:  # the common case, without building the message's parts
        return
    position, members, timeout_s = _sites.get(site, (0, None, None))
    control.check_status(words, position, timeout_s, members=members)


def _poll(wait: bool, at_most=None) -> None:
    """Check the statuses that have landed, in issue order (``wait``: wait for each first; ``at_most``: check no
    more than that many); failures go to ``_unreported`` and, the first since the last take(), to ``_first``."""
    global _first
    done = 0
    while _pending and (at_most is None or done < at_most):
        platform, slot, site, seq = _pending[0]
        slots = _slots[platform]
        if wait:
            slots.wait(slot)
        elif not slots.landed(slot):
            return
        _pending.popleft()
        done += 1
        try:
            _check(slots.words[slot], site)
        except RuntimeError as e:  # RingAttentionTimeout / RingAttentionMismatch, or a call that never completed
            _unreported.append((seq, e))
            _first = _first or e
        finally:
            _free[platform].append(slot)


def _attributes(frame) -> dict:
    """The call's attributes by name (``site``, ``now``: int64 scalars)."""
    attrs, got = frame.attrs, {}
    for i in range(attrs.size):
        name = _ByteSpan.from_address(ctypes.cast(attrs.names, POINTER(c_void_p))[i])
        name = ctypes.string_at(name.ptr, name.len).decode()
        scalar = _Scalar.from_address(attrs.items[i]) if attrs.types[i] == _ATTR_SCALAR else None
        if scalar is None or scalar.dtype != _S64:
            raise RuntimeError(f"{TARGET}: the attribute {name!r} is not an int64 scalar")
        got[name] = c_int64.from_address(scalar.value).value
    if set(got) != {"site", "now"}:
        raise RuntimeError(f"{TARGET}: expected the attributes site and now, got {sorted(got)}")
    return got


def _status_pointer(frame) -> int:
    if frame.args.size != 1 or frame.args.types[0] != 1:  # XLA_FFI_ArgType_BUFFER
        raise RuntimeError(f"{TARGET}: expected one buffer operand, got {frame.args.size}")
    buf = _Buffer.from_address(frame.args.items[0])
    if buf.dtype != _S32 or buf.rank != 1 or buf.dims[0] != control.STATUS_WORDS:
        raise RuntimeError(f"{TARGET}: the status must be int32[{control.STATUS_WORDS}]")
    return buf.data


_stream_get = {}  # XLA_FFI_Stream_Get's address -> its ctypes function (made once: making one costs microseconds)


def _stream(frame):
    args = _StreamArgs(ctypes.sizeof(_StreamArgs), None, frame.ctx, None)
    address = frame.api.contents.stream_get
    get = _stream_get.get(address) or _stream_get.setdefault(address, _STREAM_GET(address))
    if get(ctypes.byref(args)):
        raise RuntimeError(f"{TARGET}: XLA gave no stream")
    return args.stream


def _execute(frame, platform: str):
    """One call: report a failure that earlier calls' statuses show, then start this call's copy (the copy is
    enqueued first, so this call's status is tracked even when this call fails). With the attribute ``now``
    (RING_ATTENTION_ERRORS=call) it first waits for this call's copy, so that this call reports its own failure,
    which is then not kept for check_errors() (as torch's call mode: the call raised it)."""
    global _issued, _first
    if frame.stage != _STAGE_EXECUTE:
        return None
    src, attrs = _status_pointer(frame), _attributes(frame)
    site = attrs["site"]
    stream = _stream(frame) if platform == "cuda" else None
    with _lock:
        _poll(wait=False)
        if platform not in _slots:
            _slots[platform] = _CudaSlots(SLOTS, stream) if platform == "cuda" else _HostSlots(SLOTS)
            _free[platform] = list(range(SLOTS - 1, -1, -1))
        while not _free[platform]:  # the host is SLOTS calls ahead of the GPU: wait for the oldest
            _poll(wait=True, at_most=1)
        slot = _free[platform].pop()
        _slots[platform].copy(slot, src, stream)
        _issued += 1
        _pending.append((platform, slot, site, _issued))
        if attrs["now"]:
            _poll(wait=True)  # every copy in flight, this call's last: a host sync
            mine = next((e for seq, e in _unreported if seq == _issued), None)
            if mine is not None:  # reported by this call: not kept (earlier calls' failures stay for their turn)
                _unreported.remove((_issued, mine))
                _first = None if _first is mine else _first
                return _ffi_error(frame, f"{type(mine).__name__}: {mine}")
        if _unreported:
            e = _unreported.popleft()[1]
            name = type(e).__name__
            where = "ring_core.protocol.control." if type(e).__module__ == control.__name__ else ""
            return _ffi_error(frame, f"{name}: {e} [{REPORTED}; jax_ring.check_errors() raises it as {where}{name}]")
    return None


def _handler(platform: str):
    def handler(frame_p):
        try:
            frame = frame_p.contents
            if _answer_metadata(frame):
                return None
            return _execute(frame, platform)
        except BaseException as e:  # never let an exception into XLA's thread: ctypes would drop it
            try:
                return _ffi_error(frame_p.contents, f"{TARGET} handler failed: {type(e).__name__}: {e}")
            except BaseException:
                return None

    return _HANDLER(handler)


_handlers = {}  # platform -> the ctypes function (kept alive: XLA holds its address)
_registered = {}  # platform -> True, or the error that registration raised


def register(platform: str):
    """Register the handler for ``platform`` (a JAX platform: "cpu", or "gpu"/"cuda") with XLA, once; returns None,
    or the error registration raised (e.g. a jaxlib whose FFI this handler does not speak; a ROCm GPU)."""
    platform = "cuda" if platform == "gpu" else platform
    if platform not in _registered:
        if platform not in ("cpu", "cuda"):
            _registered[platform] = ValueError(f"no status check for the {platform!r} platform")
            return _registered[platform]
        fn = _handlers[platform] = _handler(platform)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, (c_void_p, c_char_p, c_void_p)
        try:
            jax.ffi.register_ffi_target(TARGET, new(ctypes.cast(fn, c_void_p), None, None),
                                        platform="CUDA" if platform == "cuda" else "cpu", api_version=1)
            _registered[platform] = True
        except Exception as e:
            _registered[platform] = e
    got = _registered[platform]
    return None if got is True else got


# ---------------------------------------------------------------------------- the primitive
def site_key(*parts) -> int:
    """A call site's key (int63): the same in every process for the same program (multi-controller JAX compiles
    one program everywhere), from values every process has alike (the ring table, the timeout)."""
    crc = zlib.crc32(repr([p for p in parts if not isinstance(p, np.ndarray)]).encode())
    crc2 = zlib.crc32(b"".join(np.asarray(p).tobytes() for p in parts if isinstance(p, np.ndarray)), crc)
    return (crc << 31) ^ crc2


# (position in its ring, the ring's global ranks, the ring table) of this process's device, from the lowering's
# context: jax_ring.fused's ``local_ring``, which it sets here when imported (this module does not import it).
ring_of = None


def register_site(key: int, position: int, members, timeout_s) -> None:
    """What this process's failures at site ``key`` are named with (ring_core.protocol.control.check_status)."""
    _sites[key] = (int(position), tuple(int(m) for m in members) if members is not None else None, timeout_s)


def _abstract(status, **_):
    return []


def _lowering(ctx, status, *, axis_name, ring_size, timeout_s, now, platform):
    if axis_name is None:  # no ring to name ranks with (a status outside any ring: tests/gpu/gpu_status.py)
        position, members, table = 0, None, None
    else:
        position, members, table = ring_of(ctx, axis_name, ring_size)
    key = site_key(axis_name, ring_size, timeout_s, table)
    register_site(key, position, members, timeout_s)
    err = register(platform)
    if err is not None:  # jax_ring.fused registered it when the call was traced, for the default backend
        raise RuntimeError(f"the status check ({TARGET}) cannot be lowered for {platform}: {err} (the program was "
                           f"traced where the handler is registered, for another platform)")
    return jax.ffi.ffi_lowering(TARGET, has_side_effect=True)(ctx, status, site=np.int64(key),
                                                               now=np.int64(bool(now)))


# Checks one call's status words (int32[STATUS_WORDS]) of a ring along ``axis_name``; no outputs and no JAX effect
# (see the module docstring). Lowered where the mesh is known, which names the ring's members (the context row's).
ring_status_p = Primitive("ring_attention_status")
ring_status_p.multiple_results = True
ring_status_p.def_abstract_eval(_abstract)
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(ring_status_p, functools.partial(_lowering, platform=_platform), platform=_platform)


def _keep(used_outputs, eqn):
    return [True] * len(eqn.invars), eqn


try:
    from jax._src.interpreters import partial_eval as _pe

    _pe.dce_rules[ring_status_p] = _keep
except (ImportError, AttributeError):  # pragma: no cover - a JAX without dce_rules: the tests see the call gone
    pass


_left_out = threading.local()


def check(status, axis_name, ring_size: int, timeout_s, now: bool = False) -> None:
    """Check ``status`` (a launch's int32[STATUS_WORDS] on the ring along ``axis_name``, inside shard_map) at a later
    fused call on this process, or at ``take(wait=True)``, without a host sync now; ``now`` (RING_ATTENTION_ERRORS=
    call): wait for it when the program reaches the check, and fail this program with its failure. ``axis_name``
    None: a status of no ring (ranks named by ring position)."""
    ring_status_p.bind(status, axis_name=axis_name, ring_size=int(ring_size), timeout_s=timeout_s, now=bool(now))


def is_left_out() -> bool:
    return getattr(_left_out, "on", False)


class left_out:
    """``with status.left_out():`` fused calls traced inside it have no per-call check (the kernel still keeps a
    failure for check_errors()): for benchmarks, where the check's cost is the difference. Not for programs."""

    def __enter__(self):
        self.before, _left_out.on = getattr(_left_out, "on", False), True
        return self

    def __exit__(self, *exc):
        _left_out.on = self.before


# ---------------------------------------------------------------------------- the host's side
def take(wait: bool = True):
    """The first failure (the exception) found since the last take() or clear(), or None; with ``wait``, after
    waiting for every status copy in flight. Clears it, and the failures not yet reported by a call."""
    global _first
    with _lock:
        _poll(wait)
        first, _first = _first, None
        _unreported.clear()
        return first


def clear() -> None:
    """Wait for the copies in flight and forget every failure (after reset(): the ranks start again)."""
    take(wait=True)


def in_flight() -> int:
    """Status copies not yet checked (for tests and benchmarks)."""
    return len(_pending)
