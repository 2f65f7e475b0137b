"""Stage prepare (speculators 0.5+): conversations -> on-policy token ids and loss masks, with speculators' CLI.

Reads ``pipeline.dataset`` (stages/lib/conversations.py: one source or several mixed by weight: built-in
sets, a file on the host such as a sample of your own traffic, a hub id), shuffles with ``pipeline.seed``
and keeps ``pipeline.samples`` conversations for training plus ``pipeline.heldout`` others whose prompts
only go to evaluate (never trained on), each labelled with its source's category.

Then, with a vLLM server for the target started by this stage on the host (stages/lib/vllm_server.py):

* ``pipeline.regenerate`` (default): ``speculators regenerate-responses`` rewrites every assistant turn
  with the target's own greedy reply (``pipeline.max_new_tokens`` tokens, ``pipeline.concurrency``
  requests in flight) and writes one boundary row per turn: the prompt as the server rendered it
  (loss mask 0) + the reply's own token ids (loss mask 1). Resumable: a rerun keeps the rows written.
* otherwise ``speculators prepare-data`` renders the dataset's own replies through the server's
  ``/v1/chat/completions/render`` and derives the masks from the render boundaries.

``speculators prepare-data`` then writes the Arrow dataset (``input_ids``, ``loss_mask``, truncated to
``pipeline.max_seq_len``) and ``token_freq.pt``. The target's tokenizer runs custom code only when the
inventory opts in (``model.trust_remote_code``).

Outputs: ``dataset/`` (speculators' prepared dataset + token_freq.pt), ``regenerated.jsonl`` (the
boundary rows, when regenerated), ``heldout.jsonl`` (prompts for evaluate), ``server.log``.
"""
import json

from stages import common
from stages.lib import conversations
from stages.lib.vllm_server import VllmServer, server_dtype, speculators_cli

STAGE = "prepare"
READS = ()                   # the stages whose artifacts this one reads: none, it starts the pipeline
GPU = True                   # the target runs in vLLM
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "dataset": {                   # {source: weight} or one source: builtin:<name> (stages/data/<name>.jsonl),
        "builtin:chat": 30,        # a .jsonl/.json/.parquet on the host (your traffic sample: prompts alone
        "builtin:code": 20,        # will do, the target writes the replies), a hub id; each source gives its
        "builtin:math": 15,        # share of samples and heldout, and names the category evaluate reports
        "builtin:writing": 12,
        "builtin:extraction": 8,
        "builtin:multilingual": 8,
        "builtin:multiturn": 7,
    },
    "dataset_split": "train",      # the split of a hub dataset
    "samples": 64,                 # conversations kept for training
    "heldout": 16,                 # other conversations whose prompts only evaluate sees
    "seed": 0,                     # the shuffle before samples and heldout are taken
    "regenerate": True,            # rewrite every assistant turn with the target's own greedy reply
    "max_new_tokens": 128,         # tokens per regenerated reply
    "max_seq_len": 512,            # tokens per sample (prompt + reply), longer ones truncated
    "concurrency": 64,             # requests in flight to the target's vLLM server
    "tensor_parallel": 1,          # GPUs the target is split over
    "gpu_memory_utilization": 0.8,  # the fraction of each GPU's memory vLLM may take
}


def main(spec: dict) -> dict:
    from datasets import load_from_disk

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)

    train, held = conversations.load_split(cfg.dataset, cfg.dataset_split, cfg.samples, cfg.heldout, cfg.seed,
                                           STAGE)
    conversations.write_heldout(out / "heldout.jsonl", held)
    source = out / "conversations.in.jsonl"
    conversations.write_messages(source, train)

    model_path = common.model_dir(spec)
    trust = bool(spec["model"].get("trust_remote_code"))
    dataset_dir = out / "dataset"
    regenerated = out / "regenerated.jsonl"
    with VllmServer(STAGE, model_path, log_path=out / "server.log", max_model_len=cfg.max_seq_len,
                    tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization,
                    trust_remote_code=trust, dtype=server_dtype(cfg)) as server:
        if cfg.regenerate:
            def rows_written():
                n = sum(1 for _ in open(regenerated)) if regenerated.exists() else 0
                common.progress(n, len(train), "conversations")

            # greedy, as the target serves by default; --resume keeps the rows of an interrupted run
            speculators_cli(STAGE, ["regenerate-responses", "--endpoint", f"{server.url}/v1/chat/completions",
                                    "--model", server.name, "--dataset", str(source),
                                    "--max-tokens", str(cfg.max_new_tokens), "--concurrency", str(cfg.concurrency),
                                    "--sampling-params", json.dumps({"temperature": 0.0}),
                                    "--outfile", str(regenerated), "--resume"], progress=rows_written)
            data, render = regenerated, []
        else:
            data, render = source, ["--render-endpoint", server.url]
        # the dataset (and its token frequencies) from the rows: speculators' own loss masks and format
        speculators_cli(STAGE, ["prepare-data", "--model", model_path, "--data", str(data),
                                "--output", str(dataset_dir), "--seq-length", str(cfg.max_seq_len),
                                "--seed", str(cfg.seed), "--no-skip-token-freq", "--overwrite", *render,
                                *(["--trust-remote-code"] if trust else [])])

    dataset = load_from_disk(str(dataset_dir))
    if len(dataset) == 0:
        common.fail(STAGE, "no sample has an assistant token to train on; raise pipeline.max_seq_len or check the "
                           "dataset's replies (or set pipeline.regenerate: true)")
    tokens = sum(len(x) for x in dataset["input_ids"])
    trained = sum(int(sum(m)) for m in dataset["loss_mask"])  # an int, not a tensor, in result.json
    common.progress(len(dataset), len(dataset), "samples")
    return {"samples": len(dataset), "conversations": len(train), "tokens": tokens, "assistant_tokens": trained,
            "heldout": len(held), "regenerated": cfg.regenerate, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
