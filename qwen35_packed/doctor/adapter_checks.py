"""Adapter checks: a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, what `hub_upload.py`
uploads as an adapter), against the rules of `integrations/lora.py` and, when `base_model_name_or_path` is a local
folder, against the base model's tensors. The base folder then gets every model check as well (`run_doctor`).

A folder holds the adapters PEFT's `save_pretrained` writes: the one named "default" at its top, every other one in
a subfolder named after it. Their LoRA tensors are read from the safetensors headers: Linear factors (lora_A
[r, in], lora_B [out, r]), conv factors (lora_A [r, C_in, K], lora_B [C_out, r / groups, 1]: the GDN conv) and the
factors of `target_parameters` (lora_A [r * experts, in], lora_B [out, r * experts] per fused expert tensor; PEFT
nests one wrapper per tensor, so their keys carry one `.base_layer` per level of nesting)."""

from __future__ import annotations

import re
from pathlib import Path

from ..json_files import read_json_object
from .folder import DoctorError
from .report import FAIL, PASS, SKIP, DoctorReport

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
DEFAULT_ADAPTER = "default"
GDN_CONV = "linear_attn.conv1d"
# Modules integrations/lora.py refuses (a module path ending so), and why.
REFUSED_MODULES = {
    "mlp.gate": "the MoE router computes its logits in fp32 from the raw weight: a LoRA there never runs",
    "lm_head": "TRL projects with the raw lm_head weight (and refuses adapters there)",
}
_LORA_KEY = re.compile(r"^(?P<module>.+?)(?P<nesting>(?:\.base_layer)*)\.lora_(?P<which>[AB])\.weight$")

# module -> {nesting depth -> {"A": shape, "B": shape}}
AdapterModules = dict[str, dict[int, dict[str, tuple[int, ...]]]]


def adapter_folders(path) -> dict[str, Path]:
    """{adapter name: its folder} of the adapters PEFT saved at PATH (the default one at the top, others in
    subfolders named after them)."""
    path = Path(path)
    found = {DEFAULT_ADAPTER: path} if (path / ADAPTER_CONFIG).is_file() else {}
    if path.is_dir():
        found.update({sub.name: sub for sub in sorted(path.iterdir()) if (sub / ADAPTER_CONFIG).is_file()})
    return found


def is_adapter_folder(path) -> bool:
    return bool(adapter_folders(path)) and not (Path(path) / "config.json").is_file()


def run_adapter_checks(path, report: DoctorReport) -> Path | None:
    """Check the adapter folder at PATH; return the base model folder when it is a local one (else None)."""
    path = Path(path)
    adapters = adapter_folders(path)
    configs = {name: read_json_object(folder / ADAPTER_CONFIG, DoctorError) for name, folder in adapters.items()}
    modules = {name: _adapter_modules(folder, name, report) for name, folder in adapters.items()}
    _adapter_configs(configs, modules, report)
    bases = {config.get("base_model_name_or_path") for config in configs.values()}
    if len(bases) > 1:
        report.add("adapter.base", FAIL, f"the adapters name different base models: {sorted(map(str, bases))}",
                   "save adapters of one base model in one folder")  # fmt: skip
        return None
    (base,) = bases
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


def _adapter_modules(folder: Path, name: str, report: DoctorReport) -> AdapterModules | None:
    """The adapter's LoRA tensor shapes by module (None when unreadable; reported)."""
    from ..conversion.errors import ConversionError
    from ..conversion.verify import read_header

    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        report.add("adapter.weights", FAIL, f"adapter {name!r}: {ADAPTER_CONFIG} without {ADAPTER_WEIGHTS}",
                   "save the adapter with safetensors (PEFT's default)")  # fmt: skip
        return None
    try:
        header, _ = read_header(weights)
    except ConversionError as exc:
        report.add("adapter.weights", FAIL, f"adapter {name!r}: {exc}", "re-save the adapter")
        return None
    modules: AdapterModules = {}
    for key, info in header.items():
        m = _LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if m:
            depth = m["nesting"].count(".base_layer")
            modules.setdefault(m["module"], {}).setdefault(depth, {})[m["which"]] = tuple(info["shape"])
    return modules


def _adapter_configs(configs: dict[str, dict], modules: dict[str, AdapterModules | None], report) -> None:
    problems, summaries = [], []
    for name, config in configs.items():
        label = f"adapter {name!r}: " if len(configs) > 1 else ""
        found = _config_problems(config, modules[name])
        problems += [label + problem for problem in found]
        if not found:
            summaries.append(label + _summary(config, modules[name] or {}))
    if problems:
        report.add("adapter.config", FAIL, "; ".join(problems),
                   "build the adapter with qwen35_packed.integrations.lora.lora_config (or its trl_cli_args)")  # fmt: skip
    else:
        report.add("adapter.config", PASS, "; ".join(summaries))


def _config_problems(config: dict, modules: AdapterModules | None) -> list[str]:
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
    if config.get("use_dora") and any(n.endswith(GDN_CONV) for n in names):
        problems.append("DoRA on the GDN conv: the packed conv applies plain LoRA only (and refuses DoRA)")
    if config.get("target_parameters") and (config.get("lora_dropout") or 0) > 0:
        problems.append(f"lora_dropout {config['lora_dropout']} with target_parameters: PEFT applies LoRA to the fused "
                        "expert tensors only with lora_dropout 0")  # fmt: skip
    if modules is not None and not modules:
        problems.append(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    return problems


def _summary(config: dict, modules: AdapterModules) -> str:
    parts = [f"LoRA r={config.get('r')}, {len(modules)} adapted modules"]
    if config.get("target_parameters"):
        parts.append("the fused experts (target_parameters)")
    convs = [n for n in modules if n.endswith(GDN_CONV)]
    if convs:
        parts.append(
            f"the GDN conv in {len(convs)} layers (applied by the conv's PyTorch formula on every backend; PEFT "
            "cannot merge it, so neither merge_and_unload nor the vLLM weight sync takes this adapter)"
        )
    return ", ".join(parts[:1]) + (" and " + " and ".join(parts[1:]) if parts[1:] else "")


def check_adapter_against_base(path, base_headers: dict, report: DoctorReport) -> None:
    """Every adapted module exists in the base, and its lora_A / lora_B fit the base tensor they adapt (a Linear's
    or a conv's weight, or one of the fused expert tensors of `target_parameters`)."""
    scratch = DoctorReport(str(path), report.device)  # unreadable weights were reported by run_adapter_checks
    adapters = {name: _adapter_modules(folder, name, scratch) for name, folder in adapter_folders(path).items()}
    absent, wrong, count = [], [], 0
    for name, modules in adapters.items():
        label = f"{name}: " if len(adapters) > 1 else ""
        for module, pairs in sorted((modules or {}).items()):
            count += 1
            tensors = {
                key[len(module) + 1 :]: shape
                for key, (_, shape, _) in base_headers.items()
                if key.startswith(module + ".") and "." not in key[len(module) + 1 :]
            }
            if not tensors and not any(key.startswith(module + ".") for key in base_headers):
                absent.append(label + module)
                continue
            for pair in pairs.values():
                a, b = pair.get("A"), pair.get("B")
                if a is None or b is None or not _fits(a, b, tensors):
                    base = {k: list(v) for k, v in tensors.items()}
                    wrong.append(f"{label}{module} (A {list(a or [])}, B {list(b or [])}, base {base})")
    if absent or wrong:
        parts = [f"{len(items)} {what}: {', '.join(items[:3])}" + (" ..." if len(items) > 3 else "")
                 for what, items in (("modules the base lacks", absent), ("with shapes that do not fit", wrong))
                 if items]  # fmt: skip
        report.add("adapter.weights", FAIL, "; ".join(parts) + " (PEFT refuses to load it onto this base)",
                   "load the adapter onto the model it was trained from")  # fmt: skip
    elif count:
        report.add("adapter.weights", PASS, f"all {count} adapted modules exist in the base with fitting shapes")


def _fits(a: tuple[int, ...], b: tuple[int, ...], tensors: dict[str, tuple[int, ...]]) -> bool:
    """Whether LoRA factors A, B fit the module's base tensors {name: shape}: its `weight` (Linear, ConvNd) or,
    without one, one of its 3-D tensors (a fused expert tensor [experts, out, in] of target_parameters). A module
    whose experts the folder stores one by one has no such tensor: its factors are not checked."""
    weight = tensors.get("weight")
    if weight is None:
        experts = [shape for shape in tensors.values() if len(shape) == 3]
        return not experts or any(_fits_experts(a, b, shape) for shape in experts)
    if len(weight) == 2:  # Linear [out, in]: A [r, in], B [out, r]
        return len(a) == len(b) == 2 and a[1] == weight[1] and b[0] == weight[0] and a[0] == b[1]
    # ConvNd [out, in / groups, *kernel]: A [r, in, *kernel], B [out, r / groups, 1, ...] (PEFT's _ConvNd)
    if len(a) != len(weight) or len(b) != len(weight) or a[2:] != weight[2:] or any(k != 1 for k in b[2:]):
        return False
    groups, spare = divmod(a[1], weight[1])
    return not spare and b[0] == weight[0] and a[0] % groups == 0 and b[1] == a[0] // groups


def _fits_experts(a, b, shape) -> bool:
    experts, out_features, in_features = shape
    return (
        len(a) == len(b) == 2 and a[1] == in_features and b[0] == out_features and a[0] == b[1] and a[0] % experts == 0
    )


__all__ = ["adapter_folders", "check_adapter_against_base", "is_adapter_folder", "run_adapter_checks"]
