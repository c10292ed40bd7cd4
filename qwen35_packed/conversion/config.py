"""config.json of a converted (packed, text-only) checkpoint, from the source's config.json."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..configuration.configuration_qwen3_5_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5PackedConfig,
    resolve_rope_parameters,
)
from .errors import ConversionError

TEXT_MODEL_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True}  # model_type -> is MoE
COMPOSITE_MODEL_TYPES = {"qwen3_5": False, "qwen3_5_moe": True}
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")

CONFIG_MODULE = "configuration_qwen3_5_packed"
MODELING_MODULE = "modeling_qwen3_5_packed"
ARCHITECTURES = {False: "Qwen3_5PackedForCausalLM", True: "Qwen3_5MoePackedForCausalLM"}
CONFIG_CLASSES = {False: Qwen3_5PackedConfig, True: Qwen3_5MoePackedConfig}

# Keys of a source config that describe the file, not the model; they are not carried over.
_NOT_CARRIED = ("architectures", "auto_map", "transformers_version", "_name_or_path")


@dataclass
class OutputConfig:
    """The converted config: `data` is written as config.json; `config` is the validated project config object."""

    data: dict
    config: Qwen3_5PackedConfig
    is_moe: bool
    source_layout: str  # "text" or "composite"
    notes: list[str]  # lines to print (warnings about the conversion)


def detect_layout(src_config: dict) -> str:
    """'composite' for the official vision-language layout (text_config + vision_config), else 'text'."""
    if "text_config" in src_config or src_config.get("model_type") in COMPOSITE_MODEL_TYPES:
        return "composite"
    return "text"


def auto_map(is_moe: bool) -> dict:
    arch = ARCHITECTURES[is_moe]
    return {
        "AutoConfig": f"{CONFIG_MODULE}.{CONFIG_CLASSES[is_moe].__name__}",
        "AutoModelForCausalLM": f"{MODELING_MODULE}.{arch}",
    }


def build_output_config(src_config: dict, *, text_only: bool) -> OutputConfig:
    """Normalise a source config.json (text or composite layout) into this project's text config.

    Raises ConversionError for a composite source without `text_only`, an unknown model_type, contradicting rope or
    tie settings, and anything the project's config class rejects.
    """
    notes: list[str] = []
    layout = detect_layout(src_config)
    if layout == "composite":
        if not text_only:
            raise ConversionError(
                f"SRC is a composite vision-language Qwen3.5 checkpoint (model_type "
                f"{src_config.get('model_type')!r}, text_config + vision_config). Converting the VLM is not available "
                "yet; pass --text-only to convert its language model (the vision tower and the MTP head are dropped)."
            )
        text = src_config.get("text_config")
        if not isinstance(text, dict):
            raise ConversionError("SRC config.json: composite config without a text_config dict")
        text = copy.deepcopy(text)
        top_rope = [k for k in ROPE_KEYS if src_config.get(k) is not None]
        if top_rope:
            raise ConversionError(
                f"SRC config.json has rope settings at the top level ({', '.join(top_rope)}); the language model reads "
                "rope only from text_config, so they would be ignored or contradict it. Move them into text_config "
                "(or remove them) and convert again."
            )
        # transformers' composite class ties (or not) by the top-level flag; its text_config's flag is not used (and
        # transformers 5 itself saves composite configs with tie true at the top and false in text_config). The
        # small official models carry true in both places; the larger ones only at the top level (false).
        top_tie, text_tie = src_config.get("tie_word_embeddings"), text.get("tie_word_embeddings")
        if top_tie is not None:
            if text_tie is not None and bool(text_tie) != bool(top_tie):
                notes.append(
                    f"note: text_config.tie_word_embeddings is {text_tie} but the top-level value, which transformers' "
                    f"composite class uses, is {top_tie}; the converted model uses {bool(top_tie)}."
                )
            text["tie_word_embeddings"] = bool(top_tie)
        model_type = text.get("model_type")
        if model_type is None:
            is_moe = COMPOSITE_MODEL_TYPES.get(src_config.get("model_type"))
            if is_moe is None:
                raise ConversionError(
                    "SRC config.json: cannot tell dense from MoE (no model_type in text_config, top-level model_type "
                    f"{src_config.get('model_type')!r})"
                )
            model_type = "qwen3_5_moe_text" if is_moe else "qwen3_5_text"
    else:
        text = copy.deepcopy(src_config)
        model_type = text.get("model_type")
    if model_type not in TEXT_MODEL_TYPES:
        raise ConversionError(
            f"SRC config.json: model_type {model_type!r} is not a Qwen3.5 text model; expected one of "
            f"{sorted(TEXT_MODEL_TYPES)} (or a composite {sorted(COMPOSITE_MODEL_TYPES)} with --text-only)"
        )
    is_moe = TEXT_MODEL_TYPES[model_type]

    for key in _NOT_CARRIED:
        text.pop(key, None)
    try:
        rope = resolve_rope_parameters(
            text.pop("rope_parameters", None),
            text.pop("rope_scaling", None),
            text.pop("rope_theta", None),
            text.pop("partial_rotary_factor", None),
        )
    except ValueError as exc:
        raise ConversionError(f"SRC config.json: {exc}") from exc
    text["rope_parameters"] = rope
    # Legacy mirrors for v4-style readers; equal to rope_parameters by construction.
    text["rope_theta"] = rope["rope_theta"]
    text["partial_rotary_factor"] = rope["partial_rotary_factor"]
    text["model_type"] = model_type
    text["architectures"] = [ARCHITECTURES[is_moe]]
    text["auto_map"] = auto_map(is_moe)
    text.setdefault("tie_word_embeddings", False)

    try:
        config = CONFIG_CLASSES[is_moe](**copy.deepcopy(text))
    except (ValueError, TypeError) as exc:
        raise ConversionError(f"SRC config.json is not a valid {model_type} config: {exc}") from exc

    coef = getattr(config, "router_aux_loss_coef", 0.0)
    if is_moe and coef > 0:
        notes.append(
            f"warning: router_aux_loss_coef is {coef} (> 0). In qwen35-packed the load-balancing loss is added to the "
            "loss only when router logits are requested (output_router_logits=True); other stacks (transformers' "
            "built-in class with output_router_logits, TRL's MoE handling) may add it silently, which adds a "
            "gradient that is not part of the objective and hurts RL. Set router_aux_loss_coef to 0 in config.json "
            "for RL if in doubt."
        )
    return OutputConfig(data=text, config=config, is_moe=is_moe, source_layout=layout, notes=notes)


def summarize(out: OutputConfig) -> str:
    c = out.config
    full = sum(t == "full_attention" for t in c.layer_types)
    parts = [
        f"model_type {c.model_type}",
        f"architectures {out.data['architectures']}",
        f"{c.num_hidden_layers} layers ({c.num_hidden_layers - full} GDN / {full} full attention)",
        f"hidden {c.hidden_size}",
        f"vocab {c.vocab_size}",
        f"tie_word_embeddings {c.tie_word_embeddings}",
    ]
    if out.is_moe:
        parts.append(
            f"experts {c.num_experts} top-{c.num_experts_per_tok} (expert I {c.moe_intermediate_size}, shared I "
            f"{c.shared_expert_intermediate_size}), router_aux_loss_coef {c.router_aux_loss_coef}"
        )
    else:
        parts.append(f"intermediate {c.intermediate_size}")
    r = c.rope_parameters
    parts.append(
        f"rope theta {r['rope_theta']:g}, partial_rotary_factor {r['partial_rotary_factor']}, mrope_section "
        f"{r['mrope_section']}, interleaved {r['mrope_interleaved']}"
    )
    return "; ".join(parts)


__all__ = ["OutputConfig", "auto_map", "build_output_config", "detect_layout", "summarize"]
