"""``inv pipeline --plan``: what a pipeline would do on a host and whether it fits, before anything loads.

Hidden states are what outgrows a host: EAGLE-3 stores four captured layers per token in bf16, so
Kimi-K2.5 (hidden size 7168) takes 57 KB a token and 50,000 samples of 8,192 tokens 23.5 TB. The plan
reads the facts in one round trip (remote/tools/plan.py: the target's config.json, the GPUs, the free
space under the workdir, the state of each run id) and sizes the extraction: an upper bound (samples x
max_seq_len) until prepare has run, exact from prepare's token count after it. ``inv pipeline`` makes
the same plan first and refuses an extraction that cannot fit, with the numbers and the ways out.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness import generations
from harness.connection import HostConnection
from harness.errors import HarnessError
from harness.inventory import Inventory

#: EAGLE-3 data: three layers fed to the draft plus the last one for the targets
CAPTURED_LAYERS = 4
#: bytes per stored value: bf16, or float32 where the current stages compute in it (stored_dtype)
BYTES_PER_VALUE = {"bfloat16": 2, "float16": 2, "float32": 4}


def stored_dtype(inv: Inventory, generation: str | None, gpus: list | None, native_bf16: bool) -> str:
    """The dtype extract stores hidden states in: ``pipeline.dtype`` when set; the legacy stages store
    bf16; the current ones the dtype their vLLM server computes in, float32 on a host without GPUs whose
    CPU only emulates bf16 (remote/stages/common.py's vllm_dtype), else the model's (bf16)."""
    given = getattr(inv.pipeline, "dtype", "auto") or "auto"
    if given != "auto":
        return given
    if generation == "current" and not gpus and not native_bf16:
        return "float32"
    return "bfloat16"


@dataclass
class Plan:
    """One host's plan: the data ``--plan --json`` prints and ``inv pipeline`` checks."""

    host: str
    generation: str | None
    speculators: str | None
    model: dict
    gpus: list | None
    workdir: str
    free_bytes: int
    min_free_bytes: int
    #: what extract stores the hidden states in (stored_dtype)
    dtype: str = "bfloat16"
    stages: list[dict] = field(default_factory=list)
    hidden_states: dict = field(default_factory=dict)
    verdict: str = "fits"   # fits | does not fit | unknown
    reason: str = ""
    ways_out: list[str] = field(default_factory=list)
    #: what will not stop the pipeline but deserves a look (a draft vocabulary that misses what is served)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.verdict != "does not fit"

    def as_dict(self) -> dict:
        return asdict(self) | {"fits": self.fits}

    def refusal(self) -> str:
        """The one line ``inv pipeline`` stops with."""
        return f"host {self.host}: {self.reason}; ways out: {'; '.join(self.ways_out)} (inv pipeline --plan shows the sizes)"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"


def make_plan(conn: HostConnection, inv: Inventory, stages: list[str], ids: dict[str, dict[str, str | None]],
              order: list[str], instead: dict[str, str] | None = None) -> Plan:
    """Read the host's facts and size the pipeline's ``stages`` on it (``inv`` already the host's own).
    ``ids``: each generation's run id of every stage (harness/pipeline.py's; None: not on this host),
    ``order`` the stages' order, ``instead``: what this host does in place of running a stage (in a
    multi-host job: a copy from the first host, or nothing)."""
    facts = conn.run_script("plan", {"workdir": conn.host.workdir, "model": inv.model.model_dump() if inv.model else {},
                                     "run_ids": sorted({rid for by in ids.values() for rid in by.values() if rid})})
    version = facts.get("speculators")
    try:
        generation = generations.generation_of(version, conn.name) if version else None
    except HarnessError:
        generation = None
    p = Plan(host=conn.name, generation=generation, speculators=version, model=facts["model"], gpus=facts["gpus"],
             workdir=facts["disk"]["path"], free_bytes=int(facts["disk"]["free_bytes"]),
             min_free_bytes=int(conn.host.min_free_gb * 2**30),
             dtype=stored_dtype(inv, generation, facts["gpus"], bool(facts.get("native_bf16"))))
    by_id = ids.get(generation, {}) if generation else {}
    runs = facts["runs"]
    for stage in order:
        rid = by_id.get(stage)
        state = runs.get(rid, {}).get("state") if rid else None
        selected = stage in stages
        todo = (instead or {}).get(stage, "run")
        action = ("skip: succeeded before" if state == "succeeded" else todo) if selected else "not selected"
        p.stages.append({"stage": stage, "run_id": rid, "state": state, "action": action})
    _size(p, inv, runs.get(by_id.get("prepare")) or {}, extract_runs=any(
        s["stage"] == "extract" and s["action"] == "run" for s in p.stages))
    p.warnings += coverage_warnings(inv, runs.get(by_id.get("vocab")) or {})
    return p


def coverage_warnings(inv: Inventory, vocab: dict) -> list[str]:
    """The held-out prompts' coverage by the draft vocabulary, once a vocab run with these settings has
    counted it: each category below ``pipeline.coverage_warning``, naming the setting to raise."""
    settings = inv.pipeline
    floor = getattr(settings, "coverage_warning", 0.0)
    return [f"the draft vocabulary ({settings.draft_vocab_size} tokens) holds {share:.1%} of the held-out {name} "
            f"prompts' tokens (< pipeline.coverage_warning {floor}): raise pipeline.draft_vocab_size, or give "
            "pipeline.dataset more such prompts" for name, share in (vocab.get("heldout_coverage") or {}).items()
            if share < floor]


def _size(p: Plan, inv: Inventory, prepare: dict, extract_runs: bool) -> None:
    settings = inv.pipeline
    online = bool(getattr(settings, "online", False)) and p.generation != "legacy"
    shape = p.model
    hidden = shape.get("hidden_size")
    exact = prepare.get("state") == "succeeded" and isinstance(prepare.get("tokens"), int)
    tokens = prepare["tokens"] if exact else settings.samples * settings.max_seq_len
    width = BYTES_PER_VALUE.get(p.dtype, 2)
    per_token = CAPTURED_LAYERS * hidden * width if isinstance(hidden, int) else None
    total = tokens * per_token if per_token else None
    p.hidden_states = {"tokens": tokens, "exact": exact,
                       "basis": "prepare's token count" if exact else
                                f"upper bound: {settings.samples} samples x max_seq_len {settings.max_seq_len}",
                       "layers": CAPTURED_LAYERS, "dtype": p.dtype, "bytes_per_token": per_token, "bytes": total,
                       "stored": extract_runs and not online, "online": online}
    if not p.generation:
        p.reason = (f"speculators {p.speculators} is outside the lines the harness drives" if p.speculators
                    else "speculators is not installed for the host's python (inv setup)")
    if not extract_runs:
        p.verdict = "fits" if p.generation else "unknown"
        p.reason = p.reason or ("extract does not run: nothing new to store")
        return
    if online:
        p.reason = p.reason or "pipeline.online: hidden states stream to the trainer, none stored"
        p.verdict = "fits" if p.generation else "unknown"
        return
    if total is None:
        p.verdict, p.reason = "unknown", f"the target's shape is unknown: {shape.get('error')}"
        return
    room = p.free_bytes - p.min_free_bytes
    if total <= room:
        p.verdict = "fits" if p.generation else "unknown"
        p.reason = p.reason or (f"hidden states {human_bytes(total)} of {human_bytes(p.free_bytes)} free under "
                                f"{p.workdir}")
        return
    p.verdict = "does not fit"
    p.reason = (f"the hidden states need {human_bytes(total)} ({tokens:,} tokens x {CAPTURED_LAYERS} layers x "
                f"hidden {hidden} x {width} bytes ({p.dtype}), {p.hidden_states['basis']}) but {p.workdir} has "
                f"{human_bytes(p.free_bytes)} free")
    per_sample = (tokens / max(prepare.get("samples") or settings.samples, 1)) * per_token
    most = max(int(room // per_sample), 0)
    if p.generation != "legacy":
        p.ways_out.append("train online: pipeline.online: true (vLLM streams the states to the trainer, none stored)")
    p.ways_out.append(f"fewer samples: pipeline.samples {most:,} or less fit" if most else
                      "fewer samples: not even one fits the free space")
    p.ways_out.append(f"another workdir: hosts.{p.host}.workdir on a filesystem with {human_bytes(total + p.min_free_bytes)} free")
