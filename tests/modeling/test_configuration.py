"""Configuration: every official text_config reads; rope has one source of truth; contradictions raise."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from conftest import requires_builtin_qwen35, tiny_kwargs

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)

REFERENCE = Path(
    os.environ.get("QWEN35_REFERENCE_DIR", Path(__file__).resolve().parents[3] / "shared/reference/qwen3.5")
)


def reference_configs():
    if not REFERENCE.is_dir():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"reference configs not found at {REFERENCE}")
        return []
    return sorted(p.parent.name for p in REFERENCE.glob("*/config.json"))


def load_text_config(name):
    composite = json.loads((REFERENCE / name / "config.json").read_text())
    text = dict(composite["text_config"])
    text.setdefault("tie_word_embeddings", composite.get("tie_word_embeddings", False))
    return text


@requires_builtin_qwen35
@pytest.mark.parametrize("name", reference_configs())
def test_reference_config_builds_builtin_identical_model_on_meta(name):
    text = load_text_config(name)
    moe = text["model_type"] == "qwen3_5_moe_text"
    ours_config = (Qwen3_5MoePackedConfig if moe else Qwen3_5PackedConfig)(**text)
    ref_config = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**text)
    assert ours_config.rope_parameters["rope_theta"] == 1e7 == ours_config.rope_theta
    assert ours_config.layer_types == ref_config.layer_types
    with torch.device("meta"):
        ours = (Qwen3_5MoePackedForCausalLM if moe else Qwen3_5PackedForCausalLM)(ours_config)
        ref = (transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM)(ref_config)
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert ours_shapes == ref_shapes
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())


def test_v4_top_level_rope_keys_are_read():
    config = Qwen3_5PackedConfig(
        rope_theta=5e6,
        partial_rotary_factor=0.25,
        rope_scaling={"type": "mrope", "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    assert config.rope_parameters["rope_theta"] == 5e6 == config.rope_theta
    assert config.rope_parameters["mrope_section"] == [11, 11, 10]
    assert config.rope_parameters["rope_type"] == "default"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rope_theta": 5e6, "rope_parameters": {"rope_theta": 1e7}},
        {"partial_rotary_factor": 0.5, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}},
        {"rope_scaling": {"mrope_section": [10, 11, 11]}, "rope_parameters": {"mrope_section": [11, 11, 10]}},
    ],
)
def test_contradicting_rope_values_raise(kwargs):
    with pytest.raises(ValueError, match="Contradicting rope values"):
        Qwen3_5PackedConfig(**kwargs)


@requires_builtin_qwen35
def test_saved_config_gives_every_reader_the_same_rope(tmp_path):
    Qwen3_5PackedConfig(rope_parameters={"rope_theta": 5e6}).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 5e6  # v4 and v5 readers agree
    builtin = transformers.AutoConfig.from_pretrained(tmp_path)  # model_type qwen3_5_text -> built-in class
    assert type(builtin) is transformers.Qwen3_5TextConfig
    assert builtin.rope_parameters["rope_theta"] == 5e6
    assert Qwen3_5PackedConfig.from_pretrained(tmp_path).rope_parameters["rope_theta"] == 5e6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_hidden_layers": 3, "layer_types": ["linear_attention"] * 2}, "layer_types has 2 entries"),
        ({"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention", "x", "y"]}, "Unknown layer"),
        ({"num_hidden_layers": 4, "full_attention_interval": 2, "layer_types": ["full_attention"] * 4}, "contradicts"),
        ({"rope_parameters": {"mrope_section": [8, 8, 8], "mrope_interleaved": False}}, "must sum to the rotary"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "'yarn' .* cannot be computed .*factor"),
        ({"rope_parameters": {"rope_type": "bogus"}}, "'bogus' is not one of the rope types .* yarn"),
        ({"gdn_kernel": "cuda"}, "gdn_kernel"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
    ],
)
def test_invalid_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Qwen3_5PackedConfig(**kwargs)


def test_moe_aux_coefficient_must_be_a_number():
    with pytest.raises(ValueError, match="router_aux_loss_coef must be a number"):
        Qwen3_5MoePackedConfig(router_aux_loss_coef="0.001")


def test_moe_config_takes_the_dense_fields_and_its_own():
    """The MoE config's parameters are the dense config's (its shape defaults Qwen3.5-35B-A3B's) with the MoE fields
    before the kernel choices; fields given by keyword or by position reach the config as they bind there."""
    import inspect

    from qwen35_packed.modeling.configuration_qwen3_5_packed import MOE_FIELDS, MOE_SHAPE_DEFAULTS

    dense = inspect.signature(Qwen3_5PackedConfig.__init__).parameters
    moe = inspect.signature(Qwen3_5MoePackedConfig.__init__).parameters
    assert [name for name in moe if name not in MOE_FIELDS] == list(dense)
    names = list(moe)
    assert names.index("gdn_kernel") == names.index(list(MOE_FIELDS)[-1]) + 1
    for name, parameter in dense.items():
        assert moe[name].default == MOE_SHAPE_DEFAULTS.get(name, parameter.default), name
    for name, (default, _) in MOE_FIELDS.items():
        assert moe[name].default == default, name

    given = {**tiny_kwargs("moe"), "num_experts": 6, "output_router_logits": True}
    config = Qwen3_5MoePackedConfig(**given, moe_kernel="loop")
    assert (config.num_experts, config.output_router_logits, config.moe_kernel) == (6, True, "loop")
    assert config.hidden_size == tiny_kwargs("moe")["hidden_size"]
    assert Qwen3_5MoePackedConfig(248320, 1024).hidden_size == 1024  # positions follow the signature
    with pytest.raises(TypeError, match="vocab_size"):
        Qwen3_5MoePackedConfig(248320, vocab_size=248320)


@pytest.mark.parametrize("name", ["Qwen3.5-0.8B", "Qwen3.5-4B", "Qwen3.5-9B", "Qwen3.5-35B-A3B"])
def test_example_config_is_the_official_file(name):
    # examples/fsdp2_train_step.py and the benchmarks read these copies (the reference set does not travel to the
    # GPU machines); each must stay the official file byte for byte.
    if name not in reference_configs():
        pytest.skip("reference configs not available")
    copy = Path(__file__).resolve().parents[2] / "examples" / "configs" / f"{name}.config.json"
    assert copy.read_bytes() == (REFERENCE / name / "config.json").read_bytes()


@requires_builtin_qwen35
@pytest.mark.parametrize("moe", [False, True])
def test_every_field_is_a_parameter_with_the_builtin_default(moe):
    """Tools (transformers' model testers among them) build configs from the signature: a field taken only through
    **kwargs gets the full-size default (256 experts). Every field of the built-in config is a parameter of ours,
    with the built-in's default (max_position_embeddings: the official checkpoints' 262,144)."""
    import dataclasses
    import inspect

    ours, builtin = (
        (Qwen3_5MoePackedConfig, transformers.Qwen3_5MoeTextConfig)
        if moe
        else (Qwen3_5PackedConfig, transformers.Qwen3_5TextConfig)
    )
    parameters = inspect.signature(ours.__init__).parameters
    own_fields = set(builtin.__annotations__)  # declared by the Qwen3.5 config itself, not PreTrainedConfig
    builtin_defaults = {
        f.name: f.default
        for f in dataclasses.fields(builtin)
        if f.name in own_fields and f.default is not dataclasses.MISSING
    }
    assert builtin_defaults, "the built-in config lists no fields"
    for name, default in builtin_defaults.items():
        if name == "max_position_embeddings":
            continue
        assert name in parameters, name
        assert parameters[name].default == default, name
    assert parameters["max_position_embeddings"].default == 262144
    if moe:
        small = {name: 2 for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
        config = ours(**{**tiny_kwargs("moe"), **small, "shared_expert_intermediate_size": 4})
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (2, 2, 2)
        assert config.shared_expert_intermediate_size == 4


@pytest.mark.parametrize("interleaved", [True, False])
def test_a_stated_mrope_section_must_cover_the_rotary_half_dim(interleaved, caplog):
    rope = {"rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_interleaved": interleaved}
    base = {k: v for k, v in tiny_kwargs("dense").items() if k != "rope_parameters"}  # head_dim 32: half-dim 8
    for bad in (
        {"rope_parameters": {**rope, "mrope_section": [2, 1, 1]}},
        {"rope_scaling": {**rope, "mrope_section": [4, 4, 5]}},
    ):
        if interleaved:  # the built-in reads these; so do we, saying so once
            with caplog.at_level("WARNING"):
                Qwen3_5PackedConfig(**base, **bad)
            assert "does not sum to the rotary half-dim 8" in caplog.text
            caplog.clear()
        else:
            with pytest.raises(ValueError, match="must sum to the rotary half-dim 8"):
                Qwen3_5PackedConfig(**base, **bad)
    assert Qwen3_5PackedConfig(**base, rope_parameters={**rope, "mrope_section": [3, 3, 2]}).rotary_dim == 16
    # no sections: the official default is read as the built-in reads it (interleaved), whatever its sum, also
    # after a round trip through the saved dict, which then states it
    if interleaved:
        config = Qwen3_5PackedConfig(**base, rope_parameters=rope)
        assert config.rope_parameters["mrope_section"] == [11, 11, 10]
        again = Qwen3_5PackedConfig.from_dict(config.to_dict())
        assert again.rope_parameters == config.rope_parameters


@requires_builtin_qwen35
@pytest.mark.parametrize("moe", [False, True])
def test_tensor_parallel_plan_names_modules_of_the_model(moe):
    """The built-in's plan for attention, GDN and dense / shared-expert MLPs, every entry naming modules the model
    has; no entry for the routed experts (replicated; no expert-parallel plan); lm_head's entry is the built-in's
    (tests/integrations/test_tensor_parallel.py runs the plans)."""
    import re

    config_class, model_class = (
        (Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM)
        if moe
        else (Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM)
    )
    kind = "moe" if moe else "dense"
    overrides = {"mlp_only_layers": [0], "intermediate_size": 64} if moe else {}  # a dense MLP layer in the MoE too
    model = model_class(config_class(**{**tiny_kwargs(kind), **overrides}))
    plan = config_class.base_model_tp_plan
    builtin = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig).base_model_tp_plan
    names = [name for name, _ in model.model.named_modules()]
    for pattern, style in plan.items():
        assert builtin[pattern] == style, pattern
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        assert any(regex.match(name) for name in names), pattern
    assert not [p for p in plan if ".experts" in p] and getattr(config_class, "base_model_ep_plan", None) is None
    missing = set(builtin) - set(plan)
    assert missing == ({p for p in builtin if ".experts" in p} if moe else set())
    builtin_class = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    assert model_class._tp_plan == builtin_class._tp_plan == {"lm_head": "colwise_gather_output"}
    assert model._tp_plan["lm_head"] == "colwise_gather_output"  # the merged plan transformers applies
