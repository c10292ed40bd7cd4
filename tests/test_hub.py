"""`qwen35-packed upload` / hub_upload.py: the upload plan (allow-list), the model card, and the HfApi call boundary through a recording fake
(the Hub is not reachable from CI)."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import requires_builtin_qwen35
from fixtures_conversion import build_builtin, build_tiny_vlm
from fixtures_hub import SECRET, RecordingApi, packed  # noqa: F401 (the module-scoped converted folder)
from huggingface_hub import ModelCard
from safetensors.torch import save_file

from qwen35_packed import cli, hub
from qwen35_packed.conversion import convert, remote_code_files
from qwen35_packed.tiny import build_tiny_reward_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_real_login(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no cached login of this machine is read


def with_junk(folder: Path, dest: Path) -> Path:
    """A copy of `folder` with every kind of file that must not be uploaded."""
    import shutil

    shutil.copytree(folder, dest)
    (dest / ".cache").mkdir()
    (dest / ".cache" / "x.lock").write_text("")
    (dest / "__pycache__").mkdir()
    (dest / ".hf_token").write_text(SECRET)
    (dest / "hf_token.txt").write_text(SECRET)
    (dest / "notes.txt").write_text("my notes")
    (dest / "helper.py").write_text("print('hi')\n")
    (dest / "optimizer.pt").write_bytes(b"\0" * 10)
    (dest / "tokenizer.json").symlink_to(dest / "tokenizer_config.json")
    save_file({"x": torch.zeros(1)}, str(dest / "model-00009-of-00009.safetensors"))  # not in any index
    return dest


def test_dry_run_plan_lists_exactly_the_allowed_files(packed, tmp_path, capsys):
    folder = with_junk(packed, tmp_path / "folder")
    api = RecordingApi()
    assert hub.main([str(folder), "--repo-id", "me/tiny-packed", "--dry-run"], api=api) == 0
    printed = capsys.readouterr().out
    assert api.calls == []  # nothing sent
    expected = {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json", "LICENSE",
                "README.md"}  # fmt: skip
    expected |= {p.name for p in remote_code_files()}
    listed = {line.split()[0] for line in printed.split("left out")[0].splitlines() if line.startswith("  ")}
    assert listed == expected
    left_out = printed.split("left out")[1].split("--- model card")[0]
    for name, reason in [(".cache", "hidden"), (".hf_token", "hidden"), ("__pycache__", "folder"),
                         ("hf_token.txt", "credential"), ("notes.txt", "allow-list"), ("optimizer.pt", "allow-list"),
                         ("helper.py", "not one of this package's remote-code"), ("tokenizer.json", "symlink"),
                         ("model-00009-of-00009.safetensors", "without model.safetensors.index.json")]:  # fmt: skip
        assert any(line.strip().startswith(f"{name}:") and reason in line for line in left_out.splitlines()), name
    assert "token: from the HF_TOKEN environment variable" in printed
    assert SECRET not in printed
    assert "--- model card (generated) ---" in printed and "dry run: nothing uploaded" in printed


def test_upload_goes_through_create_repo_and_one_commit(packed, tmp_path, capsys):
    folder = with_junk(packed, tmp_path / "folder")
    api = RecordingApi()
    assert hub.main([str(folder), "--repo-id", "me/tiny-packed", "--private", "--base-model", "Qwen/Qwen3.5-0.8B"],
                    api=api) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert [name for name, _ in api.calls] == ["create_repo", "create_commit"]
    assert api.calls[0][1] == {"repo_id": "me/tiny-packed", "repo_type": "model", "private": True, "exist_ok": True}
    commit = api.calls[1][1]
    assert commit["repo_id"] == "me/tiny-packed" and commit["repo_type"] == "model"
    ops = {op.path_in_repo: op for op in commit["operations"]}
    plan = hub.plan_upload(folder, "me/tiny-packed", base_model="Qwen/Qwen3.5-0.8B")
    assert set(ops) == {f.path_in_repo for f in plan.files}
    for name, op in ops.items():
        if name == "README.md":  # the generated card, sent as bytes
            card = ModelCard(op.path_or_fileobj.decode())
            assert card.data.base_model == "Qwen/Qwen3.5-0.8B"
        else:
            assert Path(op.path_or_fileobj).resolve() == (folder / name).resolve()
            assert not (folder / name).is_symlink() and not name.startswith(".")
    assert "uploaded" in out and "/commit/0" in out


def test_card_metadata_and_report(packed, tmp_path):
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(packed, folder)
    report = {
        "schema": hub.REPORT_SCHEMA,
        "source": {"base_model": "Qwen/Qwen3.5-0.8B"},
        "round_trip": {"identical": True, "tensors": 488, "digest": "ab" * 32},
        "parity": [{"check": "packed vs per-document logits", "value": 5.2e-4, "unit": "max |diff|", "dtype": "fp32",
                    "device": "H200"}],
        "performance": [{"check": "training step", "value": 1234.5, "unit": "tokens/s", "device": "H200"}],
    }  # fmt: skip
    (folder / hub.REPORT_NAME).write_text(json.dumps(report))
    plan = hub.plan_upload(folder, "org/qwen35-tiny")
    card = ModelCard(plan.card_text)
    assert card.data.library_name == "transformers"
    assert card.data.base_model == "Qwen/Qwen3.5-0.8B"  # from the report
    assert card.data.license == "apache-2.0"  # from the LICENSE copied from the source
    assert set(card.data.tags) >= {"qwen3_5", "qwen35-packed"} and "moe" not in card.data.tags
    text = card.text
    assert "| packed vs per-document logits | 0.00052 | max \\|diff\\| | fp32 | H200 |" in text
    assert "| training step | 1234 | tokens/s |  | H200 |" in text  # :.4g
    assert "bit-identical, 488 tensors" in text
    for needle in ('trust_remote_code=True', "trl grpo --model_name_or_path org/qwen35-tiny --trust_remote_code true",
                   'hf_overrides={"architectures": ["Qwen3_5ForCausalLM"]}', "vllm.general_plugins",
                   "LoraConfig("):  # fmt: skip
        assert needle in text, needle
    assert hub.REPORT_NAME in {f.path_in_repo for f in plan.files}
    assert hub.plan_upload(folder, "org/x", license="mit").card_text.count("license: mit") == 1

    report["parity"][0]["value"] = "small"
    (folder / hub.REPORT_NAME).write_text(json.dumps(report))
    with pytest.raises(hub.UploadError, match=r"parity\[0\] needs a string 'check' and a finite number"):
        hub.plan_upload(folder, "org/x")
    (folder / hub.REPORT_NAME).write_text(json.dumps({"schema": "other/2"}))
    with pytest.raises(hub.UploadError, match="schema must be"):
        hub.plan_upload(folder, "org/x")


def test_card_python_snippets_run(packed):
    """The transformers and packed snippets of the card run as written, with the repo id pointing at the folder."""
    snippets = hub.usage_snippets(str(packed), "packed", False, None)
    for name in ("transformers", "packed"):
        scope = {}
        exec(compile(snippets[name], f"<card:{name}>", "exec"), scope)
        if name == "packed":
            assert torch.isfinite(scope["out"].loss)
        else:
            assert scope["logits"].shape == (1, 7, 128)
    for name in ("peft", "vllm"):  # not installed here: at least valid Python
        compile(snippets[name], f"<card:{name}>", "exec")


def test_official_and_adapter_folders(tmp_path, capsys):
    official = tmp_path / "official"
    build_builtin("moe", seed=2).save_pretrained(official)  # per expert, one shard
    plan = hub.plan_upload(official, "org/official")
    assert plan.kind == "official" and plan.is_moe
    assert not any(f.path_in_repo.endswith(".py") for f in plan.files)
    snippets = hub.usage_snippets("org/official", "official", True, None)
    assert "trust_remote_code" not in snippets["transformers"]

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 8,
                                                             "peft_type": "LORA"}))  # fmt: skip
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(2, 2)}, str(adapter / "adapter_model.safetensors"))
    (adapter / "training_args.bin").write_bytes(b"\0")
    plan = hub.plan_upload(adapter, "org/adapter")
    assert plan.kind == "adapter"
    assert {f.path_in_repo for f in plan.files} == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    card = ModelCard(plan.card_text)
    assert card.data.library_name == "peft" and card.data.base_model == "org/base"
    assert 'PeftModel.from_pretrained(base, "org/adapter")' in card.text


def test_existing_readme_is_kept_unless_replaced(packed, tmp_path):
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(packed, folder)
    (folder / "README.md").write_text("# my own card\n")
    plan = hub.plan_upload(folder, "org/x")
    readme = next(f for f in plan.files if f.path_in_repo == "README.md")
    assert readme.local == folder / "README.md" and plan.card_source.startswith("README.md")
    plan = hub.plan_upload(folder, "org/x", replace_card=True)
    readme = [f for f in plan.files if f.path_in_repo == "README.md"]
    assert len(readme) == 1 and readme[0].local is None and b"qwen35-packed" in readme[0].content


def test_errors(packed, tmp_path, monkeypatch, capsys):
    assert hub.main([str(packed), "--repo-id", "no-slash", "--dry-run"]) == 2
    assert "ORG/NAME" in capsys.readouterr().err
    assert hub.main([str(tmp_path / "missing"), "--repo-id", "a/b", "--dry-run"]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    with pytest.raises(hub.UploadError, match="no safetensors weights"):
        hub.plan_upload(empty, "a/b")
    (empty / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(hub.UploadError, match="expected one of"):
        hub.plan_upload(empty, "a/b")
    (empty / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5PackedForCausalLM"]}))
    with pytest.raises(hub.UploadError, match="remote code is incomplete"):
        hub.plan_upload(empty, "a/b")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    index = {"weight_map": {"x": "model-00001-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hub.UploadError, match="names shards that are missing"):
        hub.plan_upload(sharded, "a/b")
    # no token anywhere: the real HfApi is never built
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    assert hub.main([str(packed), "--repo-id", "a/b"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err


def test_hub_upload_script_is_a_thin_entry(packed, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hub_upload.py", str(packed), "--repo-id", "a/b", "--dry-run"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "hub_upload.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert "dry run: nothing uploaded" in capsys.readouterr().out
    assert os.access(ROOT / "hub_upload.py", os.R_OK)


def test_the_upload_command_is_the_uploader(packed, monkeypatch, capsys):
    """`qwen35-packed upload` takes hub_upload.py's arguments and prints the same plan and card; without a token it
    refuses as the uploader does."""
    argv = [str(packed), "--repo-id", "a/b", "--base-model", "Qwen/Qwen3.5-0.8B", "--dry-run"]
    assert hub.main(argv) == 0
    expected = capsys.readouterr().out
    assert cli.main(["upload", *argv]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    assert cli.main(["upload", str(packed), "--repo-id", "a/b"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err


def test_the_project_license_is_declared_and_recognised(packed, tmp_path):
    """LICENSE is the Apache-2.0 text pyproject.toml declares (an SPDX expression, which needs setuptools 77), and
    the card recognises it when a folder carries it."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0" and pyproject["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in pyproject["build-system"]["requires"]
    folder = tmp_path / "folder"
    shutil.copytree(packed, folder)
    (folder / "LICENSE").write_bytes((ROOT / "LICENSE").read_bytes())
    plan = hub.plan_upload(folder, "a/b")
    assert "license: apache-2.0" in plan.card_text
    assert not any("no license known" in note for note in plan.notes)


@pytest.fixture(scope="module")
def packed_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_moe")
    build_builtin("moe", seed=3).save_pretrained(root / "src")
    convert(root / "src", root / "packed", progress=False, log=lambda line: None)
    return root / "packed"


def test_card_trl_command_parses():
    """The card's `trl grpo` line is accepted by TRL's own parser for that command (run on CPU here)."""
    import shlex

    trl = pytest.importorskip("trl")
    from trl.scripts.grpo import GRPOScriptArguments

    command = hub.usage_snippets("org/packed", "packed", False, None)["trl"]
    line = " ".join(part.rstrip("\\").strip() for part in command.splitlines() if not part.startswith("#"))
    words = shlex.split(line)
    assert words[:2] == ["trl", "grpo"]
    parser = trl.TrlParser((GRPOScriptArguments, trl.GRPOConfig, trl.ModelConfig))
    script, training, model = parser.parse_args_and_config(words[2:] + ["--use_cpu", "true"])
    assert training.trust_remote_code is True and model.model_name_or_path == "org/packed"
    assert script.reward_funcs == ["my_rewards.reward_fn"]


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_card_peft_snippets_run(layout, packed, packed_moe, tmp_path):
    """The card's LoRA snippet wraps the model (MoE: the fused experts too); the adapter card's snippet loads the
    saved adapter onto the base folder and merges it."""
    pytest.importorskip("peft")
    folder = packed if layout == "dense" else packed_moe
    scope = {}
    exec(
        compile(hub.usage_snippets(str(folder), "packed", layout == "moe", None)["peft"], "<card:peft>", "exec"), scope
    )
    model = scope["model"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any("linear_attn.in_proj_qkv" in n for n in names) and not any("conv1d" in n for n in names)
    assert any("experts" in n for n in names) is (layout == "moe")
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    plan = hub.plan_upload(adapter, "org/adapter", base_model=str(folder))
    assert plan.kind == "adapter"
    scope = {}
    exec(compile(hub.usage_snippets("PLACEHOLDER", "adapter", False, str(folder))["peft"].replace(
        "PLACEHOLDER", str(adapter)), "<card:adapter>", "exec"), scope)  # fmt: skip
    assert type(scope["merged"]).__name__.startswith("Qwen3_5")


def test_shards_are_whatever_the_index_names(tmp_path):
    """Shard names differ between repositories (model-00001-of-00002, model.safetensors-00001-of-00002, ...): the
    index decides."""
    folder = tmp_path / "official"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    names = ["model.safetensors-00001-of-00002.safetensors", "model.safetensors-00002-of-00002.safetensors"]
    for i, name in enumerate(names):
        save_file({f"t{i}": torch.zeros(1)}, str(folder / name))
    save_file({"old": torch.zeros(1)}, str(folder / "model-00001-of-00009.safetensors"))
    index = {"weight_map": {"t0": names[0], "t1": names[1]}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    plan = hub.plan_upload(folder, "org/x")
    assert {f.path_in_repo for f in plan.files} >= set(names) | {"model.safetensors.index.json"}
    assert ("model-00001-of-00009.safetensors", "a shard model.safetensors.index.json does not name (stale?)") in (
        plan.skipped
    )


@requires_builtin_qwen35
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reward_model_folders(kind, tmp_path):
    """A folder saved from a reward model (our sequence-classification class with its remote code) and, dense, its
    official layout (`convert --to official`): accepted, the card a text-classification one whose snippets load it
    through AutoModelForSequenceClassification and score as written (one score per packed document), without the
    generation, TRL GRPO, PEFT or vLLM snippets; without its auto_map entry the upload is refused."""
    folder = build_tiny_reward_folder(tmp_path / "reward", kind)
    moe = kind == "moe"
    folders = [(folder, "packed")]
    if not moe:
        convert(folder, tmp_path / "official", to="official", progress=False, log=lambda line: None)
        folders.append((tmp_path / "official", "official"))
    for path, expected_kind in folders:
        plan = hub.plan_upload(path, "org/reward")
        assert (plan.kind, plan.is_moe, plan.vision) == (expected_kind, moe, False)
        assert {"config.json", "model.safetensors"} <= {f.path_in_repo for f in plan.files}
        assert any(f.path_in_repo == "modeling_qwen3_5_packed.py" for f in plan.files) == (expected_kind == "packed")
        card = ModelCard(plan.card_text)
        assert card.data.pipeline_tag == "text-classification" and "reward-model" in card.data.tags
        assert "sequence-classification (reward / value)" in card.text and "`num_labels` 1" in card.text
        for absent in ("AutoModelForCausalLM", "trl grpo", "LoraConfig", "from vllm"):
            assert absent not in card.text, absent
        snippets = hub.usage_snippets(str(path), expected_kind, moe, None, reward=True)
        assert set(snippets) == ({"transformers", "packed"} if expected_kind == "packed" else {"transformers"})
        if expected_kind == "official" and not hasattr(transformers, "Qwen3_5TextForSequenceClassification"):
            continue
        for name, code in snippets.items():
            scope = {}
            exec(compile(code, f"<card:{name}>", "exec"), scope)
            assert type(scope["model"]).__name__.endswith("ForSequenceClassification")
            assert scope["scores"].shape == ((2, 1) if name == "packed" else (1, 1))
    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]["AutoModelForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(hub.UploadError, match="auto_map has no AutoModelForSequenceClassification entry"):
        hub.plan_upload(folder, "org/reward")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_vision_language_folders_and_their_adapters(kind, tmp_path):
    """What `convert` writes by default from a composite checkpoint (this project's vision-language classes), the
    composite checkpoint itself and a LoRA adapter of the converted model: each is accepted, and the card's
    snippets load it through AutoModelForImageTextToText and run as written."""
    src, out = tmp_path / "src", tmp_path / "packed"
    build_tiny_vlm(kind=kind).save_pretrained(src)
    convert(src, out, progress=False, log=lambda line: None)
    moe = kind == "moe"
    for folder, expected_kind in ((out, "packed"), (src, "official")):
        plan = hub.plan_upload(folder, "org/vl")
        assert (plan.kind, plan.is_moe, plan.vision) == (expected_kind, moe, True)
        card = ModelCard(plan.card_text)
        assert card.data.pipeline_tag == "image-text-to-text" and "vision-language" in card.text
        assert "AutoModelForCausalLM" not in card.text and "trl grpo" not in card.text
        snippets = hub.usage_snippets(str(folder), expected_kind, moe, None, vision=True)
        for name in ("transformers", "packed") if expected_kind == "packed" else ("transformers",):
            scope = {}
            exec(compile(snippets[name], f"<card:{name}>", "exec"), scope)
            assert type(scope["model"]).__name__.endswith("ForConditionalGeneration")
            assert scope["logits"].shape == (1, 7, 128) if name == "transformers" else torch.isfinite(scope["out"].loss)
    pytest.importorskip("peft")
    scope = {}
    exec(compile(hub.usage_snippets(str(out), "packed", moe, None, vision=True)["peft"], "<card:peft>", "exec"),
         scope)  # fmt: skip
    adapter = tmp_path / "adapter"
    scope["model"].save_pretrained(adapter)
    plan = hub.plan_upload(adapter, "org/vl-adapter", base_model=str(out))
    assert (plan.kind, plan.vision) == ("adapter", True)
    scope = {}
    exec(compile(hub.usage_snippets(str(adapter), "adapter", moe, str(out), vision=True)["peft"], "<card:adapter>",
                 "exec"), scope)  # fmt: skip
    assert type(scope["merged"]).__name__.endswith("PackedForConditionalGeneration")
