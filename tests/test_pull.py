"""Artifact pull over a real loopback sshd: rsync and SFTP, intermediates left on the host, an
interrupted pull resumed and verified, a corrupted artifact on the host detected."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, run_inv, write_inventory
from runs_support import code_root, drop_connections, wait_for
from harness import runs
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import load_inventory
from harness.pull import check_names, pull

FILES = {"vocab/d2t.npy": 5000, "checkpoint/model.safetensors": 300_000, "data_0.pt": 40_000, "data_1.pt": 40_000}


@pytest.fixture
def finished(sshd, tmp_path):
    """A succeeded run 'p1' whose stage wrote FILES and marks data_*.pt as intermediates."""
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(workdir=str(tmp_path / "wd"))}))
    conn = open_host(inv.hosts["gpu1"], inv)
    runs.launch(conn, inv, "teststage", run_id="p1", extra={"files": FILES, "intermediates": ["data_*.pt"]},
                code_root=code_root(tmp_path), environ={})
    st = runs.follow(conn, "p1", base=tmp_path / "runs", on_line=lambda l: None)
    assert st["state"] == "succeeded"
    yield inv, conn, tmp_path / "wd" / "runs" / "p1" / "artifacts"
    conn.close()


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_pull_verified_and_intermediates_stay(finished, tmp_path, method):
    inv, conn, art = finished
    dest = tmp_path / f"dest-{method}"
    res = pull(conn, "p1", dest, method=method)
    assert res.method == method
    assert sorted(res.files) == ["checkpoint/model.safetensors", "vocab/d2t.npy"]
    assert sorted(res.left_on_host) == ["data_0.pt", "data_1.pt"] and not (dest / "data_0.pt").exists()
    for rel in res.files:
        assert digest(dest / rel) == digest(art / rel)
    assert json.loads((dest / "result.json").read_text())["intermediates"] == ["data_*.pt"]
    assert not (dest / ".partial").exists()
    again = pull(conn, "p1", dest, method=method)
    assert again.transferred == 0  # verified files already here are not fetched again
    full = pull(conn, "p1", dest, method=method, include_all=True)
    assert sorted(full.files) == sorted(FILES) and digest(dest / "data_1.pt") == digest(art / "data_1.pt")


def test_pull_cli_include_and_all_bring_intermediates(finished, tmp_path):
    """As a user asks for them: ``--include GLOB`` brings the matching intermediates, ``--all`` every one."""
    inv, conn, art = finished
    one = tmp_path / "one"
    r = run_inv("pull", "p1", "--include", "data_1.*", "--dest", str(one), "--json", "--inventory", inv.source)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["gpu1"]
    assert sorted(out["files"]) == ["checkpoint/model.safetensors", "data_1.pt", "vocab/d2t.npy"]
    assert out["left_on_host"] == ["data_0.pt"] and not (one / "data_0.pt").exists()
    assert digest(one / "data_1.pt") == digest(art / "data_1.pt")
    every = tmp_path / "every"
    r = run_inv("pull", "p1", "--all", "--dest", str(every), "--json", "--inventory", inv.source)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["gpu1"]
    assert sorted(out["files"]) == sorted(FILES) and out["left_on_host"] == []
    assert all(digest(every / rel) == digest(art / rel) for rel in FILES)


def test_pull_detects_corrupted_artifact(finished, tmp_path):
    inv, conn, art = finished
    target = art / "checkpoint" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[1000] ^= 0xFF  # one flipped byte, same size: only a checksum notices
    target.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    with pytest.raises(HarnessError, match=r"artifact checkpoint/model.safetensors does not match SHA256SUMS"):
        pull(conn, "p1", dest)
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
pull(conn, "big", {dest!r}, method={method!r}, bwlimit_kbps=4000)
"""


def big_run(sshd, tmp_path, size: int = 24 << 20):
    """A finished run "big" on the host with one random ``size``-byte artifact, hidden.bin."""
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(workdir=str(tmp_path / "wd"))}))
    with open_host(inv.hosts["gpu1"], inv) as conn:
        runs.launch(conn, inv, "teststage", run_id="big", extra={"files": {"hidden.bin": size}, "random": True},
                    code_root=code_root(tmp_path), environ={})
        assert runs.follow(conn, "big", base=tmp_path / "runs", on_line=lambda l: None)["state"] == "succeeded"
    return inv, size


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_interrupted_pull_resumes_and_verifies(sshd, tmp_path, method):
    inv, size = big_run(sshd, tmp_path)
    dest = tmp_path / "dest"
    partial = dest / ".partial" / "hidden.bin"
    script = PULL_SCRIPT.format(repo=str(REPO), inv=inv.source, dest=str(dest), method=method)
    if method == "sftp":  # SFTP has no bandwidth limit: slow it with a tiny reader instead
        script = script.replace("bwlimit_kbps=4000", "bwlimit_kbps=None, chunk=1 << 14")
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
        res = pull(conn, "big", dest, method=method)
    assert res.transferred <= size - got + (1 << 20)  # only the rest crossed the link
    assert digest(dest / "hidden.bin") == digest(tmp_path / "wd" / "runs" / "big" / "artifacts" / "hidden.bin")


def test_pull_refuses_running_run(sshd, tmp_path):
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(workdir=str(tmp_path / "wd"))}))
    with open_host(inv.hosts["gpu1"], inv) as conn:
        runs.launch(conn, inv, "teststage", run_id="busy", extra={"sleep": 30}, code_root=code_root(tmp_path),
                    environ={})
        with pytest.raises(HarnessError, match="run busy is running; pull it once it has finished"):
            pull(conn, "busy", tmp_path / "d")
        runs.stop(conn, "busy", grace=2)


def test_artifact_name_escaping_the_artifacts_dir_is_refused(finished, tmp_path):
    """A SHA256SUMS on the host naming ``../../.bashrc`` (or an absolute path) must not make the pull
    write outside dest on the workstation."""
    inv, conn, art = finished
    sums = art / "SHA256SUMS"
    good = sums.read_text()
    dest = tmp_path / "a" / "b" / "dest"
    for name in ("../../.bashrc", "/tmp/harness-escape-test"):
        sums.write_text(good + f"{'0' * 64}  {name}\n")
        with pytest.raises(HarnessError, match=re.escape(
                f"host gpu1: run p1: artifact name '{name}' escapes the artifacts dir; refusing to pull")):
            pull(conn, "p1", dest)
        assert not dest.exists() and not (tmp_path / "a" / ".bashrc").exists()
        r = run_inv("pull", "p1", "--dest", str(dest), "--inventory", inv.source)
        assert r.returncode == 1 and "escapes the artifacts dir" in r.stderr and "Traceback" not in r.stderr
        assert not dest.exists()
    # the workstation checks the names too, whatever the host's runctl let through
    with pytest.raises(HarnessError, match=r"artifact name 'vocab/\.\./\.\./x' escapes"):
        check_names(conn, "p1", ["vocab/d2t.npy", "vocab/../../x"])
    check_names(conn, "p1", ["vocab/d2t.npy", "a..b/c"])  # '..' inside a name is fine


def test_pull_method_checked_before_anything_happens(finished, tmp_path):
    inv, conn, art = finished
    dest = tmp_path / "dest"
    with pytest.raises(HarnessError, match=r"pull --method 'ftp': unknown method; use auto, rsync or sftp"):
        pull(conn, "p1", dest, method="ftp")
    with pytest.raises(HarnessError, match=r"pull --method 'local': host gpu1 has transport ssh; use auto, rsync or sftp"):
        pull(conn, "p1", dest, method="local")
    assert not dest.exists()
    # rsync asked for on a workstation without rsync: one line, before any transfer or progress bar
    empty = tmp_path / "empty-path"
    empty.mkdir()
    r = run_inv("pull", "p1", "--method", "rsync", "--dest", str(dest), "--inventory", inv.source,
                env={"PATH": str(empty)})
    assert r.returncode == 1, r.stderr
    assert "pull --method rsync: rsync is not installed on this machine" in r.stderr
    assert "Traceback" not in r.stderr and not dest.exists()


def test_pull_with_one_host_unreachable_reports_both(finished, sshd, tmp_path):
    """One host pulled, one unreachable: the good host's line, the dead one's message, exit 1."""
    inv, conn, art = finished
    entries = {"gpu1": sshd.entry(workdir=str(tmp_path / "wd")),
               "dead": sshd.entry(workdir=str(tmp_path / "wd"), port=free_port())}
    path = write_inventory(tmp_path / "two.yaml", entries)
    r = run_inv("pull", "p1", "--dest", str(tmp_path / "out"), "--inventory", str(path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "TypeError" not in r.stderr
    assert "gpu1: 2 file(s)" in r.stdout
    assert any(l.startswith("dead: ") and "host dead" in l for l in r.stdout.splitlines())
    assert "error: host dead" in r.stderr
    assert digest(tmp_path / "out" / "gpu1" / "vocab" / "d2t.npy") == digest(art / "vocab" / "d2t.npy")


SFTP_DROP_SCRIPT = """
import sys
sys.path[:0] = [{repo!r}]
import harness.pull as P
from harness.errors import HarnessError
from harness.inventory import load_inventory
from harness.connection import open_host
inv = load_inventory({inv!r})
conn = open_host(inv.hosts["gpu1"], inv)
try:
    P.pull(conn, "big", {dest!r}, method="sftp", chunk=1 << 14)  # small reads: the drop lands mid-file
except HarnessError as e:
    print("HarnessError:", e, flush=True)
    sys.exit(3)
"""


def test_sftp_link_dropped_mid_pull_says_rerun_and_resumes(sshd, tmp_path):
    inv, size = big_run(sshd, tmp_path)
    dest = tmp_path / "dest"
    partial = dest / ".partial" / "hidden.bin"
    script = SFTP_DROP_SCRIPT.format(repo=str(REPO), inv=inv.source, dest=str(dest))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: partial.exists() and partial.stat().st_size > (2 << 20), timeout=60, step=0.02)
        assert drop_connections(sshd) >= 1  # the link drops mid-file
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, out + err
    assert "Traceback" not in err
    assert "SFTP pull failed" in out and "run the pull again to resume" in out
    got = partial.stat().st_size
    assert 0 < got < size and not (dest / "hidden.bin").exists()
    with open_host(inv.hosts["gpu1"], inv) as conn:
        res = pull(conn, "big", dest, method="sftp")
    assert res.transferred <= size - got + (1 << 20)
    assert digest(dest / "hidden.bin") == digest(tmp_path / "wd" / "runs" / "big" / "artifacts" / "hidden.bin")


def test_pull_falls_back_to_sftp_on_a_host_without_rsync(finished, sshd_factory, tmp_path):
    """README: rsync where both ends have it, else SFTP. The same run, seen through a second sshd whose
    sessions get a PATH with every command of this machine but rsync: the pull (auto) takes SFTP, and
    lands the same verified files."""
    inv, conn, art = finished
    bin_dir = tmp_path / "bin-without-rsync"
    bin_dir.mkdir()
    for d in ("/usr/local/bin", "/usr/bin", "/bin"):
        for exe in sorted(Path(d).iterdir()) if Path(d).is_dir() else []:
            if exe.name != "rsync" and not (bin_dir / exe.name).exists():
                (bin_dir / exe.name).symlink_to(exe)
    bare = sshd_factory("no-rsync", extra_config=[f"SetEnv PATH={bin_dir}"])
    inv2 = load_inventory(write_inventory(tmp_path / "bare.yaml", {"gpu1": bare.entry(workdir=str(tmp_path / "wd"))}))
    with open_host(inv2.hosts["gpu1"], inv2) as c2:
        assert c2.exec("command -v rsync || echo none").stdout.strip() == "none"  # the host really has none
        res = pull(c2, "p1", tmp_path / "dest-auto")
    assert res.method == "sftp" and sorted(res.files) == ["checkpoint/model.safetensors", "vocab/d2t.npy"]
    for rel in res.files:
        assert digest(tmp_path / "dest-auto" / rel) == digest(art / rel)
    with open_host(inv.hosts["gpu1"], inv) as c1:  # the ordinary host: rsync at both ends
        assert pull(c1, "p1", tmp_path / "dest-rsync").method == "rsync"
