"""Builders shared by the conversion tests and by the tests that need official-layout folders (loading, the hub,
sequence classification): transformers' built-in models, shards and side files written as official checkpoints
hold them, folder digests, and the `auto_map` a converted composite folder gets (CPU, fp32, tiny models)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import transformers
from conftest import tiny_kwargs
from safetensors import safe_open
from safetensors.torch import save_file

from qwen35_packed.cli import main

TOKENIZER_FILES = {
    "tokenizer_config.json": '{"eos_token": "<|im_end|>"}\n',
    "chat_template.jinja": "{{ messages }}\n",
    "generation_config.json": '{"eos_token_id": [1, 2]}\n',
}
NOT_COPIED = {"preprocessor_config.json": "{}\n", "video_preprocessor_config.json": "{}\n", "notes.txt": "x\n"}


def build_builtin(kind: str, seed: int = 0, **overrides):
    kwargs = tiny_kwargs(kind)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    if kind == "moe":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kwargs))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kwargs))
    with torch.no_grad():  # zero-initialised norms / routers would hide a swapped tensor
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def builtin_class(kind: str):
    return transformers.Qwen3_5MoeForCausalLM if kind == "moe" else transformers.Qwen3_5ForCausalLM


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                assert key not in out, key
                out[key] = handle.get_tensor(key)
    return out


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], n_shards: int) -> None:
    """Write `tensors` as `n_shards` safetensors files (round-robin, so a layer's experts span shards) + index."""
    keys = list(tensors)
    names = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {}
    for i, name in enumerate(names):
        part = {k: tensors[k].contiguous() for k in keys[i::n_shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def add_side_files(folder: Path) -> None:
    for name, text in {**TOKENIZER_FILES, **NOT_COPIED}.items():
        if name == "generation_config.json" and (folder / name).exists():
            continue
        (folder / name).write_text(text)


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def logits(model, seed: int = 3) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def assert_loads_with_builtin(out: Path, kind: str, reference) -> None:
    model, info = builtin_class(kind).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert torch.equal(logits(model.eval()), logits(reference))


def composite_config(text_model, *, moe: bool, top_tie: bool | None, keep_text_tie: bool) -> dict:
    text = text_model.config.to_dict()
    for key in ("architectures", "transformers_version", "_name_or_path", "dtype"):
        text.pop(key, None)
    if not keep_text_tie:
        text.pop("tie_word_embeddings", None)
    text["mtp_num_hidden_layers"] = 1
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 32, "model_type": "qwen3_5_moe" if moe else "qwen3_5"},
        "image_token_id": 120,
    }
    if top_tie is not None:
        config["tie_word_embeddings"] = top_tie
    return config


def composite_tensors(text_model, *, per_expert_mtp: bool) -> dict[str, torch.Tensor]:
    """Official composite layout: model.language_model.*, model.visual.*, lm_head, mtp.* (MTP experts per expert)."""
    tensors = {}
    for key, value in text_model.state_dict().items():
        if key == "lm_head.weight" and text_model.config.tie_word_embeddings:
            continue
        tensors[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key] = value
    g = torch.Generator().manual_seed(5)
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 4, 4, generator=g)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(96, 32, generator=g)
    tensors["model.visual.merger.linear_fc2.bias"] = torch.randn(64, generator=g)
    tensors["mtp.fc.weight"] = torch.randn(64, 128, generator=g)
    tensors["mtp.norm.weight"] = torch.randn(64, generator=g)
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = torch.randn(128, 64, generator=g)
    if per_expert_mtp:
        for e in range(4):
            tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = torch.randn(32, 64, generator=g)
            tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = torch.randn(32, 64, generator=g)
            tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = torch.randn(64, 32, generator=g)
    return tensors


def run_cli(*args) -> int:
    return main(["convert", *map(str, args), "--no-progress"])


def build_tiny_vlm(seed: int = 4, kind: str = "dense"):
    """transformers' composite (vision-language) class, tiny, eval mode; dense tied, MoE untied."""
    text = tiny_kwargs(kind)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)  # fmt: skip
    torch.manual_seed(seed)
    if kind == "moe":
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        return transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    return transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    ).eval()


# the remote-code classes of a converted composite (vision-language) folder
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
