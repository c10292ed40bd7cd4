"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for packed Qwen3.5 with A_log / dt_bias kept fp32.

Under bf16 mixed precision FSDP2 gathers every parameter of a unit in `param_dtype`, and a unit must hold one
dtype. A_log and dt_bias set the GDN decay, which compounds over the whole sequence, so the model keeps them fp32
(modeling/gated_deltanet.py); gathered in bf16 they would be rounded before every forward. `shard_gdn_decay_fp32`
gives them units of their own: each GatedDeltaNet's child modules (projections, conv, norm) become one bf16 unit,
and the GatedDeltaNet itself, which then directly owns only A_log and dt_bias, a unit gathered in fp32 that leaves
its inputs' dtype alone. Call it before Accelerate prepares the model (Accelerate skips modules already sharded and
wraps the decoder layers and the root as its config says):

    accelerator = Accelerator()                      # accelerate launch --config_file examples/accelerate/fsdp2.yaml
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    shard_gdn_decay_fp32(model, accelerator.state.fsdp_plugin.mixed_precision_policy)
    model, optimizer = accelerator.prepare(model, optimizer)

With a Trainer (TRL's included), call it after the trainer is built and before `train()`.
"""

from __future__ import annotations

import torch
from torch import nn


def shard_gdn_decay_fp32(model: nn.Module, mp_policy=None, mesh=None, reshard_after_forward: bool = True) -> int:
    """Shard every GatedDeltaNet of `model` (a PEFT model too) as described above; returns how many.

    `mp_policy`: the MixedPrecisionPolicy of the rest of the model (Accelerate's
    `accelerator.state.fsdp_plugin.mixed_precision_policy`); None means no casting. Must run before the decoder
    layers and the root are sharded. Raises if the model has no GDN layer or is already sharded there."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    decay_policy = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=False
    )
    count = 0
    for name, module in gated_deltanet_modules(model):
        if isinstance(module, FSDPModule):
            raise ValueError(f"{name} is already sharded: call shard_gdn_decay_fp32 before Accelerate / fully_shard")
        for param_name in ("A_log", "dt_bias"):
            param = module._parameters[param_name]
            if param.dtype != torch.float32:
                raise ValueError(
                    f"{name}.{param_name} is {param.dtype}; load the model in fp32 (mixed precision "
                    "casts the other parameters for compute)"
                )
        fully_shard(
            list(module.children()), mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
        fully_shard(module, mesh=mesh, mp_policy=decay_policy, reshard_after_forward=reshard_after_forward)
        count += 1
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no GatedDeltaNet layer to shard")
    return count


def gated_deltanet_modules(model: nn.Module):
    """(name, module) of every GDN layer, found by class name through the MRO: the class may come from
    transformers_modules (remote code) and FSDP2 swaps it for a subclass."""
    for name, module in model.named_modules():
        if any(cls.__name__ == "GatedDeltaNet" for cls in type(module).__mro__):
            yield name, module
