"""inv pipeline: patch if needed, then prepare -> extract -> vocab -> train -> evaluate on each host,
skipping every stage whose inputs hash to those of its last successful run."""
from invoke import task

from tasks._cli import (COMMON_HELP, LiveView, clean_errors, console, emit_json, escape, finish, load, print_wide)


@task(iterable=["compare"], help=COMMON_HELP | {"from": "first stage to run (earlier ones must have succeeded before)",
                          "to": "last stage to run", "no_pull": "leave the artifacts on the host",
                          "no_patch": "do not apply the patch set first",
                          "plan": "change nothing: per host, the stages that would run, the target's shape, the "
                                  "hidden states' size against the free space, the GPUs, a verdict (exit 1: "
                                  "does not fit)",
                          "compare": "SETTING=A,B[,...]: the pipeline once per value of one pipeline setting; or "
                                     "once per --compare, each 'SETTING=V [SETTING=V ...]' (variants that differ in "
                                     "several settings). The stages they share run once; one table of the drafts side by side: "
                                     "acceptance per position and category, tokens/s with and without, training "
                                     "time, checkpoint size (also --json, and a plot); inv deploy --best takes the "
                                     "fastest",
                          "cluster": "run one job over the inventory's cluster NAME (clusters: in inventory.yaml): "
                                     "extraction sharded over its hosts, training as one torchrun job",
                          "verbose": "print every line of the stages' logs as it comes (by default: one live row per "
                                     "host, each finished stage one line; the logs stay in the runs, inv runs.logs)"})
@clean_errors
def pipeline(c, inventory=None, hosts=None, json=False, from_=None, to=None, no_pull=False, no_patch=False,
             plan=False, cluster=None, verbose=False, compare=None):
    """Patch if needed, then prepare -> extract -> vocab -> train -> evaluate, skipping unchanged stages."""
    from harness import pipeline as _pipeline
    from harness.errors import HarnessError
    from harness.parallel import on_hosts, with_connection

    inv, selected = load(inventory, hosts)
    stages = _pipeline.select_stages(from_, to)  # bad stage names fail before any connection
    if cluster is not None:
        from harness.cluster import cluster_of

        if hosts:
            raise HarnessError("--cluster and --hosts: a cluster names its own hosts; give one of the two")
        _, selected = cluster_of(inv, cluster)
        if not plan:
            return run_cluster(inv, cluster, from_, to, not no_pull, not no_patch, json, verbose)
    if plan:
        return show_plans(inv, selected, stages, json, cluster)
    if compare:
        if from_ or to:
            raise HarnessError("--compare runs each variant's whole pipeline: give no --from or --to with it")
        return run_compare(inv, selected, compare, not no_pull, not no_patch, json, verbose)

    with LiveView([h.name for h in selected], verbose=verbose, show=not json) as view:
        def one(conn):
            return _pipeline.run_pipeline(conn, inv, start=from_, stop=to, pull=not no_pull, patch=not no_patch,
                                          say=lambda m: view.say(conn.name, m), on_line=view.for_host(conn.name),
                                          on_stage=stage_lines(view, conn.name))

        results = on_hosts(selected, with_connection(inv, one))
    if json:
        emit_json(results.to_json(lambda runs: [r.as_dict() for r in runs]))
    else:
        for name, runs in results.succeeded.items():
            print_wide(summary_table(name, runs))
            for table in category_tables(runs):
                print_wide(table)
            plots = pictures(runs)
            if plots:
                console("err").print(f"[bold cyan]\\[{escape(name)}][/] pictures: " + "  ".join(escape(p) for p in plots))
    finish(results)


def run_compare(inv, selected, spec, pull, patch, json, verbose):
    """``--compare``: each host's variants, then one table (and plot) per host."""
    from harness import compare as _compare
    from harness.parallel import on_hosts, with_connection

    variants = _compare.parse_variants(spec)
    for h in selected:  # every value checked against its setting before any connection
        for variant in variants:
            _compare.variant_inventory(inv, h.name, variant)
    with LiveView([h.name for h in selected], verbose=verbose, show=not json) as view:
        def one(conn):
            return _compare.run_comparison(conn, inv, variants, pull=pull, patch=patch,
                                           say=lambda m: view.say(conn.name, m), on_line=view.for_host(conn.name),
                                           on_stage=stage_lines(view, conn.name))

        results = on_hosts(selected, with_connection(inv, one))
    if json:
        emit_json(results.to_json(lambda comparison: comparison))
    else:
        for comparison in results.succeeded.values():
            print_wide(comparison_table(comparison))
    finish(results)


def comparison_table(comparison: dict):
    """One row a variant: what it costs to train, how often vLLM accepts its tokens, how fast it serves."""
    from rich.table import Table

    shared = ", ".join(f"{s} {rid}" for s, rid in comparison["shared"].items()) or "none"
    t = Table(title=f"{comparison['host']}: pipeline.{comparison['setting']} compared (shared runs: {shared})",
              title_justify="left", header_style="bold",
              caption=f"saved: {comparison['saved']}; plot: {comparison['plot']}" if comparison.get("plot") else None,
              caption_justify="left")
    for col in ("variant", "acceptance", "per position", "per category", "tokens/s", "without", "speedup",
                "train", "checkpoint", "train run"):
        t.add_column(col, justify="left" if col in ("variant", "per position", "per category", "train run") else "right")
    for r in comparison["variants"]:
        per = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"] or [])
        cats = " ".join(f"{c} {v['acceptance_length']:.2f}" for c, v in r["categories"].items()
                        if v.get("acceptance_length") is not None)
        fast = "*" if r["variant"] == comparison.get("fastest") else ""
        t.add_row(escape(r["variant"]) + fast, f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "",
                  per, escape(cats), str(r["tokens_per_s"] or ""), str(r["tokens_per_s_without"] or ""),
                  f"{r['speedup']:.2f}x" if r["speedup"] else "", f"{r['train_seconds']:.0f}s",
                  f"{r['checkpoint_bytes'] / 2**20:.1f} MiB" if r["checkpoint_bytes"] else "", r["train_run"] or "")
    return t


def stage_lines(view, host: str):
    """The pipeline's ``on_stage`` for a LiveView: a stage's row starts with it, and ends as one line:
    how it ended, how long it took, its run id."""
    def on_stage(stage: str, rid: str, out) -> None:
        if out is None:
            view.begin(host, stage, f"run {rid}")
        elif not out.ran:
            view.end(host, f"{stage:<9} skipped: inputs unchanged since run {rid}", "dim")
        else:
            m, sec = divmod(int(round(out.seconds)), 60)
            view.end(host, f"{stage:<9} done in {m}:{sec:02d}  run {rid}" + (f", pulled to {out.pulled}" if out.pulled else ""),
                     "green")
    return on_stage


def pictures(runs) -> list[str]:
    """The plots the pulled runs hold (loss, acceptance per category): where a person would rather look."""
    from pathlib import Path

    return [str(p) for o in runs if o.pulled for p in sorted(Path(o.pulled).glob("*.png"))]


def run_cluster(inv, name, start, stop, pull, patch, json, verbose=False):
    """``--cluster``: one job over the cluster's hosts (harness/cluster.py), its stages in one table."""
    import contextlib

    from harness.cluster import cluster_of, run_cluster_pipeline
    from harness.connection import open_host

    _, hosts = cluster_of(inv, name)
    with contextlib.ExitStack() as stack:
        view = stack.enter_context(LiveView([h.name for h in hosts], verbose=verbose, show=not json))
        conns = [stack.enter_context(open_host(h, inv)) for h in hosts]
        job = run_cluster_pipeline(conns, inv, name, start=start, stop=stop, pull=pull, patch=patch,
                                   say=lambda m: view.say(name, m), on_line=view.line)
    if json:
        emit_json(job.as_dict())
    else:
        print_wide(summary_table(f"cluster {name} ({', '.join(job.hosts)})", job.stages))


def summary_table(host: str, runs):
    """Per stage: time, samples, tokens, loss, acceptance length, where the artifacts are."""
    from rich.table import Table

    t = Table(title=f"pipeline on {host}", title_justify="left", header_style="bold")
    many = len({o.host for o in runs}) > 1
    for col in ("stage", *(("host",) if many else ()), "run", "state", "time", "samples", "tokens", "loss",
                "acceptance", "artifacts"):
        t.add_column(col, justify="right" if col in ("time", "samples", "tokens", "loss", "acceptance") else "left")
    for o in runs:
        r = o.result
        loss = r.get("loss", r.get("final_loss"))
        acc = r.get("acceptance_length")
        t.add_row(o.stage, *((o.host,) if many else ()), o.run_id, o.state, f"{o.seconds:.1f}s",
                  str(r.get("samples", "")), str(r.get("tokens", "")),
                  f"{loss:.3f}" if isinstance(loss, (int, float)) else "",
                  f"{acc:.2f}" if isinstance(acc, (int, float)) else "", o.pulled or "")
    return t


def category_tables(runs):
    """evaluate's figures per category of prompts (held-out, and the eval sets never trained on), with
    the plot it pulled."""
    from rich.table import Table

    for o in runs:
        rows = o.result.get("categories") if o.stage == "evaluate" else None
        if not rows:
            continue
        plot = f"; plot: {o.pulled}/categories.png" if o.pulled else ""
        t = Table(title=f"evaluate {o.run_id}: per category (k = {o.result.get('k')}){plot}", title_justify="left",
                  header_style="bold")
        for col in ("category", "kind", "prompts", "acceptance", "per position", "vocab coverage", "tokens/s",
                    "without draft", "speedup"):
            t.add_column(col, justify="left" if col in ("category", "kind", "per position") else "right")
        for r in rows:
            acc = r.get("acceptance_length")
            t.add_row(r["category"], r.get("kind", ""), str(r.get("prompts", "")), f"{acc:.2f}" if acc else "",
                      " ".join(f"{x:.2f}" for x in r.get("acceptance_rate_per_position") or []),
                      f"{r['vocab_coverage']:.1%}" if "vocab_coverage" in r else "",
                      f"{r['tokens_per_s']:.1f}" if r.get("tokens_per_s") else "",
                      f"{r['tokens_per_s_without']:.1f}" if r.get("tokens_per_s_without") else "",
                      f"{r['speedup']:.2f}x" if r.get("speedup") else "")
        yield t


def show_plans(inv, selected, stages, json, cluster=None):
    """``--plan``: each host's plan (harness/plan.py), a table or JSON; exit 1 when one does not fit.
    With a cluster, each host's part in the job: its run ids, what it runs and what it gets copied."""
    from invoke.exceptions import Exit

    from harness import pipeline as _pipeline
    from harness.parallel import on_hosts, with_connection

    roles = {}
    if cluster is not None:
        from harness.cluster import plan_roles

        roles = plan_roles(inv, cluster)
        job_inv = inv.for_host(selected[0].name)  # one job, one set of settings: the first host's

    def one(conn):
        if conn.name in roles:
            ids, instead = roles[conn.name]
            return _pipeline.plan_for(conn, job_inv, stages, ids, instead)
        return _pipeline.plan_for(conn, inv.for_host(conn.name), stages)

    results = on_hosts(selected, with_connection(inv, one))
    if json:
        emit_json(results.to_json(lambda p: p.as_dict()))
    else:
        for p in results.succeeded.values():
            print_wide(plan_table(p))
    finish(results)
    misfits = [p for p in results.succeeded.values() if not p.fits]
    if misfits:
        raise Exit("\n".join(f"error: {p.refusal()}" for p in misfits), code=1)


def plan_table(p):
    from rich.table import Table

    from harness.plan import human_bytes
    from tasks._cli import escape

    t = Table(title=f"plan for {p.host}", title_justify="left", header_style="bold", show_header=False)
    t.add_column("what")
    t.add_column("value")
    m = p.model
    shape = (f"{m.get('num_hidden_layers')} layers, hidden {m.get('hidden_size')}, vocabulary {m.get('vocab_size')}"
             + (f" (its {m['text_config']})" if m.get("text_config") else "")) if not m.get("error") else m["error"]
    t.add_row("target", escape(f"{shape}\n{m.get('source') or ''}"))
    t.add_row("speculators", f"{p.speculators or 'not installed'} ({p.generation or 'no stages'})")
    gpus = p.gpus
    t.add_row("GPUs", "no GPU (nvidia-smi not found)" if gpus is None else
              f"{len(gpus)} x {gpus[0]['name']}" if gpus else "none")
    for s in p.stages:
        t.add_row(f"stage {s['stage']}", f"{s['action']}  {s['run_id'] or ''}")
    hs = p.hidden_states
    size = human_bytes(hs["bytes"]) if hs.get("bytes") is not None else "unknown"
    t.add_row("hidden states", f"{size} ({hs['tokens']:,} tokens, {hs['basis']})"
              + ("" if hs.get("stored") else ", not stored by this run"))
    t.add_row("free", escape(f"{human_bytes(p.free_bytes)} under {p.workdir}"))
    colour = {"fits": "green", "does not fit": "red"}.get(p.verdict, "yellow")
    t.add_row("verdict", f"[{colour}]{p.verdict}[/]: {escape(p.reason)}")
    for w in p.ways_out:
        t.add_row("way out", escape(w))
    for w in p.warnings:
        t.add_row("[yellow]warning[/]", escape(w))
    return t
