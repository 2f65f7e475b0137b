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
is ``loss_positions_forward``: speculators' loss, gradients and metrics, without the TTT work on prompt
positions that no loss reads (39% less time per training step on the default); on GPUs speculators'
own compiled forward runs.

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

STAGE = "train"


class MetricsTap(logging.Handler):
    """Collects the dicts speculators' Trainer logs on ``speculators.metrics`` and prints progress."""

    def __init__(self, total_steps: int):
        super().__init__()
        self.train, self.val, self.total = [], [], total_steps

    def emit(self, record):
        entry = record.msg
        if not isinstance(entry, dict):
            return
        if "train" in entry:
            self.train.append({"step": getattr(record, "step", len(self.train)), "epoch": entry["epoch"],
                               "lr": entry["lr"], **entry["train"]})
            done = len(self.train)
            self.total = max(self.total, done)  # the packing, hence the batch count, varies by epoch
            common.progress(done, self.total, "steps")
            if done % 20 == 0 or done == self.total:
                common.log(f"step {done}/{self.total} loss {entry['train']['loss']:.4f} "
                           f"acc0 {entry['train'].get('full_acc_0', 0):.3f}")
        elif "val" in entry:
            self.val.append({"epoch": entry["epoch"], **entry["val"]})
            common.log(f"epoch {entry['epoch']} validation " + json.dumps(
                {k: round(v, 4) for k, v in entry["val"].items()}))


def draft_config(verifier_path: str, spec: dict, draft_vocab: int, aux_layers: list[int]):
    """speculators' create_transformer_layer_config + Eagle3SpeculatorConfig, as its train script."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, LlamaConfig

    pipeline = spec["pipeline"]
    full = AutoConfig.from_pretrained(verifier_path, **common.hub_kwargs(spec))
    target = common.text_config(full)
    layer_config = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=int(pipeline.get("draft_intermediate_size") or target.intermediate_size),
        num_hidden_layers=int(pipeline.get("draft_layers") or 1),
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
                                                        speculative_tokens=int(pipeline.get("k") or 3))],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_path,
                                    architectures=list(full.architectures or ["LlamaForCausalLM"])),
        ),
    )


def cache_keys_and_values(self, cache, ids, hidden, positions):
    """Step-0 keys and values of positions that are never queried, into the draft's one-layer cache.

    Exactly what ``LlamaDecoderEagle3FirstLayer`` computes for them before attention (its two input
    norms, then ``LlamaAttention``'s k/v projections and rotary embedding), and nothing after it: their
    attention output, o_proj and MLP would only feed logits no loss reads.
    """
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer = self.layers[0]
    attention = layer.self_attn
    with torch.no_grad():
        embeds = self.embed_tokens(ids)
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1).unsqueeze(0)
    shape = (1, x.shape[1], -1, attention.head_dim)
    keys = attention.k_proj(x).view(shape).transpose(1, 2)
    values = attention.v_proj(x).view(shape).transpose(1, 2)
    cos, sin = self.rotary_emb(x, positions.unsqueeze(0))
    _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
    cache.update(keys, values, attention.layer_idx)


def loss_positions_forward(self, hidden_states, input_ids, lengths=None, loss_mask=None, position_ids=None,
                           verifier_last_hidden_states=None, ttt_steps=3, ttt_step_loss_decay=1.0,
                           use_off_policy_tokens=False, **kwargs):
    """speculators' ``Eagle3DraftModel.forward`` for training, computing only what reaches the loss.

    TTT step s at position i is scored against the target at i + s, where ``loss_mask[i + s]``; at steps
    s > 0 position i attends to the step-0 keys of positions <= i (its document) and to its own earlier
    steps only. So a position whose chain never reaches an assistant token (the prompt: ~40% of the
    default's tokens) is needed at step 0 as a key and nowhere else. This runs step 0 at every position
    (with the usual one draft layer, only the keys and values of the positions not kept), then logits
    and steps s > 0 only at the kept positions: the same loss, gradients and metrics as speculators'
    forward (tests/test_stages.py compares them), in 39% less time per training step (the default's
    320-token batches on 2 cores: 0.43 -> 0.26 s). Returns the draft tokens of the kept positions only
    (the trainer ignores them). Bound to the model on CPU, where speculators' forward runs the dense-mask
    attention of patch 7; the mask here is a mask_mod over the kept positions for that path. Without a
    loss mask or targets (not training) it is speculators' forward.
    """
    import torch
    from transformers import DynamicCache

    if loss_mask is None or verifier_last_hidden_states is None:
        return type(self).forward(self, hidden_states, input_ids, lengths=lengths, loss_mask=loss_mask,
                                  position_ids=position_ids, verifier_last_hidden_states=verifier_last_hidden_states,
                                  ttt_steps=ttt_steps, ttt_step_loss_decay=ttt_step_loss_decay,
                                  use_off_policy_tokens=use_off_policy_tokens, **kwargs)

    device, n = hidden_states.device, hidden_states.shape[1]
    if lengths is None:
        lengths = torch.tensor([n], dtype=torch.long, device=device)
    if position_ids is None:
        position_ids = 1 + torch.arange(n, dtype=torch.long, device=device).unsqueeze(0)
    document = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths.to(device))
    document = torch.cat([document, document.new_full((n - document.shape[0],), -1)])  # -1: padding
    scored = loss_mask[0].to(torch.bool)
    keep = torch.zeros(n, dtype=torch.bool, device=device)
    for s in range(ttt_steps):
        keep[:n - s] |= scored[s:]
    kept = keep.nonzero().squeeze(-1)
    # the target rows any step compares a kept position with (i + s), computed once
    compared = torch.zeros(n, dtype=torch.bool, device=device)
    for s in range(ttt_steps):
        compared[(kept + s)[kept + s < n]] = True
    row = torch.cumsum(compared.long(), 0) - 1
    with torch.no_grad():
        targets = self.verifier_lm_head(self.verifier_norm(verifier_last_hidden_states[0, compared]))
        target_p, target_tokens = torch.softmax(targets, dim=-1), targets.argmax(dim=-1)

    cache = DynamicCache(config=self.config.transformer_layer_config)
    key_position = torch.arange(n, device=device)  # the position of each cached key, step by step
    key_step0 = torch.ones(n, dtype=torch.bool, device=device)

    def attention_mask(query_position):
        keys, step0, query_document = key_position, key_step0, document[query_position]

        def mask_mod(_b, _h, q, kv):  # causal within the document at step 0, own position at any step
            p = query_position[q]
            return (step0[kv] & (keys[kv] <= p) & (document[keys[kv]] == query_document[q])
                    & (query_document[q] != -1)) | (keys[kv] == p)
        return types.SimpleNamespace(mask_mod=mask_mod)

    hidden = self.fc(hidden_states)[0]
    ids, original_ids, positions = input_ids[0], input_ids[0], position_ids[0]
    first_queries = key_position  # step 0 at every position, unless the one layer's keys suffice
    if len(self.layers) == 1:
        skipped = (~keep).nonzero().squeeze(-1)
        cache_keys_and_values(self, cache, ids[skipped], hidden[skipped], positions[skipped])
        key_position = torch.cat([skipped, kept])
        first_queries, ids, hidden = kept, ids[kept], hidden[kept]
    loss = torch.tensor(0.0, device=device)
    prev_correct = scored[kept].clone()
    metrics, draft_tokens = {}, []
    for step in range(ttt_steps):
        query_position = first_queries if step == 0 else kept
        with torch.no_grad():
            embeds = self.embed_tokens(ids)
        h = torch.cat([embeds, hidden], dim=-1).unsqueeze(0)
        step_positions = (positions[query_position] + step).unsqueeze(0)
        rotary = self.rotary_emb(h, step_positions)
        mask = attention_mask(query_position)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=step_positions, past_key_values=cache,
                      position_embeddings=rotary, **kwargs)
        hidden = h[0] if len(query_position) == len(kept) else h[0, kept]  # the kept positions' states
        key_position = torch.cat([key_position, kept])  # the next step's keys
        key_step0 = torch.cat([key_step0, torch.zeros_like(kept, dtype=torch.bool)])
        logits = self.lm_head(self.norm(hidden))

        at = kept + step  # the target each kept position is scored against at this step
        inside = at < n
        at = at.clamp(max=n - 1)
        weight = scored[at] & inside
        kl = torch.nn.functional.kl_div(torch.log_softmax(logits, dim=-1), target_p[row[at]],
                                        reduction="none").sum(-1)
        s_loss = ttt_step_loss_decay ** step * (kl * weight).sum() / (scored[step:].sum() + 1e-5)
        loss = loss + s_loss
        with torch.no_grad():  # speculators' compute_accuracy, on the kept positions
            predicted = logits.argmax(dim=-1)
            cond_denominator = prev_correct[inside].sum()
            correct = prev_correct & (predicted == target_tokens[row[at]])
            prev_correct = torch.where(inside, correct, prev_correct)
            hits = (correct & weight).float().sum()
            metrics[f"loss_{step}"] = s_loss.detach().clone()
            metrics[f"full_acc_{step}"] = hits / (scored[step:].sum() + 1e-5)
            metrics[f"cond_acc_{step}"] = hits / (cond_denominator + 1e-5)
        draft_tokens.append(predicted)
        if use_off_policy_tokens:  # the verified token: x_{i+step+1}, 0 past the end (as speculators)
            following = kept + step + 1
            ids = torch.where(following < n, original_ids[following.clamp(max=n - 1)], torch.zeros_like(following))
        else:
            ids = predicted + self.d2t[predicted]
    metrics["loss"] = loss.detach().clone()
    return draft_tokens, loss, metrics


def loader(files, pipeline, rank, world, train: bool):
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.noise_transforms import AddUniformNoise
    from torch.utils.data import DataLoader

    seq = int(pipeline.get("train_seq_len") or 2048)
    noise = AddUniformNoise(std=0.05, tensors=("hidden_states", "verifier_last_hidden_states")) if train else None
    dataset = Eagle3SampleFileDataset(file_list=[str(f) for f in files], max_len=seq, transform=noise)
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=seq, lengths=dataset.approx_lengths, num_replicas=world, rank=rank,
        seed=int(pipeline.get("seed") or 0))
    workers = 0 if common.device(pipeline) == "cpu" else 4
    return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, collate_fn=create_collate_fn(seq),
                      pin_memory=workers > 0, persistent_workers=workers > 0)


def plot(tap: MetricsTap, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in tap.train], [m["loss"] for m in tap.train], label="train loss")
    if tap.val:
        per_epoch = max(1, len(tap.train) // max(1, len(tap.val)))
        ax.plot([(i + 1) * per_epoch for i in range(len(tap.val))], [m["loss_epoch"] for m in tap.val],
                "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (sum over TTT steps)")
    ax.set_title("EAGLE-3 draft training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def relaunch_with_torchrun(spec: dict, gpus: int) -> dict:
    """Several GPUs: run this stage once per GPU under torchrun; rank 0 writes the result."""
    spec_path = os.path.join(spec["run_dir"], "train-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "stages.train", spec_path]
    common.log("launching: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    return json.loads((common.artifacts(spec) / "result.json").read_text())


def main(spec: dict) -> dict:
    pipeline = spec.setdefault("pipeline", {})
    dev = common.device(pipeline)
    gpus = int(pipeline.get("gpus") or 1)
    if dev.startswith("cuda") and gpus > 1 and "LOCAL_RANK" not in os.environ:
        return relaunch_with_torchrun(spec, gpus)

    import numpy as np
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.data import split_files
    from speculators.train.trainer import Trainer, TrainerConfig
    from speculators.train.utils import maybe_destroy_distributed, maybe_setup_distributed

    timer = common.Timer()
    if not pipeline.get("compile", dev.startswith("cuda")):
        # speculators wraps the draft's forward in torch.compile; on CPU compiling (C++ codegen for
        # forward, backward and each new shape) costs minutes and gains nothing for a one-layer draft
        torch.compiler.set_stance("force_eager")
    out = common.artifacts(spec)
    extracted, vocab = common.input_dir(spec, "extract"), common.input_dir(spec, "vocab")
    meta = json.loads((extracted / "extract.json").read_text())
    torch.manual_seed(int(pipeline.get("seed") or 0))

    local_rank, world, rank, distributed = maybe_setup_distributed()
    d2t = torch.from_numpy(np.load(vocab / "d2t.npy"))
    t2d = torch.from_numpy(np.load(vocab / "t2d.npy"))
    verifier = common.model_dir(spec)
    config = draft_config(verifier, spec, int(d2t.shape[0]), meta["eagle_aux_hidden_state_layer_ids"])
    model = Eagle3DraftModel(config=config, t2d=t2d, d2t=d2t)
    if dev == "cpu":  # see loss_positions_forward; on GPUs speculators' compiled FlexAttention forward
        model.forward = types.MethodType(loss_positions_forward, model)

    val_fraction = float(pipeline.get("val_fraction", 0.1))
    train_files, val_files = split_files(str(extracted / "data"), ratio=1.0 - val_fraction,
                                         seed=int(pipeline.get("seed") or 0))
    if not train_files:
        common.fail(STAGE, f"no training samples in {extracted / 'data'}; run extract again")
    train_loader = loader(train_files, pipeline, rank, world, train=True)
    val_loader = loader(val_files, pipeline, rank, world, train=False) if val_files else None

    epochs, ttt = int(pipeline.get("epochs") or 1), int(pipeline.get("ttt_steps") or 3)
    tap = MetricsTap(epochs * len(train_loader))
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.addHandler(tap)
    metric_logger.setLevel(logging.INFO)
    state = os.path.join(spec["run_dir"], "train-state")  # per-epoch checkpoints + optimizer state
    decay = float(pipeline.get("ttt_step_loss_decay") or 1.0)
    # which token TTT steps s > 0 read: see the module docstring; validation always the draft's own guesses
    verified = bool(pipeline.get("ttt_verified_tokens", True))
    call = {"use_off_policy_tokens": verified, "ttt_steps": ttt, "ttt_step_loss_decay": decay}
    val_call = {**call, "use_off_policy_tokens": False}
    trainer = Trainer(model, TrainerConfig(
        lr=float(pipeline.get("lr") or 1e-4), num_epochs=epochs, save_path=state,
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
        "lr": pipeline.get("lr"), "train_files": len(train_files),
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
