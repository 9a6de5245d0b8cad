"""Properties of the fused kernels (forward: ring_core.kernels.tl_fwd; backward, cases named "bwd ...":
ring_core.kernels.tl_bwd) as compiled for Hopper (sm_90), checked on CPU: Triton compiles for a GPU target
without a GPU. The compile runs in a subprocess, since this test process may hold the
interpreted kernel (TRITON_INTERPRET=1, see test_simulate.py).

Properties:
* no loop that Triton software-pipelines (it issues async copies of later iterations ahead) contains an
  acquire. An acquire there does not order the copies issued before it, so K/V could be read from a
  receive slot before the peer's data arrived; an earlier version of the kernel had exactly that;
* every K/V loop (one with a dot) *is* pipelined, for local K/V and for the receive slots, in every dtype:
  a loop that is not waits out the full memory latency on every block (v0 was 5-15x below cuDNN so);
* the pushes to peers are 16-byte vector stores (iris.store's alignment hint); without it they were
  2-byte stores over NVLink, about 6 GB/s, the largest cost of every call in v1;
* shared memory fits Hopper;
* ptxas keeps the wgmma pipelined: its warning C7515 ("wgmma.mma_async instructions are serialized due to
  non wgmma instructions defining accumulator registers") means every k-step of every matmul in the kernel
  waits for the one before. The backward had it until 2026-11-30 (a dQ loop nest followed by another loop).

The cases with a window or segment ids compile the masked variants (WINDOW, SEGMENTED): more K/V
loops (a masked one before the unmasked one), the segment ids' range pass and the ids pushed with the K/V; the
same properties must hold. Run this file under both Triton versions the project meets: the GPU machine's 3.6
(``/work/venv36/bin/python -m pytest tests/cpu/test_kernel_ir.py``) and CI's.

Pointer arguments are compiled as 16-byte aligned, as ring_core.runtime.build declares them and as torch's launcher
specialises aligned tensors.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COMPILE = textwrap.dedent("""
    import json, os, re, subprocess, sys, tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    from ring_core.runtime import build
    from ring_core.protocol import control
    from ring_core import plans, validate
    from ring_core.kernels.tl_fwd import ring_attn_fwd_kernel
    from ring_core.kernels.tl_bwd import ring_attn_bwd_kernel
    TT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    out = {}
    for name, (dt, d, hkv, causal, layout, *masks) in json.loads(sys.argv[1]).items():
        window, segmented = masks or (None, False)
        spec = validate.check_attention_args((1, 514, 4, d), (1, 514, hkv, d), (1, 514, hkv, d), dt, dt, dt,
                                             is_causal=causal, scale=None, layout=layout, backend="fused",
                                             backends=("fused",), window_size=window,
                                             segment_ids_shape=(1, 514) if segmented else None,
                                             segment_ids_dtype="int32" if segmented else None)
        heap = control.HeapLayout.for_workspace(1 << 30)
        t = TT[dt]
        if name.startswith("bwd "):
            kernel, p = ring_attn_bwd_kernel, plans.plan_bwd(spec, 2, heap)
            types = ["*" + t] * 5 + ["*fp32", "*fp32", "*i32", "*i32"] + list(p.scalar_types) + ["*" + t] * 3 + ["*fp32", "*i32"]
        else:
            kernel, p = ring_attn_fwd_kernel, plans.plan(spec, 2, heap)
            types = ["*" + t] * 3 + ["*i32", "*i32"] + list(p.scalar_types) + ["*" + t, "*fp32", "*i32"]
        consts = p.constexprs(sticky_errors=name.endswith("sticky"))
        # the JAX launcher's compile (ring_core.runtime.build): what runs on the GPU
        ck = build.compile_kernel(kernel, types, consts, num_warps=p.config.num_warps,
                                  num_stages=p.config.num_stages, capability=90)
        # ptxas's own report on the PTX (registers, spills, and warnings such as C7515, wgmma serialised).
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ck.asm["ptx"])
            ptxas = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o",
                                    os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
        out[name] = dict(ttgir=ck.asm["ttgir"], shared=ck.metadata.shared, ptxas=ptxas.stderr,
                         stores=sorted(set(re.findall(r"st\\.global(?:\\.[a-z0-9]+)*", ck.asm["ptx"]))),
                         constexprs={k: v for k, v in consts.items() if k in ("WINDOW", "SEGMENTED")})
    print(json.dumps(out))
""")

CASES = {  # name: (dtype, head_dim, kv_heads, causal, layout[, window, segmented])
    "fp32 d64 mqa": ("float32", 64, 1, False, "contiguous"),
    "bf16 d128": ("bfloat16", 128, 4, False, "contiguous"),
    "bf16 d128 causal zigzag": ("bfloat16", 128, 4, True, "zigzag"),
    "fp16 d64 gqa causal": ("float16", 64, 2, True, "contiguous"),
    # The backward: K/V, partial dK/dV and delta are all acquired before the loops that read them; its dQ
    # loops (per ring step, unmasked and masked) and dK/dV loops over query blocks must all be pipelined.
    "bwd fp32 d64 mqa": ("float32", 64, 1, False, "contiguous"),
    "bwd fp16 d80 gqa causal": ("float16", 80, 2, True, "contiguous"),
    # bf16 d128 causal zigzag, compiled once, with JAX's deferred error mode (STICKY_ERRORS): the end-of-call
    # path that keeps a failure on the heap. STICKY_ERRORS only adds a branch to that path (protocol.finish_call,
    # after every loop), so this one compile checks this variant's K/V loops for the plain (torch) variant too;
    # the plain end-of-call path is compiled in every other "bwd" case (CI-time cut: a separate plain compile of
    # this variant checked the same loops again).
    "bwd bf16 d128 causal zigzag sticky": ("bfloat16", 128, 4, True, "zigzag"),
    # Masks: a causal sliding window, segment ids (packed sequences), and both, forward and backward.
    "bf16 d128 causal window": ("bfloat16", 128, 4, True, "contiguous", (300, -1), False),
    "fp16 d64 gqa segmented zigzag": ("float16", 64, 2, False, "zigzag", None, True),
    "bf16 d128 window segmented zigzag": ("bfloat16", 128, 4, False, "zigzag", (200, 40), True),
    "bwd bf16 d128 causal zigzag window": ("bfloat16", 128, 4, True, "zigzag", (300, -1), False),
    "bwd fp16 d64 gqa segmented": ("float16", 64, 2, True, "contiguous", None, True),
    "bwd bf16 d128 window segmented": ("bfloat16", 128, 4, False, "contiguous", (200, 40), True),
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
    """Every case compiled, in as many subprocesses as there are CPUs (compiles are single-threaded; the test
    process only waits meanwhile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    names = sorted(CASES)
    n = max(1, min(len(names), os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE, json.dumps({k: CASES[k] for k in names[i::n]})],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    out = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-4000:]
        out.update(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_acquire_inside_pipelined_loop(compiled, name):
    ttgir = compiled[name]["ttgir"]
    pipelined = [b for b in _loops(ttgir) if "ttg.async_copy_global_to_local" in b]
    for body in pipelined:
        assert "acquire" not in body, "an acquire sits inside a pipelined loop: its loads can run ahead of it"
    assert "acquire, sys" in ttgir  # the waits exist, outside those loops


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_kv_loop_is_pipelined(compiled, name):
    # Innermost loops with a dot are the K/V loops: per ring step, an unmasked and a masked one (step 0
    # also nests its unmasked loop in the push-claim loop; a window or segment ids add a masked one before
    # the unmasked one). All must issue async copies ahead.
    kv_loops = [b for b in _loops(compiled[name]["ttgir"]) if "dot" in b and b.count("scf.for") == 1]
    masked = any(compiled[name]["constexprs"].values())
    assert masked == (len(CASES[name]) > 5)
    assert len(kv_loops) >= (6 if masked else 4)
    for body in kv_loops:
        assert "ttg.async_copy_global_to_local" in body, "a K/V loop is not software-pipelined"


@pytest.mark.parametrize("name", sorted(CASES))
def test_shared_memory_fits_hopper(compiled, name):
    assert compiled[name]["shared"] <= 227 * 1024


@pytest.mark.parametrize("name", sorted(CASES))
def test_stores_are_vectorised(compiled, name):
    # Every global store (pushes to peers, out, lse, flags) is 32-bit or a vector: none is a 2-byte scalar.
    stores = compiled[name]["stores"]
    assert any(".v4" in s for s in stores), stores
    assert not [s for s in stores if s.endswith(".b16") or s.endswith(".u16")], stores


@pytest.mark.parametrize("name", sorted(CASES))
def test_wgmma_not_serialised(compiled, name):
    report = compiled[name]["ptxas"]
    assert "C7515" not in report, report
    assert "Used" in report, report  # ptxas ran and reported
