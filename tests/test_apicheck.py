"""The vLLM API preflight: speculators' data_generation calls read against real vLLM 0.11.0 / 0.16.0 sources.

vLLM is either an unpacked wheel directory given as ``vllm_path`` or "installed" in the host's venv
(its wheel's .py files and dist-info); speculators comes from its PyPI wheel. Nothing is imported.
"""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

from conftest import run_inv
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
