"""What every task shares: the common options, clean one-line errors, JSON or rich output, exits.

The harness returns data and never prints; everything a person sees is drawn here and in the task
modules. Nothing heavy is imported at module level: ``inv -l`` loads every task module, so rich,
pydantic, paramiko and jinja2 load only when a task runs.
"""
from __future__ import annotations

import atexit
import functools
import gc
import json
import sys
import threading
from typing import Any, Callable

from invoke import Task
from invoke.exceptions import Exit
from invoke.parser import Argument

#: help strings of the options every host task takes
COMMON_HELP = {
    "inventory": "inventory file (default ./inventory.yaml, or $HARNESS_INVENTORY)",
    "hosts": "comma-separated host names (default: every host in the inventory)",
    "json": "print JSON only (for machines) instead of the table",
}
#: the progress lines a stage prints (remote/runtime/runstage.py's contract)
PROGRESS = "@@progress "

_consoles: dict[str, Any] = {}

# At exit the interpreter's last garbage collections walk every object of every module a task loaded
# (pydantic, paramiko, cryptography, rich): ~90 ms of a 0.8 s ``inv audit`` on a 2-core host, spent
# after the answer is printed. Frozen objects are skipped by those passes; the modules are still torn
# down and the streams flushed as usual.
atexit.register(gc.freeze)


def console(name: str = "out"):
    """The rich console for stdout (``out``) or stderr (``err``), made on first use. soft_wrap: a
    message stays one line when output is not a terminal (rich wraps at 80 columns otherwise)."""
    if name not in _consoles:
        from rich.console import Console

        _consoles[name] = Console(stderr=name == "err", highlight=False, soft_wrap=True)
    return _consoles[name]


def escape(text: str) -> str:
    from rich.markup import escape as _escape

    return _escape(str(text))


def clean_errors(fn: Callable) -> Callable:
    """Turn a HarnessError into a one-line message and exit 2, Ctrl-C into exit 130, no traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from harness.errors import HarnessError

        try:
            return fn(*args, **kwargs)
        except HarnessError as e:
            raise Exit(f"error: {e}", code=2)
        except KeyboardInterrupt as e:  # runs.Detached says how to reattach
            raise Exit(str(e) or "interrupted", code=130)
    return wrapper


def load(inventory: str | None, hosts: str | None):
    """(inventory, selected hosts): every problem with either is a one-line HarnessError."""
    from harness.inventory import load_inventory, select_hosts

    inv = load_inventory(inventory)
    return inv, select_hosts(inv, hosts)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def dest_for(dest: str | None, host: str, many: bool):
    """Where a host's artifacts go: ``dest`` itself, or ``dest/<host>`` when several hosts share it
    (None: the harness's default, ``runs/<run-id>``)."""
    from pathlib import Path

    if not dest:
        return None
    return Path(dest) / host if many else Path(dest)


def print_wide(renderable, to: str = "out") -> None:
    """Print a table whole: off a terminal (a pipe, CI, a log file) at the width it needs rather than
    squeezed into 80 columns ("succee…")."""
    out = console(to)
    if not out.is_terminal:
        from rich.console import Console
        from rich.measure import Measurement

        width = Measurement.get(out, out.options.update_width(10_000), renderable).maximum
        out = Console(file=out.file, width=max(width, 80), color_system=out.color_system, highlight=False)
    out.print(renderable)


def print_failures(results, to: str = "err") -> None:
    """Each failed host's message on one line (never wrapped), prefixed by its name, in red."""
    for f in results.failed.values():
        console(to).print(f"[bold cyan]\\[{escape(f.host)}][/] [red]{escape(f.message)}[/]")


def finish(results) -> None:
    """After every host was shown: exit 1 with one ``error:`` line per failed host, if any."""
    lines = results.error_lines()
    if lines:
        raise Exit("\n".join(lines), code=1)


class HostOutput:
    """Prints lines prefixed with their host, one whole line at a time, from many threads."""

    def __init__(self, enabled: bool = True, to: str = "err"):
        self.enabled, self.to = enabled, to
        self._lock = threading.Lock()

    def line(self, host: str, text: str, style: str = "") -> None:
        if not self.enabled:
            return
        with self._lock:
            body = escape(text)
            console(self.to).print(f"[bold cyan]\\[{escape(host)}][/] " + (f"[{style}]{body}[/]" if style else body))

    def for_host(self, host: str, style: str = "") -> Callable[[str], None]:
        return lambda text: self.line(host, text, style)


class StageView:
    """A stage's log as a person follows it: ``@@progress`` lines drive a rich bar, the others are
    printed (``@@harness`` ones dimmed), through ``echo`` when given (e.g. host-prefixed)."""

    def __init__(self, label: str, show: bool = True, echo: Callable[[str], None] | None = None):
        self.label, self.show, self.echo = label, show, echo
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.show:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                      console=console("err"), transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress, self._task = None, None

    def line(self, line: str) -> None:
        if line.startswith(PROGRESS):
            try:
                p = json.loads(line[len(PROGRESS):])
                done, total = p.get("done"), p.get("total") or None  # 0: not known yet (a pulsing bar)
            except (ValueError, AttributeError):
                p = None
            if p is not None:
                if self._progress is not None:
                    if self._task is None:
                        self._task = self._progress.add_task(self.label, total=total, unit=p.get("unit", ""))
                    self._progress.update(self._task, completed=done, total=total, unit=p.get("unit", ""))
                return
        if self.echo:
            self.echo(line)
        elif self.show:
            style = "dim" if line.startswith("@@harness") else ""
            console("err").print(f"[{style}]{escape(line)}[/]" if style else escape(line))


class ByteBar:
    """A rich bar for a pull: bytes done, total, rate; made on the first report, closed by ``close``."""

    def __init__(self, label: str, show: bool = True):
        self.label, self.show = label, show
        self._progress = None

    def __call__(self, done: int, total: int) -> None:
        if not self.show:
            return
        if self._progress is None:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=console("err"),
                                      transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=total)
        self._progress.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None


class _WaivedPositional(Argument):
    """A positional argument that counts as given once another flag is set (``waived_by``)."""

    waived_by: Argument | None = None

    @property
    def value(self) -> Any:
        v = self._value if self._value is not None else self.default
        if v is None and self.waived_by is not None and self.waived_by.value:
            return ""
        return v

    @value.setter
    def value(self, arg: str) -> None:
        self.set_value(arg, cast=True)


class WaivablePositionalTask(Task):
    """A task whose positional argument a flag makes unnecessary: ``inv deploy RUN`` and ``inv deploy
    --rollback`` (invoke requires every positional argument, and eats a token for one only while it is
    missing: a default would stop it from ever taking one). ``waive={"run": "rollback"}``."""

    def __init__(self, *args, waive: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.waive = waive or {}

    def get_arguments(self, ignore_unknown_help=None):
        args = super().get_arguments(ignore_unknown_help=ignore_unknown_help)
        by_name = {a.name: a for a in args}
        for name, flag in self.waive.items():
            by_name[name].__class__ = _WaivedPositional
            by_name[name].waived_by = by_name[flag]
        return args


def number(value, option: str, kind: type = float, default=None, minimum=None, why: str = ""):
    """An option's value as ``kind`` (invoke hands options without a typed default over as text), or
    ``default`` when it was not given; bad input, or a value below ``minimum`` (``why``: what the
    option means), is one line naming the option, not a traceback."""
    from harness.errors import HarnessError

    if value is None:
        return default
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise HarnessError(f"{option} {value!r}: not {'a whole number' if kind is int else 'a number'}") from None
    if minimum is not None and out < minimum:
        raise HarnessError(f"{option} {out:g}: {why}, at least {minimum:g}")
    return out
