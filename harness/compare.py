"""``inv pipeline --compare``: several variants of the pipeline's settings on one host, measured side by side.

Why here: the runs are content-addressed, so the variants of a train setting (``speculator=eagle3,dflash``,
``draft_layers=1,2``) share the prepare, extract and vocab runs, which run once; each variant trains and
evaluates its own draft. The comparison (one row a variant: acceptance per position and per category,
tokens/s with and without the draft, training time, checkpoint size) is saved on the workstation as
``runs/comparisons/<host>.json``, from which ``inv deploy --best`` takes the measured fastest.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import ValidationError

from harness.errors import HarnessError
from harness.inventory import Inventory, PipelineSpec
from harness.runs import local_runs_dir

#: the evaluate category whose speed decides the fastest variant: every held-out prompt together
HELDOUT = "held-out (all)"


def _setting(text: str, pair: str) -> tuple[str, str]:
    name, sep, value = pair.partition("=")
    name = name.strip()
    if not sep or not name or not value.strip():
        raise HarnessError(f"--compare {text!r}: give SETTING=VALUE1,VALUE2 (e.g. speculator=eagle3,dflash), or one "
                           "--compare per variant: SETTING=VALUE [SETTING=VALUE ...]")
    if name not in PipelineSpec.model_fields:
        raise HarnessError(f"--compare: {name!r} is not a pipeline setting (see inventory.yaml's pipeline:)")
    return name, value.strip()


def parse_variants(specs: str | list[str]) -> list[dict[str, Any]]:
    """The variants, each the pipeline settings it changes, values read as YAML (numbers, booleans, strings).
    One ``NAME=V1,V2,...``: one variant per value of one setting. Several (one ``--compare`` each):
    ``NAME=V [NAME2=V2 ...]`` one variant each, so variants may differ in several settings
    (``speculator=eagle3`` against ``speculator=dflash draft_layers=2``). At least two, all distinct."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    if len(specs) == 1:
        name, values = _setting(specs[0], specs[0])
        variants = [{name: yaml.safe_load(v.strip()) if v.strip() else ""} for v in values.split(",")]
    else:
        variants = []
        for text in specs:
            pairs = [_setting(text, pair) for pair in text.split()] or [_setting(text, text)]
            variants.append({name: yaml.safe_load(value) for name, value in pairs})
    if len(variants) < 2 or len({json.dumps(v, sort_keys=True) for v in variants}) < len(variants):
        what = ", ".join(dict.fromkeys(n for v in variants for n in v)) or "a setting"
        raise HarnessError(f"--compare {' '.join(specs)!r}: give two or more distinct values of {what}")
    return variants


def label(variant: dict[str, Any]) -> str:
    """``speculator=dflash draft_layers=2``: how a variant is named in the table, the JSON and --best."""
    return " ".join(f"{name}={value}" for name, value in variant.items())


def variant_inventory(inv: Inventory, host: str, variant: dict[str, Any]) -> Inventory:
    """``inv`` as ``host`` sees it with the variant's settings over the host's own; a value a setting
    refuses is one line naming both."""
    merged = inv.pipeline_for(host).model_dump(exclude_unset=False)
    try:
        pipeline = PipelineSpec.model_validate({**merged, **variant})
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else next(iter(variant))
        raise HarnessError(f"--compare: pipeline.{name} = {variant.get(name, merged.get(name))!r}: {err['msg']}") from None
    hosts = {**inv.hosts, host: inv.hosts[host].model_copy(update={"pipeline": None})}
    return inv.model_copy(update={"pipeline": pipeline, "hosts": hosts})


def _checkpoint_bytes(pulled: str | None) -> int | None:
    if not pulled:
        return None
    files = list((Path(pulled) / "checkpoint").glob("*"))
    return sum(f.stat().st_size for f in files) if files else None


def variant_row(variant: dict[str, Any], runs: list) -> dict:
    """One variant's figures from its pipeline's runs (the train and evaluate results, the pulled files)."""
    by = {r.stage: r for r in runs}
    train, evaluate = by.get("train"), by.get("evaluate")
    trained, metrics = train.result if train else {}, evaluate.result if evaluate else {}
    categories = {c["category"]: c for c in metrics.get("categories") or []}
    held = categories.get(HELDOUT, {})
    return {
        "variant": label(variant), "settings": variant,
        "runs": {r.stage: r.run_id for r in runs}, "ran": [r.stage for r in runs if r.ran],
        "train_run": train.run_id if train else None,
        "speculator": trained.get("speculator"), "train_seconds": round(float(trained.get("seconds") or 0), 1),
        "checkpoint_bytes": _checkpoint_bytes(train.pulled if train else None),
        "acceptance_length": metrics.get("acceptance_length"),
        "acceptance_per_position": (metrics.get("vllm") or {}).get("acceptance_rate_per_position"),
        "categories": {c: {"acceptance_length": r.get("acceptance_length"), "speedup": r.get("speedup")}
                       for c, r in categories.items()},
        "tokens_per_s": held.get("tokens_per_s"), "tokens_per_s_without": held.get("tokens_per_s_without"),
        "speedup": held.get("speedup"),
    }


def shared_runs(rows: list[dict]) -> dict[str, str]:
    """The runs every variant shares (prepare, extract, vocab for a train setting): the same run id."""
    stages = rows[0]["runs"]
    return {s: rid for s, rid in stages.items() if all(r["runs"].get(s) == rid for r in rows)}


def fastest(rows: list[dict]) -> dict | None:
    """The variant whose server is fastest with its draft on the held-out prompts (None: no speed measured)."""
    timed = [r for r in rows if r.get("tokens_per_s")]
    return max(timed, key=lambda r: r["tokens_per_s"]) if timed else None


def run_comparison(conn, inv: Inventory, variants: list[dict], *, pull: bool = True, patch: bool = True,
                   say: Callable[[str], None] | None = None, **kwargs) -> dict:
    """Each variant's pipeline on ``conn``'s host, one after the other (the shared runs run once, the
    later variants skip them), then the comparison: saved under runs/comparisons/ and returned.
    ``kwargs`` go to each run_pipeline (on_line, on_stage)."""
    from harness.pipeline import run_pipeline

    say = say or (lambda m: None)
    inventories = [variant_inventory(inv, conn.name, v) for v in variants]  # every value checked first
    rows = []
    for variant, inv_v in zip(variants, inventories):
        say(f"variant {label(variant)}")
        runs = run_pipeline(conn, inv_v, pull=pull, patch=patch and not rows, say=say, **kwargs)
        rows.append(variant_row(variant, runs))
    best = fastest(rows)
    comparison = {"host": conn.name, "setting": ", ".join(dict.fromkeys(n for v in variants for n in v)),
                  "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "shared": shared_runs(rows), "variants": rows, "fastest": best["variant"] if best else None}
    path = comparison_path(conn.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    comparison.update(saved=str(path), plot=str(path.with_suffix(".png")))
    plot(comparison, path.with_suffix(".png"))
    path.write_text(json.dumps(comparison, indent=1) + "\n")
    return comparison


def comparison_path(host: str) -> Path:
    return local_runs_dir() / "comparisons" / f"{host}.json"


def best_train_run(host: str) -> tuple[str, dict]:
    """``inv deploy --best``: the train run of the fastest variant of ``host``'s last comparison."""
    path = comparison_path(host)
    try:
        comparison = json.loads(path.read_text())
    except (OSError, ValueError):
        raise HarnessError(f"host {host}: no comparison at {path}; run inv pipeline --compare SETTING=A,B first") from None
    best = next((r for r in comparison["variants"] if r["variant"] == comparison.get("fastest")), None)
    if best is None or not best.get("train_run"):
        raise HarnessError(f"host {host}: the last comparison ({path}) measured no speed (pipeline.speed_prompts 0): "
                           "set pipeline.speed_prompts and compare again")
    return best["train_run"], best


def plot(comparison: dict, path: Path) -> None:
    """Per category, each variant's acceptance length; beside it, tokens/s with and without each draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = comparison["variants"]
    cats = list(dict.fromkeys(c for r in rows for c in r["categories"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        left.bar([x + i * width for x in range(len(cats))],
                 [r["categories"].get(c, {}).get("acceptance_length") or 0 for c in cats], width, label=r["variant"])
    left.set_xticks([x + width * (len(rows) - 1) / 2 for x in range(len(cats))], cats, rotation=30, ha="right")
    left.set_ylabel("acceptance length")
    left.legend(loc="best", fontsize="small")
    names = [r["variant"] for r in rows]
    right.bar(names, [r.get("tokens_per_s") or 0 for r in rows], label="with the draft")
    right.plot(names, [r.get("tokens_per_s_without") or 0 for r in rows], "k_", markersize=30, label="without")
    right.set_ylabel(f"tokens/s, {HELDOUT}")
    right.tick_params(axis="x", rotation=30)
    right.legend(loc="best", fontsize="small")
    fig.suptitle(f"{comparison['host']}: {comparison['setting']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
