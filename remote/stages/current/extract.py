"""Stage extract (speculators 0.5+): the target's hidden states through vLLM's extract_hidden_states.

Reads prepare's ``dataset/``. Starts a vLLM server for the target on the host with the speculative and
KV-transfer configs speculators documents for offline data (method ``extract_hidden_states``, the
``ExampleHiddenStatesConnector`` writing safetensors files; stages/lib/vllm_server.py), and runs
``speculators generate-offline-data`` against it: one ``max_tokens=1`` completion per sample, its
hidden states moved to ``hidden_states/hs_{i}.safetensors`` = ``{"hidden_states": (seq, L, hidden),
"token_ids": (seq,)}``, checked by speculators (``--validate-outputs``: token ids equal the sample's, rows
equal tokens, finite values). The states are in the server's dtype (common.vllm_dtype: float32 on a CPU
that only emulates bf16, else the model's), which extract.json records.

Layers, in vLLM's convention (id i: the input of decoder layer i, i.e. the output of layer i-1; id n:
the last layer's output): ``pipeline.target_layer_ids`` (default speculators' [2, n//2, n-3]) feed the
draft, and n is always captured after them for the training targets. The checkpoint lists the same
``target_layer_ids``, so a vLLM server gives the draft exactly the layers it was trained on.

With ``pipeline.online`` nothing is extracted here: the stage records the layers, and train asks a
vLLM server of its own for each sample's states as it reads the sample (speculators' online mode).

Sharded (a multi-host job, ``spec.cluster``): host ``rank`` of ``size`` extracts its shard of the samples,
as speculators' own multi-node generation splits them (``--world-size``/``--rank``: contiguous chunks that
differ by at most one sample), and checks only those; the shards together are the whole dataset, each
with its own SHA256SUMS, and train reads them all (harness/cluster.py copies each to every node).

Resumable: speculators skips the files already written and regenerates the ones that do not open;
the stage then checks every sample's file (its header: rows equal tokens) before it succeeds, and a
sample left without one stops the stage naming it.
"""
from stages import common
from stages.lib.vllm_server import VllmServer, extract_configs, server_dtype, speculators_cli

STAGE = "extract"
READS = ("prepare",)         # the stages whose artifacts this one reads: prepare's dataset/
GPU = True                   # runs the target
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "target_layer_ids": None,      # vLLM layer ids fed to the draft; unset: speculators' [2, n//2, n-3]
    "max_seq_len": 512,            # the longest sample (the server's max_model_len is this + 1)
    "concurrency": 64,             # requests in flight to the target's vLLM server
    "tensor_parallel": 1,          # GPUs the target is split over
    "gpu_memory_utilization": 0.8,  # the fraction of each GPU's memory vLLM may take
    "online": False,               # train reads the hidden states from a live vLLM instead: store none here
}


def target_layer_ids(layer_ids, num_layers: int) -> list[int]:
    """The draft's layers (vLLM ids), checked: distinct, ascending, within 0..num_layers-1."""
    layer_ids = list(layer_ids or [2, num_layers // 2, num_layers - 3])
    if (len(layer_ids) != 3 or sorted(set(layer_ids)) != layer_ids
            or not all(0 <= i < num_layers for i in layer_ids)):
        common.fail(STAGE, f"pipeline.target_layer_ids {layer_ids}: EAGLE-3 takes 3 distinct ascending layer ids "
                           f"within 0..{num_layers - 1} (the model has {num_layers} layers); fix pipeline.target_layer_ids")
    return layer_ids


def rows_of(path) -> int | None:
    """The number of hidden-state rows in an ``hs_i.safetensors`` (its header only), None if unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.get_slice("hidden_states").get_shape()[0]
    except Exception:  # a truncated or foreign file: safetensors' header checks say so
        return None


def stored_dtype(path) -> str | None:
    """The dtype of an ``hs_i.safetensors``'s hidden states (its header only), as torch names it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(f.get_slice("hidden_states").get_dtype())
    except Exception:
        return None


def config_dtype(config) -> str:
    """The model's own dtype (what vLLM serves it in when told nothing)."""
    return str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16").removeprefix("torch.")


def main(spec: dict) -> dict:
    from datasets import load_from_disk
    from transformers import AutoConfig

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)
    hidden = out / "hidden_states"
    dataset_dir = common.input_dir(spec, "prepare") / "dataset"
    dataset = load_from_disk(str(dataset_dir))

    model_path = common.model_dir(spec)
    config = common.text_config(AutoConfig.from_pretrained(model_path, **common.hub_kwargs(spec)))
    n = config.num_hidden_layers
    layers = target_layer_ids(cfg.target_layer_ids, n)
    captured = [*layers, n]  # the last one: the verifier's last hidden state, the training targets

    if cfg.online:  # the trainer asks its own extract server for each sample's states: nothing stored
        common.log("pipeline.online: no hidden states stored; train generates them from a live vLLM server")
        tokens = sum(len(x) for x in dataset["input_ids"])
        common.write_json(out / "extract.json", {
            "target_layer_ids": layers, "captured_layer_ids": captured, "eagle_aux_hidden_state_layer_ids": layers,
            "num_hidden_layers": n, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "samples": len(dataset), "tokens": tokens, "backend": "vllm", "online": True,
            "dtype": server_dtype(cfg) or config_dtype(config),
            "format": "online: streamed from vLLM's extract_hidden_states to the trainer, not stored"})
        common.progress(len(dataset), len(dataset), "samples")
        return {"samples": len(dataset), "tokens": tokens, "extracted": 0, "layers": captured, "online": True,
                "hidden_state_bytes": 0, "backend": "vllm", "seconds": timer()}

    node = common.cluster(spec)
    shard = list(range(len(dataset)))
    if node["size"] > 1:  # this host's samples, as speculators' generate-offline-data picks them
        from speculators.data_generation.offline import get_indices_to_process

        shard = get_indices_to_process(len(dataset), None, [], node["size"], node["rank"])
        common.log(f"shard {node['rank']} of {node['size']}: samples {shard[0]}..{shard[-1]}" if shard
                   else f"shard {node['rank']} of {node['size']}: no samples")
    # what a rerun finds: speculators skips the readable files and regenerates the rest
    before = sum(rows_of(p) is not None for p in hidden.glob("hs_*.safetensors")) if hidden.is_dir() else 0
    if before:
        common.log(f"resuming: {before} of {len(shard)} samples have a readable file already")
    staging = out / ".staging"  # where vLLM writes: the same file system, so speculators' move is a rename
    with VllmServer(STAGE, model_path, log_path=out / "server.log", max_model_len=cfg.max_seq_len + 1,
                    tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization,
                    trust_remote_code=bool(spec["model"].get("trust_remote_code")), dtype=server_dtype(cfg),
                    extra_args=extract_configs(captured, staging)) as server:
        def files_written():
            common.progress(len(list(hidden.glob("hs_*.safetensors"))) if hidden.is_dir() else 0, len(shard),
                            "samples")

        speculators_cli(STAGE, ["generate-offline-data", "--model", server.name, "--endpoint", f"{server.url}/v1",
                                "--preprocessed-data", str(dataset_dir), "--output", str(hidden),
                                "--concurrency", str(cfg.concurrency), "--validate-outputs", "--fail-on-error",
                                "--world-size", str(node["size"]), "--rank", str(node["rank"])],
                        progress=files_written)

    tokens, stored = 0, None
    for i in shard:  # never a sample of this shard short or missing
        want, got = len(dataset[i]["input_ids"]), rows_of(hidden / f"hs_{i}.safetensors")
        if got != want:
            common.fail(STAGE, f"sample {i}: hs_{i}.safetensors has {'no readable file' if got is None else f'{got} rows'} "
                               f"for {want} tokens; run the stage again (it regenerates what is missing)")
        tokens += want
        stored = stored or stored_dtype(hidden / f"hs_{i}.safetensors")

    meta = {
        "target_layer_ids": layers,
        "captured_layer_ids": captured,
        "eagle_aux_hidden_state_layer_ids": layers,
        "num_hidden_layers": n,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "samples": len(shard),
        "tokens": tokens,
        "dataset_samples": len(dataset),
        "shard": {"rank": node["rank"], "size": node["size"], "first": shard[0] if shard else None,
                  "end": shard[-1] + 1 if shard else None},
        "backend": "vllm",
        "dtype": stored or server_dtype(cfg) or config_dtype(config),
        "format": "speculators 0.5+ hidden states (hidden_states/hs_{i}.safetensors)",
    }
    common.write_json(out / "extract.json", meta)
    hidden_bytes = tokens * len(captured) * config.hidden_size * (4 if meta["dtype"] == "float32" else 2)
    return {"samples": len(shard), "tokens": tokens, "extracted": len(shard) - before, "layers": captured,
            "shard": f"{node['rank'] + 1}/{node['size']}",
            "hidden_state_bytes": hidden_bytes, "backend": "vllm", "seconds": timer(),
            # the hidden states stay on the host unless a pull asks for them (inv pull --all)
            "intermediates": ["hidden_states/hs_*.safetensors", ".staging/*"]}


if __name__ == "__main__":
    common.cli(main)
