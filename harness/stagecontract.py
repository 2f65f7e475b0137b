"""The stages' contracts, read from their source on the workstation without importing them (no torch).

The stages come in generations, one per speculators line (``GENERATIONS``; harness/generations.py says
which one a host's installed speculators needs): ``remote/stages/<generation>/<name>.py``. Each stage
module declares at its top, in plain literals::

    READS = ("extract", "vocab")  # the stages whose artifacts it reads (its inputs)
    GPU = True                    # it needs the GPUs (so the service guard) when the host has any
    SETTINGS = {"lr": 1e-4, ...}  # the pipeline settings it reads, with their defaults

and ``remote/stages/common.py`` declares ``COMMON_SETTINGS``, the settings every stage reads. Those
literals are the one place each default lives: the stages read them at run time
(``common.settings``), the pipeline derives its stage order, inputs, run-id settings and GPU stages
from them (harness/pipeline.py), and the inventory schema its defaults (``PipelineSpec``). A setting
that several stages read is declared by each of them with the same default; a contract that breaks
a rule (a missing or non-literal block, an unknown or circular input, two defaults for one setting)
is a ``ContractError`` naming the file and line. Both generations run the same stages in the same
order (what the pipeline, ``inv stage.<name>`` and the run ids name), each reading what its own
speculators line needs; a setting both declare has one default. Parsing the files takes a few
milliseconds and is done once per process and stages directory.
"""
from __future__ import annotations

import ast
import copy
import functools
import marshal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import CACHE_DIR, REMOTE_DIR, write_cache
from harness.errors import HarnessError

#: the stage generations, one per speculators line: remote/stages/<generation>/
GENERATIONS = ("legacy", "current")
#: modules of remote/stages/<generation>/ that are not stages
NOT_STAGES = ("__init__", "common")
STAGE_BLOCK = ("READS", "GPU", "SETTINGS")


class ContractError(HarnessError):
    """A stage contract breaks a rule: a mistake in remote/stages/, not in the inventory."""

    kind = "stage contract"


@dataclass(frozen=True)
class StageContract:
    name: str
    reads: tuple[str, ...]
    gpu: bool
    settings: dict[str, Any]
    path: Path


@dataclass(frozen=True)
class Contracts:
    #: stage name -> contract, in pipeline order (every stage after the stages it reads)
    stages: dict[str, StageContract]
    #: COMMON_SETTINGS of stages/common.py: read by every stage
    common: dict[str, Any]
    #: the generation these stages are (remote/stages/<generation>/)
    generation: str

    @property
    def order(self) -> list[str]:
        return list(self.stages)

    @property
    def reads(self) -> dict[str, tuple[str, ...]]:
        """stage -> the stages whose artifacts it reads (its ``inputs``)."""
        return {name: c.reads for name, c in self.stages.items()}

    @property
    def gpu_stages(self) -> set[str]:
        return {name for name, c in self.stages.items() if c.gpu}

    @functools.cached_property
    def merged(self) -> dict[str, Any]:
        """Every pipeline setting -> its default, merged once (read-only: ``default`` copies)."""
        return self.defaults()

    def defaults(self) -> dict[str, Any]:
        """Every pipeline setting -> its default (a copy: mutating it changes nothing here)."""
        out = dict(self.common)
        for contract in self.stages.values():
            out.update(contract.settings)
        return copy.deepcopy(out)


#: ``_literals``' results between processes: parsing the stage files would be part of every command that
#: loads the inventory (its defaults come from here), ``inv audit`` among them; a file whose size or
#: mtime changed is parsed again
LITERALS_CACHE = CACHE_DIR / "stage-contracts.marshal"
_parsed: dict[tuple, dict[str, tuple[Any, int]]] | None = None
_used: dict[tuple, dict[str, tuple[Any, int]]] = {}


def _literals(path: Path, names: tuple[str, ...]) -> dict[str, tuple[Any, int]]:
    """``name -> (value, line)`` of the module-level assignments ``name = <literal>`` in ``path``."""
    global _parsed
    try:
        st = path.stat()
    except OSError as e:
        raise ContractError(f"{path}: cannot read the stage contract: {e}")
    key = (str(path), st.st_size, st.st_mtime_ns, names)
    if _parsed is None:
        try:
            _parsed = marshal.loads(LITERALS_CACHE.read_bytes())
            assert isinstance(_parsed, dict)
        except (OSError, ValueError, EOFError, TypeError, AssertionError):
            _parsed = {}
    if key in _parsed:
        _used[key] = _parsed[key]
        return copy.deepcopy(_parsed[key])
    found = _parse_literals(path, names)
    _used[key] = copy.deepcopy(found)
    return found


def _save_literals() -> None:
    """Write the literals this process read (and only those: edited files' old entries go), when it
    read one the cache did not hold. A cache that cannot be written is no error."""
    if _parsed is not None and all(_parsed.get(k) == v for k, v in _used.items()):
        return  # nothing new read (a process reads the contracts, then the constants: one write at most)
    try:
        data = marshal.dumps(_used)
    except ValueError:  # a literal marshal cannot write: no cache, nothing else changes
        return
    write_cache(LITERALS_CACHE, data)


def _parse_literals(path: Path, names: tuple[str, ...]) -> dict[str, tuple[Any, int]]:
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError) as e:
        raise ContractError(f"{path}: cannot read the stage contract: {e}")
    found: dict[str, tuple[Any, int]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in names:
            try:
                found[target.id] = (ast.literal_eval(value), node.lineno)
            except ValueError:
                raise ContractError(f"{path}:{node.lineno}: {target.id} must be a plain literal "
                                    "(the workstation reads it without importing the stage)")
    missing = [n for n in names if n not in found]
    if missing:
        raise ContractError(f"{path}: no {', '.join(missing)} at module level; every stage declares "
                            f"{', '.join(names)} at its top (see remote/stages/__init__.py)")
    return found


def _settings(path: Path, name: str, value: Any, line: int) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise ContractError(f"{path}:{line}: {name} must be a dict of setting name -> default")
    return value


def _read(stages_root: Path, generation: str) -> Contracts:
    common_path = stages_root / "common.py"
    stages_dir = stages_root / generation
    (common, line), = _literals(common_path, ("COMMON_SETTINGS",)).values()
    common = _settings(common_path, "COMMON_SETTINGS", common, line)

    found: dict[str, StageContract] = {}
    lines: dict[str, tuple[int, int]] = {}  # stage -> (line of READS, line of SETTINGS)
    for path in sorted(stages_dir.glob("*.py")):
        if path.stem in NOT_STAGES:
            continue
        block = _literals(path, STAGE_BLOCK)
        (reads, reads_line), (gpu, gpu_line), (settings, settings_line) = (block[n] for n in STAGE_BLOCK)
        if not isinstance(reads, tuple) or not all(isinstance(r, str) for r in reads):
            raise ContractError(f"{path}:{reads_line}: READS must be a tuple of stage names")
        if not isinstance(gpu, bool):
            raise ContractError(f"{path}:{gpu_line}: GPU must be True or False")
        settings = _settings(path, "SETTINGS", settings, settings_line)
        for name in settings:
            if name in common:
                raise ContractError(f"{path}:{settings_line}: SETTINGS.{name} is in common.py's COMMON_SETTINGS "
                                    "already (every stage reads it); declare it once")
        found[path.stem] = StageContract(path.stem, reads, gpu, settings, path)
        lines[path.stem] = (reads_line, settings_line)
    if not found:
        raise ContractError(f"{stages_dir}: no stage modules")

    for name, contract in found.items():
        for dep in contract.reads:
            if dep not in found or dep == name:
                raise ContractError(f"{contract.path}:{lines[name][0]}: READS names {dep!r}, which is not another "
                                    f"stage (stages: {', '.join(sorted(found))})")

    # pipeline order: every stage after the stages it reads; among those ready, by name
    order: list[str] = []
    while len(order) < len(found):
        ready = sorted(n for n, c in found.items() if n not in order and set(c.reads) <= set(order))
        if not ready:
            stuck = sorted(set(found) - set(order))
            raise ContractError(f"{stages_dir}: the READS of {', '.join(stuck)} form a cycle")
        order.append(ready[0])

    # one default per setting, whichever stages read it
    seen: dict[str, tuple[Any, str]] = {}
    for name in order:
        contract = found[name]
        for key, default in contract.settings.items():
            if key in seen and (seen[key][0] != default or type(seen[key][0]) is not type(default)):
                raise ContractError(f"{contract.path}:{lines[name][1]}: SETTINGS.{key} defaults to {default!r} "
                                    f"but stage {seen[key][1]} declares {seen[key][0]!r}; one default per setting")
            seen.setdefault(key, (default, name))
    return Contracts({name: found[name] for name in order}, common, generation)


def _check_generations(stages_root: Path, loaded: dict[str, Contracts]) -> None:
    """The generations agree on the stage names and order, and on the default of a setting both read."""
    first, *others = loaded.values()
    for other in others:
        if other.order != first.order:
            raise ContractError(f"{stages_root / other.generation}: stages {', '.join(other.order)}, but "
                                f"{first.generation}/ has {', '.join(first.order)}; every generation runs the same "
                                "stages in the same order")
        mine, theirs = first.defaults(), other.defaults()
        for key in sorted(set(mine) & set(theirs)):
            if mine[key] != theirs[key] or type(mine[key]) is not type(theirs[key]):
                stage = next(n for n, c in other.stages.items() if key in c.settings)
                raise ContractError(f"{other.stages[stage].path}: SETTINGS.{key} defaults to {theirs[key]!r} but "
                                    f"the {first.generation} stages declare {mine[key]!r}; one default per setting")


@functools.lru_cache(maxsize=None)
def _cached(stages_root: Path) -> dict[str, Contracts]:
    loaded = {g: _read(stages_root, g) for g in GENERATIONS}
    _check_generations(stages_root, loaded)
    _save_literals()
    return loaded


def check_generation(generation: str) -> str:
    if generation not in GENERATIONS:
        raise ContractError(f"no stage generation {generation!r} (there are: {', '.join(GENERATIONS)})")
    return generation


def load(remote: Path | None = None, generation: str = "current") -> Contracts:
    """The contracts of one generation's stages under ``remote/stages`` (default: this repository's
    remote/ tree); every generation is read and checked against the others once."""
    return _cached(Path(remote or REMOTE_DIR).resolve() / "stages")[check_generation(generation)]


def merged_defaults(remote: Path | None = None) -> dict[str, Any]:
    """Every pipeline setting of any generation -> its default (one per setting, checked)."""
    out: dict[str, Any] = {}
    for g in GENERATIONS:
        out.update(load(remote, g).merged)
    return copy.deepcopy(out)


def constant(relative: str, name: str) -> Any:
    """A module-level literal of a host module other than a stage's contract (``stages/lib/drafttypes.py``'s
    ``TYPES``), read as the contracts are, so the inventory's checks and the host code name one list."""
    value = _literals(REMOTE_DIR / relative, (name,))[name][0]
    _save_literals()
    return copy.deepcopy(value)


def default(name: str) -> Any:
    """The default of pipeline setting ``name`` (a copy), as the stages declare it."""
    defaults = merged_defaults()
    if name not in defaults:
        raise ContractError(f"pipeline setting {name!r} is declared by no stage (remote/stages/*/*.py SETTINGS, "
                            "common.py COMMON_SETTINGS)")
    return copy.deepcopy(defaults[name])
