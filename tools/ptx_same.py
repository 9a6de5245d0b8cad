"""Whether two trees' kernels compile to the same code: each record of a compile log compiled (Triton, sm_90, no GPU)
from this tree's ring_core and from another's, the PTX compared up to its DWARF debug section (which names the
source files' folder) with the .loc/.file lines dropped. For a change meant to leave some binaries alone (e.g.
the Gluon forward's pushers at W > 1 must leave every W = 1 kernel as it was):

    git archive 9fa4b9d ring_core | tar x -C /tmp/oldtree
    python tools/ptx_same.py --other /tmp/oldtree --records RECORDS.jsonl      # with the GPU's Triton (3.6)

Each tree compiles in its own process (its own Triton cache under a temporary folder; ``--cache DIR`` gives this
tree's compiles a cache of its own, e.g. .cache/triton after ``ring_core.runtime.build --warm`` of the same records)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# (imports by itself, not with ring_core.runtime.build.import_kernel_module: the other tree's build may predate it)
_DUMP = r"""
import importlib, json, re, sys
try:
    from ring_core.runtime import build
except ModuleNotFoundError:  # a tree from before ring_core's subpackages
    from ring_core import build
MOVED = {"ring_core.kernel": "ring_core.kernels.tl_fwd", "ring_core.kernel_bwd": "ring_core.kernels.tl_bwd",
         "ring_core.gluon_kernel": "ring_core.kernels.gluon_fwd", "ring_core.gluon_bwd": "ring_core.kernels.gluon_bwd"}
MOVED.update({v: k for k, v in MOVED.items()})
try:
    import torch  # noqa: F401
except ModuleNotFoundError:
    build._iris_device_only()
out = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    mod, name = r["kernel"].split(":")
    try:
        k = getattr(importlib.import_module(mod), name)
    except ModuleNotFoundError as e:  # the records may name the kernel by the other tree's module
        if mod not in MOVED or not (mod + ".").startswith((e.name or "") + "."):  # the module or its package
            raise
        k = getattr(importlib.import_module(MOVED[mod]), name)
    # (a constexpr the tree's kernel does not take yet, e.g. one added at a default that keeps the code as it was:
    # left out)
    consts = {n: v for n, v in r["constexprs"].items() if n in k.arg_names}
    ck = build._compile(k, (r["types"], {}, set(r["divisible"])), consts, r["num_warps"], r["num_stages"],
                        r["capability"])
    c = r["constexprs"]
    out[f'{r["kernel"]} W={c.get("W")} D={c.get("D")} {r["types"][0]} segmented={c.get("SEGMENTED")} '
        f'window={c.get("WINDOW")} causal={c.get("CAUSAL")}'] = ck.asm["ptx"]
json.dump(out, open(sys.argv[2], "w"))
"""


def code(ptx: str) -> list:
    """The PTX's lines before its DWARF section, without .loc / .file lines and without the ``$L__tmpN:`` labels that
    only the DWARF section refers to (they mark inlined functions' scopes: moving code into a function of its own
    adds some, the instructions staying the same)."""
    lines = [ln for ln in ptx.splitlines()
             if not re.match(r"\s*\.(loc|file)\b", ln) and not re.match(r"\$L__tmp\d+:\s*$", ln.strip())]
    end = next((i for i, ln in enumerate(lines) if "Length of Unit" in ln or ".section\t.debug" in ln), len(lines))
    return lines[:end]


def dump(tree: str, records: str, out: str, cache: str = None) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=cache or tempfile.mkdtemp(prefix="ptx_same_"))
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", _DUMP, records, out], cwd=tree, env=env, check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/ptx_same.py", description=__doc__.split("\n")[0])
    ap.add_argument("--other", required=True, help="the other tree's folder (holding its ring_core)")
    ap.add_argument("--records", required=True, help="compile-log records (JSON lines: ring_core.runtime.build's)")
    ap.add_argument("--cache", default=None, help="a Triton cache for this tree's compiles (e.g. the one "
                    "ring_core.runtime.build --warm filled from the same records); default: a temporary one")
    a = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        sides = []
        for i, tree in enumerate((os.path.abspath(a.other), here)):
            dump(tree, os.path.abspath(a.records), os.path.join(tmp, f"{i}.json"),
                 os.path.abspath(a.cache) if i and a.cache else None)
            with open(os.path.join(tmp, f"{i}.json")) as f:
                sides.append(json.load(f))
    same = 0
    for k in sides[0]:
        ok = code(sides[0][k]) == code(sides[1].get(k, ""))
        same += ok
        print("identical" if ok else "DIFFERENT", k, len(code(sides[0][k])), "lines")
    print(f"{same} of {len(sides[0])} identical")
    return 0 if same == len(sides[0]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
