"""A ready PEFT `LoraConfig` for packed Qwen3.5 models (dense and MoE).

Target groups (module names as in the official checkpoints):

| group | what PEFT wraps |
|---|---|
| `gdn` | `linear_attn.{in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj}` (nn.Linear) |
| `attention` | `self_attn.{q_proj, k_proj, v_proj, o_proj}` (nn.Linear) |
| `mlp` | dense `mlp.{gate,up,down}_proj` and the MoE `mlp.shared_expert.{gate,up,down}_proj` (nn.Linear) |
| `experts` | the fused 3D expert tensors `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, through PEFT's
  `target_parameters` (ParamWrapper); PEFT supports these only with `lora_dropout=0` |

The GDN short conv (`linear_attn.conv1d`) is refused: the forward reads `conv1d.weight` directly (so a LoRA layer
around the module would never run), and PEFT's LoRA for a depthwise conv needs `r` to be a multiple of the channel
count and cannot be merged, so it could not reach vLLM either. The router (`mlp.gate`), `lm_head` and the
embeddings are never targeted (TRL refuses adapters on `lm_head`: it projects with the raw weight).

Merged adapters give the base model's own parameter names and shapes, which are the names vLLM's Qwen3.5 loader
accepts (see `vllm_weight_names`).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

GROUPS = ("gdn", "attention", "mlp", "experts")
DEFAULT_GROUPS = GROUPS

_MODULE_PATTERNS = {
    "gdn": r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)",
    "attention": r"self_attn\.(q_proj|k_proj|v_proj|o_proj)",
    "mlp": r"mlp\.(shared_expert\.)?(gate_proj|up_proj|down_proj)",
}
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Modules that must not take LoRA, with the reason given to the caller.
_REFUSED = {
    "conv": "LoRA on the GDN conv (linear_attn.conv1d) is not supported: the forward reads conv1d.weight directly, "
    "so an adapter around the module would silently never run, and PEFT's depthwise-conv LoRA needs r to be "
    "a multiple of the channel count and cannot be merged for vLLM. Train in_proj_qkv instead (the conv's "
    "input) or unfreeze conv1d.weight fully with modules_to_save.",
    "conv1d": None,  # alias, same message
    "router": "LoRA on the MoE router (mlp.gate) is not supported: it computes its logits in fp32 from the raw weight.",
    "lm_head": "LoRA on lm_head is not supported: TRL's GRPO projects with the raw lm_head weight and refuses it.",
}


def _layer_names(model_or_config) -> list[str]:
    """Module names of the model, from an instance or (on the meta device) from a config."""
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
        base = getattr(model, "get_base_model", None)
        if callable(base) and hasattr(model, "peft_config"):
            raise ValueError("pass the model before get_peft_model(): it already carries adapters")
    else:
        from ..modeling import Qwen3_5MoePackedForCausalLM, Qwen3_5PackedForCausalLM

        config = model_or_config
        cls = Qwen3_5MoePackedForCausalLM if getattr(config, "is_moe", False) else Qwen3_5PackedForCausalLM
        with torch.device("meta"):
            model = cls(config)
    return [name for name, _ in model.named_modules()] + [
        name for name, _ in model.named_parameters(remove_duplicate=False)
    ]


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

    `targets`: groups among `gdn`, `attention`, `mlp`, `experts` (default all that exist in the model; `experts`
    is skipped silently for a dense model only when left at the default). `lora_dropout` defaults to 0.05, and to
    0 when experts are targeted; an explicit dropout > 0 with expert targets raises (PEFT's ParamWrapper cannot
    apply dropout). Every requested group must match at least one module or parameter of the model, else
    ValueError. Extra keyword arguments go to `LoraConfig` (`target_modules` / `target_parameters` may not).
    """
    from peft import LoraConfig

    if isinstance(targets, str):
        targets = [targets]
    targets = list(dict.fromkeys(targets))
    explicit_targets = targets != list(DEFAULT_GROUPS)
    for name in targets:
        if name in _REFUSED:
            raise ValueError(_REFUSED[name] or _REFUSED["conv"])
        if name not in GROUPS:
            raise ValueError(f"unknown LoRA target group {name!r}; choose among {list(GROUPS)}")
    if not targets:
        raise ValueError("no LoRA targets: give at least one of " + ", ".join(GROUPS))
    for key in ("target_modules", "target_parameters"):
        if key in lora_kwargs:
            raise ValueError(f"{key} is derived from `targets`; pass target groups instead")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"r must be a positive int, got {r!r}")

    names = _layer_names(model_or_config)
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

    module_regex = target_modules_regex(targets)
    return LoraConfig(
        r=r,
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
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
    pattern = re.compile(config.target_modules) if isinstance(config.target_modules, str) else None
    names = sorted({n.rsplit(".", 1)[-1] for n in _layer_names(model_or_config) if pattern and pattern.fullmatch(n)})
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
