"""GPU check of the row-invariant product (modeling/projection.py) over row counts: a row's result must not depend on
how many rows share the product, at the projection shapes of Qwen3.5-35B-A3B and Qwen3.5-4B.

For each shape a random input of the largest row count is multiplied once; then every row count from 1 to
SWEEP_ALL, and random counts up to the shape's largest drawn from a seed that changes every run and is printed
(QWEN35_GPU_SEED=N repeats a run), multiply a window of that many rows starting at a random offset; the window's
result must equal the same rows of the full product bit for bit. bf16 runs the one-group grouped GEMM; fp32 (the
router's product, PEFT's default fp32 adapters) the fixed cuBLAS row blocks, which the module docstring says are
invariant as measured, not by construction: this test is that measurement. The plain cuBLAS product is measured
alongside (its differing rows are recorded, not asserted) so the test shows it would catch a plain GEMM at these
shapes. QWEN35_GPU_RESULTS=FILE writes the measured numbers."""

import json
import os
import time

import pytest
import torch

from qwen35_packed.modeling.projection import plain_product, row_invariant_product

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

BASE_SEED = int(os.environ.get("QWEN35_GPU_SEED", time.time_ns() % 1_000_000))
print(f"\nrow counts of this run: QWEN35_GPU_SEED={BASE_SEED}")
SWEEP_ALL = 512
RANDOM_COUNTS = 48
RESULTS: dict = {"base_seed": BASE_SEED, "shapes": []}

# (name, K, N, dtype, largest row count)
SHAPES = (
    ("35b-a3b GDN in_proj_qkv", 2048, 8192, torch.bfloat16, 32768),
    ("35b-a3b GDN out_proj", 4096, 2048, torch.bfloat16, 32768),
    ("35b-a3b attention q + gate", 2048, 8192, torch.bfloat16, 32768),
    ("35b-a3b attention k", 2048, 512, torch.bfloat16, 32768),
    ("35b-a3b shared expert up", 2048, 512, torch.bfloat16, 32768),
    ("35b-a3b shared expert gate", 2048, 1, torch.bfloat16, 32768),
    ("35b-a3b GDN in_proj_a (32 heads)", 2048, 32, torch.bfloat16, 32768),
    ("4b MLP down", 9728, 2560, torch.bfloat16, 32768),
    ("lm_head, vocab 248,320", 2048, 248320, torch.bfloat16, 6144),
    ("LoRA A, r=16, bf16 adapters", 2048, 16, torch.bfloat16, 32768),
    ("LoRA B, r=16, bf16 adapters", 16, 4096, torch.bfloat16, 32768),
    ("35b-a3b router (fp32)", 2048, 256, torch.float32, 32768),
    ("LoRA A, r=16, fp32 adapters", 2048, 16, torch.float32, 32768),
    ("LoRA B, r=16, fp32 adapters", 16, 4096, torch.float32, 32768),
)


def row_counts(largest: int, gen: torch.Generator) -> list[int]:
    drawn = torch.randint(SWEEP_ALL + 1, largest + 1, (RANDOM_COUNTS,), generator=gen).tolist()
    return [*range(1, SWEEP_ALL + 1), *drawn, largest]


@pytest.mark.parametrize("name, k, n, dtype, largest", SHAPES, ids=[s[0] for s in SHAPES])
def test_a_rows_result_does_not_depend_on_the_row_count(name, k, n, dtype, largest):
    index = [s[0] for s in SHAPES].index(name)
    gen = torch.Generator().manual_seed(BASE_SEED + index)
    x = torch.randn(largest, k, generator=gen).to("cuda", dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", dtype)
    full = row_invariant_product(x, weight)
    full_plain = plain_product(x, weight)
    differing, plain_differing = [], []
    for m in row_counts(largest, gen):
        start = int(torch.randint(0, largest - m + 1, (1,), generator=gen))
        window = x[start : start + m]
        if not torch.equal(row_invariant_product(window, weight), full[start : start + m]):
            differing.append(m)
        if not torch.equal(plain_product(window, weight), full_plain[start : start + m]):
            plain_differing.append(m)
    entry = {"shape": name, "k": k, "n": n, "dtype": str(dtype), "seed": BASE_SEED + index,
             "row_counts_tried": SWEEP_ALL + RANDOM_COUNTS + 1, "row_counts_differing": differing,
             "plain_cublas_row_counts_differing": len(plain_differing)}  # fmt: skip
    RESULTS["shapes"].append(entry)
    print(entry)
    if os.environ.get("QWEN35_GPU_RESULTS"):
        with open(os.environ["QWEN35_GPU_RESULTS"], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **RESULTS}, f, indent=2)
    assert not differing, f"{name}: rows differ from the full product at row counts {differing[:20]}"
