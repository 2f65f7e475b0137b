"""``inv pipeline`` over a real sshd on a tiny model: patch, five stages, pull, the input-hash skip.

The host's python is a venv on top of this machine's packages with its own speculators 0.3.0 from
PyPI (``--no-deps``), so the pipeline patches that copy and never the test runner's own.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import make_venv, run_inv, write_inventory
from harness import pipeline
from harness.errors import HarnessError
from harness.inventory import load_inventory
from tests.models import build_tiny_model

SETTINGS = {"dataset": "builtin:prompts", "samples": 12, "heldout": 4, "max_seq_len": 96, "max_new_tokens": 24,
            "batch_size": 4, "draft_vocab_size": 64, "epochs": 2, "lr": 3e-3, "train_seq_len": 256,
            "val_fraction": 0.2, "k": 3, "ttt_steps": 3, "seed": 0}


@pytest.fixture(scope="module")
def host_python(tmp_path_factory) -> Path:
    return make_venv(tmp_path_factory.mktemp("hostenv") / "venv", "--no-deps", "speculators==0.3.0",
                     system_site_packages=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def setup_inv(tmp_path_factory, sshd_hosts, host_python, tiny):
    root = tmp_path_factory.mktemp("pipe")
    host = sshd_hosts(1)[0]

    def write(**pipeline_overrides) -> Path:
        return write_inventory(root / "inventory.yaml",
                               {"gpu": host.entry(python=str(host_python), workdir=str(root / "wd"))},
                               model={"path": str(tiny)}, pipeline={**SETTINGS, **pipeline_overrides})

    return root, write


def run_pipeline_cli(root: Path, inv: Path, *args: str):
    r = run_inv("pipeline", "--json", "--inventory", str(inv), *args, env={"HARNESS_RUNS_DIR": str(root / "runs"),
                                                                            "HF_HUB_OFFLINE": "1"}, timeout=900)
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


def test_pipeline_end_to_end_then_skip_then_partial_rerun(setup_inv):
    root, write = setup_inv
    inv = write()
    r, out = run_pipeline_cli(root, inv)
    assert r.returncode == 0, r.stderr[-3000:]
    stages = out["gpu"]
    assert [s["stage"] for s in stages] == pipeline.ORDER
    assert all(s["state"] == "ran" for s in stages)
    by = {s["stage"]: s for s in stages}
    # artifacts pulled and verified into runs/<run-id>/ on the workstation
    vocab_dir = Path(by["vocab"]["pulled"])
    d2t = np.load(vocab_dir / "d2t.npy")
    assert d2t.shape == (64,)
    ckpt = Path(by["train"]["pulled"]) / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert (ckpt / "model.safetensors").stat().st_size > 0
    assert config["speculators_model_type"] == "eagle3"
    assert isinstance(by["evaluate"]["result"]["acceptance_length"], float)
    assert 1.0 <= by["evaluate"]["result"]["acceptance_length"] <= 4.0
    # the hidden states stayed on the host
    extract_local = Path(by["extract"]["pulled"])
    assert not list(extract_local.rglob("data_*.pt"))
    assert (root / "wd" / "runs" / by["extract"]["run_id"] / "artifacts").is_dir()

    # the patch set was applied on the host (patch 7 lets the draft train on the CPU)
    r2 = run_inv("patch.status", "--json", "--inventory", str(inv))
    st = json.loads(r2.stdout)["gpu"]
    states = {p["name"]: p["state"] for p in st["patches"]}
    assert any(n.startswith("0007") and s == "applied" for n, s in states.items()), states

    # same inputs: every stage is skipped
    r, again = run_pipeline_cli(root, inv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s["state"] for s in again["gpu"]] == ["skipped"] * 5
    assert [s["run_id"] for s in again["gpu"]] == [s["run_id"] for s in stages]

    # a training setting changed: only train and evaluate run again
    inv = write(lr=2e-3)
    r, partial = run_pipeline_cli(root, inv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s["state"] for s in partial["gpu"]] == ["skipped", "skipped", "skipped", "ran", "ran"]
    assert partial["gpu"][2]["run_id"] == by["vocab"]["run_id"]
    # --from finds the upstream runs by the same ids
    r, tail = run_pipeline_cli(root, inv, "--from", "train")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(s["stage"], s["state"]) for s in tail["gpu"]] == [("train", "skipped"), ("evaluate", "skipped")]


def test_from_needs_upstream_runs_with_same_settings(setup_inv):
    root, write = setup_inv
    inv = write(seed=12345)  # nothing ran with these settings
    r, _ = run_pipeline_cli(root, inv, "--from", "train")
    assert r.returncode != 0
    assert "needs a successful prepare run" in r.stderr and "inv pipeline --from prepare" in r.stderr and "Traceback" not in r.stderr


def test_bad_stage_name_is_one_line(setup_inv):
    root, write = setup_inv
    r, _ = run_pipeline_cli(root, write(), "--from", "trian")
    assert r.returncode != 0 and "unknown stage" in r.stderr and "Traceback" not in r.stderr


def _ids(tmp_path, name, **settings):
    return pipeline.run_ids(load_inventory(write_inventory(
        tmp_path / f"{name}.yaml", {"l": {"transport": "local"}}, model={"path": "m"}, pipeline=settings)))


def test_run_ids_follow_inputs(tmp_path):
    base = _ids(tmp_path, "a", lr=1e-4)
    assert _ids(tmp_path, "a2", lr=1e-4) == base  # deterministic
    lr = _ids(tmp_path, "b", lr=2e-4)
    assert [base[s] == lr[s] for s in pipeline.ORDER] == [True, True, True, False, False]
    vocab = _ids(tmp_path, "c", lr=1e-4, draft_vocab_size=100)
    assert [base[s] == vocab[s] for s in pipeline.ORDER] == [True, True, False, False, False]
    samples = _ids(tmp_path, "d", lr=1e-4, samples=5)
    assert all(base[s] != samples[s] for s in pipeline.ORDER)  # upstream ids feed downstream ones
    with pytest.raises(HarnessError):
        pipeline.select_stages("train", "prepare")


def test_stage_setting_lists_cover_what_stages_read():
    """Every pipeline setting a stage's source reads is in that stage's READS (or common): otherwise a
    changed setting would wrongly let the stage be skipped."""
    import re

    from harness import REMOTE_DIR

    pattern = r"pipeline(?:\.get\(|\[)\"(\w+)\""
    declared_anywhere = set(pipeline.COMMON_SETTINGS).union(*pipeline.READS.values())
    for stage in pipeline.ORDER:
        read = set(re.findall(pattern, (REMOTE_DIR / "stages" / f"{stage}.py").read_text()))
        declared = set(pipeline.READS[stage]) | set(pipeline.COMMON_SETTINGS)
        assert read, stage
        assert read <= declared, (stage, read - declared)
    # the shared helpers' settings (device, dtype, capture layers) belong to some stage's list
    common = set(re.findall(pattern, (REMOTE_DIR / "stages" / "common.py").read_text()))
    assert common <= declared_anywhere, common - declared_anywhere


def test_stage_inputs_match_what_stages_open():
    """The DAG gives each stage exactly the upstream artifacts its source asks for."""
    import re

    from harness import REMOTE_DIR

    for stage in pipeline.ORDER:
        src = (REMOTE_DIR / "stages" / f"{stage}.py").read_text()
        opened = set(re.findall(r"input_dir\(spec, \"(\w+)\"\)", src))
        assert opened == set(pipeline.PIPELINE[stage]), (stage, opened)
