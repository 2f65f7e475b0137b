"""Read-only facts about a GPU host, gathered in one process: the data behind ``inv audit``.

Standard library only, so it runs on a bare host before anything is installed: it is sent over
stdin to the host's python and answers one JSON document. Versions come from package metadata (no
``import torch``: importing a CUDA build can take seconds and touch the GPUs), GPUs from nvidia-smi,
vLLM servers from /proc, and "edited after install" from pip's RECORD hashes.

Run by hand on a host, next to distinfo.py (the harness ships both):
    python3 probe.py < spec.json   (spec: {"workdir": "~/.eagle-harness"})
"""
import hashlib
import json
import os
import re
import sys

import distinfo

PACKAGES = ["torch", "vllm", "speculators", "transformers", "triton", "safetensors", "datasets"]
NCCL_DISTS = ["nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11", "nvidia-nccl"]
NO_VLLM = "vLLM is not installed on this host: nothing to check"
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|CREDENTIAL", re.I)


def _normalize(name):
    return distinfo.normalize(name)


def installed_versions():
    """{normalized name: version} of every distribution on sys.path, read from the metadata
    directories' names (``<name>-<version>.dist-info``) in one listing of each site directory."""
    return distinfo.installed_versions()


def package_version(name):
    """The installed version of distribution ``name`` on this interpreter's path, or None."""
    dist = distinfo.find(name)
    return dist.version if dist else None


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
    u = os.uname()  # what platform.node/system/release/machine return on Linux, without importing it
    return {
        "hostname": u.nodename,
        "os": pretty or u.sysname,
        "kernel": u.release,
        "arch": u.machine,
        "python": sys.version.split()[0],  # platform.python_version(): "3.11.2", "3.13.0rc1"
        "python_path": sys.executable,
        "cpus": os.cpu_count(),
        "native_bf16": native_bf16(),  # without it the current stages compute in float32 on a host without GPUs
    }


def which(name):
    """shutil.which(name) for a plain command name, without loading shutil."""
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _nvidia_smi(args):
    exe = which("nvidia-smi")
    if not exe:
        return None
    import subprocess  # noqa: PLC0415 - loaded only on a host that has a driver to ask

    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def native_bf16():
    """Whether the CPU multiplies bf16 in hardware (x86 AMX or AVX512-BF16, Arm's BF16); without it torch
    and vLLM emulate bf16, and the current stages compute and store hidden states in float32."""
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})


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
    st = os.statvfs(path)  # what shutil.disk_usage computes
    return {"path": path, "free_bytes": st.f_bavail * st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize}


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
        opts = {}  # --port / --model, as "--name value" or "--name=value"; the last one counts
        for i, a in enumerate(argv):
            name, eq, value = a.partition("=")
            if name in ("--port", "--model") and (eq or i + 1 < len(argv)):
                opts[name] = value if eq else argv[i + 1]
        port = _int(opts["--port"]) if "--port" in opts else None
        model = opts.get("--model")
        if model is None and "serve" in argv:  # vllm serve MODEL
            model = next((a for a in argv[argv.index("serve") + 1:] if not a.startswith("-")), None)
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
    dist = distinfo.find(dist_name)
    if dist is None:
        return None
    edited, missing, checked = [], [], 0
    for rel, recorded in dist.sha256_record().items():
        try:
            with open(dist.locate(rel), "rb") as fh:
                digest = distinfo.record_b64(hashlib.sha256(fh.read()).hexdigest())
        except FileNotFoundError:
            missing.append(rel)
            continue
        checked += 1
        if digest != recorded:
            edited.append(rel)
    return {"checked": checked, "edited": sorted(edited), "missing": sorted(missing)}


def speculators_path():
    dist = distinfo.find("speculators")
    return None if dist is None else dist.locate("speculators")


def interfaces():
    """Network interface names (what NCCL_SOCKET_IFNAME must match)."""
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return []


def paths_exist(paths):
    """{path: exists} for host paths an env file names (``~`` expanded as the host's shell would)."""
    return {p: os.path.exists(os.path.expanduser(p)) for p in paths}


#: the facts a caller can ask for alone (``spec["only"]``), e.g. env.lint's three
SELECTABLE = {
    "interfaces": lambda spec: interfaces(),
    "gpus": lambda spec: gpus(),
    "files": lambda spec: paths_exist(spec.get("paths") or []),
    "disk": lambda spec: disk(spec.get("workdir", "~/.eagle-harness")),
    "packages": lambda spec: packages(),
}


def main(spec):
    if spec.get("only"):  # a few facts, not the whole audit
        return {name: SELECTABLE[name](spec) for name in spec["only"]}
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
            import patchstate  # noqa: PLC0415 - only present when the harness ships it
        except ImportError:
            facts["patches"] = {"error": "patchstate not shipped"}
        else:
            try:
                facts["patches"] = patchstate.status(spec["patches"])
            except Exception as e:  # noqa: BLE001 - a refusal (a malformed spec) is a fact of the audit
                facts["patches"] = {"error": str(e), "kind": getattr(e, "kind", "exception")}
    api = spec.get("apicheck")
    if api is not None:
        if not api.get("vllm_path") and distinfo.package_root("vllm")[0] is None:
            # apicheck.check's own answer for this case, without loading apicheck (and ast) at all
            facts["apicheck"] = {"ok": True, "skipped": NO_VLLM, "mismatches": []}
        else:
            try:
                import apicheck  # noqa: PLC0415
            except ImportError:
                facts["apicheck"] = {"error": "apicheck not shipped"}
            else:
                facts["apicheck"] = apicheck.check(api)
    return facts


if __name__ == "__main__":
    raw = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    json.dump(main(json.loads(raw) if raw.strip() else {}), sys.stdout, indent=2)
    sys.stdout.write("\n")
