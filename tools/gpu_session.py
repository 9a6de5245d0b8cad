"""Run GPU stages in one GPU run and carry the Triton cache from one call to the next.

A cold compile of the kernels costs 5-150 s per variant on the GPU machine, and every run on the GPU machine
starts on a bare machine. This runner restores the Triton cache carried in ``.tcache/``, runs the stages one
after another, each under its own time limit, and then writes the variants it compiled under ``$OUT`` in parts
of at most 15 MiB (a remote run returns a limited number of files). The next call finds the compiled kernels,
as long as the kernel source has not changed. Of each variant only what a launch needs travels (CACHE_SUFFIXES).

The local cache ``.cache/triton/`` (git-ignored) is the master copy. It can be filled here, with no GPU, before
the GPU run (tools/gpu_variants.py works the variants out from the stages' tables; it needs Triton of the
GPU machine's wheel: ``python -m ring_core.runtime.build --identity`` prints the same line on both)::

    python tools/gpu_variants.py --nproc 4 checks-all soak --out /tmp/variants.jsonl
    TRITON_CACHE_DIR=.cache/triton python3.12 -m ring_core.runtime.build --warm /tmp/variants.jsonl --jobs 2
    python tools/gpu_session.py --pack            # .cache/triton -> .tcache/ parts (xz)

On the GPU machine (carry ``.gpu`` and ``.tcache``)::

    source .gpu/prelude.sh; python tools/gpu_session.py --budget 580 --out $OUT soak:300 bench-fwdbwd:240
    source .gpu/prelude.sh; python tools/gpu_session.py --nproc 4 --out $OUT checks:300 faults:200  # 4 ranks, 1 GPU

Several sessions in one call write into folders of ``$OUT``; a remote run may return only a few files, so end
the call with ``python tools/gpu_session.py --bundle $OUT`` (one tar, in parts). Then, on this machine, add the
returned compiles to the local cache and carry it again (a bundle is first unpacked into a new folder)::

    python tools/gpu_session.py --collect RETURNED_DIR

Compiles are logged (ring_core.runtime.build's compile log, tagged ``stage@nproc``) into ``$OUT/compiles.jsonl``;
``--collect`` merges them into ``tools/gpu_compiles.jsonl`` (committed), and a ``warm`` stage put first
compiles the variants of the stages after it, from that list and from tools/gpu_variants.py, in parallel
processes, with the current kernel source: after a kernel edit a call then spends its cold compiles at once,
not case after case (variants already in the cache take a second or two each).

Stages (``NAME[:SECONDS]``; the default time limit is in brackets):
  warm         ring_core.runtime.build --warm: the later stages' variants (recorded in tools/gpu_compiles.jsonl, and
               worked out by tools/gpu_variants.py), compiled in parallel            [240]
  checks       tests/gpu/gpu_checks.py, forward sections: cases, jit, grads, launch, big [540]
  checks-all   tests/gpu/gpu_checks.py, every section                                  [540]
  checks-fwdbwd tests/gpu/gpu_checks.py --sections cases,gluon,bwd                     [420]
  checks-gluon tests/gpu/gpu_checks.py --sections gluon: the Gluon Hopper forward against float64 and the tl kernel [240]
  bench-w1-split  bench-w1's deterministic forward+backward on the tl split (RING_ATTENTION_GLUON_DETERMINISTIC=0;
               the default is the Gluon kernel's deterministic order), torch, beside cuDNN    [120]
  bench-w1-tl  bench-w1's forward with RING_ATTENTION_GLUON=0 (the tl kernel), beside cuDNN: the Gluon A/B [150]
  bench-w1-shapes  bench-w1's forward at the other shapes, world size 1, torch_fused beside cuDNN: head_dim
               64 and 256 (32 kv heads), then GQA 32/8 at head_dim 128; bf16 16k/32k, causal and not      [150]
  checks-quick tests/gpu/gpu_checks.py, forward sections cases, gluon, jit, grads, launch (no big grid) [300]
  checks-grads tests/gpu/gpu_checks.py, sections grads and launch (the end of checks-quick)  [240]
  checks-big   tests/gpu/gpu_checks.py --sections big (a grid far larger than the GPU holds at once)  [180]
  checks-bwd   tests/gpu/gpu_checks.py --sections bwd                                  [300]
  checks-gluon-bwd tests/gpu/gpu_checks.py --sections gluon-bwd: the Gluon Hopper backward (deterministic=False)
               against float64 [240]
  checks-gluon-bwd-masks tests/gpu/gpu_checks.py --sections gluon-bwd-masks: the Gluon backward with windows and
               segment ids (deterministic=False) against float64 [240]
  checks-gluon-bwd-rest  the slowest runs of those two sections alone: gluon-bwd case 5 deterministic,
               gluon-bwd-masks case 7 (batch 2, both masks)                                   [200]
  checks-padded  the gluon section's padded head dims (96, 80, 192: cases g8-g10) and their Gluon backwards
               (b7, b8), against float64                                                     [240]
  checks-gluon-bwd-d64  the head_dim-64 runs of those two sections (cases b1, b3, b6, m1, m4)     [240]
  checks-masks tests/gpu/gpu_checks.py --sections masks: segment ids and windows, forward and
               backward (6 cases; compiles dominate)                                [540]
  faults       tests/gpu/gpu_faults.py (timeout, concurrent, mismatch, bad_inputs, security) [240]
  probe-status tests/gpu/gpu_status.py: jax_ring.status's CUDA side alone (one process, no ring): registered,
               no sync, raised by the next call, the slots, its cost                    [120]
  status       tests/gpu/gpu_faults.py --sections timeout,mismatch: JAX's default error mode (jax_ring.status:
               raised by the next fused call and by check_errors()) and the call mode, torch's   [180]
  bench-status the per-call check's cost at seq_local 4k, world size 1: jax_fused (default check),
               jax_fused_deferred (none), jax_fused_call (a sync), torch_fused; timed per call and back to
               back                                                                   [420]
  bench-shapes every shape at world size 1, torch beside cuDNN, forward and forward+backward, one call at a
               time: head_dim 128 16k/32k causal and not; head_dim 64, 256, 80, 96, 192 at 16k causal;
               4k causal head_dim 128, also back to back                                     [420]
  bench-d64-bwd  head_dim 64, 16k causal, forward+backward beside cuDNN: the Gluon backward in any order, the
               deterministic one (the tl split), twice: the second with RING_ATTENTION_GLUON_DETERMINISTIC=0 [200]
  tune-bwd-d256  benchmarks/tune.py --kernel bwd at head_dim 256 (and so 192, padded), 16k, world size 1: the
               portable backward's candidate tiles                                          [300]
  probe-host-path  benchmarks/host_path.py: a 4k call's launch, kernels and GPU idle time, fused against cuDNN,
               forward and forward+backward, under the torch profiler; cProfile of the host  [150]
  bench-w1-fwd every forward shape at world size 1 (D128, D64, D256, GQA 32/8), torch beside
               cuDNN, 10 timed calls: the A/B of a Gluon forward change              [200]
  bad_inputs   tests/gpu/gpu_faults.py --sections bad_inputs                           [150]
  kill         tests/gpu/gpu_faults.py --sections kill (ends rank 1)                   [90]
  soak         tests/gpu/gpu_soak.py --calls 10000, stopped 50 s before its limit      [420]
  bench-fwdbwd benchmarks/attention.py --pass fwd,fwd+bwd --seq 4k,16k             [420]
  bench-packed benchmarks/attention.py --mask none,packed: packed documents against the dense
               causal rate, seq_local 16k, torch_fused, fwd then fwd+bwd (--nproc ranks)  [420]
  bench-packed-stream  bench-packed with the calls back to back (--timing stream, 10 calls)       [300]
  bench-window benchmarks/attention.py --mask window --window 4095,0, causal contiguous, seq_local 16k,
               torch_fused, fwd and fwd+bwd (--nproc ranks)                          [300]
  bench-window-share  bench-window, back to back: one rank alone on one rank's share of the SMs (MPS), then the
               --nproc ranks sharing the GPU, into one CSV                                   [300]
  bench-masks-w1  the world-1 runs of bench-packed and bench-window (one process, whatever --nproc; the
               MPS SM share of a shared session is dropped for it, so it gets the whole GPU)  [540]
  bench-masks-w1-stream  bench-masks-w1 with --timing stream (the calls back to back)       [300]
  bench-w1-stream  bench-w1 with --timing stream (the calls back to back)                [300]
  bench-w1-peers  torch_fused beside torch flex_attention and flash-attn (where it imports) at world size 1, back to
               back, 16k causal: dense and packed documents, then the 4k window; fwd and fwd+bwd       [420]
  bench-w1-ready  bench-w1's forward with --timing ready (each call until its results are ready on the host: torch
               and JAX timed alike)                                                           [300]
  probe-mask-cost  the masked forward's cost over dense with the same blocks, back to back, twice: dense, a window
               that hides almost nothing (16000, 0: the masked path without ids) and one 16384-token document
               (the masked path with ids)                                                    [120]
  probe-mask-cost-call  the same, each call timed on its own (--timing call), twice                  [120]
  probe-timeline  benchmarks/timeline.py: the Gluon forward built with its timeline (RING_ATTENTION_GLUON_TIMELINE=1),
               each partition's clock at each tile's events, for dense, that window, one document and packed
               documents (512-8192), calls back to back and one at a time, twice: where a masked tile's
               time goes (W=1)                                                                [240]
  probe-tiles  one problem's work cut into 1, 4, 16 and 64 sequences (B=1 S=16k ... B=64 S=2k), ours and cuDNN's
               forward and forward+backward back to back: what a tile costs however few blocks it has    [240]
  bench-doclens  the packed forward at W=1 with documents of 16384, 4096 and 1024 tokens    [150]
  bench-doclens-stream  bench-doclens back to back, documents of 16384 down to 512 tokens, and dense    [150]
  checks-masks-tail  tests/gpu/gpu_checks.py masks cases 3, 4, 5 (fp32 last)                  [420]
  bench-w1     benchmarks/attention.py at world size 1 (one rank whatever --nproc: run it with --nproc 1, so
               that no MPS share caps it): fused (also with deterministic=True) and cuDNN, torch and JAX, bf16
               D128 16k/32k, fwd and fwd+bwd                                          [300]
  examples     the four examples on 2 GPUs (flax_train.py needs flax and optax there: install them
               first, see docs/operations.md)                                 [300]
  flax         examples/flax_train.py alone                                        [120]
  integrations examples/hf_llama_train.py (5 steps, --nproc ranks, gloo between them) and
               examples/flax_attention_fn.py (one process: its gradient sum is an XLA collective, which
               ranks sharing a GPU cannot run); both need the wheels of docs/integrations.md, "An offline
               GPU machine", on PYTHONPATH                                           [300]
  examples-torch  the two torch examples (gloo between the ranks: they run with ranks sharing a GPU, which the JAX
               examples' NCCL collectives cannot)                                  [240]
  limits       tests/gpu/gpu_shared_limits.py: what works between ranks sharing a GPU   [240]
  rings        tests/gpu/gpu_rings.py: 2 x 2 meshes, DeviceMesh groups, torch.compile (--nproc 4) [300]
  train-dp     examples/torch_train.py --dp 2 (data x sequence parallel; --nproc 4)  [180]
  tune-bwd     benchmarks/tune.py --kernel bwd, bf16 D128 seq_local 16k            [420]
  tune-fwd256  benchmarks/tune.py --kernel fwd, bf16 D256 seq_local 4k (checked) and 16k [240]

Every stage's output goes to ``$OUT/session.log``; a stage that overruns its limit is stopped (its output
kept) and the next one runs. The exit code is that of the first stage that failed, or 0.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ring_core.runtime import build, gpus, ptxas_shim  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRY = os.path.join(ROOT, ".tcache")  # carried to the GPU machine; git-ignored
CACHE = os.path.join(ROOT, ".cache", "triton")  # TRITON_CACHE_DIR there
PART_BYTES = 15 << 20
PART_PREFIX = "tcache.tgz.part"  # parts of one tar, xz-compressed (gzip before 2026-12-02: still read)
# The variants earlier GPU runs compiled (ring_core.runtime.build's compile log, merged by --collect; committed):
# what the warm stage compiles, in parallel, for the stages after it.
COMPILES = os.path.join(ROOT, "tools", "gpu_compiles.jsonl")
COMPILE_LOG = "compiles.jsonl"  # this session's compile log, under --out
# The later stages' variants as tools/gpu_variants.py works them out from their tables (under --out): the warm
# stage compiles them too, so a stage that no earlier GPU run logged at this --nproc starts warm as well.
VARIANTS = "variants.jsonl"
# What a launch needs of a cache entry: the metadata, the binary (torch's launcher) and the PTX (jax_ring's
# custom call); the other stages' IR (ttir, ttgir, llir, source) is left out of the carried parts.
CACHE_SUFFIXES = (".json", ".cubin", ".ptx")
LAUNCH = [sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", "{nproc}"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{nproc}"]
# One process on the whole GPU, also in a session whose ranks share it (no SM share for it).
LAUNCH1 = ["env", "-u", gpus.MPS_SHARE_ENV, sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", "1"]
# The masked benchmarks (benchmarks/results/README.md): packed documents against the dense causal rate, and a
# 4096-token causal window on a contiguous layout; torch_fused only (jax_fused runs the same kernel and would
# double the compiles).
BENCH = ["-m", "benchmarks.attention", "--causal", "yes", "--seq", "16k", "--methods", "torch_fused",
         "--warmup", "2", "--iters", "5"]
PACKED = BENCH + ["--mask", "none,packed", "--csv", "{out}/masks_packed.csv"]
WINDOW = BENCH + ["--mask", "window", "--window", "4095,0", "--layout", "contiguous", "--pass", "fwd,fwd+bwd",
                  "--csv", "{out}/masks_window.csv"]
W1_SHAPES = ["-m", "benchmarks.attention", "--methods", "torch_fused,torch_cudnn_1gpu", "--seq", "16k,32k", "--pass",
             "fwd", "--warmup", "2", "--iters", "5", "--csv", "{out}/attention_w1_shapes.csv"]

PEERS = ["-m", "benchmarks.attention", "--methods", "torch_fused,torch_flex,torch_flash_attn", "--causal", "yes",
         "--seq", "16k", "--pass", "fwd,fwd+bwd", "--timing", "stream", "--warmup", "2", "--iters", "5"]
# The shapes users train at, each beside cuDNN in the same process, one call at a time (docs/performance.md, "Every
# shape, one call at a time"): torch only (JAX runs the same binary; its per-call compile of each variant's PTX
# would take most of the stage).
SHAPES = ["-m", "benchmarks.attention", "--methods", "torch_fused,torch_cudnn_1gpu", "--pass", "fwd,fwd+bwd",
          "--warmup", "3", "--iters", "10", "--csv", "{out}/attention_w1_shapes.csv"]
D64_BWD = ["-m", "benchmarks.attention", "--methods", "torch_fused,torch_fused_det,torch_cudnn_1gpu", "--head-dim",
           "64", "--seq", "16k", "--causal", "yes", "--pass", "fwd+bwd", "--warmup", "3", "--iters", "10", "--csv",
           "{out}/attention_d64_bwd.csv"]
STATUS_BENCH = ["-m", "benchmarks.attention", "--methods", "jax_fused,jax_fused_deferred,jax_fused_call,torch_fused",
                "--seq", "4k", "--pass", "fwd,fwd+bwd", "--warmup", "5", "--iters", "30"]

def _mask_cost(timing: str, csv: str) -> list:
    """probe-mask-cost's commands (twice, to show the spread) with ``--timing`` ``timing``, into ``{out}/csv``."""
    return [LAUNCH1 + BENCH + ["--mask", "none,window,packed", "--window", "16000,0", "--doc-lens", "16384-16384",
                               "--pass", "fwd", "--timing", timing, "--iters", "10", "--csv", "{out}/" + csv]] * 2


STAGES = {
    # First in a call after a kernel edit: the later stages' variants (as tools/gpu_compiles.jsonl records them, at
    # the same --nproc), compiled from the current source many at a time, instead of one after another as each
    # stage's cases reach them.
    "warm": (240, [[sys.executable, "tools/gpu_variants.py", "--nproc", "{nproc}", "--stages", "{later_names}",
                    "--out", "{out}/" + VARIANTS],
                   [sys.executable, "-m", "ring_core.runtime.build", "--warm", COMPILES, "{out}/" + VARIANTS, "--tags",
                    "{later}", "--jobs", "{jobs}"]]),
    "checks": (540, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "cases,gluon,jit,grads,launch,big", "--out", "{out}"]]),
    # Every section (cases, jit, grads, launch, bwd, masks, soak of 1000 calls, big): the full run per world size.
    "checks-all": (540, [LAUNCH + ["tests/gpu/gpu_checks.py", "--out", "{out}"]]),
    # The forward and backward sections at many ranks (W=8 included).
    "checks-fwdbwd": (420, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "cases,gluon,bwd", "--out", "{out}"]]),
    "checks-gluon": (240, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "gluon", "--out", "{out}"]]),
    "checks-gluon-bwd": (240, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "gluon-bwd", "--out", "{out}"]]),
    "checks-gluon-bwd-masks": (240, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "gluon-bwd-masks", "--out",
                                               "{out}"]]),
    # The slowest runs of the two sections above, alone: gluon-bwd case 5 (non-causal zigzag) in the deterministic
    # order, and the batch-2 masked case (windows and padded segment ids together).
    "checks-gluon-bwd-rest": (200, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "gluon-bwd,gluon-bwd-masks",
                                              "--gluon-bwd-cases", "b5:det,m7", "--out", "{out}"]]),
    # The head dims the kernels run padded (ring_core.plans.kernel_spec: 96 and 80 at 128, 192 at 256): the
    # gluon section's forwards and the gluon-bwd section's backwards (both orders).
    "checks-padded": (240, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "gluon,gluon-bwd", "--gluon-cases",
                                      "g8,g9,g10", "--gluon-bwd-cases", "b7,b8", "--out", "{out}"]]),
    # The head_dim-64 runs of the same two sections (in any order: the deterministic one is the tl split's there).
    "checks-gluon-bwd-d64": (240, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "gluon-bwd,gluon-bwd-masks",
                                             "--gluon-bwd-cases", "b1,b3,b6,m1,m4", "--out", "{out}"]]),
    "checks-quick": (300, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "cases,gluon,jit,grads,launch", "--out", "{out}"]]),
    "checks-grads": (240, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "grads,launch", "--out", "{out}"]]),
    "checks-big": (180, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "big", "--out", "{out}"]]),
    "checks-bwd": (300, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "bwd", "--out", "{out}"]]),
    "checks-kv-ids": (200, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "kv-ids", "--out", "{out}"]]),
    "checks-masks": (540, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "masks", "--out", "{out}"]]),
    # The masks cases from 3 on (fp32 last: its cold compiles alone take minutes at 2 ranks).
    "checks-masks-tail": (420, [LAUNCH + ["tests/gpu/gpu_checks.py", "--sections", "masks", "--mask-cases", "3,4,5",
                                          "--out", "{out}"]]),
    "faults": (240, [LAUNCH + ["tests/gpu/gpu_faults.py", "--deadline", "{limit_minus}", "--out", "{out}"]]),
    # jax_ring.status's CUDA side alone (one process, no ring, no Triton): registration, no sync, a failure
    # raised by the next call, the ring of slots, the cost per call (also with the main thread busy in Python).
    "probe-status": (120, [["env", "-u", gpus.MPS_SHARE_ENV, sys.executable, "tests/gpu/gpu_status.py", "--out", "{out}"]]),
    # JAX's default error mode (jax_ring.status) against the GPU: a timeout and a mismatch raised by the
    # next fused call and by check_errors(), the call mode beside it (the call's own), torch's as before.
    "status": (180, [LAUNCH + ["tests/gpu/gpu_faults.py", "--sections", "timeout,mismatch", "--deadline", "{limit_minus}",
                               "--out", "{out}"]]),
    # Its cost at seq_local 4k (target: 2 % of a call): jax_fused (the default check) against jax_fused_deferred
    # (no per-call check) and jax_fused_call (the call mode: a host sync), one process on the whole GPU, timed per call
    # (a sync after each) and back to back.
    "bench-status": (420, [LAUNCH1 + STATUS_BENCH + ["--timing", timing, "--csv", f"{{out}}/status_4k_{timing}.csv"]
                           for timing in ("call", "stream")]),
    "bad_inputs": (150, [LAUNCH + ["tests/gpu/gpu_faults.py", "--sections", "bad_inputs", "--deadline", "{limit_minus}",
                                   "--out", "{out}"]]),
    "kill": (90, [LAUNCH + ["tests/gpu/gpu_faults.py", "--sections", "kill", "--deadline", "{limit_minus}",
                            "--out", "{out}"]]),
    "soak": (420, [LAUNCH + ["tests/gpu/gpu_soak.py", "--calls", "10000", "--deadline", "{limit_minus}",
                             "--max-seconds", "{soak_seconds}", "--out", "{out}"]]),
    "bench-fwdbwd": (420, [LAUNCH + ["-m", "benchmarks.attention", "--pass", "fwd,fwd+bwd", "--seq", "4k,16k",
                                     "--warmup", "2", "--iters", "5", "--csv", "{out}/attention_fwdbwd.csv"]]),
    "bench-packed": (420, [LAUNCH + PACKED + ["--pass", "fwd"], LAUNCH + PACKED + ["--pass", "fwd+bwd"]]),
    # bench-packed with the calls back to back (--timing stream, ten of them): as bench-masks-w1-stream times W=1.
    # With --timing call each call starts after the ranks meet on the host, so the ranks' launches are apart by
    # the host's skew, which the first rank's call check waits out: a fixed cost that weighs on the short packed call.
    "bench-packed-stream": (300, [LAUNCH + [x.replace("masks_packed", "masks_packed_stream") for x in PACKED]
                                  + ["--pass", p, "--timing", "stream", "--iters", "10"] for p in ("fwd", "fwd+bwd")]),
    "bench-window": (300, [LAUNCH + WINDOW]),
    # The window benchmark with the ranks sharing one GPU: first one rank alone held to one rank's share of the
    # SMs (MPS, 100/nproc %), then the ranks; the same CSV, so the ring's rows get ms_vs_world1 against the lone
    # rank on as many SMs (the same banded work per rank): the protocol's overhead, which the share cancels.
    "bench-window-share": (300, [["env", f"{gpus.MPS_SHARE_ENV}={{share}}", sys.executable, "-m", "jax_ring.launch",
                                  "--nproc-per-node", "1", "--mps", "on"]
                                 + [x.replace("masks_window", "masks_window_share") for x in WINDOW]
                                 + ["--timing", "stream"],
                                 LAUNCH + [x.replace("masks_window", "masks_window_share") for x in WINDOW]
                                 + ["--timing", "stream"]]),
    "bench-masks-w1": (540, [LAUNCH1 + PACKED + ["--pass", "fwd"], LAUNCH1 + PACKED + ["--pass", "fwd+bwd"],
                             LAUNCH1 + WINDOW]),
    # The same rows back to back (--timing stream: the host's work for a call hidden behind the GPU's for the one
    # before, as in a training step), into CSVs of their own.
    "bench-masks-w1-stream": (300, [LAUNCH1 + [x.replace("masks_packed", "masks_packed_stream") for x in PACKED]
                                    + ["--pass", p, "--timing", "stream"] for p in ("fwd", "fwd+bwd")]
                              + [LAUNCH1 + [x.replace("masks_window", "masks_window_stream") for x in WINDOW]
                                 + ["--timing", "stream"]]),
    # Where the packed forward's time goes (docs/performance.md): world size 1, documents of one length each, from
    # one per 16k shard (the segment-id path at dense work) down to 1024 tokens (many short rows per tile).
    "bench-doclens": (150, [LAUNCH1 + BENCH + ["--mask", "packed", "--pass", "fwd", "--doc-lens", f"{n}-{n}",
                                               "--csv", "{out}/masks_doclens.csv"] for n in (16384, 4096, 1024)]),
    # The same back to back (the host's time hidden), from one document of 16384 tokens down to 512-token documents,
    # beside the dense causal forward: every row has the same 4096 tiles and the same plan scans (by position), the
    # blocks shrink with the documents, so the intercept of time against blocks is what a segmented tile costs
    # however few blocks it has (the packed forward; docs/performance.md).
    "bench-doclens-stream": (150, [LAUNCH1 + BENCH + ["--mask", "none,packed" if n == 16384 else "packed", "--pass",
                                                      "fwd", "--doc-lens", f"{n}-{n}", "--timing", "stream",
                                                      "--csv", "{out}/masks_doclens_stream.csv"]
                                   for n in (16384, 8192, 4096, 2048, 1024, 512)]),
    # The masked path's own cost: the same blocks as dense, through the masked path without ids (a window
    # that hides almost nothing) and with them (one document), twice to show the spread.
    "probe-mask-cost": (120, _mask_cost("stream", "mask_cost.csv")),
    # The same timed one call at a time (--timing call): the masked path's cost as the per-call benchmarks see it.
    "probe-mask-cost-call": (120, _mask_cost("call", "mask_cost_call.csv")),
    # Where the masked path's time goes, partition by partition: the kernel's timeline (benchmarks/timeline.py).
    "probe-timeline": (240, [LAUNCH1 + ["-m", "benchmarks.timeline", "--out", "{out}"]]),
    # What a tile costs however few blocks it has, without masks: one problem's work (B * S^2 at 16k, B=1) cut into
    # 1, 4, 16 and 64 sequences (B=1 S=16k ... B=64 S=2k), so the tiles (B * S / 128 per head) grow 4x a row while
    # the blocks stay; ours and cuDNN's forward and forward+backward, causal and not, back to back. The slope of time
    # against tiles is the per-tile cost (the causal rows, the packed rows; docs/performance.md).
    "probe-tiles": (240, [LAUNCH1 + ["-m", "benchmarks.attention", "--methods", "torch_fused,torch_cudnn_1gpu",
                                     "--seq", s, "--batch", str(b), "--pass", "fwd,fwd+bwd", "--warmup", "2",
                                     "--iters", "5", "--timing", "stream", "--csv", "{out}/tiles.csv"]
                          for b, s in ((1, "16k"), (4, "8k"), (16, "4k"), (64, "2k"))]),
    # bench-w1 timed back to back (--timing stream): the host's dispatch overlapped, as do_bench and training see it.
    "bench-w1-ready": (300, [LAUNCH1 + ["-m", "benchmarks.attention", "--methods",
                                        "torch_fused,torch_cudnn_1gpu,jax_fused,jax_fused_deferred,jax_cudnn_1gpu",
                                        "--seq", "16k,32k", "--pass", "fwd", "--warmup", "2", "--iters", "10",
                                        "--timing", "ready", "--csv", "{out}/attention_w1_ready.csv"]]),
    # The one-process peers of packed documents and windows (flex_attention; flash-attn where it imports) beside the
    # fused kernel at world size 1, back to back (docs/performance.md).
    "bench-w1-peers": (420, [LAUNCH1 + PEERS + ["--mask", "none,packed", "--csv", "{out}/attention_w1_peers.csv"],
                             LAUNCH1 + PEERS + ["--mask", "window", "--window", "4095,0", "--layout", "contiguous",
                                                "--csv", "{out}/attention_w1_peers.csv"]]),
    "bench-w1-stream": (300, [LAUNCH1 + ["-m", "benchmarks.attention", "--methods",
                                         "torch_fused,torch_cudnn_1gpu,jax_fused,jax_fused_deferred,jax_cudnn_1gpu",
                                         "--seq", "16k,32k", "--pass", "fwd,fwd+bwd", "--warmup", "2", "--iters", "5",
                                         "--timing", "stream", "--csv", "{out}/attention_w1_stream.csv"]]),
    "bench-w1": (300, [LAUNCH1 + ["-m", "benchmarks.attention", "--methods",
                                  "torch_fused,torch_cudnn_1gpu,jax_fused,jax_fused_deferred,jax_cudnn_1gpu,"
                                  "torch_fused_det,jax_fused_det",
                                  "--seq", "16k,32k", "--pass", "fwd,fwd+bwd", "--warmup", "2", "--iters", "5",
                                  "--csv", "{out}/attention_w1.csv"]]),
    # bench-w1's deterministic forward+backward on the tl split (RING_ATTENTION_GLUON_DETERMINISTIC=0; the default
    # deterministic backward is the Gluon kernel's own order), beside cuDNN: the deterministic A/B.
    "bench-w1-split": (120, [["env", "RING_ATTENTION_GLUON_DETERMINISTIC=0"] + LAUNCH1 + [
        "-m", "benchmarks.attention", "--methods", "torch_fused_det,torch_cudnn_1gpu", "--seq", "16k,32k", "--pass",
        "fwd+bwd", "--warmup", "2", "--iters", "5", "--csv", "{out}/attention_w1_split.csv"]]),
    # The backward's kernels at head_dim 64, 16k causal, beside cuDNN: the Gluon kernel in any order (torch_fused), then
    # the tl split (torch_fused_det: the deterministic backward there; RING_ATTENTION_GLUON_DETERMINISTIC=0 too).
    "bench-d64-bwd": (200, [LAUNCH1 + D64_BWD, ["env", "RING_ATTENTION_GLUON_DETERMINISTIC=0"] + LAUNCH1 + D64_BWD]),
    # bench-w1's forward with the tl kernel (RING_ATTENTION_GLUON=0), beside cuDNN in the same run: the A/B of the
    # Gluon Hopper forward.
    "bench-w1-tl": (150, [["env", "RING_ATTENTION_GLUON=0"] + LAUNCH1 + [
        "-m", "benchmarks.attention", "--methods", "torch_fused,jax_fused_deferred,torch_cudnn_1gpu", "--seq",
        "16k,32k", "--pass", "fwd", "--warmup", "2", "--iters", "5", "--csv", "{out}/attention_w1_tl.csv"]]),
    # The shapes beyond D128 (D64, D256, GQA): the forward at world size 1 through torch
    # (JAX runs the same binary), beside cuDNN in the same run; two processes, one CSV.
    "bench-w1-shapes": (150, [LAUNCH1 + W1_SHAPES + ["--head-dim", "64,256", "--kv-heads", "32"],
                              LAUNCH1 + W1_SHAPES + ["--head-dim", "128", "--kv-heads", "8"]]),
    "tune-bwd-d256": (300, [LAUNCH1 + ["-m", "benchmarks.tune", "--kernel", "bwd", "--head-dims", "256", "--seq",
                                       "16384", "--csv", "{out}/tune_backward_d256.csv"]]),
    "probe-host-path": (150, [LAUNCH1 + ["-m", "benchmarks.host_path", "--out", "{out}", "--seq", "4k",
                                         "--cprofile", "200"]]),
    "bench-shapes": (420, [LAUNCH1 + SHAPES + ["--head-dim", "128", "--seq", "16k,32k"],
                           LAUNCH1 + SHAPES + ["--head-dim", "64,256,80,96,192", "--seq", "16k", "--causal", "yes"],
                           LAUNCH1 + SHAPES + ["--head-dim", "128", "--seq", "4k", "--causal", "yes"],
                           LAUNCH1 + SHAPES + ["--head-dim", "128", "--seq", "4k", "--causal", "yes", "--timing",
                                               "stream"]]),
    # Every forward shape at world size 1 in one stage (D128, D64, D256, GQA 32/8; torch beside cuDNN;
    # 10 timed calls): the A/B of a Gluon forward change (e.g. RING_ATTENTION_GLUON_PINGPONG=1 in the environment).
    "bench-w1-fwd": (200, [LAUNCH1 + W1_SHAPES[:-4] + ["--iters", "10", "--csv", "{out}/attention_w1_fwd.csv",
                                                        "--head-dim", "128,64,256", "--kv-heads", "32"],
                           LAUNCH1 + W1_SHAPES[:-4] + ["--iters", "10", "--csv", "{out}/attention_w1_fwd.csv",
                                                        "--head-dim", "128", "--kv-heads", "8"]]),
    "examples": (300, [LAUNCH + ["examples/jax_ring_attention.py"],
                       TORCHRUN + ["examples/torch_ring_attention.py"],
                       TORCHRUN + ["examples/torch_train.py"],
                       LAUNCH + ["examples/flax_train.py"]]),  # last: it needs the extra wheels
    # The torch examples alone: with ranks sharing a GPU the JAX ones cannot run (their XLA collectives need NCCL,
    # which refuses two ranks on one GPU), and a stage stops at its first failing command.
    "examples-torch": (240, [TORCHRUN + ["examples/torch_ring_attention.py"], TORCHRUN + ["examples/torch_train.py"]]),
    "flax": (120, [LAUNCH + ["examples/flax_train.py"]]),
    "integrations": (300, [LAUNCH + ["examples/hf_llama_train.py", "--steps", "5"],
                           LAUNCH1 + ["examples/flax_attention_fn.py"]]),
    "limits": (240, [LAUNCH + ["tests/gpu/gpu_shared_limits.py", "--out", "{out}"]]),
    "rings": (300, [LAUNCH + ["tests/gpu/gpu_rings.py", "--out", "{out}"]]),
    # The two-level ring at {nproc} ranks as "nodes" of 2 (K/V between them over gloo): its checks (segment ids
    # too) and soak, then its timing against the same problem as one node.
    "nodes": (420, [["env", "RING_ATTENTION_NODE_SIZE=2"] + LAUNCH + ["tests/gpu/gpu_nodes.py", "--sections",
                                                                       "checks,soak", "--out", "{out}"],
                    ["env", "RING_ATTENTION_NODE_SIZE=2"] + LAUNCH + ["tests/gpu/gpu_nodes.py", "--sections",
                                                                       "timing", "--out", "{out}"],
                    ["env", "RING_ATTENTION_NODE_SIZE={nproc}"] + LAUNCH + ["tests/gpu/gpu_nodes.py", "--sections",
                                                                             "timing", "--out", "{out}"]]),
    # The two-level ring's timing against the flat ring from 4k to 32k tokens a rank (compute grows with S_local
    # squared, the hop with S_local).
    "nodes-timing": (480, [["env", "RING_ATTENTION_NODE_SIZE=2"] + LAUNCH + [
        "tests/gpu/gpu_nodes.py", "--sections", "timing", "--seq-local", "4096,16384,32768", "--iters", "5",
        "--out", "{out}"], ["env", "RING_ATTENTION_NODE_SIZE={nproc}"] + LAUNCH + [
        "tests/gpu/gpu_nodes.py", "--sections", "timing", "--seq-local", "4096,16384,32768", "--iters", "5",
        "--out", "{out}"]]),
    # The same with segment ids of packed documents (512-8192 tokens) at 16k and 32k tokens a rank.
    "nodes-timing-packed": (420, [["env", "RING_ATTENTION_NODE_SIZE=2"] + LAUNCH + [
        "tests/gpu/gpu_nodes.py", "--sections", "timing", "--seq-local", "16384,32768", "--iters", "5", "--packed",
        "--out", "{out}"], ["env", "RING_ATTENTION_NODE_SIZE={nproc}"] + LAUNCH + [
        "tests/gpu/gpu_nodes.py", "--sections", "timing", "--seq-local", "16384,32768", "--iters", "5", "--packed",
        "--out", "{out}"]]),
    # The nodes stage's checks of windows across nodes alone (tests/gpu/gpu_nodes.py cases 5-7: bands off the
    # diagonal in the kernels, the zigzag layout's second halves reversed).
    "nodes-windows": (300, [["env", "RING_ATTENTION_NODE_SIZE=2"] + LAUNCH + ["tests/gpu/gpu_nodes.py", "--sections",
                                                                               "checks", "--cases", "5,6,7", "--out",
                                                                               "{out}"]]),
    # The two-level ring's fault checks (tests/gpu/gpu_nodes.py --sections faults): a call not taken, a late node,
    # an absent rank.
    "nodes-faults": (240, [["env", "RING_ATTENTION_NODE_SIZE=2"] + LAUNCH + ["tests/gpu/gpu_nodes.py", "--sections",
                                                                              "faults", "--out", "{out}"]]),
    "train-dp": (180, [TORCHRUN + ["examples/torch_train.py", "--dp", "2"]]),
    "tune-bwd": (420, [LAUNCH + ["-m", "benchmarks.tune", "--kernel", "bwd", "--head-dims", "128", "--seq", "16384",
                                 "--csv", "{out}/tune_backward.csv"]]),
    "tune-fwd256": (240, [LAUNCH + ["-m", "benchmarks.tune", "--kernel", "fwd", "--head-dims", "256",
                                    "--seq", "4096,16384", "--csv", "{out}/tune_forward_d256.csv"]]),
}


def parse_stage(text: str) -> tuple:
    """``NAME[:SECONDS]`` -> (name, seconds)."""
    name, _, secs = text.partition(":")
    if name not in STAGES:
        raise argparse.ArgumentTypeError(f"unknown stage {name!r}; choose from {', '.join(STAGES)}")
    try:
        limit = float(secs) if secs else float(STAGES[name][0])
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad time limit in {text!r}: NAME[:SECONDS]") from None
    if limit <= 0:
        raise argparse.ArgumentTypeError(f"the time limit of {name} must be positive, got {limit:g}")
    return name, limit


def tag(name: str, nproc: int) -> str:
    """The compile-log tag of a stage's compiles: its name and ranks (the world size is a constexpr)."""
    return f"{name}@{nproc}"


def commands(name: str, limit: float, out: str, nproc: int = 2, later=()) -> list:
    """The command lines of a stage, with its placeholders filled in; ``later``: the names of the stages after
    it in this session (what the warm stage compiles for)."""
    values = dict(out=out, limit_minus=f"{max(limit - 10, 5):g}", soak_seconds=f"{max(limit - 50, 10):g}",
                  nproc=nproc, later=",".join(tag(n, nproc) for n in later), later_names=",".join(later),
                  jobs=max(1, (os.cpu_count() or 2) - 2), share=gpus.mps_share(nproc))
    return [[arg.format(**values) for arg in cmd] for cmd in STAGES[name][1]]


def _join_parts(parts, joined: str) -> str:
    with open(joined, "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, f)
    return joined


def _unpack(parts, cache: str) -> int:
    """Unpack cache parts (a split tar, gzip or xz) into ``cache``; returns the number of files."""
    if not parts:
        return 0
    os.makedirs(cache, exist_ok=True)
    joined = _join_parts(parts, os.path.join(os.path.dirname(cache), "tcache.tar.part-joined"))
    with tarfile.open(joined, "r:*") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]  # nothing else travels
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(os.path.dirname(cache), members=members, **extra)
    os.remove(joined)
    return sum(1 for m in members if m.isfile())


def restore_cache(carry: str = CARRY, cache: str = CACHE) -> int:
    """Unpack the carried cache parts (if any) into ``cache``; returns the number of files restored."""
    return _unpack(sorted(glob.glob(os.path.join(carry, PART_PREFIX + "*"))), cache)


def cache_entries(cache: str = CACHE) -> set:
    """The entries (one folder per compiled variant) now in ``cache``."""
    return set(os.listdir(cache)) if os.path.isdir(cache) else set()


def save_cache(out: str, cache: str = CACHE, part_bytes: int = PART_BYTES, skip=()) -> list:
    """Write the entries of ``cache`` not in ``skip`` (what a launch needs of each: CACHE_SUFFIXES) as an
    xz-compressed tar split into parts of at most ``part_bytes`` under ``out``; returns their paths (none if
    there is nothing to write)."""
    files = [(e, name) for e in sorted(cache_entries(cache) - set(skip))
             for name in sorted(os.listdir(os.path.join(cache, e))) if name.endswith(CACHE_SUFFIXES)]
    if not files:  # (an entry of a compile that failed or was cut short holds none of them)
        return []
    joined = os.path.join(out, "tcache.tar.xz")
    with tarfile.open(joined, "w:xz", preset=1) as tar:  # (preset 6 took 5 minutes on 2 cores)
        for e, name in files:
            tar.add(os.path.join(cache, e, name), arcname=os.path.join(os.path.basename(cache), e, name))
    return _split(joined, out, PART_PREFIX, part_bytes)


def _split(joined: str, out: str, prefix: str, part_bytes: int = PART_BYTES) -> list:
    """Cut the file ``joined`` into ``out/{prefix}NN`` parts of at most ``part_bytes`` (a remote run returns
    files of at most 16 MiB), remove it; returns the parts' paths."""
    paths = []
    with open(joined, "rb") as f:
        while chunk := f.read(part_bytes):
            paths.append(os.path.join(out, f"{prefix}{len(paths):02d}"))
            with open(paths[-1], "wb") as part:
                part.write(chunk)
    os.remove(joined)
    return paths


BUNDLE_PREFIX = "results.tgz.part"


def bundle(out: str, part_bytes: int = PART_BYTES) -> list:
    """Put every file under ``out`` (several sessions' folders, their logs, JSON and cache parts) into one tar
    cut into ``results.tgz.partNN``: a remote run returns few files (a W=8 log was lost to that,
    2026-12-02). ``--collect`` takes such a bundle apart again. Returns the parts' paths."""
    files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    if not files:
        return []
    joined = os.path.join(tempfile.gettempdir(), f"results-bundle.{os.getpid()}.tgz")
    with tarfile.open(joined, "w:gz") as tar:
        for rel in files:
            tar.add(os.path.join(out, rel), arcname=rel)
    for rel in files:
        os.remove(os.path.join(out, rel))
    for d, _, _ in sorted(os.walk(out), reverse=True):
        if d != out and not os.listdir(d):
            os.rmdir(d)
    return _split(joined, out, BUNDLE_PREFIX, part_bytes)


def unbundle(returned: str) -> str:
    """The folder holding what a GPU run returned: ``returned`` itself, or, where it holds a bundle
    (``results.tgz.partNN``), a new folder it is unpacked into (the returned folder may be read-only)."""
    parts = sorted(glob.glob(os.path.join(returned, BUNDLE_PREFIX + "*")))
    if not parts:
        return returned
    dest = tempfile.mkdtemp(prefix="gpu-returned-")
    joined = _join_parts(parts, os.path.join(dest, ".bundle.tgz"))
    with tarfile.open(joined, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **extra)
    os.remove(joined)
    return dest


def pack(carry: str = CARRY, cache: str = CACHE) -> int:
    """Replace the carried parts with the whole local ``cache`` (as ``save_cache`` writes it); returns how many.
    The local cache is the master copy: variants warmed on this machine (tools/gpu_variants.py) and those
    GPU runs returned (``collect``)."""
    os.makedirs(carry, exist_ok=True)
    for old in glob.glob(os.path.join(carry, PART_PREFIX + "*")):
        os.remove(old)
    return len(save_cache(carry, cache))


def merge_compiles(returned: str, compiles: str = COMPILES) -> int:
    """Merge the compile log a GPU run returned into ``compiles``: a tag's records are replaced by the new
    run's (the latest set of variants a stage needed), other tags kept; returns the records now there."""
    new_path = os.path.join(returned, COMPILE_LOG)
    if not os.path.exists(new_path):
        return len(build.read_log(compiles)) if os.path.exists(compiles) else 0
    new = build.read_log(new_path)
    tags = {r.get("tag", "") for r in new}
    old = [r for r in build.read_log(compiles) if r.get("tag", "") not in tags] if os.path.exists(compiles) else []
    rows = sorted({json.dumps(r, sort_keys=True) for r in old + new})
    with open(compiles, "w") as f:
        f.writelines(row + "\n" for row in rows)
    return len(rows)


def returned_sessions(returned: str) -> list:
    """The folders under ``returned`` (unbundled) that a session wrote into (its compile log or cache parts):
    one per ``gpu_session.py`` run of the GPU run."""
    return sorted(d for d, _, fs in os.walk(returned)
                  if COMPILE_LOG in fs or any(f.startswith(PART_PREFIX) for f in fs))


def collect(returned: str, carry: str = CARRY, cache: str = CACHE) -> int:
    """Add the cache parts a GPU run returned (its new compiles, from every session folder in it; unbundled)
    to the local cache, then carry the whole local cache (``pack``); returns the number of parts carried."""
    parts = [sorted(glob.glob(os.path.join(d, PART_PREFIX + "*"))) for d in returned_sessions(returned)]
    if not any(parts):
        print(f"no {PART_PREFIX}* files under {returned}: no new compiles")
    for p in parts:
        _unpack(p, cache)
    return pack(carry, cache)


def run_stage(name: str, limit: float, out: str, log, nproc: int = 2, later=()) -> int:
    """Run the stage's commands one after another within ``limit`` seconds in all; returns the first
    non-zero exit code (124 when the limit stopped it), or 0. Their compiles are logged under the stage's tag."""
    end = time.monotonic() + limit
    env = dict(os.environ, **{build.COMPILE_TAG_ENV: tag(name, nproc)})
    for cmd in commands(name, limit, out, nproc, later):
        left = end - time.monotonic()
        log.write(f"\n=== {name}: {' '.join(cmd)} (limit {left:.0f} s)\n")
        log.flush()
        t0 = time.monotonic()
        if left <= 0:
            rc = 124
        else:
            # Its own process group: on a timeout every rank the launcher started is stopped with it (an
            # orphaned rank would go on using the GPUs under the next stage).
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=env)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
        log.write(f"=== {name}: exit {rc} after {time.monotonic() - t0:.0f} s\n")
        log.flush()
        if rc:
            return rc
    return 0


SAVE_RESERVE = 45  # seconds kept for writing the cache back at the end of a --budget


def stage_limits(stages, budget, reserve: float = SAVE_RESERVE) -> list:
    """The stages' time limits within ``budget`` seconds for the whole session (None: no budget), keeping
    ``reserve`` seconds for the cache save; stages are clipped in order, and those left without at least 5 s
    get 0 (skipped). Every stage in a GPU run should fit its limit, and the cache must be saved: a call
    stopped from outside loses both (it happened: the next call recompiled everything)."""
    if budget is None:
        return [limit for _, limit in stages]
    left, limits = budget - reserve, []
    for _, limit in stages:
        lim = min(limit, left)
        lim = lim if lim >= 5 else 0
        limits.append(lim)
        left -= lim
    return limits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", nargs="*", type=parse_stage, help="NAME[:SECONDS] ...")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where the log and the cache parts go ($OUT)")
    ap.add_argument("--collect", metavar="DIR", help="add the cache parts a GPU run returned to the local cache "
                    "(.cache/triton) and carry it (.tcache/); merge its compile log")
    ap.add_argument("--bundle", metavar="DIR", help="put every file under DIR (e.g. $OUT, after the sessions of a "
                    "GPU run) into results.tgz.partNN, since a remote run returns few files")
    ap.add_argument("--pack", action="store_true",
                    help="carry the local cache (.cache/triton, e.g. filled by ring_core.runtime.build --warm) in .tcache/")
    ap.add_argument("--nproc", type=int, default=2,
                    help="ranks per stage (default 2); more ranks than GPUs share them under one CUDA MPS daemon "
                         "that this runner starts first and stops last (ring_core.runtime.gpus)")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="wall time for the whole session: the stages' limits are clipped in order so that it "
                         f"ends, cache saved, within it ({SAVE_RESERVE} s kept for the save); use it inside a "
                         "GPU run's own limit")
    ap.add_argument("--no-ptxas-shim", action="store_true",
                    help="let jaxlib run its own ptxas on every variant in every process, instead of serving it "
                         "the cubin Triton built from the same PTX (ring_core/runtime/ptxas_shim.py)")
    a = ap.parse_args(argv)
    if a.bundle:
        print(f"{len(bundle(a.bundle))} bundle parts in {a.bundle}")
        return 0
    if a.pack:
        print(f"{pack()} cache parts now in {CARRY}")
        return 0
    if a.collect:
        src = unbundle(a.collect)
        if src != a.collect:
            print(f"bundle unpacked into {src}")
        carried = collect(src)
        records = [merge_compiles(d) for d in returned_sessions(src)]
        print(f"{carried} cache parts now in {CARRY}; {records[-1] if records else 'no new'} compile records in "
              f"{os.path.relpath(COMPILES, ROOT)}")
        return 0
    if not a.stages or not a.out:
        ap.error("give stages and --out (or $OUT), or --collect DIR")
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", CACHE)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("RING_ATTENTION_TIMEOUT_S", "60")  # a rank left waiting by a failure gets out soon
    os.environ[build.COMPILE_LOG_ENV] = os.path.join(a.out, COMPILE_LOG)  # brought back for --collect
    first_failure = 0
    n_gpus = gpus.visible_gpus()
    # One daemon for every stage (torchrun stages too); the launcher then uses it and starts none.
    start_mps, extra = gpus.mps_plan(a.nproc, n_gpus, "auto")
    mps = gpus.MpsDaemon()
    with open(os.path.join(a.out, "session.log"), "a") as log:
        log.write(f"restored {restore_cache(cache=os.environ['TRITON_CACHE_DIR'])} cached files\n")
        restored = cache_entries(os.environ["TRITON_CACHE_DIR"])
        if start_mps:
            extra.update(mps.start())
        os.environ.update(extra)
        if not a.no_ptxas_shim:
            # jaxlib's first launch of a variant in each process would run ptxas on its PTX (10-80 s a variant):
            # a ptxas first on PATH hands it the cubin in the (carried) Triton cache instead; one line per call
            # in ptxas.log says which it did.
            shim_dir = os.path.join("/tmp", f"ring_ptxas_shim.{os.getpid()}")
            try:
                log.write(f"ptxas shim: {ptxas_shim.install(shim_dir)} (real: {ptxas_shim.find_real()})\n")
                os.environ["PATH"] = shim_dir + os.pathsep + os.environ.get("PATH", "")
                os.environ[ptxas_shim.LOG_ENV] = os.path.join(a.out, "ptxas.log")
            except SystemExit as e:
                log.write(f"ptxas shim not installed: {e}\n")
        log.write(f"{a.nproc} ranks on {n_gpus} GPU(s); MPS: {'started, ' if start_mps else ''}{extra}\n")
        try:
            names = [n for n, _ in a.stages]
            for i, ((name, _), limit) in enumerate(zip(a.stages, stage_limits(a.stages, a.budget))):
                if not limit:
                    log.write(f"\n=== {name}: skipped, no time left in --budget {a.budget:g} s\n")
                    print(f"gpu_session: {name}: skipped (budget)", flush=True)
                    first_failure = first_failure or 124
                    continue
                rc = run_stage(name, limit, a.out, log, a.nproc, later=names[i + 1:])
                print(f"gpu_session: {name}: exit {rc}", flush=True)
                first_failure = first_failure or rc
                if start_mps and (rc or name == "kill") and names[i + 1:]:
                    # A rank ended with its kernel in flight (a stage stopped at its limit, a failure, the kill
                    # check) faults the GPU for every MPS client, later ones included: at 8 ranks the next
                    # stage's ranks failed at once with "CUDA-capable device(s) is/are busy or unavailable"
                    # (2026-12-02). A fresh daemon for the next stage.
                    mps.stop()
                    try:
                        extra.update(mps.start())
                        os.environ.update(extra)
                        log.write(f"MPS daemon restarted after {name} (exit {rc})\n")
                    except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # the next stages say so
                        log.write(f"MPS daemon not restarted after {name}: {e}\n")
        finally:
            mps.stop()
            if not a.no_ptxas_shim:
                shutil.rmtree(shim_dir, ignore_errors=True)
        parts = save_cache(a.out, cache=os.environ["TRITON_CACHE_DIR"], skip=restored)
        log.write(f"saved this session's compiles in {len(parts)} parts\n")
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
