"""Loading checks: which class each consumer builds from this folder, decided the way each consumer decides it,
without loading any weights.

* transformers without trust_remote_code: the auto class's mapping for the config class of `model_type` (the
  built-in Qwen3.5 class: same weights, but it mixes packed documents);
* transformers with trust_remote_code: the `auto_map` class from the folder's own remote code;
* TRL 1.16 (`trl.trainer.utils.create_model_from_path`): `getattr(transformers, architectures[0])` wins over
  `auto_map`; only a name transformers lacks falls through to the most specific auto class in `auto_map`
  (AutoModelForImageTextToText, then AutoModelForCausalLM), loaded with trust_remote_code. Its RewardTrainer names
  the auto class itself: AutoModelForSequenceClassification (the `auto_map` class with trust_remote_code);
* vLLM: its registry by architecture name, with this package's plugin mapping our names onto vLLM's native classes.

A sequence-classification (reward / value) folder is checked through AutoModelForSequenceClassification, and is
not served through vLLM by this package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

from .environment_checks import builtin_qwen35_available
from .folder import ModelFolder
from .report import FAIL, PASS, SKIP, WARN, DoctorReport

OUR_ARCHITECTURES = {
    "Qwen3_5PackedForCausalLM", "Qwen3_5MoePackedForCausalLM",
    "Qwen3_5PackedForConditionalGeneration", "Qwen3_5MoePackedForConditionalGeneration",
    "Qwen3_5PackedForSequenceClassification", "Qwen3_5MoePackedForSequenceClassification",
}  # fmt: skip
# vLLM's own Qwen3.5 architecture names (vllm/model_executor/models/registry.py)
VLLM_NATIVE = {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
               "Qwen3_5MoeForConditionalGeneration"}  # fmt: skip
CONVERT_FIX = "re-convert with `qwen35-packed convert` (writes this project's architecture names and auto_map)"


def run_loading_checks(folder: ModelFolder, report: DoctorReport) -> None:
    _transformers_builtin(folder, report)
    remote = _transformers_remote(folder, report)
    _remote_code_files(folder, report)
    _trl(folder, report, remote)
    _vllm_registry(folder, report)


def _auto_class(folder: ModelFolder):
    import transformers

    if folder.sequence_classifier:
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForImageTextToText if folder.composite else transformers.AutoModelForCausalLM


def _name(cls) -> str:
    return f"{cls.__module__}.{cls.__name__}"


def _transformers_builtin(folder: ModelFolder, report: DoctorReport) -> None:
    import transformers
    from transformers.models.auto.auto_factory import _get_model_class

    auto = _auto_class(folder)
    if not builtin_qwen35_available():
        report.add("loading.transformers", SKIP, f"transformers {transformers.__version__} has no Qwen3.5: without "
                   "trust_remote_code nothing loads this folder")  # fmt: skip
        return
    if folder.sequence_classifier and folder.is_moe:
        report.add("loading.transformers", SKIP, f"transformers {transformers.__version__} has no MoE Qwen3.5 "
                   "sequence-classification class: without trust_remote_code nothing loads this folder")  # fmt: skip
        return
    try:
        config = transformers.AutoConfig.from_pretrained(folder.path)
        cls = _get_model_class(config, auto._model_mapping)
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        report.add("loading.transformers", FAIL, f"{auto.__name__} without trust_remote_code fails: "
                   f"{type(exc).__name__}: {exc}", "model_type must be transformers' qwen3_5_text / qwen3_5_moe_text "
                   "(vLLM requires them too)")  # fmt: skip
        return
    if cls.__module__.startswith("transformers.models.qwen3_5"):
        report.add("loading.transformers", PASS, f"without trust_remote_code: built-in {cls.__name__} (same "
                   "weights; it mixes packed documents)")  # fmt: skip
    else:
        report.add("loading.transformers", WARN, f"without trust_remote_code: {_name(cls)}, not a Qwen3.5 class",
                   "model_type must be transformers' qwen3_5_text / qwen3_5_moe_text")  # fmt: skip


def _remote_class(folder: ModelFolder, auto_name: str):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    reference = (folder.config.get("auto_map") or {}).get(auto_name)
    return None if reference is None else get_class_from_dynamic_module(reference, str(folder.path))


def _transformers_remote(folder: ModelFolder, report: DoctorReport):
    """The class AutoModel* builds with trust_remote_code, or None."""
    auto = _auto_class(folder)
    try:
        cls = _remote_class(folder, auto.__name__)
    except Exception as exc:  # noqa: BLE001
        report.add("loading.remote_code", FAIL, f"the remote code does not import: {type(exc).__name__}: {exc}",
                   CONVERT_FIX)  # fmt: skip
        return None
    if cls is None:
        report.add("loading.remote_code", FAIL, f"no auto_map entry for {auto.__name__}: trust_remote_code builds the "
                   "built-in class, which mixes packed documents", CONVERT_FIX)  # fmt: skip
        return None
    if cls.__name__ not in OUR_ARCHITECTURES:
        report.add("loading.remote_code", FAIL, f"auto_map builds {cls.__name__}, not one of this package's classes",
                   CONVERT_FIX)  # fmt: skip
        return cls
    if cls.__name__ != folder.architecture:
        report.add("loading.remote_code", WARN, f"auto_map builds {cls.__name__} but architectures names "
                   f"{folder.architecture}", CONVERT_FIX)  # fmt: skip
        return cls
    report.add("loading.remote_code", PASS, f"with trust_remote_code: {cls.__name__} from the folder's remote code")
    return cls


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _imported_remote_code(folder: ModelFolder) -> set[str]:
    """The files of this package's bundle that the folder's `auto_map` classes import, directly or through each
    other: what transformers copies when it saves a remote-code model (TRL's final save of a text model, for one,
    leaves out the vision-language files, which a text folder does not need)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from ..conversion.remote_code import BUNDLE

    needed = set()
    for reference in (folder.config.get("auto_map") or {}).values():
        reference = reference[0] if isinstance(reference, (list, tuple)) else reference
        if not isinstance(reference, str):
            continue
        path = BUNDLE / (reference.split("--")[-1].rsplit(".", 1)[0] + ".py")
        if path.is_file():
            needed |= {path.name, *(Path(p).name for p in get_relative_import_files(path))}
    return needed


def _remote_code_files(folder: ModelFolder, report: DoctorReport) -> None:
    from ..conversion.remote_code import remote_code_files

    ours = remote_code_files()
    present = [p for p in ours if (folder.path / p.name).is_file()]
    needed = _imported_remote_code(folder)
    missing = sorted(needed - {p.name for p in present})
    differ = [p.name for p in present if _digest(p) != _digest(folder.path / p.name)]
    if not present:
        report.add("loading.remote_code_files", SKIP, "no remote-code files in the folder (official layout?)")
    elif missing or differ:
        report.add("loading.remote_code_files", WARN,
                   f"the folder's remote code is not this package's: missing {missing or 'none'}, different "
                   f"{differ or 'none'} (the doctor's numerics run this package's code)",
                   "copy this version's files (`qwen35-packed convert` does) or run the doctor of the version that "
                   "wrote them")  # fmt: skip
    else:
        unused = len(ours) - len(present)
        more = f"; the other {unused} of the bundle are not imported by its classes" if unused else ""
        report.add("loading.remote_code_files", PASS,
                   f"the {len(present)} remote-code files equal this package's{more}")  # fmt: skip


def trl_resolved_class(folder: ModelFolder):
    """The class TRL 1.16's `create_model_from_path` builds for this folder (its decision, without the weights)."""
    import transformers

    if folder.sequence_classifier:  # RewardTrainer: AutoModelForSequenceClassification, auto_map before the built-in
        return _remote_class(folder, transformers.AutoModelForSequenceClassification.__name__)
    architecture = getattr(transformers, folder.architecture or "", None)
    if architecture is not None:
        return architecture  # a concrete built-in class: from_pretrained ignores auto_map
    auto_map = folder.config.get("auto_map") or {}
    for candidate in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
        if candidate.__name__ in auto_map:
            return _remote_class(folder, candidate.__name__)
    return None  # AutoModelForCausalLM without an auto_map entry: the built-in mapping


def _trl(folder: ModelFolder, report: DoctorReport, remote) -> None:
    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed; TRL 1.16's rule"
    try:
        cls = trl_resolved_class(folder)
    except Exception as exc:  # noqa: BLE001
        report.add("loading.trl", FAIL, f"TRL's class cannot be resolved: {type(exc).__name__}: {exc}", CONVERT_FIX)
        return
    if cls is not None and cls.__name__ in OUR_ARCHITECTURES and (remote is None or cls is remote):
        users = "its RewardTrainer" if folder.sequence_classifier else "the policy and the reference model alike"
        report.add("loading.trl", PASS, f"TRL ({version}) builds {cls.__name__} from auto_map, {users}")
        return
    if folder.sequence_classifier:
        report.add("loading.trl", FAIL, f"TRL's RewardTrainer ({version}) builds the built-in class of "
                   "AutoModelForSequenceClassification (no auto_map entry for it), not this package's: packed "
                   "documents mix silently", CONVERT_FIX)  # fmt: skip
        return
    built = _name(cls) if cls is not None else "the built-in class of AutoModelForCausalLM"
    why = (
        f"architectures[0] {folder.architecture!r} is a transformers class name, so TRL ({version}) resolves "
        f"getattr(transformers, ...) before auto_map and builds {built}"
        if cls is not None and cls.__module__.startswith("transformers.")
        else f"TRL ({version}) builds {built}"
    )
    report.add("loading.trl", FAIL, why + ", not this package's class: packed documents mix silently",
               "architectures must name this package's class (Qwen3_5PackedForCausalLM / "
               "Qwen3_5MoePackedForCausalLM); " + CONVERT_FIX)  # fmt: skip


def _vllm_registry(folder: ModelFolder, report: DoctorReport) -> None:
    from ..integrations.vllm_plugin import ARCHITECTURES

    arch = folder.architecture
    if folder.sequence_classifier:
        report.add("loading.vllm", SKIP, f"{arch} is a sequence-classification (reward / value) model: this package "
                   "serves causal-LM and vision-language models through vLLM, not reward models (its plugin maps no "
                   "class for it and the vLLM tools refuse it); score with this package's class in "
                   "transformers")  # fmt: skip
        return
    plugin = [p for p in importlib.metadata.entry_points(group="vllm.general_plugins") if p.name == "qwen35_packed"]
    no_vllm = importlib.util.find_spec("vllm") is None  # vLLM may live elsewhere: --vllm checks its engine
    if arch in ARCHITECTURES:
        target = ARCHITECTURES[arch].replace(":", ".")
        if no_vllm:
            report.add("loading.vllm", SKIP, f"vLLM not installed; where it is, this package's plugin installed next "
                       f"to it maps {arch} to {target} (--vllm checks the engine in vLLM's environment)")  # fmt: skip
        elif plugin:
            report.add("loading.vllm", PASS, f"the qwen35_packed plugin maps {arch} to {target}")
        else:
            report.add("loading.vllm", FAIL, f"{arch} needs the qwen35_packed vLLM plugin, whose entry point is not "
                       "installed next to this vLLM", "install this package next to vLLM (`pip install --no-deps -e "
                       f".`) or pass hf_overrides={{'architectures': ['{target.rsplit('.', 1)[1]}']}}")  # fmt: skip
    elif arch in VLLM_NATIVE:
        if no_vllm:
            report.add("loading.vllm", SKIP, f"vLLM not installed; where it is, {arch} is its native class")
        else:
            report.add("loading.vllm", PASS, f"{arch} is vLLM's native class")
    else:
        native = ("Qwen3_5MoeForConditionalGeneration" if folder.is_moe else "Qwen3_5ForConditionalGeneration") \
            if folder.composite else ("Qwen3_5MoeForCausalLM" if folder.is_moe else "Qwen3_5ForCausalLM")  # fmt: skip
        report.add(
            "loading.vllm",
            FAIL,
            f"vLLM knows no {arch!r}: it falls back to its Transformers backend, which rejects linear attention",
            f"serve with hf_overrides={{'architectures': ['{native}']}}",
        )


__all__ = ["run_loading_checks", "trl_resolved_class"]
