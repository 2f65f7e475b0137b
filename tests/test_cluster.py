"""Several hosts as one job (``inv pipeline --cluster``): two loopback sshd hosts, each its own workdir,
today's stack (the shipped cpu profile, patched), a tiny model.

What a user of a multi-host job relies on, each asserted on what the hosts hold afterwards: the
extraction is split into shards that are disjoint and together the whole dataset, each extracted on
its own host and copied, checked, to the other; training is one torchrun job over both hosts (gloo
on CPU, one process per host, world size 2) whose first host writes a checkpoint that speculators
loads; a rerun copies and runs nothing; and a node lost mid-run ends the job with that node named
while the other is stopped rather than left waiting for it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, run_inv, write_inventory
from job_support import TINY_CURRENT
from loopback import free_port
from models import build_tiny_model

pytestmark = pytest.mark.timeout(2400)

PIPELINE = {**TINY_CURRENT, "epochs": 2}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, sshd_factory, current_python):
    root = tmp_path_factory.mktemp("cluster")
    model = build_tiny_model(root / "model", hidden=128, heads=4)
    sshds = [sshd_factory(f"node{i}") for i in range(2)]
    hosts = {f"node{i}": sshds[i].entry(python=str(current_python), workdir=str(root / f"wd{i}"), profile="cpu",
                                        env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
             for i in range(2)}
    port = free_port()
    inventory = write_inventory(root, hosts, model={"path": str(model)}, pipeline=PIPELINE,
                                clusters={"pair": {"hosts": ["node0", "node1"], "master_port": port}})
    env = {"HARNESS_INVENTORY": str(inventory), "HARNESS_RUNS_DIR": str(root / "runs")}
    return SimpleNamespace(root=root, inventory=inventory, env=env, python=current_python, port=port,
                           wd=[root / "wd0", root / "wd1"], sshds=sshds)


def status(wd: Path, run_id: str) -> dict:
    return json.loads((wd / "runs" / run_id / "status.json").read_text())


def test_two_hosts_extract_shards_and_train_as_one_torchrun_job(pair):
    r = run_inv("pipeline", "--cluster", "pair", "--to", "train", "--json", env=pair.env, timeout=2200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    job = json.loads(r.stdout)
    assert job["hosts"] == ["node0", "node1"]
    assert [(s["stage"], s["host"]) for s in job["stages"]] == [
        ("prepare", "node0"), ("extract", "node0"), ("extract", "node1"), ("vocab", "node0"),
        ("train", "node0"), ("train", "node1")]
    assert all(s["state"] == "ran" and s["run_state"] == "succeeded" for s in job["stages"])
    by = {(s["stage"], s["host"]): s for s in job["stages"]}

    # the shards: each host extracted its own contiguous half, and each now holds both halves
    shards = [by[("extract", f"node{i}")]["run_id"] for i in range(2)]
    assert shards[0] != shards[1]
    held = []
    for i, rid in enumerate(shards):
        meta = json.loads((pair.wd[i] / "runs" / rid / "artifacts/extract.json").read_text())
        assert meta["shard"]["rank"] == i and meta["shard"]["size"] == 2 and meta["dataset_samples"] == PIPELINE["samples"]
        got = sorted(int(p.stem.split("_")[1]) for p in (pair.wd[i] / "runs" / rid / "artifacts/hidden_states").glob("hs_*.safetensors"))
        assert got == list(range(meta["shard"]["first"], meta["shard"]["end"])) and got
        held.append(got)
        other = pair.wd[1 - i] / "runs" / rid
        assert status(pair.wd[1 - i], rid)["copied_from"] == f"node{i}"  # adopted after its checksums matched
        assert (other / "artifacts/SHA256SUMS").read_text() == (pair.wd[i] / "runs" / rid / "artifacts/SHA256SUMS").read_text()
        assert sorted(int(p.stem.split("_")[1]) for p in (other / "artifacts/hidden_states").iterdir()) == got
    assert sorted(held[0] + held[1]) == list(range(PIPELINE["samples"])) and not set(held[0]) & set(held[1])
    prep = by[("prepare", "node0")]["run_id"]
    assert status(pair.wd[1], prep)["copied_from"] == "node0"
    assert {c["run_id"] for c in job["copies"]} == {prep, *shards, by[("vocab", "node0")]["run_id"]}

    # training: one job, the same run id on both hosts, world size 2 over a rendezvous on node0
    rid = by[("train", "node0")]["run_id"]
    assert by[("train", "node1")]["run_id"] == rid
    for i in range(2):
        log = (pair.wd[i] / "runs" / rid / "run.log").read_text()
        assert f"--nnodes=2 --node-rank={i} --master-addr=127.0.0.1 --master-port={pair.port}" in log
        assert "dp_size=2" in log  # speculators' own report of the process group it joined
    assert by[("train", "node1")]["result"]["node_rank"] == 1
    trained = by[("train", "node0")]["result"]
    assert trained["nodes"] == 2 and trained["steps"] > 0 and trained["loss"] > 0
    ckpt = Path(by[("train", "node0")]["pulled"]) / "checkpoint"
    assert not (pair.wd[1] / "runs" / rid / "artifacts/checkpoint").exists()
    check = (f"from speculators.models.eagle3 import Eagle3DraftModel\n"
             f"m = Eagle3DraftModel.from_pretrained({str(ckpt)!r})\n"
             f"print(m.config.eagle_aux_hidden_state_layer_ids, int(m.d2t.shape[0]))")
    proc = subprocess.run([str(pair.python), "-c", check], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == str(PIPELINE["draft_vocab_size"])

    # a rerun: every run id already succeeded where it belongs, every copy already there
    r = run_inv("pipeline", "--cluster", "pair", "--to", "train", "--json", env=pair.env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    again = json.loads(r.stdout)
    assert {s["state"] for s in again["stages"]} == {"skipped"}
    assert all(not c["adopted"] and c["already"] for c in again["copies"])

    # the plan says the same, host by host, with the job's run ids: each host's shard, the copies it holds
    r = run_inv("pipeline", "--plan", "--cluster", "pair", "--json", env=pair.env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plans = json.loads(r.stdout)
    rows = {h: {s["stage"]: (s["run_id"], s["action"]) for s in plans[h]["stages"]} for h in ("node0", "node1")}
    skip = "skip: succeeded before"
    assert rows["node0"] == {"prepare": (prep, skip), "extract": (shards[0], skip),
                             "vocab": (by[("vocab", "node0")]["run_id"], skip), "train": (rid, skip),
                             "evaluate": (rows["node0"]["evaluate"][0], "run")}
    assert rows["node1"] == {"prepare": (prep, skip), "extract": (shards[1], skip),
                             "vocab": (by[("vocab", "node0")]["run_id"], skip), "train": (rid, skip),
                             "evaluate": (None, "runs on node0")}

    # evaluate: the job's checkpoint, on the first host, served there by vLLM
    r = run_inv("pipeline", "--cluster", "pair", "--from", "evaluate", "--json", env=pair.env, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ev = json.loads(r.stdout)["stages"]
    assert [(s["stage"], s["host"], s["state"]) for s in ev] == [("evaluate", "node0", "ran")], ev
    assert ev[0]["run_id"] == rows["node0"]["evaluate"][0]  # the run the plan named
    res = ev[0]["result"]
    assert res["measured_with"] == "vllm" and res["prompts"] > 0 and res["acceptance_length"] >= 1.0, res
    assert json.loads((pair.wd[0] / "runs" / ev[0]["run_id"] / "spec.json").read_text())["input_runs"]["train"] == rid
    assert not (pair.wd[1] / "runs" / ev[0]["run_id"]).exists()


@pytest.mark.parametrize("ending", ["lost", "stopped"])
def test_a_node_lost_mid_run_is_named_and_the_other_stopped(pair, ending):
    """Kill node1's whole run (its wrapper, torchrun and the trainer: what a host crash leaves), or stop
    it with ``inv runs.stop``, while the job trains: the job fails naming node1 as lost (stopped), and
    node0 does not go on waiting for it."""
    epochs = {"lost": 400, "stopped": 401}[ending]  # a longer job, and another run id each time
    inv = pair.inventory.read_text().replace("epochs: 2", f"epochs: {epochs}")
    lost_inv = pair.root / "lost.yaml"
    lost_inv.write_text(inv)
    env = {**pair.env, "HARNESS_INVENTORY": str(lost_inv)}
    earlier = set((pair.wd[1] / "runs").glob("train-*"))  # an earlier case's lost run still reads "running"
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "--search-root", str(REPO), "pipeline", "--cluster",
                             "pair", "--from", "train", "--to", "train"], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900
        victim = None
        while time.monotonic() < deadline and victim is None:
            time.sleep(1)
            for d in set((pair.wd[1] / "runs").glob("train-*")) - earlier:
                log = d / "run.log"
                if ((d / "status.json").exists() and status(pair.wd[1], d.name).get("state") == "running" and log.exists()
                        and "Training epoch" in log.read_text()):
                    victim = d.name
            assert proc.poll() is None, proc.communicate()
        assert victim, "node1 never started training"
        st = status(pair.wd[1], victim)
        if ending == "lost":
            for pid, group in ((st["stage_pid"], True), (st["pid"], False)):
                try:
                    (os.killpg if group else os.kill)(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            stop = run_inv("runs.stop", victim, "--hosts", "node1", env=env, timeout=120)
            assert stop.returncode == 0, stop.stdout + stop.stderr
        killed = time.monotonic()
        out, err = proc.communicate(timeout=600)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    own = [line for line in err.splitlines() if not line.startswith("[")]  # not the hosts' followed logs
    assert len(errors) == 1 and not any("Traceback" in line for line in own), err
    assert f"job {victim}" in errors[0] and "host node1 (node 2 of 2)" in errors[0], errors[0]
    assert f"run {victim} {ending}" in errors[0], errors[0]
    assert "were stopped" in errors[0]
    assert status(pair.wd[0], victim)["state"] in ("failed", "stopped")
    assert ended < 90, ended  # node0 was stopped, not left to time out waiting for its peer
    deadline = time.monotonic() + 30  # and no rank of the job is left running on either host
    while time.monotonic() < deadline and _ranks_of(victim):
        time.sleep(1)
    assert not _ranks_of(victim)


def test_an_unreachable_node_stops_the_job_before_it_starts(pair):
    """node1's sshd down: the job is refused in one line naming node1, and nothing starts on node0."""
    before = set((pair.wd[0] / "runs").iterdir())
    pair.sshds[1].stop()
    try:
        r = run_inv("pipeline", "--cluster", "pair", "--from", "train", "--to", "train", env=pair.env, timeout=300)
    finally:
        pair.sshds[1].start()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "node1" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and set((pair.wd[0] / "runs").iterdir()) == before


def _ranks_of(run_id: str) -> list[int]:
    """The processes whose command line names run ``run_id`` (its torchrun ranks included)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and run_id.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def _fake_run(workdir: Path, run_id: str, files: dict[str, bytes], state: str = "succeeded") -> Path:
    """A run as the runner leaves it: status.json, result.json, artifacts/ and their SHA256SUMS."""
    import hashlib

    run = workdir / "runs" / run_id
    art = run / "artifacts"
    for rel, data in files.items():
        (art / rel).parent.mkdir(parents=True, exist_ok=True)
        (art / rel).write_bytes(data)
    (art / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {rel}\n" for rel, d in files.items()))
    now = time.time()
    (run / "status.json").write_text(json.dumps({"run_id": run_id, "state": state, "exit_code": 0 if state == "succeeded"
                                                 else 1, "started_ts": now - 5, "finished_ts": now}))
    (run / "result.json").write_text(json.dumps({"samples": 3}))
    return run


def test_a_copy_between_hosts_is_checked_on_arrival_and_never_half_made(tmp_path, sshd_hosts, monkeypatch):
    """harness/transfer.py over two real sshd hosts: a run arrives whole, verified, as a succeeded run
    that says where it came from; a file altered on the source after its run wrote it stops the copy
    naming the file, and the destination gets no run; a failed run is not copied."""
    from harness.connection import open_host
    from harness.errors import HarnessError
    from harness.inventory import load_inventory
    from harness.transfer import copy_run

    a, b = sshd_hosts(2)
    wd = [tmp_path / "a", tmp_path / "b"]
    inv = load_inventory(write_inventory(tmp_path, {"a": a.entry(workdir=str(wd[0])), "b": b.entry(workdir=str(wd[1]))}))
    monkeypatch.setenv("HARNESS_RUNS_DIR", str(tmp_path / "relay"))
    _fake_run(wd[0], "extract-good", {"extract.json": b"{}", "hidden_states/hs_0.safetensors": os.urandom(3 << 20)})
    _fake_run(wd[0], "extract-bad", {"extract.json": b"{}", "hidden_states/hs_1.safetensors": os.urandom(1 << 20)})
    (wd[0] / "runs/extract-bad/artifacts/hidden_states/hs_1.safetensors").write_bytes(os.urandom(1 << 20))
    _fake_run(wd[0], "extract-failed", {"extract.json": b"{}"}, state="failed")
    with open_host(inv.hosts["a"], inv) as src, open_host(inv.hosts["b"], inv) as dst:
        got = copy_run(src, [dst], "extract-good")
        assert got.adopted == ["b"] and got.files == 2 and got.bytes > 3 << 20
        here = wd[1] / "runs/extract-good"
        assert json.loads((here / "status.json").read_text())["copied_from"] == "a"
        assert (here / "artifacts/hidden_states/hs_0.safetensors").read_bytes() == \
            (wd[0] / "runs/extract-good/artifacts/hidden_states/hs_0.safetensors").read_bytes()
        assert json.loads((here / "result.json").read_text()) == {"samples": 3}
        assert copy_run(src, [dst], "extract-good").already == ["b"]  # nothing copied twice

        with pytest.raises(HarnessError, match=r"hidden_states/hs_1.safetensors does not match SHA256SUMS"):
            copy_run(src, [dst], "extract-bad")
        assert not (wd[1] / "runs/extract-bad").exists()
        with pytest.raises(HarnessError, match=r"run extract-failed is failed; only a succeeded run is copied"):
            copy_run(src, [dst], "extract-failed")
        assert not (wd[1] / "runs/extract-failed").exists()


def test_a_bad_cluster_is_one_line_before_any_host(tmp_path):
    """Unknown cluster, --hosts beside --cluster, a cluster naming an unknown host or one host twice:
    one line each, naming the thing, before any connection (the hosts here do not exist)."""
    hosts = {"g1": {"address": "192.0.2.1"}, "g2": {"address": "192.0.2.2"}}
    good = write_inventory(tmp_path / "good.yaml", hosts, clusters={"pair": {"hosts": ["g1", "g2"]}})
    cases = [
        (good, ["--cluster", "trio"], "no cluster 'trio' (clusters: pair)"),
        (good, ["--cluster", "pair", "--hosts", "g1"], "--cluster and --hosts"),
        (write_inventory(tmp_path / "unknown.yaml", hosts, clusters={"pair": {"hosts": ["g1", "g3"]}}), ["--cluster", "pair"],
         "clusters.pair.hosts: unknown host 'g3'"),
        (write_inventory(tmp_path / "twice.yaml", hosts, clusters={"pair": {"hosts": ["g1", "g1"]}}), ["--cluster", "pair"],
         "a host is listed twice"),
        (write_inventory(tmp_path / "one.yaml", hosts, clusters={"solo": {"hosts": ["g1"]}}), ["--cluster", "solo"],
         "clusters.solo.hosts"),
    ]
    for inventory, args, message in cases:
        t0 = time.monotonic()
        r = run_inv("pipeline", *args, "--inventory", str(inventory), timeout=120)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1, r.stderr
        assert time.monotonic() - t0 < 30  # no connection was tried (192.0.2.0/24 answers nothing)


def test_a_failed_job_is_named_after_its_cause_not_the_first_node_heard_of():
    """A node lost with its host makes its peer fail in the next collective, and the workstation may
    hear of the peer first: the job is named after the lost node. A node the job stopped itself is not
    the cause; between two failures, the earlier one is."""
    from harness.cluster import culprit

    nodes = [SimpleNamespace(name="node0"), SimpleNamespace(name="node1")]
    assert culprit(nodes, {"node0": {"state": "failed", "finished_ts": 5}, "node1": {"state": "lost"}}, {"node1"}) == "node1"
    assert culprit(nodes, {"node0": {"state": "stopped", "finished_ts": 5}, "node1": {"state": "failed",
                                                                                     "finished_ts": 6}}, {"node0"}) == "node1"
    assert culprit(nodes, {"node0": {"state": "failed", "finished_ts": 7}, "node1": {"state": "failed",
                                                                                    "finished_ts": 6}}, set()) == "node1"
    assert culprit(nodes, {"node0": {"state": "succeeded"}, "node1": {"state": "succeeded"}}, set()) is None
