"""transformers' per-document MRoPE positions, the reference of the packed ones (test_mrope_positions.py,
test_properties_mrope.py)."""

import functools
import types

import torch
import transformers
from vl_tiny import MERGE, grid_tensor, token_types


def builtin_rope_index(ids: torch.Tensor, images, videos) -> torch.Tensor:
    """transformers' Qwen3_5Model.get_rope_index on one unpadded document -> [3, L]."""
    model_cls = transformers.Qwen3_5Model
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=MERGE))
    )
    fake.get_vision_position_ids = functools.partial(model_cls.get_vision_position_ids, fake)
    row = ids.unsqueeze(0)
    positions, _ = model_cls.get_rope_index(fake, row, token_types(row), grid_tensor(images), grid_tensor(videos))
    return positions[:, 0]
