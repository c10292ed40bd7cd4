"""Pushing trainer weights into a running vLLM engine on CPU (TRL colocate mode).

TRL's colocate sync calls `model.load_weights([(name, tensor)])` once per tensor on the engine's model. vLLM's CPU
backend cannot take that: after loading, `dispatch_cpu_unquantized_gemm` (vllm/model_executor/layers/utils.py,
vLLM 0.32) packs every linear weight into a oneDNN / SGL handle and replaces `layer.weight` by an empty Parameter
without `weight_loader`. So `load_weights` raises (AttributeError `weight_loader` for merged projections such as
in_proj_qkvz / qkv_proj, a shape assertion against the empty weight for the others), and, were it to succeed, the
packed handle would still be what the layer computes with. vLLM's in-place reload (`model_runner.reload_weights`,
vllm/model_executor/model_loader/reload) restores the layers' loading state, loads, and packs again: that is the
push used here, once per sync with all tensors, under the names TRL sends.
"""

from __future__ import annotations

import types


def push_weights(llm, named_tensors) -> list[str]:
    """Push (name, tensor) pairs into the engine as `model_runner.reload_weights(weights_iterator=...)` does
    (restore the layers' loading state, `load_weights`, pack again), then reset the prefix cache. Returns the
    engine's parameters that the pushed names did not cover (vLLM's loader maps checkpoint names onto them:
    q/k/v -> qkv_proj, in_proj_qkv + in_proj_z -> in_proj_qkvz, ...); empty when every weight arrived."""
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
    llm.reset_prefix_cache()
    return sorted(expected - set(loaded or ()))


def vllm_runs_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def use_reload_sync(vllm_generation) -> None:
    """Make a TRL `VLLMGeneration` in colocate mode sync through `push_weights`: TRL's own name iteration
    (`_iter_named_params`: PEFT merge, prefix stripping, unmerge) into one in-place reload."""

    def sync_weights(self):
        not_covered = push_weights(self.llm, self._iter_named_params())
        if not_covered:
            raise RuntimeError(f"weight sync left vLLM parameters unloaded: {not_covered}")

    if vllm_generation.mode != "colocate":
        raise ValueError("use_reload_sync applies to colocate mode only")
    vllm_generation.sync_weights = types.MethodType(sync_weights, vllm_generation)
