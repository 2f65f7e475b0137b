"""A deploy, run on the host as a detached job: the trained draft served by the production vLLM, checked
live, and kept -- or rolled back by itself.

``inv deploy RUN`` launches this through the same run path as a stage (``runtime.runstage``; its
status, log and follow, so a dropped link changes nothing: the job finishes on the host). In order:

1. take the host lock (the one GPU stages hold: no deploy while a stage has the service down);
2. check what can be checked before the server is touched: the train run's ``checkpoint/`` against
   that run's SHA256SUMS, its config.json an EAGLE-3 draft, held-out prompts to measure with (the
   pipeline's prepare run, found through the runs' inputs; else the shipped prompt set's tail);
3. install the checkpoint under ``<workdir>/deploys/<deploy-id>/checkpoint`` (a copy, verified, renamed
   into place), record the deploy (``deploy.json``: what, when, what it replaced) as ``switching``;
4. point the server at it (``service/draft.json``, ``draft.env``) and restart it; wait for health;
5. send held-out prompts through it and read vLLM's own spec-decode counters: the acceptance length;
6. unhealthy, or below ``min_acceptance``: point the server back at what it ran before, restart it,
   record ``rolled back`` with the reason, and fail in one line. Else record ``deployed``.

``action: rollback`` (``inv deploy --rollback``) points the server at what the current deploy replaced
and restarts it. Every outcome is appended to ``deploys/history.jsonl``.
"""
import fcntl
import hashlib
import json
import os
import shutil
import signal
import time
from contextlib import contextmanager

from runtime.service import Service, ServiceError, read_json, restart, write_text

SETTINGS = {                 # inventory ``deploy:`` (and inv deploy's options) over these defaults
    "k": 3,                  # draft tokens per step (vLLM's num_speculative_tokens)
    "min_acceptance": 1.5,   # the live acceptance length below which the deploy rolls itself back
    "prompts": 16,           # held-out prompts sent through the server to measure it
    "max_tokens": 64,        # new tokens per prompt
    "concurrency": 4,        # requests in flight while measuring
}


class DeployFailed(Exception):
    pass


def say(message):
    print("@@harness deploy: %s" % message, flush=True)


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json(path, data):
    write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


@contextmanager
def host_lock(workdir, owner):
    """The host lock GPU stages take (their wrapper's ``flock`` on ``gpu.lock``): refused while held."""
    path = os.path.join(workdir, "gpu.lock")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (open(path + ".owner").read().strip() if os.path.exists(path + ".owner") else "") or "unknown"
            raise DeployFailed("the host lock is held by run %s (a stage has the service down); wait for it "
                               "to finish or stop it (inv runs.stop %s), then deploy again" % (holder, holder))
        with open(path + ".owner", "w") as f:
            f.write(owner + "\n")
        try:
            yield
        finally:
            try:
                os.remove(path + ".owner")
            except OSError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------
# what is checked before the server is touched

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checked_checkpoint(train_artifacts, run_id):
    """The train run's checkpoint files -> sha256, each checked against the run's SHA256SUMS."""
    ckpt = os.path.join(train_artifacts, "checkpoint")
    config = read_json(os.path.join(ckpt, "config.json"))
    if not os.path.isdir(ckpt) or config is None:
        raise DeployFailed("run %s has no checkpoint/config.json in its artifacts: deploy a train run "
                           "(inv runs.list shows them)" % run_id)
    kind = config.get("speculators_model_type") or ""
    if "eagle3" not in kind and "eagle3" not in json.dumps(config.get("architectures") or []).lower():
        raise DeployFailed("run %s: checkpoint/config.json is not an EAGLE-3 draft (speculators_model_type %r)"
                           % (run_id, kind))
    sums = {}
    try:
        with open(os.path.join(train_artifacts, "SHA256SUMS")) as f:
            for line in f:
                digest, _, name = line.rstrip("\n").partition("  ")
                sums[name] = digest
    except OSError:
        raise DeployFailed("run %s has no artifacts/SHA256SUMS: its run did not finish; run train again" % run_id)
    files = {}
    for name in sorted(os.listdir(ckpt)):
        rel = "checkpoint/" + name
        if not os.path.isfile(os.path.join(ckpt, name)):
            continue
        if rel not in sums:
            raise DeployFailed("run %s: %s is not in the run's SHA256SUMS (changed after the run?)" % (run_id, rel))
        digest = sha256(os.path.join(ckpt, name))
        if digest != sums[rel]:
            raise DeployFailed("run %s: %s does not match the run's SHA256SUMS (sha256 %s, recorded %s); "
                               "run train again" % (run_id, rel, digest, sums[rel]))
        files[name] = digest
    missing = sorted(n for n in sums if n.startswith("checkpoint/") and n[len("checkpoint/"):] not in files)
    if missing:
        raise DeployFailed("run %s: %s is in the run's SHA256SUMS but not in its checkpoint/ (deleted after the "
                           "run?); run train again" % (run_id, missing[0]))
    if not any(n.endswith(".safetensors") for n in files):
        raise DeployFailed("run %s: checkpoint/ holds no *.safetensors weights" % run_id)
    return ckpt, files


def heldout_prompts(workdir, train_run, code_dir, n):
    """Up to ``n`` held-out conversations of the pipeline that trained the draft: prepare's
    heldout.jsonl, found by walking the runs' recorded inputs; else the shipped prompt set's tail."""
    runs = os.path.join(workdir, "runs")
    todo, seen = [train_run], set()
    while todo:
        rid = todo.pop(0)
        if rid in seen:
            continue
        seen.add(rid)
        path = os.path.join(runs, rid, "artifacts", "heldout.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                prompts = [json.loads(line)["messages"] for line in f if line.strip()]
            if prompts:
                return prompts[:n], "held-out prompts of run %s" % rid
        spec = read_json(os.path.join(runs, rid, "spec.json"), {})
        todo.extend((spec.get("input_runs") or {}).values())
    with open(os.path.join(code_dir, "stages", "data", "prompts.jsonl")) as f:
        prompts = [json.loads(line)["messages"] for line in f if line.strip()]
    return prompts[-n:], "the shipped prompt set's last %d" % n


class Terminated(Exception):
    """TERM (inv runs.stop) while the new draft was being switched in or measured."""


def _term_as_error(signum, frame):
    raise Terminated("stopped (SIGTERM) while switching to the new draft")


def install(ckpt, files, dest):
    """Copy the checkpoint to ``dest`` (a temp dir, each file verified, then renamed into place)."""
    if os.path.isdir(dest):
        return dest
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        for name, digest in files.items():
            shutil.copyfile(os.path.join(ckpt, name), os.path.join(tmp, name))
            if sha256(os.path.join(tmp, name)) != digest:
                raise DeployFailed("the copy of checkpoint/%s under %s differs from the run's; check the disk"
                                   % (name, tmp))
        os.replace(tmp, dest)
    except OSError as e:  # a full disk: nothing half-copied stays behind, and the service was not touched
        shutil.rmtree(tmp, ignore_errors=True)
        raise DeployFailed("installing the checkpoint under %s failed: %s" % (os.path.dirname(dest), e))
    except DeployFailed:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# ---------------------------------------------------------------------------------------------------
# the switch, the check, the way back

def history(workdir, entry):
    d = os.path.join(workdir, "deploys")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "history.jsonl"), "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def measured(service, prompts, cfg):
    """The live acceptance over ``prompts`` by vLLM's own counters."""
    from stages.lib import specdecode

    m = specdecode.measure(service.url, prompts, cfg["max_tokens"], cfg["concurrency"],
                           on_done=lambda d, t: print("@@progress " + json.dumps({"done": d, "total": t,
                                                                                   "unit": "prompts"}), flush=True))
    if not m["drafts"]:
        raise DeployFailed("the server proposed no draft tokens for %d prompts: it does not run the draft "
                           "(see the server log)" % len(prompts))
    return m


def switch_back(service, code_dir, previous, was_running, why):
    """Put back what the server ran before and restart it (or leave it stopped, as it was)."""
    say("rolling back: %s" % why)
    service.set_draft(previous)
    if was_running is False:
        service.stop()
        return True, "stopped again, as it was before the deploy"
    ok, how = restart(service, code_dir)
    return ok, ("healthy again with %s" % ("draft " + previous["checkpoint"] if previous else "no draft")
                if ok else how)


def deploy(spec, cfg, service):
    workdir, did, code_dir = spec["workdir"], spec["run_id"], spec["code_dir"]
    train_run = (spec.get("input_runs") or {}).get("train")
    ckpt, files = checked_checkpoint(spec["inputs"]["train"], train_run)
    prompts, source = heldout_prompts(workdir, train_run, code_dir, cfg["prompts"])
    if not service.url:
        raise DeployFailed("the service has no url to measure it through: set hosts.<host>.service.url")
    say("checkpoint of run %s verified (%d files); measuring with %d %s" % (train_run, len(files), len(prompts), source))
    ddir = os.path.join(workdir, "deploys", did)
    os.makedirs(ddir, exist_ok=True)
    installed = install(ckpt, files, os.path.join(ddir, "checkpoint"))
    previous, was_running = service.draft(), service.running()
    draft = {"deploy_id": did, "run_id": train_run, "checkpoint": installed, "k": int(cfg["k"]),
             "files": files, "installed_at": now()}
    record = {"deploy_id": did, "action": "deploy", "run_id": train_run, "checkpoint": installed, "k": int(cfg["k"]),
              "min_acceptance": cfg["min_acceptance"], "started_at": now(), "replaced": previous,
              "was_running": was_running, "state": "switching"}
    write_json(os.path.join(ddir, "deploy.json"), record)
    service.set_draft(draft)
    measurement = None
    # from here on the host serves (or is switching to) the new draft: whatever fails, the previous server
    # is put back (a stop command that fails, a reply that does not parse, a TERM from inv runs.stop)
    previous_term = signal.signal(signal.SIGTERM, _term_as_error)
    try:
        ok, why = restart(service, code_dir)
        if ok:
            measurement = measured(service, prompts, cfg)
    except DeployFailed as e:
        ok, why = False, str(e)
    except OSError as e:
        ok, why = False, "measuring through %s failed: %s" % (service.url, e)
    except Exception as e:  # noqa: BLE001 - any failure after the switch must end in the rollback below
        ok, why = False, "%s: %s" % (type(e).__name__, e)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if ok and measurement["acceptance_length"] < cfg["min_acceptance"]:
        ok, why = False, ("live acceptance length %.3f is below deploy.min_acceptance %.2f"
                          % (measurement["acceptance_length"], cfg["min_acceptance"]))
    if ok:
        say("live acceptance length %.3f (rate %.3f, %s tokens/s) >= %.2f: kept"
            % (measurement["acceptance_length"], measurement["acceptance_rate"], measurement.get("tokens_per_s"),
               cfg["min_acceptance"]))
        record.update(state="deployed", ended_at=now(), measurement=measurement)
        write_json(os.path.join(ddir, "deploy.json"), record)
        history(workdir, {k: record[k] for k in ("deploy_id", "action", "run_id", "state", "started_at", "ended_at")}
                | {"acceptance_length": measurement["acceptance_length"]})
        return {"deploy_id": did, "state": "deployed", "run_id": train_run, "checkpoint": installed,
                "k": int(cfg["k"]), "measurement": measurement, "replaced": previous}
    back_ok, back = switch_back(service, code_dir, previous, was_running, why)
    record.update(state="rolled back", ended_at=now(), reason=why, measurement=measurement,
                  rollback_healthy=back_ok, rollback=back)
    write_json(os.path.join(ddir, "deploy.json"), record)
    history(workdir, {k: record[k] for k in ("deploy_id", "action", "run_id", "state", "started_at", "ended_at",
                                             "reason")})
    raise DeployFailed("rolled back: %s; the service is %s" % (why, back))


def rollback(spec, service):
    """Point the server at what the current deploy replaced, and restart it."""
    workdir, code_dir = spec["workdir"], spec["code_dir"]
    current = service.draft()
    if not current:
        raise DeployFailed("nothing to roll back: the service runs no deployed draft (inv service.status)")
    record = read_json(os.path.join(workdir, "deploys", current["deploy_id"], "deploy.json"))
    if record is None:
        raise DeployFailed("the record of deploy %s is missing under %s/deploys; point the service at another "
                           "draft with inv deploy RUN" % (current["deploy_id"], workdir))
    previous = record.get("replaced")
    entry = {"deploy_id": spec["run_id"], "action": "rollback", "undid": current["deploy_id"], "started_at": now(),
             "restored": previous}
    service.set_draft(previous)
    ok, why = restart(service, code_dir)
    entry.update(state="rolled back" if ok else "failed", ended_at=now(), reason=None if ok else why)
    history(workdir, entry)
    if not ok:
        raise DeployFailed("rolled back deploy %s, but the service is not healthy: %s" % (current["deploy_id"], why))
    say("deploy %s rolled back; the service runs %s" % (
        current["deploy_id"], "draft " + previous["checkpoint"] if previous else "without a draft"))
    return {"deploy_id": spec["run_id"], "state": "rolled back", "undid": current["deploy_id"], "restored": previous}


def main(spec):
    cfg = {**SETTINGS, **{k: v for k, v in (spec.get("deploy") or {}).items() if v is not None}}
    try:
        service = Service(spec["workdir"])
        with host_lock(spec["workdir"], spec["run_id"]):
            if spec.get("action") == "rollback":
                return rollback(spec, service)
            return deploy(spec, cfg, service)
    except (DeployFailed, ServiceError) as e:
        raise SystemExit("stage deploy: %s" % e)
