"""Property tests of rope normalisation: random mixes of v5 (`rope_parameters`), v4 (`rope_scaling` with `type` or
`rope_type`, `mrope` or `default`) and top-level keys, each value in one or several places, in the spellings
configs carry (int or float theta, list or tuple sections). Invariant: the config class, `resolve_rope_parameters`
and `convert`'s config all resolve to the values given (official defaults for absent ones), the written config
reads the same to every reader and normalising it again changes nothing; a value given twice with different
numbers is a ValueError (a ConversionError in `convert`) naming both sources."""

from __future__ import annotations

import copy

import pytest
from conftest import tiny_kwargs
from hypothesis import given
from hypothesis import strategies as st
from properties import property_settings

from qwen35_packed import Qwen3_5PackedConfig
from qwen35_packed.configuration.configuration_qwen3_5_packed import QWEN3_5_ROPE_DEFAULTS, resolve_rope_parameters
from qwen35_packed.conversion import ConversionError
from qwen35_packed.conversion.config import build_output_config
from qwen35_packed.conversion.rope_readers import disagreements, rope_views

# partial_rotary_factor -> mrope sections summing to the rotary half-dim of the tiny head_dim 32
SECTIONS = {0.25: [[2, 1, 1]], 0.5: [[3, 3, 2], [4, 2, 2]], 1.0: [[6, 5, 5], [8, 4, 4]]}
PLACES = {
    "rope_theta": ("rope_parameters", "rope_scaling", "top"),
    "partial_rotary_factor": ("rope_parameters", "rope_scaling", "top"),
    "mrope_section": ("rope_parameters", "rope_scaling"),
    "mrope_interleaved": ("rope_parameters", "rope_scaling"),
    "rope_type": ("rope_parameters", "rope_scaling"),
}


@st.composite
def rope_settings(draw, required=("partial_rotary_factor", "mrope_section")):
    """(config kwargs holding the rope keys, the values a correct resolution gives)."""
    prf = draw(st.sampled_from(sorted(SECTIONS)))
    values = {
        "rope_theta": draw(st.sampled_from([1e4, 1e6, 5e6, 1e7])),
        "partial_rotary_factor": prf,
        "mrope_section": draw(st.sampled_from(SECTIONS[prf])),
        "mrope_interleaved": draw(st.booleans()),
        "rope_type": "default",
    }
    kwargs: dict = {}
    for name, value in values.items():
        places = draw(st.lists(st.sampled_from(PLACES[name]), unique=True, min_size=0 if name not in required else 1))
        for place in places:
            written = value
            if name == "rope_theta" and draw(st.booleans()):
                written = int(value)  # 10000000 and 1e7 are the same theta
            if name == "mrope_section" and draw(st.booleans()):
                written = tuple(value)
            key = name
            if name == "rope_type" and place == "rope_scaling":
                key = draw(st.sampled_from(["type", "rope_type"]))  # v4 spelling, or v5's inside rope_scaling
                written = draw(st.sampled_from(["default", "mrope"]))  # v4 configs call it mrope
            if place == "top":
                kwargs[name] = written
            else:
                kwargs.setdefault(place, {})[key] = written
    expected = {k: values[k] if _present(kwargs, k) else QWEN3_5_ROPE_DEFAULTS[k] for k in values}
    return kwargs, expected


def _present(kwargs, name) -> bool:
    keys = {name, "type"} if name == "rope_type" else {name}
    return name in kwargs or any(keys & set(kwargs.get(p, {})) for p in ("rope_parameters", "rope_scaling"))


def _resolve(kwargs):
    return resolve_rope_parameters(kwargs.get("rope_parameters"), kwargs.get("rope_scaling"),
                                   kwargs.get("rope_theta"), kwargs.get("partial_rotary_factor"))  # fmt: skip


def _text_config(kwargs) -> dict:
    base = {k: v for k, v in tiny_kwargs("dense").items() if k != "rope_parameters"}
    return {**base, **copy.deepcopy(kwargs), "model_type": "qwen3_5_text"}


@property_settings(max_examples=150)
@given(rope_settings(required=()))
def test_resolution_gives_the_values_given(case):
    kwargs, expected = case
    assert _resolve(kwargs) == expected


@property_settings(max_examples=60)
@given(rope_settings())
def test_config_and_convert_agree_on_every_reader(case):
    kwargs, expected = case
    config = Qwen3_5PackedConfig(**_text_config(kwargs))
    assert config.rope_parameters == expected
    assert (config.rope_theta, config.partial_rotary_factor) == (expected["rope_theta"],
                                                                 expected["partial_rotary_factor"])  # fmt: skip
    assert Qwen3_5PackedConfig(**config.to_dict()).rope_parameters == expected  # a saved config reads the same

    written = build_output_config(_text_config(kwargs), text_only=False).data
    views = rope_views(written)
    assert disagreements(views) == []
    for view in views.values():
        assert view == {k: expected[k] for k in view}
    again = build_output_config(copy.deepcopy(written), text_only=False).data
    assert {k: again[k] for k in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")} == {
        k: written[k] for k in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")
    }


CONTRADICTIONS = {"rope_theta": 123.0, "partial_rotary_factor": 0.75, "mrope_section": [1, 2, 3],
                  "mrope_interleaved": None}  # None: the opposite boolean  # fmt: skip


@property_settings(max_examples=80)
@given(rope_settings(required=tuple(CONTRADICTIONS)), st.sampled_from(sorted(CONTRADICTIONS)), st.data())
def test_a_value_given_twice_with_different_numbers_raises(case, name, data):
    kwargs, expected = case
    # a place that does not hold the value yet, else overwrite one of several places
    other = [p for p in PLACES[name] if (kwargs if p == "top" else kwargs.get(p, {})).get(name) is None]
    place = data.draw(st.sampled_from(other or list(PLACES[name])))
    wrong = CONTRADICTIONS[name] if CONTRADICTIONS[name] is not None else not expected[name]
    if place == "top":
        kwargs[name] = wrong
    else:
        kwargs.setdefault(place, {})[name] = wrong
    with pytest.raises(ValueError, match=f"Contradicting rope values: {name}="):
        _resolve(kwargs)
    with pytest.raises(ConversionError, match=f"Contradicting rope values: {name}=(.|\n)*each reader sees"):
        build_output_config(_text_config(kwargs), text_only=False)
