"""Every bench runs in the suite, in its quick mode, so that none can rot silently: the real script, its
real subprocesses and hosts, smaller sizes, figures printed and bars shown but not judged. The benches
that need a trained draft run beside the tests that train one: bench/pipeline.py in
test_default_pipeline.py, bench/legacy.py in test_legacy_pipeline.py, bench/serve.py in test_serve.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO
from job_support import run_bench


def test_every_bench_has_a_quick_mode_run_by_the_suite():
    """A new bench without a quick mode, one no test runs, or one that does not record its figures in
    bench/results.md (bench/results.py, the recorder itself, is no bench) fails here."""
    tests = "".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    for bench in sorted((REPO / "bench").glob("*.py")):
        if bench.stem == "results":
            continue
        assert f'run_bench("{bench.stem}"' in tests, f"no test runs bench/{bench.name}"
        assert "from results import record" in bench.read_text() and "record(" in bench.read_text(), \
            f"bench/{bench.name} does not record its figures in bench/results.md"
        assert '"--quick"' in bench.read_text(), f"bench/{bench.name} has no --quick"


def test_audit_bench_quick():
    out = run_bench("audit", "--quick")
    ms = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(ours 1 host|ours 2 hosts|inv -l) +(\d+) ms$", out, re.M)}
    assert set(ms) == {"ours 1 host", "ours 2 hosts", "inv -l"} and all(v > 0 for v in ms.values()), out
    assert "quick: Ansible not run, bars not judged" in out


def test_pull_bench_quick():
    out = run_bench("pull", "--quick")
    for method in ("ours", "rsync", "fabric"):
        assert re.search(rf"^  {method} +[\d.]+ s +[\d.]+ MB/s", out, re.M), out
    assert "(bar >= 0.90: quick: not judged)" in out


@pytest.mark.timeout(900)
def test_patch_bench_quick():
    out = run_bench("patch", "--quick")
    import yaml

    series = len(yaml.safe_load((REPO / "patches" / "speculators" / "0.3.0" / "series.yaml").read_text())["patches"])
    assert f"the speculators 0.3.0 series ({series} patches" in out, out
    assert re.search(r"gnu patch over ssh / ours: [\d.]+x faster \(bar >= 3: quick: not judged\)", out), out


def test_results_file_names_the_machine_of_every_figure():
    """bench/results.md, which README links: one table, each row with its date, bench, figure and the
    machine with its CPU flags; a quick run (the suite's) adds none."""
    text = (REPO / "bench" / "results.md").read_text()
    rows = [l for l in text.splitlines() if l.startswith("| ") and not l.startswith("| date") and not l.startswith("| ---")]
    cells = [[c.strip() for c in l.strip().strip("|").split("|")] for l in rows]
    assert rows and all(len(c) == 7 and c[0] and c[2] and c[3] and "cores" in c[6] for c in cells), rows[:3]
    assert "bench/results.md" in (REPO / "README.md").read_text()


def test_plan_bench():
    out = run_bench("plan", "--quick")
    assert "bars              ~23.5 TB, free_bytes reported, exit 1: PASS" in out, out


def test_gpu_check_quick_on_the_cpu(current_python):
    """bench/gpu_check.py as the suite can run it (``--device cpu``: no FlexAttention backward or fused
    loss on a CPU): the hf capture within bf16's noise of transformers' float32 forward, and the train
    stage's speculators 0.9 trainer on the states written as the extract stage writes them, its loss
    falling."""
    out = run_bench("gpu_check", "--device", "cpu", "--samples", "8", "--epochs", "2", "--json", "--quick",
                    python=current_python)
    report = json.loads(out[out.index("{"):])
    assert report["speculators"] == "0.9.0" and report["passed"], report["bars"]
    capture = report["capture"]
    assert capture["tokens"] > 8 * 20 and set(capture["worst_relative_diff"]) == set(capture["bf16_forward_diff"])
    assert list(report["train"]) == ["sdpa+eager"]  # the CUDA variant is the GPU's
    run = report["train"]["sdpa+eager"]
    assert run["steps"] >= 2 and run["finite"] and run["loss_last_epoch"] < run["loss_first_epoch"]
