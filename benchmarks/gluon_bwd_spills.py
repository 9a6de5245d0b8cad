"""ptxas's spills in the Gluon backward (ring_core.kernels.gluon_bwd) as compiled for sm_90 on the CPU, and where they sit:
the local loads and stores (LDL/STL) inside each loop of the SASS that holds warpgroup MMAs (the consumers' steps).
bf16, B=1, H=32, D=128, seq_local 16384: world size 1 non-causal and causal contiguous, world size 2 causal zigzag;
with ``--probe``, benchmarks/gluon_bwd.py's probe too. Needs the GPU machine's Triton (3.6) for its numbers to be
the ones that run there; nvdisasm comes with Triton. Run from a tree's root (any tree with ring_core.kernels.gluon_bwd, e.g.
a git worktree of an older commit):

    TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD python benchmarks/gluon_bwd_spills.py [--probe] [--masks]

``--masks``: the variants with segment ids or a window instead (deterministic=False only): segment ids at
world size 1 and 2 (causal), a causal window of 4095 at world size 1.

It found the wgmma descriptors the consumers' loop once reloaded every step (docs/performance.md).
"""
import inspect
import os
import re
import subprocess
import sys
import tempfile

from triton.backends.nvidia.compiler import get_ptxas

from ring_core.runtime import build
from ring_core.protocol import control
from ring_core import plans, validate


def sass(ptx: str) -> tuple:
    """(ptxas's spill report, the SASS text) of ``ptx`` for sm_90a."""
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


def main() -> int:
    build._iris_device_only()
    heap = control.HeapLayout.for_workspace(8 << 30)
    from ring_core.kernels import gluon_bwd

    det_ok = "DETERMINISTIC" in inspect.getsource(gluon_bwd)  # the deterministic order (trees from 2026-12-02 on)
    variants = [(W, causal, det, None, False) for W, causal, det in (
        (1, False, False), (1, True, False), (2, True, False), (1, False, True), (1, True, True), (2, True, True))]
    if "--masks" in sys.argv:
        variants = [(1, True, False, None, True), (2, True, False, None, True), (1, True, False, (4095, 0), False)]
    for W, causal, det, window, seg in variants:
        if det and not det_ok:
            continue
        spec = validate.check_attention_args((1, 16384, 32, 128), (1, 16384, 32, 128), (1, 16384, 32, 128),
                                             "bfloat16", "bfloat16", "bfloat16", is_causal=causal, scale=None,
                                             layout="zigzag" if W > 1 else "contiguous", backend="fused",
                                             backends=("fused",), window_size=window,
                                             segment_ids_shape=(1, 16384) if seg else None,
                                             segment_ids_dtype="int32" if seg else None)
        kw = {"deterministic": True, "gluon_det": True} if det else {}  # the Gluon kernel's own order
        if "gluon_det" not in inspect.signature(plans.plan_bwd).parameters:  # (trees before ff5e45c)
            kw.pop("gluon_det", None)
        p = plans.plan_bwd(spec, W, heap, capability=(9, 0), **kw)
        # Specialised on the scalars' values as the launches are (batch 1 folded in): LaunchPlan.compile_record.
        n_in = len(p.arg_types()) - len(p.scalar_types) - len(p.out_shapes)
        ck = build.compile_kernel(p.kernel(), p.arg_types(), p.constexprs(), num_warps=p.config.num_warps,
                                  num_stages=p.config.num_stages, capability=90,
                                  values=[None] * n_in + list(p.scalars()) + [None] * len(p.out_shapes))
        report, text = sass(ck.asm["ptx"])
        name = (f"product W={W} causal={causal}{' deterministic' if det else ''}{' window' if window else ''}"
                f"{' segment ids' if seg else ''}")
        print(f"{name}: {report}; MMA loops (instructions, LDL/STL): {mma_loops(text)}")
    if "--probe" in sys.argv and "--masks" not in sys.argv:
        from benchmarks import gluon_bwd

        # Older trees, before the probe ran the product's loop, had dQ modes: 1 (TMA reductions) is that loop.
        kw = {"dq_mode": 1} if "dq_mode" in inspect.signature(gluon_bwd.compile_for_sm90).parameters else {}
        for causal in (False, True):
            report, text = sass(gluon_bwd.compile_for_sm90(causal=causal, **kw).asm["ptx"])
            print(f"probe causal={causal}: {report}; MMA loops (instructions, LDL/STL): {mma_loops(text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
