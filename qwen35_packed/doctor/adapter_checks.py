"""Adapter checks: a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, what `hub_upload.py`
uploads as an adapter), against the rules of `integrations/lora.py` and, when `base_model_name_or_path` is a local
folder, against the base model's tensors. The base folder then gets every model check as well (`run_doctor`)."""

from __future__ import annotations

import re
from pathlib import Path

from ..json_files import read_json_object
from .folder import DoctorError
from .report import FAIL, PASS, SKIP, DoctorReport

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Modules integrations/lora.py refuses (a module path ending so), and why.
REFUSED_MODULES = {
    "linear_attn.conv1d": "the forward reads conv1d.weight directly: a LoRA around the GDN conv never runs",
    "mlp.gate": "the MoE router computes its logits in fp32 from the raw weight: a LoRA there never runs",
    "lm_head": "TRL projects with the raw lm_head weight (and refuses adapters there)",
}
_LORA_KEY = re.compile(r"^(?P<module>.+?)(?:\.base_layer)?\.lora_(?P<which>[AB])\.weight$")


def is_adapter_folder(path) -> bool:
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def run_adapter_checks(path, report: DoctorReport) -> Path | None:
    """Check the adapter folder at PATH; return the base model folder when it is a local one (else None)."""
    path = Path(path)
    config = read_json_object(path / ADAPTER_CONFIG, DoctorError)
    modules = _adapter_modules(path, report)
    _adapter_config(config, modules, report)
    base = config.get("base_model_name_or_path")
    base_path = Path(base) if isinstance(base, str) and base else None
    if base_path is not None and not base_path.is_absolute() and not base_path.is_dir():
        base_path = path / base_path
    if base_path is None or not (base_path / "config.json").is_file():
        report.add("adapter.base", SKIP, f"base_model_name_or_path {base!r} is not a local model folder: the "
                   "adapter's modules were not checked against the base",
                   "run `qwen35-packed doctor BASE_DIR` on the base model folder")  # fmt: skip
        return None
    report.add("adapter.base", PASS, f"base model folder {base_path}: the checks below are of that folder")
    return base_path


def _adapter_modules(path: Path, report: DoctorReport) -> dict[str, dict[str, tuple[int, ...]]] | None:
    """`module -> {"A": shape, "B": shape}` of the adapter's LoRA tensors (None when unreadable; reported)."""
    from ..conversion.errors import ConversionError
    from ..conversion.verify import read_header

    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        report.add("adapter.weights", FAIL, f"{ADAPTER_CONFIG} without {ADAPTER_WEIGHTS}",
                   "save the adapter with safetensors (PEFT's default)")  # fmt: skip
        return None
    try:
        header, _ = read_header(weights)
    except ConversionError as exc:
        report.add("adapter.weights", FAIL, str(exc), "re-save the adapter")
        return None
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, info in header.items():
        m = _LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if m:
            modules.setdefault(m["module"], {})[m["which"] + key.count(".base_layer.") * "'"] = tuple(info["shape"])
    return modules


def _adapter_config(config: dict, modules, report: DoctorReport) -> None:
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r}: the doctor checks LoRA adapters")
    names = set(modules or ())
    targets = config.get("target_modules") or []
    listed = set() if isinstance(targets, str) else set(targets)
    for suffix, why in REFUSED_MODULES.items():
        hit = sorted(n for n in names if n == suffix or n.endswith("." + suffix))
        if hit or suffix.rsplit(".", 1)[-1] in listed - {"gate"} or suffix in listed:
            problems.append(f"adapts {', '.join(hit[:3]) or suffix}: {why}")
    if config.get("target_parameters") and (config.get("lora_dropout") or 0) > 0:
        problems.append(f"lora_dropout {config['lora_dropout']} with target_parameters: PEFT applies LoRA to the fused "
                        "expert tensors only with lora_dropout 0")  # fmt: skip
    if modules is not None and not modules:
        problems.append(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    if problems:
        report.add("adapter.config", FAIL, "; ".join(problems),
                   "build the adapter with qwen35_packed.integrations.lora.lora_config (or its trl_cli_args)")  # fmt: skip
        return
    experts = " and the fused experts (target_parameters)" if config.get("target_parameters") else ""
    report.add("adapter.config", PASS, f"LoRA r={config.get('r')}, {len(names)} adapted modules{experts}")


def check_adapter_against_base(path, base_headers: dict, report: DoctorReport) -> None:
    """Every adapted module exists in the base model, and a Linear's lora_A / lora_B fit its weight."""
    modules = _adapter_modules(Path(path), DoctorReport(str(path), report.device))
    if not modules:
        return
    absent, wrong = [], []
    for module, shapes in sorted(modules.items()):
        weight = base_headers.get(f"{module}.weight")
        if weight is None:
            if not any(key.startswith(module + ".") for key in base_headers):
                absent.append(module)
            continue
        out_features, in_features = weight[1]
        a, b = shapes.get("A"), shapes.get("B")
        if a is None or b is None or a[1] != in_features or b[0] != out_features or a[0] != b[1]:
            wrong.append(f"{module} (A {list(a or [])}, B {list(b or [])}, base weight {list(weight[1])})")
    if absent or wrong:
        parts = [f"{len(items)} {what}: {', '.join(items[:3])}" + (" ..." if len(items) > 3 else "")
                 for what, items in (("modules the base lacks", absent), ("with shapes that do not fit", wrong))
                 if items]  # fmt: skip
        report.add("adapter.weights", FAIL, "; ".join(parts) + " (PEFT refuses to load it onto this base)",
                   "load the adapter onto the model it was trained from")  # fmt: skip
    else:
        report.add("adapter.weights", PASS, f"all {len(modules)} adapted modules exist in the base with fitting shapes")


__all__ = ["check_adapter_against_base", "is_adapter_folder", "run_adapter_checks"]
