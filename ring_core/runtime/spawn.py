"""Start one process per rank: ``python -m jax_ring.launch --nproc-per-node N script.py [args]`` (or
``python -m torch_bridge.launch``, the same program; no framework here).

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (what
``jax_ring.initialize`` / ``torch_bridge.initialize`` read; the same names torchrun sets). Rank r uses GPU
``r % visible GPUs``, so N may exceed the GPUs: ranks then share them (``ring_core.runtime.gpus``). With
``--mps auto`` (the default) the launcher then starts a private CUDA MPS daemon for the job, gives each
rank its share of the SMs and stops the daemon at the end, so the ranks' kernels run side by side instead
of time-sliced. If one process fails, the others are stopped and the launcher exits with that process's
code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from ring_core.runtime import gpus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None, prog: str = "python -m ring_core.runtime.spawn") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--nproc-per-node", type=int, required=True,
                    help="processes (ranks) to start; rank r uses GPU r %% visible GPUs")
    ap.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                    help="run a private CUDA MPS daemon for the job: auto (default) when ranks outnumber the "
                         "visible GPUs and none serves already, on, or off")
    ap.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    ap.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    ap.add_argument("target", help="script path (or module name with -m)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    n = a.nproc_per_node
    if n < 1:
        ap.error("--nproc-per-node must be >= 1")
    start_mps, extra = gpus.mps_plan(n, gpus.visible_gpus() if a.mps != "off" else 0, a.mps)
    mps = gpus.MpsDaemon()
    if start_mps:
        extra.update(mps.start())
        print(f"launch: started a CUDA MPS daemon for {n} ranks ({extra})", file=sys.stderr)
    try:
        return _run(a, extra)
    finally:
        mps.stop()


def _run(a, extra: dict) -> int:
    n = a.nproc_per_node
    port = a.master_port or _free_port()
    cmd = [sys.executable] + (["-m", a.target] if a.module else [a.target]) + a.args
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
        procs.append(subprocess.Popen(cmd, env=env))

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, lambda *x: (stop(), sys.exit(143)))
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    print(f"launch: a process exited with code {rc}; stopping the others", file=sys.stderr)
                    stop()
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop()
        code = 130
    finally:
        deadline = time.time() + 30
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
