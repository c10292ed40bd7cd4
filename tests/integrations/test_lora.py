"""PEFT LoRA on packed Qwen3.5: the config helper, the modules and expert parameters each target group wraps per
layer (written out by name), adapters that really act (GDN, attention, MLP, experts), merge/unmerge equality, merged
names/shapes = the base state dict (what the vLLM sync sends), adapter save/load, the TRL CLI flags, and the
errors."""

import pytest
import torch
from conftest import packed_model

peft = pytest.importorskip("peft")

from qwen35_packed.integrations.lora import (  # noqa: E402
    EXPERT_PARAMETERS,
    lora_config,
    target_modules_regex,
    trl_cli_args,
)


def _model(kind):
    return packed_model(kind, seed=5)


def _randomize_lora_b(model, seed=0):
    model.eval()  # PEFT creates its dropout modules in training mode
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _adapted(kind, **config):
    """(base model, PEFT model with random nonzero adapters on every default group), eval mode."""
    model = _model(kind)
    wrapped = peft.get_peft_model(model, lora_config(model, r=4, **config))
    _randomize_lora_b(wrapped)
    return model, wrapped


def _ids(seed=0):
    return torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(seed))


def _trl_sync_names(peft_model):
    """The names and shapes TRL's vLLM sync sends for a PEFT model (its stripping rules)."""
    out = {}
    for name, p in peft_model.named_parameters():
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if peft_model.prefix in name or "original_module" in name:
            continue
        out[name] = tuple(p.shape)
    return out


def test_config_dense_and_moe():
    dense, moe = lora_config(_model("dense")), lora_config(_model("moe"))
    assert dense.target_parameters in (None, []) and dense.lora_dropout == 0.05
    assert list(moe.target_parameters) == list(EXPERT_PARAMETERS) and moe.lora_dropout == 0.0
    wrapped = peft.get_peft_model(_model("dense"), dense)
    names = {n.split(".lora_A")[0] for n, _ in wrapped.named_parameters() if "lora_A" in n}
    leaf = {n.split(".")[-1] for n in names}
    assert leaf == {
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_a",
        "in_proj_b",
        "out_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert not any("conv1d" in n or "lm_head" in n or "embed" in n for n in names)


# What PEFT wraps in the tiny models (layers 0-2 Gated DeltaNet, layer 3 full attention), written out by name: a
# fault in the target patterns or the expert parameter list changes these sets whatever the module's constants say.
GDN = {
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "linear_attn.out_proj",
}
ATTENTION = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
DENSE_MLP = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
SHARED_EXPERT = {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"}
EXPERTS = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}  # 3D parameters, through PEFT's ParamWrapper
CONV = {"linear_attn.conv1d"}
CONV_CHANNELS = 256  # 2 * 64 (q, k) + 2 * 64 (v) in the tiny models
LINEAR_LAYERS, ATTENTION_LAYERS = (0, 1, 2), (3,)


def _expected_targets(kind, groups):
    """{layer: the names PEFT must wrap there} for the target groups `groups` of the tiny `kind` model."""
    per_layer = {}
    for layer in LINEAR_LAYERS + ATTENTION_LAYERS:
        names = set()
        if "gdn" in groups and layer in LINEAR_LAYERS:
            names |= GDN
        if "conv" in groups and layer in LINEAR_LAYERS:
            names |= CONV
        if "attention" in groups and layer in ATTENTION_LAYERS:
            names |= ATTENTION
        if "mlp" in groups:
            names |= SHARED_EXPERT if kind == "moe" else DENSE_MLP
        if "experts" in groups and kind == "moe":
            names |= EXPERTS
        per_layer[layer] = names
    return per_layer


def _wrapped_targets(peft_model):
    """{layer: names PEFT wrapped there}: a LoRA nn.Linear by its module path, a ParamWrapper by the path of the
    parameter it adapts (PEFT nests one wrapper per parameter of a module through `base_layer`)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    per_layer = {layer: set() for layer in LINEAR_LAYERS + ATTENTION_LAYERS}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        path = name.removeprefix("base_model.model.model.layers.").replace(".base_layer", "")
        layer, _, inner = path.partition(".")
        if isinstance(module, ParamWrapper):
            inner = f"{inner}.{module.parameter_name}"
        per_layer[int(layer)].add(inner)
    return per_layer


@pytest.mark.parametrize(
    "kind, groups",
    [
        ("dense", ["gdn"]),
        ("dense", ["attention"]),
        ("dense", ["mlp"]),
        ("dense", ["gdn", "conv"]),
        ("dense", None),  # the default: every group the dense model has but the conv
        ("moe", ["gdn"]),
        ("moe", ["attention"]),
        ("moe", ["mlp"]),
        ("moe", ["experts"]),
        ("moe", ["attention", "experts"]),
        ("moe", None),
    ],
    ids=lambda v: v if isinstance(v, str) else "+".join(v or ["default"]),
)
def test_each_group_wraps_exactly_the_named_modules(kind, groups):
    """Per layer, the modules and expert parameters PEFT wraps for each target group equal the names written out
    above; nothing else (conv1d, norms, router, shared-expert gate, embeddings, lm_head) gets an adapter."""
    model = _model(kind)
    config = lora_config(model, r=2) if groups is None else lora_config(model, r=2, targets=groups)
    wrapped = peft.get_peft_model(model, config)
    expected = _expected_targets(kind, ["gdn", "attention", "mlp", "experts"] if groups is None else groups)
    assert _wrapped_targets(wrapped) == expected
    # Every wrapped name carries one adapter pair: as many lora_A as names.
    lora_a = [n for n, _ in wrapped.named_parameters() if ".lora_A." in n]
    assert len(lora_a) == sum(len(names) for names in expected.values())


@pytest.mark.parametrize("group", ["gdn", "attention", "mlp", "experts"])
def test_every_group_really_acts(group):
    """An adapter on each group changes the output (none is a silent no-op) and merges exactly."""
    kind = "moe" if group == "experts" else "dense"
    model = _model(kind)
    ids = _ids()
    with torch.no_grad():
        base = model(ids, use_cache=False).logits
    wrapped = peft.get_peft_model(model, lora_config(model, r=4, targets=[group]))
    _randomize_lora_b(wrapped)
    with torch.no_grad():
        adapted = wrapped(ids, use_cache=False).logits
        wrapped.merge_adapter()
        merged = wrapped(ids, use_cache=False).logits
        wrapped.unmerge_adapter()
        unmerged = wrapped(ids, use_cache=False).logits
        with wrapped.disable_adapter():
            disabled = wrapped(ids, use_cache=False).logits
    assert (adapted - base).abs().max().item() > 1e-3
    assert (merged - adapted).abs().max().item() <= 1e-5
    assert (unmerged - adapted).abs().max().item() <= 1e-5
    assert (disabled - base).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_adapted_module_acts_alone(kind):
    """Each LoRA module of the default config, freshly initialised (B = 0, where training starts), gets a gradient
    from the logits: its adapter alone moves the output. One module that the forward bypasses (reading its weight
    directly, as the GDN conv once did) gets none and cannot hide behind the rest of its group."""
    model = _model(kind)
    with torch.no_grad():  # decays exp(g) away from 0: a saturated decay (A up to 16) would hide in_proj_a
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-2.0, 0.0)
    wrapped = peft.get_peft_model(model, lora_config(model, r=4))
    wrapped.eval()
    logits = wrapped(_ids(3), use_cache=False).logits
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    (logits * probe).sum().backward()
    lora_b = {n.split(".lora_B")[0]: p for n, p in wrapped.named_parameters() if "lora_B" in n}
    assert len(lora_b) == sum(1 for n, _ in wrapped.named_parameters() if "lora_A" in n)
    silent = {m: 0.0 if p.grad is None else p.grad.abs().max().item() for m, p in lora_b.items()}
    silent = {m: g for m, g in silent.items() if g <= 1e-3}
    assert not silent, silent
    assert any("experts" in m for m in lora_b) == (kind == "moe")


@pytest.mark.parametrize("r, conv_rank", [(4, CONV_CHANNELS), (2 * CONV_CHANNELS, 2 * CONV_CHANNELS)])
def test_conv_group_gets_a_rank_peft_takes_and_acts(r, conv_rank):
    """`conv`: the GDN conv gets rank r where r is a multiple of its channels, else the channel count (PEFT takes
    no other), with the scaling of the other modules; its adapter acts, a disabled one does not, PEFT refuses to
    merge it and the vLLM weight sync, which merges, refuses it up front."""
    from qwen35_packed.integrations.vllm_sync import check_adapters_mergeable

    model = _model("moe")
    ids = _ids()
    with torch.no_grad():
        base = model(ids, use_cache=False).logits
    wrapped = peft.get_peft_model(model, lora_config(model, r=r, targets=["gdn", "conv"]))
    _randomize_lora_b(wrapped)
    convs = [m for name, m in wrapped.named_modules() if name.endswith("linear_attn.conv1d")]
    projections = [m for name, m in wrapped.named_modules() if name.endswith("linear_attn.in_proj_qkv")]
    assert len(convs) == len(LINEAR_LAYERS)
    assert {c.r["default"] for c in convs} == {conv_rank} and {m.r["default"] for m in projections} == {r}
    assert {c.scaling["default"] for c in convs} == {m.scaling["default"] for m in projections} == {2.0}
    with torch.no_grad():
        adapted = wrapped(ids, use_cache=False).logits
        with wrapped.disable_adapter():
            disabled = wrapped(ids, use_cache=False).logits
    assert (adapted - base).abs().max().item() > 1e-3
    assert (disabled - base).abs().max().item() <= 1e-5
    with pytest.raises(NotImplementedError, match="groups > 1"):
        wrapped.merge_adapter()
    wrapped.unmerge_adapter()  # the projections PEFT merged before it reached a conv
    with pytest.raises(ValueError, match="LoRA on the GDN conv \\(3 modules, base_model.model.model.layers.0"):
        check_adapters_mergeable(wrapped)
    check_adapters_mergeable(_adapted("moe")[1])  # no conv target: the sync merges


def test_trl_cli_flags_with_the_conv():
    """TRL's flags have one rank: with `conv` they need r a multiple of the conv's channels, and then build the same
    adapter; another r raises, naming the channel count."""
    trl = pytest.importorskip("trl")
    model = _model("dense")
    with pytest.raises(ValueError, match=f"multiple of its {CONV_CHANNELS} channels"):
        trl_cli_args(model, r=16, targets=["gdn", "conv"])
    args = trl_cli_args(model, r=CONV_CHANNELS, targets=["gdn", "conv"])
    assert "conv1d" in args
    (model_args,) = trl.TrlParser((trl.ModelConfig,)).parse_args_into_dataclasses(["--model_name_or_path", "x", *args])
    from_cli = peft.get_peft_model(_model("dense"), trl.get_peft_config(model_args))
    from_helper = peft.get_peft_model(model, lora_config(model, r=CONV_CHANNELS, targets=["gdn", "conv"]))
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters() if "lora_" in n}  # noqa: E731
    assert shapes(from_cli) == shapes(from_helper) and any("conv1d.lora_A" in n for n in shapes(from_helper))


def test_packed_forward_with_lora_equals_per_document():
    _, wrapped = _adapted("moe")
    ids = _ids(1)
    with torch.no_grad():
        alone = wrapped(ids, use_cache=False).logits
        packed = wrapped(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 37, 74]), use_cache=False).logits
    assert (packed.reshape(2, 37, -1) - alone).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_merged_names_and_shapes_are_the_base_state_dict(kind):
    expected = {k: tuple(v.shape) for k, v in _model(kind).state_dict().items()}
    _, wrapped = _adapted(kind)
    wrapped.merge_adapter()
    assert _trl_sync_names(wrapped) == expected
    wrapped.unmerge_adapter()


def test_adapter_save_and_load(tmp_path):
    _, wrapped = _adapted("moe")
    ids = _ids(2)
    with torch.no_grad():
        expected = wrapped(ids, use_cache=False).logits
    wrapped.save_pretrained(tmp_path / "adapter")
    fresh = _model("moe")  # same seed: same base weights
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    with torch.no_grad():
        got = loaded(ids, use_cache=False).logits
    assert (got - expected).abs().max().item() <= 1e-6
    merged = loaded.merge_and_unload()
    assert type(merged).__name__ == "Qwen3_5MoePackedForCausalLM"
    with torch.no_grad():
        assert (merged(ids, use_cache=False).logits - expected).abs().max().item() <= 1e-5


def test_trl_cli_flags_build_the_same_adapter():
    trl = pytest.importorskip("trl")
    model = _model("moe")
    args = trl_cli_args(model, r=4)
    parser = trl.TrlParser((trl.ModelConfig,))
    (model_args,) = parser.parse_args_into_dataclasses(["--model_name_or_path", "x", *args])
    from_cli = peft.get_peft_model(_model("moe"), trl.get_peft_config(model_args))
    from_helper = peft.get_peft_model(model, lora_config(model, r=4))
    names = lambda m: sorted(n for n, _ in m.named_parameters() if "lora_" in n)  # noqa: E731
    assert names(from_cli) == names(from_helper) and names(from_helper)
    assert model_args.lora_dropout == 0.0


def test_config_from_a_config_object():
    model = _model("moe")
    assert lora_config(model.config).target_modules == lora_config(model).target_modules
    assert target_modules_regex([]) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(targets=["conv1d"]), "unknown LoRA target group 'conv1d'"),
        (dict(targets=["lm_head"]), "lm_head"),
        (dict(targets=["router"]), "router"),
        (dict(targets=["gdn", "embeddings"]), "unknown LoRA target group"),
        (dict(targets=[]), "no LoRA targets"),
        (dict(lora_dropout=0.1), "lora_dropout=0.1 with expert targets"),
        (dict(lora_dropout="0"), "lora_dropout must be a number"),
        (dict(r=0), "r must be a positive int"),
        (dict(target_modules=["q_proj"]), "derived from `targets`"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lora_config(_model("moe"), **kwargs)


def test_targets_that_match_nothing():
    with pytest.raises(ValueError, match="'experts' matches nothing in this model \\(dense\\)"):
        lora_config(_model("dense"), targets=["gdn", "experts"])
    from conftest import tiny_kwargs

    from qwen35_packed import Qwen3_5PackedConfig

    no_attention = dict(layer_types=["linear_attention"] * 4)
    config = Qwen3_5PackedConfig(**{**tiny_kwargs("dense"), **no_attention})
    with pytest.raises(ValueError, match="'attention' matches nothing"):
        lora_config(config, targets=["attention"])
    assert lora_config(config, targets=["gdn"]).target_modules


def test_refuses_a_model_that_already_has_adapters():
    model = _model("dense")
    wrapped = peft.get_peft_model(model, lora_config(model, r=2))
    with pytest.raises(ValueError, match="already carries adapters"):
        lora_config(wrapped)
