"""Greedy generation with the target: prepare's regenerated replies, evaluate's held-out continuations."""
from stages.lib.batching import shared_prefix


def generate(model, tokenizer, prompts: list[list[int]], max_new: int, dev: str) -> list[list[int]]:
    """Greedy continuations of a batch of tokenised prompts, up to and including EOS.

    The tokens every prompt starts with (a chat template's system prompt: two thirds of the default's
    prompt tokens) are prefilled once and their KV cache shared by the batch. Each row is laid out as
    [shared tokens, padding, own tokens]: the attention mask hides the padding and transformers counts
    positions over real tokens only, so every row decodes as if alone.
    """
    import torch

    shared = shared_prefix(prompts)
    width = shared + max(len(ids) - shared for ids in prompts)
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        own = len(ids) - shared
        input_ids[row, :shared], input_ids[row, width - own:] = torch.tensor(ids[:shared]), torch.tensor(ids[shared:])
        mask[row, :shared], mask[row, width - own:] = 1, 1
    with torch.inference_mode():
        cache = {}
        if shared:
            cache["past_key_values"] = model(input_ids=input_ids[:1, :shared].to(dev), use_cache=True,
                                             logits_to_keep=1).past_key_values
            cache["past_key_values"].batch_repeat_interleave(len(prompts))
        generated = model.generate(
            input_ids=input_ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new,
            do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id,
            **cache,
        )
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops]) | {tokenizer.eos_token_id}
    replies = []
    for row in generated[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        replies.append(row[:end])
    return replies
