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
  ``pipeline.tensor_parallel`` GPUs.

Each sample is saved with only its own bytes (tensors cloned out of the batch: a view would drag the
whole batch's storage into the file) and atomically (temp file + rename), so after an interruption a
rerun of the same run resumes with the samples not yet written.
"""
import os
from pathlib import Path

from stages import common

STAGE = "extract"


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


class HfCapture:
    """Decoder forward with hooks that keep the output of the capture layers (the layers' own output,
    before the final norm; transformers' ``output_hidden_states`` would hold all n+1 states and replace
    the last one with the normed state)."""

    def __init__(self, model, layers: list[int]):
        self.decoder, blocks = common.decoder_layers(model)
        self.layers, self.captured = layers, {}
        self.hooks = [blocks[layer].register_forward_hook(self._hook(layer)) for layer in layers]

    def _hook(self, layer):
        def keep(_module, _args, output):
            self.captured[layer] = output[0] if isinstance(output, tuple) else output
        return keep

    def __call__(self, input_ids):
        """Captured states ``[rows, seq, hidden]`` per layer. The leading tokens every row shares (a chat
        template's system prompt: a quarter of the default's tokens) run once, and the rest of each row
        runs on their KV cache: the same states, in a quarter less time."""
        import torch

        rows = input_ids.shape[0]
        shared = common.shared_prefix(input_ids.tolist())
        self.captured = {}
        with torch.inference_mode():
            if not shared:
                self.decoder(input_ids=input_ids, use_cache=False)
                return [self.captured[layer] for layer in self.layers]
            cache = self.decoder(input_ids=input_ids[:1, :shared], use_cache=True).past_key_values
            prefix = [self.captured[layer].expand(rows, -1, -1) for layer in self.layers]
            cache.batch_repeat_interleave(rows)
            self.decoder(input_ids=input_ids[:, shared:], past_key_values=cache, use_cache=True)
            return [torch.cat([p, self.captured[layer]], dim=1) for p, layer in zip(prefix, self.layers)]

    def close(self):
        for hook in self.hooks:
            hook.remove()


def right_padded(sequences) -> "torch.Tensor":
    """Token sequences as one ``[rows, longest]`` batch, right-padded with 0: with causal attention a
    real token never sees the padding after it, so no attention mask is needed."""
    import torch

    batch = torch.zeros((len(sequences), max(len(s) for s in sequences)), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        batch[row, :len(sequence)] = torch.as_tensor(sequence)
    return batch


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


def extract_hf(spec, dataset, todo, layers, out, model_path):
    pipeline = spec["pipeline"]
    dev = common.device(pipeline)
    model = common.load_model(spec, model_path, dev, common.compute_dtype(pipeline, dev))
    write_samples(HfCapture(model, layers), dataset, todo, out, int(pipeline.get("batch_size") or 8), dev)


def extract_vllm(spec, dataset, todo, layers, out, model_path):
    pipeline = spec["pipeline"]
    try:
        import vllm  # noqa: F401  (its absence is the common mistake: say so in one line)
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    except ImportError as e:
        common.fail(STAGE, f"backend vllm needs vLLM on the host ({e}); set pipeline.backend: hf, "
                           "or run inv setup with the gpu profile")
    generator = VllmHiddenStatesGenerator(
        model_path=model_path,
        layer_ids=layers,
        max_model_len=int(pipeline.get("max_seq_len") or 512) + 1,  # it keeps len(prompt) + 1 <= max
        gpu_memory_utilization=float(pipeline.get("gpu_memory_utilization") or 0.8),
        tensor_parallel_size=int(pipeline.get("tensor_parallel") or 1),
    )
    batch_size = int(pipeline.get("batch_size") or 8)
    done = len(dataset) - len(todo)
    for start in range(0, len(todo), batch_size):
        index = todo[start:start + batch_size]
        rows = [dataset[i] for i in index]
        results = generator.generate([r["input_ids"].tolist() for r in rows])
        for i, r, result in zip(index, rows, results):
            n = len(result["input_ids"])
            save_sample(out / f"data_{i}.pt", result["input_ids"], result["hidden_states"], r["loss_mask"][:n])
        done += len(rows)
        common.progress(done, len(dataset), "samples")


def main(spec: dict) -> dict:
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import save_token_frequency_distribution
    from transformers import AutoConfig

    timer = common.Timer()
    pipeline = spec.setdefault("pipeline", {})
    out = common.artifacts(spec)
    data = out / "data"
    data.mkdir(exist_ok=True)
    dataset = load_from_disk(str(common.input_dir(spec, "prepare") / "dataset"))
    dataset.set_format("torch")

    model_path = common.model_dir(spec)
    config = common.text_config(AutoConfig.from_pretrained(model_path, **common.hub_kwargs(spec)))
    layers = common.capture_layers(pipeline, config.num_hidden_layers, STAGE)

    todo = [i for i in range(len(dataset)) if not (data / f"data_{i}.pt").is_file()]
    if len(todo) < len(dataset):
        common.log(f"resuming: {len(dataset) - len(todo)} of {len(dataset)} samples already written")
    backend = pipeline.get("backend") or "hf"
    if todo:
        (extract_vllm if backend == "vllm" else extract_hf)(spec, dataset, todo, layers, data, model_path)

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
