"""Stage vocab (speculators 0.5+): the draft's vocabulary, the ``pipeline.draft_vocab_size`` most frequent target tokens.

speculators' ``build_vocab_mappings_from_distribution`` over prepare's ``dataset/token_freq.pt`` (written
by ``speculators prepare-data``: assistant tokens only) gives ``d2t`` (draft index -> offset to the target
id) and ``t2d`` (target id -> is in the draft vocabulary), saved as ``d2t.npy`` / ``t2d.npy`` for
``speculators train``. The target's vocabulary size comes from its config.json. When the data holds
fewer distinct tokens than the draft vocabulary, speculators pads it with the lowest token ids:
allowed, but wasted lm_head rows, so it is reported as a warning.
"""
from stages import common

STAGE = "vocab"
READS = ("prepare",)         # the stages whose artifacts this one reads: prepare's dataset/token_freq.pt
GPU = False                  # counting tokens: no model runs
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "draft_vocab_size": 32000,     # the draft's vocabulary: this many of the target's most frequent tokens
}


def main(spec: dict) -> dict:
    import numpy as np
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
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
    draft_vocab = cfg.draft_vocab_size
    if draft_vocab > target_vocab:
        common.fail(STAGE, f"pipeline.draft_vocab_size {draft_vocab} exceeds the target's vocabulary "
                           f"({target_vocab}); lower pipeline.draft_vocab_size")
    if len(freq) < draft_vocab:
        common.log(f"warning: the data has {len(freq)} distinct assistant tokens, fewer than "
                   f"pipeline.draft_vocab_size {draft_vocab}; the other {draft_vocab - len(freq)} draft "
                   "tokens are padding (lower draft_vocab_size or add samples)")

    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab, target_vocab)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())

    total = sum(freq.values())
    covered = sum(count for token, count in freq.items() if t2d[token])
    common.progress(1, 1, "mappings")
    return {"draft_vocab_size": draft_vocab, "target_vocab_size": target_vocab, "distinct_tokens": len(freq),
            "coverage": round(covered / total, 4) if total else 0.0, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
