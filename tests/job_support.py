"""What the tests of whole jobs share: the tiny pipeline every module starts from (each says only how its
own differs), the main job's line budget, and running a bench as the suite runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, run_inv

#: a pipeline small enough for the tiny targets on 2 cores: a few chat prompts, a 64-token draft vocabulary
TINY_PIPELINE = {"dataset": "builtin:chat", "samples": 12, "heldout": 4, "max_seq_len": 96, "max_new_tokens": 16,
                 "draft_vocab_size": 64, "lr": 3e-3, "train_seq_len": 256, "seed": 0}
#: the current stages' evaluate on a tiny target: a few prompts, the draft's own MLP small
TINY_CURRENT = {**TINY_PIPELINE, "concurrency": 8, "draft_intermediate_size": 96, "epochs": 1, "val_fraction": 0.25,
                "eval_prompts": 4, "speed_prompts": 0}

#: README's main job (setup, then the pipeline) prints at most this many lines at the default verbosity,
#: setup at most SETUP_LINES of them
MAIN_JOB_LINES, SETUP_LINES = 60, 5


def run_bench(name: str, *args: str, timeout: float = 600, env: dict | None = None, python=sys.executable) -> str:
    """``python bench/<name>.py ARGS`` (this python unless told): exit 0, no traceback; its output."""
    p = subprocess.run([str(python), str(REPO / "bench" / f"{name}.py"), *args], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert p.returncode == 0 and "Traceback" not in p.stderr, f"bench/{name}.py {' '.join(args)}: exit " \
        f"{p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def whole_pipeline(host: str, env: dict, cwd, timeout: float = 2700) -> dict:
    """``inv pipeline --hosts HOST --json``: exit 0, the five stages in order, each run succeeded; by stage."""
    r = run_inv("pipeline", "--hosts", host, "--json", cwd=cwd, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stages = {s["stage"]: s for s in json.loads(r.stdout)[host]}
    assert list(stages) == ["prepare", "extract", "vocab", "train", "evaluate"]
    assert all(s["run_state"] == "succeeded" for s in stages.values()), stages
    return stages
