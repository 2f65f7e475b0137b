"""inv pipeline --compare and inv deploy --best, what is refused before any host is touched and how variants
are written. The comparison itself (EAGLE-3 against DFlash over the shared runs, each served by vLLM and
measured live) runs on tests/test_serve.py's host, over the pipeline that module has already run."""
from __future__ import annotations

import pytest

from conftest import run_inv, write_inventory
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
