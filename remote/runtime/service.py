"""The host's production vLLM server: start, stop, health, status, and the draft it serves.

Everything that touches the server runs here, on the host: ``inv service.*`` (through runctl), the run
wrapper's guard (``python -m runtime.service stop|start|health|running WORKDIR`` from the code dir, also
when the workstation is gone) and a deploy (runtime/deploy.py). Two ways of running a server, as the
inventory's ``service`` says (written to ``<workdir>/service/config.json`` by the harness on each call):

* ``vllm`` (managed): the harness runs ``python -m vllm.entrypoints.openai.api_server`` for the
  inventory's model itself, detached in its own session with the host's env file; ``server.pid`` (pid,
  its start time, boot id: a reused pid is not taken for the server) and ``server.log`` beside the
  config. Stop signals the whole process group (the API server and its engine), TERM then KILL.
* commands (``stop``/``start``/``health``/``running``, e.g. systemd): run as given.

The draft the server runs with is ``draft.json`` (what a deploy installed; absent: none): a managed
server gets it as ``--speculative-config``; a command-run one reads ``draft.env`` (``SPECULATIVE_CONFIG``,
empty without a draft; systemd's ``EnvironmentFile=`` syntax), which its start command also finds in
its environment. Stdlib only; the model directory of a GGUF target comes from stages/common.py in the
detached server process, never in an SSH call.
"""
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request

from hostcore import identity, is_alive, read_json, stop_group, write_text

#: arguments a managed server always gets first; the inventory's ``args`` follow
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


# ---------------------------------------------------------------------------------------------------
# files

def state_dir(workdir):
    return os.path.join(os.path.abspath(os.path.expanduser(workdir)), "service")


def write_config(workdir, config, env_text):
    """What the harness sends on each call: the service settings (config.json) and the env file the
    server runs with (``env``, 0600: it may hold secrets)."""
    d = state_dir(workdir)
    os.makedirs(d, exist_ok=True)
    write_text(os.path.join(d, "env"), env_text or "", 0o600)
    write_text(os.path.join(d, "config.json"), json.dumps(config, indent=1, sort_keys=True) + "\n", 0o600)


def speculative_config(draft):
    """vLLM's ``--speculative-config`` for an installed draft (``draftcheck.speculative_config``)."""
    from stages.lib import draftcheck  # noqa: PLC0415 - stdlib only, as this module

    return draftcheck.speculative_config(draft["checkpoint"], draft["k"])


class ServiceError(Exception):
    """Something about the server the user must act on, in one line."""


class Service:
    """The server as ``<workdir>/service/config.json`` describes it."""

    def __init__(self, workdir):
        self.workdir = os.path.abspath(os.path.expanduser(workdir))
        self.dir = state_dir(workdir)
        self.config = read_json(os.path.join(self.dir, "config.json"))
        if not self.config:
            raise ServiceError("no service is configured on this host (%s/config.json); give the host a "
                               "'service' in the inventory" % self.dir)
        self.managed = self.config.get("mode") == "vllm"
        self.url = (self.config.get("url") or "").rstrip("/") or None
        self.pidfile = os.path.join(self.dir, "server.pid")
        self.log = os.path.join(self.dir, "server.log")

    # -- the draft ------------------------------------------------------------------------------
    def draft(self):
        """The draft the server runs with ({deploy_id, run_id, checkpoint, k}), or None."""
        return read_json(os.path.join(self.dir, "draft.json"))

    def set_draft(self, draft):
        """Record the draft the server is to run with (None: none), atomically, in both forms."""
        spec = json.dumps(speculative_config(draft), separators=(",", ":")) if draft else ""
        write_text(os.path.join(self.dir, "draft.env"),
               "# written by eagle-harness deploys: the draft the production server runs with (empty: none)\n"
               "SPECULATIVE_CONFIG=%s\n" % (shlex.quote(spec) if spec else ""))
        path = os.path.join(self.dir, "draft.json")
        if draft:
            write_text(path, json.dumps(draft, indent=1, sort_keys=True) + "\n")
        elif os.path.exists(path):
            os.remove(path)

    # -- the process ------------------------------------------------------------------------------
    def _reap(self):
        child = getattr(self, "_child", None)
        if child is not None and child.poll() is not None:
            self._child = None

    def _pid_record(self):
        rec = read_json(self.pidfile)
        return rec if is_alive(rec) else None

    def running(self):
        """Managed: the server's process is alive. Commands: the ``running`` command says so (None
        when there is none: unknown)."""
        if self.managed:
            self._reap()
            return self._pid_record() is not None
        cmd = (self.config.get("commands") or {}).get("running")
        if not cmd:
            return None
        return self._shell(cmd, 60) == 0

    def _env(self):
        """The environment of a command-run service's commands: this one, plus the draft."""
        d = self.draft()
        return dict(os.environ, SPECULATIVE_CONFIG=json.dumps(speculative_config(d), separators=(",", ":")) if d else "")

    def _shell(self, cmd, timeout):
        with open(self.log, "ab") as out:
            try:
                return subprocess.call(["bash", "-c", cmd], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                       env=self._env(), timeout=timeout)
            except subprocess.TimeoutExpired:
                return 124

    def start(self, code_dir):
        """Start the server unless it runs; returns at once (health is ``wait_healthy``'s)."""
        if self.managed:
            rec = self._pid_record()
            if rec:
                return {"started": False, "pid": rec["pid"], "reason": "already running"}
            self._port_free()
            with open(self.log, "ab") as out:
                out.write(("\n@@service %s starting (draft: %s)\n" % (
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    (self.draft() or {}).get("checkpoint") or "none")).encode())
                out.flush()
                # sourcing the env file in bash (it is shell syntax), then the server process itself
                proc = subprocess.Popen(
                    ["bash", "-c", 'set -a; . "$0"; set +a; exec "$@"', os.path.join(self.dir, "env"),
                     self.config["python"], "-m", "runtime.service", "serve", self.workdir],
                    cwd=code_dir, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                    close_fds=True)
            self._child = proc  # reaped by running()/wait_healthy when it exits under this process
            write_text(self.pidfile, json.dumps(dict(identity(proc.pid), started_ts=time.time(),
                                                       draft=self.draft())) + "\n")
            return {"started": True, "pid": proc.pid}
        cmd = (self.config.get("commands") or {}).get("start")
        if not cmd:
            raise ServiceError("the service has no 'start' command in the inventory")
        # in its own session, in the background: a start command that stays in the foreground (the
        # server itself) must not hold this call; one that returns (systemctl) is waited for, 10 s
        with open(self.log, "ab") as out:
            proc = subprocess.Popen(["bash", "-c", cmd], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    env=self._env(), start_new_session=True, close_fds=True)
        try:
            rc = proc.wait(10)
        except subprocess.TimeoutExpired:
            rc = None
        if rc not in (None, 0):
            raise ServiceError("service.start exited with code %d; see %s" % (rc, self.log))
        return {"started": True, "pid": None}

    def _port_free(self):
        """Refuse to start a server whose port another process listens on: vLLM would load the model
        first and only then fail to bind (minutes, on a big target), and health would answer for the
        other process."""
        import socket  # noqa: PLC0415

        v = self.config.get("vllm") or {}
        host = v.get("host") or "127.0.0.1"
        port = int(v.get("port", 8000))
        with socket.socket() as s:
            s.settimeout(2)
            if s.connect_ex(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)) == 0:
                raise ServiceError("port %d on %s is taken by another process, not this service's server: free it, "
                                   "or give the service another (hosts.<name>.service.vllm.port)" % (port, host))

    def stop(self, grace=60.0):
        """Stop the server; returns whether it was running."""
        if self.managed:
            rec = self._pid_record()
            if rec is None:
                return {"stopped": False, "was_running": False}
            pgid = int(rec["pid"])
            if not stop_group(pgid, grace, 15.0, self._reap)[0]:
                raise ServiceError("the server's process group %d survived SIGKILL" % pgid)
            os.remove(self.pidfile)
            with open(self.log, "ab") as out:  # what the server logs as it is killed is not its last error
                out.write(("\n@@service %s stopped\n" % time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())).encode())
            return {"stopped": True, "was_running": True}
        cmd = (self.config.get("commands") or {}).get("stop")
        if not cmd:
            raise ServiceError("the service has no 'stop' command in the inventory")
        was = self.running()
        rc = self._shell(cmd, int(self.config.get("timeout") or 300))
        if rc != 0:
            raise ServiceError("service.stop exited with code %d; see %s" % (rc, self.log))
        return {"stopped": True, "was_running": was}

    def healthy(self):
        cmd = (self.config.get("commands") or {}).get("health")
        if cmd and not self.managed:
            return self._shell(cmd, 60) == 0
        if not self.url:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, timeout=None, poll=2.0):
        """(True, "") once healthy; (False, why) when the managed server died or ``timeout`` passed."""
        timeout = float(timeout or self.config.get("health_timeout") or 1800)
        deadline = time.time() + timeout
        while True:
            if self.healthy():
                return True, ""
            self._reap()
            if self.managed and self._pid_record() is None:
                return False, "the server exited before it was healthy: %s; see %s" % (self.last_error(), self.log)
            if time.time() >= deadline:
                return False, "not healthy %.0f s after the start; see %s" % (timeout, self.log)
            time.sleep(poll)

    def last_error(self):
        """The last line of the server log that reads as an error (since the last start); None when the
        harness stopped the server since."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log) - (256 << 10)))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return "no log"
        starts = [i for i, ln in enumerate(lines) if ln.startswith("@@service ")]
        if starts and lines[starts[-1]].rstrip().endswith(" stopped"):
            return None  # stopped on purpose: the errors vLLM logs as its engine is killed are not failures
        lines = lines[starts[-1] + 1:] if starts else lines
        errors = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
        return ((errors or [ln.strip() for ln in lines if ln.strip()] or ["no output"])[-1])[-300:]

    def status(self):
        rec = self._pid_record() if self.managed else None
        running = self.running()
        healthy = self.healthy() if running is not False else False
        out = {"mode": "vllm" if self.managed else "commands", "url": self.url, "running": running,
               "healthy": healthy, "pid": rec["pid"] if rec else None,
               "uptime_s": round(time.time() - rec["started_ts"], 1) if rec else None,
               "draft": self.draft(), "serving_draft": (rec or {}).get("draft") if self.managed else None,
               "log": self.log}
        error = self.last_error() if self.managed and not running and os.path.exists(self.log) else None
        if error:
            out["last_error"] = error
        draft = self.draft()
        if draft:  # the deploy that installed it; "switching" with no job left means it was interrupted
            rec = read_json(os.path.join(self.workdir, "deploys", draft.get("deploy_id", "?"), "deploy.json")) or {}
            out["deploy"] = {k: rec.get(k) for k in ("deploy_id", "run_id", "state", "started_at", "ended_at")}
            out["deploy"]["acceptance_length"] = (rec.get("measurement") or {}).get("acceptance_length")
            out["deploy"]["speedup"] = (rec.get("measurement") or {}).get("speedup")
        out["history"] = self.history(5)
        return out

    def history(self, n=None):
        """The deploys and rollbacks on this host, oldest first (``deploys/history.jsonl``)."""
        try:
            with open(os.path.join(self.workdir, "deploys", "history.jsonl")) as f:
                entries = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            entries = []
        return entries[-n:] if n else entries

    def metrics_text(self):
        if not self.url:
            raise ServiceError("the service has no url (hosts.<name>.service.url in the inventory): "
                               "nowhere to read /metrics")
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
                return r.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            raise ServiceError("cannot read %s/metrics: %s; is the server up? (inv service.status)"
                               % (self.url, getattr(e, "reason", e)))


def restart(service, code_dir, timeout=None, say=print):
    """Stop, start, wait for health: (healthy, why)."""
    say("@@harness service: stopping")
    service.stop()
    say("@@harness service: starting (draft: %s)" % ((service.draft() or {}).get("checkpoint") or "none"))
    service.start(code_dir)
    ok, why = service.wait_healthy(timeout)
    say("@@harness service: %s" % ("healthy" if ok else why))
    return ok, why


# ---------------------------------------------------------------------------------------------------
# the managed server process itself

def server_argv(config, model_path, draft, accelerator, native_bf16=True):
    """The managed server's command line. On a host without an accelerator: eager (no torch.compile
    warm-up) unless the inventory's args say otherwise, and, with a draft, on a CPU that only emulates
    bf16, ``--dtype float32`` unless they give a dtype: a step's verify pass runs k + 1 tokens through the
    target, which emulated bf16 makes nearly k + 1 times as costly as one token, float32 not (without a
    draft emulated bf16 is the faster; bench/results.md has the figures)."""
    v = config["vllm"]
    args = list(v.get("args") or [])
    argv = [config["python"], "-m", SERVER_MODULE, "--model", model_path, "--host", v.get("host", "127.0.0.1"),
            "--port", str(v.get("port", 8000))]
    given = {a.split("=", 1)[0] for a in args}
    if not accelerator and not {"--enforce-eager", "--no-enforce-eager"} & given:
        argv.append("--enforce-eager")  # no torch.compile warm-up on a CPU unless asked for
    if draft and not accelerator and not native_bf16 and "--dtype" not in given:
        argv += ["--dtype", "float32"]
    if (config.get("model") or {}).get("trust_remote_code") and "--trust-remote-code" not in args:
        argv.append("--trust-remote-code")
    argv += args
    if draft:
        argv += ["--speculative-config", json.dumps(speculative_config(draft))]
    return argv


def serve(workdir):
    """The detached server process: resolve the model directory (a GGUF is converted once, by
    stages/common.py), then become vLLM's API server (exec: the pid stays the recorded one)."""
    service = Service(workdir)
    model = service.config.get("model") or {}
    from stages import common  # noqa: PLC0415 - the model directory (a GGUF's conversion) needs transformers

    path = common.model_dir({"model": model, "workdir": service.workdir})
    import torch  # noqa: PLC0415

    accelerator = torch.accelerator.current_accelerator() is not None
    argv = server_argv(service.config, path, service.draft(), accelerator, common.cpu_has_native_bf16())
    common.vllm_cpu_env(os.environ, accelerator)  # on two cores both for the model runner (exec keeps it)
    print("@@service exec: %s" % " ".join(shlex.quote(a) for a in argv), flush=True)
    os.execvp(argv[0], argv)  # the inventory's python may be a bare name (python3): PATH finds it


def main(argv):
    """``python -m runtime.service ACTION WORKDIR`` (the wrapper's guard; ``serve``: the server)."""
    if len(argv) != 3 or argv[1] not in ("start", "stop", "health", "running", "serve"):
        print("usage: python -m runtime.service start|stop|health|running|serve WORKDIR", file=sys.stderr)
        return 2
    action, workdir = argv[1], argv[2]
    try:
        if action == "serve":
            serve(workdir)
            return 1
        service = Service(workdir)
        if action == "start":
            service.start(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            return 0
        if action == "stop":
            print(json.dumps(service.stop()))
            return 0
        if action == "health":  # 0 healthy, 1 not yet, 3 the server this harness runs has exited
            if service.healthy():
                return 0
            if service.managed and service.running() is False:
                print("service: the server exited before it was healthy: %s; see %s" % (service.last_error(), service.log),
                      file=sys.stderr)
                return 3
            return 1
        return 0 if service.running() is not False else 1
    except ServiceError as e:
        print("service: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
