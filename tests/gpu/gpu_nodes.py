"""The two-level ring on GPUs (torch_bridge), checked and timed: run under the launcher, e.g. 4 ranks on one GPU as
2 "nodes" x 2 ranks (the fused kernel inside each node, a heap per node, K/V between nodes over gloo, since NCCL
refuses ranks that share a GPU)::

    RING_ATTENTION_NODE_SIZE=2 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py --out DIR

and the same problem as one node of 4 ranks (the flat ring) for the timing's baseline::

    RING_ATTENTION_NODE_SIZE=4 python -m jax_ring.launch --nproc-per-node 4 tests/gpu/gpu_nodes.py \\
        --sections timing --out DIR

Sections: ``checks`` (forward and gradients against float64 with the one tolerance table, on rank 0 over the
gathered results; deterministic=True bitwise from run to run), ``timing`` (per-call ms of the forward and of
forward+backward, the slowest rank, at each ``--seq-local``, with ``--packed`` with segment ids of packed documents,
written to DIR/nodes_timing.csv), ``soak`` (many calls a rank, each
compared bitwise with the first), ``faults`` (a call not taken, a late node, an absent rank; run it last).
Prints ALL PASSED when every check passed; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import torch_bridge
from ring_core import testing
from ring_core.layout import layout_permutation

CASES = [  # B, S_local, H, HKV, D, dtype, causal, layout, segment ids, window
    (1, 512, 8, 2, 128, "bfloat16", True, "zigzag", False, None),  # the Gluon kernels (Hopper), GQA
    (2, 256, 4, 4, 64, "float16", True, "contiguous", False, None),
    (1, 384, 4, 1, 128, "bfloat16", False, "zigzag", False, None),
    # packed documents crossing the nodes' boundaries: the ids travel with the K/V, the kernels take another node's
    (1, 512, 8, 2, 128, "bfloat16", True, "zigzag", True, None),
    (2, 256, 4, 4, 64, "float16", True, "contiguous", True, None),
    # windows across nodes: bands off the diagonal in the kernels (ring_core.nodes.window_pieces), the zigzag
    # layout's second halves reversed
    (1, 512, 8, 2, 128, "bfloat16", True, "contiguous", False, (700, -1)),
    (1, 512, 8, 2, 128, "bfloat16", True, "zigzag", False, (300, -1)),
    (2, 256, 4, 4, 64, "float16", False, "zigzag", True, (100, 60)),
]


# segment ids: every kind of step the ring has
SOAK_CASE = (1, 256, 4, 2, 64, "bfloat16", True, "zigzag", True, None)


def packed_ids(B, seq):
    """Segment ids of packed documents (lengths drawn per row, some crossing the ranks' and the nodes' boundaries)
    with padding at the end of row 0, in natural order."""
    rng = np.random.default_rng(11)
    ids = np.zeros((B, seq), np.int32)
    for b in range(B):
        cuts = np.unique(np.concatenate([[0, seq], rng.integers(1, seq, 6), [seq // 2 - 5, seq // 2 + 3]]))
        for i in range(len(cuts) - 1):
            ids[b, cuts[i]:cuts[i + 1]] = i
    ids[0, -17:] = -1
    return ids


def _shard(x, rows, device, dtype, axis=1):
    return torch.from_numpy(np.ascontiguousarray(np.take(x, rows, axis=axis))).to(device=device, dtype=dtype)


def _gather(x):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, x)
    return parts


def _call(case, rank, world, seed, deterministic=False):
    B, S, H, HKV, D, dtype, causal, layout, segmented, window = case
    q, k, v, dout = testing.random_inputs(seed, B, world * S, H, HKV, D, dtype, with_dout=True)
    ids = packed_ids(B, world * S) if segmented else None
    dlse = np.random.default_rng(seed).standard_normal((B, H, world * S))
    rows = layout_permutation(world * S, world, layout)[rank * S:(rank + 1) * S]
    dev, tdt = torch.device("cuda", torch.cuda.current_device()), getattr(torch, dtype)
    qt, kt, vt = (_shard(x, rows, dev, tdt).requires_grad_() for x in (q, k, v))
    seg = None if ids is None else _shard(ids, rows, dev, torch.int32)
    out, lse = torch_bridge.ring_attention(qt, kt, vt, is_causal=causal, layout=layout, return_lse=True,
                                           backend="fused", deterministic=deterministic, segment_ids=seg,
                                           window_size=window)
    # (a padding row's lse is the constant -inf: no gradient through it)
    dlse_t = _shard(dlse, rows, dev, torch.float32, 2).masked_fill(torch.isneginf(lse.detach()), 0.0)
    torch.autograd.backward([out, lse], [_shard(dout, rows, dev, tdt), dlse_t])
    torch_bridge.check_errors()
    f = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
    return [f(out), f(lse), f(qt.grad), f(kt.grad), f(vt.grad)], (q, k, v, dout, dlse, ids)


def checks(rank, world, log, cases):
    ok = True
    for i, case in enumerate(CASES):
        if i not in cases:
            continue
        B, S, H, HKV, D, dtype, causal, layout, segmented, window = case
        name = "B{} S_local {} H{}/{} D{} {} causal={} {} segment_ids={} window={}".format(*case)
        res, (q, k, v, dout, dlse, ids) = _call(case, rank, world, seed=i)
        again, _ = _call(case, rank, world, seed=i, deterministic=True)
        again2, _ = _call(case, rank, world, seed=i, deterministic=True)
        same = all(np.array_equal(a, b) for a, b in zip(again, again2))
        parts = _gather(res)
        sames = _gather(same)
        if rank == 0:
            inv = np.argsort(layout_permutation(world * S, world, layout))
            g = lambda j, ax=1: np.take(np.concatenate([p[j] for p in parts], axis=ax), inv, axis=ax)  # noqa: E731
            try:
                err = testing.check_attention(name, g(0), g(1, 2), q, k, v, dtype, is_causal=causal,
                                              segment_ids=ids, window=window)
                dlse = np.where(np.isneginf(g(1, 2)), 0.0, dlse)
                gerr = testing.check_grads(name, [g(j) for j in (2, 3, 4)], q, k, v, dout, dtype, is_causal=causal,
                                           dlse=dlse, segment_ids=ids, window=window)
                if not all(sames):
                    raise AssertionError(f"{name}: deterministic=True gradients differ between two runs")
                log(f"PASS {name}: out err {err:.3g}, grad err {gerr:.3g}, deterministic bitwise")
            except AssertionError as e:
                ok = False
                log(f"FAIL {e}")
    return ok


TIMING_CASE = (1, 4096, 32, 8, 128, "bfloat16", True, "zigzag", False, None)  # (S_local: --seq-local's)
DOC_LENS = (512, 8192)  # --packed: the documents' lengths, as benchmarks/attention.py's packed mask


def timing_ids(rank, world, seq_local, layout, seed=0):
    """This rank's segment ids (int32 [1, seq_local], layout order) of documents DOC_LENS long packed back to back
    over the whole sequence (a fixed seed: the same documents on every rank and run)."""
    rng, s_g, ids, doc = np.random.default_rng(seed), world * seq_local, [], 0
    while len(ids) < s_g:
        ids += [doc] * int(rng.integers(DOC_LENS[0], DOC_LENS[1] + 1))
        doc += 1
    ids = np.asarray(ids[:s_g], np.int32)[layout_permutation(s_g, world, layout)]
    return torch.from_numpy(ids[rank * seq_local:(rank + 1) * seq_local][None].copy())


def _timing(rank, world, log, seq_local, iters, warmup, packed=False):
    """The timing rows of one S_local (``packed``: with segment ids of packed documents), and the hop alone at it
    (logged)."""
    B, _, H, HKV, D, dtype, causal, layout = TIMING_CASE[:8]
    S = seq_local
    dev, tdt = torch.device("cuda", torch.cuda.current_device()), getattr(torch, dtype)
    g = torch.Generator(device=dev).manual_seed(rank)
    q = torch.randn(B, S, H, D, device=dev, dtype=tdt, generator=g).requires_grad_()
    k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=tdt, generator=g).requires_grad_() for _ in range(2))
    ids = timing_ids(rank, world, S, layout).to(dev) if packed else None
    node_size = torch_bridge.node_size()
    rows = []
    for pass_ in ("fwd", "fwd+bwd"):
        times = []
        for i in range(warmup + iters):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            with torch.set_grad_enabled(pass_ == "fwd+bwd"):
                out = torch_bridge.ring_attention(q, k, v, is_causal=causal, layout=layout, backend="fused",
                                                  segment_ids=ids)
            if pass_ == "fwd+bwd":
                out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        torch_bridge.check_errors()
        slowest = max(_gather(float(np.median(times))))
        flops = 4 * B * H * D * (world * S) ** 2 / 2 / world * (1 if pass_ == "fwd" else 3.5)  # (dense causal's)
        rows.append(dict(world=world, node_size=node_size, nodes=world // node_size, seq_local=S, heads=H,
                         kv_heads=HKV, head_dim=D, dtype=dtype, causal=causal, layout=layout,
                         mask="packed({}-{})".format(*DOC_LENS) if packed else "none", pass_=pass_,
                         ms=round(slowest * 1e3, 3), tflops_per_rank=round(flops / slowest / 1e12, 1),
                         gpu=torch.cuda.get_device_name(), ranks_per_gpu=world // max(1, torch.cuda.device_count())))
        if rank == 0:
            log("TIMING " + json.dumps(rows[-1]))
    torch_bridge.check_errors()
    if node_size < world and not packed:  # the between-node transfer alone: one K/V shard to the next node and back in
        from torch_bridge import nodes as tnodes

        rings = torch_bridge.lifecycle.node_rings()
        hop = []
        for i in range(warmup + iters):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            got = tnodes._Transfer([k.detach(), v.detach()], rings, 60.0).wait()
            torch.cuda.synchronize()
            if i >= warmup:
                hop.append(time.perf_counter() - t0)
        del got
        slowest = max(_gather(float(np.median(hop))))
        mb = 2 * k.numel() * k.element_size() / 1e6
        if rank == 0:
            log(f"HOP K/V shard ({mb:.1f} MB, S_local {S}) to the next node over {dist.get_backend(rings.peers)}: "
                f"{slowest * 1e3:.2f} ms ({mb / 1e3 / slowest:.2f} GB/s)")
    return rows


def timing(rank, world, log, out_dir, seq_locals=(4096,), iters=10, warmup=2, packed=False):
    rows = []
    for seq_local in seq_locals:
        rows += _timing(rank, world, log, seq_local, iters, warmup, packed)
    if rank == 0 and out_dir:
        path = os.path.join(out_dir, "nodes_timing.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    return True


def soak(rank, world, log, calls):
    case = SOAK_CASE
    first, _ = _call(case, rank, world, seed=7, deterministic=True)
    wrong = 0
    t0 = time.perf_counter()
    for i in range(calls):
        res, _ = _call(case, rank, world, seed=7, deterministic=True)
        wrong += not all(np.array_equal(a, b) for a, b in zip(first, res))
    wrongs = _gather(wrong)
    if rank == 0:
        log(f"{'PASS' if not any(wrongs) else 'FAIL'} soak: {calls} forward+backward calls a rank, "
            f"{sum(wrongs)} wrong, {time.perf_counter() - t0:.1f} s")
    return not any(wrongs)


def faults(rank, world, log, timeout_s=5.0, slack_s=60.0):
    """What goes wrong, on the two-level ring: a call it cannot take raises on every rank before anything runs, and
    the next right call passes; a late node only delays the others (its calls start 3 s after theirs: right
    results); a rank that never calls makes every other rank raise RingAttentionTimeout naming the rank it waited
    for, within the bound. Run last: the ranks around the absent one leave transfers posted that nobody will
    match (a job whose rank died restarts)."""
    from ring_core import nodes as core_nodes
    from ring_core.protocol.control import RingAttentionTimeout

    R = torch_bridge.node_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    B, S, H, HKV, D, dtype = CASES[0][:6]  # (tools/gpu_variants.py compiles this call's variants)
    q = torch.zeros(B, S, H, D, device=dev, dtype=getattr(torch, dtype))
    kv = torch.zeros(B, S, HKV, D, device=dev, dtype=getattr(torch, dtype))
    chunk = R * S // 2  # a node-level zigzag chunk
    try:
        torch_bridge.ring_attention(q, kv, kv, is_causal=True, layout="zigzag", window_size=(chunk + 10, -1),
                                    backend="fused")
        bad = "FAIL a zigzag window across a node's halves: the call returned"
    except core_nodes.WindowAcrossChunksError as e:
        bad = f"PASS a zigzag window across a node's halves raises before anything runs: {str(e)[:90]}..."
    bads = _gather(bad)
    ok = all(b.startswith("PASS") for b in bads)
    if rank == 0:
        log(bads[0] if ok else f"FAIL {bads}")
    ok &= checks(rank, world, log, {0})  # then a right call
    if R * 2 == world:  # a late node: the second node's ranks call 3 s after the first's
        if rank >= R:
            time.sleep(3.0)
        late_ok = checks(rank, world, lambda m: log(m.replace("PASS ", "PASS late node: ", 1)), {0})
        ok &= late_ok
    absent = world - 1
    dist.barrier()
    got = "absent"
    if rank != absent:
        t0 = time.perf_counter()
        try:
            torch_bridge.ring_attention(q, kv, kv, is_causal=False, layout="contiguous", backend="fused",
                                        timeout_s=timeout_s)
            torch.cuda.synchronize()
            torch_bridge.check_errors()
            got = "FAIL returned"
        except RingAttentionTimeout as e:
            took = time.perf_counter() - t0
            named = [r for r in range(world) if f"rank {r} " in str(e) or f"rank {r}:" in str(e)
                     if r != rank]
            bound = 3 * timeout_s + slack_s
            got = (f"{'PASS' if took <= bound and named else 'FAIL'} rank {rank}: RingAttentionTimeout after "
                   f"{took:.1f} s (bound {bound:.0f} s) naming rank {named}: {str(e)[:160]}")
    gots = _gather(got)
    if rank == 0:
        for g in gots:
            log(g if g != "absent" else f"(rank {absent} never called)")
    ok &= all(g == "absent" or g.startswith("PASS") for g in gots)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="checks,timing,soak")
    ap.add_argument("--soak-calls", type=int, default=2000)
    ap.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))), help="checks: which CASES")
    ap.add_argument("--seq-local", default="4096", help="timing: tokens a rank (a comma-separated list)")
    ap.add_argument("--iters", type=int, default=10, help="timing: timed calls (after 2 warm-up calls)")
    ap.add_argument("--packed", action="store_true", help="timing: with segment ids of packed documents")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch_bridge.initialize()
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    if rank == 0:
        log(f"world {world}, node_size {torch_bridge.node_size()}, {torch.cuda.get_device_name()}")
    ok = True
    for section in args.sections.split(","):
        if section == "checks":
            ok &= checks(rank, world, log, {int(c) for c in args.cases.split(",")})
        elif section == "timing":
            ok &= timing(rank, world, log, args.out, [int(x) for x in args.seq_local.split(",")], args.iters,
                         packed=args.packed)
        elif section == "soak":
            ok &= soak(rank, world, log, args.soak_calls)
        elif section == "faults":
            ok &= faults(rank, world, log)
        else:
            raise SystemExit(f"unknown section {section!r}")
    if rank == 0:
        log("ALL PASSED" if ok else "FAILED")
        if args.out:
            with open(os.path.join(args.out, f"nodes_log_R{torch_bridge.node_size()}.txt"), "a") as f:
                f.write("\n".join(lines) + "\n")
    if "faults" in args.sections.split(","):  # transfers left posted: no orderly shutdown (the process ends)
        sys.stdout.flush()
        os._exit(0 if ok else 1)
    torch_bridge.shutdown()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
