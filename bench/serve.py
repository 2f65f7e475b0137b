"""The serving loop's bars: the production server with and without the trained draft, per category of prompts.

    python bench/serve.py [--hosts local] [--inventory inventory.yaml] [--run TRAIN_RUN] [--prompts 16]
                          [--max-tokens 64] [--rounds 2] [--narrow] [--quick]

After the default pipeline (``inv pipeline --hosts local``), through the CLI exactly as a user runs it:
``inv service.start``; then paired phases A B A B...: A the server without a draft (``inv deploy
--rollback`` until it runs none), B with the draft of ``--run`` (default: the newest succeeded train
run on the host; ``inv deploy RUN`` with its gates open, so that B always runs the draft). Each phase
sends, per category, the same prompts one request at a time, greedy, ``--max-tokens`` new tokens, after
two warm-up requests, and times them on the workstation; vLLM's own counters (``inv serve.metrics
--json`` before and after) give the category's acceptance length. The categories: the pipeline's
held-out prompts (never trained on, from the training sources' distribution) and each shipped
out-of-distribution set (remote/stages/data/eval/). Pairing A and B back to back cancels the machine's
drift; a speedup is mean(B tokens/s) / mean(A tokens/s).

Bars: held-out acceptance length >= 2.0 and speedup >= 1.5x; each out-of-distribution category
acceptance >= 1.6 and speedup >= 1.15x; and ``inv deploy --rollback`` leaves the server healthy without
the draft (the last step; ``--keep-draft`` skips it). The service must be reachable from this machine at
its URL (the embedded ``local`` host). Exit 1 when a bar is missed. ``--quick``: 2 prompts per category,
16 new tokens, one round, figures shown but not judged (the suite runs it on its tiny served target).
``--narrow``: then a draft trained on one template (the shipped chat set's haikus, through ``inv pipeline``)
is deployed over the healthy server with the inventory's own gates: the bar is that ``inv deploy`` rolls it
back for its speed, both figures in its message. ``--rounds 0`` skips the A B phases (that check alone).
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

import yaml

from results import record

REPO = Path(__file__).resolve().parent.parent
#: (acceptance length, speedup) each category must reach: the held-out prompts, and any other set
BARS = {"held-out": (2.0, 1.5), "other": (1.6, 1.15)}
EVAL_SETS = REPO / "remote" / "stages" / "data" / "eval"


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


def served_model(url: str) -> str:
    """The model id the server at ``url`` serves (what every request names)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def fits(url: str, model: str, messages: list, max_tokens: int) -> bool:
    """Whether the server takes ``messages`` with ``max_tokens`` new tokens: its own /tokenize count of
    the templated prompt against its max_model_len."""
    t = post(url + "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": True})
    return t["count"] + max_tokens <= t["max_model_len"]


def phase(url: str, prompts: list, max_tokens: int) -> dict:
    """The prompts one at a time through the server: completion tokens, wall seconds, tokens/s."""
    model = served_model(url)
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
    ap.add_argument("--prompts", type=int, default=16, help="prompts per category")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs (0: none, e.g. for --narrow alone)")
    ap.add_argument("--keep-draft", action="store_true", help="leave the draft deployed at the end")
    ap.add_argument("--narrow", action="store_true",
                    help="also train a draft on one chat template and check that inv deploy rolls it back for its speed")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens, one round; bars not judged")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.rounds = 2, 16, 1
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
    held = [json.loads(l)["messages"] for l in (workdir / "runs" / prep / "artifacts" / "heldout.jsonl").read_text().splitlines()]
    categories = {"held-out": held[:args.prompts]}
    for path in sorted(EVAL_SETS.glob("*.jsonl")):
        categories["ood-" + path.stem] = [json.loads(l)["messages"] for l in path.read_text().splitlines() if l.strip()][:args.prompts]
    t = time.perf_counter()
    inv("service.start", "--hosts", args.hosts, inventory=args.inventory)
    print(f"service.start: {time.perf_counter() - t:.0f} s", flush=True)
    # only the prompts the server can take with max_tokens more (vLLM's /tokenize counts them its way)
    model = served_model(url)
    for cat in list(categories):
        categories[cat] = [m for m in categories[cat] if fits(url, model, m, args.max_tokens)]
        if not categories[cat]:
            print(f"{cat}: no prompt fits the server's max_model_len with {args.max_tokens} new tokens: left out")
            del categories[cat]
    print(f"draft: train run {train}; per category at most {args.prompts} prompts ("
          + ", ".join(f"{c} {len(p)}" for c, p in categories.items()) + f"; held out by run {prep}), "
          f"{args.max_tokens} new tokens each, one request at a time; server {url}", flush=True)

    def status() -> dict:
        return json.loads(inv("service.status", "--hosts", args.hosts, "--json", inventory=args.inventory).stdout)[args.hosts]

    def metrics() -> dict:
        return json.loads(inv("serve.metrics", "--hosts", args.hosts, "--json", inventory=args.inventory).stdout)[args.hosts]

    def without_draft():
        for _ in range(10):
            if not status().get("draft"):
                return
            inv("deploy", "--rollback", "--hosts", args.hosts, inventory=args.inventory)
        raise SystemExit("the service still runs a draft after 10 rollbacks")

    def with_draft():  # the gates open: this bench measures, the deploy's own gate is tested elsewhere
        inv("deploy", train, "--hosts", args.hosts, "--json", "--min-acceptance", "1", "--min-speedup", "0.01",
            inventory=args.inventory)

    rows = []
    for r in range(args.rounds):
        for name, switch in (("A", without_draft), ("B", with_draft)):
            t = time.perf_counter()
            switch()
            switched = time.perf_counter() - t
            for cat, prompts in categories.items():
                b = metrics()
                m = phase(url, prompts, args.max_tokens)
                a = metrics()
                drafts = a["drafts"] - b["drafts"]  # both readings are totals since the server started
                acc = round(1 + (a["accepted"] - b["accepted"]) / drafts, 4) if drafts else None
                rows.append({"round": r + 1, "phase": name, "category": cat, **m, "acceptance_length": acc,
                             "switch_s": round(switched, 1)})
                print(f"round {r + 1} {name} ({'draft' if name == 'B' else 'no draft'}) {cat:10s} "
                      f"{m['tokens_per_s']:7.2f} tokens/s ({m['tokens']} tokens in {m['seconds']:.1f} s)"
                      + (f"  acceptance length {acc:.3f}" if acc else ""), flush=True)

    ok = judged(categories, rows, args.quick) if rows else True
    if args.narrow:
        ok &= narrow_draft_is_rolled_back(args, without_draft, status)
    if not args.keep_draft:
        without_draft()
        st = status()
        good = bool(st.get("healthy")) and not st.get("draft")
        ok &= good
        print(f"{'deploy --rollback: healthy, no draft':45s} {str(good):>9s}  {'PASS' if good else 'FAIL'}")
    return 0 if ok else 1


def judged(categories: dict, rows: list, quick: bool) -> bool:
    """The A B rows side by side per category: tokens/s without and with the draft, the speedup and the
    acceptance length against their bars, printed and recorded, with each round's own speedup beside it
    (B over the A just before it): how far the machine moves one configuration between pairs, which
    says what a difference between two runs of this bench can mean; False when a bar is missed (never
    in quick)."""
    ok, results = True, []
    print()
    print(f"{'category':12s} {'without':>9s} {'with':>9s} {'speedup':>8s} {'acceptance':>10s}  verdict")
    for cat in categories:
        a = {x["round"]: x["tokens_per_s"] for x in rows if x["phase"] == "A" and x["category"] == cat}
        b = [x for x in rows if x["phase"] == "B" and x["category"] == cat]
        without, with_draft = sum(a.values()) / len(a), sum(x["tokens_per_s"] for x in b) / len(b)
        speedup = with_draft / without
        accs = [x["acceptance_length"] for x in b if x["acceptance_length"]]
        acceptance = sum(accs) / len(accs) if accs else 0.0
        bar_acc, bar_speed = BARS["held-out" if cat == "held-out" else "other"]
        good = acceptance >= bar_acc and speedup >= bar_speed
        ok &= good or quick
        rounds = "/".join(f"{x['tokens_per_s'] / a[x['round']]:.2f}" for x in b if x["round"] in a)
        print(f"{cat:12s} {without:9.2f} {with_draft:9.2f} {speedup:7.3f}x "
              f"{acceptance:10.3f}  {'-' if quick else 'PASS' if good else 'FAIL'} (bars: acceptance >= {bar_acc}, "
              f"speedup >= {bar_speed}x; each round {rounds}x)")
        results.append((f"{cat} acceptance / speedup, batch 1", f"{acceptance:.3f} / {speedup:.3f}x (rounds {rounds}x)",
                        f"{'held-out ' if cat == 'held-out' else ''}>= {bar_acc} / {bar_speed}x"))
    record("serve", results, quick)
    return ok


#: the one template the narrow draft is trained on (the haikus among the shipped chat prompts)
NARROW_TEMPLATE = "Write a haiku about "


def narrow_draft_is_rolled_back(args, without_draft, status) -> bool:
    """A draft trained on one template (the haikus of the shipped chat set), deployed with the inventory's
    own gates over the healthy server without a draft: the deploy must roll it back for its speed,
    with both figures in its message."""
    import tempfile

    chat = (REPO / "remote" / "stages" / "data" / "chat.jsonl").read_text().splitlines()
    haikus = [line for line in chat if json.loads(line)["messages"][0]["content"].startswith(NARROW_TEMPLATE)]
    tmp = Path(tempfile.mkdtemp(prefix="narrow-"))
    (tmp / "haikus.jsonl").write_text("\n".join(haikus) + "\n")
    inv_doc = yaml.safe_load(Path(args.inventory).read_text())
    host = inv_doc["hosts"][args.hosts]
    heldout = 8
    samples = len(haikus) - heldout
    host["pipeline"] = {**(host.get("pipeline") or {}), "dataset": str(tmp / "haikus.jsonl"),
                        "samples": samples, "heldout": heldout, "epochs": 3, "val_fraction": 0.05}
    narrow_inv = tmp / "inventory.yaml"
    narrow_inv.write_text(yaml.safe_dump(inv_doc, sort_keys=False))
    t = time.perf_counter()
    done = json.loads(inv("pipeline", "--hosts", args.hosts, "--json", inventory=str(narrow_inv)).stdout)[args.hosts]
    train = next(s["run_id"] for s in done if s["stage"] == "train")
    print(f"narrow draft: {samples} haiku prompts, train run {train} ({time.perf_counter() - t:.0f} s)")
    without_draft()
    before = status()
    r = inv("deploy", train, "--hosts", args.hosts, inventory=args.inventory, check=False)
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("error:")), "")
    after = status()
    good = (r.returncode == 1 and "below deploy.min_speedup" in line and "tokens/s against" in line
            and bool(after.get("healthy")) and not after.get("draft") and before.get("healthy"))
    print(f"narrow draft deployed: exit {r.returncode}: {line or r.stdout.strip()[-300:]}")
    print(f"{'narrow draft rolled back for its speed':45s} {str(good):>9s}  {'PASS' if good else 'FAIL'}")
    said = line.removeprefix("error:").strip().replace("|", "/") if line else f"exit {r.returncode}, kept"
    record("serve", [(f"narrow draft ({samples} haiku prompts, run {train}) deployed with the inventory's gates",
                      f"{'rolled back' if good else 'NOT rolled back for its speed'}: {said}",
                      "rolled back for its speed, both figures said")], args.quick)
    return good


if __name__ == "__main__":
    sys.exit(main())
