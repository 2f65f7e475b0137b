"""Bad inventories that used to slip through, through the real ``inv`` CLI: each stops with one line
naming the file, the line and the field and what to do -- no traceback, no host touched."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, run_inv


def one_line(r: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (and nothing on stdout)."""
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout.strip() == "", r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


DUPLICATE_HOST = """\
hosts:
  gpu1:
    transport: local
    workdir: /tmp/first
  gpu2:
    transport: local
  gpu1:
    transport: local
    workdir: /tmp/second
"""


def test_host_defined_twice_is_refused_naming_both_lines(tmp_path):
    p = tmp_path / "inventory.yaml"
    p.write_text(DUPLICATE_HOST)
    line = one_line(run_inv("audit", "--json", "--inventory", str(p)))
    assert f"{p}:7: hosts.gpu1: defined twice (first at line 2)" in line, line
    assert "remove or rename one" in line


@pytest.mark.parametrize("text, where", [
    # any mapping of the inventory, not only hosts: a host's field, an env variable, a top-level section
    ("hosts:\n  a:\n    transport: local\n    workdir: /x\n    workdir: /y\n", ":5: hosts.a.workdir: defined twice (first at line 4)"),
    ("hosts:\n  a:\n    transport: local\n    env: {NCCL_DEBUG: INFO, NCCL_DEBUG: WARN}\n",
     ":4: hosts.a.env.NCCL_DEBUG: defined twice (first at line 4)"),
    ("pipeline:\n  samples: 4\nhosts:\n  a: {transport: local}\npipeline:\n  samples: 8\n",
     ":5: pipeline: defined twice (first at line 1)"),
])
def test_any_key_defined_twice_is_refused(tmp_path, text, where):
    p = tmp_path / "inventory.yaml"
    p.write_text(text)
    line = one_line(run_inv("audit", "--json", "--inventory", str(p)))
    assert f"{p}{where}" in line, line


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    """``<<`` merges then overrides on purpose: that is not a key given twice."""
    p = tmp_path / "inventory.yaml"
    p.write_text("hosts:\n  a: &base\n    transport: local\n    workdir: /tmp/a\n"
                 "  b:\n    <<: *base\n    workdir: /tmp/b\n")
    r = run_inv("audit", "--json", "--hosts", "nope", "--inventory", str(p))
    assert "defined twice" not in r.stderr and "unknown host 'nope'" in r.stderr, r.stderr


@pytest.mark.parametrize("text", ["hosts: {}\n", "model:\n  path: m\nhosts:\n"])
@pytest.mark.parametrize("task", [("audit", "--strict"), ("patch.apply",), ("patch.status",), ("pipeline",)])
def test_inventory_without_hosts_is_refused(tmp_path, text, task):
    p = tmp_path / "inventory.yaml"
    p.write_text(text)
    line = one_line(run_inv(*task, "--inventory", str(p)))
    at = text.splitlines().index(next(l for l in text.splitlines() if l.startswith("hosts:"))) + 1
    assert f"{p}:{at}: hosts: no hosts defined; add at least one host under 'hosts'" in line, line


def test_identity_that_is_a_directory_says_so(tmp_path):
    keydir = tmp_path / "keys"
    keydir.mkdir()
    p = tmp_path / "inventory.yaml"
    p.write_text(f"hosts:\n  gpu1:\n    address: 127.0.0.1\n    identity: {keydir}\n")
    line = one_line(run_inv("audit", "--inventory", str(p)))
    assert f"{p}:4: hosts.gpu1.identity: {keydir} is a directory, not a key file" in line, line
    assert "not found" not in line and "point 'identity' at the private key file" in line


def test_identity_that_is_unreadable_says_so(tmp_path):
    """A key file the user cannot read. As root, file permissions do not stop a read, so the CLI runs
    as root without the capabilities that override them (what an ordinary user is)."""
    key = tmp_path / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o000)
    p = tmp_path / "inventory.yaml"
    p.write_text(f"hosts:\n  gpu1:\n    address: 127.0.0.1\n    identity: {key}\n")
    argv = [sys.executable, "-m", "invoke", "--search-root", str(REPO), "audit", "--inventory", str(p)]
    if os.geteuid() == 0:
        drop = "-dac_override,-dac_read_search"
        argv = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *argv]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    line = one_line(r)
    assert f"{p}:4: hosts.gpu1.identity: key file {key} is not readable" in line, line
    assert "permission denied" in line and "not found" not in line


@pytest.mark.parametrize("argv, line", [
    (("audit", "--workers", "abc"), "error: --workers 'abc': not a whole number"),
    (("audit", "--workers", "0"), "error: --workers 0: hosts probed at once, at least 1"),
    (("runs.stop", "r1", "--grace", "abc"), "error: --grace 'abc': not a number"),
    (("runs.stop", "r1", "--grace", "-1"), "error: --grace -1: seconds between TERM and KILL, at least 0"),
    (("service.stop", "--grace", "soon"), "error: --grace 'soon': not a number"),
    (("service.stop", "--grace", "-5"), "error: --grace -5: seconds between TERM and KILL, at least 0"),
    (("service.start", "--timeout", "0"), "error: --timeout 0: seconds to wait for health, at least 1"),
    (("deploy", "r1", "-k", "three"), "error: -k 'three': not a whole number"),
    (("serve.metrics", "--watch", "x"), "error: --watch 'x': not a number"),
    (("serve.metrics", "--watch", "5", "--count", "-1"), "error: --count -1: intervals to report (0: until Ctrl-C), at least 0"),
])
def test_a_numeric_option_given_text_is_one_line_before_any_host(tmp_path, argv, line):
    """Checked before the inventory is read: the host here does not exist."""
    p = tmp_path / "inventory.yaml"
    p.write_text("hosts:\n  gpu1:\n    address: 192.0.2.1\n")
    r = run_inv(*argv, "--inventory", str(p))
    assert r.returncode == 2 and line in one_line(r), r.stderr
