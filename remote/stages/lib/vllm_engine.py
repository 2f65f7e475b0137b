"""The target inside vLLM, for ``pipeline.backend: vllm``: where a 1T target only exists (over 8 GPUs).

* ``TargetLLM``: greedy continuations through vLLM's offline ``LLM`` (tensor parallel over
  ``tensor_parallel`` GPUs): prepare's regenerated replies, evaluate's held-out continuations.
* ``hidden_states_generator``: speculators' own ``VllmHiddenStatesGenerator`` (patched for the host's
  vLLM by the 0.3.0 series): extract's samples, evaluate's states along each continuation, each
  checked to hold a row per token by ``hidden_states``.

Why the offline engine and not the host's running server: a GPU stage runs under the service guard,
which has stopped the production server to free its GPUs; the stage owns the GPUs, so it loads the
target itself, once per stage, and frees them before the next engine or the service starts.

Both engines are freed by ``close`` (vLLM's engine core and workers are processes of their own) so
that evaluate can run one after the other on the same GPUs.
"""
import gc


def _eager() -> bool:
    """CUDA graphs and torch.compile pay off on a GPU; on vLLM's CPU backend they only add minutes."""
    import torch

    return not torch.cuda.is_available()


class TargetLLM:
    """The target in vLLM's offline engine, loaded once: ``llm(prompts, max_new)`` gives greedy
    continuations of tokenised prompts, up to and including EOS (as stages.lib.generation)."""

    def __init__(self, model_path: str, *, max_model_len: int, tensor_parallel: int = 1,
                 gpu_memory_utilization: float = 0.8, trust_remote_code: bool = False):
        from vllm import LLM

        eager = _eager()
        # vLLM 0.16's CPU backend picks its AMX attention for bf16 at its default block size (128),
        # which refuses head size 64 on AMX CPUs ("Unsupported CPU attention configuration:
        # head_dim=64 isa=0"); 16-token blocks take the vector kernel, as speculators' generator does
        cpu = {"block_size": 16} if eager else {}
        self.llm = LLM(model=model_path, tokenizer=model_path, trust_remote_code=trust_remote_code,
                       tensor_parallel_size=tensor_parallel, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enforce_eager=eager, seed=0, **cpu)

    def __call__(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        from vllm import SamplingParams

        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                                    SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]  # in prompt order

    def close(self):
        close(self.llm)
        self.llm = None


def hidden_states_generator(model_path: str, layers: list[int], *, max_model_len: int, tensor_parallel: int = 1,
                            gpu_memory_utilization: float = 0.8):
    """speculators' generator: ``.generate(list of token lists)`` -> one dict per sequence with
    ``input_ids`` and ``hidden_states`` (one ``(len, hidden)`` tensor per capture layer)."""
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    return VllmHiddenStatesGenerator(model_path=model_path, layer_ids=layers, max_model_len=max_model_len,
                                     gpu_memory_utilization=gpu_memory_utilization,
                                     tensor_parallel_size=tensor_parallel)


class ShortStates(ValueError):
    """The generator returned fewer ids or hidden-state rows than a sequence has tokens (the seed's
    silent loss under prefix caching, which patch 0008 ends): never to be saved or measured."""


def hidden_states(generator, sequences: list[list[int]]) -> list[list]:
    """The generator's hidden states for each sequence (one ``(len, hidden)`` tensor per capture layer),
    each checked to have exactly one row per token; ``ShortStates`` names the first that does not."""
    results = generator.generate(sequences)
    for i, (sequence, result) in enumerate(zip(sequences, results)):
        rows = [h.shape[0] for h in result["hidden_states"]]
        if len(result["input_ids"]) != len(sequence) or any(r != len(sequence) for r in rows):
            raise ShortStates(f"{len(sequence)} tokens but the generator returned {len(result['input_ids'])} ids and "
                              f"{rows} hidden-state rows; inv patch.status (0008 turns prefix caching off)", i)
    return [result["hidden_states"] for result in results]


def close(engine) -> None:
    """Stop an engine's processes and free its memory: an ``LLM`` or the generator's executor."""
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    executor = getattr(engine, "executor", None)
    for part in (core, executor):
        if part is not None and hasattr(part, "shutdown"):
            part.shutdown()
    del engine
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - freeing is best effort; the process ends soon anyway
        pass
