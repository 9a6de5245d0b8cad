"""The host cost of JAX's per-call status check (jax_ring.status's handler) on the CPU platform, by part: a jitted
``x + 1`` inside shard_map with and without ``status.check``, 3000 calls each, twice, with the handler's Python
functions timed in place (microseconds per call, summed over their calls). No GPU: the CUDA copy and event are not
in it (the CPU platform copies with a memcpy); what it shows is the Python a call pays before them.

``--cuda-stub``: then the CUDA side's Python (``_CudaSlots``: the copy's launch, its event, the query of a slot) per
call, against a stub ``libcuda.so.1`` whose functions return at once (built with the system's C compiler into a
temporary folder): what the handler's ctypes work costs on top of the driver's own.

    JAX_PLATFORMS=cpu python -m benchmarks.status_handler_cpu [--cuda-stub]     # prints one line per run
"""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def main() -> int:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from jax_ring import fused, status
    from ring_core.protocol import control

    # a ring as the lowering sees it, without a heap (as tests/cpu/test_status.py's fixture)
    fused.local_ring = lambda ctx, axis_name, ring_size: (0, np.array((4, 6)), np.arange(8, dtype=np.int32))
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("sp",))

    def program(check: bool):
        def body(words, x):
            if check:
                status.check(words, "sp", 2, 2.5)
            return x + 1

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P()))

    words = np.zeros(control.STATUS_WORDS, np.int32)
    words[3] = 1  # epoch 1, no error
    words, x = jnp.asarray(words), jnp.zeros(4)
    parts = {}
    for name in ("_answer_metadata", "_status_pointer", "_attributes", "_poll", "_execute"):
        def timed(*a, _f=getattr(status, name), _name=name, **k):
            t = time.perf_counter_ns()
            try:
                return _f(*a, **k)
            finally:
                parts[_name] = parts.get(_name, 0) + time.perf_counter_ns() - t
        setattr(status, name, timed)
    n = 3000
    for check in (False, True, False, True):
        fn = program(check)
        fn(words, x).block_until_ready()
        parts.clear()
        t = time.perf_counter()
        for _ in range(n):
            y = fn(words, x)
        y.block_until_ready()
        per = (time.perf_counter() - t) / n * 1e6
        print(f"{'check' if check else 'none '} {per:6.1f} us a call; in the handler (us a call): "
              + ", ".join(f"{k} {v / n / 1e3:.2f}" for k, v in parts.items()), flush=True)
    status.clear()
    if "--cuda-stub" in sys.argv[1:]:
        cuda_stub(status)
    return 0


_STUB = r"""
#include <stdlib.h>
#include <stdint.h>
int cuCtxGetCurrent(void **c) { *c = (void *)1; return 0; }
int cuStreamGetCtx(void *s, void **c) { *c = (void *)1; return 0; }
int cuCtxSetCurrent(void *c) { return 0; }
int cuCtxPushCurrent_v2(void *c) { return 0; }
int cuCtxPopCurrent_v2(void **c) { return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned f) { *p = calloc(1, n); return 0; }
int cuMemHostGetDevicePointer_v2(uint64_t *d, void *p, unsigned f) { *d = (uint64_t)p; return 0; }
int cuEventCreate(void **e, unsigned f) { *e = malloc(8); return 0; }
int cuEventRecord(void *e, void *s) { return 0; }
int cuEventQuery(void *e) { return 0; }
int cuEventSynchronize(void *e) { return 0; }
int cuMemcpyDtoHAsync_v2(void *d, uint64_t s, size_t n, void *st) { return 0; }
int cuModuleLoadData(void **m, const void *ptx) { *m = (void *)1; return 0; }
int cuModuleGetFunction(void **f, void *m, const char *n) { *f = (void *)1; return 0; }
int cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned sm,
                   void *s, void **params, void **extra) { return 0; }
"""


def cuda_stub(status, n: int = 20000) -> None:
    """``_CudaSlots``' Python per call (copy, then the query that finds it landed) against a driver stub."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "stub.c"), os.path.join(tmp, "libcuda.so.1")
        with open(src, "w") as f:
            f.write(_STUB)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src], check=True)
        libcuda, status._LIBCUDA = status._LIBCUDA, lib
        try:
            slots = status._CudaSlots(status.SLOTS, 1)
        finally:
            status._LIBCUDA = libcuda
        for mode in ("kernel", "dma"):
            slots.mode = mode
            for _ in range(3):
                t = time.perf_counter()
                for i in range(n):
                    slot = i % status.SLOTS
                    slots.copy(slot, 4096 + slot, 7)
                    slots.landed(slot)
                print(f"cuda stub, copy by {mode:6s}: {(time.perf_counter() - t) / n * 1e6:5.2f} us a call "
                      "(copy + landed)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
