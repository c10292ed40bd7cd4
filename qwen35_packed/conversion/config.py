"""config.json of a converted checkpoint (this project's text or composite layout, or an official one), from the
source's config.json."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from ..modeling.configuration_qwen3_5_packed import (
    KERNEL_FIELDS,
    Qwen3_5MoePackedConfig,
    Qwen3_5PackedConfig,
    resolve_rope_parameters,
)
from .errors import ConversionError
from .rope_readers import (
    disagreements,
    normalized_rope_keys,
    number_changing_disagreements,
    resolution_line,
    rope_table,
    rope_views,
)

TEXT_MODEL_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True}  # model_type -> is MoE
COMPOSITE_MODEL_TYPES = {"qwen3_5": False, "qwen3_5_moe": True}
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")

CONFIG_MODULE = "configuration_qwen3_5_packed"
MODELING_MODULE = "modeling_qwen3_5_packed"
ARCHITECTURES = {False: "Qwen3_5PackedForCausalLM", True: "Qwen3_5MoePackedForCausalLM"}
TEXT_BASE_MODELS = {False: "Qwen3_5PackedTextModel", True: "Qwen3_5MoePackedTextModel"}  # what AutoModel gives
# what AutoModelForSequenceClassification gives (a reward / value model, TRL's RewardTrainer)
SEQUENCE_CLASSIFIERS = {
    False: "Qwen3_5PackedForSequenceClassification",
    True: "Qwen3_5MoePackedForSequenceClassification",
}
OFFICIAL_TEXT_ARCHITECTURES = {False: "Qwen3_5ForCausalLM", True: "Qwen3_5MoeForCausalLM"}
# transformers' sequence-classification head on the text model; it has none for the MoE text model.
OFFICIAL_SEQUENCE_CLASSIFIER = "Qwen3_5TextForSequenceClassification"
OFFICIAL_COMPOSITE_ARCHITECTURES = {
    False: "Qwen3_5ForConditionalGeneration",
    True: "Qwen3_5MoeForConditionalGeneration",
}
OFFICIAL_COMPOSITE_MODEL_TYPES = {False: "qwen3_5", True: "qwen3_5_moe"}
# This project's composite (vision-language) layout: architectures and remote code (tests/conversion/test_vl_remote_code.py).
VL_CONFIG_MODULE = "configuration_qwen3_5_packed_vl"
VL_MODELING_MODULE = "modeling_qwen3_5_packed_vl"
VL_ARCHITECTURES = {False: "Qwen3_5PackedForConditionalGeneration", True: "Qwen3_5MoePackedForConditionalGeneration"}
VL_CONFIG_CLASSES = {False: "Qwen3_5PackedVLConfig", True: "Qwen3_5MoePackedVLConfig"}
VL_BASE_MODELS = {False: "Qwen3_5PackedVLModel", True: "Qwen3_5MoePackedVLModel"}
# vision_config.model_type transformers expects; older official configs say "qwen3_5" / "qwen3_5_moe" there.
VISION_MODEL_TYPES = {False: "qwen3_5_vision", True: "qwen3_5_moe_vision"}
# Fields of this project's config class that official readers do not know; not written to official configs.
PROJECT_ONLY_KEYS = (
    *KERNEL_FIELDS,
    "return_logits_with_loss",
    "checkpoint_granularity",
    "gdn_token_chunk",
    "layer_token_chunk",
    "moe_token_chunk",
)
PROJECT_ONLY_COMPOSITE_KEYS = ("freeze_vision", "vision_dummy_pass")
CONFIG_CLASSES = {False: Qwen3_5PackedConfig, True: Qwen3_5MoePackedConfig}

# Keys of a source config that describe the file, not the model; they are not carried over.
_NOT_CARRIED = ("architectures", "auto_map", "transformers_version", "_name_or_path")


@dataclass
class OutputConfig:
    """The converted config: `data` is written as config.json; `config` is the validated project config object."""

    data: dict
    config: Qwen3_5PackedConfig
    is_moe: bool
    source_layout: str  # "text" or "composite"
    notes: list[str]  # lines to print (warnings about the conversion)
    rope_lines: list[str] = field(default_factory=list)  # the rope table(s): source and written config
    # what `data` is: "packed", "packed-composite", "official-text" or "official-composite"
    layout: str = "packed"
    # a sequence-classification (reward / value) model: `score.weight` [num_labels, hidden] instead of lm_head
    sequence_classifier: bool = False

    @property
    def is_composite(self) -> bool:
        return self.layout in ("packed-composite", "official-composite")

    @property
    def text_data(self) -> dict:
        """The text config inside `data` (`data` itself except for the composite layouts)."""
        return self.data["text_config"] if self.is_composite else self.data


def detect_layout(src_config: dict) -> str:
    """'composite' for the official vision-language layout (text_config + vision_config), else 'text'."""
    if "text_config" in src_config or src_config.get("model_type") in COMPOSITE_MODEL_TYPES:
        return "composite"
    return "text"


def is_sequence_classifier(src_config: dict) -> bool:
    """Whether a config.json describes a sequence-classification (reward / value) model: its architecture is one
    (ours or transformers'), so its checkpoint holds `score.weight` instead of `lm_head.weight`."""
    architectures = src_config.get("architectures") or []
    return bool(architectures) and str(architectures[0]).endswith("ForSequenceClassification")


def _refuse_composite_sequence_classifier(src_config: dict) -> None:
    if is_sequence_classifier(src_config) and detect_layout(src_config) == "composite":
        raise ConversionError(
            f"SRC is a vision-language sequence-classification model ({src_config['architectures'][0]}): convert "
            "reads text ones only (this project has no vision-language reward class); "
            "Qwen3_5PackedForSequenceClassification.from_pretrained(SRC) reads its language model and score head "
            "as they are"
        )


def auto_map(is_moe: bool) -> dict:
    arch = ARCHITECTURES[is_moe]
    return {
        "AutoConfig": f"{CONFIG_MODULE}.{CONFIG_CLASSES[is_moe].__name__}",
        "AutoModel": f"{MODELING_MODULE}.{TEXT_BASE_MODELS[is_moe]}",
        "AutoModelForCausalLM": f"{MODELING_MODULE}.{arch}",
        "AutoModelForSequenceClassification": f"{MODELING_MODULE}.{SEQUENCE_CLASSIFIERS[is_moe]}",
    }


def vl_auto_map(is_moe: bool) -> dict:
    """auto_map of this project's composite layout (the remote-code VL classes)."""
    arch = f"{VL_MODELING_MODULE}.{VL_ARCHITECTURES[is_moe]}"
    return {
        "AutoConfig": f"{VL_CONFIG_MODULE}.{VL_CONFIG_CLASSES[is_moe]}",
        "AutoModel": f"{VL_MODELING_MODULE}.{VL_BASE_MODELS[is_moe]}",
        "AutoModelForCausalLM": arch,
        "AutoModelForImageTextToText": arch,
    }


def _source_text_config(src_config: dict, *, notes: list[str]) -> tuple[dict, str, str]:
    """(a copy of the text config, its model_type, the source layout) of a source config.json."""
    layout = detect_layout(src_config)
    if layout == "composite":
        text = src_config.get("text_config")
        if not isinstance(text, dict):
            raise ConversionError("SRC config.json: composite config without a text_config dict")
        text = copy.deepcopy(text)
        # which transformers wrote the file decides how contradicting rope keys are read (resolve_rope_parameters)
        text.setdefault("transformers_version", src_config.get("transformers_version"))
        _refuse_top_level_rope(src_config, "SRC")
        # transformers' composite class ties (or not) by the top-level flag; its text_config's flag is not used (and
        # transformers 5 itself saves composite configs with tie true at the top and false in text_config). The
        # small official models carry true in both places; the larger ones only at the top level (false).
        top_tie, text_tie = src_config.get("tie_word_embeddings"), text.get("tie_word_embeddings")
        if top_tie is not None:
            if text_tie is not None and bool(text_tie) != bool(top_tie):
                notes.append(
                    f"note: text_config.tie_word_embeddings is {text_tie} but the top-level value, which transformers' "
                    f"composite class uses, is {top_tie}; the converted model uses {bool(top_tie)}."
                )
            text["tie_word_embeddings"] = bool(top_tie)
        model_type = text.get("model_type")
        if model_type is None:
            is_moe = COMPOSITE_MODEL_TYPES.get(src_config.get("model_type"))
            if is_moe is None:
                raise ConversionError(
                    "SRC config.json: cannot tell dense from MoE (no model_type in text_config, top-level model_type "
                    f"{src_config.get('model_type')!r})"
                )
            model_type = "qwen3_5_moe_text" if is_moe else "qwen3_5_text"
    else:
        text = copy.deepcopy(src_config)
        model_type = text.get("model_type")
    if model_type not in TEXT_MODEL_TYPES:
        raise ConversionError(
            f"SRC config.json: model_type {model_type!r} is not a Qwen3.5 text model; expected one of "
            f"{sorted(TEXT_MODEL_TYPES)} (or a composite {sorted(COMPOSITE_MODEL_TYPES)})"
        )
    return text, model_type, layout


def _refuse_top_level_rope(composite: dict, name: str) -> None:
    top_rope = [k for k in ROPE_KEYS if composite.get(k) is not None]
    if top_rope:
        raise ConversionError(
            f"{name} config.json has rope settings at the top level ({', '.join(top_rope)}); the language model reads "
            "rope only from text_config, so they would be ignored or contradict it. Move them into text_config "
            "(or remove them) and convert again."
        )


def _normalize_text(
    text: dict, model_type: str, *, router_aux_loss_coef: float | None, notes: list[str], rope_lines: list[str]
) -> Qwen3_5PackedConfig:
    """Normalise rope (in place) and the aux-loss coefficient; return the validated project config object."""
    is_moe = TEXT_MODEL_TYPES[model_type]
    writer_version = text.get("transformers_version")
    for key in _NOT_CARRIED:
        text.pop(key, None)
    source_views = rope_views(text)
    source_text = copy.deepcopy(text)
    top_level_factor = text.get("partial_rotary_factor")
    try:
        rope = resolve_rope_parameters(
            text.pop("rope_parameters", None),
            text.pop("rope_scaling", None),
            text.pop("rope_theta", None),
            text.pop("partial_rotary_factor", None),
            writer_version=writer_version,
        )
    except ValueError as exc:
        table = "\n".join(rope_table(source_views, "rope as each reader sees SRC's config.json:"))
        raise ConversionError(f"SRC config.json: {exc}\n{table}") from exc
    if top_level_factor is not None and top_level_factor != rope["partial_rotary_factor"]:  # see resolve
        notes.append(
            f"note: SRC's top-level partial_rotary_factor={top_level_factor} contradicts its rope_parameters "
            f"({rope['partial_rotary_factor']}); transformers {writer_version} wrote it and reads rope_parameters, "
            f"so the converted config has {rope['partial_rotary_factor']}."
        )
    # v5 dict, v4 dict and legacy top-level keys, all equal: every reader sees the same values.
    text.update(normalized_rope_keys(rope))
    written_views = rope_views(text)
    if disagreements(written_views):  # a bug in normalized_rope_keys, never the user's input
        raise AssertionError(f"normalised rope keys still disagree: {rope_table(written_views, '')}")
    if not disagreements(source_views) and source_views == written_views:
        rope_lines.extend(rope_table(written_views, "rope as each reader sees it (SRC and the written config.json):"))
    elif disagreements(source_views) and not number_changing_disagreements(source_text, source_views, True):
        # the normal case (every config transformers 5 saves): stated once, only legacy readers use their defaults
        rope_lines.extend(rope_table(written_views, "rope as each reader sees the written config.json:"))
        rope_lines.append(
            f"    (SRC states {', '.join(disagreements(source_views))} once, as transformers 5 saves configs; the "
            "written config.json also states them where readers of v4-style keys look: `qwen35-packed rope SRC` "
            "shows SRC's view)"
        )
    else:
        rope_lines.extend(rope_table(source_views, "rope as each reader sees SRC's config.json:"))
        if disagreements(source_views):
            rope_lines.append(resolution_line(source_text, source_views))
        rope_lines.extend(rope_table(written_views, "rope as each reader sees the written config.json:"))
    text["model_type"] = model_type

    if router_aux_loss_coef is not None:
        if not is_moe:
            raise ConversionError("--router-aux-loss-coef applies to MoE models; SRC is a dense model")
        if (
            isinstance(router_aux_loss_coef, bool)
            or not isinstance(router_aux_loss_coef, (int, float))
            or not (math.isfinite(router_aux_loss_coef) and router_aux_loss_coef >= 0)
        ):
            raise ConversionError(f"--router-aux-loss-coef must be a finite number >= 0, got {router_aux_loss_coef!r}")
        old = text.get("router_aux_loss_coef")
        text["router_aux_loss_coef"] = float(router_aux_loss_coef)
        notes.append(f"router_aux_loss_coef set to {float(router_aux_loss_coef)} (SRC had {old})")
    text.setdefault("tie_word_embeddings", False)
    try:
        config = CONFIG_CLASSES[is_moe](**copy.deepcopy(text))
    except (ValueError, TypeError) as exc:
        raise ConversionError(f"SRC config.json is not a valid {model_type} config: {exc}") from exc
    coef = getattr(config, "router_aux_loss_coef", 0.0)
    if is_moe and coef > 0:
        notes.append(
            f"warning: router_aux_loss_coef is {coef} (> 0). In qwen35-packed the load-balancing loss is added to the "
            "loss only when router logits are requested (output_router_logits=True); other stacks (transformers' "
            "built-in class with output_router_logits, TRL's MoE handling) may add it silently, which adds a "
            "gradient that is not part of the objective and hurts RL. Set it explicitly for RL with "
            "--router-aux-loss-coef 0 if in doubt."
        )
    return config


def build_output_config(
    src_config: dict, *, text_only: bool, router_aux_loss_coef: float | None = None
) -> OutputConfig:
    """Normalise a source config.json into this project's config: its text config for a text source or (with
    `text_only`) a composite one, else its composite config (see `_packed_composite`).

    Raises ConversionError for an unknown model_type, contradicting rope or tie settings, and anything the project's
    config class rejects.
    """
    _refuse_composite_sequence_classifier(src_config)
    if detect_layout(src_config) == "composite" and not text_only:
        return _packed_composite(src_config, router_aux_loss_coef)
    notes: list[str] = []
    rope_lines: list[str] = []
    text, model_type, layout = _source_text_config(src_config, notes=notes)
    is_moe = TEXT_MODEL_TYPES[model_type]
    config = _normalize_text(
        text, model_type, router_aux_loss_coef=router_aux_loss_coef, notes=notes, rope_lines=rope_lines
    )
    reward = is_sequence_classifier(src_config)
    text["architectures"] = [(SEQUENCE_CLASSIFIERS if reward else ARCHITECTURES)[is_moe]]
    text["auto_map"] = auto_map(is_moe)
    return OutputConfig(text, config, is_moe, layout, notes, rope_lines, "packed", sequence_classifier=reward)


def build_official_config(
    src_config: dict, *, vision_config: dict | None = None, router_aux_loss_coef: float | None = None
) -> OutputConfig:
    """The official config.json for SRC (this project's layout or transformers' classes, text or composite).

    Text SRC without `vision_config`: transformers' text class (architectures `Qwen3_5ForCausalLM` /
    `Qwen3_5MoeForCausalLM`, no auto_map). With it (the config.json of the composite checkpoint the text model came
    from): that composite config with its text_config replaced by SRC's, and the top-level tie flag set from it.
    Composite SRC (this project's vision-language layout): the same config with transformers' composite
    architecture, without auto_map and this project's fields. A dense sequence-classification SRC becomes
    transformers' `Qwen3_5TextForSequenceClassification`; a MoE one, for which transformers has no class, or one
    with `vision_config` is refused.
    """
    _refuse_composite_sequence_classifier(src_config)
    if detect_layout(src_config) == "composite":
        if vision_config is not None:
            raise ConversionError(
                "SRC is a composite checkpoint with its own vision tower; --vision-from is for a text-only SRC"
            )
        return _official_from_composite(src_config, router_aux_loss_coef)
    notes: list[str] = []
    rope_lines: list[str] = []
    text, model_type, _ = _source_text_config(src_config, notes=notes)
    is_moe = TEXT_MODEL_TYPES[model_type]
    for key in PROJECT_ONLY_KEYS:
        text.pop(key, None)
    config = _normalize_text(
        text, model_type, router_aux_loss_coef=router_aux_loss_coef, notes=notes, rope_lines=rope_lines
    )
    if is_sequence_classifier(src_config):
        if is_moe:
            raise ConversionError(
                f"SRC is a MoE sequence-classification model ({src_config['architectures'][0]}): transformers has "
                f"no MoE Qwen3.5 sequence-classification class (only the dense {OFFICIAL_SEQUENCE_CLASSIFIER}), so "
                "an official folder would have no class to load it; keep this project's layout (its "
                "AutoModelForSequenceClassification auto_map) for the MoE reward model"
            )
        if vision_config is not None:
            raise ConversionError(
                "--vision-from: SRC is a sequence-classification model; convert writes its official text layout "
                f"({OFFICIAL_SEQUENCE_CLASSIFIER}) only"
            )
        text["architectures"] = [OFFICIAL_SEQUENCE_CLASSIFIER]
        _check_builtin_reads(text, model_type)
        return OutputConfig(text, config, is_moe, "text", notes, rope_lines, "official-text", sequence_classifier=True)
    if vision_config is None:
        text["architectures"] = [OFFICIAL_TEXT_ARCHITECTURES[is_moe]]
        _check_builtin_reads(text, model_type)
        return OutputConfig(text, config, is_moe, "text", notes, rope_lines, "official-text")

    if detect_layout(vision_config) != "composite" or not isinstance(vision_config.get("vision_config"), dict):
        raise ConversionError("--vision-from: config.json is not a composite Qwen3.5 config (no vision_config)")
    expected_type = OFFICIAL_COMPOSITE_MODEL_TYPES[is_moe]
    if vision_config.get("model_type") != expected_type:
        raise ConversionError(
            f"--vision-from has model_type {vision_config.get('model_type')!r} but SRC is a "
            f"{'MoE' if is_moe else 'dense'} model; the composite checkpoint must be {expected_type!r}"
        )
    _refuse_top_level_rope(vision_config, "--vision-from")
    composite = _official_composite(vision_config, text, is_moe, expected_type)
    return OutputConfig(composite, config, is_moe, "text", notes, rope_lines, "official-composite")


def _official_composite(base: dict, text: dict, is_moe: bool, model_type: str) -> dict:
    """`base` (a composite config.json) as the official composite config around the normalised `text` config."""
    composite = copy.deepcopy(base)
    for key in _NOT_CARRIED + PROJECT_ONLY_COMPOSITE_KEYS:
        composite.pop(key, None)
    composite["architectures"] = [OFFICIAL_COMPOSITE_ARCHITECTURES[is_moe]]
    # transformers' composite class ties by the top-level flag; text_config carries the same value for readers that
    # look there.
    composite["tie_word_embeddings"] = bool(text["tie_word_embeddings"])
    composite["text_config"] = text
    _check_builtin_reads(composite, model_type)
    return composite


def _composite_text(
    src_config: dict,
    router_aux_loss_coef: float | None,
    *,
    drop: tuple[str, ...],
    notes: list[str],
    rope_lines: list[str],
) -> tuple[dict, bool, str, Qwen3_5PackedConfig]:
    """(normalised text config, is_moe, composite model_type, project config) of a composite SRC config.json."""
    composite_type = src_config.get("model_type")
    if composite_type not in COMPOSITE_MODEL_TYPES or not isinstance(src_config.get("vision_config"), dict):
        raise ConversionError(
            f"SRC config.json: a composite config needs model_type in {sorted(COMPOSITE_MODEL_TYPES)} and a "
            f"vision_config; got model_type {composite_type!r}"
        )
    text, model_type, _ = _source_text_config(src_config, notes=notes)
    is_moe = TEXT_MODEL_TYPES[model_type]
    if COMPOSITE_MODEL_TYPES[composite_type] != is_moe:
        raise ConversionError(f"SRC config.json: model_type {composite_type!r} with a {model_type!r} text_config")
    for key in drop + ("architectures", "auto_map"):
        text.pop(key, None)
    config = _normalize_text(
        text, model_type, router_aux_loss_coef=router_aux_loss_coef, notes=notes, rope_lines=rope_lines
    )
    return text, is_moe, composite_type, config


def _official_from_composite(src_config: dict, router_aux_loss_coef: float | None) -> OutputConfig:
    notes: list[str] = []
    rope_lines: list[str] = []
    text, is_moe, composite_type, config = _composite_text(
        src_config, router_aux_loss_coef, drop=PROJECT_ONLY_KEYS, notes=notes, rope_lines=rope_lines
    )
    composite = _official_composite(src_config, text, is_moe, composite_type)
    return OutputConfig(composite, config, is_moe, "composite", notes, rope_lines, "official-composite")


def _packed_composite(src_config: dict, router_aux_loss_coef: float | None) -> OutputConfig:
    """This project's composite config from a composite SRC config.json: the text part normalised exactly as the
    text conversion does (rope written every way, model_type `qwen3_5_text` / `qwen3_5_moe_text`), `vision_config`
    kept (an old `model_type` there normalised), token ids and the tie flag kept, this project's architectures and
    the `auto_map` of the remote-code VL classes."""
    notes: list[str] = []
    rope_lines: list[str] = []
    text, is_moe, composite_type, config = _composite_text(
        src_config, router_aux_loss_coef, drop=(), notes=notes, rope_lines=rope_lines
    )
    composite = copy.deepcopy(src_config)
    for key in _NOT_CARRIED:
        composite.pop(key, None)
    vision = composite["vision_config"]
    vision_type = VISION_MODEL_TYPES[is_moe]
    if vision.get("model_type") in (None, composite_type):
        if vision.get("model_type") is not None:
            notes.append(f"vision_config.model_type {composite_type!r} -> {vision_type!r} (what transformers reads)")
        vision["model_type"] = vision_type
    elif vision["model_type"] != vision_type:
        raise ConversionError(
            f"SRC config.json: vision_config.model_type is {vision['model_type']!r}; a {composite_type} model's "
            f"vision tower is {vision_type!r}"
        )
    composite["architectures"] = [VL_ARCHITECTURES[is_moe]]
    composite["auto_map"] = vl_auto_map(is_moe)
    composite["tie_word_embeddings"] = bool(text["tie_word_embeddings"])  # the flag the composite class ties by
    composite["text_config"] = text
    _check_builtin_reads({k: v for k, v in composite.items() if k != "auto_map"}, composite_type)
    _check_project_vl_reads(composite, is_moe)
    return OutputConfig(composite, config, is_moe, "composite", notes, rope_lines, "packed-composite")


def _check_project_vl_reads(data: dict, is_moe: bool) -> None:
    """This project's composite config class must accept the written config.json."""
    try:
        from ..modeling import configuration_qwen3_5_packed_vl as vl
    except ImportError as exc:  # transformers without Qwen3.5: the VL classes cannot exist
        raise ConversionError(f"converting a composite checkpoint needs the vision-language classes: {exc}") from exc
    config_class = getattr(vl, VL_CONFIG_CLASSES[is_moe])
    try:
        config_class(**{k: v for k, v in copy.deepcopy(data).items() if k != "model_type"})
    except (ValueError, TypeError) as exc:
        raise ConversionError(f"{config_class.__name__} rejects the converted config: {exc}") from exc


def _check_builtin_reads(data: dict, model_type: str) -> None:
    """transformers' built-in config class must accept the official config (skipped if it is not installed)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:  # no built-in Qwen3.5 in this transformers (4.x): nothing to check against
        return
    try:
        AutoConfig.for_model(model_type, **copy.deepcopy({k: v for k, v in data.items() if k != "model_type"}))
    except (ValueError, TypeError) as exc:
        raise ConversionError(f"transformers' built-in {model_type} config rejects the official config: {exc}") from exc


def summarize(out: OutputConfig) -> str:
    c = out.config
    full = sum(t == "full_attention" for t in c.layer_types)
    parts = [
        f"model_type {c.model_type}",
        f"architectures {out.data['architectures']}",
        f"{c.num_hidden_layers} layers ({c.num_hidden_layers - full} GDN / {full} full attention)",
        f"hidden {c.hidden_size}",
        f"vocab {c.vocab_size}",
        f"tie_word_embeddings {c.tie_word_embeddings}",
    ]
    if out.is_moe:
        parts.append(
            f"experts {c.num_experts} top-{c.num_experts_per_tok} (expert I {c.moe_intermediate_size}, shared I "
            f"{c.shared_expert_intermediate_size}), router_aux_loss_coef {c.router_aux_loss_coef}"
        )
    else:
        parts.append(f"intermediate {c.intermediate_size}")
    r = c.rope_parameters
    parts.append(
        f"rope theta {r['rope_theta']:g}, partial_rotary_factor {r['partial_rotary_factor']}, mrope_section "
        f"{r['mrope_section']}, interleaved {r['mrope_interleaved']}"
    )
    return "; ".join(parts)


__all__ = [
    "OutputConfig",
    "auto_map",
    "build_official_config",
    "build_output_config",
    "detect_layout",
    "is_sequence_classifier",
    "summarize",
    "vl_auto_map",
]
