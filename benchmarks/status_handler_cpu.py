"""The host cost of JAX's per-call status check (jax_ring.status's handler) on the CPU platform, by part: a jitted
``x + 1`` inside shard_map with and without ``status.check``, 3000 calls each, twice, with the handler's Python
functions timed in place (microseconds per call, summed over their calls). No GPU: the CUDA copy and event are not
in it (the CPU platform copies with a memcpy); what it shows is the Python a call pays before them.

    JAX_PLATFORMS=cpu python -m benchmarks.status_handler_cpu      # prints one line per run
"""
import time

import numpy as np


def main() -> int:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from jax_ring import fused, status
    from ring_core import control

    # a ring as the lowering sees it, without a heap (as tests/test_status.py's fixture)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
