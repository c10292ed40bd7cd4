"""Pushing trainer weights into a running vLLM engine on CPU (TRL colocate mode).

TRL's colocate sync calls `model.load_weights([(name, tensor)])` once per tensor on the engine's model. vLLM's CPU
backend cannot take that: after loading, `dispatch_cpu_unquantized_gemm` (vllm/model_executor/layers/utils.py,
vLLM 0.32) packs every linear weight into a oneDNN / SGL handle and replaces `layer.weight` by an empty Parameter
without `weight_loader`. So `load_weights` raises (AttributeError `weight_loader` for merged projections such as
in_proj_qkvz / qkv_proj, a shape assertion against the empty weight for the others), and, were it to succeed, the
packed handle would still be what the layer computes with. vLLM's in-place reload (`model_runner.reload_weights`,
vllm/model_executor/model_loader/reload) restores the layers' loading state, loads, and packs again: that is the
push used here, once per sync with all tensors, under the names TRL sends (`trl_patches.configure_colocate_sync`
makes it the sync of TRL's colocate vLLM on CPU).

MoE on CPU needs one more step. On a reload, vLLM 0.32's `UnquantizedFusedMoEMethod._setup_kernel`
(vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py) copies the new expert weights into the
existing storage but skips `moe_kernel.fused_experts.process_weights_after_loading(layer)` ("setup moe kernel only
on the first call"), which on CPU is what packs them into the grouped-GEMM layout (`cpu_moe.py`,
`cpu_prepack_moe_weight`). The CPU MoE kernel then reads checkpoint-layout weights as packed ones: after any reload,
even of unchanged weights, its outputs are garbage (mean KL ~7 against the model). `push_weights` runs that packing
step for the CPU experts after the reload; the parity test checks the result.
"""

from __future__ import annotations

import torch


def push_weights(llm, named_tensors, reset_encoder_cache: bool = True) -> list[str]:
    """Push (name, tensor) pairs into the engine as `model_runner.reload_weights(weights_iterator=...)` does
    (restore the layers' loading state, `load_weights`, pack again), then reset the engine's caches
    (`reset_engine_caches`; `reset_encoder_cache=False` leaves the image embeddings cached, only to measure what
    that does). Returns the engine's parameters that the pushed names did not cover (vLLM's loader maps checkpoint
    names onto them: q/k/v -> qkv_proj, in_proj_qkv + in_proj_z -> in_proj_qkvz, ...); empty when every weight
    arrived."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    model = runner.get_model()
    expected = {name for name, _ in model.named_parameters()}
    initialize_layerwise_reload(model)
    loaded = model.load_weights(iter(named_tensors))
    finalize_layerwise_reload(model, runner.vllm_config.model_config)
    _repack_cpu_experts(model)
    if reset_encoder_cache:
        reset_engine_caches(llm)
    else:
        llm.reset_prefix_cache()
    return sorted(expected - set(loaded or ()))


def reset_engine_caches(llm) -> None:
    """Forget what the old weights computed: the prefix (KV) cache, and the encoder cache. vLLM keeps an image's
    vision embeddings after its request ends and reuses them for any later request with the same image (keyed by
    content hash, vllm/v1/core/encoder_cache_manager.py); TRL's sync resets only the prefix cache."""
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()


def _repack_cpu_experts(model) -> None:
    """Run the CPU experts' packing that vLLM's reload skips (see the module doc)."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not type(experts).__module__.endswith(".cpu_moe"):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise NotImplementedError(
                "pushing MoE weights into vLLM-CPU with a padded expert intermediate size "
                f"({config.intermediate_size_per_partition} -> {experts._padded_intermediate_size(config)}) is not "
                "supported: vLLM's reload copies unpadded weights into padded storage"
            )
        experts.process_weights_after_loading(module)


def check_adapters_mergeable(model) -> None:
    """Raise ValueError where the weight sync cannot give vLLM the trainer's model: every sync (TRL's, and the
    reload sync of `trl_patches.configure_colocate_sync` through TRL's name iteration) merges the PEFT adapters into
    the base weights first, and a LoRA on a GDN conv cannot be merged (its delta mixes channels, which the depthwise
    conv weight vLLM loads cannot hold; PEFT raises NotImplementedError after merging the other modules)."""
    convs = [
        name
        for name, module in model.named_modules()
        if name.endswith("linear_attn.conv1d") and isinstance(module._modules.get("lora_A"), torch.nn.ModuleDict)
    ]
    if convs:
        raise ValueError(
            f"the vLLM weight sync merges the adapters into the base weights, and PEFT's LoRA on the GDN conv "
            f"({len(convs)} modules, {convs[0]} first) cannot be merged: its delta mixes the conv's channels. Train "
            "without the conv target to generate with vLLM, or generate with the trainer's model (use_vllm=False)"
        )


def vllm_runs_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
