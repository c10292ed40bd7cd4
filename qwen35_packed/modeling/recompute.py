"""Activations recomputed in the backward instead of kept from the forward.

A linear layer keeps its input for its weight gradient. When that input is the output of a cheap elementwise chain
(an RMSNorm, SwiGLU, the GDN gated norm, the attention output gate) whose own backward keeps the chain's inputs
anyway, keeping the output as well is a second [tokens x features] tensor per layer for nothing: the backward can
rerun the chain on the inputs it already holds. On the 1.4B benchmark config that is most of a training step's
activation memory outside the matmul outputs.

How: while a training forward runs, `RecomputedActivations` is installed as autograd's saved-tensors hook.
Producers call `remember(output, fn, *inputs)`. When autograd saves exactly that tensor object, unchanged since it
was produced, the hook stores the recipe (fn and inputs) instead; the first backward node that needs it reruns fn,
and every other node that saved the same tensor shares that result. The rerun uses the grad mode and the
requires_grad flags of the forward, so a compiled chain runs the same compiled graph: gradients are bitwise those
of keeping the tensor (tests/modeling/test_recompute.py). A recipe whose inputs were modified in place after the forward
raises, as autograd does for saved tensors. Everything else autograd saves is kept as it is, detached from its
graph (see `_pack`), so a forward that never reaches its backward frees its activations.

`recompute_enabled()` says when to install it: autograd recording, no saved-tensors hooks already active around the
forward (a caller's `save_on_cpu()`, offloading or checkpointing of the whole call keep deciding about every saved
tensor, as without this module: the innermost hooks would silently replace theirs), and not inside a graph that
torch.compile traces as a whole (`torch.compile(model)`), which plans its own saved tensors. Gradient
checkpointing of the decoder layers installs its own hooks inside and takes precedence.
"""

from __future__ import annotations

import threading
import weakref

import torch

_active = threading.local()


class _Recipe:
    """fn(*inputs) as it was computed in the forward; materialised once, shared by every node that saved it."""

    __slots__ = ("fn", "inputs", "versions", "grad_flags", "result")

    def __init__(self, fn, inputs):
        self.fn = fn
        self.inputs = inputs
        self.versions = tuple(a._version if isinstance(a, torch.Tensor) else None for a in inputs)
        self.grad_flags = tuple(a.requires_grad if isinstance(a, torch.Tensor) else None for a in inputs)
        self.result = None

    def materialise(self) -> torch.Tensor:
        if self.result is None:
            for a, version in zip(self.inputs, self.versions):
                if isinstance(a, torch.Tensor) and a._version != version:
                    raise RuntimeError(
                        "an input of a recomputed activation was modified in place after the forward "
                        f"(version {version} -> {a._version}); the backward cannot recompute it"
                    )
            args = [
                a.detach().requires_grad_(flag) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a, flag in zip(self.inputs, self.grad_flags)
            ]
            with torch.enable_grad():
                self.result = self.fn(*args).detach()
        return self.result


class RecomputedActivations:
    """Context manager: saved-tensors hooks that swap remembered chain outputs for their recipes."""

    def __init__(self):
        self._recipes: dict[int, tuple[weakref.ref, _Recipe, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._previous = getattr(_active, "registry", None)
        _active.registry = self
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        _active.registry = self._previous
        self._recipes.clear()  # recipes already packed live on in the graph; the rest are dropped here
        return False

    def remember(self, output: torch.Tensor, fn, inputs) -> None:
        key = id(output)
        # The entry dies with the output: an output nobody saved must not keep its inputs alive.
        ref = weakref.ref(output, lambda _, key=key, recipes=self._recipes: recipes.pop(key, None))
        self._recipes[key] = (ref, _Recipe(fn, inputs), output._version)

    def _pack(self, tensor: torch.Tensor):
        entry = self._recipes.get(id(tensor))
        if entry is not None:
            ref, recipe, version = entry
            if ref() is tensor and tensor._version == version:
                return recipe
        # Detached (same storage and version counter): a node that saves its own output would otherwise hold, through
        # the hook, the tensor whose grad_fn is that node, a cycle the garbage collector cannot see. A backward breaks
        # it by releasing the saved tensors; a forward that never reaches one (an out-of-memory error, a dropped loss)
        # would keep its whole graph alive.
        return tensor.detach()

    @staticmethod
    def _unpack(saved):
        return saved.materialise() if isinstance(saved, _Recipe) else saved


def recompute_enabled() -> bool:
    """Whether a forward starting now should run inside `RecomputedActivations` (see the module docstring)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    # The query torch's own checkpointing uses; where a torch lacks it, no enclosing hooks are assumed.
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top_hooks is None or top_hooks(False) is None


def remember(output: torch.Tensor, fn, *inputs) -> torch.Tensor:
    """Declare `output == fn(*inputs)` so the backward may recompute it instead of keeping it; returns `output`.
    A no-op outside a `RecomputedActivations` context or when autograd is not recording."""
    if torch.compiler.is_compiling():
        return output
    registry = getattr(_active, "registry", None)
    # Not only outputs that require grad: a frozen chain's output is still saved by a trainable reader (LoRA's A).
    if registry is not None and torch.is_grad_enabled():
        registry.remember(output, fn, inputs)
    return output
