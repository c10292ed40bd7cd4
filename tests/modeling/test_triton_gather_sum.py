"""The Triton top-k combine (modeling/triton_gather_sum.py) against the eager gather and sum.

Triton's interpreter runs the kernel on CPU tensors when TRITON_INTERPRET=1 is set before it is decorated, so the
checks run in a fresh process with it set and report as JSON; the tests below assert on them. The reference is the
in-order fp32 sum of each group's rows, rounded once: the kernel must equal it bit for bit. (Triton's interpreter
converts fp32 to bf16 by truncation, compiled kernels round to nearest even: interpreted, a bf16 result equals the
truncated sum; tests/gpu/test_gpu.py checks the rounded one on the GPU.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_triton_interpreted

pytest.importorskip("triton")

from qwen35_packed.modeling import triton_support  # noqa: E402
from qwen35_packed.modeling.triton_gather_sum import DEFAULT_BLOCKS, gather_sum_rows  # noqa: E402

INTERPRETED_CHECKS = r"""
import json
import torch
from qwen35_packed.modeling import kernel_selection
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.triton_gather_sum import GatherSumBlocks, gather_sum_rows

SMALL = GatherSumBlocks(groups=2, columns=8, warps=1)
results = {}


def in_order(src, index, group):
    rows = src[index].float().view(-1, group, src.shape[1])
    acc = torch.zeros(rows.shape[0], rows.shape[2])
    for slot in range(group):
        acc = acc + rows[:, slot]
    return acc


def truncated_to_bf16(x):
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def case(n_src, width, group, n_groups, dtype, blocks, seed, index_dtype=torch.int64, repeats=False):
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(n_src, width, generator=gen) * 10).to(dtype)
    if repeats:
        index = torch.randint(0, n_src, (n_groups * group,), generator=gen)
    else:
        index = torch.randperm(n_src, generator=gen)[: n_groups * group]
    index = index.to(index_dtype)
    out = gather_sum_rows(src, index, group, blocks)
    eager = src[index.long()].view(-1, group, width).sum(dim=1)
    reference = in_order(src, index.long(), group)
    return {
        "bitwise_in_order": torch.equal(out, reference.to(dtype)),
        "bitwise_in_order_truncated": dtype == torch.bfloat16 and torch.equal(out, truncated_to_bf16(reference)),
        "max_abs_vs_eager": (out.float() - eager.float()).abs().max().item() if out.numel() else 0.0,
        "scale": eager.float().abs().max().item() if out.numel() else 0.0,
        "dtype": str(out.dtype),
        "shape": list(out.shape),
    }


# Partial blocks in both directions (7 groups in blocks of 2, 20 columns in blocks of 8), every group size the
# configs use and 1; the default blocks; int32 indices; repeated rows (the transposed gather of the expand reads
# each token row k times); no group at all.
results["fp32_k8"] = case(64, 20, 8, 7, torch.float32, SMALL, 0)
results["fp32_k1"] = case(30, 20, 1, 30, torch.float32, SMALL, 1)
results["fp32_k3"] = case(40, 9, 3, 11, torch.float32, SMALL, 2)
results["bf16_k8"] = case(64, 20, 8, 7, torch.bfloat16, SMALL, 3)
results["fp16_k8"] = case(64, 20, 8, 7, torch.float16, SMALL, 4)
results["bf16_default_blocks"] = case(96, 600, 8, 12, torch.bfloat16, GatherSumBlocks(), 5)
results["int32_index"] = case(64, 20, 8, 7, torch.float32, SMALL, 6, index_dtype=torch.int32)
results["repeated_rows"] = case(10, 20, 4, 9, torch.float32, SMALL, 7, repeats=True)
results["no_groups"] = case(10, 20, 8, 0, torch.float32, SMALL, 8)

# A group's sum does not depend on the other groups: any slice of groups gives the same rows.
gen = torch.Generator().manual_seed(9)
src = torch.randn(96, 40, generator=gen).to(torch.bfloat16) * 10
index = torch.randperm(96, generator=gen)
full = gather_sum_rows(src, index, 8, SMALL)
results["slices_equal"] = all(
    torch.equal(gather_sum_rows(src, index[a * 8 : b * 8], 8, SMALL), full[a:b]) for a, b in ((0, 1), (1, 4), (4, 12))
)

# Rows in two parts (the down product and its adapter's): each row's parts summed in their dtype, then combined.
def case_addend(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    src, addend = ((torch.randn(64, 20, generator=gen) * 10).to(dtype) for _ in range(2))
    index = torch.randperm(64, generator=gen)[:56]
    out = gather_sum_rows(src, index, 8, SMALL, addend=addend)
    exact = in_order(src.float() + addend.float(), index, 8)  # fp32: the sum of two fp32 rows is what fp32 adds
    truncated = in_order(truncated_to_bf16(src.float() + addend.float()), index, 8)
    return {
        "bitwise": torch.equal(out, exact) if dtype == torch.float32 else torch.equal(out, truncated_to_bf16(truncated)),
        "dtype": str(out.dtype),
    }


results["addend_fp32"] = case_addend(torch.float32, 10)
results["addend_bf16"] = case_addend(torch.bfloat16, 11)

# The kernel set's combine with combine="triton" against combine="eager".
triton_combine = kernel_set(kernel_selection.KernelChoice("torch", "sdpa", moe="grouped_mm", combine="triton")).combine
eager_combine = kernel_set(kernel_selection.KernelChoice("torch", "sdpa", moe="grouped_mm", combine="eager")).combine
src = torch.randn(48, 24, generator=gen)
index = torch.randperm(48, generator=gen)
got, want = triton_combine(src, index, 8), eager_combine(src, index, 8)
results["dispatch_max_abs"] = (got - want).abs().max().item()
addend = torch.randn(48, 24, generator=gen)
got, want = triton_combine(src, index, 8, addend), eager_combine(src, index, 8, addend)
results["dispatch_addend_max_abs"] = (got - want).abs().max().item()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreted(INTERPRETED_CHECKS)


CASES = {
    "fp32_k8": ("torch.float32", [7, 20]),
    "fp32_k1": ("torch.float32", [30, 20]),
    "fp32_k3": ("torch.float32", [11, 9]),
    "bf16_k8": ("torch.bfloat16", [7, 20]),
    "fp16_k8": ("torch.float16", [7, 20]),
    "bf16_default_blocks": ("torch.bfloat16", [12, 600]),
    "int32_index": ("torch.float32", [7, 20]),
    "repeated_rows": ("torch.float32", [9, 20]),
    "no_groups": ("torch.float32", [0, 20]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_the_in_order_fp32_sum_rounded_once(interpreted, name):
    result = interpreted[name]
    assert result["bitwise_in_order"] or result["bitwise_in_order_truncated"], result
    assert [result["dtype"], result["shape"]] == list(CASES[name]), result
    # against the eager reduction (its own summation order): within one rounding of the output dtype
    eps = {"torch.float32": 1e-6, "torch.bfloat16": 2**-7, "torch.float16": 2**-10}[result["dtype"]]
    assert result["max_abs_vs_eager"] <= eps * max(result["scale"], 1.0), result


def test_a_groups_sum_does_not_depend_on_the_other_groups(interpreted):
    assert interpreted["slices_equal"] is True


def test_dispatch_equals_the_eager_combine(interpreted):
    assert interpreted["dispatch_max_abs"] <= 1e-5
    assert interpreted["dispatch_addend_max_abs"] <= 1e-5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rows_in_two_parts_are_summed_as_their_own_add_then_combined(interpreted, dtype):
    """Each row is src + addend rounded to their dtype (as the add the kernel replaces), then the in-order sum."""
    result = interpreted[f"addend_{dtype}"]
    assert result["bitwise"] is True, result


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda s, i: (s.t(), i, 8), "src must be contiguous"),
        (lambda s, i: (s[None], i, 8), r"src must be \[M, H\]"),
        (lambda s, i: (s.long(), i, 8), r"src must be \[M, H\]"),
        (lambda s, i: (s, i[:5], 8), "index must be an integer tensor"),
        (lambda s, i: (s, i.float(), 8), "index must be an integer tensor"),
        (lambda s, i: (s, i, 0), "index must be an integer tensor"),
        (lambda s, i: (s, i, 8, DEFAULT_BLOCKS, s[:8]), "addend must match src"),
        (lambda s, i: (s, i, 8, DEFAULT_BLOCKS, s.double()), r"addend must be \[M, H\]"),
        (lambda s, i: (s, i, 8, DEFAULT_BLOCKS, s.t()), "addend must be contiguous"),
    ],
)
def test_bad_inputs_raise(make, match):
    src, index = torch.randn(16, 16), torch.randperm(16)
    with pytest.raises(ValueError, match=match):
        gather_sum_rows(*make(src, index))


@pytest.mark.skipif(triton_support.INTERPRETED, reason="kernel interpreted in this process (TRITON_INTERPRET=1)")
def test_cpu_tensors_need_the_interpreter():
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        gather_sum_rows(torch.randn(16, 16), torch.randperm(16), 8)
