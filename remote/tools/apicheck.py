"""vLLM API preflight: do the installed speculators' calls into vLLM fit the installed vLLM? (stdlib only)

Why: the reference failure was found only after minutes of loading a 1T model. This reads both
packages' sources with ``ast`` (no import, no GPU, works where vLLM cannot even be imported) and
checks, for every name that speculators' data_generation code imports from vLLM, that it exists, and
for every call to such a name (SchedulerConfig, Scheduler, Request, get_kv_cache_config_from_groups,
...) that its keywords exist and its required arguments are given. Each mismatch comes with file:line
and, when the patch series knows it, the patch that fixes it.

Spec keys: ``vllm_path`` (a directory holding the ``vllm/`` package, e.g. an unpacked wheel; default:
the host's installed vLLM, found from its dist-info or find_spec without importing it),
``speculators_path`` (likewise for ``speculators/``), ``subdir`` (default data_generation),
``fixes`` ({speculators version: {api name: patch name}}), ``uses`` (what the harness's stages ask of
vLLM, collected by vllmuses.py: ``[{"speculators": [first, stop], "uses": [...]}]``, each list checked on a
host whose speculators version is in ``[first, stop)``).

Today's stages and speculators 0.5+ drive vLLM as a server rather than importing it: their uses (flags,
config keys and values, routes, request fields, metric names; vllmuses.py) are looked up in the vLLM
tree's own definitions (``VllmIndex``), and speculators' own are collected from its installed source.
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path

import distinfo
import vllmuses
from hostcore import version_tuple

NO_VLLM = "vLLM is not installed on this host: nothing to check"


def _dist_root(name: str) -> tuple[Path | None, str | None]:
    """Where a package's top-level directory lives (its parent) and its version, without importing it."""
    root, version = distinfo.package_root(name)
    return (Path(root) if root is not None else None), version


def _version_in(root: Path, name: str) -> str | None:
    dist = distinfo.find(name, [str(root)])
    return dist.version if dist else None


def _package(spec: dict, key: str, name: str) -> tuple[Path | None, str | None]:
    """(the folder holding ``name``'s package, its version): ``spec[key]`` when the caller names one (an
    unpacked wheel), else where this python has it installed."""
    if spec.get(key):
        root = Path(os.path.expanduser(spec[key]))
        return root, _version_in(root, name)
    return _dist_root(name)


# ------------------------------------------------------------------------------------------------
# resolving names in a source tree

class Source:
    """A package tree read with ast: find modules, the definition a dotted name leads to."""

    def __init__(self, root: Path):
        self.root = root
        self._mods: dict[str, ast.Module | None] = {}

    def module_file(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._mods:
            f = self.module_file(dotted)
            try:
                self._mods[dotted] = ast.parse(f.read_text(errors="replace")) if f else None
            except SyntaxError:
                self._mods[dotted] = None
        return self._mods[dotted]

    @staticmethod
    def _top_level(body):
        """Top-level statements, looking into if/try blocks (TYPE_CHECKING, optional imports)."""
        for node in body:
            if isinstance(node, ast.If):
                yield from Source._top_level(node.body)
                yield from Source._top_level(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    yield from Source._top_level(part)
            else:
                yield node

    @staticmethod
    def _absolute(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts if is_pkg else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def resolve(self, module: str, name: str, _seen=None):
        """-> ("def", module, node) | ("module", dotted, None) | ("external", where, None)
        | ("unknown", module, None) | None when the name does not exist."""
        _seen = _seen or set()
        if (module, name) in _seen:
            return ("unknown", module, None)
        _seen.add((module, name))
        tree = self.module(module)
        if tree is None:
            return None
        is_pkg = str(self.module_file(module)).endswith("__init__.py")
        found = None
        star = []
        has_getattr = False
        for node in self._top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == name:
                    found = ("def", module, node)  # the last one wins (after @overload stubs)
                has_getattr |= node.name == "__getattr__"
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    found = ("external", module, None)
            elif isinstance(node, ast.AnnAssign):
                if isinstance(node.target, ast.Name) and node.target.id == name:
                    found = ("external", module, None)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if (a.asname or a.name.split(".")[0]) == name:
                        found = ("external", a.name, None)
            elif isinstance(node, ast.ImportFrom):
                src = self._absolute(module, node, is_pkg)
                for a in node.names:
                    if a.name == "*":
                        star.append(src)
                    elif (a.asname or a.name) == name:
                        if src.split(".")[0] == self.root_package(module):
                            found = self.resolve(src, a.name, _seen) or (
                                ("module", f"{src}.{a.name}", None) if self.module_file(f"{src}.{a.name}") else None)
                            if found is None:
                                return None
                        else:
                            found = ("external", src, None)
        if found:
            return found
        for src in star:
            if src.split(".")[0] == self.root_package(module):
                r = self.resolve(src, name, _seen)
                if r:
                    return r
        if self.module_file(f"{module}.{name}"):
            return ("module", f"{module}.{name}", None)
        if has_getattr or any(src.split(".")[0] != self.root_package(module) for src in star):
            return ("unknown", module, None)
        return None

    @staticmethod
    def root_package(module: str) -> str:
        return module.split(".")[0]


# ------------------------------------------------------------------------------------------------
# signatures

_DATACLASS_DECORATORS = {"dataclass", "config", "pydantic_dataclass"}
_FIELD_BASES = {"Struct", "BaseModel", "NamedTuple"}


def _name(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    return ""


def _func_sig(fn: ast.FunctionDef, method: bool) -> dict:
    a = fn.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    defaults = len(a.defaults)
    required = positional[: len(positional) - defaults] if defaults else list(positional)
    if method and positional:
        positional, required = positional[1:], [r for r in required if r != positional[0]]
    kwonly = [x.arg for x in a.kwonlyargs]
    required += [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return {"positional": positional, "names": positional + kwonly, "required": required,
            "varargs": a.vararg is not None, "varkw": a.kwarg is not None}


def _field(stmt: ast.AnnAssign) -> tuple[str, bool] | None:
    """(name, has_default) of a dataclass-style field, or None when it is not an init argument."""
    if not isinstance(stmt.target, ast.Name):
        return None
    ann = ast.unparse(stmt.annotation)
    if "ClassVar" in ann:
        return None
    v = stmt.value
    if v is None:
        return stmt.target.id, False
    if isinstance(v, ast.Call) and _name(v.func) in ("field", "Field"):
        kw = {k.arg: k.value for k in v.keywords}
        if isinstance(kw.get("init"), ast.Constant) and kw["init"].value is False:
            return None
        has_default = "default" in kw or "default_factory" in kw or bool(v.args and _name(v.func) == "Field")
        return stmt.target.id, has_default
    return stmt.target.id, True


def class_sig(src: Source, module: str, cls: ast.ClassDef, _depth: int = 0) -> dict | None:
    """The constructor signature of a class, or None when it cannot be told from the source."""
    if _depth > 8:
        return None
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return _func_sig(node, method=True)
    dataclassy = any(_name(d) in _DATACLASS_DECORATORS for d in cls.decorator_list)
    fields: list[tuple[str, bool]] = []
    for base in cls.bases:
        bname = _name(base)
        if bname in _FIELD_BASES or bname in ("object", "Generic", "Protocol", "ABC") or not bname:
            dataclassy |= bname in _FIELD_BASES
            continue
        if isinstance(base, ast.Name):
            r = src.resolve(module, bname)
            if r and r[0] == "def" and isinstance(r[2], ast.ClassDef):
                sig = class_sig(src, r[1], r[2], _depth + 1)
                if sig is None:
                    return None
                if "_fields" not in sig:
                    return sig  # a base with its own __init__
                fields += sig["_fields"]
                dataclassy = True
                continue
        if bname.endswith("Mixin"):
            continue
        return None  # an unknown base (Enum, a torch Module...): do not guess
    if not dataclassy:
        return {"positional": [], "names": [], "required": [], "varargs": False, "varkw": False, "_fields": []}
    own = [f for f in (_field(s) for s in cls.body if isinstance(s, ast.AnnAssign)) if f]
    names = [n for n, _ in own]
    fields = [f for f in fields if f[0] not in names] + own
    return {"positional": [n for n, _ in fields], "names": [n for n, _ in fields],
            "required": [n for n, d in fields if not d], "varargs": False, "varkw": False, "_fields": fields}


def signature(src: Source, resolved) -> dict | None:
    kind, module, node = resolved
    if kind != "def":
        return None
    if isinstance(node, ast.ClassDef):
        return class_sig(src, module, node)
    return _func_sig(node, method=False)


def check_call(call: ast.Call, sig: dict) -> list[str]:
    problems = []
    names = set(sig["names"])
    for kw in call.keywords:
        if kw.arg is not None and kw.arg not in names and not sig["varkw"]:
            problems.append(f"unexpected keyword argument {kw.arg!r}")
    opaque = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
    if not opaque:
        if len(call.args) > len(sig["positional"]) and not sig["varargs"]:
            problems.append(f"{len(call.args)} positional arguments, at most {len(sig['positional'])} accepted")
        given = set(sig["positional"][: len(call.args)]) | {k.arg for k in call.keywords}
        for r in sig["required"]:
            if r not in given:
                problems.append(f"missing required argument {r!r}")
    return problems


# ------------------------------------------------------------------------------------------------
# a vLLM tree's command line, configs, routes, request fields and metrics, read once

def _kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


class VllmIndex:
    """What a vLLM source tree defines, as the uses need it: the API server's flags (the fields of its
    ``*Args`` dataclasses and every ``add_argument("--x")``), ``vllm bench serve``'s flags, the fields
    of the request classes under vllm/entrypoints, and its text for names that are only strings there
    (routes, metric names, method and connector names)."""

    def __init__(self, root: Path):
        self.root, self.src = root, Source(root)
        self._text: dict[str, str] = {}
        self.server_flags: set[str] = set()
        self.bench_flags: set[str] = set()
        self.fields: set[str] = set()
        for f in sorted((root / "vllm" / "entrypoints").rglob("*.py")) + [root / "vllm" / "engine" / "arg_utils.py"]:
            self._index(f, self.server_flags, fields=True)
        for f in sorted((root / "vllm" / "benchmarks").rglob("*.py")):
            self._index(f, self.bench_flags, fields=False)

    def _index(self, f: Path, flags: set[str], fields: bool) -> None:
        try:
            tree = ast.parse(f.read_text(errors="replace"))
        except (OSError, SyntaxError):
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node.func) == "add_argument":
                flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                             and a.value.startswith("--"))
            elif fields and isinstance(node, ast.ClassDef):
                names = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                if node.name.endswith("Args"):
                    flags.update(_kebab(n) for n in names)
                self.fields.update(names)

    def text(self, subdir: str) -> str:
        """Every .py file under vllm/<subdir>, joined (read once)."""
        if subdir not in self._text:
            base = self.root / "vllm" / subdir
            files = sorted(base.rglob("*.py")) if base.is_dir() else []
            self._text[subdir] = "\n".join(f.read_text(errors="replace") for f in files)
        return self._text[subdir]

    def quoted(self, value: str, subdir: str = "") -> bool:
        body = self.text(subdir)
        return f'"{value}"' in body or f"'{value}'" in body

    def word(self, value: str, subdir: str = "") -> bool:
        return re.search(rf"\b{re.escape(value)}\b", self.text(subdir)) is not None

    def problem(self, use: dict) -> str | None:
        """Why vLLM would not take this use, or None."""
        kind, api = use["kind"], use["api"]
        if kind == "import":
            module, name = api.split(":")
            if self.src.resolve(module, name) is None:
                return (f"module {module} does not exist" if self.src.module(module) is None
                        else f"cannot import name {name!r} from {module}")
        elif kind == "module":
            f = self.src.module_file(api)
            if f is None:
                return f"module {api} does not exist: python -m {api} fails"
            if "__main__" not in f.read_text(errors="replace"):
                return f"module {api} has no __main__ block: python -m {api} would do nothing"
        elif kind in ("flag", "bench-flag"):
            have = self.server_flags if kind == "flag" else self.bench_flags
            base = "--" + api[5:] if api.startswith("--no-") else api
            if api not in have and base not in have:
                return ("the API server" if kind == "flag" else "vllm bench serve") + f" has no flag {api}"
        elif kind == "config-key":
            owner = use.get("of", "")
            if "." not in owner:
                r = self.src.resolve("vllm.config", owner)
                sig = signature(self.src, r) if r else None
                if sig is None:
                    return f"vllm.config has no {owner}" if r is None else None
                if api not in sig["names"]:
                    return f"{owner} has no field {api!r}: vLLM refuses the config"
            elif not self.word(api):
                return f"{owner} key {api!r}: no vLLM code reads it, so it would be ignored"
        elif kind == "config-value":
            if not self.quoted(api):
                return f"{use.get('of', '')} value {api!r} is not one vLLM knows"
        elif kind == "route":
            if not self.quoted(api, "entrypoints"):
                return f"the API server has no route {api}"
        elif kind == "request-field":
            if api not in self.fields:
                return f"no request class of vllm/entrypoints has a field {api!r}: vLLM would ignore it"
        elif kind == "metric":
            if not self.quoted(api):
                return f"vLLM exports no metric {api}"
        return None


def speculators_uses(sroot: Path) -> list[dict]:
    """What the installed speculators asks of a vLLM server (its CLI and data generation; 0.5+)."""
    pkg = sroot / "speculators"
    files = [f.relative_to(sroot).as_posix() for sub in ("cli", "data_generation") for f in sorted((pkg / sub).glob("*.py"))]
    return [u for u in vllmuses.collect(sroot, files) if u["kind"] in ("route", "request-field")]


def check_uses(vroot: Path, uses: list[dict]) -> list[dict]:
    """Each use looked up in the vLLM tree at ``vroot``; a mismatch per use vLLM would not take. Uses
    in one ``alt`` group (imports tried one after the other) pass when any of them does."""
    index = VllmIndex(vroot)
    out, groups = [], {}
    for use in uses:
        problem = index.problem(use)
        if use.get("alt"):
            groups.setdefault(use["alt"], []).append((use, problem))
            continue
        if problem:
            out.append(_mismatch(use, problem))
    for tries in groups.values():
        if all(p for _, p in tries):
            out += [_mismatch(u, p) for u, p in tries]
    return out


def _mismatch(use: dict, problem: str) -> dict:
    """A use's mismatch in the shape of a call's (no patch set fixes the harness's own uses: the code does)."""
    file, _, line = use["where"].rpartition(":")
    return {"file": file, "line": int(line or 0), "where": use["where"], "api": use["api"], "kind": use["kind"],
            "problem": problem, "fixed_by": None}


# ------------------------------------------------------------------------------------------------

def check(spec: dict) -> dict:
    """Every vLLM import and call of speculators' data_generation code against the vLLM source."""
    vroot, vver = _package(spec, "vllm_path", "vllm")
    if vroot is None or not (vroot / "vllm").is_dir():
        return {"ok": True, "skipped": NO_VLLM, "mismatches": []}  # probe.py answers the same without loading this
    sroot, sver = _package(spec, "speculators_path", "speculators")
    if sroot is None or not (sroot / "speculators").is_dir():
        return {"ok": False, "error": "speculators is not installed on this host", "mismatches": []}
    v = version_tuple(sver or "")
    uses = [u for group in spec.get("uses") or []
            if tuple(group["speculators"][0]) <= v[:len(group["speculators"][0])]
            and v[:len(group["speculators"][1])] < tuple(group["speculators"][1]) for u in group["uses"]]
    uses += speculators_uses(sroot)
    fixes = (spec.get("fixes") or {}).get(sver or "", {})
    vllm = Source(vroot)
    subdir = spec.get("subdir", "data_generation")
    files = sorted((sroot / "speculators" / subdir).glob("*.py"))
    mismatches, calls, imports = [], 0, 0
    for f in files:
        rel = f.relative_to(sroot).as_posix()
        try:
            tree = ast.parse(f.read_text(errors="replace"))
        except SyntaxError as e:
            mismatches.append({"file": rel, "line": e.lineno or 0, "where": f"{rel}:{e.lineno}", "api": "",
                               "problem": f"syntax error: {e.msg}", "fixed_by": None})
            continue
        local: dict[str, tuple] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm" and not node.level:
                for a in node.names:
                    imports += 1
                    r = vllm.resolve(node.module, a.name)
                    if r is None:
                        problem = (f"module {node.module} does not exist" if vllm.module(node.module) is None
                                   else f"cannot import name {a.name!r} from {node.module}")
                        mismatches.append({"file": rel, "line": node.lineno, "where": f"{rel}:{node.lineno}",
                                           "api": a.name, "problem": problem, "fixed_by": fixes.get(a.name)})
                    else:
                        local[a.asname or a.name] = (a.name, r)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in local:
                api, r = local[node.func.id]
                sig = signature(vllm, r)
                if sig is None:
                    continue
                calls += 1
                for problem in check_call(node, sig):
                    mismatches.append({"file": rel, "line": node.lineno, "where": f"{rel}:{node.lineno}",
                                       "api": api, "problem": f"{api}(): {problem}", "fixed_by": fixes.get(api)})
    mismatches += check_uses(vroot, uses)
    mismatches.sort(key=lambda m: (m["file"], m["line"]))
    return {"ok": not mismatches, "vllm": vver, "vllm_path": str(vroot), "speculators": sver,
            "speculators_path": str(sroot), "files": len(files), "imports_checked": imports,
            "calls_checked": calls, "uses_checked": len(uses), "mismatches": mismatches}


def main(spec: dict) -> dict:
    return check(spec)


if __name__ == "__main__":
    out = main(json.loads(sys.stdin.read() or "{}"))
    try:
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    except OSError:
        pass
