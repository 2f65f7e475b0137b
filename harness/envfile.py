"""The environment a stage runs in: rendered from a hardware profile template, linted, and masked.

Why a rendered file rather than exported variables: the file is what the host's run actually used
(kept in the run directory, diffable against the next run), and NCCL silently ignores a misspelt
variable, so the file is linted against the names NCCL, vLLM and CUDA really read before a run.

* ``render_env(host, inv)`` -> ``EnvFile``: ``templates/env/<profile>.env.j2`` (Jinja2, StrictUndefined)
  plus the inventory's per-host ``env:`` overrides plus the inventory's ``secrets:`` -- a list of
  variable NAMES whose values come from the workstation's environment, never from the inventory.
* ``lint_env(envfile, facts)`` -> problems: unknown NCCL_*/VLLM_*/CUDA_* names (with the nearest known
  name), values that contradict the host (a NCCL_SOCKET_IFNAME interface it lacks, a
  CUDA_VISIBLE_DEVICES index beyond its GPUs, a NCCL_GRAPH_FILE that is not there).
* ``Masker`` / ``mask`` replace secret values by ``****`` in anything shown or logged.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import traceback
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping

import jinja2

from harness import TEMPLATES_DIR
from harness.errors import HarnessError
from harness.inventory import HostSpec, Inventory

MASK = "****"
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
LINTED_PREFIXES = ("NCCL_", "VLLM_", "CUDA_")


# ---------------------------------------------------------------------------------------------------
# masking

class Masker:
    """Replaces every secret value in a text by ``****`` (longest first, so a value containing
    another is masked whole). Empty values are not secrets: masking them would erase everything."""

    def __init__(self, values: Iterable[str] = ()):
        self.values = sorted({v for v in values if v}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for v in self.values:
            if v in text:
                text = text.replace(v, MASK)
        return text

    def __bool__(self) -> bool:
        return bool(self.values)


def mask(text: str, values: Iterable[str]) -> str:
    return Masker(values)(text)


def secret_values(inv: Inventory | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The current workstation values of the inventory's secrets (what must never be shown)."""
    environ = os.environ if environ is None else environ
    return [environ[n] for n in (inv.secrets if inv else []) if environ.get(n)]


# ---------------------------------------------------------------------------------------------------
# rendering

@dataclass
class EnvFile:
    """One host's rendered environment. ``text`` holds real secret values: send it to the host only;
    show ``masked()``."""

    host: str
    profile: str
    template: str
    text: str
    values: dict[str, str]
    origins: dict[str, str]  # name -> where it came from (template path or inventory field)
    secrets: dict[str, str] = field(default_factory=dict)
    missing_secrets: list[str] = field(default_factory=list)

    def masked(self) -> str:
        return mask_env_text(self.text, self.secrets)


def mask_env_text(text: str, secrets: Mapping[str, str]) -> str:
    """An env file with the values of secret NAMES replaced (whatever the value), plus any secret
    value that shows up elsewhere in the text."""
    out = []
    for line in text.splitlines(keepends=True):
        m = _ASSIGN.match(line.rstrip("\n"))
        if m and m.group(1) in secrets:
            line = f"{m.group(1)}={MASK}\n"
        out.append(line)
    return mask("".join(out), secrets.values())


def _jinja(templates_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["shq"] = lambda v: shlex.quote(str(v))
    return env


def render_template(templates_dir: Path, name: str, context: dict) -> str:
    """Render one template; a missing variable or a syntax error is one line naming template and line."""
    try:
        return _jinja(templates_dir).get_template(name).render(**context)
    except jinja2.TemplateNotFound as e:
        raise HarnessError(f"template {templates_dir.name}/{e.name} not found")
    except jinja2.TemplateSyntaxError as e:
        raise HarnessError(f"template {e.name or name}:{e.lineno}: syntax error: {e.message}")
    except jinja2.UndefinedError as e:
        where = name
        for frame in reversed(traceback.extract_tb(e.__traceback__)):
            if frame.filename.endswith(".j2"):
                where = f"{Path(frame.filename).name}:{frame.lineno}"
                break
        raise HarnessError(f"template {where}: variable {_undefined_name(e)} is undefined; "
                           "pass it in the render context or remove it from the template")


def _undefined_name(e: jinja2.UndefinedError) -> str:
    m = re.search(r"'([^']+)' is undefined|has no attribute '([^']+)'", str(e))
    return repr(m.group(1) or m.group(2)) if m else str(e)


def profiles(templates_dir: Path | None = None) -> list[str]:
    d = (templates_dir or TEMPLATES_DIR) / "env"
    return sorted(p.name[:-len(".env.j2")] for p in d.glob("*.env.j2") if not p.name.startswith("_"))


def render_env(host: HostSpec, inv: Inventory | None, environ: Mapping[str, str] | None = None,
               templates_dir: Path | None = None, require_secrets: bool = True) -> EnvFile:
    """Render ``host``'s env file. ``require_secrets``: a secret missing from ``environ`` is an error
    (for a run); otherwise it is left out and listed in ``missing_secrets`` (for display)."""
    environ = os.environ if environ is None else environ
    tdir = (templates_dir or TEMPLATES_DIR) / "env"
    known = profiles(templates_dir)
    if host.profile not in known:
        near = difflib.get_close_matches(host.profile, known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise HarnessError(f"host {host.name}: profile {host.profile!r} has no template env/{host.profile}.env.j2; "
                           f"{hint}known profiles: {', '.join(known)}")
    secrets: dict[str, str] = {}
    missing = []
    for name in (inv.secrets if inv else []):
        if name in environ:
            secrets[name] = environ[name]
        elif require_secrets:
            raise HarnessError(f"secret {name} (inventory 'secrets:') is not set in this shell's environment; "
                               f"export {name} before running, or remove it from 'secrets:'")
        else:
            missing.append(name)
    overrides = {k: v for k, v in host.env.items() if k not in secrets}
    template = f"{host.profile}.env.j2"
    context = {"host": host, "profile": host.profile, "gpus": host.gpus,
               "gpu_ids": ",".join(str(i) for i in range(host.gpus)),
               "overrides": overrides, "secrets": secrets}
    text = render_template(tdir, template, context)
    text, values, origins = _settle(text, host, template, overrides, secrets)
    return EnvFile(host=host.name, profile=host.profile, template=f"templates/env/{template}", text=text,
                   values=values, origins=origins, secrets=secrets, missing_secrets=missing)


def _settle(text: str, host: HostSpec, template: str, overrides: dict, secrets: dict):
    """Parse the rendered file; comment out a profile line that an override or secret replaces, so each
    name is assigned exactly once. A line that is not ``NAME=value`` is a template error."""
    lines = text.splitlines()
    last: dict[str, int] = {}
    parsed: dict[int, tuple[str, str]] = {}
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = _ASSIGN.match(s)
        try:
            words = shlex.split(m.group(2)) if m else None
        except ValueError:
            words = None
        if m is None or words is None or len(words) > 1:
            raise HarnessError(f"template {template}: rendered line {i + 1} is not NAME=value: {s[:60]!r}")
        parsed[i] = (m.group(1), words[0] if words else "")
        last[m.group(1)] = i
    values, origins = {}, {}
    for i, (name, value) in parsed.items():
        if last[name] != i:
            lines[i] = f"# {lines[i]}   (replaced below)"
            continue
        values[name] = value
        origins[name] = ("inventory secrets" if name in secrets else
                         f"inventory hosts.{host.name}.env.{name}" if name in overrides else
                         f"templates/env/{template}")
    return "\n".join(lines).rstrip("\n") + "\n", values, origins


def parse_env_text(text: str) -> dict[str, str]:
    """NAME -> value of an env file as written by the harness (comments and blanks skipped)."""
    out = {}
    for line in text.splitlines():
        m = _ASSIGN.match(line.strip())
        if m:
            try:
                words = shlex.split(m.group(2))
            except ValueError:
                continue
            out[m.group(1)] = words[0] if words else ""
    return out


# ---------------------------------------------------------------------------------------------------
# linting

@dataclass
class Problem:
    host: str
    name: str
    message: str
    origin: str = ""

    def __str__(self) -> str:
        where = f" ({self.origin})" if self.origin else ""
        return f"host {self.host}: {self.name}{where}: {self.message}"

    def as_dict(self) -> dict:
        return {"host": self.host, "name": self.name, "message": self.message, "origin": self.origin,
                "line": str(self)}


@lru_cache(maxsize=4)
def known_names(templates_dir: Path | None = None) -> dict[str, frozenset[str]]:
    """Known variable names per prefix, from templates/env/known-vars.txt (sources named there)."""
    path = (templates_dir or TEMPLATES_DIR) / "env" / "known-vars.txt"
    sections: dict[str, set[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]").upper() + "_"
            sections[current] = set()
        elif current:
            sections[current].add(line)
    return {k: frozenset(v) for k, v in sections.items()}


_ENUMS = {
    "NCCL_P2P_LEVEL": {"LOC", "NVL", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5"},
    "NCCL_DEBUG": {"VERSION", "WARN", "INFO", "TRACE"},
    "NCCL_IB_DISABLE": {"0", "1"},
    "NCCL_P2P_DISABLE": {"0", "1"},
    "NCCL_SHM_DISABLE": {"0", "1"},
    "NCCL_CUMEM_ENABLE": {"0", "1"},
    "NCCL_NVLS_ENABLE": {"0", "1"},
    "CUDA_DEVICE_ORDER": {"FASTEST_FIRST", "PCI_BUS_ID"},
    "VLLM_WORKER_MULTIPROC_METHOD": {"fork", "spawn"},
}
_INTS = ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_NTHREADS")
_HOST_FILES = ("NCCL_GRAPH_FILE", "NCCL_TOPO_FILE")


def lint_env(envfile: EnvFile, facts: dict | None = None, gpus: int | None = None,
             templates_dir: Path | None = None) -> list[Problem]:
    """Every problem of one host's env file. ``facts`` (from ``host_facts``) enables the checks that
    need the host: interfaces, GPU count, files; without it only names and value shapes are checked."""
    known = known_names(templates_dir)
    facts = facts or {}
    problems: list[Problem] = []

    def bad(name: str, msg: str) -> None:
        problems.append(Problem(envfile.host, name, msg, envfile.origins.get(name, "")))

    for name, value in envfile.values.items():
        prefix = next((p for p in LINTED_PREFIXES if name.startswith(p)), None)
        if prefix and name not in known.get(prefix, ()):
            near = difflib.get_close_matches(name, sorted(known.get(prefix, ())), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else "check the spelling against the library's documentation"
            bad(name, f"unknown {prefix[:-1]} variable ({prefix[:-1]} ignores unknown names silently); {hint}")
            continue
        if name in _ENUMS and value not in _ENUMS[name]:
            bad(name, f"value {value!r} is not one of {', '.join(sorted(_ENUMS[name]))}")
        if name in _INTS and not re.fullmatch(r"\d+", value):
            bad(name, f"value {value!r} is not a non-negative integer")
    n_gpus = facts.get("gpus") if facts.get("gpus") is not None else gpus
    cvd = envfile.values.get("CUDA_VISIBLE_DEVICES")
    if cvd and n_gpus is not None:
        for item in cvd.split(","):
            item = item.strip()
            if re.fullmatch(r"-?\d+", item) and not 0 <= int(item) < n_gpus:
                have = f"GPUs 0-{n_gpus - 1}" if n_gpus else "no GPU"
                bad("CUDA_VISIBLE_DEVICES", f"names GPU {item} but the host has {have}")
    ifname = envfile.values.get("NCCL_SOCKET_IFNAME")
    if ifname and facts.get("interfaces") is not None:
        ifaces = facts["interfaces"]
        for item in ifname.split(","):
            item = item.strip()
            if not item or item.startswith("^"):
                continue  # an exclusion cannot be wrong about the host
            exact = item.startswith("=")
            want = item.lstrip("=")
            if not any(i == want if exact else i.startswith(want) for i in ifaces):
                bad("NCCL_SOCKET_IFNAME", f"no interface on the host matches {item!r} (it has: {', '.join(ifaces)})")
    for name in _HOST_FILES:
        path = envfile.values.get(name)
        if path and facts.get("files", {}).get(path) is False:
            bad(name, f"file {path} does not exist on the host")
    return problems


def host_facts(conn, envfile: EnvFile | None = None) -> dict:
    """The facts ``lint_env`` checks values against, from the probe in one round trip: network
    interfaces, the GPUs (``gpus``: their count, None without nvidia-smi) and whether the env's
    host-side files exist."""
    paths = [envfile.values[n] for n in _HOST_FILES if envfile and envfile.values.get(n)]
    facts = conn.run_script("probe", {"only": ["interfaces", "gpus", "files"], "paths": paths})
    facts["gpus"] = None if facts["gpus"] is None else len(facts["gpus"])
    return facts


def diff_env(old_text: str | None, new: EnvFile, old_label: str, new_label: str,
             old_secrets: Iterable[str] = ()) -> str:
    """A unified diff between the env file the host's last run used and the one rendered now, both
    masked. A secret whose value changed shows as ``****`` -> ``**** (changed)``. ``old_secrets``: the
    secret names that run was started with, so one removed from ``secrets:`` since stays masked."""
    old_text = old_text or ""
    old_vals = parse_env_text(old_text)
    was_secret = set(old_secrets) | set(new.secrets) | set(new.missing_secrets)
    names = set(new.secrets) | {n for n in old_vals if n in was_secret}
    old_masked = mask_env_text(old_text, {n: old_vals.get(n, "") for n in names})
    new_text = new.masked()
    for n in new.secrets:
        if n in old_vals and old_vals[n] != new.secrets[n]:
            new_text = new_text.replace(f"{n}={MASK}\n", f"{n}={MASK} (changed)\n")
    # old values of secrets are masked by name above; also mask them wherever else they show
    old_masked = mask(old_masked, [old_vals[n] for n in names if old_vals.get(n)])
    return "".join(difflib.unified_diff(old_masked.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                        fromfile=old_label, tofile=new_label))
