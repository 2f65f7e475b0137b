"""The legacy generation's stages: speculators 0.3 and 0.4 (the seed's stack, the reference case).

speculators 0.3.0 was written for vLLM 0.11 and runs on vLLM 0.16 with this repository's patch series:
hidden states from its ``VllmHiddenStatesGenerator`` (or a transformers forward, backend ``hf``),
``data_{i}.pt`` sample files, its ``Eagle3SampleFileDataset`` and ``Trainer`` driven from the stage code.
The stage contract and the data flow are in ``stages/__init__.py``.
"""
