"""The shape of the code, checked: imports run one way (tasks -> harness -> remote, never back),
harness/ has no import cycle, harness/ never prints, and listing the tasks loads nothing heavy."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions (dotted, absolute)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _graph(package: str) -> dict[str, set[str]]:
    mods = {p.stem for p in (REPO / package).glob("*.py")}
    graph = {}
    for p in (REPO / package).glob("*.py"):
        deps = {i.split(".")[1] for i in _imports(p) if i.startswith(f"{package}.") and i.split(".")[1] in mods}
        graph[p.stem] = deps - {p.stem}
    return graph


def test_no_import_cycle_in_harness():
    graph = _graph("harness")
    assert "runner" in graph and "pull" in graph["runner"]  # the walk sees function-level imports too

    def visit(node, path):
        for dep in sorted(graph[node]):
            assert dep not in path, "import cycle: " + " -> ".join(path[path.index(dep):] + [dep])
            visit(dep, path + [dep])

    for mod in graph:
        visit(mod, [mod])


def test_imports_run_one_way():
    for p in (REPO / "harness").glob("*.py"):
        bad = {i for i in _imports(p) if i.split(".")[0] in ("tasks", "rich", "remote", "torch")}
        assert not bad, f"harness/{p.name} imports {sorted(bad)}: harness returns data, the CLI prints"
    for p in (REPO / "remote").rglob("*.py"):
        bad = {i for i in _imports(p) if i.split(".")[0] in ("harness", "tasks")}
        assert not bad, f"{p.relative_to(REPO)} imports {sorted(bad)}: remote/ runs on the host alone"


def test_harness_never_prints():
    for p in (REPO / "harness").glob("*.py"):
        calls = [n for n in ast.walk(ast.parse(p.read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
        assert not calls, f"harness/{p.name}:{calls[0].lineno} prints; return the data and let tasks/ show it"


def test_listing_tasks_loads_nothing_heavy():
    """``inv -l`` imports every task module: none of them may load the harness's heavy dependencies."""
    code = ("import sys, json; from invoke import Program; import tasks; "
            "print(json.dumps(sorted(m for m in ('paramiko', 'fabric', 'pydantic', 'jinja2', 'rich', "
            "'harness.connection', 'harness.inventory') if m in sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    r = subprocess.run([sys.executable, "-m", "invoke", "-l"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "stage.extract" in r.stdout and "patch.refresh" in r.stdout, r.stderr


#: the host side's primitives: each is defined once, in remote/hostcore.py (issue: one host core)
HOST_PRIMITIVES = ("read_json", "write_json", "write_text", "write_bytes", "sha256_file", "boot_id", "proc_start",
                   "is_alive", "group_alive", "stop_group", "text_config", "text_config_key", "Refused",
                   "ACTIVE", "FINAL", "PROGRESS", "TEXT_CONFIG_KEYS", "TEMP_MARK")


def _definitions(path: Path) -> set[str]:
    """Names a module defines itself: functions, classes, and constants bound to a literal."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.Tuple, ast.List)):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def test_host_primitives_are_defined_once():
    """JSON files, process identity and liveness, a group's stop, a wrapper's language-model config, the
    run states, the progress marker, the refusal: remote/hostcore.py alone defines them; the tools, the
    runtime, the stages and the harness import them, and the run wrapper asks it for its identity."""
    core = REPO / "remote" / "hostcore.py"
    assert set(HOST_PRIMITIVES) <= _definitions(core)
    for p in [*(REPO / "remote").rglob("*.py"), *(REPO / "harness").glob("*.py"), *(REPO / "tasks").glob("*.py")]:
        if p != core:
            twice = _definitions(p) & set(HOST_PRIMITIVES)
            assert not twice, f"{p.relative_to(REPO)} defines {sorted(twice)} again: import them from hostcore"
        if p.suffix == ".py" and p != core:
            assert '"@@progress ' not in p.read_text(), f"{p.relative_to(REPO)} spells the progress marker itself"
    wrapper = (REPO / "templates" / "run" / "wrapper.sh.j2").read_text()
    assert "/proc/" not in wrapper and "hostcore.py\" identity" in wrapper
    assert all(m == "{{" for m in re.findall(r"\bSTATE=(\S+)", wrapper)), "a run state the host core does not define"


#: a measurement in prose: milliseconds, a rate, a speed-up, seconds "of"/"against" something
_TIMING = re.compile(r"\b\d+(\.\d+)? ?(ms|µs)\b|\b\d+(\.\d+)? (tokens|MB)/s|\b\d+(\.\d+)?x (faster|slower)\b"
                     r"|\b\d+% (less|more) time|\b\d+(\.\d+)? s (of|against|a read|a step)\b")


def test_no_timing_figure_in_a_docstring():
    """Docstrings say what and why; figures live in the bench that measures them and bench/results.md."""
    for p in [*(REPO / "harness").glob("*.py"), *(REPO / "remote").rglob("*.py")]:
        tree = ast.parse(p.read_text())
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                                        ast.AsyncFunctionDef)))]:
            doc = ast.get_docstring(node) or ""
            m = _TIMING.search(doc)
            assert not m, f"{p.relative_to(REPO)}: {getattr(node, 'name', 'module')}'s docstring measures: {m.group(0)!r}"
