"""The serving loop's bars: the production server with and without the trained draft, side by side.

    python bench/serve.py [--hosts local] [--inventory inventory.yaml] [--run TRAIN_RUN] [--prompts 32]
                          [--max-tokens 64] [--rounds 2] [--threshold 1.3]

After the default pipeline (``inv pipeline --hosts local``), through the CLI exactly as a user runs it:
``inv service.start``; then paired phases A B A B...: A the server without a draft (``inv deploy
--rollback`` until it runs none), B with the draft of ``--run`` (default: the newest succeeded train
run on the host; ``inv deploy RUN``). Each phase sends the same held-out prompts (the pipeline's
prepare run's heldout.jsonl) one request at a time, greedy, ``--max-tokens`` new tokens, after two
warm-up requests, and times them on the workstation; vLLM's own counters (``inv serve.metrics --json``
before and after) give the phase's acceptance length. Pairing A and B back to back cancels the
machine's drift; the speedup is mean(B tokens/s) / mean(A tokens/s), the pairs' ratios printed too.

Bars: speedup >= 1.3 (goal 1.6); acceptance length by vLLM's counters >= 1.8; and ``inv deploy
--rollback`` leaves the server healthy without the draft (the last step; ``--keep-draft`` skips it).
The service must be reachable from this machine at its URL (the embedded ``local`` host). Exit 1 when
a bar is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BARS = {"speedup": 1.3, "speedup_goal": 1.6, "acceptance": 1.8}


def inv(*args: str, inventory: str, timeout: float = 3600, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "invoke", *args, "--inventory", inventory]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def phase(url: str, prompts: list, max_tokens: int) -> dict:
    """The prompts one at a time through the server: completion tokens, wall seconds, tokens/s."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = lambda m: {"model": model, "messages": m, "max_tokens": max_tokens, "temperature": 0.0}  # noqa: E731
    for m in prompts[:2]:  # warm-up: the first requests after a start pay one-off costs
        post(url + "/v1/chat/completions", body(m))
    tokens, t0 = 0, time.perf_counter()
    for m in prompts:
        tokens += post(url + "/v1/chat/completions", body(m))["usage"]["completion_tokens"]
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inventory", default=str(REPO / "inventory.yaml"))
    ap.add_argument("--hosts", default="local")
    ap.add_argument("--run", help="the train run to deploy (default: the newest succeeded one on the host)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs")
    ap.add_argument("--keep-draft", action="store_true", help="leave the draft deployed at the end")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from harness.inventory import load_inventory

    inventory = load_inventory(args.inventory)
    host = inventory.hosts[args.hosts]
    if host.service is None or not host.service.base_url:
        raise SystemExit(f"host {args.hosts} has no service with a url in {args.inventory}")
    url = host.service.base_url
    workdir = Path(os.path.expanduser(host.workdir))

    train = args.run
    if not train:
        listed = json.loads(inv("runs.list", "--hosts", args.hosts, "--json", inventory=args.inventory).stdout)
        done = sorted((r for r in listed[args.hosts] if r.get("stage") == "train" and r["state"] == "succeeded"),
                      key=lambda r: r.get("ended_ts") or 0)
        if not done:
            raise SystemExit("no succeeded train run on the host: run inv pipeline first")
        train = done[-1]["run_id"]
    spec = json.loads((workdir / "runs" / train / "spec.json").read_text())
    prep = spec["input_runs"]["prepare"]
    prompts = [json.loads(l)["messages"] for l in (workdir / "runs" / prep / "artifacts" / "heldout.jsonl").read_text().splitlines()]
    prompts = prompts[:args.prompts]
    print(f"draft: train run {train}; {len(prompts)} held-out prompts of run {prep}, {args.max_tokens} new tokens each, "
          f"one request at a time; server {url}", flush=True)

    t = time.perf_counter()
    inv("service.start", "--hosts", args.hosts, inventory=args.inventory)
    print(f"service.start: {time.perf_counter() - t:.0f} s", flush=True)

    def status() -> dict:
        return json.loads(inv("service.status", "--hosts", args.hosts, "--json", inventory=args.inventory).stdout)[args.hosts]

    def without_draft():
        for _ in range(10):
            if not status().get("draft"):
                return
            inv("deploy", "--rollback", "--hosts", args.hosts, inventory=args.inventory)
        raise SystemExit("the service still runs a draft after 10 rollbacks")

    def with_draft():
        inv("deploy", train, "--hosts", args.hosts, "--json", inventory=args.inventory)

    rows = []
    for r in range(args.rounds):
        for name, switch in (("A (no draft)", without_draft), ("B (draft)", with_draft)):
            t = time.perf_counter()
            switch()
            switched = time.perf_counter() - t
            before = json.loads(inv("serve.metrics", "--hosts", args.hosts, "--json", inventory=args.inventory).stdout)
            m = phase(url, prompts, args.max_tokens)
            live = json.loads(inv("serve.metrics", "--hosts", args.hosts, "--json", inventory=args.inventory).stdout)
            b, a = before[args.hosts], live[args.hosts]
            drafts = a["drafts"] - b["drafts"]  # both readings are totals since the server started
            acc = round(1 + (a["accepted"] - b["accepted"]) / drafts, 4) if drafts else None
            rows.append({"round": r + 1, "phase": name, **m, "acceptance_length": acc, "switch_s": round(switched, 1)})
            print(f"round {r + 1} {name:13s} {m['tokens_per_s']:7.2f} tokens/s  ({m['tokens']} tokens in "
                  f"{m['seconds']:.1f} s; switch {switched:.0f} s)"
                  + (f"  acceptance length {acc:.3f}" if acc else ""), flush=True)

    a = [x["tokens_per_s"] for x in rows if x["phase"].startswith("A")]
    b = [x["tokens_per_s"] for x in rows if x["phase"].startswith("B")]
    accs = [x["acceptance_length"] for x in rows if x["phase"].startswith("B") and x["acceptance_length"]]
    speedup = (sum(b) / len(b)) / (sum(a) / len(a))
    acceptance = sum(accs) / len(accs) if accs else 0.0
    ok = True
    print()
    print("pairs (B/A): " + ", ".join(f"{y / x:.3f}x" for x, y in zip(a, b)))
    for label, value, bar, fmt in (("speedup, tokens/s with the draft / without", speedup, BARS["speedup"], "{:.3f}x"),
                                   ("acceptance length (vLLM's counters)", acceptance, BARS["acceptance"], "{:.3f}")):
        good = value >= bar
        ok &= good
        print(f"{label:45s} {fmt.format(value):>9s}  {'PASS' if good else 'FAIL'} (bar >= {bar}"
              + (f", goal {BARS['speedup_goal']}x" if label.startswith("speedup") else "") + ")")
    if not args.keep_draft:
        without_draft()
        st = status()
        good = bool(st.get("healthy")) and not st.get("draft")
        ok &= good
        print(f"{'deploy --rollback: healthy, no draft':45s} {str(good):>9s}  {'PASS' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
