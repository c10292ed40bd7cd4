"""A ready PEFT `LoraConfig` for packed Qwen3.5 models (dense and MoE).

Target groups (module names as in the official checkpoints):

| group | what PEFT wraps |
|---|---|
| `gdn` | `linear_attn.{in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj}` (nn.Linear) |
| `conv` | `linear_attn.conv1d`, the GDN short conv (depthwise nn.Conv1d); not among the default groups |
| `attention` | `self_attn.{q_proj, k_proj, v_proj, o_proj}` (nn.Linear) |
| `mlp` | dense `mlp.{gate,up,down}_proj` and the MoE `mlp.shared_expert.{gate,up,down}_proj` (nn.Linear) |
| `experts` | the fused 3D expert tensors `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, through PEFT's
  `target_parameters` (ParamWrapper); PEFT supports these only with `lora_dropout=0` |

PEFT's LoRA on the GDN conv (`conv`) needs a rank that is a multiple of the conv's channel count C (its groups):
where `r` is not one, the conv gets rank C through `rank_pattern`, and `alpha_pattern` gives it the scaling
lora_alpha / r of the other modules. Its lora_A is [rank, C, K] per layer, a channel-mixing conv the forward
applies with a PyTorch formula on every conv backend (modeling/conv_lora.py); PEFT cannot merge it, so such an
adapter cannot reach vLLM through the weight sync (integrations/vllm_sync.py refuses it). The router (`mlp.gate`),
`lm_head` and the embeddings are never targeted (TRL refuses adapters on `lm_head`: it projects with the raw
weight).

Merged adapters give the base model's own parameter names and shapes, which are the names vLLM's Qwen3.5 loader
accepts (see `vllm_weight_names`).
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import torch
from torch import nn

GROUPS = ("gdn", "conv", "attention", "mlp", "experts")
DEFAULT_GROUPS = ("gdn", "attention", "mlp", "experts")

_MODULE_PATTERNS = {
    "gdn": r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)",
    "conv": r"linear_attn\.conv1d",
    "attention": r"self_attn\.(q_proj|k_proj|v_proj|o_proj)",
    "mlp": r"mlp\.(shared_expert\.)?(gate_proj|up_proj|down_proj)",
}
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Modules that must not take LoRA, with the reason given to the caller.
_REFUSED = {
    "router": "LoRA on the MoE router (mlp.gate) is not supported: it computes its logits in fp32 from the raw weight.",
    "lm_head": "LoRA on lm_head is not supported: TRL's GRPO projects with the raw lm_head weight and refuses it.",
}


def _model(model_or_config) -> nn.Module:
    """The model itself, or one built from a config on the meta device."""
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
        base = getattr(model, "get_base_model", None)
        if callable(base) and hasattr(model, "peft_config"):
            raise ValueError("pass the model before get_peft_model(): it already carries adapters")
        return model
    from ..modeling import Qwen3_5MoePackedForCausalLM, Qwen3_5PackedForCausalLM

    config = model_or_config
    cls = Qwen3_5MoePackedForCausalLM if getattr(config, "is_moe", False) else Qwen3_5PackedForCausalLM
    with torch.device("meta"):
        return cls(config)


def _layer_names(model: nn.Module) -> list[str]:
    """Module and parameter names of the model."""
    return [name for name, _ in model.named_modules()] + [
        name for name, _ in model.named_parameters(remove_duplicate=False)
    ]


def _conv_patterns(model: nn.Module, r: int, lora_alpha, use_rslora: bool) -> dict:
    """`rank_pattern` / `alpha_pattern` for LoRA on the GDN conv: PEFT takes a rank that is a multiple of the
    conv's groups (its channel count C) only, so where r is not one the conv gets rank C, with the alpha that
    keeps the scaling of the other modules (lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    (channels,) = {m.groups for n, m in model.named_modules() if n.endswith("linear_attn.conv1d")}
    if r % channels == 0:
        return {}
    ratio = math.sqrt(channels / r) if use_rslora else channels / r
    return {
        "rank_pattern": {_MODULE_PATTERNS["conv"]: channels},
        "alpha_pattern": {_MODULE_PATTERNS["conv"]: lora_alpha * ratio},
    }


def target_modules_regex(groups: Iterable[str]) -> str | None:
    """The PEFT `target_modules` regex (full match on module names) for the module groups among `groups`."""
    parts = [_MODULE_PATTERNS[g] for g in groups if g in _MODULE_PATTERNS]
    if not parts:
        return None
    return r".*\.(" + "|".join(parts) + r")"


def lora_config(
    model_or_config,
    r: int = 16,
    lora_alpha: int | None = None,
    lora_dropout: float | None = None,
    targets: Iterable[str] = DEFAULT_GROUPS,
    **lora_kwargs,
):
    """A `peft.LoraConfig` for this model.

    `targets`: groups among `gdn`, `conv`, `attention`, `mlp`, `experts` (default all that exist in the model
    except `conv`; `experts` is skipped silently for a dense model only when left at the default). With `conv`,
    the conv gets rank C (its channel count) unless r is a multiple of C (see the module docstring). `lora_dropout`
    defaults to 0.05, and to 0 when experts are targeted; an explicit dropout > 0 with expert targets raises
    (PEFT's ParamWrapper cannot apply dropout). Every requested group must match at least one module or parameter
    of the model, else ValueError. Extra keyword arguments go to `LoraConfig` (`target_modules` /
    `target_parameters` may not; a `rank_pattern` / `alpha_pattern` given overrides the conv's entries).
    """
    from peft import LoraConfig

    if isinstance(targets, str):
        targets = [targets]
    targets = list(dict.fromkeys(targets))
    explicit_targets = targets != list(DEFAULT_GROUPS)
    for name in targets:
        if name in _REFUSED:
            raise ValueError(_REFUSED[name])
        if name not in GROUPS:
            raise ValueError(f"unknown LoRA target group {name!r}; choose among {list(GROUPS)}")
    if not targets:
        raise ValueError("no LoRA targets: give at least one of " + ", ".join(GROUPS))
    for key in ("target_modules", "target_parameters"):
        if key in lora_kwargs:
            raise ValueError(f"{key} is derived from `targets`; pass target groups instead")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"r must be a positive int, got {r!r}")

    model = _model(model_or_config)
    names = _layer_names(model)
    is_moe = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    if "experts" in targets and not is_moe and not explicit_targets:
        targets.remove("experts")  # the default on a dense model

    for group in targets:
        if group == "experts":
            matched = [n for n in names if n.endswith(EXPERT_PARAMETERS)]
        else:
            pattern = re.compile(target_modules_regex([group]))
            matched = [n for n in names if pattern.fullmatch(n)]
        if not matched:
            raise ValueError(
                f"LoRA target group {group!r} matches nothing in this model "
                f"({'MoE' if is_moe else 'dense'}); groups present: "
                f"{[g for g in GROUPS if _group_present(g, names)]}"
            )

    experts = "experts" in targets
    if lora_dropout is None:
        lora_dropout = 0.0 if experts else 0.05
    if not isinstance(lora_dropout, (int, float)) or isinstance(lora_dropout, bool) or not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout must be a number in [0, 1), got {lora_dropout!r}")
    if experts and lora_dropout > 0:
        raise ValueError(
            f"lora_dropout={lora_dropout} with expert targets: PEFT's target_parameters (the fused "
            "expert tensors) work only with lora_dropout=0; set it to 0 or drop 'experts'"
        )

    lora_alpha = 2 * r if lora_alpha is None else lora_alpha
    if "conv" in targets:
        for key, entries in _conv_patterns(model, r, lora_alpha, lora_kwargs.get("use_rslora", False)).items():
            lora_kwargs[key] = {**entries, **lora_kwargs.get(key, {})}
    module_regex = target_modules_regex(targets)
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=float(lora_dropout),
        target_modules=module_regex if module_regex is not None else [],
        target_parameters=list(EXPERT_PARAMETERS) if experts else None,
        bias=lora_kwargs.pop("bias", "none"),
        task_type=lora_kwargs.pop("task_type", "CAUSAL_LM"),
        **lora_kwargs,
    )


def _group_present(group: str, names: list[str]) -> bool:
    if group == "experts":
        return any(n.endswith(EXPERT_PARAMETERS) for n in names)
    pattern = re.compile(target_modules_regex([group]))
    return any(pattern.fullmatch(n) for n in names)


def trl_cli_args(
    model_or_config, r: int = 16, lora_alpha: int | None = None, targets: Iterable[str] = DEFAULT_GROUPS
) -> list[str]:
    """The `trl grpo` / `trl sft` flags that build the same adapter as `lora_config` through TRL's
    `get_peft_config` (module names there are suffixes, which select the same modules here)."""
    config = lora_config(model_or_config, r=r, lora_alpha=lora_alpha, targets=targets)
    if config.rank_pattern:
        raise ValueError(
            f"TRL's flags give every module the rank --lora_r; LoRA on the GDN conv needs a multiple of its "
            f"{next(iter(config.rank_pattern.values()))} channels: pass r as one, or build the adapter with "
            "lora_config() in Python"
        )
    pattern = re.compile(config.target_modules) if isinstance(config.target_modules, str) else None
    names = sorted(
        {n.rsplit(".", 1)[-1] for n in _layer_names(_model(model_or_config)) if pattern and pattern.fullmatch(n)}
    )
    args = [
        "--use_peft",
        "--lora_r",
        str(config.r),
        "--lora_alpha",
        str(config.lora_alpha),
        "--lora_dropout",
        str(config.lora_dropout),
    ]
    if names:
        args += ["--lora_target_modules", *names]
    if config.target_parameters:
        args += ["--lora_target_parameters", *config.target_parameters]
    return args
