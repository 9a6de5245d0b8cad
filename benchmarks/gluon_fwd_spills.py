"""ptxas's registers and spills in the Gluon forward (ring_core.kernels.gluon_fwd) as ring_core.plans launches it on an
H200, compiled for sm_90 on the CPU, and where the spills sit: the local loads and stores (LDL/STL) inside each loop
of the SASS that holds warpgroup MMAs (the consumers' steps); with the kernel's shared memory, and its global stores
by width and shuffles (the rows of O: ``_store_rows``). bf16, B=1, H=32,
seq_local 16384, head_dim 64, 128 and 256: world size 1 non-causal and causal contiguous, world size 2 causal zigzag
with GQA 32/8. Needs the GPU machine's Triton (3.6) for its numbers to be the ones that run there; nvdisasm comes
with Triton. Run from a tree's root (any tree with ring_core.kernels.gluon_fwd, e.g. a git worktree of an older commit):

    TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD python benchmarks/gluon_fwd_spills.py [--dims 64,128,256] [--ptx DIR] \
        [--masks]

``--ptx DIR``: also write each variant's PTX there without its debug line information (``.loc`` / ``.file``
directives and the debug sections), to compare two trees' binaries (``diff -r``). Head dims the tree's plans do not
give the Gluon kernel are reported as such. The same maths as benchmarks/gluon_bwd_spills.py (``sass``,
``mma_loops``).
"""
import argparse
import os
import re

from benchmarks.gluon_bwd_spills import mma_loops, sass
from ring_core.runtime import build
from ring_core.protocol import control
from ring_core import plans, validate


def cases(dims, masks=False):
    """(name, spec, world size) of every variant reported; ``masks``: those of the masked benchmarks instead (causal,
    segment ids at world size 1 and 2, a causal window of 4096 tokens at world size 1)."""
    rows = ((1, True, 32, None, True), (2, True, 8, None, True), (1, True, 32, (4095, 0), False)) if masks else \
        ((1, False, 32, None, False), (1, True, 32, None, False), (2, True, 8, None, False))
    for D in dims:
        for W, causal, hkv, window, segs in rows:
            layout = "zigzag" if W > 1 else "contiguous"
            spec = validate.check_attention_args((1, 16384, 32, D), (1, 16384, hkv, D), (1, 16384, hkv, D),
                                                 "bfloat16", "bfloat16", "bfloat16", is_causal=causal, scale=None,
                                                 layout=layout, backend="fused", backends=("fused",),
                                                 window_size=window, segment_ids_shape=(1, 16384) if segs else None,
                                                 segment_ids_dtype="int32" if segs else None)
            mask = (f"-window{window[0]}" if window else "") + ("-segments" if segs else "")
            yield f"D{D}-W{W}-{'causal' if causal else 'full'}-{layout}-hkv{hkv}{mask}", spec, W


def strip_debug(ptx: str) -> str:
    """``ptx`` without its debug line information: what two trees' binaries are compared on."""
    keep = [line for line in ptx.splitlines() if not re.match(r"\s*\.(loc|file)\b", line)]
    text = "\n".join(keep)
    return re.sub(r"\n\s*\.section\s+\.debug_\w+\s*\{.*?\n\s*\}", "", text, flags=re.S)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64,128,256", help="head dims, comma-separated")
    ap.add_argument("--ptx", default=None, help="a directory for each variant's PTX without debug lines")
    ap.add_argument("--masks", action="store_true", help="the masked variants (segment ids, a window) instead")
    args = ap.parse_args(argv)
    build._iris_device_only()
    heap = control.HeapLayout.for_workspace(8 << 30)
    if args.ptx:
        os.makedirs(args.ptx, exist_ok=True)
    for name, spec, W in cases((int(d) for d in args.dims.split(",")), args.masks):
        p = plans.plan(spec, W, heap, capability=(9, 0))
        if not p.config.gluon:
            print(f"{name}: not the Gluon kernel in this tree's plans")
            continue
        # Specialised on the scalars' values as the launches are (batch 1 folded in): LaunchPlan.compile_record.
        n_in = len(p.arg_types()) - len(p.scalar_types) - len(p.out_shapes)
        ck = build.compile_kernel(p.kernel(), p.arg_types(), p.constexprs(), num_warps=p.config.num_warps,
                                  num_stages=p.config.num_stages, capability=90,
                                  values=[None] * n_in + list(p.scalars()) + [None] * len(p.out_shapes))
        ptx = ck.asm["ptx"]
        if args.ptx:
            with open(os.path.join(args.ptx, f"{name}.ptx"), "w") as f:
                f.write(strip_debug(ptx))
        report, text = sass(ptx)
        regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
        tiles = getattr(plans, "GLUON_TILES", {}).get(spec.head_dim, ())
        rings = tiles[3] if len(tiles) > 3 else 1  # K and V in rings of their own (2) or sharing slots (1)
        print(f"{name}: tiles {p.config.block_m}x{p.config.block_n} slots {p.config.num_stages} rings {rings}, shared "
              f"{ck.metadata.shared / 1024:.1f} KiB, setmaxnreg {regs}, ws {'ttg.warp_specialize' in ck.asm['ttgir']}; "
              f"{report}; MMA loops (instructions, LDL/STL): {mma_loops(text)}; global stores (16 / 4 bytes a "
              f"thread) {len(re.findall(r'STG[.]E[.]128', text))} / {len(re.findall(r'STG[.]E ', text))}, SHFL "
              f"{len(re.findall(r'SHFL', text))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
