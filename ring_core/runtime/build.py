"""The compile of a fused launch for a GPU, for launchers that do not go through Triton's JIT (the JAX frontend):
a kernel, the Triton types of its runtime arguments and its constexprs -> ``Binary``: the PTX and what a launch
of it needs (entry name, shared memory, *total* warps, global scratch per program).

It goes through ``triton.compile``, so through Triton's on-disk cache (``TRITON_CACHE_DIR``): a kernel compiled
once on a machine (by any rank, any frontend, an earlier process) is not compiled again. It specialises as
Triton's JIT does for the arguments torch passes, so that torch's JIT launch and this one compile the same
binary (the same cache entry): pointers 16-byte aligned; an integer scalar (unless the kernel marks it
``do_not_specialize``) known divisible by 16 when it is, and folded into a constexpr when it is 1. The
sequence length matters here: the backward compiled for a length known divisible by 16 spills half as much
(ptxas, sm_90, bf16 D128: 284 against 496 bytes of spill stores).

What a launcher must honour (Triton's own launcher does; jax-triton 0.3.1 does neither):
* ``num_warps`` is the compiled kernel's total: Hopper warp specialisation adds partitions' warps to the
  ``num_warps`` asked for (Triton records the total in the module, ``ttg.total-num-warps``);
* ``global_scratch`` bytes per program (aligned to ``global_scratch_align``), one buffer for the grid, passed
  as the argument after the kernel's own: device-side TMA descriptors live there. Zero for kernels that need
  none.

Runs without a GPU: Triton compiles for a GPU target on any machine (tests/cpu/test_build.py).

Compiles can be recorded and replayed, for machines where every run starts with a cold cache (the GPU machine
of tools/gpu_session.py): with ``RING_ATTENTION_COMPILE_LOG`` set, each compile made here appends one JSON line
(the kernel by module and name, its Triton types, constexprs, divisible scalars, warps, stages, capability, and
``RING_ATTENTION_COMPILE_TAG``, the run that asked for it); ``python -m ring_core.runtime.build --warm FILE`` compiles
a log's variants again, in parallel processes, into Triton's cache, from the kernel source as it is now. The
variants a run needs rarely change when the kernels' code does, so a run after a kernel edit finds them
compiled, many at once, instead of one after another as its cases reach them. Only this module's compiles are
recorded (the JAX launches, hence every variant the GPU checks run through both frontends, which launch the same
binary); a run of torch launches alone records nothing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from ring_core import settings

COMPILE_LOG_ENV = settings.COMPILE_LOG  # append every compile made here to this file (JSON lines)
COMPILE_TAG_ENV = settings.COMPILE_TAG  # ... tagged with this (e.g. the GPU session's stage)

TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64",
                "uint8": "u8", "int8": "i8", "uint32": "u32"}


def _params(kernel) -> list:
    """The kernel's parameters (Triton's KernelParam: name, is_constexpr, do_not_specialize), also for a kernel
    the interpreter holds (TRITON_INTERPRET=1 wraps it without them: rebuilt from the same decorator flags)."""
    if hasattr(kernel, "params"):
        return kernel.params
    return _jit_function(kernel).params


def runtime_arg_names(kernel) -> list:
    """The kernel's non-constexpr argument names, in order (what a launch passes)."""
    return [p.name for p in _params(kernel) if not p.is_constexpr]


@dataclass(frozen=True)
class Binary:
    """A compiled kernel as a launcher outside Triton needs it. Hashable and compared by its cache key, so that
    it can be a static parameter of a JAX primitive; its repr is short (it shows in jaxprs)."""

    name: str
    num_warps: int  # total warps per program, warp-specialised partitions included
    num_ctas: int
    shared: int  # bytes of dynamic shared memory
    global_scratch: int  # bytes per program (0: none)
    global_scratch_align: int
    capability: int
    key: str  # Triton's cache hash of the compile
    ptx: str = field(repr=False, compare=False)
    folded: tuple = ()  # integer scalars equal to 1, compiled in as constexprs: not passed at launch

    def scratch_bytes(self, grid) -> int:
        """Bytes of global scratch a launch over ``grid`` needs (Triton's launcher: per program x programs)."""
        n = 1
        for g in grid:
            n *= int(g)
        return self.global_scratch * n * self.num_ctas


INT_TYPES = ("i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")


def specialize(kernel, arg_types, values=None):
    """Triton's JIT specialisation of the integer scalars: (arg_types with the scalars equal to 1 as "constexpr",
    {name: 1} of those, names known divisible by 16). ``values``: the runtime arguments, in the order of
    ``runtime_arg_names(kernel)`` (None, or None for an array: nothing specialised)."""
    names = runtime_arg_names(kernel)
    params = {p.name: p for p in _params(kernel)}
    types, ones, divisible = list(arg_types), {}, set()
    for i, (name, ty) in enumerate(zip(names, arg_types)):
        v = None if values is None else values[i]
        if ty not in INT_TYPES or v is None or isinstance(v, bool) or params[name].do_not_specialize:
            continue
        if int(v) == 1:
            types[i] = "constexpr"
            ones[name] = 1
        elif int(v) % 16 == 0:
            divisible.add(name)
    return types, ones, divisible


def signature(kernel, arg_types, constexprs: dict, divisible=(), capability: int = 90):
    """(signature, attrs) for ``triton.compile``: ``arg_types`` are the Triton types ("*bf16", "i32", "fp32",
    "constexpr" for a scalar folded in, ...) of ``runtime_arg_names(kernel)``, in order; pointers are 16-byte
    aligned, and so are the integer scalars named in ``divisible`` (known divisible by 16).

    The attributes are made by Triton's JIT itself (``JITFunction._pack_args``) from the specialisation its launch
    would compute: they are part of the cache key, and which arguments get an entry (an empty one included) has
    changed between Triton releases (3.6: the specialised scalars and string constexprs; 3.9: every constexpr).
    So torch's JIT launch and this compile share one cache entry whatever the installed Triton."""
    names = runtime_arg_names(kernel)
    if len(arg_types) != len(names):
        raise ValueError(f"{kernel.__name__} takes {len(names)} runtime arguments {names}, got {len(arg_types)} types")
    sig = dict(zip(names, arg_types))
    missing = [p.name for p in _params(kernel) if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{kernel.__name__}: constexprs {missing} not given")
    sig.update({k: "constexpr" for k in constexprs})
    params = {p.name: p for p in _params(kernel)}
    sig = {k: sig[k] for k in params if k in sig}
    specialization = []  # (type, what the JIT's specialisation says of the value), as its binder gives them
    for n, t in sig.items():
        if t == "constexpr":
            specialization.append((t, constexprs[n]))
        elif t.startswith("*"):
            specialization.append((t, "D"))
        elif t in INT_TYPES and not params[n].do_not_specialize:
            specialization.append((t, "D" if n in divisible else ""))
        else:
            specialization.append((t, None))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", capability, 32))
    jit = kernel if hasattr(kernel, "_pack_args") else _jit_function(kernel)
    bound = {n: constexprs.get(n) for n in sig}
    _, _, _, attrs = jit._pack_args(backend, {}, bound, specialization, None)
    return sig, attrs


# The modules whose Triton functions settle_cache_keys settles (with everything they call).
KERNEL_MODULES = ("ring_core.kernels.tl_fwd", "ring_core.kernels.tl_bwd", "ring_core.kernels.gluon_fwd",
                  "ring_core.kernels.gluon_bwd")
_settled = False


def settle_cache_keys() -> None:
    """Make every Triton function's cache key independent of the order in which a process first asks for keys.

    Triton 3.6 (the GPU machine's) merges a called function's global constexprs into its caller's key *before* it
    computes the callee's key (``DependenciesFinder._update_hash``; Triton 3.9 computes it first), so a function
    whose callees had no key yet hashes without their globals: the same kernel got another cache key in a process
    that had compiled another kernel first (``ring_attn_fwd_kernel`` then ``ring_attn_fwd_gluon``, or the reverse,
    gave both kernels other keys), and the GPU compiled variants its carried cache held (Triton 3.6, 2026-12). Here
    every Triton function loaded (ring_core's kernels, what they call, iris's, Triton's own)
    is hashed again until no key changes: each caller then holds all its callees' globals, one fixed point
    whatever the order. Once per process, before the first compile or launch (``_compile``, torch_bridge's
    first launch); about a second."""
    global _settled
    if _settled:
        return
    import sys
    import warnings

    from triton.runtime.jit import JITCallable

    for name in KERNEL_MODULES:
        import_kernel_module(name)
    with warnings.catch_warnings():  # (a module's deprecated attributes warn when looked at: torch.distributed's)
        warnings.simplefilter("ignore")
        fns = {id(v): v for mod in list(sys.modules.values()) if mod is not None
               for v in list(getattr(mod, "__dict__", {}).values())
               if isinstance(v, JITCallable) and "hash" in vars(v)}
    fns = sorted(fns.values(), key=lambda f: (getattr(f, "__module__", ""), getattr(f, "__name__", "")))
    keys = None
    for _ in range(64):  # (as many passes as the deepest call chain, plus one)
        for f in fns:
            f.hash = None
        new = [f.cache_key for f in fns]
        if new == keys:
            break
        keys = new
    else:
        raise RuntimeError("settle_cache_keys: the Triton functions' cache keys did not settle")
    _settled = True


def _jit_function(kernel):
    """A JITFunction of ``kernel`` (the interpreter wraps it without one: rebuilt from the same decorator flags)."""
    from triton.runtime.jit import JITFunction

    return JITFunction(kernel.fn, **kernel.kwargs)


def compile_kernel(kernel, arg_types, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90,
                   values=None):
    """Triton's CompiledKernel for an NVIDIA GPU of compute ``capability`` (90: Hopper), through its cache;
    ``values``: the runtime arguments (as in ``specialize``), for the integer scalars' specialisation."""
    return _compile(kernel, specialize(kernel, arg_types, values), constexprs, num_warps, num_stages, capability)


def _compile(kernel, specialized, constexprs: dict, num_warps: int, num_stages: int, capability: int):
    """``compile_kernel`` from ``specialize``'s result."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    settle_cache_keys()
    types, ones, divisible = specialized
    consts = dict(constexprs, **ones)
    sig, attrs = signature(kernel, types, consts, divisible, capability)
    _record(kernel, types, consts, divisible, num_warps, num_stages, capability)
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel (ring_core.kernels.gluon_fwd): its own source
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _record(kernel, types, consts: dict, divisible, num_warps: int, num_stages: int, capability: int) -> None:
    """One line of the compile log (``COMPILE_LOG_ENV``), if one is asked for: what ``warm`` needs to compile
    the same variant again. One write of one line in append mode: ranks may share the file."""
    path, tag = settings.compile_log()
    if not path:
        return
    rec = _as_record(kernel, types, consts, divisible, num_warps, num_stages, capability, tag)
    with open(path, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")


def _as_record(kernel, types, consts: dict, divisible, num_warps: int, num_stages: int, capability: int,
               tag: str) -> dict:
    fn = getattr(kernel, "fn", kernel)
    return dict(kernel=f"{fn.__module__}:{fn.__name__}", types=list(types), constexprs=dict(consts),
                divisible=sorted(divisible), num_warps=num_warps, num_stages=num_stages, capability=capability,
                tag=tag)


def record(kernel, arg_types, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90,
           values=None, tag: str = "") -> dict:
    """The compile-log record (``read_log``'s, what ``warm`` takes) of the variant that ``compile_kernel`` with
    these arguments would compile, without compiling it: for a cache filled ahead of the runs that need it."""
    types, ones, divisible = specialize(kernel, arg_types, values)
    return _as_record(kernel, types, dict(constexprs, **ones), divisible, num_warps, num_stages, capability, tag)


def read_log(path: str) -> list:
    """The records of a compile log, each once (first seen first); lines that are not records are skipped."""
    seen, out = set(), []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            key = variant_key(rec)
            if isinstance(rec, dict) and "kernel" in rec and key not in seen:
                seen.add(key)
                out.append(rec)
    return out


def variant_key(rec) -> str:
    """A record without its tag: what decides the binary."""
    return json.dumps({k: v for k, v in rec.items() if k != "tag"}, sort_keys=True) if isinstance(rec, dict) else ""


def _warm_one(rec: dict) -> tuple:
    """Compile one recorded variant (into Triton's cache): (seconds, cache key, error or "")."""
    t0 = time.perf_counter()
    try:
        module, name = rec["kernel"].split(":")
        kernel = getattr(import_kernel_module(module), name)
        ck = _compile(kernel, (rec["types"], {}, set(rec["divisible"])), rec["constexprs"], rec["num_warps"],
                      rec["num_stages"], rec["capability"])
        return time.perf_counter() - t0, ck.hash, ""
    except Exception as e:  # a variant the current source no longer takes, a module not importable here
        return time.perf_counter() - t0, "", f"{type(e).__name__}: {str(e)[:300]}"


def import_kernel_module(name: str):
    """Import the kernel module ``name``; on a machine with Triton and no torch (``warm``'s, ``ptx_same``'s), against
    iris's device functions only (``_iris_device_only``)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != "torch" or not _iris_device_only():
            raise
        return importlib.import_module(name)


def _iris_device_only() -> bool:
    """Make ``import iris`` give iris's device functions only (iris.mem.triton.ops: what the kernels call), without
    its host half, which needs torch; for ``warm`` on a machine with Triton and no torch (the same wheel as the
    GPU machine's, ``--identity``). The kernels compile to the same cache entries: a cache key hashes the
    functions a kernel calls, not the module they come from. Returns False if iris's device part is not there
    either."""
    import importlib.util
    import sys
    import types

    found = importlib.util.find_spec("iris")
    if found is None or not found.submodule_search_locations:
        return False
    view = types.ModuleType("iris", "iris's device functions only (ring_core.runtime.build._iris_device_only)")
    view.__path__ = list(found.submodule_search_locations)
    sys.modules["iris"] = view
    from iris.mem.triton import ops

    for name, fn in vars(ops).items():
        if not name.startswith("_") and callable(fn):
            setattr(view, name, fn)
    return True


def warm(records, jobs: int = 1) -> list:
    """Compile ``records`` (``read_log``'s), ``jobs`` at a time in separate processes (1: in this one); returns
    (record, seconds, cache key, error) per record, in order. The variants compiled here are not logged again."""
    return list(iter_warm(records, jobs))


def iter_warm(records, jobs: int = 1):
    """``warm``, yielding each record's result as soon as it and those before it are done."""
    os.environ.pop(COMPILE_LOG_ENV, None)
    if jobs <= 1 or len(records) <= 1:
        yield from ((r, *_warm_one(r)) for r in records)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        yield from ((r, *res) for r, res in zip(records, ex.map(_warm_one, records)))


def cache_identity(capability: int = 90) -> str:
    """What every Triton cache key of this machine's compiles for ``capability`` starts from: Triton's version,
    a hash of its own files (Python and libtriton: differs between Python versions' wheels) and ptxas's
    version. Two machines with the same identity compile a variant to the same cache entry, so a cache filled
    on one (``warm``) serves the other."""
    import hashlib

    import triton

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.cache import triton_key

    ptxas = CUDABackend(GPUTarget("cuda", capability, 32)).hash().split("\n")
    release = next((ln for ln in ptxas if "release" in ln), ptxas[-1]).strip()
    return (f"triton {triton.__version__} files {hashlib.sha256(triton_key().encode()).hexdigest()[:16]} "
            f"ptxas {release} sm_{capability}")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ring_core.runtime.build",
                                 description="Compile the variants of a compile log into Triton's cache.")
    ap.add_argument("--warm", metavar="FILE", nargs="+",
                    help=f"compile logs ({COMPILE_LOG_ENV}; a missing one is skipped)")
    ap.add_argument("--identity", action="store_true",
                    help="print what Triton's cache keys depend on besides the kernel (cache_identity)")
    ap.add_argument("--tags", default=None, help="comma list: only the records of these tags (default: all)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    a = ap.parse_args(argv)
    if a.identity:
        print(cache_identity())
    if a.warm is None:
        if not a.identity:
            ap.error("give --warm FILE or --identity")
        return 0
    records = []
    for path in a.warm:
        if os.path.exists(path):
            records += read_log(path)
        else:
            print(f"no compile log at {path}: skipped")
    if a.tags is not None:
        tags = set(a.tags.split(","))
        records = [r for r in records if r.get("tag", "") in tags]
    seen = set()
    records = [r for r in records if not (variant_key(r) in seen or seen.add(variant_key(r)))]  # each variant once
    t0 = time.perf_counter()
    failed = done = 0
    for rec, secs, key, err in iter_warm(records, a.jobs):
        done += 1
        c = rec["constexprs"]
        what = f"{rec['kernel'].split(':')[1]} W={c.get('W', '-')} D={c.get('D', '-')} {rec['types'][0]}"
        print(f"  {secs:6.1f} s  {what}  {key[:12] if key else 'FAILED ' + err}", flush=True)
        failed += bool(err)
    print(f"warmed {done - failed} of {done} variants in {time.perf_counter() - t0:.0f} s "
          f"({a.jobs} processes)")
    return 0


def binary(kernel, arg_types, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90,
           values=None) -> Binary:
    """``compile_kernel``, as a ``Binary``; raises where the compiled kernel needs a launch feature that a plain
    launch does not give (profiling scratch, cooperative grids, programmatic dependent launch, clusters)."""
    specialized = specialize(kernel, arg_types, values)
    ck = _compile(kernel, specialized, constexprs, num_warps, num_stages, capability)
    md = ck.metadata
    unsupported = {"profile_scratch_size": getattr(md, "profile_scratch_size", 0) or 0,
                   "launch_cooperative_grid": bool(getattr(md, "launch_cooperative_grid", False)),
                   "launch_pdl": bool(getattr(md, "launch_pdl", False)),
                   "num_ctas > 1": getattr(md, "num_ctas", 1) > 1}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise NotImplementedError(f"{kernel.__name__} compiled to a kernel whose launch needs {bad}")
    folded = tuple(specialized[1])
    return Binary(name=md.name, num_warps=md.num_warps, num_ctas=getattr(md, "num_ctas", 1), shared=md.shared,
                  global_scratch=md.global_scratch_size or 0, global_scratch_align=md.global_scratch_align or 1,
                  capability=capability, key=ck.hash, ptx=ck.asm["ptx"], folded=folded)


if __name__ == "__main__":
    raise SystemExit(main())
