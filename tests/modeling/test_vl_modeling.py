"""Vision-language classes: parity with transformers' built-in composite classes, packed == per-document with
images, text-only batches, freeze_vision, the FSDP dummy vision pass, configs, and bad input (fp32, CPU)."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from conftest import packed_model, requires_builtin_qwen35
from packaging.version import Version
from vl_tiny import (
    IMAGE,
    PAD,
    PATCH_DIM,
    VIDEO,
    VISION_END,
    VISION_START,
    builtin_vl_pair,
    composite_kwargs,
    grid_tensor,
    image_tokens,
    make_document,
    our_vl_model,
    packed_vl_model,
    pixels_for,
    token_types,
    video_tokens,
)

from qwen35_packed.modeling.outputs import CACHE_FIELD

REFERENCE_DIR = Path(
    os.environ.get("QWEN35_REFERENCE_DIR", Path(__file__).resolve().parents[3] / "shared" / "reference" / "qwen3.5")
)


def _official_config(name: str) -> dict:
    """The config.json of the official checkpoint `name` (skips the test where the reference configs are absent)."""
    path = REFERENCE_DIR / name / "config.json"
    if not path.is_file():
        pytest.skip("reference configs not available")
    return json.loads(path.read_text())


def _padded_batch(rows, left: bool):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        start = width - len(row) if left else 0
        ids[i, start : start + len(row)] = row
        mask[i, start : start + len(row)] = 1
    return ids, mask


@pytest.mark.parametrize("layout", ["unpadded-or-right", "left-padded", "with-holes"])
def test_logits_match_builtin_with_images(kind, layout):
    ref, ours = builtin_vl_pair(kind)
    gen = torch.Generator().manual_seed(1)
    docs = [make_document(gen, n) for n in (2, 1, 0)]
    rows = [d[0] for d in docs]
    images = [g for d in docs for g in d[1]]
    ids, mask = _padded_batch(rows, layout != "unpadded-or-right")
    if layout == "with-holes":  # two text tokens masked inside each row that has them
        vision = torch.isin(ids, torch.tensor([IMAGE, VIDEO, VISION_START, VISION_END]))
        for row in range(ids.shape[0]):
            text = torch.nonzero(mask[row].bool() & ~vision[row]).flatten()
            mask[row, text[2:4]] = 0
    pixels, grid = pixels_for(images, gen), grid_tensor(images)
    inputs = dict(
        input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=token_types(ids)
    )
    with torch.no_grad():
        expected = ref(**inputs, use_cache=False).logits
        got = ours(**inputs).logits
        no_image = ours(**dict(inputs, pixel_values=torch.zeros_like(pixels))).logits
    real = mask.bool()
    diff = (got[real] - expected[real]).abs().max().item()
    assert diff <= 1e-4, diff
    assert got[~real].abs().max().item() == 0.0 if (~real).any() else True
    # The images matter: replacing them moves the logits far more than the tolerance.
    assert (no_image[real] - got[real]).abs().max().item() > 1e-2


def test_logits_match_builtin_with_videos():
    ref, ours = builtin_vl_pair("dense")
    inputs = _images_and_videos_row(torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(**inputs, use_cache=False).logits
        got = ours(**inputs).logits
    assert (got - expected).abs().max().item() <= 1e-4


def _images_and_videos_row(gen):
    """One row with a video, an image and another video, and the forward's vision inputs."""
    videos, image = [[2, 4, 2], [1, 2, 4]], [1, 4, 4]
    ids = torch.tensor(
        [3, 4] + video_tokens(videos[0], gen) + [5] + image_tokens(image) + [6] + video_tokens(videos[1], gen) + [7, 8]
    ).unsqueeze(0)
    return dict(
        input_ids=ids,
        pixel_values=pixels_for([image], gen),
        image_grid_thw=grid_tensor([image]),
        pixel_values_videos=pixels_for(videos, gen),
        video_grid_thw=grid_tensor(videos),
        mm_token_type_ids=token_types(ids),
    )


def test_vision_outputs_equal_the_builtin(kind):
    """`image_outputs` / `video_outputs` hold what the built-in's hold (transformers >= 5.25 returns them): the tower's
    last hidden state, its merged features split per image / video, and on request every block's hidden state and
    attention sub-layer output; a forward without images has none."""
    ref, ours = builtin_vl_pair(kind)
    inputs = _images_and_videos_row(torch.Generator().manual_seed(2))
    ref.set_attn_implementation("eager")  # the built-in records vision attention outputs eagerly only
    with torch.no_grad():
        expected = ref(**inputs, use_cache=False, output_hidden_states=True, output_attentions=True)
        got = ours(**inputs, output_hidden_states=True, output_attentions=True)
        plain = ours.model(**inputs)
        text_only = ours(input_ids=inputs["input_ids"][:, :2])
    if getattr(expected, "image_outputs", None) is None:
        pytest.skip(f"transformers {transformers.__version__}'s built-in returns no image_outputs")
    for name, items in (("image_outputs", 1), ("video_outputs", 2)):
        want, have = getattr(expected, name), getattr(got, name)
        assert len(have.pooler_output) == len(want.pooler_output) == items
        pairs = [(have.last_hidden_state, want.last_hidden_state)]
        for field in ("pooler_output", "hidden_states", "attentions"):
            assert len(getattr(have, field)) == len(getattr(want, field)), (name, field)
            pairs += list(zip(getattr(have, field), getattr(want, field)))
        for mine, theirs in pairs:
            assert mine.shape == theirs.shape and (mine - theirs).abs().max().item() <= 1e-5, name
        unrecorded = getattr(plain, name)
        assert unrecorded.hidden_states is None and unrecorded.attentions is None
        assert torch.equal(unrecorded.last_hidden_state, have.last_hidden_state)
    assert text_only.image_outputs is None and text_only.video_outputs is None


def test_vision_outputs_hold_the_features_the_decoder_reads():
    """The merged features in `image_outputs` / `video_outputs`, written onto the placeholder tokens' embeddings and
    run with the 3D positions the forward used, give the forward's logits: they are the features, in the order,
    that the decoder read. The tuple form holds them as tuples (as transformers' multimodal outputs do)."""
    model = packed_vl_model("dense")
    inputs = _images_and_videos_row(torch.Generator().manual_seed(5))
    ids = inputs["input_ids"]
    with torch.no_grad():
        out = model(**inputs)
        embeds = model.get_input_embeddings()(ids)
        for token, name in ((IMAGE, "image_outputs"), (VIDEO, "video_outputs")):
            features = torch.cat(getattr(out, name).pooler_output)
            embeds[ids == token] = features
        rebuilt = model(inputs_embeds=embeds, position_ids=out.rope_position_ids).logits
        as_tuple = model(**inputs, return_dict=False)
    assert (rebuilt - out.logits).abs().max().item() <= 1e-5
    image_tuple = as_tuple[-2]
    assert isinstance(image_tuple, tuple) and torch.equal(image_tuple[0], out.image_outputs.last_hidden_state)


def _processor():
    """The real Qwen3VLProcessor: its image processor built from the reference preprocessor_config.json (patch
    size and pixel limits scaled down to the tiny vision tower), and a tiny local word-level tokenizer with the
    Qwen3.5 vision special tokens. The video processor needs torchvision, which CI does not install: images only."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    vocab = {f"w{i}": i for i in range(100)}
    vocab.update(
        {
            "<|image_pad|>": IMAGE,
            "<|video_pad|>": VIDEO,
            "<|vision_start|>": VISION_START,
            "<|vision_end|>": VISION_END,
            "<|endoftext|>": PAD,
            "[UNK]": 125,
        }
    )
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    )
    reference = json.loads((REFERENCE_DIR / "Qwen3.5-0.8B" / "preprocessor_config.json").read_text())
    assert reference["merge_size"] == 2 and reference["temporal_patch_size"] == 2
    kwargs = {k: v for k, v in reference.items() if k not in ("processor_class", "image_processor_type")}
    kwargs.update(patch_size=4, size={"shortest_edge": 8 * 8, "longest_edge": 40 * 40})
    image_processor = Qwen2VLImageProcessorPil(**kwargs)

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, argument):
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    return ImageOnlyQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


@requires_builtin_qwen35
@pytest.mark.skipif(not (REFERENCE_DIR / "Qwen3.5-0.8B").is_dir(), reason="reference configs not available")
def test_processor_batch_matches_builtin(kind):
    import numpy as np

    processor = _processor()
    rng = np.random.default_rng(0)
    images = [(rng.random((h, w, 3)) * 255).astype(np.uint8) for h, w in ((24, 40), (30, 17), (16, 16))]
    texts = [
        "w1 w2 <|vision_start|><|image_pad|><|vision_end|> w3 <|vision_start|><|image_pad|><|vision_end|> w4",
        "w5 w6 w7",
        "w8 <|vision_start|><|image_pad|><|vision_end|> w9 w10",
    ]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    assert batch["image_grid_thw"].shape == (3, 3) and batch["pixel_values"].shape[1] == PATCH_DIM
    ref, ours = builtin_vl_pair(kind, seed=5)
    inputs = {
        k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    }
    with torch.no_grad():
        expected = ref(**inputs, use_cache=False).logits
        got = ours(**inputs).logits
    real = batch["attention_mask"].bool()
    assert (got[real] - expected[real]).abs().max().item() <= 1e-4


def _documents(seed: int, image_counts):
    gen = torch.Generator().manual_seed(seed)
    docs = [make_document(gen, n, min_text=1) for n in image_counts]
    pixels = [pixels_for(d[1], gen) for d in docs]
    return docs, pixels


def _cat(values):
    values = [v for v in values if v is not None]
    return torch.cat(values) if values else None


@pytest.mark.parametrize(
    "kind, form", [("dense", "cu_seqlens"), ("dense", "position_ids"), ("dense", "padded-rows"), ("moe", "cu_seqlens")]
)
def test_packed_equals_per_document_with_images(kind, form):
    model = packed_vl_model(kind, seed=2)
    counts = [0, 2, 1, 0, 2, 0, 3, 1]
    docs, pixels = _documents(3, counts)
    per_doc = []
    with torch.no_grad():
        for (ids, images, _), pix in zip(docs, pixels):
            per_doc.append(
                model(
                    input_ids=ids.unsqueeze(0),
                    pixel_values=pix,
                    image_grid_thw=grid_tensor(images),
                    labels=ids.unsqueeze(0),
                )
            )
    all_pixels = _cat(pixels)
    all_grids = grid_tensor([g for d in docs for g in d[1]])
    lengths = [len(d[0]) for d in docs]
    if form == "padded-rows":
        ids, mask = _padded_batch([d[0] for d in docs], left=True)
        kwargs = dict(input_ids=ids, attention_mask=mask)
    else:
        ids = torch.cat([d[0] for d in docs]).unsqueeze(0)
        if form == "cu_seqlens":
            kwargs = dict(input_ids=ids, cu_seqlens=torch.tensor([0] + lengths).cumsum(0))
        else:
            kwargs = dict(input_ids=ids, position_ids=torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0))
    with torch.no_grad():
        out = model(**kwargs, pixel_values=all_pixels, image_grid_thw=all_grids, labels=kwargs["input_ids"])
    if form == "padded-rows":
        got = [out.logits[i, mask[i].bool()] for i in range(len(docs))]
    else:
        got = list(out.logits[0].split(lengths))
    worst = max((g - d.logits[0]).abs().max().item() for g, d in zip(got, per_doc))
    assert worst <= 1e-5, worst
    # The loss is token-weighted over documents: each document has len - 1 targets.
    expected_loss = sum(d.loss * (n - 1) for d, n in zip(per_doc, lengths)) / sum(n - 1 for n in lengths)
    assert abs(out.loss.item() - expected_loss.item()) <= 1e-5


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_shift_labels_through_kwargs_give_the_labels_loss(kind):
    """`shift_labels` is taken through **kwargs as in the text classes: the Trainer's label names (read from the
    forward's signature) are then only `labels`, so its evaluation finds the labels; with images and packed
    documents, `shift_labels` (each document's next tokens, -100 at its end) give the loss of `labels`."""
    model = packed_vl_model(kind, seed=3)
    assert transformers.utils.find_labels(type(model)) == ["labels"]
    docs, pixels = _documents(6, [1, 0, 2])
    ids = torch.cat([d[0] for d in docs]).unsqueeze(0)
    shifted = torch.cat([torch.cat([d[0][1:], torch.tensor([-100])]) for d in docs]).unsqueeze(0)
    lengths = [len(d[0]) for d in docs]
    inputs = dict(
        input_ids=ids,
        cu_seqlens=torch.tensor([0] + lengths).cumsum(0),
        pixel_values=_cat(pixels),
        image_grid_thw=grid_tensor([g for d in docs for g in d[1]]),
    )
    with torch.no_grad():
        expected = model(**inputs, labels=ids).loss
        got = model(**inputs, shift_labels=shifted).loss
    assert torch.equal(got, expected), (got.item(), expected.item())


def test_packed_gradients_equal_sum_of_per_document_gradients():
    model = packed_vl_model("dense", seed=4)
    model.train()
    docs, pixels = _documents(5, [2, 0, 1])
    lengths = [len(d[0]) for d in docs]
    targets = sum(n - 1 for n in lengths)
    for (ids, images, _), pix in zip(docs, pixels):
        out = model(
            input_ids=ids.unsqueeze(0),
            pixel_values=pix,
            image_grid_thw=grid_tensor(images),
            labels=ids.unsqueeze(0),
            num_items_in_batch=targets,
        )
        out.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ids = torch.cat([d[0] for d in docs]).unsqueeze(0)
    out = model(
        input_ids=ids,
        cu_seqlens=torch.tensor([0] + lengths).cumsum(0),
        pixel_values=_cat(pixels),
        image_grid_thw=grid_tensor([g for d in docs for g in d[1]]),
        labels=ids,
    )
    out.loss.backward()
    visual_grads = 0
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=1e-6, rtol=1e-4), name
        visual_grads += name.startswith("model.visual.") and bool(param.grad.abs().sum() > 0)
    assert visual_grads == len([n for n, _ in model.named_parameters() if n.startswith("model.visual.")])


def test_text_only_batch_equals_text_model(kind):
    """No pixel values needed; the language part is the packed text decoder itself (loss and MoE aux loss too)."""
    text_model = packed_model(kind, seed=6)
    # (router_aux_loss_coef stays 0: adding coef * aux_loss is the shared lm_head_outputs code, tested on the text
    # model, whose test reads the once-per-process warning that a coefficient > 0 would use up here.)
    vl = our_vl_model(kind)
    state = {
        f"model.language_model.{k[len('model.') :]}" if k.startswith("model.") else k: v
        for k, v in text_model.state_dict().items()
    }
    missing, unexpected = vl.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing)
    vl.eval()
    ids = torch.randint(0, 100, (1, 60), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 25, 60])
    router = {"output_router_logits": True} if kind == "moe" else {}
    with torch.no_grad():
        expected = text_model(ids, cu_seqlens=cu, labels=ids, use_cache=False, **router)
        got = vl(input_ids=ids, cu_seqlens=cu, labels=ids, **router)
    assert (got.logits - expected.logits).abs().max().item() <= 1e-6
    assert abs(got.loss.item() - expected.loss.item()) <= 1e-6
    if kind == "moe":
        assert got.aux_loss is not None and abs(got.aux_loss.item() - expected.aux_loss.item()) <= 1e-6
        assert len(got.router_logits) == len(expected.router_logits)


def test_eval_forward_returns_a_cache_by_the_config_as_the_builtin(kind):
    """Without use_cache an eval forward of one document per row returns a cache (the config's use_cache, as the
    built-in's does) that the next step continues exactly; a training forward returns none."""
    ref, ours = builtin_vl_pair(kind)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    step = torch.randint(3, 100, (2, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(input_ids=ids)
        got = ours(input_ids=ids)
        assert getattr(expected, CACHE_FIELD) is not None and getattr(got, CACHE_FIELD) is not None
        expected_step = ref(input_ids=step, **{CACHE_FIELD: getattr(expected, CACHE_FIELD)}).logits
        got_step = ours(input_ids=step, **{CACHE_FIELD: getattr(got, CACHE_FIELD)}).logits
    assert (got_step - expected_step).abs().max().item() <= 1e-4
    assert getattr(ours.train()(input_ids=ids), CACHE_FIELD) is None


def test_dummy_vision_pass_contributes_zero_and_gives_zero_grads():
    plain = packed_vl_model("dense", seed=7)
    dummy = our_vl_model("dense", vision_dummy_pass=True)
    dummy.load_state_dict(plain.state_dict())
    for model in (plain, dummy):  # the logits of training forwards are compared
        model.config.text_config.return_logits_with_loss = True
        model.train()
    ids = torch.randint(0, 100, (2, 30), generator=torch.Generator().manual_seed(1))
    out_plain = plain(input_ids=ids, labels=ids)
    out_dummy = dummy(input_ids=ids, labels=ids)
    assert torch.equal(out_plain.logits, out_dummy.logits)
    assert out_plain.loss.item() == out_dummy.loss.item()
    out_plain.loss.backward()
    out_dummy.loss.backward()
    visual = [(n, p) for n, p in dummy.named_parameters() if n.startswith("model.visual.")]
    assert visual and all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for _, p in visual)
    assert all(p.grad is None for n, p in plain.named_parameters() if n.startswith("model.visual."))
    plain_grads = dict(plain.named_parameters())
    for name, param in dummy.named_parameters():
        if not name.startswith("model.visual."):
            assert torch.equal(param.grad, plain_grads[name].grad), name


def test_freeze_vision():
    model = packed_vl_model("dense", seed=8)
    frozen = our_vl_model("dense", freeze_vision=True)
    frozen.load_state_dict(model.state_dict())
    for m in (model, frozen):  # the logits of training forwards are compared
        m.config.text_config.return_logits_with_loss = True
    assert not any(p.requires_grad for p in frozen.model.visual.parameters())
    assert all(p.requires_grad for p in frozen.model.language_model.parameters())
    docs, pixels = _documents(9, [2])
    (ids, images, _), pix = docs[0], pixels[0]
    inputs = dict(
        input_ids=ids.unsqueeze(0), pixel_values=pix, image_grid_thw=grid_tensor(images), labels=ids.unsqueeze(0)
    )
    frozen.train()
    out = frozen(**inputs)
    out.loss.backward()
    assert all(p.grad is None for p in frozen.model.visual.parameters())
    assert frozen.lm_head.weight.grad is not None
    with torch.no_grad():
        assert torch.equal(out.logits, model.train()(**inputs).logits)
    # Frozen + dummy pass on a text-only batch: the tower runs, nothing gets a gradient, the output is unchanged.
    frozen.zero_grad(set_to_none=True)
    frozen.config.vision_dummy_pass = True
    text = dict(input_ids=ids.unsqueeze(0).clamp(max=99), labels=ids.unsqueeze(0).clamp(max=99))
    with_dummy = frozen(**text)
    with_dummy.loss.backward()
    assert all(p.grad is None for p in frozen.model.visual.parameters())
    frozen.config.vision_dummy_pass = False
    with torch.no_grad():
        assert torch.equal(with_dummy.logits, frozen(**text).logits)
    frozen.set_vision_frozen(False)
    assert all(p.requires_grad for p in frozen.model.visual.parameters()) and not frozen.config.freeze_vision


def test_placeholder_tokens_without_pixels_are_text_tokens_as_in_the_builtin(kind, caplog, monkeypatch):
    """No images given: the built-in embeds image / video placeholder tokens as text tokens with text positions;
    ours gives the same logits (left padding included) and says so once."""
    from qwen35_packed.modeling import utils

    monkeypatch.setattr(utils, "_logged_once", set())  # the line is said once per process
    ref, ours = builtin_vl_pair(kind)
    ids = torch.tensor([[PAD, PAD, 5, IMAGE, IMAGE, 7, VIDEO, 9], [3, IMAGE, 4, 5, 6, 7, 8, 9]])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        expected = ref(input_ids=ids[1:], use_cache=False).logits
        with caplog.at_level("WARNING"):
            got = ours(input_ids=ids, attention_mask=mask).logits
        alone = ours(input_ids=ids[:1, 2:]).logits
        text = ours.model.language_model  # the same tokens through the text decoder alone
        as_text = ours.lm_head(text(input_ids=ids[1:]).last_hidden_state)
    torch.testing.assert_close(got[1:], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1:], as_text, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0, 2:], alone[0], rtol=0, atol=1e-5)
    assert "embedded and positioned as text tokens" in caplog.text


@pytest.mark.parametrize(
    "case, message",
    [
        ("grid_without_tokens", "grids without tokens"),
        ("count_mismatch", "tokens, but its token run"),
        ("pixels_without_grid", "pixel_values was given without image_grid_thw"),
        ("grid_without_pixels", "image_grid_thw was given without pixel_values"),
        ("pixel_rows_mismatch", "patches but the grids"),
        ("pixel_width", "must be \\[num_patches"),
        ("embeds_without_placeholders", "grids without tokens"),
        ("type_ids", "mm_token_type_ids contradict"),
        ("use_cache_packed", "use_cache=True needs one document per row"),
    ],
)
def test_bad_input(case, message):
    model = our_vl_model("dense").eval()
    gen = torch.Generator().manual_seed(0)
    grids = [[1, 4, 4], [1, 2, 4]]
    ids = torch.tensor([1] + image_tokens(grids[0]) + [2, 3] + image_tokens(grids[1]) + [4]).unsqueeze(0)
    kwargs = dict(input_ids=ids, pixel_values=pixels_for(grids, gen), image_grid_thw=grid_tensor(grids))
    if case == "grid_without_tokens":
        extra = grids + [[1, 2, 2]]
        kwargs.update(pixel_values=pixels_for(extra, gen), image_grid_thw=grid_tensor(extra))
    elif case == "count_mismatch":
        kwargs.update(
            pixel_values=pixels_for([[1, 4, 4], [1, 4, 4]], gen), image_grid_thw=grid_tensor([[1, 4, 4], [1, 4, 4]])
        )
    elif case == "pixels_without_grid":
        kwargs.update(image_grid_thw=None)
    elif case == "grid_without_pixels":
        kwargs.update(pixel_values=None)
    elif case == "pixel_rows_mismatch":
        kwargs.update(pixel_values=kwargs["pixel_values"][:-1])
    elif case == "pixel_width":
        kwargs.update(pixel_values=kwargs["pixel_values"][:, :-1])
    elif case == "embeds_without_placeholders":  # images given, no embedding equals the image token's
        kwargs.update(input_ids=None, inputs_embeds=torch.zeros(1, ids.shape[1], 64))
    elif case == "type_ids":
        kwargs.update(mm_token_type_ids=token_types(ids) * 2)  # image tokens typed video (typed 0: text tokens)
    elif case == "use_cache_packed":
        split = 1 + len(image_tokens(grids[0]))  # two documents, one image each
        kwargs.update(use_cache=True, cu_seqlens=torch.tensor([0, split, ids.shape[1]]))
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(**kwargs)


@requires_builtin_qwen35
def test_config_classes_and_round_trip(tmp_path):
    from qwen35_packed.configuration import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig
    from qwen35_packed.configuration.configuration_qwen3_5_packed_vl import (
        Qwen3_5MoePackedVLConfig,
        Qwen3_5PackedVLConfig,
    )

    for cls, builtin, text_cls, model_type in (
        (Qwen3_5PackedVLConfig, transformers.Qwen3_5Config, Qwen3_5PackedConfig, "qwen3_5"),
        (Qwen3_5MoePackedVLConfig, transformers.Qwen3_5MoeConfig, Qwen3_5MoePackedConfig, "qwen3_5_moe"),
    ):
        kind = "moe" if "Moe" in cls.__name__ else "dense"
        config = cls(**composite_kwargs(kind), freeze_vision=True)
        assert isinstance(config, builtin) and config.model_type == model_type
        assert type(config.text_config) is text_cls
        config.save_pretrained(tmp_path / kind)
        loaded = cls.from_pretrained(tmp_path / kind)
        assert type(loaded.text_config) is text_cls and loaded.freeze_vision is True
        assert loaded.text_config.rope_parameters == config.text_config.rope_parameters
        assert loaded.vision_config.to_dict() == config.vision_config.to_dict()


@requires_builtin_qwen35
@pytest.mark.parametrize("name", ["Qwen3.5-0.8B", "Qwen3.5-35B-A3B"])
def test_reference_configs_give_builtin_keys_and_shapes(name):
    data = _official_config(name)
    from qwen35_packed.configuration.configuration_qwen3_5_packed_vl import (
        Qwen3_5MoePackedVLConfig,
        Qwen3_5PackedVLConfig,
    )
    from qwen35_packed.modeling import Qwen3_5MoePackedForConditionalGeneration, Qwen3_5PackedForConditionalGeneration

    moe = data["model_type"] == "qwen3_5_moe"
    ours_cls = Qwen3_5MoePackedForConditionalGeneration if moe else Qwen3_5PackedForConditionalGeneration
    ours_cfg = (Qwen3_5MoePackedVLConfig if moe else Qwen3_5PackedVLConfig)(**data)
    ref_cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    ref_cfg = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(**data)
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in ours_cls(ours_cfg).state_dict().items()}
        ref = {k: tuple(v.shape) for k, v in ref_cls(ref_cfg).state_dict().items()}
    assert ours == ref


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_with_images_equals_the_builtin(cache_implementation):
    """generate() from a left-padded batch with images: the prefill encodes them, decode steps continue the text
    at the prompt's largest MRoPE position + 1; greedy output equals the built-in composite class, with this model's
    dynamic and static cache."""
    ref, ours = builtin_vl_pair("dense")
    grids = [[1, 4, 4], [1, 2, 4]]
    rows = [[5, 6] + image_tokens(grids[0]) + [7, 8, 9], [10] + image_tokens(grids[1]) + [11]]
    width = max(len(r) for r in rows)
    ids, mask = torch.full((2, width), PAD), torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    inputs = dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels_for(grids, torch.Generator().manual_seed(0)),
        image_grid_thw=grid_tensor(grids),
        mm_token_type_ids=token_types(ids),
    )
    for model in (ref, ours):
        model.generation_config.pad_token_id = PAD
    with torch.no_grad():
        expected = ref.generate(
            **inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True
        )
        got = ours.generate(
            **inputs,
            max_new_tokens=6,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            cache_implementation=cache_implementation,
        )
    assert torch.equal(got.sequences, expected.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, expected.scores)) <= 1e-4


def test_one_packing_step_per_forward(monkeypatch):
    """A vision-language forward resolves the packing once: the text decoder runs on the same PackedSequence (no
    second validation of the boundaries, no second host copy of them), for the prefill of generate() too."""
    from qwen35_packed.modeling import generation, packed_batch, packing

    model = packed_vl_model("dense", seed=5)
    docs, pixels = _documents(6, [1, 0, 2])
    lengths = [len(d[0]) for d in docs]
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0])
        return packing.build_packed_sequence(*args, **kwargs)

    for module in (packed_batch, generation):
        monkeypatch.setattr(module, "build_packed_sequence", counting)
    with torch.no_grad():
        model(
            input_ids=torch.cat([d[0] for d in docs]).unsqueeze(0),
            cu_seqlens=torch.tensor([0] + lengths).cumsum(0),
            pixel_values=_cat(pixels),
            image_grid_thw=grid_tensor([g for d in docs for g in d[1]]),
        )
        assert len(calls) == 1, calls
        ids, images, _ = docs[0]
        model.generate(
            ids.unsqueeze(0),
            pixel_values=pixels[0],
            image_grid_thw=grid_tensor(images),
            mm_token_type_ids=token_types(ids.unsqueeze(0)),
            max_new_tokens=2,
            do_sample=False,
        )
    assert len(calls) == 2, calls  # the prefill packs once; the cached steps continue the cache's rows


def _left_padded_image_rows(rows, grids):
    width = max(len(r) for r in rows)
    ids, mask = torch.full((len(rows), width), PAD), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return dict(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels_for(grids, torch.Generator().manual_seed(0)),
        image_grid_thw=grid_tensor(grids),
        mm_token_type_ids=token_types(ids),
    )


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_beam_search_and_several_sequences_with_images_equal_the_builtin(kind):
    """num_beams / num_return_sequences > 1 with images: each row's images are repeated with the row (rows holding
    two, no and one image, left-padded): every returned copy of a row continues it as greedy decoding of that row
    does, and the sequences equal the built-in composite class's (transformers >= 5.23; older built-ins hand the
    copies of a row the wrong images)."""
    ref, ours = builtin_vl_pair(kind, seed=3)
    grids = [[1, 4, 4], [1, 2, 4], [1, 2, 2]]
    rows = [
        [5, 6] + image_tokens(grids[0]) + [7, 8] + image_tokens(grids[1]),
        [10, 11, 12],
        [13] + image_tokens(grids[2]) + [14],
    ]
    inputs = _left_padded_image_rows(rows, grids)
    for model in (ref, ours):
        model.generation_config.pad_token_id = PAD
    with torch.no_grad():
        greedy = ours.generate(**inputs, max_new_tokens=4, do_sample=False)
        copies = ours.generate(**inputs, max_new_tokens=4, do_sample=True, top_k=1, num_return_sequences=2)
    assert torch.equal(copies, greedy.repeat_interleave(2, dim=0))
    if Version(transformers.__version__) < Version("5.23"):
        return
    for options in (
        dict(num_beams=3),
        dict(num_beams=2, num_return_sequences=2),
        dict(do_sample=True, top_k=1, num_return_sequences=2),
        # dict outputs read `attentions` (None) from each step's output
        dict(num_beams=2, return_dict_in_generate=True, output_hidden_states=True, output_scores=True),
        dict(return_dict_in_generate=True, output_hidden_states=True, use_cache=False),
    ):
        with torch.no_grad():
            expected = ref.generate(**inputs, max_new_tokens=4, **options)
            got = ours.generate(**inputs, max_new_tokens=4, **options)
        if options.get("return_dict_in_generate"):
            assert got.attentions is None and len(got.hidden_states) == len(expected.hidden_states) == 4
            expected, got = expected.sequences, got.sequences
        assert torch.equal(got, expected), options


def test_repeat_vision_per_row_repeats_each_rows_images_as_a_group():
    from qwen35_packed.modeling.modeling_qwen3_5_packed_vl import repeat_vision_per_row

    grids = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 4, 4]])  # 1, 2 and 4 tokens; 4, 8 and 16 patches
    pixels = torch.arange(28.0).unsqueeze(-1)
    # row 0: images 0 and 1 (3 tokens), row 1: none, row 2: image 2 (4 tokens)
    got_pixels, got_grids = repeat_vision_per_row(pixels, grids, torch.tensor([3, 0, 4]), 2, 2)
    rows_0 = list(range(12))
    assert got_pixels.squeeze(-1).tolist() == rows_0 + rows_0 + list(range(12, 28)) * 2
    assert got_grids.tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2], [1, 2, 4], [1, 4, 4], [1, 4, 4]]
    with pytest.raises(ValueError, match="row 0's image / video placeholder tokens do not match"):
        repeat_vision_per_row(pixels, grids, torch.tensor([2, 0, 5]), 2, 2)
    with pytest.raises(ValueError, match="1 images / videos have no placeholder tokens"):
        repeat_vision_per_row(pixels, grids, torch.tensor([3, 0, 0]), 2, 2)


def test_inputs_embeds_with_images_equal_input_ids_and_the_builtin():
    """Images with `inputs_embeds` and no `input_ids`: placeholders are found by the image token's embedding (as the
    built-in does) and get their grid positions, so the logits equal those from `input_ids` exactly, and the
    built-in's given the same 3D positions; generate() from the embeddings alone, beams included, continues as from
    the ids."""
    ref, ours = builtin_vl_pair("dense", seed=4)
    grids = [[1, 4, 4], [1, 2, 2]]
    rows = [[5, 6] + image_tokens(grids[0]) + [7, 8, 9], [10] + image_tokens(grids[1]) + [11]]
    inputs = _left_padded_image_rows(rows, grids)
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    embeds = ours.get_input_embeddings()(ids).detach()
    vision = {k: inputs[k] for k in ("attention_mask", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        from_ids = ours(input_ids=ids, **vision).logits
        from_embeds = ours(inputs_embeds=embeds, **vision).logits
        # the outputs carry the built-in's `attentions` field (always None: never formed)
        assert (
            ours(input_ids=ids, **vision).attentions is None and ours.model(input_ids=ids, **vision).attentions is None
        )
        positions = ref.model.get_rope_index(
            ids,
            image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs["attention_mask"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
        )[0]
        builtin = ref(inputs_embeds=embeds, position_ids=positions, **vision).logits
    assert torch.equal(from_embeds, from_ids)
    assert (builtin[mask] - from_embeds[mask]).abs().max().item() <= 1e-4
    ours.generation_config.pad_token_id = PAD
    for options in (dict(), dict(num_beams=2)):
        with torch.no_grad():
            expected = ours.generate(**inputs, max_new_tokens=4, do_sample=False, **options)
            got = ours.generate(inputs_embeds=embeds, **vision, max_new_tokens=4, do_sample=False, **options)
        assert torch.equal(got, expected[:, ids.shape[1] :]), options


@pytest.mark.parametrize("name", ["Qwen3.5-0.8B", "Qwen3.5-35B-A3B"])
def test_default_vision_tower_is_the_smallest_official_one(name):
    """A composite config without vision_config gets the vision tower of the smallest official checkpoint of its
    kind, projecting to the text model's hidden size, so that the default config builds a consistent model."""
    official = _official_config(name)
    from qwen35_packed.configuration.configuration_qwen3_5_packed_vl import (
        Qwen3_5MoePackedVLConfig,
        Qwen3_5PackedVLConfig,
    )
    from qwen35_packed.modeling import Qwen3_5PackedForConditionalGeneration

    cls = Qwen3_5MoePackedVLConfig if official["model_type"] == "qwen3_5_moe" else Qwen3_5PackedVLConfig
    default = cls().vision_config.to_dict()
    fields = [k for k in official["vision_config"] if k not in ("model_type", "deepstack_visual_indexes")]
    official_text_hidden = official["text_config"]["hidden_size"]
    assert {k: default[k] for k in fields if k != "out_hidden_size"} == {
        k: official["vision_config"][k] for k in fields if k != "out_hidden_size"
    }
    assert official["vision_config"]["out_hidden_size"] == official_text_hidden
    assert cls().vision_config.out_hidden_size == cls().text_config.hidden_size
    config = cls(text_config={**official["text_config"], "num_hidden_layers": 1, "layer_types": None})
    assert config.vision_config.out_hidden_size == official_text_hidden
    assert cls(vision_config={"depth": 2}).vision_config.depth == 2  # a given vision_config is used as given
    with torch.device("meta"):
        Qwen3_5PackedForConditionalGeneration(cls(text_config={"num_hidden_layers": 1}))


def test_config_signature_lists_every_composite_field():
    """Tools that build a config from its class signature (transformers' test helpers among them) see every field
    of the composite config, this project's vision options included, with their defaults."""
    import inspect

    from qwen35_packed.configuration.configuration_qwen3_5_packed_vl import (
        Qwen3_5MoePackedVLConfig,
        Qwen3_5PackedVLConfig,
    )

    for cls in (Qwen3_5PackedVLConfig, Qwen3_5MoePackedVLConfig):
        parameters = inspect.signature(cls.__init__).parameters
        defaults = {
            "text_config": None,
            "vision_config": None,
            "image_token_id": 248056,
            "video_token_id": 248057,
            "vision_start_token_id": 248053,
            "vision_end_token_id": 248054,
            "freeze_vision": False,
            "vision_dummy_pass": False,
        }
        assert {name: parameters[name].default for name in defaults if name in parameters} == defaults, cls
