"""Normalisation layers. Both compute in fp32 whatever the parameter dtype, as the reference does. Their outputs
feed linear layers, so the backward recomputes them from the inputs instead of keeping them (recompute.py)."""

from __future__ import annotations

import torch
from torch import nn

from .kernel_set import REFERENCE_KERNELS, KernelSet
from .recompute import remember


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight stored as an offset from 1: y = rmsnorm(x) * (1 + w), all in fp32, cast back last."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, kernels: KernelSet = REFERENCE_KERNELS) -> torch.Tensor:
        norm = kernels.rms_norm
        return remember(norm(x, self.weight, self.eps), norm, x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """GDN output norm: weight * rmsnorm(x) * silu(gate) over every group of `dim` features (one per head), weight
    initialised to ones (not zero-centred). x, gate [N, heads * dim]: the output is out_proj's input as it is."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, kernels: KernelSet = REFERENCE_KERNELS) -> torch.Tensor:
        return remember(self._normed(x, gate, kernels.gated_norm), self._normed, x, gate, kernels.gated_norm)

    def _normed(self, x: torch.Tensor, gate: torch.Tensor, gated_norm) -> torch.Tensor:
        dim = self.weight.shape[0]
        return gated_norm(x.reshape(-1, dim), gate.reshape(-1, dim), self.weight, self.eps).reshape(x.shape)
