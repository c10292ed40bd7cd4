"""Which part of the MoE block gives a token a different bf16 result when its document runs alone than when it runs
packed with others (batch-size dependence of a kernel), on the GPU.

tests/test_gpu.py checks packed == per-document for the MoE model; a kernel whose rounding depends on how many
rows it multiplies at once changes hidden states by an ulp, and the router then sends near-tie tokens to other
experts. This script runs each part of one MoE block on the whole packed stream and on each document's rows alone
and counts the rows that are not bitwise equal:

  router      fp32 router logits through one F.linear
  router_blocked   the same through moe.batch_invariant_linear (fixed-size row blocks: what the router runs)
  gate        shared_expert_gate: a [rows, hidden] x [hidden, 1] product
  shared      the shared expert (three bf16 linears)
  grouped     the experts through grouped_mm, with the routing of the packed run
  loop        the experts through the per-expert loop, same routing
  block       the whole block

    python benchmarks/moe_batch_invariance.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen35_packed import Qwen3_5MoePackedConfig
from qwen35_packed.modeling import kernels
from qwen35_packed.modeling.moe import SparseMoeBlock, batch_invariant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [700, 1030, 1, 37, 500, 64, 3, 211, 129, 90]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3_5MoePackedConfig(
        vocab_size=1024,
        hidden_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        router_aux_loss_coef=0.0,
        rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [6, 5, 5]},
    )
    block = SparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    block = block.to(DEVICE, torch.bfloat16)
    config.moe_kernel = "grouped_mm"
    choice = kernels.select_kernels(config, torch.device(DEVICE), torch.bfloat16)
    x = torch.randn(sum(LENGTHS), 512, device=DEVICE).to(torch.bfloat16)
    bounds = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    with torch.no_grad():
        _, weights, index = block.gate(x)
        parts = {
            "router": lambda rows, sl: F.linear(rows.float(), block.gate.weight.float()),
            "router_blocked": lambda rows, sl: batch_invariant_linear(rows.float(), block.gate.weight.float()),
            "gate": lambda rows, sl: block.shared_expert_gate(rows),
            "shared": lambda rows, sl: block.shared_expert(rows, choice),
            "grouped": lambda rows, sl: block.experts(rows, index[sl], weights[sl], choice),
            "loop": lambda rows, sl: block.experts.looped(rows, index[sl], weights[sl]),
            "block": lambda rows, sl: block(rows, choice)[0],
        }
        report = {"choice": choice.moe, "rows": len(x), "documents": LENGTHS, "parts": {}}
        for name, fn in parts.items():
            whole = fn(x, slice(None))
            differing, worst = 0, 0.0
            for start, end in zip(bounds[:-1], bounds[1:]):
                alone = fn(x[start:end], slice(start, end))
                same = (alone == whole[start:end]).all(-1)
                differing += int((~same).sum())
                worst = max(worst, (alone.float() - whole[start:end].float()).abs().max().item())
            report["parts"][name] = {"rows_not_bitwise_equal": differing, "max_abs_diff": worst}
            print(f"{name:<8} rows not bitwise equal {differing:>5} / {len(x)}   max |diff| {worst:.3g}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
