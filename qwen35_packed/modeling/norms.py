"""Normalisation layers. Both compute in fp32 whatever the parameter dtype, as the reference does."""

from __future__ import annotations

import torch
from torch import nn

from .kernels import KernelChoice, add_zero_centred_rms_norm, gated_rms_norm, zero_centred_rms_norm


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight stored as an offset from 1: y = rmsnorm(x) * (1 + w), all in fp32, cast back last."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, choice: KernelChoice | None = None) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps, choice)

    def add_and_norm(self, residual: torch.Tensor, update: torch.Tensor, choice: KernelChoice | None = None):
        """(residual + update, self(residual + update)), fused into one kernel when `choice` compiles."""
        return add_zero_centred_rms_norm(residual, update, self.weight, self.eps, choice)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """GDN output norm: weight * rmsnorm(x) * silu(gate), weight initialised to ones (not zero-centred)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, choice: KernelChoice) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, choice)
