"""Which stage code drives a host: the line of the speculators it has installed.

speculators changed shape at 0.5: up to 0.4 it generated hidden states itself (VllmHiddenStatesGenerator,
``data_{i}.pt`` files) and was driven from the stage code; from 0.5 on vLLM extracts them
(``extract_hidden_states`` and a KV connector, ``hs_{i}.safetensors``) and the work is its own CLI. The
harness keeps one set of stages per line (``remote/stages/<generation>/``) and picks it from the
installed version; a version outside both lines is refused in one line before anything loads a model.
"""
from __future__ import annotations

import re

from harness.errors import HarnessError

#: generation -> (first version, first version it no longer covers), and what it is
LINES = {
    "legacy": ((0, 3), (0, 5), "speculators 0.3-0.4: its VllmHiddenStatesGenerator, data_{i}.pt (remote/stages/legacy/)"),
    "current": ((0, 5), (1, 0), "speculators 0.5+: vLLM's extract_hidden_states, its CLI (remote/stages/current/)"),
}


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def generation_of(version: str | None, host: str = "") -> str:
    """``legacy`` or ``current`` for an installed speculators version; anything else is refused."""
    where = f"host {host}: " if host else ""
    if not version:
        raise HarnessError(f"{where}speculators is not installed for the host's python; run inv setup "
                           "(or point the host's 'python' at the interpreter that has it)", kind="not installed")
    v = _vtuple(version)
    for name, (first, stop, _) in LINES.items():
        if first <= v[:len(first)] and v[:len(stop)] < stop:
            return name
    raise HarnessError(f"{where}speculators {version} is outside both lines the harness drives (0.3-0.4: legacy, "
                       "0.5 up to 1.0: current); install one of them (inv setup) or pin the host's requirements",
                       kind="unsupported speculators")


def host_generation(conn, patched: dict | None = None) -> str:
    """The generation for ``conn``'s host: from a patch apply's answer when the caller just patched
    (its ``installed``), else from a patch status call (one round trip)."""
    from harness import patches  # noqa: PLC0415 - the series are read only when asked

    res = patched or conn.run_script("patchtool", patches.host_spec(conn.host, "status", required=()))
    return generation_of(res["packages"][patches.REQUIRED].get("installed"), conn.name)


#: the stage code each line runs (under remote/), read for its uses of vLLM; the runtime (the managed
#: server, deploys) serves every line's drafts
STAGE_CODE = {"legacy": (), "current": ("stages/current", "stages/lib")}
RUNTIME_CODE = ("runtime",)


def _files(dirs) -> list:
    from harness import REMOTE_DIR  # noqa: PLC0415

    return [f for d in dirs for f in sorted((REMOTE_DIR / d).glob("*.py"))]


def vllm_use_files() -> list:
    """Every file ``vllm_uses`` reads."""
    return _files(RUNTIME_CODE + tuple(d for dirs in STAGE_CODE.values() for d in dirs))


def vllm_uses() -> list[dict]:
    """What the stages and the runtime ask of vLLM (flags, config keys, routes, request fields, metric
    names: remote/tools/vllmuses.py), per speculators line, as the API preflight's ``uses``."""
    from harness import REMOTE_DIR  # noqa: PLC0415
    from harness.patches import load_remote  # noqa: PLC0415

    collect = load_remote("vllmuses").collect

    def uses(dirs, first, stop):
        rel = [f.relative_to(REMOTE_DIR).as_posix() for f in _files(dirs)]
        return {"speculators": [list(first), list(stop)], "uses": collect(REMOTE_DIR, rel)}

    out = [uses(RUNTIME_CODE, min(v[0] for v in LINES.values()), max(v[1] for v in LINES.values()))]
    out += [uses(dirs, LINES[name][0], LINES[name][1]) for name, dirs in STAGE_CODE.items() if dirs]
    return out
