"""Stage evaluate: acceptance length of the trained draft against the target on held-out prompts.

Greedy chain speculative decoding with ``pipeline.k`` draft tokens per step: the target verifies the
chain, the longest prefix equal to the target's own greedy tokens is accepted, and the target adds one
token of its own; acceptance length = mean(accepted + 1) over steps (1.0: the draft never helps).

Offline, with transformers, computed exactly but without a step loop. Greedy verification makes the
output the target's greedy continuation whatever the draft proposes, so: (1) generate that
continuation once per prompt; (2) one target forward over prompt + continuation gives the captured
hidden states at every position (a batch of prompts at a time, as extract does); (3) one draft
forward (speculators' own, ``ttt_steps = k``) gives at every position j the chain of k tokens the
draft proposes when j is the last verified position: at TTT step s, position j attends to the
verified positions <= j and to its own earlier steps only, which is what the draft sees at serving
time; (4) walk the continuation: from position t, accept the proposals of t-1 that match, jump by
accepted + 1. tests/test_stages.py checks this against a literal step-by-step loop.

Held-out prompts come from prepare's ``heldout.jsonl`` (never trained on); the continuation is
``pipeline.max_new_tokens`` long at most. The target runs where the backend says: ``hf`` loads it with
transformers (small targets); ``vllm`` never does (a 1T target exists only inside vLLM): steps (1) and
(2) go through vLLM's offline engine and speculators' generator (stages/lib/vllm_engine), and only the
draft runs in torch. With ``pipeline.vllm_spec_decode`` the prompts also go through vLLM with the
checkpoint as its EAGLE-3 speculative model, and vLLM's own counters give ``vllm_acceptance_length``.

Output: ``metrics.json`` (acceptance_length, per-position acceptance rates, steps, tokens).
"""
import json

from stages import common
from stages.lib.acceptance import summary, walk
from stages.lib.batching import right_padded
from stages.lib.capture import HfCapture
from stages.lib.generation import generate

STAGE = "evaluate"
READS = ("prepare", "extract", "train")  # prepare's heldout.jsonl, extract's capture layers, train's checkpoint
GPU = True                   # runs the target and the draft
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "k": 3,                        # draft tokens per speculative step
    "max_new_tokens": 128,         # the longest continuation of a held-out prompt
    "max_seq_len": 512,            # vllm: its max_model_len is this + max_new_tokens
    "batch_size": 8,               # prompts generated and captured together
    "backend": "hf",               # hf: the target in transformers; vllm: continuations and states from vLLM
    "tensor_parallel": 1,          # vllm: GPUs the target is split over
    "gpu_memory_utilization": 0.8,  # vllm: the fraction of each GPU's memory it may take
    "vllm_spec_decode": False,     # also run vLLM with the draft as its EAGLE-3 speculator, read its counters
    "compile": None,               # torch.compile the draft; unset: only on CUDA
}


def load_draft(checkpoint):
    """The trained draft from its directory with speculators' own config class and checkpoint reader.

    (``SpeculatorModel.from_pretrained`` in speculators 0.3.0 passes ``verifier=`` on to
    ``Eagle3DraftModel.__init__``, which does not take it; the trainer's checkpointer path works.)
    """
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.train.checkpointer import load_safetensors_state_dict

    config = Eagle3SpeculatorConfig.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = "simple_flex_attention"  # noqa: SLF001  (not saved)
    weights = load_safetensors_state_dict(checkpoint / "model.safetensors", "cpu")
    model = Eagle3DraftModel(config=config, t2d=weights["t2d"], d2t=weights["d2t"])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed = set(model._keys_to_ignore_on_load_missing)  # noqa: SLF001  (verifier parts, rebuilt)
    if unexpected or set(missing) - allowed:
        raise SystemExit(f"stage {STAGE}: checkpoint {checkpoint} does not match its config "
                         f"(missing {sorted(set(missing) - allowed)}, unexpected {unexpected}); train again")
    return model.eval()


def draft_chains(draft, states, input_ids, k: int):
    """For every position j < n-1: the k target-vocabulary tokens the draft proposes after x_{j+1}.

    The inputs are aligned exactly as speculators' training data (its ``shift_batch``): hidden state
    of position j with token j+1, positions numbered from 1.
    """
    import torch

    n = input_ids.shape[0]
    aux = torch.cat(states[:3], dim=-1).to(torch.bfloat16).float()  # as stored for training
    with torch.inference_mode():
        tokens = draft(
            hidden_states=aux[:-1].unsqueeze(0).to(draft.fc.weight.device),
            input_ids=input_ids[1:].unsqueeze(0),
            lengths=torch.tensor([n - 1], device=input_ids.device),
            position_ids=torch.arange(1, n, device=input_ids.device).unsqueeze(0),
            ttt_steps=k,
        )
    chains = torch.stack([t[0] + draft.d2t[t[0]] for t in tokens], dim=-1)  # draft -> target ids
    return chains.tolist()  # chains[j][s]: proposal for x_{j+2+s}


def along_hf(spec, cfg, model_path, tokenizer, prompts, layers, dev):
    """``(prompt, prompt + greedy continuation, captured states)`` per prompt, with transformers: a
    batch of prompts generated, then captured in one forward."""
    target = common.load_model(spec, model_path, dev, common.compute_dtype(cfg, dev))
    capture = HfCapture(target, layers)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), cfg.batch_size):
        chunk = [prompts[i] for i in order[start:start + cfg.batch_size]]
        sequences = [p + reply for p, reply in zip(chunk, generate(target, tokenizer, chunk, cfg.max_new_tokens, dev))]
        batch = right_padded(sequences).to(dev)
        states = capture(batch)
        for row, (prompt, sequence) in enumerate(zip(chunk, sequences)):
            yield prompt, sequence, [h[row, :len(sequence)] for h in states]
        common.progress(min(start + cfg.batch_size, len(order)), len(order), "prompts")


def along_vllm(spec, cfg, model_path, tokenizer, prompts, layers, dev):
    """The same through vLLM, never a transformers load of the target: the continuations from vLLM's
    offline engine (all prompts in one call), then that engine freed and the states along each
    sequence from speculators' generator (the extract stage's, same layers, same patches)."""
    from stages.lib import vllm_engine

    common.require_vllm(STAGE)
    max_len = cfg.max_seq_len + cfg.max_new_tokens
    llm = vllm_engine.TargetLLM(model_path, max_model_len=max_len, tensor_parallel=cfg.tensor_parallel,
                                gpu_memory_utilization=cfg.gpu_memory_utilization,
                                trust_remote_code=bool(spec["model"].get("trust_remote_code")))
    try:
        sequences = [p + reply for p, reply in zip(prompts, llm(prompts, cfg.max_new_tokens))]
    finally:
        llm.close()
    generator = vllm_engine.hidden_states_generator(model_path, layers, max_model_len=max_len + 1,
                                                    tensor_parallel=cfg.tensor_parallel,
                                                    gpu_memory_utilization=cfg.gpu_memory_utilization)
    try:
        for start in range(0, len(sequences), cfg.batch_size):
            chunk = list(range(start, min(start + cfg.batch_size, len(sequences))))
            try:
                states = vllm_engine.hidden_states(generator, [sequences[i] for i in chunk])
            except vllm_engine.ShortStates as e:
                common.fail(STAGE, f"held-out prompt {chunk[e.args[1]]}: {e.args[0]}")
            for i, hidden in zip(chunk, states):
                yield prompts[i], sequences[i], hidden
            common.progress(chunk[-1] + 1, len(sequences), "prompts")
    finally:
        vllm_engine.close(generator)


def evaluate_vllm(spec, cfg, model_path, checkpoint, prompts, k) -> dict:
    """vLLM's own acceptance counters with the checkpoint as EAGLE-3 speculative model."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, trust_remote_code=bool(spec["model"].get("trust_remote_code")),
              tensor_parallel_size=cfg.tensor_parallel,
              max_model_len=cfg.max_seq_len + cfg.max_new_tokens,
              speculative_config={"method": "eagle3", "model": str(checkpoint), "num_speculative_tokens": k},
              disable_log_stats=False)  # get_metrics() needs the stat loggers (LLM turns them off)
    llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                 SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens))
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"vllm_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
            "vllm_drafts": drafts, "vllm_accepted_tokens": accepted}


def main(spec: dict) -> dict:
    import torch

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)
    prepared, extracted = common.input_dir(spec, "prepare"), common.input_dir(spec, "extract")
    checkpoint = common.input_dir(spec, "train") / "checkpoint"
    layers = json.loads((extracted / "extract.json").read_text())["capture_layers"]
    k = cfg.k
    dev = common.device(cfg)
    if not (dev.startswith("cuda") if cfg.compile is None else cfg.compile):
        torch.compiler.set_stance("force_eager")  # see stages/train.py

    heldout = [json.loads(line)["messages"] for line in (prepared / "heldout.jsonl").read_text().splitlines()]
    if not heldout:
        common.fail(STAGE, "no held-out prompts (pipeline.heldout is 0); set pipeline.heldout and run prepare again")

    model_path = common.model_dir(spec)
    tokenizer = common.load_tokenizer(spec, model_path)
    draft = load_draft(checkpoint).to(dev)
    prompts = [tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for m in heldout]
    along = along_vllm if cfg.backend == "vllm" else along_hf
    accepted, generated = [], 0
    for prompt, sequence, states in along(spec, cfg, model_path, tokenizer, prompts, layers, dev):
        ids = torch.tensor(sequence, device=dev)
        chains = draft_chains(draft, [h.to(dev) for h in states], ids, k)
        accepted += walk(sequence, chains, len(prompt), k)
        generated += len(sequence) - len(prompt)

    metrics = {**summary(accepted, k), "prompts": len(prompts), "generated_tokens": generated}
    metrics["measured_with"] = "vllm" if cfg.backend == "vllm" else "transformers"
    if cfg.vllm_spec_decode:
        common.require_vllm(STAGE)
        metrics.update(evaluate_vllm(spec, cfg, model_path, checkpoint, prompts, k))
    common.write_json(out / "metrics.json", metrics)
    return {**metrics, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
