"""An exact unified-diff applier (stdlib only): ``diff -u`` text parsed into hunks, applied or reversed
byte for byte. No fuzz and no offset search, unlike GNU patch: the patch tool has checked every file's
hash against the series first, so a hunk that does not fit is an error to name, never to work around.
"""
from __future__ import annotations

import re


class HunkFailed(Exception):
    def __init__(self, file: str, number: int, header: str, reason: str):
        super().__init__(f"file {file}, hunk #{number} ({header}): {reason}")
        self.file, self.number, self.header, self.reason = file, number, header, reason


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_diff(text: str) -> list[dict]:
    """``diff -u`` text -> [{"path", "hunks": [{"header", "old_start", "old_len", "new_start",
    "new_len", "lines": [(tag, bytes)]}]}]; paths are the ``+++`` names (relative to site-packages)."""
    files: list[dict] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].rstrip("\n").split("\t")[0].strip()
            files.append({"path": path, "hunks": []})
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise ValueError(f"line {i + 1}: hunk before any file header")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunk = {"header": line.split("@@")[1].strip().join(["@@ ", " @@"]), "old_start": int(m.group(1)),
                    "old_len": old_len, "new_start": int(m.group(3)), "new_len": new_len, "lines": []}
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len or lines[i].startswith("\\")):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    tag, data = hunk["lines"][-1]
                    hunk["lines"][-1] = (tag, data[:-1] if data.endswith(b"\n") else data)
                    i += 1
                    continue
                tag, data = body[:1], body[1:].encode()
                if body in ("\n", ""):  # some tools drop the space of an empty context line
                    tag, data = " ", b"\n"
                if tag not in (" ", "-", "+"):
                    raise ValueError(f"line {i + 1}: bad hunk line {body[:40]!r}")
                seen_old += tag in (" ", "-")
                seen_new += tag in (" ", "+")
                hunk["lines"].append((tag, data))
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise ValueError(f"hunk {hunk['header']}: truncated")
            files[-1]["hunks"].append(hunk)
            continue
        i += 1
    return files


def _split(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    out = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def apply_file_patch(data: bytes, fpatch: dict, reverse: bool = False) -> bytes:
    """Apply (or reverse) one file's hunks exactly; raise HunkFailed naming the hunk that does not fit."""
    src = _split(data)
    out: list[bytes] = []
    pos = 0
    for n, h in enumerate(fpatch["hunks"], 1):
        old_tag, new_tag = ("+", "-") if reverse else ("-", "+")
        start, length = (h["new_start"], h["new_len"]) if reverse else (h["old_start"], h["old_len"])
        old = [d for t, d in h["lines"] if t in (" ", old_tag)]
        new = [d for t, d in h["lines"] if t in (" ", new_tag)]
        at = start - 1 if length else start
        if at < pos or src[at:at + len(old)] != old:
            got = src[at:at + len(old)]
            first_bad = next((k for k, (a, b) in enumerate(zip(old, got)) if a != b), min(len(old), len(got)))
            raise HunkFailed(fpatch["path"], n, h["header"],
                             f"context does not match at line {at + first_bad + 1}")
        out.extend(src[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(src[pos:])
    return b"".join(out)
