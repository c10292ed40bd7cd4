"""Packed MRoPE positions: equal to transformers' per-document `get_rope_index`, and clean errors."""

import pytest
import torch
from conftest import requires_builtin_qwen35
from fixtures_mrope import builtin_rope_index
from vl_tiny import IMAGE, MERGE, VIDEO, VISION_END, VISION_START, grid_tensor, make_document, token_types

from qwen35_packed.modeling.mrope_positions import packed_mrope_positions

N_DOCS = 150


def _positions(stream, cu, images, videos, **kwargs):
    return packed_mrope_positions(
        stream,
        cu,
        grid_tensor(images),
        grid_tensor(videos),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        spatial_merge_size=MERGE,
        **kwargs,
    )


def _cu(docs):
    lengths = torch.tensor([len(d) for d in docs])
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


@requires_builtin_qwen35
def test_packed_positions_equal_per_document_positions():
    gen = torch.Generator().manual_seed(0)
    docs, images, videos, expected = [], [], [], []
    for i in range(N_DOCS):
        n_images = [0, 0, 1, 2, 3][i % 5]
        n_videos = 1 if i % 7 == 3 else 0
        # some documents are only an image (vision tokens at both document boundaries)
        min_text = 0 if i % 11 == 5 else 1
        ids, doc_images, doc_videos = make_document(gen, n_images, n_videos, min_text=min_text)
        if min_text == 0:
            ids = torch.tensor([VISION_START] + [IMAGE] * 4 + [VISION_END])
            doc_images, doc_videos = [[1, 4, 4]], []
        docs.append(ids)
        images += doc_images
        videos += doc_videos
        expected.append(builtin_rope_index(ids, doc_images, doc_videos))
    assert sum(len(v) for v in videos) > 5 and len(images) > 100

    got = _positions(torch.cat(docs), _cu(docs), images, videos)
    assert torch.equal(got, torch.cat(expected, dim=1))
    # Documents that end and start with image tokens right next to each other are still two images.
    back_to_back = [torch.tensor([IMAGE] * 4), torch.tensor([IMAGE] * 8 + [5])]
    got = _positions(torch.cat(back_to_back), _cu(back_to_back), [[1, 4, 4], [1, 4, 8]], [])
    assert got[:, :4].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]
    assert got[:, 4:].tolist() == [[0] * 8 + [4], [0, 0, 0, 0, 1, 1, 1, 1, 4], [0, 1, 2, 3, 0, 1, 2, 3, 4]]


def test_text_after_an_image_continues_after_its_largest_side():
    ids = torch.tensor([1, 2, VISION_START] + [IMAGE] * 6 + [VISION_END, 3])  # image grid 1 x 4 x 6 -> 2 x 3
    got = _positions(ids, torch.tensor([0, len(ids)]), [[1, 4, 6]], [])
    assert got[:, :3].tolist() == [[0, 1, 2]] * 3
    assert got[:, 3:9].tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    assert got[:, 9:].tolist() == [[6, 7]] * 3  # 3 + max(2, 3)


@pytest.mark.parametrize(
    "case, message",
    [
        ("too_few_tokens", "has 3 tokens"),
        ("grid_without_tokens", "grids without tokens"),
        ("tokens_without_grid", "no pixel values"),
        ("crosses_boundary", "may not cross"),
        ("bad_merge", "multiples of spatial_merge_size"),
        ("type_ids_disagree", "mm_token_type_ids contradict"),
    ],
)
def test_errors(case, message):
    ids = torch.tensor([1, VISION_START] + [IMAGE] * 4 + [VISION_END, 2])
    cu, images, kwargs = torch.tensor([0, len(ids)]), [[1, 4, 4]], {}
    if case == "too_few_tokens":
        ids = torch.tensor([1, VISION_START] + [IMAGE] * 3 + [VISION_END, 2])
        cu = torch.tensor([0, len(ids)])
    elif case == "grid_without_tokens":
        images = [[1, 4, 4], [1, 2, 2]]
    elif case == "tokens_without_grid":
        images = []
    elif case == "crosses_boundary":
        cu = torch.tensor([0, 4, len(ids)])
    elif case == "bad_merge":
        images = [[1, 4, 3]]
    elif case == "type_ids_disagree":
        types_ = token_types(ids)
        types_[2] = 2  # an image token typed video (typed 0 it would be a text token: see modality_of_tokens)
        kwargs["mm_token_type_ids"] = types_
    with pytest.raises(ValueError, match=message):
        _positions(ids, cu, images, [], **kwargs)
