"""The Gluon forward over a ring's steps, the waits in the load partition (no protocol).

benchmarks/gluon_fwd.py's split-consumer loop (``n128s3x``: 0.97-1.04x cuDNN at world size 1, one H200,
2026-12-02) reads one K/V. The product's fused forward reads, at ring step t >= 1, the K/V that rank ``rank - t``
pushed into this rank's receive slot t - 1 (``[W-1][K, V][B][HKV][S][D]`` on the heap, ring_core.plans), each chunk
after its flag, which the pusher releases once the chunk's rows are stored. Here the **load partition** does that
wait: before the TMA loads of a chunk's first block it spins, bounded, on the chunk's flag with acquire loads, then
fences the generic proxy against the async one (the flag is acquired by ordinary loads, the chunk's bytes read by
TMA, which is the async proxy: ``fence.proxy.async.global``, PTX ISA, "memory consistency model", proxies). The
consumers, the product's own (ring_core.kernels.gluon_fwd), see one flat sequence of blocks in the product's order: the
local K/V's (causal: the diagonal masked), then every peer step's (the tile is the last rank's of a contiguous ring,
so every peer key is visible to every query).

What this probe answers, on one GPU (the flags and slots filled by the host, not by peers):
* ``check``: right against float32 attention over all W shards' keys, with the flags set before the launch
  (``ready``) and released late by a side stream after a sleep, the slots' zeros overwritten only then
  (``late``: a TMA read that overtook the flag would read zeros); a flag never released ends the wait after
  ``max_polls`` with the error word set (``timeout``), and the kernel returns.
* ``time``: TFLOP/s of the ring kernel at W = 1, 2, 4 with the flags set, against cuDNN on the same keys (non-causal)
  and the W = 1 kernel (causal): what the waits and the second descriptor cost inside the specialised loop.

    python -m benchmarks.gluon_ring --out OUT_DIR/gluon_ring.csv

Left out here (the product, ring_core.kernels.gluon_fwd, has them): the pushes, the call check, the end barrier and status words,
NaN rows after a failed wait, zigzag positions and the masked steps of other ranks, D64/D256.
"""
from __future__ import annotations

import argparse
import math
import time

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from benchmarks.gluon_fwd import (_LOAD_REGS, _LOAD_WARPS, _SPLIT_REGS, BLOCK_M, BLOCK_N, DEFAULT_NUM_STAGES,
                                  SPLIT_WARPS, _free_slots, _slots, _tile, _tma_load, _tma_store, consumer,
                                  descriptors, free_turns, turns)
from ring_core.protocol import control

STAGES = 3  # n128s3x: the split consumers need the third slot
CHUNK_BLOCKS = 4  # K/V blocks per flag (512 rows)
CTL_ERROR = gl.constexpr(control.CTL_ERROR)  # the word of ``err`` a failed wait sets (the product's error record)


@gluon.jit
def _acquire_flag(flag_ptr, target, max_polls, err_ptr):
    """Spin until ``*flag_ptr >= target`` (acquire loads, at most ``max_polls`` more; past them ``*err_ptr = 1``
    and go on, the data then undefined), then order the async proxy (TMA) after this generic acquire."""
    v = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    n = 0
    while (v < target) & (n < max_polls):
        v = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        n += 1
    if v < target:
        gl.store(err_ptr, 1)
    gl.inline_asm_elementwise("fence.proxy.async.global;\n mov.b32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _load_ring_partition(q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, row_q,
                         row_kv, col_q, col_kv, n_local, n_peer, n_blocks, n_step, r_row, slot_rows, v_rows, flag0,
                         flags_per_step, epoch, max_polls, err_ptr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         CHUNK_BLOCKS: gl.constexpr):
    """The producer: Q once; then in the product's order (ring_core.kernels.gluon_fwd) flat block j: local block j
    (j < n_local), then peer block j - n_local (``n_step`` per ring step, from the receive slots through ``r_desc``,
    a chunk's blocks after its flag)."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [row_q, col_q], q_bar, q_smem)
    for j in range(n_blocks):
        s = j % STAGES
        # Round r of a slot waits for the consumers' release of round r - 1 (a fresh barrier passes round 0).
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        i = j - n_local
        if (i >= 0) & (i < n_peer):  # (W = 1: folded away, no wait left)
            t = i // n_step
            blk = i % n_step
            if blk % CHUNK_BLOCKS == 0:
                _acquire_flag(flag0 + t * flags_per_step + blk // CHUNK_BLOCKS, epoch, max_polls, err_ptr)
            row = r_row + t * slot_rows + blk * BLOCK_N
            mbarrier.expect(kv_ready.index(s), 2 * r_desc.block_type.nbytes)
            _tma_load(r_desc, [row, 0], kv_ready.index(s), k_smem.index(s))
            _tma_load(r_desc, [row + v_rows, 0], kv_ready.index(s), v_smem.index(s))
        else:
            mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [row_kv + j * BLOCK_N, col_kv], kv_ready.index(s), k_smem.index(s))
            _tma_load(v_desc, [row_kv + j * BLOCK_N, col_kv], kv_ready.index(s), v_smem.index(s))


@gluon.jit
def gluon_ring_fwd(q_desc, k_desc, v_desc, r_desc, o_desc, lse_ptr, flags_ptr, err_ptr, B, S, H, HKV, sm_scale,
                   epoch, max_polls, W: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                   NUM_WARPS: gl.constexpr, CHUNK_BLOCKS: gl.constexpr):
    """The split-consumer forward over W ring steps, as the last rank of a contiguous ring: the local K/V (causal:
    its diagonal masked) and W - 1 peers' K/V from the receive slots (``r_desc``: [(W-1) * 2 * B * HKV * S, D]),
    each chunk of CHUNK_BLOCKS blocks after its flag (``flags_ptr``: [W-1][B][HKV][S / (CHUNK_BLOCKS * BLOCK_N)]
    int32, ready at ``epoch``). A wait that gave up sets the word ``err_ptr[CTL_ERROR]`` to 1: ``err_ptr`` stands for
    the ring's control words, which the product's consumers read (NaN rows after a failed wait)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    b, h, hkv, q0, _, n_local = _tile(S, H, HKV, BLOCK_M, BLOCK_N, CAUSAL)
    n_step = S // BLOCK_N  # blocks of one peer's shard, every one visible
    n_peer = (W - 1) * n_step
    n_blocks = n_local + n_peer
    n_chunks = S // (CHUNK_BLOCKS * BLOCK_N)
    flag0 = flags_ptr + (b * HKV + hkv) * n_chunks  # ring step 1's flags; step 1 + t at + t * B * HKV * n_chunks
    r_row = (b * HKV + hkv) * S  # K rows of slot 0; its V at + B * HKV * S rows; slot t at + t * 2 * B * HKV * S
    q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty = _slots(q_desc, k_desc, v_desc, STAGES, 2)  # two consumers

    qk_scale = sm_scale * 1.4426950408889634
    lse_row = lse_ptr + (b * H + h).to(gl.int64) * S + q0
    rank = S * 0 + (W - 1)  # the last rank of a contiguous ring (a run-time value, as the product's rank is)
    q_pos = rank * S + q0
    pp = turns()
    gl.warp_specialize([
        (consumer, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, pp, q_bar, n_blocks, qk_scale, lse_row, err_ptr,
                    1, rank, 1, S, q_pos, q_pos + BLOCK_M - 1, err_ptr, err_ptr,
                    0, W, 1, D, CAUSAL, False, False, -1, -1, False)),
        (_load_ring_partition, (q_desc, k_desc, v_desc, r_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty,
                                b * S + q0, b * S, h * D, hkv * D, n_local, n_peer, n_blocks, n_step, r_row,
                                2 * B * HKV * S, B * HKV * S, flag0, B * HKV * n_chunks, epoch, max_polls,
                                err_ptr + CTL_ERROR, BLOCK_N, STAGES, CHUNK_BLOCKS)),
        (consumer, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, pp, q_bar, n_blocks, qk_scale, lse_row, err_ptr,
                    1, rank, 1, S, q_pos, q_pos + BLOCK_M - 1, err_ptr, err_ptr,
                    1, W, 1, D, CAUSAL, False, False, -1, -1, False)),
    ], [_LOAD_WARPS, NUM_WARPS], [_LOAD_REGS, _SPLIT_REGS])
    _tma_store(o_desc, [b * S + q0, h * D], q_smem)  # both halves written (the partitions joined)
    tma.store_wait(pendings=0)
    _free_slots(q_bar, kv_ready, kv_empty, STAGES)
    free_turns(pp)


@triton.jit
def _release_flags(flags_ptr, n, epoch, BLOCK: tl.constexpr):
    """The host's stand-in for the peers' pushes: release every flag (after the slots' bytes, in stream order)."""
    offs = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        tl.atomic_xchg(flags_ptr + i + offs, epoch, mask=i + offs < n, sem="release", scope="gpu")


def receive_slots(peers):
    """The receive region of ``peers`` ([(k, v)] of W - 1 ranks, each [B, S, HKV, D]) as the kernel reads it:
    [(W-1) * 2 * B * HKV * S, D] ([W-1][K, V][B][HKV][S][D]); None when there is none (W = 1: ``attention`` then
    gives the kernel a block of zeros, which it never reads)."""
    import torch

    if not peers:
        return None
    x = torch.stack([torch.stack(kv) for kv in peers])  # [W-1, 2, B, S, HKV, D]
    return x.permute(0, 1, 2, 4, 3, 5).reshape(-1, x.shape[-1]).contiguous()


def flag_count(B: int, S: int, HKV: int, W: int) -> int:
    return max(W - 1, 1) * B * HKV * (S // (CHUNK_BLOCKS * BLOCK_N))


def check_shapes(q, k, W: int):
    B, S, H, D = q.shape
    HKV = k.shape[2]
    if S % (CHUNK_BLOCKS * BLOCK_N) or D not in (64, 128) or H % HKV or W < 1:
        raise ValueError(f"gluon_ring takes S % {CHUNK_BLOCKS * BLOCK_N} == 0, D in (64, 128), H % HKV == 0, W >= 1; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, W={W}")
    return B, S, H, HKV, D


def attention(q, k, v, recv, flags, err, W: int, causal: bool, epoch: int = 1, max_polls: int = 1 << 30,
              scale: float | None = None):
    """(out, lse) of the last rank of a contiguous W-rank ring: q, k, v its shards [B, S, H|HKV, D], ``recv`` the
    other ranks' K/V in the receive slots (``receive_slots``; None for W = 1), ``flags`` int32 [flag_count]
    (each chunk read once its flag >= ``epoch``), ``err`` int32 [CTL_ERROR + 1] (word CTL_ERROR set to 1 by a wait that
    gave up; the outputs are NaN then)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, S, H, HKV, D = check_shapes(q, k, W)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qd, kd, vd, od = descriptors(q, k, v, out, BLOCK_N)
    if recv is None:
        recv = torch.zeros((BLOCK_N, D), dtype=q.dtype, device=q.device)
    rd = TensorDescriptor(recv, list(recv.shape), [D, 1], [BLOCK_N, D], kd.layout)
    gluon_ring_fwd[(B * H * (S // BLOCK_M),)](qd, kd, vd, rd, od, lse, flags, err, B, S, H, HKV, scale, epoch,
                                              max_polls, **_constexprs(W, causal), num_warps=SPLIT_WARPS)
    return out, lse


def _constexprs(W: int, causal: bool) -> dict:
    return {"W": W, "CAUSAL": causal, "STAGES": STAGES, "NUM_WARPS": SPLIT_WARPS, "CHUNK_BLOCKS": CHUNK_BLOCKS}


def _arg_types(dtype: str, D: int) -> list:
    import torch
    from triton.runtime.jit import mangle_type

    t = torch.zeros((1, 512, 2, D), dtype=getattr(torch, dtype))
    descs = descriptors(t, t, t, t, BLOCK_N)
    return [mangle_type(d) for d in descs[:3]] + [mangle_type(descs[1])] + [mangle_type(descs[3])] + [
        "*fp32", "*i32", "*i32", "i32", "i32", "i32", "i32", "fp32", "i32", "i32"]


def compile_for_sm90(dtype: str = "bfloat16", D: int = 128, W: int = 2, causal: bool = True):
    """Compile the kernel for sm_90 without a GPU; returns Triton's CompiledKernel (``asm``: TTGIR, PTX)."""
    from ring_core.runtime import build

    return build.compile_kernel(gluon_ring_fwd, _arg_types(dtype, D), _constexprs(W, causal), num_warps=SPLIT_WARPS,
                                num_stages=DEFAULT_NUM_STAGES, capability=90)


def launch_records() -> list:
    """The compile-log records (ring_core.runtime.build.record) of every launch ``main`` makes (each check, each timed
    world size), for a cache filled ahead of the GPU run (tools/gpu_variants.py)."""
    from ring_core.runtime import build

    shapes = [(B, S, H, HKV, D, W, causal, dt, TIMEOUT_POLLS if mode == "timeout" else 1 << 30)
              for B, S, H, HKV, D, W, causal, dt, mode in CHECKS]
    shapes += [(1, TIMED["S"], TIMED["H"], TIMED["H"], TIMED["D"], W, c, "bfloat16", 1 << 30)
               for W in TIMED["worlds"] for c in (False, True)]
    return [build.record(gluon_ring_fwd, _arg_types(dt, D), _constexprs(W, causal), num_warps=SPLIT_WARPS,
                         num_stages=DEFAULT_NUM_STAGES, values=[None] * 8 + [B, S, H, HKV, None, 1, polls])
            for B, S, H, HKV, D, W, causal, dt, polls in shapes]


def reference(q, k, v, peers, causal: bool):
    """float32 attention of the last rank's queries over every rank's keys (peers' all visible; the local ones
    causal when ``causal``)."""
    import torch
    import torch.nn.functional as F

    B, S, H, D = q.shape
    ks = torch.cat([pk for pk, _ in peers] + [k], dim=1)
    vs = torch.cat([pv for _, pv in peers] + [v], dim=1)
    n_peer = ks.shape[1] - S
    mask = torch.ones(S, ks.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        mask[:, n_peer:] = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    rep = lambda x: x.float().transpose(1, 2).repeat_interleave(H // x.shape[2], dim=1)  # noqa: E731 (GQA)
    return F.scaled_dot_product_attention(rep(q), rep(ks), rep(vs), attn_mask=mask).transpose(1, 2)


# (B, S, H, HKV, D, W, causal, dtype, mode) of the checks. ``late``: the grid (B * H * S / 128 programs, one per
# SM at 224 KiB of shared memory each) must leave SMs to the side stream's copy and release, or they could only
# run after the waits gave up: at most 64 programs here.
CHECKS = [(1, 1024, 4, 2, 128, 2, True, "bfloat16", "ready"), (2, 512, 4, 1, 64, 3, False, "float16", "ready"),
          (1, 2048, 4, 2, 128, 4, True, "bfloat16", "ready"), (1, 1024, 4, 2, 128, 1, True, "bfloat16", "ready"),
          (1, 2048, 4, 2, 128, 2, True, "bfloat16", "late"), (1, 1024, 2, 2, 128, 4, False, "bfloat16", "late"),
          (1, 1024, 2, 1, 128, 2, False, "bfloat16", "timeout")]
LATE_SLEEP_CYCLES = 20_000_000  # torch.cuda._sleep before the side stream's copy: about 10 ms at 1.98 GHz
TIMEOUT_POLLS = 20_000
TIMED = dict(S=8192, H=32, D=128, worlds=(1, 2, 4))


def check(case) -> dict:
    import torch

    B, S, H, HKV, D, W, causal, dt, mode = case
    dev = torch.device("cuda")
    dtype = getattr(torch, dt)
    g = torch.Generator(device=dev).manual_seed(S + H + W)
    mk = lambda h: torch.randn(B, S, h, D, device=dev, dtype=dtype, generator=g)  # noqa: E731
    q, k, v = mk(H), mk(HKV), mk(HKV)
    peers = [(mk(HKV), mk(HKV)) for _ in range(W - 1)]
    staged = receive_slots(peers)
    recv = None if staged is None else torch.zeros_like(staged)
    flags = torch.zeros(flag_count(B, S, HKV, W), dtype=torch.int32, device=dev)
    err = torch.zeros(control.CTL_ERROR + 1, dtype=torch.int32, device=dev)
    row = dict(kind="check", mode=mode, B=B, S=S, H=H, HKV=HKV, D=D, W=W, causal=int(causal), dtype=dt)
    t0 = time.perf_counter()
    if mode == "ready":
        if recv is not None:
            recv.copy_(staged)
        flags.fill_(1)
        out, _ = attention(q, k, v, recv, flags, err, W, causal)
    elif mode == "late":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # staged is ready
        with torch.cuda.stream(side):
            torch.cuda._sleep(LATE_SLEEP_CYCLES)
            recv.copy_(staged)
            _release_flags[(1,)](flags, flags.numel(), 1, BLOCK=256)
        out, _ = attention(q, k, v, recv, flags, err, W, causal)  # launched while the side stream sleeps
    else:  # timeout: no flag is ever released
        out, _ = attention(q, k, v, recv, flags, err, W, causal, max_polls=TIMEOUT_POLLS)
    torch.cuda.synchronize()
    row["seconds"] = round(time.perf_counter() - t0, 3)
    if mode == "timeout":
        row.update(err_word=int(err[control.CTL_ERROR].item()), ok=int(err[control.CTL_ERROR].item() == 1))
        return row
    e = (out.float() - reference(q, k, v, peers, causal)).abs().max().item()
    row.update(err_word=int(err[control.CTL_ERROR].item()), max_abs_err=f"{e:.3e}",
               ok=int(e < 2e-2 and err[control.CTL_ERROR].item() == 0))
    return row


def plot(csv_path: str, png: str) -> None:
    """Bar chart of a run's timed rows: TFLOP/s per world size and causality, the ring kernel beside cuDNN on the
    same keys (non-causal)."""
    from benchmarks import gluon_fwd

    gluon_fwd.plot(csv_path, png, shape=lambda r: (int(r["W"]), int(r["causal"])),
                   label=lambda s: f"W={s[0]} {'causal' if s[1] else 'full'}",
                   title=f"Gluon ring-step forward, seq_local {TIMED['S']}, flags ready, one H200")


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.harness import cuda_stream_ms, write_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    rows = []
    for case in CHECKS:
        try:
            row = check(case)
        except Exception as e:  # noqa: BLE001 (a probe: one case failing must not hide the others)
            row = dict(kind="check", case=str(case), ok=0, error=f"{type(e).__name__}: {str(e)[:300]}")
        print(row, flush=True)
        rows.append(row)
    S, H, D = TIMED["S"], TIMED["H"], TIMED["D"]
    dev = torch.device("cuda")
    if all(r["ok"] for r in rows):
        for W in TIMED["worlds"]:
            for causal in (False, True):
                q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
                peers = [tuple(torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
                         for _ in range(W - 1)]
                recv = receive_slots(peers)
                flags = torch.ones(flag_count(1, S, H, W), dtype=torch.int32, device=dev)
                err = torch.zeros(control.CTL_ERROR + 1, dtype=torch.int32, device=dev)
                keys = (W - 1) * S + (S / 2 if causal else S)
                flops = 4 * H * S * keys * D
                runs = [("gluon_ring n128s3x", lambda: attention(q, k, v, recv, flags, err, W, causal))]
                if not causal:
                    ks = torch.cat([pk for pk, _ in peers] + [k], dim=1).transpose(1, 2)
                    vs = torch.cat([pv for _, pv in peers] + [v], dim=1).transpose(1, 2)
                    qt = q.transpose(1, 2)

                    def cudnn():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            return F.scaled_dot_product_attention(qt, ks, vs)

                    runs.append(("torch_cudnn", cudnn))
                for name, fn in runs:
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    ms = cuda_stream_ms(torch, fn, a.iters)
                    row = dict(kind="time", method=name, W=W, B=1, S=S, H=H, HKV=H, D=D, causal=int(causal),
                               dtype="bfloat16", keys=int(keys), ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                               err_word=int(err[control.CTL_ERROR].item()))
                    print(row, flush=True)
                    rows.append(row)
    if a.out:
        write_rows(a.out, rows)
    # A check row's ok covers its error word (the timeout check wants it set); a timed row's must stay clear.
    return 0 if all(r.get("ok", 1) and (r["kind"] == "check" or not r.get("err_word", 0)) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
