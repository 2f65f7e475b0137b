"""``inv pipeline --plan`` and the pipeline's own size check, on a loopback sshd host with today's stack.

The reference case at full size without a byte of weights: Kimi-K2.5's config.json (its text model under
``text_config``) and 50,000 samples of 8,192 tokens. Then the exact count: a prepare run that succeeded
on the host (its status and result as the runner writes them) makes the pipeline refuse its extraction
before it launches.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from conftest import native_bf16, run_inv, write_inventory
from models import KIMI_K25_CONFIG, build_tiny_model

pytestmark = pytest.mark.timeout(900)

def _host(tmp_path, sshd_factory, python, model, pipeline, name="planhost"):
    sshd = sshd_factory(name)
    workdir = tmp_path / "wd"
    inventory = write_inventory(tmp_path, {name: sshd.entry(python=str(python), workdir=str(workdir), profile="cpu")},
                                model={"path": str(model)}, pipeline=pipeline)
    return inventory, workdir


def test_plan_sizes_kimi_k25_at_full_scale_and_says_it_does_not_fit(tmp_path, sshd_factory, current_python):
    model = tmp_path / "kimi-k2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI_K25_CONFIG))
    # the reference host's GPUs compute in bf16: said here, since this test host has none
    inventory, workdir = _host(tmp_path, sshd_factory, current_python, model,
                               {"samples": 50000, "max_seq_len": 8192, "dtype": "bfloat16"})
    r = run_inv("pipeline", "--plan", "--json", "--hosts", "planhost", "--inventory", str(inventory))
    assert r.returncode == 1, r.stdout + r.stderr
    p = json.loads(r.stdout)["planhost"]
    assert p["model"]["text_config"] == "text_config" and p["model"]["hidden_size"] == 7168
    assert p["model"]["num_hidden_layers"] == 61 and p["model"]["vocab_size"] == 163840
    hs = p["hidden_states"]
    assert hs["bytes_per_token"] == 4 * 7168 * 2 == 57344 and hs["exact"] is False
    assert hs["bytes"] == 50000 * 8192 * 57344 and round(hs["bytes"] / 1e12, 1) == 23.5
    st = os.statvfs(tmp_path)
    assert abs(p["free_bytes"] - st.f_bavail * st.f_frsize) < 2**30  # the host's own free space, read there
    assert p["verdict"] == "does not fit" and p["fits"] is False and p["generation"] == "current"
    assert [s["action"] for s in p["stages"]] == ["run"] * 5
    assert any("pipeline.online: true" in w for w in p["ways_out"]) and any("workdir" in w for w in p["ways_out"])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "23.5 TB" in errors[0] and "Traceback" not in r.stderr
    assert not (workdir / "runs").exists()  # a plan changes nothing

    # the same as people read it, and the way out it names works: online stores nothing
    r = run_inv("pipeline", "--plan", "--hosts", "planhost", "--inventory", str(inventory))
    assert r.returncode == 1 and "23.5 TB" in r.stdout and "(its text_config)" in r.stdout, r.stdout
    inventory.write_text(inventory.read_text().replace("max_seq_len: 8192", "max_seq_len: 8192\n  online: true"))
    r = run_inv("pipeline", "--plan", "--json", "--hosts", "planhost", "--inventory", str(inventory))
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)["planhost"]
    assert p["verdict"] == "fits" and p["hidden_states"]["stored"] is False and p["hidden_states"]["online"] is True

    # with pipeline.dtype auto the size follows the host: on a CPU host without GPUs whose CPU only
    # emulates bf16 the current stages store float32 (the plan reads /proc/cpuinfo there), 2x the bytes
    inventory.write_text(inventory.read_text().replace("  dtype: bfloat16\n", "").replace("  online: true\n", ""))
    p = json.loads(run_inv("pipeline", "--plan", "--json", "--hosts", "planhost", "--inventory",
                           str(inventory)).stdout)["planhost"]
    native = native_bf16()
    assert p["hidden_states"]["dtype"] == ("bfloat16" if native else "float32"), p["hidden_states"]
    assert p["hidden_states"]["bytes_per_token"] == 4 * 7168 * (2 if native else 4)


def _fake_prepare(workdir, run_id: str, samples: int, tokens: int) -> None:
    """A prepare run that succeeded on the host, as the runner leaves it (status.json, result.json)."""
    _fake_run(workdir, run_id, {"samples": samples, "tokens": tokens})


def _fake_run(workdir, run_id: str, result: dict) -> None:
    """A run that succeeded on the host, as the runner leaves it (status.json, result.json)."""
    run = workdir / "runs" / run_id
    (run / "artifacts").mkdir(parents=True)
    now = time.time()
    (run / "status.json").write_text(json.dumps({"run_id": run_id, "state": "succeeded", "exit_code": 0,
                                                 "started_ts": now - 60, "finished_ts": now}))
    (run / "result.json").write_text(json.dumps(result))


def test_the_plan_warns_of_a_draft_vocabulary_that_misses_the_held_out_prompts(tmp_path, sshd_factory,
                                                                                current_python):
    """Once a vocab run with these settings has counted the held-out prompts' coverage, the plan names each
    category below pipeline.coverage_warning and the setting to raise; the others pass unnamed."""
    model = build_tiny_model(tmp_path / "tiny")
    inventory, workdir = _host(tmp_path, sshd_factory, current_python, model,
                               {"samples": 16, "max_seq_len": 96, "draft_vocab_size": 64}, name="vocabhost")
    env = {"HARNESS_INVENTORY": str(inventory), "HARNESS_RUNS_DIR": str(tmp_path / "runs")}
    p = json.loads(run_inv("pipeline", "--plan", "--json", "--hosts", "vocabhost", env=env).stdout)["vocabhost"]
    assert p["warnings"] == []  # nothing counted yet
    vocab = next(s for s in p["stages"] if s["stage"] == "vocab")["run_id"]
    _fake_run(workdir, vocab, {"draft_vocab_size": 64, "heldout_coverage": {"chat": 0.93, "code": 0.53}})
    r = run_inv("pipeline", "--plan", "--hosts", "vocabhost", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(run_inv("pipeline", "--plan", "--json", "--hosts", "vocabhost", env=env).stdout)["vocabhost"]
    assert p["warnings"] == ["the draft vocabulary (64 tokens) holds 53.0% of the held-out code prompts' tokens "
                             "(< pipeline.coverage_warning 0.8): raise pipeline.draft_vocab_size, or give "
                             "pipeline.dataset more such prompts"], p["warnings"]
    assert "53.0%" in r.stdout and "93.0%" not in r.stdout, r.stdout  # the table shows it too


def test_the_pipeline_refuses_an_extraction_that_cannot_fit(tmp_path, sshd_factory, current_python):
    """prepare's exact token count on the host (a billion-token dataset): the plan says it fits no
    longer, so the pipeline stops before extract launches, naming the numbers and the ways out."""
    model = build_tiny_model(tmp_path / "tiny")
    inventory, workdir = _host(tmp_path, sshd_factory, current_python, model, {"samples": 16, "max_seq_len": 96},
                               name="fullhost")
    env = {"HARNESS_INVENTORY": str(inventory), "HARNESS_RUNS_DIR": str(tmp_path / "runs")}
    r = run_inv("pipeline", "--plan", "--json", "--hosts", "fullhost", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)["fullhost"]
    assert p["verdict"] == "fits" and p["hidden_states"]["tokens"] == 16 * 96 and not p["hidden_states"]["exact"]
    prepare = next(s for s in p["stages"] if s["stage"] == "prepare")["run_id"]

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    tokens = free // (4 * 128 * 2) * 2  # twice what the free space holds at hidden 128
    _fake_prepare(workdir, prepare, samples=16, tokens=tokens)
    p = json.loads(run_inv("pipeline", "--plan", "--json", "--hosts", "fullhost", env=env).stdout)["fullhost"]
    assert p["stages"][0]["action"] == "skip: succeeded before" and p["hidden_states"]["exact"] is True
    assert p["hidden_states"]["tokens"] == tokens and p["verdict"] == "does not fit"
    assert any("pipeline.samples" in w for w in p["ways_out"])

    r = run_inv("pipeline", "--from", "extract", "--hosts", "fullhost", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hidden states need" in errors[0] and "ways out" in errors[0], r.stderr
    assert sorted(x.name for x in (workdir / "runs").iterdir()) == [prepare]  # extract never launched
