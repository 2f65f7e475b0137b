"""Kinds of draft compared on the embedded default: ``inv pipeline --compare`` on the shipped ``local``
host (SmolLM2-135M-Instruct, today's stack), as a user runs it after README's main job.

    python bench/compare.py [--inventory inventory.yaml] [--hosts local] [--compare SPEC ...] [--runs-dir DIR] [--quick]

Runs ``inv pipeline --hosts HOST --compare SPEC ... --json`` (default ``speculator=eagle3,dflash``) with
the inventory as it stands, so the host's earlier runs are reused where their inputs are unchanged
(README's main job leaves prepare, extract and vocab behind). Prints each variant's figures (acceptance,
per category, tokens/s with and without the draft, training time) and judges issue 34's bars:

- a variant of a type other than EAGLE-3 trained, served by the host's vLLM and measured live, in the
  same table as an EAGLE-3 variant;
- the variants share one prepare, one extract and one vocab run, and no variant after the first ran any
  of them.

Exit status 1 when a bar is missed. The figures go to bench/results.md. ``--quick``: the same, recording
nothing (the suite runs it on a tiny target's host whose comparison has already run, so every stage is
skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from results import record

REPO = Path(__file__).resolve().parent.parent
SHARED = ("prepare", "extract", "vocab")


def compare(inventory: str, host: str, specs: list[str], runs_dir: str | None, log: Path) -> tuple[dict, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if runs_dir:
        env["HARNESS_RUNS_DIR"] = runs_dir
    flags = [a for spec in specs for a in ("--compare", spec)]
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "invoke", "pipeline", "--hosts", host, *flags, "--json",
                               "--inventory", inventory], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err,
                              text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"inv pipeline --compare failed (exit {proc.returncode}); see {log}")
    return json.loads(proc.stdout)[host], wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inventory", default=str(REPO / "inventory.yaml"))
    ap.add_argument("--hosts", default="local")
    ap.add_argument("--compare", action="append", help="as inv pipeline's (repeatable); default speculator=eagle3,dflash")
    ap.add_argument("--runs-dir", help="the workstation's runs directory (default: the harness's)")
    ap.add_argument("--quick", action="store_true", help="record nothing in bench/results.md (the suite's run)")
    args = ap.parse_args()
    specs = args.compare or ["speculator=eagle3,dflash"]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-compare-{args.hosts}.log"
    comparison, wall = compare(args.inventory, args.hosts, specs, args.runs_dir, log)
    rows = comparison["variants"]

    print(f"{args.hosts}: {comparison['setting']} compared in {wall / 60:.1f} min; shared runs: "
          + (", ".join(f"{s} {r}" for s, r in comparison["shared"].items()) or "none"))
    for r in rows:
        cats = "  ".join(f"{c} {v['acceptance_length']:.2f}/{v['speedup']:.2f}x" for c, v in r["categories"].items()
                         if v.get("acceptance_length") is not None and v.get("speedup"))
        print(f"  {r['variant']:<32} {r['speculator']:<7} acceptance {r['acceptance_length'] or 0:.2f} "
              f"per position {r['acceptance_per_position']}  {r['tokens_per_s']} tok/s vs {r['tokens_per_s_without']} "
              f"without ({r['speedup'] or 0:.2f}x)  train {r['train_seconds']:.0f} s  ran {','.join(r['ran']) or 'nothing'}")
        print(f"  {'':<32} per category (acceptance/speedup): {cats}")
    print(f"  fastest: {comparison['fastest']}; plot {comparison['plot']}")

    others = [r for r in rows if r["speculator"] != "eagle3" and r.get("tokens_per_s") and r.get("acceptance_length")]
    eagle3 = [r for r in rows if r["speculator"] == "eagle3" and r.get("tokens_per_s")]
    shared_ok = set(SHARED) <= set(comparison["shared"]) and not any(set(SHARED) & set(r["ran"]) for r in rows[1:])
    bars = {"another type served and measured beside EAGLE-3": bool(others and eagle3),
            "one prepare, extract and vocab for all variants": shared_ok}
    for name, ok in bars.items():
        print(f"  {'PASS' if ok else 'MISS'}  {name}")

    figures = []
    for r in rows:
        held = r["categories"].get("held-out (all)", {})
        figures.append((f"compare {r['variant']}: held-out acceptance / speedup, batch 1; train time",
                        f"{r['acceptance_length'] or 0:.2f} / {held.get('speedup') or 0:.2f}x; {r['train_seconds']:.0f} s", ""))
        ood = "; ".join(f"{c} {v['acceptance_length']:.2f}/{v['speedup']:.2f}x" for c, v in r["categories"].items()
                        if c.startswith("ood-") and v.get("acceptance_length") is not None and v.get("speedup"))
        if ood:
            figures.append((f"compare {r['variant']}: out-of-distribution acceptance/speedup", ood, ""))
    figures.append(("compare: another type served and measured beside EAGLE-3; shared runs",
                    f"{'yes' if bars['another type served and measured beside EAGLE-3'] else 'no'}; "
                    f"{', '.join(comparison['shared']) or 'none'}", "yes; prepare, extract, vocab"))
    record("compare", figures, args.quick)
    return 0 if all(bars.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
