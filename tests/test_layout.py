"""The shape of the code, checked: imports run one way (tasks -> harness -> remote, never back),
harness/ has no import cycle, harness/ never prints, and listing the tasks loads nothing heavy."""
import ast
import json
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
