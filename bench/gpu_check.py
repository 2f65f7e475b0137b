"""The GPU check: what needs CUDA and not vLLM, run on whatever CUDA machine is at hand.

    python bench/gpu_check.py [--samples 64] [--epochs 6] [--json] [--quick] [--device cpu]

Run it with the python of a GPU host's `gpu` profile (``inv setup`` makes it: speculators 0.9.0,
transformers 5.19.0, torch with CUDA); vLLM is not used. On a tiny Llama target built on the fly (no hub)
it checks, on the device, in bf16:

1. capture: the hf backend's capture (stages/lib/capture.py: hooks on the decoder layers, right-padded
   batches whose shared prefix runs once on a KV cache) against transformers' own float32 forward of each
   sample alone (``output_hidden_states``; the last layer through the target's final norm). Bar: its worst
   difference, relative to the largest reference value, within bf16 noise: at most ``CAPTURE_SLACK``
   times that of transformers' plain bf16 forward of the same sample.
2. train: the current train stage itself (stages/current/train.py ``main``, as the pipeline runs it) on
   those states, written as the extract stage writes them (``hs_{i}.safetensors``): on CUDA its defaults
   are FlexAttention (``simple_flex_attention``) and speculators' fused loss (a Triton kernel). Bars: the
   checkpoint and metrics.json written, every loss finite, the last epoch's mean loss below the first's.
3. agreement: the same training with sdpa attention and the eager loss, same seed, same data. Bar: the
   first ``AGREE_STEPS`` steps' losses within ``AGREE_BAR`` of the FlexAttention + fused run's.

Prints one table (``--json``: one object) with the figures: capture error per layer, step time and
tokens/s of each variant (the first steps, where FlexAttention compiles, apart), peak GPU memory, loss
first and last. ``--device cpu`` runs what a CPU can (1 and 3's sdpa + eager run; FlexAttention has no
CPU backward and the fused loss is a GPU kernel): a smoke test of the script itself. Figures go to
bench/results.md unless ``--quick``. Exit code 0 when every bar is met.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import statistics
import sys
import tempfile
from importlib.metadata import version
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "remote"))  # the stages, as the host runs them
sys.path.insert(0, str(REPO / "tests"))   # the tiny target the stage tests build

# ---------------------------------------------------------------------------------------------------
# settings
CAPTURE_SLACK = 1.5      # the capture's error may be this times transformers' own bf16 forward's (same dtype)
AGREE_STEPS = 3          # steps compared between the two training variants (before rounding compounds)
AGREE_BAR = 0.03         # relative difference of their losses
HIDDEN, HEADS = 256, 4   # the target: 8 Llama layers, head size 64 (FlexAttention's and sdpa's fast paths)
DRAFT_VOCAB = 256        # of the target's 320 tokens
BATCH = 8                # capture rows per forward
TRAIN_SEQ_LEN = 1024     # tokens per packed training batch
LR = 1e-3                # high enough that a few epochs show the loss falling


class StepClock(logging.Handler):
    """The time each training step's metrics were logged (speculators' Trainer logs one dict a step)."""

    def __init__(self):
        super().__init__()
        self.start = time.time()
        self.times: list[float] = []

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.times.append(record.created)


def conversations(tokenizer, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``count`` chat samples as (input_ids, loss_mask): a user turn and an assistant reply of a few of
    the tokenizer's corpus sentences each, through its chat template (so every row shares its system
    prompt: the capture's shared-prefix path runs); the mask covers the reply."""
    import random

    from models import CORPUS

    sentences = sorted(set(CORPUS))
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        user = " ".join(rng.choices(sentences, k=rng.randint(1, 3)))
        reply = " ".join(rng.choices(sentences, k=rng.randint(4, 12)))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                               tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def check_capture(model, samples, captured: list[int], dev: str) -> tuple[list, dict]:
    """The hf capture of ``captured`` (vLLM layer ids: the input of layer i, i.e. the output of layer
    i - 1; the last id is the number of layers, the final pre-norm state) over right-padded batches, and
    per layer its worst difference from transformers' float32 forward of each sample alone, relative to
    the largest value there, beside the same figure for transformers' own bf16 forward."""
    import torch

    from stages.lib.batching import right_padded
    from stages.lib.capture import HfCapture

    n_layers = model.config.num_hidden_layers
    capture = HfCapture(model, [layer - 1 for layer in captured])
    states: list = [None] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    torch.cuda.synchronize() if dev.startswith("cuda") else None
    start = time.perf_counter()
    for first in range(0, len(order), BATCH):
        index = order[first:first + BATCH]
        got = capture(right_padded([samples[i][0] for i in index]).to(dev))
        for row, i in enumerate(index):
            states[i] = torch.stack([h[row, :len(samples[i][0])] for h in got], dim=1)  # [seq, layers, hidden]
    torch.cuda.synchronize() if dev.startswith("cuda") else None
    seconds = time.perf_counter() - start
    capture.close()

    # against transformers' forward of each sample alone: in float32 (the truth) and in bf16 (what bf16
    # itself costs: the capture's error is bf16 noise when it is no larger than that forward's own)
    err = {"capture": {layer: 0.0 for layer in captured}, "forward": {layer: 0.0 for layer in captured}}
    exact = copy.deepcopy(model).float()
    with torch.inference_mode():
        for i, (ids, _mask) in enumerate(samples):
            batch = torch.tensor([ids], device=dev)
            want = exact(input_ids=batch, output_hidden_states=True).hidden_states
            plain = model(input_ids=batch, output_hidden_states=True).hidden_states
            for k, layer in enumerate(captured):
                mine = states[i][:, k]
                if layer == n_layers:  # transformers' last state is the normed one
                    mine = model.model.norm(mine[None])[0]
                truth = want[layer][0].float()
                scale = truth.abs().max().item() or 1.0
                for name, got in (("capture", mine), ("forward", plain[layer][0])):
                    err[name][layer] = max(err[name][layer], (got.float() - truth).abs().max().item() / scale)
    del exact
    tokens = sum(len(ids) for ids, _ in samples)
    return [s.cpu() for s in states], {
        "worst_relative_diff": {str(k): round(v, 5) for k, v in err["capture"].items()},
        "bf16_forward_diff": {str(k): round(v, 5) for k, v in err["forward"].items()},
        "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def write_inputs(work: Path, samples, states, layer_ids: list[int], captured: list[int],
                 vocab_size: int, hidden: int) -> dict:
    """prepare's, extract's and vocab's artifacts as those stages write them, for the train stage."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from stages.current.extract import rows_of
    from stages.lib.vocabulary import write_mappings

    prepare, extract, vocab = (work / name / "artifacts" for name in ("prepare", "extract", "vocab"))
    for d in (prepare, extract / "hidden_states", vocab):
        d.mkdir(parents=True)
    ds = Dataset.from_dict({"input_ids": [ids for ids, _ in samples], "loss_mask": [m for _, m in samples],
                            "seq_len": [len(ids) for ids, _ in samples]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(prepare / "dataset"))
    for i, ((ids, _), hs) in enumerate(zip(samples, states)):
        path = extract / "hidden_states" / f"hs_{i}.safetensors"
        save_file({"hidden_states": hs.to(torch.bfloat16).contiguous(), "token_ids": torch.tensor(ids)}, str(path))
        assert rows_of(path) == len(ids), f"{path}: the extract stage's own check does not read it back"
    (extract / "extract.json").write_text(json.dumps({
        "target_layer_ids": layer_ids, "captured_layer_ids": captured, "num_hidden_layers": captured[-1],
        "hidden_size": hidden, "vocab_size": vocab_size, "samples": len(samples),
        "tokens": sum(len(ids) for ids, _ in samples), "dtype": "bfloat16"}))
    freq: dict[int, int] = {}
    for ids, mask in samples:
        for t, m in zip(ids, mask):
            if m:
                freq[t] = freq.get(t, 0) + 1
    write_mappings(freq, DRAFT_VOCAB, vocab_size, vocab, "vocab")
    return {"prepare": str(prepare), "extract": str(extract), "vocab": str(vocab)}


def train_spec(work: Path, name: str, model_dir: Path, inputs: dict, dev: str, epochs: int, attn: str) -> dict:
    return {"run_id": f"gpu-check-{name}", "stage": "train", "run_dir": str(work / name), "workdir": str(work),
            "inputs": inputs, "model": {"path": str(model_dir)},
            "pipeline": {"device": dev, "epochs": epochs, "lr": LR, "train_seq_len": TRAIN_SEQ_LEN,
                         "val_fraction": 0.125, "draft_attn_impl": attn, "seed": 0}}


def timed(run) -> tuple[object, StepClock, float]:
    """``run()``, its steps clocked (its output goes where main sends everything: the log)."""
    import torch

    clock = StepClock()
    logging.getLogger().addHandler(clock)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        result = run()
    finally:
        logging.getLogger().removeHandler(clock)
    return result, clock, time.perf_counter() - start


def step_figures(losses: list[float], clock: StepClock, epochs: int, samples_tokens: int, dev: str) -> dict:
    import torch

    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    steady = gaps[2:] or gaps  # the first steps compile (FlexAttention, the fused loss's Triton kernel)
    per_epoch = max(1, len(losses) // max(1, epochs))
    first, last = losses[:per_epoch], losses[-per_epoch:]
    step_s = statistics.median(steady) if steady else None
    return {"steps": len(losses), "first_step_s": round(clock.times[0] - clock.start, 2) if clock.times else None,
            "step_s": round(step_s, 4) if step_s else None,
            "tokens_per_s": round(samples_tokens * epochs / len(losses) / step_s, 1) if step_s and losses else None,
            "loss_first_epoch": round(statistics.fmean(first), 4) if first else None,
            "loss_last_epoch": round(statistics.fmean(last), 4) if last else None,
            "finite": all(math.isfinite(x) for x in losses),
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.startswith("cuda") else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test of the script")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--quick", action="store_true", help="do not record the figures in bench/results.md")
    ap.add_argument("--keep", type=Path, help="work in this directory and keep it (logs, checkpoints)")
    a = ap.parse_args()

    try:
        import speculators  # noqa: F401 - only whether it is installed
        import torch
        import transformers
    except ImportError as e:
        print(f"gpu_check: {e.name} is not installed here; run this with the python of a host's `gpu` profile "
              "(inv setup), or pip install -r remote/requirements/gpu.txt", file=sys.stderr)
        return 2
    on_gpu = a.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; run it on a GPU machine "
              "(--device cpu: the smoke test)", file=sys.stderr)
        return 2
    from models import build_tiny_model
    from stages.current import train
    from stages.current.extract import target_layer_ids
    from stages.lib.trainworker import train_tapped

    report: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                    "speculators": version("speculators"), "device": a.device,
                    "device_name": torch.cuda.get_device_name(a.device) if on_gpu else "cpu",
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(a.device))) if on_gpu else None}
    bars: dict[str, bool] = {}
    with contextlib.ExitStack() as stack:
        if a.keep:
            a.keep.mkdir(parents=True, exist_ok=True)
            work = a.keep
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-")))
        log = stack.enter_context(open(work / "gpu_check.log", "a"))  # the libraries' chatter, the stage's log
        stack.enter_context(contextlib.redirect_stdout(log))
        stack.enter_context(contextlib.redirect_stderr(log))
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = build_tiny_model(work / "target", hidden=HIDDEN, heads=HEADS)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(a.device).eval()
        n_layers = model.config.num_hidden_layers
        layer_ids = target_layer_ids(None, n_layers)
        captured = [*layer_ids, n_layers]

        # 1. capture
        samples = conversations(tokenizer, a.samples, seed=0)
        states, report["capture"] = check_capture(model, samples, captured, a.device)
        worst = max(report["capture"]["worst_relative_diff"].values())
        noise = max(report["capture"]["bf16_forward_diff"].values())
        bars[f"capture within {CAPTURE_SLACK:g}x bf16's own error of transformers' float32 forward"] = (
            worst <= CAPTURE_SLACK * noise)
        vocab_size, hidden = model.config.vocab_size, model.config.hidden_size
        del model
        if on_gpu:
            torch.cuda.empty_cache()
        inputs = write_inputs(work, samples, states, layer_ids, captured, vocab_size, hidden)
        tokens = sum(len(ids) for ids, _ in samples) * (1 - 0.125)

        # 2. the train stage as the pipeline runs it (on CUDA: FlexAttention + the fused loss)
        variants = {}
        if on_gpu:
            spec = train_spec(work, "flex-fused", model_dir, inputs, a.device, a.epochs, "auto")
            result, clock, seconds = timed(lambda: train.main(spec))
            metrics = json.loads((work / "flex-fused" / "artifacts" / "metrics.json").read_text())
            losses = [m["loss"] for m in metrics["train"]]
            args = metrics["config"]["args"]
            variants["flex+fused"] = {**step_figures(losses, clock, a.epochs, tokens, a.device),
                                      "attn": args[args.index("--draft-attn-impl") + 1],
                                      "loss": "eager" if "--loss-implementation" in args else "fused",
                                      "seconds": round(seconds, 1)}
            ckpt = work / "flex-fused" / "artifacts" / "checkpoint"
            bars["the stage wrote its checkpoint"] = all((ckpt / f).is_file() for f in ("config.json", "model.safetensors"))

        # 3. sdpa + the eager loss, same seed and data (on a CPU: the stage's own defaults)
        spec = train_spec(work, "sdpa-eager", model_dir, inputs, a.device, a.epochs, "sdpa")
        cfg = train.common.settings(spec, train.SETTINGS)
        meta, shards = train.extraction(spec)
        out = train.common.artifacts(spec)
        args = train.train_args(spec, cfg, meta, str(out / "checkpoints"), on_gpu, str(shards[0]))
        if "--loss-implementation" not in args:
            args += ["--loss-implementation", "eager"]
        tap, clock, seconds = timed(lambda: train_tapped(args))
        losses = [m["loss"] for m in tap.train]
        variants["sdpa+eager"] = {**step_figures(losses, clock, a.epochs, tokens, a.device), "attn": "sdpa",
                                  "loss": "eager", "seconds": round(seconds, 1)}
        report["train"] = variants
        for name, v in variants.items():
            bars[f"{name}: losses finite, last epoch below the first"] = bool(
                v["finite"] and v["loss_last_epoch"] is not None and v["loss_last_epoch"] < v["loss_first_epoch"])
        if "flex+fused" in variants:
            flex = json.loads((work / "flex-fused" / "artifacts" / "metrics.json").read_text())["train"]
            pairs = list(zip([m["loss"] for m in flex], losses))[:AGREE_STEPS]
            diff = max((abs(x - y) / abs(y) for x, y in pairs), default=math.inf)
            report["agreement"] = {"steps": len(pairs), "worst_relative_diff": round(diff, 5)}
            bars[f"flex+fused within {AGREE_BAR:g} of sdpa+eager over {AGREE_STEPS} steps"] = diff <= AGREE_BAR
    report["bars"] = bars
    report["passed"] = all(bars.values())
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        show(report)
    from results import record

    record("gpu_check", figures(report), quick=a.quick)
    return 0 if report["passed"] else 1


def figures(report: dict) -> list[tuple[str, object, str]]:
    """The report as results.md's rows (figure, value, bar); the device is named in each row."""
    on = f"{report['device_name']}, torch {report['torch']}, speculators {report['speculators']}"
    worst = max(report["capture"]["worst_relative_diff"].values())
    noise = max(report["capture"]["bf16_forward_diff"].values())
    rows = [(f"capture: worst relative difference to the float32 forward ({on})", worst,
             f"<= {CAPTURE_SLACK:g} x {noise} (the bf16 forward's)"),
            (f"capture tokens/s ({on})", report["capture"]["tokens_per_s"], "")]
    for name, v in report["train"].items():
        rows += [(f"train {name}: step s, first step s ({on})", f"{v['step_s']}, {v['first_step_s']}", ""),
                 (f"train {name}: tokens/s ({on})", v["tokens_per_s"], ""),
                 (f"train {name}: loss first -> last epoch ({on})", f"{v['loss_first_epoch']} -> {v['loss_last_epoch']}",
                  "falls"),
                 (f"train {name}: peak GPU GiB ({on})", v["peak_gpu_gib"], "")]
    if "agreement" in report:
        rows.append((f"flex+fused vs sdpa+eager: worst relative loss difference, {AGREE_STEPS} steps ({on})",
                     report["agreement"]["worst_relative_diff"], f"<= {AGREE_BAR:g}"))
    return rows


def show(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(f"[bold]{report['device_name']}[/] (capability {report['capability']}), torch {report['torch']}, "
                  f"transformers {report['transformers']}, speculators {report['speculators']}")
    cap = report["capture"]
    console.print(f"capture: {cap['tokens']} tokens at {cap['tokens_per_s']} tokens/s; worst relative difference to "
                  "the float32 forward per vLLM layer id " + ", ".join(
                      f"{k}: {v:.2e} (bf16 forward {cap['bf16_forward_diff'][k]:.2e})"
                      for k, v in cap["worst_relative_diff"].items()))
    table = Table("variant", "attention", "loss", "steps", "first step s", "step s", "tokens/s", "loss epoch 1",
                  "loss last", "peak GiB")
    for name, v in report["train"].items():
        table.add_row(name, v["attn"], v["loss"], str(v["steps"]), str(v["first_step_s"]), str(v["step_s"]),
                      str(v["tokens_per_s"]), str(v["loss_first_epoch"]), str(v["loss_last_epoch"]),
                      str(v["peak_gpu_gib"]))
    console.print(table)
    if "agreement" in report:
        console.print(f"agreement over {report['agreement']['steps']} steps: worst relative loss difference "
                      f"{report['agreement']['worst_relative_diff']:.2e}")
    for bar, ok in report["bars"].items():
        console.print(f"{'[green]pass[/]' if ok else '[red]FAIL[/]'}  {bar}")


if __name__ == "__main__":
    sys.exit(main())
