"""`qwen35-packed tiny`: the tiny folders and datasets the recipes of the README and docs/ run on (qwen35_packed/tiny.py)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from conftest import requires_builtin_qwen35

from qwen35_packed import cli, tiny

ROOT = Path(__file__).resolve().parent.parent
pytestmark = requires_builtin_qwen35  # the folders are saved from the built-in classes


def run_tiny(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["tiny", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def dense_with_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    assert cli.main(["tiny", str(root / "dense"), "--data", str(root / "data")]) == 0
    return root / "dense", root / "data"


def test_a_tiny_folder_loads_as_a_user_loads_it(dense_with_data, capsys):
    """The folder is a converted one: AutoModelForCausalLM with trust_remote_code builds this project's class from
    the folder's own remote code, and AutoTokenizer its tokenizer, whose ids fit the model and whose pad / eos ids
    are the config's and the generation config's."""
    folder, _ = dense_with_data
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__name__ == "Qwen3_5PackedForCausalLM"
    assert type(model).__module__.startswith("transformers_modules")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "Count to 3: 1 2 3!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids
    assert len(tokenizer) <= model.config.vocab_size
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["pad_token_id"], generation["eos_token_id"]) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    docs = [torch.tensor(tokenizer(t)["input_ids"]) for t in ("abc", "x", "hello there")]
    out = model(torch.cat(docs)[None], cu_seqlens=torch.tensor([0, 3, 4, 15]), labels=torch.cat(docs)[None])
    assert torch.isfinite(out.loss)


def test_the_chat_template_marks_the_assistant_turn_for_assistant_only_loss(dense_with_data):
    """The template renders every message, and the assistant mask covers exactly the answer and its eos (what TRL's
    `--assistant_only_loss true` trains on)."""
    folder, _ = dense_with_data
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "count to 3"}, {"role": "assistant", "content": "1 2 3"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "user: count to 3\nassistant: 1 2 3<eos>\n"
    encoded = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "1 2 3<eos>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "user: count to 3\nassistant: "


def test_the_datasets_are_what_trl_reads_in_the_tokenizer_alphabet(dense_with_data):
    """DIR/chat has a `messages` column (user, then assistant), DIR/prompts a plain-text `prompt` column; every text
    is made of the tokenizer's characters (no unknown token)."""
    datasets = pytest.importorskip("datasets")
    folder, data = dense_with_data
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    chat = datasets.load_dataset(str(data / "chat"), split="train")
    prompts = datasets.load_dataset(str(data / "prompts"), split="train")
    assert chat.column_names == ["messages"] and prompts.column_names == ["prompt"]
    assert len(chat) > 0 and len(prompts) > 0
    assert all([m["role"] for m in row] == ["user", "assistant"] for row in chat["messages"])
    texts = [tokenizer.apply_chat_template(row, tokenize=False) for row in chat["messages"]] + list(prompts["prompt"])
    assert all(tokenizer.unk_token_id not in tokenizer(t)["input_ids"] for t in texts)


def test_the_seed_decides_the_weights(tmp_path, capsys):
    """The same seed writes the same weights bit for bit; another seed other weights."""
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert run_tiny(capsys, tmp_path / name, "--moe", "--seed", seed)[0] == 0
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoePackedForCausalLM"] and config["num_experts"] == 4


def test_existing_outputs_are_refused_before_anything_is_written(tmp_path, capsys):
    """An existing OUT, DIR/chat or DIR/prompts: exit status 2 with an error naming it, and none of the other
    outputs written."""
    (tmp_path / "taken").mkdir()
    code, out, err = run_tiny(capsys, tmp_path / "taken", "--data", tmp_path / "data")
    assert code == 2 and f"{tmp_path / 'taken'} exists" in err and not (tmp_path / "data").exists()
    (tmp_path / "data" / "prompts").mkdir(parents=True)
    code, out, err = run_tiny(capsys, tmp_path / "model", "--data", tmp_path / "data")
    assert code == 2 and f"{tmp_path / 'data' / 'prompts'} exists" in err
    assert not (tmp_path / "model").exists() and not (tmp_path / "data" / "chat").exists()


def test_a_transformers_without_qwen35_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.57.0"))
    with pytest.raises(tiny.TinyFolderError, match="transformers 4.57.0 does not have"):
        tiny.build_tiny_folder(tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_a_vision_language_folder_with_its_processor_files(tmp_path, capsys, monkeypatch):
    """--vl: the composite folder loads into this project's vision-language class; the tokenizer's vision tokens are
    the config's ids and the processor files name Qwen3VLProcessor. Where torchvision does not import (forced here)
    the command says that AutoProcessor needs it and names the `vl` extra."""
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError
    code, out, err = run_tiny(capsys, tmp_path / "vl", "--vl")
    assert code == 0 and f"wrote {tmp_path / 'vl'}" in out
    assert "needs torchvision" in err and "qwen35-packed[vl]" in err
    folder = tmp_path / "vl"
    config = json.loads((folder / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.convert_tokens_to_ids(list(tiny.VISION_TOKENS))
    assert ids == [
        config[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ]
    assert len(tokenizer) <= config["text_config"]["vocab_size"]
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert json.loads((folder / name).read_text())["processor_class"] == "Qwen3VLProcessor"
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__name__ == "Qwen3_5PackedForConditionalGeneration"


def test_the_processor_loads_where_torchvision_imports(tmp_path):
    """With torchvision (the `vl` extra), AutoProcessor builds the folder's Qwen3VLProcessor, which puts one image
    placeholder per merged patch of an image."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # PyPI's builds fail to load their operators beside a CPU torch
        pytest.skip(f"torchvision does not import here: {type(exc).__name__}: {exc}")
    from PIL import Image

    folder = tiny.build_tiny_vl_folder(tmp_path / "vl")
    processor = transformers.AutoProcessor.from_pretrained(folder)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    image = Image.new("RGB", (16, 16), (200, 10, 10))
    text = "<|vision_start|><|image_pad|><|vision_end|>what is it?"
    batch = processor(text=[text], images=[image], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    t, h, w = batch["image_grid_thw"][0].tolist()
    assert int((batch["input_ids"] == image_id).sum()) == t * h * w // 4


def test_the_vl_extra_installs_what_the_processor_needs():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {requirement.split(">")[0].split("=")[0].strip().lower() for requirement in extras["vl"]}
    assert {"torchvision", "pillow"} <= names
