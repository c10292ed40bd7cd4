"""PEFT LoRA on the fused expert tensors, applied to the expert rows instead of folded into the weight.

PEFT's `target_parameters` wraps the experts module in one `ParamWrapper` per adapted tensor (nested: the outer
wraps the inner, the innermost the experts). Each wrapper's forward registers a parametrization on its tensor for
the duration of the wrapped call, so that reading `experts.gate_up_proj` returns the adapted weight: with one
active adapter `W + scaling * lhs @ rhs` (one `baddbmm`; `get_delta_factors` gives lhs = lora_B per expert
[E, out, r] and rhs = lora_A per expert [E, r, in] for our layout W [E, out, in]), with several adapters or a
low-precision base `W + delta` from a delta it builds first. Registering already evaluates the parametrization
once (torch checks its shape and dtype), and the expert GEMMs then multiply by the adapted weight.

`low_rank_plan` recognises that chain in the state where each wrapper would fold exactly one adapter and returns
the bare experts with PEFT's own factors, so that the wrappers' forwards (and their parametrizations) do not run.
The experts multiply their rows x of expert e by

    x @ W_e^T + ((x @ A_e^T) * scaling) @ B_e^T

on the grouped path as three grouped GEMMs over the same expert offsets (the base one and two of rank r), on the
loop path as three matmuls per expert. Mathematically the adapted weight's product; in floating point the sums
are ordered differently, as with any change of GEMM. Nothing else changes: the adapter's parameters and saved
format, merging (PEFT's `merge_and_unload` writes `W + delta` into the base tensor and removes the wrappers),
scaling (`get_delta_factors` reads it on every forward: `lora_alpha`, `use_rslora`, `scale_layer`). Every other
state runs PEFT's own forward: disabled or merged adapters (PEFT then adapts nothing, and unmerges a disabled
merged one), and, saying why once, what the products do not cover (several active adapters, an fp8 base, forward
hooks on a wrapper). PEFT itself refuses dropout, DoRA and biases on these tensors.

Cost per adapted tensor and layer, M = tokens x top-k expert rows, base frozen:

* PEFT's fold builds the adapted [E, out, in] weight in the forward (E*out*in*r multiply-adds and a weight-sized
  write, twice: the registration check and the read) and keeps it for the backward; the backward computes the
  full weight gradient of the expert GEMM (M*out*in multiply-adds, as many as the forward product, into a
  weight-sized tensor) only to reduce it to the factors' gradients through two more weight-sized batched products;
* the low-rank products cost M*r*(in + out) multiply-adds each way and keep an [M, r] intermediate (the rows
  themselves are kept, or recomputed, for the base product already); the frozen base gets no weight gradient and
  no weight-sized tensor exists.

grouped_mm needs 16-byte aligned strides, so the rank is zero-padded to a multiple of RANK_ALIGNMENT there (the
padded rows and columns contribute exact zeros).

`moe_lora_kernel` (config; the kernel set binds its `expert_lora` to `low_rank_plan` or `peft_plan`): "auto" as
above on every device (in bf16 on the GPU the products are as close to PEFT's fp32 path as PEFT's own bf16 path:
tests/gpu/test_gpu.py); "low_rank" (`forced=True`) raises where "auto" would fall back for a reason it states;
"peft" always runs PEFT's forward (the comparison).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels import grouped_linear
from .utils import first_time, log_once

logger = logging.getLogger(__name__)

RANK_ALIGNMENT = 8  # grouped_mm wants strides of 16 bytes: 8 bf16 (or 4 fp32) elements


@dataclass(frozen=True)
class ExpertWeight:
    """One fused expert tensor as the experts multiply by it: `base` [E, out, in] and, when a LoRA adapter is
    applied on the rows, its factors `lora_a` [E, r, in], `lora_b` [E, out, r] and `scaling`."""

    base: torch.Tensor
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    scaling: float = 1.0

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [n, in] (rows of one expert) -> [n, out]."""
        out = F.linear(x, self.base[expert])
        if self.lora_a is None:
            return out
        return out + F.linear(F.linear(x, self.lora_a[expert]) * self.scaling, self.lora_b[expert])

    def grouped_linear(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [M, in] grouped by expert (see kernels.grouped_linear) -> [M, out]."""
        out, adapter_out = self.grouped_parts(x, offsets)
        # In place: the base product's output is no GEMM's saved input, so autograd allows it and no third
        # [M, out] tensor is allocated.
        return out if adapter_out is None else out.add_(adapter_out)

    def grouped_parts(self, x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the base product [M, out], the adapter's [M, out] or None): what `grouped_linear` sums, for a consumer
        that reads both and sums them itself (the MoE's combine) instead of a pass over their sum."""
        out = grouped_linear(x, self.base, offsets)
        if self.lora_a is None:
            return out, None
        pad = -self.lora_a.shape[1] % RANK_ALIGNMENT
        lora_a, lora_b = self.lora_a, self.lora_b
        if pad:
            lora_a, lora_b = F.pad(lora_a, (0, 0, 0, pad)), F.pad(lora_b, (0, pad))
        low = grouped_linear(x, lora_a.contiguous(), offsets) * self.scaling
        return out, grouped_linear(low, lora_b.contiguous(), offsets)


def peft_plan(experts: torch.nn.Module) -> None:
    """No plan: `experts` (PEFT's wrappers, if any) run their own forward."""
    return None


def low_rank_plan(experts: torch.nn.Module, forced: bool = False):
    """(bare experts, {tensor name: (lora_a, lora_b, scaling)}) when `experts` is PEFT's ParamWrapper chain in the
    state the low-rank products cover, else None: call `experts` itself (see the module docstring). `forced`: a
    chain the products do not cover raises instead."""
    if not _is_param_wrapper(experts):
        return None
    factors, module = {}, experts
    while _is_param_wrapper(module):
        name = module.parameter_name
        if module.disable_adapters or module.merged:
            return None  # PEFT's forward adapts nothing then (and unmerges a disabled merged adapter)
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        found, why_not = _wrapper_factors(module, adapters)
        if why_not is not None:
            if forced:
                raise RuntimeError(f"moe_lora_kernel='low_rank' was forced but experts.{name} {why_not}")
            log_once(
                logger,
                ("expert_lora", name, why_not),
                "qwen35-packed: LoRA on experts.%s runs PEFT's own path (the adapted [experts, out, in] weight "
                "rebuilt every forward) because it %s",
                name,
                why_not,
            )
            return None
        if found is not None:
            factors[name] = found
        module = module.base_layer
    if first_time(("expert_lora", "low_rank")):
        logger.info("qwen35-packed: PEFT LoRA on the MoE experts applied as low-rank products on the expert rows")
    return module, factors


def _is_param_wrapper(module) -> bool:
    # PEFT is no import of the remote-code bundle: its wrapper is recognised by module and class name.
    return type(module).__name__ == "ParamWrapper" and type(module).__module__.startswith("peft.")


def _wrapper_factors(wrapper, adapters: list[str]):
    """(factors, None): PEFT's one active adapter on this wrapper's tensor as (lora_a [E, r, in], lora_b [E, out, r],
    scaling); (None, None): no active adapter of it; (None, why): PEFT's forward would do what the low-rank
    products do not."""
    if len(adapters) > 1:
        return None, f"has {len(adapters)} active adapters ({', '.join(adapters)})"
    if wrapper._forward_hooks or wrapper._forward_pre_hooks:
        return None, "has forward hooks on PEFT's wrapper, which the low-rank path would not run"
    if not adapters:
        return None, None
    if not hasattr(wrapper, "get_delta_factors"):
        return None, "is wrapped by a PEFT without ParamWrapper.get_delta_factors"
    param = wrapper.get_param()
    if param.dtype.itemsize == 1:
        return None, f"has a {param.dtype} base weight, which PEFT upcasts to add its delta"
    experts, out_features, in_features = param.shape
    lhs, rhs, scaling = wrapper.get_delta_factors(adapters[0])
    rank = rhs.shape[1]
    if tuple(lhs.shape) != (experts, out_features, rank) or tuple(rhs.shape) != (experts, rank, in_features):
        return None, f"has LoRA factors {tuple(lhs.shape)} @ {tuple(rhs.shape)}, not [E, out, r] @ [E, r, in]"
    return (rhs, lhs, float(scaling)), None
