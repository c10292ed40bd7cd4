from .configuration_qwen3_5_packed import (
    QWEN3_5_ROPE_DEFAULTS,
    Qwen3_5MoePackedConfig,
    Qwen3_5PackedConfig,
    resolve_rope_parameters,
)
from .configuration_qwen3_5_packed_vl import Qwen3_5MoePackedVLConfig, Qwen3_5PackedVLConfig

__all__ = [
    "QWEN3_5_ROPE_DEFAULTS",
    "Qwen3_5MoePackedConfig",
    "Qwen3_5MoePackedVLConfig",
    "Qwen3_5PackedConfig",
    "Qwen3_5PackedVLConfig",
    "resolve_rope_parameters",
]
