"""A deploy, run on the host as a detached job: the trained draft served by the production vLLM, checked
live, and kept -- or rolled back by itself.

``inv deploy RUN`` launches this through the same run path as a stage (``runtime.runstage``; its
status, log and follow, so a dropped link changes nothing: the job finishes on the host). In order:

1. take the host lock (the one GPU stages hold: no deploy while a stage has the service down);
2. check what can be checked before the server is touched: the train run's ``checkpoint/`` against
   that run's SHA256SUMS, its config.json an EAGLE-3 draft that the server's vLLM reads as written (the
   draft preflight, stages/lib/draftcheck.py), the prompts to measure with (``traffic``, a
   sample of your own prompts on the host; else the pipeline's held-out prompts, found through the
   runs' inputs, and the shipped out-of-distribution sets, taken from each category in turn);
3. install the checkpoint under ``<workdir>/deploys/<deploy-id>/checkpoint`` (a copy, verified, renamed
   into place), record the deploy (``deploy.json``: what, when, what it replaced);
4. measure the server without a draft (restarted without one first if it runs one, or is down) with
   vLLM's own benchmark client (stages/lib/servebench.py): one request at a time and ``concurrency`` in
   flight, tokens/s, time to first token, inter-token latency;
5. point the server at the draft (``service/draft.json``, ``draft.env``), restart it, wait for health,
   and measure it the same way on the same prompts; vLLM's spec-decode counters over those requests
   give the acceptance length;
6. unhealthy, below ``min_acceptance``, or slower than ``min_speedup`` times the server without the
   draft at either concurrency: point the server back at what it ran before, restart it, record
   ``rolled back`` with the reason and both figures, and fail in one line. Else record ``deployed``.

``action: rollback`` (``inv deploy --rollback``) points the server at what the current deploy replaced
and restarts it. Every outcome is appended to ``deploys/history.jsonl``.
"""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

from hostcore import read_json, sha256_file, write_json
from runtime.service import Service, ServiceError, restart

SETTINGS = {                 # inventory ``deploy:`` (and inv deploy's options) over these defaults
    "k": 3,                  # draft tokens per step (vLLM's num_speculative_tokens)
    "min_acceptance": 1.5,   # the live acceptance length below which the deploy rolls itself back
    "min_speedup": 1.0,      # tokens/s with the draft / without, at 1 and at ``concurrency``, below which it does
    "prompts": 16,           # prompts sent through the server to measure it
    "max_tokens": 64,        # new tokens per prompt
    "concurrency": 4,        # requests in flight, the service's usual load (measured besides one at a time)
    "traffic": None,         # a file of your own prompts on the host to measure with (else the evaluation set)
}


class DeployFailed(Exception):
    pass


def say(message):
    print("@@harness deploy: %s" % message, flush=True)


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


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

def checked_checkpoint(train_artifacts, run_id):
    """The train run's checkpoint files -> sha256, each checked against the run's SHA256SUMS."""
    ckpt = os.path.join(train_artifacts, "checkpoint")
    config = read_json(os.path.join(ckpt, "config.json"))
    if not os.path.isdir(ckpt) or config is None:
        raise DeployFailed("run %s has no checkpoint/config.json in its artifacts: deploy a train run "
                           "(inv runs.list shows them)" % run_id)
    if not config.get("speculators_model_type"):  # whether the server's vLLM serves its type: the preflight's
        raise DeployFailed("run %s: checkpoint/config.json is not a speculators draft (no speculators_model_type)"
                           % run_id)
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
        digest = sha256_file(os.path.join(ckpt, name))
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


def draft_preflight(service, ckpt, code_dir, run_id, k):
    """The draft's config.json against the server's own vLLM (stages/lib/draftcheck.py, run with the
    server's python: its vLLM read as source, not imported), before the server is touched: a field that
    vLLM would ignore or replace by a default refuses the deploy in one line."""
    python = service.config.get("python") or sys.executable
    env = dict(os.environ, PYTHONPATH=code_dir + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([python, "-m", "stages.lib.draftcheck", ckpt, str(int(k))], capture_output=True, text=True, env=env,
                         cwd=code_dir, timeout=120)
    try:
        out = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise DeployFailed("the draft preflight could not run with the server's python %s: %s"
                           % (python, (res.stderr.strip().splitlines() or ["no output"])[-1]))
    if out["problems"]:
        more = " (and %d more)" % (len(out["problems"]) - 1) if len(out["problems"]) > 1 else ""
        raise DeployFailed("run %s's draft would be misread by the server: %s%s; the server was not touched"
                           % (run_id, out["problems"][0], more))
    say("draft preflight: vLLM %s reads every field of the checkpoint's config.json" % out["vllm"])
    return out


def heldout_prompts(workdir, train_run):
    """``(category, messages)`` of the held-out prompts of the pipeline that trained the draft (prepare's
    heldout.jsonl, found by walking the runs' recorded inputs), and the run they came from."""
    from stages.lib import conversations

    runs = os.path.join(workdir, "runs")
    todo, seen = [train_run], set()
    while todo:
        rid = todo.pop(0)
        if rid in seen:
            continue
        seen.add(rid)
        path = os.path.join(runs, rid, "artifacts", "heldout.jsonl")
        if os.path.exists(path):
            prompts = conversations.read_prompts(path)
            if prompts:
                return prompts, rid
        spec = read_json(os.path.join(runs, rid, "spec.json"), {})
        todo.extend((spec.get("input_runs") or {}).values())
    return [], None


def measuring_prompts(spec, cfg, train_run):
    """The prompts to measure the server with, in the order they are taken, and where they come from:
    ``traffic`` (your own prompts) when given; else the pipeline's held-out prompts and the shipped
    out-of-distribution sets (stages/data/eval/), one category after another in turn, so each weighs alike."""
    import itertools

    from stages.lib import conversations

    if cfg.get("traffic"):
        path = os.path.expanduser(cfg["traffic"])
        if not os.path.isfile(path):
            raise DeployFailed("deploy.traffic: %s is not a file on the host; copy your prompt sample there or "
                               "unset deploy.traffic" % path)
        try:
            rows = conversations.load_conversations(path, "train", "deploy")
        except SystemExit as e:
            raise DeployFailed(str(e).replace("stage deploy: ", "deploy.traffic: "))
        prompts = [p for p in map(conversations.first_turn, rows) if p]
        if not prompts:
            raise DeployFailed("deploy.traffic: %s holds no user prompt" % path)
        return prompts, path
    held, rid = heldout_prompts(spec["workdir"], train_run)
    groups = {}
    for name, messages in held:
        groups.setdefault(name, []).append(messages)
    shipped = os.path.join(spec["code_dir"], "stages", "data", "eval")
    for name in sorted(f[:-len(".jsonl")] for f in (os.listdir(shipped) if os.path.isdir(shipped) else [])
                       if f.endswith(".jsonl")):
        with open(os.path.join(shipped, name + ".jsonl")) as f:
            groups.setdefault("ood-" + name, []).extend(
                json.loads(line)["messages"] for line in f if line.strip())
    rounds = itertools.zip_longest(*groups.values())
    prompts = [m for row in rounds for m in row if m is not None]
    return prompts, "prompts from %s" % ", ".join(groups) + (" (held out by run %s)" % rid if rid else "")


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
            if sha256_file(os.path.join(tmp, name)) != digest:
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


def concurrencies(cfg):
    """One request at a time, and the service's usual load."""
    return sorted({1, int(cfg["concurrency"])})


def client(service):
    """(served model name, tokenizer, trust_remote_code) for vLLM's benchmark client."""
    from stages.lib import specdecode

    model = specdecode.served_model(service.url)
    tokenizer = model if os.path.isdir(model) else (service.config.get("model") or {}).get("path") or model
    return model, tokenizer, bool((service.config.get("model") or {}).get("trust_remote_code"))


def servable(service, candidates, cfg):
    """The first ``prompts`` of the candidates that the running server can answer (its max_model_len)."""
    from stages.lib import servebench

    _, tokenizer, trust = client(service)
    prompts = servebench.servable(service.url, tokenizer, candidates, cfg["max_tokens"], trust)[:cfg["prompts"]]
    if not prompts:
        raise DeployFailed("none of the %d prompts fits the server's max_model_len with deploy.max_tokens %d new "
                           "tokens; lower deploy.max_tokens or give deploy.traffic shorter prompts"
                           % (len(candidates), cfg["max_tokens"]))
    return prompts


def speed(service, prompts, cfg, ddir, label):
    """The server's speed on ``prompts`` by vLLM's own benchmark client, per concurrency."""
    from stages.lib import servebench

    model, tokenizer, trust = client(service)
    out = {}
    for c in concurrencies(cfg):
        say("measuring the server %s: %d prompts, %d in flight (vLLM's benchmark client)" % (label, len(prompts), c))
        try:
            out[str(c)] = servebench.run(service.url, model, tokenizer, prompts, cfg["max_tokens"], c,
                                         os.path.join(ddir, "bench"), "%s-c%d" % (label.replace(" ", "-"), c),
                                         trust_remote_code=trust)
        except servebench.BenchFailed as e:
            raise DeployFailed("measuring the server %s: %s" % (label, e))
    return out


def with_draft(service, prompts, cfg, ddir):
    """The server running the draft: its speed, and vLLM's spec-decode counters over those requests."""
    from stages.lib import specdecode

    before = specdecode.read(service.url)
    fast = speed(service, prompts, cfg, ddir, "with the draft")
    live = specdecode.summary(before, specdecode.read(service.url))
    if not live["drafts"]:
        raise DeployFailed("the server proposed no draft tokens for %d prompts: it does not run the draft "
                           "(see the server log)" % len(prompts))
    return fast, live


def speedups(without, fast):
    """tokens/s with the draft / without, per concurrency."""
    return {c: round(fast[c]["tokens_per_s"] / without[c]["tokens_per_s"], 3) for c in fast
            if without.get(c, {}).get("tokens_per_s")}


def verdict(live, without, fast, cfg):
    """Why the draft must go (None: it stays): too few tokens accepted, a server slower with it, or both;
    every gate it misses is said, and the speed in figures whenever it was measured below its floor (the
    first concurrency that falls short), so a draft refused for its acceptance is also seen for its speed."""
    why = []
    if live["acceptance_length"] < cfg["min_acceptance"]:
        why.append("live acceptance length %.3f is below deploy.min_acceptance %.2f" % (
            live["acceptance_length"], cfg["min_acceptance"]))
    for c, ratio in sorted(speedups(without, fast).items(), key=lambda kv: int(kv[0])):
        if ratio < cfg["min_speedup"]:
            why.append("with the draft the server makes %.1f tokens/s against %.1f without it at %s in flight "
                       "(%.2fx, below deploy.min_speedup %.2f%s)" % (
                           fast[c]["tokens_per_s"], without[c]["tokens_per_s"], c, ratio, cfg["min_speedup"],
                           "" if why else "; acceptance length %.3f" % live["acceptance_length"]))
            break
    return "; and ".join(why) or None


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
    if not service.url:
        raise DeployFailed("the service has no url to measure it through: set hosts.<host>.service.url")
    preflight = draft_preflight(service, ckpt, code_dir, train_run, cfg["k"])
    prompts, source = measuring_prompts(spec, cfg, train_run)
    if not prompts:
        raise DeployFailed("no prompts to measure the server with: run %s has no held-out prompts and no eval "
                           "set is shipped; set deploy.traffic to a file of prompts on the host" % train_run)
    say("checkpoint of run %s verified (%d files); measuring with %d %s" % (train_run, len(files),
                                                                            min(len(prompts), cfg["prompts"]), source))
    ddir = os.path.join(workdir, "deploys", did)
    os.makedirs(ddir, exist_ok=True)
    installed = install(ckpt, files, os.path.join(ddir, "checkpoint"))
    previous, was_running = service.draft(), service.running()
    draft = {"deploy_id": did, "run_id": train_run, "checkpoint": installed, "k": int(cfg["k"]),
             "files": files, "installed_at": now()}
    record = {"deploy_id": did, "action": "deploy", "run_id": train_run, "checkpoint": installed, "k": int(cfg["k"]),
              "min_acceptance": cfg["min_acceptance"], "min_speedup": cfg["min_speedup"], "prompts": source,
              "started_at": now(), "draft_preflight": preflight, "replaced": previous, "was_running": was_running, "state": "measuring"}
    write_json(os.path.join(ddir, "deploy.json"), record)
    measurement, without, fast = None, None, None
    # from here on the host may be restarted: whatever fails, the previous server is put back (a stop
    # command that fails, a reply that does not parse, a TERM from inv runs.stop)
    previous_term = signal.signal(signal.SIGTERM, _term_as_error)
    try:
        ok, why = True, None
        if previous or not service.healthy():  # the figure to beat is the server without any draft
            say("restarting the server without a draft to measure it")
            service.set_draft(None)
            ok, why = restart(service, code_dir)
        if ok:
            prompts = servable(service, prompts, cfg)
            without = speed(service, prompts, cfg, ddir, "without a draft")
            record.update(state="switching", without_draft=without)
            write_json(os.path.join(ddir, "deploy.json"), record)
            service.set_draft(draft)
            ok, why = restart(service, code_dir)
        if ok:
            fast, measurement = with_draft(service, prompts, cfg, ddir)
            measurement.update(prompts=len(prompts), speed=fast, without_draft=without,
                               speedup=speedups(without, fast))
    except DeployFailed as e:
        ok, why = False, str(e)
    except OSError as e:
        ok, why = False, "measuring through %s failed: %s" % (service.url, e)
    except Exception as e:  # noqa: BLE001 - any failure after the switch must end in the rollback below
        ok, why = False, "%s: %s" % (type(e).__name__, e)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if ok:
        why = verdict(measurement, without, fast, cfg)
        ok = why is None
    summary = {"acceptance_length": (measurement or {}).get("acceptance_length"),
               "speedup": (measurement or {}).get("speedup")}
    if ok:
        say("live acceptance length %.3f >= %.2f; %s: kept" % (
            measurement["acceptance_length"], cfg["min_acceptance"], ", ".join(
                "%.1f tokens/s with the draft against %.1f without at %s in flight (%.2fx)" % (
                    fast[c]["tokens_per_s"], without[c]["tokens_per_s"], c, r)
                for c, r in measurement["speedup"].items())))
        record.update(state="deployed", ended_at=now(), measurement=measurement)
        write_json(os.path.join(ddir, "deploy.json"), record)
        history(workdir, {k: record[k] for k in ("deploy_id", "action", "run_id", "state", "started_at", "ended_at")}
                | summary)
        return {"deploy_id": did, "state": "deployed", "run_id": train_run, "checkpoint": installed,
                "k": int(cfg["k"]), "measurement": measurement, "replaced": previous, "draft_preflight": preflight}
    back_ok, back = switch_back(service, code_dir, previous, was_running, why)
    record.update(state="rolled back", ended_at=now(), reason=why, measurement=measurement,
                  rollback_healthy=back_ok, rollback=back)
    write_json(os.path.join(ddir, "deploy.json"), record)
    history(workdir, {k: record[k] for k in ("deploy_id", "action", "run_id", "state", "started_at", "ended_at",
                                             "reason")} | summary)
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
