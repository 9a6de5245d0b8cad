"""ring_core/runtime/ptxas_shim.py: jaxlib's ptxas call answered from Triton's cache, anything else passed to the real
one."""

import os
import subprocess
import sys
from pathlib import Path

from ring_core.runtime import ptxas_shim

ROOT = Path(__file__).resolve().parents[2]


def _cache(tmp_path, ptx=b".version 8.7\n.target sm_90a\n// kernel\n", cubin=b"\x7fELF cubin"):
    entry = tmp_path / "cache" / "HASHDIR"
    entry.mkdir(parents=True)
    (entry / "k.ptx").write_bytes(ptx)
    (entry / "k.cubin").write_bytes(cubin)
    (entry / "k.json").write_text("{}")
    return tmp_path / "cache", ptx, cubin


def _fake_real(tmp_path):
    """A stand-in real ptxas: writes 'compiled' to its -o file, answers --version."""
    real = tmp_path / "real" / "ptxas"
    real.parent.mkdir()
    real.write_text("#!/bin/sh\n"
                    "if [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release 0.0'; exit 0; fi\n"
                    "while [ $# -gt 0 ]; do if [ \"$1\" = -o ]; then printf compiled > \"$2\"; fi; shift; done\n")
    real.chmod(0o755)
    return real


def test_parse_reads_xla_arguments():
    # XLA's subprocess call: ptxas PTX_FILE -o CUBIN_FILE -arch=sm_90a --warn-on-spills [extra flags]
    assert ptxas_shim.parse(["/tmp/tempfile-a", "-o", "/tmp/tempfile-b", "-arch=sm_90a", "--warn-on-spills"]) == (
        "/tmp/tempfile-a", "/tmp/tempfile-b")
    assert ptxas_shim.parse(["--version"]) == (None, None)
    assert ptxas_shim.parse(["-arch", "sm_90a", "--output-file=o.cubin", "in.ptx"]) == ("in.ptx", "o.cubin")


def test_find_cubin_matches_bytes_not_names(tmp_path):
    cache, ptx, _ = _cache(tmp_path)
    assert ptxas_shim.find_cubin(ptx, str(cache)) == str(cache / "HASHDIR" / "k.cubin")
    assert ptxas_shim.find_cubin(ptx + b" ", str(cache)) is None
    assert ptxas_shim.find_cubin(ptx[:-1] + b"X", str(cache)) is None  # same size, other bytes
    assert ptxas_shim.find_cubin(ptx, str(tmp_path / "missing")) is None


def test_installed_shim_serves_cached_cubin_and_passes_the_rest(tmp_path):
    cache, ptx, cubin = _cache(tmp_path)
    real = _fake_real(tmp_path)
    env = dict(os.environ, RING_PTXAS_REAL=str(real), TRITON_CACHE_DIR=str(cache),
               RING_PTXAS_LOG=str(tmp_path / "log"))
    shim = subprocess.run([sys.executable, "-m", "ring_core.runtime.ptxas_shim", "--install", str(tmp_path / "bin")],
                          env=env, capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    src = tmp_path / "tempfile-1"  # XLA's temp names carry no suffix
    src.write_bytes(ptx)
    subprocess.run([shim, str(src), "-o", str(tmp_path / "out1"), "-arch=sm_90a"], env=env, check=True)
    assert (tmp_path / "out1").read_bytes() == cubin
    src.write_bytes(ptx + b"// not compiled by Triton\n")
    subprocess.run([shim, str(src), "-o", str(tmp_path / "out2"), "-arch=sm_90a"], env=env, check=True)
    assert (tmp_path / "out2").read_bytes() == b"compiled"
    version = subprocess.run([shim, "--version"], env=env, capture_output=True, text=True, check=True).stdout
    assert "release 0.0" in version
    log = (tmp_path / "log").read_text().splitlines()
    assert log[0].startswith("served k.cubin") and log[1].startswith("compiled tempfile-1")


def test_find_real_skips_shims(tmp_path, monkeypatch):
    real = _fake_real(tmp_path)
    monkeypatch.delenv("RING_PTXAS_REAL", raising=False)
    monkeypatch.setenv("RING_PTXAS_REAL", str(real))
    shim = ptxas_shim.install(str(tmp_path / "bin"))
    monkeypatch.delenv("RING_PTXAS_REAL")
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(shim), str(real.parent)]))
    assert ptxas_shim.find_real() == str(real)
