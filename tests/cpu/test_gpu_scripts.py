"""The GPU scripts' host-side logic, on CPU: tests/gpu/gpu_faults.py and gpu_soak.py (run by tests/gpu/test_gpu.py on
GPUs) and the GPU runner's tools/gpu_session.py."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import gpu_script

ROOT = Path(__file__).resolve().parents[2]



def test_fault_expectations_name_checks_the_script_reports():
    """The names test_faults_on_gpus asks for are names gpu_faults.py reports (a renamed check would otherwise
    fail only on a GPU machine)."""
    import re

    text = (ROOT / "tests" / "gpu" / "gpu_faults.py").read_text()
    patterns = [re.escape(n).replace(r"\{", "{") for n in re.findall(r'check\(f?"([^"]+)"', text)]
    patterns = [re.sub(r"\{[^}]*\}", ".+", p) for p in patterns]
    suite = gpu_script("test_gpu")
    for sections in suite.FAULT_RUNS:
        for shared in (False, True):
            wanted, may_skip = suite.expected_fault_checks(sections, shared)
            for name in wanted:
                reported = any(re.fullmatch(p, name) for p in patterns) or name in gpu_script("gpu_faults").CONCURRENT_CHECKS
                assert reported, name
            assert may_skip <= set(wanted)


def test_soak_plan_is_valid_and_the_same_on_every_rank():
    from ring_core import validate

    gpu_soak = gpu_script("gpu_soak")

    plan = gpu_soak.plan(2026, 40, 4)
    assert plan == gpu_soak.plan(2026, 40, 4) and len(set(plan)) > 10
    # Configurations of one variant share the kernel (Triton's specialisation of batch and seq_local too).
    spec_class = lambda c: (c[0] == 1, c[1] == 1, c[1] % 16 == 0, *c[2:])  # noqa: E731
    assert len({spec_class(c) for c in plan}) <= 4
    for b, s, h, hkv, d, dtype, causal, layout in plan + [gpu_soak.big_case(w) for w in (1, 2, 3, 4, 8)]:
        validate.check_attention_args((b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), dtype, dtype, dtype,
                                      is_causal=causal, scale=None, layout=layout, backend="fused",
                                      backends=("fused",))


# ------------------------------------------------------------ the fault script's host-side logic (CPU)
def test_fault_script_imports_lightly_and_checks_its_arguments():
    code = ("import sys; sys.path.insert(0, 'tests/gpu'); import gpu_faults; "
            "heavy = [m for m in ('jax', 'torch', 'iris', 'jax_ring', 'torch_bridge') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
    gf = gpu_script("gpu_faults")
    for argv, fragment in ((["--sections", "kill,timeout"], "must run alone"),
                           (["--sections", "timeout,hang"], "unknown sections")):
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_faults.py"), *argv], cwd=ROOT,
                           timeout=120, capture_output=True, text=True)
        assert r.returncode == 2 and fragment in r.stderr, r.stderr
    assert set(gf.DEFAULT_SECTIONS.split(",")) | {"kill"} == set(gf.SECTIONS)


def test_fault_script_timeout_message_check():
    import numpy as np

    from ring_core.protocol import control

    gf = gpu_script("gpu_faults")
    for status in ((control.ERR_KV_TIMEOUT, 1, 1, 4), (control.ERR_BARRIER_TIMEOUT, 1, 0, 4)):
        with pytest.raises(control.RingAttentionTimeout) as info:
            control.check_status(np.array(status, np.int32), rank=0, timeout_s=5.0)
        gf.expect_timeout_message(info.value, rank=0, peer=1, timeout_s=5.0)
        # JAX re-raises the callback's exception inside its own error type: the text is what is checked.
        gf.expect_timeout_message(RuntimeError(f"INTERNAL: callback failed: RingAttentionTimeout: {info.value}"),
                                  rank=0, peer=1, timeout_s=5.0)
        with pytest.raises(AssertionError, match=r"lacks \['rank 2'\]"):
            gf.expect_timeout_message(info.value, rank=0, peer=2, timeout_s=5.0)
    with pytest.raises(AssertionError, match="expected RingAttentionTimeout, got ValueError"):
        gf.expect_timeout_message(ValueError("rank 1"), rank=0, peer=1, timeout_s=5.0)


def test_fault_script_report_and_waits(capsys):
    gf = gpu_script("gpu_faults")
    report = gf.Report(rank=0)
    with report.check("passes") as c:
        c.detail = "fine"
    with report.check("fails"):
        raise AssertionError("wrong")
    assert report.results["passes"]["ok"] and not report.results["fails"]["ok"] and not report.ok
    assert "AssertionError: wrong" in report.results["fails"]["detail"]
    printed = capsys.readouterr().out
    assert "FAULT-CHECK rank 0 passes ok" in printed and "FAULT-CHECK rank 0 fails FAILED" in printed
    with pytest.raises(KeyboardInterrupt):  # only Exceptions are recorded and passed over
        with report.check("interrupted"):
            raise KeyboardInterrupt
    gf.wait_until(lambda: True, 0.1, "nothing")
    with pytest.raises(TimeoutError, match=r"the kernel did not complete within 0.2 s \(deadlock\?\)"):
        gf.wait_until(lambda: False, 0.2, "the kernel")


def test_fault_script_watchdog_ends_a_stuck_process():
    code = ("import sys, time; sys.path.insert(0, 'tests/gpu'); import gpu_faults; "
            "gpu_faults.start_watchdog(0.5, rank=3); time.sleep(60)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert r.returncode == 124, r.stderr
    assert "WATCHDOG: rank 3 still running after 0.5 s" in r.stderr, r.stderr
    assert "most recent call first" in r.stderr, r.stderr  # the stacks


# ------------------------------------------------------------ the GPU session runner's host-side logic (CPU)
def test_session_stages_parse_and_fill_their_commands():
    gs = gpu_script("gpu_session")
    assert gs.parse_stage("soak") == ("soak", float(gs.STAGES["soak"][0]))
    assert gs.parse_stage("faults:90") == ("faults", 90.0)
    for bad in ("nope", "soak:x", "soak:0"):
        with pytest.raises(Exception):
            gs.parse_stage(bad)
    (cmd,) = gs.commands("soak", 300, "/o")
    assert cmd[-2:] == ["--out", "/o"] and "290" in cmd and "250" in cmd  # deadline and soak time from the limit
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert all(c[c.index("--nproc-per-node") + 1] == "4" for c in gs.commands("examples", 100, "/o", nproc=4))
    assert all("{" not in arg for name in gs.STAGES for c in gs.commands(name, 100, "/o") for arg in c)
    (masks,) = gs.commands("checks-masks", 540, "/o")  # the masked kernels' checks alone
    assert masks[masks.index("tests/gpu/gpu_checks.py") + 1:] == ["--sections", "masks", "--out", "/o"]
    packed = gs.commands("bench-packed", 420, "/o", nproc=2)  # the packed benchmarks: W ranks, then W=1
    assert [c[c.index("--pass") + 1] for c in packed] == ["fwd", "fwd+bwd"]
    assert all(c[c.index("--nproc-per-node") + 1] == "2" and "/o/masks_packed.csv" in c for c in packed)
    w1 = gs.commands("bench-masks-w1", 540, "/o", nproc=4)
    assert all(c[:3] == ["env", "-u", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for c in w1)  # the whole GPU
    assert all(c[c.index("--nproc-per-node") + 1] == "1" for c in w1)
    assert [c[c.index("--csv") + 1] for c in w1] == ["/o/masks_packed.csv"] * 2 + ["/o/masks_window.csv"]


def test_session_warm_stage_compiles_for_the_stages_after_it(tmp_path, monkeypatch):
    """The warm stage asks ring_core.runtime.build for the later stages' recorded variants (tagged stage@nproc); each
    stage's compiles are tagged so; --collect merges a call's compile log, a tag's records replaced by the new
    run's."""
    gs = gpu_script("gpu_session")
    variants, cmd = gs.commands("warm", 200, "/o", nproc=4, later=["checks-masks", "bench-packed"])
    assert variants[1:] == ["tools/gpu_variants.py", "--nproc", "4", "--stages", "checks-masks,bench-packed",
                            "--out", "/o/" + gs.VARIANTS]
    assert cmd[1:4] == ["-m", "ring_core.runtime.build", "--warm"] and cmd[4:6] == [gs.COMPILES, "/o/" + gs.VARIANTS]
    assert cmd[cmd.index("--tags") + 1] == "checks-masks@4,bench-packed@4" and int(cmd[cmd.index("--jobs") + 1]) >= 1
    seen = tmp_path / "tag"
    monkeypatch.setattr(gs, "commands", lambda name, limit, out, nproc=2, later=(): [
        [sys.executable, "-c", f"import os; open({str(seen)!r}, 'w').write(os.environ['RING_ATTENTION_COMPILE_TAG'])"]])
    with open(tmp_path / "log", "w") as log:
        assert gs.run_stage("checks-masks", 30.0, str(tmp_path), log, nproc=3) == 0
    assert seen.read_text() == "checks-masks@3"

    def rec(tag, w):
        return dict(kernel="m:k", types=["*bf16"], constexprs=dict(W=w), divisible=[], num_warps=4, num_stages=1,
                    capability=90, tag=tag)
    compiles, returned = tmp_path / "compiles.jsonl", tmp_path / "ret"
    returned.mkdir()
    compiles.write_text("".join(json.dumps(r) + "\n" for r in (rec("a@2", 2), rec("b@2", 2), rec("b@2", 3))))
    (returned / gs.COMPILE_LOG).write_text(json.dumps(rec("b@2", 4)) + "\n" + json.dumps(rec("b@2", 4)) + "\n")
    assert gs.merge_compiles(str(returned), compiles=str(compiles)) == 2
    kept = [json.loads(line) for line in compiles.read_text().splitlines()]
    assert sorted((r["tag"], r["constexprs"]["W"]) for r in kept) == [("a@2", 2), ("b@2", 4)]


def test_session_budget_clips_stages_and_keeps_time_for_the_cache():
    gs = gpu_script("gpu_session")
    stages = [("checks", 300.0), ("soak", 200.0), ("kill", 90.0)]
    assert gs.stage_limits(stages, None) == [300.0, 200.0, 90.0]
    assert gs.stage_limits(stages, 1000, reserve=45) == [300.0, 200.0, 90.0]
    assert gs.stage_limits(stages, 400, reserve=45) == [300.0, 55.0, 0]  # the last one is skipped
    assert gs.stage_limits(stages, 348, reserve=45) == [300.0, 0, 0]  # 3 s left: not worth a stage


def test_session_cache_survives_the_round_trip_in_parts(tmp_path):
    """The cache carried in parts (``pack``) is restored on the GPU machine; what a session compiled there (the
    entries it did not restore) comes back in parts that respect the size limit, and ``collect`` adds them to
    the local cache and carries it all. Only what a launch needs travels (no IR)."""
    gs = gpu_script("gpu_session")
    local = tmp_path / "here" / ".cache" / "triton"
    files = {"a/k.cubin": os.urandom(3000), "a/k.json": b"{}", "a/k.ptx": b"ptx", "b/__grp__k.json": os.urandom(5000)}
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    (local / "a" / "k.llir").write_bytes(b"IR left behind")
    carry = tmp_path / "carry"
    assert gs.pack(carry=str(carry), cache=str(local)) >= 1
    remote = tmp_path / "gpu" / ".cache" / "triton"
    assert gs.restore_cache(carry=str(carry), cache=str(remote)) == len(files)
    assert not (remote / "a" / "k.llir").exists()
    restored = gs.cache_entries(str(remote))
    assert restored == {"a", "b"}
    new = {"c/k.cubin": os.urandom(6000), "c/k.json": b"{}"}
    for rel, data in new.items():
        (remote / rel).parent.mkdir(parents=True, exist_ok=True)
        (remote / rel).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    parts = gs.save_cache(str(out), cache=str(remote), part_bytes=2048, skip=restored)
    assert len(parts) >= 3 and all(os.path.getsize(p) <= 2048 for p in parts)
    assert gs.save_cache(str(tmp_path), cache=str(remote), skip=gs.cache_entries(str(remote))) == []
    assert gs.collect(str(out), carry=str(carry), cache=str(local)) >= 1
    again = tmp_path / "next" / ".cache" / "triton"
    assert gs.restore_cache(carry=str(carry), cache=str(again)) == len(files) + len(new)
    for rel, data in {**files, **new}.items():
        assert (again / rel).read_bytes() == data
    assert gs.restore_cache(carry=str(tmp_path / "empty"), cache=str(again)) == 0


def test_session_stage_timeout_stops_the_launchers_children(tmp_path, monkeypatch):
    """A stage past its limit is stopped with every process its launcher started (ranks left running would
    use the GPUs under the next stage)."""
    gs = gpu_script("gpu_session")
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    launcher = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]).wait()"
    monkeypatch.setattr(gs, "commands",
                        lambda name, limit, out, nproc=2, later=(): [[sys.executable, "-c", launcher]])
    with open(tmp_path / "log", "w") as log:
        assert gs.run_stage("soak", 3.0, str(tmp_path), log) == 124
    pid = int(pid_file.read_text())
    for _ in range(50):
        try:  # gone, or a zombie waiting for init to reap it
            if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the stage's child {pid} outlived the stage's time limit")


def test_session_restarts_mps_after_a_stage_that_may_have_faulted_it(tmp_path, monkeypatch):
    """Ranks sharing a GPU: after a stage that failed, was stopped at its limit or killed a rank on purpose, the
    next stage gets a fresh MPS daemon (a client ended with its kernel in flight faults the GPU for later
    clients too); after a stage that passed, the same one. The ptxas shim goes first on PATH for the stages."""
    gs = gpu_script("gpu_session")
    events, seen_env = [], []

    class FakeMps:
        n = 0

        def start(self):
            FakeMps.n += 1
            events.append(f"start{FakeMps.n}")
            return {"CUDA_MPS_PIPE_DIRECTORY": f"/pipe{FakeMps.n}"}

        def stop(self):
            events.append("stop")

    def fake_stage(name, limit, out, log, nproc=2, later=()):
        seen_env.append((name, os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["PATH"].split(os.pathsep)[0]))
        return {"checks": 124, "soak": 0, "kill": 0, "faults": 1}[name]

    monkeypatch.setattr(gs.gpus, "MpsDaemon", FakeMps)
    monkeypatch.setattr(gs.gpus, "visible_gpus", lambda: 1)
    monkeypatch.setattr(gs.gpus, "mps_plan", lambda nproc, n, mode: (True, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}))
    monkeypatch.setattr(gs, "run_stage", fake_stage)
    monkeypatch.setattr(gs, "restore_cache", lambda cache: 0)
    monkeypatch.setattr(gs, "save_cache", lambda out, cache, skip: [])
    monkeypatch.setenv("RING_PTXAS_REAL", "/bin/true")
    for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "RING_PTXAS_LOG", "PATH"):
        monkeypatch.setenv(k, os.environ.get(k, ""))  # restored after the test
    assert gs.main(["--nproc", "4", "--out", str(tmp_path), "checks", "soak", "kill", "faults"]) == 124
    assert [(n, p) for n, p, _ in seen_env] == [("checks", "/pipe1"), ("soak", "/pipe2"), ("kill", "/pipe2"),
                                                ("faults", "/pipe3")]
    assert events == ["start1", "stop", "start2", "stop", "start3", "stop"]  # none after the last stage's failure
    shim_dir = seen_env[0][2]
    assert "ring_ptxas_shim" in shim_dir and not Path(shim_dir).exists()  # installed for the stages, then removed


def test_session_bundle_returns_several_sessions_in_few_files(tmp_path, monkeypatch):
    """A GPU run with several sessions (``--out $OUT/w8``, ``$OUT/w4``, ...) ends with ``--bundle $OUT``: every
    file in one tar cut into parts under the size limit; ``--collect`` unpacks it elsewhere (the remote run's
    folder is read-only), merges each session's compile log and adds each session's new compiles to the cache."""
    gs = gpu_script("gpu_session")
    out = tmp_path / "out"
    rec = dict(kernel="m:k", types=["*bf16"], constexprs=dict(W=8), divisible=[], num_warps=4, num_stages=1,
               capability=90)
    remote = tmp_path / "gpu" / ".cache" / "triton"
    for w, entry in (("w8", "e8"), ("w4", "e4")):
        (out / w).mkdir(parents=True)
        (out / w / "session.log").write_text(f"log of {w}\n" * 500)
        (out / w / gs.COMPILE_LOG).write_text(json.dumps(dict(rec, tag=f"checks@{w[1:]}")) + "\n")
        (remote / entry).mkdir(parents=True)
        (remote / entry / "k.cubin").write_bytes(os.urandom(4000))
        gs.save_cache(str(out / w), cache=str(remote), skip={"e8", "e4"} - {entry})
    (out / "top.csv").write_text("a,b\n")
    assert gs.main(["--bundle", str(out)]) == 0
    left = sorted(p.name for p in out.iterdir())
    assert left and all(n.startswith(gs.BUNDLE_PREFIX) for n in left), left
    out.chmod(0o555)  # as a remote run may leave it
    local, compiles = tmp_path / "here" / ".cache" / "triton", tmp_path / "compiles.jsonl"
    monkeypatch.setattr(gs, "CACHE", str(local))
    monkeypatch.setattr(gs, "CARRY", str(tmp_path / "carry"))
    monkeypatch.setattr(gs, "COMPILES", str(compiles))
    monkeypatch.setattr(gs.merge_compiles, "__defaults__", (str(compiles),))
    monkeypatch.setattr(gs.collect, "__defaults__", (str(tmp_path / "carry"), str(local)))
    try:
        assert gs.main(["--collect", str(out)]) == 0
    finally:
        out.chmod(0o755)
    assert gs.cache_entries(str(local)) == {"e8", "e4"}
    assert sorted(json.loads(x)["tag"] for x in compiles.read_text().splitlines()) == ["checks@4", "checks@8"]
