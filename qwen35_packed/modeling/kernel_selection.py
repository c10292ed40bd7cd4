"""Kernel selection: the one place where the kernels a model runs are chosen for a (device, dtype), and the probes
that say what is installed and runs here. The kernels themselves are called through `kernels.py` (dispatch) and
written out in PyTorch in `reference_kernels.py` (the exact references, what CPU runs).

GDN recurrence backends: "flash_qla" (FlashQLA's fused TileLang forward and backward, called directly with its
intra-card split `auto_cp` off: FlashQLA decides that split from the whole batch's lengths, so a long document
would be computed in other pieces alone than packed; with it off a document's result depends on itself only),
"fla" (FLA's Triton kernels, called behind FLA's backend dispatcher so that no other backend is picked silently),
"torch" (the per-document reference). "auto" takes the first that runs here, in that order; FlashQLA needs Hopper
or Blackwell, bf16 / fp16 and key and value head dims of 128 (every Qwen3.5 GDN). Attention: flash-attn varlen when
importable, else PyTorch's `varlen_attn`, else SDPA per document.

`config.gdn_kernel` ("auto" | "flash_qla" | "fla" | "torch"), `config.conv_kernel` ("auto" | "fla" | "triton" |
"compiled" | "torch"), `config.attention_kernel` ("auto" | "flash_attn" | "torch_varlen" | "sdpa"),
`config.long_document_attention` ("auto" | "varlen" | "sdpa": see `kernels.varlen_causal_attention`),
`config.elementwise_kernel` ("auto" | "triton" | "eager") and, for MoE models, `config.moe_kernel` ("auto" |
"grouped_mm" | "loop"), `config.moe_combine_kernel` ("auto" | "triton" | "eager": the grouped experts' top-k
combine) and `config.moe_lora_kernel` ("auto" | "low_rank" | "peft": PEFT LoRA on the experts, see expert_lora.py)
force a path; forcing one that cannot run raises. The choice is logged once per distinct (device, choice). A missing
kernel may cost speed, never correctness.
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
from .triton_conv import TRITON_CONV_AVAILABLE
from .triton_gather_sum import TRITON_GATHER_SUM_AVAILABLE
from .utils import first_time

logger = logging.getLogger(__name__)

try:  # optional: flash-linear-attention
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_dispatched_gated_delta_rule

    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d
    except ImportError:
        from fla.modules.convolution import causal_conv1d as fla_causal_conv1d
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
    except ImportError:
        from fla.modules.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
    # FLA's entry point dispatches to another backend where one is installed (FlashQLA, with its own intra-card
    # split of long sequences chosen from the whole batch); this project picks the GDN backend itself
    # (gdn_kernel), so "fla" means FLA's own Triton kernels: the function behind the dispatcher.
    fla_chunk_gated_delta_rule = inspect.unwrap(_fla_dispatched_gated_delta_rule)
    FLA_AVAILABLE = True
except Exception:  # ImportError, or FLA failing to import its Triton parts
    FLA_AVAILABLE = False
    fla_causal_conv1d = fla_rms_norm_gated = fla_chunk_gated_delta_rule = None

try:  # optional: FlashQLA (the Qwen team's TileLang GDN kernels; imports only where tilelang finds a GPU target)
    from flash_qla import chunk_gated_delta_rule as flash_qla_chunk_gated_delta_rule

    FLASH_QLA_AVAILABLE = True
except Exception:
    FLASH_QLA_AVAILABLE = False
    flash_qla_chunk_gated_delta_rule = None

try:  # optional: flash-attn 2/3
    from flash_attn import flash_attn_varlen_func as flash_attn_varlen_func

    FLASH_ATTN_AVAILABLE = True
except Exception:
    FLASH_ATTN_AVAILABLE = False
    flash_attn_varlen_func = None

try:
    from torch.nn.attention.varlen import varlen_attn as torch_varlen_attn

    TORCH_VARLEN_AVAILABLE = True
except Exception:
    TORCH_VARLEN_AVAILABLE = False
    torch_varlen_attn = None

# torch.compile needs Triton on CUDA (the compiled loss chunk and conv formula).
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


# The length from which `long_document_attention="sdpa"` runs a document alone through SDPA: on Hopper torch's SDPA
# picks cuDNN's flash attention for a long causal document, faster than the FlashAttention-2 varlen kernels at
# head_dim 256 in the profile of a long-document step (docs/performance.md, "What one H200 trains"); below it the
# per-document calls would cost more launches than they save.
LONG_DOCUMENT_TOKENS = 16384


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

    # Long documents alone through SDPA (cuDNN's flash attention on Hopper) wherever a varlen kernel runs the rest:
    # packed == per-document holds bitwise for it on the GPU (tests/gpu/test_gpu.py) and it is the faster kernel
    # for one long document at head_dim 256 (results/gpu/, results/benchmarks/ workload files).
    long_documents = getattr(config, "long_document_attention", "auto")
    if long_documents == "auto":
        long_documents = "sdpa" if attention in ("flash_attn", "torch_varlen") else "varlen"

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
    choice = KernelChoice(gdn, attention, long_documents, elementwise, conv, moe, combine, expert_lora)
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


# What select_kernels reads of a config: a model's kernels are bound once per (device, dtype) and these values.
_KERNEL_CONFIG_FIELDS = (
    "gdn_kernel",
    "conv_kernel",
    "attention_kernel",
    "long_document_attention",
    "elementwise_kernel",
    "moe_kernel",
    "moe_combine_kernel",
    "moe_lora_kernel",
    "is_moe",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
_BOUND: dict[tuple, KernelChoice] = {}


def bound_kernels(config, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """select_kernels, run once per (device, dtype) and kernel settings of the config: every later forward reads
    the bound choice (a setting changed later, e.g. by set_attn_implementation, binds anew)."""
    key = (device.type, device.index, dtype, *(getattr(config, name, None) for name in _KERNEL_CONFIG_FIELDS))
    choice = _BOUND.get(key)
    if choice is None:
        choice = _BOUND[key] = select_kernels(config, device, dtype)
    return choice


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
