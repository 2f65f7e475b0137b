"""A tiny Llama target built on the fly, for the stage tests: no hub, no download.

A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens and a ChatML chat
template (the same shape as SmolLM2's), and a randomly initialised LlamaForCausalLM with 8 layers of
hidden size 64. Built once per session under a temporary directory and reused by every stage test.
"""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a tiny test model.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Explain gravity in simple terms. Gravity pulls things toward each other.",
    "Write a haiku about tea. Green leaves in hot water, a calm cup at dawn.",
    "What is DNA? DNA carries the instructions that living things use to grow.",
    "Give me three facts about cats: they sleep a lot, they purr, they hunt.",
    "You are a tiny test model. Hello, how can I help you today?",
] * 20

NUM_LAYERS = 8
HIDDEN = 64


def build_tiny_model(path: Path, seed: int = 0, hidden: int = HIDDEN, heads: int = 4) -> Path:
    """Write a tokenizer + LlamaForCausalLM directory at ``path`` and return it. (vLLM's CPU attention
    needs a head size of 32 or more: ``hidden=128, heads=4`` for a model that vLLM runs.)"""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    return path
