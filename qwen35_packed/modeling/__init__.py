"""The remote-code bundle: every `.py` file of this folder except this `__init__.py` is copied flat into a model
folder by `convert`, so they import only torch, transformers, optional kernels, harmless standard-library modules and
each other (`tests/conversion/test_remote_code_audit.py`). The rest of the package imports the bundle from here."""

from .configuration_qwen3_5_packed import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig
from .configuration_qwen3_5_packed_vl import Qwen3_5MoePackedVLConfig, Qwen3_5PackedVLConfig
from .modeling_qwen3_5_packed import (
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5MoePackedForSequenceClassification,
    Qwen3_5MoePackedTextModel,
    Qwen3_5PackedCache,
    Qwen3_5PackedForCausalLM,
    Qwen3_5PackedForSequenceClassification,
    Qwen3_5PackedPreTrainedModel,
    Qwen3_5PackedTextModel,
)
from .modeling_qwen3_5_packed_vl import (
    Qwen3_5MoePackedForConditionalGeneration,
    Qwen3_5PackedForConditionalGeneration,
    Qwen3_5PackedVLModel,
)
from .packing import PackedSequence, build_packed_sequence

__all__ = [
    "PackedSequence",
    "Qwen3_5MoePackedConfig",
    "Qwen3_5MoePackedForCausalLM",
    "Qwen3_5MoePackedForConditionalGeneration",
    "Qwen3_5MoePackedForSequenceClassification",
    "Qwen3_5MoePackedTextModel",
    "Qwen3_5MoePackedVLConfig",
    "Qwen3_5PackedCache",
    "Qwen3_5PackedConfig",
    "Qwen3_5PackedForCausalLM",
    "Qwen3_5PackedForConditionalGeneration",
    "Qwen3_5PackedForSequenceClassification",
    "Qwen3_5PackedPreTrainedModel",
    "Qwen3_5PackedTextModel",
    "Qwen3_5PackedVLConfig",
    "Qwen3_5PackedVLModel",
    "build_packed_sequence",
]
