"""eagle-harness: the control plane that drives EAGLE-3 draft training on remote GPU hosts.

Everything here runs on the workstation and never imports torch; the code that runs on a host lives
in the sibling ``remote`` tree and is shipped there (see ``harness.connection.HostConnection.run_script``).
"""
import importlib.util
import os
from pathlib import Path

#: The repository root: templates/, patches/ and remote/ are found relative to it.
ROOT = Path(__file__).resolve().parent.parent
REMOTE_DIR = ROOT / "remote"
#: stdlib scripts sent with each call (probe, patchtool, runctl...): never part of the code bundle
TOOLS_DIR = REMOTE_DIR / "tools"
#: the host side's primitives (stdlib): shipped with every tool call and at the code bundle's root
HOSTCORE = REMOTE_DIR / "hostcore.py"
#: what rides in the code bundle uploaded to a host: the host core, the stage runner and the stages
BUNDLE_DIRS = ("runtime", "stages")
BUNDLE_FILES = ("hostcore.py",)
#: pinned pip profiles for ``inv setup``
REQUIREMENTS_DIR = REMOTE_DIR / "requirements"
TEMPLATES_DIR = ROOT / "templates"
PATCHES_DIR = ROOT / "patches"
#: the workstation's cache: wheels downloaded for patch checks, and what is derived from this repository's
#: files and kept between commands (each keyed by the files' sizes and mtimes, rebuilt when one changes)
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle-harness"


def write_cache(path: Path, data: bytes) -> bool:
    """``data`` to ``path`` under ``CACHE_DIR`` atomically (a reader never sees half a file); False, and
    no error, when it cannot be written: a cache is an optimisation."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def remote_source(name: str) -> Path:
    """The file of a module shipped to hosts by its plain name: ``hostcore``, or a tool of remote/tools/."""
    return HOSTCORE if name == "hostcore" else TOOLS_DIR / f"{name}.py"


def _load_hostcore():
    spec = importlib.util.spec_from_file_location("_eagle_hostcore", HOSTCORE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: the host core, read here for what both planes share: the run states, the progress marker
hostcore = _load_hostcore()
