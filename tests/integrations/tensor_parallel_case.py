"""The tiny models and the packed batch shared by test_tensor_parallel.py and its torchrun worker: heads that
two ranks can split, tied (dense) and untied (MoE) embeddings."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import tiny_kwargs  # noqa: E402

from qwen35_packed import (  # noqa: E402
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)

CLASSES = {"dense": Qwen3_5PackedForCausalLM, "moe": Qwen3_5MoePackedForCausalLM}
SPLITTABLE = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


def build(kind: str):
    """The tiny model of `kind` in fp32 with random weights: dense ties lm_head to the embedding, MoE does not."""
    config_class = Qwen3_5MoePackedConfig if kind == "moe" else Qwen3_5PackedConfig
    config = config_class(**{**tiny_kwargs(kind), **SPLITTABLE}, tie_word_embeddings=kind == "dense")
    torch.manual_seed(0)
    model = CLASSES[kind](config)
    with torch.no_grad():  # norms away from their initial values, so a wrongly applied weight shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def batch():
    """One packed row of three documents: (input_ids [1, 40], cu_seqlens)."""
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    return ids, torch.tensor([0, 13, 14, 40], dtype=torch.int32)
