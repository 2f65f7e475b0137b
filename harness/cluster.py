"""``inv pipeline --cluster NAME``: one EAGLE-3 job over several hosts (the inventory's ``clusters:``).

The work is split where it is big and kept on one host where it is small:

    prepare   on the first host; its run copied to the others
    extract   sharded by sample over every host (host i of N: speculators' own multi-node split,
              ``--world-size N --rank i``), each shard its own checksummed run, copied to every other host
    vocab     on the first host; copied to the others
    train     one torchrun job over every host (``--nnodes N --node-rank i``, rendezvous on the first
              host's ``master_addr:master_port``; NCCL on GPUs, gloo on CPUs), launched detached on
              each host by the runner under the same run id; the first host writes the checkpoint
    evaluate  on the first host

Copies go host to host through this workstation over each host's verified SSH settings
(harness/transfer.py), checked against SHA256SUMS on arrival, so the hosts need no keys to each
other. Run ids are content-addressed as in the one-host pipeline (the shards and the job's shape
added), so a rerun skips what is done and copies nothing twice.

One status for the whole job: the train nodes are followed together, and the first node that ends
without success (failed, stopped, lost with its host, or unreachable) stops the others and is named.
"""
from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness import generations, pipeline, runner, runs, transfer
from harness.connection import HostConnection
from harness.endpoint import endpoint_for
from harness.envfile import Masker, secret_values
from harness.errors import HarnessError
from harness.inventory import ClusterSpec, HostSpec, Inventory
from harness.pull import pull as pull_run
from harness.runner import StageRun

# where each stage runs: "first" host, "sharded" over all, or "all" as one job
PLACEMENT = {"prepare": "first", "extract": "sharded", "vocab": "first", "train": "all", "evaluate": "first"}


@dataclass
class ClusterRun:
    """What a multi-host job did: every stage run on every host, and every copy between hosts."""

    cluster: str
    hosts: list[str]
    stages: list[StageRun] = field(default_factory=list)
    copies: list[transfer.Copied] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"cluster": self.cluster, "hosts": self.hosts, "stages": [s.as_dict() for s in self.stages],
                "copies": [c.as_dict() for c in self.copies]}


def cluster_of(inv: Inventory, name: str) -> tuple[ClusterSpec, list[HostSpec]]:
    """The inventory's cluster ``name`` and its hosts, in rank order."""
    if name not in inv.clusters:
        known = ", ".join(inv.clusters) or "none"
        raise HarnessError(f"{inv.source or 'inventory'}: no cluster {name!r} (clusters: {known}); add it under "
                           "'clusters:' with its hosts")
    spec = inv.clusters[name]
    return spec, [inv.hosts[h] for h in spec.hosts]


def master_addr(spec: ClusterSpec, first: HostSpec, inv: Inventory) -> str:
    """Where the other hosts reach the first one for torchrun's rendezvous: the cluster's
    ``master_addr``, else the first host's own address as this workstation reaches it."""
    if spec.master_addr:
        return spec.master_addr
    return "127.0.0.1" if first.is_local else endpoint_for(first, inv).hostname


def shard_id(base: str, rank: int, size: int) -> str:
    return f"{base}-s{rank}of{size}"


def job_id(stage: str, base: str, **parts) -> str:
    """A content-addressed id for a multi-host run of ``stage``: its one-host id plus the job's shape."""
    key = json.dumps({"base": base, **parts}, sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def run_ids(inv: Inventory, size: int, addr: str, port: int, generation: str) -> dict:
    """Every stage's run id in a job over ``size`` hosts: ``extract`` is the list of shard ids."""
    base = pipeline.run_ids(inv, generation=generation)
    shards = [shard_id(base["extract"], r, size) for r in range(size)]
    train = job_id("train", base["train"], extract=shards, nodes=size, master=f"{addr}:{port}")
    return {"prepare": base["prepare"], "extract": shards, "vocab": base["vocab"], "train": train,
            "evaluate": job_id("evaluate", base["evaluate"], train=train)}


def plan_roles(inv: Inventory, name: str) -> dict[str, tuple[dict[str, dict[str, str | None]], dict[str, str]]]:
    """What ``inv pipeline --plan --cluster NAME`` checks on each host: (its run ids, keyed by
    generation as ``pipeline.plan_for`` takes them; what it does instead of running a stage). The
    first host runs prepare, vocab and evaluate, the others get copies of the first two; each host
    its own shard of the extraction; all of them the training job. A job runs the current line."""
    spec, hosts = cluster_of(inv, name)
    first = hosts[0]
    ids = run_ids(inv.for_host(first.name), len(hosts), master_addr(spec, first, inv), spec.master_port, "current")
    out = {}
    for rank, h in enumerate(hosts):
        mine = {s: (v[rank] if isinstance(v, list) else v) for s, v in ids.items()}
        instead = {}
        if rank:
            instead = {s: f"copy from {first.name}" for s, where in PLACEMENT.items() if where == "first"}
            instead["evaluate"] = f"runs on {first.name}"
            mine["evaluate"] = None
        out[h.name] = ({"current": mine}, instead)
    return out


#: how a node can end without success, the likeliest cause of a job's end first: a node lost with its
#: host (or out of reach) or stopped by someone makes its peers fail in their next collective, so
#: their failures are its consequence, whichever the workstation heard of first
_CAUSES = ("lost", "unreachable", "stopped", "failed")


def culprit(conns: list[HostConnection], finals: dict[str, dict], stopped_by_us: set[str]) -> str | None:
    """The node a failed job is named after: by ``_CAUSES``, then the one that finished first. A node
    that this job stopped itself, and that ended stopped, is not the cause; one it tried to stop that
    was already lost (or had failed) may be."""
    def key(c):
        st = finals.get(c.name) or {}
        state = st.get("state")
        return (_CAUSES.index(state) if state in _CAUSES else len(_CAUSES), st.get("finished_ts") or float("inf"))
    candidates = [c for c in conns if (finals.get(c.name) or {}).get("state") not in ("succeeded", None)
                  and not (c.name in stopped_by_us and finals[c.name].get("state") == "stopped")]
    return min(candidates, key=key).name if candidates else None


def follow_job(conns: list[HostConnection], run_id: str, inv: Inventory | None = None,
               on_line: Callable[[str, str], None] | None = None, stop_grace: float = 10.0) -> list[dict]:
    """Follow run ``run_id`` on every host at once until all end; the first that ends without success
    stops the others. Returns the final statuses in host order; raises ``HarnessError`` naming the
    host that failed first (and how) when the job did not succeed on every host."""
    masker = Masker(secret_values(inv, None))
    finals: dict[str, dict] = {}
    first_bad: list[tuple[str, str]] = []
    lock = threading.Lock()

    def one(conn: HostConnection) -> dict:
        try:
            st = runs.follow(conn, run_id, masker=masker,
                             on_line=(lambda line: on_line(conn.name, line)) if on_line else None)
        except HarnessError as e:  # the host itself went away: the run is lost to the job
            st = {"run_id": run_id, "state": "unreachable", "error": str(e)}
        with lock:
            finals[conn.name] = st
        return st

    size = len(conns)
    stopped_by_us: set[str] = set()
    with ThreadPoolExecutor(max_workers=size) as pool:
        futures = {pool.submit(one, c): c for c in conns}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                conn, st = futures[f], f.result()
                if st.get("state") != "succeeded" and not first_bad:
                    first_bad.append(conn.name)
                    for other in conns:  # a torchrun job cannot finish without every node: stop the rest
                        if other is not conn and other.name not in finals:
                            stopped_by_us.add(other.name)
                            try:
                                runs.stop(other, run_id, grace=stop_grace)
                            except HarnessError:
                                pass
    if first_bad:
        name = culprit(conns, finals, stopped_by_us) or first_bad[0]
        why = f"host {name} (node {[c.name for c in conns].index(name) + 1} of {size}) {runs.describe_failure(finals[name])}"
        others = [c.name for c in conns if c.name != name]
        raise HarnessError(f"job {run_id}: {why}; the other nodes ({', '.join(others)}) were stopped. See: "
                           f"inv runs.logs {run_id} --hosts {name}", kind="node " + finals[name].get("state", "failed"))
    return [finals[c.name] for c in conns]


def run_cluster_pipeline(conns: list[HostConnection], inv: Inventory, name: str, *, start: str | None = None,
                         stop: str | None = None, pull: bool = True, patch: bool = True,
                         dest_root: Path | None = None, say: Callable[[str], None] | None = None,
                         on_line: Callable[[str, str], None] | None = None) -> ClusterRun:
    """Run the selected stages as one job over ``conns`` (the cluster's hosts, in rank order)."""
    say = say or (lambda m: None)
    spec = inv.clusters[name]
    stages = pipeline.select_stages(start, stop)
    first, size = conns[0], len(conns)
    inv = inv.for_host(first.name)  # one job, one set of settings: the first host's
    if inv.pipeline.online:
        raise HarnessError(f"cluster {name}: pipeline.online streams hidden states on one host; a multi-host job "
                           "extracts shards and copies them (set online: false, or run on one host)")
    lines = []
    for c in conns:
        res = pipeline.ensure_patched(c, say) if patch else None
        lines.append(generations.host_generation(c, res))
    for c, line in zip(conns, lines):
        if line != "current":
            raise HarnessError(f"cluster {name}: host {c.name} has the {line} speculators line; a multi-host job "
                               "needs speculators 0.5+ (the current stack) on every host")
    addr = master_addr(spec, first.host, inv)
    ids = run_ids(inv, size, addr, spec.master_port, "current")
    graph = pipeline.contracts("current")
    for c in conns:  # every host ends up with the whole extraction: each must have room for it
        sized = pipeline.plan_for(c, inv, stages)
        if not sized.fits and sized.hidden_states["exact"]:
            raise HarnessError(f"cluster {name}: {sized.refusal()}", kind="does not fit")
    out = ClusterRun(name, [c.name for c in conns])
    needed = {d for s in stages for d in graph.reads[s] if d not in stages}
    for d in sorted(needed, key=pipeline.ORDER.index):
        where = conns if PLACEMENT[d] == "sharded" else [first]
        for rank, c in enumerate(where):
            rid = ids[d][rank] if PLACEMENT[d] == "sharded" else ids[d]
            state = runs.status(c, rid, missing_ok=True).get("state")
            if state != "succeeded":
                raise HarnessError(f"cluster {name}: --from {stages[0]} needs a successful {d} run {rid} on {c.name}, "
                                   f"but it is {state}; run: inv pipeline --cluster {name} --from {d}")

    def settings(stage: str) -> dict:
        return pipeline.stage_settings(inv, stage, "current")

    def inputs(stage: str, rank: int = 0) -> dict:
        return {d: (ids[d] if stage == "train" else ids[d][rank]) if PLACEMENT[d] == "sharded" else ids[d]
                for d in graph.reads[stage]}

    def node(rank: int) -> dict:
        return {"size": size, "rank": rank, "master_addr": addr, "master_port": spec.master_port}

    def launch(c: HostConnection, stage: str, rid: str, rank: int, follow: bool) -> StageRun:
        gpu = runner.guarded(c.host, stage, "current")
        return runner.run_stage(c, inv, stage, run_id=rid, inputs=inputs(stage, rank), gpu=gpu, follow=follow,
                                extra={"generation": "current", "pipeline": settings(stage), "cluster": node(rank)},
                                lock_wait=(c.host.service.health_timeout + 600) if gpu and c.host.service else 0,
                                pull=pull and follow and rank == 0,
                                dest=(dest_root / rid) if dest_root and follow else None,
                                on_line=(lambda line, n=c.name: on_line(n, line)) if on_line and follow else None)

    def copy(src: HostConnection, rid: str) -> None:
        got = transfer.copy_run(src, [c for c in conns if c is not src], rid)
        out.copies.append(got)
        if got.adopted:
            say(f"copied {rid} from {src.name} to {', '.join(got.adopted)} ({got.files} files, {got.bytes} bytes)")

    for stage in stages:
        where = PLACEMENT[stage]
        if where == "first":
            say(f"{stage}: run {ids[stage]} on {first.name}")
            r = launch(first, stage, ids[stage], 0, True)
            out.stages.append(r)
            if stage in ("prepare", "vocab"):
                copy(first, ids[stage])
        elif where == "sharded":
            say(f"{stage}: {size} shards, {', '.join(ids[stage])}")
            with ThreadPoolExecutor(max_workers=size) as pool:
                done = list(pool.map(lambda rc: launch(rc[1], stage, ids[stage][rc[0]], rc[0], True),
                                     enumerate(conns)))
            out.stages.extend(done)
            for rank, c in enumerate(conns):
                copy(c, ids[stage][rank])
        else:  # one torchrun job over every host
            rid = ids[stage]
            say(f"{stage}: one job {rid} over {size} hosts, rendezvous {addr}:{spec.master_port}")
            launched = [launch(c, stage, rid, rank, False) for rank, c in enumerate(conns)]
            if any(l.ran for l in launched) or any(l.status.get("state") not in runs.FINAL for l in launched):
                follow_job(conns, rid, inv, on_line)
            for rank, c in enumerate(conns):
                st = runs.status(c, rid)
                runner.check_finished(c, stage, st)
                r = StageRun(c.name, stage, rid, ran=any(l.ran for l in launched), status=st,
                             result=st.get("result") or {})
                if rank == 0 and pull:
                    res = pull_run(c, rid, dest=(dest_root / rid) if dest_root else None)
                    r.pulled, r.result = str(res.dest), res.result or {}
                out.stages.append(r)
    return out
