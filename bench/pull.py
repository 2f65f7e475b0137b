"""Artifact pull throughput: ``harness.pull`` (rsync + SHA-256 verification) against plain rsync and
Fabric's ``Connection.get``, side by side, on a 1 GiB artifact over a real loopback sshd.

The artifact is written by a real run (the runner's test stage, random bytes, so nothing compresses)
and listed in that run's SHA256SUMS. Each round pulls it with every method into a fresh directory,
in turn, so machine load hits all of them alike; the best round of each is compared (loopback on
a shared machine is noisy, and the best round is the one least disturbed by other work). CPU
seconds per GiB (this process and its children, plus the sshd's finished sessions) are printed too:
they depend far less on the load than wall time does.

  ours = harness.pull.pull(...)                  rsync over ssh_argv(), then every byte SHA-256 checked
  rsync = rsync -a -e "<the same ssh command>"   no verification beyond rsync's own
  fabric = fabric.Connection(...).get(...)       SFTP, paramiko's prefetch

Bars (issue 4): ours / rsync >= 0.9 and ours / fabric >= 1.5 (throughput ratios).
"""
from __future__ import annotations

import argparse
import getpass
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import yaml  # noqa: E402

from loopback import start_hosts  # noqa: E402
from runs_support import code_root  # noqa: E402
from harness import runs  # noqa: E402
from harness.connection import open_host  # noqa: E402
from harness.inventory import load_inventory  # noqa: E402
from harness.pull import pull  # noqa: E402
from results import record  # noqa: E402


def cpu_seconds(sshd_pid: int) -> float:
    """CPU time of this process, its finished children (rsync, ssh) and the sshd's finished sessions
    (the host side: sshd, sftp-server, the remote rsync), in seconds."""
    t = os.times()
    with open(f"/proc/{sshd_pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    host = (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick  # utime stime cutime cstime
    return t.user + t.system + t.children_user + t.children_system + host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fabric-rounds", type=int, default=1, help="Fabric is slow; fewer rounds of it")
    ap.add_argument("--dest-root", default=None,
                    help="where the pulled copies go (default: the temp dir; /dev/shm takes the local disk out)")
    ap.add_argument("--quick", action="store_true",
                    help="8 MiB, one round each, bars shown but not judged: the suite runs this so the bench cannot rot")
    ap.add_argument("--nice", type=int, default=0,
                    help="run the whole measurement (sshd, ssh, rsync included) at this niceness, e.g. -10 on a "
                         "machine busy with unrelated work; every method gets the same priority")
    args = ap.parse_args()
    if args.quick:
        args.size_mib, args.rounds, args.fabric_rounds = 8, 1, 1
    size = args.size_mib << 20
    if args.nice:
        os.nice(args.nice)

    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp:
        tmp = Path(tmp)
        (tmp / "hosts").mkdir()
        host = start_hosts(tmp / "hosts", 1)[0]
        try:
            inv_path = tmp / "inventory.yaml"
            inv_path.write_text(yaml.safe_dump({"hosts": {"h": host.entry(workdir=str(tmp / "wd"))}}))
            inv = load_inventory(inv_path)
            conn = open_host(inv.hosts["h"], inv)
            print(f"writing a {args.size_mib} MiB artifact through a real run ...", flush=True)
            runs.launch(conn, inv, "teststage", run_id="bench", code_root=code_root(tmp),
                        extra={"files": {"hidden.bin": size}, "random": True}, environ={}, gpu=False)
            st = runs.follow(conn, "bench", base=tmp / "runs", on_line=lambda l: None)
            assert st["state"] == "succeeded", st
            remote = tmp / "wd" / "runs" / "bench" / "artifacts" / "hidden.bin"
            kh = tmp / "kh"
            ssh = " ".join(shlex.quote(a) for a in conn.ssh_argv(known_hosts_file=str(kh)))

            def ours(dest: Path) -> None:
                res = pull(conn, "bench", dest, method="rsync")
                assert res.bytes == size and (dest / "hidden.bin").stat().st_size == size

            def plain_rsync(dest: Path) -> None:
                dest.mkdir(parents=True)
                subprocess.run(["rsync", "-a", "-e", ssh, f"127.0.0.1:{remote}", str(dest) + "/"], check=True)
                assert (dest / "hidden.bin").stat().st_size == size

            def fabric_get(dest: Path) -> None:
                import fabric
                dest.mkdir(parents=True)
                c = fabric.Connection("127.0.0.1", port=host.port, user=getpass.getuser(),
                                      connect_kwargs={"key_filename": str(host.identity), "look_for_keys": False,
                                                      "allow_agent": False})
                c.client.load_host_keys(str(host.write_known_hosts()))
                try:
                    c.get(str(remote), str(dest / "hidden.bin"))
                finally:
                    c.close()
                assert (dest / "hidden.bin").stat().st_size == size

            methods = {"ours": ours, "rsync": plain_rsync, "fabric": fabric_get}
            times: dict[str, list[float]] = {m: [] for m in methods}
            cpus: dict[str, list[float]] = {m: [] for m in methods}
            for r in range(max(args.rounds, args.fabric_rounds)):
                for name, fn in methods.items():
                    if name == "fabric" and r >= args.fabric_rounds or name != "fabric" and r >= args.rounds:
                        continue
                    dest = Path(args.dest_root or tmp) / f"bench-pull-dest-{name}-{r}"
                    c0 = cpu_seconds(host.proc.pid)
                    t = time.perf_counter()
                    fn(dest)
                    dt = time.perf_counter() - t
                    cpu = cpu_seconds(host.proc.pid) - c0
                    shutil.rmtree(dest)
                    times[name].append(dt)
                    cpus[name].append(cpu)
                    print(f"round {r + 1}: {name:6s} {dt:7.2f} s  {size / dt / 1e6:7.1f} MB/s  "
                          f"CPU {cpu:5.2f} s (both ends)", flush=True)
            conn.close()
        finally:
            host.stop()

    best = {m: min(v) for m, v in times.items()}
    rate = {m: size / t / 1e6 for m, t in best.items()}
    print()
    print(f"{args.size_mib} MiB on loopback into {args.dest_root or 'the temp dir'}, best of {args.rounds} "
          f"(fabric: {args.fabric_rounds}):")
    for m in methods:
        print(f"  {m:6s} {best[m]:7.2f} s  {rate[m]:7.1f} MB/s   CPU per GiB (workstation + host): "
              f"{min(cpus[m]) / (size / 2**30):.2f} s")
    r_rsync = rate["ours"] / rate["rsync"]
    r_fabric = rate["ours"] / rate["fabric"]
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"medians: " + ", ".join(f"{m} {size / med[m] / 1e6:.1f} MB/s" for m in methods))
    print(f"plain rsync / Fabric get = {rate['rsync'] / rate['fabric']:.2f}x  (for reference: what rsync alone gains)")
    judged = (lambda ok: "quick: not judged") if args.quick else (lambda ok: "PASS" if ok else "FAIL")
    print(f"ours / plain rsync      = {r_rsync:.2f}x  (bar >= 0.90: {judged(r_rsync >= 0.9)})")
    print(f"ours / Fabric get       = {r_fabric:.2f}x  (bar >= 1.50: {judged(r_fabric >= 1.5)})")
    record("pull", [(f"{args.size_mib} MiB pulled and verified, ours", f"{rate['ours']:.1f} MB/s", ""),
                    ("ours / plain rsync", f"{r_rsync:.2f}x", ">= 0.90x"),
                    ("ours / Fabric get", f"{r_fabric:.2f}x", ">= 1.50x")], args.quick)
    sys.exit(0 if args.quick or (r_rsync >= 0.9 and r_fabric >= 1.5) else 1)


if __name__ == "__main__":
    main()
