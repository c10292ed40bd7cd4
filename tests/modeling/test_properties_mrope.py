"""Property tests of packed MRoPE positions: random documents with random image and video placements (at document
starts and ends, back to back across documents, with or without vision start / end tokens) equal transformers'
per-document `get_rope_index`; single corruptions (a token short, a grid too many or too few, a boundary inside
an image, contradicting token types) raise a ValueError that names the problem."""

from __future__ import annotations

import pytest
import torch
from fixtures_mrope import builtin_rope_index
from hypothesis import assume, given
from hypothesis import strategies as st
from properties import property_settings
from vl_tiny import IMAGE, MERGE, VIDEO, VISION_END, VISION_START, grid_tensor, token_types

from qwen35_packed.modeling.mrope_positions import packed_mrope_positions

side = st.integers(1, 3).map(lambda n: n * MERGE)
text_item = st.tuples(st.just("text"), st.integers(1, 6))
image_item = st.tuples(st.just("image"), st.just(1), side, side, st.booleans())  # (.., t, h, w, wrapped)
video_item = st.tuples(st.just("video"), st.integers(1, 2), side, side, st.just(True))
document = st.lists(st.one_of(text_item, image_item, video_item), min_size=1, max_size=5)


def build(docs, seed=0):
    """(stream ids, cu_seqlens, image grids, video grids, per-document (ids, images, videos)).

    Adjacent unwrapped items of one modality would form one run of tokens (two images that cannot be told
    apart); they get a text token between them, as any real prompt has."""
    gen = torch.Generator().manual_seed(seed)
    per_doc, images, videos = [], [], []
    for items in docs:
        ids, doc_images, doc_videos = [], [], []
        for i, item in enumerate(items):
            if item[0] == "text":
                ids += torch.randint(0, 100, (item[1],), generator=gen).tolist()
                continue
            kind, t, h, w, wrapped = item
            token = IMAGE if kind == "image" else VIDEO
            if ids and ids[-1] == token:
                ids.append(int(torch.randint(0, 100, (1,), generator=gen)))
            per_frame = [token] * (h * w // MERGE**2)
            if kind == "image":
                ids += [VISION_START, *per_frame, VISION_END] if wrapped else per_frame
                doc_images.append([t, h, w])
            else:  # per frame: a timestamp word, then the wrapped frame (Qwen3.5's video layout)
                for _ in range(t):
                    ids += [int(torch.randint(0, 100, (1,), generator=gen)), VISION_START, *per_frame, VISION_END]
                doc_videos.append([t, h, w])
        per_doc.append((torch.tensor(ids), doc_images, doc_videos))
        images += doc_images
        videos += doc_videos
    stream = torch.cat([d[0] for d in per_doc])
    lengths = torch.tensor([len(d[0]) for d in per_doc])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return stream, cu, images, videos, per_doc


def positions(stream, cu, images, videos, **kwargs):
    return packed_mrope_positions(stream, cu, grid_tensor(images), grid_tensor(videos), image_token_id=IMAGE,
                                  video_token_id=VIDEO, spatial_merge_size=MERGE, **kwargs)  # fmt: skip


@property_settings(max_examples=150)
@given(st.lists(document, min_size=1, max_size=6), st.integers(0, 2**16))
def test_packed_positions_equal_per_document_positions(docs, seed):
    stream, cu, images, videos, per_doc = build(docs, seed)
    expected = torch.cat([builtin_rope_index(ids, imgs, vids) for ids, imgs, vids in per_doc], dim=1)
    assert torch.equal(positions(stream, cu, images, videos), expected)
    # the processor's token types, when given, change nothing
    assert torch.equal(positions(stream, cu, images, videos, mm_token_type_ids=token_types(stream)), expected)


CORRUPTIONS = {
    "token_short": r"tokens \(a run of|grids without tokens",  # a one-token run disappears entirely
    "extra_grid": "grids without tokens",
    "missing_grid": "has no grid",
    "boundary_inside": "may not cross",
    "token_types": "mm_token_type_ids contradict",
}


@property_settings(max_examples=100)
@given(st.lists(document, min_size=1, max_size=4), st.sampled_from(sorted(CORRUPTIONS)), st.data())
def test_corrupted_placements_raise(docs, corruption, data):
    stream, cu, images, videos, _ = build(docs)
    vision = torch.nonzero((stream == IMAGE) | (stream == VIDEO)).flatten().tolist()
    assume(vision)  # a text-only batch has nothing to corrupt (its positions are covered above)
    kwargs = {}
    grids = {"image": images, "video": videos}
    which = "image" if images and (not videos or data.draw(st.booleans())) else "video"
    if corruption == "token_short":
        drop = data.draw(st.sampled_from(vision))
        stream = torch.cat([stream[:drop], stream[drop + 1 :]])
        cu = torch.where(cu > drop, cu - 1, cu)
        assume(not bool((cu[1:] == cu[:-1]).any()))  # the dropped token was a whole document: not this case
    elif corruption == "extra_grid":
        grids[which] = grids[which] + [[1, MERGE, MERGE]]
    elif corruption == "missing_grid":
        grids[which] = grids[which][:-1]
    elif corruption == "boundary_inside":
        # a boundary between two tokens of one run (runs of one token have no inside)
        inside = [i for i in vision[1:] if int(stream[i - 1]) == int(stream[i]) and i not in cu.tolist()]
        assume(inside)
        cut = data.draw(st.sampled_from(inside))
        cu = torch.sort(torch.cat([cu, torch.tensor([cut])])).values
    else:
        types = token_types(stream)
        token = data.draw(st.sampled_from(vision))
        types[token] = 3 - types[token]  # image typed video or video typed image (typed 0 it is a text token)
        kwargs["mm_token_type_ids"] = types
    with pytest.raises(ValueError, match=CORRUPTIONS[corruption]):
        positions(stream, cu, grids["image"], grids["video"], **kwargs)
