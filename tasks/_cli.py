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
import re
import sys
import threading
from typing import Any, Callable

from invoke import Task
from invoke.exceptions import Exit
from invoke.parser import Argument

from harness import hostcore

#: help strings of the options every host task takes
COMMON_HELP = {
    "inventory": "inventory file (default ./inventory.yaml, or $HARNESS_INVENTORY)",
    "hosts": "comma-separated host names (default: every host in the inventory)",
    "json": "print JSON only (for machines) instead of the table",
}
#: the progress lines a stage prints (the host core's marker)
PROGRESS = hostcore.PROGRESS

_consoles: dict[str, Any] = {}

# At exit the interpreter's last garbage collections walk every object of every module a task loaded
# (pydantic, paramiko, cryptography, rich), after the answer is printed: a noticeable share of a short
# command. Frozen objects are skipped by those passes; the modules are still torn down and the streams
# flushed as usual.
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


def finish(results, printed: bool = False) -> None:
    """After every host was shown: exit 1 with one ``error:`` line per failed host, if any: the one
    place a failure is printed (``printed``: already shown, e.g. by each interval of a watch; exit 1
    silently)."""
    lines = results.error_lines()
    if lines:
        raise Exit(None if printed else "\n".join(lines), code=1)


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


#: log lines that tell a person nothing (library chatter): they stay in the run's log file, never on
#: the terminal, unless --verbose. httpx's request lines, tqdm bars (carriage returns), datasets' split
#: counters, Python warnings and the source line under them, blank lines.
_CHATTER = re.compile(r"HTTP Request: |\r|\bit/s\]|examples/s\]|^\s*$|Warning: |^\s+warnings\.warn\(|^\s+\S+\(\S*\)$"
                      r"|^Generating \w+ split|^\s*(Using|Loading) ")
#: rich's logging prefix ("[02:16:43] INFO     ") and the harness's own ("@@harness 02:14:33 ")
_LOG_PREFIX = re.compile(r"^(\[\d\d:\d\d:\d\d\] +)?(\s*(DEBUG|INFO|WARNING|ERROR) +)|^@@harness (\d\d:\d\d:\d\d )?")


def progress_of(line: str) -> tuple[int, int | None, str] | None:
    """A ``@@progress`` line's (done, total or None while not known, unit); None for any other line."""
    if not line.startswith(PROGRESS):
        return None
    try:
        p = json.loads(line[len(PROGRESS):])
        return p.get("done") or 0, p.get("total") or None, p.get("unit", "")
    except (ValueError, AttributeError):
        return None


def meaningful(line: str) -> str | None:
    """The part of a stage's log line worth a glance (the live view's last line), or None for chatter."""
    if line.startswith(PROGRESS) or _CHATTER.search(line):
        return None
    text = _LOG_PREFIX.sub("", line, count=1).strip()
    return text or None


class LiveView:
    """What a person watches while stages run: one live row per host (its stage, a bar with the count,
    time elapsed and left, and the last meaningful line of the stage's log), and one line per finished
    stage above the rows. The full logs stay in the runs' directories on the host and come back with
    each pull (``inv runs.logs``); library chatter never reaches the terminal. ``verbose`` prints every
    log line as well, as it comes (``[host]``-prefixed when there are several hosts). Off a terminal (a
    pipe, CI) there are no rows, only the lines. Thread-safe: hosts report from their own threads."""

    def __init__(self, hosts, *, verbose: bool = False, show: bool = True):
        self.hosts, self.verbose, self.show = list(hosts), verbose, show
        self.many = len(self.hosts) > 1
        self._lock = threading.RLock()
        self._progress = None
        self._rows: dict[str, Any] = {}

    def __enter__(self):
        if self.show and console("err").is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold cyan]{task.fields[host]}"), TextColumn("[bold]{task.description}"),
                                      BarColumn(bar_width=24), TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                                      TimeRemainingColumn(), TextColumn("[dim]{task.fields[last]}"),
                                      console=console("err"), transient=True)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def _print(self, host: str, markup: str) -> None:
        if self.show:
            with self._lock:
                target = self._progress.console if self._progress is not None else console("err")
                target.print((f"[bold cyan]\\[{escape(host)}][/] " if host else "") + markup)

    def _row(self, host: str):
        if host not in self._rows and self._progress is not None:
            self._rows[host] = self._progress.add_task("", total=None, host=host, count="", last="", visible=False)
        return self._rows.get(host)

    def begin(self, host: str, stage: str, note: str = "") -> None:
        """``host`` starts ``stage``: its row starts over (bar, clock, last line)."""
        with self._lock:
            row = self._row(host)
            if row is not None:
                # reset() replaces the task's fields: every one the columns read is given again
                self._progress.reset(row, total=None, completed=0, description=stage, host=host, count="",
                                     last=note, visible=True)

    def end(self, host: str, text: str, style: str = "") -> None:
        """``host``'s stage is over: ``text`` becomes a line of its own, the row waits for the next."""
        with self._lock:
            row = self._rows.get(host)
            if row is not None:
                self._progress.update(row, visible=False)
            self.say(host, text, style)

    def say(self, host: str, text: str, style: str = "") -> None:
        """A message from the harness, printed above the rows."""
        self._print(host, f"[{style}]{escape(text)}[/]" if style else escape(text))

    def line(self, host: str, line: str) -> None:
        """A line of ``host``'s stage log: ``@@progress`` moves the bar; with ``verbose`` every other
        line is printed; the last meaningful one shows on the row."""
        p = progress_of(line)
        if p is not None:
            done, total, unit = p
            with self._lock:
                row = self._row(host)
                if row is not None:
                    count = f"{done}/{total} {unit}" if total else f"{done} {unit}"
                    self._progress.update(row, completed=done, total=total, count=count, visible=True)
            return
        if self.verbose:
            if self.many:
                self._print(host, f"[dim]{escape(line)}[/]")
            else:
                self._print("", f"[dim]{escape(line)}[/]" if line.startswith("@@harness") else escape(line))
        text = meaningful(line)
        if text is not None:
            with self._lock:
                row = self._row(host)
                if row is not None:
                    self._progress.update(row, last=text[:70], visible=True)

    def for_host(self, host: str) -> Callable[[str], None]:
        """``line`` for one host: the ``on_line`` the harness's followers take."""
        return lambda text: self.line(host, text)


class StageView(LiveView):
    """One run's whole log as it comes (``inv runs.logs --follow``): every line to ``echo``, its
    ``@@progress`` lines on a LiveView row instead."""

    def __init__(self, label: str, echo: Callable[[str], None]):
        super().__init__([label])
        self.label, self.echo = label, echo

    def __enter__(self):
        super().__enter__()
        self.begin(self.label, "")
        return self

    def line(self, line: str) -> None:  # type: ignore[override]
        if progress_of(line) is not None:
            super().line(self.label, line)
        else:
            self.echo(line)


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

    waived_by: tuple[Argument, ...] = ()

    @property
    def value(self) -> Any:
        v = self._value if self._value is not None else self.default
        if v is None and any(flag.value for flag in self.waived_by):
            return ""
        return v

    @value.setter
    def value(self, arg: str) -> None:
        self.set_value(arg, cast=True)


class WaivablePositionalTask(Task):
    """A task whose positional argument a flag makes unnecessary: ``inv deploy RUN`` and ``inv deploy
    --rollback`` (invoke requires every positional argument, and eats a token for one only while it is
    missing: a default would stop it from ever taking one). ``waive={"run": ("rollback", "best")}``."""

    def __init__(self, *args, waive: dict[str, str | tuple[str, ...]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.waive = waive or {}

    def get_arguments(self, ignore_unknown_help=None):
        args = super().get_arguments(ignore_unknown_help=ignore_unknown_help)
        by_name = {a.name: a for a in args}
        for name, flags in self.waive.items():
            by_name[name].__class__ = _WaivedPositional
            by_name[name].waived_by = tuple(by_name[f] for f in ((flags,) if isinstance(flags, str) else flags))
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
