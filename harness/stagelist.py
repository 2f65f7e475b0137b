"""The stages there are: every module of remote/stages/<generation>/ with a top-level ``main`` (what ``inv
stage.<name>`` offers; both generations have the same stages), and of remote/stages/ itself (a code
tree of stages without generations, as the tests use). Read from the files as text, never imported, and
cheap: ``inv -l`` calls it."""
from __future__ import annotations

import re
from pathlib import Path

from harness import REMOTE_DIR

_MAIN = re.compile(r"^def main\(", re.M)


def stage_names(code_root: Path | None = None) -> list[str]:
    d = (code_root or REMOTE_DIR) / "stages"
    files = sorted([*d.glob("*.py"), *d.glob("*/*.py")], key=lambda p: p.stem)
    names = [p.stem for p in files if not p.name.startswith("_") and p.parent.name != "lib" and _MAIN.search(p.read_text())]
    return list(dict.fromkeys(names))
