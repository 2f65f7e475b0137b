"""Stage extract: the target's hidden states at the capture layers, one speculators sample file each.

Reads prepare's ``dataset/``; writes ``data/data_{i}.pt`` = ``{"input_ids": (seq,) int64,
"hidden_states": [4 x (seq, hidden) bf16], "loss_mask": (seq,) int64}`` (speculators' data format v1,
read by its ``Eagle3SampleFileDataset``), ``token_freq.pt`` (speculators'
``save_token_frequency_distribution``: assistant-token counts) and ``extract.json`` (layers, sizes).

Layers: ``pipeline.capture_layers`` (default [2, n//2, n-3, n-1]) name decoder layers whose OUTPUT is
captured, pre-norm, exactly what speculators' VllmHiddenStatesGenerator stores (see stages/__init__).

Backends (``pipeline.backend``):
* ``hf``: a transformers forward through the decoder only (no lm_head: its logits are not needed), with
  forward hooks on the capture layers; batches of ``pipeline.batch_size`` similar-length samples,
  right-padded (causal attention never lets a real token see the padding after it); the tokens all
  samples of a batch start with (the chat template's system prompt) run once, the rest on their cache.
* ``vllm``: speculators' VllmHiddenStatesGenerator (patched for the host's vLLM), tensor parallel over
  ``pipeline.tensor_parallel`` GPUs; a sample whose hidden-state rows are not its token count stops
  the stage (never saved short).

Each sample is saved with only its own bytes (tensors cloned out of the batch: a view would drag the
whole batch's storage into the file) and atomically (temp file + rename), so after an interruption a
rerun of the same run resumes with the samples not yet written.
"""
import os
from pathlib import Path

from stages import common
from stages.lib.batching import right_padded
from stages.lib.capture import HfCapture

STAGE = "extract"
READS = ("prepare",)         # the stages whose artifacts this one reads: prepare's dataset/
GPU = True                   # runs the target
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "capture_layers": None,        # 4 decoder layers whose output is captured; unset: [2, n//2, n-3, n-1]
    "backend": "hf",               # hf (transformers forward with hooks) or vllm (speculators' generator)
    "batch_size": 8,               # samples per forward
    "max_seq_len": 512,            # the longest sample (vllm: its max_model_len is this + 1)
    "tensor_parallel": 1,          # vllm: GPUs the target is split over
    "gpu_memory_utilization": 0.8,  # vllm: the fraction of each GPU's memory it may take
}


def save_sample(path: Path, input_ids, hidden_states, loss_mask):
    import torch

    sample = {
        "input_ids": input_ids.to(torch.long).clone(),
        # copy=True: a new tensor holding exactly this sample's rows (one conversion, never a view)
        "hidden_states": [h.to(torch.bfloat16, copy=True) for h in hidden_states],
        "loss_mask": loss_mask.to(torch.long).clone(),
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(sample, tmp)
    os.replace(tmp, path)


def batches(dataset, todo: list[int], batch_size: int):
    """``(indices, rows, input_ids)`` batches of similar-length samples, ``right_padded``."""
    todo = sorted(todo, key=lambda i: len(dataset[i]["input_ids"]))
    for start in range(0, len(todo), batch_size):
        index = todo[start:start + batch_size]
        rows = [dataset[i] for i in index]
        yield index, rows, right_padded([r["input_ids"] for r in rows])


def write_samples(capture: HfCapture, dataset, todo: list[int], out: Path, batch_size: int, dev: str):
    done = len(dataset) - len(todo)
    for index, rows, batch in batches(dataset, todo, batch_size):
        states = capture(batch.to(dev))
        for b, (i, r) in enumerate(zip(index, rows)):
            n = len(r["input_ids"])
            save_sample(out / f"data_{i}.pt", r["input_ids"], [h[b, :n].cpu() for h in states], r["loss_mask"])
        done += len(rows)
        common.progress(done, len(dataset), "samples")


def extract_hf(spec, cfg, dataset, todo, layers, out, model_path):
    dev = common.device(cfg)
    model = common.load_model(spec, model_path, dev, common.compute_dtype(cfg, dev))
    write_samples(HfCapture(model, layers), dataset, todo, out, cfg.batch_size, dev)


def extract_vllm(spec, cfg, dataset, todo, layers, out, model_path):
    from stages.lib import vllm_engine

    common.require_vllm(STAGE)
    generator = vllm_engine.hidden_states_generator(
        model_path, layers, max_model_len=cfg.max_seq_len + 1,  # it keeps len(prompt) + 1 <= max
        tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization)
    batch_size = cfg.batch_size
    done = len(dataset) - len(todo)
    try:
        for start in range(0, len(todo), batch_size):
            index = todo[start:start + batch_size]
            rows = [dataset[i] for i in index]
            try:
                states = vllm_engine.hidden_states(generator, [r["input_ids"].tolist() for r in rows])
            except vllm_engine.ShortStates as e:  # a sample is never saved short
                common.fail(STAGE, f"sample {index[e.args[1]]}: {e.args[0]}")
            for i, r, hidden in zip(index, rows, states):
                save_sample(out / f"data_{i}.pt", r["input_ids"], hidden, r["loss_mask"])
            done += len(rows)
            common.progress(done, len(dataset), "samples")
    finally:
        vllm_engine.close(generator)


def main(spec: dict) -> dict:
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import save_token_frequency_distribution
    from transformers import AutoConfig

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)
    data = out / "data"
    data.mkdir(exist_ok=True)
    dataset = load_from_disk(str(common.input_dir(spec, "prepare") / "dataset"))
    dataset.set_format("torch")

    model_path = common.model_dir(spec)
    config = common.text_config(AutoConfig.from_pretrained(model_path, **common.hub_kwargs(spec)))
    layers = common.capture_layers(cfg.capture_layers, config.num_hidden_layers, STAGE)

    todo = [i for i in range(len(dataset)) if not (data / f"data_{i}.pt").is_file()]
    if len(todo) < len(dataset):
        common.log(f"resuming: {len(dataset) - len(todo)} of {len(dataset)} samples already written")
    backend = cfg.backend
    if todo:
        (extract_vllm if backend == "vllm" else extract_hf)(spec, cfg, dataset, todo, layers, data, model_path)

    freq = out / "token_freq.pt"
    freq.unlink(missing_ok=True)  # speculators' function keeps an existing file; count this dataset
    save_token_frequency_distribution(dataset, str(freq))

    tokens = sum(len(x) for x in dataset["input_ids"])
    meta = {
        "capture_layers": layers,
        "eagle_aux_hidden_state_layer_ids": common.vllm_aux_layer_ids(layers),
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "samples": len(dataset),
        "tokens": tokens,
        "backend": backend,
        "dtype": "bfloat16",
        "format": "speculators data v1",
    }
    common.write_json(out / "extract.json", meta)
    hidden_bytes = tokens * len(layers) * config.hidden_size * 2
    return {"samples": len(dataset), "tokens": tokens, "extracted": len(todo), "layers": layers,
            "hidden_state_bytes": hidden_bytes, "backend": backend, "seconds": timer(),
            # the hidden states stay on the host unless a pull asks for them (inv pull --all)
            "intermediates": ["data/data_*.pt"]}


if __name__ == "__main__":
    common.cli(main)
