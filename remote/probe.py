"""Read-only facts about a GPU host, gathered in one process: the data behind ``inv audit``.

Standard library only, so it runs on a bare host before anything is installed: it is sent over
stdin to the host's python and answers one JSON document. Versions come from package metadata (no
``import torch``: importing a CUDA build can take seconds and touch the GPUs), GPUs from nvidia-smi,
vLLM servers from /proc, and "edited after install" from pip's RECORD hashes.

Run by hand on a host:  python3 probe.py < spec.json   (spec: {"workdir": "~/.eagle-harness"})
"""
import base64
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata

PACKAGES = ["torch", "vllm", "speculators", "transformers", "triton", "safetensors", "datasets"]
NCCL_DISTS = ["nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11", "nvidia-nccl"]
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|CREDENTIAL", re.I)


def _normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions():
    """{normalized name: version} of every distribution on sys.path, from one listing of each
    site directory (``<name>-<version>.dist-info``): ~1 ms, where asking importlib.metadata name by
    name rescans every directory each time."""
    found = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for n in names:
            if n.endswith((".dist-info", ".egg-info")):
                stem = n.rsplit(".", 1)[0]
                name, _, version = stem.partition("-")
                if version:
                    found.setdefault(_normalize(name), version.split("-py")[0])
    return found


def packages():
    have = installed_versions()
    found = {name: have.get(_normalize(name)) for name in PACKAGES}
    found["nccl"] = next((have[_normalize(d)] for d in NCCL_DISTS if _normalize(d) in have), None)
    return found


def os_facts():
    pretty = None
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    pretty = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "os": pretty or platform.system(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "python_path": sys.executable,
        "cpus": os.cpu_count(),
    }


def _nvidia_smi(args):
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def gpus():
    """GPUs and their processes, or None when the host has no NVIDIA driver."""
    rows = _nvidia_smi(["--query-gpu=index,uuid,name,memory.used,memory.total,driver_version",
                        "--format=csv,noheader,nounits"])
    if rows is None:
        return None
    procs = _nvidia_smi(["--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                         "--format=csv,noheader,nounits"]) or []
    out = []
    for r in rows:
        if len(r) < 6:
            continue
        idx, uuid, name, used, total, driver = r[:6]
        out.append({
            "index": int(idx), "name": name, "memory_used_mib": _int(used), "memory_total_mib": _int(total),
            "driver": driver,
            "processes": [{"pid": _int(p[1]), "name": p[2], "memory_mib": _int(p[3])}
                          for p in procs if len(p) >= 4 and p[0] == uuid],
        })
    return out


def _int(s):
    try:
        return int(float(s))
    except (TypeError, ValueError):
        return None


def disk(workdir):
    path = os.path.expanduser(workdir)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    usage = shutil.disk_usage(path)
    return {"path": path, "free_bytes": usage.free, "total_bytes": usage.total}


def vllm_servers():
    """Running vLLM servers, from /proc (no psutil on a bare host)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        joined = " ".join(argv)
        if not argv or "vllm" not in joined or "probe" in joined:
            continue
        if not re.search(r"vllm(\s+|\.entrypoints\S*\s*)(serve|api_server)|vllm\.entrypoints|vllm serve", joined):
            continue
        port = None
        for i, a in enumerate(argv):
            if a == "--port" and i + 1 < len(argv):
                port = _int(argv[i + 1])
            elif a.startswith("--port="):
                port = _int(a.split("=", 1)[1])
        model = next((a for a in argv[argv.index("serve") + 1:] if not a.startswith("-")), None) if "serve" in argv else None
        found.append({"pid": int(pid), "port": port, "model": model, "cmdline": _mask_argv(argv)[:400]})
    return found


def _mask_argv(argv):
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif re.search(r"--(api-key|hf-token|token)$", a):
            out.append(a)
            hide = True
        else:
            out.append(re.sub(r"(--(?:api-key|hf-token|token)=).*", r"\1***", a))
    return " ".join(out)


def env_vars():
    prefixes = ("NCCL_", "VLLM_", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_")
    return {k: ("***" if SECRET_NAME.search(k) else v) for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def record_drift(dist_name="speculators"):
    """Files of an installed distribution whose sha256 no longer matches pip's RECORD."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return None
    edited, missing, checked = [], [], 0
    for f in dist.files or []:
        if not f.hash or f.hash.mode != "sha256":
            continue
        path = f.locate()
        try:
            with open(path, "rb") as fh:
                digest = base64.urlsafe_b64encode(hashlib.sha256(fh.read()).digest()).rstrip(b"=").decode()
        except FileNotFoundError:
            missing.append(str(f))
            continue
        checked += 1
        if digest != f.hash.value:
            edited.append(str(f))
    return {"checked": checked, "edited": sorted(edited), "missing": sorted(missing)}


def speculators_path():
    try:
        dist = metadata.distribution("speculators")
    except metadata.PackageNotFoundError:
        return None
    return str(dist.locate_file("speculators"))


def main(spec):
    workdir = spec.get("workdir", "~/.eagle-harness")
    facts = {
        "system": os_facts(),
        "packages": packages(),
        "speculators_path": speculators_path(),
        "gpus": gpus(),
        "disk": disk(workdir),
        "vllm_servers": vllm_servers(),
        "env": env_vars(),
        "record_drift": record_drift("speculators"),
    }
    # Optional parts shipped in the same bundle by the harness (issue: patches, API preflight).
    if spec.get("patches") is not None:
        try:
            import patchtool  # noqa: PLC0415 - only present when the harness ships it
        except ImportError:
            facts["patches"] = {"error": "patchtool not shipped"}
        else:
            facts["patches"] = patchtool.status(spec["patches"])
    if spec.get("apicheck") is not None:
        try:
            import apicheck  # noqa: PLC0415
        except ImportError:
            facts["apicheck"] = {"error": "apicheck not shipped"}
        else:
            facts["apicheck"] = apicheck.check(spec["apicheck"])
    return facts


if __name__ == "__main__":
    raw = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    json.dump(main(json.loads(raw) if raw.strip() else {}), sys.stdout, indent=2)
    sys.stdout.write("\n")
