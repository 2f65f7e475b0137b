"""The draft's vocabulary from token counts, shared by both generations' vocab stage.

speculators' ``build_vocab_mappings_from_distribution`` (0.3 and 0.9 alike) over assistant-token counts
gives ``d2t`` (draft index -> offset to the target id) and ``t2d`` (target id -> is in the draft
vocabulary), saved as ``d2t.npy`` / ``t2d.npy``. When the data holds fewer distinct tokens than the
draft vocabulary, speculators pads it with the lowest token ids: allowed, but wasted lm_head rows, so it
is reported as a warning.
"""
from pathlib import Path

from stages import common


def write_mappings(freq: dict, draft_vocab: int, target_vocab: int, out: Path, stage: str) -> dict:
    """d2t.npy / t2d.npy in ``out``; returns the vocab stage's summary (sizes, coverage)."""
    import numpy as np
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if draft_vocab > target_vocab:
        common.fail(stage, f"pipeline.draft_vocab_size {draft_vocab} exceeds the target's vocabulary "
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
            "coverage": round(covered / total, 4) if total else 0.0}


def prompt_coverage(prompts: list, tokenizer, t2d_path: Path, warn_below: float) -> dict:
    """Per category of ``(category, messages)`` prompts: the share of their tokens (every turn's text)
    that the draft vocabulary holds, warned of in the log below ``warn_below``."""
    import numpy as np

    in_vocab = np.load(t2d_path)
    counts: dict[str, list[int]] = {}
    for name, messages in prompts:
        ids = [t for turn in messages for t in tokenizer(turn["content"], add_special_tokens=False)["input_ids"]]
        c = counts.setdefault(name, [0, 0])
        c[0] += sum(1 for t in ids if t < len(in_vocab) and in_vocab[t])
        c[1] += len(ids)
    out = {name: round(hit / n, 4) if n else 1.0 for name, (hit, n) in counts.items()}
    for name, share in out.items():
        if share < warn_below:
            common.log(f"WARNING: the draft vocabulary holds {share:.1%} of the held-out {name} prompts' tokens "
                       f"(< pipeline.coverage_warning {warn_below}); raise pipeline.draft_vocab_size or give "
                       "pipeline.dataset more such prompts")
    return out
