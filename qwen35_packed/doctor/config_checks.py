"""Config checks: rope as every reader sees it, mrope sections, layer types, the tensors the config implies, the MTP
head, tied embeddings and the MoE load-balancing coefficient. They read config.json and the shard headers only."""

from __future__ import annotations

import copy

from ..conversion.errors import ConversionError
from ..conversion.rope_readers import (
    LEGACY_READERS,
    ROPE_FIELDS,
    TEXT_FIELDS,
    contradicted_fields,
    disagreements,
    number_changing_disagreements,
    rope_views,
)
from ..conversion.schema import expected_text_tensors, expected_vision_tensors
from ..modeling.configuration_qwen3_5_packed import LAYER_TYPES
from .environment_checks import builtin_qwen35_available
from .folder import ModelFolder
from .report import FAIL, PASS, SKIP, WARN, DoctorReport

ROPE_FIX = ("`qwen35-packed rope DIR` prints every reader's view; `qwen35-packed convert` writes rope_parameters, "
            "rope_scaling and the top-level keys with the same values")  # fmt: skip
# What transformers' built-in text rotary embedding falls back to when rope_parameters lacks a key, and what it
# does with mrope_interleaved (it has no such option: it always interleaves). See Qwen3_5TextRotaryEmbedding.
BUILTIN_PARTIAL_DEFAULT = 1.0
BUILTIN_MROPE_DEFAULT = [11, 11, 10]


def run_config_checks(folder: ModelFolder, report: DoctorReport) -> None:
    _rope(folder, report)
    _mrope_section(folder, report)
    _layer_types(folder, report)
    _weights(folder, report)
    for name, check in (("config.mtp", _mtp), ("config.tie_word_embeddings", _tied_embeddings)):
        if folder.headers_error:  # what the shards hold is unknown past the damaged one: config.weights names it
            report.add(name, SKIP, "the shard headers do not all read (config.weights)")
        else:
            check(folder, report)
    _router_aux_loss_coef(folder, report)


def _builtin_rope_view(folder: ModelFolder) -> tuple[dict | None, str]:
    """Rope as transformers' built-in model really uses it: its config class, then its rotary embedding (which
    raises for a rope_type it does not know, e.g. the legacy 'mrope'). (view, error)."""
    import transformers

    text = copy.deepcopy(folder.text)  # the built-in config class writes into nested rope dicts
    model_type = text.pop("model_type", "qwen3_5_moe_text" if folder.is_moe else "qwen3_5_text")
    try:
        config = transformers.AutoConfig.for_model(model_type, **text)
        if folder.is_moe:
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding as rotary
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding as rotary
        rotary(config)
    except Exception as exc:  # noqa: BLE001 - whatever the built-in raises is the finding
        return None, f"{type(exc).__name__}: {exc}"
    rope = config.rope_parameters
    return {
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope.get("partial_rotary_factor", BUILTIN_PARTIAL_DEFAULT),
        "mrope_section": rope.get("mrope_section", BUILTIN_MROPE_DEFAULT),
        "mrope_interleaved": True,
    }, ""


def _fmt(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _rope(folder: ModelFolder, report: DoctorReport) -> None:
    views = rope_views(folder.text)
    problems = []
    if builtin_qwen35_available():
        builtin, builtin_error = _builtin_rope_view(folder)
        if builtin_error:
            problems.append(f"transformers' built-in model cannot use this rope ({builtin_error})")
        else:
            views["transformers built-in model"] = builtin
    if folder.packed_config is None:
        if "rope" in folder.packed_config_error:
            problems.append(f"this package's config refuses it ({folder.packed_config_error})")
    else:
        rope = folder.packed_config.rope_parameters
        views["qwen35_packed config"] = {name: rope[name] for name in ROPE_FIELDS}
    disagreeing = disagreements(views)
    loud = number_changing_disagreements(folder.text, views, multimodal=folder.composite)
    for name in loud:
        seen = ", ".join(f"{reader} {_fmt(view[name])}" for reader, view in views.items())
        problems.append(f"readers disagree on {name}: {seen}")
    if (
        problems
        and len(problems) == len(loud)
        and not contradicted_fields(folder.text, loud)
        and (folder.packed_config is not None)
    ):
        # stated once (or not at all), readers differ only in their defaults: a folder `convert` did not write,
        # and what it resolves
        report.add(
            "config.rope",
            WARN,
            "expected for a folder not written by `qwen35-packed convert`: " + "; ".join(problems),
            ROPE_FIX,
        )
        return
    if problems:
        report.add("config.rope", FAIL, "; ".join(problems), ROPE_FIX)
        return
    current = [reader for reader in views if reader not in LEGACY_READERS]
    fields = ROPE_FIELDS if folder.composite else TEXT_FIELDS
    values = ", ".join(f"{name}={_fmt(views[current[0]][name])}" for name in fields)
    absent = "" if builtin_qwen35_available() else " (this transformers has no built-in Qwen3.5 to ask)"
    quiet = sorted(set(disagreeing) - set(loud))
    note = (
        f"; {', '.join(quiet)} stated once or not at all: only readers of v4-style keys fall back to their defaults "
        "(a folder `convert` writes states every value where they look)"
        + ("" if folder.composite else ", and mrope fields change nothing in a text model (1-D positions)")
        if quiet
        else ""
    )
    report.add("config.rope", PASS, f"{len(current)} readers agree: {values}{absent}{note}")


def _mrope_section(folder: ModelFolder, report: DoctorReport) -> None:
    config = folder.packed_config
    if config is None:
        report.add("config.mrope_section", SKIP, "no config to read (see config.rope / config.layer_types)")
        return
    rope = config.rope_parameters
    half = int(config.head_dim * rope["partial_rotary_factor"]) // 2
    section = rope["mrope_section"]
    if sum(section) == half:
        report.add("config.mrope_section", PASS, f"{section} sums to the rotary half-dim {half}")
    elif rope["mrope_interleaved"]:
        report.add(
            "config.mrope_section",
            PASS,
            f"{section} sums to {sum(section)}, the rotary half-dim is {half}: interleaved sections are read "
            "as transformers' built-in reads them (frequency i reads h / w while i < 3 x its section)",
        )
    else:
        report.add("config.mrope_section", FAIL,
                   f"mrope_section {section} sums to {sum(section)}, the rotary half-dim is {half}",
                   "contiguous mrope_section (t, h, w), mrope_interleaved False, must sum to head_dim x "
                   "partial_rotary_factor / 2")  # fmt: skip


def _layer_types(folder: ModelFolder, report: DoctorReport) -> None:
    text = folder.text
    n = text.get("num_hidden_layers")
    layer_types = text.get("layer_types")
    interval = text.get("full_attention_interval")
    fix = "layer_types needs one entry per layer, each 'linear_attention' or 'full_attention'"
    if not isinstance(n, int) or n <= 0:
        report.add("config.layer_types", FAIL, f"num_hidden_layers is {n!r}", "set num_hidden_layers")
        return
    if layer_types is None:
        derived = f"full_attention_interval {interval}" if interval else "the default interval 4"
        report.add("config.layer_types", WARN, f"no layer_types: every reader derives them from {derived}",
                   "write layer_types explicitly (`qwen35-packed convert` does)")  # fmt: skip
        return
    if len(layer_types) != n:
        report.add("config.layer_types", FAIL, f"{len(layer_types)} layer_types for num_hidden_layers {n}", fix)
        return
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        report.add("config.layer_types", FAIL, f"unknown layer types {unknown}", fix)
        return
    if interval:
        expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if list(layer_types) != expected:
            report.add("config.layer_types", FAIL, f"layer_types contradict full_attention_interval {interval}",
                       "remove full_attention_interval or make layer_types follow it")  # fmt: skip
            return
    full = sum(t == "full_attention" for t in layer_types)
    report.add("config.layer_types", PASS, f"{n} layers: {n - full} linear_attention, {full} full_attention")


def _weights(folder: ModelFolder, report: DoctorReport) -> None:
    if folder.headers_error:
        report.add("config.weights", FAIL, folder.headers_error, "re-copy or re-convert the checkpoint")
        return
    if folder.packed_config is None:
        report.add("config.weights", SKIP, f"this package's config does not build: {folder.packed_config_error}")
        return
    expected = {
        folder.text_key(k): shape
        for k, shape in expected_text_tensors(
            folder.packed_config, sequence_classifier=folder.sequence_classifier
        ).items()
    }
    if folder.composite and isinstance(folder.config.get("vision_config"), dict):
        try:
            expected.update(expected_vision_tensors(folder.config["vision_config"], is_moe=folder.is_moe) or {})
        except (ValueError, TypeError) as exc:
            report.add(
                "config.weights",
                FAIL,
                f"transformers' vision model rejects vision_config: {exc}",
                "fix vision_config (convert copies the official one)",
            )
            return
    try:
        stored = {key: node.shape for key, node in folder.as_loaded(expected).items()}
    except ConversionError as exc:
        report.add("config.weights", FAIL, f"{exc} (this package's classes refuse to load it)",
                   "the checkpoint is incomplete: re-save or re-convert it from the source")  # fmt: skip
        return
    missing = sorted(k for k in expected if k not in stored)
    wrong = sorted(f"{k} {list(stored[k])} (expected {list(s)})"
                   for k, s in expected.items() if k in stored and stored[k] != s)  # fmt: skip
    other = ("mtp.", "model.visual.")
    unexpected = sorted(k for k in stored if k not in expected and not k.startswith(other))
    if missing or wrong:
        parts = [f"{len(items)} {what}: {', '.join(items[:4])}" + (" ..." if len(items) > 4 else "")
                 for what, items in (("missing", missing), ("with another shape", wrong)) if items]  # fmt: skip
        report.add(
            "config.weights",
            FAIL,
            "; ".join(parts) + " (this package's classes refuse to load the folder with a ValueError naming them; "
            "transformers' built-in classes load it with them randomly initialised)",
            "the checkpoint is incomplete or does not match config.json: re-convert from the source",
        )
    elif unexpected:
        report.add("config.weights", WARN,
                   f"{len(unexpected)} tensors no model reads: {', '.join(unexpected[:5])}",
                   "remove them or fix config.json (they are dropped silently on load)")  # fmt: skip
    else:
        per_expert = sum(k not in stored for k in folder.headers)
        fused = sum(k not in folder.headers for k in stored)
        how = (
            f" ({fused} of them stored as {per_expert} per-expert tensors, which the classes fuse on load)"
            if fused
            else ""
        )
        report.add("config.weights", PASS, f"all {len(expected)} tensors of the config present with their shapes{how}")


def _mtp(folder: ModelFolder, report: DoctorReport) -> None:
    n_layers = folder.text.get("mtp_num_hidden_layers") or 0
    keys = [k for k in folder.headers if k.startswith("mtp.")]
    layers = sorted({int(k.split(".")[2]) for k in keys if k.startswith("mtp.layers.")})
    if keys and layers != list(range(n_layers)):
        report.add("config.mtp", WARN, f"mtp.* holds layers {layers}, mtp_num_hidden_layers is {n_layers}",
                   "make mtp_num_hidden_layers match the stored MTP head (vLLM builds it from the config)")  # fmt: skip
    elif keys:
        report.add("config.mtp", PASS, f"MTP head present ({len(keys)} tensors, {n_layers} layers): unused in "
                                       "training, available to vLLM's MTP speculative decoding")  # fmt: skip
    elif n_layers:
        report.add("config.mtp", PASS, f"MTP head dropped ({n_layers} layers in the config): serving with MTP "
                                       "speculative decoding needs `convert --to official --mtp-from SRC`")  # fmt: skip
    else:
        report.add("config.mtp", PASS, "no MTP head in config or weights")


def _tied_embeddings(folder: ModelFolder, report: DoctorReport) -> None:
    if folder.sequence_classifier:  # config.weights checks score.weight; a stored lm_head.weight is listed there
        report.add("config.tie_word_embeddings", PASS, "a sequence-classification model: its head is score.weight, "
                   "there is no output embedding to tie")  # fmt: skip
        return
    tied = folder.tied
    head, embed = folder.text_key("lm_head.weight"), folder.text_key("model.embed_tokens.weight")
    has_head = head in folder.headers
    if not tied and not has_head:
        report.add("config.tie_word_embeddings", FAIL,
                   "tie_word_embeddings is false but there is no lm_head.weight: the head would be random",
                   "set tie_word_embeddings true if the model ties its head to the embedding, else restore "
                   "lm_head.weight")  # fmt: skip
    elif tied and has_head:
        if _same_tensor(folder, head, embed):
            report.add("config.tie_word_embeddings", PASS, "tied; the stored lm_head.weight equals the embedding")
        else:
            report.add(
                "config.tie_word_embeddings",
                WARN,
                "tie_word_embeddings is true but the stored lm_head.weight differs from the embedding: "
                "loaders keep only one of them",
                "set tie_word_embeddings false if the head was trained separately, else drop lm_head.weight",
            )
    else:
        report.add(
            "config.tie_word_embeddings",
            PASS,
            "tied (no separate head stored)" if tied else "untied, lm_head.weight present",
        )


def _same_tensor(folder: ModelFolder, a: str, b: str) -> bool:
    import torch
    from safetensors import safe_open

    tensors = []
    for key in (a, b):
        if key not in folder.headers:
            return False
        with safe_open(folder.path / folder.headers[key][2], framework="pt") as handle:
            tensors.append(handle.get_tensor(key))
    return tensors[0].shape == tensors[1].shape and bool(torch.equal(tensors[0], tensors[1]))


def _router_aux_loss_coef(folder: ModelFolder, report: DoctorReport) -> None:
    if not folder.is_moe:
        report.add("config.router_aux_loss_coef", PASS, "dense model: no router, no load-balancing loss")
        return
    # absent means the readers' default, 0.001 for transformers' class and this package's
    coef = folder.packed_config.router_aux_loss_coef if folder.packed_config is not None else \
        folder.text.get("router_aux_loss_coef", 0.001)  # fmt: skip
    if coef > 0:
        report.add("config.router_aux_loss_coef", WARN,
                   f"router_aux_loss_coef is {coef:g}: TRL adds coef x load-balancing loss to an RL loss whenever "
                   "router logits are returned", "for RL: convert with `--router-aux-loss-coef 0` or pass "
                   "`--router_aux_loss_coef 0` to trl")  # fmt: skip
    else:
        report.add("config.router_aux_loss_coef", PASS, "0: no load-balancing loss is added")


__all__ = ["run_config_checks"]
