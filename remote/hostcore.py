"""The host side's primitives, in one place: JSON files read and written atomically, a process's
identity and liveness, stopping a process group, the language model's config inside a multimodal
wrapper, the run states, the progress marker and the refusal every host tool raises.

Stdlib only. Shipped with every tool call (``import hostcore``) and at the root of the code bundle, so
the tools, the runtime and the stages share one definition of each; the run wrapper's bash asks it for
its own identity (``python hostcore.py identity PID``) rather than parsing /proc again.
"""
import json
import os
import re
import signal
import sys
import time

# ---------------------------------------------------------------------------------------------------
# what the planes share

#: a run's states while its wrapper works (runctl writes ``launching`` before the wrapper starts)
ACTIVE = ("launching", "starting", "waiting", "guarding", "running", "restoring", "hashing")
#: a run's states once it is over (``lost``: its wrapper died without writing an end)
FINAL = ("succeeded", "failed", "stopped", "lost")
#: the states by name, for the wrapper template (``{{ states.running }}``: a misspelt one fails to render)
STATES = dict((s, s) for s in ACTIVE + FINAL)
#: a stage's progress line: this marker, then ``{"done": n, "total": N, "unit": "..."}``
PROGRESS = "@@progress "
#: where multimodal wrappers keep their language model's config (Kimi-K2.5: text_config)
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config", "language_model")


class Refused(Exception):
    """A request the host declines. It travels back as data, ``{"ok": false, "kind", "error"}``: the
    ``kind`` says what went wrong (``refused``, ``no_run``, ``not installed``, ``version mismatch``...)
    and the message is the one line the user reads."""

    def __init__(self, message, kind="refused"):
        Exception.__init__(self, message)
        self.kind = kind


def progress_line(done, total, unit):
    return PROGRESS + json.dumps({"done": int(done), "total": int(total), "unit": unit})


# ---------------------------------------------------------------------------------------------------
# files

def version_tuple(v):
    """A version's numeric release parts, up to the first that is not one: ``"0.16.0+cpu"`` -> (0, 16, 0)."""
    nums = []
    for part in re.split(r"[.+-]", v):
        m = re.match(r"\d+", part)
        if not m:
            break
        nums.append(int(m.group()))
    return tuple(nums)


def read_json(path, default=None):
    """A JSON file's content, or ``default`` when it is missing or unreadable."""
    try:
        with open(str(path)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def sha256_file(path):
    """The hex sha256 of a file's bytes, read a MiB at a time."""
    import hashlib  # noqa: PLC0415

    h = hashlib.sha256()
    with open(str(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path):
    """Make a rename in ``path`` durable; a filesystem that cannot fsync a directory is let be."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: what a temp file of ``write_bytes`` carries in its name (``.NAME.eh-PID``): a recovery finds the ones
#: a killed writer left
TEMP_MARK = ".eh-"


def write_bytes(path, data, mode=0o644, durable=False):
    """Replace ``path`` with ``data`` in one rename: a reader sees the old file or the new one, never
    half of either. ``mode`` None keeps the temp file's default; ``durable`` fsyncs the data and the
    directory (a patched package must survive a power cut; a status file need not)."""
    path = str(path)
    d, name = os.path.split(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, ".%s%s%d" % (name, TEMP_MARK, os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:  # a live failure (disk full...) leaves no temp file; a kill can, and a recovery removes it
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(d or ".")


def write_text(path, text, mode=0o644):
    write_bytes(path, text.encode("utf-8"), mode)


def write_json(path, data, mode=0o644):
    write_text(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", mode)


# ---------------------------------------------------------------------------------------------------
# processes

def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _stat(pid):
    """The fields of /proc/PID/stat after ``pid (comm)``: state first, start time at index 19."""
    try:
        with open("/proc/%d/stat" % int(pid)) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, TypeError, IndexError):
        return None


def proc_start(pid):
    """The process's start time in clock ticks since boot (with the boot id, what tells it from a reused
    pid), or None when it is gone or a zombie: a process that exited under a parent that has not reaped
    it yet must read as exited."""
    fields = _stat(pid)
    if not fields or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def identity(pid):
    """What a record of a process keeps so that a later reader can tell it is still that process."""
    return {"pid": int(pid), "pid_start": proc_start(pid), "boot_id": boot_id()}


def is_alive(record):
    """Whether the process a record of ``identity`` names still runs: same boot, same start time."""
    if not record or not record.get("pid"):
        return False
    if record.get("boot_id") and record["boot_id"] != boot_id():
        return False
    return proc_start(record["pid"]) == str(record.get("pid_start"))


def group_alive(pgid):
    """Whether a live (not zombie) process is left in process group ``pgid``. A zombie member would keep
    ``killpg(pgid, 0)`` succeeding until its parent reaps it; /proc tells the two apart."""
    try:
        os.killpg(int(pgid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if name.isdigit():
            fields = _stat(name)
            if fields and len(fields) > 2 and fields[2] == str(int(pgid)) and fields[0] not in ("Z", "X"):
                return True
    return False


def stop_group(pgid, grace, kill_wait, reap=lambda: None, done=lambda: True):
    """SIGTERM to process group ``pgid``, SIGKILL after ``grace`` seconds; returns (stopped, killed):
    stopped once no live process of the group is left and ``done()`` holds (a caller waiting on a
    record as well), False if a process is still alive ``kill_wait`` seconds after SIGKILL. Not when the
    leader exits: a server's workers outlive it by a moment. ``reap`` is called while waiting, so that
    the caller's own child does not linger as a zombie."""
    killed = False
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        reap()
        if not group_alive(pgid) and done():
            return True, killed
        if group_alive(pgid):
            try:
                os.killpg(int(pgid), sig)
                killed = killed or sig == signal.SIGKILL
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            reap()
            if not group_alive(pgid) and done():
                return True, killed
            time.sleep(0.05)
    return not group_alive(pgid), killed


# ---------------------------------------------------------------------------------------------------
# models

def _field(config, key):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def text_config_key(config):
    """Which of ``TEXT_CONFIG_KEYS`` holds a multimodal wrapper's language model (a config.json dict or a
    transformers config object): the first whose value has layers or a hidden size; None for a plain
    language model."""
    for key in TEXT_CONFIG_KEYS:
        sub = _field(config, key)
        if sub is not None and not isinstance(sub, (str, int, float, list)) and (
                _field(sub, "hidden_size") or _field(sub, "num_hidden_layers")):
            return key
    return None


def text_config(config):
    """The language model's config: a multimodal wrapper's nested one, else ``config`` itself."""
    key = text_config_key(config)
    return config if key is None else _field(config, key)


def main(argv):
    """``python hostcore.py identity PID``: ``BOOT_ID PID_START`` for the run wrapper's status file."""
    if len(argv) == 2 and argv[0] == "identity":
        rec = identity(argv[1])
        print("%s %s" % (rec["boot_id"], rec["pid_start"] or "null"))
        return 0
    print("usage: python hostcore.py identity PID", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
