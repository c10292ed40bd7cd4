"""qwen35-packed: packed-varlen Qwen3.5 for transformers (remote code), with conversion and training tools.

The model classes are imported from `qwen35_packed.modeling` on first use (`from qwen35_packed import
Qwen3_5PackedForCausalLM`), so that importing the package, e.g. for `qwen35-packed --help`, loads neither torch nor
transformers.
"""

import importlib

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


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(".modeling", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
