"""Env profiles: rendering, overrides, secrets by name and their masking, every lint error case, the
missing-template-variable error, and env.render --diff against the host's last run (real sshd)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import free_port, run_inv, write_inventory
from runs_support import code_root
from harness import TEMPLATES_DIR, envfile, runs
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import HostSpec, Inventory, load_inventory

SECRET = "hf_EnvSecret_0123456789"


def host(**kw) -> HostSpec:
    return HostSpec(name="g", transport="local", **kw)


@pytest.mark.parametrize("profile", envfile.profiles())
def test_every_profile_renders_and_documents_each_variable(profile):
    e = envfile.render_env(host(profile=profile, gpus=8), None, environ={})
    assert e.values, profile
    lines = e.text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Z_][A-Z0-9_]*=", line):
            assert lines[i - 1].startswith("#"), f"{profile}: {line} has no comment saying why"
    assert envfile.lint_env(e, gpus=8) == []


def test_pcie_blackwell_reference_values():
    v = envfile.render_env(host(profile="pcie-blackwell", gpus=8), None, environ={}).values
    assert v["NCCL_P2P_LEVEL"] == "SYS" and v["NCCL_IB_DISABLE"] == "1" and v["NCCL_CUMEM_ENABLE"] == "0"
    assert v["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "NCCL_GRAPH_FILE" not in v  # an optional knob, documented but off


def test_override_replaces_profile_value_and_secrets_come_from_environment():
    inv = Inventory(hosts={"g": host(profile="pcie-blackwell", gpus=8,
                                     env={"NCCL_P2P_LEVEL": "PXB", "NCCL_SOCKET_IFNAME": "lo"})},
                    secrets=["HF_TOKEN"])
    e = envfile.render_env(inv.hosts["g"], inv, environ={"HF_TOKEN": SECRET})
    assert e.values["NCCL_P2P_LEVEL"] == "PXB" and e.values["HF_TOKEN"] == SECRET
    assert sum(1 for l in e.text.splitlines() if l.startswith("NCCL_P2P_LEVEL=")) == 1
    assert e.origins["NCCL_P2P_LEVEL"] == "inventory hosts.g.env.NCCL_P2P_LEVEL"
    assert SECRET in e.text and SECRET not in e.masked() and "HF_TOKEN=****" in e.masked()
    with pytest.raises(HarnessError, match="secret HF_TOKEN .* not set in this shell's environment"):
        envfile.render_env(inv.hosts["g"], inv, environ={})
    shown = envfile.render_env(inv.hosts["g"], inv, environ={}, require_secrets=False)
    assert shown.missing_secrets == ["HF_TOKEN"] and "HF_TOKEN" not in shown.values


def test_value_with_shell_metacharacters_stays_a_value(tmp_path):
    marker = tmp_path / "pwned"
    e = envfile.render_env(host(env={"MY_OPT": f"$(touch {marker}) `id` ;x"}), None, environ={})
    import subprocess
    out = subprocess.run(["bash", "-c", f"set -a; . /dev/stdin; set +a; printf %s \"$MY_OPT\""], input=e.text,
                         capture_output=True, text=True).stdout
    assert out == f"$(touch {marker}) `id` ;x" and not marker.exists()


def test_mask_replaces_every_occurrence():
    m = envfile.Masker([SECRET, "", "short"])
    assert m(f"url=https://x:{SECRET}@hub and {SECRET}; short") == "url=https://x:****@hub and ****; ****"


def test_lint_names_and_values():
    e = envfile.render_env(host(profile="pcie-blackwell", gpus=2, env={
        "NCCL_P2P_LEVL": "SYS", "VLLM_WORKER_MULTIPROC_METOD": "spawn", "CUDA_VISIBLE_DEVICE": "0",
        "NCCL_DEBUG": "LOUD", "CUDA_VISIBLE_DEVICES": "0,1,2", "NCCL_MIN_NCHANNELS": "many",
        "OTHER_THING": "fine"}), None, environ={})
    msgs = [str(p) for p in envfile.lint_env(e, gpus=2)]
    joined = "\n".join(msgs)
    assert "NCCL_P2P_LEVL" in joined and "did you mean NCCL_P2P_LEVEL?" in joined
    assert "did you mean VLLM_WORKER_MULTIPROC_METHOD?" in joined
    assert "did you mean CUDA_VISIBLE_DEVICES?" in joined
    assert "NCCL_DEBUG (inventory hosts.g.env.NCCL_DEBUG): value 'LOUD' is not one of" in joined
    assert "CUDA_VISIBLE_DEVICES (inventory hosts.g.env.CUDA_VISIBLE_DEVICES): names GPU 2 but the host has GPUs 0-1" in joined
    assert "NCCL_MIN_NCHANNELS" in joined and "not a non-negative integer" in joined
    assert "OTHER_THING" not in joined  # only the NCCL_/VLLM_/CUDA_ families are checked
    assert len(msgs) == 6


def test_lint_against_host_facts_over_ssh(sshd, tmp_path):
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry(gpus=0, env={
        "NCCL_SOCKET_IFNAME": "=lo,eth-nothere", "NCCL_GRAPH_FILE": str(tmp_path / "graph.xml")})}))
    with open_host(inv.hosts["h"], inv) as conn:
        e = envfile.render_env(inv.hosts["h"], inv, environ={})
        facts = envfile.host_facts(conn, e)
    assert "lo" in facts["interfaces"] and facts["gpus"] is None
    assert facts["files"] == {str(tmp_path / "graph.xml"): False}
    msgs = [str(p) for p in envfile.lint_env(e, facts, gpus=0)]
    assert any("no interface on the host matches 'eth-nothere'" in m for m in msgs)
    assert not any("'=lo'" in m for m in msgs)
    assert any(f"file {tmp_path / 'graph.xml'} does not exist on the host" in m for m in msgs)
    (tmp_path / "graph.xml").write_text("<graphs/>")
    # the CLI: non-zero exit, one line per problem, no traceback
    r = run_inv("env.lint", "--inventory", inv.source)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "eth-nothere" in r.stderr and "graph.xml" not in r.stderr
    r = run_inv("env.lint", "--json", "--inventory", inv.source)
    data = json.loads(r.stdout)
    assert [p["name"] for p in data["h"]["problems"]] == ["NCCL_SOCKET_IFNAME"]
    # --offline: names and values only, no host asked, so the interface the host lacks goes unseen;
    # it works with the host down (a port nothing listens on)
    down = write_inventory(tmp_path / "down.yaml", {"h": sshd.entry(gpus=0, port=free_port(), env={
        "NCCL_SOCKET_IFNAME": "=lo,eth-nothere", "NCCL_MIN_NCHANNELS": "-2"})})
    r = run_inv("env.lint", "--offline", "--json", "--inventory", str(down))
    assert r.returncode == 1, r.stderr
    assert [p["name"] for p in json.loads(r.stdout)["h"]["problems"]] == ["NCCL_MIN_NCHANNELS"]
    r = run_inv("env.lint", "--json", "--inventory", str(down))  # without it, the host is asked
    assert r.returncode == 1 and json.loads(r.stdout)["h"]["kind"] == "unreachable", r.stdout


def test_missing_template_variable_and_unknown_profile(tmp_path):
    tdir = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR / "env", tdir / "env")
    (tdir / "env" / "broken.env.j2").write_text(
        '{% extends "_base.env.j2" %}\n{% block profile %}\n# why\nNCCL_BUFFSIZE={{ buffsize }}\n{% endblock %}\n')
    with pytest.raises(HarnessError, match=r"template broken.env.j2:4: variable 'buffsize' is undefined"):
        envfile.render_env(host(profile="broken"), None, environ={}, templates_dir=tdir)
    (tdir / "env" / "nonsense.env.j2").write_text(
        '{% extends "_base.env.j2" %}\n{% block profile %}\nthis is not an assignment\n{% endblock %}\n')
    with pytest.raises(HarnessError, match=r"template nonsense.env.j2: rendered line \d+ is not NAME=value"):
        envfile.render_env(host(profile="nonsense"), None, environ={}, templates_dir=tdir)
    with pytest.raises(HarnessError, match=r"profile 'pcie-blackwel' has no template .*did you mean 'pcie-blackwell'"):
        envfile.render_env(host(profile="pcie-blackwel"), None, environ={})


def test_env_render_cli_masks_and_diffs_against_last_run(sshd, tmp_path):
    entry = sshd.entry(workdir=str(tmp_path / "wd"), profile="single-gpu", gpus=1, env={"NCCL_DEBUG": "WARN"})
    inv_path = write_inventory(tmp_path, {"h": entry}, secrets=["HF_TOKEN"])
    r = run_inv("env.render", "--inventory", str(inv_path), env={"HF_TOKEN": SECRET})
    assert r.returncode == 0, r.stderr
    assert "HF_TOKEN=****" in r.stdout and SECRET not in r.stdout + r.stderr
    assert "CUDA_VISIBLE_DEVICES=0" in r.stdout
    r = run_inv("env.render", "--diff", "--inventory", str(inv_path), env={"HF_TOKEN": SECRET})
    assert r.returncode == 0 and "(no run yet)" in r.stdout
    # a run on the host records the env it used
    inv = load_inventory(inv_path)
    with open_host(inv.hosts["h"], inv) as conn:
        runs.launch(conn, inv, "teststage", run_id="e1", gpu=False, code_root=code_root(tmp_path),
                    environ={"HF_TOKEN": SECRET})
        runs.follow(conn, "e1", base=tmp_path / "runs", on_line=lambda l: None)
    entry["env"] = {"NCCL_DEBUG": "INFO"}
    write_inventory(tmp_path, {"h": entry}, secrets=["HF_TOKEN"])
    r = run_inv("env.render", "--diff", "--inventory", str(inv_path), env={"HF_TOKEN": "hf_NewValue_999"})
    assert r.returncode == 0, r.stderr
    assert "-NCCL_DEBUG=WARN" in r.stdout and "+NCCL_DEBUG=INFO" in r.stdout and "last run e1" in r.stdout
    assert "HF_TOKEN=**** (changed)" in r.stdout
    assert SECRET not in r.stdout and "hf_NewValue_999" not in r.stdout
    r = run_inv("env.render", "--json", "--inventory", str(inv_path), env={"HF_TOKEN": SECRET})
    data = json.loads(r.stdout)
    assert data["h"]["values"]["HF_TOKEN"] == "****" and SECRET not in r.stdout


def test_env_diff_masks_a_secret_removed_from_the_inventory_since_the_last_run(sshd, tmp_path):
    entry = sshd.entry(workdir=str(tmp_path / "wd"), profile="cpu")
    inv_path = write_inventory(tmp_path, {"h": entry}, secrets=["HF_TOKEN", "WANDB_API_KEY"])
    old_wandb = "wandb_OldSecret_42424242"
    inv = load_inventory(inv_path)
    with open_host(inv.hosts["h"], inv) as conn:
        runs.launch(conn, inv, "teststage", run_id="s1", gpu=False, code_root=code_root(tmp_path),
                    environ={"HF_TOKEN": SECRET, "WANDB_API_KEY": old_wandb})
        runs.follow(conn, "s1", base=tmp_path / "runs", on_line=lambda l: None)
        assert sorted(runs.last_env(conn)["secrets"]) == ["HF_TOKEN", "WANDB_API_KEY"]
    write_inventory(tmp_path, {"h": entry}, secrets=["HF_TOKEN"])  # WANDB_API_KEY is no secret any more
    r = run_inv("env.render", "--diff", "--inventory", str(inv_path), env={"HF_TOKEN": SECRET})
    assert r.returncode == 0, r.stderr
    assert "-WANDB_API_KEY=****" in r.stdout and "last run s1" in r.stdout
    assert old_wandb not in r.stdout + r.stderr and SECRET not in r.stdout + r.stderr
    r = run_inv("env.render", "--diff", "--json", "--inventory", str(inv_path), env={"HF_TOKEN": SECRET})
    assert "-WANDB_API_KEY=****" in json.loads(r.stdout)["h"]["diff"] and old_wandb not in r.stdout


def test_env_render_json_leaves_no_file_open(tmp_path):
    """--json prints only JSON; the human output goes nowhere without an unclosed file behind it."""
    inv_path = write_inventory(tmp_path, {"h": {"transport": "local", "profile": "cpu"}})
    r = run_inv("env.render", "--json", "--inventory", str(inv_path), env={"PYTHONWARNINGS": "always::ResourceWarning"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["h"]["profile"] == "cpu"
    assert "ResourceWarning" not in r.stderr
