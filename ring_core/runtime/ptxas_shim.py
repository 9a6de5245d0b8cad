"""A ``ptxas`` for jaxlib that hands back the cubin Triton already built from the same PTX.

jaxlib's Triton custom call takes a kernel's PTX only, and turns it into a cubin with ptxas at the kernel's first
launch, in every process (XLA's ``CompileGpuAsm``: the jax CUDA plugin is built without libnvptxcompiler, so it runs the
first ``ptxas`` it finds, ``PATH`` before the CUDA roots). For our kernels that is 2-80 s per variant per process,
though Triton compiled that very PTX into a cubin when ``ring_core.runtime.build`` asked for the binary, and keeps both
in its cache. Torch's launcher loads that cubin; jaxlib compiles again with its own ptxas.

Put this first on ``PATH`` (``python -m ring_core.runtime.ptxas_shim --install DIR`` writes ``DIR/ptxas``; then
``PATH=DIR:$PATH``) and jaxlib's ptxas call finds, in Triton's cache, the ``.ptx`` whose bytes equal the file it
was given and gets the ``.cubin`` beside it: the JAX frontend then launches exactly the binary torch launches, and
a warm Triton cache means no ptxas at all. Anything else (no such PTX in the cache, ``--version``, other calls)
runs the real ptxas with the same arguments. It only reads the cache; stdlib only, so it runs as a script too.

``RING_PTXAS_LOG`` (a file) gets one line per call: served or compiled, and the time taken.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import time

REAL_ENV = "RING_PTXAS_REAL"  # the real ptxas (written into the installed script)
LOG_ENV = "RING_PTXAS_LOG"
CACHE_ENV = "TRITON_CACHE_DIR"
# ptxas options that take a value as the next argument (jaxlib passes ``-o FILE``; the rest for completeness).
_VALUED = {"-o", "--output-file", "-arch", "--gpu-name", "-maxrregcount", "--maxrregcount", "-O", "--opt-level",
           "-m", "--machine", "--entry", "-e"}


def triton_cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def parse(argv: list) -> tuple:
    """ptxas's arguments -> (input PTX path or None, output path or None)."""
    src = out = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _VALUED:
            if arg in ("-o", "--output-file") and i + 1 < len(argv):
                out = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--output-file="):
            out = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            src = arg
        i += 1
    return src, out


def find_cubin(ptx: bytes, cache: str) -> str | None:
    """The ``.cubin`` beside a ``.ptx`` in Triton's cache whose bytes equal ``ptx`` (sizes compared first)."""
    want = hashlib.sha256(ptx).digest()
    try:
        entries = os.scandir(cache)
    except OSError:
        return None
    with entries:
        for entry in entries:
            if not entry.is_dir():
                continue
            try:
                names = os.listdir(entry.path)
            except OSError:
                continue
            for name in names:
                if not name.endswith(".ptx"):
                    continue
                path = os.path.join(entry.path, name)
                cubin = path[:-4] + ".cubin"
                try:
                    if os.path.getsize(path) != len(ptx) or not os.path.exists(cubin):
                        continue
                    with open(path, "rb") as f:
                        if hashlib.sha256(f.read()).digest() == want:
                            return cubin
                except OSError:
                    continue
    return None


def _is_shim(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return REAL_ENV.encode() in f.read(4096)
    except OSError:
        return False


def find_real() -> str | None:
    """The ptxas jaxlib would run without this one: ``PATH`` (shims skipped), then the CUDA roots (the NVIDIA
    pip packages beside this Python's site-packages, /usr/local/cuda), then Triton's own."""
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cand = os.path.join(d, "ptxas")
        if d and os.access(cand, os.X_OK) and not os.path.isdir(cand) and not _is_shim(cand):
            return cand
    roots = []
    for site in sys.path:
        for sub in ("nvidia/cu13", "nvidia/cuda_nvcc", "nvidia/cu12"):
            roots.append(os.path.join(site, sub))
    roots.append("/usr/local/cuda")
    for site in sys.path:
        roots.append(os.path.join(site, "triton", "backends", "nvidia"))
    for root in roots:
        cand = os.path.join(root, "bin", "ptxas")
        if os.access(cand, os.X_OK):
            return cand
    return None


def install(directory: str) -> str:
    """Write ``directory/ptxas`` (a shell script running this file with this Python); returns its path."""
    os.makedirs(directory, exist_ok=True)
    real = os.environ.get(REAL_ENV) or find_real()
    if real is None:
        raise SystemExit("ptxas_shim: no real ptxas found (PATH, NVIDIA pip packages, /usr/local/cuda, Triton's); "
                         f"set {REAL_ENV}")
    path = os.path.join(directory, "ptxas")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n"
                f"export {REAL_ENV}=\"${{{REAL_ENV}:-{real}}}\"\n"
                f"exec \"{sys.executable}\" \"{os.path.abspath(__file__)}\" \"$@\"\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _log(line: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass


def main(argv: list) -> int:
    if argv[:1] == ["--install"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m ring_core.runtime.ptxas_shim --install DIR")
        print(install(argv[1]))
        return 0
    t0 = time.monotonic()
    src, out = parse(argv)
    if src and out and os.path.isfile(src):  # XLA names its temp files without a suffix
        with open(src, "rb") as f:
            ptx = f.read()
        cubin = find_cubin(ptx, triton_cache_dir())
        if cubin is not None:
            shutil.copyfile(cubin, out)
            _log(f"served {os.path.basename(cubin)} {len(ptx)} B in {time.monotonic() - t0:.2f} s: {cubin}")
            return 0
    real = os.environ.get(REAL_ENV) or find_real()
    if real is None:
        print(f"ptxas_shim: no real ptxas to run (set {REAL_ENV})", file=sys.stderr)
        return 127
    if not (src and out):
        os.execv(real, [real] + argv)  # --version and the like: the real one answers
    import subprocess
    rc = subprocess.call([real] + argv)
    _log(f"compiled {os.path.basename(src)} with {real}: exit {rc} in {time.monotonic() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
