"""Multimodal rotary embedding (MRoPE) on a packed stream.

Only the first `rotary_dim = head_dim * partial_rotary_factor` channels of q/k rotate, in the rotate-half
layout. Each of the rotary_dim/2 frequencies reads one of the three position axes (t, h, w):
  * interleaved (Qwen3.5): frequency i reads h when i % 3 == 1 and i < 3 * sections[1], w when i % 3 == 2 and
    i < 3 * sections[2], t otherwise;
  * contiguous (mrope_interleaved False): the first sections[0] frequencies read t, the next sections[1] h,
    the last sections[2] w.
Text tokens have t == h == w, so for text the result is ordinary rope.
"""

from __future__ import annotations

import torch
from torch import nn


def mrope_axis_of_frequency(sections: list[int], interleaved: bool) -> torch.Tensor:
    """long [rotary_dim/2]: which position axis (0=t, 1=h, 2=w) each frequency reads."""
    half = sum(sections)
    axis = torch.zeros(half, dtype=torch.long)
    if interleaved:
        idx = torch.arange(half)
        axis[(idx % 3 == 1) & (idx < 3 * sections[1])] = 1
        axis[(idx % 3 == 2) & (idx < 3 * sections[2])] = 2
    else:
        axis[sections[0]: sections[0] + sections[1]] = 1
        axis[sections[0] + sections[1]:] = 2
    return axis


class MRotaryEmbedding(nn.Module):
    """Computes cos/sin from the config on every call: no buffers, so nothing to re-initialise after loading
    from the meta device and nothing that a `.to(bfloat16)` could round (frequencies are always fp32)."""

    def __init__(self, config):
        super().__init__()
        rope = config.rope_parameters
        self.rotary_dim = config.rotary_dim
        self.theta = rope["rope_theta"]
        self.sections = list(rope["mrope_section"])
        self.interleaved = bool(rope["mrope_interleaved"])

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids long [N] (text) or [3, N] (t, h, w) -> (cos, sin) [N, rotary_dim] in `dtype`."""
        device = position_ids.device
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(3, -1)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = position_ids[..., None].float() * inv_freq  # [3, N, half]
        axis = mrope_axis_of_frequency(self.sections, self.interleaved).to(device)
        freqs = torch.gather(freqs, 0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, rotary_dim]: rotate the first rotary_dim channels, pass the rest through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
