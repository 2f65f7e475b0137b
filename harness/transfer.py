"""Copy a finished run from one host to others: what a node of a multi-host job needs from another.

Hosts need no keys to each other: the copy is relayed through this workstation over each host's own
verified SSH settings. The run is pulled from its host (harness/pull.py: resumable, every file checked
against the run's SHA256SUMS), pushed to each destination's ``incoming/<run-id>/`` with rsync
(``--partial``: an interrupted push resumes), and adopted there by runctl in one call: every file
checked again against SHA256SUMS, then renamed into ``runs/<run-id>/`` as a succeeded run that
records where it came from. A destination that already has the run with the same checksums is left
as it is, so a rerun of a multi-host job copies nothing twice.

The relay copy lives under the workstation's runs dir (``.relay/<run-id>/``) until every destination
has adopted it, then goes.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.connection import HostConnection
from harness.errors import HarnessError
from harness.pull import rsync_ssh_command, pull
from harness.runs import check_run_id, local_runs_dir, runctl


@dataclass
class Copied:
    """One run copied from ``source`` to ``dests``: the hosts that adopted it now, those that had it."""

    run_id: str
    source: str
    adopted: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"run_id": self.run_id, "source": self.source, "adopted": self.adopted, "already": self.already,
                "files": self.files, "bytes": self.bytes, "seconds": round(self.seconds, 1)}


def succeeded_sums(conn: HostConnection, run_id: str) -> str | None:
    """The SHA256SUMS of run ``run_id`` on ``conn``'s host when it succeeded there, else None."""
    try:
        man = runctl(conn, "manifest", run_id=run_id)
    except HarnessError as e:
        if e.kind == "no_run":
            return None
        raise
    return man["sums"] if man["status"].get("state") == "succeeded" else None


def _push(conn: HostConnection, local: Path, names: list[str], remote_artifacts: str, has_rsync: bool) -> None:
    """``names`` (and SHA256SUMS) from ``local`` into the host's incoming artifacts dir."""
    names = [*names, "SHA256SUMS"]
    if conn.host.is_local:
        for rel in names:
            dst = Path(remote_artifacts) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not (dst.is_file() and dst.stat().st_size == (local / rel).stat().st_size):
                shutil.copy2(local / rel, dst)
        return
    if not (has_rsync and shutil.which("rsync")):
        raise HarnessError(f"host {conn.name}: copying a run to it needs rsync on both ends; install rsync "
                           "(apt install rsync) there and here")
    with tempfile.TemporaryDirectory(prefix="harness-push-") as tmp:
        argv = ["rsync", "-s", "--partial", "--no-compress", "--times", "--files-from=-",
                "-e", rsync_ssh_command(conn, str(Path(tmp) / "known_hosts")),
                str(local) + "/", f"{conn.ssh_target}:{remote_artifacts.rstrip('/')}/"]
        proc = subprocess.run(argv, input="".join(n + "\n" for n in names).encode(), capture_output=True)
    if proc.returncode != 0:
        msg = (proc.stderr.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise HarnessError(f"host {conn.name}: rsync to it failed ({msg}); run again to resume the copy")


def copy_run(src: HostConnection, dests: list[HostConnection], run_id: str,
             on_progress: Callable[[int, int], None] | None = None) -> Copied:
    """Copy succeeded run ``run_id`` from ``src``'s host to every host of ``dests`` (its artifacts,
    intermediates included, and its status and result), each copy checked against the run's
    SHA256SUMS on arrival. Raises ``HarnessError`` naming the host and the file that failed."""
    check_run_id(run_id)
    t0 = time.monotonic()
    out = Copied(run_id, src.name)
    man = runctl(src, "manifest", run_id=run_id)
    st = man["status"]
    if st.get("state") != "succeeded":
        raise HarnessError(f"host {src.name}: run {run_id} is {st.get('state')}; only a succeeded run is copied to "
                           "other hosts")
    todo = []
    for dst in dests:  # hosts that already hold this exact run need nothing
        if man["sums"] is not None and succeeded_sums(dst, run_id) == man["sums"]:
            out.already.append(dst.name)
        else:
            todo.append(dst)
    if not todo:
        out.seconds = time.monotonic() - t0
        return out
    relay = local_runs_dir() / ".relay" / run_id
    got = pull(src, run_id, dest=relay, include_all=True, on_progress=on_progress)
    names = got.files  # every file SHA256SUMS lists (include_all), each verified by the pull
    source = {"status": st, "result": got.result}
    for dst in todo:
        where = runctl(dst, "incoming", run_id=run_id)
        _push(dst, relay, names, where["artifacts"], bool(where.get("has_rsync")))
        res = runctl(dst, "adopt", run_id=run_id, source=source, **{"from": src.name})
        (out.adopted if res.get("adopted") else out.already).append(dst.name)
    out.files, out.bytes = len(names), got.bytes
    shutil.rmtree(relay, ignore_errors=True)
    out.seconds = time.monotonic() - t0
    return out
