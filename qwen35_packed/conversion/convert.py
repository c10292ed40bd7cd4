"""`qwen35-packed convert`: an official-layout Qwen3.5 text checkpoint -> this project's layout.

Streaming: only safetensors headers are read to plan and validate; output shards are then built one at a time, each
output tensor from just the source tensors it needs (a fused expert tensor from one layer's experts, wherever they
are stored). The output is written into a temporary folder next to OUT and renamed to OUT at the end; SRC is only
read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config import OutputConfig, build_output_config, summarize
from .errors import ConversionError
from .remote_code import copy_remote_code, remote_code_files
from .rules import Drop, FuseExperts, LazyTensor, MappingEngine, MappingPlan, Rule, StripPrefix, materialize
from .schema import expected_text_tensors

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Files copied from SRC when present. An allow-list: processor / preprocessor files of the VLM are not carried.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)

MTP_REASON = (
    "multi-token-prediction head: the packed model ignores it (putting it back is the job of a later "
    "`--to official` step)"
)
VISUAL_REASON = "vision tower: --text-only converts the language model only"
# processor_class in tokenizer_config.json makes AutoProcessor (used e.g. by TRL) look for the image processor of the
# VLM, whose files a text checkpoint does not have; without it AutoProcessor returns the tokenizer.
TOKENIZER_CONFIG_DROPPED_KEYS = ("processor_class",)
TIED_REASON = "tie_word_embeddings is true: the output layer is model.embed_tokens.weight"


def conversion_rules(layout: str, *, tie_word_embeddings: bool) -> list[Rule]:
    """The declarative mapping from a source layout ('text' or 'composite') to this project's layout."""
    rules: list[Rule] = [Drop(r"^mtp\.", MTP_REASON)]
    if layout == "composite":
        rules += [Drop(r"^model\.visual\.", VISUAL_REASON), StripPrefix("model.language_model.", "model.")]
    if tie_word_embeddings:
        rules.append(Drop(r"^lm_head\.weight$", TIED_REASON))
    rules.append(FuseExperts())
    return rules


_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(size: int | str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, 1000 -> 1000."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if not m or m[2].upper() not in _SIZE_UNITS:
            raise ConversionError(f"Cannot read the size {size!r}; use e.g. 5GB, 500MB, 2GiB or a number of bytes")
        value = int(float(m[1]) * _SIZE_UNITS[m[2].upper()])
    if value <= 0:
        raise ConversionError(f"The shard size must be positive, got {size!r}")
    return value


@dataclass
class SourceCheckpoint:
    folder: Path
    config: dict
    shard_files: list[str]
    shard_of: dict[str, str]  # key -> shard file name
    tensors: dict[str, LazyTensor]  # in stream order (shard, then key)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path.name} in SRC is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{path.name} in SRC is not a JSON object")
    return data


def read_source(src: Path) -> SourceCheckpoint:
    """Read config.json and the safetensors headers of SRC (no tensor data)."""
    from safetensors import safe_open

    if not src.is_dir():
        raise ConversionError(f"SRC {src} is not a folder")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"SRC {src} has no config.json")
    config = _read_json(config_path)

    index_path = src / WEIGHTS_INDEX_NAME
    index_map: dict[str, str] | None = None
    if index_path.is_file():
        index_map = _read_json(index_path).get("weight_map")
        if not isinstance(index_map, dict) or not index_map:
            raise ConversionError(f"{index_path} has no weight_map")
        shard_files = sorted(set(index_map.values()))
    elif (src / WEIGHTS_NAME).is_file():
        shard_files = [WEIGHTS_NAME]
    else:
        found = sorted(p.name for p in src.iterdir() if p.is_file())
        raise ConversionError(
            f"SRC {src} has neither {WEIGHTS_INDEX_NAME} nor {WEIGHTS_NAME} (files: {found[:20]}); only safetensors "
            "checkpoints are supported"
        )
    missing_files = [name for name in shard_files if not (src / name).is_file()]
    if missing_files:
        raise ConversionError(f"{WEIGHTS_INDEX_NAME} names shard files that do not exist: {missing_files}")

    shard_of: dict[str, str] = {}
    tensors: dict[str, LazyTensor] = {}
    for name in shard_files:
        with safe_open(src / name, framework="pt") as handle:
            for key in handle.keys():
                if key in shard_of:
                    raise ConversionError(f"Tensor {key!r} is stored twice: in {shard_of[key]} and in {name}")
                piece = handle.get_slice(key)
                tensors[key] = LazyTensor.source(key, piece.get_shape(), piece.get_dtype())
                shard_of[key] = name
    if index_map is not None:
        wrong = sorted(k for k, name in index_map.items() if shard_of.get(k) != name)
        unlisted = sorted(set(shard_of) - set(index_map))
        if wrong or unlisted:
            raise ConversionError(
                f"{WEIGHTS_INDEX_NAME} does not match the shard files: {len(wrong)} listed tensors not found where the "
                f"index says (e.g. {wrong[:5]}), {len(unlisted)} stored tensors not in the index (e.g. {unlisted[:5]})"
            )
    return SourceCheckpoint(src, config, shard_files, shard_of, tensors)


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
    copied_files: list[str]  # names of SRC files copied (tokenizer_config.json minus TOKENIZER_CONFIG_DROPPED_KEYS)
    remote_code: list[Path]
    source: SourceCheckpoint
    lines: list[str] = field(default_factory=list)  # the printed plan

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.mapping.outputs.values())


def _validate(mapping: MappingPlan, output_config: OutputConfig) -> None:
    expected = expected_text_tensors(output_config.config)
    outputs = mapping.outputs
    unknown = [k for k in outputs if k not in expected]
    if unknown:
        shown = []
        for key in unknown[:20]:
            sources = outputs[key].source_keys()
            shown.append(key if sources == [key] else f"{key} (from {', '.join(sources[:3])}{' ...' if len(sources) > 3 else ''})")
        more = f"\n  ... and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        raise ConversionError(
            f"{len(unknown)} SRC tensors are neither part of the {output_config.data['model_type']} text model "
            "described by config.json nor dropped by a rule:\n  " + "\n  ".join(shown) + more
        )
    missing = [k for k in expected if k not in outputs]
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = " (lm_head.weight is required because tie_word_embeddings is false)"
        more = f" ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise ConversionError(
            f"SRC lacks {len(missing)} tensors the text model needs{hint}: {', '.join(missing[:20])}{more}"
        )
    wrong = [(k, outputs[k].shape, expected[k]) for k in expected if tuple(outputs[k].shape) != expected[k]]
    if wrong:
        raise ConversionError(
            "SRC tensors have shapes that contradict config.json:\n  "
            + "\n  ".join(f"{k}: {list(got)}, config says {list(want)}" for k, got, want in wrong[:20])
        )


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


def _format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def plan_conversion(src, out, *, text_only: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
    """Read and validate SRC and return the `ConversionPlan` (writes nothing)."""
    src, out = Path(src).resolve(), Path(out).resolve()
    if out.exists():
        raise ConversionError(f"OUT {out} already exists; choose a new folder (convert never overwrites)")
    if out == src or src in out.parents:
        raise ConversionError(f"OUT {out} is inside SRC {src}; SRC is never modified, choose a folder outside it")
    max_bytes = parse_size(max_shard_size)
    source = read_source(src)
    output_config = build_output_config(source.config, text_only=text_only)
    rules = conversion_rules(output_config.source_layout, tie_word_embeddings=output_config.config.tie_word_embeddings)
    mapping = MappingEngine(rules).plan(source.tensors)
    _validate(mapping, output_config)
    _stream_order(mapping, source)

    shards = _plan_shards(mapping, max_bytes)
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    copied = [name for name in COPIED_FILES if (src / name).is_file()]
    plan = ConversionPlan(src, out, output_config, rules, mapping, shards, names, copied, remote_code_files(), source)

    lines = plan.lines
    lines.append(
        f"SRC {src}: {output_config.source_layout} layout, {len(source.tensors)} tensors in "
        f"{len(source.shard_files)} shard file(s)"
    )
    for report in mapping.reports:
        lines.append(f"  {report.summary()}")
    lines.append(
        f"OUT {out}: {len(mapping.outputs)} tensors, {_format_bytes(plan.total_size)} in {n} shard(s) of at most "
        f"{_format_bytes(max_bytes)}"
    )
    lines.append(f"  config: {summarize(output_config)}")
    lines.append(f"  remote code: {', '.join(p.name for p in plan.remote_code)}")
    lines.append(f"  copied from SRC: {', '.join(copied) if copied else '(no tokenizer / generation files found)'}")
    if "tokenizer_config.json" in copied:
        dropped = [k for k in TOKENIZER_CONFIG_DROPPED_KEYS if k in _read_json(src / "tokenizer_config.json")]
        if dropped:
            lines.append(
                f"  tokenizer_config.json: removing {', '.join(dropped)} (it names the VLM processor, whose image "
                "processor files a text checkpoint lacks; AutoProcessor would fail, without it AutoProcessor returns "
                "the tokenizer)"
            )
    lines.extend(output_config.notes)
    return plan


def _stream_order(mapping: MappingPlan, source: SourceCheckpoint) -> None:
    """Reorder the outputs so that they follow the source stream (shard file, then key): reads stay local."""
    position = {key: i for i, key in enumerate(source.tensors)}
    order = sorted(
        mapping.outputs.items(), key=lambda kv: min((position[k] for k in kv[1].source_keys()), default=-1)
    )
    mapping.outputs = dict(order)


class _ShardReader:
    """Open source shards lazily (memory-mapped by safetensors) and load single tensors."""

    def __init__(self, source: SourceCheckpoint):
        from safetensors import safe_open

        self._open = safe_open
        self.source = source
        self.handles: dict[str, object] = {}

    def load(self, key: str):
        name = self.source.shard_of[key]
        if name not in self.handles:
            self.handles[name] = self._open(self.source.folder / name, framework="pt")
        return self.handles[name].get_tensor(key)

    def close(self) -> None:
        self.handles.clear()


def _check_tied_lm_head(plan: ConversionPlan, reader: _ShardReader) -> None:
    """A tied SRC that still stores lm_head.weight: it is dropped, so it must equal the embedding."""
    import torch

    if not plan.output_config.config.tie_word_embeddings or "lm_head.weight" not in plan.source.tensors:
        return
    (embed_key,) = plan.mapping.outputs["model.embed_tokens.weight"].source_keys()
    if not torch.equal(reader.load("lm_head.weight"), reader.load(embed_key)):
        raise ConversionError(
            f"config.json says tie_word_embeddings is true, but SRC stores an lm_head.weight that differs from "
            f"{embed_key}; dropping it would change the model. Fix tie_word_embeddings in SRC's config.json."
        )


def write_conversion(plan: ConversionPlan, *, progress: bool = True) -> Path:
    """Carry out a plan: write everything into a temporary folder next to OUT, then rename it to OUT."""
    from safetensors.torch import save_file

    out = plan.out
    reader = _ShardReader(plan.source)
    _check_tied_lm_head(plan, reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; OUT gets the permissions of a normal mkdir
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(plan.mapping.outputs), unit="tensor", desc="convert")
        except ImportError:
            bar = None
    try:
        weight_map: dict[str, str] = {}
        for keys, name in zip(plan.shards, plan.shard_names):
            items = [(k, plan.mapping.outputs[k]) for k in keys]
            tensors = {}
            for key, tensor in materialize(items, reader.load):
                tensors[key] = tensor.contiguous()
                weight_map[key] = name
                if bar is not None:
                    bar.update(1)
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            del tensors
        if len(plan.shard_names) > 1:
            index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(plan.output_config.data, indent=2, sort_keys=True) + "\n")
        copy_remote_code(tmp)
        for name in plan.copied_files:
            if name == "tokenizer_config.json":
                data = _read_json(plan.src / name)
                if any(k in data for k in TOKENIZER_CONFIG_DROPPED_KEYS):
                    for key in TOKENIZER_CONFIG_DROPPED_KEYS:
                        data.pop(key, None)
                    (tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
                    continue
            shutil.copyfile(plan.src / name, tmp / name)
        if out.exists():
            raise ConversionError(f"OUT {out} appeared while converting; nothing was written to it")
        os.rename(tmp, out)
    finally:
        reader.close()
        if bar is not None:
            bar.close()
        if tmp.exists():  # only when something failed before the rename
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(
    src,
    out,
    *,
    text_only: bool = False,
    dry_run: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> ConversionPlan:
    """Convert SRC (official Qwen3.5 text or, with `text_only`, composite layout) into OUT; see the module doc.

    With `dry_run` the plan is printed and nothing is written. Raises ConversionError with a readable message.
    """
    plan = plan_conversion(src, out, text_only=text_only, max_shard_size=max_shard_size)
    for line in plan.lines:
        log(line)
    if dry_run:
        log("dry run: nothing written")
        return plan
    write_conversion(plan, progress=progress)
    log(f"wrote {plan.out}")
    return plan


__all__ = [
    "COPIED_FILES",
    "ConversionPlan",
    "conversion_rules",
    "convert",
    "parse_size",
    "plan_conversion",
    "read_source",
    "write_conversion",
]
