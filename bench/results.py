"""Where the benches' figures go: each bench prints its figures and appends them here, to bench/results.md,
one row a figure with the date, the commit, the machine and the CPU flags that decide the speed of a
run (bf16 in hardware or not), so that a figure is always read beside the machine that gave it.

A ``--quick`` run (the test suite's) records nothing: its sizes are not the bench's.
"""
from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).with_name("results.md")
#: the CPU flags that change what a bench measures: bf16 in hardware (AMX, AVX512-BF16), AVX-512, AVX2
FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def machine() -> str:
    """``CPU model, N cores, flags`` of this machine, as a row of results.md says it."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(have) or 'no ' + '/'.join(FLAGS[:2])}"


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    return r.stdout.strip() or "?"


def record(bench: str, figures: list[tuple[str, object, str]], quick: bool = False) -> None:
    """Append ``figures`` ([(figure, value, bar or "")]) of ``bench`` to results.md (not for ``quick``)."""
    if quick or not figures:
        return
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    head, where = commit(), machine()
    rows = "".join(f"| {when} | {head} | {bench} | {name} | {value} | {bar} | {where} |\n" for name, value, bar in figures)
    with open(RESULTS, "a") as f:
        f.write(rows)
    print(f"recorded {len(figures)} figure(s) in {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}")
