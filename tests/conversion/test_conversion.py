"""`qwen35-packed convert`: official Qwen3.5 layouts -> this project's layout (CPU, fp32, tiny models)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_kwargs
from fixtures_conversion import (
    NOT_COPIED,
    TOKENIZER_FILES,
    add_side_files,
    assert_loads_with_builtin,
    build_builtin,
    build_tiny_vlm,
    composite_config,
    composite_tensors,
    folder_digest,
    logits,
    read_folder,
    run_cli,
    write_shards,
)
from safetensors.torch import save_file

from qwen35_packed.cli import main
from qwen35_packed.conversion import (
    ConversionError,
    Drop,
    FuseExperts,
    MappingEngine,
    NotInvertibleError,
    SplitExperts,
    StripPrefix,
    conversion_rules,
    convert,
    remote_code_files,
)
from qwen35_packed.conversion.convert import parse_size

# ---------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Built-in dense text model saved by save_pretrained in several shards, with tokenizer-like side files."""
    model = build_builtin("dense")
    src = tmp_path_factory.mktemp("dense") / "src"
    model.save_pretrained(src, max_shard_size="40KB")
    add_side_files(src)
    return model, src


@pytest.fixture(scope="module")
def moe_per_expert(tmp_path_factory):
    """Built-in MoE text model saved by save_pretrained: per-expert tensors."""
    model = build_builtin("moe", seed=1, router_aux_loss_coef=0.001)
    src = tmp_path_factory.mktemp("moe_pe") / "src"
    model.save_pretrained(src, max_shard_size="40KB")
    return model, src


@pytest.fixture(scope="module")
def moe_fused(tmp_path_factory, moe_per_expert):
    """The same MoE model stored the way official checkpoints are: fused experts (state_dict keys)."""
    model, pe_src = moe_per_expert
    src = tmp_path_factory.mktemp("moe_fused") / "src"
    src.mkdir()
    shutil.copy(pe_src / "config.json", src / "config.json")
    write_shards(src, model.state_dict(), n_shards=3)
    return model, src


# ------------------------------------------------------------------------------------------------------------- tests


def test_dense_sharded_conversion(dense, tmp_path, capsys):
    model, src = dense
    before = folder_digest(src)
    out = tmp_path / "out"
    assert run_cli(src, out, "--max-shard-size", "60KB") == 0
    assert folder_digest(src) == before  # SRC untouched

    tensors = read_folder(out)
    expected = model.state_dict()
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key

    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    assert {out / name for name in index["weight_map"].values()} == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    biggest = max(t.numel() * t.element_size() for t in expected.values())
    for shard in shards:  # header overhead aside, no shard holds more than the limit (or one larger tensor)
        assert shard.stat().st_size <= max(60_000, biggest) + 16_000

    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    for name in NOT_COPIED:
        assert not (out / name).exists()
    for path in remote_code_files():
        assert (out / path.name).read_bytes() == path.read_bytes()
    assert not list(out.glob("__init__.py"))
    assert not list(tmp_path.glob(".out.tmp-*"))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not the private mode of a temporary folder

    assert_loads_with_builtin(out, "dense", model)


def test_dense_config(dense, tmp_path):
    model, src = dense
    out = tmp_path / "out"
    convert(src, out, progress=False, log=lambda line: None)
    data = json.loads((out / "config.json").read_text())
    assert data["model_type"] == "qwen3_5_text"
    assert data["architectures"] == ["Qwen3_5PackedForCausalLM"]
    assert data["auto_map"] == {
        "AutoConfig": "configuration_qwen3_5_packed.Qwen3_5PackedConfig",
        "AutoModel": "modeling_qwen3_5_packed.Qwen3_5PackedTextModel",
        "AutoModelForCausalLM": "modeling_qwen3_5_packed.Qwen3_5PackedForCausalLM",
        "AutoModelForSequenceClassification": "modeling_qwen3_5_packed.Qwen3_5PackedForSequenceClassification",
    }
    assert data["rope_parameters"] == {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [3, 3, 2], "mrope_interleaved": True,
    }  # fmt: skip
    assert data["rope_theta"] == 10000.0 and data["partial_rotary_factor"] == 0.5
    assert data["rope_scaling"] == data["rope_parameters"]  # v4-style readers look for mrope_section there
    assert data["tie_word_embeddings"] is False
    for key, value in tiny_kwargs("dense").items():
        assert data[key] == value, key

    builtin = transformers.AutoConfig.from_pretrained(out)
    assert type(builtin) is transformers.Qwen3_5TextConfig
    assert builtin.rope_parameters["rope_theta"] == 10000.0
    assert builtin.rope_parameters["partial_rotary_factor"] == 0.5
    remote = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert type(remote).__name__ == "Qwen3_5PackedConfig"
    assert remote.rope_parameters == data["rope_parameters"]
    assert remote.rope_theta == 10000.0 and remote.num_hidden_layers == 4


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_moe_conversion(layout, moe_per_expert, moe_fused, tmp_path, capsys):
    model, src = moe_per_expert if layout == "per_expert" else moe_fused
    out = tmp_path / "out"
    assert run_cli(src, out, "--max-shard-size", "100KB") == 0
    printed = capsys.readouterr().out
    assert "router_aux_loss_coef is 0.001" in printed and "RL" in printed

    tensors = read_folder(out)
    expected = model.state_dict()
    assert set(tensors) == set(expected)
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    assert not any(".experts.0." in key for key in tensors)
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key

    if layout == "per_expert":  # fused = stack over experts of cat([gate, up], dim=0), checked by hand
        source = read_folder(src)
        for layer in range(4):
            p = f"model.layers.{layer}.mlp.experts"
            manual = torch.stack(
                [
                    torch.cat([source[f"{p}.{e}.gate_proj.weight"], source[f"{p}.{e}.up_proj.weight"]], 0)
                    for e in range(4)
                ]
            )
            assert torch.equal(tensors[f"{p}.gate_up_proj"], manual)
            manual_down = torch.stack([source[f"{p}.{e}.down_proj.weight"] for e in range(4)])
            assert torch.equal(tensors[f"{p}.down_proj"], manual_down)

    data = json.loads((out / "config.json").read_text())
    assert data["model_type"] == "qwen3_5_moe_text"
    assert data["architectures"] == ["Qwen3_5MoePackedForCausalLM"]
    assert data["auto_map"] == {
        "AutoConfig": "configuration_qwen3_5_packed.Qwen3_5MoePackedConfig",
        "AutoModel": "modeling_qwen3_5_packed.Qwen3_5MoePackedTextModel",
        "AutoModelForCausalLM": "modeling_qwen3_5_packed.Qwen3_5MoePackedForCausalLM",
        "AutoModelForSequenceClassification": "modeling_qwen3_5_packed.Qwen3_5MoePackedForSequenceClassification",
    }
    assert type(transformers.AutoConfig.from_pretrained(out)) is transformers.Qwen3_5MoeTextConfig
    assert type(transformers.AutoConfig.from_pretrained(out, trust_remote_code=True)).__name__ == (
        "Qwen3_5MoePackedConfig"
    )
    assert_loads_with_builtin(out, "moe", model)


def test_verify_compares_per_expert_experts_as_the_fused_tensors_they_convert_to(
    moe_per_expert, moe_fused, tmp_path, capsys
):
    """`convert --verify` of a per-expert source against its conversion: identical, because the per-expert tensors
    are checksummed as the fused tensors they make (against the fused folder's own bytes too); a swapped gate / up
    in one expert, or an incomplete expert group, is a difference."""
    from qwen35_packed.conversion.verify import verify_folders

    _, src = moe_per_expert
    _, fused_src = moe_fused
    out = tmp_path / "out"
    assert run_cli(src, out) == 0
    capsys.readouterr()
    assert main(["convert", "--verify", str(src), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "its 48 per-expert tensors are compared as the 8 fused tensors `convert` makes of them" in printed
    assert "identical: the same 72 keys" in printed and "NOT identical" not in printed
    result, _ = verify_folders(fused_src, src)  # the per-expert folder on the B side, fused from 3-shard headers
    assert result.identical and result.fused_b == (48, 8) and result.fused_a == (0, 0), result.lines()

    tensors = read_folder(src)
    p = "model.layers.1.mlp.experts"
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(src / "config.json", swapped)
    gate, up = tensors[f"{p}.2.gate_proj.weight"], tensors[f"{p}.2.up_proj.weight"]
    save_file({**tensors, f"{p}.2.gate_proj.weight": up, f"{p}.2.up_proj.weight": gate}, swapped / "model.safetensors")
    result, _ = verify_folders(swapped, out)
    assert result.different == [f"{p}.gate_up_proj: bytes differ"] and not result.only_in_a, result.lines()

    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    shutil.copy(src / "config.json", incomplete)
    save_file({k: v for k, v in tensors.items() if k != f"{p}.3.down_proj.weight"}, incomplete / "model.safetensors")
    result, _ = verify_folders(incomplete, out)
    assert not result.identical and f"{p}.0.gate_proj.weight" in result.only_in_a, result.lines()
    assert f"{p}.gate_up_proj" in result.only_in_b


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_composite_text_only(kind, tmp_path, capsys):
    """Official composite layout (prefix, vision tower, MTP head with per-expert MoE), tie only at the top level."""
    tie = kind == "dense"  # like the small official models: tied, no lm_head.weight in the checkpoint
    model = build_builtin(kind, seed=2, tie_word_embeddings=tie)
    src = tmp_path / "src"
    src.mkdir()
    config = composite_config(model, moe=kind == "moe", top_tie=tie, keep_text_tie=False)
    (src / "config.json").write_text(json.dumps(config))
    source = composite_tensors(model, per_expert_mtp=kind == "moe")
    write_shards(src, source, n_shards=2)
    add_side_files(src)
    tokenizer_config = {"eos_token": "<|im_end|>", "processor_class": "Qwen3VLProcessor", "chat_template": "{{ x }}"}
    (src / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    out = tmp_path / "out"
    assert run_cli(src, out) == 2  # keeping the vision tower validates it: these three tensors are not one
    err = capsys.readouterr().err
    assert "the vision tower described by vision_config needs" in err and "--text-only" in err
    assert not out.exists()

    assert run_cli(src, out, "--text-only") == 0
    printed = capsys.readouterr().out
    n_mtp = sum(k.startswith("mtp.") for k in source)
    assert f"{n_mtp} dropped (multi-token-prediction head" in printed
    assert "3 dropped (vision tower" in printed

    tensors = read_folder(out)
    expected = model.state_dict()
    if tie:
        expected.pop("lm_head.weight")
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key
    data = json.loads((out / "config.json").read_text())
    assert data["tie_word_embeddings"] is tie
    assert "text_config" not in data and "vision_config" not in data and "image_token_id" not in data
    assert data["mtp_num_hidden_layers"] == 1
    for name in NOT_COPIED:
        assert not (out / name).exists()
    # AutoProcessor would look for the VLM's image processor: processor_class is removed, nothing else changes
    assert "removing processor_class" in printed
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        k: v for k, v in tokenizer_config.items() if k != "processor_class"
    }
    assert_loads_with_builtin(out, kind, model)


def test_composite_saved_by_transformers(tmp_path, capsys):
    """What transformers' composite class writes: tie true at the top level, false in text_config."""
    vlm = build_tiny_vlm()
    src = tmp_path / "src"
    vlm.save_pretrained(src, max_shard_size="50KB")
    out = tmp_path / "out"
    assert run_cli(src, out, "--text-only") == 0
    assert "the converted model uses True" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    converted, info = transformers.Qwen3_5ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(logits(converted.eval()), logits(vlm))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_composite_saved_by_transformers_keeps_vision(kind, tmp_path, capsys):
    """A composite model saved by transformers (MoE: main-layer experts per expert) -> this project's composite layout:
    the language model's experts fused, every other tensor as stored; the built-in class loads it with the same
    logits."""
    vlm = build_tiny_vlm(kind=kind)
    src = tmp_path / "src"
    vlm.save_pretrained(src, max_shard_size="50KB")
    out = tmp_path / "out"
    assert run_cli(src, out) == 0
    printed = capsys.readouterr().out
    source, written = read_folder(src), read_folder(out)
    per_expert = [k for k in source if ".mlp.experts.0." in k]
    assert bool(per_expert) is (kind == "moe") and not any(".experts.0." in k for k in written)
    assert ("48 -> 8 per-expert expert tensors fused" in printed) is (
        kind == "moe"
    )  # 4 layers x 4 experts x 3 -> 4 layers x 2
    assert written.keys() == vlm.state_dict().keys() - ({"lm_head.weight"} if kind == "dense" else set())
    assert all(torch.equal(v, source[k]) for k, v in written.items() if k in source)
    loaded, info = type(vlm).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert torch.equal(logits(loaded.eval()), logits(vlm))


def test_legacy_rope_keys_are_normalised(dense, tmp_path):
    model, src = dense
    legacy = tmp_path / "legacy"
    shutil.copytree(src, legacy)
    data = json.loads((legacy / "config.json").read_text())
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope["rope_theta"]
    data["partial_rotary_factor"] = rope["partial_rotary_factor"]
    data["rope_scaling"] = {"type": "mrope", "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    (legacy / "config.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    assert run_cli(legacy, out) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"] == rope | {"rope_type": "default"}
    assert written["rope_theta"] == 10000.0 and written["partial_rotary_factor"] == 0.5
    assert written["rope_scaling"] == written["rope_parameters"]
    assert_loads_with_builtin(out, "dense", model)


def test_contradictory_rope_is_a_clean_error(dense, tmp_path, capsys):
    _, src = dense
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    data = json.loads((bad / "config.json").read_text())
    data["rope_theta"] = 1_000_000.0  # rope_parameters says 10000
    (bad / "config.json").write_text(json.dumps(data))
    assert run_cli(bad, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Contradicting rope values: rope_theta" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_out_exists_is_refused(dense, tmp_path, capsys):
    _, src = dense
    out = tmp_path / "out"
    out.mkdir()
    assert run_cli(src, out) == 2
    assert "already exists" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_unknown_tensor_is_listed(dense, tmp_path, capsys):
    _, src = dense
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    save_file({"model.layers.0.mystery.weight": torch.zeros(2)}, str(bad / "extra.safetensors"))
    index["weight_map"]["model.layers.0.mystery.weight"] = "extra.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    assert run_cli(bad, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mystery.weight" in err and "neither part of" in err
    assert not (tmp_path / "out").exists()


def test_missing_and_misshaped_tensors_are_errors(moe_fused, tmp_path):
    model, _ = moe_fused
    state = model.state_dict()
    config = json.loads((moe_fused[1] / "config.json").read_text())
    for name, tensors, message in [
        ("missing", {k: v for k, v in state.items() if k != "model.norm.weight"}, "lacks 1 tensors"),
        ("shape", state | {"model.layers.1.mlp.experts.down_proj": torch.zeros(4, 64, 16)}, "contradict config"),
    ]:
        src = tmp_path / name
        src.mkdir()
        (src / "config.json").write_text(json.dumps(config))
        write_shards(src, tensors, n_shards=1)
        with pytest.raises(ConversionError, match=message):
            convert(src, tmp_path / f"out_{name}", log=lambda line: None)


def test_incomplete_experts_are_an_error(moe_per_expert, tmp_path):
    model, src = moe_per_expert
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(src / "config.json", bad / "config.json")
    tensors = read_folder(src)
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    write_shards(bad, tensors, n_shards=2)
    with pytest.raises(ConversionError, match=r"missing model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        convert(bad, tmp_path / "out", log=lambda line: None)


def test_plan_reads_as_a_result_rules_only_with_verbose(moe_per_expert, tmp_path, capsys):
    """Without -v the plan says what happened to the tensors in one line; -v adds every rule (matched or not) and the
    remote-code file names."""
    _, src = moe_per_expert
    assert run_cli(src, tmp_path / "out", "--dry-run") == 0
    brief = capsys.readouterr().out
    assert "  tensors: 48 -> 8 per-expert expert tensors fused\n" in brief
    assert "FuseExperts(" not in brief and "no match" not in brief and "rule " not in brief
    assert "remote code: " in brief and "modeling_qwen3_5_packed.py" not in brief
    assert run_cli(src, tmp_path / "out", "--dry-run", "-v") == 0
    verbose = capsys.readouterr().out
    assert "    rule Drop('^mtp\\\\.'): no match" in verbose and "    rule FuseExperts(" in verbose
    assert "modeling_qwen3_5_packed.py" in verbose
    assert set(brief.splitlines()) <= set(verbose.splitlines())


def test_rope_table_says_a_disagreement_is_resolved(tmp_path, capsys):
    """A source whose readers disagree: a value stated once (readers of v4-style keys falling back to their
    defaults, what transformers 5 saves) is the normal case, one line under the written table; a contradiction
    prints SRC's table and says that the written config resolves it."""
    model = build_builtin("dense", seed=3)
    for name, top_level in (
        ("absent", {}),
        ("stale", {"partial_rotary_factor": 0.25, "transformers_version": "5.17.0"}),
    ):
        src = tmp_path / name
        model.save_pretrained(src)
        config = json.loads((src / "config.json").read_text())
        config = {k: v for k, v in config.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_scaling")}
        config.update(top_level)
        (src / "config.json").write_text(json.dumps(config))
        assert run_cli(src, tmp_path / f"{name}-out", "--dry-run") == 0
        printed = capsys.readouterr().out
        source_table, written_table = printed.split("rope as each reader sees the written config.json:")
        assert "!" not in written_table
        if name == "absent":  # the normal case, what transformers 5 saves: quiet, no table of SRC
            assert "!" not in source_table and "rope as each reader sees SRC" not in source_table, printed
            assert "once, as transformers 5 saves configs; the written config.json also states them" in written_table
        else:
            assert "! readers disagree on" in source_table
            explanation = source_table.rstrip().splitlines()[-1]
            assert "states partial_rotary_factor twice with different values" in explanation
            assert "resolves it" in explanation


def test_dry_run_writes_nothing(moe_per_expert, tmp_path, capsys):
    _, src = moe_per_expert
    out = tmp_path / "sub" / "out"
    assert run_cli(src, out, "--dry-run") == 0
    printed = capsys.readouterr().out
    assert "48 -> 8 per-expert expert tensors fused" in printed  # 4 layers x 4 experts x 3 -> 4 layers x 2
    assert "qwen3_5_moe_text" in printed and "dry run: nothing written" in printed
    assert not (tmp_path / "sub").exists()


def test_tied_source_with_different_lm_head_is_refused(dense, tmp_path):
    model, src = dense
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    data = json.loads((bad / "config.json").read_text())
    data["tie_word_embeddings"] = True  # but lm_head.weight is a separate, different tensor
    (bad / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConversionError, match="differs from model.embed_tokens.weight"):
        convert(bad, tmp_path / "out", progress=False, log=lambda line: None)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_remote_code_loads_converted_folder(layout, dense, moe_per_expert, tmp_path):
    """The flat remote-code files in OUT are importable by transformers and take every converted tensor."""
    model, src = dense if layout == "dense" else moe_per_expert
    out = tmp_path / "out"
    convert(src, out, progress=False, log=lambda line: None)
    ours, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, output_loading_info=True
    )
    assert type(ours).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = ours.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_remote_code_logits_match_builtin(layout, dense, moe_per_expert, tmp_path):
    model, src = dense if layout == "dense" else moe_per_expert
    out = tmp_path / "out"
    convert(src, out, progress=False, log=lambda line: None)
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert (logits(ours) - logits(model)).abs().max().item() <= 1e-4


def _reward_folder(folder: Path, kind: str, num_labels: int = 2) -> torch.nn.Module:
    """This project's sequence-classification (reward) model saved by its save_pretrained: `model.*` + `score.weight`
    (transformers' layout), architectures our class, no remote code."""
    from qwen35_packed import (
        Qwen3_5MoePackedConfig,
        Qwen3_5MoePackedForSequenceClassification,
        Qwen3_5PackedConfig,
        Qwen3_5PackedForSequenceClassification,
    )

    config_class, model_class = (
        (Qwen3_5MoePackedConfig, Qwen3_5MoePackedForSequenceClassification)
        if kind == "moe"
        else (Qwen3_5PackedConfig, Qwen3_5PackedForSequenceClassification)
    )
    torch.manual_seed(0)
    model = model_class(config_class(**tiny_kwargs(kind), pad_token_id=0, num_labels=num_labels))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reward_model_folder_converts_with_its_score_head(kind, tmp_path):
    """A sequence-classification folder converts to this project's layout with `score.weight` kept, its
    architecture and the AutoModelForSequenceClassification auto_map (trust_remote_code builds our head with the
    same scores); dense, `--to official` writes transformers' `Qwen3_5TextForSequenceClassification` and converts
    back to the same tensors; MoE, for which transformers has no head class, `--to official` is refused."""
    model = _reward_folder(tmp_path / "src", kind)
    packed = tmp_path / "packed"
    convert(tmp_path / "src", packed, progress=False, log=lambda line: None)
    config = json.loads((packed / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["auto_map"]["AutoModelForSequenceClassification"].endswith("." + type(model).__name__)
    assert read_folder(packed).keys() == model.state_dict().keys()
    assert all(torch.equal(read_folder(packed)[k], v) for k, v in model.state_dict().items())
    ids = torch.tensor([[5, 9, 14, 3, 1], [7, 22, 1, 0, 0]])
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(packed, trust_remote_code=True).eval()
    assert type(loaded).__name__ == type(model).__name__
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    if kind == "moe":
        with pytest.raises(ConversionError, match="transformers has no MoE Qwen3.5 sequence-classification class"):
            convert(packed, tmp_path / "official", to="official", progress=False, log=lambda line: None)
        return
    official = tmp_path / "official"
    convert(packed, official, to="official", progress=False, log=lambda line: None)
    config = json.loads((official / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5TextForSequenceClassification"] and "auto_map" not in config
    back = tmp_path / "back"
    convert(official, back, progress=False, log=lambda line: None)
    assert folder_digest(back)["model.safetensors"] == folder_digest(packed)["model.safetensors"]
    if hasattr(transformers, "Qwen3_5TextForSequenceClassification"):
        builtin = transformers.AutoModelForSequenceClassification.from_pretrained(official).eval()
        assert type(builtin).__name__ == "Qwen3_5TextForSequenceClassification"
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits
            assert (builtin(ids, use_cache=False).logits - expected).abs().max().item() <= 1e-5


def test_vision_language_reward_folder_is_refused(tmp_path):
    """transformers' composite `Qwen3_5ForSequenceClassification` layout: no class of this project to convert it to,
    an error that says so (and what reads it) in both directions."""
    from qwen35_packed.conversion.config import build_official_config, build_output_config

    src = {"architectures": ["Qwen3_5ForSequenceClassification"], "model_type": "qwen3_5", "text_config": {}}
    for build in (
        lambda: build_output_config(src, text_only=True),
        lambda: build_output_config(src, text_only=False),
        lambda: build_official_config(src),
    ):
        with pytest.raises(ConversionError, match="vision-language sequence-classification model .* text ones only"):
            build()


# -------------------------------------------------------------------------------------------- rules, unit level


def test_rules_are_invertible_where_they_can_be():
    g = torch.Generator().manual_seed(0)
    per_expert = {}
    for e in range(3):
        per_expert[f"model.language_model.layers.0.mlp.experts.{e}.gate_proj.weight"] = torch.randn(5, 4, generator=g)
        per_expert[f"model.language_model.layers.0.mlp.experts.{e}.up_proj.weight"] = torch.randn(5, 4, generator=g)
        per_expert[f"model.language_model.layers.0.mlp.experts.{e}.down_proj.weight"] = torch.randn(4, 5, generator=g)
    per_expert["model.language_model.norm.weight"] = torch.randn(4, generator=g)
    per_expert["lm_head.weight"] = torch.randn(7, 4, generator=g)

    engine = MappingEngine([StripPrefix("model.language_model.", "model."), FuseExperts()])
    fused = engine.map_tensors(per_expert)
    assert set(fused) == {
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj", "model.norm.weight",
        "lm_head.weight",
    }  # fmt: skip
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 10, 4)
    back = engine.inverse().map_tensors(fused)
    assert set(back) == set(per_expert)
    for key, value in per_expert.items():
        assert torch.equal(back[key], value), key
    assert isinstance(engine.inverse().rules[0], SplitExperts)

    with pytest.raises(NotInvertibleError):
        MappingEngine([Drop(r"^mtp\.", "why")]).inverse()


def test_rules_refuse_collisions():
    tensors = {"model.language_model.norm.weight": torch.zeros(2), "model.norm.weight": torch.zeros(2)}
    with pytest.raises(ConversionError, match="maps two tensors"):
        MappingEngine([StripPrefix("model.language_model.", "model.")]).map_tensors(tensors)
    both = {
        "m.experts.gate_up_proj": torch.zeros(1, 4, 3),
        "m.experts.0.gate_proj.weight": torch.zeros(2, 3),
        "m.experts.0.up_proj.weight": torch.zeros(2, 3),
        "m.experts.0.down_proj.weight": torch.zeros(3, 2),
    }
    with pytest.raises(ConversionError, match="maps two tensors"):
        MappingEngine([FuseExperts()]).map_tensors(both)


def test_conversion_rules_order():
    rules = conversion_rules("composite", tie_word_embeddings=True)
    assert [type(r).__name__ for r in rules] == ["Drop", "Drop", "StripPrefix", "Drop", "FuseExperts"]
    assert [type(r).__name__ for r in conversion_rules("text", tie_word_embeddings=False)] == ["Drop", "FuseExperts"]


def test_remote_code_files():
    names = [p.name for p in remote_code_files()]
    assert "configuration_qwen3_5_packed.py" in names
    assert "__init__.py" not in names
    assert len(names) == len(set(names))
    assert all(p.suffix == ".py" and p.parent.name in ("configuration", "modeling") for p in remote_code_files())


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("100kb") == 100_000
    assert parse_size(1234) == 1234
    for bad in ("five", "5XB", "0"):
        with pytest.raises(ConversionError):
            parse_size(bad)


def test_schema_matches_our_model_when_available():
    """The expected tensors of the validation equal our modeling's state_dict (incl. fields the built-in ignores)."""
    try:
        from qwen35_packed import (
            Qwen3_5MoePackedConfig,
            Qwen3_5MoePackedForCausalLM,
            Qwen3_5PackedConfig,
            Qwen3_5PackedForCausalLM,
        )
    except ImportError:
        pytest.skip("modeling not available")
    from qwen35_packed.conversion.schema import expected_text_tensors

    cases = [
        (Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM, tiny_kwargs("dense")),
        (Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM, tiny_kwargs("dense") | {"tie_word_embeddings": True}),
        (Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM, tiny_kwargs("dense") | {"attn_output_gate": False}),
        (Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM, tiny_kwargs("moe")),
        (Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM,
         tiny_kwargs("moe") | {"mlp_only_layers": [1], "intermediate_size": 96}),
    ]  # fmt: skip
    for config_cls, model_cls, kwargs in cases:
        config = config_cls(**kwargs)
        with torch.device("meta"):
            model = model_cls(config)
        actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            actual.pop("lm_head.weight", None)
        assert expected_text_tensors(config) == actual, kwargs
