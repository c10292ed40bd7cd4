"""`qwen35-packed doctor MODEL_DIR`: checks that find silent train / inference mismatches before a run starts.

One module per concern: `folder` reads the folder once, `adapter_checks` (PEFT adapter folders), `config_checks`, `loading_checks`, `environment_checks`
(kernels, versions), `numerics` (packed == per-document on the real weights) and `vllm_check` (vLLM's log-probs
against this model's, in vLLM's own environment); `report` holds the results, prints the table and writes the JSON
the model card reads.
"""

from __future__ import annotations

from collections.abc import Callable

from .folder import DoctorError
from .report import FAIL, PASS, SKIP, WARN, Check, DoctorReport


def run_doctor(
    model_dir, device: str | None = None, with_vllm: bool = False, progress: Callable[[str], None] | None = None
) -> DoctorReport:
    """Run every check on MODEL_DIR; `device` "cpu" or "cuda" (default: cuda when available). A PEFT adapter folder
    gets the adapter checks, then every check of its base model folder when that is local. `progress` is called with
    what is checked next as each group of checks starts (the command prints it: the loading and numerics groups take
    seconds to minutes). Raises DoctorError when the folder has no readable config.json (nor adapter_config.json) or
    the device does not exist."""
    import torch

    from .adapter_checks import check_adapter_against_base, is_adapter_folder, run_adapter_checks
    from .config_checks import run_config_checks
    from .environment_checks import run_environment_checks
    from .folder import read_folder
    from .loading_checks import run_loading_checks
    from .numerics import run_packed_numerics

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise DoctorError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DoctorError("--device cuda, but torch sees no CUDA device")
    starting = progress or (lambda _group: None)
    report = DoctorReport(str(model_dir), device)
    adapter = None
    if is_adapter_folder(model_dir):  # a PEFT adapter: its own checks, then those of its base model folder
        starting("the adapter")
        base = run_adapter_checks(model_dir, report)
        if base is None:
            return report
        adapter, model_dir = model_dir, base
    folder = read_folder(model_dir)
    if adapter is not None:
        check_adapter_against_base(adapter, folder.headers, report)
    if not folder.is_qwen35:  # every other check would only list the ways another model differs from Qwen3.5
        types = (
            " / ".join(
                repr(t) for t in dict.fromkeys((folder.config.get("model_type"), folder.text.get("model_type"))) if t
            )
            or "none"
        )
        report.add("folder.model_type", FAIL,
                   f"not a Qwen3.5 model: model_type {types}, architectures {folder.config.get('architectures')}; "
                   "nothing else was checked",
                   "the doctor checks Qwen3.5 folders: model_type qwen3_5_text / qwen3_5_moe_text, or a composite "
                   "qwen3_5 / qwen3_5_moe one")  # fmt: skip
        return report
    starting("the config and the tensors it implies")
    run_config_checks(folder, report)
    starting("the classes transformers, TRL and vLLM build")
    run_loading_checks(folder, report)
    starting("kernels and versions")
    run_environment_checks(folder, torch.device(device), report, vllm_elsewhere=with_vllm)
    starting("packed vs per-document numerics on the first layers")
    run_packed_numerics(folder, torch.device(device), report)
    if with_vllm:
        from .vllm_check import run_vllm_checks

        starting("vLLM's log-probs against this model's (vLLM's environment)")
        run_vllm_checks(folder, device, report)
    return report


__all__ = ["FAIL", "PASS", "SKIP", "WARN", "Check", "DoctorError", "DoctorReport", "run_doctor"]
