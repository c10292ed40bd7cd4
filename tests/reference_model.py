"""A pure-PyTorch Qwen3.5 text model for ONE document, in fp64, token by token: the reference the model is checked
against where transformers has no built-in Qwen3.5 (4.x). Written from the architecture (see README), not from
this project's modules: no varlen, no chunking, no kernels, explicit loops and full attention matrices.

Weights are read from a state dict with the official keys; `config` is any object with the text-config fields.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _zero_centred_rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _silu_mlp(x, w, prefix):
    hidden = F.silu(x @ w[f"{prefix}.gate_proj.weight"].T) * (x @ w[f"{prefix}.up_proj.weight"].T)
    return hidden @ w[f"{prefix}.down_proj.weight"].T


def _rope(x, positions, theta, rotary_dim):
    """Rotate-half rope on the first rotary_dim channels of x [L, heads, D] (text: t == h == w, plain rope)."""
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angle = positions[:, None].double() * inv_freq  # [L, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _gated_deltanet(h, w, p, config):
    length = h.shape[0]
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    mixed = h @ w[f"{p}.in_proj_qkv.weight"].T  # [L, 2 nk dk + nv dv]
    kernel = w[f"{p}.conv1d.weight"][:, 0, :]  # [C, K]
    size = kernel.shape[1]
    history = torch.cat([torch.zeros(size - 1, mixed.shape[1], dtype=mixed.dtype), mixed])
    conv = torch.stack([(history[t : t + size] * kernel.T).sum(0) for t in range(length)])
    conv = F.silu(conv)
    q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)
    ratio = nv // nk
    q = q.reshape(length, nk, dk).repeat_interleave(ratio, dim=1)
    k = k.reshape(length, nk, dk).repeat_interleave(ratio, dim=1)
    v = v.reshape(length, nv, dv)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(h @ w[f"{p}.in_proj_b.weight"].T)  # [L, nv]
    decay = -w[f"{p}.A_log"].exp() * F.softplus(h @ w[f"{p}.in_proj_a.weight"].T + w[f"{p}.dt_bias"])
    state = torch.zeros(nv, dk, dv, dtype=h.dtype)
    outputs = []
    for t in range(length):
        state = state * decay[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + torch.einsum("hk,hv->hkv", k[t], (v[t] - predicted) * beta[t][:, None])
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    out = torch.stack(outputs)  # [L, nv, dv]
    z = (h @ w[f"{p}.in_proj_z.weight"].T).reshape(length, nv, dv)
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w[f"{p}.norm.weight"]
    out = out * F.silu(z)
    return out.reshape(length, nv * dv) @ w[f"{p}.out_proj.weight"].T


def _attention(h, w, p, config):
    length, heads, kv_heads, d = h.shape[0], config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = (h @ w[f"{p}.q_proj.weight"].T).reshape(length, heads, -1)
    gate = None
    if config.attn_output_gate:  # per head [q | gate]
        q, gate = q[..., :d], q[..., d:].reshape(length, heads * d)
    k = (h @ w[f"{p}.k_proj.weight"].T).reshape(length, kv_heads, d)
    v = (h @ w[f"{p}.v_proj.weight"].T).reshape(length, kv_heads, d)
    q = _zero_centred_rms_norm(q, w[f"{p}.q_norm.weight"], config.rms_norm_eps)
    k = _zero_centred_rms_norm(k, w[f"{p}.k_norm.weight"], config.rms_norm_eps)
    rope = config.rope_parameters
    rotary_dim = int(d * rope["partial_rotary_factor"])
    positions = torch.arange(length)
    q, k = _rope(q, positions, rope["rope_theta"], rotary_dim), _rope(k, positions, rope["rope_theta"], rotary_dim)
    group = heads // kv_heads
    out = torch.empty(length, heads, d, dtype=h.dtype)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for head in range(heads):
        scores = (q[:, head] @ k[:, head // group].T) * d**-0.5
        out[:, head] = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, head // group]
    out = out.reshape(length, heads * d)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out @ w[f"{p}.o_proj.weight"].T


def _moe(x, w, p, config):
    probs = (x @ w[f"{p}.gate.weight"].T).softmax(-1)
    weights, experts = probs.topk(config.num_experts_per_tok, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    size = config.moe_intermediate_size
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token], experts[token].tolist()):
            gate_up = w[f"{p}.experts.gate_up_proj"][expert]  # [2I, H]: gate rows, then up rows
            hidden = F.silu(gate_up[:size] @ x[token]) * (gate_up[size:] @ x[token])
            out[token] += weight * (w[f"{p}.experts.down_proj"][expert] @ hidden)
    shared = _silu_mlp(x, w, f"{p}.shared_expert")
    return out + torch.sigmoid(x @ w[f"{p}.shared_expert_gate.weight"].T) * shared


@torch.no_grad()
def reference_logits(state_dict: dict, config, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [L, vocab] (fp64) of one document `input_ids` [L]."""
    w = {name: tensor.detach().double() for name, tensor in state_dict.items()}
    eps = config.rms_norm_eps
    x = w["model.embed_tokens.weight"][input_ids]
    moe_layers = getattr(config, "num_experts", None) is not None
    for i, layer_type in enumerate(config.layer_types):
        p = f"model.layers.{i}"
        h = _zero_centred_rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        if layer_type == "linear_attention":
            x = x + _gated_deltanet(h, w, f"{p}.linear_attn", config)
        else:
            x = x + _attention(h, w, f"{p}.self_attn", config)
        h = _zero_centred_rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        if moe_layers and i not in (getattr(config, "mlp_only_layers", None) or []):
            x = x + _moe(h, w, f"{p}.mlp", config)
        else:
            x = x + _silu_mlp(h, w, f"{p}.mlp")
    x = _zero_centred_rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if "lm_head.weight" not in w else w["lm_head.weight"]
    return x @ head.T
