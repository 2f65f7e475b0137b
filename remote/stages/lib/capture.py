"""The target's hidden states at the capture layers: extract's hf backend, evaluate's offline acceptance.

The layer convention (the off-by-one with vLLM) is in stages/__init__: a capture layer's OUTPUT is kept.
"""
from stages.lib.batching import shared_prefix


def decoder_layers(model):
    """The decoder and its layer list, through the language-model accessor where the model has one."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if hasattr(decoder, "language_model"):
        decoder = decoder.language_model
    return decoder, decoder.layers


class HfCapture:
    """Decoder forward with hooks that keep the output of the capture layers (the layers' own output,
    before the final norm; transformers' ``output_hidden_states`` would hold all n+1 states and replace
    the last one with the normed state)."""

    def __init__(self, model, layers: list[int]):
        self.decoder, blocks = decoder_layers(model)
        self.layers, self.captured = layers, {}
        self.hooks = [blocks[layer].register_forward_hook(self._hook(layer)) for layer in layers]

    def _hook(self, layer):
        def keep(_module, _args, output):
            self.captured[layer] = output[0] if isinstance(output, tuple) else output
        return keep

    def __call__(self, input_ids):
        """Captured states ``[rows, seq, hidden]`` per layer. The leading tokens every row shares (a chat
        template's system prompt: a quarter of the default's tokens) run once, and the rest of each row
        runs on their KV cache: the same states, in a quarter less time."""
        import torch

        rows = input_ids.shape[0]
        shared = shared_prefix(input_ids.tolist())
        self.captured = {}
        with torch.inference_mode():
            if not shared:
                self.decoder(input_ids=input_ids, use_cache=False)
                return [self.captured[layer] for layer in self.layers]
            cache = self.decoder(input_ids=input_ids[:1, :shared], use_cache=True).past_key_values
            prefix = [self.captured[layer].expand(rows, -1, -1) for layer in self.layers]
            cache.batch_repeat_interleave(rows)
            self.decoder(input_ids=input_ids[:, shared:], past_key_values=cache, use_cache=True)
            return [torch.cat([p, self.captured[layer]], dim=1) for p, layer in zip(prefix, self.layers)]

    def close(self):
        for hook in self.hooks:
            hook.remove()
