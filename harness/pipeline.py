"""``inv pipeline``: the whole EAGLE-3 job on one host, stage after stage, skipping what is done.

Each stage run gets a content-addressed run id: ``<stage>-<hash>`` of the stage's code, the model, the
pipeline settings that stage reads, and the run ids of the stages it reads. The runner never repeats a finished run
id, so a stage whose inputs hash to those of its last successful run is skipped for free, and a
changed setting reruns exactly the stages downstream of it. ``--from`` finds the upstream runs by the
same ids (they must have succeeded before); ``--to`` stops early.

Before the first stage the host's speculators is patched if its patch set says so (one transaction
on the host, see harness/patches.py). Small artifacts (vocab mapping, checkpoint, metrics, plots) are
pulled into ``runs/<run-id>/``; hidden states stay on the host.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from harness import REMOTE_DIR
from harness.connection import HostConnection
from harness.envfile import Masker, secret_values
from harness.errors import HarnessError
from harness.inventory import Inventory

#: stage -> the stages whose artifacts it reads (its ``inputs``), in pipeline order
PIPELINE: dict[str, tuple[str, ...]] = {
    "prepare": (),
    "extract": ("prepare",),
    "vocab": ("extract",),
    "train": ("extract", "vocab"),
    "evaluate": ("prepare", "extract", "train"),
}
ORDER = list(PIPELINE)
#: the pipeline settings each stage reads (tests/test_pipeline.py checks these against the stage
#: sources); a stage's run id hashes only these, so changing ``lr`` reruns train and evaluate only
COMMON_SETTINGS = ("device", "dtype", "threads", "extra")
READS: dict[str, tuple[str, ...]] = {
    "prepare": ("dataset", "dataset_split", "samples", "heldout", "max_seq_len", "regenerate", "max_new_tokens",
                "batch_size", "seed"),
    "extract": ("capture_layers", "backend", "max_seq_len", "batch_size", "tensor_parallel",
                "gpu_memory_utilization"),
    "vocab": ("draft_vocab_size",),
    "train": ("epochs", "lr", "ttt_steps", "ttt_verified_tokens", "ttt_step_loss_decay", "k", "seed", "draft_layers",
              "draft_intermediate_size", "train_seq_len", "val_fraction", "gpus", "compile"),
    "evaluate": ("k", "max_new_tokens", "max_seq_len", "batch_size", "backend", "tensor_parallel", "compile"),
}
#: stages that need the GPUs (and so the service guard) when the host has any
GPU_STAGES = {"prepare", "extract", "train", "evaluate"}


def select_stages(start: str | None, stop: str | None) -> list[str]:
    for name, value in (("--from", start), ("--to", stop)):
        if value and value not in PIPELINE:
            raise HarnessError(f"{name} {value!r}: unknown stage; stages are {', '.join(ORDER)}")
    i = ORDER.index(start) if start else 0
    j = ORDER.index(stop) if stop else len(ORDER) - 1
    if i > j:
        raise HarnessError(f"--from {start} comes after --to {stop}")
    return ORDER[i:j + 1]


def stage_code_hash(stage: str, root: Path | None = None) -> str:
    """Hash of what decides a stage's behaviour on the host: its module, the shared helpers, the runner."""
    root = root or REMOTE_DIR
    h = hashlib.sha256()
    for rel in (f"stages/{stage}.py", "stages/common.py", "stages/__init__.py", "runtime/runstage.py"):
        p = root / rel
        if p.is_file():
            h.update(rel.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def stage_settings(inv: Inventory, stage: str) -> dict:
    """The pipeline settings ``stage`` is given: exactly those it reads, unset ones left to its defaults.
    The run spec carries only these, so the runner's spec hash and the run id agree."""
    every = inv.pipeline.model_dump(exclude_none=True)
    return {k: every[k] for k in (*READS[stage], *COMMON_SETTINGS) if k in every}


def run_ids(inv: Inventory, root: Path | None = None) -> dict[str, str]:
    """The content-addressed run id of every stage, given the inventory (no host needed)."""
    model = inv.model.model_dump() if inv.model else None
    ids: dict[str, str] = {}
    for stage, deps in PIPELINE.items():
        settings = stage_settings(inv, stage)
        key = json.dumps({"stage": stage, "code": stage_code_hash(stage, root), "model": model,
                          "settings": settings, "inputs": {d: ids[d] for d in deps}}, sort_keys=True, default=str)
        ids[stage] = f"{stage}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return ids


@dataclass
class StageOutcome:
    stage: str
    run_id: str
    state: str  # ran | skipped | failed
    seconds: float = 0.0
    result: dict = field(default_factory=dict)
    pulled: str | None = None

    def as_dict(self) -> dict:
        return {"stage": self.stage, "run_id": self.run_id, "state": self.state, "seconds": round(self.seconds, 1),
                "result": self.result, "pulled": self.pulled}


def _ensure_patched(conn: HostConnection, inv: Inventory, say: Callable[[str], None]) -> dict:
    """Apply the host's patch set if it needs it: one patchtool transaction on the host, a no-op when
    every needed patch is already applied. A version we have no series for stops the pipeline here,
    before minutes are spent loading a model into code that would break."""
    from harness import patches  # imported here to keep the CLI's start-up light

    res = conn.run_script("patchtool", patches.host_spec(conn.host, "apply"))
    if not res.get("ok"):
        raise HarnessError(f"host {conn.name}: patching speculators failed: {res.get('error')}; "
                           "see inv patch.status (or run with --no-patch if you manage the patches yourself)")
    if res.get("changed"):
        say(f"patched speculators {res.get('installed')}: {', '.join(res.get('applied', []))}")
    return res


def run_pipeline(conn: HostConnection, inv: Inventory, *, start: str | None = None, stop: str | None = None,
                 progress: bool = True, console: Console | None = None, pull: bool = True,
                 dest_root: Path | None = None, patch: bool = True,
                 say: Callable[[str], None] | None = None) -> list[StageOutcome]:
    """Run the selected stages on ``conn``'s host; returns one outcome per stage (raises on failure)."""
    from harness import runs

    console = console or Console(stderr=True, highlight=False, soft_wrap=True)
    say = say or (lambda m: console.print(f"[bold cyan]\\[{conn.name}][/] {m}"))
    stages = select_stages(start, stop)
    ids = run_ids(inv)
    if patch:
        _ensure_patched(conn, inv, say)
    # Upstream runs that this invocation will not run must already have succeeded.
    needed = {d for s in stages for d in PIPELINE[s] if d not in stages}
    for d in sorted(needed, key=ORDER.index):
        try:
            state = runs.status(conn, ids[d]).get("state")
        except HarnessError:  # no such run on the host
            state = None
        if state != "succeeded":
            raise HarnessError(
                f"host {conn.name}: --from {stages[0]} needs a successful {d} run with these settings ({ids[d]}), "
                f"but it is {state or 'absent'}; run: inv pipeline --from {d}")
    outcomes: list[StageOutcome] = []
    for stage in stages:
        rid = ids[stage]
        inputs = {d: ids[d] for d in PIPELINE[stage]}
        gpu = conn.host.gpus > 0 and stage in GPU_STAGES
        t0 = time.monotonic()
        # lock_wait: the previous GPU stage's wrapper may still be waiting for the service to come
        # back healthy; queue behind it rather than be refused by the host's GPU lock
        launched = runs.launch(conn, inv, stage, run_id=rid, inputs=inputs, gpu=gpu,
                               extra={"pipeline": stage_settings(inv, stage)},
                               lock_wait=(conn.host.service.health_timeout + 600) if gpu and conn.host.service else 0)
        if not launched.launched and launched.status.get("state") == "succeeded":
            say(f"{stage}: skipped, inputs unchanged since run {rid}")
            st = launched.status
            state = "skipped"
        else:
            say(f"{stage}: running as {rid}")
            st = runs.follow(conn, rid, progress=progress, console=console,
                             masker=Masker(secret_values(inv, None)))
            state = "ran"
            if st.get("state") != "succeeded":
                raise HarnessError(f"host {conn.name}: stage {stage}: {runs.describe_failure(st)}; "
                                   f"see: inv runs.logs {rid} --hosts {conn.name}")
        out = StageOutcome(stage, rid, state, seconds=time.monotonic() - t0)
        if pull:
            from harness.pull import pull as do_pull
            res = do_pull(conn, rid, dest=(dest_root / rid) if dest_root else None, progress=progress, console=console)
            out.pulled = str(res.dest)
            out.result = res.result or {}
        else:
            out.result = runs.status(conn, rid).get("result") or {}
        if state == "skipped":
            out.seconds = float(out.result.get("seconds", 0.0) or 0.0)
        outcomes.append(out)
    return outcomes


def summary_table(host: str, outcomes: list[StageOutcome]) -> Table:
    """Per-stage time, samples, tokens, loss, acceptance length."""
    t = Table(title=f"pipeline on {host}", title_justify="left", header_style="bold")
    for col in ("stage", "run", "state", "time", "samples", "tokens", "loss", "acceptance", "artifacts"):
        t.add_column(col, justify="right" if col in ("time", "samples", "tokens", "loss", "acceptance") else "left")
    for o in outcomes:
        r = o.result
        loss = r.get("loss", r.get("final_loss"))
        acc = r.get("acceptance_length")
        t.add_row(o.stage, o.run_id, o.state, f"{o.seconds:.1f}s",
                  str(r.get("samples", "")), str(r.get("tokens", "")),
                  f"{loss:.3f}" if isinstance(loss, (int, float)) else "",
                  f"{acc:.2f}" if isinstance(acc, (int, float)) else "", o.pulled or "")
    return t
