"""Multimodal rope (MRoPE) positions computed directly on a packed stream with document boundaries.

transformers' `Qwen3_5Model.get_rope_index` works row by row on padded batches; packed rows (several documents
in one row) get positions that run on across documents. Here positions are computed on the packed stream of real
tokens with its `cu_seqlens`, with the same rules per document as the built-in:
  * positions restart at 0 at every document start;
  * a text token advances every axis (t, h, w) by 1;
  * the tokens of one image (a run of image tokens, one grid) get `start + (t, h, w)` grid indices on the merged
    grid (t, H / merge, W / merge), in the order the vision tower emits them (t-major, then rows, then columns),
    and the position after the image is `start + max(H, W) / merge`;
  * a video is split into its frames (`t` grids of one temporal patch each, separated in the text by timestamp
    and vision start/end tokens), each frame placed like an image with t index 0.

Every run of image (video) tokens must be exactly one image (video frame) of the grid list, taken in order;
count mismatches, grids without tokens, tokens without grids and runs crossing a document boundary raise
ValueError.
"""

from __future__ import annotations

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def check_grid_thw(grid: torch.Tensor | None, name: str, spatial_merge_size: int) -> torch.Tensor | None:
    """`grid` ([num, 3] of (t, h, w) in patches) as a long tensor on the host, after checking it: integer, positive,
    heights and widths multiples of `spatial_merge_size`; None stays None. Raises ValueError naming `name`."""
    if grid is None:
        return None
    grid = torch.as_tensor(grid)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point:
        raise ValueError(f"{name} must be an integer tensor [num, 3] of (t, h, w), got shape {tuple(grid.shape)}")
    grid = grid.long().cpu()
    if bool((grid <= 0).any()):
        raise ValueError(f"{name} entries must be positive, got {grid.tolist()}")
    if bool((grid[:, 1:] % spatial_merge_size).any()):
        raise ValueError(
            f"{name} heights and widths must be multiples of spatial_merge_size={spatial_merge_size}, got "
            f"{grid.tolist()}"
        )
    return grid


def modality_of_tokens(
    input_ids: torch.Tensor, image_token_id: int, video_token_id: int, mm_token_type_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """long [...] with 0 (text), 1 (image), 2 (video) per token. Without `mm_token_type_ids` the placeholder ids
    decide. A given `mm_token_type_ids` (what the processor returns) decides which placeholder ids are vision tokens:
    a placeholder id typed 0 is a text token (a sampled completion may hold one, and vLLM embeds and positions the
    tokens it generates as text); a token typed image or video must hold that modality's placeholder id."""
    kind = torch.zeros_like(input_ids, dtype=torch.long)
    kind[input_ids == image_token_id] = IMAGE
    kind[input_ids == video_token_id] = VIDEO
    if mm_token_type_ids is not None:
        given = torch.as_tensor(mm_token_type_ids, device=input_ids.device).long()
        if given.shape != input_ids.shape:
            raise ValueError(
                f"mm_token_type_ids has shape {tuple(given.shape)} but input_ids has {tuple(input_ids.shape)}"
            )
        contradiction = (given != kind) & (given != TEXT)
        if bool(contradiction.any()):
            bad = int(torch.nonzero(contradiction.reshape(-1))[0])
            raise ValueError(
                f"mm_token_type_ids contradict input_ids at flat token {bad}: type {int(given.reshape(-1)[bad])} "
                f"but the token id says {int(kind.reshape(-1)[bad])} (image token id {image_token_id}, video token "
                f"id {video_token_id})"
            )
        return given
    return kind


def vision_runs(kind: torch.Tensor, cu_seqlens: torch.Tensor) -> list[tuple[int, int, int]]:
    """(modality, start, end) of every maximal run of image or video tokens inside one document, in order."""
    n = kind.numel()
    if n == 0:
        return []
    new_run = torch.ones(n, dtype=torch.bool, device=kind.device)
    new_run[1:] = kind[1:] != kind[:-1]
    new_run[cu_seqlens[:-1].long()] = True
    starts = torch.nonzero(new_run).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([n])])
    run_kind = kind[starts]
    keep = run_kind != TEXT
    return list(zip(run_kind[keep].tolist(), starts[keep].tolist(), ends[keep].tolist()))


def packed_mrope_positions(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """3D rope positions long [3, N] for a packed stream of N real tokens.

    input_ids long [N]; cu_seqlens [n_docs + 1] (document boundaries on the stream); image_grid_thw [n_images, 3]
    and video_grid_thw [n_videos, 3] in patches, in the order the images / videos appear in the stream (the
    processor's order); mm_token_type_ids [N] optional, see `modality_of_tokens`.
    """
    if input_ids.ndim != 1:
        raise ValueError(f"input_ids must be the packed stream [N], got shape {tuple(input_ids.shape)}")
    device = input_ids.device
    n = input_ids.numel()
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if int(cu[-1]) != n:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the stream has {n} tokens")
    merge = int(spatial_merge_size)
    image_grid = check_grid_thw(image_grid_thw, "image_grid_thw", merge)
    video_grid = check_grid_thw(video_grid_thw, "video_grid_thw", merge)
    if video_grid is not None:  # one grid per frame, as the text separates frames with timestamps
        video_grid = torch.repeat_interleave(video_grid, video_grid[:, 0], dim=0)
        video_grid[:, 0] = 1

    kind = modality_of_tokens(input_ids, image_token_id, video_token_id, mm_token_type_ids)
    runs = vision_runs(kind, cu)
    grids = {IMAGE: image_grid, VIDEO: video_grid}
    used = {IMAGE: 0, VIDEO: 0}
    names = {IMAGE: ("image", "image_grid_thw"), VIDEO: ("video frame", "video_grid_thw")}

    # Per token: its offset (t, h, w) from the start position of its run, and per run how far it advances the
    # position. Text runs need no bookkeeping: a text token offsets every axis by its index in the run and
    # advances by 1, which is what the default values below encode once run starts are known.
    offsets = torch.zeros(3, n, dtype=torch.long, device=device)
    advance = torch.ones(n, dtype=torch.long, device=device)  # position increase contributed by each token
    is_vision = kind != TEXT
    for modality, start, end in runs:
        word, grid_name = names[modality]
        grid_list = grids[modality]
        index = used[modality]
        if grid_list is None or index >= grid_list.shape[0]:
            have = 0 if grid_list is None else grid_list.shape[0]
            raise ValueError(
                f"the tokens hold more {word}s than {grid_name} describes ({have}): {word} token run at "
                f"[{start}, {end}) has no grid" + (" (no pixel values / grids were given)" if have == 0 else "")
            )
        t, h, w = (int(v) for v in grid_list[index])
        gh, gw = h // merge, w // merge
        expected = t * gh * gw
        if end - start != expected:
            raise ValueError(
                f"{word} {index} has a grid {[t, h, w]} -> {expected} tokens, but its token run at [{start}, {end}) "
                f"has {end - start} tokens (a run of {word} tokens must be exactly one {word}, and may not cross "
                "a document boundary)"
            )
        used[modality] = index + 1
        tt, hh, ww = torch.meshgrid(
            torch.arange(t, device=device),
            torch.arange(gh, device=device),
            torch.arange(gw, device=device),
            indexing="ij",
        )
        offsets[:, start:end] = torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)])
        advance[start:end] = 0
        advance[start] = max(gh, gw)
    for modality in (IMAGE, VIDEO):
        total = 0 if grids[modality] is None else grids[modality].shape[0]
        if used[modality] != total:
            word, grid_name = names[modality]
            raise ValueError(
                f"{grid_name} describes {total} {word}s but the tokens hold only {used[modality]} runs of {word} "
                "tokens (grids without tokens)"
            )

    # Start position of every token's run = sum of the advances of the earlier runs of its document.
    # For a text token, "its run" is the token itself (offset 0); for a vision token it is its image.
    run_start = torch.ones(n, dtype=torch.bool, device=device)
    run_start[1:] = ~(is_vision[1:] & (kind[1:] == kind[:-1]))
    run_start[cu[:-1]] = True
    # Within one image run the first token carries the whole advance; exclusive cumsum per document.
    inclusive = torch.cumsum(advance, 0)
    doc_lengths = cu[1:] - cu[:-1]
    doc_base = torch.repeat_interleave(inclusive[cu[:-1]] - advance[cu[:-1]], doc_lengths)
    exclusive = inclusive - advance - doc_base
    # Every token of a run reads the position of the run's first token.
    run_id = torch.cumsum(run_start.long(), 0) - 1
    first_token = torch.nonzero(run_start).flatten()
    start_pos = exclusive[first_token][run_id]
    return start_pos.unsqueeze(0) + offsets


__all__ = ["modality_of_tokens", "packed_mrope_positions", "vision_runs"]
