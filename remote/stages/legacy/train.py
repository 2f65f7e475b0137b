"""Stage train: an EAGLE-3 draft with speculators' own model, data loader and trainer.

Reads extract's ``data/`` + ``extract.json`` and vocab's ``d2t.npy`` / ``t2d.npy``. Builds the draft as
speculators' ``scripts/train.py`` (0.3.0) does: a Llama decoder layer config derived from the target
(``pipeline.draft_layers`` layers; ``pipeline.draft_intermediate_size`` shrinks the MLP, default the
target's), ``Eagle3SpeculatorConfig`` with the greedy proposal of ``pipeline.k`` tokens and the
target as verifier; ``Eagle3SampleFileDataset`` (format v1, uniform noise 0.05 on the hidden
states), ``MultipackDistributedBatchSamplerV2`` packing samples into ``pipeline.train_seq_len``
tokens, and ``Trainer`` (AdamW, ``pipeline.lr``, linear schedule, ``pipeline.epochs``,
``pipeline.ttt_steps`` test-time-training steps). A ``pipeline.val_fraction`` of the samples is held
out for the trainer's validation pass.

TTT steps: at step s > 0 the draft reads its own hidden state from step s-1 and a token. Which token
is ``pipeline.ttt_verified_tokens``: true (default) gives it the verified token (speculators'
``use_off_policy_tokens``), false its own guess from step s-1. Verified is what serving asks of it:
greedy chain verification only uses draft token s when tokens 0..s-1 were accepted, i.e. equal to the
target's, so training on its own wrong guesses spends capacity on chains that are never used
(measured on SmolLM2-135M, 64 held-out prompts: acceptance length 1.58 -> 1.69, validation
accuracy of TTT step 1 given step 0 right 0.42 -> 0.49). Validation always feeds the draft's own
guesses, like serving. ``pipeline.ttt_step_loss_decay`` weighs step s's loss by decay ** s.

The checkpoint records ``eagle_aux_hidden_state_layer_ids`` = captured layers + 1 (vLLM feeds the
input of a listed layer; see stages/__init__), so a vLLM server gives the draft the layers it was
trained on.

Devices: one process on CPU or one GPU; with ``pipeline.gpus`` > 1 the stage relaunches itself under
``torchrun`` (speculators' FSDP path). On CPU the installed speculators must carry the dense-attention
fallback (patch 7 of the 0.3.0 series): FlexAttention has no CPU backward. On CPU the draft's forward
is ``stages.lib.draft.loss_positions_forward``: speculators' loss, gradients and metrics, without the
TTT work on prompt positions that no loss reads (a much shorter training step); on
GPUs speculators' own compiled forward runs.

Outputs: ``checkpoint/`` (config.json + model.safetensors, loadable by speculators' from_pretrained
and vLLM's speculators config loader), ``metrics.json`` (every step's loss/accuracies, per-epoch
validation), ``loss.png``.
"""
import json
import logging
import os
import shutil
import subprocess
import sys
import types

from stages import common
from stages.lib.draft import loss_positions_forward
from stages.lib.trainlog import MetricsTap, plot

STAGE = "train"
READS = ("extract", "vocab")  # the stages whose artifacts this one reads: extract's data/, vocab's d2t/t2d
GPU = True                   # trains on the GPUs (torchrun over pipeline.gpus)
SETTINGS = {                 # the pipeline settings this stage reads, with their defaults
    "draft_layers": 1,             # decoder layers of the draft
    "draft_intermediate_size": None,  # the draft's MLP width; unset: the target's
    "k": 3,                        # tokens the draft proposes per step (its checkpoint's speculative_tokens)
    "epochs": 1,                   # passes over the training samples
    "lr": 1e-4,                    # AdamW, linear schedule
    "train_seq_len": 2048,         # tokens per packed batch
    "val_fraction": 0.1,           # samples held out for the trainer's validation pass
    "ttt_steps": 3,                # test-time-training steps
    "ttt_verified_tokens": True,   # TTT steps > 0 read the verified token, not the draft's own guess
    "ttt_step_loss_decay": 1.0,    # TTT step s's loss weighs decay ** s
    "seed": 0,                     # initialisation, packing, the train/validation split
    "gpus": 1,                     # GPUs for training: > 1 relaunches the stage under torchrun
    "compile": None,               # torch.compile the draft; unset: only on CUDA
}


def draft_config(verifier_path: str, spec: dict, cfg: common.Settings, draft_vocab: int, aux_layers: list[int]):
    """speculators' create_transformer_layer_config + Eagle3SpeculatorConfig, as its train script."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, LlamaConfig

    full = AutoConfig.from_pretrained(verifier_path, **common.hub_kwargs(spec))
    target = common.text_config(full)
    layer_config = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=int(cfg.draft_intermediate_size or target.intermediate_size),
        num_hidden_layers=cfg.draft_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        hidden_act=target.hidden_act,
        max_position_embeddings=target.max_position_embeddings,
        initializer_range=target.initializer_range,
        rms_norm_eps=target.rms_norm_eps,
        head_dim=getattr(target, "head_dim", None),
        rope_theta=getattr(target, "rope_theta", 10000.0),
    )
    layer_config._attn_implementation = "simple_flex_attention"  # noqa: SLF001  (speculators' attention)
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=draft_vocab,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=aux_layers,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy",
                                                        speculative_tokens=cfg.k)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_path,
                                    architectures=list(full.architectures or ["LlamaForCausalLM"])),
        ),
    )


def loader(files, cfg: common.Settings, rank, world, train: bool):
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.noise_transforms import AddUniformNoise
    from torch.utils.data import DataLoader

    seq = cfg.train_seq_len
    noise = AddUniformNoise(std=0.05, tensors=("hidden_states", "verifier_last_hidden_states")) if train else None
    dataset = Eagle3SampleFileDataset(file_list=[str(f) for f in files], max_len=seq, transform=noise)
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=seq, lengths=dataset.approx_lengths, num_replicas=world, rank=rank,
        seed=cfg.seed)
    workers = 0 if common.device(cfg) == "cpu" else 4
    return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, collate_fn=create_collate_fn(seq),
                      pin_memory=workers > 0, persistent_workers=workers > 0)


def relaunch_with_torchrun(spec: dict, gpus: int) -> dict:
    """Several GPUs: run this stage once per GPU under torchrun; rank 0 writes the result."""
    spec_path = os.path.join(spec["run_dir"], "train-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "stages.legacy.train", spec_path]
    common.log("launching: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    return json.loads((common.artifacts(spec) / "result.json").read_text())


def main(spec: dict) -> dict:
    cfg = common.settings(spec, SETTINGS)
    dev = common.device(cfg)
    if dev.startswith("cuda") and cfg.gpus > 1 and "LOCAL_RANK" not in os.environ:
        return relaunch_with_torchrun(spec, cfg.gpus)

    import numpy as np
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.data import split_files
    from speculators.train.trainer import Trainer, TrainerConfig
    from speculators.train.utils import maybe_destroy_distributed, maybe_setup_distributed

    timer = common.Timer()
    if not (dev.startswith("cuda") if cfg.compile is None else cfg.compile):
        # speculators wraps the draft's forward in torch.compile; on CPU compiling (C++ codegen for
        # forward, backward and each new shape) costs minutes and gains nothing for a one-layer draft
        torch.compiler.set_stance("force_eager")
    out = common.artifacts(spec)
    extracted, vocab = common.input_dir(spec, "extract"), common.input_dir(spec, "vocab")
    meta = json.loads((extracted / "extract.json").read_text())
    torch.manual_seed(cfg.seed)

    local_rank, world, rank, distributed = maybe_setup_distributed()
    d2t = torch.from_numpy(np.load(vocab / "d2t.npy"))
    t2d = torch.from_numpy(np.load(vocab / "t2d.npy"))
    verifier = common.model_dir(spec)
    config = draft_config(verifier, spec, cfg, int(d2t.shape[0]), meta["eagle_aux_hidden_state_layer_ids"])
    model = Eagle3DraftModel(config=config, t2d=t2d, d2t=d2t)
    if dev == "cpu":  # see loss_positions_forward; on GPUs speculators' compiled FlexAttention forward
        model.forward = types.MethodType(loss_positions_forward, model)

    train_files, val_files = split_files(str(extracted / "data"), ratio=1.0 - cfg.val_fraction, seed=cfg.seed)
    if not train_files:
        common.fail(STAGE, f"no training samples in {extracted / 'data'}; run extract again")
    train_loader = loader(train_files, cfg, rank, world, train=True)
    val_loader = loader(val_files, cfg, rank, world, train=False) if val_files else None

    epochs, ttt = cfg.epochs, cfg.ttt_steps
    tap = MetricsTap(epochs * len(train_loader))
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.addHandler(tap)
    metric_logger.setLevel(logging.INFO)
    state = os.path.join(spec["run_dir"], "train-state")  # per-epoch checkpoints + optimizer state
    decay = cfg.ttt_step_loss_decay
    # which token TTT steps s > 0 read: see the module docstring; validation always the draft's own guesses
    verified = cfg.ttt_verified_tokens
    call = {"use_off_policy_tokens": verified, "ttt_steps": ttt, "ttt_step_loss_decay": decay}
    val_call = {**call, "use_off_policy_tokens": False}
    trainer = Trainer(model, TrainerConfig(
        lr=cfg.lr, num_epochs=epochs, save_path=state,
        # resuming reloads onto cuda:0 in speculators 0.3.0, so only on GPUs
        resume_from_checkpoint=dev.startswith("cuda"), is_distributed=distributed,
        # an int rank means cuda:<rank> to torch; on CPU the device itself
        local_rank=local_rank if dev.startswith("cuda") else "cpu",
        train_call_kwargs=call, val_call_kwargs=val_call,
    ), train_loader, val_loader)
    trainer.run_training()
    maybe_destroy_distributed()
    if rank != 0:
        return {}

    final = os.path.join(state, str(epochs - 1))
    checkpoint = out / "checkpoint"
    shutil.rmtree(checkpoint, ignore_errors=True)
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(os.path.join(final, name), checkpoint / name)
    shutil.rmtree(state, ignore_errors=True)  # optimizer states: large, and not part of the model

    last = tap.train[-1] if tap.train else {}
    val = tap.val[-1] if tap.val else {}
    common.write_json(out / "metrics.json", {"train": tap.train, "val": tap.val, "config": {
        "epochs": epochs, "ttt_steps": ttt, "ttt_verified_tokens": verified, "ttt_step_loss_decay": decay,
        "lr": cfg.lr, "train_files": len(train_files),
        "val_files": len(val_files), "draft_vocab_size": int(d2t.shape[0]),
        "eagle_aux_hidden_state_layer_ids": meta["eagle_aux_hidden_state_layer_ids"]}})
    plot(tap, out / "loss.png")
    result = {"samples": len(train_files), "tokens": meta["tokens"], "epochs": epochs, "steps": len(tap.train),
              "loss": last.get("loss"), "full_acc_0": last.get("full_acc_0"),
              "val_loss": val.get("loss_epoch"), "val_full_acc_0": val.get("full_acc_0_epoch"),
              "seconds": timer()}
    if distributed:
        common.write_json(out / "result.json", result)
    return result


if __name__ == "__main__":
    common.cli(main)
