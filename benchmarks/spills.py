"""ptxas's registers and spills in a Gluon Hopper kernel as ring_core.plans launches it on an H200, compiled for sm_90
on the CPU, and where the spills sit: the local loads and stores (LDL/STL) inside each loop of the SASS that holds
warpgroup MMAs (the consumers' steps).

* ``--kernel fwd`` (ring_core.kernels.gluon_fwd): bf16, B=1, H=32, seq_local 16384, head_dim 64, 128 and 256
  (``--dims``): world size 1 non-causal and causal contiguous, world size 2 causal zigzag with GQA 32/8; with the
  kernel's tiles, shared memory and ``setmaxnreg`` values, and its global stores by width and shuffles (the rows of O:
  ``_store_rows``). Head dims the tree's plans do not give the Gluon kernel are reported as such.
* ``--kernel bwd`` (ring_core.kernels.gluon_bwd): bf16, B=1, H=32, seq_local 16384, head_dim 128 (``--dims``): world
  size 1 non-causal and causal contiguous, world size 2 causal zigzag, each in any order and in the deterministic
  one.

``--masks``: the variants of the masked benchmarks instead (causal; segment ids at world size 1 and 2, a causal window
of 4096 tokens at world size 1; the backward's in any order only). ``--ptx DIR``: also write each variant's PTX there
without its debug line information (``.loc`` / ``.file`` directives and the debug sections), to compare two trees'
binaries (``diff -r``).

Needs the GPU machine's Triton (3.6) for its numbers to be the ones that run there; nvdisasm comes with Triton. Run
from a tree's root (any tree with ring_core.kernels.gluon_fwd and gluon_bwd, e.g. a git worktree of an older commit):

    TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD python -m benchmarks.spills --kernel fwd [--dims 64,128,256] [--masks]
    TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD python -m benchmarks.spills --kernel bwd [--masks] [--ptx DIR]

The backward's found the wgmma descriptors the consumers' loop once reloaded every step.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEQ = 16384


def sass(ptx: str) -> tuple:
    """(ptxas's spill report, the SASS text) of ``ptx`` for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", cubin], capture_output=True,
                           text=True)
        nvdisasm = os.path.join(os.path.dirname(get_ptxas(90).path), "nvdisasm")
        text = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
    return " | ".join(line.strip() for line in r.stderr.splitlines() if "spill" in line), text


def mma_loops(text: str) -> list:
    """(instructions, local loads and stores) of each loop (a backward branch to a label) that holds an HGMMA and
    fewer than 2,000 instructions: the steps of the consumers."""
    labels, lines = {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(lines)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line):
            lines.append(line)
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b.*?`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i + 1) <= i:
            body = lines[labels[m.group(1)]:i + 1]
            if len(body) < 2000 and any("HGMMA" in x for x in body):
                out.append((len(body), sum(bool(re.search(r"\b(LDL|STL)", x)) for x in body)))
    return out


def strip_debug(ptx: str) -> str:
    """``ptx`` without its debug line information: what two trees' binaries are compared on."""
    keep = [line for line in ptx.splitlines() if not re.match(r"\s*\.(loc|file)\b", line)]
    text = "\n".join(keep)
    return re.sub(r"\n\s*\.section\s+\.debug_\w+\s*\{.*?\n\s*\}", "", text, flags=re.S)


def _spec(D: int, W: int, causal: bool, hkv: int, window=None, segs: bool = False):
    from ring_core import validate

    return validate.check_attention_args((1, SEQ, 32, D), (1, SEQ, hkv, D), (1, SEQ, hkv, D), "bfloat16", "bfloat16",
                                         "bfloat16", is_causal=causal, scale=None,
                                         layout="zigzag" if W > 1 else "contiguous", backend="fused",
                                         backends=("fused",), window_size=window,
                                         segment_ids_shape=(1, SEQ) if segs else None,
                                         segment_ids_dtype="int32" if segs else None)


def fwd_cases(dims, masks: bool = False):
    """(name, spec, world size) of every forward variant reported; ``masks``: those of the masked benchmarks."""
    rows = ((1, True, 32, None, True), (2, True, 8, None, True), (1, True, 32, (4095, 0), False)) if masks else \
        ((1, False, 32, None, False), (1, True, 32, None, False), (2, True, 8, None, False))
    for D in dims:
        for W, causal, hkv, window, segs in rows:
            layout = "zigzag" if W > 1 else "contiguous"
            mask = (f"-window{window[0]}" if window else "") + ("-segments" if segs else "")
            yield (f"fwd-D{D}-W{W}-{'causal' if causal else 'full'}-{layout}-hkv{hkv}{mask}",
                   _spec(D, W, causal, hkv, window, segs), W)


def bwd_cases(dims=(128,), masks: bool = False):
    """(name, spec, world size, deterministic) of every backward variant reported."""
    rows = ((1, True, False, None, True), (2, True, False, None, True), (1, True, False, (4095, 0), False)) if masks \
        else tuple((W, causal, det, None, False) for det in (False, True)
                   for W, causal in ((1, False), (1, True), (2, True)))
    for D in dims:
        for W, causal, det, window, segs in rows:
            mask = (f"-window{window[0]}" if window else "") + ("-segments" if segs else "")
            yield (f"bwd-D{D}-W{W}-{'causal' if causal else 'full'}{'-deterministic' if det else ''}{mask}",
                   _spec(D, W, causal, 32, window, segs), W, det)


def _compiled(p):
    """The plan's kernel compiled for sm_90, specialised on the scalars' values as the launches are (batch 1 folded
    in): LaunchPlan.compile_record."""
    from ring_core.runtime import build

    n_in = len(p.arg_types()) - len(p.scalar_types) - len(p.out_shapes)
    return build.compile_kernel(p.kernel(), p.arg_types(), p.constexprs(), num_warps=p.config.num_warps,
                                num_stages=p.config.num_stages, capability=90,
                                values=[None] * n_in + list(p.scalars()) + [None] * len(p.out_shapes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spills", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", required=True, choices=("fwd", "bwd"), help="the Hopper forward or backward")
    ap.add_argument("--dims", default=None, help="head dims, comma-separated (fwd: 64,128,256; bwd: 128)")
    ap.add_argument("--masks", action="store_true", help="the masked variants (segment ids, a window) instead")
    ap.add_argument("--ptx", default=None, help="a directory for each variant's PTX without debug lines")
    args = ap.parse_args(argv)
    from ring_core import plans
    from ring_core.protocol import control
    from ring_core.runtime import build

    build._iris_device_only()
    heap = control.HeapLayout.for_workspace(8 << 30)
    if args.ptx:
        os.makedirs(args.ptx, exist_ok=True)
    dims = [int(d) for d in (args.dims or ("64,128,256" if args.kernel == "fwd" else "128")).split(",")]
    if args.kernel == "fwd":
        variants = [(name, spec, plans.plan(spec, W, heap, capability=(9, 0)))
                    for name, spec, W in fwd_cases(dims, args.masks)]
    else:  # deterministic: the Gluon kernel's own order
        variants = [(name, spec, plans.plan_bwd(spec, W, heap, capability=(9, 0),
                                                **({"deterministic": True, "gluon_det": True} if det else {})))
                    for name, spec, W, det in bwd_cases(dims, args.masks)]
    for name, spec, p in variants:
        if not p.config.gluon:
            print(f"{name}: not the Gluon kernel in this tree's plans")
            continue
        ck = _compiled(p)
        ptx = ck.asm["ptx"]
        if args.ptx:
            with open(os.path.join(args.ptx, f"{name}.ptx"), "w") as f:
                f.write(strip_debug(ptx))
        report, text = sass(ptx)
        line = f"{name}: {report}; MMA loops (instructions, LDL/STL): {mma_loops(text)}"
        if args.kernel == "fwd":
            regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
            tiles = getattr(plans, "GLUON_TILES", {}).get(spec.head_dim, ())
            rings = tiles[3] if len(tiles) > 3 else 1  # K and V in rings of their own (2) or sharing slots (1)
            line = (f"{name}: tiles {p.config.block_m}x{p.config.block_n} slots {p.config.num_stages} rings {rings}, "
                    f"shared {ck.metadata.shared / 1024:.1f} KiB, setmaxnreg {regs}, "
                    f"ws {'ttg.warp_specialize' in ck.asm['ttgir']}; {report}; MMA loops (instructions, LDL/STL): "
                    f"{mma_loops(text)}; global stores (16 / 4 bytes a thread) "
                    f"{len(re.findall(r'STG[.]E[.]128', text))} / {len(re.findall(r'STG[.]E ', text))}, SHFL "
                    f"{len(re.findall(r'SHFL', text))}")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
