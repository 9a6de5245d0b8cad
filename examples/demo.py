"""CPU demo: ``python examples/demo.py`` (after ``pip install -e .``).

Simulates 4 devices, runs causal zigzag GQA ring attention on a few-thousand-token sequence with the
JAX reference ring (4 simulated XLA devices) and the same inputs through torch_bridge (4 gloo processes
started here), compares both with dense float64 attention and prints a table. Under a minute on 2 cores.
"""

import os

WORLD = 4
# Simulated CPU devices must be requested before JAX creates its backend (importing jax does not).
_flag = f"--xla_force_host_platform_device_count={WORLD}"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402


def _torch_rank(rank, world_size, q, k, v, kw):
    """Runs in each gloo worker: this rank's shard through torch_bridge (reference ring)."""
    import torch

    import torch_bridge

    S = q.shape[1] // world_size
    sl = slice(rank * S, (rank + 1) * S)
    t = [torch.from_numpy(np.ascontiguousarray(x[:, sl])) for x in (q, k, v)]
    torch.distributed.barrier()
    t0 = time.perf_counter()
    out = torch_bridge.ring_attention(*t, backend="torch", **kw)
    return out.numpy(), time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=3072, help="global sequence length")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args(argv)

    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ring
    from ring_core import reference, testing
    from torch_bridge.procs import LocalGroup

    B, S, H, HKV, D, dt = 1, a.seq, a.heads, a.kv_heads, a.head_dim, "float32"
    kw = dict(is_causal=True, layout="zigzag")
    q, k, v = (x.astype(np.float32) for x in testing.random_inputs(0, B, S, H, HKV, D, dt))
    print(f"ring attention demo: batch {B}, {S} tokens, {H} query / {HKV} kv heads, head_dim {D}, {dt}, "
          f"causal, zigzag layout, world size {WORLD}")
    t0 = time.perf_counter()
    out64, _ = reference.attention(q, k, v, is_causal=True)
    t_ref = time.perf_counter() - t0
    out_lowp, _ = reference.attention_lowp(q, k, v, dt, is_causal=True)
    lay = [jax_ring.to_layout(x, "zigzag", WORLD) for x in (q, k, v)]  # numpy in layout order

    rows = []
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("sp",))
    f = jax.jit(jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="xla", **kw),
                              mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
    f(*lay).block_until_ready()  # compile
    t0 = time.perf_counter()
    out_j = np.asarray(f(*lay).block_until_ready())
    rows.append(("jax_ring", "xla", jax_ring.from_layout(out_j, "zigzag", WORLD), time.perf_counter() - t0))

    with LocalGroup(WORLD) as group:
        res = group.run(_torch_rank, *lay, kw)
    out_t = np.concatenate([r[0] for r in res], axis=1)
    rows.append(("torch_bridge", "torch", jax_ring.from_layout(out_t, "zigzag", WORLD), max(r[1] for r in res)))

    print(f"\n{'frontend':<14}{'backend':<9}{'world':>6}{'max |err| vs float64':>24}{'time (s)':>11}")
    for fw, be, out, t in rows:
        err = testing.check(f"{fw}/{be}", out, out64, out_lowp, dt)
        print(f"{fw:<14}{be:<9}{WORLD:>6}{err:>24.2e}{t:>11.3f}")
    print(f"{'numpy dense':<14}{'float64':<9}{1:>6}{0.0:>24.2e}{t_ref:>11.3f}")
    diff = testing.max_abs_err(rows[0][2], rows[1][2])
    print(f"\njax_ring vs torch_bridge: max |difference| {diff:.2e}; both within the float32 tolerance table.")


if __name__ == "__main__":
    main()
