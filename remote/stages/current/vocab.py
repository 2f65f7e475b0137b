"""Stage vocab (speculators 0.5+): the draft's vocabulary, the ``pipeline.draft_vocab_size`` most frequent target tokens.

Counts from prepare's ``dataset/token_freq.pt`` (written by ``speculators prepare-data``: assistant
tokens only), the target's vocabulary size from its config.json; the mappings are speculators' own
(stages/lib/vocabulary.py): ``d2t.npy`` / ``t2d.npy`` for ``speculators train``. Beside the training
tokens' coverage, the held-out prompts' (per source of ``pipeline.dataset``: what will be served looks
like them), with a warning below ``pipeline.coverage_warning``; evaluate reports the eval sets' replies.
"""
from stages import common
from stages.lib import conversations, vocabulary

STAGE = "vocab"
READS = ("prepare",)         # the stages whose artifacts this one reads: prepare's dataset/token_freq.pt
GPU = False                  # counting tokens: no model runs
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "draft_vocab_size": 32000,     # the draft's vocabulary: this many of the target's most frequent tokens
    "coverage_warning": 0.8,       # a category whose tokens the draft vocabulary covers less is warned of
}


def main(spec: dict) -> dict:
    import torch
    from transformers import AutoConfig

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)
    freq_path = common.input_dir(spec, "prepare") / "dataset" / "token_freq.pt"
    if not freq_path.is_file():
        common.fail(STAGE, f"{freq_path} is missing (prepare-data writes it); run prepare again")
    freq = torch.load(freq_path, weights_only=True)
    config = common.text_config(AutoConfig.from_pretrained(common.model_dir(spec), **common.hub_kwargs(spec)))

    target_vocab = int(config.vocab_size)
    summary = vocabulary.write_mappings(freq, cfg.draft_vocab_size, target_vocab, out, STAGE)
    held = common.input_dir(spec, "prepare") / "heldout.jsonl"
    if held.is_file():
        tokenizer = common.load_tokenizer(spec, common.model_dir(spec))
        summary["heldout_coverage"] = vocabulary.prompt_coverage(conversations.read_prompts(held), tokenizer,
                                                                 out / "t2d.npy", cfg.coverage_warning)
    return {**summary, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
