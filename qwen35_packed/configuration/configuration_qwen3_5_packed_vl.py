"""Composite (vision-language) configurations of the packed Qwen3.5 models, dense and MoE.

Remote code: copied flat into model folders next to `configuration_qwen3_5_packed.py`, so it imports only the
standard library, transformers and that sibling.

`model_type` is `qwen3_5` / `qwen3_5_moe` and the classes subclass transformers' `Qwen3_5Config` /
`Qwen3_5MoeConfig` (vLLM's multimodal processor checks `isinstance` against them). The only difference from the
built-in classes is `text_config`, which is this project's text configuration (single-source rope, kernel choice,
the fields the built-in ignores); `vision_config` is the built-in vision configuration. Two options steer the
vision tower:
  * `freeze_vision` (default False): the vision tower's parameters get `requires_grad=False` and it runs without
    autograd;
  * `vision_dummy_pass` (default False): a forward without images still runs the vision tower on one tiny
    all-zero image and adds `0 * sum(output)`, so that under FSDP every rank enters the tower's collectives
    (ranks without images would otherwise hang) and its parameters get (zero) gradients on every rank.
"""

from __future__ import annotations

import transformers

from .configuration_qwen3_5_packed import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig

_BuiltinConfig = getattr(transformers, "Qwen3_5Config", None)
_BuiltinMoeConfig = getattr(transformers, "Qwen3_5MoeConfig", None)
if _BuiltinConfig is None or _BuiltinMoeConfig is None:
    raise ImportError(
        f"The packed Qwen3.5 vision-language models need a transformers release with Qwen3.5 "
        f"(transformers.Qwen3_5Config / Qwen3_5MoeConfig); transformers {transformers.__version__} has none. "
        "The text-only classes (Qwen3_5PackedForCausalLM) work without it."
    )


class Qwen3_5PackedVLConfig(_BuiltinConfig):
    """Dense composite config (`model_type` `qwen3_5`): built-in vision config + this project's text config."""

    sub_configs_defaults = {
        "vision_config": transformers.Qwen3_5VisionConfig,
        "text_config": Qwen3_5PackedConfig,
    }

    freeze_vision: bool = False
    vision_dummy_pass: bool = False


class Qwen3_5MoePackedVLConfig(_BuiltinMoeConfig):
    """MoE composite config (`model_type` `qwen3_5_moe`): built-in vision config + this project's MoE text config."""

    sub_configs_defaults = {
        "vision_config": transformers.Qwen3_5MoeVisionConfig,
        "text_config": Qwen3_5MoePackedConfig,
    }

    freeze_vision: bool = False
    vision_dummy_pass: bool = False


__all__ = ["Qwen3_5MoePackedVLConfig", "Qwen3_5PackedVLConfig"]
