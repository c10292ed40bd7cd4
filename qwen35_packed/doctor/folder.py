"""What the doctor reads from a model folder once: the raw config, its text part, this package's config object
built from it (or why that failed) and the tensor headers of every shard (no tensor data is read here)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from ..json_files import read_json_object

# model_type of a text config -> is it MoE (composite configs carry one of these as text_config.model_type)
TEXT_MODEL_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True}
COMPOSITE_MODEL_TYPES = {"qwen3_5": False, "qwen3_5_moe": True}


class DoctorError(Exception):
    """The folder cannot be examined at all (no readable config.json); the message says why."""


@dataclass
class ModelFolder:
    path: Path
    config: dict  # config.json as stored
    text: dict  # the text config: config.json itself, or its text_config
    composite: bool
    is_moe: bool
    packed_config: object | None = None  # Qwen3_5PackedConfig / Qwen3_5MoePackedConfig, None when it failed
    packed_config_error: str = ""
    headers: dict[str, tuple[str, tuple[int, ...], str]] = field(default_factory=dict)  # key -> (dtype, shape, file)
    headers_error: str = ""

    @property
    def architecture(self) -> str | None:
        architectures = self.config.get("architectures") or []
        return architectures[0] if architectures else None

    @property
    def sequence_classifier(self) -> bool:
        """A sequence-classification (reward / value) model: `score.weight` is its head, there is no lm_head."""
        from ..conversion.config import is_sequence_classifier

        return is_sequence_classifier(self.config)

    @property
    def is_qwen35(self) -> bool:
        """Whether config.json describes a Qwen3.5 model at all (text, or composite with a Qwen3.5 text_config)."""
        if self.composite:
            return (
                self.config.get("model_type") in COMPOSITE_MODEL_TYPES
                and self.text.get("model_type", "qwen3_5_text") in TEXT_MODEL_TYPES
            )
        return self.config.get("model_type") in TEXT_MODEL_TYPES

    @property
    def tied(self) -> bool:
        """tie_word_embeddings as loaders read it (a composite config's top level decides for its model)."""
        return bool(self.config.get("tie_word_embeddings", self.text.get("tie_word_embeddings", False)))

    def as_loaded(self, expected_keys) -> dict:
        """`key -> LazyTensor` of the stored tensors as the classes load them: MoE experts stored one by one
        (transformers' `save_pretrained` writes them so) as the fused tensors of `expected_keys` they are fused into
        on load. Raises ConversionError for an incomplete or inconsistent per-expert group."""
        from ..conversion.rules import LazyTensor, fused_view

        sources = {key: LazyTensor.source(key, shape, dtype) for key, (dtype, shape, _) in self.headers.items()}
        return fused_view(sources, expected_keys)

    def text_key(self, key: str) -> str:
        """A text-model key (`model.layers.0...`, `lm_head.weight`) as this folder stores it."""
        if self.composite and key.startswith("model."):
            return "model.language_model." + key[len("model.") :]
        return key


def read_folder(path) -> ModelFolder:
    path = Path(path)
    config_path = path / "config.json"
    config = read_json_object(config_path, DoctorError)
    composite = isinstance(config.get("text_config"), dict)
    text = config["text_config"] if composite else config
    model_type = text.get("model_type") or ("qwen3_5_text" if composite else None)
    is_moe = TEXT_MODEL_TYPES.get(model_type, COMPOSITE_MODEL_TYPES.get(config.get("model_type"), False))
    folder = ModelFolder(path, config, text, composite, is_moe)
    folder.packed_config, folder.packed_config_error = _packed_config(text, is_moe)
    folder.headers, folder.headers_error = _headers(path)
    return folder


def _packed_config(text: dict, is_moe: bool):
    from ..modeling import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig

    config_class = Qwen3_5MoePackedConfig if is_moe else Qwen3_5PackedConfig
    try:
        return config_class.from_dict(copy.deepcopy(text)), ""
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _headers(path: Path):
    from ..conversion.errors import ConversionError
    from ..conversion.verify import read_header, shard_files

    headers = {}
    try:
        for name in shard_files(path):
            if not (path / name).is_file():
                return headers, f"the index names {name}, which does not exist"
            header, _ = read_header(path / name)
            for key, info in header.items():
                headers[key] = (info["dtype"], tuple(info["shape"]), name)
    except ConversionError as exc:
        return headers, str(exc)
    return headers, ""


__all__ = ["DoctorError", "ModelFolder", "read_folder"]
