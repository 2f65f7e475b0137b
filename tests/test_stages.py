"""The five stages on a tiny Llama built on the fly (tests/models.py), end to end and one by one.

The stages run against the real speculators 0.3.0 with this repo's patch series applied (GNU patch
on a copy of the installed package, put first on PYTHONPATH): patch 7 is what lets the Eagle3 draft
train on CPU, patch 6 what makes its targets the verifier's real logits. The whole tiny pipeline runs
once per module in one subprocess (imports dominate the time); the tests then read its outputs back
with speculators' own dataset and config classes and with transformers, and check the layer
convention against an independent transformers forward.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from job_support import TINY_PIPELINE
from models import NUM_LAYERS, build_tiny_model

REPO = Path(__file__).resolve().parent.parent
REMOTE = REPO / "remote"
sys.path.insert(0, str(REMOTE))  # the stages import as on a host: `from stages import common`
SERIES = REPO / "patches" / "speculators" / "0.3.0"
STAGES = ["prepare", "extract", "vocab", "train", "evaluate"]

PIPELINE = {**TINY_PIPELINE, "max_new_tokens": 24, "batch_size": 4, "epochs": 3, "val_fraction": 0.2, "k": 3,
            "ttt_steps": 3, "threads": 1}


@pytest.fixture(scope="session")
def patched_speculators(tmp_path_factory) -> Path:
    """speculators 0.3.0 from its PyPI wheel (whatever state the installed copy is in) with the shipped
    series applied in order by GNU patch, each file then at the series' after-hash."""
    import zipfile

    from harness.patches import fetch_wheel

    site = tmp_path_factory.mktemp("patched-site")
    with zipfile.ZipFile(fetch_wheel("speculators", "0.3.0")) as zf:
        zf.extractall(site, [n for n in zf.namelist() if n.startswith("speculators/")])
    series = yaml.safe_load((SERIES / "series.yaml").read_text())
    for entry in series["patches"]:
        diff = (SERIES / entry["file"]).read_bytes()
        subprocess.run(["patch", "-p0", "--batch", "--silent", "--fuzz=0"], input=diff, cwd=site, check=True)
        for f, h in entry["files"].items():
            assert hashlib.sha256((site / f).read_bytes()).hexdigest() == h["after"], (entry["file"], f)
    return site


def stage_spec(root: Path, stage: str, model: Path, **pipeline) -> dict:
    return {"run_id": f"{stage}-1", "stage": stage, "generation": "legacy", "run_dir": str(root / "runs" / f"{stage}-1"),
            "model": {"path": str(model)}, "pipeline": {**PIPELINE, **pipeline},
            "inputs": {s: str(root / "runs" / f"{s}-1" / "artifacts") for s in STAGES[:STAGES.index(stage)]}}


def run_stages(site: Path, specs: list[dict], after: str = "", timeout: float = 900) -> subprocess.CompletedProcess:
    """Run stage mains in sequence in ONE python (cwd = remote/, as on a host), results to result.json;
    then the python source ``after`` (with ``specs`` defined) in the same process: imports dominate."""
    driver = (
        "import json, sys, importlib\n"
        "specs = json.load(sys.stdin)\n"
        "for spec in specs:\n"
        "    result = importlib.import_module('stages.legacy.' + spec['stage']).main(spec)\n"
        "    open(spec['run_dir'] + '/result.json', 'w').write(json.dumps(result))\n"
    ) + after
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-c", driver], input=json.dumps(specs), cwd=REMOTE, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_cli(site: Path, spec: dict, tmp: Path) -> subprocess.CompletedProcess:
    """One stage through the runner's entry point, exactly as the wrapper launches it."""
    path = tmp / f"{spec['stage']}-spec.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "runtime.runstage", str(path)], cwd=REMOTE, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, tiny, patched_speculators):
    root = tmp_path_factory.mktemp("work")
    specs = [stage_spec(root, s, tiny) for s in STAGES]
    proc = run_stages(patched_speculators, specs, after=LITERAL_LOOP)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {s["stage"]: json.loads((Path(s["run_dir"]) / "result.json").read_text()) for s in specs}
    arts = {s["stage"]: Path(s["run_dir"]) / "artifacts" for s in specs}
    return root, specs, results, arts, proc.stdout


# ---------------------------------------------------------------------------------------------------
# prepare


def test_prepare_regenerates_replies_and_holds_out_prompts(pipeline_run, tiny):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    _, _, results, arts, _ = pipeline_run
    tok = AutoTokenizer.from_pretrained(tiny)
    data = load_from_disk(str(arts["prepare"] / "dataset"))
    convs = [json.loads(line)["messages"] for line in (arts["prepare"] / "conversations.jsonl").read_text().splitlines()]
    # a reply that decodes to nothing (the tiny model is random) is dropped, nothing else is
    assert results["prepare"]["samples"] == len(data) == len(convs) >= PIPELINE["samples"] - 4
    assert results["prepare"]["regenerated"]
    for row, conv in zip(data, convs):
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(ids) == len(mask) <= PIPELINE["max_seq_len"] and sum(mask) > 0
        # the shipped prompts have no replies: each one here was written by the target
        assert [t["role"] for t in conv] == ["user", "assistant"] and conv[1]["content"]
        untrained = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert conv[0]["content"] in untrained and "<|im_start|>assistant" in untrained
    held = [json.loads(line)["messages"] for line in (arts["prepare"] / "heldout.jsonl").read_text().splitlines()]
    assert len(held) == PIPELINE["heldout"] and all(m[-1]["role"] == "user" for m in held)
    assert not {m[-1]["content"] for m in held} & {c[0]["content"] for c in convs}


def masked_runs(tok, ids, mask) -> list[str]:
    """The loss-masked tokens, decoded run by run."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


def test_prepare_masks_exactly_the_assistant_replies_of_sharegpt_and_openai_files(tmp_path, tiny):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from stages.legacy import prepare

    tok = AutoTokenizer.from_pretrained(tiny)
    sharegpt = tmp_path / "chats.jsonl"
    sharegpt.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer number {i}"}]})
        for i in range(6)))
    openai = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer number {i}"},
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": f"that is all {i}"}]}
        for i in range(6)]), openai)
    for path in (sharegpt, openai):
        spec = stage_spec(tmp_path / path.suffix[1:], "prepare", tiny, dataset=str(path), samples=4, heldout=2,
                          regenerate=False)
        result = prepare.main(spec)
        assert result["samples"] == 4 and not result["regenerated"]
        data = load_from_disk(str(Path(spec["run_dir"]) / "artifacts" / "dataset"))
        for row in data:
            decoded = masked_runs(tok, row["input_ids"], row["loss_mask"])
            i = decoded[0].split()[-1]
            assert decoded == [f"answer number {i}"] + ([f"that is all {i}"] if path is openai else [])


@pytest.mark.parametrize("dataset, message", [
    ("builtin:nope", "no built-in dataset 'builtin:nope'"),
    ("/nonexistent/chats.jsonl", "dataset file not found: /nonexistent/chats.jsonl"),
])
def test_prepare_refuses_a_missing_dataset(tmp_path, tiny, dataset, message):
    from stages.legacy import prepare

    with pytest.raises(SystemExit, match="^stage prepare: " + message):
        prepare.main(stage_spec(tmp_path, "prepare", tiny, dataset=dataset))


def test_sources_mixed_by_weight_each_a_category_of_held_out_prompts(tmp_path):
    """pipeline.dataset {source: weight}: each source gives its share of samples and of heldout (whole
    numbers that add up), a traffic sample of bare prompts among them; held-out prompts keep their
    source's category, and none is also trained on."""
    from stages.lib import conversations

    for name, n in (("traffic", 50), ("code", 30)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{name} prompt {i}"}) + "\n"
                                                        for i in range(n)))
    mix = {str(tmp_path / "traffic.jsonl"): 2, str(tmp_path / "code.jsonl"): 1}
    train, held = conversations.load_split(mix, "train", 31, 7, 0, "prepare")
    texts = [c[0]["content"] for c in train]
    assert len(train) == 31 and sum(t.startswith("traffic") for t in texts) == 21  # 20.67 and 10.33: 21 + 10
    assert [name for name, _ in held] == ["traffic"] * 5 + ["code"] * 2  # 4.67 and 2.33: 5 + 2
    assert all(c == [{"role": "user", "content": c[0]["content"]}] for _, c in held)
    assert not {c[0]["content"] for _, c in held} & set(texts)
    path = tmp_path / "heldout.jsonl"
    conversations.write_heldout(path, held)
    assert conversations.read_prompts(path) == held
    with pytest.raises(SystemExit, match=r"^stage prepare: pipeline.dataset: '.*code.jsonl' has 30 conversations, "
                                         r"fewer than its share \(40 to train \+ 2 held out, weight 3\); lower"):
        conversations.load_split({str(tmp_path / "traffic.jsonl"): 1, str(tmp_path / "code.jsonl"): 3}, "train",
                                 53, 3, 0, "prepare")


def test_eval_sets_are_first_turns_of_each_set_up_to_the_limit(tmp_path):
    from stages.lib import conversations

    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"},
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]}) + "\n" for i in range(5)))
    got = conversations.evaluation_sets({"ood-code": "builtin:eval/code", "mine": str(tmp_path / "mine.jsonl")}, 3,
                                        "train", "evaluate")
    assert [name for name, _ in got] == ["ood-code"] * 3 + ["mine"] * 3
    assert got[-1][1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q2"}]
    shipped = (REMOTE / "stages" / "data" / "eval" / "code.jsonl").read_text().splitlines()
    assert [m for _, m in got[:3]] == [json.loads(line)["messages"] for line in shipped[:3]]


def test_a_malformed_jsonl_dataset_is_one_line_naming_the_file_and_line(tmp_path, tiny, patched_speculators):
    """Through the runner, as on a host: one line naming the file and the broken line, no traceback
    (datasets' own loader prints three chained ones naming neither)."""
    import re

    path = tmp_path / "chats.jsonl"
    rows = [json.dumps({"conversations": [{"from": "human", "value": f"q {i}"}, {"from": "gpt", "value": f"a {i}"}]})
            for i in range(9)]
    rows[6] = rows[6][:-2]  # line 7 loses its closing brackets
    path.write_text("\n".join(rows) + "\n")
    spec = stage_spec(tmp_path, "prepare", tiny, dataset=str(path), samples=4, heldout=2, regenerate=False)
    proc = run_cli(patched_speculators, spec, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    named = [line for line in out.splitlines() if str(path) in line]
    assert len(named) == 1, out[-3000:]
    assert re.fullmatch(rf"@@harness stage prepare failed: dataset {re.escape(str(path))}:7: not valid JSON "
                        rf"\(.+, column \d+\); .+", named[0]), named[0]
    assert not (Path(spec["run_dir"]) / "result.json").exists()


@pytest.mark.parametrize("name, text, where", [
    # a JSON document (not JSON lines) in a .json file: the line of the error inside it
    ("chats.json", '[\n  {"messages": []},\n  {"messages": [}\n]\n', ":3: not valid JSON (Expecting value, column 17)"),
    # JSON lines in a .json file: line by line
    ("chats.json", '{"messages": []}\n\n{"messages": [\n', ":3: not valid JSON ("),
    ("chats.jsonl", '{"messages": []}\n[1, 2]\n', ":2: a JSON list, not an object (one conversation per line)"),
    ("chats.jsonl", b'{"messages": []}\n{"messages": "\xff"}\n', ":2: not UTF-8 text"),
])
def test_prepare_names_the_line_of_a_broken_json_dataset(tmp_path, tiny, name, text, where):
    from stages.legacy import prepare

    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SystemExit) as refused:
        prepare.main(stage_spec(tmp_path, "prepare", tiny, dataset=str(path), regenerate=False))
    assert str(refused.value).startswith(f"stage prepare: dataset {path}{where}"), str(refused.value)
    assert "\n" not in str(refused.value)


def test_stage_settings_are_the_contract_defaults_overridden_by_the_spec():
    """common.settings: declared settings only, the spec's value where set (converted as the stage uses
    it), the contract's default where absent, null or empty; an undeclared one cannot be read."""
    from stages import common
    from stages.legacy import prepare, train

    cfg = common.settings({"stage": "prepare", "pipeline": {
        "samples": "12", "heldout": None, "dataset": "", "seed": 0, "lr": 5.0, "threads": 2}}, prepare.SETTINGS)
    assert set(cfg) == set(prepare.SETTINGS) | set(common.COMMON_SETTINGS)
    assert cfg.samples == 12 and type(cfg.samples) is int
    assert cfg.heldout == prepare.SETTINGS["heldout"] == 16 and cfg.dataset == prepare.SETTINGS["dataset"] and cfg.seed == 0
    assert cfg.threads == 2 and cfg.device == "auto" and cfg.regenerate is True
    with pytest.raises(AttributeError, match="'lr' is not declared"):
        cfg.lr  # noqa: B018  (train's setting, not prepare's)
    cfg = common.settings({"stage": "train", "pipeline": {"lr": 1, "val_fraction": 0, "compile": None}}, train.SETTINGS)
    assert cfg.lr == 1.0 and type(cfg.lr) is float and cfg.val_fraction == 0.0 and cfg.compile is None
    assert cfg.extra == {} and cfg.extra is not common.COMMON_SETTINGS["extra"]
    with pytest.raises(SystemExit, match=r"^stage train: pipeline.epochs is 'many', not an integer; fix pipeline.epochs$"):
        common.settings({"stage": "train", "pipeline": {"epochs": "many"}}, train.SETTINGS)


# ---------------------------------------------------------------------------------------------------
# extract


def test_extract_writes_speculators_samples_of_exactly_bf16_hidden_bytes(pipeline_run):
    import torch
    from speculators.train.data import Eagle3SampleFileDataset

    _, _, results, arts, _ = pipeline_run
    meta = json.loads((arts["extract"] / "extract.json").read_text())
    files = sorted((arts["extract"] / "data").glob("data_*.pt"))
    assert len(files) == results["extract"]["samples"] == results["prepare"]["samples"]
    hidden = meta["hidden_size"]
    for f in files:
        sample = torch.load(f, weights_only=True)
        n = sample["input_ids"].shape[0]
        assert [tuple(h.shape) for h in sample["hidden_states"]] == [(n, hidden)] * 4
        assert all(h.dtype == torch.bfloat16 for h in sample["hidden_states"])
        # nothing more than the samples' own bytes: no storage of a whole batch behind a view
        storages = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in sample["hidden_states"]}
        assert sum(storages.values()) == 4 * n * hidden * 2
    # speculators' own reader (format v1): 3 layers concatenated for the draft, the last as target
    dataset = Eagle3SampleFileDataset(max_len=PIPELINE["train_seq_len"], file_list=[str(f) for f in files])
    item = dataset[0]
    assert item["hidden_states"].shape[-1] == 3 * hidden
    assert item["verifier_last_hidden_states"].shape[-1] == hidden
    freq = torch.load(arts["extract"] / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == results["prepare"]["assistant_tokens"]


def test_captured_layers_are_layer_outputs_and_vllm_ids_are_one_higher(pipeline_run, tiny):
    """The off-by-one. speculators captures the OUTPUT of layer i (transformers' hidden_states[i+1],
    pre-norm for the last layer); vLLM feeds the draft the INPUT of each listed layer (transformers'
    hidden_states[id]); so the checkpoint's ids must be capture + 1 for the draft to see at serving
    time what it was trained on."""
    import torch
    from transformers import AutoModelForCausalLM

    _, _, _, arts, _ = pipeline_run
    meta = json.loads((arts["extract"] / "extract.json").read_text())
    layers = meta["capture_layers"]
    assert layers == [2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS - 1]
    config = json.loads((arts["train"] / "checkpoint" / "config.json").read_text())
    ids = config["eagle_aux_hidden_state_layer_ids"]
    assert ids == [layers[0] + 1, layers[1] + 1, layers[2] + 1]

    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    sample = torch.load(arts["extract"] / "data" / "data_0.pt", weights_only=True)
    with torch.no_grad():
        hf = model(sample["input_ids"][None], output_hidden_states=True).hidden_states
    stored = [h.float() for h in sample["hidden_states"]]
    for j in range(3):
        # what vLLM collects for id ids[j]: the input of that layer == what we stored for training
        assert torch.allclose(stored[j], hf[ids[j]][0].to(torch.bfloat16).float(), atol=1e-2)
        # and not the neighbouring layer's (the off-by-one would be visible)
        assert not torch.allclose(stored[j], hf[ids[j] - 1][0].to(torch.bfloat16).float(), atol=1e-2)
    # last layer: its raw output, before the final norm (transformers' last hidden state is normed)
    assert not torch.allclose(stored[3], hf[NUM_LAYERS][0], atol=1e-2)
    assert torch.allclose(model.model.norm(stored[3]), hf[NUM_LAYERS][0], atol=5e-2)


def test_shared_prompt_prefix_runs_once_and_changes_nothing(tiny):
    """generate() and HfCapture run the tokens all rows start with (the chat template's system prompt)
    once and the rest on their KV cache. Replies and captured states must be those of the plain batch."""
    import torch
    from stages.lib import batching
    from stages.lib.capture import HfCapture
    from stages.lib.generation import generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    questions = ["What is DNA?", "Explain gravity in simple terms, please.", "Write a haiku about tea.", "Hi"]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for q in questions]
    shared = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    assert shared >= batching.SHARED_PREFIX_MIN  # the system prompt is long enough to be shared
    assert batching.shared_prefix(prompts) == shared

    replies = generate(model, tok, prompts, 12, "cpu")
    sequences = [p + r for p, r in zip(prompts, replies)]
    batch = batching.right_padded(sequences)
    capture = HfCapture(model, [1, 4, 6, 7])
    states = capture(batch)

    # the reference, independent of the shared-prefix code: each row alone, through transformers' own
    # greedy generate and its output_hidden_states (layer i's output is hidden_states[i + 1]; the last
    # layer's is returned after the final norm)
    for prompt, reply in zip(prompts, replies):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, temperature=None,
                               top_p=None, top_k=None, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        end = next((i + 1 for i, t in enumerate(alone) if t == tok.eos_token_id), len(alone))
        assert reply == alone[:end]
    with torch.inference_mode():
        for row, seq in enumerate(sequences):
            hf = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
            for layer, a in zip([1, 4, 6], states[:3]):
                assert torch.allclose(a[row, :len(seq)], hf[layer + 1][0], atol=1e-5, rtol=1e-4)
            assert torch.allclose(model.model.norm(states[3][row, :len(seq)]), hf[NUM_LAYERS][0], atol=1e-5, rtol=1e-4)


def test_extract_resumes_with_the_samples_not_yet_written(pipeline_run, patched_speculators, tmp_path):
    _, specs, results, arts, _ = pipeline_run
    n = results["extract"]["samples"]
    data = arts["extract"] / "data"
    kept = {f.name: f.stat().st_mtime_ns for f in data.glob("data_*.pt")}
    for name in ("data_1.pt", "data_5.pt"):
        (data / name).unlink()
        kept.pop(name)
    proc = run_cli(patched_speculators, specs[1], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resuming: {n - 2} of {n} samples already written" in proc.stdout
    result = json.loads((Path(specs[1]["run_dir"]) / "result.json").read_text())
    assert result["extracted"] == 2 and result["samples"] == n
    assert (data / "data_1.pt").is_file() and (data / "data_5.pt").is_file()
    assert {f.name: f.stat().st_mtime_ns for f in data.glob("data_*.pt") if f.name in kept} == kept
    assert f'"done": {n}, "total": {n}' in proc.stdout


def test_extract_refuses_an_out_of_range_layer_in_one_line(pipeline_run, tiny, tmp_path):
    from stages.legacy import extract

    root, _, _, _, _ = pipeline_run
    spec = stage_spec(root, "extract", tiny, capture_layers=[2, 4, 5, 99])
    spec["run_dir"] = str(tmp_path / "run")
    with pytest.raises(SystemExit) as refused:
        extract.main(spec)
    assert str(refused.value) == (f"stage extract: layer 99 out of range: the model has {NUM_LAYERS} layers "
                                  f"(0..{NUM_LAYERS - 1}); fix pipeline.capture_layers")
    assert not (tmp_path / "run" / "artifacts" / "data" / "data_0.pt").exists()


def test_extract_with_vllm_backend_says_vllm_is_missing(pipeline_run, tiny, tmp_path):
    from stages.legacy import extract

    root, _, _, _, _ = pipeline_run
    spec = stage_spec(root, "extract", tiny, backend="vllm")
    spec["run_dir"] = str(tmp_path / "run")
    with pytest.raises(SystemExit, match="^stage extract: pipeline.backend is vllm but vLLM is not installed on the host; "
                                         "set pipeline.backend: hf"):
        extract.main(spec)


# ---------------------------------------------------------------------------------------------------
# vocab, train, evaluate


def test_vocab_maps_the_most_frequent_tokens_and_warns_about_padding(pipeline_run):
    import numpy as np
    import torch

    _, _, results, arts, stdout = pipeline_run
    d2t, t2d = np.load(arts["vocab"] / "d2t.npy"), np.load(arts["vocab"] / "t2d.npy")
    freq = torch.load(arts["extract"] / "token_freq.pt", weights_only=True)
    assert d2t.shape == (PIPELINE["draft_vocab_size"],) and t2d.sum() == PIPELINE["draft_vocab_size"]
    draft_ids = np.arange(len(d2t)) + d2t
    assert set(np.nonzero(t2d)[0]) == set(draft_ids)
    top = sorted(freq, key=lambda t: -freq[t])[:min(len(freq), len(d2t))]
    assert set(top) <= set(draft_ids.tolist())
    if len(freq) < PIPELINE["draft_vocab_size"]:
        assert f"warning: the data has {len(freq)} distinct assistant tokens" in stdout
    assert results["vocab"]["coverage"] == 1.0


def test_train_checkpoint_reads_back_with_speculators_and_vllms_config_loader(pipeline_run):
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    _, _, results, arts, _ = pipeline_run
    ckpt = arts["train"] / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    config = Eagle3SpeculatorConfig.from_pretrained(str(ckpt))
    assert config.draft_vocab_size == PIPELINE["draft_vocab_size"]
    assert config.speculators_config.proposal_methods[0].speculative_tokens == PIPELINE["k"]
    metrics = json.loads((arts["train"] / "metrics.json").read_text())
    steps = metrics["train"]
    assert len(steps) == results["train"]["steps"] > 0 and len(metrics["val"]) == PIPELINE["epochs"]
    # TTT steps trained on the verified tokens (the default), each step's accuracy recorded
    assert metrics["config"]["ttt_verified_tokens"] is True and metrics["config"]["ttt_step_loss_decay"] == 1.0
    assert {f"cond_acc_{s}" for s in range(PIPELINE["ttt_steps"])} <= set(steps[-1])
    assert (arts["train"] / "loss.png").stat().st_size > 1000
    # vLLM's speculators config loader, from the real vLLM source
    vllm_config = vllm_speculators_config(ckpt)
    assert vllm_config["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert vllm_config["eagle_aux_hidden_state_layer_ids"] == config.eagle_aux_hidden_state_layer_ids
    assert vllm_config["draft_vocab_size"] == PIPELINE["draft_vocab_size"]


COMPARE_FORWARDS = r'''
import numpy as np
import torch
from speculators.models.eagle3 import Eagle3DraftModel
from stages import common
from stages.legacy import train
from stages.lib import draft

torch.compiler.set_stance("force_eager")
torch.manual_seed(0)
arts = {k: Path(v) for k, v in spec["inputs"].items()}
meta = json.loads((arts["extract"] / "extract.json").read_text())
d2t, t2d = (torch.from_numpy(np.load(arts["vocab"] / f)) for f in ("d2t.npy", "t2d.npy"))
cfg = common.settings(spec, train.SETTINGS)
config = train.draft_config(spec["model"]["path"], spec, cfg, int(d2t.shape[0]), meta["eagle_aux_hidden_state_layer_ids"])
model = Eagle3DraftModel(config=config, t2d=t2d, d2t=d2t)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
files = sorted((arts["extract"] / "data").glob("data_*.pt"))
report = {"batches": 0, "unscored": 0.0, "loss": 0.0, "grad": 0.0, "metric": 0.0, "metrics": set()}
for batch in train.loader(files, cfg, 0, 1, train=False):
    report["batches"] += 1
    report["unscored"] = max(report["unscored"], 1 - batch["loss_mask"].float().mean().item())
    for verified in (False, True):
        call = {"ttt_steps": 3, "use_off_policy_tokens": verified}
        out = []
        for forward in (Eagle3DraftModel.forward, draft.loss_positions_forward):
            model.zero_grad()
            _, loss, metrics = forward(model, **batch, **call)
            loss.backward()
            out.append((loss.item(), {k: float(v) for k, v in metrics.items()},
                        [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (l1, m1, g1), (l2, m2, g2) = out
        report["loss"] = max(report["loss"], abs(l1 - l2) / abs(l1))
        report["grad"] = max(report["grad"], max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(g1, g2)))
        report["metric"] = max(report["metric"], max(abs(m1[k] - m2[k]) for k in m1))
        report["metrics"] |= set(m1) ^ set(m2)
        report["metrics"] |= {"gradients differ in number"} if len(g1) != len(g2) else set()
    opt.step()  # this forward's gradients (equal to speculators'): later batches meet a trained draft
report["metrics"] = sorted(map(str, report["metrics"]))
print("COMPARED " + json.dumps(report))
'''


def test_train_forward_on_loss_positions_matches_speculators_forward(pipeline_run, patched_speculators):
    """stages.lib.draft.loss_positions_forward (bound to the draft by train on CPU) runs TTT steps > 0 and the logits
    only where they reach the loss. It must give speculators' own loss, gradients and metrics, with the
    verified tokens and with the draft's own, on the real packed batches of the tiny pipeline, at
    initialisation and after optimiser steps."""
    _, specs, _, _, _ = pipeline_run
    spec = next(s for s in specs if s["stage"] == "train")
    proc = run_stages(patched_speculators, [], after=f"from pathlib import Path\nspec = json.loads({json.dumps(json.dumps(spec))})\n"
                      + COMPARE_FORWARDS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("COMPARED ", 1)[1])
    assert report["batches"] >= 2 and report["unscored"] > 0.2  # prompt positions were there to skip
    assert report["metrics"] == []  # the same metric names, gradients for the same parameters
    assert report["loss"] < 1e-5 and report["grad"] < 1e-4 and report["metric"] < 1e-4, report


def vllm_speculators_config(checkpoint: Path) -> dict:
    """Run vLLM 0.16's SpeculatorsConfig conversion (its own files, read from the PyPI wheel) on a
    checkpoint. vLLM itself cannot be imported without CUDA, so only these two modules are loaded."""
    import types
    import zipfile

    cache = Path(os.environ.get("EAGLE_HARNESS_CACHE", "~/.cache/eagle-harness")).expanduser() / "wheels"
    wheel = next(cache.glob("vllm-0.16.0-*.whl"), None)
    if wheel is None:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache),
                        "vllm==0.16.0"], check=True)
        wheel = next(cache.glob("vllm-0.16.0-*.whl"))
    prefix = "vllm/transformers_utils/configs/speculators/"
    with zipfile.ZipFile(wheel) as z:
        algos_src, base_src = z.read(prefix + "algos.py").decode(), z.read(prefix + "base.py").decode()
    algos = types.ModuleType("vllm_algos")
    exec(compile(algos_src, prefix + "algos.py", "exec"), algos.__dict__)
    base_src = base_src.replace("from vllm.transformers_utils.configs.speculators.algos import",
                                "from vllm_algos import")
    sys.modules["vllm_algos"] = algos
    base = types.ModuleType("vllm_base")
    exec(compile(base_src, prefix + "base.py", "exec"), base.__dict__)
    raw = json.loads((checkpoint / "config.json").read_text())
    base.SpeculatorsConfig.validate_speculators_config(raw)
    out = base.SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    assert base.SpeculatorsConfig.build_vllm_speculative_config(raw) == {
        "method": "eagle3", "num_speculative_tokens": PIPELINE["k"]}
    return out


# The plain loop, run after the stages in the fixture's process (same patched speculators): draft k
# tokens from the current prefix (its proposals from the last position), verify them greedily with the
# target over prefix + proposals, accept the matching prefix plus the target's own next token, repeat.
LITERAL_LOOP = r'''
import torch
from pathlib import Path
from stages.legacy.evaluate import load_draft, draft_chains
from stages.lib.capture import HfCapture
from transformers import AutoModelForCausalLM, AutoTokenizer
spec = specs[-1]; arts = spec["inputs"]
torch.compiler.set_stance("force_eager")
tok = AutoTokenizer.from_pretrained(spec["model"]["path"])
target = AutoModelForCausalLM.from_pretrained(spec["model"]["path"]).eval()
layers = json.load(open(arts["extract"] + "/extract.json"))["capture_layers"]
capture, draft = HfCapture(target, layers), load_draft(Path(arts["train"]) / "checkpoint")
k, max_new, total, steps = spec["pipeline"]["k"], spec["pipeline"]["max_new_tokens"], 0, 0
eos = {tok.eos_token_id, target.generation_config.eos_token_id}
for line in open(arts["prepare"] + "/heldout.jsonl"):
    msgs = json.loads(line)["messages"]
    seq = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    start = len(seq)
    with torch.no_grad():
        seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))  # prefill: the first token
    while seq[-1] not in eos and len(seq) - start < max_new:
        ids = torch.tensor(seq)
        proposal = draft_chains(draft, [h[0] for h in capture(ids[None])], ids, k)[-1]
        with torch.no_grad():
            greedy = target(torch.tensor([seq + proposal])).logits[0, len(seq) - 1:].argmax(-1).tolist()
        a = 0
        while a < k and proposal[a] == greedy[a] and proposal[a] not in eos and len(seq) + a + 1 - start < max_new:
            a += 1
        seq += proposal[:a] + [greedy[a]]
        total, steps = total + a + 1, steps + 1
open(spec["run_dir"] + "/literal.json", "w").write(json.dumps({"acceptance_length": round(total / steps, 4), "steps": steps}))
'''


def test_evaluate_matches_a_literal_speculative_decoding_loop(pipeline_run):
    """evaluate computes acceptance in one pass over each held-out continuation; the same number must
    come out of the plain step-by-step loop (LITERAL_LOOP, run in the fixture)."""
    _, specs, results, arts, _ = pipeline_run
    acceptance = results["evaluate"]["acceptance_length"]
    assert 1.0 <= acceptance <= PIPELINE["k"] + 1
    metrics = json.loads((arts["evaluate"] / "metrics.json").read_text())
    assert metrics["acceptance_length"] == acceptance and metrics["prompts"] == PIPELINE["heldout"]
    literal = json.loads((Path(specs[-1]["run_dir"]) / "literal.json").read_text())
    assert literal == {"acceptance_length": acceptance, "steps": metrics["steps"]}


def test_progress_lines_from_many_threads_stay_one_per_line():
    """evaluate reports progress from the threads its requests finish on: every line the harness reads
    must be one whole ``@@progress`` record (two glued into one line were shown raw to the user), and a
    train whose step total is not known ahead reports 0 (no total) until its first epoch has ended."""
    script = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from stages import common
def burst(i):
    for n in range(3000):
        common.progress(n, 3000, f"unit {i}")
        common.log(f"line {i} {n}")
threads = [threading.Thread(target=burst, args=(i,)) for i in range(6)]
[t.start() for t in threads]; [t.join() for t in threads]
import logging
from stages.lib.trainlog import MetricsTap
tap = MetricsTap(0, epochs=3)
lg = logging.getLogger("t"); lg.addHandler(tap); lg.setLevel(logging.INFO); lg.propagate = False
for epoch, steps in enumerate((10, 12, 11)):
    for _ in range(steps):
        lg.info({"train": {"loss": 1.0}, "epoch": epoch, "lr": 1e-3})
"""
    proc = subprocess.run([sys.executable, "-c", script, str(REMOTE)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    progress = [json.loads(line[len("@@progress "):]) for line in lines if line.startswith("@@progress ")]
    assert not [line for line in lines if "@@progress" in line[1:]], "two records on one line"
    assert len(progress) == 6 * 3000 + 33 and len([line for line in lines if line.startswith("line ")]) == 6 * 3000
    steps = progress[-33:]
    assert [p["total"] for p in steps[:10]] == [0] * 10  # the first epoch: no estimate yet
    assert steps[10]["total"] == 30 and steps[-1] == {"done": 33, "total": 33, "unit": "steps"}


def test_a_stage_server_is_stopped_with_its_whole_process_group(tmp_path):
    """A stage hashes its artifacts right after its vLLM server stops, and the server's log is one of
    them: vLLM's engine process outlives the API server by a moment and writes its last lines to that
    log. A stand-in server whose leader exits at once on TERM while its worker takes a second to write
    its farewell: stop() returns only once the worker is gone, its line written (the pull's checksum
    of server.log failed on a 2-core EPYC when stop() returned as soon as the leader had exited)."""
    log = tmp_path / "server.log"
    server = ("(trap 'sleep 1; echo worker done >> \"$0\"; exit 0' TERM; echo worker up >> \"$0\"; "
              "while :; do sleep 0.1; done) & trap 'exit 0' TERM; while :; do sleep 0.1; done")
    code = f"""
import os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from hostcore import group_alive
from stages.lib.vllm_server import VllmServer
server = VllmServer("test", "model", log_path={str(log)!r}, max_model_len=16)
server.proc = subprocess.Popen(["sh", "-c", {server!r}, {str(log)!r}], start_new_session=True)
while not (os.path.exists({str(log)!r}) and "worker up" in open({str(log)!r}).read()):
    time.sleep(0.05)
t0 = time.monotonic()
server.stop(grace=10)
print(round(time.monotonic() - t0, 2), group_alive(server.proc.pid))
"""
    proc = subprocess.run([sys.executable, "-c", code, str(REMOTE)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    took, alive = proc.stdout.split()
    assert log.read_text().splitlines() == ["worker up", "worker done"]  # written before stop() returned
    assert 0.9 <= float(took) < 10 and alive == "False"


def test_train_refuses_a_metric_logger_it_cannot_run_in_one_line(monkeypatch):
    """pipeline.logger is checked before anything loads: a name speculators does not know, a logger whose
    package the host lacks, a logger whose credentials are not in the stage's environment (W&B would wait on
    a login prompt no one sees); TensorBoard, the default, passes where its package is installed."""
    import importlib.util

    from stages.current import train

    train.check_loggers("tensorboard")
    train.check_loggers("")
    with pytest.raises(SystemExit, match=r"^stage train: pipeline.logger 'tensorbord' is not one of .*tensorboard, "
                                         r"wandb, mlflow, trackio\); fix pipeline.logger$"):
        train.check_loggers("tensorboard,tensorbord")
    assert importlib.util.find_spec("mlflow") is None
    with pytest.raises(SystemExit, match=r"pipeline.logger mlflow: the mlflow package is not installed on this host"):
        train.check_loggers("tensorboard, mlflow")
    monkeypatch.setitem(train.LOGGERS, "wandb", ("json", ("WANDB_API_KEY",)))  # an installed stand-in package
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(SystemExit, match=r"pipeline.logger wandb: WANDB_API_KEY is not set on the host; name it in "
                                         r"the inventory's secrets:"):
        train.check_loggers("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "k")
    train.check_loggers("wandb")
