"""vLLM plugin: serve packed Qwen3.5 model folders with vLLM's native Qwen3.5 classes.

Our folders name their architectures `Qwen3_5PackedForCausalLM` / `Qwen3_5MoePackedForCausalLM`, and for the
vision-language models `Qwen3_5PackedForConditionalGeneration` / `Qwen3_5MoePackedForConditionalGeneration` (not the
built-in names, so that TRL picks the remote class). vLLM picks its model class from `architectures`; an unknown
name with `trust_remote_code` falls back to vLLM's Transformers backend, which rejects the linear-attention layers.
This plugin maps our names onto vLLM's own implementations, so `vllm.LLM(model=OUT)` and TRL's colocate mode (which
passes no `hf_overrides`) run the native kernels. The weights need no renaming: our state-dict keys and shapes are
the built-in ones, which vLLM's loader maps itself (q/k/v -> qkv_proj, in_proj_qkv + in_proj_z -> in_proj_qkvz,
in_proj_b + in_proj_a -> in_proj_ba, fused 3D experts).

Sequence-classification (reward / value) folders (`Qwen3_5PackedForSequenceClassification` /
`Qwen3_5MoePackedForSequenceClassification`) are not served through vLLM by this package: no name is registered for
them, and this package's vLLM tools refuse them up front (`refuse_unserved_folder`) instead of letting vLLM pick a
class for them.

vLLM loads it through the `vllm.general_plugins` entry point `qwen35_packed` (pyproject.toml) in every process it
starts; `register()` may also be called by hand and is idempotent. Importing this module does not import vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

# Our architecture name -> vLLM's "module:Class" (model_type is already the built-in one, as vLLM requires).
ARCHITECTURES = {
    "Qwen3_5PackedForCausalLM": "vllm.model_executor.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoePackedForCausalLM": "vllm.model_executor.models.qwen3_5:Qwen3_5MoeForCausalLM",
    # vision-language: vLLM's classes carry their multimodal processor registration (Qwen3-VL's processor)
    "Qwen3_5PackedForConditionalGeneration": "vllm.model_executor.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoePackedForConditionalGeneration": "vllm.model_executor.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
}


def refuse_unserved_folder(model_dir) -> None:
    """Raise ValueError for a folder whose model this package does not serve through vLLM: a sequence-classification
    (reward / value) model (vLLM would have to pick some other class for its architecture name)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architecture = (config.get("architectures") or [""])[0]
    if architecture.endswith("ForSequenceClassification"):
        raise ValueError(
            f"{model_dir} holds a sequence-classification (reward / value) model ({architecture}): this package "
            "serves causal-LM and vision-language Qwen3.5 models through vLLM, not reward models (its plugin maps "
            "no vLLM class for this name); score with the transformers class (AutoModelForSequenceClassification "
            "with trust_remote_code)"
        )


def register() -> list[str]:
    """Register the architecture names with vLLM's ModelRegistry; returns the names newly registered."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    added = []
    for name, target in ARCHITECTURES.items():
        if name not in supported:
            ModelRegistry.register_model(name, target)
            added.append(name)
    return added
