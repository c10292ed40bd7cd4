"""The Triton GDN short conv (modeling/triton_conv.py) against the boundary-masked PyTorch reference.

Triton's interpreter runs the kernels on CPU tensors when TRITON_INTERPRET=1 is set before they are decorated, so
the checks run in a fresh process with it set and report their measured errors as JSON; the tests below assert on
them. Small block sizes make short streams cover several row programs, backward chunks and channel blocks, with
partial ones at the ends; the default block sizes run too.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_triton_interpreted

pytest.importorskip("triton")

from qwen35_packed.modeling import triton_support  # noqa: E402
from qwen35_packed.modeling.triton_conv import causal_conv1d_silu_split  # noqa: E402

INTERPRETED_CHECKS = r"""
import json, time
from dataclasses import replace

import torch
from qwen35_packed.modeling import kernel_selection, reference_kernels
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.packing import PackedSequence
from qwen35_packed.modeling.triton_conv import ConvBlocks, DEFAULT_BLOCKS, causal_conv1d_silu_split

start = time.perf_counter()
SMALL = ConvBlocks(forward_rows=4, forward_channels=8, forward_warps=1, backward_rows=4, backward_channels=8,
                   backward_chunks=2, backward_warps=1)
results = {}


def positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


def inputs(lengths, channels, kernel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype)
    cotangents = torch.randn(sum(lengths), channels, generator=gen)
    return x, weight, cotangents


def reference(x, weight, pos, cotangent):
    # fp32 reference on the same (rounded) inputs, with autograd's gradients
    x, weight = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    out = reference_kernels.torch_causal_conv1d_varlen(x, weight, pos)
    (out * cotangent).sum().backward()
    return out.detach(), x.grad, weight.grad


def triton_run(x, weight, pos, splits, cotangent, blocks, skip=None):
    # `skip`: index of an output left out of the loss (its gradient reaches the backward as None)
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    outs = causal_conv1d_silu_split(x, weight, pos, splits, blocks)
    pieces = cotangent.split(list(splits), dim=1)
    loss = sum((o.float() * c).sum() for i, (o, c) in enumerate(zip(outs, pieces)) if i != skip)
    loss.backward()
    return outs, x.grad, weight.grad


def errors(lengths, splits, kernel, dtype, blocks, seed, skip=None):
    x, weight, cot = inputs(lengths, sum(splits), kernel, dtype, seed)
    pos = positions(lengths)
    if skip is not None:
        offsets = [0] + torch.tensor(splits).cumsum(0).tolist()
        cot[:, offsets[skip]:offsets[skip + 1]] = 0
    ref_out, ref_dx, ref_dw = reference(x, weight, pos, cot)
    outs, dx, dw = triton_run(x, weight, pos, splits, cot, blocks, skip)
    out = torch.cat(outs, dim=1)
    return {
        "out": (out.float() - ref_out).abs().max().item(),
        # bf16 / fp16: distance to the fp32 reference in units of the output dtype's rounding bound (half an ulp)
        "out_in_half_ulps": ((out.float() - ref_out).abs()
                             / (ref_out.abs() * torch.finfo(dtype).eps / 2).clamp(min=1e-30)).max().item(),
        "dx": (dx.float() - ref_dx).abs().max().item(),
        "dw": (dw.float() - ref_dw).abs().max().item(),
        "dx_rel": ((dx.float() - ref_dx).norm() / ref_dx.norm()).item(),
        "dw_rel": ((dw.float() - ref_dw).norm() / ref_dw.norm()).item(),
        "dtypes": [str(o.dtype) for o in outs] + [str(dx.dtype), str(dw.dtype)],
        "contiguous": all(o.is_contiguous() for o in outs),
        "shapes": [list(o.shape) for o in outs],
    }


mix = [1, 2, 3, 1, 9, 4, 1, 5]  # 1-, 2- and 3-token documents; 26 tokens: not a multiple of any row block
# 4-row tiles write 1 to 4 rows per chunk (K = 4 to 1: the last K-1 rows of a tile are lookahead); a tile of 2 rows
# with K = 4, and K = 6 with 4-row tiles, are raised to the smallest power of two >= K.
for kernel in (4, 3, 2, 1):
    results[f"fp32_small_blocks_k{kernel}"] = errors(mix, [5, 7, 12], kernel, torch.float32, SMALL, seed=kernel)
results["fp32_tile_raised_to_the_kernel"] = errors(mix, [5, 7, 12], 4, torch.float32,
                                                   replace(SMALL, backward_rows=2), seed=5)
results["fp32_kernel_longer_than_the_tile"] = errors(mix, [5, 7, 12], 6, torch.float32, SMALL, seed=6)
results["fp32_default_blocks"] = errors([3, 40, 1, 2, 31], [16, 16, 40], 4, torch.float32, DEFAULT_BLOCKS, seed=7)
results["fp32_eight_row_tiles"] = errors([3, 40, 1, 2, 31], [16, 16, 40], 4, torch.float32,
                                         replace(DEFAULT_BLOCKS, backward_rows=8, backward_chunks=3), seed=16)
results["fp32_single_document"] = errors([37], [8, 8, 16], 4, torch.float32, SMALL, seed=8)
results["fp32_none_gradient_for_k"] = errors(mix, [5, 7, 12], 4, torch.float32, SMALL, seed=9, skip=1)
results["fp32_none_gradient_for_v"] = errors(mix, [5, 7, 12], 4, torch.float32, SMALL, seed=10, skip=2)
results["bf16"] = errors(mix + [17], [8, 8, 16], 4, torch.bfloat16, SMALL, seed=11)
results["fp16"] = errors(mix + [17], [8, 8, 16], 4, torch.float16, SMALL, seed=12)

# Packed == every document alone.
x, weight, _ = inputs(mix, 20, 4, torch.float32, seed=13)
packed = torch.cat(causal_conv1d_silu_split(x, weight, positions(mix), [4, 16], SMALL), dim=1)
worst, begin = 0.0, 0
for n in mix:
    alone = torch.cat(causal_conv1d_silu_split(x[begin:begin + n].contiguous(), weight, torch.arange(n), [4, 16],
                                               SMALL), dim=1)
    worst = max(worst, (alone - packed[begin:begin + n]).abs().max().item())
    begin += n
results["packed_vs_alone"] = worst

# The dispatch with conv="triton" against conv="torch" (q | k | v of a GDN layer).
cu = torch.tensor([0] + torch.tensor(mix).cumsum(0).tolist(), dtype=torch.int32)
stream = PackedSequence(cu, max(mix), None, None, (1, sum(mix)))
x, weight, _ = inputs(mix, 24, 4, torch.float32, seed=14)
got = kernel_set(kernel_selection.KernelChoice("torch", "sdpa", conv="triton")).conv(x, weight, stream, [6, 6, 12])
want = kernel_set(kernel_selection.KernelChoice("torch", "sdpa", conv="torch")).conv(x, weight, stream, [6, 6, 12])
results["dispatch"] = {"max_abs": max((g - w).abs().max().item() for g, w in zip(got, want)),
                       "contiguous": all(g.is_contiguous() for g in got), "shapes": [list(g.shape) for g in got]}
results["seconds"] = time.perf_counter() - start  # for the record: the interpreter runs every program in numpy
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreted(INTERPRETED_CHECKS)


FP32_CASES = [
    "fp32_small_blocks_k4",
    "fp32_small_blocks_k3",
    "fp32_small_blocks_k2",
    "fp32_small_blocks_k1",
    "fp32_tile_raised_to_the_kernel",
    "fp32_kernel_longer_than_the_tile",
    "fp32_default_blocks",
    "fp32_eight_row_tiles",
    "fp32_single_document",
    "fp32_none_gradient_for_k",
    "fp32_none_gradient_for_v",
]


@pytest.mark.parametrize("case", FP32_CASES)
def test_fp32_outputs_and_gradients_match_the_reference(interpreted, case):
    result = interpreted[case]
    assert result["out"] <= 1e-5 and result["dx"] <= 1e-5 and result["dw"] <= 1e-5, result
    assert result["contiguous"] and result["dtypes"] == ["torch.float32"] * 5, result


def test_outputs_have_the_split_shapes(interpreted):
    assert interpreted["fp32_small_blocks_k4"]["shapes"] == [[26, 5], [26, 7], [26, 12]]
    assert interpreted["fp32_default_blocks"]["shapes"] == [[77, 16], [77, 16], [77, 40]]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_forward_is_the_rounded_fp32_result(interpreted, dtype):
    # Accumulated in fp32 and rounded once: within half an ulp of the fp32 reference (plus fp32 summation-order
    # noise, far below that); gradients in the input dtype, close to the fp32 reference's. Triton 3.6's interpreter
    # converts fp32 to bf16 by truncation (under an ulp; fp16 it rounds to nearest), where compiled kernels round to
    # nearest even: the bound here is one ulp for bf16; tests/gpu/test_gpu.py checks half an ulp on the GPU.
    result = interpreted[dtype]
    assert result["out_in_half_ulps"] <= {"bf16": 2.02, "fp16": 1.01}[dtype], result
    name = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    assert result["dtypes"] == [name] * 5 and result["contiguous"], result
    assert result["dx_rel"] <= 1e-2 and result["dw_rel"] <= 1e-2, result


def test_packed_equals_each_document_alone(interpreted):
    assert interpreted["packed_vs_alone"] <= 1e-6


def test_dispatch_returns_contiguous_splits_equal_to_the_torch_path(interpreted):
    result = interpreted["dispatch"]
    assert result["max_abs"] <= 1e-5 and result["contiguous"], result
    assert result["shapes"] == [[26, 6], [26, 6], [26, 12]]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x, w, p: (x.t(), w, p, [4, 4]), "x must be contiguous"),
        (lambda x, w, p: (x[None], w, p, [4, 8]), r"x must be \[N, C\]"),
        (lambda x, w, p: (x.long(), w, p, [4, 8]), r"x must be \[N, C\]"),
        (lambda x, w, p: (x, w[:4], p, [4, 8]), "weight must be"),
        (lambda x, w, p: (x, w, p[:5], [4, 8]), "position_in_doc must be"),
        (lambda x, w, p: (x, w, p.float(), [4, 8]), "position_in_doc must be"),
        (lambda x, w, p: (x, w, p, [4, 4]), "must be positive and sum to C=12"),
        (lambda x, w, p: (x, w, p, [0, 12]), "must be positive and sum to C=12"),
    ],
)
def test_bad_inputs_raise(make, match):
    x, w, p = torch.randn(8, 12), torch.randn(12, 4), torch.arange(8)
    with pytest.raises(ValueError, match=match):
        causal_conv1d_silu_split(*make(x, w, p))


@pytest.mark.skipif(triton_support.INTERPRETED, reason="kernels interpreted in this process (TRITON_INTERPRET=1)")
def test_cpu_tensors_need_the_interpreter():
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        causal_conv1d_silu_split(torch.randn(8, 12), torch.randn(12, 4), torch.arange(8), [4, 8])
