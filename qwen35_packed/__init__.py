"""qwen35-packed: packed-varlen Qwen3.5 for transformers (remote code), with conversion and training tools."""

from .modeling import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5MoePackedForConditionalGeneration,
    Qwen3_5MoePackedForSequenceClassification,
    Qwen3_5MoePackedVLConfig,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
    Qwen3_5PackedForConditionalGeneration,
    Qwen3_5PackedForSequenceClassification,
    Qwen3_5PackedVLConfig,
)

__version__ = "0.1.0"

__all__ = [
    "Qwen3_5MoePackedConfig",
    "Qwen3_5MoePackedForCausalLM",
    "Qwen3_5MoePackedForConditionalGeneration",
    "Qwen3_5MoePackedForSequenceClassification",
    "Qwen3_5MoePackedVLConfig",
    "Qwen3_5PackedConfig",
    "Qwen3_5PackedForCausalLM",
    "Qwen3_5PackedForConditionalGeneration",
    "Qwen3_5PackedForSequenceClassification",
    "Qwen3_5PackedVLConfig",
]
