"""Kernel dispatch: the one place where GDN, conv, gated-norm and attention kernels are chosen.

GPU: FLA's `chunk_gated_delta_rule` (varlen via cu_seqlens, qk l2-norm in kernel), FLA's `causal_conv1d` with
cu_seqlens, FLA's fused gated RMSNorm; attention through flash-attn varlen when importable, else PyTorch's
`varlen_attn`, else SDPA per document. CPU (or `gdn_kernel="torch"`): pure-PyTorch paths below, exact for packed
input (per-document chunked delta rule, boundary-masked conv).

Elementwise chains (zero-centred RMSNorm, SwiGLU, the MoE experts' weighted SwiGLU, the sigmoid output gate, the
GDN gates) run on CUDA as this project's Triton kernels (`triton_elementwise.py`): one launch each way inside an
autograd Function, fp32 inside, and autograd keeps only the bf16 inputs, not the eager chain's fp32 intermediates.
Elsewhere they run eagerly; the two compute the same formula. The loss's per-chunk math, which has no kernel of its
own, runs through `torch.compile` on CUDA.

The GDN short conv runs through FLA's `causal_conv1d`, or this project's Triton kernel (`triton_conv.py`: writes q,
k and v as three contiguous outputs and reads their three gradients, so neither the GDN kernel's contiguous copies
nor the split's concatenating backward happen), or the boundary-masked formula below compiled the same way
(`torch.compile`: a few fused kernels each way), or that formula eagerly. Every path returns the split outputs.

Varlen kernels read the boundaries from the PackedSequence, built once per forward: FLA gets the same int64
cu_seqlens object and a CPU copy in every layer (its index helpers are memoised by tensor identity and would
otherwise copy the boundaries to the host in every layer's forward and backward), per-document loops iterate over
the CPU copy: the dispatch reads nothing back from the device in any layer.

GDN recurrence backends: "flash_qla" (FlashQLA's fused TileLang forward and backward, called directly with its
intra-card split `auto_cp` off: FlashQLA decides that split from the whole batch's lengths, so a long document
would be computed in other pieces alone than packed; with it off a document's result depends on itself only),
"fla" (FLA's Triton kernels, called behind FLA's backend dispatcher so that no other backend is picked silently),
"torch" (the per-document reference below). "auto" takes the first that runs here, in that order; FlashQLA
needs Hopper or Blackwell, bf16 / fp16 and key and value head dims of 128 (every Qwen3.5 GDN).

`config.gdn_kernel` ("auto" | "flash_qla" | "fla" | "torch"), `config.conv_kernel` ("auto" | "fla" | "triton" | "compiled" |
"torch"),
`config.attention_kernel` ("auto" | "flash_attn" | "torch_varlen" | "sdpa"), `config.long_document_attention`
("auto" | "varlen" | "sdpa": see `varlen_causal_attention`), `config.elementwise_kernel`
("auto" | "triton" | "eager") and, for MoE models, `config.moe_kernel` ("auto" | "grouped_mm" | "loop") and
`config.moe_combine_kernel` ("auto" | "triton" | "eager": the grouped experts' top-k combine) and
`config.moe_lora_kernel` ("auto" | "low_rank" | "peft": PEFT LoRA on the experts, see expert_lora.py) force a path;
forcing one that cannot run raises. The choice is logged once per
distinct (device, choice). A missing kernel may cost speed, never correctness.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import triton_elementwise
from .triton_conv import TRITON_CONV_AVAILABLE, causal_conv1d_silu_split
from .triton_gather_sum import TRITON_GATHER_SUM_AVAILABLE, gather_sum_rows
from .utils import first_time

logger = logging.getLogger(__name__)

try:  # optional: flash-linear-attention
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_dispatched_gated_delta_rule

    try:
        from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d
    except ImportError:
        from fla.modules.convolution import causal_conv1d as _fla_causal_conv1d
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
    except ImportError:
        from fla.modules.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
    # FLA's entry point dispatches to another backend where one is installed (FlashQLA, with its own intra-card
    # split of long sequences chosen from the whole batch); this project picks the GDN backend itself
    # (gdn_kernel), so "fla" means FLA's own Triton kernels: the function behind the dispatcher.
    _fla_chunk_gated_delta_rule = inspect.unwrap(_fla_dispatched_gated_delta_rule)
    FLA_AVAILABLE = True
except Exception:  # ImportError, or FLA failing to import its Triton parts
    FLA_AVAILABLE = False

try:  # optional: FlashQLA (the Qwen team's TileLang GDN kernels; imports only where tilelang finds a GPU target)
    from flash_qla import chunk_gated_delta_rule as _flash_qla_chunk_gated_delta_rule

    FLASH_QLA_AVAILABLE = True
except Exception:
    FLASH_QLA_AVAILABLE = False

try:  # optional: flash-attn 2/3
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func

    FLASH_ATTN_AVAILABLE = True
except Exception:
    FLASH_ATTN_AVAILABLE = False

try:
    from torch.nn.attention.varlen import varlen_attn as _torch_varlen_attn

    TORCH_VARLEN_AVAILABLE = True
except Exception:
    TORCH_VARLEN_AVAILABLE = False

# torch.compile needs Triton on CUDA (the compiled loss chunk and conv formula).
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class KernelChoice:
    gdn: str  # "flash_qla" | "fla" | "torch"
    attention: str  # "flash_attn" | "torch_varlen" | "sdpa"
    # "varlen" | "sdpa": documents of at least LONG_DOCUMENT_TOKENS run alone through SDPA when "sdpa" and the
    # attention kernel is a varlen one (with attention="sdpa" every document already runs alone)
    long_documents: str = "varlen"
    elementwise: str = "eager"  # "triton" | "eager"
    conv: str = "torch"  # "fla" | "triton" | "compiled" | "torch" (GDN short conv)
    moe: str = "loop"  # "grouped_mm" | "loop" (MoE experts; dense models keep "loop", unused)
    combine: str = "eager"  # "triton" | "eager" (the grouped experts' top-k combine; unused elsewhere)
    # "auto" | "low_rank" | "peft": PEFT LoRA on the experts (expert_lora.py), resolved per expert tensor in the
    # forward, where PEFT's adapter state is known
    expert_lora: str = "auto"


def flash_qla_refusal(config, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashQLA cannot run this model here, or None when it can. It comes with FLA (the gated norm and conv
    stay FLA's), runs on Hopper and Blackwell data-centre GPUs in bf16 / fp16, with key and value head dims 128."""
    if not FLASH_QLA_AVAILABLE:
        return "flash-qla is not importable"
    if not FLA_AVAILABLE:
        return "flash-linear-attention is not importable (its gated norm and conv serve the GDN layer)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) not in ((9, 0), (10, 0), (10, 3)):
        return "FlashQLA runs its forward and backward on sm_90 / sm_100 / sm_103 GPUs only"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashQLA runs in bf16 / fp16, not {dtype}"
    if config.linear_key_head_dim != 128 or config.linear_value_head_dim != 128:
        return (
            f"FlashQLA needs key and value head dims of 128, not {config.linear_key_head_dim} / "
            f"{config.linear_value_head_dim}"
        )
    return None


def select_kernels(config, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """Pick the kernels for `device` and activation `dtype`, honouring the config's forced choices; log each new
    choice once. Flash-style varlen attention exists for fp16/bf16 only; fp32 attention runs SDPA per document."""
    on_cuda = device.type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16)
    gdn = config.gdn_kernel
    if gdn == "auto":
        if flash_qla_refusal(config, device, dtype) is None:
            gdn = "flash_qla"
        else:
            gdn = "fla" if (on_cuda and FLA_AVAILABLE) else "torch"
    elif gdn == "flash_qla" and (why := flash_qla_refusal(config, device, dtype)) is not None:
        raise RuntimeError(f"gdn_kernel='flash_qla' was forced but {why}")
    elif gdn == "fla" and not (on_cuda and FLA_AVAILABLE):
        raise RuntimeError(
            "gdn_kernel='fla' was forced but flash-linear-attention "
            + ("is not importable" if not FLA_AVAILABLE else "needs a CUDA device")
        )

    attention = config.attention_kernel
    if attention == "auto":
        if on_cuda and half and FLASH_ATTN_AVAILABLE:
            attention = "flash_attn"
        elif on_cuda and half and TORCH_VARLEN_AVAILABLE:
            attention = "torch_varlen"
        else:
            attention = "sdpa"
    elif attention == "flash_attn" and not (on_cuda and half and FLASH_ATTN_AVAILABLE):
        raise RuntimeError(f"attention_kernel='flash_attn' was forced but flash-attn is not usable here ({dtype})")
    elif attention == "torch_varlen" and not (on_cuda and half and TORCH_VARLEN_AVAILABLE):
        raise RuntimeError(f"attention_kernel='torch_varlen' was forced but varlen_attn is not usable here ({dtype})")

    # The SDPA path for long documents is opt-in until its GPU run (packed == per-document, speed) has been made.
    long_documents = getattr(config, "long_document_attention", "auto")
    long_documents = "varlen" if long_documents == "auto" else long_documents

    elementwise = getattr(config, "elementwise_kernel", "auto")
    if elementwise == "auto":
        elementwise = "triton" if (on_cuda and triton_elementwise.TRITON_ELEMENTWISE_AVAILABLE) else "eager"
    elif elementwise == "triton" and not (on_cuda and triton_elementwise.TRITON_ELEMENTWISE_AVAILABLE):
        raise RuntimeError(
            "elementwise_kernel='triton' was forced but "
            + (
                "Triton is not importable"
                if not triton_elementwise.TRITON_ELEMENTWISE_AVAILABLE
                else "the Triton kernels need a CUDA device"
            )
        )

    conv = getattr(config, "conv_kernel", "auto")
    if conv == "auto":
        # Fastest first (forward + backward of the RL batch on an H200): Triton, then FLA with the copies of its
        # q | k | v views (results/benchmarks/2026-11-30-conv.json times both), then the compiled formula.
        if on_cuda and TRITON_CONV_AVAILABLE:
            conv = "triton"
        elif gdn in ("fla", "flash_qla"):
            conv = "fla"
        else:
            conv = "compiled" if (on_cuda and TRITON_AVAILABLE) else "torch"
    elif conv == "fla" and not (on_cuda and FLA_AVAILABLE):
        raise RuntimeError(
            "conv_kernel='fla' was forced but flash-linear-attention "
            + ("is not importable" if not FLA_AVAILABLE else "needs a CUDA device")
        )
    elif conv == "triton" and not (on_cuda and TRITON_CONV_AVAILABLE):
        raise RuntimeError(
            "conv_kernel='triton' was forced but "
            + (
                "Triton >= 3.6 is not importable"
                if not TRITON_CONV_AVAILABLE
                else "the Triton conv kernel needs a CUDA device"
            )
        )
    elif conv == "compiled" and on_cuda and not TRITON_AVAILABLE:
        raise RuntimeError("conv_kernel='compiled' was forced but torch.compile needs Triton on CUDA")

    is_moe = bool(getattr(config, "is_moe", False))
    moe = getattr(config, "moe_kernel", "auto") if is_moe else "loop"
    if moe == "auto":
        moe = "grouped_mm" if (on_cuda and grouped_mm_usable(device, dtype)) else "loop"
    elif moe == "grouped_mm" and not grouped_mm_usable(device, dtype):
        raise RuntimeError(
            f"moe_kernel='grouped_mm' was forced but torch's grouped_mm does not run on {device.type} "
            f"with {dtype} here" + ("" if GROUPED_MM is not None else " (this torch has none)")
        )

    combine = getattr(config, "moe_combine_kernel", "auto") if is_moe else "eager"
    if combine == "auto":
        combine = "triton" if (on_cuda and TRITON_GATHER_SUM_AVAILABLE) else "eager"
    elif combine == "triton" and not (on_cuda and TRITON_GATHER_SUM_AVAILABLE):
        raise RuntimeError(
            "moe_combine_kernel='triton' was forced but "
            + (
                "Triton is not importable"
                if not TRITON_GATHER_SUM_AVAILABLE
                else "the Triton kernel needs a CUDA device"
            )
        )

    expert_lora = getattr(config, "moe_lora_kernel", "auto") if is_moe else "auto"
    if expert_lora == "auto" and on_cuda:
        # The low-rank expert products are checked against PEFT's path in fp32 on CPU; their bf16 CUDA run
        # (tests/test_gpu.py::test_expert_lora_low_rank_path_matches_peft_bf16) has not run yet, so on CUDA they
        # are opt-in (moe_lora_kernel="low_rank") until it has.
        expert_lora = "peft"
    choice = KernelChoice(
        gdn=gdn,
        attention=attention,
        long_documents=long_documents,
        elementwise=elementwise,
        conv=conv,
        moe=moe,
        combine=combine,
        expert_lora=expert_lora,
    )
    key = (device.type, dtype, choice)
    if first_time(key):
        slow = (
            " (pure PyTorch: exact, but slow on GPU; install flash-linear-attention)"
            if (on_cuda and gdn == "torch")
            else ""
        )
        if on_cuda and gdn == "fla":
            slow += (
                f" (FlashQLA not used: {flash_qla_refusal(config, device, dtype) or 'gdn_kernel=fla was asked for'})"
            )
        if on_cuda and is_moe and moe == "loop":
            why = (
                "moe_kernel='loop' was asked for"
                if getattr(config, "moe_kernel", "auto") == "loop"
                else f"torch's grouped_mm does not run here with {dtype}"
            )
            slow += f" (MoE experts in a per-expert loop with a host sync per layer: {why})"
        logger.warning(
            "qwen35-packed kernels on %s (%s): GDN=%s, conv=%s, attention=%s%s, elementwise=%s%s%s",
            device.type,
            dtype,
            gdn,
            conv,
            attention,
            f" (documents of >= {LONG_DOCUMENT_TOKENS} tokens: sdpa)" if long_documents == "sdpa" else "",
            elementwise,
            f", moe={moe}, combine={combine}" + (f", expert_lora={expert_lora}" if expert_lora != "auto" else "")
            if is_moe
            else "",
            slow,
        )
    return choice


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM (MoE experts)
# --------------------------------------------------------------------------------------------------------------

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _grouped_mm_runs(device_type: str, device_index, dtype: torch.dtype) -> bool:
    # Dispatch support differs by torch release, device and dtype (bf16 on Hopper; a CPU fallback in recent
    # releases); a tiny forward + backward answers it where a version table would go stale. The probe runs with
    # autograd on, whatever mode its first caller is in: a first call under no_grad (an eval forward, generate())
    # had no graph to run backward through, answered False for good, and every later call ran the per-expert loop.
    if GROUPED_MM is None:
        return False
    try:
        device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.randn(16, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            out = GROUPED_MM(x, w.transpose(-2, -1), offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
            out.backward(torch.ones_like(out))
        return True
    except Exception:  # RuntimeError / NotImplementedError: no kernel for this device or dtype
        return False


def grouped_mm_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return _grouped_mm_runs(device.type, device.index, dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (group e = rows offsets[e-1]:offsets[e]) times weight[e]^T: x [M, in],
    weight [E, out, in] (the nn.Linear layout of the fused expert tensors), offsets int32 [E] ending at M."""
    return GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)


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


def _zero_centred_rms_norm(x, weight, eps: float):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def _swiglu(gate, up):
    return F.silu(gate) * up


def _sigmoid_gate(x, gate):
    return x * torch.sigmoid(gate)


def _gdn_gates(a, b, a_log, dt_bias):
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float()), torch.sigmoid(b)


def _weighted_swiglu(gate_up, weight):
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float() * weight.unsqueeze(-1)).to(gate_up.dtype)


@functools.cache
def _compiled(fn):
    # dynamic=True: one graph for every token count (packed streams change length every batch).
    return torch.compile(fn, dynamic=True)


def _triton_form(fn):
    """The Triton kernel form of an eager chain (triton_elementwise.py), or None where there is none."""
    return {
        _zero_centred_rms_norm: triton_elementwise.rms_norm,
        _swiglu: triton_elementwise.swiglu,
        _sigmoid_gate: triton_elementwise.sigmoid_gate,
        _weighted_swiglu: triton_elementwise.weighted_swiglu,
        _gdn_gates: triton_elementwise.gdn_gates,
    }.get(fn)


def _elementwise(fn, choice):
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
    return _elementwise(_zero_centred_rms_norm, choice)(x.reshape(-1, shape[-1]), weight, eps).reshape(shape)


def swiglu(gate, up, choice: KernelChoice | None = None):
    """silu(gate) * up."""
    return _elementwise(_swiglu, choice)(gate, up)


def sigmoid_gate(x, gate, choice: KernelChoice | None = None):
    """x * sigmoid(gate), same shapes."""
    return _elementwise(_sigmoid_gate, choice)(x, gate)


def gdn_gates(a, b, a_log, dt_bias, choice: KernelChoice | None = None):
    """The GDN decay g = -exp(A_log) * softplus(a + dt_bias) in fp32 (log space) and beta = sigmoid(b) in b's
    dtype: a, b [N, Hv]; A_log, dt_bias [Hv] fp32. One Triton kernel each way with elementwise="triton", else
    eager."""
    return _elementwise(_gdn_gates, choice)(a, b, a_log, dt_bias)


def weighted_swiglu(gate_up, weight, choice: KernelChoice | None = None):
    """silu(gate) * up * weight in fp32, cast to gate_up's dtype: gate_up [M, 2I] (gate | up halves), weight [M]
    fp32 (the routing weight of each expert row)."""
    return _elementwise(_weighted_swiglu, choice)(gate_up, weight)


# --------------------------------------------------------------------------------------------------------------
# Causal depthwise conv over a packed stream
# --------------------------------------------------------------------------------------------------------------


def torch_causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    position_in_doc: torch.Tensor,
    doc_index: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU on a packed stream; no token of one document reaches another.

    x [N, C]; weight [C, K]; position_in_doc long [N]; initial_state [n_docs, C, K-1] holds the K-1 inputs
    preceding each document (cached decode), zeros when None; doc_index long [N] is read only with it. Computed in
    x's dtype with fp32 accumulation, like a conv kernel. Without initial_state this is also what
    conv_kernel="compiled" runs, through torch.compile.
    """
    kernel = weight.shape[-1]
    out = x.float() * weight[:, kernel - 1].float()
    for lag in range(1, kernel):
        shifted = F.pad(x, (0, 0, lag, 0))[: x.shape[0]].float()
        inside = (position_in_doc >= lag).unsqueeze(-1)
        if initial_state is not None:
            # Tokens closer than `lag` to their document start read the cached history instead.
            hist_pos = (position_in_doc - lag + kernel - 1).clamp(min=0, max=kernel - 2)
            history = initial_state[doc_index, :, hist_pos].float()
            shifted = torch.where(inside, shifted, history)
        else:
            shifted = shifted * inside
        out = out + shifted * weight[:, kernel - 1 - lag].float()
    return F.silu(out).to(x.dtype)


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


def causal_conv1d_varlen(x, weight, packed, choice: KernelChoice, split_sizes, initial_state=None):
    """Dispatch for the GDN short conv (x [N, C], weight [C, K]); returns the outputs of the channel segments
    `split_sizes` (q | k | v). The Triton kernel writes them as separate contiguous tensors; the other paths split
    their [N, C] output into views. FLA, Triton and the compiled formula serve the stateless training / prefill path;
    decode steps with a cached state run the eager formula."""
    if initial_state is not None:
        out = torch_causal_conv1d_varlen(x, weight, packed.position_in_doc(), packed.doc_index(), initial_state)
    elif choice.conv == "triton":
        return causal_conv1d_silu_split(x, weight, packed.position_in_doc(), split_sizes)
    elif choice.conv == "fla":
        out, _ = _fla_causal_conv1d(
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


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Gated delta rule for ONE document, chunked, fp32.

    q, k [L, H, Dk] (already l2-normalised, q scaled); v [L, H, Dv]; g (log decay), beta [L, H];
    initial_state [H, Dk, Dv]. Recurrence per head: S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,
    o_t = S_t^T q_t. Within a chunk the WY form gives new values U - W S0 with T = (I + tril(b K K^T Gamma, -1))^-1.
    Returns (o [L, H, Dv], final state [H, Dk, Dv]).
    """
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    # Zero padding at the end: k = v = beta = 0 and g = 0 leave the state and earlier outputs untouched.
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n_chunks = (length + pad) // chunk_size
    # -> [H, n_chunks, C, ...]
    q, k, v = (t.reshape(n_chunks, chunk_size, heads, -1).permute(2, 0, 1, 3) for t in (q, k, v))
    g, beta = (t.reshape(n_chunks, chunk_size, heads).permute(2, 0, 1) for t in (g, beta))

    g_cum = g.cumsum(dim=-1)  # [H, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H,n,C,C]
    k_beta = k * beta.unsqueeze(-1)
    strictly_lower = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    system = eye + strictly_lower
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g_cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # causal incl. diagonal (decay is 0 above it)

    state = q.new_zeros(heads, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outputs = []
    for c in range(n_chunks):
        new_v = u[:, c] - w[:, c] @ state
        out = (q[:, c] * g_cum[:, c].exp().unsqueeze(-1)) @ state + attn[:, c] @ new_v
        outputs.append(out)
        to_end = (g_cum[:, c, -1:] - g_cum[:, c]).exp().unsqueeze(-1)  # [H, C, 1]
        state = state * g_cum[:, c, -1].exp()[:, None, None] + (k[:, c] * to_end).transpose(-1, -2) @ new_v
    o = torch.stack(outputs, dim=1).reshape(heads, -1, dv)[:, :length].permute(1, 0, 2)
    return o, state


def torch_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, initial_state=None, output_final_state=False):
    """Per-document chunked delta rule over a packed stream; q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv];
    cu_seqlens on the CPU (PackedSequence.cu_seqlens_cpu), as the loop over documents reads it."""
    dtype = v.dtype
    ratio = v.shape[1] // k.shape[1]
    # Grouped value attention: each q/k head serves `ratio` consecutive value heads.
    q = _l2norm(q.float()).repeat_interleave(ratio, dim=1) * q.shape[-1] ** -0.5
    k = _l2norm(k.float()).repeat_interleave(ratio, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_state is None else initial_state[i]
        o, s = torch_chunk_gated_delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], init
        )
        outs.append(o)
        states.append(s)
    final = torch.stack(states) if output_final_state else None
    return torch.cat(outs).to(dtype), final


def gated_delta_rule_varlen(
    q, k, v, g, beta, packed, choice: KernelChoice, initial_state=None, output_final_state=False
):
    """Dispatch; returns (o [N, Hv, Dv], final_state [n_docs, Hv, Dk, Dv] fp32 or None)."""
    if choice.gdn in ("flash_qla", "fla"):
        if choice.gdn == "flash_qla":  # its intra-card split off: see the module docstring
            kernel, extra = _flash_qla_chunk_gated_delta_rule, {"auto_cp": False}
        else:  # FLA memoises its index helpers by the boundaries' identity and reads the host copy
            kernel, extra = _fla_chunk_gated_delta_rule, {"cu_seqlens_cpu": packed.cu_seqlens_cpu()}
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
        out = _fla_rms_norm_gated(
            x=x.reshape(-1, shape[-1]),
            g=gate.reshape(-1, shape[-1]),
            weight=weight,
            bias=None,
            activation="silu",
            eps=eps,
        )
        return out.reshape(shape)
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# Causal varlen attention
# --------------------------------------------------------------------------------------------------------------

# The length from which `long_document_attention="sdpa"` runs a document alone through SDPA: on Hopper torch's SDPA
# picks cuDNN's flash attention for a long causal document, faster than the FlashAttention-2 varlen kernels at
# head_dim 256 in the profile of a long-document step (docs/performance.md, "What one H200 trains"); below it the
# per-document calls would cost more launches than they save.
LONG_DOCUMENT_TOKENS = 16384


def sdpa_one_document(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """SDPA over one document: q [Lq, H, D], k / v [Lk, Hkv, D] (kv heads repeated for grouped-query attention) ->
    [Lq, H, D]. Causal with the queries as the last Lq of the Lk positions (Lk > Lq: cached keys come first)."""
    groups = q.shape[1] // k.shape[1]
    qd = q.transpose(0, 1)
    kd, vd = (t.transpose(0, 1).repeat_interleave(groups, dim=0) for t in (k, v))
    q_len, kv_len = q.shape[0], k.shape[0]
    if causal and kv_len != q_len:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale).transpose(0, 1)
    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale).transpose(0, 1)


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
        return _flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal
        )
    if kernel == "torch_varlen":
        # varlen_attn has no is_causal flag: window (-1, 0) = unlimited left context, no right context.
        return _torch_varlen_attn(
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

    With `long_documents="sdpa"` and a varlen attention kernel, every document of at least LONG_DOCUMENT_TOKENS
    runs alone through `sdpa_long_document` and the runs of shorter documents between them through the varlen
    kernel. Which kernel a document gets depends on its own length only, so packed == per-document holds as it does
    for either kernel alone."""
    if choice.long_documents == "sdpa" and choice.attention != "sdpa":
        segments = packed.attention_segments(LONG_DOCUMENT_TOKENS)
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
