"""benchmarks/add_census.py: the census finds the adds this project issues where their count follows from the
config: the adapters' in-place sums (one per LoRA'd dense projection, over its output, in the forward and again in
the checkpointed layer's recompute) and the expert LoRA's sums (over the expert rows of each adapted expert tensor)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from add_census import run  # noqa: E402
from bench_moe import layer_shapes  # noqa: E402


def _site(result: dict, prefix: str) -> dict:
    (row,) = [row for row in result["sites"] if row["site"].startswith(prefix)]
    return row


@pytest.mark.parametrize("autocast", [False, True])
def test_adapter_and_expert_lora_sums_are_counted_per_projection_and_pass(autocast):
    c = layer_shapes(4, 4096, tiny=True)  # 3 GDN layers, then 1 attention layer
    gdn_out = (
        2 * c["linear_key_head_dim"] * c["linear_num_key_heads"] + c["linear_value_head_dim"] * c["linear_num_value_heads"]  # qkv
        + c["linear_value_head_dim"] * c["linear_num_value_heads"]  # z
        + 2 * c["linear_num_value_heads"]  # a, b
        + c["hidden_size"]  # out_proj
    )  # fmt: skip
    attention_out = (
        2 * c["num_attention_heads"] * c["head_dim"]  # q with its gate
        + 2 * c["num_key_value_heads"] * c["head_dim"]  # k, v
        + c["hidden_size"]  # o_proj
    )
    passes = 2  # the forward, and the recompute of the checkpointed layer
    result = run(tokens=256, layers=4, tiny=True, autocast=autocast)
    dense = _site(result, "adapter_products.py")
    assert dense["elements_per_token_per_layer"] == passes * (3 * gdn_out + attention_out) / 4
    assert dense["calls"] == passes * (3 * 5 + 4)
    # the gate/up product's adapter sum on the expert rows; the down product's is the combine's (moe.py), which the
    # CPU's eager combine computes as an add of the two parts and the GPU's Triton combine as it reads them
    gate_up = _site(result, "expert_lora.py")
    assert gate_up["elements_per_token_per_layer"] == passes * c["num_experts_per_tok"] * 2 * c["moe_intermediate_size"]
    assert gate_up["calls"] == passes * 4
    down = _site(result, "kernels.py")
    assert down["elements_per_token_per_layer"] == passes * c["num_experts_per_tok"] * c["hidden_size"]
    assert down["calls"] == passes * 4
    assert sum(row["share"] for row in result["sites"]) == pytest.approx(1, abs=1e-3)
