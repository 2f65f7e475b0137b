"""inv pipeline --compare and inv deploy --best: two kinds of draft (EAGLE-3 and DFlash) for one tiny target
on today's stack (speculators 0.9, vLLM 0.32 on this CPU), over the shared prepare, extract and vocab runs,
each served by vLLM and measured live, in one table; the fastest is the one --best takes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_inv, write_inventory
from job_support import TINY_CURRENT
from models import build_tiny_model

PIPELINE = {**TINY_CURRENT, "speed_prompts": 2, "eval_prompts": 2, "eval_sets": {"ood-code": "builtin:eval/code"}}


@pytest.fixture(scope="module")
def bench(tmp_path_factory, current_python):
    root = tmp_path_factory.mktemp("compare")
    model = build_tiny_model(root / "model", hidden=128, heads=4)
    hosts = {"local": {"transport": "local", "python": str(current_python), "workdir": str(root / "wd"),
                       "profile": "cpu", "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}}}
    inventory = write_inventory(root, hosts, model={"path": str(model)}, pipeline=PIPELINE)
    return root, {"HARNESS_INVENTORY": str(inventory), "HARNESS_RUNS_DIR": str(root / "runs")}


@pytest.mark.timeout(2400)
def test_two_draft_types_compared_over_shared_runs_and_the_fastest_taken(bench):
    root, env = bench
    r = run_inv("pipeline", "--hosts", "local", "--compare", "speculator=eagle3,dflash", "--json", env=env,
                timeout=2300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    comparison = json.loads(r.stdout)["local"]
    eagle3, dflash = comparison["variants"]
    assert (eagle3["variant"], dflash["variant"]) == ("speculator=eagle3", "speculator=dflash")
    assert (eagle3["speculator"], dflash["speculator"]) == ("eagle3", "dflash")
    # one prepare, one extract, one vocab: the second variant trained and evaluated only
    assert set(comparison["shared"]) == {"prepare", "extract", "vocab"}
    assert eagle3["ran"] == ["prepare", "extract", "vocab", "train", "evaluate"] and dflash["ran"] == ["train", "evaluate"]
    assert eagle3["train_run"] != dflash["train_run"]
    for v in (eagle3, dflash):  # each served by vLLM with its draft and measured live, with and without it
        assert v["acceptance_length"] >= 1.0 and len(v["acceptance_per_position"]) == 3, v
        assert v["tokens_per_s"] > 0 and v["tokens_per_s_without"] > 0 and v["checkpoint_bytes"] > 0, v
        assert {"held-out (all)", "chat"} <= set(v["categories"]), v
    # the DFlash draft as speculators wrote it and vLLM read it: its own type and fields, no TTT steps, read
    # by the draft preflight as vLLM's DFlash reader reads it; no offline replay claimed (EAGLE-3's)
    pulled = root / "runs"
    config = json.loads((pulled / dflash["train_run"] / "checkpoint" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [2, 4, 5]
    args = json.loads((pulled / dflash["train_run"] / "metrics.json").read_text())["config"]["args"]
    assert args[args.index("--speculator-type") + 1] == "dflash" and "--ttt-steps" not in args
    # its block: the anchor and the k = ttt_steps tokens vLLM will ask of it, not speculators' 16
    assert args[args.index("--block-size") + 1] == "4" and config["block_size"] == 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    metrics = json.loads((pulled / dflash["runs"]["evaluate"] / "metrics.json").read_text())
    assert metrics["speculator"] == "dflash" and metrics["draft_preflight"] == {"vllm": "0.32.0", "problems": []}
    assert metrics["vllm"]["draft_tokens"] == 3 * metrics["vllm"]["drafts"]  # k = 3, its whole trained block
    assert metrics["offline"] is None and metrics["agree"] is None
    best = max((eagle3, dflash), key=lambda v: v["tokens_per_s"])
    assert comparison["fastest"] == best["variant"]
    saved = json.loads((root / "runs" / "comparisons" / "local.json").read_text())
    assert saved["variants"] == comparison["variants"]
    assert (root / "runs" / "comparisons" / "local.png").stat().st_size > 0

    # the same comparison again, for people: every stage skipped, one table, the fastest marked
    r = run_inv("pipeline", "--hosts", "local", "--compare", "speculator=eagle3,dflash", env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "pipeline.speculator compared" in r.stdout and f"{best['variant']}*" in r.stdout, r.stdout
    assert eagle3["train_run"] in r.stdout and dflash["train_run"] in r.stdout

    # --best resolves to that train run (what inv deploy --best deploys, through the deploy gate)
    probe = ("import json, sys; from harness.compare import best_train_run; "
             "print(json.dumps(best_train_run('local')[0]))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, **env})
    assert p.returncode == 0 and json.loads(p.stdout) == best["train_run"], p.stderr


@pytest.mark.parametrize("spec, message", [
    ("speculator", "--compare 'speculator': give SETTING=VALUE1,VALUE2 (e.g. speculator=eagle3,dflash)"),
    ("nosuch=1,2", "--compare: 'nosuch' is not a pipeline setting"),
    ("speculator=eagle3", "--compare 'speculator=eagle3': give two or more distinct values of speculator"),
    ("speculator=eagle3,medusa", "--compare: pipeline.speculator = 'medusa': Input should be"),
    ("draft_layers=1,zero", "--compare: pipeline.draft_layers = 'zero': Input should be a valid integer"),
    (("speculator=eagle3", "speculator=dflash block_size=1"), "--compare: pipeline.block_size = 1: Input should be greater"),
    (("speculator=eagle3", "speculator=dflash nosuch=2"), "--compare: 'nosuch' is not a pipeline setting"),
    (("speculator=dflash block_size=8", "block_size=8 speculator=dflash"), "give two or more distinct values of speculator, block_size"),
])
def test_a_bad_comparison_is_one_line_before_any_host_is_touched(bench, spec, message):
    root, env = bench
    flags = [a for one in ([spec] if isinstance(spec, str) else spec) for a in ("--compare", one)]
    r = run_inv("pipeline", "--hosts", "local", *flags, env={**env, "HARNESS_RUNS_DIR": str(root / "none")},
                timeout=120)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (root / "none").exists()


def test_deploy_best_without_a_comparison_names_what_to_run(bench, tmp_path):
    _, env = bench
    r = run_inv("deploy", "--best", "--hosts", "local", env={**env, "HARNESS_RUNS_DIR": str(tmp_path)}, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "host local: no comparison at" in r.stderr and "inv pipeline --compare SETTING=A,B first" in r.stderr, r.stderr


def test_variants_of_one_setting_or_of_several():
    """One --compare sweeps one setting; one --compare per variant lets variants differ in several."""
    from harness.compare import label, parse_variants

    assert parse_variants(["draft_layers=1,2"]) == [{"draft_layers": 1}, {"draft_layers": 2}]
    variants = parse_variants(["speculator=eagle3", "speculator=dflash block_size=8 epochs=2"])
    assert variants == [{"speculator": "eagle3"}, {"speculator": "dflash", "block_size": 8, "epochs": 2}]
    assert [label(v) for v in variants] == ["speculator=eagle3", "speculator=dflash block_size=8 epochs=2"]
