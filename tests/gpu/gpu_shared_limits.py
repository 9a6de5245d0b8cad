"""What works between ranks that share one GPU, measured (README: "Several ranks on one GPU").

Run with more ranks than GPUs, e.g. on one GPU (the launcher starts a private CUDA MPS daemon)::

    source .gpu/prelude.sh; python -m jax_ring.launch --nproc-per-node 3 tests/gpu/gpu_shared_limits.py --out $OUT

Each probe runs under a bounded wait and reports ``works`` or ``fails: <error>``; nothing here is
expected to pass or fail, it is a record. Probes, in this order (those that may leave NCCL or XLA in a
bad state last): the fused kernel through both frontends (the reference point), torch gloo collectives
on CUDA tensors (all_reduce, broadcast, all_gather), the torch reference ring (``backend="torch"``: gloo
point-to-point, CUDA tensors staged through host memory), a JAX psum across the processes, the JAX
reference ring (``backend="xla"``: ppermute), and a torch NCCL group over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_faults import start_watchdog  # noqa: E402


def probe(results, name, fn, deadline_s, rank):
    """Run ``fn`` in a thread, at most ``deadline_s`` seconds; record works / fails / hangs."""
    box = {}

    def target():
        try:
            box["detail"] = fn() or ""
        except BaseException as e:  # noqa: BLE001 - recorded
            box["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"

    t0 = time.monotonic()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(deadline_s)
    secs = round(time.monotonic() - t0, 2)
    if th.is_alive():
        results[name] = dict(result=f"hangs (no answer within {deadline_s:g} s)", seconds=secs)
    elif "error" in box:
        results[name] = dict(result=f"fails: {box['error']}", seconds=secs)
    else:
        results[name] = dict(result=f"works {box['detail']}".strip(), seconds=secs)
    print(f"SHARED-LIMIT rank {rank} {name}: {results[name]['result']} ({secs} s)", flush=True)
    return not th.is_alive()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--deadline", type=float, default=60.0, help="seconds each probe may take")
    a = ap.parse_args(argv)
    import jax_ring

    jax_ring.initialize(heap_size=1 << 30)
    import jax
    import jax.numpy as jnp
    import torch
    import torch.distributed as dist
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import torch_bridge
    from ring_core.runtime import gpus
    from ring_core import reference

    torch_bridge.initialize()
    rank, W = dist.get_rank(), dist.get_world_size()
    where = gpus.placement_from_env(torch.cuda.device_count())
    start_watchdog(12 * a.deadline + 120, rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    results = {}
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 64 * W, 4, 32)).astype(np.float32) for _ in range(3))
    ref, _ = reference.attention(q, k, v, is_causal=True)
    mine = slice(rank * 64, (rank + 1) * 64)

    def shards_torch():
        return [torch.as_tensor(x[:, mine], device=dev) for x in (q, k, v)]

    def err(out):
        return f"(max err vs float64 {np.abs(np.asarray(out, np.float64) - ref[:, mine]).max():.1e})"

    def torch_ring(backend):
        out = torch_bridge.ring_attention(*shards_torch(), is_causal=True, backend=backend)
        torch_bridge.check_errors()
        return err(out.cpu().numpy())

    def jax_ring_call(backend):
        sh = NamedSharding(mesh, P(None, "sp"))
        g = [jax.make_array_from_process_local_data(sh, jnp.asarray(x[:, mine]), x.shape) for x in (q, k, v)]
        f = jax.jit(jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                                                         backend=backend),
                                  mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
        return err(np.asarray(f(*g).addressable_shards[0].data))

    def gloo(op):
        t = torch.full((4,), float(rank + 1), device=dev)
        if op == "all_reduce":
            dist.all_reduce(t)
            assert float(t[0]) == W * (W + 1) / 2, t
        elif op == "broadcast":
            dist.broadcast(t, src=0)
            assert float(t[0]) == 1.0, t
        else:
            out = [torch.empty_like(t) for _ in range(W)]
            dist.all_gather(out, t)
            assert [float(x[0]) for x in out] == [r + 1.0 for r in range(W)], out
        torch.cuda.synchronize()

    def jax_psum():
        sh = NamedSharding(mesh, P("sp"))
        x = jax.make_array_from_process_local_data(sh, jnp.full((4,), rank + 1.0), (4 * W,))
        f = jax.jit(jax.shard_map(lambda x: lax.psum(x, "sp"), mesh=mesh, in_specs=P("sp"), out_specs=P()))
        got = np.asarray(f(x).addressable_shards[0].data)
        assert np.all(got == W * (W + 1) / 2), got

    def nccl():
        group = dist.new_group(backend="nccl")
        t = torch.ones(4, device=dev)
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
        assert float(t[0]) == W, t

    print(f"rank {rank}: {W} ranks, {where.ranks_per_gpu} per GPU, GPU {where.device}, process group "
          f"{dist.get_backend()}, MPS serving {gpus.mps_serving()}, {gpus.MPS_SHARE_ENV}="
          f"{os.environ.get(gpus.MPS_SHARE_ENV)}", flush=True)
    plan = [("fused, torch_bridge", lambda: torch_ring("fused")),
            ("fused, jax_ring", lambda: jax_ring_call("fused")),
            ("gloo all_reduce of a CUDA tensor", lambda: gloo("all_reduce")),
            ("gloo broadcast of a CUDA tensor", lambda: gloo("broadcast")),
            ("gloo all_gather of a CUDA tensor", lambda: gloo("all_gather")),
            ("torch reference ring (backend='torch', gloo)", lambda: torch_ring("torch")),
            ("JAX psum across the processes", jax_psum),
            ("JAX reference ring (backend='xla', ppermute)", lambda: jax_ring_call("xla")),
            ("torch NCCL group over the ranks", nccl)]
    for name, fn in plan:
        if not probe(results, name, fn, a.deadline, rank):
            break  # a hung collective may hold the others: stop here
    if rank == 0 and a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_shared_limits.json"), "w") as f:
            json.dump(dict(world=W, ranks_per_gpu=where.ranks_per_gpu, gpu=torch.cuda.get_device_name(),
                           results=results), f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # a failed NCCL or XLA communicator may not shut down cleanly; the record is written


if __name__ == "__main__":
    sys.exit(main())
