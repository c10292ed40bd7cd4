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
product; every projection of the model is one, and `adopt_adapter_products` turns the low-rank products PEFT adds
around them (its `lora_A` / `lora_B` nn.Linear modules) into row-invariant ones too. `plain_products()` turns the
whole mechanism off for a block of code (plain products everywhere: what the benchmarks use to measure its cost).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_selection import grouped_mm_usable

ROW_INVARIANT = True
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
    Each block's product is written straight into its rows of the result; only the partial block is copied."""
    n = x.shape[0]
    out = x.new_empty((-(-n // rows) * rows, weight.shape[0]))
    for start in range(0, n, rows):
        block = x[start : start + rows]
        if block.shape[0] < rows:
            block = F.pad(block, (0, 0, 0, rows - block.shape[0]))
        torch.mm(block, weight.t(), out=out[start : start + rows])
    return out[:n]


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
    """Within the block every projection is a plain product (cuBLAS on CUDA): not row-invariant, for measuring
    what the invariance costs. Process-wide while it lasts."""
    global ROW_INVARIANT
    saved, ROW_INVARIANT = ROW_INVARIANT, False
    try:
        yield
    finally:
        ROW_INVARIANT = saved


def row_invariant_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (both in the compute dtype), each row's result independent of M (see above)."""
    if not ROW_INVARIANT or is_dtensor(weight):  # tensor parallelism: the sharded product is DTensor's own
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


class RowInvariantProduct(torch.autograd.Function):
    """x [N, in] @ weight^T in `dtype` through `row_invariant_product`. Only the forward decides a token's result,
    so only it needs the invariant kernel: the backward is two plain GEMMs. They run in the forward's `dtype` where
    that is no wider than x (autocast, or fp32 adapter weights on bf16 activations: tensor-core GEMMs with fp32
    accumulation, as autograd through an autocast F.linear computes them); a product widened to fp32 from bf16
    inputs (the router's logits) keeps its backward in the inputs' dtype when both share it, else fp32. It saves x
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
        if ctx.dtype.itemsize <= x.dtype.itemsize:
            dtype = ctx.dtype
        else:
            dtype = x.dtype if x.dtype == weight.dtype else torch.float32
        grad = grad.to(dtype)  # the incoming gradient's dtype is the caller's (bf16 where it cast the logits)
        grad_x = (grad @ weight.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.t() @ x.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through RowInvariantProduct: x [..., in] -> [..., out]. Under autocast the product runs in the
    autocast dtype, as F.linear's would; the bias is added after the product (an elementwise add per row)."""
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
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


class _CastOutsideAutocast:
    """The value of a PEFT LoRA layer's `cast_input_dtype_enabled` (PEFT casts the layer's input to the adapter
    weights' dtype while it is truthy): true outside autocast, where the adapter's products then run in the weights'
    dtype (fp32 for PEFT's default adapters) as PEFT computes them; false under autocast, where they run in the
    autocast dtype whatever the input's dtype, so the cast would only copy every adapted projection's [tokens,
    hidden] input to fp32 and back, and skipping it changes no bit (tests/modeling/test_projection.py)."""

    def __bool__(self) -> bool:
        return not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))

    def __repr__(self) -> str:
        return "cast outside autocast"


CAST_OUTSIDE_AUTOCAST = _CastOutsideAutocast()


def adopt_adapter_products(model: nn.Module) -> None:
    """Turn the plain nn.Linear low-rank products of PEFT's LoRA wrappers in `model` (their `lora_A` / `lora_B`
    module dicts) into RowInvariantLinear: the same parameters and keys, so PEFT saves, merges and unloads them as
    before, and an adapter's rank-r products no longer vary with the row count. The wrappers cast their input to the
    adapter weights' dtype outside autocast only (`CAST_OUTSIDE_AUTOCAST`; a wrapper whose casting is already off
    stays off). PEFT records the adapters it injects in `model.peft_config` (a dict by adapter name, also for
    adapters added later); the modules are walked only when that record changes, so every forward calls this for
    the price of an attribute read."""
    adapters = model.__dict__.get("peft_config")
    key = tuple(adapters) if isinstance(adapters, dict) else None
    if model.__dict__.get("_row_invariant_adapters") == key:
        return
    for module in model.modules():
        for name in ("lora_A", "lora_B"):
            products = module.__dict__["_modules"].get(name)
            if isinstance(products, nn.ModuleDict):
                for product in products.values():
                    if type(product) is nn.Linear:
                        product.__class__ = RowInvariantLinear
                if name == "lora_A" and module.__dict__.get("cast_input_dtype_enabled") is True:
                    module.cast_input_dtype_enabled = CAST_OUTSIDE_AUTOCAST
    model.__dict__["_row_invariant_adapters"] = key
