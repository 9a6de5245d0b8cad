"""GPU checks of the training set-ups (several rings, meshes), on 4 ranks as a 2 x 2 mesh (one GPU each, or sharing
GPUs):

    source .gpu/prelude.sh; python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_rings.py --out $OUT

Every result against float64, under the frameworks' defaults (shard_map's check_vma on):
* JAX, mesh ("dp", "sp"): the batch over dp, the sequence over sp (zigzag, causal), two rings at once;
  forward (out, lse) and the gradients taken outside the shard_map (jax.grad of a loss over the global arrays);
* torch, the same rings from a DeviceMesh's "sp" group: forward and gradients bit-identical to JAX's (the same
  kernel on the same ring; every call here passes deterministic=True, since the default Hopper backward adds dQ in
  any order at head_dim 64 and 128 and so is not bitwise from run to run), then torch.compile(fullgraph=True) of a
  module calling it and torch.utils.checkpoint around it, both bit-identical to eager;
* the other axis: rings over "dp" (every rank again, in another ring: another heap slot), then "sp" again;
* JAX mesh ("sp", "tp"): heads sharded over tp, the ring over sp.
Prints one line per check; exit code 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax_ring

    jax_ring.initialize(heap_size=2 << 30)
    import jax
    import jax.numpy as jnp
    import torch
    import torch.distributed as dist
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from torch.distributed.device_mesh import init_device_mesh

    import torch_bridge
    from ring_core import layout as L
    from ring_core import reference, testing

    torch_bridge.initialize()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit(f"gpu_rings.py runs on 4 ranks (a 2 x 2 mesh), got {world}")
    dev = torch.device("cuda", torch.cuda.current_device())
    results = {}

    def check(name, fn):
        t0 = time.time()
        try:
            detail = fn() or ""
            results[name] = dict(ok=True, detail=detail)
        except Exception as e:  # noqa: BLE001 - reported, and the other checks still run
            results[name] = dict(ok=False, detail=f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        print(f"RING-CHECK rank {rank} {name}: {'ok' if results[name]['ok'] else 'FAILED'} "
              f"({time.time() - t0:.1f} s) {results[name]['detail'][:300]}", flush=True)

    # ---- data: global float64 references, bf16 inputs; the batch over dp, zigzag sequence over sp ---------
    B, S_local, H, HKV, D, dt = 2, 256, 4, 2, 64, "bfloat16"
    SP, DP = 2, 2
    q64, k64, v64, do64 = testing.random_inputs(17, B, S_local * SP, H, HKV, D, dt, with_dout=True)
    perm = L.layout_permutation(S_local * SP, SP, "zigzag")
    jmesh = Mesh(np.array(jax.devices()).reshape(DP, SP), ("dp", "sp"))
    tmesh = init_device_mesh("cuda", (DP, SP), mesh_dim_names=("dp", "sp"))
    sp_group, dp_group = tmesh.get_group("sp"), tmesh.get_group("dp")
    d_idx, s_idx = tmesh.get_local_rank("dp"), tmesh.get_local_rank("sp")
    assert rank == d_idx * SP + s_idx  # row-major, as the JAX mesh over jax.devices() in process order
    rows = slice(d_idx * (B // DP), (d_idx + 1) * (B // DP))
    mine = perm[s_idx * S_local:(s_idx + 1) * S_local]  # this rank's global token positions
    spec = P("dp", "sp")
    bf = jnp.bfloat16

    def global_array(x, dtype=bf):  # [B, S, ...] natural order -> zigzag order, sharded (dp, sp)
        z = x[:, perm]
        return jax.make_array_from_callback(z.shape, NamedSharding(jmesh, spec),
                                            lambda idx: jnp.asarray(z[idx], dtype=dtype))

    def local(arr):  # this rank's shard of a global jax array, as float64 numpy
        return np.asarray(arr.addressable_shards[0].data.astype(jnp.float32), np.float64)

    ref_out, ref_lse = reference.attention(q64, k64, v64, is_causal=True)
    low_out, low_lse = reference.attention_lowp(q64, k64, v64, dt, is_causal=True)
    ref_g = reference.attention_grad(q64, k64, v64, do64, is_causal=True)
    low_g = reference.attention_grad_lowp(q64, k64, v64, do64, dt, is_causal=True)
    pick = lambda x: x[rows][:, mine]  # noqa: E731 - this rank's part of a global [B, S, ...] array
    jax_res = {}

    def attn(q, k, v):
        return jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", is_causal=True, layout="zigzag",
                                       return_lse=True, deterministic=True)  # (bitwise checks: the docstring)

    def jax_dp_sp():
        f = jax.jit(jax.shard_map(attn, mesh=jmesh, in_specs=(spec,) * 3,
                                  out_specs=(spec, P("dp", None, "sp"))))
        out, lse = f(global_array(q64), global_array(k64), global_array(v64))
        jax_res["out"], jax_res["lse"] = out.addressable_shards[0].data, lse.addressable_shards[0].data
        e = testing.check("jax dp x sp out", local(out), pick(ref_out), pick(low_out), dt, "out")
        testing.check("jax dp x sp lse", np.asarray(jax_res["lse"], np.float64), ref_lse[rows][:, :, mine],
                      low_lse[rows][:, :, mine], dt, "lse")
        return f"max err {e:.2e}"

    def jax_grad_outside():
        f = jax.shard_map(lambda q, k, v: attn(q, k, v)[0], mesh=jmesh, in_specs=(spec,) * 3, out_specs=spec)
        loss = lambda q, k, v, do: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))  # noqa: E731
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(global_array(x) for x in (q64, k64, v64, do64)))
        jax_res["grads"] = [x.addressable_shards[0].data for x in g]
        errs = [testing.check(f"jax grad outside d{n}", local(x), pick(r), pick(lo), dt, "grad")
                for n, x, r, lo in zip("qkv", g, ref_g, low_g)]
        return f"max err {max(errs):.2e}"

    tq, tk, tv, tdo = (torch.as_tensor(pick(x), device=dev).to(torch.bfloat16) for x in (q64, k64, v64, do64))

    def torch_ring(q, k, v):
        return torch_bridge.ring_attention(q, k, v, group=sp_group, is_causal=True, layout="zigzag",
                                           backend="fused", return_lse=True, deterministic=True)

    def bits(x):
        x = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32).cpu().numpy()

    def torch_same_as_jax():
        out, lse = torch_ring(tq, tk, tv)
        torch_bridge.check_errors()
        assert np.array_equal(bits(out), np.asarray(jax_res["out"]).view(np.int16)), "out differs from JAX's"
        assert np.array_equal(lse.cpu().numpy().view(np.int32), np.asarray(jax_res["lse"]).view(np.int32))
        ts = [x.clone().requires_grad_() for x in (tq, tk, tv)]
        torch_ring(*ts)[0].backward(tdo)
        torch_bridge.check_errors()
        for n, t, j in zip("qkv", ts, jax_res["grads"]):
            assert np.array_equal(bits(t.grad), np.asarray(j).view(np.int16)), f"d{n} differs from JAX's"
        return "out, lse, dq, dk, dv bit-identical"

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch_bridge.RingAttention(group=sp_group, is_causal=True, layout="zigzag", backend="fused",
                                                   deterministic=True)

        def forward(self, q, k, v):
            return self.attn(q * 1.0, k, v)

    def eager_grads(module, checkpoint=False):
        ts = [x.clone().requires_grad_() for x in (tq, tk, tv)]
        if checkpoint:
            out = torch.utils.checkpoint.checkpoint(module, *ts, use_reentrant=False)
        else:
            out = module(*ts)
        out.backward(tdo)
        torch_bridge.check_errors()
        return [out.detach()] + [t.grad for t in ts]

    def torch_compile():
        layer = Layer()
        want = eager_grads(layer)
        got = eager_grads(torch.compile(layer, fullgraph=True))
        for n, w, g in zip(("out", "dq", "dk", "dv"), want, got):
            assert np.array_equal(bits(w), bits(g)), f"compiled {n} differs from eager"
        again = eager_grads(layer, checkpoint=True)
        for n, w, g in zip(("out", "dq", "dk", "dv"), want, again):
            assert np.array_equal(bits(w), bits(g)), f"checkpointed {n} differs from eager"
        return "fullgraph compile and checkpoint bit-identical to eager"

    def other_axis_then_back():
        # Ring over "dp" (ranks {0, 2} and {1, 3}: every rank in a second ring, another heap slot), natural layout.
        dq_, dk_, dv_ = (torch.as_tensor(x[:, mine_dp], device=dev).to(torch.bfloat16) for x in (q64, k64, v64))
        out = torch_bridge.ring_attention(dq_, dk_, dv_, group=dp_group, backend="fused")
        torch_bridge.check_errors()
        testing.check("torch dp ring out", out.float().cpu().numpy(), ref_full[:, mine_dp], low_full[:, mine_dp],
                      dt, "out")
        out, _ = torch_ring(tq, tk, tv)  # and the sp ring again, on its own slot and call counter
        torch_bridge.check_errors()
        assert np.array_equal(bits(out), np.asarray(jax_res["out"]).view(np.int16))
        return "dp rings right; sp rings again bit-identical"

    # the "dp" rings: a sequence of B rows split over dp in natural order (each rank the same batch, all rows)
    mine_dp = np.arange(d_idx * S_local, (d_idx + 1) * S_local)
    ref_full, _ = reference.attention(q64[:, :S_local * DP], k64[:, :S_local * DP], v64[:, :S_local * DP])
    low_full, _ = reference.attention_lowp(q64[:, :S_local * DP], k64[:, :S_local * DP], v64[:, :S_local * DP], dt)

    def jax_sp_tp():
        m = Mesh(np.array(jax.devices()).reshape(SP, 2), ("sp", "tp"))
        hs = P(None, "sp", "tp")
        f = jax.jit(jax.shard_map(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused"),
                                  mesh=m, in_specs=(hs,) * 3, out_specs=hs))
        arr = lambda x: jax.make_array_from_callback(x.shape, NamedSharding(m, hs),  # noqa: E731
                                                     lambda idx: jnp.asarray(x[idx], dtype=bf))
        out = f(arr(q64), arr(k64), arr(v64))
        ref, _ = reference.attention(q64, k64, v64)
        low, _ = reference.attention_lowp(q64, k64, v64, dt)
        sh = out.addressable_shards[0]
        e = testing.check("jax sp x tp out", local(out), ref[sh.index], low[sh.index], dt, "out")
        return f"heads over tp, ring over sp: max err {e:.2e}"

    for name, fn in (("jax dp x sp: forward", jax_dp_sp), ("jax dp x sp: gradients outside shard_map", jax_grad_outside),
                     ("torch DeviceMesh sp group: bit-identical to jax", torch_same_as_jax),
                     ("torch.compile(fullgraph) and checkpoint", torch_compile),
                     ("rings over the other axis, then back", other_axis_then_back),
                     ("jax sp x tp: heads over tp", jax_sp_tp)):
        check(name, fn)
    dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    ok = all(r["ok"] for per in gathered for r in per.values())
    if rank == 0:
        print(f"gpu_rings: {'ALL RING CHECKS PASSED' if ok else 'SOME RING CHECKS FAILED'}", flush=True)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "gpu_rings.json"), "w") as f:
                json.dump(dict(ok=ok, world=world, gpu=torch.cuda.get_device_name(), checks=gathered), f, indent=1)
    torch_bridge.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
