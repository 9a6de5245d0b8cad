"""The launcher across several nodes (CPU): two launcher processes on this host play two nodes (``--nnodes 2
--node-rank 0/1``, one master address and port), their workers meet in one gloo group."""

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
    import os, socket, sys
    import torch
    import torch.distributed as dist
    from ring_core.topology import check_hosts, resolve_nodes

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT")
    dist.init_process_group("gloo")  # env://: the variables above
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = resolve_nodes(world)
    try:
        check_hosts(hosts, nodes)
        verdict = "ok"
    except ValueError as e:
        verdict = "refused:" + str(e).replace(" ", "_")
    dist.destroy_process_group()
    # One write: the ranks' lines must not interleave.
    os.write(1, (" ".join(["ENV", *[os.environ[k] for k in keys], str(int(x.item())), str(nodes.num_nodes),
                           str(nodes.node_size), verdict, *sys.argv[1:]]) + "\\n").encode())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RING_ATTENTION_NODE_SIZE",
              "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if k not in extra:
            env.pop(k, None)
    return env


def _launcher(args, script, env):
    return subprocess.Popen([sys.executable, "-m", "jax_ring.launch", "--mps", "off", *args, str(script), "a1"],
                            env=env, cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _two_nodes(tmp_path, nproc, **env_extra):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(WORKER))
    port = _free_port()
    env = _env(**env_extra)
    common = ["--nnodes", "2", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
              "--master-port", str(port)]
    procs = [_launcher(common + ["--node-rank", str(i)], script, env) for i in (1, 0)]  # node 1 first: it waits
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, _, err in outs:
        assert rc == 0, err
    return sorted((line.split()[1:] for _, out, _ in outs for line in out.splitlines() if line.startswith("ENV")),
                  key=lambda row: int(row[0]))


@pytest.mark.parametrize("nproc", [2, 1])
def test_two_launchers_make_one_job(tmp_path, nproc):
    world = 2 * nproc
    rows = _two_nodes(tmp_path, nproc, RING_ATTENTION_NODE_SIZE=str(nproc))
    assert [int(r[0]) for r in rows] == list(range(world))
    for row in rows:
        rank, ws, local, lws, group, node, addr, _, total, n_nodes, node_size, verdict, arg = row
        assert int(ws) == world and int(lws) == nproc and addr == "127.0.0.1" and arg == "a1"
        assert int(rank) == int(node) * nproc + int(local) and group == node and int(node) == int(rank) // nproc
        assert int(total) == world * (world + 1) // 2  # the gloo all_reduce spans both launchers' workers
        # LOCAL_WORLD_SIZE gives the nodes; the override lets two of them share this host
        assert (int(n_nodes), int(node_size), verdict) == (2, nproc, "ok")
    assert len({r[7] for r in rows}) == 1  # one master port


def test_two_nodes_on_one_host_found_from_the_launcher_are_refused(tmp_path):
    """Without the override, the nodes come from LOCAL_WORLD_SIZE and both are on this host: check_hosts says to
    set RING_ATTENTION_NODE_SIZE."""
    rows = _two_nodes(tmp_path, 1)
    assert len(rows) == 2
    for row in rows:
        assert row[11].startswith("refused:") and "RING_ATTENTION_NODE_SIZE" in row[11] and "both_on_host" in row[11]


@pytest.mark.parametrize("args,match", [
    (["--nnodes", "2", "--master-port", "29500"], "--nnodes 2 needs --master-addr"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1"], "--nnodes 2 needs --master-port"),
    (["--nnodes", "2"], "needs --master-addr and --master-port"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "29500"],
     r"--node-rank must be in 0\.\.1"),
    (["--node-rank", "-1"], r"--node-rank must be in 0\.\.0"),
    (["--master-port", "70000"], "--master-port must be in 1..65535"),
    (["--master-addr", " ", "--master-port", "29500"], "--master-addr is empty"),
])
def test_bad_node_flags_fail_before_anything_starts(tmp_path, args, match):
    marker = tmp_path / "started"
    script = tmp_path / "job.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    r = subprocess.run([sys.executable, "-m", "jax_ring.launch", "--nproc-per-node", "1", *args, str(script)],
                       env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and not marker.exists()
    assert re.search(match, r.stderr), r.stderr


def test_rank_env_matches_torchrun():
    from ring_core.runtime.spawn import rank_env

    seen = set()
    for node in range(3):
        for local in range(4):
            e = rank_env(node, 3, 4, local, "h", 1234)
            assert int(e["RANK"]) == node * 4 + local and e["WORLD_SIZE"] == "12" and e["LOCAL_WORLD_SIZE"] == "4"
            assert e["GROUP_RANK"] == e["NODE_RANK"] == str(node) and e["MASTER_PORT"] == "1234"
            seen.add(e["RANK"])
    assert len(seen) == 12
