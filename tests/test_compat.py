"""Compatibility across transformers versions. Part of the core suite, which runs on every version of the matrix
(scripts/test-matrix.sh), 4.x included, where transformers has no built-in Qwen3.5: there these tests are the
references. The model against a pure-PyTorch per-document model (tests/reference_model.py), and the user path
built without the built-in classes (text and vision-language): our save_pretrained -> `convert --to official` ->
`convert` -> the Auto classes with trust_remote_code, rope read the same by v4- and v5-style readers."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import TINY_ROPE, packed_model, tiny_kwargs
from reference_model import reference_logits
from vl_tiny import grid_tensor, make_document, packed_vl_model, pixels_for

from qwen35_packed import Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM
from qwen35_packed.conversion import convert

LENGTHS = [1, 3, 9, 70]  # a 1-token document, one shorter than the conv kernel, one longer than a 64-token chunk


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_and_unpacked_equal_pure_pytorch_reference_per_document(kind):
    model = packed_model(kind, seed=11)
    ids = torch.randint(0, 128, (sum(LENGTHS),), generator=torch.Generator().manual_seed(0))
    state = model.state_dict()
    with torch.no_grad():
        packed = model(ids[None], cu_seqlens=_cu(LENGTHS)).logits[0]
        packed_loss = model(ids[None], cu_seqlens=_cu(LENGTHS), labels=ids[None]).loss
    nll, targets = 0.0, 0
    for doc, logits in zip(ids.split(LENGTHS), packed.split(LENGTHS)):
        expected = reference_logits(state, model.config, doc)
        with torch.no_grad():
            alone = model(doc[None], use_cache=False).logits[0]
        assert (alone.double() - expected).abs().max().item() <= 1e-4, len(doc)
        assert (logits - alone).abs().max().item() <= 1e-5, len(doc)
        nll += F.cross_entropy(expected[:-1], doc[1:], reduction="sum").item()
        targets += len(doc) - 1
    assert abs(packed_loss.item() - nll / targets) <= 1e-5  # token-weighted, no target across documents


def _assert_rope_in_every_form(folder, composite=False):
    raw = json.loads((folder / "config.json").read_text())
    if composite:
        raw = raw["text_config"]
    assert raw["rope_parameters"] == TINY_ROPE  # transformers 5
    assert raw["rope_scaling"] == TINY_ROPE  # transformers 4-style readers: mrope_section, interleaving
    assert raw["rope_theta"] == TINY_ROPE["rope_theta"]  # getattr(config, "rope_theta", default)
    assert raw["partial_rotary_factor"] == TINY_ROPE["partial_rotary_factor"]


def _folder_without_builtin(model, tmp_path):
    """The user path without transformers' built-in classes: save_pretrained -> official layout -> packed folder."""
    model.save_pretrained(tmp_path / "ours")
    convert(tmp_path / "ours", tmp_path / "official", to="official", progress=False, log=lambda *_: None)
    convert(tmp_path / "official", tmp_path / "packed", progress=False, log=lambda *_: None)
    return tmp_path / "packed"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_user_path_without_builtin_classes(kind, tmp_path):
    model = packed_model(kind, seed=3)
    folder = _folder_without_builtin(model, tmp_path)
    _assert_rope_in_every_form(tmp_path / "ours")
    _assert_rope_in_every_form(folder)

    remote = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    arch = "Qwen3_5MoePackedForCausalLM" if kind == "moe" else "Qwen3_5PackedForCausalLM"
    assert type(remote).__name__ == arch and type(remote).__module__.startswith("transformers_modules.")
    assert remote.config.rope_parameters == TINY_ROPE
    assert remote.config.rope_theta == TINY_ROPE["rope_theta"]

    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        assert (remote(ids, use_cache=False).logits - expected).abs().max().item() <= 1e-6
        packed = remote(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 40, 80])).logits
    assert (packed.reshape(2, 40, -1) - expected).abs().max().item() <= 1e-5

    remote.save_pretrained(tmp_path / "resaved")  # what a trainer writes: still every rope form
    _assert_rope_in_every_form(tmp_path / "resaved")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_vision_language_user_path_without_builtin_classes(kind, tmp_path):
    model = packed_vl_model(kind, seed=1)
    folder = _folder_without_builtin(model, tmp_path)
    _assert_rope_in_every_form(folder, composite=True)

    remote = transformers.AutoModelForImageTextToText.from_pretrained(folder, trust_remote_code=True)
    arch = "Qwen3_5MoePackedForConditionalGeneration" if kind == "moe" else "Qwen3_5PackedForConditionalGeneration"
    assert type(remote).__name__ == arch and type(remote).__module__.startswith("transformers_modules.")
    assert remote.config.model_type == ("qwen3_5_moe" if kind == "moe" else "qwen3_5")
    gen = torch.Generator().manual_seed(0)
    ids, images, _ = make_document(gen, 2)
    inputs = dict(input_ids=ids.unsqueeze(0), pixel_values=pixels_for(images, gen), image_grid_thw=grid_tensor(images))
    with torch.no_grad():
        assert (remote.eval()(**inputs).logits - model(**inputs).logits).abs().max().item() <= 1e-6


def test_generate_and_tied_embeddings_round_trip(tmp_path):
    config = Qwen3_5PackedConfig(**dict(tiny_kwargs("dense"), tie_word_embeddings=True))
    torch.manual_seed(0)
    model = Qwen3_5PackedForCausalLM(config).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = Qwen3_5PackedForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    prompt = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        out = loaded.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
        alone = loaded.generate(prompt[1:, 3:], max_new_tokens=6, do_sample=False)
        # greedy decoding equals the argmax of full forwards over the growing sequence
        seq = prompt[:1]
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert out[0].tolist() == seq[0].tolist()
    assert out[1, 7:].tolist() == alone[0, 4:].tolist()


def test_grpo_with_lora_on_a_folder_built_without_builtin(tmp_path):
    """TRL's GRPOTrainer (where TRL is installed: the main environment and the 4.57 leg of the matrix) trains the
    remote-code model with LoRA on a folder made without the built-in classes."""
    trl = pytest.importorskip("trl")
    pytest.importorskip("peft")
    import datasets
    from conftest import _randomize_zero_init

    from qwen35_packed.integrations.lora import lora_config
    from qwen35_packed.tiny import build_char_tokenizer, write_prompt_dataset

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = Qwen3_5PackedForCausalLM(
        Qwen3_5PackedConfig(
            **tiny_kwargs("dense"), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
        )
    )
    _randomize_zero_init(model)
    folder = _folder_without_builtin(model, tmp_path)
    tokenizer.save_pretrained(folder)
    data = datasets.load_dataset("json", data_files=str(write_prompt_dataset(tmp_path / "data") / "train.jsonl"))

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_cpu=True,
        report_to=[],
        max_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        beta=0.04,
        seed=0,
        trust_remote_code=True,
    )
    trainer = trl.GRPOTrainer(
        model=str(folder),
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args,
        train_dataset=data["train"],
        peft_config=lora_config(model.config, r=4),
    )
    base = trainer.model.get_base_model()
    assert type(base).__name__ == "Qwen3_5PackedForCausalLM" and type(base).__module__.startswith(
        "transformers_modules."
    )
    lora_b = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    assert lora_b and all(p.abs().max() == 0 for p in lora_b.values())  # PEFT starts B at zero
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = [n for n, p in trainer.model.named_parameters() if n in lora_b and p.abs().max() > 0]
    assert moved, "no LoRA weight changed in the GRPO step"


def test_top_level_rope_key_written_by_transformers_5_is_read_as_transformers_5_reads_it(tmp_path, monkeypatch, caplog):
    """transformers 5.17's Qwen3_5TextConfig saves its class default `partial_rotary_factor` 0.25 at the top level
    next to the 0.5 of `rope_parameters` that its model uses. A file written by transformers 5 is read as
    transformers 5 reads it (with a warning); elsewhere a contradiction stays an error."""
    from vl_tiny import composite_kwargs

    from qwen35_packed.configuration.configuration_qwen3_5_packed_vl import Qwen3_5PackedVLConfig
    from qwen35_packed.conversion.config import build_output_config
    from qwen35_packed.modeling import utils

    monkeypatch.setattr(utils, "_logged_once", set())
    text = {**tiny_kwargs("dense"), "model_type": "qwen3_5_text", "partial_rotary_factor": 0.25}
    (tmp_path / "config.json").write_text(json.dumps({**text, "transformers_version": "5.17.0"}))
    with caplog.at_level("WARNING"):
        config = Qwen3_5PackedConfig.from_pretrained(tmp_path)
    assert config.rope_parameters["partial_rotary_factor"] == config.partial_rotary_factor == 0.5
    assert "transformers 5.17.0 has top-level partial_rotary_factor=0.25" in caplog.text

    composite = {
        **composite_kwargs("dense"),
        "text_config": text,
        "model_type": "qwen3_5",
        "transformers_version": "5.17.0",
    }
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps(composite))
    assert Qwen3_5PackedVLConfig.from_pretrained(tmp_path / "vl").text_config.rope_parameters == TINY_ROPE

    out = build_output_config({**text, "transformers_version": "5.17.0"}, text_only=False)
    assert out.data["partial_rotary_factor"] == out.data["rope_scaling"]["partial_rotary_factor"] == 0.5
    assert any("top-level partial_rotary_factor=0.25" in note for note in out.notes)

    (tmp_path / "config.json").write_text(json.dumps({**text, "transformers_version": "4.57.6"}))
    with pytest.raises(ValueError, match="Contradicting rope values"):
        Qwen3_5PackedConfig.from_pretrained(tmp_path)
