"""Why a GPU process compiles a variant that the carried Triton cache holds (e.g. a cache key that moves between
processes): a trace of every ``triton.compile`` a process makes, and the cache keys of the kernels' functions.

* ``install(path)`` (what ``tools/compile_trace_site/sitecustomize.py`` calls in every Python process when
  that folder leads ``PYTHONPATH`` and ``RING_ATTENTION_COMPILE_TRACE`` names a folder): Triton's compilation
  listener appends one JSON line per compile, hit or miss, to ``<folder>/trace.<pid>.jsonl``: the kernel, the
  cache entry (``hash``), the source's hash and its parts (the function's key, the attributes, the
  constexprs), whether the entry's folder was in the cache when the process started (``in_cache_at_start``:
  a miss with ``True`` means the entry was there and Triton would not take it, e.g. a group file naming
  files under another root) and the seconds it took.
* ``python tools/compile_trace.py --keys`` prints the cache key of every Triton function of ``ring_core``
  and of iris's device functions, one per line, sorted, as ``ring_core.runtime.build.settle_cache_keys`` settles them:
  two processes' outputs (two machines', two runs') diffed show which function's key moves. (What moved them
  before the settling, 2026-12-04: Triton 3.6 hashed a caller without the globals of callees not yet hashed, so a
  key depended on which kernel a process hashed first.)
* ``python tools/compile_trace.py --summarize FOLDER``: the traces' misses and hits per kernel, and the
  functions whose keys differ between two ``--keys`` outputs (``--diff A B``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TRACE_ENV = "RING_ATTENTION_COMPILE_TRACE"


def _cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def install(folder: str) -> None:
    """Log every compile of this process (hits too) to ``folder/trace.<pid>.jsonl``."""
    from triton import knobs

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"trace.{os.getpid()}.jsonl")
    cache = _cache_dir()
    at_start = set(os.listdir(cache)) if os.path.isdir(cache) else set()
    t_last = [time.perf_counter()]

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        fn = getattr(src, "fn", None)
        row = dict(pid=os.getpid(), argv=" ".join(sys.argv[:3])[-120:], cwd=os.getcwd(),
                   kernel=getattr(fn, "__name__", str(fn)), hash=metadata.get("hash"), hit=bool(cache_hit),
                   in_cache_at_start=metadata.get("hash") in at_start, src_hash=src.hash(),
                   fn_key=getattr(fn, "cache_key", ""), attrs=repr(getattr(src, "attrs", "")),
                   constexprs=repr(sorted((str(k), repr(v)) for k, v in getattr(src, "constants", {}).items())),
                   group=sorted(metadata_group.values())[:1], since_last_s=round(time.perf_counter() - t_last[0], 2))
        t_last[0] = time.perf_counter()
        with open(path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")

    knobs.compilation.listener = listener


def function_keys(settle: bool = True) -> dict:
    """{module.name: cache key} of every Triton function in ring_core's kernel modules and the modules they
    import Triton functions from (iris's included), settled as every compile and launch of ours settles them
    (``ring_core.runtime.build.settle_cache_keys``; ``settle=False``: as this process's order of asking gives them)."""
    from triton.runtime.jit import JITCallable

    from ring_core.runtime import build

    if settle:
        build.settle_cache_keys()
    keys = {}
    for mod_name, mod in sorted(sys.modules.items()):
        if not (mod_name.startswith("ring_core") or mod_name.startswith("iris")) or mod is None:
            continue
        for attr, val in sorted(vars(mod).items()):
            if isinstance(val, JITCallable) and getattr(val, "__module__", mod_name) == mod_name:
                keys[f"{mod_name}.{attr}"] = val.cache_key
    return keys


def summarize(folder: str) -> list:
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("trace.") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/compile_trace.py", description=__doc__.split("\n")[0])
    ap.add_argument("--keys", action="store_true", help="print every kernel function's cache key")
    ap.add_argument("--summarize", metavar="FOLDER", help="the traces under FOLDER: misses and hits")
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"), help="two --keys outputs: the functions that differ")
    a = ap.parse_args(argv)
    if a.keys:
        for k, v in function_keys().items():
            print(k, v)
    if a.summarize:
        rows = summarize(a.summarize)
        misses = [r for r in rows if not r["hit"]]
        print(f"{len(rows)} compiles, {len(misses)} misses "
              f"({sum(r['in_cache_at_start'] for r in misses)} of them with the entry in the cache at start)")
        for r in misses:
            print(f"  miss {r['kernel']} {r['hash'][:12]} src {r['src_hash'][:12]} fn {r['fn_key'][:12]} "
                  f"at_start={r['in_cache_at_start']} pid {r['pid']} {r['argv']}")
        by_src = {}
        for r in rows:
            by_src.setdefault((r["kernel"], r["attrs"], r["constexprs"]), set()).add((r["fn_key"], r["src_hash"]))
        for (kern, _, _), keys in by_src.items():
            if len(keys) > 1:
                print(f"  one variant of {kern}, {len(keys)} source keys: {sorted(k[0][:12] for k in keys)}")
    if a.diff:
        sides = []
        for p in a.diff:
            with open(p) as f:
                sides.append(dict(line.split() for line in f if len(line.split()) == 2))
        for k in sorted(set(sides[0]) | set(sides[1])):
            if sides[0].get(k) != sides[1].get(k):
                print(f"{k}: {sides[0].get(k, '-')[:16]} {sides[1].get(k, '-')[:16]}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's ring_core
    raise SystemExit(main())
