"""Planning a conversion: read SRC's headers and config, map every tensor, validate, and lay out OUT's shards.

`plan_conversion` reads only safetensors headers and JSON; it returns a `ConversionPlan` (the mapping, the output
config, the shards, the files to copy and the lines `convert` prints) and writes nothing. `write.py` carries a plan
out. The directions and layouts are described in `convert.py`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..json_files import read_json_object
from .config import OutputConfig, build_official_config, build_output_config, summarize
from .errors import ConversionError
from .remote_code import remote_code_files
from .rules import (
    Drop,
    FuseExperts,
    LazyTensor,
    MappingEngine,
    MappingPlan,
    Rule,
    RuleReport,
    StripPrefix,
)
from .schema import expected_mtp_tensors, expected_text_tensors, expected_vision_tensors
from .sizes import format_bytes, parse_size

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
DIRECTIONS = ("packed", "official")

# Files copied from SRC when present. An allow-list: processor / preprocessor files of the VLM are carried only to a
# composite output (PROCESSOR_FILES).
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
    "LICENSE",
)
# Files of the composite checkpoint that only it has (the VLM processor): copied to composite outputs, from SRC or
# `--vision-from`.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)

MTP_REASON = (
    "multi-token-prediction head: the packed model ignores it (`convert --to official --mtp-from SRC` puts it back)"
)
VISUAL_REASON = "vision tower: --text-only converts the language model only"
# processor_class in tokenizer_config.json makes AutoProcessor (used e.g. by TRL) look for the image processor of the
# VLM, whose files a text checkpoint does not have; without it AutoProcessor returns the tokenizer.
TOKENIZER_CONFIG_DROPPED_KEYS = ("processor_class",)
TIED_REASON = "tie_word_embeddings is true: the output layer is model.embed_tokens.weight"
MAIN_LAYERS = r"^model\."  # official MTP experts stay per expert; only the main layers are fused


def conversion_rules(layout: str, *, tie_word_embeddings: bool, keep_vision: bool = False) -> list[Rule]:
    """The declarative mapping from a source layout ('text' or 'composite') to this project's layout: the text layout,
    or with `keep_vision` (composite sources) the composite one (keys unchanged, main-layer experts fused)."""
    rules: list[Rule] = [Drop(r"^mtp\.", MTP_REASON)]
    if layout == "composite" and not keep_vision:
        rules += [Drop(r"^model\.visual\.", VISUAL_REASON), StripPrefix("model.language_model.", "model.")]
    if tie_word_embeddings:
        rules.append(Drop(r"^lm_head\.weight$", TIED_REASON))
    rules.append(FuseExperts(scope=r"^model\.language_model\." if keep_vision else None))
    return rules


def official_rules(*, composite: bool, tie_word_embeddings: bool, src_composite: bool = False) -> list[Rule]:
    """The mapping from a model (ours or transformers' classes) to the official layout: of the text model, composite
    (`composite`: the language model under `model.language_model.`) when SRC is or `--vision-from` makes it."""
    rules: list[Rule] = []
    if tie_word_embeddings:
        rules.append(Drop(r"^lm_head\.weight$", TIED_REASON))
    rules.append(FuseExperts(scope=r"^model\.language_model\." if src_composite else MAIN_LAYERS))
    if composite and not src_composite:
        rules.append(StripPrefix("model.", "model.language_model."))
    return rules


@dataclass
class SourceCheckpoint:
    folder: Path
    config: dict
    shard_files: list[str]
    shard_of: dict[str, str]  # key -> shard file name
    tensors: dict[str, LazyTensor]  # in stream order (shard, then key)
    role: str = "SRC"

    def path_of(self, key: str) -> Path:
        return self.folder / self.shard_of[key]


def _read_json(path: Path, role: str = "SRC") -> dict:
    return read_json_object(path, ConversionError, f"{path.name} in {role}")


def _is_plain_file_name(name) -> bool:
    """A shard named in an index must be a file of the folder itself: no path, no '..'."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def read_source(src: Path, role: str = "SRC") -> SourceCheckpoint:
    """Read config.json and the safetensors headers of a checkpoint folder (no tensor data)."""
    from safetensors import safe_open

    src = Path(src)
    if not src.is_dir():
        raise ConversionError(f"{role} {src} is not a folder")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{role} {src} has no config.json")
    config = _read_json(config_path, role)

    index_path = src / WEIGHTS_INDEX_NAME
    index_map: dict[str, str] | None = None
    if index_path.is_file():
        index_map = _read_json(index_path, role).get("weight_map")
        if not isinstance(index_map, dict) or not index_map:
            raise ConversionError(f"{WEIGHTS_INDEX_NAME} in {role} has no weight_map")
        outside = sorted({str(v) for v in index_map.values() if not _is_plain_file_name(v)})
        if outside:
            raise ConversionError(
                f"{WEIGHTS_INDEX_NAME} in {role} names a shard outside SRC or not by a file name: {outside[:5]}; "
                "shards must sit in the checkpoint folder"
            )
        shard_files = sorted(set(index_map.values()))
    elif (src / WEIGHTS_NAME).is_file():
        shard_files = [WEIGHTS_NAME]
    else:
        found = sorted(p.name for p in src.iterdir() if p.is_file())
        raise ConversionError(
            f"{role} {src} has neither {WEIGHTS_INDEX_NAME} nor {WEIGHTS_NAME} (files: {found[:20]}); only "
            "safetensors checkpoints are supported"
        )
    missing_files = [name for name in shard_files if not (src / name).is_file()]
    if missing_files:
        raise ConversionError(f"{WEIGHTS_INDEX_NAME} in {role} names shard files that do not exist: {missing_files}")

    shard_of: dict[str, str] = {}
    tensors: dict[str, LazyTensor] = {}
    for name in shard_files:
        try:
            with safe_open(src / name, framework="pt") as handle:
                for key in handle.keys():
                    if key in shard_of:
                        raise ConversionError(
                            f"Tensor {key!r} is stored twice in {role}: in {shard_of[key]} and in {name}"
                        )
                    piece = handle.get_slice(key)
                    tensors[key] = LazyTensor.source(key, piece.get_shape(), piece.get_dtype())
                    shard_of[key] = name
        except ConversionError:
            raise
        except Exception as exc:  # safetensors raises its own error type (truncated file, bad header)
            raise ConversionError(
                f"{role} shard {name} is not a readable safetensors file (truncated or damaged?): {exc}"
            ) from exc
    if index_map is not None:
        wrong = sorted(k for k, name in index_map.items() if shard_of.get(k) != name)
        unlisted = sorted(set(shard_of) - set(index_map))
        if wrong or unlisted:
            raise ConversionError(
                f"{WEIGHTS_INDEX_NAME} in {role} does not match the shard files: {len(wrong)} listed tensors not "
                f"found where the index says (e.g. {wrong[:5]}), {len(unlisted)} stored tensors not in the index "
                f"(e.g. {unlisted[:5]})"
            )
    return SourceCheckpoint(src, config, shard_files, shard_of, tensors, role)


@dataclass
class CopiedFile:
    name: str
    source: Path
    drop_keys: tuple[str, ...] = ()  # JSON keys removed (tokenizer_config.json -> packed)
    add_keys: dict = field(default_factory=dict)  # JSON keys added (tokenizer_config.json -> composite)

    def write(self, dest: Path) -> None:
        if not self.drop_keys and not self.add_keys:
            shutil.copyfile(self.source, dest / self.name)
            return
        data = _read_json(self.source)
        for key in self.drop_keys:
            data.pop(key, None)
        data.update(self.add_keys)
        (dest / self.name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass
class ConversionPlan:
    """Everything `convert` will do; built from config.json and headers only."""

    src: Path
    out: Path
    output_config: OutputConfig
    rules: list[Rule]
    mapping: MappingPlan
    shards: list[list[str]]  # output keys per output shard, in write order
    shard_names: list[str]
    copied: list[CopiedFile]
    remote_code: list[Path]
    source: SourceCheckpoint
    locations: dict[str, Path]  # source key -> shard file, over SRC and the *_from checkpoints
    direction: str = "packed"
    lines: list[str] = field(default_factory=list)  # the printed plan
    verbose_only: set[int] = field(default_factory=set)  # indices of `lines` printed only with -v (the rules)

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.mapping.outputs.values())


def _describe_unknown(outputs: dict[str, LazyTensor], unknown: list[str]) -> str:
    shown = []
    for key in unknown[:20]:
        sources = outputs[key].source_keys()
        more = " ..." if len(sources) > 3 else ""
        shown.append(key if sources == [key] else f"{key} (from {', '.join(sources[:3])}{more})")
    more = f"\n  ... and {len(unknown) - 20} more" if len(unknown) > 20 else ""
    return "\n  ".join(shown) + more


def _check_against(outputs: dict[str, LazyTensor], expected: dict[str, tuple], what: str, role: str) -> None:
    """Exactly the `expected` keys with the expected shapes, or a ConversionError that lists the differences."""
    unknown = [k for k in outputs if k not in expected]
    if unknown:
        raise ConversionError(
            f"{len(unknown)} {role} tensors are neither part of the {what} described by config.json nor dropped by a "
            "rule:\n  " + _describe_unknown(outputs, unknown)
        )
    missing = [k for k in expected if k not in outputs]
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = " (lm_head.weight is required because tie_word_embeddings is false)"
        more = f" ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise ConversionError(
            f"{role} lacks {len(missing)} tensors the {what} needs{hint}: {', '.join(missing[:20])}{more}"
        )
    wrong = [(k, outputs[k].shape, expected[k]) for k in expected if tuple(outputs[k].shape) != expected[k]]
    if wrong:
        raise ConversionError(
            f"{role} tensors have shapes that contradict config.json:\n  "
            + "\n  ".join(f"{k}: {list(got)}, config says {list(want)}" for k, got, want in wrong[:20])
        )


def _validate(mapping: MappingPlan, output_config: OutputConfig) -> None:
    reward = output_config.sequence_classifier
    what = f"{output_config.text_data['model_type']} {'sequence-classification' if reward else 'text'} model"
    expected = expected_text_tensors(output_config.config, sequence_classifier=reward)
    _check_against(mapping.outputs, expected, what, "SRC")


def _validate_composite(mapping: MappingPlan, output_config: OutputConfig) -> None:
    """This project's composite layout: the language model (checked in the text namespace) and the vision tower
    (keys and shapes of transformers' vision model for `vision_config`)."""
    visual = _prefixed(mapping.outputs, "model.visual.")
    if not visual:
        raise ConversionError(
            "SRC has a composite config.json but holds no model.visual.* tensors (--text-only converts the language "
            "model alone)"
        )
    text = {k: v for k, v in mapping.outputs.items() if k not in visual}
    _validate(MappingEngine([StripPrefix("model.language_model.", "model.")]).plan(text), output_config)
    try:
        expected = expected_vision_tensors(output_config.data["vision_config"], is_moe=output_config.is_moe)
    except (ValueError, TypeError) as exc:
        raise ConversionError(f"SRC config.json: transformers rejects vision_config: {exc}") from exc
    if expected is not None:
        try:
            _check_against(visual, expected, "vision tower described by vision_config", "SRC")
        except ConversionError as exc:
            raise ConversionError(f"{exc}\n(--text-only converts the language model alone)") from exc


def _mtp_layers(output_config: OutputConfig) -> int:
    n = output_config.text_data.get("mtp_num_hidden_layers", 0) or 0
    if not isinstance(n, int) or n < 0:
        raise ConversionError(f"config.json: mtp_num_hidden_layers must be a non-negative integer, got {n!r}")
    return n


def validate_mtp(mtp: dict[str, LazyTensor], output_config: OutputConfig, role: str) -> None:
    """The `mtp.*` tensors must be the MTP head config.json describes (experts per expert or fused)."""
    n_layers = _mtp_layers(output_config)
    if n_layers == 0:
        raise ConversionError(
            f"{role} holds {len(mtp)} mtp.* tensors but config.json says mtp_num_hidden_layers is 0 (or absent); set "
            "it to the number of MTP layers"
        )
    fused = MappingEngine([FuseExperts()]).plan(mtp).outputs
    what = f"MTP head ({n_layers} layer(s), mtp_num_hidden_layers)"
    _check_against(fused, expected_mtp_tensors(output_config.config, n_layers), what, role)


def _plan_shards(mapping: MappingPlan, max_shard_size: int) -> list[list[str]]:
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key, tensor in mapping.outputs.items():
        if current and size + tensor.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += tensor.nbytes
    if current:
        shards.append(current)
    return shards


def _check_out(src: Path, out: Path, others: list[Path]) -> None:
    if out.exists():
        raise ConversionError(f"OUT {out} already exists; choose a new folder (convert never overwrites)")
    for folder in [src, *others]:
        if out == folder or folder in out.parents:
            raise ConversionError(f"OUT {out} is inside {folder}; inputs are never modified, choose a folder outside")


def _prefixed(tensors: dict[str, LazyTensor], prefix: str) -> dict[str, LazyTensor]:
    return {k: v for k, v in tensors.items() if k.startswith(prefix)}


def _insert(mapping: MappingPlan, extra: dict[str, LazyTensor], description: str) -> None:
    report = RuleReport(description, label=description[0].lower() + description[1:])
    for key, value in extra.items():
        if key in mapping.outputs:
            raise ConversionError(f"{description}: {key!r} is also produced from SRC")
        mapping.outputs[key] = value
        report.consumed.append(key)
        report.produced.append(key)
    mapping.reports.append(report)


def plan_official_mapping(
    tensors: dict[str, LazyTensor],
    src_config: dict,
    *,
    mtp: tuple[dict[str, LazyTensor], dict, str] | None = None,
    vision: tuple[dict[str, LazyTensor], dict, str] | None = None,
    router_aux_loss_coef: float | None = None,
) -> tuple[OutputConfig, list[Rule], MappingPlan]:
    """Headers-only planning of `--to official`: (config, rules, mapping) for SRC tensors and config.

    `mtp` is (the tensors of the `--mtp-from` checkpoint, its config.json, its name); `vision` is (the tensors of
    the `--vision-from` checkpoint, its config.json, its name). Validates every part against config.json. A SRC
    config without `mtp_num_hidden_layers` (transformers' text classes drop it) takes the `--mtp-from` value.
    """
    output_config = build_official_config(
        src_config, vision_config=vision[1] if vision else None, router_aux_loss_coef=router_aux_loss_coef
    )
    own_mtp = _prefixed(tensors, "mtp.")
    if own_mtp and mtp is not None:
        raise ConversionError(
            f"SRC already holds {len(own_mtp)} mtp.* tensors and --mtp-from names another source; use one of them"
        )
    src_composite = output_config.source_layout == "composite"
    own_visual = _prefixed(tensors, "model.visual.") if src_composite else {}
    text_tensors = {k: v for k, v in tensors.items() if k not in own_mtp and k not in own_visual}
    composite = vision is not None or src_composite
    tie = output_config.config.tie_word_embeddings
    # validated in the text namespace (a composite SRC's language model with its prefix stripped)
    check = [StripPrefix("model.language_model.", "model.")] if src_composite else []
    text_mapping = MappingEngine(check + official_rules(composite=False, tie_word_embeddings=tie)).plan(text_tensors)
    _validate(text_mapping, output_config)

    rules = official_rules(composite=composite, tie_word_embeddings=tie, src_composite=src_composite)
    mapping = MappingEngine(rules).plan(text_tensors)
    if src_composite:
        if not own_visual:
            raise ConversionError("SRC has a composite config.json but holds no model.visual.* tensors")
        _insert(mapping, own_visual, "Keep model.visual.* of SRC, as stored")
    mtp_tensors, mtp_role = (own_mtp, "SRC") if own_mtp else (_prefixed(mtp[0], "mtp."), mtp[2]) if mtp else ({}, "")
    if mtp is not None and not mtp_tensors:
        raise ConversionError(f"--mtp-from {mtp[2]} holds no mtp.* tensors")
    text_data = output_config.text_data
    if mtp is not None and "mtp_num_hidden_layers" not in text_data:
        n_layers = mtp[1].get("text_config", mtp[1]).get("mtp_num_hidden_layers")
        if n_layers is not None:
            text_data["mtp_num_hidden_layers"] = n_layers
            output_config.notes.append(f"mtp_num_hidden_layers: SRC has none, taken from --mtp-from ({n_layers})")
    if mtp_tensors:
        validate_mtp(mtp_tensors, output_config, mtp_role)
        what = "Keep mtp.* of SRC" if own_mtp else f"Insert mtp.* from --mtp-from {mtp_role}"
        _insert(mapping, mtp_tensors, f"{what}, as stored")
    if vision is not None:
        vision_tensors, _, vision_role = vision
        visual = _prefixed(vision_tensors, "model.visual.")
        if not visual:
            raise ConversionError(f"--vision-from {vision_role} holds no model.visual.* tensors")
        # compared with experts fused: a composite saved by transformers stores them per expert
        language_model = MappingEngine([FuseExperts()]).plan(_prefixed(vision_tensors, "model.language_model."))
        theirs = {k: v.shape for k, v in language_model.outputs.items()}
        ours = {k: v.shape for k, v in mapping.outputs.items() if k.startswith("model.language_model.")}
        if theirs != ours:
            differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise ConversionError(
                f"--vision-from {vision_role} holds a language model of another shape than SRC's, so its vision "
                f"tower does not belong to this model ({len(differ)} keys differ, e.g. "
                + ", ".join(
                    f"{k}: SRC {list(ours[k]) if k in ours else '-'}, vision-from "
                    f"{list(theirs[k]) if k in theirs else '-'}"
                    for k in differ[:3]
                )
                + ")"
            )
        _insert(mapping, visual, f"Insert model.visual.* from --vision-from {vision_role}, as stored")
    return output_config, rules, mapping


def plan_packed_mapping(
    tensors: dict[str, LazyTensor], src_config: dict, *, text_only: bool, router_aux_loss_coef: float | None = None
) -> tuple[OutputConfig, list[Rule], MappingPlan]:
    """Headers-only planning of the default direction: (config, rules, mapping), validated."""
    output_config = build_output_config(src_config, text_only=text_only, router_aux_loss_coef=router_aux_loss_coef)
    composite = output_config.is_composite
    rules = conversion_rules(
        output_config.source_layout,
        tie_word_embeddings=output_config.config.tie_word_embeddings,
        keep_vision=composite,
    )
    mapping = MappingEngine(rules).plan(tensors)
    (_validate_composite if composite else _validate)(mapping, output_config)
    return output_config, rules, mapping


def plan_conversion(
    src,
    out,
    *,
    to: str = "packed",
    text_only: bool = False,
    mtp_from=None,
    vision_from=None,
    router_aux_loss_coef: float | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
):
    """Read and validate SRC (and the `*_from` folders) and return the `ConversionPlan` (writes nothing)."""
    if to not in DIRECTIONS:
        raise ConversionError(f"--to must be one of {DIRECTIONS}, got {to!r}")
    if to == "packed" and (mtp_from is not None or vision_from is not None):
        raise ConversionError("--mtp-from and --vision-from belong to --to official")
    if to == "official" and text_only:
        raise ConversionError("--text-only belongs to the packed direction; --to official reads a text model")
    src, out = Path(src).resolve(), Path(out).resolve()
    others = [Path(p).resolve() for p in (mtp_from, vision_from) if p is not None]
    _check_out(src, out, others)
    max_bytes = parse_size(max_shard_size)
    source = read_source(src)
    extra_sources: list[SourceCheckpoint] = []
    if to == "packed":
        output_config, rules, mapping = plan_packed_mapping(
            source.tensors, source.config, text_only=text_only, router_aux_loss_coef=router_aux_loss_coef
        )
    else:
        mtp_source = read_source(Path(mtp_from).resolve(), "--mtp-from") if mtp_from is not None else None
        vision_source = None
        if vision_from is not None:
            vision_path = Path(vision_from).resolve()
            same = mtp_source is not None and vision_path == mtp_source.folder
            vision_source = mtp_source if same else read_source(vision_path, "--vision-from")
        output_config, rules, mapping = plan_official_mapping(
            source.tensors,
            source.config,
            mtp=(mtp_source.tensors, mtp_source.config, mtp_source.folder.name) if mtp_source else None,
            vision=(vision_source.tensors, vision_source.config, vision_source.folder.name) if vision_source else None,
            router_aux_loss_coef=router_aux_loss_coef,
        )
        extra_sources = [s for s in (mtp_source, vision_source) if s is not None]
        if len(extra_sources) == 2 and extra_sources[0] is extra_sources[1]:
            extra_sources = extra_sources[:1]
            extra_sources[0].role = "--mtp-from / --vision-from"

    locations = _locations(mapping, [source, *extra_sources])
    _stream_order(mapping, [source, *extra_sources])
    shards = _plan_shards(mapping, max_bytes)
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    copied = _copied_files(src, output_config, Path(vision_from).resolve() if vision_from is not None else None)
    remote = remote_code_files() if to == "packed" else []
    plan = ConversionPlan(src, out, output_config, rules, mapping, shards, names, copied, remote, source, locations, to)
    _describe(plan, max_bytes, extra_sources)
    return plan


def _locations(mapping: MappingPlan, sources: list[SourceCheckpoint]) -> dict[str, Path]:
    """Source key -> shard file for every source tensor the outputs need (found by identity, not by name)."""
    where: dict[int, Path] = {}
    for source in sources:
        for key, tensor in source.tensors.items():
            where[id(tensor)] = source.path_of(key)
    locations: dict[str, Path] = {}
    for tensor in mapping.outputs.values():
        stack = [tensor]
        while stack:
            node = stack.pop()
            stack.extend(node.inputs)
            if not node.is_source:
                continue
            path = where[id(node)]
            if locations.setdefault(node.key, path) != path:
                raise ConversionError(f"{node.key!r} is needed from two checkpoints ({locations[node.key]} and {path})")
    return locations


def _stream_order(mapping: MappingPlan, sources: list[SourceCheckpoint]) -> None:
    """Reorder the outputs to follow the source stream (checkpoint, shard file, key): reads stay local."""
    position: dict[int, int] = {}
    for source in sources:
        for tensor in source.tensors.values():
            position.setdefault(id(tensor), len(position))

    def first(node: LazyTensor) -> int:
        stack, best = [node], -1
        while stack:
            n = stack.pop()
            if n.is_source:
                p = position.get(id(n), -1)
                best = p if best < 0 else min(best, p)
            stack.extend(n.inputs)
        return best

    mapping.outputs = dict(sorted(mapping.outputs.items(), key=lambda kv: first(kv[1])))


def _copied_files(src: Path, output_config: OutputConfig, vision_folder: Path | None) -> list[CopiedFile]:
    copied: list[CopiedFile] = []
    # a composite output carries the VLM processor files: of --vision-from, else of a composite SRC
    processor_folder = vision_folder or (src if output_config.is_composite else None)
    for name in COPIED_FILES:
        path = src / name
        if not path.is_file() and vision_folder is not None and (vision_folder / name).is_file():
            path = vision_folder / name  # the composite checkpoint's file where SRC lacks it
        if not path.is_file():
            continue
        item = CopiedFile(name, path)
        if name == "tokenizer_config.json":
            data = _read_json(path)
            if output_config.layout == "packed":
                item.drop_keys = tuple(k for k in TOKENIZER_CONFIG_DROPPED_KEYS if k in data)
            elif vision_folder is not None and (vision_folder / name).is_file():
                theirs = _read_json(vision_folder / name, "--vision-from")
                item.add_keys = {k: theirs[k] for k in TOKENIZER_CONFIG_DROPPED_KEYS if k in theirs and k not in data}
        copied.append(item)
    if processor_folder is not None:
        copied += [CopiedFile(n, processor_folder / n) for n in PROCESSOR_FILES if (processor_folder / n).is_file()]
    return copied


def _describe(plan: ConversionPlan, max_bytes: int, extra_sources: list[SourceCheckpoint]) -> None:
    source, output_config, mapping, lines = plan.source, plan.output_config, plan.mapping, plan.lines
    lines.append(
        f"SRC {plan.src}: {output_config.source_layout} layout, {len(source.tensors)} tensors in "
        f"{len(source.shard_files)} shard file(s)"
    )
    for extra in extra_sources:
        lines.append(f"{extra.role} {extra.folder}: {len(extra.tensors)} tensors in {len(extra.shard_files)} shard(s)")
    outcomes = [o for o in (report.outcome() for report in mapping.reports) if o]
    lines.append(f"  tensors: {'; '.join(outcomes) if outcomes else 'all as stored'}")
    for report in mapping.reports:
        plan.verbose_only.add(len(lines))
        lines.append(f"    rule {report.summary()}")
    layout = {"packed": "this project's layout", "packed-composite": "this project's composite layout",
              "official-text": "official text layout",
              "official-composite": "official composite layout"}[output_config.layout]  # fmt: skip
    lines.append(
        f"OUT {plan.out} ({layout}): {len(mapping.outputs)} tensors, {format_bytes(plan.total_size)} in "
        f"{len(plan.shards)} shard(s) of at most {format_bytes(max_bytes)}"
    )
    lines.append(f"  config: {summarize(output_config)}")
    if plan.remote_code:
        lines.append(f"  remote code: {len(plan.remote_code)} files of qwen35_packed/modeling")
        plan.verbose_only.add(len(lines))
        lines.append(f"    {', '.join(p.name for p in plan.remote_code)}")
    copied = [c.name if c.source.parent == plan.src else f"{c.name} (from {c.source.parent.name})" for c in plan.copied]
    lines.append(f"  copied: {', '.join(copied) if copied else '(no tokenizer / generation files found)'}")
    for item in plan.copied:
        if item.drop_keys:
            lines.append(
                f"  {item.name}: removing {', '.join(item.drop_keys)} (it names the VLM processor, whose image "
                "processor files a text checkpoint lacks; AutoProcessor would fail, without it AutoProcessor returns "
                "the tokenizer)"
            )
        if item.add_keys:
            lines.append(f"  {item.name}: restoring {', '.join(item.add_keys)} from the composite checkpoint")
    if (
        not output_config.layout.startswith("packed")
        and _mtp_layers(output_config)
        and not any(k.startswith("mtp.") for k in mapping.outputs)
    ):
        lines.append(
            f"note: config.json says mtp_num_hidden_layers={_mtp_layers(output_config)} but OUT holds no mtp.* "
            "tensors; serving with MTP speculative decoding needs them: pass --mtp-from ORIGINAL_CHECKPOINT"
        )
    lines.extend(output_config.rope_lines)
    lines.extend(output_config.notes)
