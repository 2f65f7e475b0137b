"""Detached runs over a real loopback sshd: launch cost, idempotence, exit codes, a run that outlives
its SSH connection, log reattach at the right offset, runs.stop, secret masking in the log."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port, run_inv, write_inventory
from runs_support import code_root, drop_connections, pid_alive, wait_for
from harness import runner, runs
from harness.stagelist import stage_names
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import ModelSpec, load_inventory


@pytest.fixture
def host(sshd, tmp_path):
    """(inventory, connection factory, code root) for the shared loopback host, own workdir."""
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(workdir=str(tmp_path / "wd"))},
                                         secrets=["HF_TOKEN"]))
    conns = []

    def connect():
        c = open_host(inv.hosts["gpu1"], inv)
        conns.append(c)
        return c

    yield inv, connect, code_root(tmp_path)
    for c in conns:
        c.close()


ENV = {"HF_TOKEN": "hf_TopSecretValue123"}


def test_launch_runs_detached_and_records_everything(host, tmp_path):
    inv, connect, code = host
    conn = connect()
    h = runs.launch(conn, inv, "teststage", run_id="t1", extra={"lines": 3, "files": {"a.bin": 1000}},
                    code_root=code, environ=ENV)
    assert h.launched and h.code_uploaded and h.round_trips == 2  # new code: ask, then send it
    st = runs.follow(conn, "t1", base=tmp_path / "runs", on_line=lambda l: None)
    assert st["state"] == "succeeded" and st["exit_code"] == 0
    rd = Path(st["run_dir"])
    assert st["pid"] and st["pid_start"] and len(st["boot_id"]) >= 32 and st["started_at"] and st["ended_at"]
    assert json.loads((rd / "result.json").read_text())["lines"] == 3
    assert (rd / "env").stat().st_mode & 0o777 == 0o600
    sums = (rd / "artifacts" / "SHA256SUMS").read_text()
    import hashlib
    assert sums == hashlib.sha256((rd / "artifacts" / "a.bin").read_bytes()).hexdigest() + "  a.bin\n"
    spec = json.loads((rd / "spec.json").read_text())
    assert spec["stage"] == "teststage" and spec["run_dir"] == str(rd) and spec["pipeline"]["samples"] >= 1
    assert Path(spec["code_dir"]).name == runs.code_bundle(code)[0]

    # the bar: code unchanged -> launch-to-running in at most 2 round trips (here: 1)
    h2 = runs.launch(conn, inv, "teststage", run_id="t2", code_root=code, environ=ENV)
    assert h2.launched and not h2.code_uploaded
    assert h2.round_trips <= 2 and h2.round_trips == 1
    assert h2.status["state"] in ("running", "hashing", "succeeded")


def test_run_id_makes_launch_idempotent(host, tmp_path):
    inv, connect, code = host
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="idem", code_root=code, environ=ENV)
    st = runs.follow(conn, "idem", base=tmp_path / "runs", on_line=lambda l: None)
    assert st["state"] == "succeeded"
    again = runs.launch(conn, inv, "teststage", run_id="idem", code_root=code, environ=ENV)
    assert not again.launched and again.reason == "already succeeded" and again.status["attempt"] == 1
    with pytest.raises(HarnessError, match="different spec"):
        runs.launch(conn, inv, "teststage", run_id="idem", extra={"lines": 9}, code_root=code, environ=ENV)

    runs.launch(conn, inv, "teststage", run_id="bad", extra={"exit": 3}, code_root=code, environ=ENV)
    st = runs.follow(conn, "bad", base=tmp_path / "runs", on_line=lambda l: None)
    assert st["state"] == "failed" and st["attempt"] == 1
    retry = runs.launch(conn, inv, "teststage", run_id="bad", extra={"exit": 3}, code_root=code, environ=ENV)
    assert retry.launched  # a failed run is started again, as attempt 2, its first log kept
    st = runs.follow(conn, "bad", base=tmp_path / "runs", on_line=lambda l: None)
    assert st["attempt"] == 2
    assert (Path(st["run_dir"]) / "attempts" / "1" / "run.log").exists()


def test_failing_stage_exit_code_surfaced(host, tmp_path):
    inv, connect, code = host
    conn = connect()
    with pytest.raises(HarnessError, match=r"run f1 failed.*exit code 7"):
        runner.run_stage(conn, inv, "teststage", run_id="f1", extra={"exit": 7}, code_root=code, environ=ENV)
    st = runs.status(conn, "f1")
    assert st["state"] == "failed" and st["exit_code"] == 7 and st["error"] == "stage teststage exited with code 7"
    # a stage's own one-line reason becomes the run's error, which the pipeline and stage.* show
    with pytest.raises(HarnessError) as refused:
        runner.run_stage(conn, inv, "teststage", run_id="f2", extra={"refuse": "dataset /d/x.jsonl:7: not valid JSON"},
                         code_root=code, environ=ENV)
    assert "stage teststage failed: dataset /d/x.jsonl:7: not valid JSON" in str(refused.value)
    log = runs.read_whole_log(conn, "f2")["log"]
    assert "Traceback" not in log and "@@harness stage teststage failed: dataset /d/x.jsonl:7" in log
    # and through the CLI, as a user sees it
    r = run_inv("runs.status", "f1", "--json", "--inventory", inv.source)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpu1"]["exit_code"] == 7
    r = run_inv("runs.logs", "f1", "--inventory", inv.source)
    assert "failing on purpose with exit code 7" in r.stdout


def test_stage_outlives_its_connection_and_logs_resume_at_offset(host, sshd, tmp_path):
    inv, connect, code = host
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="long", extra={"lines": 40, "delay": 0.1}, code_root=code,
                environ=ENV)
    seen: list[str] = []
    errors: list[Exception] = []

    def watch():
        try:
            runs.follow(conn, "long", base=tmp_path / "runs", on_line=seen.append, reconnect_s=0)
        except HarnessError as e:
            errors.append(e)

    t = threading.Thread(target=watch)
    t.start()
    wait_for(lambda: sum(l.startswith("line ") for l in seen) >= 5)
    assert drop_connections(sshd) >= 1  # the workstation's link is gone, and sshd restarted
    t.join(20)
    assert errors and "link lost" in str(errors[0]) and "runs.logs long --follow" in str(errors[0])
    first = list(seen)
    assert not any("run long succeeded" in l for l in first)  # it was cut mid-run

    # reattach on a new connection: continues exactly where the first follow stopped
    conn2 = connect()
    rest: list[str] = []
    st = runs.follow(conn2, "long", base=tmp_path / "runs", on_line=rest.append)
    assert st["state"] == "succeeded"  # the run went on while nobody was connected
    lines = [l for l in first + rest if l.startswith("line ")]
    assert lines == [f"line {i} of 40" for i in range(1, 41)]  # no gap, no repeat
    full, _, _ = runs.read_log(conn2, "long")
    mirror = (tmp_path / "runs" / "long" / "run.gpu1.log").read_text()
    assert mirror == full


def test_follow_reconnects_by_itself_across_a_dropped_link(host, sshd, tmp_path):
    """With reconnect on (the default a user gets), a dropped link mid-run costs nothing: follow opens a
    new connection and continues from the offset it reached, every line once, to the run's end."""
    inv, connect, code = host
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="relink", extra={"lines": 40, "delay": 0.1}, code_root=code,
                environ=ENV)
    seen: list[str] = []
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(
        runs.follow(conn, "relink", base=tmp_path / "runs", on_line=seen.append, reconnect_s=60)))
    t.start()
    wait_for(lambda: sum(l.startswith("line ") for l in seen) >= 5)
    at_drop = sum(l.startswith("line ") for l in seen)
    assert drop_connections(sshd) >= 1
    t.join(120)
    assert not t.is_alive() and out["state"] == "succeeded", out
    assert at_drop < 40  # the drop came mid-run, and follow saw the rest over a new connection
    assert [l for l in seen if l.startswith("line ")] == [f"line {i} of 40" for i in range(1, 41)]


def test_runs_stop_ends_the_whole_process_group(host, tmp_path):
    inv, connect, code = host
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="stopme", extra={"child": True, "sleep": 120}, code_root=code,
                environ=ENV)
    rd = tmp_path / "wd" / "runs" / "stopme"
    child = int(wait_for(lambda: (rd / "child.pid").exists() and (rd / "child.pid").read_text()))
    stage_pid = runs.status(conn, "stopme")["stage_pid"]
    assert pid_alive(child) and pid_alive(stage_pid)
    r = run_inv("runs.stop", "stopme", "--inventory", inv.source)
    assert r.returncode == 0, r.stderr
    st = wait_for(lambda: (s := runs.status(conn, "stopme"))["state"] in runs.FINAL and s)
    assert st["state"] == "stopped"
    assert not pid_alive(stage_pid) and not pid_alive(child)  # the stage's child went with the group


def test_runs_stop_grace_then_kill_for_a_stage_that_ignores_term(host, tmp_path):
    """``--grace 1``: TERM, and a second later KILL for a stage that did not end; the CLI says so."""
    inv, connect, code = host
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="deaf", extra={"ignore_term": True, "sleep": 120}, code_root=code,
                environ=ENV)
    wait_for(lambda: runs.status(conn, "deaf").get("stage_pid"))
    stage_pid = runs.status(conn, "deaf")["stage_pid"]
    t0 = time.monotonic()
    r = run_inv("runs.stop", "deaf", "--grace", "1", "--inventory", inv.source)
    assert r.returncode == 0, r.stderr
    assert "run deaf stopped (killed after grace)" in r.stdout, r.stdout
    assert time.monotonic() - t0 >= 1 and not pid_alive(stage_pid)


def test_logs_follow_cli_detaches_on_ctrl_c_and_reattaches_across_a_drop(host, sshd, tmp_path):
    """As a user meets it: ``inv runs.logs RUN --follow``, Ctrl-C (the run goes on, the CLI says how to
    come back), then the same command again, which resumes where the first stopped and rides out a
    dropped link by itself; every line once, in order."""
    import signal
    import subprocess
    import sys

    from conftest import REPO

    inv, connect, code = host
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="cli", extra={"lines": 60, "delay": 0.15}, code_root=code,
                environ=ENV)
    env = {**__import__("os").environ, "HARNESS_RUNS_DIR": str(tmp_path / "runs"), "COLUMNS": "200"}
    argv = [sys.executable, "-m", "invoke", "runs.logs", "cli", "--follow", "--inventory", inv.source]
    log = tmp_path / "wd" / "runs" / "cli" / "run.log"
    # Ctrl-C reaches the CLI as at a terminal even where this suite was started in the background
    # (a shell's '&' or nohup leaves SIGINT ignored, and a child inherits that: the CLI would never see it)
    first = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(iter(first.stdout.readline, "")))
    reader.start()
    wait_for(lambda: sum("line " in l for l in printed) >= 3)  # the CLI is following
    first.send_signal(signal.SIGINT)
    first.wait(timeout=60)
    reader.join(10)
    err1 = first.stderr.read()
    out1 = "".join(printed)
    assert first.returncode == 130, err1
    assert "runs.logs cli --follow" in err1 and "Traceback" not in err1, err1
    assert runs.status(conn, "cli")["state"] == "running"  # Ctrl-C detached; it did not stop the run

    second = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed2: list[str] = []
    reader2 = threading.Thread(target=lambda: printed2.extend(iter(second.stdout.readline, "")))
    reader2.start()
    # the link drops while the CLI follows (not while it is still starting: that is an unreachable host)
    wait_for(lambda: any("line " in l for l in printed2))
    seen = log.read_text().count("line ")
    wait_for(lambda: log.read_text().count("line ") >= seen + 5)
    assert drop_connections(sshd) >= 1
    second.wait(timeout=180)
    reader2.join(10)
    out2, err2 = "".join(printed2), second.stderr.read()
    assert second.returncode == 0, err2
    assert "reattaching to run cli" in err2 and "run cli succeeded" in err2, err2
    lines = re.findall(r"line \d+ of 60", out1 + out2)
    assert lines == [f"line {i} of 60" for i in range(1, 61)]


def test_secret_never_reaches_log_or_output(host, tmp_path):
    inv, connect, code = host
    conn = connect()
    seen: list[str] = []
    runs.launch(conn, inv, "teststage", run_id="sec", extra={"print_env": "HF_TOKEN"}, code_root=code, environ=ENV)
    runs.follow(conn, "sec", base=tmp_path / "runs", on_line=seen.append)
    log = (tmp_path / "wd" / "runs" / "sec" / "run.log").read_text()
    assert "env HF_TOKEN=****" in log  # the stage saw it, the log on the host shows it masked
    assert ENV["HF_TOKEN"] not in log and ENV["HF_TOKEN"] not in "\n".join(seen)
    assert ENV["HF_TOKEN"] in (tmp_path / "wd" / "runs" / "sec" / "env").read_text()  # 0600, host only
    r = run_inv("runs.logs", "sec", "--inventory", inv.source, env=ENV)
    assert "env HF_TOKEN=****" in r.stdout and ENV["HF_TOKEN"] not in r.stdout + r.stderr


def test_list_and_bad_run_id(host, tmp_path):
    inv, connect, code = host
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="l1", code_root=code, environ=ENV)
    runs.follow(conn, "l1", base=tmp_path / "runs", on_line=lambda l: None)
    r = run_inv("runs.list", "--json", "--inventory", inv.source)
    assert r.returncode == 0, r.stderr
    assert [x["run_id"] for x in json.loads(r.stdout)["gpu1"]] == ["l1"]
    r = run_inv("runs.logs", "l1", "--follow", "--inventory", inv.source, env={"HARNESS_RUNS_DIR": str(tmp_path / "cli")})
    assert r.returncode == 0, r.stderr
    assert "line 3 of 3" in r.stdout and "run l1 succeeded" in r.stderr
    r = run_inv("runs.logs", "l1", "--json", "--inventory", inv.source)
    assert json.loads(r.stdout)["gpu1"]["state"] == "succeeded"
    r = run_inv("runs.status", "nope", "--inventory", inv.source)
    assert r.returncode != 0 and "no run nope" in r.stderr and "Traceback" not in r.stderr
    r = run_inv("runs.status", "../etc", "--inventory", inv.source)
    assert r.returncode != 0 and "bad run id" in r.stderr


def test_killed_wrapper_reads_as_lost_and_can_be_relaunched(host, tmp_path):
    import os
    import signal
    inv, connect, code = host
    conn = connect()
    h = runs.launch(conn, inv, "teststage", run_id="k1", extra={"sleep": 60}, code_root=code, environ=ENV)
    st = wait_for(lambda: (s := runs.status(conn, "k1"))["stage_pid"] and s)
    # the launcher that ran says so, and either way the wrapper leads a session of its own (no SIGHUP
    # reaches it when the SSH session that launched it ends)
    assert h.detach in ("setsid", "systemd-run")
    session = int(Path(f"/proc/{st['pid']}/stat").read_text().rsplit(")", 1)[1].split()[3])
    assert session == st["pid"], (session, st["pid"])
    os.kill(st["pid"], signal.SIGKILL)  # as a host crash would: no chance to record anything
    os.killpg(st["stage_pid"], signal.SIGKILL)
    st = wait_for(lambda: (s := runs.status(conn, "k1"))["state"] == "lost" and s)
    assert "wrapper is gone" in st["error"]
    again = runs.launch(conn, inv, "teststage", run_id="k1", extra={"sleep": 60}, code_root=code, environ=ENV)
    assert again.launched and again.status["attempt"] == 2
    runs.stop(conn, "k1", grace=2)


def test_a_reboot_or_a_reused_pid_reads_as_lost(host, tmp_path):
    """A run that claims to be running is believed only while its wrapper is the very process that
    started it: same boot (boot id) and same process (pid and its start time). After a reboot, or
    when the pid now belongs to another process, it reads as lost; the control, a live process whose
    record matches, reads as running."""
    import os

    inv, connect, _ = host
    conn = connect()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    me = os.getpid()  # a live process on the host (loopback): the test itself
    start = Path(f"/proc/{me}/stat").read_text().rsplit(")", 1)[1].split()[19]
    records = {"matching": {"boot_id": boot, "pid_start": start},
               "rebooted": {"boot_id": "0" * 8 + boot[8:], "pid_start": start},
               "reused": {"boot_id": boot, "pid_start": str(int(start) + 1)}}
    for rid, rec in records.items():
        run = tmp_path / "wd" / "runs" / rid
        run.mkdir(parents=True)
        (run / "status.json").write_text(json.dumps({"run_id": rid, "state": "running", "pid": me, **rec}))
    assert runs.status(conn, "matching")["state"] == "running"
    for rid in ("rebooted", "reused"):
        st = runs.status(conn, rid)
        assert st["state"] == "lost" and "wrapper is gone" in st["error"], st


def test_every_stage_module_is_a_task():
    r = run_inv("-l")
    assert r.returncode == 0, r.stderr
    names = stage_names()
    assert names  # remote/stages/ has stages
    for name in names:
        assert f"stage.{name}" in r.stdout
    assert "stage.common" not in r.stdout  # helpers without main() are not stages
    for t in ("runs.list", "runs.status", "runs.logs", "runs.stop", "pull", "env.render", "env.lint"):
        assert t in r.stdout


def test_unknown_run_names_the_command_that_lists_runs(host, tmp_path):
    inv, connect, code = host
    with pytest.raises(HarnessError, match=r"^host gpu1: no run nope on this host \(under .*\); "
                                           r"list the runs with: inv runs.list --hosts gpu1$"):
        runs.status(connect(), "nope")
    assert runs.status(connect(), "nope", missing_ok=True)["state"] == "absent"


def test_path_like_model_path_missing_on_host_is_refused_before_launch(host, tmp_path):
    inv, connect, code = host
    for path in ("/nonexistent/model", "~/nonexistent-model-dir", "./nonexistent"):
        bad = inv.model_copy(update={"model": ModelSpec(path=path)})
        with pytest.raises(HarnessError, match=re.escape(
                f"host gpu1: model.path {path}: no such directory on this host; fix 'model.path' in the inventory")):
            runs.launch(connect(), bad, "teststage", run_id="m1", code_root=code, environ=ENV)
        assert not (tmp_path / "wd").exists()  # nothing written on the host: no run dir, no code
    # a directory that is there, and a hub id, are launched
    for path, rid in ((str(tmp_path), "m2"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "m3")):
        ok = inv.model_copy(update={"model": ModelSpec(path=path)})
        assert runs.launch(connect(), ok, "teststage", run_id=rid, code_root=code, environ=ENV).launched


def _dead(sshd, tmp_path, name):
    """An inventory entry for a host that is down (nothing listens on its port)."""
    return sshd.entry(workdir=str(tmp_path / f"wd-{name}"), port=free_port())


def test_every_failing_host_is_shown_and_fails_the_task(host, sshd, tmp_path):
    inv, connect, code = host
    runs.launch(connect(), inv, "teststage", run_id="l1", code_root=code, environ=ENV)
    runs.follow(connect(), "l1", base=tmp_path / "runs", on_line=lambda l: None)
    entries = {"gpu1": sshd.entry(workdir=str(tmp_path / "wd")), "dead1": _dead(sshd, tmp_path, "dead1"),
               "dead2": _dead(sshd, tmp_path, "dead2")}
    two = str(write_inventory(tmp_path / "mixed.yaml", entries, secrets=["HF_TOKEN"]))

    # one host up, one down: the good host is listed, the dead one shown, and the task fails
    r = run_inv("runs.list", "--hosts", "gpu1,dead1", "--inventory", two)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "l1" in r.stdout and "succeeded" in r.stdout
    assert "error: host dead1" in r.stderr and "Traceback" not in r.stderr
    r = run_inv("runs.list", "--json", "--hosts", "gpu1,dead1", "--inventory", two)
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert [x["run_id"] for x in data["gpu1"]] == ["l1"] and data["dead1"]["kind"] == "unreachable"
    msg = data["dead1"]["error"]
    assert len(msg) > 40
    # the message stays on one line even though it is wider than the console (COLUMNS; off a terminal
    # rich would otherwise wrap at 80)
    r = run_inv("runs.status", "l1", "--hosts", "gpu1,dead1", "--inventory", two, env={"COLUMNS": "40"})
    assert r.returncode == 1
    assert "gpu1 run l1 (stage teststage, attempt 1): succeeded" in r.stdout
    assert f"dead1: {msg}" in r.stdout.splitlines()

    # every host down: every host's message, not only the first
    r = run_inv("runs.status", "l1", "--hosts", "dead1,dead2", "--inventory", two)
    assert r.returncode == 1
    assert "error: host dead1" in r.stderr and "error: host dead2" in r.stderr
    r = run_inv("runs.logs", "l1", "--hosts", "gpu1,dead2", "--inventory", two, env=ENV)
    assert r.returncode == 1 and "line 3 of 3" in r.stdout and "error: host dead2" in r.stderr
    r = run_inv("runs.stop", "l1", "--hosts", "gpu1,dead1", "--inventory", two)
    assert r.returncode == 1 and "gpu1: run l1 succeeded" in r.stdout and "dead1: host dead1" in r.stdout


def test_stage_task_prints_each_failing_host(host, sshd, tmp_path):
    """inv stage.X on two hosts where both fail differently: each host's own line, printed once, exit 1."""
    entries = {"gpu1": sshd.entry(workdir=str(tmp_path / "wd")), "dead1": _dead(sshd, tmp_path, "dead1")}
    path = str(write_inventory(tmp_path / "mixed.yaml", entries, model={"path": "/nonexistent/model"}))
    stage = stage_names()[0]
    r = run_inv(f"stage.{stage}", "--no-follow", "--inventory", path)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    gpu1 = [l for l in lines if "model.path /nonexistent/model: no such directory on this host" in l]
    dead1 = [l for l in lines if "host dead1" in l]
    assert len(gpu1) == 1 and gpu1[0].startswith("error: host gpu1: "), r.stderr
    assert len(dead1) == 1 and dead1[0].startswith("error: host dead1"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "wd" / "runs").exists()
