"""ptxas's register and spill report for the fused kernels as compiled for sm_90 on CPU (no GPU needed): forward and
backward, bf16 D128 H32 causal zigzag, seq_local 16384, world size 1, with S unspecialised and with S known
divisible by 16 (what Triton's JIT compiles for such lengths). Run from a tree's root, e.g. under Triton 3.6:

    TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD python benchmarks/ptxas_spills.py

It also runs on trees from before ring_core.plans (e.g. b768330, the kernels of ../shared/gpu/README.md's world-size-1
table): ``git worktree add /tmp/wt_old b768330; cd /tmp/wt_old; PYTHONPATH=$PWD python /path/to/ptxas_spills.py``.
"""
import os, re, subprocess, sys, tempfile, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.backends.nvidia.compiler import get_ptxas
from ring_core import validate
try:
    from ring_core.protocol import control
    from ring_core import plans
    heap_layout, old_api = control.HeapLayout, False
except ImportError:  # before ring_core.plans: ring_core.launch held the plans (b768330)
    from ring_core import launch as plans
    heap_layout, old_api = plans.HeapLayout, True
from ring_core.kernels.tl_fwd import ring_attn_fwd_kernel
from ring_core.kernels.tl_bwd import ring_attn_bwd_kernel
seg = "seg_ptr" in ring_attn_fwd_kernel.arg_names
spec = validate.check_attention_args((1, 16384, 32, 128), (1, 16384, 32, 128), (1, 16384, 32, 128), "bfloat16", "bfloat16", "bfloat16",
    is_causal=True, scale=None, layout="zigzag", backend="fused", backends=("fused",))
heap = heap_layout.for_workspace(8 << 30)
ctx = "*i64" if old_api else "*i32"  # the context as launched: int64 by torch then, int32 words by both frontends now
for kind in ("fwd", "bwd"):
    if kind == "bwd":
        k, p = ring_attn_bwd_kernel, plans.plan_bwd(spec, 1, heap)
        scal = ["i32", "i32", "fp32", "i64", "i32"] if old_api else list(p.scalar_types)
        types = ["*bf16"] * 5 + ["*fp32", "*fp32"] + (["*i32"] if seg else []) + [ctx] + scal + ["*bf16"] * 3 + ["*fp32", "*i32"]
    else:
        k, p = ring_attn_fwd_kernel, plans.plan(spec, 1, heap)
        scal = ["i32", "i32", "fp32", "i64"] if old_api else list(p.scalar_types)
        types = ["*bf16"] * 3 + (["*i32"] if seg else []) + [ctx] + scal + ["*bf16", "*fp32", "*i32"]
    names = [q.name for q in k.params if not q.is_constexpr]
    consts = p.constexprs(interpret=False) if old_api else p.constexprs()
    sig = dict(zip(names, types)); sig.update({c: "constexpr" for c in consts})
    order = [q.name for q in k.params]; sig = {n: sig[n] for n in order}
    for spec_s in (False, True):
        attrs = {(order.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*") or (spec_s and n == "S")}
        ck = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=p.config.num_warps, num_stages=p.config.num_stages))
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx"); open(src, "w").write(ck.asm["ptx"])
            r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
        info = re.findall(r"Used (\d+) registers|(\d+) bytes spill stores|(\d+) bytes stack frame", r.stderr)
        print(kind, "S-divisible" if spec_s else "S-unspecialised", re.sub(r"\s+", " ", " ".join(l for l in r.stderr.splitlines() if "Used" in l or "spill" in l or "C7515" in l))[:300], "ptx lines", ck.asm["ptx"].count("\n"), "mma", ck.asm["ptx"].count("wgmma.mma_async"))
