"""Where the images and videos of a vision-language batch go: the layout the front door decides (which tokens are
image / video placeholders, the 3D rope positions of the packed stream) and the scatter of the encoded features
onto the placeholders, in the order the images appear in the batch, row by row.

The layout is computed on the packed stream (mrope_positions.py): positions restart per document, image tokens get
grid positions, text after an image continues after it; 3D `position_ids` given by the caller are used as given.
Without input_ids the placeholders are found by their embedding, as the built-in does. Under context parallelism
the layout is the whole row's, computed on the gathered token ids, and each rank keeps its shard's part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import context_parallel
from .mrope_positions import IMAGE, TEXT, VIDEO, modality_of_tokens, packed_mrope_positions
from .packing import PackedSequence
from .utils import log_once

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionInputs:
    """A vision-language forward's vision inputs, as the caller gave them, and the token ids they are placed by."""

    pixel_values: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    mm_token_type_ids: torch.Tensor | None
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int

    @property
    def has_pixels(self) -> bool:
        return self.pixel_values is not None or self.pixel_values_videos is not None


@dataclass(frozen=True)
class VisionLayout:
    """The images and videos a forward encodes, and which tokens of the stream show them."""

    # (pixels, grid_thw, modality, name) per modality given: "image" / "video"
    items: tuple[tuple[torch.Tensor, torch.Tensor, int, str], ...]
    # the modality of every token (TEXT / IMAGE / VIDEO), of the whole row under context parallelism; None
    # without token ids
    kinds: torch.Tensor | None


def placeholder_ids(embedding: torch.nn.Embedding, embeds: torch.Tensor, image_token_id: int, video_token_id: int):
    """long [...] for embeddings [..., H]: the image / video token id where an embedding equals that token's
    embedding, -1 elsewhere (enough to locate images and videos and compute their positions)."""
    ids = torch.full(embeds.shape[:-1], -1, dtype=torch.long, device=embeds.device)
    for token in (image_token_id, video_token_id):
        token_embedding = embedding(torch.tensor(token, device=embeds.device)).to(embeds.dtype)
        ids[(embeds == token_embedding).all(-1)] = token
    return ids


def _check_pairs(vision: VisionInputs) -> None:
    for pixels, grid, what in (
        (vision.pixel_values, vision.image_grid_thw, "image"),
        (vision.pixel_values_videos, vision.video_grid_thw, "video"),
    ):
        pixel_name = "pixel_values" if what == "image" else "pixel_values_videos"
        if (pixels is None) != (grid is None):
            given, missing = (pixel_name, f"{what}_grid_thw") if grid is None else (f"{what}_grid_thw", pixel_name)
            raise ValueError(f"{given} was given without {missing}; {what}s need both")


def lay_out_vision(
    vision: VisionInputs,
    packed: PackedSequence,
    token_ids: torch.Tensor | None,
    embeds: torch.Tensor | None,
    embedding: torch.nn.Embedding,
    shard: context_parallel.ShardLayout | None,
    text_positions: torch.Tensor,
    *,
    continues_cache: bool,
    given_3d_positions: bool,
) -> tuple[torch.Tensor, VisionLayout]:
    """(the stream's 3D rope positions [3, N], its VisionLayout). `token_ids` / `embeds`: the stream's packed
    input_ids or inputs_embeds; `text_positions`: the packing's positions (the caller's 3D ones when
    `given_3d_positions`). A generation step after the prefill takes new text tokens only, one position on every
    axis."""
    if continues_cache:
        if vision.has_pixels:
            raise ValueError("images and videos go into the prefill; a cached step takes new text tokens only")
        return text_positions.unsqueeze(0).expand(3, -1), VisionLayout((), None)
    _check_pairs(vision)
    ids = token_ids
    if ids is None and vision.has_pixels:
        ids = placeholder_ids(embedding, embeds, vision.image_token_id, vision.video_token_id)
    kinds = None
    if ids is not None:
        kinds, positions = _positions_of_tokens(vision, packed, ids, shard)
    else:
        positions = text_positions.unsqueeze(0).expand(3, -1) if text_positions.dim() == 1 else None
    if given_3d_positions:  # the caller's 3D positions
        positions = text_positions
    items = tuple(
        (pixels, torch.as_tensor(grid, device=pixels.device), modality, name)
        for pixels, grid, modality, name in (
            (vision.pixel_values, vision.image_grid_thw, IMAGE, "image"),
            (vision.pixel_values_videos, vision.video_grid_thw, VIDEO, "video"),
        )
        if pixels is not None
    )
    return positions, VisionLayout(items, kinds)


def _positions_of_tokens(vision: VisionInputs, packed: PackedSequence, ids: torch.Tensor, shard):
    """(the modality of every token, the stream's 3D positions) from the token ids of the stream."""
    types = None
    if vision.mm_token_type_ids is not None:
        mm = torch.as_tensor(vision.mm_token_type_ids, device=ids.device)
        if tuple(mm.shape) != packed.batch_shape:
            raise ValueError(
                f"mm_token_type_ids must have the shape of input_ids {packed.batch_shape}, got {tuple(mm.shape)}"
            )
        types = packed.pack(mm)
    row_cu_seqlens = packed.cu_seqlens
    if shard is not None:
        # Under context parallelism the layout (modalities, 3D positions, which image a placeholder shows) is the
        # whole row's: computed on the gathered row, then this shard's part is taken.
        ids, types, row_cu_seqlens = context_parallel.gather_row_tokens(ids, types, packed, shard)
    # Which tokens are vision tokens: a placeholder id typed text by mm_token_type_ids is a text token.
    kinds = modality_of_tokens(ids, vision.image_token_id, vision.video_token_id, types)
    if vision.image_grid_thw is None and vision.video_grid_thw is None and bool((kinds != TEXT).any()):
        # No images or videos given: the built-in embeds placeholder tokens as the text tokens they are and
        # positions them as text; so do we, and say so once.
        log_once(
            logger,
            "placeholders-as-text",
            "image / video placeholder tokens without pixel inputs (no image_grid_thw / video_grid_thw) are "
            "embedded and positioned as text tokens, as transformers' Qwen3.5 does",
        )
        kinds = torch.full_like(kinds, TEXT)
    # Also the check that image/video token runs match the grids one to one, in order.
    positions = packed_mrope_positions(
        ids,
        row_cu_seqlens,
        vision.image_grid_thw,
        vision.video_grid_thw,
        image_token_id=vision.image_token_id,
        video_token_id=vision.video_token_id,
        spatial_merge_size=vision.spatial_merge_size,
        mm_token_type_ids=kinds,
    )
    if shard is not None:
        positions = positions[:, shard.offset : shard.offset + packed.num_tokens]
    return kinds, positions


def scatter_features(
    embeds: torch.Tensor,
    layout: VisionLayout,
    modality: int,
    features: torch.Tensor,
    packed: PackedSequence,
    shard: context_parallel.ShardLayout | None,
) -> torch.Tensor:
    """`embeds` [N, H] with the encoded `features` of one modality written onto its placeholder tokens, the i-th
    feature row onto the i-th placeholder (so features land on their own documents). Under context parallelism
    every rank encodes all the row's images and keeps the features of its shard's placeholders."""
    slots = torch.nonzero(layout.kinds == modality).flatten()
    if shard is not None:
        slots, features = context_parallel.shard_slots(slots, features, shard, packed.num_tokens)
    if slots.numel() != features.shape[0]:  # guaranteed by the layout's checks; a last line of defence
        raise ValueError(f"{slots.numel()} placeholder tokens but {features.shape[0]} vision features")
    return embeds.index_copy(0, slots, features.to(device=embeds.device, dtype=embeds.dtype))
