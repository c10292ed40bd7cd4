"""A model's kernels bound once, as callables: `KernelSet`. `kernel_selection.select_kernels` names the backends
for a (device, dtype) and the config's settings; `kernel_set` binds the functions of `kernels.py` (and the Triton
kernel files) those names stand for. This is the one place where a kernel name becomes a function: the layers
call the members and compare no names.

A model resolves its set once per (device, dtype) and kernel settings and keeps it on the instance
(`Qwen3_5PackedTextModel.kernels_for`; dropped on `.to()` and `set_attn_implementation`); a test injects a set of
its own with `inject_kernels`. Under the model's context parallelism the set of a shard wraps the conv, the delta rule
and attention with the exchanges between ranks (context_parallel.py), so the layers do not know they run on a
shard.

The dense projections are no member: they are `RowInvariantLinear` modules, whose product is chosen by the device
(projection.py), because PEFT wraps them as modules and calls them with the input only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from . import context_parallel, kernels, triton_decode, triton_elementwise
from . import reference_kernels as reference
from .expert_lora import low_rank_plan, peft_plan
from .kernel_selection import LONG_DOCUMENT_TOKENS, KernelChoice
from .loss import chunk_cross_entropy
from .triton_gather_sum import gather_sum_rows
from .utils import log_once

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSet:
    """The callables a forward runs, bound for one (device, dtype); `choice` names them."""

    choice: KernelChoice
    # elementwise chains, each an eager formula or its Triton kernel (the same formula)
    rms_norm: Callable  # (x [..., D], weight [D], eps) -> rmsnorm(x) * (1 + weight)
    swiglu: Callable  # (gate, up) -> silu(gate) * up
    sigmoid_gate: Callable  # (x, gate) -> x * sigmoid(gate)
    weighted_swiglu: Callable  # (gate_up [M, 2I], weight [M] fp32) -> silu(gate) * up * weight
    gdn_gates: Callable  # (a, b, A_log, dt_bias) -> (g fp32, beta)
    loss_chunk: Callable  # (logits chunk, targets) -> the chunk's loss terms (loss.chunk_cross_entropy)
    # Gated DeltaNet
    conv: Callable  # (x, weight, packed, split_sizes, initial_state=None, adapters=()) -> (q, k, v)
    delta_rule: Callable  # (q, k, v, g, beta, packed, initial_state=None, output_final_state=False) -> (o, state)
    # the same from an initial state that carries a gradient (a long document's later pieces): FLA's where FlashQLA
    # was chosen, whose kernels take no gradient into the initial state
    delta_rule_from_state: Callable
    gated_norm: Callable  # (x, gate, weight, eps) -> weight * rmsnorm(x) * silu(gate)
    # a generation step with one new token per row, all rows at once (the decode kernels)
    conv_step: Callable  # (x [B, C], weight, state [B, C, K]) -> (silu(conv) [B, C], new state)
    # (q, k, v, g, beta, state [B, Hv, Dk, Dv], out_state=None) -> (o [B, Hv, Dv], new state, in out_state if given)
    delta_rule_step: Callable
    # attention
    attention: Callable  # (q, k, v, packed, scale) -> causal attention within each document
    # (q [Lq, H, D], k / v [Lk, Hkv, D], scale) -> one document's last Lq tokens over its keys so far
    continued_attention: Callable
    cached_attention: Callable  # (q, k, v, packed, cache rows, scale) -> a cached step of several new tokens
    attention_step: Callable  # (q [B, H, D], k, v [B, Hkv, D], cache rows, scale) -> one new token per row
    varlen_attention: Callable  # (q, k, v, cu_seqlens, max_seqlen, scale, causal) -> (the vision tower's)
    # MoE: the experts as one grouped GEMM per projection (else the per-expert loop), the top-k combine
    grouped_experts: bool
    combine: Callable  # (src [M, H], index [G * k], k, addend=None) -> [G, H]: rows of src (+ addend) summed
    expert_lora: Callable  # (experts module) -> (bare experts, LoRA factors) or None (expert_lora.py)


# The Triton form of each eager chain (triton_elementwise.py) and of the generation steps (triton_decode.py: one
# launch each, where the PyTorch steps run a few elementwise kernels and small matmuls per layer and step).
_TRITON_CHAINS = {
    "rms_norm": triton_elementwise.rms_norm,
    "swiglu": triton_elementwise.swiglu,
    "sigmoid_gate": triton_elementwise.sigmoid_gate,
    "weighted_swiglu": triton_elementwise.weighted_swiglu,
    "gdn_gates": triton_elementwise.gdn_gates,
    "conv_step": triton_decode.conv_step_silu,
    "delta_rule_step": triton_decode.delta_rule_step,
}
_EAGER_CHAINS = {
    "rms_norm": reference.zero_centred_rms_norm,
    "swiglu": reference.swiglu,
    "sigmoid_gate": reference.sigmoid_gate,
    "weighted_swiglu": reference.weighted_swiglu,
    "gdn_gates": reference.gdn_gates,
    "conv_step": reference.torch_causal_conv1d_step,
    "delta_rule_step": reference.torch_gated_delta_rule_step,
}
_CONV = {"triton": kernels.conv_triton, "fla": kernels.conv_fla, "compiled": kernels.conv_compiled,
         "torch": kernels.conv_eager}  # fmt: skip
_DELTA_RULE = {
    "flash_qla": kernels.delta_rule_flash_qla,
    "fla": kernels.delta_rule_fla,
    "torch": kernels.delta_rule_torch,
}
_GATED_NORM = {"triton": triton_elementwise.gated_rms_norm, "flash_qla": kernels.gated_rms_norm_fla,
               "fla": kernels.gated_rms_norm_fla, "torch": reference.gated_rms_norm}  # fmt: skip


def gated_norm_backend(choice: KernelChoice) -> str:
    """The GDN output norm's kernel: the Triton one with the Triton elementwise kernels (its tile fixed by the width,
    where FLA's fused one is autotuned per bucket of rows), else the GDN backend's."""
    return "triton" if choice.elementwise == "triton" else choice.gdn


_VARLEN_ATTENTION = {"flash_attn": kernels.attention_flash_attn, "torch_varlen": kernels.attention_torch_varlen,
                     "sdpa": kernels.attention_sdpa}  # fmt: skip


@functools.cache
def kernel_set(choice: KernelChoice) -> KernelSet:
    """The callables `choice` names (one set per distinct choice, shared by every model that makes it)."""
    chains = _TRITON_CHAINS if choice.elementwise == "triton" else _EAGER_CHAINS
    varlen = _VARLEN_ATTENTION[choice.attention]
    return KernelSet(
        choice=choice,
        rms_norm=kernels.flattened_rms_norm(chains["rms_norm"]),
        swiglu=chains["swiglu"],
        sigmoid_gate=chains["sigmoid_gate"],
        weighted_swiglu=chains["weighted_swiglu"],
        gdn_gates=chains["gdn_gates"],
        loss_chunk=kernels.compiled_chain(chunk_cross_entropy)
        if choice.elementwise == "triton"
        else chunk_cross_entropy,
        conv=functools.partial(kernels.causal_conv1d_varlen, stateless=_CONV[choice.conv], backend=choice.conv),
        delta_rule=_DELTA_RULE[choice.gdn],
        delta_rule_from_state=_DELTA_RULE["fla" if choice.gdn == "flash_qla" else choice.gdn],
        gated_norm=_GATED_NORM[gated_norm_backend(choice)],
        conv_step=chains["conv_step"],
        delta_rule_step=chains["delta_rule_step"],
        attention=functools.partial(
            kernels.causal_attention,
            varlen=varlen,
            host_bounds=choice.attention == "sdpa",
            alone_from=LONG_DOCUMENT_TOKENS if choice.long_documents == "sdpa" and choice.attention != "sdpa" else None,
        ),
        continued_attention=functools.partial(
            kernels.continued_attention, varlen=None if choice.attention == "sdpa" else varlen
        ),
        cached_attention=kernels.cached_attention,
        attention_step=kernels.attention_step,
        varlen_attention=varlen,
        grouped_experts=choice.moe == "grouped_mm",
        combine=_gather_sum_triton if choice.combine == "triton" else kernels.gather_sum,
        expert_lora={
            "auto": low_rank_plan,
            "low_rank": functools.partial(low_rank_plan, forced=True),
            "peft": peft_plan,
        }[choice.expert_lora],
    )


def _gather_sum_triton(src, index, group: int, addend=None):
    """kernels.gather_sum in one Triton pass (triton_gather_sum.py, slot order, fp32 accumulation)."""
    return gather_sum_rows(src.contiguous(), index, group, addend=None if addend is None else addend.contiguous())


# The kernels of a module run outside a model's forward (a layer called on its own, the vision tower without a
# text configuration): the PyTorch references.
REFERENCE_KERNELS = kernel_set(KernelChoice(gdn="torch", attention="sdpa"))


def shard_kernel_set(choice: KernelChoice, layout: context_parallel.ShardLayout) -> KernelSet:
    """The kernels of a rank's shard under context parallelism: the conv reads the row's inputs before the shard,
    the delta rule starts the shard's first document from the state the earlier ranks reach, attention reads the
    earlier ranks' keys and values of that document. FLA's Triton delta rule runs where FlashQLA was chosen (a
    shard's first document starts from a state carrying a gradient, and the state maps run with value dim Dk + Dv,
    which FlashQLA's kernels do not take), said once."""
    if choice.gdn == "flash_qla":
        log_once(
            logger,
            "context-parallel-gdn",
            "context parallelism: the GDN layers run FLA's Triton delta rule instead of FlashQLA (initial states "
            "with gradients and state maps of value dim Dk + Dv)",
        )
        choice = dataclasses.replace(choice, gdn="fla")
    whole = kernel_set(choice)
    return dataclasses.replace(
        whole,
        conv=functools.partial(context_parallel.conv_across_shards, conv=whole.conv, layout=layout),
        delta_rule=functools.partial(
            context_parallel.delta_rule_across_shards, delta_rule=whole.delta_rule, layout=layout
        ),
        attention=functools.partial(context_parallel.attention_across_shards, attention=whole.attention, layout=layout),
    )
