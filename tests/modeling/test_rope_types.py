"""Rope as transformers' built-in Qwen3.5 reads it: a config without `mrope_section` (dense, MoE, vision-language)
and every scaled rope type the built-in implements, logits equal to the built-in's (CPU, fp32, tiny models); and the
positions and angles the rotary embedding gets for packed documents in every packing form, written out."""

from __future__ import annotations

import pytest
import torch
from conftest import builtin_pair, packed_model, requires_builtin_qwen35, tiny_kwargs
from vl_tiny import builtin_vl_pair, grid_tensor, make_document, pixels_for, token_types

from qwen35_packed import Qwen3_5MoePackedForCausalLM, Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM

# What `Qwen3_5TextConfig(head_dim=32)` saves: no mrope_section; the rotary half-dim is 4, not the 32 that the
# official sections [11, 11, 10] (which the built-in then uses) sum to.
NO_SECTIONS = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
MAX_POSITIONS = 48  # the longer input below runs past it, where dynamic / longrope / yarn scaling matters
BASE = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
SCALED = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 24,
        "short_factor": [1.0, 1.1, 1.2, 1.3, 1.0, 1.0, 1.0, 1.0],
        "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def builtin_text_pair(kind: str, rope: dict, **overrides):
    return builtin_pair(kind, rope_parameters=dict(rope), **overrides)


def _logits(model, length: int, seed: int = 3) -> torch.Tensor:
    ids = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@requires_builtin_qwen35
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_text_config_without_mrope_section_matches_builtin(kind, tmp_path):
    ref, _ = builtin_text_pair(kind, NO_SECTIONS)
    ref.save_pretrained(tmp_path)  # the built-in's file, read by our class
    assert "mrope_section" not in ref.config.to_dict()["rope_parameters"]
    ours = (Qwen3_5MoePackedForCausalLM if kind == "moe" else Qwen3_5PackedForCausalLM).from_pretrained(tmp_path)
    assert (_logits(ours.eval(), 40) - _logits(ref, 40)).abs().max() <= 1e-4


@requires_builtin_qwen35
def test_vision_language_without_mrope_section_matches_builtin():
    text = dict(tiny_kwargs("dense"), rope_parameters=dict(NO_SECTIONS))
    ref, ours = builtin_vl_pair("dense", text_config=text)
    gen = torch.Generator().manual_seed(1)
    ids, images, _ = make_document(gen, 2)
    ids = ids.unsqueeze(0)
    inputs = dict(
        input_ids=ids,
        pixel_values=pixels_for(images, gen),
        image_grid_thw=grid_tensor(images),
        mm_token_type_ids=token_types(ids),
    )
    with torch.no_grad():
        assert (ours(**inputs).logits - ref(**inputs, use_cache=False).logits).abs().max() <= 1e-4


@requires_builtin_qwen35
@pytest.mark.parametrize("rope_type", sorted(SCALED))
def test_scaled_rope_matches_builtin(rope_type):
    rope = dict(BASE, **SCALED[rope_type])
    ref, ours = builtin_text_pair("dense", rope, max_position_embeddings=MAX_POSITIONS)
    _, plain = builtin_text_pair("dense", dict(BASE, rope_type="default"), max_position_embeddings=MAX_POSITIONS)
    for length in (20, 2 * MAX_POSITIONS + 5):
        assert (_logits(ours, length) - _logits(ref, length)).abs().max() <= 1e-4, length
    # the scaling is in effect: the long input's logits are far from those of unscaled rope
    assert (_logits(ours, 2 * MAX_POSITIONS + 5) - _logits(plain, 2 * MAX_POSITIONS + 5)).abs().max() > 1e-2


def test_scaled_rope_packed_equals_per_document():
    """Static scaled types keep packed == per-document (dynamic / longrope follow the call's longest sequence)."""
    config = Qwen3_5PackedConfig(
        **dict(
            tiny_kwargs("dense"), rope_parameters=dict(BASE, **SCALED["yarn"]), max_position_embeddings=MAX_POSITIONS
        )
    )
    torch.manual_seed(0)
    model = Qwen3_5PackedForCausalLM(config).eval()
    docs = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (30, 70)]
    cu = torch.tensor([0, 30, 100])
    with torch.no_grad():
        packed = model(input_ids=torch.cat(docs)[None], cu_seqlens=cu).logits[0]
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    assert (packed - alone).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------ positions of packed documents

# One row of three documents (3, 1 and 4 tokens) in every packing form, and a padded batch (left and right padding, a
# row of two documents by restarting position_ids): the positions rope gets on the packed stream, written out.
ROW_POSITIONS = [0, 1, 2, 0, 0, 1, 2, 3]
PADDED_POSITIONS = [0, 1, 2, 3, 4] + [0, 1, 2, 0, 1, 2, 3]
PACKING_FORMS = {
    "cu_seqlens": dict(cu_seqlens=torch.tensor([0, 3, 4, 8])),
    "cu_seq_lens_q/k": dict(
        cu_seq_lens_q=torch.tensor([0, 3, 4, 8]), cu_seq_lens_k=torch.tensor([0, 3, 4, 8]), max_length_q=4
    ),
    "position_ids": dict(position_ids=torch.tensor([ROW_POSITIONS])),
    "seq_idx": dict(seq_idx=torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2]])),
    "padded": dict(
        attention_mask=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0]]),
        position_ids=torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3, 0]]),
    ),
}


def _rope_call(model, rotary, **inputs):
    """(positions, cos, sin) of the one call the model makes to the rotary embedding `rotary` (its `cos_sin` on
    the packed stream) in a forward of `model`."""
    seen = []
    original = rotary.cos_sin

    def recorded(position_ids, dtype):
        cos, sin = original(position_ids, dtype)
        seen.append((position_ids.clone(), cos, sin))
        return cos, sin

    rotary.cos_sin = recorded
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        del rotary.cos_sin
    (call,) = seen
    return call


def _packing_inputs(form):
    kwargs = dict(PACKING_FORMS[form])
    rows = kwargs["attention_mask"].shape[0] if "attention_mask" in kwargs else 1
    ids = torch.randint(0, 100, (rows, 8), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, **kwargs), PADDED_POSITIONS if form == "padded" else ROW_POSITIONS


def _document_lengths(positions):
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return [b - a for a, b in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize("form", sorted(PACKING_FORMS))
def test_rope_positions_restart_at_every_document(form):
    """Under the default rope, which is relative (a document whose positions do not restart still gets the logits of
    a lone document, so logits alone cannot tell), the rotary embedding gets positions counting from 0 in every
    document, and each document the cos / sin it gets alone: angle 0 (cos 1, sin 0) at each document start."""
    model = packed_model("dense")
    assert model.config.rope_parameters["rope_type"] == "default"
    rotary = model.model.rotary_emb
    inputs, expected = _packing_inputs(form)
    positions, cos, sin = _rope_call(model, rotary, **inputs)
    assert positions.tolist() == expected
    starts = torch.tensor(expected) == 0
    assert torch.equal(cos[starts], torch.ones_like(cos[starts])) and not sin[starts].any()
    offset = 0
    for length in _document_lengths(expected):
        _, alone_cos, alone_sin = _rope_call(model, rotary, input_ids=torch.zeros(1, length, dtype=torch.long))
        assert torch.equal(cos[offset : offset + length], alone_cos), (offset, length)
        assert torch.equal(sin[offset : offset + length], alone_sin), (offset, length)
        offset += length


@pytest.mark.parametrize("form", ["cu_seqlens", "padded"])
def test_vision_language_rope_positions_restart_at_every_document(form):
    """The composite model's 3D (t, h, w) positions of text documents: each axis restarts at 0 in every document."""
    from vl_tiny import packed_vl_model

    model = packed_vl_model("dense")
    inputs, expected = _packing_inputs(form)
    positions, _, _ = _rope_call(model, model.model.language_model.rotary_emb, **inputs)
    assert positions.tolist() == [expected] * 3


@requires_builtin_qwen35
@pytest.mark.parametrize("rope_name", ["default", "linear", "dynamic", "yarn"])
def test_rotary_module_has_the_builtin_interface(rope_name):
    """`model.rotary_emb(x, position_ids)` with 2D or 3D (t, h, w) positions gives the built-in's cos / sin, and
    `inv_freq` its buffer: tools and transformers' rope tests read the module that way."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rope = {**BASE, "rope_type": "default", "mrope_section": [3, 3, 2]}
    if rope_name != "default":
        rope = {**rope, **SCALED[rope_name]}
    kwargs = {**tiny_kwargs("dense"), "rope_parameters": rope, "max_position_embeddings": MAX_POSITIONS}
    ours = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**kwargs)).model.rotary_emb
    ref = Qwen3_5TextRotaryEmbedding(transformers.Qwen3_5TextConfig(**kwargs))
    flat = torch.arange(2 * 60).view(2, 60)
    grid = torch.stack([flat, flat // 3, flat % 7])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(1, dtype=dtype)
        # 2D positions are text positions on every axis: built-ins before 5.19 take only the 3D form of them
        for positions, ref_positions in ((flat, flat.expand(3, -1, -1)), (grid, grid)):
            for got, expected in zip(ours(x, positions), ref(x, ref_positions)):
                assert got.dtype == expected.dtype == dtype and got.shape == expected.shape == (2, 60, 16)
                if dtype == torch.float32:  # (bf16 may round an fp32 ulp apart the other way)
                    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ours.inv_freq, ref.original_inv_freq, rtol=0, atol=0)
