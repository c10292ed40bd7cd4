"""The configuration classes. Their files belong to the remote-code bundle and live in `qwen35_packed/modeling/`;
this package keeps the import paths `qwen35_packed.configuration[.configuration_qwen3_5_packed[_vl]]` working."""

from ..modeling.configuration_qwen3_5_packed import (
    QWEN3_5_ROPE_DEFAULTS,
    Qwen3_5MoePackedConfig,
    Qwen3_5PackedConfig,
    resolve_rope_parameters,
)
from ..modeling.configuration_qwen3_5_packed_vl import Qwen3_5MoePackedVLConfig, Qwen3_5PackedVLConfig

__all__ = [
    "QWEN3_5_ROPE_DEFAULTS",
    "Qwen3_5MoePackedConfig",
    "Qwen3_5MoePackedVLConfig",
    "Qwen3_5PackedConfig",
    "Qwen3_5PackedVLConfig",
    "resolve_rope_parameters",
]
