"""Row-invariant projections: a token's x @ W^T does not depend on how many tokens share the product.

Why: a document packed with others must get the logits it gets alone, bit for bit. cuBLAS chooses its GEMM
algorithm (tile shape, split-K, stream-K) by the whole shape, the row count included, and split-K / stream-K change
the order in which a row's products are summed: the same row rounded differently alone than packed, and through
40 layers a near-tie MoE route flipped (docs/guarantees.md).

How, by device and dtype (`row_invariant_product`, resolved once per (device, dtype)):

* CUDA, bf16, where torch's grouped GEMM runs (Hopper, Blackwell): `torch._grouped_mm` with one group. It is a
  CUTLASS kernel with a persistent group tile scheduler: every output tile is computed by one thread block over the
  whole K loop, in k order, with no split-K or stream-K; the row count only picks the tile shape (64 x 128 x 128
  for groups of at most 128 rows, else 128 x 256 x 64, PyTorch's GroupMM.cu), which changes which block computes
  an element but not the order of its sum (the tensor-core instruction's k-16 steps run in sequence into one fp32
  accumulator either way; the epilogue rounds that accumulator once). Shapes whose K or N is not a multiple of 8
  (the grouped GEMM's 16-byte alignment) are padded with zero columns / rows, which add exact zeros.
* CUDA otherwise (fp32, fp16, or no grouped GEMM): fixed blocks of CUDA_ROW_BLOCK rows through cuBLAS, the last
  one zero-padded, so every row goes through a GEMM of one shape. Invariant as measured (tests/gpu/), not by
  construction: cuBLAS may pick stream-K for that shape, whose partition differs between tiles.
* CPU: the same fixed blocks, of CPU_ROW_BLOCK rows (the CPU BLAS, too, rounds some rows of one plain product
  differently by the row count; small blocks keep the padding of short inputs cheap).

Only the forward decides a token's result: the backward is two plain GEMMs (`RowInvariantProduct`).

`RowInvariantLinear` is an nn.Linear (same parameters, state-dict keys and PEFT targets) whose forward runs that
product; every projection of the model is one, and the low-rank products PEFT adds around them become row-invariant
too (adapter_products.py). `plain_products()` turns the whole mechanism off for a block of code: a generation step
with one new token per row runs in one (`run_layers`), and the benchmarks use it to measure what the invariance costs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_selection import grouped_mm_usable

# Off within plain_products(): a context variable, so a block in one thread leaves the products of another thread (a
# model training there) row-invariant.
_ROW_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar("row_invariant_products", default=True)
CUDA_ROW_BLOCK = 2048
CPU_ROW_BLOCK = 64
_ALIGN = 8  # the grouped GEMM's 16-byte alignment of K and N, in bf16 elements


def plain_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


def grouped_mm_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T as a one-group grouped GEMM (bf16, CUDA)."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        return x.new_empty((0, n))
    pad_k, pad_n = -k % _ALIGN, -n % _ALIGN
    if pad_k:
        x = F.pad(x, (0, pad_k))
    if pad_k or pad_n:
        weight = F.pad(weight, (0, pad_k, 0, pad_n))
    out = torch._grouped_mm(x.contiguous()[None], weight.t()[None])[0]
    return out[:, :n] if pad_n else out


def row_block_product(x: torch.Tensor, weight: torch.Tensor, rows: int = CUDA_ROW_BLOCK) -> torch.Tensor:
    """x [M, K] @ weight^T over blocks of `rows` rows, the last one zero-padded: every block is one GEMM shape.
    Each whole block's product is written straight into its rows of the result; only the partial block's goes
    through a padded buffer, so the result owns exactly its M rows (a tensor autograd saves holds no padding)."""
    n = x.shape[0]
    out = x.new_empty((n, weight.shape[0]))
    whole = n - n % rows
    for start in range(0, whole, rows):
        torch.mm(x[start : start + rows], weight.t(), out=out[start : start + rows])
    if whole < n:  # out= products are not autocast: every block is computed in x's dtype
        tail = x.new_empty((rows, weight.shape[0]))
        torch.mm(F.pad(x[whole:], (0, 0, 0, rows - (n - whole))), weight.t(), out=tail)
        out[whole:] = tail[: n - whole]
    return out


@functools.cache
def _product_for(device_type: str, device_index, dtype: torch.dtype) -> Callable:
    if device_type != "cuda":
        return functools.partial(row_block_product, rows=CPU_ROW_BLOCK)
    device = torch.device(device_type, device_index)
    if dtype == torch.bfloat16 and grouped_mm_usable(device, dtype):
        return grouped_mm_product
    return row_block_product


@contextlib.contextmanager
def plain_products() -> Iterator[None]:
    """Within the block, in this thread, every projection is a plain product (cuBLAS on CUDA): not row-invariant.

    Where: a generation step with one new token per row (`run_layers`). Its rows' bits are no training result: a
    trainer scores the completions with its own forward, whose products stay invariant. And a decode step has a few
    rows, where the invariant product (no split-K) leaves most of the GPU without an output tile while the step reads
    every weight. Also the benchmarks' measure of what the invariance costs. Not in a backward: autograd's threads
    do not see the block (the backward products are plain anyway; a checkpointed forward reruns invariant)."""
    token = _ROW_INVARIANT.set(False)
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


def row_invariant_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (both in the compute dtype), each row's result independent of M (see above)."""
    if not _ROW_INVARIANT.get() or is_dtensor(weight):  # tensor parallelism: the sharded product is DTensor's own
        return plain_product(x, weight)
    return _product_for(x.device.type, x.device.index, x.dtype)(x, weight)


@functools.cache
def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(weight: torch.Tensor) -> bool:
    """Whether `weight` is a DTensor (sharded by FSDP2 or a tensor-parallel plan)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(weight, dtensor)


def backward_dtype(dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of a product's backward GEMMs: its forward's `dtype` where that is no wider than x; a product
    widened to fp32 from narrower inputs keeps its backward in the inputs' dtype when both share it, else fp32."""
    if dtype.itemsize <= x.dtype.itemsize:
        return dtype
    return x.dtype if x.dtype == weight.dtype else torch.float32


class RowInvariantProduct(torch.autograd.Function):
    """x [N, in] @ weight^T in `dtype` through `row_invariant_product`. Only the forward decides a token's result,
    so only it needs the invariant kernel: the backward is two plain GEMMs, in `backward_dtype` (the forward's dtype
    under autocast or for fp32 adapter weights on bf16 activations: tensor-core GEMMs with fp32 accumulation, as
    autograd through an autocast F.linear computes them; the inputs' dtype for the router's widened logits). It saves x
    itself, not a cast copy, so an activation recomputed in the backward (recompute.py) is known by its
    identity."""

    @staticmethod
    def forward(ctx, x, weight, dtype):
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        return row_invariant_product(x.to(dtype), weight.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dtype = backward_dtype(ctx.dtype, x, weight)
        grad = grad.to(dtype)  # the incoming gradient's dtype is the caller's (bf16 where it cast the logits)
        grad_x = (grad @ weight.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.t() @ x.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `x @ weight.T` computes in: autocast's when it is on for x's device (mm is autocast-eligible on CPU
    and CUDA), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through RowInvariantProduct: x [..., in] -> [..., out]. Under autocast the product runs in the
    autocast dtype, as F.linear's would; the bias is added after the product (an elementwise add per row)."""
    dtype = matmul_dtype(x)
    # the tensor itself when 2-D: a recomputed activation (recompute.py) is known by its identity
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = RowInvariantProduct.apply(rows, weight, dtype)
    else:  # nothing for autograd to record (generation, eval): the Function's forward without its bookkeeping
        out = row_invariant_product(rows.to(dtype), weight.to(dtype))
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


class RowInvariantLinear(nn.Linear):
    """An nn.Linear (same parameters, state-dict keys, PEFT LoRA target) whose forward is `row_invariant_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, self.weight, self.bias)
