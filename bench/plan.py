"""The scale bar: ``inv pipeline --plan`` sizes Kimi-K2.5 at full scale before anything loads.

    python bench/plan.py [--samples 50000] [--max-seq-len 8192]

Writes Kimi-K2.5's config.json (no weights: the plan reads the shape only; its text model sits under
``text_config``) to a temporary directory, points a copy of the shipped inventory's ``local`` host at
it with that many samples of that length, and runs the real CLI: ``inv pipeline --plan --json --hosts
local``. Prints the hidden states' size, the free space under the workdir, the verdict, the ways out and
the wall time. Bars: about 23.5 TB (four captured layers x 7168 x bf16 = 57,344 bytes a token), free_bytes
reported, exit code 1 (it does not fit).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from models import KIMI_K25_CONFIG  # noqa: E402 - the same config the test reads
from results import record  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=50000)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--python", default=sys.executable,
                    help="the local host's python (the plan's tools are stdlib: any python 3 will do; default this one)")
    ap.add_argument("--quick", action="store_true", help="the same run, not recorded in bench/results.md (the suite's)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "Kimi-K2.5"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(KIMI_K25_CONFIG))
        inv = yaml.safe_load((REPO / "inventory.yaml").read_text())
        host = inv["hosts"]["local"]
        host["pipeline"] = {"samples": a.samples, "max_seq_len": a.max_seq_len}
        host["python"] = a.python  # the shipped venv need not exist: planning loads nothing
        inv = {"hosts": {"local": host}, "model": {"path": str(model), "trust_remote_code": True},
               "pipeline": inv.get("pipeline") or {}}
        path = Path(tmp) / "inventory.yaml"
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "invoke", "pipeline", "--plan", "--json", "--hosts", "local",
                            "--inventory", str(path)], cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    try:
        p = json.loads(r.stdout)["local"]
    except (ValueError, KeyError):
        print(r.stdout[-2000:], r.stderr[-2000:])
        return 2
    hs = p["hidden_states"]
    tb = hs["bytes"] / 1e12
    print(f"target            {p['model']['num_hidden_layers']} layers, hidden {p['model']['hidden_size']}, "
          f"vocabulary {p['model']['vocab_size']} ({p['model']['text_config']})")
    print(f"hidden states     {tb:.2f} TB = {hs['tokens']:,} tokens x {hs['bytes_per_token']:,} bytes ({hs['basis']})")
    print(f"free              {p['free_bytes'] / 1e9:.1f} GB under {p['workdir']}")
    print(f"verdict           {p['verdict']}: exit code {r.returncode}")
    for w in p["ways_out"]:
        print(f"way out           {w}")
    print(f"wall              {wall:.2f} s (one round trip, nothing loaded)")
    ok = abs(tb - 23.5) < 0.1 and r.returncode == 1 and p["free_bytes"] > 0
    print(f"bars              ~23.5 TB, free_bytes reported, exit 1: {'PASS' if ok else 'FAIL'}")
    record("plan", [("Kimi-K2.5, 50,000 x 8,192 tokens: hidden states", f"{tb:.2f} TB", "~23.5 TB"),
                    ("verdict, exit code", f"{p['verdict']}, {r.returncode}", "exit 1"), ("wall", f"{wall:.2f} s", "")], a.quick)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
