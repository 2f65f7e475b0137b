"""What a body of Python code asks of vLLM, read from its source with ``ast`` (stdlib only, nothing imported).

Today's stages and speculators 0.5+ do not import vLLM: they start its server and talk to it, so what can
break between vLLM versions is a command-line flag, a key of ``--speculative-config`` or
``--kv-transfer-config``, a method or connector name, an HTTP route, a request field or a metric name, each
of which a vLLM that no longer knows it ignores, guesses or refuses only after the model has loaded. This
collects those uses, each with file:line; ``apicheck.check_uses`` looks each one up in a vLLM source tree.

A use is ``{"kind", "api", "where"}`` (and ``"of"`` for a config key: the config class). Kinds:
``import`` (``from vllm.x import y``, also inside a string of code run with ``python -c``), ``module``
(a module run with ``python -m``), ``flag`` (the API server's), ``bench-flag`` (``vllm bench serve``'s),
``config-key``, ``config-value``, ``route``, ``request-field``, ``metric``.

Which flags are vLLM's is told by where they stand: in a function that starts the server (it names the
server module) or builds its configs (it names ``--speculative-config``), or in an ``extra_args=`` given to
a server; ``vllm bench serve``'s in a function that runs the benchmark client (it names ``CLIENT``).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: the config dicts passed as JSON on the server's command line, told apart by a key only each one has
CONFIGS = {"method": "SpeculativeConfig", "kv_connector": "KVTransferConfig"}
CONFIG_VALUES = ("method", "kv_connector", "kv_role")
FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")
#: the server's routes the stages call (the OpenAI API under /v1, and its own)
ROUTE_PATTERN = r"/(?:v1/[a-z_/]+|health|metrics|tokenize|detokenize|version|ping)"
ROUTE = re.compile(f"^{ROUTE_PATTERN}$")
ROUTE_AT_END = re.compile(f"({ROUTE_PATTERN})$")
METRIC = re.compile(r"^vllm:[a-z_:]+$")


def _consts(node) -> list[ast.Constant]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _route_of(node) -> str | None:
    """The route a URL expression ends with: ``"/v1/models"``, ``url + "/metrics"``, ``f"{u}/v1/x"``."""
    parts = [node] if isinstance(node, ast.Constant) else (
        node.values if isinstance(node, ast.JoinedStr) else [node.right] if isinstance(node, ast.BinOp) else [])
    for p in reversed(parts):
        if isinstance(p, ast.Constant) and isinstance(p.value, str):
            m = ROUTE_AT_END.search(p.value)
            return m.group(1) if m and (p is not node or ROUTE.match(p.value)) else None
    return None


class _Collector:
    """One file's uses, kind by kind (``run``)."""

    def __init__(self, rel: str, tree: ast.Module):
        self.rel, self.tree, self.uses = rel, tree, []

    def add(self, kind: str, api: str, node, **extra) -> None:
        line = getattr(node, "lineno", 0)
        self.uses.append({"kind": kind, "api": api, "where": f"{self.rel}:{line}", **extra})

    def run(self) -> list[dict]:
        self.imports(self.tree, 0)
        for fn in [n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            self.flags(fn)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                self.call(node)
            elif isinstance(node, ast.Dict):
                self.config(node)
        self.routes()
        self.metrics()
        return self.uses

    def imports(self, tree: ast.Module, offset: int) -> None:
        # imports tried one after the other (try: ... except ImportError: ...) are alternatives
        alt = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h.type or ast.Constant("")) or
                                                 "ModuleNotFoundError" in ast.unparse(h.type or ast.Constant(""))
                                                 for h in node.handlers):
                for part in (node.body, *[h.body for h in node.handlers]):
                    for n in part:
                        for m in ast.walk(n):
                            alt.setdefault(id(m), f"{self.rel}:{node.lineno + offset}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                for a in node.names:
                    use = {"kind": "import", "api": f"{node.module}:{a.name}", "where": f"{self.rel}:{node.lineno + offset}"}
                    if id(node) in alt:
                        use["alt"] = alt[id(node)]
                    self.uses.append(use)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "from vllm" in node.value \
                    and tree is self.tree:
                try:  # code run with python -c
                    self.imports(ast.parse(node.value), node.lineno - 1)
                except SyntaxError:
                    pass
            elif tree is self.tree and isinstance(node, ast.List):  # [python, "-m", "vllm.x", ...]
                for a, b in zip(node.elts, node.elts[1:]):
                    if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant) \
                            and str(b.value).startswith("vllm."):
                        self.add("module", b.value, b)
            elif tree is self.tree and isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and str(node.value.value).startswith("vllm.") \
                    and any(isinstance(x, ast.Name) and x.id.endswith("MODULE") for x in node.targets):
                self.add("module", node.value.value, node.value)

    def flags(self, fn) -> None:
        consts = _consts(fn)
        values = {c.value for c in consts}
        names = _names(fn)
        starts_server = SERVER_MODULE in values or "SERVER_MODULE" in names
        # a function that builds the configs, not one that hands them to a server (its extra_args= say)
        builds_configs = "--speculative-config" in values and not any(
            isinstance(n, ast.keyword) and n.arg == "extra_args" for n in ast.walk(fn))
        kind = "flag" if starts_server or builds_configs else "bench-flag" if "CLIENT" in names else None
        if kind is None:
            return
        inner = {id(n) for d in ast.walk(fn) if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d is not fn
                 for n in ast.walk(d)}
        for c in consts:
            if FLAG.match(c.value) and id(c) not in inner:
                self.add(kind, c.value, c)

    def call(self, node: ast.Call) -> None:
        for kw in node.keywords:
            if kw.arg == "extra_args":
                for c in _consts(kw.value):
                    if FLAG.match(c.value):
                        self.add("flag", c.value, c)
            if kw.arg in ("json", "extra_body") and isinstance(kw.value, ast.Dict):
                self.fields(kw.value)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "post" and len(node.args) > 1 \
                and _route_of(node.args[0]) and isinstance(node.args[1], ast.Dict):
            self.fields(node.args[1])

    def routes(self) -> None:
        seen = set()
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                route = _route_of(node)
                if route and (route, node.lineno) not in seen:
                    seen.add((route, node.lineno))
                    self.add("route", route, node)

    def fields(self, d: ast.Dict) -> None:
        for k in d.keys:
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                self.add("request-field", k.value, k)

    def config(self, d: ast.Dict) -> None:
        keys = {k.value: v for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        cls = next((CONFIGS[k] for k in CONFIGS if k in keys), None)
        if cls is None:
            return
        for key, value in keys.items():
            self.add("config-key", key, value, of=cls)
            if key in CONFIG_VALUES and isinstance(value, ast.Constant) and isinstance(value.value, str):
                self.add("config-value", value.value, value, of=cls)
            if isinstance(value, ast.Dict):  # nested: draft_model_config's hf_config, the connector's extra config
                for n in ast.walk(value):
                    if isinstance(n, ast.Dict):
                        for k in n.keys:
                            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                                self.add("config-key", k.value, k, of=f"{cls}.{key}")

    def metrics(self) -> None:
        """Metric names: literal ``vllm:...`` strings, or a module's ``PREFIX = "vllm:"`` joined to the
        string constants of its other module-level assignments (specdecode's counter table)."""
        prefix = None
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PREFIX" for t in node.targets) \
                    and isinstance(node.value, ast.Constant) and node.value.value == "vllm:":
                prefix = node.value.value
        for node in self.tree.body:
            if not isinstance(node, ast.Assign) or node.value is None:
                continue
            for c in _consts(node.value):
                if METRIC.match(c.value):
                    self.add("metric", c.value, c)
                elif prefix and isinstance(node.value, (ast.Dict, ast.Constant)) and re.match(r"^[a-z]+(_[a-z]+)+$", c.value) \
                        and not (isinstance(node.value, ast.Dict) and c in node.value.keys):
                    self.add("metric", prefix + c.value, c)


def collect(root: str | Path, files: list[str]) -> list[dict]:
    """Every vLLM use in ``files`` (paths relative to ``root``), with ``where`` relative to ``root``."""
    root = Path(root)
    uses: list[dict] = []
    for rel in files:
        try:
            tree = ast.parse((root / rel).read_text(errors="replace"))
        except SyntaxError:
            continue
        uses += _Collector(rel, tree).run()
    return uses
