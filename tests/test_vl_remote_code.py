"""The VL classes as remote code: the flat copy of the remote-code files next to a config.json with `auto_map`
loads through `trust_remote_code` (what a converted composite folder holds)."""

import json

import pytest
import torch
import transformers

from qwen35_packed.conversion.remote_code import copy_remote_code
from vl_tiny import builtin_vl_pair, grid_tensor, make_document, pixels_for, token_types

AUTO_MAP = {
    "dense": {
        "AutoConfig": "configuration_qwen3_5_packed_vl.Qwen3_5PackedVLConfig",
        "AutoModel": "modeling_qwen3_5_packed_vl.Qwen3_5PackedVLModel",
        "AutoModelForCausalLM": "modeling_qwen3_5_packed_vl.Qwen3_5PackedForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_qwen3_5_packed_vl.Qwen3_5PackedForConditionalGeneration",
    },
    "moe": {
        "AutoConfig": "configuration_qwen3_5_packed_vl.Qwen3_5MoePackedVLConfig",
        "AutoModel": "modeling_qwen3_5_packed_vl.Qwen3_5MoePackedVLModel",
        "AutoModelForCausalLM": "modeling_qwen3_5_packed_vl.Qwen3_5MoePackedForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_qwen3_5_packed_vl.Qwen3_5MoePackedForConditionalGeneration",
    },
}
ARCH = {"dense": "Qwen3_5PackedForConditionalGeneration", "moe": "Qwen3_5MoePackedForConditionalGeneration"}


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
    frozen = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, trust_remote_code=True,
                                                                      freeze_vision=True)
    assert not any(p.requires_grad for p in frozen.model.visual.parameters())
