"""The stages there are: every module of remote/stages/ with a top-level ``main`` (what ``inv
stage.<name>`` offers). Read from the files as text, never imported, and cheap: ``inv -l`` calls it."""
from __future__ import annotations

import re
from pathlib import Path

from harness import REMOTE_DIR

_MAIN = re.compile(r"^def main\(", re.M)


def stage_names(code_root: Path | None = None) -> list[str]:
    d = (code_root or REMOTE_DIR) / "stages"
    return [p.stem for p in sorted(d.glob("*.py")) if not p.name.startswith("_") and _MAIN.search(p.read_text())]
