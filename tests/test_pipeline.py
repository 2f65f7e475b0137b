"""``inv pipeline`` over a real sshd on a tiny model: patch, five stages, pull, the input-hash skip.

The host's python is a venv on top of this machine's packages with its own speculators 0.3.0 from
PyPI (``--no-deps``), so the pipeline patches that copy and never the test runner's own.
"""
from __future__ import annotations

import json
import re
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, chain_acceptance, make_venv, run_inv, write_inventory
from harness import pipeline
from harness.errors import HarnessError
from harness.inventory import load_inventory
from harness.stagecontract import GENERATIONS
from job_support import TINY_PIPELINE
from models import build_tiny_model

SETTINGS = {**TINY_PIPELINE, "max_new_tokens": 24, "batch_size": 4, "epochs": 2, "val_fraction": 0.2, "k": 3,
            "ttt_steps": 3}


@pytest.fixture(scope="module")
def host_python(tmp_path_factory) -> Path:
    return make_venv(tmp_path_factory.mktemp("hostenv") / "venv", "--no-deps", "speculators==0.3.0",
                     system_site_packages=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def setup_inv(tmp_path_factory, sshd_hosts, host_python, tiny):
    root = tmp_path_factory.mktemp("pipe")
    host = sshd_hosts(1)[0]

    def write(**pipeline_overrides) -> Path:
        return write_inventory(root / "inventory.yaml",
                               {"gpu": host.entry(python=str(host_python), workdir=str(root / "wd"))},
                               model={"path": str(tiny)}, pipeline={**SETTINGS, **pipeline_overrides})

    return root, write


def run_pipeline_cli(root: Path, inv: Path, *args: str):
    r = run_inv("pipeline", "--json", "--inventory", str(inv), *args, env={"HARNESS_RUNS_DIR": str(root / "runs"),
                                                                            "HF_HUB_OFFLINE": "1"}, timeout=900)
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


def test_pipeline_end_to_end_then_skip_then_partial_rerun(setup_inv):
    root, write = setup_inv
    inv = write()
    r, out = run_pipeline_cli(root, inv)
    assert r.returncode == 0, r.stderr[-3000:]
    stages = out["gpu"]
    assert [s["stage"] for s in stages] == pipeline.ORDER
    assert all(s["state"] == "ran" for s in stages)
    by = {s["stage"]: s for s in stages}
    # artifacts pulled and verified into runs/<run-id>/ on the workstation
    vocab_dir = Path(by["vocab"]["pulled"])
    d2t = np.load(vocab_dir / "d2t.npy")
    assert d2t.shape == (64,)
    ckpt = Path(by["train"]["pulled"]) / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert (ckpt / "model.safetensors").stat().st_size > 0
    assert config["speculators_model_type"] == "eagle3"
    assert isinstance(by["evaluate"]["result"]["acceptance_length"], float)
    metrics = by["evaluate"]["result"]
    assert len(metrics["acceptance_rate_per_position"]) == metrics["k"] == 3 and metrics["steps"] > 0
    assert abs(metrics["acceptance_length"] - chain_acceptance(metrics)) < 2e-3, metrics
    # the hidden states stayed on the host
    extract_local = Path(by["extract"]["pulled"])
    assert not list(extract_local.rglob("data_*.pt"))
    assert (root / "wd" / "runs" / by["extract"]["run_id"] / "artifacts").is_dir()

    # the patch set was applied on the host (patch 7 lets the draft train on the CPU)
    r2 = run_inv("patch.status", "--json", "--inventory", str(inv))
    st = json.loads(r2.stdout)["gpu"]["packages"]["speculators"]
    states = {p["name"]: p["state"] for p in st["patches"]}
    assert any(n.startswith("0007") and s == "applied" for n, s in states.items()), states

    # same inputs: every stage is skipped
    r, again = run_pipeline_cli(root, inv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s["state"] for s in again["gpu"]] == ["skipped"] * 5
    assert [s["run_id"] for s in again["gpu"]] == [s["run_id"] for s in stages]

    # --to, --no-pull, --no-patch: with the patches rolled back by hand, a new vocabulary size runs
    # vocab alone, leaves its artifacts on the host and the patches as they are
    assert run_inv("patch.rollback", "--inventory", str(inv)).returncode == 0
    r, head = run_pipeline_cli(root, write(draft_vocab_size=48), "--to", "vocab", "--no-pull", "--no-patch")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(s["stage"], s["state"]) for s in head["gpu"]] == [("prepare", "skipped"), ("extract", "skipped"),
                                                                ("vocab", "ran")]
    vocab = head["gpu"][2]
    assert vocab["pulled"] is None and not list((root / "runs" / vocab["run_id"]).rglob("*.npy"))  # log mirror only
    assert np.load(root / "wd" / "runs" / vocab["run_id"] / "artifacts" / "d2t.npy").shape == (48,)
    st = json.loads(run_inv("patch.status", "--json", "--inventory", str(inv)).stdout)["gpu"]["packages"]["speculators"]
    assert not any(p["state"] == "applied" for p in st["patches"]), st["patches"]

    # a training setting changed: only train and evaluate run again (patched again first)
    inv = write(lr=2e-3)
    r, partial = run_pipeline_cli(root, inv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s["state"] for s in partial["gpu"]] == ["skipped", "skipped", "skipped", "ran", "ran"]
    st = json.loads(run_inv("patch.status", "--json", "--inventory", str(inv)).stdout)["gpu"]["packages"]["speculators"]
    assert any(p["name"].startswith("0007") and p["state"] == "applied" for p in st["patches"]), st["patches"]
    assert partial["gpu"][2]["run_id"] == by["vocab"]["run_id"]
    # --from finds the upstream runs by the same ids
    r, tail = run_pipeline_cli(root, inv, "--from", "train")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(s["stage"], s["state"]) for s in tail["gpu"]] == [("train", "skipped"), ("evaluate", "skipped")]


def test_from_needs_upstream_runs_with_same_settings(setup_inv):
    root, write = setup_inv
    inv = write(seed=12345)  # nothing ran with these settings
    r, _ = run_pipeline_cli(root, inv, "--from", "train")
    assert r.returncode != 0
    assert "needs a successful prepare run" in r.stderr and "inv pipeline --from prepare" in r.stderr and "Traceback" not in r.stderr


def test_bad_stage_name_is_one_line(setup_inv):
    root, write = setup_inv
    r, _ = run_pipeline_cli(root, write(), "--from", "trian")
    assert r.returncode != 0 and "unknown stage" in r.stderr and "Traceback" not in r.stderr


def _ids(tmp_path, name, **settings):
    return pipeline.run_ids(load_inventory(write_inventory(
        tmp_path / f"{name}.yaml", {"l": {"transport": "local"}}, model={"path": "m"}, pipeline=settings)), "legacy")


def test_run_ids_follow_inputs(tmp_path):
    base = _ids(tmp_path, "a", lr=1e-4)
    assert _ids(tmp_path, "a2", lr=1e-4) == base  # deterministic
    lr = _ids(tmp_path, "b", lr=2e-4)
    assert [base[s] == lr[s] for s in pipeline.ORDER] == [True, True, True, False, False]
    vocab = _ids(tmp_path, "c", lr=1e-4, draft_vocab_size=100)
    assert [base[s] == vocab[s] for s in pipeline.ORDER] == [True, True, False, False, False]
    samples = _ids(tmp_path, "d", lr=1e-4, samples=5)
    assert all(base[s] != samples[s] for s in pipeline.ORDER)  # upstream ids feed downstream ones
    with pytest.raises(HarnessError):
        pipeline.select_stages("train", "prepare")
    # the same settings on the other speculators line are other runs (other code, other inputs)
    inv = load_inventory(tmp_path / "a.yaml")
    current = pipeline.run_ids(inv, generation="current")
    assert all(current[s] != base[s] for s in pipeline.ORDER)
    assert pipeline.run_ids(inv, generation="current") == current


def _tree(path: Path):
    import ast

    return ast.parse(path.read_text(), filename=str(path))


def _settings_read(tree) -> set[str]:
    """The settings a module reads from its settings object: ``cfg.X``, ``cfg["X"]``, ``cfg.get("X")``."""
    import ast

    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg":
            if node.attr not in ("get", "items", "keys", "values"):
                read.add(node.attr)
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
              and node.value.id == "cfg"):
            assert isinstance(node.slice, ast.Constant), ast.unparse(node)  # a computed name would escape
            read.add(node.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "cfg"):
            read.add(node.args[0].value)
    return read


def _pipeline_lookups(tree) -> list[str]:
    """Places that read the run spec's ``pipeline`` dict directly (``x["pipeline"]``, ``x.get("pipeline")``)."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "pipeline":
            found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "setdefault", "pop") and node.args
              and isinstance(node.args[0], ast.Constant) and node.args[0].value == "pipeline"):
            found.append(ast.unparse(node))
    return found


def test_stage_contracts_declare_exactly_what_stages_read():
    """Every pipeline setting a stage's source reads is in its contract (SETTINGS, or common's
    COMMON_SETTINGS): otherwise a changed setting would wrongly let the stage be skipped. And every
    setting it declares is read (else changing it would rerun the stage for nothing). Settings are
    read only through ``cfg = common.settings(spec, SETTINGS)``, never from the spec's dict."""
    import ast

    from harness import REMOTE_DIR

    stages_dir = REMOTE_DIR / "stages"
    common_settings = set(pipeline.COMMON_SETTINGS)
    for generation, stage in ((g, s) for g in GENERATIONS for s in pipeline.ORDER):
        tree = _tree(stages_dir / generation / f"{stage}.py")
        read = _settings_read(tree)
        declared = set(pipeline.contracts(generation).stages[stage].settings)
        assert read, stage
        assert read <= declared | common_settings, (stage, read - declared - common_settings)
        assert declared <= read, (stage, declared - read)  # declared but never read
        assert not _pipeline_lookups(tree), (stage, _pipeline_lookups(tree))
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "common.settings"]
        assert [(ast.unparse(c.targets[0]), ast.unparse(c.value)) for c in calls] == \
            [("cfg", "common.settings(spec, SETTINGS)")], stage
        main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
        assert any(n is calls[0] for n in ast.walk(main)), stage  # read in main, once
    # the shared helpers read only the common settings; the stage library reads none (plain arguments)
    common_tree = _tree(stages_dir / "common.py")
    assert _settings_read(common_tree) <= common_settings, _settings_read(common_tree) - common_settings
    settings_fn = next(n for n in common_tree.body if isinstance(n, ast.FunctionDef) and n.name == "settings")
    outside = [n for n in common_tree.body if n is not settings_fn]
    assert not [x for n in outside for x in _pipeline_lookups(n)]
    for path in sorted((stages_dir / "lib").rglob("*.py")):
        tree = _tree(path)
        assert not _settings_read(tree) and not _pipeline_lookups(tree), path


def test_no_stage_imports_another():
    """Model code two stages share lives in stages/lib/, so each stage reads top to bottom on its own."""
    import ast

    from harness import REMOTE_DIR

    stages = set(pipeline.ORDER)
    for path in (REMOTE_DIR / "stages").rglob("*.py"):
        for node in ast.walk(_tree(path)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            hit = [n for n in names if n.split(".")[0] == "stages" and set(n.split(".")[1:3]) & (stages | set(GENERATIONS))]
            assert not hit, (path, hit)


def test_pipeline_spec_defaults_are_the_stage_contracts():
    """One place for each default: every PipelineSpec field defaults to what the stage contracts
    declare, every declared setting is a field, and the pipeline's shape comes from the contracts."""
    from harness import stagecontract
    from harness.inventory import PipelineSpec

    declared = stagecontract.merged_defaults()
    fields = PipelineSpec.model_fields
    assert set(fields) == set(declared), (set(fields) ^ set(declared))
    for name, info in fields.items():
        value = info.get_default(call_default_factory=True)
        assert value == declared[name] and type(value) is type(declared[name]), (name, value, declared[name])
    # a setting several stages read has one default, and each stage's list is its own
    assert PipelineSpec().heldout == 16 and PipelineSpec().seed == 0
    assert PipelineSpec().extra is not PipelineSpec().extra  # a fresh dict each time
    assert pipeline.ORDER == ["prepare", "extract", "vocab", "train", "evaluate"]
    legacy, current = pipeline.contracts("legacy"), pipeline.contracts("current")
    assert legacy.reads == {"prepare": (), "extract": ("prepare",), "vocab": ("extract",),
                            "train": ("extract", "vocab"), "evaluate": ("prepare", "extract", "train")}
    # speculators 0.5+: prepare-data counts the tokens, and train reads prepare's dataset itself
    assert current.reads == {"prepare": (), "extract": ("prepare",), "vocab": ("prepare",),
                             "train": ("prepare", "extract", "vocab"), "evaluate": ("prepare", "extract", "train")}
    assert current.order == legacy.order == pipeline.ORDER
    assert legacy.gpu_stages == current.gpu_stages == {"prepare", "extract", "train", "evaluate"}
    assert pipeline.COMMON_SETTINGS == ("device", "dtype", "threads", "extra")
    assert set(legacy.stages["vocab"].settings) == {"draft_vocab_size"}
    # today's vocab also reports the held-out prompts' coverage, warned of below coverage_warning
    assert set(current.stages["vocab"].settings) == {"draft_vocab_size", "coverage_warning"}
    assert {"lr", "epochs", "k"} <= set(legacy.stages["train"].settings) and "lr" not in legacy.stages["evaluate"].settings
    assert "capture_layers" in legacy.stages["extract"].settings and "target_layer_ids" in current.stages["extract"].settings


def test_reading_the_contracts_imports_no_torch():
    """The inventory (hence every inv task) reads the contracts: from the source, never by importing."""
    import subprocess
    import sys

    from conftest import REPO

    code = ("import sys, time; t = time.perf_counter(); import harness.inventory; harness.inventory.PipelineSpec(); "
            "print(time.perf_counter() - t); "
            "assert not {'torch', 'transformers', 'stages'} & set(sys.modules), sorted(sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def _remote_copy(tmp_path: Path) -> Path:
    import shutil

    from harness import REMOTE_DIR

    root = tmp_path / "remote"
    for part in ("stages", "runtime"):
        shutil.copytree(REMOTE_DIR / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REMOTE_DIR / "hostcore.py", root / "hostcore.py")
    return root


def test_stage_code_hash_covers_the_stage_library(tmp_path):
    """A change to stages/lib/ (or common.py, or the host core) changes every stage's run id; a stage's own
    module only its."""
    root = _remote_copy(tmp_path)
    before = {s: pipeline.stage_code_hash(s, "legacy", root) for s in pipeline.ORDER}
    assert before == {s: pipeline.stage_code_hash(s, "legacy") for s in pipeline.ORDER}  # a copy hashes the same
    core = root / "hostcore.py"
    core.write_text(core.read_text() + "\n# changed\n")
    assert all(pipeline.stage_code_hash(s, "legacy", root) != before[s] for s in pipeline.ORDER)
    core.write_text(core.read_text().removesuffix("\n# changed\n"))
    lib = root / "stages" / "lib" / "batching.py"
    lib.write_text(lib.read_text() + "\n# changed\n")
    after = {s: pipeline.stage_code_hash(s, "legacy", root) for s in pipeline.ORDER}
    assert all(after[s] != before[s] for s in pipeline.ORDER)
    vocab = root / "stages" / "legacy" / "vocab.py"
    vocab.write_text(vocab.read_text() + "\n# changed\n")
    again = {s: pipeline.stage_code_hash(s, "legacy", root) for s in pipeline.ORDER}
    assert [again[s] != after[s] for s in pipeline.ORDER] == [False, False, True, False, False]
    current = {s: pipeline.stage_code_hash(s, "current", root) for s in pipeline.ORDER}
    assert all(current[s] != again[s] for s in pipeline.ORDER)  # each generation's own module
    # a shipped prompt set: the stage that reads it runs anew (prepare its training sets, today's evaluate
    # its eval sets), no other
    one_more = json.dumps({"messages": [{"role": "user", "content": "One more."}]}) + "\n"
    for rel, changed in (("code.jsonl", [True, False, False, False, False]),
                         ("eval/code.jsonl", [False, False, False, False, True])):
        data = root / "stages" / "data" / rel
        data.write_text(data.read_text() + one_more)
        edited = {g: {s: pipeline.stage_code_hash(s, g, root) for s in pipeline.ORDER} for g in ("legacy", "current")}
        assert [edited["legacy"][s] != again[s] for s in pipeline.ORDER] == changed[:4] + [False], rel
        assert [edited["current"][s] != current[s] for s in pipeline.ORDER] == changed, rel
        again, current = edited["legacy"], edited["current"]


@pytest.mark.parametrize("edit, message", [
    # prepare's own setting, but the other generation's prepare declares it too: one default for both
    (("prepare.py", '"heldout": 16,', '"heldout": 0,'), "SETTINGS.heldout defaults to 16 but the legacy stages declare 0"),
    (("evaluate.py", '"k": 3,', '"k": 4,'), "SETTINGS.k defaults to 4 but stage train declares 3"),
    (("evaluate.py", '"max_new_tokens": 128,', '"max_new_tokens": 128.0,'), "SETTINGS.max_new_tokens"),
    (("vocab.py", 'READS = ("extract",)', 'READS = ("extrakt",)'), "READS names 'extrakt', which is not another stage"),
    (("prepare.py", 'READS = ()', 'READS = ("evaluate",)'), "form a cycle"),
    (("vocab.py", 'GPU = False', 'GPU = bool(0)'), "GPU must be a plain literal"),
    (("vocab.py", '"draft_vocab_size": 32000,', '"draft_vocab_size": 32000, "device": "cpu",'),
     "SETTINGS.device is in common.py's COMMON_SETTINGS"),
])
def test_a_broken_contract_is_one_line_naming_the_file(tmp_path, edit, message):
    from harness import stagecontract

    root = _remote_copy(tmp_path)
    name, old, new = edit
    path = root / "stages" / "legacy" / name
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(stagecontract.ContractError) as e:
        stagecontract.load(root, "legacy")
    text = str(e.value)
    assert message in text and "\n" not in text, text
    assert text.startswith(str(root.resolve() / "stages")), text


def test_stage_inputs_match_what_stages_open():
    """The DAG gives each stage exactly the upstream artifacts its source asks for."""
    import re

    from harness import REMOTE_DIR

    for generation, stage in ((g, s) for g in GENERATIONS for s in pipeline.ORDER):
        src = (REMOTE_DIR / "stages" / generation / f"{stage}.py").read_text()
        opened = set(re.findall(r"input_dirs?\(spec, \"(\w+)\"\)", src))
        assert opened == set(pipeline.contracts(generation).reads[stage]), (generation, stage, opened)


def test_the_installed_speculators_line_picks_the_stages():
    """0.3-0.4: the legacy stages, 0.5 up to 1.0: the current ones; anything else is one line naming the
    host and the version, before a model loads (the pipeline asks this right after patching)."""
    from harness.generations import generation_of

    assert [generation_of(v) for v in ("0.3.0", "0.4.0.1", "0.5.0", "0.9.0", "0.9.1rc1")] == \
        ["legacy", "legacy", "current", "current", "current"]
    for version, kind in (("0.2.1", "unsupported speculators"), ("1.0.0", "unsupported speculators"),
                          (None, "not installed")):
        with pytest.raises(HarnessError) as e:
            generation_of(version, "gpu1")
        assert e.value.kind == kind and str(e.value).startswith("host gpu1: ") and "\n" not in str(e.value)
        if version:
            assert f"speculators {version} is outside both lines" in str(e.value)


def test_stage_contracts_cached_between_processes_follow_every_edit(tmp_path):
    """The contracts' literals are kept on disk between commands (parsing the stage files is ~20 ms of
    each); a stage file edited since is parsed again, and an unreadable cache is parsed around."""
    import subprocess
    import sys

    root = _remote_copy(tmp_path)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    read = ("import sys; from harness import stagecontract; from pathlib import Path; "
            "print(stagecontract.load(Path(sys.argv[1]), 'current').stages['train'].settings['loss_tokens'])")

    def loss_tokens() -> str:
        proc = subprocess.run([sys.executable, "-c", read, str(root)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    cache = tmp_path / "cache" / "eagle-harness" / "stage-contracts.marshal"
    assert loss_tokens() == "assistant" and cache.is_file()
    assert loss_tokens() == "assistant"  # from the cache
    train = root / "stages" / "current" / "train.py"
    train.write_text(train.read_text().replace('"loss_tokens": "assistant",', '"loss_tokens": "all",', 1))
    assert loss_tokens() == "all"
    cache.write_bytes(b"not marshal")
    assert loss_tokens() == "all"


def _on_a_terminal(argv: list[str], env: dict, timeout: float = 900) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as its stdout and stderr (what a person's shell gives it):
    (exit code, everything it wrote, escape sequences included)."""
    import os
    import pty
    import select
    import subprocess
    import time

    main, sub = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sub, stderr=sub, cwd=REPO,
                            env={**os.environ, **env, "COLUMNS": "160", "TERM": "xterm-256color"})
    os.close(sub)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([main], [], [], 0.5)[0]:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    return proc.wait(timeout=60), out.decode(errors="replace")


def test_pipeline_on_a_terminal_draws_live_rows_and_one_line_a_stage(setup_inv):
    """What a person sees: on a terminal, the live row (rich) is drawn and cleared, each stage that ran
    or was skipped is one line, the summary table follows; off a terminal --verbose prints the log."""
    import sys

    root, write = setup_inv
    inv = write(draft_vocab_size=40)  # a vocab run of its own
    env = {"HARNESS_RUNS_DIR": str(root / "runs"), "HF_HUB_OFFLINE": "1"}
    rc, out = _on_a_terminal([sys.executable, "-m", "invoke", "--search-root", str(REPO), "pipeline", "--to", "vocab",
                              "--inventory", str(inv)], env)
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    assert "\x1b[" in out and "\x1b[?25l" in out  # drawn live: styled, the cursor hidden while rows update
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out).replace("\r", "\n")
    assert re.search(r"\[gpu\] vocab +done in \d+:\d\d", plain), plain[-3000:]
    for stage in ("prepare", "extract"):
        assert re.search(rf"\[gpu\] {stage} +skipped: inputs unchanged", plain), plain[-3000:]
    assert "pipeline on gpu" in plain and "HTTP Request" not in plain
    # --verbose, off a terminal: the stage's log lines themselves (the harness's own among them)
    r = run_inv("pipeline", "--to", "vocab", "--verbose", "--inventory", str(write(draft_vocab_size=44)), env=env,
                timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "@@harness" in r.stderr and re.search(r"\[gpu\] vocab +done in", r.stderr), r.stderr[-3000:]
