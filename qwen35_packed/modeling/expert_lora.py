"""PEFT LoRA on the fused expert tensors, applied to the expert rows instead of folded into the weight.

PEFT's `target_parameters` wraps the experts module in a `ParamWrapper` per adapted tensor. Around the wrapped
forward it registers a parametrization on the tensor, so that reading `experts.gate_up_proj` returns the adapted
weight: with one active adapter `W + scaling * lhs @ rhs` (PEFT's `_LoraFactorsProxy`, one `baddbmm`), with
several, or a low-precision base, `W + delta` from a delta it has already built (`_LoraParameterProxy`). For our
layout W [E, out, in], lhs is lora_B per expert [E, out, r] and rhs lora_A per expert [E, r, in].

`expert_weight` reads that parametrization instead of the attribute. Where it holds PEFT's factors, the experts
multiply their rows x of expert e by

    x @ W_e^T + ((x @ A_e^T) * scaling) @ B_e^T

on the grouped path as three grouped GEMMs over the same expert offsets (the base one and two of rank r), on the
loop path as three matmuls per expert. Mathematically the adapted weight's product; in floating point the sums
are ordered differently, as any change of GEMM is. Nothing else changes: the adapter's parameters, its saved
format, merging (PEFT's `merge_and_unload` writes `W + delta` into the base tensor and removes the wrapper, and the
forward then has no parametrization to read), disabling (PEFT then registers none) and scaling (read from the
factors PEFT hands over on every forward, so `use_rslora`, `lora_alpha` and `scale_layer` apply).

Cost per adapted tensor and layer, M = tokens x top-k expert rows, base frozen:

* the fold builds the adapted [E, out, in] weight in the forward (E*out*in*r multiply-adds, a weight-sized write)
  and keeps it for the backward; the backward then computes the full weight gradient of the expert GEMM
  (M*out*in multiply-adds, as many as the forward product, and a weight-sized tensor) only to reduce it to the
  factors' gradients through two more weight-sized batched products;
* the low-rank products cost M*r*(in + out) multiply-adds each way, keep an [M, r] intermediate (the rows
  themselves are kept, or recomputed, for the base product already), and the frozen base gets no weight gradient.

So the saving grows with E*out*in against M*r: at the 35B-A3B's 256 experts, no weight-sized tensor exists per
layer. grouped_mm needs 16-byte aligned strides, so the rank is zero-padded to a multiple of RANK_ALIGNMENT there
(the padded rows and columns contribute exact zeros).

`moe_lora_kernel` (config, via KernelChoice.expert_lora): "auto" takes the low-rank products where PEFT hands over
its factors and otherwise PEFT's own path, saying why once; "low_rank" raises instead of falling back; "peft"
always reads the adapted weight (the comparison). PEFT itself refuses dropout, DoRA and biases on these tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from .configuration_qwen3_5_packed import first_time, log_once
from .kernels import KernelChoice, grouped_linear

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
        out = grouped_linear(x, self.base, offsets)
        if self.lora_a is None:
            return out
        pad = -self.lora_a.shape[1] % RANK_ALIGNMENT
        lora_a, lora_b = self.lora_a, self.lora_b
        if pad:
            lora_a, lora_b = F.pad(lora_a, (0, 0, 0, pad)), F.pad(lora_b, (0, pad))
        low = grouped_linear(x, lora_a.contiguous(), offsets) * self.scaling
        # In place: the base product's output is no GEMM's saved input, so autograd allows it and no third
        # [M, out] tensor is allocated.
        return out.add_(grouped_linear(low, lora_b.contiguous(), offsets))


def expert_weight(module: torch.nn.Module, name: str, choice: KernelChoice | None = None) -> ExpertWeight:
    """The tensor `module.<name>` [E, out, in] as the forward multiplies by it (see the module docstring)."""
    if not parametrize.is_parametrized(module, name):
        return ExpertWeight(getattr(module, name))
    mode = choice.expert_lora if choice is not None else "auto"
    if mode == "peft":
        return ExpertWeight(getattr(module, name))
    chain = module.parametrizations[name]
    factors, why_not = _peft_factors(chain)
    if factors is not None:
        if first_time(("expert_lora", "low_rank")):
            logger.info("qwen35-packed: PEFT LoRA on the MoE experts applied as low-rank products on the expert rows")
        return ExpertWeight(chain.original, *factors)
    if mode == "low_rank":
        raise RuntimeError(f"moe_lora_kernel='low_rank' was forced but experts.{name} {why_not}")
    log_once(
        logger,
        ("expert_lora", "peft", name, why_not),
        "qwen35-packed: LoRA on experts.%s runs PEFT's own path (the adapted [experts, out, in] weight rebuilt "
        "every forward) because it %s",
        name,
        why_not,
    )
    return ExpertWeight(getattr(module, name))


def _peft_factors(chain) -> tuple[tuple | None, str]:
    """((lora_a [E, r, in], lora_b [E, out, r], scaling), "") from PEFT's single-adapter parametrization, else
    (None, why not)."""
    if len(chain) != 1:
        return None, f"carries {len(chain)} parametrizations, not PEFT's LoRA alone"
    proxy = chain[0]
    # PEFT is no import of the remote-code bundle: its proxies are recognised by module and class name.
    peft_kind = type(proxy).__name__ if type(proxy).__module__.startswith("peft.") else None
    if peft_kind == "_LoraParameterProxy":
        return None, "gets a prebuilt delta from PEFT (several active adapters, a low-precision base or one expert)"
    if peft_kind != "_LoraFactorsProxy":
        return None, f"is parametrized by {type(proxy).__module__}.{type(proxy).__name__}, not PEFT's LoRA factors"
    base, lhs, rhs = chain.original, proxy.lhs, proxy.rhs
    experts, out_features, in_features = base.shape
    rank = rhs.shape[1]
    if tuple(lhs.shape) != (experts, out_features, rank) or tuple(rhs.shape) != (experts, rank, in_features):
        return None, f"has LoRA factors of shapes {tuple(lhs.shape)} @ {tuple(rhs.shape)}, not [E, out, r] @ [E, r, in]"
    return (rhs, lhs, float(proxy.scaling)), ""
