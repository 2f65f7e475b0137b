"""The reference scenario in miniature, end to end through the harness's own CLI, with its bars.

    python bench/legacy.py [--host local-legacy] [--inventory inventory.yaml] [--fresh] [--quick]

On the shipped ``local-legacy`` host (speculators 0.3.0 patched for a real vLLM 0.16 on this CPU; run
``inv setup --hosts local-legacy`` first): ``inv audit``, ``inv pipeline`` and ``inv patch.status``, each
with ``--json``, as a user runs them; then the host's own artifacts are read with the host's python.
Prints, each with its bar:

* the audit's vLLM and speculators versions (0.16.x, 0.3.0);
* the patches applied (0001, 0003, 0004, 0005 among them);
* extract.json's backend (vllm) and, for every ``data_i.pt``, hidden-state rows == tokens (the seed's
  prefix-caching loss was silent);
* the held-out acceptance length (k = 3; >= 1.6) and the pipeline's wall time per stage.

``--fresh`` removes the host's earlier runs first, so every stage runs (else unchanged ones are skipped).
Exit status 1 when a bar is missed. ``--quick`` shows the same figures for any host (the suite runs it on
its tiny Kimi-shaped target after its own pipeline, so every stage is skipped) without judging them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BARS = {"vllm": "0.16", "speculators": "0.3.0", "patches": ["0001", "0003", "0004", "0005"], "acceptance": 1.6}

ROWS = r"""
import glob, json, sys, torch
bad, n = [], 0
for f in sorted(glob.glob(sys.argv[1] + "/data_*.pt")):
    s = torch.load(f, weights_only=True)
    rows = {h.shape[0] for h in s["hidden_states"]}
    n += 1
    if rows != {len(s["input_ids"])} or len(s["loss_mask"]) != len(s["input_ids"]):
        bad.append([f, len(s["input_ids"]), sorted(rows)])
print(json.dumps({"files": n, "bad": bad}))
"""


def inv(*args: str, inventory: str) -> tuple[int, object, float]:
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args, "--json",
                        "--inventory", inventory], cwd=REPO, capture_output=True, text=True)
    try:
        data = json.loads(p.stdout)
    except ValueError:
        raise SystemExit(f"inv {' '.join(args)} printed no JSON (exit {p.returncode}): {p.stderr.strip()[-500:]}")
    return p.returncode, data, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="local-legacy")
    ap.add_argument("--inventory", default=str(REPO / "inventory.yaml"))
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--quick", action="store_true", help="figures shown, bars not judged (the suite's run)")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from harness.inventory import load_inventory
    from results import record

    host = load_inventory(a.inventory).hosts[a.host]
    workdir, python = Path(os.path.expanduser(host.workdir)), os.path.expanduser(host.python)
    if not workdir.is_dir():
        raise SystemExit(f"host {a.host}: this bench reads the host's artifacts in place, and its workdir {workdir} "
                         "is not on this machine; use a local host (or one on loopback)")
    if a.fresh:
        shutil.rmtree(workdir / "runs", ignore_errors=True)

    ok, figures = True, []

    def bar(name: str, value, good: bool, want: str):
        nonlocal ok
        ok &= good
        figures.append((name, value, want))
        print(f"{name:<34} {str(value):<28} {'-  ' if a.quick else 'ok ' if good else 'MISS'} (bar: {want})")

    rc, audit, _ = inv("audit", "--hosts", a.host, inventory=a.inventory)
    pk = (audit.get("hosts", {}).get(a.host) or {}).get("packages") or {}
    rc, runs, wall = inv("pipeline", "--hosts", a.host, inventory=a.inventory)
    if rc != 0 or not isinstance(runs.get(a.host), list):
        raise SystemExit(f"inv pipeline failed on {a.host}: {json.dumps(runs.get(a.host))[:800]}")
    _, status, _ = inv("patch.status", "--hosts", a.host, inventory=a.inventory)
    applied = [p["name"][:4] for p in status[a.host]["packages"]["speculators"]["patches"] if p["state"] == "applied"]
    by_stage = {r["stage"]: r for r in runs[a.host]}
    extract = json.loads((workdir / "runs" / by_stage["extract"]["run_id"] / "artifacts" / "extract.json").read_text())
    metrics = json.loads((workdir / "runs" / by_stage["evaluate"]["run_id"] / "artifacts" / "metrics.json").read_text())
    data = workdir / "runs" / by_stage["extract"]["run_id"] / "artifacts" / "data"
    rows = json.loads(subprocess.run([python, "-c", ROWS, str(data)], capture_output=True, text=True, check=True).stdout)

    stages = ", ".join(f"{s} {(r.get('result') or {}).get('seconds', 0):.0f}s ({r['state']})"
                       for s, r in by_stage.items())
    print(f"reference scenario in miniature on {a.host}: inv pipeline took {wall / 60:.1f} min this time; "
          f"each stage's own run: {stages}")
    bar("audit: vLLM", pk.get("vllm"), str(pk.get("vllm", "")).startswith(BARS["vllm"]), BARS["vllm"] + ".x")
    bar("audit: speculators", pk.get("speculators"), pk.get("speculators") == BARS["speculators"], BARS["speculators"])
    bar("patch.status: applied", " ".join(applied), all(p in applied for p in BARS["patches"]),
        ", ".join(BARS["patches"]) + " among them")
    bar("extract.json backend", extract["backend"], extract["backend"] == "vllm", "vllm")
    bar("data_i.pt rows == tokens", f"{rows['files'] - len(rows['bad'])}/{rows['files']} files",
        rows["files"] == extract["samples"] and not rows["bad"], "every sample")
    bar("held-out acceptance length (k=3)", metrics["acceptance_length"],
        metrics["acceptance_length"] >= BARS["acceptance"], f">= {BARS['acceptance']}")
    print(f"{'acceptance measured with':<34} {metrics.get('measured_with')}")
    record("legacy", [("inv pipeline wall", f"{wall / 60:.1f} min", ""), *figures], a.quick)
    return 0 if ok or a.quick else 1


if __name__ == "__main__":
    sys.exit(main())
