"""The Triton generation-step kernels (modeling/triton_decode.py) against the PyTorch steps of reference_kernels.py.

Triton's interpreter runs them on CPU tensors when TRITON_INTERPRET=1 is set before they are decorated, so the checks
run in a fresh process with it set and report as JSON. fp32 results equal the PyTorch steps to fp32 rounding (the
sums run in another order), the conv's new state bit for bit; bf16 outputs within one bf16 rounding (the interpreter
converts to bf16 by truncation). Every row's result does not depend on the other rows of the step. Compiling them for
the H200: tests/modeling/test_triton_compile.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_triton_interpreted

pytest.importorskip("triton")

from qwen35_packed.modeling import triton_decode  # noqa: E402

INTERPRETED_CHECKS = r"""
import json
import torch
from qwen35_packed.modeling import reference_kernels as ref
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.kernel_selection import KernelChoice
from qwen35_packed.modeling.triton_decode import conv_step_silu, delta_rule_step

gen = torch.Generator().manual_seed(0)
results = {}


def gap(a, b):
    return (a.float() - b.float()).abs().max().item()


CONV = {"fp32_k4_one_row": (1, 24, 4, torch.float32), "fp32_k4_channels_past_a_block": (3, 300, 4, torch.float32),
        "fp32_k2": (4, 40, 2, torch.float32), "bf16_k4": (5, 80, 4, torch.bfloat16)}
for name, (rows, channels, kernel, dtype) in CONV.items():
    x = torch.randn(rows, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    state = torch.randn(rows, channels, kernel, generator=gen).to(dtype)
    out, new_state = conv_step_silu(x, weight, state)
    want, want_state = ref.torch_causal_conv1d_step(x, weight, state)
    alone = [conv_step_silu(x[r : r + 1], weight, state[r : r + 1])[0] for r in range(rows)]
    results["conv_" + name] = {"gap": gap(out, want), "scale": want.float().abs().max().item(),
                               "state_equal": torch.equal(new_state, want_state), "dtype": str(out.dtype),
                               "rows_alone": all(torch.equal(a[0], out[r]) for r, a in enumerate(alone))}

DELTA = {"fp32_one_head": (1, 1, 1, 8, 8, torch.float32), "fp32_grouped_heads": (3, 2, 4, 16, 40, torch.float32),
         "fp32_qwen_heads": (2, 2, 4, 128, 128, torch.float32), "bf16_qwen_heads": (2, 2, 4, 128, 128, torch.bfloat16)}
for name, (rows, key_heads, value_heads, key_dim, value_dim, dtype) in DELTA.items():
    q, k = (torch.randn(rows, key_heads, key_dim, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(rows, value_heads, value_dim, generator=gen).to(dtype)
    g = -torch.rand(rows, value_heads, generator=gen)
    beta = torch.rand(rows, value_heads, generator=gen).to(dtype)
    state = torch.randn(rows, value_heads, key_dim, value_dim, generator=gen)
    out, new_state = delta_rule_step(q, k, v, g, beta, state)
    want, want_state = ref.torch_gated_delta_rule_step(q, k, v, g, beta, state)
    held = state.clone()  # a static cache's state, updated where it is
    out_in_place, new_in_place = delta_rule_step(q, k, v, g, beta, held, out_state=held)
    alone = [delta_rule_step(q[r:r+1], k[r:r+1], v[r:r+1], g[r:r+1], beta[r:r+1], state[r:r+1]) for r in range(rows)]
    results["delta_" + name] = {"gap": gap(out, want), "scale": want.float().abs().max().item(),
                                "state_gap": gap(new_state, want_state),
                                "state_scale": want_state.abs().max().item(), "dtype": str(out.dtype),
                                "rows_alone": all(torch.equal(a[0][0], out[r]) and torch.equal(a[1][0], new_state[r])
                                                  for r, a in enumerate(alone)),
                                "in_place": new_in_place is held and torch.equal(new_in_place, new_state)
                                            and torch.equal(out_in_place, out)}

# the kernel set binds these with the Triton elementwise kernels, the PyTorch steps otherwise
triton_set = kernel_set(KernelChoice("torch", "sdpa", elementwise="triton"))
eager_set = kernel_set(KernelChoice("torch", "sdpa"))
results["bound"] = [triton_set.conv_step is conv_step_silu, triton_set.delta_rule_step is delta_rule_step,
                    eager_set.conv_step is ref.torch_causal_conv1d_step,
                    eager_set.delta_rule_step is ref.torch_gated_delta_rule_step]
# generate() through the whole kernel set with the Triton kernels (chains, gated norm, decode steps) against the
# eager set: the same greedy tokens and the last step's logits within fp32 rounding, dense and MoE, rows of two
# prompt lengths (left padding).
import sys
sys.path.insert(0, "tests")
from conftest import tiny_kwargs
from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM, Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM

for kind, model_class, config_class in (("dense", Qwen3_5PackedForCausalLM, Qwen3_5PackedConfig),
                                        ("moe", Qwen3_5MoePackedForCausalLM, Qwen3_5MoePackedConfig)):
    ids = torch.randint(3, tiny_kwargs(kind)["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    runs = {}
    for label, choice in (("triton", KernelChoice("torch", "sdpa", elementwise="triton")),
                          ("eager", KernelChoice("torch", "sdpa"))):
        torch.manual_seed(0)
        model = model_class(config_class(**tiny_kwargs(kind))).eval()
        model.model.inject_kernels(kernel_set(choice))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        runs[label] = (out.sequences, out.logits[-1])
    results["generate_" + kind] = {"same_tokens": torch.equal(runs["triton"][0], runs["eager"][0]),
                                   "last_logits_gap": gap(runs["triton"][1], runs["eager"][1])}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreted(INTERPRETED_CHECKS)


def _tolerance(dtype: str) -> float:
    return {"torch.float32": 1e-5, "torch.bfloat16": 2**-7}[dtype]


@pytest.mark.parametrize("name", ["fp32_k4_one_row", "fp32_k4_channels_past_a_block", "fp32_k2", "bf16_k4"])
def test_conv_step_equals_the_pytorch_step(interpreted, name):
    result = interpreted["conv_" + name]
    assert result["gap"] <= _tolerance(result["dtype"]) * max(result["scale"], 1.0), result
    assert result["state_equal"] and result["rows_alone"], result


@pytest.mark.parametrize("name", ["fp32_one_head", "fp32_grouped_heads", "fp32_qwen_heads", "bf16_qwen_heads"])
def test_delta_rule_step_equals_the_pytorch_step(interpreted, name):
    result = interpreted["delta_" + name]
    assert result["gap"] <= _tolerance(result["dtype"]) * max(result["scale"], 1.0), result
    assert result["state_gap"] <= 1e-5 * max(result["state_scale"], 1.0), result  # the state stays fp32
    assert result["rows_alone"], result
    assert result["in_place"], result  # written into the state it read: the same outputs bit for bit


def test_the_kernel_set_binds_them_with_the_triton_elementwise_kernels(interpreted):
    assert interpreted["bound"] == [True, True, True, True]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_generate_with_the_triton_kernels_equals_the_eager_kernels(interpreted, kind):
    result = interpreted["generate_" + kind]
    assert result["same_tokens"] and result["last_logits_gap"] <= 1e-4, result


def test_bad_shapes_raise():
    x, weight = torch.zeros(2, 8), torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"must be \[B, C\], \[C, K\] and \[B, C, K\]"):
        triton_decode.conv_step_silu(x, weight, torch.zeros(2, 8, 3))
    q = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match=r"state must be fp32 \[B, Hv, Dk, Dv\]"):
        triton_decode.delta_rule_step(q, q, torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 4),
                                      torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16))  # fmt: skip
    with pytest.raises(ValueError, match="must be a multiple of key heads"):
        triton_decode.delta_rule_step(q, q, torch.zeros(2, 3, 8), torch.zeros(2, 3), torch.zeros(2, 3),
                                      torch.zeros(2, 3, 8, 8))  # fmt: skip
