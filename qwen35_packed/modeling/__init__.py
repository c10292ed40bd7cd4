"""The remote-code modeling files. In a model folder they sit flat beside configuration_qwen3_5_packed.py and
import it as `.configuration_qwen3_5_packed`; inside the installed package that file lives in
`qwen35_packed.configuration`, so it is registered here under the flat name (one file, one class identity)."""

import sys

from ..configuration import configuration_qwen3_5_packed as _configuration
from ..configuration import configuration_qwen3_5_packed_vl as _configuration_vl

sys.modules.setdefault(f"{__name__}.configuration_qwen3_5_packed", _configuration)
sys.modules.setdefault(f"{__name__}.configuration_qwen3_5_packed_vl", _configuration_vl)

from .modeling_qwen3_5_packed import (  # noqa: E402
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5MoePackedTextModel,
    Qwen3_5PackedCache,
    Qwen3_5PackedForCausalLM,
    Qwen3_5PackedPreTrainedModel,
    Qwen3_5PackedTextModel,
)
from .modeling_qwen3_5_packed_vl import (  # noqa: E402
    Qwen3_5MoePackedForConditionalGeneration,
    Qwen3_5PackedForConditionalGeneration,
    Qwen3_5PackedVLModel,
)
from .packing import PackedSequence, build_packed_sequence  # noqa: E402

__all__ = [
    "PackedSequence",
    "Qwen3_5MoePackedForCausalLM",
    "Qwen3_5MoePackedForConditionalGeneration",
    "Qwen3_5MoePackedTextModel",
    "Qwen3_5PackedCache",
    "Qwen3_5PackedForCausalLM",
    "Qwen3_5PackedForConditionalGeneration",
    "Qwen3_5PackedPreTrainedModel",
    "Qwen3_5PackedTextModel",
    "Qwen3_5PackedVLModel",
    "build_packed_sequence",
]
