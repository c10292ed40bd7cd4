"""`qwen35-packed convert --to official`, round trips proven by per-tensor checksums, `--verify`, rope normalisation,
the reference configs' key lists, and failure cases (CPU, tiny models)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_kwargs
from fixtures_conversion import (
    ARCH,
    AUTO_MAP,
    add_side_files,
    build_builtin,
    build_tiny_vlm,
    builtin_class,
    composite_config,
    folder_digest,
    logits,
    read_folder,
    write_shards,
)
from safetensors.torch import save_file
from vl_tiny import builtin_vl_pair, grid_tensor, make_document, pixels_for, token_types

from qwen35_packed import hub
from qwen35_packed.cli import main
from qwen35_packed.conversion import (
    ConversionError,
    FuseExperts,
    LazyTensor,
    MappingEngine,
    convert,
    plan_official_mapping,
    plan_packed_mapping,
)
from qwen35_packed.conversion.config import CONFIG_CLASSES, build_output_config
from qwen35_packed.conversion.remote_code import remote_code_files
from qwen35_packed.conversion.rope_readers import disagreements, rope_views
from qwen35_packed.conversion.schema import expected_mtp_tensors, expected_text_tensors, expected_vision_tensors
from qwen35_packed.conversion.verify import folder_digests, verify_folders

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "qwen3.5"
PROCESSOR = {"preprocessor_config.json": '{"patch_size": 16}\n', "video_preprocessor_config.json": '{"fps": 2}\n'}
QUIET = {"progress": False, "log": lambda line: None}


def mtp_tensors(config, seed: int = 7) -> dict[str, torch.Tensor]:
    """An MTP head the way official checkpoints store it (experts per expert), random values."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in expected_mtp_tensors(config, 1).items():
        if key.endswith("experts.gate_up_proj"):
            p = key[: -len("gate_up_proj")]
            for e in range(shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = torch.randn(shape[1] // 2, shape[2], generator=g)
                out[f"{p}{e}.up_proj.weight"] = torch.randn(shape[1] // 2, shape[2], generator=g)
        elif key.endswith("experts.down_proj"):
            p = key[: -len("down_proj")]
            for e in range(shape[0]):
                out[f"{p}{e}.down_proj.weight"] = torch.randn(shape[1], shape[2], generator=g)
        else:
            out[key] = torch.randn(*shape, generator=g)
    return out


def project_config(model):
    return CONFIG_CLASSES[model.config.model_type == "qwen3_5_moe_text"](**model.config.to_dict())


def make_composite(folder: Path, kind: str, *, seed: int = 2, n_shards: int = 7) -> torch.nn.Module:
    """An official composite checkpoint: model.language_model.*, model.visual.*, mtp.* (MTP experts per expert),
    tied (dense, no lm_head.weight) or not (MoE), many small shards, tokenizer and processor files."""
    tie = kind == "dense"
    model = build_builtin(kind, seed=seed, tie_word_embeddings=tie, router_aux_loss_coef=0.001)
    folder.mkdir(parents=True)
    config = composite_config(model, moe=kind == "moe", top_tie=tie, keep_text_tie=tie)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and tie:
            continue
        tensors[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key] = value
    g = torch.Generator().manual_seed(seed + 100)
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 4, 4, generator=g)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(96, 32, generator=g).to(torch.bfloat16)
    tensors["model.visual.merger.linear_fc2.bias"] = torch.randn(64, generator=g)
    tensors.update(mtp_tensors(project_config(model)))
    write_shards(folder, tensors, n_shards=n_shards)
    add_side_files(folder)
    for name, text in PROCESSOR.items():
        (folder / name).write_text(text)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "processor_class": "P"}))
    return model


def run_cli(*args) -> int:
    return main(["convert", *map(str, args), "--no-progress"])


@pytest.fixture(scope="module", params=["dense", "moe"])
def composite(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"composite_{request.param}")
    model = make_composite(root / "official", request.param)
    return request.param, model, root / "official"


@pytest.fixture(scope="module", params=["dense", "moe"])
def official_vl(request, tmp_path_factory):
    """A real official composite checkpoint (transformers' VLM weights; dense tied, MoE untied), with an MTP head
    (MTP experts per expert), the old `model_type: "qwen3_5"` in vision_config, processor and tokenizer files; and
    its conversion to this project's composite layout (OUT), with the printed plan."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"official_vl_{kind}")
    ref, _ = builtin_vl_pair(kind, seed=13, tie_word_embeddings=kind == "dense")
    config = ref.config.to_dict()
    for key in ("transformers_version", "dtype", "_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [type(ref).__name__]
    config["text_config"]["mtp_num_hidden_layers"] = 1
    config["vision_config"]["model_type"] = config["model_type"]  # as in the published configs
    src = root / "official"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in ref.state_dict().items() if not (kind == "dense" and k == "lm_head.weight")}
    text_config = CONFIG_CLASSES[kind == "moe"](**ref.config.text_config.to_dict())
    write_shards(src, tensors | mtp_tensors(text_config), n_shards=6)
    add_side_files(src)
    for name, text in PROCESSOR.items():
        (src / name).write_text(text)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "processor_class": "P"}))
    lines: list[str] = []
    convert(src, root / "ours", progress=False, log=lines.append)
    return kind, ref, src, root / "ours", "\n".join(lines)


def test_composite_to_ours_keeps_vision_and_round_trips(official_vl, tmp_path):
    """Official composite -> this project's composite layout (no --text-only): vision tower, language model and
    lm_head kept as stored, mtp.* dropped with the same explanation as the text conversion, config normalised;
    -> official again with --mtp-from: bit-identical by checksum."""
    kind, ref, src, ours, printed = official_vl
    source = folder_digests(src)
    n_mtp = sum(k.startswith("mtp.") for k in source)
    assert f"{n_mtp} dropped (multi-token-prediction head" in printed
    assert "this project's composite layout" in printed
    result, _ = verify_folders(src, ours)
    assert result.only_in_a == sorted(k for k in source if k.startswith("mtp.")), result.lines()
    assert not result.only_in_b and not result.different  # everything else: same dtype, shape and bytes
    assert any(k.startswith("model.visual.") for k in folder_digests(ours))
    assert ("lm_head.weight" in source) is (kind == "moe")

    original, data = json.loads((src / "config.json").read_text()), json.loads((ours / "config.json").read_text())
    assert data["architectures"] == [ARCH[kind]] and data["auto_map"] == AUTO_MAP[kind]
    assert data["model_type"] == original["model_type"] == ("qwen3_5_moe" if kind == "moe" else "qwen3_5")
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert data[key] == original[key], key
    assert data["tie_word_embeddings"] is (kind == "dense") is data["text_config"]["tie_word_embeddings"]
    text = data["text_config"]
    assert text["model_type"] == ("qwen3_5_moe_text" if kind == "moe" else "qwen3_5_text")
    assert text["rope_scaling"] == text["rope_parameters"] == original["text_config"]["rope_parameters"]
    assert text["rope_theta"] == text["rope_parameters"]["rope_theta"] and not disagreements(rope_views(text))
    assert "auto_map" not in text and "architectures" not in text
    vision_type = "qwen3_5_moe_vision" if kind == "moe" else "qwen3_5_vision"
    assert data["vision_config"] == original["vision_config"] | {"model_type": vision_type}
    # the same text part as the text conversion writes
    text_only = build_output_config(original, text_only=True).data
    assert text == {k: v for k, v in text_only.items() if k not in ("architectures", "auto_map")}
    for name in [*PROCESSOR, "tokenizer_config.json", "chat_template.jinja"]:  # processor_class kept
        assert (ours / name).read_bytes() == (src / name).read_bytes(), name
    assert {p.name for p in remote_code_files()} <= {p.name for p in ours.glob("*.py")}

    back = tmp_path / "back"
    assert run_cli(ours, back, "--to", "official", "--mtp-from", src) == 0
    result, _ = verify_folders(src, back)
    assert result.identical and result.tensors_a == len(source), result.lines()
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == original["architectures"] and "auto_map" not in written
    assert written["vision_config"] == data["vision_config"]
    for name in [*PROCESSOR, "tokenizer_config.json"]:
        assert (back / name).read_bytes() == (src / name).read_bytes(), name


def test_converted_composite_loads_in_builtin_and_remote_classes(official_vl):
    """transformers' composite class loads OUT with every key and gives the source model's logits on an input with
    images; AutoModelForImageTextToText with trust_remote_code gives our class, within 1e-4 of the built-in."""
    kind, ref, _, ours, _ = official_vl
    gen = torch.Generator().manual_seed(0)
    ids, images, _ = make_document(gen, 2)
    inputs = dict(input_ids=ids.unsqueeze(0), pixel_values=pixels_for(images, gen), image_grid_thw=grid_tensor(images))
    types = token_types(inputs["input_ids"])
    with torch.no_grad():
        expected = ref(**inputs, mm_token_type_ids=types, use_cache=False).logits
    builtin, info = type(ref).from_pretrained(ours, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        got = builtin.eval()(**inputs, mm_token_type_ids=types, use_cache=False).logits
    assert torch.equal(got, expected)
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        ours, trust_remote_code=True, output_loading_info=True
    )
    assert type(model).__name__ == ARCH[kind] and type(model).__module__.startswith("transformers_modules.")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        remote = model.eval()(**inputs).logits
    assert (remote - got).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------------------------------------ round trips


def test_composite_round_trip_is_bit_identical(composite, tmp_path, capsys):
    kind, model, src = composite
    before = folder_digest(src)
    ours, back = tmp_path / "ours", tmp_path / "back"
    assert run_cli(src, ours, "--text-only") == 0
    assert run_cli(ours, back, "--to", "official", "--mtp-from", src, "--vision-from", src) == 0
    printed = capsys.readouterr().out
    n_mtp = sum(k.startswith("mtp.") for k in folder_digests(src))
    assert f"{n_mtp} -> {n_mtp} insert mtp.* from --mtp-from official, as stored" in printed
    assert "3 -> 3 insert model.visual.* from --vision-from official, as stored" in printed
    assert folder_digest(src) == before  # SRC untouched

    result, _ = verify_folders(src, back)
    assert result.identical, result.lines()
    assert result.tensors_a == len(read_folder(src)) and result.digest_a == result.digest_b
    report = tmp_path / "verify.json"
    assert main(["convert", "--verify", str(src), str(back), "--json", str(report), "--report-to", str(ours)]) == 0
    data = json.loads(report.read_text())
    assert data["identical"] is True and len(data["checksums"]) == result.tensors_a
    assert "identical: the same" in capsys.readouterr().out
    recorded = hub.load_report(ours)["round_trip"]  # the packed folder's card shows the proof
    assert recorded == {"identical": True, "tensors": result.tensors_a, "digest": result.digest_a}
    card = hub.plan_upload(ours, "org/packed").card_text
    assert f"Round trip official -> packed -> official: bit-identical, {result.tensors_a} tensors" in card

    config, original = json.loads((back / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert config["architectures"] == original["architectures"] and config["model_type"] == original["model_type"]
    assert "auto_map" not in config and "auto_map" not in config["text_config"]
    assert config["vision_config"] == original["vision_config"] and config["image_token_id"] == 120
    assert config["tie_word_embeddings"] is (kind == "dense") is config["text_config"]["tie_word_embeddings"]
    rope_keys = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "tie_word_embeddings")
    text = {k: v for k, v in config["text_config"].items() if k not in rope_keys}
    assert text == {k: v for k, v in original["text_config"].items() if k not in rope_keys}
    assert config["text_config"]["rope_parameters"] == original["text_config"]["rope_parameters"]
    assert not disagreements(rope_views(config["text_config"]))
    assert not list(back.glob("*.py"))  # official layout: no remote code
    for name in PROCESSOR:
        assert (back / name).read_bytes() == (src / name).read_bytes()
    assert json.loads((back / "tokenizer_config.json").read_text())["processor_class"] == "P"  # restored
    assert (back / "chat_template.jinja").read_bytes() == (src / "chat_template.jinja").read_bytes()


def test_trained_model_saved_by_remote_class_merges_back(composite, tmp_path):
    """The text-only RL path: ours loaded with trust_remote_code, saved by save_pretrained (its own config: auto_map,
    kernel fields, rope_scaling null), then merged back into the composite checkpoint: bit-identical to it."""
    kind, _, src = composite
    convert(src, tmp_path / "ours", text_only=True, **QUIET)
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", trust_remote_code=True)
    trained.save_pretrained(tmp_path / "trained")
    saved = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert "auto_map" in saved and "gdn_kernel" in saved
    convert(tmp_path / "trained", tmp_path / "back", to="official", mtp_from=src, vision_from=src, **QUIET)
    assert verify_folders(src, tmp_path / "back")[0].identical
    text = json.loads((tmp_path / "back" / "config.json").read_text())["text_config"]
    assert "auto_map" not in text and "gdn_kernel" not in text and "attention_kernel" not in text
    assert text["rope_scaling"] == text["rope_parameters"] and not disagreements(rope_views(text))


def test_composite_packed_layout_to_official(composite, tmp_path):
    """This project's vision-language layout (composite keys, auto_map, project fields) -> official: the config
    loses what is ours, the tensors stay as stored; with the MTP head of the original, bit-identical to it."""
    kind, _, src = composite
    ours = tmp_path / "ours_vl"
    ours.mkdir()
    tensors = {k: v for k, v in read_folder(src).items() if not k.startswith("mtp.")}
    write_shards(ours, tensors, n_shards=3)
    config = json.loads((src / "config.json").read_text())
    arch = "Qwen3_5MoePackedForConditionalGeneration" if kind == "moe" else "Qwen3_5PackedForConditionalGeneration"
    config |= {"architectures": [arch], "auto_map": {"AutoConfig": "configuration_qwen3_5_packed_vl.X"},
               "freeze_vision": True, "vision_dummy_pass": False}  # fmt: skip
    config["text_config"] |= {"gdn_kernel": "auto", "attention_kernel": "auto"}
    (ours / "config.json").write_text(json.dumps(config))
    convert(ours, tmp_path / "back", to="official", mtp_from=src, **QUIET)
    assert verify_folders(src, tmp_path / "back")[0].identical
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    original = json.loads((src / "config.json").read_text())
    assert written["architectures"] == original["architectures"]
    for key in ("auto_map", "freeze_vision", "vision_dummy_pass"):
        assert key not in written
    assert "gdn_kernel" not in written["text_config"] and written["vision_config"] == original["vision_config"]
    # an official composite checkpoint with its own MTP head is its own official form
    convert(src, tmp_path / "same", to="official", **QUIET)
    assert verify_folders(src, tmp_path / "same")[0].identical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_text_round_trip_with_mtp(kind, dtype, tmp_path):
    """Official text layout (fused experts, MTP experts per expert) -> ours -> official: bit-identical, in fp32 and
    in bf16 (what official checkpoints store: a cast anywhere on the way is invisible in fp32 alone)."""
    model = build_builtin(kind, seed=4).to(dtype)
    src = tmp_path / "official"
    src.mkdir()
    config = model.config.to_dict()
    config["mtp_num_hidden_layers"] = 1
    (src / "config.json").write_text(json.dumps(config))
    mtp = {k: v.to(dtype) for k, v in mtp_tensors(project_config(model)).items()}
    write_shards(src, model.state_dict() | mtp, n_shards=5)
    convert(src, tmp_path / "ours", **QUIET)
    ours = read_folder(tmp_path / "ours")
    assert not any(k.startswith("mtp.") for k in ours)
    assert {v.dtype for v in ours.values()} == {v.dtype for v in model.state_dict().values()}
    convert(tmp_path / "ours", tmp_path / "back", to="official", mtp_from=src, max_shard_size="50KB", **QUIET)
    result, _ = verify_folders(src, tmp_path / "back")
    assert result.identical, result.lines()
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 1
    data = json.loads((tmp_path / "back" / "config.json").read_text())
    assert data["architectures"] == [builtin_class(kind).__name__] and "auto_map" not in data
    assert "gdn_kernel" not in data and "attention_kernel" not in data
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert type(loaded) is builtin_class(kind) and not info["missing_keys"]
    loaded_state = loaded.state_dict()
    for key, value in model.state_dict().items():  # the same values (loading may keep A_log / dt_bias in fp32)
        assert torch.equal(loaded_state[key].to(dtype), value), key
    if dtype == torch.float32:
        assert torch.equal(logits(loaded.eval()), logits(model))


def test_per_expert_text_model_goes_back_fused(tmp_path):
    """What transformers' save_pretrained writes for MoE (per expert) -> official: fused, equal to a manual fuse."""
    model = build_builtin("moe", seed=6)
    src = tmp_path / "saved"
    model.save_pretrained(src, max_shard_size="40KB")
    convert(src, tmp_path / "official", to="official", **QUIET)
    tensors, source = read_folder(tmp_path / "official"), read_folder(src)
    p = "model.layers.1.mlp.experts"
    manual = torch.stack(
        [torch.cat([source[f"{p}.{e}.gate_proj.weight"], source[f"{p}.{e}.up_proj.weight"]]) for e in range(4)]
    )
    assert torch.equal(tensors[f"{p}.gate_up_proj"], manual)
    assert not any(re.search(r"experts\.\d+\.", k) for k in tensors)
    assert set(tensors) == set(model.state_dict())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_real_vlm_merge_back_loads_with_identical_logits(kind, tmp_path):
    """A composite model saved by transformers -> text-only ours -> merged back: transformers' VLM class loads it
    with every tensor and gives the original logits. (transformers saves MoE experts per expert; the official
    layout fuses them, so there the tensors are compared after fusing.)"""
    vlm = build_tiny_vlm(kind=kind)
    src = tmp_path / "vlm"
    vlm.save_pretrained(src, max_shard_size="50KB")
    convert(src, tmp_path / "ours", text_only=True, **QUIET)
    convert(tmp_path / "ours", tmp_path / "back", to="official", vision_from=src, **QUIET)
    result, _ = verify_folders(src, tmp_path / "back")
    if kind == "dense":
        assert result.identical
    else:
        assert all(re.search(r"\.experts\.\d+\.", k) for k in result.only_in_a) and not result.different
        source, written = MappingEngine([FuseExperts()]).map_tensors(read_folder(src)), read_folder(tmp_path / "back")
        assert source.keys() == written.keys() and all(torch.equal(v, source[k]) for k, v in written.items())
    vlm_class = type(vlm)
    back, info = vlm_class.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(logits(back.eval()), logits(vlm))


def test_official_dry_run_and_missing_mtp_note(composite, tmp_path, capsys):
    _, _, src = composite
    ours = tmp_path / "ours"
    convert(src, ours, text_only=True, **QUIET)
    assert run_cli(ours, tmp_path / "back", "--to", "official", "--dry-run") == 0
    printed = capsys.readouterr().out
    assert "official text layout" in printed and "dry run: nothing written" in printed
    assert "mtp_num_hidden_layers=1 but OUT holds no mtp.* tensors" in printed
    assert not (tmp_path / "back").exists()


# -------------------------------------------------------------------------------------------- reference configs


def _reference_cases():
    if not REFERENCE.is_dir():
        return []
    return sorted(p.name for p in REFERENCE.iterdir() if (p / "config.json").is_file())


def _derived_keys(name: str) -> list[str]:
    folder = REFERENCE / name
    if not (folder / "weight_map_keys.DERIVED.txt").is_file():  # Base models share their sibling's key list
        folder = REFERENCE / name.replace("-Base", "")
    lines = (folder / "weight_map_keys.DERIVED.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.skipif(not _reference_cases(), reason="reference configs not available")
@pytest.mark.parametrize("name", _reference_cases())
def test_reference_key_lists_map_both_ways(name):
    """Every key of the official checkpoint is mapped or dropped by a named rule (nothing unmapped), to the text
    layout (--text-only) and to this project's composite layout (vision kept); the way back rebuilds exactly the
    official key set (nothing invented, nothing missing). Headers only: no tensor data."""
    official = json.loads((REFERENCE / name / "config.json").read_text())
    keys = _derived_keys(name)
    packed = build_output_config(official, text_only=True)
    vision_shapes = expected_vision_tensors(official["vision_config"], is_moe=official["model_type"] == "qwen3_5_moe")
    text_shapes = expected_text_tensors(packed.config)
    mtp_shapes = expected_mtp_tensors(packed.config, official["text_config"]["mtp_num_hidden_layers"])

    def shape(key: str):
        if key.startswith("model.language_model."):
            return text_shapes["model." + key[len("model.language_model.") :]]
        if key.startswith("mtp."):
            m = re.match(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", key)
            if m:
                n, two_i, h = mtp_shapes[m[1] + ".gate_up_proj"]
                return (h, two_i // 2) if m[3] == "down_proj" else (two_i // 2, h)
            return mtp_shapes[key]
        if key == "lm_head.weight":
            return text_shapes[key]
        return vision_shapes[key]

    specs = {k: LazyTensor.source(k, shape(k), "BF16") for k in keys}
    _, _, to_packed = plan_packed_mapping(specs, official, text_only=True)
    assert set(to_packed.outputs) == set(text_shapes)  # validated: no unknown, missing or misshaped key
    consumed = {k for r in to_packed.reports for k in r.consumed if r.reason is not None}
    passed = {k for v in to_packed.outputs.values() for k in v.source_keys()}
    assert consumed | passed == set(keys) and not consumed & passed  # every key accounted for exactly once

    packed_specs = {k: LazyTensor.source(k, v.shape, "BF16") for k, v in to_packed.outputs.items()}
    reference = (specs, official, "ref")
    _, _, back = plan_official_mapping(packed_specs, packed.data, mtp=reference, vision=reference)
    assert set(back.outputs) == set(keys)
    assert all(tuple(back.outputs[k].shape) == specs[k].shape for k in keys)
    _, _, same = plan_official_mapping(specs, official)  # the official composite is its own official form
    assert set(same.outputs) == set(keys) and all(same.outputs[k] is specs[k] for k in keys)

    # composite: everything but mtp.* kept under its own key (the main-layer experts are stored fused already)
    ours, _, to_ours = plan_packed_mapping(specs, official, text_only=False)
    assert ours.layout == "packed-composite" and ours.data["auto_map"]["AutoModelForImageTextToText"]
    assert set(to_ours.outputs) == {k for k in keys if not k.startswith("mtp.")}
    assert all(tuple(v.shape) == specs[k].shape and v.source_keys() == [k] for k, v in to_ours.outputs.items())
    assert sum(k.startswith("model.visual.") for k in to_ours.outputs) == len(vision_shapes) > 0
    dropped = {k for r in to_ours.reports for k in r.consumed if r.reason is not None}
    assert dropped == {k for k in keys if k.startswith("mtp.")}
    ours_specs = {k: LazyTensor.source(k, v.shape, "BF16") for k, v in to_ours.outputs.items()}
    _, _, back = plan_official_mapping(ours_specs, ours.data, mtp=reference)
    assert set(back.outputs) == set(keys) and all(tuple(back.outputs[k].shape) == specs[k].shape for k in keys)


# ------------------------------------------------------------------------------------------------ rope and config


def test_v4_style_config_gives_every_reader_the_same_values(tmp_path, capsys):
    model = build_builtin("dense", seed=8)
    src = tmp_path / "v4"
    model.save_pretrained(src)
    data = json.loads((src / "config.json").read_text())
    data.pop("rope_parameters")
    data["rope_theta"] = 5_000_000.0
    data["partial_rotary_factor"] = 0.5
    data["rope_scaling"] = {"type": "mrope", "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    (src / "config.json").write_text(json.dumps(data))
    views = rope_views(data)
    assert views["transformers v5"]["rope_theta"] == 5e6 and views["v4 getattr"]["mrope_section"] == [3, 3, 2]

    assert run_cli(src, tmp_path / "out") == 0
    printed = capsys.readouterr().out
    assert "rope as each reader sees it (SRC and the written config.json):" in printed
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    expected = {"rope_theta": 5e6, "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    for reader, view in rope_views(written).items():
        assert view == expected, reader
    assert written["rope_parameters"]["rope_type"] == "default"  # v4's "mrope" is default rope with sections
    builtin = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert builtin.rope_parameters["rope_theta"] == 5e6 and builtin.rope_parameters["partial_rotary_factor"] == 0.5
    remote = transformers.AutoConfig.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert remote.rope_theta == 5e6 and remote.rope_parameters["mrope_section"] == [3, 3, 2]


def test_v5_only_config_is_what_a_v4_reader_misreads():
    """The failure the table exists for: an official v5 config gives a v4 getattr reader its defaults."""
    official = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True}}  # fmt: skip
    views = rope_views(official)
    assert views["transformers v5"]["rope_theta"] == 1e7 and views["v4 getattr"]["rope_theta"] == 10000.0
    assert set(disagreements(views)) == {"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
    # with transformers 4, vLLM lets top-level values overwrite the dict; with transformers 5 the dict wins
    both = {**official, "rope_theta": 5e6}
    assert rope_views(both)["vLLM + transformers 4"]["rope_theta"] == 5e6
    assert rope_views(both)["vLLM + transformers 5"]["rope_theta"] == 1e7


def test_contradictory_rope_is_an_error_with_the_table(tmp_path, capsys):
    model = build_builtin("dense", seed=8)
    src = tmp_path / "bad"
    model.save_pretrained(src)
    data = json.loads((src / "config.json").read_text())
    data["rope_scaling"] = {"rope_type": "default", "mrope_section": [4, 2, 2]}  # rope_parameters says [3, 3, 2]
    (src / "config.json").write_text(json.dumps(data))
    assert run_cli(src, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "Contradicting rope values: mrope_section" in err and "rope as each reader sees SRC's config.json" in err
    assert "! mrope_section" in err and not (tmp_path / "out").exists()


def test_router_aux_loss_coef_option(tmp_path, capsys):
    model = build_builtin("moe", seed=9, router_aux_loss_coef=0.001)
    src = tmp_path / "moe"
    model.save_pretrained(src)
    assert run_cli(src, tmp_path / "warned") == 0
    assert "router_aux_loss_coef is 0.001 (> 0)" in capsys.readouterr().out
    assert run_cli(src, tmp_path / "rl", "--router-aux-loss-coef", "0") == 0
    printed = capsys.readouterr().out
    assert "router_aux_loss_coef set to 0.0 (SRC had 0.001)" in printed and "(> 0)" not in printed
    assert json.loads((tmp_path / "rl" / "config.json").read_text())["router_aux_loss_coef"] == 0.0
    convert(tmp_path / "rl", tmp_path / "official", to="official", router_aux_loss_coef=0.01, **QUIET)
    assert json.loads((tmp_path / "official" / "config.json").read_text())["router_aux_loss_coef"] == 0.01
    assert run_cli(src, tmp_path / "neg", "--router-aux-loss-coef", "-1") == 2
    assert "finite number >= 0" in capsys.readouterr().err
    dense = tmp_path / "dense"
    build_builtin("dense").save_pretrained(dense)
    assert run_cli(dense, tmp_path / "x", "--router-aux-loss-coef", "0") == 2
    assert "applies to MoE models" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- failures


def test_official_direction_errors(composite, tmp_path):
    kind, model, src = composite
    ours = tmp_path / "ours"
    convert(src, ours, text_only=True, **QUIET)
    with pytest.raises(ConversionError, match="--vision-from is for a text-only SRC"):
        convert(src, tmp_path / "a", to="official", vision_from=src, **QUIET)
    with pytest.raises(ConversionError, match="SRC already holds .* mtp.. tensors and --mtp-from"):
        convert(src, tmp_path / "a", to="official", mtp_from=src, **QUIET)
    with pytest.raises(ConversionError, match="belong to --to official"):
        convert(src, tmp_path / "a", mtp_from=src, text_only=True, **QUIET)
    # a vision tower / MTP head of another model: its language model has other shapes
    config = json.loads((ours / "config.json").read_text())
    wide = tmp_path / "wide"
    build_builtin(kind, seed=3, hidden_size=128, tie_word_embeddings=kind == "dense").save_pretrained(wide)
    with pytest.raises(ConversionError, match="language model of another shape"):
        convert(wide, tmp_path / "a", to="official", vision_from=src, **QUIET)
    with pytest.raises(ConversionError, match=r"mtp\.fc\.weight: \[64, 128\], config says \[128, 256\]"):
        convert(wide, tmp_path / "a", to="official", mtp_from=src, **QUIET)
    # MTP of the right model, but config.json says there is none
    config["mtp_num_hidden_layers"] = 0
    no_mtp = tmp_path / "no_mtp"
    shutil.copytree(ours, no_mtp)
    (no_mtp / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="mtp_num_hidden_layers is 0"):
        convert(no_mtp, tmp_path / "a", to="official", mtp_from=src, **QUIET)
    with pytest.raises(ConversionError, match="holds no mtp.. tensors"):
        convert(ours, tmp_path / "a", to="official", mtp_from=ours, **QUIET)
    assert not (tmp_path / "a").exists()


def test_official_direction_missing_and_extra_tensors(tmp_path):
    model = build_builtin("dense", seed=5)
    good = model.state_dict()
    config = model.config.to_dict()
    for name, tensors, message in [
        ("missing", {k: v for k, v in good.items() if k != "model.layers.3.self_attn.k_norm.weight"}, "lacks 1"),
        ("extra", good | {"model.layers.0.extra.weight": torch.zeros(3)}, "neither part of"),
        ("shape", good | {"model.norm.weight": torch.zeros(65)}, "contradict config.json"),
    ]:
        src = tmp_path / name
        src.mkdir()
        (src / "config.json").write_text(json.dumps(config))
        write_shards(src, tensors, n_shards=2)
        with pytest.raises(ConversionError, match=message):
            convert(src, tmp_path / f"out_{name}", to="official", **QUIET)
        assert not (tmp_path / f"out_{name}").exists()


def test_truncated_shard_is_a_clean_error(tmp_path, capsys):
    model = build_builtin("dense", seed=5)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="40KB")
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    before = folder_digest(src)
    assert run_cli(src, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"shard {shard.name} is not a readable safetensors file (truncated" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and folder_digest(src) == before
    with pytest.raises(ConversionError, match="truncated"):
        folder_digests(src)


def test_verify_reports_every_kind_of_difference(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g), "c": torch.randn(2, generator=g),
            "d": torch.randn(3, generator=g)}  # fmt: skip
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    save_file(base, str(tmp_path / "A" / "model.safetensors"))
    changed = dict(base)
    changed["a"] = base["a"].clone()
    changed["a"][1, 2] = torch.nextafter(changed["a"][1, 2], torch.tensor(10.0))  # one ulp in one element
    changed["b"] = base["b"].to(torch.float64)
    changed["c"] = base["c"].reshape(1, 2)
    del changed["d"]
    changed["e"] = torch.zeros(1)
    save_file(changed, str(tmp_path / "B" / "model.safetensors"))
    result, _ = verify_folders(tmp_path / "A", tmp_path / "B")
    assert not result.identical
    assert result.only_in_a == ["d"] and result.only_in_b == ["e"]
    assert result.different == ["a: bytes differ", "b: dtype F32 vs F64", "c: shape [2] vs [1, 2]"]
    assert main(["convert", "--verify", str(tmp_path / "A"), str(tmp_path / "B")]) == 1
    assert "NOT identical" in capsys.readouterr().out
    assert main(["convert", "--verify", str(tmp_path / "A"), str(tmp_path / "B"), "--dry-run"]) == 2


def test_rope_command(tmp_path, capsys):
    official = {"model_type": "qwen3_5", "vision_config": {}, "text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(official))
    assert main(["rope", str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    assert "text_config of" in printed and "! rope_theta" in printed and "v4 getattr" in printed
    fixed = dict(official["text_config"]["rope_parameters"])
    fixed_config = {"rope_parameters": fixed, "rope_scaling": fixed, "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    (tmp_path / "fixed.json").write_text(json.dumps(fixed_config))
    assert main(["rope", str(tmp_path / "fixed.json")]) == 0
    assert "!" not in capsys.readouterr().out
    assert main(["rope", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("case", ["v5", "v4", "dict_wins", "top_level_fills", "scaling_only"])
def test_transformers_view_matches_transformers(case):
    """The 'transformers v5' column is computed from the raw dict; it must equal what transformers' own config class
    reads from the same keys."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True}  # fmt: skip
    partial = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    keys = {
        "v5": {"rope_parameters": rope},
        "v4": {"rope_theta": 5e6, "partial_rotary_factor": 0.5, "rope_scaling": {"type": "mrope", **partial}},
        "dict_wins": {"rope_parameters": rope, "rope_theta": 5e6},
        "top_level_fills": {"rope_parameters": partial, "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "scaling_only": {"rope_scaling": rope},
    }[case]
    kwargs = {k: v for k, v in tiny_kwargs("dense").items() if k != "rope_parameters"}
    builtin = transformers.Qwen3_5TextConfig(**kwargs, **json.loads(json.dumps(keys))).rope_parameters
    view = rope_views(keys)["transformers v5"]
    assert view == {k: builtin.get(k) for k in view}, (view, builtin)
