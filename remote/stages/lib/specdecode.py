"""Live speculative decoding, as vLLM itself counts it: its Prometheus counters, and a measurement.

vLLM's ``/metrics`` (read with prometheus_client's own parser) counts, per engine, the draft steps
(``vllm:spec_decode_num_drafts``), the tokens proposed (``..._num_draft_tokens``), those accepted
(``..._num_accepted_tokens``, and per position ``..._num_accepted_tokens_per_pos{position}``), and the
tokens generated and requests finished. Between two readings:

    acceptance length      = 1 + accepted / drafts    (tokens per target forward, the bonus included)
    acceptance rate        = accepted / draft tokens
    rate at position i     = accepted at position i / drafts

``measure`` sends prompts through a server (greedy, as the offline evaluation walks) between two
readings. Used by the evaluate stage (its vLLM number), a deploy (the floor it must clear) and
``inv serve.metrics``; the counters are summed over every label set (engines, model names).
"""
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PREFIX = "vllm:"
COUNTERS = {  # our name -> vLLM's counter (prometheus_client's family name: no _total)
    "drafts": "spec_decode_num_drafts",
    "draft_tokens": "spec_decode_num_draft_tokens",
    "accepted": "spec_decode_num_accepted_tokens",
    "generation_tokens": "generation_tokens",
    "prompt_tokens": "prompt_tokens",
    "requests": "request_success",
}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def counters(text: str) -> dict:
    """The totals since the server started, from the text of its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {name: 0.0 for name in COUNTERS}
    per_pos: dict[int, float] = {}
    by_family = {PREFIX + v: k for k, v in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created timestamps
            base = sample.name[:-len("_total")]
            if base in by_family:
                out[by_family[base]] += sample.value
            elif base == PREFIX + PER_POSITION:
                pos = int(sample.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    out["accepted_per_position"] = [per_pos[i] for i in sorted(per_pos)]
    out["time"] = time.time()
    return out


def summary(before: dict | None, after: dict) -> dict:
    """What happened between two readings (``before`` None: since the server started). A counter that
    went down means the server restarted in between (a deploy, the guard): then since that start."""
    before = before or {}
    if any(after[k] < before.get(k, 0.0) for k in COUNTERS):
        before = {}
    d = {k: after[k] - before.get(k, 0.0) for k in COUNTERS}
    pos_b = before.get("accepted_per_position") or []
    pos = [a - (pos_b[i] if i < len(pos_b) else 0.0) for i, a in enumerate(after["accepted_per_position"])]
    drafts = d["drafts"]
    out = {
        "acceptance_length": round(1 + d["accepted"] / drafts, 4) if drafts else None,
        "acceptance_rate": round(d["accepted"] / d["draft_tokens"], 4) if d["draft_tokens"] else None,
        "acceptance_rate_per_position": [round(p / drafts, 4) for p in pos] if drafts else [],
        **{k: int(round(v)) for k, v in d.items()},
    }
    if before.get("time"):
        seconds = after["time"] - before["time"]
        out["seconds"] = round(seconds, 3)
        out["tokens_per_s"] = round(d["generation_tokens"] / seconds, 2) if seconds > 0 else None
    return out


def _get(url: str, timeout: float = 30) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def read(url: str) -> dict:
    """The counters of the server at ``url`` now."""
    return counters(_get(url.rstrip("/") + "/metrics").decode("utf-8", "replace"))


def served_model(url: str) -> str:
    """The name the server serves its model under (its first)."""
    return json.loads(_get(url.rstrip("/") + "/v1/models"))["data"][0]["id"]


def chat(url: str, model: str, messages: list, max_tokens: int, timeout: float = 900) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def measure(url: str, prompts: list, max_tokens: int, concurrency: int = 4, on_done=None) -> dict:
    """Send each conversation (a list of chat messages) greedily through the server at ``url``;
    returns the counters' ``summary`` over exactly that time, plus the replies' token count as the
    server reported it (``completion_tokens``)."""
    model = served_model(url)
    before = read(url)
    done = [0]
    tokens = [0]

    def one(messages):
        reply = chat(url, model, messages, max_tokens)
        tokens[0] += int((reply.get("usage") or {}).get("completion_tokens") or 0)
        done[0] += 1
        if on_done:
            on_done(done[0], len(prompts))
        return reply

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        list(pool.map(one, prompts))
    out = summary(before, read(url))
    out.update({"prompts": len(prompts), "completion_tokens": tokens[0], "model": model})
    return out


def timed(url: str, model: str, prompts: list, max_tokens: int, on_done=None) -> dict:
    """The prompts one request at a time, greedy, after one warm-up request (a server's first requests
    pay one-off costs): completion tokens, seconds, tokens/s. What one user sees of the server's speed."""
    if prompts:
        chat(url, model, prompts[0], max_tokens)
    tokens, t0 = 0, time.perf_counter()
    for i, messages in enumerate(prompts, 1):
        tokens += int((chat(url, model, messages, max_tokens).get("usage") or {}).get("completion_tokens") or 0)
        if on_done:
            on_done(i, len(prompts))
    seconds = time.perf_counter() - t0
    return {"prompts": len(prompts), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 and tokens else None}
