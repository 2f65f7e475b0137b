"""The current generation's stages: speculators 0.5 and later (0.9.0 on vLLM 0.32, the embedded default).

speculators 0.5+ has no hidden-states generator of its own: the target runs in a vLLM server that each
GPU stage starts on the host for itself (stages/lib/vllm_server.py), hidden states come from vLLM's
``extract_hidden_states`` speculative method and a KV connector writing ``hs_{i}.safetensors``, and the
work is speculators' own CLI: ``regenerate-responses`` and ``prepare-data`` (prepare),
``generate-offline-data`` (extract), ``train`` (train). The data is speculators' Arrow dataset plus the
hidden-state files. The stage contract and the layer conventions are in ``stages/__init__.py``.
"""
