"""Stage train (speculators 0.5+): an EAGLE-3 draft with ``speculators train`` (its CLI, model, data and Trainer).

Reads prepare's ``dataset/`` (the Arrow rows), extract's ``hidden_states/`` and ``extract.json`` (the
layer ids) and vocab's ``d2t.npy`` / ``t2d.npy``, and gives them to speculators' own training command,
read by speculators' own config resolver (``TrainConfig.resolve``), so every flag is the documented one:
``--speculator-type eagle3``, ``--data-path`` the dataset, ``--hidden-states-path`` the extracted files,
``--target-layer-ids`` as extracted, ``pipeline.draft_layers`` decoder layers (with
``pipeline.draft_intermediate_size`` a narrower MLP: the decoder config speculators would build, narrowed,
given as ``--draft-config``), ``pipeline.ttt_steps``
test-time-training steps (speculators 0.9 feeds steps > 0 the verified token, and the checkpoint
proposes that many tokens), ``pipeline.train_seq_len`` tokens per packed batch, ``pipeline.epochs``,
``pipeline.lr`` with ``pipeline.optimizer`` and ``pipeline.scheduler``, and ``1 - pipeline.val_fraction`` of the samples for
training (the rest for its validation pass).

Devices: one process on the CPU or a GPU, in this process (its metrics logged on ``speculators.metrics``
become metrics.json and loss.png); with ``pipeline.gpus`` > 1, ``torchrun -m speculators.train`` with the
same arguments. On a CPU host the 0.9.0 patch series must be applied (its Trainer assumes an
accelerator), attention is ``sdpa`` (FlexAttention has no CPU backward) and the loss the eager one
(the fused loss is a Triton GPU kernel): ``pipeline.draft_attn_impl`` auto picks these.

Online (``pipeline.online``; extract then stores nothing): the stage starts a vLLM server for the target
with the extract configs and gives speculators its endpoint (``--vllm-endpoint``, ``--on-missing
generate``): each sample's hidden states are generated when the loader reads it, loaded, and discarded,
so no hidden state is ever kept on disk (the stage checks that none is left).

Resumable: speculators writes a checkpoint per epoch under ``checkpoints/`` and resumes from the last
one when the run is started again.

Outputs: ``checkpoint/`` (config.json + model.safetensors of the last epoch: what vLLM serves as an
EAGLE-3 draft and speculators' ``from_pretrained`` reads), ``metrics.json``, ``loss.png``.
"""
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys

from stages import common
from stages.lib.trainlog import MetricsTap, plot

STAGE = "train"
READS = ("prepare", "extract", "vocab")  # prepare's dataset/, extract's hidden_states/, vocab's d2t/t2d
GPU = True                   # trains on the GPUs (torchrun over pipeline.gpus)
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "draft_layers": 1,             # decoder layers of the draft
    "draft_intermediate_size": None,  # the draft's MLP width; unset: the target's
    "epochs": 1,                   # passes over the training samples
    "lr": 1e-4,                    # the learning rate (after pipeline.scheduler's warm-up)
    "scheduler": "linear",         # the learning-rate schedule: linear, cosine or none (speculators' three)
    "optimizer": "adamw",          # adamw or muon (speculators' two)
    "train_seq_len": 2048,         # tokens per packed batch
    "val_fraction": 0.1,           # samples held out for the trainer's validation pass
    "ttt_steps": 3,                # test-time-training steps (the tokens the checkpoint proposes)
    "ttt_step_loss_decay": 1.0,    # TTT step s's loss weighs decay ** s
    "seed": 0,                     # initialisation, packing, the train/validation split
    "gpus": 1,                     # GPUs for training: > 1 runs speculators' trainer under torchrun
    "draft_attn_impl": "auto",     # the draft's attention: auto (sdpa on CPU, simple_flex_attention on GPUs)
    "online": False,               # hidden states from a live vLLM extract server, never stored (extract skipped)
    "max_seq_len": 512,            # online: the extract server's max_model_len is this + 1
    "tensor_parallel": 1,          # online: GPUs the target is split over
    "gpu_memory_utilization": 0.8,  # online: the fraction of each GPU's memory vLLM may take
}


def draft_config(spec: dict, cfg: common.Settings, path) -> None:
    """The draft decoder's config as speculators builds it from the verifier (its own
    ``create_transformer_layer_config`` with its flags' defaults: what ``--num-layers`` alone gives), with
    the MLP narrowed to ``pipeline.draft_intermediate_size``; written to ``path`` for ``--draft-config``."""
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config.schema import DraftArgs

    defaults = DraftArgs()
    config = create_transformer_layer_config(
        verifier_name_or_path=common.model_dir(spec), num_layers=cfg.draft_layers, draft_arch=defaults.draft_arch or "llama",
        hidden_act=defaults.draft_hidden_act or None, sliding_window=defaults.sliding_window,
        full_attention_indices=defaults.full_attention_indices, mrope_full_head_hack=defaults.draft_mrope_full_head_hack,
        trust_remote_code=bool(spec["model"].get("trust_remote_code")))
    config.intermediate_size = int(cfg.draft_intermediate_size)
    path.write_text(config.to_json_string())


def train_args(spec: dict, cfg: common.Settings, save_path: str, on_gpu: bool, hidden_states: str,
               draft_config_path: str | None = None) -> list[str]:
    """speculators' own training flags for this run."""
    extracted, vocab = common.input_dir(spec, "extract"), common.input_dir(spec, "vocab")
    prepared = common.input_dir(spec, "prepare")
    meta = json.loads((extracted / "extract.json").read_text())
    import numpy as np

    draft_vocab = int(np.load(vocab / "d2t.npy").shape[0])
    attn = cfg.draft_attn_impl if cfg.draft_attn_impl != "auto" else ("simple_flex_attention" if on_gpu else "sdpa")
    args = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", common.model_dir(spec),
        "--data-path", str(prepared / "dataset"),
        "--hidden-states-path", hidden_states,
        "--target-layer-ids", *[str(i) for i in meta["target_layer_ids"]],
        "--draft-vocab-size", str(draft_vocab),
        "--d2t-path", str(vocab / "d2t.npy"), "--t2d-path", str(vocab / "t2d.npy"),
        *(["--draft-config", draft_config_path] if draft_config_path else ["--num-layers", str(cfg.draft_layers)]),
        "--ttt-steps", str(cfg.ttt_steps), "--ttt-step-loss-decay", str(cfg.ttt_step_loss_decay),
        "--total-seq-len", str(cfg.train_seq_len),
        "--train-data-ratio", str(1.0 - cfg.val_fraction),
        "--epochs", str(cfg.epochs), "--lr", str(cfg.lr), "--optimizer", cfg.optimizer,
        "--scheduler-type", cfg.scheduler,
        "--seed", str(cfg.seed),
        "--draft-attn-impl", attn,
        "--save-path", save_path,
    ]
    if not on_gpu:  # the fused loss is a Triton GPU kernel; data loader workers only compete for the cores
        args += ["--loss-implementation", "eager", "--num-workers", "0"]
    if spec["model"].get("trust_remote_code"):
        args.append("--trust-remote-code")
    return args


def run_training(args: list[str], cfg: common.Settings, on_gpu: bool) -> MetricsTap:
    """``speculators train`` with ``args``: in this process (its metrics tapped), or under torchrun."""
    tap = MetricsTap(0)
    if on_gpu and cfg.gpus > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.gpus}",
               "-m", "speculators.train", *args]
        if subprocess.run(cmd).returncode != 0:
            common.fail(STAGE, f"torchrun over {cfg.gpus} GPUs failed; its error is in the log above")
        return tap
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    # speculators' own logging setup replaces the handlers of its loggers (dictConfig) and gives the
    # root logger a rich console handler only when it has none: so the tap, and a plain handler for
    # the other log lines, go on the root logger first (the metric dicts propagate up to it)
    root = logging.getLogger()
    lines = logging.StreamHandler(sys.stdout)
    lines.addFilter(lambda record: not record.name.startswith("speculators.metrics"))
    root.setLevel(logging.INFO)
    for handler in (tap, lines):
        root.addHandler(handler)
    try:
        speculators_train(TrainConfig.resolve(args))
    finally:
        for handler in (tap, lines):
            root.removeHandler(handler)
    return tap


def main(spec: dict) -> dict:
    cfg = common.settings(spec, SETTINGS)
    timer = common.Timer()
    dev = common.device(cfg)
    on_gpu = dev.startswith("cuda")
    out = common.artifacts(spec)
    save_path = str(out / "checkpoints")  # one directory per epoch; a rerun resumes from the last
    extracted = common.input_dir(spec, "extract")
    if cfg.online:  # an empty directory: every sample is missing, so the loader asks the server for it
        hidden_states = out / "online"
        shutil.rmtree(hidden_states, ignore_errors=True)
        hidden_states.mkdir()
    else:
        hidden_states = extracted / "hidden_states"
    config_path = None
    if cfg.draft_intermediate_size:
        config_path = out / "draft_config.json"
        draft_config(spec, cfg, config_path)
    args = train_args(spec, cfg, save_path, on_gpu, str(hidden_states), config_path and str(config_path))
    with contextlib.ExitStack() as stack:
        if cfg.online:
            from stages.lib.vllm_server import VllmServer, extract_configs

            captured = json.loads((extracted / "extract.json").read_text())["captured_layer_ids"]
            server = stack.enter_context(VllmServer(
                STAGE, common.model_dir(spec), log_path=out / "server.log", max_model_len=cfg.max_seq_len + 1,
                tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization,
                trust_remote_code=bool(spec["model"].get("trust_remote_code")),
                extra_args=extract_configs(captured, out / ".staging")))
            # speculators' online mode: a missing sample is generated through the endpoint, loaded, discarded
            args += ["--vllm-endpoint", f"{server.url}/v1", "--on-missing", "generate"]
        common.log("speculators train " + " ".join(args))
        tap = run_training(args, cfg, on_gpu)
    if cfg.online:
        left = [*hidden_states.glob("*.safetensors"), *(out / ".staging").glob("**/*.safetensors")]
        if left:
            common.fail(STAGE, f"online training left {len(left)} hidden-state files behind ({left[0]}); "
                               "speculators discards each once loaded")

    epochs = sorted((p for p in os.scandir(save_path) if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        common.fail(STAGE, f"speculators train wrote no checkpoint under {save_path}; see the log above")
    final = epochs[-1].path
    checkpoint = out / "checkpoint"
    shutil.rmtree(checkpoint, ignore_errors=True)
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(os.path.join(final, name), checkpoint / name)

    last = tap.train[-1] if tap.train else {}
    val = tap.val[-1] if tap.val else {}
    common.write_json(out / "metrics.json", {"train": tap.train, "val": tap.val, "config": {
        "epochs": cfg.epochs, "ttt_steps": cfg.ttt_steps, "ttt_step_loss_decay": cfg.ttt_step_loss_decay,
        "lr": cfg.lr, "optimizer": cfg.optimizer, "scheduler": cfg.scheduler,
        "draft_intermediate_size": cfg.draft_intermediate_size, "online": cfg.online, "args": args}})
    if tap.train:
        plot(tap, out / "loss.png")
    return {"epochs": cfg.epochs, "steps": len(tap.train), "loss": last.get("loss"),
            "full_acc_0": last.get("full_acc_0"), "val_loss": val.get("loss_epoch"),
            "val_full_acc_0": val.get("full_acc_0_epoch"), "val_full_acc_1": val.get("full_acc_1_epoch"),
            "val_full_acc_2": val.get("full_acc_2_epoch"), "seconds": timer(),
            # per-epoch checkpoints with optimizer states: large, not part of the model
            "intermediates": ["checkpoints/*"]}


if __name__ == "__main__":
    common.cli(main)
