"""Run control on the host: launch, status, list, logs, follow, stop, and the manifest a pull needs.

Sent by the harness with its JSON spec over stdin (``HostConnection.run_script``), one call per
action, so each action is one SSH round trip and everything it changes on the host happens here, in
one process: a dropped link leaves a launch done or not done, never half done.

Layout under the host's workdir (see the design's "Remote state")::

    code/<sha256>/          the remote/ tree, written once (to a temp dir, then renamed)
    runs/<run-id>/          spec.json, env (0600), wrapper.sh, status.json, run.log, service.log,
                            result.json, artifacts/ (+ SHA256SUMS), attempts/<n>/ (earlier attempts)
    gpu.lock                the host lock a GPU stage holds (flock), gpu.lock.owner names the run

Stdlib only. ``main(spec)`` dispatches on ``spec["action"]``.
"""
import base64
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ACTIVE = ("launching", "starting", "waiting", "guarding", "running", "restoring", "hashing")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Refused(Exception):
    """A request the host declines, with a one-line reason (reported as the script's error)."""


# ---------------------------------------------------------------------------------------------------
# paths and status

def workdir(spec):
    return os.path.abspath(os.path.expanduser(spec.get("workdir") or "~/.eagle-harness"))


def run_dir(spec, run_id=None):
    rid = run_id or spec["run_id"]
    if not RUN_ID.match(rid):
        raise Refused("bad run id %r: use letters, digits, '.', '_' and '-'" % rid)
    return os.path.join(workdir(spec), "runs", rid)


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def proc_start(pid):
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open("/proc/%d/stat" % int(pid)) as f:
            stat = f.read()
    except (OSError, ValueError, TypeError):
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive(st):
    if st.get("boot_id") and st["boot_id"] != boot_id():
        return False
    if not st.get("pid"):  # written by launch, the wrapper has not started yet
        return time.time() - float(st.get("launched_ts") or 0) < 30
    return proc_start(st["pid"]) == str(st.get("pid_start"))


def group_alive(pgid):
    try:
        os.killpg(int(pgid), 0)
        return True
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_json(path, data, mode=0o644):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_status(rdir):
    """status.json, with a dead run that still claims to be active reported as ``lost``."""
    st = read_json(os.path.join(rdir, "status.json"))
    if st is None:
        return None
    if st.get("state") in ACTIVE and not alive(st):
        st["error"] = ("the run's wrapper is gone (host rebooted, or the process was killed) while it was %s"
                       % st["state"])
        st["state"] = "lost"
    log = os.path.join(rdir, "run.log")
    st["log_size"] = os.path.getsize(log) if os.path.exists(log) else 0
    st["run_dir"] = rdir
    if st.get("state") == "succeeded":
        st["result"] = read_json(os.path.join(rdir, "result.json"))
    return st


# ---------------------------------------------------------------------------------------------------
# launch

def ensure_code(spec):
    """The code dir for ``code_sha``; unpack the shipped tar when it is missing. None: send the tar."""
    sha = spec["code_sha"]
    if not re.match(r"^[0-9a-f]{64}$", sha):
        raise Refused("bad code hash %r" % sha)
    root = os.path.join(workdir(spec), "code")
    dest = os.path.join(root, sha)
    if os.path.exists(os.path.join(dest, ".complete")):
        return dest, False
    if not spec.get("code_tar"):
        return None, False
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, ".tmp-%s-%d" % (sha[:12], os.getpid()))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(spec["code_tar"])), mode="r:gz") as tar:
        for m in tar.getmembers():
            if m.name.startswith(("/", "..")) or "/../" in m.name or not (m.isfile() or m.isdir()):
                raise Refused("code archive member %r is not a plain relative path" % m.name)
        tar.extractall(tmp)
    open(os.path.join(tmp, ".complete"), "w").close()
    try:
        os.rename(tmp, dest)
    except OSError:  # another launch unpacked the same code first
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(dest, ".complete")):
            raise
    return dest, True


def archive_attempt(rdir, st):
    """Move a finished attempt's status, log and result under attempts/<n>/ (artifacts stay, so a
    stage that resumes, like extract, finds what the failed attempt wrote)."""
    n = int(st.get("attempt") or 1)
    dest = os.path.join(rdir, "attempts", str(n))
    os.makedirs(dest, exist_ok=True)
    for name in ("status.json", "run.log", "service.log", "result.json", "stop-requested", ".stage_rc",
                 "stage.pid"):
        p = os.path.join(rdir, name)
        if os.path.exists(p):
            os.replace(p, os.path.join(dest, name))
    return n + 1


def systemd_user_ok():
    if not shutil.which("systemd-run"):
        return False
    rt = os.environ.get("XDG_RUNTIME_DIR") or "/run/user/%d" % os.getuid()
    return os.path.exists(os.path.join(rt, "systemd", "private")) or os.path.exists(os.path.join(rt, "bus"))


def spawn(rdir, rid, attempt, how):
    """Start wrapper.sh detached from this (SSH) session: ``systemd-run --user`` when the host's user
    manager is reachable (survives logind's KillUserProcesses), else a new session (setsid) with
    stdio on files -- the nohup recipe. Returns the method used."""
    out = open(os.path.join(rdir, "wrapper.out"), "ab")
    if how in ("auto", "systemd") and systemd_user_ok():
        unit = "eagle-harness-%s-%d" % (re.sub(r"[^A-Za-z0-9_-]", "_", rid), attempt)
        rc = subprocess.call(["systemd-run", "--user", "--quiet", "--collect", "--unit", unit,
                              "--working-directory", rdir, "bash", os.path.join(rdir, "wrapper.sh")],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=30)
        if rc == 0:
            return "systemd-run"
        if how == "systemd":
            raise Refused("systemd-run --user failed (exit %d; see wrapper.out in the run directory)" % rc)
    subprocess.Popen(["bash", os.path.join(rdir, "wrapper.sh")], cwd=rdir, stdin=subprocess.DEVNULL,
                     stdout=out, stderr=out, start_new_session=True, close_fds=True)
    return "setsid"


def check_model_path(spec, rdir):
    """Refuse a model.path that names a path on this host (starts with '/', '~' or '.') which is not
    there: the stage would take it for a hub id and fail minutes later, detached, with a confusing
    hub error. A hub id ("org/name") is not checked here. Relative paths resolve like the stage's,
    whose working directory is the run directory."""
    model = (spec.get("stage_spec") or {}).get("model") or {}
    path = model.get("path")
    if not path or model.get("gguf_package") or not str(path).startswith(("/", "~", ".")):
        return
    full = os.path.join(rdir, os.path.expanduser(path))
    if not os.path.exists(full):
        raise Refused("model.path %s: no such directory on this host; fix 'model.path' in the inventory" % path)


def launch(spec):
    rdir = run_dir(spec)
    st = read_status(rdir)
    if st is not None:
        if st["state"] == "succeeded":
            if spec.get("spec_hash") and st.get("spec_hash") != spec["spec_hash"]:
                raise Refused("run %s already succeeded with a different spec; choose a new run id" % spec["run_id"])
            return {"launched": False, "reason": "already succeeded", "status": st}
        if st["state"] in ACTIVE:
            return {"launched": False, "reason": "already %s" % st["state"], "status": st}
    check_model_path(spec, rdir)  # before anything is written on the host
    # inputs: {stage: run id} -> that run's artifacts directory, which must exist
    inputs = {}
    for stage, rid in (spec.get("inputs") or {}).items():
        path = os.path.join(run_dir(spec, rid), "artifacts")
        if not os.path.isdir(path):
            raise Refused("input %s: run %s has no artifacts on this host (%s); run that stage first"
                          % (stage, rid, path))
        inputs[stage] = path
    code_dir, uploaded = ensure_code(spec)
    if code_dir is None:
        return {"launched": False, "need_code": True}
    attempt = archive_attempt(rdir, st) if st is not None else 1
    os.makedirs(os.path.join(rdir, "artifacts"), exist_ok=True)
    stage_spec = dict(spec["stage_spec"])
    stage_spec.update({"run_id": spec["run_id"], "run_dir": rdir, "code_dir": code_dir, "inputs": inputs,
                       "input_runs": spec.get("inputs") or {}, "attempt": attempt, "workdir": workdir(spec)})
    write_json(os.path.join(rdir, "spec.json"), stage_spec)
    fd = os.open(os.path.join(rdir, "env.tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(spec["env_text"])
    os.chmod(os.path.join(rdir, "env.tmp"), 0o600)
    os.replace(os.path.join(rdir, "env.tmp"), os.path.join(rdir, "env"))
    wrapper = spec["wrapper_text"].replace("@@ATTEMPT@@", str(attempt))
    fd = os.open(os.path.join(rdir, "wrapper.sh"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(wrapper)
    write_json(os.path.join(rdir, "status.json"),
               {"run_id": spec["run_id"], "stage": stage_spec.get("stage"), "attempt": attempt,
                "spec_hash": spec.get("spec_hash"), "state": "launching", "launched_ts": time.time(),
                "boot_id": boot_id()})
    how = spawn(rdir, spec["run_id"], attempt, spec.get("detach", "auto"))
    deadline = time.time() + float(spec.get("wait_s", 5))
    while time.time() < deadline:  # until the wrapper has taken the lock (or been refused) and says so
        st = read_json(os.path.join(rdir, "status.json"), {})
        if st.get("state") not in ("launching", "starting"):
            break
        time.sleep(0.01)
    st = read_status(rdir)
    return {"launched": True, "code_uploaded": uploaded, "detach": how, "status": st}


# ---------------------------------------------------------------------------------------------------
# reading runs

def no_run(spec):
    """The message for an unknown run id, with the command that lists the ones there are."""
    where = " --hosts %s" % spec["host"] if spec.get("host") else ""
    return ("no run %s on this host (under %s); list the runs with: inv runs.list%s"
            % (spec["run_id"], os.path.join(workdir(spec), "runs"), where))


def status(spec):
    st = read_status(run_dir(spec))
    if st is None:
        raise Refused(no_run(spec))
    return st


def list_runs(spec):
    root = os.path.join(workdir(spec), "runs")
    out = []
    for rid in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        st = read_status(os.path.join(root, rid))
        if st is not None:
            out.append({k: st.get(k) for k in ("run_id", "stage", "attempt", "state", "started_at", "ended_at",
                                               "started_ts", "ended_ts", "exit_code", "error")})
    return {"runs": out}


def _chunk(rdir, offset, limit, final):
    """Log bytes from ``offset``: whole lines only unless the run is over, so a secret or a progress
    line is never split between two reads."""
    path = os.path.join(rdir, "run.log")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if offset > size:  # the log was replaced (a new attempt): start over
        offset = 0
    if size <= offset:
        return "", offset, size
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(min(limit, size - offset))
    if not final and not data.endswith(b"\n"):
        cut = data.rfind(b"\n")
        if cut < 0 and len(data) < limit:
            return "", offset, size
        if cut >= 0:
            data = data[:cut + 1]
    return data.decode("utf-8", "replace"), offset + len(data), size


def logs(spec):
    rdir = run_dir(spec)
    st = status(spec)
    text, off, size = _chunk(rdir, int(spec.get("offset", 0)), int(spec.get("limit", 8 << 20)), True)
    return {"data": text, "offset": off, "size": size, "status": st}


def follow(spec):
    """Stream the log as JSON lines on stdout until the run ends (or ``max_s``): {"off", "data"} per
    chunk, then {"end": status}. Used over exec (not run_script) so lines arrive while it runs."""
    rdir = run_dir(spec)
    offset = int(spec.get("offset", 0))
    attempt = spec.get("attempt")
    deadline = time.time() + float(spec.get("max_s", 3600))
    out = os.fdopen(os.dup(1), "w")

    def emit(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    st = read_status(rdir)
    if st is None:
        emit({"error": no_run(spec)})
        return
    if attempt is not None and st.get("attempt") != attempt:
        emit({"reset": st.get("attempt")})
        offset = 0
    while True:
        st = read_status(rdir) or st
        final = st["state"] not in ACTIVE
        text, new, _size = _chunk(rdir, offset, 1 << 20, final)
        if new != offset or text:
            emit({"off": new, "data": text, "attempt": st.get("attempt")})
            offset = new
            continue
        if final:
            emit({"end": st})
            return
        if time.time() > deadline:
            emit({"timeout": True, "status": st})
            return
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------
# stop

def stop(spec):
    """Stop a run: TERM to the stage's process group and to the wrapper (which then restores the
    service), KILL to the stage group after ``grace`` seconds. The wrapper itself is never killed:
    it must live to run service.start."""
    rdir = run_dir(spec)
    st = status(spec)
    if st["state"] not in ACTIVE:
        return {"stopped": False, "reason": "run is %s" % st["state"], "status": st}
    open(os.path.join(rdir, "stop-requested"), "w").close()
    pgid = st.get("stage_pid")
    if pgid and group_alive(pgid):
        os.killpg(int(pgid), signal.SIGTERM)
    if st.get("pid") and alive(st):
        try:
            os.kill(int(st["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            pass
    killed = False
    deadline = time.time() + float(spec.get("grace", 10))
    while time.time() < deadline:
        cur = read_json(os.path.join(rdir, "status.json"), {})
        pgid = cur.get("stage_pid") or pgid
        if not (pgid and group_alive(pgid)) and cur.get("state") not in ("launching", "starting", "waiting", "running"):
            break
        time.sleep(0.05)
    else:
        if pgid and group_alive(pgid):
            os.killpg(int(pgid), signal.SIGKILL)
            killed = True
    deadline = time.time() + float(spec.get("wait_s", 5))
    while time.time() < deadline:  # give the wrapper a moment to record the outcome
        cur = read_status(rdir)
        if cur["state"] not in ("running",):
            break
        time.sleep(0.05)
    return {"stopped": True, "killed": killed, "status": read_status(rdir)}


# ---------------------------------------------------------------------------------------------------
# what a pull needs; the env the last run used

def escapes(name):
    """True for an artifact name that would leave the artifacts dir (absolute, or with a '..' part):
    SHA256SUMS is read from the host, and a pull writes each name under the workstation's dest."""
    return name.startswith("/") or ".." in name.split("/")


def manifest(spec):
    rdir = run_dir(spec)
    st = status(spec)
    art = os.path.join(rdir, "artifacts")
    sums_path = os.path.join(art, "SHA256SUMS")
    sums = None
    files = {}
    if os.path.exists(sums_path):
        with open(sums_path) as f:
            sums = f.read()
        for line in sums.splitlines():
            m = re.match(r"^\\?([0-9a-f]{64}) [ *](.+)$", line)
            if m:
                if escapes(m.group(2)):
                    raise Refused("run %s: artifact name %r escapes the artifacts dir; refusing to pull"
                                  % (spec["run_id"], m.group(2)))
                p = os.path.join(art, m.group(2))
                files[m.group(2)] = {"sha256": m.group(1), "size": os.path.getsize(p) if os.path.exists(p) else None}
    return {"run_dir": rdir, "artifacts": art, "status": st, "sums": sums, "files": files,
            "result": read_json(os.path.join(rdir, "result.json")), "has_rsync": bool(shutil.which("rsync"))}


def last_env(spec):
    root = os.path.join(workdir(spec), "runs")
    best = None
    for rid in os.listdir(root) if os.path.isdir(root) else []:
        p = os.path.join(root, rid, "env")
        if os.path.exists(p) and (best is None or os.path.getmtime(p) > best[0]):
            best = (os.path.getmtime(p), rid, p)
    if best is None:
        return {"run_id": None, "text": None, "secrets": []}
    with open(best[2]) as f:
        text = f.read()
    return {"run_id": best[1], "text": text, "secrets": secret_names(os.path.dirname(best[2]))}


def secret_names(rdir):
    """The secret NAMES a run was started with (its wrapper's SECRET_NAMES), so a secret since
    removed from the inventory's ``secrets:`` is still masked when that run's env is shown."""
    try:
        with open(os.path.join(rdir, "wrapper.sh")) as f:
            for line in f:
                if line.startswith("SECRET_NAMES=(") and line.rstrip().endswith(")"):
                    return shlex.split(line.rstrip()[len("SECRET_NAMES=("):-1])
    except (OSError, ValueError):
        pass
    return []


ACTIONS = {"launch": launch, "status": status, "list": list_runs, "logs": logs, "follow": follow,
           "stop": stop, "manifest": manifest, "last_env": last_env}


def main(spec):
    try:
        return ACTIONS[spec["action"]](spec)
    except Refused as e:
        raise SystemExit(str(e))


if __name__ == "__main__":
    _spec = json.load(sys.stdin)
    _out = sys.stdout
    sys.stdout = sys.stderr
    _res = main(_spec)
    if _spec.get("action") != "follow":
        _out.write(json.dumps(_res))
