"""Stage prepare: conversations -> chat-templated token ids with assistant-only loss masks.

Reads ``pipeline.dataset`` (stages/lib/conversations.py: one source or several mixed by weight: built-in
sets, a file on the host, a hub id; ShareGPT, OpenAI or bare prompts), shuffles with ``pipeline.seed``
and keeps ``pipeline.samples`` conversations for training plus ``pipeline.heldout`` others whose prompts
only go to evaluate (never trained on), each labelled with its source's category.

With ``pipeline.regenerate`` every assistant turn is rewritten by the target itself (greedy, batched,
``pipeline.max_new_tokens`` per turn; with ``pipeline.backend: vllm`` through vLLM, never a transformers
load of the whole target): the draft then learns the distribution it will have to guess
at serving time, not a third party's. Tokenisation and loss masks are speculators' own
``build_eagle3_dataset`` (the tokenizer's chat template; mask = assistant content only), truncated
to ``pipeline.max_seq_len``.

Outputs: ``dataset/`` (datasets.save_to_disk: input_ids, loss_mask), ``conversations.jsonl`` (the
text trained on, regenerated where asked), ``heldout.jsonl`` (prompts for evaluate).
"""
import json

from stages import common
from stages.lib import conversations
from stages.lib.generation import generate

STAGE = "prepare"
READS = ()                   # the stages whose artifacts this one reads: none, it starts the pipeline
GPU = True                   # regenerating the replies runs the target
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
    "batch_size": 8,               # prompts generated together (hf; vLLM schedules its own batches)
    "backend": "hf",               # hf: transformers generates; vllm: vLLM's offline engine does
    "tensor_parallel": 1,          # vllm: GPUs the target is split over
    "gpu_memory_utilization": 0.8,  # vllm: the fraction of each GPU's memory it may take
}


def regenerate(conversations: list[list[dict]], complete, tokenizer, cfg: common.Settings) -> list[list[dict]]:
    """Rewrite every assistant turn with the target's own greedy continuation, one turn index at a time
    over all conversations (turn r sees the regenerated turns before it). ``complete(prompts, max_new)``
    is the target's greedy generation (transformers batches by prompt length; vLLM takes a whole turn
    index at once and schedules it itself)."""
    max_new, budget, batch_size = cfg.max_new_tokens, cfg.max_seq_len - cfg.max_new_tokens, cfg.batch_size
    prompts = [[t for t in conv if t["role"] != "assistant"] for conv in conversations]
    user_turns = [[i for i, t in enumerate(p) if t["role"] == "user"] for p in prompts]
    out, taken, stopped = [[] for _ in prompts], [0] * len(prompts), set()
    total, done = sum(len(u) for u in user_turns), 0
    for r in range(max((len(u) for u in user_turns), default=0)):
        todo = []
        for c, turns in enumerate(user_turns):
            if r >= len(turns) or c in stopped:
                continue
            history = out[c] + prompts[c][taken[c]:turns[r] + 1]  # system/user turns up to user turn r
            text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > budget:  # no room left for a reply: the conversation ends before this turn
                stopped.add(c)
                continue
            out[c], taken[c] = history, turns[r] + 1
            todo.append((c, ids))
        todo.sort(key=lambda x: len(x[1]))  # similar lengths together: less padding
        step = batch_size or max(len(todo), 1)  # 0: the whole turn index at once
        for start in range(0, len(todo), step):
            chunk = todo[start:start + step]
            for (c, _), reply in zip(chunk, complete([ids for _, ids in chunk], max_new)):
                text = tokenizer.decode(reply, skip_special_tokens=True).strip()
                out[c].append({"role": "assistant", "content": text})
            done += len(chunk)
            common.progress(done, total, "turns")
    return [conv if conv and conv[-1]["role"] == "assistant" else [] for conv in out]


def main(spec: dict) -> dict:
    from datasets import Dataset

    build_eagle3_dataset = common.data_generation("preprocessing").build_eagle3_dataset

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)

    train, held = conversations.load_split(cfg.dataset, cfg.dataset_split, cfg.samples, cfg.heldout, cfg.seed,
                                           STAGE)

    path = common.model_dir(spec)
    tokenizer = common.load_tokenizer(spec, path)
    if not getattr(tokenizer, "chat_template", None):
        common.fail(STAGE, f"the tokenizer of {path} has no chat template; use an instruct/chat model")

    if cfg.regenerate and cfg.backend == "vllm":
        from stages.lib import vllm_engine

        common.require_vllm(STAGE)
        common.log(f"regenerating {len(train)} conversations with the target in vLLM (greedy, "
                   f"{cfg.max_new_tokens} new tokens, tensor parallel {cfg.tensor_parallel})")
        llm = vllm_engine.TargetLLM(path, max_model_len=cfg.max_seq_len, tensor_parallel=cfg.tensor_parallel,
                                    gpu_memory_utilization=cfg.gpu_memory_utilization,
                                    trust_remote_code=bool(spec["model"].get("trust_remote_code")))
        try:  # batch_size 0: all the prompts of a turn index in one call, vLLM schedules them
            train = regenerate(train, llm, tokenizer, common.Settings({**cfg, "batch_size": 0}))
        finally:
            llm.close()
    elif cfg.regenerate:
        dev = common.device(cfg)
        model = common.load_model(spec, path, dev, common.compute_dtype(cfg, dev))
        common.log(f"regenerating {len(train)} conversations with the target (greedy, batch "
                   f"{cfg.batch_size}, {cfg.max_new_tokens} new tokens)")
        train = regenerate(train, lambda prompts, max_new: generate(model, tokenizer, prompts, max_new, dev),
                           tokenizer, cfg)
        del model
    train = [conv for conv in train if any(t["role"] == "assistant" and t["content"] for t in conv)]
    if not train:
        common.fail(STAGE, "no conversation has an assistant turn to train on; set pipeline.regenerate: true "
                           "or use a dataset with assistant replies")

    dataset = build_eagle3_dataset(
        Dataset.from_dict({"conversations": train}), tokenizer,
        max_length=cfg.max_seq_len, num_proc=1,
    )
    if len(dataset) == len(train):  # one row per conversation: keep conversations.jsonl aligned
        keep = [i for i, mask in enumerate(dataset["loss_mask"]) if mask.sum() > 0]
        dataset, train = dataset.select(keep), [train[i] for i in keep]
    else:
        dataset = dataset.filter(lambda row: bool(row["loss_mask"].sum() > 0))
    if len(dataset) == 0:
        common.fail(STAGE, "the chat template left no assistant tokens in any sample (loss masks all zero); "
                           "raise pipeline.max_seq_len or check the model's chat template")
    dataset.save_to_disk(str(out / "dataset"))

    conversations.write_messages(out / "conversations.jsonl", train)
    conversations.write_heldout(out / "heldout.jsonl", held)

    tokens = sum(len(x) for x in dataset["input_ids"])
    trained = sum(int(m.sum()) for m in dataset["loss_mask"])
    common.progress(len(dataset), len(dataset), "samples")
    return {"samples": len(dataset), "tokens": tokens, "assistant_tokens": trained, "heldout": len(held),
            "regenerated": cfg.regenerate, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
