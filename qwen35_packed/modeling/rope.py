"""Multimodal rotary embedding (MRoPE) on a packed stream.

Only the first `rotary_dim = head_dim * partial_rotary_factor` channels of q/k rotate, in the rotate-half
layout. Each of the rotary_dim/2 frequencies reads one of the three position axes (t, h, w):
  * interleaved (Qwen3.5): frequency i reads h when i % 3 == 1 and i < 3 * sections[1], w when i % 3 == 2 and
    i < 3 * sections[2], t otherwise;
  * contiguous (mrope_interleaved False): the first sections[0] frequencies read t, the next sections[1] h,
    the last sections[2] w.
Text tokens have t == h == w, so for text the result is ordinary rope. The interleaved rule is read exactly as
transformers' built-in reads it, whatever the sections sum to (a config without `mrope_section` gets the
official [11, 11, 10], as the built-in's does).

Rope types: `default` is computed here; the scaled types transformers implements (`linear`, `dynamic`, `yarn`,
`longrope`, `llama3`, ...: its `ROPE_INIT_FUNCTIONS`) take their frequencies and attention scaling from
transformers' own functions, as the built-in model does. `dynamic` and `longrope` depend on the longest sequence
of the call (its largest position + 1), read on the host, as in the built-in; unlike the built-in nothing is kept
between calls (the built-in keeps frequencies grown by an earlier, longer call).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def mrope_axis_of_frequency(sections: list[int], interleaved: bool, half: int) -> torch.Tensor:
    """long [half]: which position axis (0=t, 1=h, 2=w) each of the `half` = rotary_dim/2 frequencies reads
    (contiguous sections must sum to `half`)."""
    axis = torch.zeros(half, dtype=torch.long)
    if interleaved:
        idx = torch.arange(half)
        axis[(idx % 3 == 1) & (idx < 3 * sections[1])] = 1
        axis[(idx % 3 == 2) & (idx < 3 * sections[2])] = 2
    else:
        axis[sections[0] : sections[0] + sections[1]] = 1
        axis[sections[0] + sections[1] :] = 2
    return axis


class MRotaryEmbedding(nn.Module):
    """Computes cos/sin from the config on every call: no buffers, so nothing to re-initialise after loading
    from the meta device and nothing that a `.to(bfloat16)` could round (frequencies are always fp32)."""

    def __init__(self, config):
        super().__init__()
        rope = config.rope_parameters
        self.config = config
        self.rope_type = rope["rope_type"]
        self.rotary_dim = config.rotary_dim
        self.theta = rope["rope_theta"]
        self.sections = list(rope["mrope_section"])
        self.interleaved = bool(rope["mrope_interleaved"])
        self._axes: dict[tuple, torch.Tensor] = {}  # mrope_axis_of_frequency on each device (`_axis_on`)

    def inverse_frequencies(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(fp32 inverse frequencies [rotary_dim/2], attention scaling of cos / sin) for this call's positions."""
        device = position_ids.device
        if self.rope_type == "default":
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            return 1.0 / (self.theta**exponents), 1.0
        init = ROPE_INIT_FUNCTIONS[self.rope_type]
        if self.rope_type == "dynamic":
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.config.max_position_embeddings:
                return init(self.config, device, seq_len=seq_len)
        elif self.rope_type == "longrope":
            seq_len = int(position_ids.max()) + 1
            original = self.config.rope_parameters.get(
                "original_max_position_embeddings", self.config.max_position_embeddings
            )
            _, scaling = init(self.config, device)  # the built-in keeps the scaling of its construction
            if seq_len > original:
                return init(self.config, device, seq_len=original + 1)[0], scaling
        return init(self.config, device)

    @property
    def inv_freq(self) -> torch.Tensor:
        """fp32 inverse frequencies [rotary_dim/2] at positions within max_position_embeddings (the built-in's
        buffer of that name)."""
        return self.inverse_frequencies(torch.zeros(1, dtype=torch.long))[0]

    @torch.no_grad()
    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids long [N] (text) or [3, N] (t, h, w) -> (cos, sin) [N, rotary_dim] in `dtype`."""
        device = position_ids.device
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(3, -1)
        inv_freq, scaling = self.inverse_frequencies(position_ids)
        freqs = position_ids[..., None].float() * inv_freq.to(device=device, dtype=torch.float32)  # [3, N, half]
        axis = self._axis_on(device, freqs.shape[-1])
        freqs = torch.gather(freqs, 0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def _axis_on(self, device: torch.device, half: int) -> torch.Tensor:
        # Made once per device: a copy from the host in every forward is a wait, and not allowed in a captured
        # decode step (decode_graph.py).
        key = (device, half)
        if key not in self._axes:
            self._axes[key] = mrope_axis_of_frequency(self.sections, self.interleaved, half).to(device)
        return self._axes[key]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        """The built-in rotary embedding's interface: position_ids [batch, seq] or [3, batch, seq] -> (cos, sin)
        [batch, seq, rotary_dim] in x's dtype. The model itself calls `cos_sin` on its packed stream."""
        batch_shape = position_ids.shape[-2:]
        flat = position_ids.reshape(-1) if position_ids.dim() == 2 else position_ids.reshape(3, -1)
        cos, sin = self.cos_sin(flat.to(x.device), x.dtype)
        return cos.view(*batch_shape, -1), sin.view(*batch_shape, -1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-second half, first half) of the last dim: the rotate-half rope layout (text and vision)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, rotary_dim]: rotate the first rotary_dim channels, pass the rest through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
