"""Kernel dispatch: each operation of the model (elementwise chains, the GDN short conv, the gated delta rule, the
gated norm, causal and bidirectional attention, the MoE experts' grouped GEMM and top-k combine) called through the
kernel a `KernelChoice` names: `kernel_selection.py` picks it, `reference_kernels.py` holds the PyTorch forms.

Elementwise chains (zero-centred RMSNorm, SwiGLU, the MoE experts' weighted SwiGLU, the sigmoid output gate, the
GDN gates) run on CUDA as this project's Triton kernels (`triton_elementwise.py`): one launch each way inside an
autograd Function, fp32 inside, and autograd keeps only the bf16 inputs (the fp32 intermediates of the eager chain
were a large share of activation memory). Elsewhere they run eagerly; the two compute the same formula. The loss's
per-chunk math, which has no kernel of its own, runs through `torch.compile` on CUDA.

The GDN short conv runs through FLA's `causal_conv1d`, or this project's Triton kernel (`triton_conv.py`: writes q,
k and v as three contiguous outputs and reads their three gradients, so neither the GDN kernel's contiguous copies
nor the split's concatenating backward happen), or the boundary-masked formula compiled (`torch.compile`: a few
fused kernels each way), or that formula eagerly. Every path returns the split outputs. A PEFT LoRA on the conv
runs `conv_lora.py`'s formula on every path.

Varlen kernels read the boundaries from the PackedSequence, built once per forward: FLA gets the same int64
cu_seqlens object and a CPU copy in every layer (its index helpers are memoised by tensor identity and would
otherwise copy the boundaries to the host in every layer's forward and backward), per-document loops iterate over
the CPU copy: the dispatch reads nothing back from the device in any layer.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

# Modules, not names, where dispatch reads an attribute at call time (the GPU kernels' handles, the long-document
# threshold): a test can swap a reference in for a kernel that needs a GPU.
from . import kernel_selection as selection
from . import reference_kernels as reference
from . import triton_elementwise
from .conv_lora import adapted_causal_conv1d_varlen
from .kernel_selection import KernelChoice
from .reference_kernels import sdpa_one_document, torch_causal_conv1d_varlen, torch_gated_delta_rule_varlen
from .triton_conv import causal_conv1d_silu_split
from .triton_gather_sum import gather_sum_rows
from .utils import log_once

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM (MoE experts)
# --------------------------------------------------------------------------------------------------------------


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (group e = rows offsets[e-1]:offsets[e]) times weight[e]^T: x [M, in],
    weight [E, out, in] (the nn.Linear layout of the fused expert tensors), offsets int32 [E] ending at M."""
    return selection.GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)


def gather_sum(src: torch.Tensor, index: torch.Tensor, group: int, choice: KernelChoice | None = None) -> torch.Tensor:
    """src[index] summed over consecutive groups of `group` rows (src [M, H], index [G * group] -> [G, H], fp32
    accumulation, src's dtype): the top-k combine of the grouped experts and its transpose's backward. Each group is
    summed on its own, so a group's result does not depend on the others. choice.combine == "triton": one pass
    (triton_gather_sum.py, in slot order); else the eager gather and reduction."""
    if choice is not None and choice.combine == "triton":
        return gather_sum_rows(src.contiguous(), index, group)
    return src[index].view(-1, group, src.shape[-1]).sum(dim=1)


# --------------------------------------------------------------------------------------------------------------
# Elementwise chains: eager formulas, Triton kernels on CUDA
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def _compiled(fn):
    # dynamic=True: one graph for every token count (packed streams change length every batch).
    return torch.compile(fn, dynamic=True)


def _triton_form(fn):
    """The Triton kernel form of an eager chain (triton_elementwise.py), or None where there is none."""
    return {
        reference.zero_centred_rms_norm: triton_elementwise.rms_norm,
        reference.swiglu: triton_elementwise.swiglu,
        reference.sigmoid_gate: triton_elementwise.sigmoid_gate,
        reference.weighted_swiglu: triton_elementwise.weighted_swiglu,
        reference.gdn_gates: triton_elementwise.gdn_gates,
    }.get(fn)


def elementwise(fn, choice):
    if choice is None or choice.elementwise == "eager":
        return fn
    triton_form = _triton_form(fn)
    if triton_form is not None:
        return triton_form
    compiled = _compiled(fn)  # a chain without a kernel of its own (the loss chunk)
    # Contiguous inputs: one graph per dtype instead of one per stride pattern.
    return lambda *args: compiled(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))


def zero_centred_rms_norm(x, weight, eps: float, choice: KernelChoice | None = None):
    """rmsnorm(x) * (1 + weight), in fp32, cast back to x's dtype. Inputs are flattened to 2-D: one kernel serves
    the hidden-size norms and the per-head q/k norms."""
    shape = x.shape
    return elementwise(reference.zero_centred_rms_norm, choice)(x.reshape(-1, shape[-1]), weight, eps).reshape(shape)


def swiglu(gate, up, choice: KernelChoice | None = None):
    """silu(gate) * up."""
    return elementwise(reference.swiglu, choice)(gate, up)


def sigmoid_gate(x, gate, choice: KernelChoice | None = None):
    """x * sigmoid(gate), same shapes."""
    return elementwise(reference.sigmoid_gate, choice)(x, gate)


def gdn_gates(a, b, a_log, dt_bias, choice: KernelChoice | None = None):
    """The GDN decay g = -exp(A_log) * softplus(a + dt_bias) in fp32 (log space) and beta = sigmoid(b) in b's
    dtype: a, b [N, Hv]; A_log, dt_bias [Hv] fp32. One Triton kernel each way with elementwise="triton", else
    eager."""
    return elementwise(reference.gdn_gates, choice)(a, b, a_log, dt_bias)


def weighted_swiglu(gate_up, weight, choice: KernelChoice | None = None):
    """silu(gate) * up * weight in fp32, cast to gate_up's dtype: gate_up [M, 2I] (gate | up halves), weight [M]
    fp32 (the routing weight of each expert row)."""
    return elementwise(reference.weighted_swiglu, choice)(gate_up, weight)


# --------------------------------------------------------------------------------------------------------------
# Causal depthwise conv over a packed stream
# --------------------------------------------------------------------------------------------------------------


def conv_final_state(
    x: torch.Tensor, cu_seqlens: torch.Tensor, kernel: int, initial_state: torch.Tensor | None = None
) -> torch.Tensor:
    """The last K-1 conv inputs of every document ([n_docs, C, K-1]), reaching into `initial_state` for short ones."""
    n_docs = cu_seqlens.numel() - 1
    ends = cu_seqlens[1:].long()
    lengths = ends - cu_seqlens[:-1].long()
    offsets = torch.arange(-(kernel - 1), 0, device=x.device)  # positions relative to the document end
    rel = lengths.unsqueeze(1) + offsets  # position inside the document, may be negative
    idx = (ends.unsqueeze(1) + offsets).clamp(min=0)
    state = x[idx].permute(0, 2, 1)  # [n_docs, C, K-1]
    before = (rel < 0).unsqueeze(1)
    if initial_state is None:
        history = torch.zeros_like(state)
    else:
        hist_idx = (rel + kernel - 1).clamp(min=0, max=kernel - 2)
        history = torch.gather(initial_state.to(x.dtype), 2, hist_idx.unsqueeze(1).expand(n_docs, x.shape[1], -1))
    return torch.where(before, history, state)


def causal_conv1d_varlen(x, weight, packed, choice: KernelChoice, split_sizes, initial_state=None, adapters=()):
    """Dispatch for the GDN short conv (x [N, C], weight [C, K]); returns the outputs of the channel segments
    `split_sizes` (q | k | v). The Triton kernel writes them as separate contiguous tensors; the other paths split
    their [N, C] output into views. FLA, Triton and the compiled formula serve the stateless training / prefill path;
    decode steps with a cached state run the eager formula. With PEFT LoRA `adapters` on the conv (conv_lora.py)
    every backend runs conv_lora's formula, said once."""
    if adapters:
        log_once(
            logger,
            ("conv_lora", choice.conv),
            "qwen35-packed: PEFT LoRA on the GDN conv: the conv runs the PyTorch formula of conv_lora.py (the base "
            "taps plus a channel-mixing conv per adapter) instead of the %r conv backend",
            choice.conv,
        )
        doc_index = packed.doc_index() if initial_state is not None else None
        out = adapted_causal_conv1d_varlen(x, weight, adapters, packed.position_in_doc(), doc_index, initial_state)
    elif initial_state is not None:
        out = torch_causal_conv1d_varlen(x, weight, packed.position_in_doc(), packed.doc_index(), initial_state)
    elif choice.conv == "triton":
        return causal_conv1d_silu_split(x, weight, packed.position_in_doc(), split_sizes)
    elif choice.conv == "fla":
        out, _ = selection.fla_causal_conv1d(
            x.unsqueeze(0),
            weight=weight,
            activation="silu",
            cu_seqlens=packed.cu_seqlens_int64(),
            cu_seqlens_cpu=packed.cu_seqlens_cpu(),
        )
        out = out.squeeze(0)
    else:
        conv = _compiled(torch_causal_conv1d_varlen) if choice.conv == "compiled" else torch_causal_conv1d_varlen
        out = conv(x, weight, packed.position_in_doc())
    return torch.split(out, list(split_sizes), dim=-1)


# --------------------------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------------------------


def gated_delta_rule_varlen(
    q, k, v, g, beta, packed, choice: KernelChoice, initial_state=None, output_final_state=False
):
    """Dispatch; returns (o [N, Hv, Dv], final_state [n_docs, Hv, Dk, Dv] fp32 or None)."""
    if choice.gdn in ("flash_qla", "fla"):
        if choice.gdn == "flash_qla":  # its intra-card split off: see the module docstring
            kernel, extra = selection.flash_qla_chunk_gated_delta_rule, {"auto_cp": False}
        else:  # FLA memoises its index helpers by the boundaries' identity and reads the host copy
            kernel, extra = selection.fla_chunk_gated_delta_rule, {"cu_seqlens_cpu": packed.cu_seqlens_cpu()}
        o, final = kernel(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g.unsqueeze(0),
            beta.unsqueeze(0),
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=packed.cu_seqlens_int64(),
            **extra,
        )
        return o.squeeze(0), (final.float() if final is not None else None)
    return torch_gated_delta_rule_varlen(q, k, v, g, beta, packed.cu_seqlens_cpu(), initial_state, output_final_state)


# --------------------------------------------------------------------------------------------------------------
# Gated RMSNorm (GDN output norm)
# --------------------------------------------------------------------------------------------------------------


def gated_rms_norm(x, gate, weight, eps, choice: KernelChoice):
    """weight * rmsnorm(x) * silu(gate): norm in fp32, gate in fp32, as the reference computes it."""
    if choice.gdn in ("fla", "flash_qla"):
        shape = x.shape
        out = selection.fla_rms_norm_gated(
            x=x.reshape(-1, shape[-1]),
            g=gate.reshape(-1, shape[-1]),
            weight=weight,
            bias=None,
            activation="silu",
            eps=eps,
        )
        return out.reshape(shape)
    return reference.gated_rms_norm(x, gate, weight, eps)


# --------------------------------------------------------------------------------------------------------------
# Causal varlen attention
# --------------------------------------------------------------------------------------------------------------


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen: int,
    scale: float,
    kernel: str,
    causal: bool,
    host_cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention inside each document of cu_seqlens, causal or full; `kernel` is a KernelChoice.attention.
    q [N, H, D], k / v [N, Hkv, D] -> [N, H, D]. The per-document SDPA loop reads the boundaries from
    `host_cu_seqlens` when given (no device-to-host copy), else from cu_seqlens."""
    if kernel == "flash_attn":
        return selection.flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal
        )
    if kernel == "torch_varlen":
        # varlen_attn has no is_causal flag: window (-1, 0) = unlimited left context, no right context.
        return selection.torch_varlen_attn(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            scale=scale,
            window_size=(-1, 0) if causal else (-1, -1),
        )
    bounds = (cu_seqlens if host_cu_seqlens is None else host_cu_seqlens).tolist()
    return torch.cat(
        [
            sdpa_one_document(q[start:end], k[start:end], v[start:end], scale, causal)
            for start, end in zip(bounds[:-1], bounds[1:])
        ]
    )


def sdpa_long_document(q, k, v, scale: float) -> torch.Tensor:
    """Causal SDPA over one document in the layout transformers' SDPA attention passes ([1, heads, length, dim],
    grouped-query heads through `enable_gqa`), where torch may pick cuDNN's flash attention; q [L, H, D],
    k / v [L, Hkv, D] -> [L, H, D]."""
    qd, kd, vd = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def varlen_causal_attention(q, k, v, packed, scale: float, choice: KernelChoice) -> torch.Tensor:
    """Causal attention within each document of a PackedSequence (the text model's attention layers).

    With `long_documents="sdpa"` and a varlen attention kernel, every document of at least `kernel_selection.LONG_DOCUMENT_TOKENS`
    runs alone through `sdpa_long_document` and the runs of shorter documents between them through the varlen
    kernel. Which kernel a document gets depends on its own length only, so packed == per-document holds as it does
    for either kernel alone."""
    if choice.long_documents == "sdpa" and choice.attention != "sdpa":
        segments = packed.attention_segments(selection.LONG_DOCUMENT_TOKENS)
        if any(segment.alone for segment in segments):
            outs = [
                sdpa_long_document(q[seg.start : seg.end], k[seg.start : seg.end], v[seg.start : seg.end], scale)
                if seg.alone
                else varlen_attention(
                    q[seg.start : seg.end],
                    k[seg.start : seg.end],
                    v[seg.start : seg.end],
                    seg.cu_seqlens,
                    seg.max_seqlen,
                    scale,
                    choice.attention,
                    True,
                )
                for seg in segments
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs)
    host = packed.cu_seqlens_cpu() if choice.attention == "sdpa" else None
    return varlen_attention(q, k, v, packed.cu_seqlens, packed.max_seqlen, scale, choice.attention, True, host)


def varlen_bidirectional_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float, kernel: str):
    """Full (non-causal) attention inside each segment of cu_seqlens (the vision tower's images)."""
    return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, kernel, causal=False)
