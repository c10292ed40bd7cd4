"""MoE routing replay: route every token to given experts (those an inference engine used when it sampled it).

The `routed_experts` forward input holds integer expert ids per token and MoE layer, in the caller's layout:
`[batch, seq_len, num_moe_layers, top_k]`, or `[batch * seq_len, num_moe_layers, top_k]` (for a packed row
`[1, total_tokens]`: `[total_tokens, num_moe_layers, top_k]`, vLLM's `CompletionOutput.routed_experts` layout).
Layers count the MoE layers only, in order (dense `mlp_only_layers` have no entry). A token whose ids are all -1
has none (e.g. a prompt the engine did not report) and routes normally; pad positions are never computed, so their
entries are ignored. The replayed experts replace the router's top-k choice; their gate weights are the router's
own softmax probabilities of those experts, renormalised, so the router weight still gets gradients (rollout
routing replay, "R3").
"""

from __future__ import annotations

import torch

NO_EXPERT = -1  # marks a token without replayed ids: it routes normally


def routed_experts_stream(routed_experts, packed, config, device) -> torch.Tensor:
    """The caller's `routed_experts` as the packed stream: long [num_tokens, num_moe_layers, top_k] on `device`,
    validated on the real tokens (shape, MoE layer count, top-k, ids in range, no duplicate expert in a token's
    top-k, a token's ids all given or all -1); ValueError naming the problem otherwise."""
    num_layers = sum(config.layer_uses_moe(i) for i in range(config.num_hidden_layers)) if config.is_moe else 0
    if num_layers == 0:
        raise ValueError("routed_experts was given, but this model has no MoE layer to replay routing in")
    top_k, num_experts = config.num_experts_per_tok, config.num_experts
    given = torch.as_tensor(routed_experts)
    if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise ValueError(f"routed_experts must hold integer expert ids, got dtype {given.dtype}")
    batch, seq_len = packed.batch_shape
    expected = (
        f"[batch, seq_len, {num_layers}, {top_k}] = [{batch}, {seq_len}, {num_layers}, {top_k}] or "
        f"[batch * seq_len, {num_layers}, {top_k}] = [{batch * seq_len}, {num_layers}, {top_k}]"
    )
    if given.ndim == 3 and given.shape[0] == batch * seq_len:
        given = given.reshape(batch, seq_len, *given.shape[1:])
    if given.ndim != 4 or tuple(given.shape[:2]) != (batch, seq_len):
        raise ValueError(f"routed_experts must be {expected} (the tokens of input_ids), got shape {tuple(given.shape)}")
    if given.shape[2] != num_layers:
        raise ValueError(
            f"routed_experts has {given.shape[2]} layers, but the model has {num_layers} MoE layers "
            f"(routed_experts must be {expected})"
        )
    if given.shape[3] != top_k:
        raise ValueError(
            f"routed_experts gives top_k={given.shape[3]} experts per token (its last dimension), but "
            f"the model routes each token to num_experts_per_tok={top_k}"
        )
    stream = packed.pack(given.to(device=device, dtype=torch.long))
    missing = stream == NO_EXPERT
    if bool((missing.any(dim=-1) & ~missing.all(dim=-1)).any()):
        raise ValueError(
            "routed_experts gives some but not all of a token's top-k experts (-1 next to an id); a "
            "token has either all its ids or all -1 (route normally)"
        )
    out_of_range = ~missing & ((stream < 0) | (stream >= num_experts))
    if bool(out_of_range.any()):
        bad = int(stream[out_of_range][0])
        raise ValueError(
            f"routed_experts holds expert id {bad}, outside [0, {num_experts}) (num_experts="
            f"{num_experts}; -1 marks a token without ids)"
        )
    ordered = stream.sort(dim=-1).values
    duplicate = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != NO_EXPERT)
    if bool(duplicate.any()):
        token, layer, _ = (int(i) for i in torch.nonzero(duplicate)[0])
        raise ValueError(
            f"routed_experts names an expert twice in one token's top-k (real token {token}, MoE "
            f"layer {layer}: {stream[token, layer].tolist()})"
        )
    return stream


def replayed_top_k(probs: torch.Tensor, top_index: torch.Tensor, replay: torch.Tensor):
    """Gate weights and experts with the replayed ids where given: probs [N, E] fp32 router probabilities,
    top_index [N, k] the router's own choice, replay [N, k] ids or -1 -> (weights [N, k] renormalised, index [N, k]).
    Tokens without ids keep the router's choice, with the same weights bit for bit (the same gathered values)."""
    index = torch.where(replay[:, :1] == NO_EXPERT, top_index, replay)
    weights = probs.gather(-1, index)
    return weights / weights.sum(dim=-1, keepdim=True), index
