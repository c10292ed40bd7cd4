"""`from_pretrained` of official-layout folders straight into this project's classes (no `convert`): composite or
text-only, experts fused or per expert, with or without `mtp.*`; missing tensors are an error naming them, or,
with `output_loading_info=True`, reported in transformers' load report (CPU, fp32, tiny models)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import packed_model, requires_builtin_qwen35, tiny_kwargs
from fixtures_conversion import read_folder, write_shards
from safetensors.torch import save_file
from vl_tiny import _randomize_vl, composite_kwargs, packed_vl_model

from qwen35_packed.conversion import FuseExperts, MappingEngine, SplitExperts
from qwen35_packed.modeling import (
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5MoePackedForConditionalGeneration,
    Qwen3_5PackedForCausalLM,
    Qwen3_5PackedForConditionalGeneration,
    Qwen3_5PackedTextModel,
)

MAIN_LAYERS = r"^model\.(language_model\.)?layers\."
IDS = torch.randint(0, 100, (2, 37), generator=torch.Generator().manual_seed(5))


def fake_mtp(config, *, moe: bool) -> dict[str, torch.Tensor]:
    """An MTP head as official checkpoints store it (experts per expert): the models must ignore it."""
    hidden = config.hidden_size
    g = torch.Generator().manual_seed(9)
    out = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g), "mtp.norm.weight": torch.randn(hidden)}
    if moe:
        for e in range(config.num_experts):
            for proj, shape in (
                ("gate_proj", (config.moe_intermediate_size, hidden)),
                ("up_proj", (config.moe_intermediate_size, hidden)),
                ("down_proj", (hidden, config.moe_intermediate_size)),
            ):
                out[f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=g)
    return out


def rewrite_weights(folder: Path, tensors: dict[str, torch.Tensor], n_shards: int = 3) -> None:
    """Replace a saved folder's weights by `tensors`, sharded (a layer's experts spread over several shards)."""
    for path in list(folder.glob("*.safetensors")) + list(folder.glob("*.index.json")):
        path.unlink()
    write_shards(folder, tensors, n_shards)


def official_folder(folder: Path, kind: str, layout: str, experts: str, mtp: bool, tie: bool):
    """transformers' built-in model saved by its save_pretrained (per-expert experts for MoE), then the variant
    asked for; returns the built-in model (the reference)."""
    torch.manual_seed(1)
    if layout == "composite":
        config_class = transformers.Qwen3_5MoeConfig if kind == "moe" else transformers.Qwen3_5Config
        model_class = (
            transformers.Qwen3_5MoeForConditionalGeneration
            if kind == "moe"
            else transformers.Qwen3_5ForConditionalGeneration
        )
        ref = model_class(config_class(**composite_kwargs(kind, tie_word_embeddings=tie)))
    else:
        config_class = transformers.Qwen3_5MoeTextConfig if kind == "moe" else transformers.Qwen3_5TextConfig
        model_class = transformers.Qwen3_5MoeForCausalLM if kind == "moe" else transformers.Qwen3_5ForCausalLM
        ref = model_class(config_class(**tiny_kwargs(kind), tie_word_embeddings=tie))
    _randomize_vl(ref) if layout == "composite" else None
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    ref.save_pretrained(folder)
    tensors = read_folder(folder)
    if kind == "moe":
        assert any(".experts.0.gate_proj.weight" in k for k in tensors), "save_pretrained wrote fused experts"
        if experts == "fused":
            tensors = MappingEngine([FuseExperts(scope=MAIN_LAYERS)]).map_tensors(tensors)
    if mtp:
        tensors.update(fake_mtp(ref.config.get_text_config(), moe=kind == "moe"))
    rewrite_weights(folder, tensors)
    return ref.eval()


def _classes(kind: str, layout: str) -> list:
    text = [Qwen3_5MoePackedForCausalLM if kind == "moe" else Qwen3_5PackedForCausalLM]
    if kind == "dense":
        text.append(Qwen3_5PackedTextModel)
    if layout == "composite":
        text.append(
            Qwen3_5MoePackedForConditionalGeneration if kind == "moe" else Qwen3_5PackedForConditionalGeneration
        )
    return text


def _expected_state(ref, cls) -> dict[str, torch.Tensor]:
    """The reference's tensors under `cls`'s names (the built-in keeps fused experts in memory)."""
    state = ref.state_dict()
    if cls in (Qwen3_5PackedForConditionalGeneration, Qwen3_5MoePackedForConditionalGeneration):
        return state
    text = {
        k.replace("model.language_model.", "model.", 1): v
        for k, v in state.items()
        if not k.startswith("model.visual.")
    }
    if cls is Qwen3_5PackedTextModel:
        return {k[len("model.") :]: v for k, v in text.items() if k.startswith("model.")}
    return text


@requires_builtin_qwen35
@pytest.mark.parametrize(
    "kind, layout, experts, mtp, tie",
    [
        ("dense", "composite", "-", True, True),
        ("dense", "text", "-", False, False),
        ("moe", "composite", "per_expert", True, False),
        ("moe", "composite", "fused", True, True),
        ("moe", "text", "per_expert", False, False),
        ("moe", "text", "fused", True, False),
    ],
)
def test_official_folder_loads_into_every_class(kind, layout, experts, mtp, tie, tmp_path):
    ref = official_folder(tmp_path, kind, layout, experts, mtp, tie)
    with torch.no_grad():
        want = ref(input_ids=IDS).logits
        want_hidden = (ref.model.language_model if layout == "composite" else ref.model)(input_ids=IDS)
    for cls in _classes(kind, layout):
        model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
        model.eval()
        assert not info["missing_keys"], (cls.__name__, info["missing_keys"])
        state = model.state_dict()
        expected = _expected_state(ref, cls)
        assert set(state) == set(expected), (cls.__name__, set(state) ^ set(expected))
        unequal = [k for k in expected if not torch.equal(state[k], expected[k])]
        assert not unequal, (cls.__name__, unequal[:5])
        with torch.no_grad():
            if cls is Qwen3_5PackedTextModel:
                diff = (model(input_ids=IDS).last_hidden_state - want_hidden.last_hidden_state).abs().max()
            else:
                diff = (model(input_ids=IDS).logits - want).abs().max()
        assert diff <= 1e-4, (cls.__name__, diff.item())
        if tie and cls is not Qwen3_5PackedTextModel:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def saved_composite(folder: Path, kind: str = "moe", *, per_expert: bool = True) -> torch.nn.Module:
    """This project's composite model saved in the official layout (no built-in needed, so this runs on 4.57),
    experts per expert as transformers' save_pretrained writes them, an MTP head, three shards."""
    model = packed_vl_model(kind)
    model.save_pretrained(folder)
    tensors = read_folder(folder)
    if per_expert:
        tensors = MappingEngine([SplitExperts()]).map_tensors(tensors)
    tensors.update(fake_mtp(model.config.text_config, moe=kind == "moe"))
    rewrite_weights(folder, tensors)
    return model


def test_per_expert_composite_loads_without_builtin(tmp_path):
    source = saved_composite(tmp_path)
    for cls in (Qwen3_5MoePackedForCausalLM, Qwen3_5MoePackedForConditionalGeneration):
        model = cls.from_pretrained(tmp_path).eval()
        with torch.no_grad():
            assert torch.equal(model(input_ids=IDS).logits, source(input_ids=IDS).logits), cls.__name__
        experts = (
            model.model.layers[0].mlp.experts
            if cls is Qwen3_5MoePackedForCausalLM
            else (model.model.language_model.layers[0].mlp.experts)
        )
        assert torch.equal(experts.gate_up_proj, source.model.language_model.layers[0].mlp.experts.gate_up_proj)


def test_text_class_on_folder_without_text_weights_names_them(tmp_path):
    saved_composite(tmp_path, per_expert=False)
    tensors = {k: v for k, v in read_folder(tmp_path).items() if k.startswith("model.visual.")}
    rewrite_weights(tmp_path, tensors, n_shards=1)
    with pytest.raises(
        ValueError,
        match=r"lacks \d+ tensors that Qwen3_5MoePackedForCausalLM needs: "
        r".*model\.embed_tokens\.weight",
    ):
        Qwen3_5MoePackedForCausalLM.from_pretrained(tmp_path)


def folder_missing_one_tensor(tmp_path):
    """A dense composite folder without layer 2's A_log: the source model, and (class, the missing key as that class
    names it) for the text and the vision-language class."""
    source = saved_composite(tmp_path, kind="dense", per_expert=False)
    tensors = read_folder(tmp_path)
    del tensors["model.language_model.layers.2.linear_attn.A_log"]
    rewrite_weights(tmp_path, tensors)
    return source, (
        (Qwen3_5PackedForCausalLM, "model.layers.2.linear_attn.A_log"),
        (Qwen3_5PackedForConditionalGeneration, "model.language_model.layers.2.linear_attn.A_log"),
    )


def test_missing_tensor_is_named(tmp_path):
    for cls, name in folder_missing_one_tensor(tmp_path)[1]:
        with pytest.raises(ValueError, match=rf"lacks 1 tensors that {cls.__name__} needs: {name}\."):
            cls.from_pretrained(tmp_path)


def test_a_missing_tensor_is_refused_before_transformers_reports_it(tmp_path, caplog):
    """transformers' load report would announce the missing tensor as newly initialised, then the class refuses the
    folder: the refusal comes first, and transformers reports nothing."""
    _, classes = folder_missing_one_tensor(tmp_path)
    library = logging.getLogger("transformers")  # logs through its own handler, not the root logger's
    library.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="transformers"):
            for cls, name in classes:
                with pytest.raises(ValueError, match=rf"lacks 1 tensors that {cls.__name__} needs: {name}\."):
                    cls.from_pretrained(tmp_path)
    finally:
        library.removeHandler(caplog.handler)
    reports = [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    assert not [m for m in reports if "newly initialized" in m or "LOAD REPORT" in m or name in m], reports


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\xff" * 8 + data[8:])


@pytest.mark.parametrize("how", ["truncated", "header"])
@pytest.mark.parametrize("layout", ["single file", "shards"])
def test_a_damaged_checkpoint_file_is_named(layout, how, tmp_path):
    """safetensors' own error ("incomplete metadata, file not fully covered") names no file: the load names it."""
    if layout == "single file":
        packed_model("dense").save_pretrained(tmp_path)
        damaged = tmp_path / "model.safetensors"
        classes = (Qwen3_5PackedForCausalLM,)
    else:
        saved_composite(tmp_path, kind="dense", per_expert=False)
        damaged = sorted(tmp_path.glob("*.safetensors"))[1]
        classes = (Qwen3_5PackedForCausalLM, Qwen3_5PackedForConditionalGeneration)
    _damage(damaged, how)
    message = f"checkpoint file {re.escape(str(damaged))} does not read: it is truncated or damaged"
    for cls in classes:
        with pytest.raises(ValueError, match=message):
            cls.from_pretrained(tmp_path)


LOADING_INFO_KEYS = {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"}


def test_output_loading_info_reports_missing_tensors_instead_of_raising(tmp_path, caplog):
    """transformers' contract: a caller who asks for the load report gets (model, info) with the missing tensors in
    `missing_keys` (and one warning line naming them), the others loaded; without the report the load raises."""
    source, classes = folder_missing_one_tensor(tmp_path)
    for cls, name in classes:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qwen35_packed"):
            model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
        assert set(info) == LOADING_INFO_KEYS, info.keys()
        assert list(info["missing_keys"]) == [name], (cls.__name__, info["missing_keys"])
        ours = [r.getMessage() for r in caplog.records if r.name.startswith("qwen35_packed")]
        assert len(ours) == 1 and f"1 tensors not in {tmp_path}, left randomly initialised" in ours[0], ours
        assert name in ours[0]
        expected = source.state_dict()
        if cls is Qwen3_5PackedForCausalLM:
            expected = {k.replace("model.language_model.", "model.", 1): v for k, v in expected.items()}
        loaded = model.state_dict()
        assert all(torch.equal(loaded[k], expected[k]) for k in loaded if k != name), cls.__name__
        with pytest.raises(ValueError, match=rf"lacks 1 tensors that {cls.__name__} needs: {name}\."):
            cls.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_output_loading_info_of_a_base_model_folder_names_the_head(kind, tmp_path):
    """transformers' test_correct_missing_keys: the base model saved alone, the causal LM loaded from it reports its
    untied lm_head missing."""
    model = packed_model(kind, tie_word_embeddings=False)
    model.model.save_pretrained(tmp_path)
    _, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert list(info["missing_keys"]) == ["lm_head.weight"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_output_loading_info_of_a_folder_without_weights_names_every_tensor(kind, tmp_path):
    """transformers' test_model_weights_reload_no_missing_tied_weights: with every weight file replaced by an
    unrelated tensor, `missing_keys` is the whole state dict (tied weights included, fused experts too: they are in
    `_keys_to_ignore_on_load_missing` only because they are filled from per-expert tensors after loading)."""
    model = packed_model(kind, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    for path in tmp_path.glob("*.safetensors*"):
        path.unlink()
    save_file({"tensor": torch.tensor([1, 2])}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reloaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == set(reloaded.state_dict())
    assert list(info["unexpected_keys"]) == ["tensor"]
    if kind == "moe":
        assert "model.layers.0.mlp.experts.gate_up_proj" in info["missing_keys"]


def test_incomplete_or_doubled_experts_are_errors(tmp_path):
    saved_composite(tmp_path)
    tensors = read_folder(tmp_path)
    missing = "model.language_model.layers.1.mlp.experts.2.up_proj.weight"
    complete = dict(tensors)
    del tensors[missing]
    rewrite_weights(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"per expert but lacks model\.layers\.1\.mlp\.experts\.2\.up_proj"):
        Qwen3_5MoePackedForCausalLM.from_pretrained(tmp_path)
    doubled = MappingEngine([FuseExperts(scope=r"layers\.1\.")]).map_tensors(complete)
    doubled.update({k: v for k, v in complete.items() if ".layers.1.mlp.experts." in k})
    rewrite_weights(tmp_path, doubled)
    with pytest.raises(ValueError, match=r"stores the experts of .*layers\.1\.mlp\.experts.* both fused and per"):
        Qwen3_5MoePackedForConditionalGeneration.from_pretrained(tmp_path)


def test_vision_language_class_on_text_folder_is_refused(tmp_path):
    text = Qwen3_5PackedForCausalLM(Qwen3_5PackedForCausalLM.config_class(**tiny_kwargs("dense")))
    text.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="text model's config .* need a composite"):
        Qwen3_5PackedForConditionalGeneration.from_pretrained(tmp_path)


def test_text_config_of_a_composite_folder(tmp_path):
    """The text classes' config of a composite config.json is its text_config, tied as the composite model."""
    saved_composite(tmp_path, kind="dense", per_expert=False)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["tie_word_embeddings"] = True
    raw["text_config"]["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = Qwen3_5PackedForCausalLM.config_class.from_pretrained(tmp_path)
    assert (
        config.model_type == "qwen3_5_text"
        and config.vocab_size == composite_kwargs("dense")["text_config"]["vocab_size"]
    )
    assert config.tie_word_embeddings is True
