"""Properties of the fused kernel as compiled for Hopper (sm_90), checked on CPU: Triton compiles for a
GPU target without a GPU. The compile runs in a subprocess, since this test process may hold the
interpreted kernel (TRITON_INTERPRET=1, see test_simulate.py).

The property: no loop that Triton software-pipelines (it issues async copies of later iterations ahead)
contains an acquire. An acquire there does not order the copies issued before it, so K/V could be read
from a receive slot before the peer's data arrived; an earlier version of the kernel had exactly that.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

COMPILE = textwrap.dedent("""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ring_core import launch, validate
    from ring_core.kernel import ring_attn_fwd_kernel
    TT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    out = {}
    for name, (dt, d, hkv, causal, layout) in json.loads(sys.argv[1]).items():
        spec = validate.check_attention_args((1, 514, 4, d), (1, 514, hkv, d), (1, 514, hkv, d), dt, dt, dt,
                                             is_causal=causal, scale=None, layout=layout, backend="fused",
                                             backends=("fused",))
        p = launch.plan(spec, 2, launch.HeapLayout.for_workspace(1 << 30))
        consts = p.constexprs(interpret=False)
        t = TT[dt]
        sig = dict(q_ptr="*" + t, k_ptr="*" + t, v_ptr="*" + t, ctx_ptr="*i32", B="i32", S="i32", sm_scale="fp32",
                   timeout_ns="i64", out_ptr="*" + t, lse_ptr="*fp32", status_ptr="*i32")
        sig.update({k: "constexpr" for k in consts})
        ck = triton.compile(ASTSource(fn=ring_attn_fwd_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=p.config.num_warps, num_stages=p.config.num_stages))
        out[name] = dict(ttgir=ck.asm["ttgir"], shared=ck.metadata.shared)
    print(json.dumps(out))
""")

CASES = {  # name: (dtype, head_dim, kv_heads, causal, layout)
    "fp32 d64 mqa": ("float32", 64, 1, False, "contiguous"),
    "bf16 d128": ("bfloat16", 128, 4, False, "contiguous"),
    "bf16 d128 causal zigzag": ("bfloat16", 128, 4, True, "zigzag"),
}


def _loops(ttgir: str):
    """Yield the text of every scf.for body (nested bodies included in their parents)."""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.for" not in line or not line.rstrip().endswith("{"):
            continue
        depth, body = 0, []
        for l in lines[i:]:
            depth += l.count("{") - l.count("}")
            body.append(l)
            if depth <= 0:
                break
        yield "\n".join(body)


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(CASES)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_acquire_inside_pipelined_loop(compiled, name):
    ttgir = compiled[name]["ttgir"]
    pipelined = [b for b in _loops(ttgir) if "ttg.async_copy_global_to_local" in b]
    for body in pipelined:
        assert "acquire" not in body, "an acquire sits inside a pipelined loop: its loads can run ahead of it"
    assert "acquire, sys" in ttgir  # the waits exist, outside those loops


def test_property_is_not_vacuous(compiled):
    # With Triton 3.9 the fp32 K/V loops are pipelined with async copies (the bf16 ones are not yet:
    # issue 4); the earlier kernel put its acquire inside exactly such a loop.
    assert any("ttg.async_copy_global_to_local" in b for b in _loops(compiled["fp32 d64 mqa"]["ttgir"]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_shared_memory_fits_hopper(compiled, name):
    assert compiled[name]["shared"] <= 227 * 1024
