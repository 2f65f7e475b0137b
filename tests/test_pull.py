"""Artifact pull over a real loopback sshd: rsync and SFTP, intermediates left on the host, an
interrupted pull resumed and verified, a corrupted artifact on the host detected."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_inv, write_inventory
from runs_support import code_root, wait_for
from harness import runs
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import load_inventory
from harness.pull import pull

FILES = {"vocab/d2t.npy": 5000, "checkpoint/model.safetensors": 300_000, "data_0.pt": 40_000, "data_1.pt": 40_000}


@pytest.fixture
def finished(sshd, tmp_path):
    """A succeeded run 'p1' whose stage wrote FILES and marks data_*.pt as intermediates."""
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(workdir=str(tmp_path / "wd"))}))
    conn = open_host(inv.hosts["gpu1"], inv)
    runs.launch(conn, inv, "teststage", run_id="p1", extra={"files": FILES, "intermediates": ["data_*.pt"]},
                code_root=code_root(tmp_path), environ={})
    st = runs.follow(conn, "p1", progress=False, base=tmp_path / "runs", on_line=lambda l: None)
    assert st["state"] == "succeeded"
    yield inv, conn, tmp_path / "wd" / "runs" / "p1" / "artifacts"
    conn.close()


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_pull_verified_and_intermediates_stay(finished, tmp_path, method):
    inv, conn, art = finished
    dest = tmp_path / f"dest-{method}"
    res = pull(conn, "p1", dest, method=method, progress=False)
    assert res.method == method
    assert sorted(res.files) == ["checkpoint/model.safetensors", "vocab/d2t.npy"]
    assert sorted(res.left_on_host) == ["data_0.pt", "data_1.pt"] and not (dest / "data_0.pt").exists()
    for rel in res.files:
        assert digest(dest / rel) == digest(art / rel)
    assert json.loads((dest / "result.json").read_text())["intermediates"] == ["data_*.pt"]
    assert not (dest / ".partial").exists()
    again = pull(conn, "p1", dest, method=method, progress=False)
    assert again.transferred == 0  # verified files already here are not fetched again
    full = pull(conn, "p1", dest, method=method, include_all=True, progress=False)
    assert sorted(full.files) == sorted(FILES) and digest(dest / "data_1.pt") == digest(art / "data_1.pt")


def test_pull_detects_corrupted_artifact(finished, tmp_path):
    inv, conn, art = finished
    target = art / "checkpoint" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[1000] ^= 0xFF  # one flipped byte, same size: only a checksum notices
    target.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    with pytest.raises(HarnessError, match=r"artifact checkpoint/model.safetensors does not match SHA256SUMS"):
        pull(conn, "p1", dest, progress=False)
    assert not (dest / "checkpoint" / "model.safetensors").exists()  # never placed
    assert not (dest / ".partial" / "checkpoint" / "model.safetensors").exists()  # nor kept to resume from
    assert digest(dest / "vocab" / "d2t.npy") == digest(art / "vocab" / "d2t.npy")  # the good file is
    r = run_inv("pull", "p1", "--dest", str(tmp_path / "cli"), "--inventory", inv.source)
    assert r.returncode != 0 and "does not match SHA256SUMS" in r.stderr and "Traceback" not in r.stderr


PULL_SCRIPT = """
import sys
sys.path[:0] = [{repo!r}]
from harness.inventory import load_inventory
from harness.connection import open_host
from harness.pull import pull
inv = load_inventory({inv!r})
conn = open_host(inv.hosts["gpu1"], inv)
pull(conn, "big", {dest!r}, method={method!r}, progress=False, bwlimit_kbps=4000)
"""


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_interrupted_pull_resumes_and_verifies(sshd, tmp_path, method):
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(workdir=str(tmp_path / "wd"))}))
    size = 24 << 20
    with open_host(inv.hosts["gpu1"], inv) as conn:
        runs.launch(conn, inv, "teststage", run_id="big", extra={"files": {"hidden.bin": size}, "random": True},
                    code_root=code_root(tmp_path), environ={})
        assert runs.follow(conn, "big", progress=False, base=tmp_path / "runs", on_line=lambda l: None)["state"] == "succeeded"
    dest = tmp_path / "dest"
    partial = dest / ".partial" / "hidden.bin"
    script = PULL_SCRIPT.format(repo=str(REPO), inv=inv.source, dest=str(dest), method=method)
    if method == "sftp":  # SFTP has no bandwidth limit: slow it with a tiny reader instead
        script = script.replace("bwlimit_kbps=4000", "bwlimit_kbps=None").replace(
            "from harness.pull import pull", "import harness.pull as P\nP.CHUNK = 1 << 14\nfrom harness.pull import pull")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        wait_for(lambda: partial.exists() and partial.stat().st_size > (2 << 20), timeout=60, step=0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the workstation dies mid-transfer (rsync and ssh with it)
        proc.wait()
    time.sleep(0.2)
    got = partial.stat().st_size
    assert 0 < got < size and not (dest / "hidden.bin").exists()
    with open_host(inv.hosts["gpu1"], inv) as conn:
        res = pull(conn, "big", dest, method=method, progress=False)
    assert res.transferred <= size - got + (1 << 20)  # only the rest crossed the link
    assert digest(dest / "hidden.bin") == digest(tmp_path / "wd" / "runs" / "big" / "artifacts" / "hidden.bin")


def test_pull_refuses_running_run(sshd, tmp_path):
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(workdir=str(tmp_path / "wd"))}))
    with open_host(inv.hosts["gpu1"], inv) as conn:
        runs.launch(conn, inv, "teststage", run_id="busy", extra={"sleep": 30}, code_root=code_root(tmp_path),
                    environ={})
        with pytest.raises(HarnessError, match="run busy is running; pull it once it has finished"):
            pull(conn, "busy", tmp_path / "d", progress=False)
        runs.stop(conn, "busy", grace=2)
