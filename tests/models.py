"""Tiny targets built on the fly, for the stage tests: no hub, no download.

``build_tiny_model``: a byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens
and a ChatML chat template (the same shape as SmolLM2's), and a randomly initialised LlamaForCausalLM with
8 layers of hidden size 64. Built once per session under a temporary directory and reused by every stage test.

``build_kimi_shaped_model``: the reference target's shape in miniature (a multimodal wrapper, a custom
tokenizer shipped as code), for the legacy generator tests against a real vLLM.
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


def _chatml_tokenizer(extra_specials: tuple[str, ...] = (), vocab_size: int = 320):
    """A byte-level BPE trained on CORPUS with the ChatML special tokens (then ``extra_specials``) first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", *extra_specials]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path: Path, seed: int = 0, hidden: int = HIDDEN, heads: int = 4) -> Path:
    """Write a tokenizer + LlamaForCausalLM directory at ``path`` and return it. (vLLM's CPU attention
    needs a head size of 32 or more: ``hidden=128, heads=4`` for a model that vLLM runs.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _chatml_tokenizer()
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


# ------------------------------------------------------------------------------------------------
# a Kimi-K2.5-shaped target

#: shipped in the model directory as tokenization_kimi.py (Kimi-K2.5 ships its own tokenization_kimi.py)
KIMI_TOKENIZER_CODE = '''"""The model's own tokenizer class, shipped as code (as Kimi-K2.5 ships tokenization_kimi.py): loading it
needs trust_remote_code=True. A byte-level BPE underneath, read from tokenizer.json."""
from transformers import PreTrainedTokenizerFast


class TinyKimiTokenizer(PreTrainedTokenizerFast):
    slow_tokenizer_class = None
'''

#: shipped as configuration_kimi_k25.py: transformers has no kimi_k25 (vLLM carries its own KimiK25Config)
KIMI_CONFIG_CODE = '''"""Kimi-K2.5's configuration, shipped with the model: a DeepseekV3 text config and a MoonViT vision
config under one multimodal wrapper (the field names are vLLM's KimiK25Config's)."""
from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    model_type = "kimi_k25_vision"

    def __init__(self, patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4,
                 pos_emb_type="divided_fixed", num_attention_heads=2, num_hidden_layers=1, hidden_size=64,
                 intermediate_size=128, merge_kernel_size=(2, 2), video_attn_type="spatial_temporal",
                 merge_type="sd2_tpool", mm_projector_type="patchmerger", mm_hidden_size=None,
                 projector_hidden_act="gelu", projector_ln_eps=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.merge_kernel_size = merge_kernel_size
        self.video_attn_type = video_attn_type
        self.merge_type = merge_type
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = mm_hidden_size if mm_hidden_size is not None else hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, vision_config=None, text_config=None, ignore_index=-100, media_placeholder_token_id=0,
                 pad_token_id=0, use_unified_vision_chunk=False, video_placeholder="<|kimi_k25_video_placeholder|>",
                 **kwargs):
        if not isinstance(vision_config, KimiK25VisionConfig):
            vision_config = KimiK25VisionConfig(**(vision_config or {}))
        if not isinstance(text_config, DeepseekV3Config):
            text_config = DeepseekV3Config(**(text_config or {}))
        self.vision_config = vision_config
        self.text_config = text_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.use_unified_vision_chunk = use_unified_vision_chunk
        self.video_placeholder = video_placeholder
        super().__init__(pad_token_id=pad_token_id, **kwargs)
'''

#: shipped as kimi_k25_vision_processing.py: vLLM's Kimi-K2.5 processor loads the model's own media
#: processor (AutoImageProcessor, trust_remote_code) even for text-only prompts, to size its profiling run
KIMI_MEDIA_PROCESSOR_CODE = '''"""Kimi-K2.5's media processor in miniature, shipped with the model: every image (or video-chunk frame)
is resized to size x size and cut into patches; a chunk's frames are pooled in time, so every item becomes
(size / patch / merge)^2 placeholder tokens."""
import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class TinyKimiMediaProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, size=56, patch_size=14, merge_kernel_size=(2, 2), num_frames_per_chunk=4, **kwargs):
        super().__init__(**kwargs)
        self.size = size
        self.patch_size = patch_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.num_frames_per_chunk = num_frames_per_chunk

    def media_tokens_calculator(self, chunk) -> int:
        g = self.size // self.patch_size
        return (g // self.merge_kernel_size[0]) * (g // self.merge_kernel_size[1])

    def split_video_chunks(self, video):
        n, frames = self.num_frames_per_chunk, list(video)
        return [{"type": "video_chunk", "video_chunk": frames[i:i + n]} for i in range(0, len(frames), n)]

    def preprocess(self, vision_chunks, **kwargs):
        p, g = self.patch_size, self.size // self.patch_size
        pixels, grids = [], []
        for chunk in vision_chunks:
            frames = [chunk["image"]] if chunk["type"] == "image" else list(chunk["video_chunk"])
            for im in frames:
                a = np.asarray(im.convert("RGB").resize((self.size, self.size)), dtype=np.float32) / 127.5 - 1.0
                t = torch.from_numpy(a).permute(2, 0, 1).reshape(3, g, p, g, p)
                pixels.append(t.permute(1, 3, 0, 2, 4).reshape(g * g, 3, p, p))
            grids.append([len(frames), g, g])
        return BatchFeature(data={"pixel_values": torch.cat(pixels), "grid_thws": torch.tensor(grids)})
'''

KIMI_MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


def kimi_text_config(hidden: int = 128):
    """The text model of the Kimi-shaped target: DeepseekV3 (Kimi-K2's architecture) in miniature: 8 layers,
    the first dense and the rest MoE (4 routed experts, top 2, one shared; sigmoid scores with a correction
    bias, noaux_tc, as Kimi-K2), MLA projections with LoRA ranks, 4 heads of 32 + 32 (nope + rope)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=328, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        max_position_embeddings=1024, rope_scaling=None, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")


def build_kimi_shaped_model(path: Path, seed: int = 0) -> Path:
    """Write a tiny Kimi-K2.5-shaped target at ``path`` and return it.

    Architecture: vLLM's own ``KimiK25ForConditionalGeneration`` (model_type ``kimi_k25``), the reference
    target's, at toy size: a MoonViT vision tower (1 block, hidden 64) and patch-merger projector, and a
    DeepseekV3 text model (:func:`kimi_text_config`) that vLLM builds as ``DeepseekV2ForCausalLM`` under
    ``language_model``, so the decoder sits at ``language_model.model.layers`` and the wrapper does not
    implement SupportsEagle3 itself. vLLM's CPU backend refuses MLA ("NotImplementedError: MLA is not supported
    on CPU."): run it with ``VLLM_MLA_DISABLE=1`` (the text model then runs the same weights as plain
    multi-head attention, head size 64). Weights are bf16, as
    Kimi-K2.5's (vLLM's ``dtype="auto"`` runs a float32 checkpoint in bf16 anyway); the ``language_model.*``
    tensors are named exactly as transformers' DeepseekV3ForCausalLM's (see :func:`load_kimi_text_model`,
    the reference forward).

    As with Kimi-K2.5, three pieces of the directory are code: ``configuration_kimi_k25.py`` (AutoConfig;
    transformers has no kimi_k25), ``kimi_k25_vision_processing.py`` (the media processor vLLM loads even
    for text prompts) and ``tokenization_kimi.py``: ``tokenizer_class`` is ``TinyKimiTokenizer`` and
    ``auto_map`` points at it, so ``AutoTokenizer.from_pretrained(path)`` fails without
    ``trust_remote_code=True`` and works with it, exactly the seed's failure with Kimi-K2.5. The tokenizer
    is build_tiny_model's (ChatML specials and template) plus Kimi's media tokens.
    """
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _chatml_tokenizer(KIMI_MEDIA_TOKENS)
    tokenizer.save_pretrained(path)
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "TinyKimiTokenizer"
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TinyKimiTokenizer", None]}
    tc_path.write_text(json.dumps(tc, indent=2))
    (path / "tokenization_kimi.py").write_text(KIMI_TOKENIZER_CODE)
    (path / "configuration_kimi_k25.py").write_text(KIMI_CONFIG_CODE)
    (path / "kimi_k25_vision_processing.py").write_text(KIMI_MEDIA_PROCESSOR_CODE)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "TinyKimiMediaProcessor",
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.TinyKimiMediaProcessor"},
        "size": 56, "patch_size": 14, "merge_kernel_size": [2, 2], "num_frames_per_chunk": 4,
        # as Kimi-K2.5's own file has it: what vLLM 0.32+'s fused Kimi-K2.5 processor reads (in place of the
        # model's code), sized to the same 56 x 56 pixels (4 x 4 patches, 4 tokens an image)
        "media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16, "patch_limit_on_one_side": 4,
                           "fixed_output_tokens": None, "in_patch_limit_each_frame": 16, "in_patch_limit_video": None,
                           "temporal_merge_kernel_size": 4, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}},
        indent=2))

    torch.manual_seed(seed)
    text = kimi_text_config()
    assert len(tokenizer) <= text.vocab_size
    state = {f"language_model.{k}": v for k, v in DeepseekV3ForCausalLM(text).state_dict().items()}
    # Routing that no rounding can flip: the experts are chosen by sigmoid(gate) + correction bias, and a
    # bias step of 0.5 over gate scores within 0.5 +- 0.1 picks the same two experts in vLLM's bf16 as in a
    # float32 reference (a different pair in each layer); their weights still follow the gate per token.
    # With near-tied random scores a flipped choice put 3% between vLLM and transformers at the first MoE layer.
    for n, k in enumerate(k for k in sorted(state) if k.endswith("e_score_correction_bias")):
        order = torch.randperm(text.n_routed_experts, generator=torch.Generator().manual_seed(seed + n))
        state[k] = torch.tensor([1.0, 0.5, 0.0, -0.5])[order]
    vh, merged = 64, 64 * 4  # vision hidden; after the 2x2 patch merger
    g = torch.Generator().manual_seed(seed + 1)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    vision = {"patch_embed.proj.weight": rnd(vh, 3, 14, 14), "patch_embed.proj.bias": rnd(vh),
              "patch_embed.pos_emb.weight": rnd(4, 4, vh),  # the 4x4 patch grid of a 56x56 image
              "encoder.final_layernorm.weight": torch.ones(vh), "encoder.final_layernorm.bias": torch.zeros(vh)}
    b = "encoder.blocks.0."
    vision.update({
        b + "norm0.weight": torch.ones(vh), b + "norm0.bias": torch.zeros(vh),
        b + "norm1.weight": torch.ones(vh), b + "norm1.bias": torch.zeros(vh),
        b + "wqkv.weight": rnd(3 * vh, vh), b + "wqkv.bias": rnd(3 * vh),
        b + "wo.weight": rnd(vh, vh), b + "wo.bias": rnd(vh),
        b + "mlp.fc0.weight": rnd(2 * vh, vh), b + "mlp.fc0.bias": rnd(2 * vh),
        b + "mlp.fc1.weight": rnd(vh, 2 * vh), b + "mlp.fc1.bias": rnd(vh)})
    state.update({f"vision_tower.{k}": v for k, v in vision.items()})
    state.update({
        "mm_projector.pre_norm.weight": torch.ones(vh), "mm_projector.pre_norm.bias": torch.zeros(vh),
        "mm_projector.proj.0.weight": rnd(merged, merged), "mm_projector.proj.0.bias": rnd(merged),
        "mm_projector.proj.2.weight": rnd(text.hidden_size, merged), "mm_projector.proj.2.bias": rnd(text.hidden_size)})
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})

    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": {**text.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]},
        "vision_config": {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
                          "init_pos_emb_time": 4, "num_attention_heads": 2, "num_hidden_layers": 1,
                          "hidden_size": vh, "intermediate_size": 2 * vh, "merge_kernel_size": [2, 2],
                          "mm_hidden_size": text.hidden_size},
        "media_placeholder_token_id": tokenizer.convert_tokens_to_ids("<|media_pad|>"),
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def load_kimi_text_model(path: Path, dtype=None):
    """The Kimi-shaped target's text model as transformers' DeepseekV3ForCausalLM with its weights (the
    ``language_model.*`` tensors), for a reference forward."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    text = DeepseekV3Config(**json.loads((path / "config.json").read_text())["text_config"])
    model = DeepseekV3ForCausalLM(text)
    state = {k[len("language_model."):]: v for k, v in load_file(path / "model.safetensors").items()
             if k.startswith("language_model.")}
    model.load_state_dict(state, strict=True)
    return model.to(dtype or torch.float32).eval()


#: Kimi-K2.5's config.json at full size, as published (the fields a plan reads and the wrapper around them;
#: no weights: what ``inv pipeline --plan`` sizes the reference case with)
KIMI_K25_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "num_hidden_layers": 61, "vocab_size": 163840, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "num_attention_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "first_k_dense_replace": 1, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    },
    "vision_config": {"patch_size": 14, "vt_hidden_size": 1152, "vt_num_hidden_layers": 27},
    "torch_dtype": "bfloat16",
}
