"""Shared pieces of the runner, pull and env tests: a code tree with a small test stage, stand-in
service scripts, a stand-in ``nvidia-smi``, and a way to drop every SSH connection to a loopback host.

The test stage is real code run by the real runner on a real sshd host; it stands in for the ML
stages (which need torch and models) with the behaviours the runner must handle: progress, output,
artifacts, a chosen exit code, a long sleep, a child process, ignoring TERM, printing a secret.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from harness import REMOTE_DIR

TEST_STAGE = r'''
"""Test stage: behaviour chosen by the spec's keys (see tests/runs_support.py)."""
import json, os, subprocess, sys, time


def mark(spec, what):
    if spec.get("markers"):
        with open(spec["markers"], "a") as f:
            f.write("%s %.6f\n" % (what, time.time()))


def main(spec):
    mark(spec, "stage-start")
    if spec.get("ignore_term"):  # a stage busy in a C call that TERM does not reach
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    art = os.path.join(spec["run_dir"], "artifacts")
    if spec.get("print_env"):
        print("env %s=%s" % (spec["print_env"], os.environ.get(spec["print_env"])), flush=True)
    if spec.get("child"):
        p = subprocess.Popen(["sleep", "300"])
        with open(os.path.join(spec["run_dir"], "child.pid"), "w") as f:
            f.write(str(p.pid))
    n = int(spec.get("lines", 3))
    for i in range(n):
        print("line %d of %d" % (i + 1, n), flush=True)
        print("@@progress " + json.dumps({"done": i + 1, "total": n, "unit": "samples"}), flush=True)
        time.sleep(float(spec.get("delay", 0.0)))
    for name, size in (spec.get("files") or {}).items():
        path = os.path.join(art, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            left = int(size)
            seed = name.encode()
            while left > 0:
                block = os.urandom(min(left, 1 << 20)) if spec.get("random") else (seed * (1 << 16))[:min(left, 1 << 20)]
                f.write(block)
                left -= len(block)
    if spec.get("sleep"):
        time.sleep(float(spec["sleep"]))
    mark(spec, "stage-end")
    if spec.get("refuse"):  # a user error, as the real stages give one (common.fail)
        raise SystemExit("stage teststage: " + spec["refuse"])
    if spec.get("exit"):
        print("failing on purpose with exit code %d" % spec["exit"], flush=True)
        sys.exit(int(spec["exit"]))
    return {"lines": n, "intermediates": spec.get("intermediates", [])}
'''


def code_root(tmp: Path) -> Path:
    """A remote/ tree for tests: the host core and runtime the bundle carries plus stages/teststage.py."""
    root = tmp / "code"
    (root / "stages").mkdir(parents=True, exist_ok=True)
    (root / "runtime").mkdir(exist_ok=True)
    for name in ("runstage.py", "logmask.py"):
        shutil.copy(REMOTE_DIR / "runtime" / name, root / "runtime" / name)
    shutil.copy(REMOTE_DIR / "hostcore.py", root / "hostcore.py")
    (root / "stages" / "teststage.py").write_text(TEST_STAGE)
    return root


FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# Stand-in for NVIDIA's nvidia-smi on a test host that has no GPU. It is a real executable that
# answers every query the harness makes, in nvidia-smi's own output formats (csv,noheader,nounits),
# from a state file listing the PIDs that hold a GPU (the stand-in vLLM service writes its PID there
# when it starts and removes it when it stops); each holder shows on GPU 0:
#   nvidia-smi --query-compute-apps=pid --format=csv,noheader            -> one PID per line (the guard)
#   nvidia-smi -L                                                        -> one line per GPU
#   nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,driver_version --format=csv,noheader,nounits
#   nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits
# (the probe's two). Anything else is refused, as the real tool refuses an unknown query.
STATE={state}
holders() {{ [ -f "$STATE" ] && while read -r pid; do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"; done < "$STATE"; }}
uuid() {{ echo "GPU-00000000-0000-0000-0000-00000000000$1"; }}
case " $* " in
  *" --query-compute-apps=pid "*)
    holders
    exit 0 ;;
  *" --query-compute-apps=gpu_uuid,pid,process_name,used_memory "*)
    for pid in $(holders); do echo "$(uuid 0), $pid, $(cat /proc/$pid/comm 2>/dev/null || echo '?'), 1024"; done
    exit 0 ;;
  *" --query-gpu=index,uuid,name,memory.used,memory.total,driver_version "*)
    busy=$(holders | wc -l)
    for i in $(seq 0 $(({gpus} - 1))); do
      used=0; [ "$i" = 0 ] && used=$((busy * 1024))
      echo "$i, $(uuid $i), Stand-in GPU, $used, 97887, 580.00"
    done
    exit 0 ;;
  *" -L "*)
    for i in $(seq 0 $(({gpus} - 1))); do echo "GPU $i: Stand-in GPU (UUID: $(uuid $i))"; done
    exit 0 ;;
esac
echo "stand-in nvidia-smi: unsupported arguments: $*" >&2
exit 2
"""


class StandInService:
    """A stand-in production vLLM server: ``start`` runs a real long-lived process that "holds the
    GPU" (its PID goes to the GPU state file the stand-in nvidia-smi reads), ``stop`` ends it,
    ``health`` checks it is alive. Every command appends a timestamped line to ``markers``."""

    def __init__(self, root: Path, gpus: int = 2, stop_frees: bool = True):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.markers = root / "markers"
        self.state = root / "gpu-procs"
        self.pidfile = root / "server.pid"
        self.bin = root / "bin"
        self.bin.mkdir(exist_ok=True)
        smi = self.bin / "nvidia-smi"
        smi.write_text(FAKE_NVIDIA_SMI.format(state=self.state, gpus=gpus))
        smi.chmod(0o755)
        m, s, p = self.markers, self.state, self.pidfile
        self.start_cmd = (f"echo \"service-start $(date +%s.%N)\" >> {m}; "
                          f"nohup sleep 1000 >/dev/null 2>&1 & echo $! > {p}; echo $! > {s}")
        self.stop_cmd = (f"echo \"service-stop $(date +%s.%N)\" >> {m}; "
                         + (f"kill $(cat {p}); rm -f {s}" if stop_frees else "true"))
        # alive and not a zombie (an ended server that nobody reaped yet must not count as healthy)
        self.health_cmd = (f"ps -o stat= -p $(cat {p}) | grep -q '^[^Z]' && "
                           f"echo \"service-healthy $(date +%s.%N)\" >> {m}")

    def spec(self, timeout: int = 20) -> dict:
        return {"stop": self.stop_cmd, "start": self.start_cmd, "health": self.health_cmd, "timeout": timeout}

    def start_now(self) -> None:
        os.system(f"bash -c {self.start_cmd!r}")

    def events(self) -> list[str]:
        return [l.split()[0] for l in self.markers.read_text().splitlines()] if self.markers.exists() else []

    def cleanup(self) -> None:
        if self.pidfile.exists():
            try:
                os.kill(int(self.pidfile.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def drop_connections(sshd_host) -> int:
    """Kill every per-connection sshd process of a loopback host (what a dropped link does to the
    sessions), then restart its listener. Returns how many connections were cut."""
    listener = sshd_host.proc.pid
    victims = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == listener:
                victims.append(int(d.name))
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sshd_host.restart()
    return len(victims)


def wait_for(pred, timeout: float = 30, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout}s")


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
