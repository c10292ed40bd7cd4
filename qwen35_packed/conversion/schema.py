"""The tensors a packed Qwen3.5 text checkpoint must hold, with shapes, derived from its config.

This is this project's layout, which equals the keys of transformers' built-in text classes
(`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`) with fused experts, plus two config fields the built-in classes
ignore: `attn_output_gate` (False: `q_proj` without the gate half) and `mlp_only_layers` (MoE: dense MLP layers).
"""

from __future__ import annotations


def expected_text_tensors(config, *, sequence_classifier: bool = False) -> dict[str, tuple[int, ...]]:
    """`key -> shape` of every tensor of the text model described by `config` (a `Qwen3_5PackedConfig`); with
    `sequence_classifier`, of the reward / value model: the score head `score.weight` [num_labels, hidden] in place
    of `lm_head.weight` (transformers' and this project's sequence-classification classes)."""
    c = config
    hidden = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden)}
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    for i, layer_type in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if layer_type == "linear_attention":
            a = p + "linear_attn."
            shapes[a + "in_proj_qkv.weight"] = (conv_dim, hidden)
            shapes[a + "in_proj_z.weight"] = (value_dim, hidden)
            shapes[a + "in_proj_b.weight"] = (c.linear_num_value_heads, hidden)
            shapes[a + "in_proj_a.weight"] = (c.linear_num_value_heads, hidden)
            shapes[a + "conv1d.weight"] = (conv_dim, 1, c.linear_conv_kernel_dim)
            shapes[a + "dt_bias"] = (c.linear_num_value_heads,)
            shapes[a + "A_log"] = (c.linear_num_value_heads,)
            shapes[a + "norm.weight"] = (c.linear_value_head_dim,)
            shapes[a + "out_proj.weight"] = (hidden, value_dim)
        else:
            shapes.update(_full_attention_shapes(c, p + "self_attn."))
        shapes.update(_mlp_shapes(c, p + "mlp.", moe=getattr(c, "is_moe", False) and c.layer_uses_moe(i)))
    shapes["model.norm.weight"] = (hidden,)
    if sequence_classifier:
        shapes["score.weight"] = (c.num_labels, hidden)
    elif not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def _full_attention_shapes(c, a: str) -> dict[str, tuple[int, ...]]:
    hidden = c.hidden_size
    q_rows = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
    kv_rows = c.num_key_value_heads * c.head_dim
    shapes = {
        a + "q_proj.weight": (q_rows, hidden),
        a + "k_proj.weight": (kv_rows, hidden),
        a + "v_proj.weight": (kv_rows, hidden),
        a + "o_proj.weight": (hidden, c.num_attention_heads * c.head_dim),
    }
    if c.attention_bias:
        shapes[a + "q_proj.bias"] = (q_rows,)
        shapes[a + "k_proj.bias"] = (kv_rows,)
        shapes[a + "v_proj.bias"] = (kv_rows,)
        shapes[a + "o_proj.bias"] = (hidden,)
    shapes[a + "q_norm.weight"] = (c.head_dim,)
    shapes[a + "k_norm.weight"] = (c.head_dim,)
    return shapes


def _mlp_shapes(c, m: str, *, moe: bool) -> dict[str, tuple[int, ...]]:
    hidden = c.hidden_size
    if moe:
        n_experts, inter, shared = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
        return {
            m + "gate.weight": (n_experts, hidden),
            m + "experts.gate_up_proj": (n_experts, 2 * inter, hidden),
            m + "experts.down_proj": (n_experts, hidden, inter),
            m + "shared_expert.gate_proj.weight": (shared, hidden),
            m + "shared_expert.up_proj.weight": (shared, hidden),
            m + "shared_expert.down_proj.weight": (hidden, shared),
            m + "shared_expert_gate.weight": (1, hidden),
        }
    inter = c.intermediate_size
    return {
        m + "gate_proj.weight": (inter, hidden),
        m + "up_proj.weight": (inter, hidden),
        m + "down_proj.weight": (hidden, inter),
    }


def expected_mtp_tensors(config, n_layers: int) -> dict[str, tuple[int, ...]]:
    """`key -> shape` of the multi-token-prediction head of an official checkpoint, experts shown fused.

    The head (`mtp.*`, unused by the text model, used by vLLM / SGLang for MTP speculative decoding): `fc` [H, 2H]
    (concatenated embedding and hidden state -> H), three norms and `n_layers` full-attention decoder layers whose
    MLP is an MoE block in MoE models (official checkpoints store its experts per expert; compare after fusing).
    """
    c = config
    hidden = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    for i in range(n_layers):
        p = f"mtp.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes.update(_full_attention_shapes(c, p + "self_attn."))
        shapes.update(_mlp_shapes(c, p + "mlp.", moe=getattr(c, "is_moe", False)))
    return shapes


def expected_vision_tensors(vision_config: dict, *, is_moe: bool) -> dict[str, tuple[int, ...]] | None:
    """`key -> shape` of the vision tower (`model.visual.*`) described by a composite config's `vision_config`.

    Taken from transformers' built-in vision model, built on the meta device (no memory); None when this
    transformers has no Qwen3.5. Raises ValueError / TypeError when the built-in config class rejects the dict.
    """
    import copy

    import torch

    try:
        if is_moe:
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
                Qwen3_5MoeVisionConfig as config_class,
            )
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
                Qwen3_5MoeVisionModel as model_class,
            )
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import (
                Qwen3_5VisionConfig as config_class,
            )
            from transformers.models.qwen3_5.modeling_qwen3_5 import (
                Qwen3_5VisionModel as model_class,
            )
    except ImportError:
        return None
    kwargs = {k: v for k, v in copy.deepcopy(vision_config).items() if k != "model_type"}
    with torch.device("meta"):
        model = model_class(config_class(**kwargs))
    return {f"model.visual.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


__all__ = ["expected_mtp_tensors", "expected_text_tensors", "expected_vision_tensors"]
