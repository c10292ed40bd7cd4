"""The Qwen3.5 vision encoder (ViT with 2D rope and a spatial patch merger), run on all images of a batch at once.

Remote code: imports only torch, transformers and sibling files. Keys and shapes are those of transformers'
`Qwen3_5VisionModel` (`patch_embed.proj`, `pos_embed`, `blocks.{i}.{norm1, norm2, attn.qkv, attn.proj,
mlp.linear_fc1, mlp.linear_fc2}`, `merger.{norm, linear_fc1, linear_fc2}`), so a composite checkpoint's
`model.visual.*` loads unchanged.

Input: `pixel_values` [num_patches, C * T * P * P] with the patches of every image (or video) in order and, inside
one image, in the processor's layout (spatial-merge blocks of merge x merge neighbouring patches are consecutive),
and `grid_thw` [num_images, 3] in patches. Attention is bidirectional inside each frame of each image and never
crosses frames or images (varlen over `cu_seqlens` of h * w patches per frame). Output: transformers'
`BaseModelOutputWithPooling` as the built-in tower returns it: `pooler_output` [num_patches / merge^2,
out_hidden_size] (one row per image placeholder token), `last_hidden_state` [num_patches, hidden] before the
merger, and on request `hidden_states` (the embedded patches, then every block's output) and `attentions` (every
block's attention sub-layer output, [num_patches, hidden]: what transformers' recorder captures from the built-in
tower, whose attention module returns no probabilities).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .kernels import attention_sdpa
from .model_conventions import init_dense_weights, weight_init
from .mrope_positions import check_grid_thw
from .projection import RowInvariantLinear, row_invariant_linear
from .rope import rotate_half


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """int32 [num_frames + 1]: every frame (t index) of every image is one attention segment of h * w patches."""
    per_frame = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(per_frame.cumsum(0), (1, 0)).to(torch.int32)


def _block_order(h: int, w: int, merge: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch of an h x w grid in spatial-merge-block order (the processor's patch order)."""
    rows = torch.arange(h, device=device).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w, device=device).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    return rows.reshape(-1), cols.reshape(-1)


class VisionPatchEmbed(nn.Module):
    """Conv3d with stride == kernel, i.e. one linear map per (T, P, P) patch; computed as a matmul."""

    def __init__(self, config):
        super().__init__()
        self.in_channels = config.in_channels
        self.temporal_patch_size = config.temporal_patch_size
        self.patch_size = config.patch_size
        self.embed_dim = config.hidden_size
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.proj = nn.Conv3d(self.in_channels, self.embed_dim, kernel_size=kernel, stride=kernel, bias=True)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.embed_dim, -1)
        return row_invariant_linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = self.dim // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv = RowInvariantLinear(self.dim, self.dim * 3, bias=True)
        self.proj = RowInvariantLinear(self.dim, self.dim)

    def forward(self, x, cu_seqlens, max_seqlen, cos, sin, varlen_attention):
        """`varlen_attention`: a kernel set's (kernel_set.py), run bidirectionally within each image."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, self.scaling, False)
        return self.proj(out.reshape(n, self.dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope over the full head dim, in fp32, back to x's dtype. x [N, H, D]; cos/sin [N, D]."""
    xf = x.float()
    return (xf * cos.unsqueeze(1) + rotate_half(xf) * sin.unsqueeze(1)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = RowInvariantLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = RowInvariantLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3_5PackedVisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cu_seqlens, max_seqlen, cos, sin, varlen_attention):
        """(the block's output, its attention sub-layer's output): the second is what `attentions` records."""
        attention = self.attn(self.norm1(x), cu_seqlens, max_seqlen, cos, sin, varlen_attention)
        x = x + attention
        return x + self.mlp(self.norm2(x)), attention


class VisionPatchMerger(nn.Module):
    """LayerNorm per patch, then merge x merge neighbouring patches -> MLP -> out_hidden_size."""

    def __init__(self, config):
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = RowInvariantLinear(self.merged_size, self.merged_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = RowInvariantLinear(self.merged_size, config.out_hidden_size)

    def forward(self, x):
        x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3_5PackedVisionModel(PreTrainedModel):
    """The vision tower (`model.visual`). `forward(pixel_values, grid_thw)` -> `BaseModelOutputWithPooling` whose
    `pooler_output` holds the merged features [tokens, out]."""

    config_class = getattr(transformers, "Qwen3_5VisionConfig", transformers.PretrainedConfig)
    base_model_prefix = "visual"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3_5PackedVisionBlock"]
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = VisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        if self.num_grid_per_side**2 != config.num_position_embeddings:
            raise ValueError(f"num_position_embeddings={config.num_position_embeddings} must be a square number")
        self.head_dim = config.hidden_size // config.num_heads
        if self.head_dim % 4:
            raise ValueError(f"vision head dim {self.head_dim} must be a multiple of 4 (2D rope on h and w)")
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.blocks = nn.ModuleList([Qwen3_5PackedVisionBlock(config) for _ in range(config.depth)])
        self.merger = VisionPatchMerger(config)
        self.gradient_checkpointing = False
        self.post_init()

    def _init_weights(self, module):
        init = weight_init()
        if init_dense_weights(module, self.config.initializer_range):
            return
        if isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)

    def interpolated_pos_embed(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The learned square position grid resampled bilinearly (align_corners) to each image's h x w patch grid,
        in the processor's patch order, repeated for every frame: [num_patches, hidden]."""
        side = self.num_grid_per_side
        table = self.pos_embed.weight
        merge = self.spatial_merge_size
        out = []
        for t, h, w in grid_thw.tolist():
            rows, cols = _block_order(h, w, merge, table.device)
            taps_r, wts_r = _axis_taps(rows, h, side)
            taps_c, wts_c = _axis_taps(cols, w, side)
            index = (taps_r[:, :, None] * side + taps_c[:, None, :]).reshape(-1, 4)
            weight = (wts_r[:, :, None] * wts_c[:, None, :]).reshape(-1, 4)
            emb = (table[index] * weight.unsqueeze(-1).to(table.dtype)).sum(1)
            out.append(emb.repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grid_thw: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """2D rope: the first half of the rotary frequencies reads the patch row, the second half its column."""
        device = self.pos_embed.weight.device
        quarter = self.head_dim // 4
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=device) / (2 * quarter))
        )
        pos = []
        for t, h, w in grid_thw.tolist():
            rows, cols = _block_order(h, w, self.spatial_merge_size, device)
            pos.append(torch.stack([rows, cols], -1).repeat(t, 1))
        pos = torch.cat(pos).float()
        freqs = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1)  # [N, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        grid_thw = check_grid_thw(grid_thw, "grid_thw", self.spatial_merge_size)
        patch_dim = self.patch_embed.patch_dim
        expected = int(grid_thw.prod(-1).sum())
        if pixel_values.ndim != 2 or pixel_values.shape[1] != patch_dim:
            raise ValueError(
                f"pixel_values must be [num_patches, {patch_dim}] (channels x temporal_patch x patch x patch), got "
                f"shape {tuple(pixel_values.shape)}"
            )
        if pixel_values.shape[0] != expected:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patches but the grids {grid_thw.tolist()} describe "
                f"{expected}"
            )

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        varlen_attention=None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> BaseModelOutputWithPooling:
        """The tower's output for all images of `grid_thw` (the module docstring says which fields); attention
        through `varlen_attention` (the kernel set's that the vision-language model binds for the tower's device and
        dtype), SDPA per image without one."""
        grid_thw = torch.as_tensor(grid_thw).long()
        self.check_inputs(pixel_values, grid_thw)
        grid_cpu = grid_thw.cpu()
        x = self.patch_embed(pixel_values)
        x = x + self.interpolated_pos_embed(grid_cpu).to(x.dtype)
        cos, sin = self.rotary(grid_cpu)
        cu = vision_cu_seqlens(grid_cpu).to(x.device)
        max_seqlen = int((grid_cpu[:, 1] * grid_cpu[:, 2]).max())
        attend = varlen_attention or attention_sdpa
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        hidden_states = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        for block in self.blocks:
            if checkpointing:
                x, attention = self._gradient_checkpointing_func(block, x, cu, max_seqlen, cos, sin, attend)
            else:
                x, attention = block(x, cu, max_seqlen, cos, sin, attend)
            if hidden_states is not None:
                hidden_states.append(x)
            if attentions is not None:
                attentions.append(attention)
        return BaseModelOutputWithPooling(
            last_hidden_state=x,
            pooler_output=self.merger(x),
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            attentions=tuple(attentions) if attentions is not None else None,
        )


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) taps into a `side`-long axis for target indices on a `size`-long axis."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    low = src.floor()
    frac = src - low
    low = low.long()
    taps = torch.stack([low, (low + 1).clamp(max=side - 1)], dim=-1)
    weights = torch.stack([1 - frac, frac], dim=-1)
    return taps, weights


__all__ = ["Qwen3_5PackedVisionModel", "Qwen3_5PackedVisionBlock", "vision_cu_seqlens"]
