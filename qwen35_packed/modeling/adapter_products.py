"""PEFT's LoRA on the model's projections: row-invariant products, and the adapter's sum taken in place.

PEFT wraps each targeted projection (a `RowInvariantLinear`) in its LoRA `Linear`, whose forward computes
`base(x) + lora_B(lora_A(dropout(x))) * scaling`. Two things are done to those wrappers, both by
`adopt_adapter_products` on the model's first forward after PEFT injected adapters:

* Their `lora_A` / `lora_B` products become `RowInvariantLinear` too (same parameters and keys, so PEFT saves,
  merges and unloads them as before): a rank-r product must not vary with the row count either.
* Their class gains `RowInvariantLoraForward`, which computes a plain adapter (one active adapter, no LoRA variant
  such as DoRA, no bias on lora_B, computed in the base product's dtype) through `AdapterSumProduct`:
  - forward: the base product, the two rank-r products, then `out.add_(lora_out, alpha=scaling)`: one pass over the
    [tokens, out] result where PEFT's `* scaling` and `+` make two, each into a new tensor. With a power-of-two
    scaling (PEFT's alpha = 2r, rsLoRA at r = 4^k) the output is PEFT's bit for bit: scaling such a product is exact.
  - backward: the input's gradient `g @ W` takes the adapter's `grad_h @ A` in place (`addmm_`) where PEFT's path
    writes a second [tokens, in] gradient and autograd adds the two; the scaling is applied to the rank-r
    gradient, not to the [tokens, out] one.
  Anything else (several active adapters, a variant, per-request `adapter_names`, fp32 adapters outside autocast on
  a bf16 model, where PEFT computes the adapter in fp32; products whose call does more than their forward: hooks,
  Accelerate's offloading, DeepSpeed ZeRO-3 or DTensor weights) runs PEFT's own forward, and the reason is logged
  once per process.
  `peft_adapter_sums()` turns the in-place sum off for a block of code (what the benchmarks compare against).

Not done, on purpose: concatenating the adapter into the base GEMM. Stacking A under W ([W; A], one GEMM giving
[y | h]) leaves y a strided view that the next op copies; stacking along K ([x | h] @ [W | s B]^T, the sum inside
the GEMM's accumulator) copies the input and the weight at every call, decode steps included, and rounds the sum
differently from PEFT's. The in-place sum keeps PEFT's numbers and copies nothing.

PEFT casts a LoRA layer's input to the adapter weights' dtype while its `cast_input_dtype_enabled` is truthy; the
wrappers get `CAST_OUTSIDE_AUTOCAST`: under autocast the adapter's products run in the autocast dtype whatever the
input's dtype, so that cast would only copy every adapted projection's input to fp32 and back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
from torch import nn

from .projection import RowInvariantLinear, backward_dtype, is_dtensor, matmul_dtype, row_invariant_product
from .utils import log_once

logger = logging.getLogger(__name__)

ADAPTER_SUM_IN_PLACE = True


@contextlib.contextmanager
def peft_adapter_sums() -> Iterator[None]:
    """Within the block PEFT's LoRA wrappers run PEFT's own forward (their products still row-invariant): for
    measuring what the in-place sum saves. Process-wide while it lasts."""
    global ADAPTER_SUM_IN_PLACE
    saved, ADAPTER_SUM_IN_PLACE = ADAPTER_SUM_IN_PLACE, False
    try:
        yield
    finally:
        ADAPTER_SUM_IN_PLACE = saved


def _adapter_sum(x, adapter_input, weight, lora_a, lora_b, scaling: float, dtype: torch.dtype):
    """x W^T + scaling * (a A^T) B^T in `dtype` for 2-D x and adapter input a; returns the sum and a A^T."""
    out = row_invariant_product(x.to(dtype), weight.to(dtype))
    low = row_invariant_product(adapter_input.to(dtype), lora_a.to(dtype))
    out.add_(row_invariant_product(low, lora_b.to(dtype)), alpha=scaling)
    return out, low


class AdapterSumProduct(torch.autograd.Function):
    """`_adapter_sum` with its gradients. `adapter_input` is None when the adapter reads x itself (no dropout); the
    input's two gradients then meet in one buffer. x itself is saved, not a cast copy, so an activation recomputed
    in the backward (recompute.py) is known by its identity. The backward's GEMMs run in `backward_dtype`, as
    RowInvariantProduct's do."""

    @staticmethod
    def forward(ctx, x, adapter_input, weight, lora_a, lora_b, scaling, dtype):
        out, low = _adapter_sum(
            x, x if adapter_input is None else adapter_input, weight, lora_a, lora_b, scaling, dtype
        )
        ctx.save_for_backward(x, adapter_input, weight, lora_a, lora_b, low)
        ctx.scaling, ctx.dtype = scaling, dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x, adapter_input, weight, lora_a, lora_b, low = ctx.saved_tensors
        needs_x, needs_input, needs_weight, needs_a, needs_b = ctx.needs_input_grad[:5]
        dtype = backward_dtype(ctx.dtype, x, weight)
        grad = grad.to(dtype)
        a = x if adapter_input is None else adapter_input
        grad_low = (grad @ lora_b.to(dtype)) * ctx.scaling
        grad_x = grad_input = None
        if needs_x:
            grad_x = grad @ weight.to(dtype)
            if adapter_input is None:
                grad_x.addmm_(grad_low, lora_a.to(dtype))
            grad_x = grad_x.to(x.dtype)
        if needs_input:
            grad_input = (grad_low @ lora_a.to(dtype)).to(adapter_input.dtype)
        grad_weight = (grad.t() @ x.to(dtype)).to(weight.dtype) if needs_weight else None
        grad_a = (grad_low.t() @ a.to(dtype)).to(lora_a.dtype) if needs_a else None
        grad_b = ((grad.t() @ low.to(dtype)) * ctx.scaling).to(lora_b.dtype) if needs_b else None
        return grad_x, grad_input, grad_weight, grad_a, grad_b, None, None


def adapter_sum_linear(x, adapter_input, weight, lora_a, lora_b, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """x [..., in] -> [..., out]: `AdapterSumProduct` on the rows of x (the Function's forward alone when autograd
    records nothing)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if adapter_input is not None and adapter_input.dim() != 2:
        adapter_input = adapter_input.reshape(-1, adapter_input.shape[-1])
    tensors = (x, adapter_input, weight, lora_a, lora_b)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        out = AdapterSumProduct.apply(rows, adapter_input, weight, lora_a, lora_b, scaling, dtype)
    else:
        out, _ = _adapter_sum(rows, rows if adapter_input is None else adapter_input, weight, lora_a, lora_b, scaling, dtype)  # fmt: skip
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])


def _compute_dtype(layer: nn.Module, x: torch.Tensor, adapter_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype PEFT's path computes both the base and the adapter products in, or None where they differ (fp32
    adapters on a bf16 input outside autocast, with PEFT's input cast on: PEFT then runs the adapter in fp32)."""
    dtype = matmul_dtype(x)
    if not torch.is_autocast_enabled(x.device.type) and adapter_dtype != x.dtype and layer.cast_input_dtype_enabled:
        return None
    return dtype


class RowInvariantLoraForward:
    """Mixed in front of PEFT's LoRA `Linear` class (by `adopt_adapter_products`): the forward of a plain adapter
    through `adapter_sum_linear`, PEFT's own forward for everything else (module docstring). Where an active adapter
    takes PEFT's forward, the reason is logged once per process: the numbers are PEFT's, the step slower."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            plan, reason = None, "a forward with extra arguments (PEFT's per-request adapter_names)"
        elif not ADAPTER_SUM_IN_PLACE:
            plan, reason = None, None  # peft_adapter_sums(): asked for
        else:
            plan, reason = self._plain_adapter(x)
        if plan is None:
            if reason is not None:
                log_once(logger, ("peft_lora_forward", reason), "PEFT's own LoRA forward runs for %s: PEFT's numbers, "
                         "without the in-place adapter sum (slower, more memory)", reason)  # fmt: skip
            return super().forward(x, *args, **kwargs)
        return adapter_sum_linear(x, *plan)

    def _plain_adapter(self, x: torch.Tensor) -> tuple[tuple | None, str | None]:
        """(the arguments of `adapter_sum_linear`, None), or (None, why PEFT's forward runs instead; None where the
        caller asked for it, adapters disabled or merged, or no active adapter is on this projection)."""
        if self.disable_adapters or self.merged:
            return None, None
        names = [name for name in self.active_adapters if name in self.lora_A]
        if not names:  # no active adapter on this projection: PEFT's forward is the base product
            return None, None
        if len(names) != 1 or names[0] in self.lora_variant:
            return None, "several active adapters or a LoRA variant (DoRA and the like)"
        (name,) = names
        base, lora_a, lora_b = self.base_layer, self.lora_A[name], self.lora_B[name]
        if base.bias is not None or lora_b.bias is not None:
            return None, "a bias on the projection or on lora_B"
        if any(_runs_more_than_its_forward(m) for m in (base, lora_a, lora_b)):
            return None, "projections whose call runs hooks (FSDP2, DeepSpeed, a user's) or Accelerate's offloading"
        weights = (base.weight, lora_a.weight, lora_b.weight)
        if any(is_dtensor(w) or hasattr(w, "ds_id") for w in weights):
            return None, "distributed weights (DTensor, DeepSpeed ZeRO-3)"
        dtype = _compute_dtype(self, x, lora_a.weight.dtype)
        if dtype is None:
            return None, (
                f"{_name(lora_a.weight.dtype)} adapters on a {_name(x.dtype)} input outside autocast (PEFT computes "
                f"them in {_name(lora_a.weight.dtype)}; under bf16 autocast, TRL's bf16=True, or with adapters in the "
                "model's dtype, get_peft_model(..., autocast_adapter_dtype=False), the sum is taken in place)"
            )
        dropout = self.lora_dropout[name]
        adapter_input = None if isinstance(dropout, nn.Identity) else dropout(x)
        return (adapter_input, *weights, self.scaling[name], dtype), None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _runs_more_than_its_forward(module: nn.Module) -> bool:
    """Whether calling `module` runs more than its forward: hooks (FSDP2 or DeepSpeed gathering its weights, a user's),
    or a forward Accelerate replaced to move the weights (offloading). The in-place sum reads the weights without
    calling the module, so it leaves such modules to PEFT's forward, which calls them."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
        or getattr(module, "_hf_hook", None) is not None
    )  # fmt: skip


@functools.cache
def _with_adapter_sum(cls: type) -> type:
    """PEFT's wrapper class `cls` with `RowInvariantLoraForward` in front (one class per wrapper class; isinstance
    checks against PEFT's classes still hold)."""
    return type(
        cls.__name__, (RowInvariantLoraForward, cls), {"__module__": __name__, "__qualname__": cls.__qualname__}
    )


class _CastOutsideAutocast:
    """The value of a PEFT LoRA layer's `cast_input_dtype_enabled`: true outside autocast, where the adapter's
    products then run in the weights' dtype (fp32 for PEFT's default adapters) as PEFT computes them; false under
    autocast, where skipping the cast changes no bit (tests/modeling/test_adapter_products.py)."""

    def __bool__(self) -> bool:
        return not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))

    def __repr__(self) -> str:
        return "cast outside autocast"


CAST_OUTSIDE_AUTOCAST = _CastOutsideAutocast()


def adopt_adapter_products(model: nn.Module) -> None:
    """Adopt the PEFT LoRA wrappers in `model` (module docstring): their `lora_A` / `lora_B` nn.Linear products
    become RowInvariantLinear; a wrapper of a RowInvariantLinear gets the in-place adapter sum; a wrapper casts its
    input outside autocast only (`CAST_OUTSIDE_AUTOCAST`; one whose casting is already off stays off). PEFT records
    the adapters it injects in `model.peft_config` (a dict by adapter name, also for adapters added later); the
    modules are walked only when that record changes, so every forward calls this for the price of a few attribute
    reads. The record is compared by its configs' identity, not their names or values: `unload()` and a new
    `get_peft_model` with the same config inject new wrappers under the same name "default"."""
    adapters = model.__dict__.get("peft_config")
    key = tuple(adapters.items()) if isinstance(adapters, dict) else ()
    seen = model.__dict__.get("_row_invariant_adapters")
    if seen is not None and len(seen) == len(key) and all(n == m and c is d for (n, c), (m, d) in zip(seen, key)):
        return
    for module in model.modules():
        modules = module.__dict__["_modules"]
        for name in ("lora_A", "lora_B"):
            products = modules.get(name)
            if isinstance(products, nn.ModuleDict):
                for product in products.values():
                    if type(product) is nn.Linear:
                        product.__class__ = RowInvariantLinear
                if name == "lora_A" and module.__dict__.get("cast_input_dtype_enabled") is True:
                    module.cast_input_dtype_enabled = CAST_OUTSIDE_AUTOCAST
        wraps_projection = isinstance(modules.get("base_layer"), RowInvariantLinear)
        if wraps_projection and isinstance(modules.get("lora_A"), nn.ModuleDict):
            if not isinstance(module, RowInvariantLoraForward):
                module.__class__ = _with_adapter_sum(type(module))
    model.__dict__["_row_invariant_adapters"] = key
