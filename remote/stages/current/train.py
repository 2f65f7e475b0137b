"""Stage train (speculators 0.5+): a draft with ``speculators train`` (its CLI, model, data and Trainer).

Reads prepare's ``dataset/`` (the Arrow rows), extract's ``hidden_states/`` and ``extract.json`` (the
layer ids) and vocab's ``d2t.npy`` / ``t2d.npy``, and gives them to speculators' own training command,
read by speculators' own config resolver (``TrainConfig.resolve``), so every flag is the documented one:
``--speculator-type`` ``pipeline.speculator`` (eagle3 by default; dflash and the others speculators trains,
each refused in one line before anything loads where this host's vLLM could not serve it:
stages/lib/drafttypes.py), ``--data-path`` the dataset, ``--hidden-states-path`` the extracted files,
``--target-layer-ids`` as extracted, ``pipeline.draft_layers`` decoder layers (with
``pipeline.draft_intermediate_size`` a narrower MLP: the decoder config speculators would build, narrowed,
given as ``--draft-config``), ``pipeline.ttt_steps``
test-time-training steps (speculators 0.9 feeds steps > 0 the verified token, and the checkpoint
proposes that many tokens), ``pipeline.train_seq_len`` tokens per packed batch, ``pipeline.epochs``,
``pipeline.lr`` with ``pipeline.optimizer`` and ``pipeline.scheduler``, and ``1 - pipeline.val_fraction`` of the samples for
training (the rest for its validation pass). ``pipeline.loss_tokens`` all trains on every position, the
prompts' too, rather than speculators' mask of the replies (``every_position_dataset``); the validation
pass then scores every position as well.

Devices: one process on the CPU or a GPU, in this process (its metrics logged on ``speculators.metrics``
become metrics.json and loss.png); with ``pipeline.gpus`` > 1, or on several hosts as one job
(``spec.cluster``, set by harness/cluster.py), torchrun runs the same trainer on every rank
(stages/lib/trainworker.py, whose rank 0 hands back the metrics): ``--nnodes`` hosts, this one's
``--node-rank``, rendezvous on the first host's ``master_addr:master_port``; NCCL between GPUs, gloo
between CPU nodes. Only the first host writes the checkpoint; a multi-host job reads the hidden states
of every extraction shard (each copied to every node), through one directory of links to them. On a CPU host the 0.9.0 patch series must be applied (its Trainer assumes an
accelerator), attention is ``sdpa`` (FlexAttention has no CPU backward) and the loss the eager one
(the fused loss is a Triton GPU kernel): ``pipeline.draft_attn_impl`` auto picks these. On a CPU without
native bf16 the trainer computes in float32 (``--hidden-states-dtype``; ``pipeline.dtype``, see
common.vllm_dtype), about twice as fast there as its emulated bf16 autocast.

Online (``pipeline.online``; extract then stores nothing): the stage starts a vLLM server for the target
with the extract configs and gives speculators its endpoint (``--vllm-endpoint``, ``--on-missing
generate``): each sample's hidden states are generated when the loader reads it, loaded, and discarded,
so no hidden state is ever kept on disk (the stage checks that none is left).

Resumable: speculators writes a checkpoint per epoch under ``checkpoints/`` and resumes from the last
one when the run is started again (on one host; a multi-host job starts over, since only its first
host holds checkpoints and every rank must resume from the same epoch).

Metrics where ML engineers look: ``pipeline.logger`` is speculators' own ``--logger`` (TensorBoard by
default; W&B, MLflow, Trackio, or several), its TensorBoard event files written under the artifacts'
``tensorboard/<run-id>/``, so they come back with the run and ``tensorboard --logdir runs/`` shows every
training run side by side. A logger's credentials come by name through the inventory's ``secrets:``.

Outputs: ``checkpoint/`` (config.json + model.safetensors of the last epoch: what vLLM serves as an
EAGLE-3 draft and speculators' ``from_pretrained`` reads), ``metrics.json``, ``loss.png``,
``tensorboard/`` (the event files).
"""
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from stages import common
from stages.lib import drafttypes
from stages.lib.trainlog import MetricsTap, plot
from stages.lib.trainworker import train_tapped

STAGE = "train"
READS = ("prepare", "extract", "vocab")  # prepare's dataset/, extract's hidden_states/, vocab's d2t/t2d
GPU = True                   # trains on the GPUs (torchrun over pipeline.gpus)
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "speculator": "eagle3",        # speculators' --speculator-type: eagle3, dflash, ... (stages/lib/drafttypes.py)
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
    "block_size": None,            # DFlash family: an anchor and the tokens it drafts at once; unset: ttt_steps + 1
    "max_anchors": None,           # DFlash family and P-EAGLE: anchor positions per batch; unset: speculators' (512)
    "loss_tokens": "assistant",    # positions trained on: assistant (speculators' loss mask: the replies) or all
    "loss_fn": None,               # speculators' --loss-fn (kl_div, tv, nla, lk_hybrid, ce, a JSON blend); unset: its own (kl_div)
    "seed": 0,                     # initialisation, packing, the train/validation split
    "gpus": 1,                     # GPUs for training: > 1 runs speculators' trainer under torchrun
    "draft_attn_impl": "auto",     # the draft's attention: auto (sdpa on CPU, simple_flex_attention on GPUs)
    "logger": "tensorboard",       # speculators' --logger: tensorboard, wandb, mlflow, trackio, a comma list, or ""
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
        verifier_name_or_path=common.model_dir(spec), num_layers=cfg.draft_layers,
        draft_arch=defaults.draft_arch or drafttypes.draft_arch(cfg.speculator),
        hidden_act=defaults.draft_hidden_act or None, sliding_window=defaults.sliding_window,
        full_attention_indices=defaults.full_attention_indices, mrope_full_head_hack=defaults.draft_mrope_full_head_hack,
        trust_remote_code=bool(spec["model"].get("trust_remote_code")))
    config.intermediate_size = int(cfg.draft_intermediate_size)
    path.write_text(config.to_json_string())


#: each of speculators' metric loggers: the package it imports, and the variables that must hold its
#: credentials on the host (the inventory's ``secrets:`` bring them from the workstation's environment)
LOGGERS = {"tensorboard": ("tensorboard", ()), "wandb": ("wandb", ("WANDB_API_KEY",)),
           "mlflow": ("mlflow", ()), "trackio": ("trackio", ())}


def check_loggers(value: str) -> None:
    """``pipeline.logger`` before anything loads: each name one speculators knows, its package installed
    here, its credentials in this environment (a logger that asks for them would wait on a prompt no one
    sees, in a detached stage)."""
    import importlib.util

    for name in filter(None, (part.strip() for part in value.split(","))):
        if name not in LOGGERS:
            common.fail(STAGE, f"pipeline.logger {name!r} is not one of speculators' loggers "
                               f"({', '.join(LOGGERS)}); fix pipeline.logger")
        package, credentials = LOGGERS[name]
        if importlib.util.find_spec(package) is None:
            common.fail(STAGE, f"pipeline.logger {name}: the {package} package is not installed on this host; "
                               f"add {package} to the host's requirements (inv setup) or drop it from pipeline.logger")
        missing = [v for v in credentials if not os.environ.get(v)]
        if missing:
            common.fail(STAGE, f"pipeline.logger {name}: {missing[0]} is not set on the host; name it in the "
                               "inventory's secrets: (its value comes from your shell, never stored there)")


def extraction(spec: dict) -> tuple[dict, list[Path]]:
    """extract.json and the hidden-state directories: one run's, or every shard's of a multi-host
    extraction, checked to be shards of one extraction that together hold every sample."""
    dirs = common.input_dirs(spec, "extract")
    metas = [json.loads((d / "extract.json").read_text()) for d in dirs]
    meta = metas[0]
    if len(dirs) > 1:
        for d, m in zip(dirs, metas):
            if m["captured_layer_ids"] != meta["captured_layer_ids"] or m.get("online"):
                common.fail(STAGE, f"extraction shard {d.parent.name} captured layers {m['captured_layer_ids']}, "
                                   f"{dirs[0].parent.name} {meta['captured_layer_ids']}: not shards of one extraction")
        have = sorted(i for m in metas for i in range(m["shard"]["first"] or 0, m["shard"]["end"] or 0))
        want = list(range(meta.get("dataset_samples", len(have))))
        if have != want:
            missing = sorted(set(want) - set(have))
            common.fail(STAGE, f"the extraction shards hold {len(have)} samples of {len(want)}"
                               + (f" (sample {missing[0]} is in none)" if missing else " (some twice)")
                               + "; run the multi-host job again with every host")
        meta = {**meta, "samples": len(want), "tokens": sum(m["tokens"] for m in metas)}
    return meta, [d / "hidden_states" for d in dirs]


def linked_hidden_states(dirs: list[Path], where: Path) -> Path:
    """One directory of links to every shard's ``hs_{i}.safetensors`` (what ``--hidden-states-path``
    reads), outside the artifacts so nothing is hashed or pulled twice."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    for d in dirs:
        for f in d.glob("hs_*.safetensors"):
            (where / f.name).symlink_to(f.resolve())
    return where


def every_position_dataset(prepared: Path, where: Path) -> Path:
    """prepare's dataset with every position in the loss (``pipeline.loss_tokens`` all), written to
    ``where``: the same rows, ``loss_mask`` all ones. The draft is distilled from the target's own
    distribution at each position (speculators scores it against the verifier's logits there, not the
    next token), so a prompt's positions are training signal too, and extract already captured their
    hidden states: more to learn from, at no extra extraction, and no extra cost a step (a packed batch
    runs every position whatever the mask says). Outside the artifacts: derived, so neither hashed nor
    pulled; rebuilt the same on a resumed run."""
    from datasets import load_from_disk

    ds = load_from_disk(str(prepared / "dataset"))
    fmt = ds.format
    ds = ds.with_format(None).map(lambda row: {"loss_mask": [1] * len(row["input_ids"])})
    ds.set_format(fmt["type"], columns=fmt["columns"], output_all_columns=fmt["output_all_columns"])
    shutil.rmtree(where, ignore_errors=True)
    ds.save_to_disk(str(where))
    return where


def draft_vocab_size(spec: dict) -> int:
    """The draft's vocabulary: the rows of vocab's d2t.npy."""
    import numpy as np

    return int(np.load(common.input_dir(spec, "vocab") / "d2t.npy").shape[0])


def train_args(spec: dict, cfg: common.Settings, meta: dict, save_path: str, on_gpu: bool, hidden_states: str,
               draft_config_path: str | None = None, data_path: str | None = None) -> list[str]:
    """speculators' own training flags for this run (``meta``: the extraction's, see ``extraction``;
    ``data_path``: the dataset to train on, prepare's unless given)."""
    vocab, prepared = common.input_dir(spec, "vocab"), common.input_dir(spec, "prepare")
    attn = cfg.draft_attn_impl if cfg.draft_attn_impl != "auto" else ("simple_flex_attention" if on_gpu else "sdpa")
    args = [
        "--speculator-type", cfg.speculator,
        "--verifier-name-or-path", common.model_dir(spec),
        "--data-path", data_path or str(prepared / "dataset"),
        "--hidden-states-path", hidden_states,
        "--target-layer-ids", *[str(i) for i in meta["target_layer_ids"]],
        "--draft-vocab-size", str(draft_vocab_size(spec)),
        "--d2t-path", str(vocab / "d2t.npy"), "--t2d-path", str(vocab / "t2d.npy"),
        *(["--draft-config", draft_config_path] if draft_config_path else ["--num-layers", str(cfg.draft_layers)]),
        *(["--ttt-steps", str(cfg.ttt_steps), "--ttt-step-loss-decay", str(cfg.ttt_step_loss_decay)]
          if cfg.speculator == drafttypes.EAGLE3 else []),  # the other types draft in parallel: no TTT steps
        *(["--block-size", str(drafttypes.block_size(cfg.block_size, cfg.ttt_steps))] if cfg.speculator in drafttypes.BLOCK else []),
        *(["--max-anchors", str(cfg.max_anchors)] if cfg.max_anchors and cfg.speculator in drafttypes.ANCHORED else []),
        *(["--loss-fn", cfg.loss_fn] if cfg.loss_fn else []),
        "--total-seq-len", str(cfg.train_seq_len),
        "--train-data-ratio", str(1.0 - cfg.val_fraction),
        "--epochs", str(cfg.epochs), "--lr", str(cfg.lr), "--optimizer", cfg.optimizer,
        "--scheduler-type", cfg.scheduler,
        "--seed", str(cfg.seed),
        "--draft-attn-impl", attn,
        # the autocast and hidden-state dtype (common.vllm_dtype: float32 on a CPU that only emulates bf16)
        "--hidden-states-dtype", common.vllm_dtype(cfg, on_gpu) or "bfloat16",
        "--save-path", save_path,
    ]
    if cfg.logger:  # the event files land in the artifacts, so they come back with the run
        args += ["--logger", cfg.logger, "--log-dir", str(common.artifacts(spec) / "tensorboard"),
                 "--run-name", spec["run_id"]]
    if not on_gpu:  # the fused loss is a Triton GPU kernel; data loader workers only compete for the cores
        args += ["--loss-implementation", "eager", "--num-workers", "0"]
    if spec["model"].get("trust_remote_code"):
        args.append("--trust-remote-code")
    return args


def torchrun_argv(cfg: common.Settings, on_gpu: bool, node: dict) -> list[str]:
    """torchrun's own flags: this host's processes (its GPUs, or one on a CPU) and, on several hosts,
    the job's shape and its rendezvous on the first host (a static one: every node knows its rank)."""
    nproc = cfg.gpus if on_gpu else 1
    if node["size"] == 1:
        return ["--standalone", f"--nproc-per-node={nproc}"]
    return [f"--nnodes={node['size']}", f"--node-rank={node['rank']}", f"--master-addr={node['master_addr']}",
            f"--master-port={node['master_port']}", f"--nproc-per-node={nproc}"]


def run_training(args: list[str], cfg: common.Settings, on_gpu: bool, node: dict, metrics_path: Path) -> MetricsTap:
    """``speculators train`` with ``args``: in this process, or under torchrun (several GPUs, or hosts);
    either way its metrics tapped (under torchrun, rank 0's, handed back through ``metrics_path``)."""
    if not ((on_gpu and cfg.gpus > 1) or node["size"] > 1):
        return train_tapped(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_argv(cfg, on_gpu, node),
           "-m", "stages.lib.trainworker", str(metrics_path), *args]
    common.log(" ".join(cmd[2:cmd.index("stages.lib.trainworker") + 1]))
    child = common.Child(cmd)
    if child.wait() != 0:
        where = f"host {node['rank'] + 1} of {node['size']}" if node["size"] > 1 else f"{cfg.gpus} GPUs"
        common.fail(STAGE, f"torchrun ({where}) failed: {child.error()}")
    tap = MetricsTap(0)
    if metrics_path.exists():  # rank 0's host
        got = json.loads(metrics_path.read_text())
        tap.train, tap.val = got["train"], got["val"]
        metrics_path.unlink()
    return tap


def main(spec: dict) -> dict:
    cfg = common.settings(spec, SETTINGS)
    check_loggers(cfg.logger)
    timer = common.Timer()
    dev = common.device(cfg)
    on_gpu = dev.startswith("cuda")
    out = common.artifacts(spec)
    node = common.cluster(spec)
    save_path = str(out / "checkpoints")  # one directory per epoch; a rerun resumes from the last
    if node["size"] > 1:  # ...except a multi-host job, whose ranks must all start from one epoch
        shutil.rmtree(save_path, ignore_errors=True)
    meta, shards = extraction(spec)
    refused = drafttypes.refusal(cfg.speculator, on_gpu, draft_vocab_size(spec), int(meta["vocab_size"]))
    if refused:  # before anything loads: the draft could not be served from this host
        common.fail(STAGE, refused)
    if cfg.online:  # an empty directory: every sample is missing, so the loader asks the server for it
        hidden_states = out / "online"
        shutil.rmtree(hidden_states, ignore_errors=True)
        hidden_states.mkdir()
    else:
        hidden_states = shards[0] if len(shards) == 1 else linked_hidden_states(
            shards, Path(spec["run_dir"]) / "hidden_states")
    config_path = None
    if cfg.draft_intermediate_size:
        config_path = out / "draft_config.json"
        draft_config(spec, cfg, config_path)
    data_path = None
    if cfg.loss_tokens == "all":
        data_path = str(every_position_dataset(common.input_dir(spec, "prepare"), Path(spec["run_dir"]) / "dataset-all"))
    args = train_args(spec, cfg, meta, save_path, on_gpu, str(hidden_states), config_path and str(config_path),
                      data_path)
    with contextlib.ExitStack() as stack:
        if cfg.online:
            from stages.lib.vllm_server import VllmServer, extract_configs, server_dtype

            server = stack.enter_context(VllmServer(
                STAGE, common.model_dir(spec), log_path=out / "server.log", max_model_len=cfg.max_seq_len + 1,
                tensor_parallel=cfg.tensor_parallel, gpu_memory_utilization=cfg.gpu_memory_utilization,
                trust_remote_code=bool(spec["model"].get("trust_remote_code")), dtype=server_dtype(cfg),
                extra_args=extract_configs(meta["captured_layer_ids"], out / ".staging")))
            # speculators' online mode: a missing sample is generated through the endpoint, loaded, discarded
            args += ["--vllm-endpoint", f"{server.url}/v1", "--on-missing", "generate"]
        common.log("speculators train " + " ".join(args))
        tap = run_training(args, cfg, on_gpu, node, out / ".rank0-metrics.json")
    if cfg.online:
        left = [*hidden_states.glob("*.safetensors"), *(out / ".staging").glob("**/*.safetensors")]
        if left:
            common.fail(STAGE, f"online training left {len(left)} hidden-state files behind ({left[0]}); "
                               "speculators discards each once loaded")

    if node["rank"] > 0:  # the first host saves the checkpoint; this one trained its share of every step
        return {"node_rank": node["rank"], "nodes": node["size"], "seconds": timer(),
                "intermediates": ["checkpoints/*"]}
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
        "speculator": cfg.speculator, "epochs": cfg.epochs, "ttt_steps": cfg.ttt_steps, "ttt_step_loss_decay": cfg.ttt_step_loss_decay,
        "lr": cfg.lr, "optimizer": cfg.optimizer, "scheduler": cfg.scheduler,
        "draft_intermediate_size": cfg.draft_intermediate_size, "online": cfg.online,
        "loss_tokens": cfg.loss_tokens, "loss_fn": cfg.loss_fn, "args": args}})
    if tap.train:
        plot(tap, out / "loss.png", cfg.speculator)
    return {"speculator": cfg.speculator, "epochs": cfg.epochs, "steps": len(tap.train), "loss": last.get("loss"),
            "full_acc_0": last.get("full_acc_0"), "val_loss": val.get("loss_epoch"),
            "val_full_acc_0": val.get("full_acc_0_epoch"), "val_full_acc_1": val.get("full_acc_1_epoch"),
            "val_full_acc_2": val.get("full_acc_2_epoch"), "nodes": node["size"], "seconds": timer(),
            # per-epoch checkpoints with optimizer states: large, not part of the model
            "intermediates": ["checkpoints/*"]}


if __name__ == "__main__":
    common.cli(main)
