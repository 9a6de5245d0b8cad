"""A caching stand-in for ``ptxas``, for GPU test sessions: the cubin of a PTX file compiled once is reused.

Why: jaxlib turns every Triton kernel's PTX into a cubin with ``ptxas`` in every process, at the variant's
first launch, and keeps it only in that process (``jaxlib/gpu/triton_kernels.cc``, ``GetModuleImage``). Our
kernels' PTX takes ptxas 10-40 s each, so a multi-rank GPU check spends most of its time there, once per rank
and per device call. Torch's JIT loads the cubin from Triton's on-disk cache and pays nothing.

``tests/gpu_session.py`` puts a ``ptxas`` shim that runs this file first on ``PATH`` (XLA looks for ptxas on
``PATH``); it finds the real ptxas further along (``PATH``, then the CUDA wheels, then Triton's own), and keys
each compile by the real ptxas's version, the arguments (file names left out) and the PTX's bytes. A hit copies
the stored cubin and output; a miss runs the real ptxas and stores what it wrote. The store lives under the
Triton cache folder, so the session carries it from one device call to the next with Triton's cache.
Nothing here changes what is compiled: the same ptxas gets the same PTX and arguments; only a repeat is skipped.

    ptxas_cache.py ARGS...        (as ptxas; RING_PTXAS_CACHE = the store, RING_PTXAS_SHIM = the shim's folder)
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time

NAME = "ptxas"


def real_ptxas(shim_dir: str | None) -> str | None:
    """The ptxas XLA would have used without the shim: the first on PATH after it, then the CUDA wheels'
    (``nvidia/cuda_nvcc``), then the one Triton ships."""
    skip = os.path.realpath(shim_dir) if shim_dir else None
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and os.path.realpath(d) != skip:
            p = os.path.join(d, NAME)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    for pattern in (os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cuda_nvcc", "bin", NAME),
                    os.path.join(sys.prefix, "lib", "python3*", "site-packages", "triton", "backends", "nvidia",
                                 "bin", NAME)):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def split_args(args: list) -> tuple:
    """(input PTX path, output path, the other arguments) or (None, None, args) when the call is not a plain
    "compile one PTX file to one output" (``--version``, for one), which then runs uncached."""
    ptx, out, rest, i = None, None, [], 0
    while i < len(args):
        a = args[i]
        if a in ("-o", "--output-file") and i + 1 < len(args):
            out = args[i + 1]
            i += 2
            continue
        if not a.startswith("-") and a.endswith(".ptx") and os.path.isfile(a):
            if ptx is not None:
                return None, None, args
            ptx = a
        else:
            rest.append(a)
        i += 1
    if ptx is None or out is None:
        return None, None, args
    return ptx, out, rest


def cache_key(real: str, ptx_path: str, rest: list) -> str:
    h = hashlib.sha256()
    version = subprocess.run([real, "--version"], capture_output=True, text=True).stdout
    for part in (real, version, "\0".join(rest)):
        h.update(part.encode() + b"\0")
    with open(ptx_path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main(args: list) -> int:
    store = os.environ.get("RING_PTXAS_CACHE")
    real = real_ptxas(os.environ.get("RING_PTXAS_SHIM"))
    if real is None:
        sys.stderr.write("ptxas_cache: no real ptxas found on PATH, in the CUDA wheels or in Triton\n")
        return 127
    ptx, out, rest = split_args(args)
    if not store or ptx is None:
        return subprocess.run([real] + args).returncode
    os.makedirs(store, exist_ok=True)
    entry = os.path.join(store, cache_key(real, ptx, rest))
    log = os.path.join(store, "calls.log")
    t0 = time.monotonic()
    if os.path.isfile(entry + ".cubin"):
        shutil.copyfile(entry + ".cubin", out)
        with open(entry + ".err", "rb") as f:
            sys.stderr.buffer.write(f.read())
        outcome, rc = "hit", 0
    else:
        proc = subprocess.run([real] + args, capture_output=True)
        sys.stdout.buffer.write(proc.stdout)
        sys.stderr.buffer.write(proc.stderr)
        rc = proc.returncode
        if rc == 0 and os.path.isfile(out):
            tmp = f"{entry}.{os.getpid()}"
            shutil.copyfile(out, tmp + ".cubin")
            with open(tmp + ".err", "wb") as f:
                f.write(proc.stderr)
            os.replace(tmp + ".err", entry + ".err")  # .err first: a reader that sees the cubin finds both
            os.replace(tmp + ".cubin", entry + ".cubin")
        outcome = "miss"
    with open(log, "a") as f:
        f.write(f"{outcome} rc={rc} {time.monotonic() - t0:.1f}s {real} {os.path.getsize(ptx)}B {' '.join(rest)}\n")
    return rc


def install(shim_dir: str, store: str) -> dict:
    """Write the shim into ``shim_dir``; returns the environment that puts it first on PATH."""
    os.makedirs(shim_dir, exist_ok=True)
    shim = os.path.join(shim_dir, NAME)
    with open(shim, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(__file__)}" "$@"\n')
    os.chmod(shim, 0o755)
    return {"PATH": shim_dir + os.pathsep + os.environ.get("PATH", ""), "RING_PTXAS_CACHE": store,
            "RING_PTXAS_SHIM": shim_dir}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
