"""Meta-device construction: every class builds on `torch.device("meta")`, `to_empty()` materialises it, and a
state dict loaded into it gives the reference model's logits, with A_log / dt_bias still fp32. This is how FSDP2
and Accelerate's `cpu_ram_efficient_loading` build a large model on every rank without materialising it (the
gloo FSDP2 step of a MoE model built this way is in tests/integrations/test_fsdp2.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import _randomize_zero_init, tiny_kwargs
from vl_tiny import our_vl_model

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.modeling import Qwen3_5PackedTextModel
from qwen35_packed.modeling.gated_deltanet import FP32_PARAMETERS, GatedDeltaNet


def _build(name: str):
    if name == "dense":
        return Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**tiny_kwargs("dense")))
    if name == "moe":
        return Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**tiny_kwargs("moe")))
    if name == "text_model_moe":
        return Qwen3_5PackedTextModel(Qwen3_5MoePackedConfig(**tiny_kwargs("moe")))
    return our_vl_model(name.removeprefix("vl_"))


def _output(model, ids):
    out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("name", ["dense", "moe", "text_model_moe", "vl_dense", "vl_moe"])
def test_meta_construction_then_to_empty_loads_a_state_dict_exactly(name):
    torch.manual_seed(0)
    reference = _build(name).eval()
    _randomize_zero_init(reference)
    with torch.device("meta"):
        model = _build(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict(), strict=True)
    model.eval()
    ids = torch.randint(0, 100, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(_output(model, ids), _output(reference, ids))
    gdn = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert gdn and all(getattr(m, p).dtype == torch.float32 for m in gdn for p in FP32_PARAMETERS)
    # a later cast still keeps them fp32 (moved, never down-cast), and keeps their gradients' dtype with them
    model.to(torch.bfloat16)
    assert all(getattr(m, p).dtype == torch.float32 for m in gdn for p in FP32_PARAMETERS)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if not n.endswith(FP32_PARAMETERS))
