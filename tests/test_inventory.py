"""Bad inventories exit non-zero with one line naming the file, the field path and the line."""
from __future__ import annotations

import pytest

from conftest import REPO, run_inv
from harness.errors import HarnessError
from harness.inventory import load_inventory, select_hosts

CASES = {
    "unknown field": ("hosts:\n  gpu1:\n    address: 10.0.0.1\n    prot: 22\n", ":4: hosts.gpu1.prot: unknown field"),
    "wrong type": ("hosts:\n  gpu1:\n    address: 10.0.0.1\n    port: twenty\n", ":4: hosts.gpu1.port: Input should be a valid integer"),
    "missing key file": ("hosts:\n  gpu1:\n    address: 10.0.0.1\n    identity: /nonexistent/id_ed25519\n",
                         ":4: hosts.gpu1.identity: key file /nonexistent/id_ed25519 not found"),
    "unknown jump": ("hosts:\n  gpu1:\n    address: 10.0.0.1\n    jump: bastion\n", ":4: hosts.gpu1.jump: unknown jump host 'bastion'"),
    "yaml syntax": ("hosts:\n  gpu1:\n    address: [10.0.0.1\n    port: 22\n", "YAML syntax error"),
    "ssh without address": ("hosts:\n  gpu1:\n    port: 22\n", ":2: hosts.gpu1: Value error") ,
    "bad transport": ("hosts:\n  gpu1:\n    transport: telnet\n    address: x\n", ":3: hosts.gpu1.transport: Input should be 'ssh' or 'local'"),
    "bad model field": ("hosts:\n  l:\n    transport: local\nmodel:\n  path: m\n  trust_remote: true\n", ":6: model.trust_remote: unknown field"),
    "not a mapping": ("- a\n- b\n", ":1: the inventory must be a mapping"),
    "unknown loss": ("hosts:\n  l:\n    transport: local\npipeline:\n  loss_fn: kl\n",
                     ":5: pipeline.loss_fn: unknown loss 'kl' (speculators has kl_div, rkl"),
    "bad loss blend": ("hosts:\n  l:\n    transport: local\npipeline:\n  loss_fn: '{\"ce\": 0.1, \"tv\": -1}'\n",
                       ":5: pipeline.loss_fn: loss 'tv' has weight -1: a positive number"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_inventory_one_line(case, tmp_path):
    text, expected = CASES[case]
    p = tmp_path / "inventory.yaml"
    p.write_text(text)
    with pytest.raises(HarnessError) as e:
        load_inventory(p)
    msg = str(e.value)
    assert msg.startswith(str(p)), msg
    assert "\n" not in msg
    if case == "ssh without address":
        assert ":2: hosts.gpu1:" in msg and "needs 'address'" in msg
    else:
        assert expected in msg, msg


def test_bad_inventory_cli_exits_with_one_line(tmp_path):
    p = tmp_path / "inventory.yaml"
    p.write_text(CASES["wrong type"][0])
    r = run_inv("audit", "--inventory", str(p))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "hosts.gpu1.port" in lines[0] and ":4:" in lines[0]


def test_missing_inventory_file(tmp_path):
    r = run_inv("audit", "--inventory", str(tmp_path / "nope.yaml"))
    assert r.returncode != 0 and "inventory file not found" in r.stderr and "Traceback" not in r.stderr


def test_inventory_from_env(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  me:\n    transport: local\n")
    r = run_inv("audit", "--json", env={"HARNESS_INVENTORY": str(p)})
    assert r.returncode == 0, r.stderr
    assert '"me"' in r.stdout


def test_shipped_inventory_is_valid():
    inv = load_inventory(REPO / "inventory.yaml")
    assert inv.hosts["local"].transport == "local"


def test_unknown_host_in_hosts_option(tmp_path):
    p = tmp_path / "inventory.yaml"
    p.write_text("hosts:\n  a:\n    transport: local\n")
    inv = load_inventory(p)
    with pytest.raises(HarnessError, match="unknown host 'b'"):
        select_hosts(inv, "a,b")


def test_shipped_reference_example_is_valid(tmp_path, monkeypatch):
    """The commented reference host (8x RTX PRO 6000, Kimi-K2.5) validates once uncommented."""
    import re

    lines = []
    skipping = False
    for line in (REPO / "inventory.yaml").read_text().splitlines():
        # the reference model and pipeline replace the embedded default's (a section given twice is refused)
        if re.match(r"^(model|pipeline):", line):
            skipping = True
            continue
        if skipping and line.startswith(" "):
            continue
        skipping = False
        m = re.match(r"^(\s*)# (.*)$", line)
        if m and re.match(r"\s*([\w-]+:(\s|$)|- )", m.group(2)):
            line = m.group(1) + m.group(2)
        lines.append(line)
    p = tmp_path / "inventory.yaml"
    p.write_text("\n".join(lines) + "\n")
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "id_ed25519").write_text("key")
    monkeypatch.setenv("HOME", str(tmp_path))
    inv = load_inventory(p)
    gpu = inv.hosts["gpu1"]
    assert gpu.profile == "pcie-blackwell" and gpu.gpus == 8 and gpu.service.health_timeout == 2400
    assert inv.model.trust_remote_code is True and inv.model.path == "moonshotai/Kimi-K2.5"
    assert inv.pipeline.capture_layers == [2, 30, 58, 60] and inv.pipeline.draft_vocab_size == 32000
    assert inv.secrets == ["HF_TOKEN"]
