"""Stage vocab: the draft's vocabulary, the ``pipeline.draft_vocab_size`` most frequent target tokens.

Counts from extract's ``token_freq.pt`` (assistant tokens only), the target's vocabulary size from
extract.json; the mappings are speculators' own (stages/lib/vocabulary.py): ``d2t.npy`` / ``t2d.npy``
for speculators' trainer.
"""
import json

from stages import common
from stages.lib import vocabulary

STAGE = "vocab"
READS = ("extract",)         # the stages whose artifacts this one reads: extract's token_freq.pt, extract.json
GPU = False                  # counting tokens: no model runs
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "draft_vocab_size": 32000,     # the draft's vocabulary: this many of the target's most frequent tokens
}


def main(spec: dict) -> dict:
    import torch

    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    out = common.artifacts(spec)
    extracted = common.input_dir(spec, "extract")
    meta = json.loads((extracted / "extract.json").read_text())
    freq = torch.load(extracted / "token_freq.pt", weights_only=True)

    target_vocab = int(meta["vocab_size"])
    summary = vocabulary.write_mappings(freq, cfg.draft_vocab_size, target_vocab, out, STAGE)
    return {**summary, "seconds": timer()}


if __name__ == "__main__":
    common.cli(main)
