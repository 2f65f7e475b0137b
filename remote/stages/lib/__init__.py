"""The stage library: model code that more than one stage runs, so that no stage imports another.

* ``batching``: how token rows are laid out in a batch (right padding, the prefix every row shares).
* ``generation``: the target's greedy continuations of a batch of prompts (prepare regenerates the
  replies with it, evaluate the held-out continuations).
* ``capture``: the target's hidden states at the capture layers, by forward hooks (extract's hf
  backend, evaluate's offline acceptance).
* ``draft``: the EAGLE-3 draft's training forward computed only where it reaches the loss (train on
  CPU; tests compare it with speculators' own).

Everything here takes plain arguments (models, token lists, tensors), never the run spec: the stages
read their settings (their contract, at the top of each stage module) and pass values in. Torch and
transformers are imported inside the functions, as in the stages.
"""
