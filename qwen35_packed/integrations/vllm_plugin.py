"""vLLM plugin: serve packed Qwen3.5 model folders with vLLM's native Qwen3.5 classes.

Our folders name their architectures `Qwen3_5PackedForCausalLM` / `Qwen3_5MoePackedForCausalLM`, and for the
vision-language models `Qwen3_5PackedForConditionalGeneration` / `Qwen3_5MoePackedForConditionalGeneration` (not the
built-in names, so that TRL picks the remote class). vLLM picks its model class from `architectures`; an unknown
name with `trust_remote_code` falls back to vLLM's Transformers backend, which rejects the linear-attention layers.
This plugin maps our names onto vLLM's own implementations, so `vllm.LLM(model=OUT)` and TRL's colocate mode (which
passes no `hf_overrides`) run the native kernels. The weights need no renaming: our state-dict keys and shapes are
the built-in ones, which vLLM's loader maps itself (q/k/v -> qkv_proj, in_proj_qkv + in_proj_z -> in_proj_qkvz,
in_proj_b + in_proj_a -> in_proj_ba, fused 3D experts).

vLLM loads it through the `vllm.general_plugins` entry point `qwen35_packed` (pyproject.toml) in every process it
starts; `register()` may also be called by hand and is idempotent. Importing this module does not import vLLM.
"""

from __future__ import annotations

# Our architecture name -> vLLM's "module:Class" (model_type is already the built-in one, as vLLM requires).
ARCHITECTURES = {
    "Qwen3_5PackedForCausalLM": "vllm.model_executor.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoePackedForCausalLM": "vllm.model_executor.models.qwen3_5:Qwen3_5MoeForCausalLM",
    # vision-language: vLLM's classes carry their multimodal processor registration (Qwen3-VL's processor)
    "Qwen3_5PackedForConditionalGeneration": "vllm.model_executor.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoePackedForConditionalGeneration": "vllm.model_executor.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
}


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
