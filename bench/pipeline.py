"""The default pipeline's bars on SmolLM2-135M-Instruct, CPU, today's stack: time, acceptance, and the
harness against the same work done by hand.

    python bench/pipeline.py [--python PY] [--workdir DIR] [--inventory inventory.yaml] [--skip-by-hand] [--reuse]
                             [--quick]

1. The harness: ``inv pipeline --hosts local`` exactly as README's main job runs it, with the host's
   python ``--python`` (default: the ``local`` host's, ``~/.eagle-harness/venv/bin/python`` that ``inv
   setup --hosts local`` made) and a fresh workdir, so nothing is skipped.
2. By hand, what a user would do instead, on the same data (the harness's own conversations and
   converted model) with the same settings: the GGUF converted with transformers (timed; the harness's
   copy is what the next steps read, so both train on the same weights), a vLLM server for the target, ``speculators
   regenerate-responses``, ``speculators prepare-data``, the server stopped; a vLLM server with the
   extract_hidden_states configs, ``speculators generate-offline-data``, stopped; ``speculators train``
   with the same flags as the harness's train stage (``--draft-vocab-size`` lets it build the vocabulary
   itself). Each command is the one the harness logged.

Then prints, each with its bar: the whole pipeline's wall time (<= 15 minutes); the held-out acceptance
length (k = 3, >= 2.0); the harness's prepare..train wall time against the same work by hand (<= 1.1x;
evaluate has no by-hand counterpart and is left out of both), and evaluate's figures per category of
prompts (held-out, and the shipped out-of-distribution sets). Exit status 1 when a bar is missed.
``--quick``: the harness's side only, its figures shown but not judged (the suite runs it on the
workdir its default-pipeline test has just filled, so every stage is skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from results import record

REPO = Path(__file__).resolve().parent.parent
BARS = {"minutes": 15.0, "acceptance": 2.0, "by_hand_ratio": 1.1}


def harness_run(python: Path, workdir: Path, inventory: Path) -> tuple[dict, float]:
    inv = yaml.safe_load(inventory.read_text())
    inv["hosts"] = {"local": {**inv["hosts"]["local"], "python": str(python), "workdir": str(workdir / "wd")}}
    path = workdir / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    env = {**os.environ, "HARNESS_RUNS_DIR": str(workdir / "runs"), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    with open(workdir / "harness.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "invoke", "pipeline", "--hosts", "local", "--json",
                               "--inventory", str(path)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
                              text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"inv pipeline failed (exit {proc.returncode}); see {workdir / 'harness.log'}")
    return {s["stage"]: s for s in json.loads(proc.stdout)["local"]}, wall


def audit_packages(workdir: Path) -> dict:
    """The host's package versions as ``inv audit`` reports them."""
    proc = subprocess.run([sys.executable, "-m", "invoke", "audit", "--hosts", "local", "--json", "--inventory",
                           str(workdir / "inventory.yaml")], cwd=REPO, capture_output=True, text=True)
    return json.loads(proc.stdout)["hosts"]["local"]["packages"] if proc.returncode == 0 else {}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` as a user starts it, waited for on /health."""

    def __init__(self, python: Path, model: str, max_len: int, log: Path, extra: list[str] = (), dtype: str = ""):
        self.port = _port()
        # the settings the harness's stage servers ran with, so both sides do the same work: its dtype
        # (extract.json's) and, on two cores, every core for vLLM's model runner
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        if (os.cpu_count() or 1) <= 2:
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        self.proc = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--max-model-len", str(max_len), "--enforce-eager",
             *(["--dtype", dtype] if dtype else []), *extra],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    break
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit(f"vLLM exited; see {log}")
                time.sleep(2)

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)


def by_hand(python: Path, stages: dict, workdir: Path) -> dict[str, float]:
    """The same work with speculators' CLI and vLLM servers; seconds per step."""
    art = {name: Path(s["status"]["run_dir"]) / "artifacts" for name, s in stages.items()}
    train_args = json.loads((art["train"] / "metrics.json").read_text())["config"]["args"]
    model = train_args[train_args.index("--verifier-name-or-path") + 1]
    meta = json.loads((art["extract"] / "extract.json").read_text())
    inv = yaml.safe_load((workdir / "inventory.yaml").read_text())  # the harness's run's, the host's settings over
    cfg = {**inv.get("pipeline", {}), **inv["hosts"]["local"].get("pipeline", {})}
    max_len, max_new = cfg["max_seq_len"], cfg["max_new_tokens"]
    hand = workdir / "by-hand"
    shutil.rmtree(hand, ignore_errors=True)
    hand.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    times = {}

    def run(*args, code="from speculators.__main__ import app; app()"):
        """``python -c CODE ARGS`` in the host python (by default speculators' CLI), logged."""
        with open(hand / "commands.log", "a") as log:
            subprocess.run([str(python), "-c", code, *args], check=True, env=env, stdout=log, stderr=subprocess.STDOUT)

    # a user converts the shipped GGUF too (transformers' own loader, then save_pretrained); the rest
    # reads the harness's converted copy, so both sides train on the same weights and tokenizer
    t0 = time.perf_counter()
    gguf = inv["model"]
    convert = ("import importlib.util, sys; from pathlib import Path; "
               "from transformers import AutoModelForCausalLM, AutoTokenizer; "
               "d = Path(importlib.util.find_spec(sys.argv[1]).origin).parent; f, out = sys.argv[2], sys.argv[3]; "
               "AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out); "
               "m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f); "
               # transformers 5 refuses to save a GGUF-loaded model, dequantized or not: drop its tag
               "m.hf_quantizer = None; m.config.__dict__.pop('quantization_config', None); m.save_pretrained(out)")
    run(gguf["gguf_package"], gguf["gguf_file"], str(hand / "model"), code=convert)
    times["convert"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    dtype = meta.get("dtype", "")
    server = Server(python, model, max_len, hand / "server-prepare.log", dtype=dtype)
    url = f"http://127.0.0.1:{server.port}"
    try:
        run("regenerate-responses", "--endpoint", f"{url}/v1/chat/completions", "--model", model,
            "--dataset", str(art["prepare"] / "conversations.in.jsonl"), "--max-tokens", str(max_new),
            "--concurrency", str(cfg.get("concurrency", 64)), "--sampling-params", '{"temperature": 0.0}',
            "--outfile", str(hand / "regenerated.jsonl"))
    finally:
        server.stop()
    run("prepare-data", "--model", model, "--data", str(hand / "regenerated.jsonl"), "--output",
        str(hand / "data"), "--seq-length", str(max_len), "--no-skip-token-freq")
    times["prepare"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": meta["captured_layer_ids"]}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(hand / "staging")}}
    server = Server(python, model, max_len + 1, hand / "server-extract.log",
                    ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)],
                    dtype=dtype)
    try:
        run("generate-offline-data", "--model", model, "--endpoint", f"http://127.0.0.1:{server.port}/v1",
            "--preprocessed-data", str(hand / "data"), "--output", str(hand / "data" / "hidden_states"),
            "--concurrency", str(cfg.get("concurrency", 64)), "--validate-outputs")
    finally:
        server.stop()
    times["extract"] = time.perf_counter() - t0

    t0 = time.perf_counter()  # the harness's train flags; vocabulary built by speculators train itself
    args = list(train_args)
    for flag, value in (("--data-path", str(hand / "data")), ("--save-path", str(hand / "checkpoints")),
                        ("--log-dir", str(hand / "tensorboard"))):
        if flag in args:  # --log-dir: with pipeline.logger, never into the harness's run
            args[args.index(flag) + 1] = value
    for flag in ("--hidden-states-path", "--d2t-path", "--t2d-path"):
        i = args.index(flag)
        del args[i:i + 2]
    run("train", *args)
    times["vocab+train"] = time.perf_counter() - t0
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", default=str(REPO / "inventory.yaml"))
    parser.add_argument("--python", default=str(Path("~/.eagle-harness/venv/bin/python").expanduser()),
                        help="the host python (inv setup --hosts local makes the default one)")
    parser.add_argument("--workdir", help="default: a fresh temp dir")
    parser.add_argument("--skip-by-hand", action="store_true", help="only the harness's run")
    parser.add_argument("--reuse", action="store_true",
                        help="take the harness's run from --workdir's harness.json (an earlier call's) and redo by hand")
    parser.add_argument("--quick", action="store_true", help="--skip-by-hand, figures shown but not judged")
    args = parser.parse_args()
    args.skip_by_hand |= args.quick
    python = Path(args.python)
    if not python.is_file():
        raise SystemExit(f"--python {python}: not found; run: python3 -m invoke setup --hosts local")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pipeline-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}; python {python}; cores {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}",
          flush=True)

    saved = workdir / "harness.json"
    if args.reuse and saved.is_file():  # the harness's run of an earlier call on this workdir
        earlier = json.loads(saved.read_text())
        stages, wall = earlier["stages"], earlier["wall"]
    else:
        stages, wall = harness_run(python, workdir, Path(args.inventory))
        saved.write_text(json.dumps({"stages": stages, "wall": wall}))
    print(f"{'stage':<10}{'seconds':>9}  result")
    for name, s in stages.items():
        keys = ("samples", "tokens", "loss", "val_full_acc_0", "coverage", "acceptance_length", "backend")
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s["result"].items() if k in keys}
        print(f"{name:<10}{s['seconds']:>9.1f}  {json.dumps(shown)}", flush=True)
    evaluate = stages["evaluate"]
    acceptance = evaluate["result"]["acceptance_length"]
    packages = audit_packages(workdir)
    extract_dir = Path(stages["extract"]["status"]["run_dir"]) / "artifacts"
    backend = json.loads((extract_dir / "extract.json").read_text())["backend"]
    files = len(list((extract_dir / "hidden_states").glob("hs_*.safetensors")))
    samples = stages["extract"]["result"]["samples"]
    checks = [
        ("today's stack", f"speculators {packages.get('speculators')}, vLLM {packages.get('vllm')} (inv audit)",
         "0.9.x / 0.32.x", str(packages.get("speculators")).startswith("0.9.") and str(packages.get("vllm")).startswith("0.32.")),
        ("extraction", f"backend {backend}, {files} hs_*.safetensors for {samples} samples", "vllm, one per sample",
         backend == "vllm" and files == samples),
        ("whole pipeline", f"{wall / 60:.2f} min wall (inv pipeline, patching to pull)", f"<= {BARS['minutes']:.0f} min",
         wall <= BARS["minutes"] * 60),
        ("acceptance length", f"{acceptance:.3f} (k={evaluate['result']['k']}, {evaluate['result']['prompts']} held-out "
         "prompts)", f">= {BARS['acceptance']}", acceptance >= BARS["acceptance"]),
    ]
    if not args.skip_by_hand:
        hand = by_hand(python, stages, workdir)
        ours = wall - evaluate["seconds"]
        theirs = sum(hand.values())
        print("by hand:  " + ", ".join(f"{k} {v:.1f}s" for k, v in hand.items()))
        checks.append(("harness vs by hand", f"{ours / theirs:.3f}x ({ours:.0f}s: inv pipeline less evaluate; "
                       f"{theirs:.0f}s: the same commands by hand)", f"<= {BARS['by_hand_ratio']}x",
                       ours / theirs <= BARS["by_hand_ratio"]))
    print()
    print(f"{'category':<16}{'kind':<10}{'prompts':>8}{'acceptance':>11}{'tokens/s':>10}{'without':>9}{'speedup':>9}")
    for c in evaluate["result"].get("categories") or []:
        speed = (f"{c['tokens_per_s']:>10.1f}{c['tokens_per_s_without']:>9.1f}{c['speedup']:>8.2f}x"
                 if c.get("speedup") else "")
        print(f"{c['category']:<16}{c.get('kind', ''):<10}{c['prompts']:>8}{c['acceptance_length']:>11.3f}{speed}")
    print()
    for name, value, bar, ok in checks:
        print(f"{name:<20}{value}  bar {bar}  {'-' if args.quick else 'PASS' if ok else 'FAIL'}")
    record("pipeline", [*((name, value, bar) for name, value, bar, _ in checks),
                        *((f"{c['category']} acceptance / speedup", f"{c['acceptance_length']:.3f}"
                           + (f" / {c['speedup']:.2f}x" if c.get("speedup") else ""), "")
                          for c in evaluate["result"].get("categories") or [])], args.quick)
    return 0 if args.quick or all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
