"""Detached stage runs on a host: launch, follow with progress, status, list, stop.

Why detached: a stage (vLLM loading a 1T model, extraction, training) runs for hours; tying it to an
SSH session means a dropped link kills it halfway. So a launch is ONE call to ``remote/tools/runctl.py`` on
the host that writes the run spec, the env file and the wrapper and starts the wrapper in its own
session; from then on the workstation only reads (status.json, run.log), and can come and go.

Round trips: a launch whose code is already on the host is one ``run_script`` call; when the remote/
tree changed, the host answers ``need_code`` and the second call carries the tree as a tar.

API (harness/runner.py puts launch, follow, the checks and the pull together as one run path)::

    h = launch(conn, inv, "extract", run_id=None, inputs={"prepare": prep_run_id}, gpu=None)
    st = follow(conn, h.run_id, on_line=print)   # every log line as it comes; returns the final status
    status(conn, run_id), list_runs(conn), read_log(conn, run_id, offset), stop(conn, run_id)

Nothing here prints: lines and progress reach the caller through callbacks (the CLI draws them).
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import secrets as _secrets
import shlex
import tarfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness import BUNDLE_DIRS, BUNDLE_FILES, REMOTE_DIR, TEMPLATES_DIR, hostcore, remote_source
from harness.connection import HostConnection, shell_path
from harness.envfile import Masker, render_env, render_template
from harness.errors import HarnessError, HostUnreachable
from harness.inventory import HostSpec, Inventory

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FINAL = hostcore.FINAL


def local_runs_dir() -> Path:
    """Where the workstation keeps what it knows of runs: log mirrors, follow offsets, pulled artifacts."""
    return Path(os.environ.get("HARNESS_RUNS_DIR", "runs"))


# ---------------------------------------------------------------------------------------------------
# the code that runs on the host

_SKIP_DIRS = {"__pycache__", ".pytest_cache"}


def code_bundle(root: Path | None = None) -> tuple[str, bytes]:
    """(sha256 of the bundle, tar.gz of it): remote/runtime/ and remote/stages/ (``BUNDLE_DIRS``); the
    per-call tools and the pip profiles are not part of it. The hash covers paths, exec bits and
    contents only, so it changes exactly when what runs on the host would."""
    root = Path(root or REMOTE_DIR)
    files = [(name, root / name) for name in BUNDLE_FILES if (root / name).is_file()]
    walks = [os.walk(root / d) for d in BUNDLE_DIRS if (root / d).is_dir()]
    for dirpath, dirnames, filenames in (entry for w in walks for entry in w):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith((".pyc", ".pyo")) or name.startswith("."):
                continue
            p = Path(dirpath) / name
            files.append((p.relative_to(root).as_posix(), p))
    h = hashlib.sha256()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for rel, p in sorted(files):
            data = p.read_bytes()
            execbit = os.access(p, os.X_OK)
            h.update(f"{rel}\0{int(execbit)}\0{len(data)}\0".encode())
            h.update(data)
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o755 if execbit else 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return h.hexdigest(), buf.getvalue()


def new_run_id(stage: str) -> str:
    return f"{stage}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}-{_secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id or ""):
        raise HarnessError(f"bad run id {run_id!r}: use letters, digits, '.', '_' and '-' (at most 128)")
    return run_id


def runctl(conn: HostConnection, action: str, **spec) -> dict:
    """One runctl action on the host, one round trip. ``host`` lets its messages name the
    inventory's host (for the command they suggest); a refusal raises ``RemoteError`` whose
    ``kind`` is runctl's (``refused``, ``no_run``)."""
    spec = {"action": action, "workdir": conn.host.workdir, "host": conn.name, **spec}
    return conn.run_script("runctl", spec)


# ---------------------------------------------------------------------------------------------------
# launch

@dataclass
class Launch:
    host: str
    run_id: str
    launched: bool
    status: dict
    reason: str = ""
    code_uploaded: bool = False
    round_trips: int = 0
    secrets: list[str] = field(default_factory=list, repr=False)
    #: how the wrapper was detached from the SSH session: ``systemd-run`` (the user's manager) or ``setsid``
    detach: str = ""


def service_commands(host: HostSpec, code_dir: str) -> dict[str, str | None]:
    """The shell commands the guard runs for ``host``'s service: the inventory's own, or for a server
    the harness runs (``service.vllm``) runtime/service.py's, from the code dir on the host."""
    svc = host.service
    if svc is None:
        return {}
    if not svc.managed:
        return {"stop": svc.stop, "start": svc.start, "health": svc.health, "running": svc.running}
    return {op: (f"cd {shell_path(code_dir)} && {shell_path(host.python)} -m runtime.service {op} "
                 f"{shell_path(host.workdir.rstrip('/'))}") for op in ("stop", "start", "health", "running")}


def service_payload(host: HostSpec, inv: Inventory | None, env_text: str) -> dict | None:
    """The host's service as runctl writes it to ``<workdir>/service/`` (config.json, and the env file
    the server runs with: the host's rendered ``env_text``), or None when the host has none."""
    svc = host.service
    if svc is None:
        return None
    config = {"mode": "vllm" if svc.managed else "commands", "url": svc.base_url, "python": host.python,
              "model": inv.model.model_dump() if inv and inv.model else None,
              "vllm": svc.vllm.model_dump() if svc.managed else None,
              "commands": None if svc.managed else {k: getattr(svc, k) for k in ("stop", "start", "health", "running")},
              "timeout": svc.timeout, "health_timeout": svc.health_timeout}
    return {"config": config, "env_text": env_text}


def render_wrapper(host: HostSpec, *, run_id: str, stage: str, spec_hash: str, code_sha: str, gpu: bool,
                   secret_names: list[str], poll_interval: float = 2.0, lock_wait: int = 0,
                   templates_dir: Path | None = None) -> str:
    """The wrapper script for one run, from templates/run/wrapper.sh.j2 (paths stay ``$HOME``-relative
    when the workdir is ``~/...``; the attempt number is filled in on the host)."""
    wd = host.workdir.rstrip("/")
    svc = host.service
    commands = service_commands(host, f"{wd}/code/{code_sha}") if svc and gpu else {}
    ctx = {
        "run_id": run_id, "stage": stage, "attempt": "@@ATTEMPT@@", "spec_hash": spec_hash,
        "run_dir": shell_path(f"{wd}/runs/{run_id}"), "code_dir": shell_path(f"{wd}/code/{code_sha}"),
        "python": shell_path(host.python), "lock_path": shell_path(f"{wd}/gpu.lock"),
        "guard": gpu, "host_gpus": host.gpus,
        "service_stop": commands.get("stop") or "", "service_start": commands.get("start") or "",
        "service_health": commands.get("health") or "", "service_running": commands.get("running") or "",
        "service_managed": bool(svc and svc.managed and commands),
        "guard_timeout": svc.timeout if svc else 300, "health_timeout": svc.health_timeout if svc else 1800,
        "poll_interval": poll_interval, "secret_names": secret_names, "lock_wait": lock_wait,
        "states": hostcore.STATES,
    }
    return render_template((templates_dir or TEMPLATES_DIR) / "run", "wrapper.sh.j2", ctx)


def stage_spec(inv: Inventory | None, stage: str, extra: dict | None = None) -> dict:
    """What a stage reads besides its inputs: the inventory's model and pipeline sections."""
    spec = {"stage": stage,
            "model": inv.model.model_dump() if inv and inv.model else None,
            "pipeline": inv.pipeline.model_dump(exclude_none=True) if inv else {}}
    spec.update(extra or {})
    return spec


def launch(conn: HostConnection, inv: Inventory | None, stage: str, *, run_id: str | None = None,
           inputs: dict[str, str] | None = None, extra: dict | None = None, gpu: bool | None = None,
           code_root: Path | None = None, environ: dict | None = None, detach: str = "auto",
           poll_interval: float = 2.0, wait_s: float = 5.0, lock_wait: int = 0) -> Launch:
    """Start ``stage`` on ``conn``'s host, detached; returns at once with the run's first status.

    ``inputs`` maps a stage name to the run id whose artifacts it reads; ``gpu`` (default: the host
    has GPUs) turns on the GPU guard; ``run_id`` makes the launch idempotent (a finished run is not
    run again, a failed or stopped one is). ``lock_wait``: a GPU stage that finds the host lock taken
    waits up to that many seconds on the host (state ``waiting``) instead of being refused -- for a
    pipeline whose previous GPU stage is still restoring the service. ``code_root`` replaces
    remote/ (tests)."""
    host = conn.host
    run_id = check_run_id(run_id or new_run_id(stage))
    gpu = host.gpus > 0 if gpu is None else gpu
    before = conn.round_trips
    inv = inv.for_host(host.name) if inv else None
    envf = render_env(host, inv, environ=environ)
    sspec = stage_spec(inv, stage, extra)
    spec_hash = hashlib.sha256(json.dumps([sspec, inputs or {}], sort_keys=True, default=str).encode()).hexdigest()
    code_sha, tar = code_bundle(code_root)
    wrapper = render_wrapper(host, run_id=run_id, stage=stage, spec_hash=spec_hash, code_sha=code_sha, gpu=gpu,
                             secret_names=sorted(envf.secrets), poll_interval=poll_interval, lock_wait=lock_wait)
    req = {"run_id": run_id, "stage_spec": sspec, "min_free_gb": host.min_free_gb, "inputs": inputs or {}, "spec_hash": spec_hash,
           "code_sha": code_sha, "env_text": envf.text, "wrapper_text": wrapper, "detach": detach, "wait_s": wait_s,
           "service": service_payload(host, inv, envf.text)}
    res = runctl(conn, "launch", **req)
    if res.get("need_code"):
        res = runctl(conn, "launch", **req, code_tar=base64.b64encode(tar).decode())
    st = res.get("status") or {}
    return Launch(host=host.name, run_id=run_id, launched=bool(res.get("launched")), status=st,
                  reason=res.get("reason", ""), code_uploaded=bool(res.get("code_uploaded")),
                  round_trips=conn.round_trips - before, secrets=list(envf.secrets), detach=res.get("detach", ""))


# ---------------------------------------------------------------------------------------------------
# reading and stopping

def status(conn: HostConnection, run_id: str, missing_ok: bool = False) -> dict:
    """The run's status.json (plus ``result`` once it succeeded, ``log_size``, ``run_dir``); a run that
    claims to be active but whose wrapper is gone reads as ``lost``. ``missing_ok``: an unknown run
    gives ``{"state": "absent"}`` instead of an error."""
    try:
        return runctl(conn, "status", run_id=check_run_id(run_id))
    except HarnessError as e:
        if missing_ok and e.kind == "no_run":
            return {"run_id": run_id, "state": "absent"}
        raise


def list_runs(conn: HostConnection) -> list[dict]:
    return runctl(conn, "list")["runs"]


def read_log(conn: HostConnection, run_id: str, offset: int = 0, masker: Masker | None = None) -> tuple[str, int, dict]:
    """The log from byte ``offset`` to its current end: (text, new offset, status)."""
    res = runctl(conn, "logs", run_id=check_run_id(run_id), offset=offset)
    text = res["data"]
    return (masker(text) if masker else text), res["offset"], res["status"]


def read_whole_log(conn: HostConnection, run_id: str, masker: Masker | None = None) -> dict:
    """The run's whole log as it is now: ``{"log", "state", "exit_code"}`` (secrets masked)."""
    offset, chunks = 0, []
    while True:
        text, new, st = read_log(conn, run_id, offset, masker)
        chunks.append(text)
        if new == offset or new >= st.get("log_size", 0):
            return {"log": "".join(chunks), "state": st.get("state"), "exit_code": st.get("exit_code")}
        offset = new


def stop(conn: HostConnection, run_id: str, grace: float = 10.0) -> dict:
    """Stop the run's whole process group (TERM, then KILL after ``grace``); the wrapper survives to
    restore the service. Returns runctl's answer ({stopped, killed, status})."""
    return runctl(conn, "stop", run_id=check_run_id(run_id), grace=grace)


def last_env(conn: HostConnection) -> dict:
    return runctl(conn, "last_env")


# ---------------------------------------------------------------------------------------------------
# following a run

_FOLLOW_BOOT = ("import json,sys,types\n"
                "d=json.loads(sys.stdin.read())\n"
                "core=sys.modules['hostcore']=types.ModuleType('hostcore')\n"
                "exec(compile(d['core'],'remote/hostcore.py','exec'),core.__dict__)\n"
                "g={'__name__':'runctl'}\n"
                "exec(compile(d['src'],'remote/tools/runctl.py','exec'),g)\n"
                "g['follow'](d['spec'])\n")


class FollowState:
    """Where the workstation left off reading a run's log (attempt, byte offset), kept beside the
    log mirror in ``runs/<run-id>/`` so ``runs.logs --follow`` reattaches exactly there."""

    def __init__(self, run_id: str, host: str, base: Path | None = None):
        self.dir = (base or local_runs_dir()) / run_id
        self.path = self.dir / f".follow-{host}.json"
        self.log = self.dir / f"run.{host}.log"
        d = {}
        if self.path.exists():
            try:
                d = json.loads(self.path.read_text())
            except ValueError:
                d = {}
        self.attempt = d.get("attempt")
        self.offset = int(d.get("offset", 0))

    def advance(self, text: str, offset: int, attempt) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if attempt != self.attempt:
            self.log.write_text("")
        with open(self.log, "a") as f:
            f.write(text)
        self.attempt, self.offset = attempt, offset
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"attempt": attempt, "offset": offset}))
        tmp.replace(self.path)

    def reset(self, attempt) -> None:
        self.attempt, self.offset = attempt, 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")


class Detached(KeyboardInterrupt):
    """Ctrl-C while following: the run goes on on the host; the message says how to reattach."""


def follow(conn: HostConnection, run_id: str, *, on_line: Callable[[str], None] | None = None,
           masker: Masker | None = None, base: Path | None = None,
           reconnect_s: float = 60.0, max_s: float = 3600.0) -> dict:
    """Follow a run's log from where this workstation last left off until the run ends; returns the
    final status. Every log line (``@@progress`` ones included) goes to ``on_line``, secrets
    masked. A dropped link is retried for ``reconnect_s`` seconds, then reported (the run goes on;
    follow again to reattach). Ctrl-C raises ``Detached``, which leaves the run running."""
    check_run_id(run_id)
    state = FollowState(run_id, conn.name, base)
    masker = masker or Masker()
    src = {"core": remote_source("hostcore").read_text(), "src": remote_source("runctl").read_text()}
    final: dict = {}
    pending = [""]
    emit = on_line or (lambda line: None)

    def handle(raw: str) -> None:
        try:
            msg = json.loads(raw)
        except ValueError:
            return
        if "reset" in msg:
            state.reset(msg["reset"])
        if "data" in msg:
            text = masker(msg["data"])
            state.advance(text, msg["off"], msg.get("attempt"))
            lines = (pending[0] + text).split("\n")
            pending[0] = lines.pop()
            for line in lines:
                emit(line)
        if "end" in msg:
            final.update(msg["end"])
        if "error" in msg:
            raise HarnessError(f"host {conn.name}: {msg['error']}")

    try:
        _follow_loop(conn, run_id, state, src, final, handle, max_s, reconnect_s)
    except KeyboardInterrupt:
        raise Detached(f"detached from run {run_id} on {conn.name}; it goes on on the host. Reattach with: "
                       f"inv runs.logs {run_id} --follow --hosts {conn.name}   (stop it with: inv runs.stop {run_id})")
    if pending[0]:
        emit(pending[0])
    return final


def _follow_loop(conn, run_id, state, src, final, handle, max_s, reconnect_s) -> None:
    """One streaming ``runctl follow`` per connection; after a dropped link, reconnect and continue
    from the offset reached, for up to ``reconnect_s`` seconds."""
    lost_since = None
    while not final:
        spec = {"action": "follow", "workdir": conn.host.workdir, "host": conn.name, "run_id": run_id,
                "offset": state.offset,
                "attempt": state.attempt, "max_s": max_s}
        cmd = f"{conn.python} -c {shlex.quote(_FOLLOW_BOOT)}"
        try:
            res = conn.exec(cmd, stdin=json.dumps({**src, "spec": spec}).encode(),
                            on_stdout=handle)
            if res.rc == -1 and not final:  # the channel closed without an exit status: link lost
                raise HostUnreachable(f"host {conn.name}: connection lost")
            lost_since = None
            if res.rc != 0 and not final:
                tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
                raise HarnessError(f"host {conn.name}: following run {run_id} failed: {tail}")
        except HostUnreachable:
            now = time.monotonic()
            lost_since = lost_since or now
            if now - lost_since >= reconnect_s:
                raise HarnessError(
                    f"host {conn.name}: link lost while following run {run_id}; the run goes on on the host, "
                    f"reattach with: inv runs.logs {run_id} --follow --hosts {conn.name}")
            time.sleep(min(2.0, max(0.2, reconnect_s / 10)))
            conn.close()
            try:
                conn.open()
            except HostUnreachable:
                pass


def describe_failure(st: dict) -> str:
    bits = [f"run {st.get('run_id')} {st.get('state')}"]
    if st.get("exit_code") not in (None, 0):
        bits.append(f"exit code {st['exit_code']}")
    if st.get("error"):
        bits.append(st["error"])
    return ": ".join(bits[:1]) + (" (" + "; ".join(bits[1:]) + ")" if len(bits) > 1 else "")


def parse_inputs(text: str | None) -> dict[str, str]:
    """``prepare=RUN,vocab=RUN`` (the ``--inputs`` option) -> {stage: run id}."""
    out = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        stage, sep, rid = item.partition("=")
        if not sep or not stage.strip() or not rid.strip():
            raise HarnessError(f"--inputs: {item!r} is not STAGE=RUN_ID")
        out[stage.strip()] = check_run_id(rid.strip())
    return out
