"""The kernels of every operation of the model, one function per backend: elementwise chains, the GDN short conv,
the gated delta rule, the gated norm, causal and bidirectional attention, the cached attention of a generation
step, the MoE experts' grouped GEMM and top-k combine. `kernel_selection.py` names the backends that run here,
`kernel_set.py` binds the named ones into a model's `KernelSet`; nothing here chooses. `reference_kernels.py`
holds the PyTorch forms (what CPU runs).

Elementwise chains (zero-centred RMSNorm, SwiGLU, the MoE experts' weighted SwiGLU, the sigmoid output gate, the
GDN gates) run on CUDA as this project's Triton kernels (`triton_elementwise.py`): one launch each way inside an
autograd Function, fp32 inside, and autograd keeps only the bf16 inputs. Elsewhere they run eagerly; the two
compute the same formula. The loss's per-chunk math, which has no kernel of its own, runs through `torch.compile`
on CUDA (`compiled_chain`).

The GDN short conv runs through FLA's `causal_conv1d`, or this project's Triton kernel (`triton_conv.py`: writes q,
k and v as three contiguous outputs and reads their three gradients, so neither the GDN kernel's contiguous copies
nor the split's concatenating backward happen), or the boundary-masked formula compiled (`torch.compile`: a few
fused kernels each way), or that formula eagerly. Every path returns the split outputs. A PEFT LoRA on the conv
runs `conv_lora.py`'s formula on every path; a conv that continues a state (a generation step, a context-parallel
shard) runs the eager formula.

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

# The module, not names: a kernel reads the optional GPU packages' handles at call time.
from . import kernel_selection as selection
from .conv_lora import adapted_causal_conv1d_varlen
from .reference_kernels import sdpa_one_document, torch_causal_conv1d_varlen, torch_gated_delta_rule_varlen
from .triton_conv import causal_conv1d_silu_split
from .utils import log_once

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM (MoE experts)
# --------------------------------------------------------------------------------------------------------------


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (group e = rows offsets[e-1]:offsets[e]) times weight[e]^T: x [M, in],
    weight [E, out, in] (the nn.Linear layout of the fused expert tensors), offsets int32 [E] ending at M."""
    return selection.GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)


def gather_sum(src: torch.Tensor, index: torch.Tensor, group: int, addend: torch.Tensor | None = None) -> torch.Tensor:
    """src[index] summed over consecutive groups of `group` rows (src [M, H], index [G * group] -> [G, H], src's
    dtype): the top-k combine of the grouped experts and its transpose's backward, as an eager gather and
    reduction; with `addend` (src's shape) the rows of `src + addend`. Each group is summed on its own, so a group's
    result does not depend on the others; the Triton form (triton_gather_sum.gather_sum_rows) computes the same in
    one pass, the addend's sum included."""
    if addend is not None:
        src = src + addend
    return src[index].view(-1, group, src.shape[-1]).sum(dim=1)


# --------------------------------------------------------------------------------------------------------------
# Elementwise chains: eager formulas, Triton kernels on CUDA
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def _compiled(fn):
    # dynamic=True: one graph for every token count (packed streams change length every batch).
    return torch.compile(fn, dynamic=True)


def compiled_chain(fn):
    """`fn` (a chain of elementwise ops without a kernel of its own: the loss chunk) through torch.compile, its
    tensor inputs made contiguous: one graph per dtype instead of one per stride pattern."""
    compiled = _compiled(fn)
    return lambda *args: compiled(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))


def flattened_rms_norm(norm):
    """A row norm over [M, D] (eager or Triton) applied to any [..., D]: one kernel serves the hidden-size norms and
    the per-head q/k norms."""

    def rms_norm(x, weight, eps: float):
        """rmsnorm(x) * (1 + weight), in fp32, cast back to x's dtype."""
        shape = x.shape
        return norm(x.reshape(-1, shape[-1]), weight, eps).reshape(shape)

    return rms_norm


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


def conv_triton(x, weight, packed, split_sizes):
    """The Triton conv (triton_conv.py): q | k | v written as separate contiguous tensors."""
    return causal_conv1d_silu_split(x, weight, packed.position_in_doc(), split_sizes)


def conv_fla(x, weight, packed, split_sizes):
    """FLA's causal_conv1d with SiLU over the stream's documents."""
    out, _ = selection.fla_causal_conv1d(
        x.unsqueeze(0),
        weight=weight,
        activation="silu",
        cu_seqlens=packed.cu_seqlens_int64(),
        cu_seqlens_cpu=packed.cu_seqlens_cpu(),
    )
    return torch.split(out.squeeze(0), list(split_sizes), dim=-1)


def conv_compiled(x, weight, packed, split_sizes):
    """The boundary-masked formula through torch.compile."""
    return torch.split(
        _compiled(torch_causal_conv1d_varlen)(x, weight, packed.position_in_doc()), list(split_sizes), dim=-1
    )


def conv_eager(x, weight, packed, split_sizes):
    """The boundary-masked formula (reference_kernels.torch_causal_conv1d_varlen)."""
    return torch.split(torch_causal_conv1d_varlen(x, weight, packed.position_in_doc()), list(split_sizes), dim=-1)


def causal_conv1d_varlen(x, weight, packed, split_sizes, stateless, initial_state=None, adapters=(), backend=""):
    """The GDN short conv (x [N, C], weight [C, K]) -> the outputs of the channel segments `split_sizes` (q | k | v).
    `stateless` (one of the conv_* backends, named `backend`) serves the training / prefill path; a conv continuing
    `initial_state` (the last K-1 inputs of each document's past: a decode step, a context-parallel shard) runs the
    eager formula. With PEFT LoRA `adapters` on the conv (conv_lora.py) every backend runs conv_lora's formula,
    said once."""
    if adapters:
        log_once(
            logger,
            ("conv_lora", backend),
            "qwen35-packed: PEFT LoRA on the GDN conv: the conv runs the PyTorch formula of conv_lora.py (the base "
            "taps plus a channel-mixing conv per adapter) instead of the %r conv backend",
            backend,
        )
        doc_index = packed.doc_index() if initial_state is not None else None
        out = adapted_causal_conv1d_varlen(x, weight, adapters, packed.position_in_doc(), doc_index, initial_state)
    elif initial_state is not None:
        out = torch_causal_conv1d_varlen(x, weight, packed.position_in_doc(), packed.doc_index(), initial_state)
    else:
        return stateless(x, weight, packed, split_sizes)
    return torch.split(out, list(split_sizes), dim=-1)


# --------------------------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------------------------


def delta_rule_flash_qla(q, k, v, g, beta, packed, initial_state=None, output_final_state=False):
    """FlashQLA's chunked gated delta rule, its intra-card split off (see kernel_selection.py); returns
    (o [N, Hv, Dv], final_state [n_docs, Hv, Dk, Dv] fp32 or None)."""
    return _delta_rule_kernel(
        selection.flash_qla_chunk_gated_delta_rule, q, k, v, g, beta, packed, initial_state, output_final_state,
        auto_cp=False,
    )  # fmt: skip


def delta_rule_fla(q, k, v, g, beta, packed, initial_state=None, output_final_state=False):
    """FLA's Triton chunked gated delta rule (it memoises its index helpers by the boundaries' identity and reads
    the host copy)."""
    return _delta_rule_kernel(
        selection.fla_chunk_gated_delta_rule, q, k, v, g, beta, packed, initial_state, output_final_state,
        cu_seqlens_cpu=packed.cu_seqlens_cpu(),
    )  # fmt: skip


def delta_rule_torch(q, k, v, g, beta, packed, initial_state=None, output_final_state=False):
    """The per-document reference (reference_kernels.torch_gated_delta_rule_varlen)."""
    return torch_gated_delta_rule_varlen(q, k, v, g, beta, packed.cu_seqlens_cpu(), initial_state, output_final_state)


def _delta_rule_kernel(kernel, q, k, v, g, beta, packed, initial_state, output_final_state, **extra):
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


# --------------------------------------------------------------------------------------------------------------
# Gated RMSNorm (GDN output norm)
# --------------------------------------------------------------------------------------------------------------


def gated_rms_norm_fla(x, gate, weight, eps):
    """weight * rmsnorm(x) * silu(gate) through FLA's fused kernel (norm and gate in fp32, as the reference
    computes them, reference_kernels.gated_rms_norm)."""
    shape = x.shape
    out = selection.fla_rms_norm_gated(
        x=x.reshape(-1, shape[-1]), g=gate.reshape(-1, shape[-1]), weight=weight, bias=None, activation="silu", eps=eps
    )
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------------------------
# Causal varlen attention
# --------------------------------------------------------------------------------------------------------------


def attention_flash_attn(
    q, k, v, cu_seqlens, max_seqlen: int, scale: float, causal: bool, cu_seqlens_k=None, max_seqlen_k=None
) -> torch.Tensor:
    """flash-attn's varlen kernel inside each document of cu_seqlens; q [N, H, D], k / v [N, Hkv, D] -> [N, H, D].
    With `cu_seqlens_k` the keys' documents are bounded apart from the queries' (`continued_attention`)."""
    cu_k, max_k = (cu_seqlens, max_seqlen) if cu_seqlens_k is None else (cu_seqlens_k, max_seqlen_k)
    return selection.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, softmax_scale=scale, causal=causal)  # fmt: skip


def attention_torch_varlen(
    q, k, v, cu_seqlens, max_seqlen: int, scale: float, causal: bool, cu_seqlens_k=None, max_seqlen_k=None
) -> torch.Tensor:
    """PyTorch's varlen_attn inside each document of cu_seqlens (`cu_seqlens_k` as attention_flash_attn's)."""
    cu_k, max_k = (cu_seqlens, max_seqlen) if cu_seqlens_k is None else (cu_seqlens_k, max_seqlen_k)
    # varlen_attn has no is_causal flag: window (-1, 0) = unlimited left context, no right context.
    return selection.torch_varlen_attn(
        q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, scale=scale, window_size=(-1, 0) if causal else (-1, -1)
    )


def attention_sdpa(q, k, v, cu_seqlens, max_seqlen: int, scale: float, causal: bool) -> torch.Tensor:
    """SDPA per document of cu_seqlens (read on the host: pass a CPU copy where one exists)."""
    bounds = cu_seqlens.tolist()
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


def causal_attention(q, k, v, packed, scale: float, varlen, host_bounds: bool, alone_from: int | None):
    """Causal attention within each document of a PackedSequence (the text model's attention layers) through the
    varlen backend `varlen` (one of the attention_* functions; `host_bounds`: it reads the boundaries on the host,
    so it gets the stream's CPU copy).

    With `alone_from` (the kernel set binds `kernel_selection.LONG_DOCUMENT_TOKENS` where long documents run alone),
    every document of at least that many tokens runs alone through `sdpa_long_document` and the runs of shorter
    documents between them through `varlen`. Which kernel a document gets depends on its own length only, so packed
    == per-document holds as it does for either kernel alone."""
    if alone_from is not None:
        segments = packed.attention_segments(alone_from)
        if any(segment.alone for segment in segments):
            outs = [
                sdpa_long_document(q[seg.start : seg.end], k[seg.start : seg.end], v[seg.start : seg.end], scale)
                if seg.alone
                else varlen(
                    q[seg.start : seg.end],
                    k[seg.start : seg.end],
                    v[seg.start : seg.end],
                    seg.cu_seqlens,
                    seg.max_seqlen,
                    scale,
                    True,
                )
                for seg in segments
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs)
    bounds = packed.cu_seqlens_cpu() if host_bounds else packed.cu_seqlens
    return varlen(q, k, v, bounds, packed.max_seqlen, scale, True)


def continued_attention(q, k, v, scale: float, varlen) -> torch.Tensor:
    """Causal attention of one document's last Lq tokens (q [Lq, H, D]) over its keys so far (k / v [Lk, Hkv, D],
    the queries' own last): a later piece of a document that layer_pieces.py cut. Through the varlen kernel `varlen`
    with the keys bounded apart from the queries (flash-attn's and PyTorch's varlen kernels align a causal mask to
    the end of the keys), or, where `varlen` is None (the sdpa attention kernel), SDPA with the mask."""
    if varlen is None:
        return sdpa_one_document(q, k, v, scale, causal=True)
    q_len, k_len = q.shape[0], k.shape[0]
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=q.device) for n in (q_len, k_len))
    return varlen(q, k, v, cu_q, q_len, scale, True, cu_seqlens_k=cu_k, max_seqlen_k=k_len)


def cached_attention(q, k, v, packed, rows, scale: float) -> torch.Tensor:
    """A cached step of several new tokens in some row: each document of the stream is one batch row continuing its
    cached keys / values (`rows`: the layer's cache entry, extended here by the new ones).
    Causal with an offset: query i sees every cached key plus the new keys up to itself."""
    bounds = packed.cu_seqlens_cpu().tolist()
    rows.append(k, v, bounds)
    keys, values = rows.key_rows, rows.value_rows
    outs = [
        sdpa_one_document(q[start:end], keys[row], values[row], scale, causal=True)
        for row, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))
        if end > start
    ]
    return torch.cat(outs)


def attention_step(q, k, v, rows, scale: float) -> torch.Tensor:
    """A generation step with one new token per row, all rows in one SDPA call: q [B, H, D] and k / v [B, Hkv, D]
    of the new tokens; `rows` (the layer's cache entry) takes the new keys / values first, then every row's query
    attends to the row's keys, the padding of shorter rows masked out. The query heads that share a key head are
    that head's queries ([B, Hkv, H / Hkv, D]), so no key is repeated per query head."""
    rows.append_one_each(k, v)
    # A static cache attends over its whole capacity: the same shapes every step, so a CUDA graph replays it.
    longest = rows.capacity if rows.static else max(rows.host_lengths)
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    keys, values = (buffer[:, :longest].transpose(1, 2) for buffer in (rows.key_buffer, rows.value_buffer))
    visible = torch.arange(longest, device=q.device)[None, :] < rows.lengths[:, None]  # [B, longest]
    out = F.scaled_dot_product_attention(
        q.reshape(batch, kv_heads, heads // kv_heads, dim).to(keys.dtype),
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, heads, dim).to(q.dtype)
