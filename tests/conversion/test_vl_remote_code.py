"""The VL classes as remote code: the flat copy of the remote-code files next to a config.json with `auto_map`
loads through `trust_remote_code` (what a converted composite folder holds)."""

import json
import sys

import pytest
import torch
import transformers
from conftest import requires_builtin_qwen35
from fixtures_conversion import ARCH, AUTO_MAP
from vl_tiny import builtin_vl_pair, grid_tensor, make_document, pixels_for, token_types

from qwen35_packed.conversion.remote_code import copy_remote_code


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_flat_remote_code_folder_loads_with_trust_remote_code(kind, tmp_path):
    ref, ours = builtin_vl_pair(kind, seed=11)
    # Dense: the folder transformers' built-in class writes (official keys). MoE: the built-in writes per-expert
    # tensors, which only the conversion fuses, so the folder is written by our class (fused, official layout).
    (ref if kind == "dense" else ours).save_pretrained(tmp_path)
    copy_remote_code(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = AUTO_MAP[kind]
    config["architectures"] = [ARCH[kind]]
    (tmp_path / "config.json").write_text(json.dumps(config))

    gen = torch.Generator().manual_seed(0)
    ids, images, _ = make_document(gen, 2)
    inputs = dict(input_ids=ids.unsqueeze(0), pixel_values=pixels_for(images, gen), image_grid_thw=grid_tensor(images))
    with torch.no_grad():
        expected = ref(**inputs, mm_token_type_ids=token_types(inputs["input_ids"]), use_cache=False).logits
    for auto in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
        model, info = auto.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
        assert type(model).__name__ == ARCH[kind] and type(model).__module__.startswith("transformers_modules.")
        # the folder's own class, not the copy transformers makes of a class that lacks GenerationMixin as a base
        assert type(model) is getattr(sys.modules[type(model).__module__], ARCH[kind])
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert isinstance(model.config, transformers.Qwen3_5MoeConfig if kind == "moe" else transformers.Qwen3_5Config)
        with torch.no_grad():
            got = model.eval()(**inputs).logits
        assert (got - expected).abs().max().item() <= 1e-4
    base = transformers.AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(base).__name__ == AUTO_MAP[kind]["AutoModel"].split(".")[-1]
    with torch.no_grad():
        hidden = base(**inputs).last_hidden_state
        assert torch.allclose(model.lm_head(hidden), got, atol=1e-5, rtol=0)
    frozen = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path, trust_remote_code=True, freeze_vision=True
    )
    assert not any(p.requires_grad for p in frozen.model.visual.parameters())


@requires_builtin_qwen35  # build_tiny_vl_folder saves transformers' built-in composite model
def test_trl_grpo_trainer_takes_the_vl_class(tmp_path):
    """TRL's GRPOTrainer loads a converted VL folder as the remote class and reads its `generation_config` (pad and
    eos ids) even when vLLM generates; `generate()` itself refuses with the cache error."""
    trl = pytest.importorskip("trl")
    import datasets

    from qwen35_packed.tiny import build_tiny_vl_folder

    folder = build_tiny_vl_folder(tmp_path / "vl", "dense")
    # the tokenizer: the folder's Qwen3VLProcessor needs torchvision (its video processor), which CI does not install
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        use_cpu=True,
        report_to="none",
        trust_remote_code=True,
        model_init_kwargs={"trust_remote_code": True},
    )
    trainer = trl.GRPOTrainer(
        model=str(folder),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "ab"}] * 4),
        processing_class=tokenizer,
    )
    model = trainer.model
    assert type(model).__name__ == ARCH["dense"] and type(model).__module__.startswith("transformers_modules.")
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
