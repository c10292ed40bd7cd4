"""PEFT LoRA on the GDN short conv (`linear_attn.conv1d`), applied on the packed stream.

The conv is depthwise: C channels, groups = C, weight [C, 1, K], padding K-1, no bias. PEFT 0.21 wraps an
nn.Conv1d in its LoRA `Conv1d` layer (peft/tuners/lora/layer.py, `_ConvNd`), whose forward adds, for each active
adapter,

    lora_B(lora_A(dropout(x))) * scaling

to the base conv's output, where lora_A = Conv1d(C, r, K, padding=K-1) mixes every input channel (weight
[r, C, K], groups 1) and lora_B = Conv1d(r, C, 1, groups=C) (weight [C, m, 1], m = r / C; PEFT requires r to be a
multiple of the groups), with a bias only under `lora_bias`. Output channel c thus receives
scaling * (sum_i B[c, i] * (A[c*m + i] conv x) + bias[c]): a conv of C x C x K taps once multiplied out, which no
depthwise weight can hold. PEFT refuses to merge it for that reason (NotImplementedError for groups > 1), so the
adapter never sits inside conv1d.weight.

The GDN layer does not call the conv module: its kernels take the depthwise taps and the packed boundaries. So
`effective_conv` reads what PEFT's forward would compute, the base taps and each active adapter's factors, and
with an adapter every conv backend (Triton, FLA, compiled, eager) runs `adapted_causal_conv1d_varlen` instead:

    pre[t] = depthwise taps over window[t] + sum over adapters of scaling * (B grouping of (A . window[t]) + bias)
    out[t] = silu(pre[t])

window[t] [C, K] holds the inputs token t's taps read inside its document (zeros before its start, or the cached
history when decoding and under context parallelism), so packed == per-document holds as for the base conv. The A
product is one row-invariant GEMM ([N, C*K] @ [C*K, r], projection.py) in the adapter's dtype, as PEFT casts the
input to it; the rest is per-token elementwise work in fp32. Cost per adapter and layer: N*C*K*r multiply-adds
each way (r >= C: at least a dense C x C x K conv, where the base conv costs N*C*K) and an [N, C*K] window kept
for the backward.

Dropout (`lora_dropout`) applies to the adapter's input once, before the windows, as PEFT applies it to x before
lora_A: each input is dropped or kept for all the taps that read it, the same distribution as PEFT's (the draws
differ, as they would for any other batch layout).

Refused with a ValueError, where PEFT would compute something this formula does not: a LoRA variant (DoRA) on the
conv; active dropout together with a conv history (cached decoding in training mode, context parallelism in
training: the history's inputs belong to an earlier forward, whose dropout this one cannot repeat); another PEFT
tuner around the conv; forward hooks on PEFT's wrapper (its per-request `adapter_names` works through one);
factors of other shapes or conv settings than PEFT builds; merged adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .projection import row_invariant_linear
from .reference_kernels import causal_conv1d_pre_activation, lagged_input


@dataclass(frozen=True)
class ConvAdapter:
    """One active PEFT LoRA adapter on the conv: `lora_a` [r, C, K], `lora_b` [C, r/C] (lora_B's one tap),
    `bias` [C] or None (`lora_bias`), `scaling`, and PEFT's dropout module (nn.Identity or nn.Dropout)."""

    where: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    bias: torch.Tensor | None
    scaling: float
    dropout: nn.Module

    def pre_activation(
        self,
        x: torch.Tensor,
        position_in_doc: torch.Tensor,
        doc_index: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This adapter's term of the conv's pre-activation for the stream x [N, C], fp32 [N, C]."""
        if initial_state is not None and _drops(self.dropout):
            raise ValueError(
                f"{self.where}: LoRA dropout (p={self.dropout.p}) in training mode with a conv history (cached "
                "decoding or context parallelism): the history's inputs were dropped in an earlier forward, which "
                "this one cannot repeat; set lora_dropout=0, or call model.eval() to decode"
            )
        rank, channels, kernel = self.lora_a.shape
        inputs = self.dropout(x)
        # windows[t, :, j]: the input tap j reads for token t, K-1-j tokens back (A's [C, K] layout)
        lags = range(kernel - 1, -1, -1)
        windows = torch.stack(
            [lagged_input(inputs, lag, position_in_doc, kernel, doc_index, initial_state) for lag in lags], dim=-1
        )
        low = row_invariant_linear(
            windows.reshape(x.shape[0], channels * kernel).to(self.lora_a.dtype), self.lora_a.reshape(rank, -1)
        )
        # lora_B, groups = C: output channel c sums low[c*m : (c+1)*m] weighted by its m taps
        up = (low.float().view(x.shape[0], channels, -1) * self.lora_b.float()).sum(-1)
        if self.bias is not None:
            up = up + self.bias.float()
        return up * self.scaling


@dataclass(frozen=True)
class EffectiveConv:
    """What the GDN conv computes: the base conv's taps `weight` [C, K] and the active LoRA adapters on it."""

    weight: torch.Tensor
    adapters: tuple[ConvAdapter, ...] = ()


def effective_conv(conv: nn.Module, where: str) -> EffectiveConv:
    """The taps and active PEFT LoRA adapters of the GDN conv module `conv` (an nn.Conv1d, PEFT's LoRA wrapper of
    one, or PEFT's modules_to_save wrapper, which resolves `weight` to its active copy itself); `where` names it
    in errors. Raises ValueError for what `adapted_causal_conv1d_varlen` cannot reproduce (module docstring)."""
    base = conv._modules.get("base_layer")  # PEFT's tuner layers keep the module they wrap here
    if base is None:
        return EffectiveConv(conv.weight.squeeze(1))
    kind = f"{type(conv).__module__}.{type(conv).__name__}"
    if not (kind.startswith("peft.") and isinstance(conv._modules.get("lora_A"), nn.ModuleDict)):
        raise ValueError(f"{where} is wrapped by {kind}: the packed conv applies PEFT's LoRA only")
    if not isinstance(base, nn.Conv1d):
        raise ValueError(f"{where}: PEFT's LoRA wraps a {type(base).__name__}, not the layer's nn.Conv1d")
    weight = base.weight.squeeze(1)
    if conv.merged:
        raise ValueError(
            f"{where} has merged LoRA adapters {conv.merged_adapters}: a depthwise conv weight cannot hold a conv "
            "LoRA's channel-mixing delta; unmerge them"
        )
    if conv.disable_adapters:
        return EffectiveConv(weight)
    names = [name for name in conv.active_adapters if name in conv.lora_A]
    if names and (conv._forward_hooks or conv._forward_pre_hooks):
        raise ValueError(
            f"{where}: forward hooks on PEFT's LoRA wrapper (e.g. per-request `adapter_names`) do not run, the "
            "packed conv does not call the module; remove them"
        )
    return EffectiveConv(weight, tuple(_adapter(conv, name, base, f"{where} (adapter {name!r})") for name in names))


def adapted_causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    adapters: tuple[ConvAdapter, ...],
    position_in_doc: torch.Tensor,
    doc_index: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(base conv + every adapter's term) on the packed stream x [N, C], in x's dtype (arguments as
    reference_kernels.torch_causal_conv1d_varlen takes them)."""
    pre = causal_conv1d_pre_activation(x, weight, position_in_doc, doc_index, initial_state)
    for adapter in adapters:
        pre = pre + adapter.pre_activation(x, position_in_doc, doc_index, initial_state)
    return F.silu(pre).to(x.dtype)


def _conv_settings(conv: nn.Conv1d) -> tuple:
    return conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode


def _adapter(conv: nn.Module, name: str, base: nn.Conv1d, where: str) -> ConvAdapter:
    if name in conv.lora_variant or conv.use_dora.get(name, False):
        raise ValueError(f"{where}: DoRA (or another LoRA variant) on the GDN conv is not supported; use plain LoRA")
    lora_a, lora_b, dropout = conv.lora_A[name], conv.lora_B[name], conv.lora_dropout[name]
    # What PEFT's _ConvNd.update_layer builds around this conv; anything else would compute another operator.
    as_built = (
        isinstance(lora_a, nn.Conv1d)
        and isinstance(lora_b, nn.Conv1d)
        and lora_a.in_channels == base.in_channels == base.out_channels == base.groups
        and _conv_settings(lora_a) == (base.kernel_size, (1,), base.padding, (1,), 1, "zeros")
        and base.padding == (base.kernel_size[0] - 1,)
        and lora_a.bias is None
        and lora_b.in_channels == lora_a.out_channels
        and lora_b.out_channels == base.out_channels
        and _conv_settings(lora_b) == ((1,), (1,), (0,), (1,), base.groups, "zeros")
    )
    if not as_built:
        raise ValueError(f"{where}: LoRA factors other than PEFT's conv LoRA builds ({lora_a} -> {lora_b})")
    if not isinstance(dropout, (nn.Identity, nn.Dropout)):
        raise ValueError(f"{where}: LoRA dropout module {type(dropout).__name__}, not nn.Dropout / nn.Identity")
    return ConvAdapter(where, lora_a.weight, lora_b.weight[:, :, 0], lora_b.bias, conv.scaling[name], dropout)


def _drops(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0


__all__ = ["ConvAdapter", "EffectiveConv", "adapted_causal_conv1d_varlen", "effective_conv"]
