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
`config.long_document_attention` ("auto" | "varlen" | "sdpa": see `kernels.causal_attention`),
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
from .configuration_qwen3_5_packed import KERNEL_FIELDS
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
class KernelSettings:
    """What the selection reads of a config: its kernel fields (configuration_qwen3_5_packed.KERNEL_FIELDS) and the
    shapes that decide whether a backend runs. A model binds its kernels once per (device, dtype) and these
    settings, so a setting changed on the config (set_attn_implementation) binds anew."""

    fields: tuple[tuple[str, str], ...]  # (kernel field, value), in KERNEL_FIELDS' order
    is_moe: bool
    linear_key_head_dim: int | None
    linear_value_head_dim: int | None

    @classmethod
    def of(cls, config) -> KernelSettings:
        return cls(
            fields=tuple((name, getattr(config, name, "auto")) for name in KERNEL_FIELDS),
            is_moe=bool(getattr(config, "is_moe", False)),
            linear_key_head_dim=getattr(config, "linear_key_head_dim", None),
            linear_value_head_dim=getattr(config, "linear_value_head_dim", None),
        )

    def __getitem__(self, name: str) -> str:
        return dict(self.fields)[name]


@dataclass(frozen=True)
class KernelChoice:
    """The names of the kernels chosen (the log line, the doctor and the result files read them); `kernel_set.py`
    binds the callables they name."""

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


# --------------------------------------------------------------------------------------------------------------
# Backends per kernel field, fastest first; each with the check that says why it cannot run here (None: it can).
# "auto" takes the first whose check (and, where given, its stricter auto check) passes; a forced one that
# fails its check raises with the reason.
# --------------------------------------------------------------------------------------------------------------


def _cuda(device: torch.device) -> str | None:
    return None if device.type == "cuda" else f"it needs a CUDA device, not {device.type}"


def _half(dtype: torch.dtype) -> str | None:
    return None if dtype in (torch.float16, torch.bfloat16) else f"it runs in bf16 / fp16, not {dtype}"


def _first(*reasons: str | None) -> str | None:
    return next((reason for reason in reasons if reason is not None), None)


def flash_qla_refusal(config, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashQLA cannot run this model here, or None when it can. It comes with FLA (the gated norm and conv
    stay FLA's), runs on Hopper and Blackwell data-centre GPUs in bf16 / fp16, with key and value head dims 128."""
    settings = config if isinstance(config, KernelSettings) else KernelSettings.of(config)
    if not FLASH_QLA_AVAILABLE:
        return "flash-qla is not importable"
    if not FLA_AVAILABLE:
        return "flash-linear-attention is not importable (its gated norm and conv serve the GDN layer)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) not in ((9, 0), (10, 0), (10, 3)):
        return "FlashQLA runs its forward and backward on sm_90 / sm_100 / sm_103 GPUs only"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashQLA runs in bf16 / fp16, not {dtype}"
    if settings.linear_key_head_dim != 128 or settings.linear_value_head_dim != 128:
        return (
            f"FlashQLA needs key and value head dims of 128, not {settings.linear_key_head_dim} / "
            f"{settings.linear_value_head_dim}"
        )
    return None


def _fla_refusal(settings, device, dtype, chosen) -> str | None:
    return _first(None if FLA_AVAILABLE else "flash-linear-attention is not importable", _cuda(device))


def _runs(settings, device, dtype, chosen) -> str | None:
    return None


def _triton_elementwise(settings, device, dtype, chosen) -> str | None:
    available = triton_elementwise.TRITON_ELEMENTWISE_AVAILABLE
    return _first(None if available else "Triton is not importable", _cuda(device))


def _triton_conv(settings, device, dtype, chosen) -> str | None:
    return _first(None if TRITON_CONV_AVAILABLE else "Triton >= 3.6 is not importable", _cuda(device))


def _fla_conv_in_auto(settings, device, dtype, chosen) -> str | None:
    # FLA's conv is taken by "auto" only beside an FLA delta rule, whose package it comes with
    return None if chosen.get("gdn_kernel") in ("fla", "flash_qla") else "the GDN layer does not run FLA"


def _compiled(settings, device, dtype, chosen) -> str | None:
    if device.type == "cuda" and not TRITON_AVAILABLE:
        return "torch.compile needs Triton on CUDA"
    return None


def _compiled_in_auto(settings, device, dtype, chosen) -> str | None:
    return _cuda(device)  # on CPU the eager formula: compiling costs more than it saves at CPU sizes


def _flash_attn(settings, device, dtype, chosen) -> str | None:
    return _first(None if FLASH_ATTN_AVAILABLE else "flash-attn is not importable", _cuda(device), _half(dtype))


def _torch_varlen(settings, device, dtype, chosen) -> str | None:
    available = TORCH_VARLEN_AVAILABLE
    return _first(None if available else "this torch has no varlen_attn", _cuda(device), _half(dtype))


def _grouped_mm(settings, device, dtype, chosen) -> str | None:
    if grouped_mm_usable(device, dtype):
        return None
    return f"torch's grouped_mm does not run on {device.type} with {dtype} here" + (
        "" if GROUPED_MM is not None else " (this torch has none)"
    )


def _triton_combine(settings, device, dtype, chosen) -> str | None:
    return _first(None if TRITON_GATHER_SUM_AVAILABLE else "Triton is not importable", _cuda(device))


@dataclass(frozen=True)
class Backend:
    name: str
    refusal: object  # (settings, device, dtype, chosen so far) -> reason it cannot run, or None
    auto_refusal: object = None  # a further reason "auto" passes it by (it may still be forced)


BACKENDS = {
    "gdn_kernel": (
        Backend("flash_qla", lambda s, d, t, c: flash_qla_refusal(s, d, t)),
        Backend("fla", _fla_refusal),
        Backend("torch", _runs),
    ),
    "conv_kernel": (
        Backend("triton", _triton_conv),
        Backend("fla", _fla_refusal, _fla_conv_in_auto),
        Backend("compiled", _compiled, _compiled_in_auto),
        Backend("torch", _runs),
    ),
    "attention_kernel": (
        Backend("flash_attn", _flash_attn),
        Backend("torch_varlen", _torch_varlen),
        Backend("sdpa", _runs),
    ),
    "elementwise_kernel": (Backend("triton", _triton_elementwise), Backend("eager", _runs)),
    # the per-expert loop is the reference and the CPU default: "auto" takes grouped_mm on CUDA only
    "moe_kernel": (Backend("grouped_mm", _grouped_mm, lambda s, d, t, c: _cuda(d)), Backend("loop", _runs)),
    "moe_combine_kernel": (Backend("triton", _triton_combine), Backend("eager", _runs)),
}
# Fields read by MoE models only; a dense model keeps their first backend-free value.
_MOE_ONLY = {"moe_kernel": "loop", "moe_combine_kernel": "eager"}


def _pick(field: str, settings: KernelSettings, device, dtype, chosen: dict) -> tuple[str, list[tuple[str, str]]]:
    """(the backend for `field`, [(faster backend, why not)]); a forced backend that cannot run raises."""
    requested = settings[field]
    passed = []
    for backend in BACKENDS[field]:
        why = backend.refusal(settings, device, dtype, chosen)
        if requested == backend.name:
            if why is not None:
                raise RuntimeError(f"{field}={requested!r} was forced but {why}")
            return backend.name, passed
        if requested != "auto":
            continue
        if why is None and backend.auto_refusal is not None:
            why = backend.auto_refusal(settings, device, dtype, chosen)
        if why is None:
            return backend.name, passed
        passed.append((backend.name, why))
    raise AssertionError(f"no backend for {field}={requested!r}")  # the last backend of every field always runs


def is_reference(field: str, name: str) -> bool:
    """Whether `name` is the PyTorch reference of kernel field `field` (its last backend, which always runs)."""
    return name == BACKENDS[field][-1].name


def kernel_refusals(config, device: torch.device, dtype: torch.dtype) -> dict[str, list[tuple[str, str]]]:
    """For each kernel field, the faster backends "auto" passed by here and why (empty where the fastest runs or
    the field is forced): what the log line and the doctor report."""
    return _select(KernelSettings.of(config), device, dtype)[1]


def _select(settings: KernelSettings, device, dtype) -> tuple[KernelChoice, dict]:
    chosen, refused = {}, {}
    for field in BACKENDS:
        if field in _MOE_ONLY and not settings.is_moe:
            chosen[field] = _MOE_ONLY[field]
            continue
        chosen[field], refused[field] = _pick(field, settings, device, dtype, chosen)
    attention = chosen["attention_kernel"]
    # Long documents alone through SDPA (cuDNN's flash attention on Hopper) wherever a varlen kernel runs the rest:
    # packed == per-document holds bitwise for it on the GPU (tests/gpu/test_gpu.py) and it is the faster kernel
    # for one long document at head_dim 256 (results/gpu/, results/benchmarks/ workload files).
    long_documents = settings["long_document_attention"]
    if long_documents == "auto":
        long_documents = "sdpa" if attention in ("flash_attn", "torch_varlen") else "varlen"
    choice = KernelChoice(
        gdn=chosen["gdn_kernel"],
        attention=attention,
        long_documents=long_documents,
        elementwise=chosen["elementwise_kernel"],
        conv=chosen["conv_kernel"],
        moe=chosen["moe_kernel"],
        combine=chosen["moe_combine_kernel"],
        expert_lora=settings["moe_lora_kernel"] if settings.is_moe else "auto",
    )
    return choice, {field: reasons for field, reasons in refused.items() if reasons}


def select_kernels(config, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """Pick the kernels for `device` and activation `dtype`, honouring the config's forced choices; log each new
    choice once, with the faster backends passed by on a GPU and why. Flash-style varlen attention exists for
    fp16/bf16 only; fp32 attention runs SDPA per document."""
    settings = config if isinstance(config, KernelSettings) else KernelSettings.of(config)
    choice, refused = _select(settings, device, dtype)
    if first_time((device.type, dtype, choice)):
        passed_by = "; ".join(f"{name} not used: {why}" for reasons in refused.values() for name, why in reasons)
        logger.warning(
            "qwen35-packed kernels on %s (%s): GDN=%s, conv=%s, attention=%s%s, elementwise=%s%s%s",
            device.type,
            dtype,
            choice.gdn,
            choice.conv,
            choice.attention,
            f" (documents of >= {LONG_DOCUMENT_TOKENS} tokens: sdpa)" if choice.long_documents == "sdpa" else "",
            choice.elementwise,
            f", moe={choice.moe}, combine={choice.combine}"
            + (f", expert_lora={choice.expert_lora}" if choice.expert_lora != "auto" else "")
            if settings.is_moe
            else "",
            f" ({passed_by})" if passed_by and device.type == "cuda" else "",
        )
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
