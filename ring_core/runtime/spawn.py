"""Start one process per rank: ``python -m jax_ring.launch --nproc-per-node N script.py [args]`` (or
``python -m torch_bridge.launch``, the same program; no framework here).

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (what
``jax_ring.initialize`` / ``torch_bridge.initialize`` read; the same names torchrun sets), and GROUP_RANK / NODE_RANK.
Several nodes, as with torchrun: run the launcher once on each with ``--nnodes M --node-rank i --master-addr HOST
--master-port PORT`` (HOST: node rank 0's host, PORT: the same free port on every node); rank ``i * N + local rank`` of
``M * N``. Local rank r uses GPU ``r % visible GPUs``, so N may exceed the GPUs: ranks then share them
(``ring_core.runtime.gpus``). With ``--mps auto`` (the default) the launcher then starts a private CUDA MPS daemon for
the job, gives each rank its share of the SMs and stops the daemon at the end, so the ranks' kernels run side by side
instead of time-sliced. If one process fails, the others are stopped and the launcher exits with that process's code.
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
    ap.add_argument("--nnodes", type=int, default=1,
                    help="nodes (hosts) in the job; run the launcher once on each (default 1)")
    ap.add_argument("--node-rank", type=int, default=0,
                    help="this node's index in 0..nnodes-1; its ranks are node_rank * nproc_per_node + local rank")
    ap.add_argument("--master-addr", default=None,
                    help="host of node rank 0, reachable from every node (default 127.0.0.1; needed with --nnodes > 1)")
    ap.add_argument("--master-port", type=int, default=None,
                    help="rendezvous port (default: a free one; needed with --nnodes > 1: the same on every node)")
    ap.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    ap.add_argument("target", help="script path (or module name with -m)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    n = a.nproc_per_node
    if n < 1:
        ap.error("--nproc-per-node must be >= 1")
    _check_nodes(ap, a)
    start_mps, extra = gpus.mps_plan(n, gpus.visible_gpus() if a.mps != "off" else 0, a.mps)
    mps = gpus.MpsDaemon()
    if start_mps:
        extra.update(mps.start())
        print(f"launch: started a CUDA MPS daemon for {n} ranks ({extra})", file=sys.stderr)
    try:
        return _run(a, extra)
    finally:
        mps.stop()


def _check_nodes(ap, a) -> None:
    """The several-node flags, before anything starts (argparse's error: usage and exit code 2)."""
    if a.nnodes < 1:
        ap.error(f"--nnodes must be >= 1, got {a.nnodes}")
    if not 0 <= a.node_rank < a.nnodes:
        ap.error(f"--node-rank must be in 0..{a.nnodes - 1} (--nnodes {a.nnodes}), got {a.node_rank}")
    if a.master_port is not None and not 0 < a.master_port < 65536:
        ap.error(f"--master-port must be in 1..65535, got {a.master_port}")
    if a.master_addr is not None and not a.master_addr.strip():
        ap.error("--master-addr is empty; give the host of node rank 0")
    if a.nnodes > 1:
        missing = [f for f, v in (("--master-addr", a.master_addr), ("--master-port", a.master_port)) if v is None]
        if missing:
            ap.error(f"--nnodes {a.nnodes} needs {' and '.join(missing)}: the host of node rank 0 and a free port "
                     f"on it, the same on every node (a port picked here could not be known to the other nodes)")


def rank_env(node_rank: int, nnodes: int, nproc_per_node: int, local_rank: int, master_addr: str,
             master_port: int) -> dict:
    """The rendezvous variables of one process, as torchrun sets them.

    >>> e = rank_env(1, 2, 4, 3, "h0", 29500)
    >>> e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["NODE_RANK"]
    ('7', '8', '3', '4', '1', '1')
    """
    return dict(RANK=str(node_rank * nproc_per_node + local_rank), WORLD_SIZE=str(nnodes * nproc_per_node),
                LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc_per_node), GROUP_RANK=str(node_rank),
                NODE_RANK=str(node_rank), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))


def _run(a, extra: dict) -> int:
    n = a.nproc_per_node
    port = a.master_port or _free_port()
    addr = a.master_addr or "127.0.0.1"
    cmd = [sys.executable] + (["-m", a.target] if a.module else [a.target]) + a.args
    procs = []
    for r in range(n):
        env = dict(os.environ, **rank_env(a.node_rank, a.nnodes, n, r, addr, port), **extra)
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
