"""Debug check for non-finite numbers: which weight, input or layer first holds a NaN or an inf.

Off by default, and free when off: nothing is registered until `enable_numerics_check(model)` (the models expose it
as `model.enable_numerics_check()`). Enabling checks every floating-point parameter and buffer once, then registers
a forward pre-hook on the model (its floating-point inputs, e.g. `inputs_embeds`, `pixel_values`) and a forward
hook on every submodule (its outputs). Hooks run innermost first, so the first non-finite output is reported at the
module that produced it, by its name in the model:

    NonFiniteError: non-finite output of model.layers.3.linear_attn (nan: 12, inf: 0 of 4096 values)

Each check synchronises with the device; this is a debugging mode, not one to train with. `check.remove()` (the
returned handle) removes every hook.
"""

from __future__ import annotations

import torch
from torch import nn


class NonFiniteError(FloatingPointError):
    """A NaN or inf in a weight, an input or a module's output (the message names which)."""


def _count(tensor: torch.Tensor) -> str | None:
    """'nan: a, inf: b of n values' when `tensor` holds a non-finite value, else None."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return None
    nan = int(torch.isnan(tensor).sum())
    return f"nan: {nan}, inf: {int(torch.isinf(tensor).sum())} of {tensor.numel()} values"


def _tensors(value, path: str = ""):
    """(path, tensor) for every tensor inside an output: a tensor, a tuple / list, a dict or ModelOutput."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}[{i}]")
    elif isinstance(value, dict):  # ModelOutput is a dict of its set fields
        for key, item in value.items():
            yield from _tensors(item, f"{path}.{key}" if path else str(key))


class NumericsCheck:
    """The hooks of one enabled check; `remove()` takes them all off."""

    def __init__(self, model: nn.Module):
        self.handles = []
        root = type(model).__name__
        bad = [f"{name} ({counts})" for name, tensor in [*model.named_parameters(), *model.named_buffers()]
               if (counts := _count(tensor.detach())) is not None]  # fmt: skip
        if bad:
            more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
            raise NonFiniteError(f"non-finite weights: {', '.join(bad[:10])}{more}")
        self.handles.append(model.register_forward_pre_hook(self._input_hook(root), with_kwargs=True))
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_hook(self._output_hook(name or root)))

    @staticmethod
    def _input_hook(root: str):
        def check(module, args, kwargs):
            for path, tensor in _tensors({**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}):
                counts = _count(tensor.detach())
                if counts is not None:
                    raise NonFiniteError(f"non-finite input {path} of {root} ({counts})")

        return check

    @staticmethod
    def _output_hook(name: str):
        def check(module, args, output):
            for path, tensor in _tensors(output):
                counts = _count(tensor.detach())
                if counts is not None:
                    where = f" ({path})" if path else ""
                    raise NonFiniteError(f"non-finite output of {name}{where} ({counts})")

        return check

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def enable_numerics_check(model: nn.Module) -> NumericsCheck:
    """Check `model`'s weights now and its inputs and every module's outputs on each forward; raise NonFiniteError
    naming the first non-finite one. Returns the handle whose `remove()` turns the check off."""
    return NumericsCheck(model)


__all__ = ["NonFiniteError", "NumericsCheck", "enable_numerics_check"]
