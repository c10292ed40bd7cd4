"""Rope values as different readers see them in a text config dict, and the config that makes them agree.

A Qwen3.5 text config can hold rope in three places: the transformers v5 dict `rope_parameters`, the v4 dict
`rope_scaling` (which carries `mrope_section` / `mrope_interleaved` for multimodal rope) and the top-level
`rope_theta` / `partial_rotary_factor`. Readers differ in where they look and who wins:

* transformers v5 (`standardize_rope_params`): `rope_parameters`, else `rope_scaling`; top-level values only fill
  keys the dict lacks (`setdefault`): a contradicting top-level value is silently ignored.
* a v4-style reader: `getattr(config, "rope_theta", 10000.0)`, `getattr(config, "partial_rotary_factor", 1.0)`,
  `rope_scaling["mrope_section"]`, `rope_scaling.get("mrope_interleaved", False)`: a v5-only config gives it the
  defaults (the failure that trains with one theta and serves with another).
* vLLM (`patch_rope_parameters`), with transformers >= 5: the transformers v5 view, then a legacy `mrope` rope
  type renamed `default`. With transformers < 5: `rope_scaling` replaces `rope_parameters` when present, and the
  top-level values *overwrite* the dict's.

`rope_views` computes each view from the raw dict (a re-implementation of those semantics, not an import), so the
table can be printed for any config, and `normalized_rope_keys` gives the keys that make all views equal.
"""

from __future__ import annotations

import copy

from ..modeling.utils import same_value

ROPE_FIELDS = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
V4_DEFAULTS = {"rope_theta": 10000.0, "partial_rotary_factor": 1.0, "mrope_section": None, "mrope_interleaved": False}
MISSING = None


def _dict_or_none(value):
    return dict(value) if isinstance(value, dict) else None


def _transformers_v5_dict(text: dict) -> dict:
    rope = _dict_or_none(text.get("rope_parameters")) or _dict_or_none(text.get("rope_scaling")) or {}
    rope.setdefault("rope_type", rope.get("type", "default"))
    if text.get("rope_theta") is not None:
        rope.setdefault("rope_theta", text["rope_theta"])
    if text.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", text["partial_rotary_factor"])
    return rope


def _vllm_transformers4_dict(text: dict) -> dict:
    rope = _dict_or_none(text.get("rope_scaling"))
    if rope is None:
        rope = _dict_or_none(text.get("rope_parameters"))
    theta, partial = text.get("rope_theta"), text.get("partial_rotary_factor")
    if (theta is not None or partial is not None) and not rope:
        rope = {"rope_type": "default"}
    rope = rope or {}
    if theta is not None:
        rope["rope_theta"] = theta
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    return rope


def _pick(rope: dict) -> dict:
    return {
        "rope_theta": rope.get("rope_theta", MISSING),
        "partial_rotary_factor": rope.get("partial_rotary_factor", MISSING),
        "mrope_section": rope.get("mrope_section", MISSING),
        "mrope_interleaved": rope.get("mrope_interleaved", MISSING),
    }


def rope_views(text: dict) -> dict[str, dict]:
    """`reader -> {field: value}` for a text config dict (`MISSING` (None) where that reader finds nothing)."""
    scaling = _dict_or_none(text.get("rope_scaling")) or {}
    v4 = {
        "rope_theta": text.get("rope_theta", V4_DEFAULTS["rope_theta"]),
        "partial_rotary_factor": text.get("partial_rotary_factor", V4_DEFAULTS["partial_rotary_factor"]),
        "mrope_section": scaling.get("mrope_section", V4_DEFAULTS["mrope_section"]),
        "mrope_interleaved": scaling.get("mrope_interleaved", V4_DEFAULTS["mrope_interleaved"]),
    }
    v5 = _pick(_transformers_v5_dict(text))
    return {
        "transformers v5": v5,
        "v4 getattr": v4,
        "vLLM + transformers 5": dict(v5),  # vLLM standardises through transformers' own method
        "vLLM + transformers 4": _pick(_vllm_transformers4_dict(text)),
    }


def disagreements(views: dict[str, dict]) -> list[str]:
    """Fields on which the readers do not all see the same value."""
    fields = []
    for name in ROPE_FIELDS:
        values = [view[name] for view in views.values()]
        if not all(same_value(values[0], v) for v in values[1:]):
            fields.append(name)
    return fields


# Readers of transformers 4 style keys only; a value a config states once in `rope_parameters` (as transformers 5
# saves every config) leaves them with their defaults. No loader of this model reads it their way, and the
# config `convert` writes states every value where they look: a disagreement of theirs alone is expected, not loud.
LEGACY_READERS = ("v4 getattr", "vLLM + transformers 4")
# Fields that change a text model's numbers (its positions are 1-D: the mrope sections and their order only matter
# for the 3-D positions of images and videos).
TEXT_FIELDS = ("rope_theta", "partial_rotary_factor")


def number_changing_disagreements(text: dict, views: dict[str, dict], multimodal: bool) -> list[str]:
    """The disagreements that change numbers: fields the config states twice with different values, and fields on
    which the readers that load this model (all but LEGACY_READERS) disagree, the mrope fields only for a
    `multimodal` model."""
    current = {reader: view for reader, view in views.items() if reader not in LEGACY_READERS}
    relevant = ROPE_FIELDS if multimodal else TEXT_FIELDS
    disagreeing = disagreements(views)
    among_current = set(disagreements(current)) & set(relevant)
    contradicted = set(contradicted_fields(text, disagreeing))
    return [name for name in disagreeing if name in contradicted or name in among_current]


def _fmt(value) -> str:
    if value is MISSING:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def rope_table(views: dict[str, dict], title: str) -> list[str]:
    """Lines of a fixed-width table: one row per field, one column per reader; `!` marks a disagreement."""
    bad = set(disagreements(views))
    readers = list(views)
    rows = [["", *readers]]
    for name in ROPE_FIELDS:
        rows.append([("! " if name in bad else "  ") + name, *(_fmt(views[r][name]) for r in readers)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title]
    for row in rows:
        lines.append("    " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if bad:
        lines.append(f"    ! readers disagree on {', '.join(sorted(bad))}")
    return lines


def _stated(text: dict, name: str) -> list:
    """The values SRC itself writes for `name` (in rope_parameters, rope_scaling, at the top level)."""
    places = [_dict_or_none(text.get("rope_parameters")) or {}, _dict_or_none(text.get("rope_scaling")) or {}, text]
    return [place[name] for place in places if place.get(name) is not None]


def contradicted_fields(text: dict, fields: list[str]) -> list[str]:
    """Those of `fields` that the config states more than once with different values (a disagreement among the
    readers is otherwise expected: the value is stated once, or not at all, and readers differ in their defaults)."""
    return [name for name in fields if any(not same_value(v, _stated(text, name)[0]) for v in _stated(text, name))]


def resolution_line(text: dict, views: dict[str, dict]) -> str:
    """Why the readers of a source config disagree and that the written config resolves it (`convert`'s table)."""
    bad = disagreements(views)
    contradicted = contradicted_fields(text, bad)
    if contradicted:
        return (
            f"    SRC states {', '.join(contradicted)} twice with different values, read as transformers 5 reads "
            "them (see the note); the written config.json resolves it: every reader sees the values below"
        )
    return (
        f"    expected: SRC states {', '.join(bad)} in one place or not at all, and the readers that look "
        "elsewhere use their own defaults; the written config.json resolves it: every reader sees the values "
        "below"
    )


def normalized_rope_keys(rope: dict) -> dict:
    """The rope keys of a config every reader reads the same way: v5 dict, v4 dict, legacy top-level keys.

    `rope` is a resolved dict (rope_type, rope_theta, partial_rotary_factor, mrope_section, mrope_interleaved).
    """
    return {
        "rope_parameters": copy.deepcopy(rope),
        "rope_scaling": copy.deepcopy(rope),
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
    }


__all__ = [
    "LEGACY_READERS",
    "contradicted_fields",
    "ROPE_FIELDS",
    "V4_DEFAULTS",
    "disagreements",
    "normalized_rope_keys",
    "number_changing_disagreements",
    "resolution_line",
    "rope_table",
    "rope_views",
]
