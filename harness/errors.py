"""The exception types a user is meant to read.

A ``HarnessError`` carries a single line that names the thing at fault (file, field, host, patch,
hunk) and what to do about it. The CLI turns it into a clean non-zero exit, never a traceback.
Its ``kind`` says what went wrong as data, so code branches on it rather than on the text.
"""


class HarnessError(Exception):
    """A user-facing, one-line error."""

    kind = "error"

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(" ".join(str(message).split()))
        if kind:
            self.kind = kind


class HostUnreachable(HarnessError):
    """The host could not be reached or authenticated within the timeout."""

    kind = "unreachable"


class HostKeyError(HarnessError):
    """The host's key is unknown or changed: never connect in that case."""

    kind = "host key"


class RemoteError(HarnessError):
    """A remote script answered ``{"ok": false, "kind": ..., "error": ...}``: ``kind`` is the host's
    own (``refused`` for a request it declines, ``no_run`` for an unknown run id, ``exception`` for
    a failure of the script itself, ...)."""
