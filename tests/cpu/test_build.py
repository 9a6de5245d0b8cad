"""ring_core.runtime.build (the compile of a fused launch for a GPU, through Triton's cache) and the JAX custom call on
top of it (jax_ring._triton_call), on CPU: Triton compiles for sm_90 without a GPU; the custom call's abstract
evaluation and its jaxlib parameter list are checked with a stand-in for jaxlib's GPU library (the launch itself
runs in tests/gpu/gpu_checks.py). Compiles run in a subprocess: this process may hold the interpreted kernels
(TRITON_INTERPRET=1, see test_simulate.py)."""

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from ring_core import testing

ROOT = Path(__file__).resolve().parents[2]

COMPILE = textwrap.dedent("""
    import json, re, sys, time
    import triton
    import triton.language as tl
    from ring_core.runtime import build
    from ring_core.protocol import control
    from ring_core import plans, validate
    from ring_core.kernels.tl_fwd import ring_attn_fwd_kernel
    from ring_core.kernels.tl_bwd import ring_attn_bwd_kernel

    @triton.jit
    def tma_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        # device-side TMA descriptors: the compiled kernel needs global scratch for them
        src = tl.make_tensor_descriptor(x_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
        dst = tl.make_tensor_descriptor(y_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
        off = tl.program_id(0) * BLOCK
        dst.store([off], src.load([off]))

    spec = validate.check_attention_args((2, 300, 4, 80), (2, 300, 2, 80), (2, 300, 2, 80), "bfloat16", "bfloat16",
                                         "bfloat16", is_causal=True, scale=None, layout="zigzag", backend="fused",
                                         backends=("fused",))
    heap = control.HeapLayout.for_workspace(1 << 30)
    out = {}
    p = plans.plan(spec, 2, heap)
    fwd = ["*bf16"] * 3 + ["*i32", "*i32"] + list(p.scalar_types) + ["*bf16", "*fp32", "*i32"]
    t0 = time.time()
    b = build.binary(ring_attn_fwd_kernel, fwd, p.constexprs(), num_warps=p.config.num_warps,
                     num_stages=p.config.num_stages)
    t1 = time.time()
    again = build.binary(ring_attn_fwd_kernel, fwd, p.constexprs(), num_warps=p.config.num_warps,
                         num_stages=p.config.num_stages)
    out["fwd"] = dict(name=b.name, num_warps=b.num_warps, want_warps=p.config.num_warps, shared=b.shared,
                      scratch=b.global_scratch, equal=again == b, hash_equal=hash(again) == hash(b),
                      again_s=time.time() - t1, first_s=t1 - t0, repr=repr(b), entry=(".entry " + b.name) in b.ptx)
    # Triton's JIT specialisation of the integer scalars: B == 1 compiled in, S = 304 known divisible by 16
    vals = [None] * 5 + [1, 304, 0.125, 6 * 10 ** 10] + [None] * 3
    b1 = build.binary(ring_attn_fwd_kernel, fwd, p.constexprs(), num_warps=p.config.num_warps,
                      num_stages=p.config.num_stages, values=vals)
    n_params = lambda ptx: len(set(re.findall(r"ring_attn_fwd_kernel_param_(\\d+)", ptx)))
    out["specialised"] = dict(folded=list(b1.folded), params=n_params(b1.ptx), params_plain=n_params(b.ptx),
                              same_key=b1.key == b.key)
    pb = plans.plan_bwd(spec, 2, heap)
    bwd = ["*bf16"] * 5 + ["*fp32", "*fp32", "*i32", "*i32"] + list(pb.scalar_types) + ["*bf16"] * 3 + ["*fp32", "*i32"]
    bb = build.binary(ring_attn_bwd_kernel, bwd, pb.constexprs(), num_warps=pb.config.num_warps,
                      num_stages=pb.config.num_stages)
    out["bwd"] = dict(name=bb.name, num_warps=bb.num_warps, want_warps=pb.config.num_warps, scratch=bb.global_scratch)
    tb = build.binary(tma_copy, ["*fp32", "*fp32", "i32"], dict(BLOCK=128), num_warps=4, num_stages=1)
    out["tma"] = dict(scratch=tb.global_scratch, align=tb.global_scratch_align, bytes=tb.scratch_bytes((5,)))
    sys.path.insert(0, "tests/gpu")
    import ws_attention_kernel as wsk
    for ws in (False, True):
        args = (wsk.ws_attention_kernel, ["*bf16"] * 3 + ["fp32", "i32", "*bf16"],
                dict(wsk.CONSTEXPRS, H=4, D=128, WARP_SPECIALIZE=ws))
        kw = dict(num_warps=wsk.NUM_WARPS, num_stages=wsk.NUM_STAGES)
        wb = build.binary(*args, **kw)
        ttgir = build.compile_kernel(*args, **kw).asm["ttgir"]
        out[f"ws={ws}"] = dict(num_warps=wb.num_warps, scratch=wb.global_scratch,
                               specialised="ttg.warp_specialize" in ttgir)
    errors = []
    for bad in (fwd[:-1], ):
        try:
            build.signature(ring_attn_fwd_kernel, bad, p.constexprs())
        except ValueError as e:
            errors.append(str(e))
    try:
        build.signature(ring_attn_fwd_kernel, fwd, {k: v for k, v in p.constexprs().items() if k != "W"})
    except ValueError as e:
        errors.append(str(e))
    out["errors"] = errors
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path_factory.mktemp("compile") / "compile_build.py"  # Triton's jit needs a source file
    script.write_text(COMPILE)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_binary_is_the_launch_the_kernel_needs(compiled):
    for kind in ("fwd", "bwd"):
        c = compiled[kind]
        assert c["name"] == f"ring_attn_{kind}_kernel"
        assert c["num_warps"] == c["want_warps"]  # no warp specialisation in these kernels (yet)
        assert c["scratch"] == 0
    f = compiled["fwd"]
    assert f["entry"] and 0 < f["shared"] <= 232448
    assert "ptx" not in f["repr"] and len(f["repr"]) < 400  # it shows in jaxprs


def test_second_compile_comes_from_the_cache(compiled):
    f = compiled["fwd"]
    assert f["equal"] and f["hash_equal"]
    assert f["again_s"] < 1.0 < f["first_s"] + 1.0  # the second is a cache hit (the first compiles)
    assert f["again_s"] < f["first_s"] / 3


def test_integer_scalars_are_specialised_as_triton_jit_does(compiled):
    """B == 1 becomes a constexpr (one parameter fewer at launch: the custom call drops it), S = 304 gets the
    divisibility hint: a different binary from the unspecialised one."""
    sp = compiled["specialised"]
    assert sp["folded"] == ["B"]
    assert sp["params"] == sp["params_plain"] - 1
    assert not sp["same_key"]


def test_specialize_follows_the_kernel_flags():
    from ring_core.runtime import build
    from ring_core.kernels.tl_fwd import ring_attn_fwd_kernel

    names = build.runtime_arg_names(ring_attn_fwd_kernel)
    types = ["*bf16" if n.endswith("_ptr") else {"sm_scale": "fp32", "timeout_ns": "i64"}.get(n, "i32") for n in names]
    vals = {"B": 1, "S": 4096, "sm_scale": 0.125, "timeout_ns": 16 * 10 ** 9}
    got, ones, divisible = build.specialize(ring_attn_fwd_kernel, types, [vals.get(n) for n in names])
    assert ones == {"B": 1} and divisible == {"S"}  # timeout_ns is do_not_specialize
    assert got[names.index("B")] == "constexpr" and got[names.index("S")] == "i32"
    vals.update(B=2, S=333)
    assert build.specialize(ring_attn_fwd_kernel, types, [vals.get(n) for n in names])[1:] == ({}, set())
    assert build.specialize(ring_attn_fwd_kernel, types, None) == (types, {}, set())


def test_global_scratch_is_reported(compiled):
    """A kernel with device-side TMA descriptors needs global scratch; the binary says how much, per program."""
    t = compiled["tma"]
    assert t["scratch"] > 0 and t["align"] >= 16
    assert t["bytes"] == 5 * t["scratch"]


def test_warp_specialised_kernel_launches_with_its_total_warps(compiled):
    """Hopper warp specialisation adds the partitions' warps to the 4 asked for: the binary's num_warps is the
    compiled total (what jax_ring._triton_call launches; jax-triton 0.3.1 launched 4, a broken kernel), and
    the descriptors need global scratch."""
    plain, ws = compiled["ws=False"], compiled["ws=True"]
    assert not plain["specialised"] and plain["num_warps"] == 4
    assert ws["specialised"], "the flat loop did not get Triton's warp specialisation"
    assert ws["num_warps"] > 4
    assert ws["scratch"] > 0 and plain["scratch"] > 0


def test_bad_signatures_raise(compiled):
    assert len(compiled["errors"]) == 2
    assert "runtime arguments" in compiled["errors"][0]
    assert "constexprs ['W'] not given" in compiled["errors"][1]


# ------------------------------------------------------------------------------ the JAX custom call (CPU)
def _binary(scratch=0):
    from ring_core.runtime import build

    return build.Binary(name="k", num_warps=8, num_ctas=1, shared=1024, global_scratch=scratch,
                        global_scratch_align=128, capability=90, key="x", ptx=".entry k")


def test_describe_orders_arrays_scalars_and_outputs():
    import jax
    import jax.numpy as jnp

    from jax_ring import _triton_call as tc

    q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16)
    ctx = jax.ShapeDtypeStruct((12,), jnp.int32)
    outs = [jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32),
            jax.ShapeDtypeStruct((4,), jnp.int32)]
    arrays, scalars, layout, tys = tc.describe((q, q, q, ctx, 1, 8, np.float32(0.25), 10 ** 10), outs,
                                               ("i32", "i32", "fp32", "i64"))
    assert len(arrays) == 4
    assert scalars == ((1, "i32"), (8, "i32"), (0.25, "fp32"), (10 ** 10, "i64"))
    assert layout == ("a",) * 4 + (0, 1, 2, 3) + ("a",) * 3
    assert tys == ["*bf16"] * 3 + ["*i32", "i32", "i32", "fp32", "i64", "*bf16", "*fp32", "*i32"]
    with pytest.raises(ValueError, match="scalar types"):
        tc.describe((q, 1), outs, ())


@pytest.mark.parametrize("scratch", [0, 96])
def test_abstract_eval_adds_the_scratch_buffer(scratch):
    import jax
    import jax.numpy as jnp

    from jax_ring import _triton_call as tc

    out_shapes = (jax.ShapeDtypeStruct((3, 5), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32))
    got = jax.eval_shape(lambda x: tc.ring_kernel_call_p.bind(
        x, out_shapes=out_shapes, binary=_binary(scratch), grid=(7,), scalars=(), layout=("a",) * 3,
        zeroed_outputs=(1,), name="k"), jax.ShapeDtypeStruct((2,), jnp.float32))
    assert [(o.shape, o.dtype) for o in got[:2]] == [((3, 5), jnp.float32), ((4,), jnp.int32)]
    if scratch:
        assert len(got) == 3 and got[2].shape == (7 * scratch,) and got[2].dtype == jnp.uint8
    else:
        assert len(got) == 2


@pytest.mark.parametrize("scratch", [0, 96])
def test_kernel_params(scratch):
    """jaxlib's parameters: the arrays 16-byte aligned, the zeroed output's bytes, the scalars with their
    types, in the kernel's order, without those compiled in (None); the scratch buffer last, at the binary's
    alignment."""
    import jax
    import jax.numpy as jnp

    from jax_ring import _triton_call as tc

    lib = types.SimpleNamespace(create_array_parameter=lambda zero, div: ("array", zero, div),
                                create_scalar_parameter=lambda v, t: ("scalar", v, t))
    out_shapes = (jax.ShapeDtypeStruct((3, 5), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
    params = tc.kernel_params(lib, layout=("a", "a", 0, None, 1, "a", "a"), n_inputs=2, out_shapes=out_shapes,
                              zeroed_outputs=(1,), scalars=((3, "i32"), (0.5, "fp32")), binary=_binary(scratch))
    want = [("array", 0, 16), ("array", 0, 16), ("scalar", 3, "i32"), ("scalar", 0.5, "fp32"), ("array", 0, 16),
            ("array", 16, 16)] + ([("array", 0, 128)] if scratch else [])
    assert params == want


TINY = textwrap.dedent("""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
""")

LOG_AND_COMPILE = textwrap.dedent("""
    import json, os
    from ring_core.runtime import build
    import tiny_kernels
    args = (tiny_kernels.add_one, ["*fp32", "*fp32", "i32"], dict(BLOCK=64))
    b = build.binary(*args, num_warps=4, num_stages=1, values=[None, None, 1024])
    build.binary(*args, num_warps=4, num_stages=1, values=[None, None, 1024])  # logged again: read once
    print(json.dumps(dict(key=b.key, records=build.read_log(os.environ["RING_ATTENTION_COMPILE_LOG"]))))
""")


def test_compiles_are_logged_and_warm_compiles_them_again(tmp_path):
    """With RING_ATTENTION_COMPILE_LOG set, a compile leaves a record; ``python -m ring_core.runtime.build --warm``
    compiles the records again (in parallel processes) into another cache, to the same cache key; a record the current
    code cannot compile is reported and skipped."""
    (tmp_path / "tiny_kernels.py").write_text(TINY)
    log = tmp_path / "compiles.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path), env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path / "cache1"), RING_ATTENTION_COMPILE_LOG=str(log),
               RING_ATTENTION_COMPILE_TAG="checks@2")
    r = subprocess.run([sys.executable, "-c", LOG_AND_COMPILE], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    (rec,) = got["records"]
    assert rec["kernel"] == "tiny_kernels:add_one" and rec["tag"] == "checks@2"
    assert rec["constexprs"] == {"BLOCK": 64} and rec["divisible"] == ["n"] and rec["num_warps"] == 4
    with open(log, "a") as f:  # a variant of a kernel that no longer exists
        f.write(json.dumps(dict(rec, kernel="tiny_kernels:gone")) + "\n")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache2")
    lines = log.read_text().count("\n")
    r = subprocess.run([sys.executable, "-m", "ring_core.runtime.build", "--warm", str(log), "--tags", "checks@2,x@1",
                        "--jobs", "2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warmed 1 of 2 variants" in r.stdout and got["key"][:12] in r.stdout, r.stdout
    assert "FAILED AttributeError" in r.stdout, r.stdout
    assert any(p.name.startswith("add_one") for p in (tmp_path / "cache2").rglob("*.cubin"))
    assert log.read_text().count("\n") == lines  # warming logs nothing (RING_ATTENTION_COMPILE_LOG is set here)
    r = subprocess.run([sys.executable, "-m", "ring_core.runtime.build", "--warm", str(log), "--tags", "other@2"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert "warmed 0 of 0 variants" in r.stdout, r.stdout


def _compiled_for_sm90(script: str, cache) -> dict:
    """The JSON that ``script`` prints last, run in a process of its own (compiled, not interpreted; its own
    Triton cache ``cache``)."""
    return testing.run_compiled(script, cache)


# What GLUON_KERNEL_COMPILE and GLUON_BWD_COMPILE do with a plan: compile it for sm_90 and find, in the TTGIR
# (structured: text order is program order), the load partition and its chunk waits.
PLAN_SM90 = """
import json, re
from ring_core.runtime import build
from ring_core.protocol import control
from ring_core import plans, validate


def compiled(p):
    ck = build.compile_kernel(p.kernel(), p.arg_types(), p.constexprs(), num_warps=p.config.num_warps,
                              num_stages=p.config.num_stages, capability=90)
    ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
    at = lambda pat, text=ptx: [m.start() for m in re.finditer(pat, text)]
    parts = re.split(r"\\bpartition\\d+\\(", ttgir)
    load = next((t for t in parts[1:] if "num_warps(1)" in t.split("\\n", 1)[0]), "")
    acq = at(r"atomic_rmw add, acquire, sys", load)
    fence = at(r"fence\\.proxy\\.async\\.global", load)
    tma = at(r"async_tma_copy_global_to_local", load)
    return ck, ttgir, ptx, at, load, acq, fence, tma
"""


GLUON_KERNEL_COMPILE = PLAN_SM90 + textwrap.dedent("""
    lay = control.HeapLayout.for_workspace(1 << 30)
    out = {}
    for B, S, H, HKV, D, dt, causal, layout, W, win, seg in (
            (1, 1024, 8, 2, 128, "bfloat16", True, "zigzag", 2, None, False),
            (2, 512, 4, 4, 64, "float16", False, "contiguous", 3, None, False),
            (1, 256, 4, 1, 128, "bfloat16", True, "contiguous", 1, None, False),
            (1, 512, 8, 2, 256, "bfloat16", True, "zigzag", 2, None, False),
            (2, 256, 4, 4, 256, "float16", False, "contiguous", 1, None, False),
            (1, 512, 8, 2, 128, "bfloat16", True, "zigzag", 2, None, True),  # masks
            (1, 256, 4, 1, 64, "float16", True, "contiguous", 1, (300, -1), False),
            (2, 512, 4, 2, 256, "bfloat16", False, "zigzag", 3, (200, 90), True)):
        spec = validate.check_attention_args((B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dt, dt, dt,
                                             is_causal=causal, scale=None, layout=layout, backend="fused",
                                             backends=("fused",), window_size=win,
                                             segment_ids_shape=(B, S) if seg else None,
                                             segment_ids_dtype="int32" if seg else None)
        p = plans.plan(spec, W, lay, capability=(9, 0))
        ck, ttgir, ptx, at, load, acq, fence, tma = compiled(p)
        out[f"{dt}-D{D}-W{W}-{causal}-{layout}-{win is not None or seg}"] = dict(
            gluon=p.config.gluon, name=ck.metadata.name, ws="ttg.warp_specialize" in ttgir, load_partition=bool(load),
            warps=ck.metadata.num_warps, shared=ck.metadata.shared, scratch=ck.metadata.global_scratch_size,
            tiles=[p.config.block_m, p.config.block_n, p.config.num_stages], barriers=ptx.count("mbarrier.init"),
            mma_n=sorted(set(int(n) for n in re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n(\\d+)k16", ptx))),
            wgmma=ptx.count("wgmma.mma_async"), tma=len(at(r"cp\\.async\\.bulk\\.tensor")), fences=len(fence),
            acquires=len(acq), fence_after_acquire=bool(acq and fence and fence[0] > acq[0]),
            tma_after_fence=bool(fence and tma and tma[-1] > fence[0]),
            releases=len(at(r"sys\\.release")), global_timer=ptx.count("%globaltimer"),
            partitions=len(re.findall(r"partition\\d+\\(", ttgir)),
            masks=bool(p.constexprs()["WINDOW"] or p.constexprs()["SEGMENTED"]),  # (a window that hides nothing: none)
            segmented=bool(p.constexprs()["SEGMENTED"]), clock=ptx.count("%clock64"))
    print(json.dumps(out))
""")


def test_gluon_product_kernel_compiles_warp_specialised_with_the_protocol(tmp_path):
    """ring_core.kernels.gluon_fwd (the Hopper forward), as ring_core.plans launches it on an H200, compiles for
    sm_90 under the Triton at hand: explicit partitions (the load warp beside two consumer warpgroups), TMA copies
    from descriptors made on the device (global scratch), warpgroup MMAs, within Hopper's shared memory; and the
    protocol compiled in from ring_core.protocol.steps's own helpers: with peers, bounded acquires of the chunks' flags
    (timed by %globaltimer) each followed by the generic-to-async proxy fence before the TMA reads, and the system-
    scope releases of the pushes, the call check and the end barrier; at world size 1 nothing to wait for. What it
    computes is checked on a GPU against float64 and the tl kernel (tests/gpu/gpu_checks.py, section ``gluon``).
    Head dim 256 in its own tiles (ring_core.plans.GLUON_TILES): 64-row K/V blocks in 2 slots, S of 64 columns and
    P V of 256 per warpgroup MMA, 192 KiB of shared memory (Q's 64 and the slots' 128), K and V in rings of their own
    (a ready and an empty barrier per slot of each; D64/D128: one pair per slot of both), beside a pair for each half
    of Q's buffer (persistent: a ready and an empty barrier per consumer's half). With a window or
    segment ids (the last three) the same, with a few words more of shared memory (the tiles' block
    counts, the slots' block words and the planner's two slots of a tile's plan; with segment ids the tile's rows'
    ids and each slot's block's) and one partition more, the planner, with a ready and an empty barrier for each of
    its slots."""
    got = _compiled_for_sm90(GLUON_KERNEL_COMPILE, tmp_path)
    plain = {c["partitions"] for c in got.values() if not c["masks"]}
    assert len(plain) == 1 and {c["partitions"] for c in got.values() if c["masks"]} == {plain.pop() + 1}, got
    assert sum(c["masks"] for c in got.values()) == 2, got
    for name, c in got.items():
        assert c["gluon"] and c["name"] == "ring_attn_fwd_gluon", (name, c)
        assert c["ws"] and c["load_partition"] and c["warps"] > 8 and c["scratch"] > 0, (name, c)
        assert c["shared"] <= 227 * 1024 and c["wgmma"] > 0 and c["tma"] > 0, (name, c)
        D = int(name.split("-D")[1].split("-")[0])
        planner = 4 if c["masks"] else 0  # masks: the planner's slots' barriers
        if D == 256:
            assert c["tiles"] == [128, 64, 2] and c["mma_n"] == [64, 256], (name, c)
            ids = (128 + 2 * 64) * 4 if c["segmented"] else 0  # the tile's rows' ids and the slots' blocks'
            assert 192 * 1024 <= c["shared"] < 193 * 1024 + 512 + ids, (name, c)
            assert c["barriers"] == 4 + 2 * 2 * 2 + planner, (name, c)
        else:
            assert c["tiles"] == [128, 128, 3] and c["mma_n"] == sorted({128, D}), (name, c)
            assert c["barriers"] == 4 + 2 * 3 + planner, (name, c)
        assert c["clock"] == 0, (name, c)  # the timeline (RING_ATTENTION_GLUON_TIMELINE) off: no stamp
        if "-W1-" in name:
            assert c["acquires"] == 0 and c["fences"] == 0, (name, c)
        else:
            assert c["acquires"] > 0 and c["fence_after_acquire"] and c["tma_after_fence"], (name, c)
            assert c["releases"] > 0 and c["global_timer"] > 0, (name, c)


GLUON_TIMELINE_COMPILE = "import os\nos.environ['RING_ATTENTION_GLUON_TIMELINE'] = '1'  # read at import\n" + \
    PLAN_SM90 + textwrap.dedent("""
    lay = control.HeapLayout.for_workspace(1 << 30)
    out = {}
    for S, H, HKV, D, dt, W, seg in ((256, 4, 1, 128, "bfloat16", 1, False), (512, 4, 2, 64, "float16", 1, True),
                                     (1024, 8, 2, 128, "bfloat16", 2, False)):
        spec = validate.check_attention_args((1, S, H, D), (1, S, HKV, D), (1, S, HKV, D), dt, dt, dt, is_causal=True,
                                             scale=None, layout="contiguous", backend="fused", backends=("fused",),
                                             segment_ids_shape=(1, S) if seg else None,
                                             segment_ids_dtype="int32" if seg else None)
        p = plans.plan(spec, W, lay, capability=(9, 0))
        try:
            ck, ttgir, ptx, *_ = compiled(p)
        except Exception as e:  # noqa: BLE001 - reported
            out[f"W{W}-{seg}"] = dict(error=str(e)[-2000:])
            continue
        out[f"W{W}-{seg}"] = dict(ws="ttg.warp_specialize" in ttgir, clock=ptx.count("%clock64"),
                                  partitions=len(re.findall(r"partition\\d+\\(", ttgir)), shared=ck.metadata.shared)
    print(json.dumps(out))
""")


def test_gluon_forward_timeline_compiles_warp_specialised_at_world_size_1_only(tmp_path):
    """The Gluon forward's diagnostic timeline (RING_ATTENTION_GLUON_TIMELINE=1 at import; benchmarks/timeline.py)
    compiles for sm_90 with the same partitions, still warp-specialised, with a clock read at each of its stamps
    (the consumers' three a tile each, the load warp's two, the planner's two, the program's start and end); at
    world size 2 it refuses to compile (its words live in the receive region, which a ring uses). Off, no stamp
    (``test_gluon_product_kernel_compiles_warp_specialised_with_the_protocol``)."""
    got = _compiled_for_sm90(GLUON_TIMELINE_COMPILE, tmp_path)
    dense, masked, ring = got["W1-False"], got["W1-True"], got["W2-False"]
    assert dense["ws"] and masked["ws"], got
    assert (dense["partitions"], masked["partitions"]) == (2, 3), got  # beside the default one (a consumer)
    assert dense["clock"] >= 2 * 3 + 2 + 2 and masked["clock"] >= 2 * 3 + 2 + 2 + 2, got
    assert "world size 1" in ring.get("error", ""), got


GLUON_BWD_COMPILE = PLAN_SM90 + textwrap.dedent("""
    lay = control.HeapLayout.for_workspace(1 << 30)
    out = {}
    for B, S, H, HKV, dt, causal, layout, W, win, seg in (
            (1, 1024, 8, 2, "bfloat16", True, "zigzag", 2, None, False),
            (2, 256, 4, 4, "float16", False, "contiguous", 3, None, False),
            (1, 256, 4, 1, "bfloat16", True, "contiguous", 1, None, False),
            (1, 512, 8, 2, "bfloat16", True, "zigzag", 2, None, True),  # masks: in any order only
            (1, 512, 4, 4, "float16", True, "contiguous", 1, (300, -1), False),
            (2, 512, 4, 2, "bfloat16", False, "zigzag", 3, (200, 90), True)):
        spec = validate.check_attention_args((B, S, H, 128), (B, S, HKV, 128), (B, S, HKV, 128), dt, dt, dt,
                                             is_causal=causal, scale=None, layout=layout, backend="fused",
                                             backends=("fused",), window_size=win,
                                             segment_ids_shape=(B, S) if seg else None,
                                             segment_ids_dtype="int32" if seg else None)
        masked = win is not None or seg
        # deterministic: the Gluon kernel's own order, compiled at W=2 only (the first case: causal zigzag, peers).
        # CI-time cut: W=1 and W=3 compiled it too (2 of the 9 compiles). What W changes in the DETERMINISTIC code is
        # _dq_turn's static loop over the other ranks' groups (none at W=1, W-1 iterations otherwise), and CAUSAL
        # only _seen_blocks's count; the turn order checked below (acquire of the turn before the reduction,
        # wait_group 2 before the release: the dQ writer's) is the same source at every W, and W=1 and W=3 (non-causal)
        # still
        # compile here in any order. Every Gluon backward case runs in both orders on a GPU (tests/gpu/gpu_checks.py,
        # section gluon-bwd).
        for det in (False, True) if W == 2 and not masked else (False, ):
            p = plans.plan_bwd(spec, W, lay, capability=(9, 0), deterministic=det, gluon_det=True)
            ck, ttgir, ptx, at, load, acq, fence, tma = compiled(p)
            reduce, done = at(r"cp\\.reduce\\.async\\.bulk\\.tensor"), at(r"cp\\.async\\.bulk\\.wait_group 0")
            # deterministic: each add after an acquire of its turn (gpu scope: a load or an atomic), an earlier
            # step's adds' completion (wait_group 2: the dQ writer's two adds a step) before the release that counts
            # them; the writer a partition of its own (one more than the load warp and the two consumers)
            turn, one = at(r"\\.global\\.gpu\\.acquire"), at(r"cp\\.async\\.bulk\\.wait_group [1-9];")
            rel = at(r"atom\\.global\\.gpu\\.release")
            # The same order in the TTGIR, which keeps the source's: in each partition that adds (the consumers, or
            # the dQ writer), its last completion wait after its first add. (In the PTX LLVM places the writer's
            # final wait, after its step loop in the source, before the loop's blocks.)
            adders = [t for t in re.split(r"\\bpartition\\d+\\(", ttgir) if "async_tma_reduce" in t]
            ir_done = bool(adders) and all(at(r"cp\\.async\\.bulk\\.wait_group 0", t)[-1:] >
                                           at(r"async_tma_reduce", t)[:1] for t in adders)
            out[f"{dt}-W{W}-{causal}-{layout}-{'masked-' if masked else ''}{det}"] = dict(
                gluon=p.config.gluon, deterministic=p.config.deterministic, name=ck.metadata.name,
                ws="ttg.warp_specialize" in ttgir, load_partition=bool(load), warps=ck.metadata.num_warps,
                shared=ck.metadata.shared, scratch=ck.metadata.global_scratch_size, grid=p.grid[0],
                tasks=p.n_dq_tasks * 2 + p.n_partial_tasks + p.n_final_tasks, wgmma=ptx.count("wgmma.mma_async"),
                reduces=len(reduce), done_after_reduce=bool(reduce and done and done[-1] > reduce[0]),
                done_after_reduce_ir=ir_done,
                acquires=len(acq), tma_after_fence=bool(fence and tma and tma[-1] > fence[0] > acq[0]) if acq else None,
                turn_before_reduce=bool(turn and reduce and turn[0] < reduce[0]), wait_one=len(one),
                release_after_wait_one=bool(one and rel and rel[-1] > one[0]),
                partitions=len(re.findall(r"partition\\d+\\(", ttgir)))
    print(json.dumps(out))
""")


def test_gluon_backward_compiles_warp_specialised_with_tma_reductions(tmp_path):
    """ring_core.kernels.gluon_bwd (the Hopper backward, deterministic=False), as ring_core.plans launches it on an
    H200, compiles for sm_90 under the Triton at hand: explicit partitions (a load warp beside the consumers),
    five warpgroup MMAs per step, dQ added by TMA bulk reductions whose completion (``cp.async.bulk.wait_group 0``,
    not only the shared-memory read) comes before the count that publishes them, within Hopper's shared memory;
    its grid the delta, dK/dV and dQ tasks; with peers, the chunk flags acquired before the proxy fence and the TMA
    reads. With a window or segment ids (the last three) the same, in any order only. With
    deterministic=True and ``gluon_det`` (RING_ATTENTION_GLUON_DETERMINISTIC=1; else deterministic plans the split
    kernel; compiled for the first case, W=2) the same kernel with its DETERMINISTIC order, in a dQ writer partition
    of its own: each reduction after the acquire of its turn, and the counts of a step's reductions released after
    ``cp.async.bulk.wait_group 2`` (their completion, a step later).
    What it computes is checked on a GPU (tests/gpu/gpu_checks.py, sections ``gluon-bwd`` and ``bwd``)."""
    got = _compiled_for_sm90(GLUON_BWD_COMPILE, tmp_path)
    for name, c in got.items():
        det = name.endswith("-True")
        assert c["gluon"] and c["deterministic"] is det and c["name"] == "ring_attn_bwd_gluon", (name, c)
        assert (c["wait_one"] > 0 and c["turn_before_reduce"] and c["release_after_wait_one"]) is det, (name, c)
        assert c["partitions"] == (3 if det else 2), (name, c)  # load warp, consumer (+ dQ writer); default: consumer
        assert c["ws"] and c["load_partition"] and c["warps"] > 8 and c["scratch"] > 0, (name, c)
        assert c["shared"] <= 227 * 1024 and c["wgmma"] >= 5 and c["grid"] == c["tasks"], (name, c)
        # (in the PTX text only for the consumers' adds: the writer's final wait is laid out before its loop there)
        assert c["reduces"] > 0 and c["done_after_reduce_ir"] and (det or c["done_after_reduce"]), (name, c)
        if "-W1-" in name:
            assert c["acquires"] == 0, (name, c)
        else:
            assert c["acquires"] > 0 and c["tma_after_fence"], (name, c)


# ------------------------------------------------------------- the variants a run compiles, worked out ahead
RECORD_THROUGH_JAX = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import jax.numpy as jnp
    import triton
    from ring_core.protocol import control
    from ring_core import plans, validate
    from jax_ring import _triton_call, fused

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop
    triton.compile = stop  # the record is written before Triton compiles; nothing compiles here
    _triton_call.capability = lambda: 90  # an H100/H200, as the GPU machine's
    lay = control.HeapLayout.for_workspace(1 << 30)
    out = []
    for (B, S, H, HKV, D, dt, causal, window, seg, W) in [(1, 512, 8, 2, 128, "bfloat16", True, None, False, 3),
                                                         (2, 333, 4, 4, 80, "float16", False, (70, 5), True, 4),
                                                         (1, 1, 2, 1, 16, "float32", True, None, True, 2)]:
        spec = validate.check_attention_args(
            (B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dt, dt, dt, is_causal=causal, scale=None,
            layout="contiguous", backend="fused", backends=("fused",), window_size=window,
            segment_ids_shape=(B, S) if seg else None, segment_ids_dtype="int32" if seg else None)
        # The Hopper kernels (forward, and the backward with deterministic=False) where they apply.
        gluon = ([plans.plan(spec, W, lay, capability=(9, 0)), plans.plan_bwd(spec, W, lay, capability=(9, 0))]
                 if S == 512 else [])
        for p in [plans.plan(spec, W, lay), plans.plan_bwd(spec, W, lay)] + gluon:
            x, kv = jnp.zeros((B, S, H, D), dt), jnp.zeros((B, S, HKV, D), dt)
            rows = jnp.zeros((B, H, S), jnp.float32)
            ids = jnp.zeros((B, S) if seg else (1,), jnp.int32)
            ctx = jnp.zeros((W + 4,), jnp.int32)
            inputs = [x, kv, kv] if p.kind == control.KIND_FWD else [x, kv, kv, x, x, rows, rows]
            open(os.environ["RING_ATTENTION_COMPILE_LOG"], "w").close()
            try:  # what jax_ring.fused._launch passes
                _triton_call.triton_call(*inputs, ids, ctx, *fused._scalars(p, None), kernel=p.kernel(),
                                         out_shape=fused._out_shapes(p), grid=p.grid, name="t",
                                         num_warps=p.config.num_warps, num_stages=p.config.num_stages,
                                         scalar_types=p.scalar_types, **p.constexprs())
            except Stop:
                pass
            (logged,) = [json.loads(l) for l in open(os.environ["RING_ATTENTION_COMPILE_LOG"])]
            out.append([logged, p.compile_record()])
    print(json.dumps(out))
""")


def test_a_plans_compile_record_is_the_variant_the_launch_compiles(tmp_path):
    """LaunchPlan.compile_record (what tools/gpu_variants.py lists, to fill a cache ahead of a GPU run) is the
    record the JAX launcher's compile logs for the same plan: argument types, Triton's specialisation of the
    scalars (batch 1 folded in, seq_local divisible by 16 or not), constexprs, warps and stages; forward and
    backward, with and without masks, bf16/fp16/fp32. (torch's JIT compiles the same cache entry: build.py.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               RING_ATTENTION_COMPILE_LOG=str(tmp_path / "log.jsonl"), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", RECORD_THROUGH_JAX], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    pairs = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(pairs) == 8  # 3 calls x (forward, backward), and the first one's Hopper forward and backward
    for logged, planned in pairs:
        assert logged == planned
    folded = [p for _, p in pairs if "constexpr" in p["types"]]
    assert len(folded) == 6 and all("S" not in p["divisible"] for _, p in pairs[4:6])  # B=1 folded; S=333


def test_gpu_variants_lists_the_runs_kernels():
    """tools/gpu_variants.py: the variants of a GPU session stage's gpu_checks sections and mask cases at a world
    size, each once, tagged like the session's compile log."""
    sys.path[:0] = [str(ROOT / "tests" / "gpu"), str(ROOT / "tools")]
    try:
        import gpu_checks as g
        import gpu_variants as gv
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))
        sys.path.remove(str(ROOT / "tools"))
    tail = gv.stage_records("checks-masks-tail", 3)  # masks cases 3, 4, 5: a forward and a backward each
    assert len(tail) == 6 and {r["tag"] for r in tail} == {"checks-masks-tail@3"}
    assert all(r["constexprs"]["W"] == 3 for r in tail)
    wins = sorted((r["constexprs"]["WIN_LEFT"], r["constexprs"]["WIN_RIGHT"]) for r in tail[::2])
    assert len(wins) == 3 and all(r["constexprs"]["WINDOW"] for r in tail)
    assert [r["constexprs"]["SEGMENTED"] for r in tail[::2]] == [g.MASK_CASES[i][9] is not None for i in (3, 4, 5)]
    everything = gv.stage_records("checks-all", 4)
    keys = {json.dumps({k: v for k, v in r.items() if k != "tag"}, sort_keys=True) for r in everything}
    assert len(keys) == len(everything)
    kinds = [r["kernel"].split(":")[1] for r in everything]
    forwards = kinds.count("ring_attn_fwd_kernel") + kinds.count("ring_attn_fwd_gluon")
    assert forwards >= len(g.CASES) and kinds.count("ring_attn_bwd_kernel") >= 7
    assert kinds.count("ring_attn_bwd_gluon") >= len(g.GLUON_BWD_CASES)  # the gluon-bwd section and the big grid
    # Planned as on the H200: the Gluon forward where it applies; the gluon section adds the tl kernel's variant of
    # each of its calls (its comparison runs with RING_ATTENTION_GLUON=0).
    gl_section = gv.stage_records("checks-gluon", 2)
    gl_kinds = [r["kernel"].split(":")[1] for r in gl_section]
    assert gl_kinds.count("ring_attn_fwd_gluon") == gl_kinds.count("ring_attn_fwd_kernel") > 0
    bench = gv.stage_records("bench-w1", 1)  # benchmarks/attention.py: fused forward (Gluon on the H200) and backward
    kinds = sorted(r["kernel"].split(":")[1] for r in bench)  # causal and not, JAX's sticky errors or not
    # the default (deterministic=False) and the _det methods' deterministic=True (the Gluon kernel's DETERMINISTIC
    # variants, as the split before them: two), causal and not
    assert kinds == ["ring_attn_bwd_gluon"] * 6 + ["ring_attn_fwd_gluon"] * 4, kinds
    assert sum(r["constexprs"]["DETERMINISTIC"] for r in bench if r["kernel"].endswith("bwd_gluon")) == 2
    tl = [r["kernel"].split(":")[1] for r in gv.stage_records("bench-w1-tl", 1)]  # RING_ATTENTION_GLUON=0
    assert tl and set(tl) == {"ring_attn_fwd_kernel"}, tl
    # The other forward shapes (D64, D256, GQA 32/8), forward only through torch: the Gluon forward, in its tiles.
    shapes = gv.stage_records("bench-w1-shapes", 1)
    assert {r["kernel"].split(":")[1] for r in shapes} == {"ring_attn_fwd_gluon"}, shapes
    got = sorted((r["constexprs"]["D"], r["constexprs"]["HKV"], r["constexprs"]["CAUSAL"], r["constexprs"]["BLOCK_N"],
                  r["num_stages"]) for r in shapes)
    assert got == [(d, hkv, causal, 64 if d == 256 else 128, 2 if d == 256 else 3)
                   for d, hkv in ((64, 32), (128, 8), (256, 32)) for causal in (False, True)], got
    assert any(r["constexprs"]["D"] == 256 for r in gl_section if r["kernel"].endswith("fwd_gluon"))
    # A command that names its own rank count counts at it: bench-window-share's lone rank, then the ranks.
    share = gv.stage_records("bench-window-share", 2)
    assert {r["constexprs"]["W"] for r in share} == {1, 2} and {r["tag"] for r in share} == {"bench-window-share@2"}
    soak = gv.stage_records("soak", 4)
    assert soak and sum(r["kernel"].endswith("bwd_kernel") for r in soak) == 1
    faults = gv.stage_records("faults", 3)  # the fault sections' right calls (forward only)
    assert faults and all(r["kernel"].split(":")[1].startswith("ring_attn_fwd") and r["constexprs"]["W"] == 3
                          for r in faults)


IRIS_DEVICE_ONLY = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # a machine with Triton and iris but no torch: iris's host half cannot import
    from ring_core.runtime import build
    ok = build._iris_device_only()
    from ring_core.kernels.tl_fwd import ring_attn_fwd_kernel
    from ring_core.kernels.tl_bwd import ring_attn_bwd_kernel
    print(ok, ring_attn_fwd_kernel.cache_key, ring_attn_bwd_kernel.cache_key)
""")


def test_warm_without_torch_compiles_the_same_kernels():
    """ring_core.runtime.build's warm on a machine without torch (a Python of the GPU machine's Triton wheel) imports
    the kernels through iris's device functions only, and they hash as with the whole of iris: same cache entries."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    code = "from ring_core.kernels.tl_fwd import ring_attn_fwd_kernel as f; from ring_core.kernels.tl_bwd import " \
           "ring_attn_bwd_kernel as b; import torch; print(True, f.cache_key, b.cache_key)"
    runs = [subprocess.run([sys.executable, "-c", c], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
            for c in (IRIS_DEVICE_ONLY, code)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    device_only, whole = (r.stdout.split() for r in runs)
    assert device_only == whole and device_only[0] == "True"


JIT_AND_BUILD_KEYS = textwrap.dedent("""
    import json
    import torch
    from triton.compiler import ASTSource
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    from ring_core.runtime import build
    from ring_core.protocol import control
    from ring_core import plans, testing, validate

    driver.set_active(testing.no_gpu_driver())  # what the JIT asks of a driver before it compiles
    seen = {}
    def capture(self, key, signature, device, constexprs, options, attrs, warmup):  # instead of compiling
        seen["hash"] = self.ASTSource(self, signature, constexprs, attrs).hash()
    JITFunction._do_compile = capture
    lay = control.HeapLayout.for_workspace(1 << 30)
    out = []
    for (B, S, H, HKV, D, dt, W, causal, seg, win) in [(1, 1024, 8, 8, 128, "bfloat16", 4, True, False, None),
                                                      (2, 777, 8, 2, 80, "float16", 3, True, True, None),
                                                      (1, 1, 2, 1, 16, "float32", 2, False, True, (5, 3))]:
        spec = validate.check_attention_args(
            (B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), dt, dt, dt, is_causal=causal, scale=None,
            layout="contiguous", backend="fused", backends=("fused",), window_size=win,
            segment_ids_shape=(B, S) if seg else None, segment_ids_dtype="int32" if seg else None)
        t = getattr(torch, dt)
        q, kv = torch.zeros(B, S, H, D, dtype=t), torch.zeros(B, S, HKV, D, dtype=t)
        ids = torch.zeros((B, S) if seg else (1,), dtype=torch.int32)
        ctx = torch.zeros((W + 4) * 2, dtype=torch.int32)  # as HeapRings.ctx: int32 words
        rows, status = torch.zeros(B, H, S), torch.zeros(control.STATUS_WORDS, dtype=torch.int32)
        # The Hopper kernels (forward, and the backward with deterministic=False) where they apply.
        gluon = ([plans.plan(spec, W, lay, capability=(9, 0)), plans.plan_bwd(spec, W, lay, capability=(9, 0))]
                 if S == 1024 else [])
        for p in [plans.plan(spec, W, lay), plans.plan_bwd(spec, W, lay)] + gluon:
            if p.kind == control.KIND_FWD:  # torch_bridge.fused's argument lists
                args = [q, kv, kv, ids, ctx, *p.scalars(None), q.clone(), rows, status]
            else:
                args = [q, kv, kv, q, q, rows, rows, ids, ctx, *p.scalars(None), q.clone(), kv.clone(), kv.clone(),
                        rows, status]
            p.kernel().run(*args, grid=p.grid, warmup=True, num_warps=p.config.num_warps,
                           num_stages=p.config.num_stages, **p.constexprs())
            rec = p.compile_record()
            sig, attrs = build.signature(p.kernel(), rec["types"], rec["constexprs"], rec["divisible"])
            src = ASTSource
            if p.config.gluon:
                from triton.experimental.gluon._runtime import GluonASTSource as src
            ours = src(fn=p.kernel(), signature=sig, constexprs=rec["constexprs"], attrs=attrs).hash()
            out.append([seen.pop("hash"), ours])
    print(json.dumps(out))
""")


def test_torch_jit_and_the_jax_launch_compile_one_cache_entry():
    """torch's JIT launch of a plan and ring_core.runtime.build's compile of it (the JAX launch, and what warm fills)
    hash to the same Triton source key: same signature, constexprs and attributes, the empty attribute entries
    the installed Triton's JIT writes included (3.6 and 3.9 differ there). Otherwise every variant would compile
    twice on the GPU machine, once per frontend, and a cache warmed ahead would serve only JAX. Also the Gluon
    Hopper forward's and backward's plans (ring_core.kernels.gluon_fwd, ring_core.kernels.gluon_bwd)."""
    pairs = testing.run_compiled(JIT_AND_BUILD_KEYS)
    assert len(pairs) == 8 and all(jit == ours for jit, ours in pairs), pairs
