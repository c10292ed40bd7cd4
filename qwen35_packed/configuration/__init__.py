from .configuration_qwen3_5_packed import (
    QWEN3_5_ROPE_DEFAULTS,
    Qwen3_5MoePackedConfig,
    Qwen3_5PackedConfig,
    resolve_rope_parameters,
)

__all__ = ["QWEN3_5_ROPE_DEFAULTS", "Qwen3_5MoePackedConfig", "Qwen3_5PackedConfig", "resolve_rope_parameters"]
