"""Tiny vision-language models and inputs for the VL tests (fp32, CPU), shared by test_vl_*.py and test_gpu_vl.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import _NO_BUILTIN, HAS_BUILTIN_QWEN35, _randomize_zero_init, tiny_kwargs

# Token ids inside the tiny text vocabulary (128): 0..99 are words.
IMAGE, VIDEO, VISION_START, VISION_END, PAD = 120, 121, 122, 123, 124
TINY_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
)
MERGE = 2
PATCH_DIM = 3 * 2 * 4 * 4


def composite_kwargs(kind: str, **overrides) -> dict:
    kwargs = dict(
        text_config=tiny_kwargs(kind),
        vision_config=dict(TINY_VISION),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    kwargs.update(overrides)
    return kwargs


def our_vl_model(kind: str, **overrides):
    from qwen35_packed.configuration.configuration_qwen3_5_packed_vl import (
        Qwen3_5MoePackedVLConfig,
        Qwen3_5PackedVLConfig,
    )
    from qwen35_packed.modeling import Qwen3_5MoePackedForConditionalGeneration, Qwen3_5PackedForConditionalGeneration

    if kind == "moe":
        return Qwen3_5MoePackedForConditionalGeneration(Qwen3_5MoePackedVLConfig(**composite_kwargs(kind, **overrides)))
    return Qwen3_5PackedForConditionalGeneration(Qwen3_5PackedVLConfig(**composite_kwargs(kind, **overrides)))


def _randomize_vl(model) -> None:
    """Norms moved off their zero init, and the vision merger scaled up so image features are as large as word
    embeddings (otherwise a wrong image placement would hardly move the logits)."""
    _randomize_zero_init(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.visual.") and (
                name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("merger.norm.weight")
            ):
                param.add_(torch.randn_like(param) * 0.1)
        model.model.visual.merger.linear_fc2.weight.mul_(10.0)


def builtin_vl_pair(kind: str, seed: int = 0, **overrides):
    """(transformers' built-in composite model, ours) with identical random weights (`_randomize_vl`), eval mode,
    fp32; skips the test where transformers has no built-in Qwen3.5."""
    if not HAS_BUILTIN_QWEN35:
        pytest.skip(_NO_BUILTIN)
    torch.manual_seed(seed)
    kwargs = composite_kwargs(kind, **overrides)
    if kind == "moe":
        ref = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(**kwargs))
    else:
        ref = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(**kwargs))
    _randomize_vl(ref)
    ours = our_vl_model(kind, **overrides)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def packed_vl_model(kind: str, seed: int = 0, **overrides):
    """This project's composite model alone with random weights (`_randomize_vl`; no built-in needed), eval, fp32."""
    torch.manual_seed(seed)
    model = our_vl_model(kind, **overrides)
    _randomize_vl(model)
    return model.eval()


def image_tokens(grid) -> list[int]:
    t, h, w = grid
    return [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_END]


def video_tokens(grid, gen) -> list[int]:
    """Per frame: a timestamp word, then vision start, the frame's tokens, vision end (Qwen3.5's layout)."""
    t, h, w = grid
    out = []
    for _ in range(t):
        out += [int(torch.randint(0, 100, (1,), generator=gen))] + [VISION_START]
        out += [VIDEO] * (h * w // MERGE**2) + [VISION_END]
    return out


def random_grid(gen, max_side: int = 4, t: int = 1) -> list[int]:
    h = MERGE * int(torch.randint(1, max_side + 1, (1,), generator=gen))
    w = MERGE * int(torch.randint(1, max_side + 1, (1,), generator=gen))
    return [t, h, w]


def make_document(gen, n_images: int, n_videos: int = 0, min_text: int = 1, max_text: int = 12):
    """A document mixing text and n_images images (and n_videos videos) in random order.

    Returns (ids long [L], image grids, video grids)."""
    parts = ["image"] * n_images + ["video"] * n_videos
    order = torch.randperm(len(parts), generator=gen).tolist()
    ids, images, videos = [], [], []

    def text():
        n = int(torch.randint(min_text, max_text + 1, (1,), generator=gen))
        return torch.randint(0, 100, (n,), generator=gen).tolist()

    if bool(torch.rand(1, generator=gen) < 0.7):
        ids += text()
    for i in order:
        if parts[i] == "image":
            grid = random_grid(gen)
            images.append(grid)
            ids += image_tokens(grid)
        else:
            grid = random_grid(gen, max_side=2, t=int(torch.randint(1, 3, (1,), generator=gen)))
            videos.append(grid)
            ids += video_tokens(grid, gen)
        if bool(torch.rand(1, generator=gen) < 0.8):
            ids += text()
    if not ids:
        ids = text()
    return torch.tensor(ids), images, videos


def pixels_for(grids, gen) -> torch.Tensor | None:
    if not grids:
        return None
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=gen)


def grid_tensor(grids) -> torch.Tensor | None:
    return torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if grids else None


def token_types(ids: torch.Tensor) -> torch.Tensor:
    types = torch.zeros_like(ids)
    types[ids == IMAGE] = 1
    types[ids == VIDEO] = 2
    return types
