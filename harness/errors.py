"""The one exception type a user is meant to read.

A ``HarnessError`` carries a single line that names the thing at fault (file, field, host, patch,
hunk) and what to do about it. tasks.py turns it into a clean non-zero exit, never a traceback.
"""


class HarnessError(Exception):
    """A user-facing, one-line error."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class HostUnreachable(HarnessError):
    """The host could not be reached or authenticated within the timeout."""


class HostKeyError(HarnessError):
    """The host's key is unknown or changed: never connect in that case."""
