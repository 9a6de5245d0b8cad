"""GPU checks of the fused kernel, one process per GPU. Run by tests/gpu/test_gpu.py (``pytest -m gpu``), or:

    python -m jax_ring.launch --nproc-per-node 2 tests/gpu/gpu_checks.py --out /tmp/gpu_checks

Checks (every rank asserts; rank 0 writes a JSON summary under --out):
  1. fused (JAX and torch) against float64 dense attention over dtypes, odd head dims, GQA/MQA, causal
     contiguous and zigzag, seq_local not a multiple of any block, batch > 1, custom scale;
  2. parity: jax_ring fused and torch_bridge fused give bit-identical out and lse; the xla and torch
     reference backends pass the same table;
  3. soak: --calls consecutive calls with changing shapes through both frontends, every result checked;
  4. a grid far larger than the GPU holds at once (batch 16 x 64 heads x 4096 local tokens): no hang, right;
  5. bwd: the fused backward kernel (ring_core.kernels.tl_bwd) through torch autograd and jax.grad: gradients
     against float64 dense gradients (dtypes, odd head dims, GQA/MQA, causal both layouts, odd seq_local,
     seq_local 1), JAX and torch bit-identical, every frontend bit-identical from run to run; and a backward
     grid far larger than the GPU holds at once against a float32 dense reference computed on the GPU;
  6. masks: segment ids (packed documents, negative id = padding) and sliding windows
     (``window_size=(left, right)``) through both frontends' fused kernels, forward and backward: out, lse,
     dq, dk, dv against the float64 reference with the same masks (packed documents crossing shard
     boundaries with padding rows, causal zigzag bf16 D128; packed non-causal contiguous fp16 GQA 8/2 with
     an odd seq_local; a causal window crossing shard boundaries, contiguous D64; a two-sided window,
     non-causal zigzag; a window with segment ids, batch 2; fp32), JAX and torch bit-identical, the
     backward bit-identical from run to run, padding rows exactly out 0, lse -inf and zero gradients, no
     NaN anywhere. ``--mask-cases`` runs a subset (indices into the section's table).
  7. launch: a warp-specialised kernel with device-side TMA descriptors (tests/gpu/ws_attention_kernel.py), whose
     launch needs the compiled total of warps and global scratch, through jax_ring's custom call and torch's
     JIT: against float64, bit-identical.
  8. gluon: the Gluon Hopper forward (ring_core.kernels.gluon_fwd, which the plans pick on an H200 where it applies;
     on another GPU the section says so and fails) through both frontends against float64, JAX and torch
     bit-identical, and the tl kernel on the same inputs (RING_ATTENTION_GLUON=0) against float64 beside it.
  9. gluon-bwd: the Gluon Hopper backward (ring_core.kernels.gluon_bwd) on the gluon section's cases it runs at head_dim
     64 or 128, through both frontends against float64: with deterministic=False (dQ's adds in any order) and, at
     128, True (in the tickets' order, by the dQ writer: JAX and torch bit-identical, each bit-identical from run to
     run; with RING_ATTENTION_GLUON_DETERMINISTIC=0 deterministic=True runs the tl kernel, the bwd section's).
 10. gluon-bwd-masks: the Gluon backward with windows and segment ids (deterministic=False only; True
     runs the tl kernel, the masks section's): padding, windows one- and two-sided, long and short documents,
     zigzag and contiguous, GQA, with the lse gradient; gradients against float64, padding rows' exactly 0.
 11. kv-ids: a call whose keys' segment ids are not the queries' (``AttentionSpec.kv_ids``: the two-level ring's
     calls with another node's K/V), through both frontends' fused launchers, the backward in any order (the Hopper
     kernel where it applies) and with deterministic=True: out, lse, dq, dk and dv against float64 with those masks,
     JAX and torch bit-identical (dq with deterministic=True).

Ranks may share a GPU (``shared``): then no XLA collective runs between them, so the xla reference ring is
left out of the tables that use it.
"""

import argparse
import functools
import json
import os
import time

import numpy as np

import jax_ring  # noqa: E402  (initialize before JAX touches the GPU)
from ring_core.kernels.configs import GLUON_BWD_DET_HEAD_DIMS, GLUON_BWD_HEAD_DIMS  # noqa: E402
from ring_core.plans import block_d  # noqa: E402

# The sections' tables, at module level: tools/gpu_variants.py reads them to compile their kernels ahead of a run.
# (B, S, H, HKV, D, dtype, causal, layout[, scale]); S is seq_local (every rank holds S tokens).
CASES = [
    (1, 1024, 8, 8, 128, "bfloat16", True, "zigzag"),
    (2, 777, 8, 2, 80, "float16", True, "contiguous"),
    (1, 513, 4, 1, 64, "float32", False, "contiguous"),
    (1, 100, 6, 3, 96, "bfloat16", False, "contiguous", 0.3),
    (1, 64, 4, 4, 192, "bfloat16", True, "zigzag"),
    (1, 1, 2, 1, 16, "float16", True, "contiguous"),
    (3, 300, 4, 2, 112, "bfloat16", True, "zigzag"),
    (1, 256, 4, 2, 160, "float32", True, "contiguous"),
    (1, 2048, 4, 4, 256, "bfloat16", False, "contiguous"),
    (1, 334, 4, 4, 24, "float16", False, "zigzag"),
]
# The bwd section: (B, S, H, HKV, D, dtype, causal, layout[, scale[, lse in the loss]])
BWD_CASES = [
    (1, 512, 8, 8, 128, "bfloat16", True, "zigzag"),
    (1, 300, 8, 2, 80, "float16", True, "contiguous"),
    (2, 77, 4, 2, 96, "bfloat16", True, "contiguous", 0.3),
    (1, 1, 2, 1, 16, "float16", True, "contiguous"),
    (1, 130, 4, 4, 256, "bfloat16", False, "zigzag"),
    (1, 130, 4, 2, 160, "float16", True, "contiguous"),  # the portable backward's tiles above 128 in fp16, D not 2^k
    (1, 512, 8, 8, 128, "bfloat16", True, "zigzag", None, True),
    (1, 256, 4, 1, 64, "float32", False, "contiguous"),  # last: its compile takes a minute
]
# (B, S, H, HKV, D, dtype, causal, layout, window_size, segment ids). Every distinct shape, dtype and mask
# kind compiles new kernels (the window is a constexpr), so the table is short. The windows cross shard
# boundaries at any world size: (300, -1) at S=256 reaches into the previous rank's shard but not to its
# start (and, from 3 ranks, not into the one before: a ring step the kernel skips).
MASK_CASES = [
    (1, 512, 8, 8, 128, "bfloat16", True, "zigzag", None, "padded"),
    (1, 333, 8, 2, 80, "float16", False, "contiguous", None, "packed"),
    (1, 256, 4, 1, 64, "bfloat16", True, "contiguous", (300, -1), None),
    (1, 256, 4, 4, 128, "float16", False, "zigzag", (70, 45), None),
    (2, 200, 4, 2, 128, "bfloat16", True, "zigzag", (150, -1), "padded"),
    (1, 192, 4, 2, 64, "float32", False, "contiguous", (-1, 50), "packed"),  # last: fp32 compiles slowest
]
# The soak section: (B, S, H, HKV, D, dtype, causal, layout)
SOAK_SHAPES = [(1, 200, 4, 2, 64, "bfloat16", True, "zigzag"), (2, 97, 2, 1, 80, "float16", False, "contiguous"),
               (1, 512, 8, 8, 128, "bfloat16", False, "contiguous"), (1, 33, 4, 4, 32, "float32", True, "contiguous"),
               (1, 1000, 4, 1, 128, "float16", True, "zigzag")]
JIT_CASES = [(1, 256, 4, 2, 64, "bfloat16", True, "zigzag"), (1, 100, 4, 2, 64, "bfloat16", False, "contiguous")]
# The gluon section: forwards the Gluon Hopper kernel takes (ring_core.plans.gluon_applies: fp16/bf16, D 64, 128 or
# 256, seq_local a multiple of 128, zigzag 256): both layouts, causal and not, GQA and MQA, batch 2, a custom scale,
# one tile per head, many chunks; D256 (64-row K/V blocks in 2 slots: ring_core.plans.GLUON_TILES) causal zigzag
# with GQA. (B, S, H, HKV, D, dtype, causal, layout[, scale])
GLUON_CASES = [(1, 1024, 8, 2, 128, "bfloat16", True, "zigzag"), (2, 512, 4, 4, 64, "float16", False, "contiguous"),
               (1, 768, 8, 8, 128, "bfloat16", True, "contiguous"), (1, 512, 6, 3, 64, "bfloat16", True, "zigzag", 0.3),
               (1, 128, 4, 1, 128, "float16", True, "contiguous"), (1, 2048, 4, 2, 128, "bfloat16", False, "zigzag"),
               (1, 768, 8, 2, 256, "bfloat16", True, "zigzag"),
               # scale 0 (allowed): the kernels get 1e-30 (ring_core.protocol.control.kernel_scale; 0 gave NaN under
               # masks)
               (1, 512, 6, 3, 64, "bfloat16", True, "zigzag", 0.0),
               # head dims the kernels run padded (ring_core.plans.kernel_spec): 96 and 80 at 128, 192 at 256
               (1, 512, 4, 2, 96, "bfloat16", True, "zigzag"), (1, 384, 4, 4, 80, "float16", False, "contiguous"),
               (1, 512, 4, 1, 192, "bfloat16", True, "contiguous")]
# ... and with masks: packed documents with padding (a 160-token run, more than a tile, and the tail),
# windows one- and two-sided, both together, GQA, D64 / D128 / D256, both layouts, a tile of one document
# (documents longer than the tiles: blocks unmasked by their published ranges). (B, S, H, HKV, D, dtype, causal,
# layout, window, segment ids)
GLUON_MASK_CASES = [(1, 512, 8, 2, 128, "bfloat16", True, "zigzag", None, "padded"),
                    (1, 768, 4, 4, 64, "float16", True, "contiguous", (300, -1), None),
                    (1, 512, 4, 2, 128, "bfloat16", False, "zigzag", (200, 90), None),
                    (2, 512, 8, 2, 256, "bfloat16", True, "zigzag", (350, -1), "padded"),
                    (1, 1024, 8, 8, 128, "bfloat16", True, "contiguous", None, "long"),
                    (1, 256, 4, 1, 64, "bfloat16", False, "contiguous", None, "packed")]
# The gluon-bwd section: backwards the Gluon Hopper backward takes (ring_core.plans.gluon_bwd_applies: the Gluon
# forward's cases run at head_dim 64 or 128, padded ones included), the lse gradient in one; each with
# deterministic=False (the default) and, where the Gluon kernel takes it (head_dim 128, padded or not), True.
# (B, S, H, HKV, D, dtype, causal, layout, scale, lse-grad)
GLUON_BWD_CASES = [c[:8] + (c[8] if len(c) > 8 else None, i == 0) for i, c in enumerate(GLUON_CASES)
                   if block_d(c[4]) in GLUON_BWD_HEAD_DIMS]
# The gluon-bwd-masks section: the masked backwards the Gluon backward takes (deterministic=False only:
# plans.gluon_bwd_applies), the forward's masked cases at head_dim 64 and 128 and three more at D128 (a one-sided
# window, short packed documents without padding, batch 2 with both masks), each with the lse gradient (the padding
# rows' dlse selected away).
GLUON_BWD_MASK_CASES = [c for c in GLUON_MASK_CASES if c[4] in GLUON_BWD_HEAD_DIMS] + [
    (1, 768, 4, 4, 128, "float16", True, "contiguous", (300, -1), None),
    (1, 256, 4, 1, 128, "bfloat16", False, "contiguous", None, "packed"),
    (2, 512, 8, 2, 128, "bfloat16", True, "zigzag", (350, -1), "padded")]  # batch 2
# The kv-ids section: a call whose keys' segment ids are not the queries' (the two-level ring's calls with another
# node's K/V, ring_core.nodes: non-causal, contiguous), through both frontends' fused launchers directly.
# (B, S, H, HKV, D, dtype)
KV_IDS_CASES = [(1, 512, 8, 2, 128, "bfloat16"), (2, 256, 4, 4, 64, "float16")]
GRADS_CASE = (1, 128, 4, 2, 32, "float32", True, "zigzag")
BWD_BIG = (2, 4096, 32, 8, 128, "bfloat16", True, "zigzag")  # the bwd section's grid larger than the GPU holds


BIG = (16, 4096, 64, 8, 64, "bfloat16", True, "zigzag")  # the big section
BIG_REF_HEADS = 8  # heads per float32 reference computation in the big section
BIG_BWD_REF_ROWS = 1024  # query rows per float32 reference computation in the big backward grid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--sections",
                    default="cases,gluon,jit,grads,launch,bwd,gluon-bwd,gluon-bwd-masks,masks,kv-ids,soak,big",
                    help="comma-separated subset of cases,gluon,jit,grads,launch,bwd,gluon-bwd,gluon-bwd-masks,masks,"
                         "soak,big "
                         "(default: all)")
    ap.add_argument("--mask-cases", default=None,
                    help="masks section: comma-separated indices of its cases to run (default: all)")
    ap.add_argument("--gluon-cases", default=None,
                    help="gluon section: comma-separated runs to make, each 'gINDEX' (a case) or 'mINDEX' (a masked "
                         "case); default: all")
    ap.add_argument("--gluon-bwd-cases", default=None,
                    help="gluon-bwd and gluon-bwd-masks sections: comma-separated runs to make, each 'bINDEX' (a "
                         "gluon-bwd case, both orders), 'bINDEX:det' / 'bINDEX:any' (one order) or 'mINDEX' (a "
                         "gluon-bwd-masks case); default: every run of the sections asked for")
    ap.add_argument("--heap-gib", type=float, default=8.0)
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    jax_ring.initialize(heap_size=int(a.heap_gib * (1 << 30)))
    import jax
    import jax.numpy as jnp
    import torch
    import torch.distributed as dist
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import torch_bridge
    from ring_core import layout as L
    from ring_core.runtime import heap as ring_heap
    from ring_core.protocol import control
    from ring_core import plans, reference, testing, validate

    torch_bridge.initialize()
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    from ring_core.runtime import gpus

    # Ranks sharing a GPU: no NCCL between them, so no XLA collective either: the xla reference ring
    # (ppermute) cannot run there (tests/gpu/gpu_shared_limits.py); the torch one runs over gloo.
    shared = gpus.placement_from_env(torch.cuda.device_count()).shared
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    log = []

    def say(*x, every_rank=False):
        msg = " ".join(str(i) for i in x)
        if every_rank:
            msg = f"rank {rank}: {msg}"
        if rank == 0 or every_rank:
            print(msg, flush=True)
        log.append(msg)

    say(f"world {W}, devices {jax.devices()}, torch {torch.__version__}, jax {jax.__version__}")
    host_group = dist.new_group(backend="gloo")  # the references' sums across ranks (host arrays)

    def sum_over_ranks(x):
        """An all-reduce of a host array over the ranks (gloo), in x's dtype."""
        t = torch.from_numpy(np.ascontiguousarray(x))
        dist.all_reduce(t, group=host_group)
        return t.numpy()
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    jdt = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
    jax_fns = {}

    def shards(x, lay):
        """This rank's shard of a global natural-order array, in layout order."""
        S = x.shape[1] // W
        return L.layout_permutation(x.shape[1], W, lay)[rank * S:(rank + 1) * S]

    sh = NamedSharding(mesh, P(None, "sp"))  # this rank's sequence shard of a global array

    def jax_ids(seg):
        """() or (this rank's segment ids [B, S] (layout order) as the global array of the mesh,): the extra
        input of a shard_map body that takes segment ids."""
        if seg is None:
            return ()
        return (jax.make_array_from_process_local_data(sh, jnp.asarray(seg, dtype=jnp.int32),
                                                       (seg.shape[0], seg.shape[1] * W)),)

    def torch_ids(seg):
        return None if seg is None else torch.as_tensor(seg, device=dev, dtype=torch.int32)

    def run_jax(q, k, v, dt, backend, seg=None, **kw):
        """``seg``: this rank's segment ids (int32 [B, S], layout order) or None."""
        key = (q.shape, k.shape, dt, backend, seg is not None, tuple(sorted(kw.items())))
        if key not in jax_fns:
            def body(q, k, v, *ids):
                return jax_ring.ring_attention(q, k, v, axis_name="sp", backend=backend, return_lse=True,
                                               segment_ids=ids[0] if ids else None, **kw)
            jax_fns[key] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * (3 + (seg is not None)),
                                                 out_specs=(P(None, "sp"), P(None, None, "sp"))))
        g = lambda x: jax.make_array_from_process_local_data(
            sh, jnp.asarray(x, dtype=jdt[dt]), (x.shape[0], x.shape[1] * W, *x.shape[2:]))
        out, lse = jax_fns[key](g(q), g(k), g(v), *jax_ids(seg))
        if backend == "fused":
            out.block_until_ready()
            jax_ring.check_errors()  # the default error mode defers a failure (jax_ring.status), as torch's does
        return (np.asarray(out.addressable_shards[0].data.astype(jnp.float32)),
                np.asarray(lse.addressable_shards[0].data), out.addressable_shards[0].data)

    def run_torch(q, k, v, dt, backend, seg=None, **kw):
        t = lambda x: torch.as_tensor(x, device=dev).to(tdt[dt])
        out, lse = torch_bridge.ring_attention(t(q), t(k), t(v), backend=backend, return_lse=True,
                                               segment_ids=torch_ids(seg), **kw)
        if backend == "fused":
            torch_bridge.check_errors()
        return out.float().cpu().numpy(), lse.float().cpu().numpy(), out

    def bits(x):
        if isinstance(x, torch.Tensor):
            return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32).cpu().numpy()
        x = np.asarray(x)
        return x.view(np.int16 if x.dtype.itemsize == 2 else np.int32)

    def masked_rows(name, seg, out=None, lse=None, grads=()):
        """Rows of padding (``seg`` < 0: this rank's ids [B, S], layout order) attend nothing and take part in
        nothing: out exactly 0, lse exactly -inf, dq, dk and dv exactly 0 there; and no NaN anywhere (the other
        lse are finite). ``grads``: (dq, dk, dv) as numpy arrays [B, S, heads, D]."""
        pad = np.asarray(seg) < 0
        if out is not None:
            assert not np.isnan(out).any(), f"{name}: NaN in out"
            assert (out[pad] == 0).all(), f"{name}: padding rows of out are not 0 (max {np.abs(out[pad]).max()})"
        if lse is not None:
            rows = np.moveaxis(lse, 1, 2)  # [B, S, H]
            assert (rows[pad] == -np.inf).all(), f"{name}: lse of padding rows is not -inf"
            assert np.isfinite(rows[~pad]).all(), f"{name}: lse not finite on rows that attend something"
        for n, gr in zip("qkv", grads):
            assert np.isfinite(gr).all(), f"{name}: d{n} not finite"
            assert (gr[pad] == 0).all(), f"{name}: d{n} of padding rows is not 0 (max {np.abs(gr[pad]).max()})"

    def mask_name(segs, window):
        return (f" window={window}" if window is not None else "") + \
            ("" if segs is None else f" segments({int((segs < 0).sum())} padding)")

    def case(B, S, H, HKV, D, dt, causal, lay, scale=None, seed=0, refs=True, segs=None, window=None):
        """``segs``: global segment ids [B, S * W] in natural order (each rank passes its layout shard), or
        None; ``window``: window_size, or None."""
        q, k, v = testing.random_inputs(seed, B, S * W, H, HKV, D, dt)
        idx = shards(q, lay)
        ql, kl, vl = q[:, idx], k[:, idx], v[:, idx]
        seg = None if segs is None else np.ascontiguousarray(segs[:, idx])
        kw = dict(is_causal=causal, layout=lay, scale=scale)  # a forward: no backward to make deterministic
        if window is not None:
            kw["window_size"] = window
        mask = dict(segment_ids=segs, window=window)
        # This rank's rows only (q_rows): the same values as the whole reference's rows, at 1/W of the cost.
        o64, l64 = reference.attention(q, k, v, is_causal=causal, scale=scale, q_rows=idx, **mask)
        olp, llp = reference.attention_lowp(q, k, v, dt, is_causal=causal, scale=scale, q_rows=idx, **mask)
        name = f"B{B} S{S} H{H}/{HKV} D{D} {dt} causal={causal} {lay} scale={scale}{mask_name(segs, window)}"
        res = {}
        backends = [("jax", "fused"), ("torch", "fused")] + ([("jax", "xla")] if refs and not shared else []) \
            + ([("torch", "torch")] if refs else [])
        # Every call first, then the checks: a rank whose check fails must still make the calls its peers make.
        runs = {(fw, be): (run_jax if fw == "jax" else run_torch)(ql, kl, vl, dt, be, seg=seg, **kw)
                for fw, be in backends}
        for (fw, be), (o, l, raw) in runs.items():
            err = testing.check(f"{fw}/{be} {name} out", o, o64, olp, dt, "out")
            testing.check(f"{fw}/{be} {name} lse", l, l64, llp, dt, "lse")
            if seg is not None or window is not None:
                masked_rows(f"{fw}/{be} {name}", np.zeros(o.shape[:2], np.int32) if seg is None else seg, o, l)
            res[(fw, be)] = (o, l, raw, err)
        jo, jl, jraw, _ = res[("jax", "fused")]
        to, tl_, traw, _ = res[("torch", "fused")]
        same_out = np.array_equal(bits(jraw), bits(traw))
        same_lse = np.array_equal(jl.view(np.int32), tl_.view(np.int32))
        assert same_out and same_lse, f"{name}: jax and torch fused differ (out {same_out}, lse {same_lse})"
        msg = f"ok {name}: err fused {res[('jax', 'fused')][3]:.2e}"
        if refs:
            ref_be = ("torch", "torch") if shared else ("jax", "xla")
            msg += f" torch {res[('torch', 'torch')][3]:.2e}"
            msg += "" if shared else f" xla {res[('jax', 'xla')][3]:.2e}"
            msg += f" |fused-{ref_be[1]}| {testing.max_abs_err(jo, res[ref_be][0]):.2e}"
        say(msg + " bit-identical jax/torch")

    # ---- the fused backward through both frontends (the bwd and masks sections) ----------------------
    grad_fns = {}

    def grads_torch(ql, kl, vl, dol, dt, dl, seg=None, **kw):
        """Gradients of sum(out * do) + sum(lse * dl) (dl: this rank's [B, H, S] shard, float32; ``seg``: this
        rank's segment ids or None)."""
        ts = [torch.as_tensor(x, device=dev).to(tdt[dt]).requires_grad_() for x in (ql, kl, vl)]
        out, lse = torch_bridge.ring_attention(*ts, backend="fused", return_lse=True, segment_ids=torch_ids(seg),
                                               **kw)
        torch.autograd.backward([out, lse], [torch.as_tensor(dol, device=dev).to(tdt[dt]),
                                             torch.as_tensor(dl, device=dev)])
        torch_bridge.check_errors()
        return [t.grad for t in ts]

    def grads_jax(ql, kl, vl, dol, dt, dl, seg=None, **kw):
        key = (ql.shape, kl.shape, dt, seg is not None, tuple(sorted(kw.items())))
        if key not in grad_fns:
            def loss(q, k, v, do, dl, *ids):
                o, lse = jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", return_lse=True,
                                                 segment_ids=ids[0] if ids else None, **kw)
                # d loss / d o == do and d loss / d lse == dl exactly (also where lse is -inf: padding rows)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(lse * dl)
            grad_fns[key] = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                                                  in_specs=(P(None, "sp"),) * 4 + (P(None, None, "sp"),)
                                                  + (P(None, "sp"),) * (seg is not None),
                                                  out_specs=(P(None, "sp"),) * 3))
        def g(x, dtype=jdt[dt], axis=1):
            shape = list(x.shape)
            shape[axis] *= W
            return jax.make_array_from_process_local_data(
                NamedSharding(mesh, P(*[None] * axis, "sp")), jnp.asarray(x, dtype=dtype), tuple(shape))
        return [gr.addressable_shards[0].data
                for gr in grad_fns[key](g(ql), g(kl), g(vl), g(dol), g(dl, jnp.float32, 2), *jax_ids(seg))]

    def as_np(x):
        return (x.float().cpu().numpy() if isinstance(x, torch.Tensor)
                else np.asarray(x.astype(jnp.float32)))

    def bwd_case(B, S, H, HKV, D, dt, causal, lay, scale=None, use_lse=False, segs=None, window=None,
                 deterministic=True, gluon=False):
        """The fused backward through both frontends, twice each: gradients against float64; with
        ``deterministic`` JAX and torch bit-identical and each frontend bit-identical from run to run; with masks
        (``segs``: global ids [B, S * W], natural order; ``window``), padding rows' gradients exactly 0 and no NaN.
        deterministic=False: whose dQ sums come in no fixed order: each run against float64 only. ``gluon``: the
        plan must launch the Gluon backward (``gluon_bwd_applies`` holds for every such case here). Raises
        AssertionError."""
        name = (f"bwd B{B} S{S} H{H}/{HKV} D{D} {dt} causal={causal} {lay} scale={scale} lse-grad={use_lse}"
                f"{mask_name(segs, window)}{' gluon' if gluon else ''}{'' if deterministic else ' any-order'}")
        if gluon:
            spec = validate.check_attention_args((B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dt, dt, dt,
                                                 is_causal=causal, scale=scale, layout=lay, backend="fused",
                                                 backends=("fused",), window_size=window,
                                                 segment_ids_shape=None if segs is None else (B, S),
                                                 segment_ids_dtype=None if segs is None else "int32")
            h = ring_heap.get()
            kernel = h.plan_bwd(h.kernel_spec(spec), W, deterministic=deterministic).kernel().__name__
            assert kernel == "ring_attn_bwd_gluon", f"{name}: the plan launches {kernel} on this GPU"
        t1 = time.time()
        q, k, v, do = testing.random_inputs(40 + len(name), B, S * W, H, HKV, D, dt, with_dout=True)
        idx = shards(q, lay)
        seg = None if segs is None else np.ascontiguousarray(segs[:, idx])
        kw = dict(is_causal=causal, layout=lay, scale=scale, deterministic=deterministic)
        if window is not None:
            kw["window_size"] = window
        mask = dict(segment_ids=segs, window=window)
        dl = np.random.default_rng(len(name)).standard_normal((B, H, S * W)).astype(np.float32) * use_lse
        # This rank's queries' share of the references (dq of its rows; dk, dv summed over the ranks' shares),
        # at 1/W of the whole computation's cost: at 8 ranks the whole one took most of a case's minute.
        share = dict(q_rows=idx, reduce=sum_over_ranks)
        ref = reference.attention_grad(q, k, v, do, is_causal=causal, scale=scale, dlse=dl, **mask, **share)
        low = reference.attention_grad_lowp(q, k, v, do, dt, is_causal=causal, scale=scale, dlse=dl, **mask, **share)
        local = [x[:, idx] for x in (q, k, v, do)] + [dt, np.ascontiguousarray(dl[:, :, idx])]
        # Every call first, then the checks: a rank whose check fails must still make its peers' calls.
        tg, jg, tg2, jg2 = (f(*local, seg=seg, **kw) for f in (grads_torch, grads_jax) * 2)
        errs = []
        for fw, gs in (("torch", tg), ("jax", jg)):
            for n, gr, r, lo in zip("qkv", gs, ref, low):
                if n != "q":  # dq's references hold this rank's rows already
                    r, lo = r[:, idx], lo[:, idx]
                errs.append(testing.check(f"{fw} fused {name} d{n}", as_np(gr), r, lo, dt, "grad"))
            if seg is not None or window is not None:
                masked_rows(f"{fw} fused {name}", np.zeros((B, S), np.int32) if seg is None else seg,
                            grads=[as_np(gr) for gr in gs])
        if not deterministic:
            for fw, gs in (("torch", tg2), ("jax", jg2)):  # the second runs too: each against float64
                for n, gr, r, lo in zip("qkv", gs, ref, low):
                    if n != "q":
                        r, lo = r[:, idx], lo[:, idx]
                    errs.append(testing.check(f"{fw} fused {name} d{n} (again)", as_np(gr), r, lo, dt, "grad"))
            diff = max(testing.max_abs_err(as_np(a_), as_np(b_)) for a_, b_ in zip(tg, jg))
            say(f"ok {name}: max grad err {max(errs):.2e}, |jax-torch| {diff:.2e} ({time.time() - t1:.1f} s)")
            return
        for n, a_, b_ in zip("qkv", jg, tg):
            assert np.array_equal(bits(a_), bits(b_)), f"{name}: jax and torch fused d{n} differ"
        for n, a_, b_, c_, d_ in zip("qkv", tg, tg2, jg, jg2):
            assert np.array_equal(bits(a_), bits(b_)), f"{name}: torch fused d{n} differs between runs"
            assert np.array_equal(bits(c_), bits(d_)), f"{name}: jax fused d{n} differs between runs"
        say(f"ok {name}: max grad err {max(errs):.2e}, jax/torch bit-identical, deterministic "
            f"({time.time() - t1:.1f} s)")

    summary = {"world": W, "ranks_per_gpu": gpus.placement_from_env(torch.cuda.device_count()).ranks_per_gpu,
               "gpu": torch.cuda.get_device_name()}
    t0 = time.time()
    cases = CASES
    failed = []

    def keep_going(run, what, tag=None):
        """Run one check; an AssertionError is kept in ``failed`` (``tag``: its prefix there) and said on every
        rank, and the run goes on: one run on the GPU machine should report every failing case, not the first, and
        every rank still makes the same calls."""
        try:
            run()
        except AssertionError as e:
            failed.append(str(e) if tag is None else f"{tag}: {e}")
            say(f"FAILED {what}: {e}", every_rank=True)

    if "cases" in sections:  # a section's figures only where it ran (stages add their sections to one file)
        for c in cases:
            t1 = time.time()
            keep_going(lambda: case(*c), c)
            say(f"   ({time.time() - t1:.1f} s)")
        summary.update(cases=len(cases), cases_s=round(time.time() - t0, 1), cases_failed=failed)

    # ---- the Gluon Hopper forward against float64 and against the tl kernel ------------------------
    def segment_ids(kind, seed, B, n):
        """Global segment ids [B, n] in natural order (None for None): documents of up to n/5 tokens packed
        back to back, crossing shard boundaries; "padded" adds padding (id -1): a run of 160 tokens (more
        than a 128-row query tile, so some tile of a rank may hold nothing else) a third of the way in,
        and the last 37 tokens; "long": documents of 600 tokens (whole tiles and blocks inside one document)."""
        if kind is None:
            return None
        if kind == "long":
            return np.ascontiguousarray(np.broadcast_to(np.arange(n, dtype=np.int32) // 600, (B, n)))
        ids = testing.random_segment_ids(seed, B, n, max_len=max(2, n // 5), padding=False)
        if kind == "padded":
            ids[:, n // 3:n // 3 + min(160, n // 6)] = -1
            ids[:, n - 37:] = -1
        return ids

    def gluon_case(B, S, H, HKV, D, dt, causal, lay, scale=None, window=None, kind=None, seed=0):
        """``window``: window_size or None; ``kind``: segment ids as ``segment_ids`` makes them (None: none)."""
        segs = segment_ids(kind, 400 + seed, B, S * W)
        name = (f"gluon B{B} S{S} H{H}/{HKV} D{D} {dt} causal={causal} {lay} scale={scale}"
                f"{mask_name(segs, window)}")
        spec = validate.check_attention_args((B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dt, dt, dt,
                                             is_causal=causal, scale=scale, layout=lay, backend="fused",
                                             backends=("fused",), window_size=window,
                                             segment_ids_shape=None if segs is None else (B, S),
                                             segment_ids_dtype=None if segs is None else "int32")
        h = ring_heap.get()
        kernel = h.plan(h.kernel_spec(spec), W).kernel().__name__
        assert kernel == "ring_attn_fwd_gluon", f"{name}: the plan launches {kernel} on this GPU"
        q, k, v = testing.random_inputs(11 + S + H + seed, B, S * W, H, HKV, D, dt)
        idx = shards(q, lay)
        ql, kl, vl = q[:, idx], k[:, idx], v[:, idx]
        seg = None if segs is None else np.ascontiguousarray(segs[:, idx])
        kw = dict(is_causal=causal, layout=lay, scale=scale)
        if window is not None:
            kw["window_size"] = window
        mask = dict(segment_ids=segs, window=window)
        o64, l64 = reference.attention(q, k, v, is_causal=causal, scale=scale, q_rows=idx, **mask)
        olp, llp = reference.attention_lowp(q, k, v, dt, is_causal=causal, scale=scale, q_rows=idx, **mask)
        jo, jl, jraw = run_jax(ql, kl, vl, dt, "fused", seg=seg, **kw)
        to, tl_, traw = run_torch(ql, kl, vl, dt, "fused", seg=seg, **kw)
        os.environ[plans.GLUON_ENV] = "0"  # the tl kernel, same inputs (torch; read at each call's plan)
        try:
            lo, ll, _ = run_torch(ql, kl, vl, dt, "fused", seg=seg, **kw)
        finally:
            del os.environ[plans.GLUON_ENV]
        errs = {}
        for what, o, l in (("jax", jo, jl), ("torch", to, tl_), ("tl", lo, ll)):
            errs[what] = testing.check(f"{what} {name} out", o, o64, olp, dt, "out")
            testing.check(f"{what} {name} lse", l, l64, llp, dt, "lse")
            if seg is not None or window is not None:
                masked_rows(f"{what} {name}", np.zeros(o.shape[:2], np.int32) if seg is None else seg, o, l)
        assert np.array_equal(bits(jraw), bits(traw)) and np.array_equal(jl.view(np.int32), tl_.view(np.int32)), \
            f"{name}: jax and torch fused differ"
        say(f"ok {name}: err gluon {errs['torch']:.2e} tl {errs['tl']:.2e} |gluon-tl| "
            f"{testing.max_abs_err(to, lo):.2e}, bit-identical jax/torch")

    if "gluon" in sections:
        t0, made = time.time(), 0
        chosen = None if a.gluon_cases is None else {r.strip() for r in a.gluon_cases.split(",") if r.strip()}
        for i, c in enumerate(GLUON_CASES):
            if chosen is None or f"g{i}" in chosen:
                made += 1
                keep_going(lambda: gluon_case(*c), c)
        for i, c in enumerate(GLUON_MASK_CASES):
            if chosen is None or f"m{i}" in chosen:
                made += 1
                keep_going(lambda: gluon_case(*c[:8], scale=None, window=c[8], kind=c[9], seed=i), c)
        summary["gluon_cases"] = made
        summary["gluon_s"] = round(time.time() - t0, 1)

    # ---- the Gluon Hopper backward (deterministic=False) against float64 ----------------------------
    runs = None if a.gluon_bwd_cases is None else {r.strip() for r in a.gluon_bwd_cases.split(",") if r.strip()}

    def chosen_run(case, order=None):
        """Whether --gluon-bwd-cases asks for this run (a case, in ``order`` where it has two)."""
        return runs is None or case in runs or (order is not None and f"{case}:{order}" in runs)

    if "gluon-bwd" in sections:
        t0, made = time.time(), 0
        for ci, c in enumerate(GLUON_BWD_CASES):  # each in both orders of dQ's adds (the deterministic one: plans)
            for det in (False, True):
                if not chosen_run(f"b{ci}", "det" if det else "any") or (
                        det and block_d(c[4]) not in GLUON_BWD_DET_HEAD_DIMS):  # (the tl split: the bwd section's)
                    continue
                made += 1
                with control.environ(**{plans.GLUON_DET_ENV: "1" if det else "0"}):
                    keep_going(lambda: bwd_case(*c[:8], scale=c[8], use_lse=c[9], deterministic=det, gluon=True),
                               c + (det,))
        summary["gluon_bwd_cases"] = made
        summary["gluon_bwd_s"] = round(time.time() - t0, 1)
    if "gluon-bwd-masks" in sections:  # any order only: masks run the tl kernel with deterministic=True
        t0, made = time.time(), 0
        for i, c in enumerate(GLUON_BWD_MASK_CASES):
            if not chosen_run(f"m{i}"):
                continue
            made += 1
            keep_going(lambda: bwd_case(*c[:8], use_lse=True, segs=segment_ids(c[9], 500 + i, c[0], c[1] * W),
                                        window=c[8], deterministic=False, gluon=True), c)
        summary["gluon_bwd_mask_cases"] = made
        summary["gluon_bwd_masks_s"] = round(time.time() - t0, 1)

    # ---- two fused calls of different shapes in one jitted program -------------------------------
    if "jit" in sections:
        ca, cb = JIT_CASES
        (qa, ka, va), (qb, kb, vb) = (testing.random_inputs(7 + i, c[0], c[1] * W, *c[2:6]) for i, c in
                                      enumerate(JIT_CASES))
        ia, ib = shards(qa, ca[7]), shards(qb, cb[7])

        def two(qa, ka, va, qb, kb, vb):
            oa = jax_ring.ring_attention(qa, ka, va, axis_name="sp", backend="fused", is_causal=ca[6], layout=ca[7])
            ob = jax_ring.ring_attention(qb, kb, vb, axis_name="sp", backend="fused", is_causal=cb[6], layout=cb[7])
            return oa, ob
        f2 = jax.jit(jax.shard_map(two, mesh=mesh, in_specs=(P(None, "sp"),) * 6, out_specs=(P(None, "sp"),) * 2))
        g = lambda x: jax.make_array_from_process_local_data(sh, jnp.asarray(x, dtype=jnp.bfloat16),
                                                             (x.shape[0], x.shape[1] * W, *x.shape[2:]))
        oa, ob = f2(*(g(x[:, ia]) for x in (qa, ka, va)), *(g(x[:, ib]) for x in (qb, kb, vb)))
        for name, o, (q, k, v), idx, causal in (("a", oa, (qa, ka, va), ia, ca[6]), ("b", ob, (qb, kb, vb), ib, cb[6])):
            o64, _ = reference.attention(q, k, v, is_causal=causal, q_rows=idx)
            olp, _ = reference.attention_lowp(q, k, v, "bfloat16", is_causal=causal, q_rows=idx)
            testing.check(f"two-in-one-jit {name}", np.asarray(o.addressable_shards[0].data.astype(jnp.float32)),
                          o64, olp, "bfloat16")
        say("ok two fused calls of different shapes in one jitted program")

    # ---- gradients through backend="fused" (torch autograd and jax.grad) --------------------------
    if "grads" in sections:
        B, S, H, HKV, D, dt, causal, lay = GRADS_CASE
        assert (dt, causal, lay) == ("float32", True, "zigzag"), "the grads section's calls below say so"
        q, k, v, do = testing.random_inputs(11, B, S * W, H, HKV, D, dt, with_dout=True)
        idx = shards(q, "zigzag")
        ref = reference.attention_grad(q, k, v, do, is_causal=True)
        low = reference.attention_grad_lowp(q, k, v, do, "float32", is_causal=True)
        ts = [torch.as_tensor(x[:, idx], device=dev, dtype=torch.float32).requires_grad_() for x in (q, k, v)]
        out = torch_bridge.ring_attention(*ts, is_causal=True, layout="zigzag", backend="fused")
        out.backward(torch.as_tensor(do[:, idx], device=dev, dtype=torch.float32))
        for n, t, r, l in zip("qkv", ts, ref, low):
            testing.check(f"torch fused d{n}", t.grad.cpu().numpy(), r[:, idx], l[:, idx], "float32", "grad")

        def loss(q, k, v, do):
            o = jax_ring.ring_attention(q, k, v, axis_name="sp", backend="fused", is_causal=True, layout="zigzag")
            return jnp.sum(o * do)
        gf = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(P(None, "sp"),) * 4,
                                   out_specs=(P(None, "sp"),) * 3))
        g32 = lambda x: jax.make_array_from_process_local_data(sh, jnp.asarray(x[:, idx], dtype=jnp.float32),
                                                               (x.shape[0], x.shape[1], *x.shape[2:]))
        grads = gf(g32(q), g32(k), g32(v), g32(do))
        for n, gr, r, l in zip("qkv", grads, ref, low):
            testing.check(f"jax fused d{n}", np.asarray(gr.addressable_shards[0].data), r[:, idx], l[:, idx],
                          "float32", "grad")
        say("ok gradients through backend='fused' (torch and jax) against float64")

    # ---- the fused backward kernel ---------------------------------------------------------------
    if "bwd" in sections:
        t0 = time.time()
        bwd_cases = BWD_CASES
        for c in bwd_cases:
            keep_going(lambda: bwd_case(*c[:8], scale=c[8] if len(c) > 8 else None, use_lse=len(c) > 9 and c[9]), c)

        # A backward grid far larger than the GPU holds at once (tasks are taken by ticket: no hang whatever
        # the residency). Reference: float32 dense gradients on the GPU; the table's bound with it standing in
        # for float64 (its own error is far below bf16's). Each rank computes its own queries' share only, one
        # (batch, kv head) and BIG_BWD_REF_ROWS query rows at a time: dq of its rows, and their contributions to
        # dk and dv over every key, summed over the ranks on the host (gloo). The whole-sequence reference on
        # every rank needed [G, S*W, S*W] scores and three more of that size per rank: out of memory with eight
        # ranks on one GPU.
        B, S, H, HKV, D, dt = BWD_BIG[:6]
        assert BWD_BIG[5:] == ("bfloat16", True, "zigzag"), "the calls below say so"
        G = H // HKV
        torch.manual_seed(2)  # the same global inputs on every rank
        qg, dog = (torch.randn(B, S * W, H, D, device=dev).to(torch.bfloat16) for _ in range(2))
        kg, vg = (torch.randn(B, S * W, HKV, D, device=dev).to(torch.bfloat16) for _ in range(2))
        perm = torch.as_tensor(L.layout_permutation(S * W, W, "zigzag"), device=dev)
        idx_t = perm[rank * S:(rank + 1) * S]
        ts = [x.index_select(1, idx_t).contiguous().requires_grad_() for x in (qg, kg, vg)]
        t1 = time.time()
        out = torch_bridge.ring_attention(*ts, is_causal=True, layout="zigzag", backend="fused")
        out.backward(dog.index_select(1, idx_t).contiguous())
        torch_bridge.check_errors()
        torch.cuda.synchronize()
        big_s = time.time() - t1
        scale = D ** -0.5
        k_pos = torch.arange(S * W, device=dev)
        dk_share = torch.zeros(B, S * W, HKV, D, device=dev)
        dv_share = torch.zeros(B, S * W, HKV, D, device=dev)
        worst = {}

        def note(n, got, r):
            """Keep the worst error of ``got`` against the reference rows ``r`` and of r's own bf16 rounding."""
            e = (got.float() - r).abs().max().item()
            e_lp = (r.bfloat16().float() - r).abs().max().item()
            worst[n] = (max(worst.get(n, (0, 0))[0], e), max(worst.get(n, (0, 0))[1], e_lp))

        for b in range(B):
            for hk in range(HKV):
                hs = slice(hk * G, (hk + 1) * G)
                kk, vv = kg[b, :, hk].float(), vg[b, :, hk].float()  # [SW, D]
                for r0 in range(0, S, BIG_BWD_REF_ROWS):
                    rows = idx_t[r0:r0 + BIG_BWD_REF_ROWS]  # natural positions of this rank's tokens r0..
                    qq = qg[b, rows, hs].float().transpose(0, 1)  # [G, rows, D]
                    dd = dog[b, rows, hs].float().transpose(0, 1)
                    s_ = torch.where(k_pos[None, :] <= rows[:, None], (qq @ kk.T) * scale, float("-inf"))
                    p_ = torch.softmax(s_, dim=-1)
                    ds = p_ * (dd @ vv.T - (dd * (p_ @ vv)).sum(-1, keepdim=True))
                    note("q", ts[0].grad[b, r0:r0 + len(rows), hs], (ds @ kk * scale).transpose(0, 1))
                    dk_share[b, :, hk] += (ds.transpose(1, 2) @ qq).sum(0) * scale
                    dv_share[b, :, hk] += (p_.transpose(1, 2) @ dd).sum(0)
                    del s_, p_, ds
        for n, share, got in (("k", dk_share, ts[1].grad), ("v", dv_share, ts[2].grad)):
            whole = torch.from_numpy(sum_over_ranks(share.cpu().numpy())).to(dev)
            note(n, got, whole.index_select(1, idx_t))
        del dk_share, dv_share
        spec_big = validate.check_attention_args(tuple(ts[0].shape), tuple(ts[1].shape), tuple(ts[2].shape), dt, dt,
                                                 dt, is_causal=True, scale=None, layout="zigzag", backend="fused",
                                                 backends=("fused",))
        programs = ring_heap.get().plan_bwd(spec_big, W).grid[0]
        msg = [f"{programs} programs per rank"]
        for n, (e, e_lp) in worst.items():
            bound = 2 * e_lp + testing.TOLERANCES[dt]["grad"]
            msg.append(f"d{n} err {e:.2e} (bound {bound:.2e})")
            if not e <= bound:
                failed.append(f"big backward grid d{n}: err {e} > bound {bound}")
        say(f"bwd big grid: B{B} S{S} H{H}/{HKV} D{D} bf16 causal zigzag, {big_s:.2f} s first call; " + ", ".join(msg))
        summary.update(bwd_cases=len(bwd_cases), bwd_s=round(time.time() - t0, 1), bwd_big_first_call_s=round(big_s, 2))

    # ---- masks: segment ids and sliding windows through both frontends' fused kernels ---------
    if "masks" in sections:
        t0 = time.time()

        mask_cases = MASK_CASES
        chosen = (range(len(mask_cases)) if a.mask_cases is None
                  else [int(i) for i in a.mask_cases.split(",") if i.strip()])
        for i in chosen:
            B, S, H, HKV, D, dt, causal, lay, window, kind = mask_cases[i]
            segs = segment_ids(kind, 300 + i, B, S * W)
            t1 = time.time()
            # Forward then backward, each making every call before its checks; a failure of either is kept
            # and the next part still runs, so every rank makes the same calls whatever fails where.
            for part, run in (("fwd", lambda: case(B, S, H, HKV, D, dt, causal, lay, seed=200 + i, refs=False,
                                                   segs=segs, window=window)),
                              ("bwd", lambda: bwd_case(B, S, H, HKV, D, dt, causal, lay, use_lse=True, segs=segs,
                                                       window=window))):
                keep_going(run, f"masks case {i} {part} {mask_cases[i]}", f"masks case {i} {part}")
            say(f"   masks case {i}: {time.time() - t1:.1f} s")
        summary.update(mask_cases=len(chosen), masks_s=round(time.time() - t0, 1))

    # ---- a launch that needs the compiled kernel's total warps and its global scratch -----------------
    if "launch" in sections:
        # tests/gpu/ws_attention_kernel.py: warp-specialised (more warps than the 4 asked for) and with device-side
        # TMA descriptors (global scratch); jax_ring._triton_call must launch exactly what ring_core.runtime.build
        # compiled, and torch's JIT launches the same binary.
        import triton
        import ws_attention_kernel as wsk
        from jax_ring import _triton_call
        from ring_core.runtime import build

        Hh, Sq, Dd = 4, 1024, 128
        rng = np.random.default_rng(5)
        xs = [np.asarray(jnp.asarray(rng.standard_normal((Hh * Sq, Dd)), jnp.bfloat16).astype(jnp.float32))
              for _ in range(3)]  # bf16 values
        scale = Dd ** -0.5
        kw = dict(wsk.CONSTEXPRS, H=Hh, D=Dd)
        call = jax.jit(lambda q, k, v: _triton_call.triton_call(
            q, k, v, np.float32(scale), Sq, kernel=wsk.ws_attention_kernel,
            out_shape=[jax.ShapeDtypeStruct((Hh * Sq, Dd), jnp.bfloat16)], grid=wsk.grid(Hh, Sq),
            name="ws_attention", num_warps=wsk.NUM_WARPS, num_stages=wsk.NUM_STAGES, scalar_types=("fp32", "i32"),
            **kw)[0])
        jo = call(*(jnp.asarray(x, jnp.bfloat16) for x in xs))
        triton.set_allocator(lambda size, align, stream: torch.empty(size, device=dev, dtype=torch.int8))
        tq = [torch.as_tensor(x, device=dev).bfloat16() for x in xs]
        to = torch.empty_like(tq[0])
        wsk.ws_attention_kernel[wsk.grid(Hh, Sq)](*tq, scale, Sq, to, num_warps=wsk.NUM_WARPS,
                                                  num_stages=wsk.NUM_STAGES, **kw)
        ref = wsk.reference(*xs, Hh, scale)
        low = np.asarray(jnp.asarray(ref, jnp.bfloat16).astype(jnp.float32))
        b = build.binary(wsk.ws_attention_kernel, ["*bf16"] * 3 + ["fp32", "i32", "*bf16"], kw,
                         num_warps=wsk.NUM_WARPS, num_stages=wsk.NUM_STAGES, capability=_triton_call.capability())
        try:
            errs = [testing.check(f"{fw} warp-specialised TMA kernel", np.asarray(o, np.float32), ref, low,
                                  "bfloat16") for fw, o in (("jax", jo.astype(jnp.float32)), ("torch", to.float().cpu()))]
            assert np.array_equal(bits(jo), bits(to)), "the JAX and torch launches of one binary differ"
            say(f"ok a warp-specialised TMA kernel ({b.num_warps} warps, {b.global_scratch} B of global scratch per "
                f"program) launched by JAX and torch: err {max(errs):.2e}, bit-identical")
        except AssertionError as e:
            failed.append(str(e))
            say(f"FAILED launch: {e}", every_rank=True)

    # ---- the keys' ids apart from the queries' (KV_IDS): JAX == torch bitwise, against float64 -------------
    if "kv-ids" in sections:
        import dataclasses

        from jax_ring import fused as jax_fused
        from torch_bridge import fused as torch_fused

        for i, (B, S, H, HKV, D, dt) in enumerate(KV_IDS_CASES):
            name = f"kv-ids B{B} S_local {S} H{H}/{HKV} D{D} {dt}"
            q, k, v, dout = testing.random_inputs(300 + i, B, S * W, H, HKV, D, dt, with_dout=True)
            qi = testing.crossing_documents(B, S * W)
            ki = np.roll(qi, S // 3, axis=1)  # other ids for the keys: documents that start elsewhere
            idx = shards(q, "contiguous")
            seg = np.stack([qi[:, idx], ki[:, idx]])
            spec = dataclasses.replace(validate.check_attention_args(
                (B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dt, dt, dt, is_causal=False, scale=None,
                layout="contiguous", backend="fused", backends=("fused",), segment_ids_shape=(B, S),
                segment_ids_dtype="int32"), kv_ids=True)
            t = lambda x: torch.as_tensor(np.ascontiguousarray(x), device=dev).to(tdt[dt])  # noqa: E731
            tq, tk, tv, tdo = (t(x[:, idx]) for x in (q, k, v, dout))
            tseg = torch.as_tensor(seg, device=dev, dtype=torch.int32)
            t_out, t_lse = torch_fused.forward(tq, tk, tv, spec, segment_ids=tseg)
            # deterministic=False: the Hopper backward where it applies (dQ's adds in any order); True: a fixed order
            t_grads, t_det = (torch_fused.backward(tq, tk, tv, t_out, t_lse, tdo, spec, segment_ids=tseg,
                                                   deterministic=det) for det in (False, True))
            torch_bridge.check_errors()

            def body(q, k, v, do, ids, det):  # ids: this rank's [2, B, S]
                out, lse = jax_fused.forward(q, k, v, spec, "sp", W, segment_ids=ids)
                return (out, lse, *jax_fused.backward(q, k, v, out, lse, do, jnp.zeros_like(lse), spec, "sp", W,
                                                        segment_ids=ids, deterministic=det))

            row, ids_row = P(None, "sp"), P(None, None, "sp")
            g = lambda x: jax.make_array_from_process_local_data(  # noqa: E731
                sh, jnp.asarray(x[:, idx], dtype=jdt[dt]), x.shape)
            ids_g = jax.make_array_from_process_local_data(NamedSharding(mesh, ids_row), jnp.asarray(seg),
                                                           (2, B, S * W))
            j_res, j_det = (jax.jit(jax.shard_map(functools.partial(body, det=det), mesh=mesh,
                                                  in_specs=(row,) * 4 + (ids_row,),
                                                  out_specs=(row, ids_row, row, row, row)))(
                g(q), g(k), g(v), g(dout), ids_g) for det in (False, True))
            jax_ring.check_errors()
            # float64 and the low-precision pipeline, with the queries' ids apart from the keys' (reference's pair)
            mask = dict(segment_ids=(qi, ki), q_rows=idx)
            o64, l64 = reference.attention(q, k, v, scale=spec.scale, **mask)
            olp, llp = reference.attention_lowp(q, k, v, dt, scale=spec.scale, **mask)
            share = dict(mask, reduce=sum_over_ranks)
            ref = reference.attention_grad(q, k, v, dout, scale=spec.scale, **share)
            low = reference.attention_grad_lowp(q, k, v, dout, dt, scale=spec.scale, **share)
            try:
                # bit for bit: everything with deterministic=True; out, lse, dk, dv without (dQ's adds in any order)
                for what, a_t, a_j, det in [(w, a, b, True) for w, a, b in zip(
                        ("out", "lse", "dq", "dk", "dv"), (t_out, t_lse, *t_det), j_det)] + [
                        (w, a, b, False) for w, a, b in zip(("dk", "dv"), t_grads[1:], j_res[3:])]:
                    jb = np.asarray(a_j.addressable_shards[0].data)
                    if not np.array_equal(bits(a_t), bits(jb)):
                        raise AssertionError(f"{name}: JAX's {what} is not torch's bit for bit (deterministic={det})")
                as_np = lambda x: x.float().cpu().numpy()  # noqa: E731
                err = testing.check(f"{name} out", as_np(t_out), o64, olp, dt, "out")
                testing.check(f"{name} lse", as_np(t_lse), l64, llp, dt, "lse")
                j_np = lambda x: np.asarray(x.addressable_shards[0].data).astype(np.float32)  # noqa: E731
                runs = [("torch", t_grads, as_np), ("torch, deterministic", t_det, as_np), ("JAX", j_res[2:], j_np)]
                gerr = max(testing.check(f"{name} d{n} ({how})", conv(gr), r if n == "q" else r[:, idx],
                                         lo if n == "q" else lo[:, idx], dt, "grad")
                           for how, grads, conv in runs for n, gr, r, lo in zip("qkv", grads, ref, low))
                say(f"ok {name}: out err {err:.2e}, grad err {gerr:.2e} against float64 (both backwards, both "
                    "frontends); JAX == torch bit for bit (out, lse, dk, dv; dq with deterministic=True)")
            except AssertionError as e:
                failed.append(str(e))
                say(f"FAILED {e}", every_rank=True)

    # ---- soak: consecutive calls with changing shapes through both frontends ----------------------
    if "soak" in sections:
        t0 = time.time()
        shapes = SOAK_SHAPES
        prepared = []
        for i, (B, S, H, HKV, D, dt, causal, lay) in enumerate(shapes):
            q, k, v = testing.random_inputs(100 + i, B, S * W, H, HKV, D, dt)
            idx = shards(q, lay)
            o64, _ = reference.attention(q, k, v, is_causal=causal, q_rows=idx)
            olp, _ = reference.attention_lowp(q, k, v, dt, is_causal=causal, q_rows=idx)
            prepared.append((q[:, idx], k[:, idx], v[:, idx], o64, olp, dt, dict(is_causal=causal, layout=lay)))
        bad = 0
        for n in range(a.calls):
            ql, kl, vl, o64, olp, dt, kw = prepared[n % len(prepared)]
            fw = run_jax if (n // len(prepared)) % 2 else run_torch
            o, _, _ = fw(ql, kl, vl, dt, "fused", **kw)
            try:
                testing.check(f"soak call {n}", o, o64, olp, dt, "out")
            except AssertionError as e:
                bad += 1
                say(str(e))
        summary.update(soak_calls=a.calls, soak_bad=bad, soak_s=round(time.time() - t0, 1))
        say(f"soak: {a.calls} calls, {bad} wrong, {summary['soak_s']} s")
        assert bad == 0

    # ---- a grid far larger than the GPU holds at once ---------------------------------------------
    if "big" in sections and not a.skip_big:
        B, S, H, HKV, D, dt = BIG[:6]
        assert BIG[5:] == ("bfloat16", True, "zigzag"), "the calls below say so"
        torch.manual_seed(1)  # same global inputs on every rank
        qg = torch.randn(B, S * W, H, D, device=dev, dtype=torch.bfloat16)
        kg = torch.randn(B, S * W, HKV, D, device=dev, dtype=torch.bfloat16)
        vg = torch.randn(B, S * W, HKV, D, device=dev, dtype=torch.bfloat16)
        perm = torch.as_tensor(L.layout_permutation(S * W, W, "zigzag"), device=dev)
        idx = perm[rank * S:(rank + 1) * S]
        ql, kl, vl = (x.index_select(1, idx).contiguous() for x in (qg, kg, vg))
        t0 = time.time()
        out = torch_bridge.ring_attention(ql, kl, vl, is_causal=True, layout="zigzag", backend="fused")
        torch_bridge.check_errors()
        torch.cuda.synchronize()
        dt_big = time.time() - t0
        grid = B * H * -(-S // 128)
        # reference: this rank's queries against the whole sequence, float32 math, one batch and a group of
        # heads at a time: [heads, S, S*W] float32 scores are 2 GiB at W=4 for 8 heads (all 64: 16 GiB, and W
        # ranks sharing one GPU each hold that at once)
        err = err_lp = 0.0
        mask = (idx[:, None] >= torch.arange(S * W, device=dev)[None, :])
        torch.cuda.empty_cache()  # the earlier sections' cached blocks, for the other ranks on this GPU
        for b in range(B):
            for h0 in range(0, H, BIG_REF_HEADS):
                hs = slice(h0, h0 + BIG_REF_HEADS)
                qb = ql[b, :, hs].transpose(0, 1).float()  # [heads, S, D]
                kb = kg[b].transpose(0, 1).float().repeat_interleave(H // HKV, 0)[hs]
                vb = vg[b].transpose(0, 1).float().repeat_interleave(H // HKV, 0)[hs]
                ref = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
                lp = torch.nn.functional.scaled_dot_product_attention(qb.bfloat16(), kb.bfloat16(), vb.bfloat16(),
                                                                      attn_mask=mask)
                err = max(err, (out[b, :, hs].transpose(0, 1).float() - ref).abs().max().item())
                err_lp = max(err_lp, (lp.float() - ref).abs().max().item())
        bound = 2 * err_lp + testing.TOLERANCES["bfloat16"]["out"]
        say(f"big grid: {grid} programs per rank, {dt_big:.2f} s first call, err {err:.2e} (bound {bound:.2e})")
        assert err <= bound, f"big grid error {err} > {bound}"
        summary.update(big_programs=grid, big_err=err, big_first_call_s=round(dt_big, 2))

    dist.barrier()
    assert not failed, f"{len(failed)} cases failed: {failed}"
    summary.update(ok=True, sections=sorted(sections), log=log)
    if rank == 0 and a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "gpu_checks.json")
        if os.path.exists(path):  # an earlier run's sections into the same folder (a GPU session's stages): kept
            with open(path) as f:
                prev = json.load(f)
            summary = {**prev, **summary, "sections": sorted(set(prev.get("sections", [])) | sections),
                       "log": prev.get("log", []) + log}
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    say("ALL GPU CHECKS PASSED")
    jax_ring.shutdown()


if __name__ == "__main__":
    main()
