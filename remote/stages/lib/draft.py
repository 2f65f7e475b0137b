"""The EAGLE-3 draft's training forward, computing only what reaches the loss (train binds it on CPU).

speculators' ``Eagle3DraftModel.forward`` runs every TTT step at every position; here the steps after
the first and the logits run only at the positions whose chain reaches a loss-masked token. The loss,
gradients and metrics are speculators' own (tests/test_stages.py compares the two forwards).
"""
import types


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
    forward (tests/test_stages.py compares them), in much less time per training step. Returns the draft tokens of the kept positions only
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
