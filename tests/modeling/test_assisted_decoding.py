"""Assisted decoding (transformers 5.25 on: an assistant model or prompt lookup drafts tokens, one forward checks
them) through the cache's past recording and `crop` (qwen35_packed/modeling/cache.py, gated_deltanet.py): greedy
assisted decoding gives the tokens of greedy decoding with drafts rejected along the way; a crop puts the cache back
as if the dropped tokens had never come; what it cannot do is refused."""

import copy

import pytest
import torch
from conftest import HAS_BUILTIN_QWEN35, builtin_pair, packed_model
from transformers import Cache

from qwen35_packed.modeling.cache import Qwen3_5PackedCache
from qwen35_packed.modeling.outputs import CACHE_FIELD

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=-1)
# transformers before 5.25 refuses assisted decoding for models with a recurrent state
ASSISTS_STATEFUL = hasattr(Cache, "get_recurrent_states_to_keep")
needs_assisted_stateful = pytest.mark.skipif(
    not ASSISTS_STATEFUL, reason="transformers before 5.25 has no assisted decoding for stateful models"
)


def _prompt(vocab: int, seed: int) -> torch.Tensor:
    """A prompt with a repeated stretch, so that prompt lookup finds drafts."""
    ids = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, ids[:, 2:8], ids], dim=1)


@pytest.fixture
def crops(monkeypatch) -> list[int]:
    """The token counts of every crop of a Qwen3_5PackedCache during the test."""
    counts, crop = [], Qwen3_5PackedCache.crop

    def recording(cache, tokens_to_remove=0):
        counts.append(-tokens_to_remove)
        return crop(cache, tokens_to_remove)

    monkeypatch.setattr(Qwen3_5PackedCache, "crop", recording)
    return counts


@needs_assisted_stateful
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize(
    "drafts",
    ["assistant", "prompt_lookup", "assistant_static", "prompt_lookup_static"],
)
def test_greedy_assisted_decoding_gives_the_tokens_of_greedy_decoding(kind, drafts, crops):
    model, assistant = packed_model(kind, seed=0), packed_model(kind, seed=7)  # the assistant's drafts often miss
    options = {
        "assistant": dict(assistant_model=assistant),
        "prompt_lookup": dict(prompt_lookup_num_tokens=4),
        "assistant_static": dict(assistant_model=assistant, cache_implementation="static"),
        "prompt_lookup_static": dict(prompt_lookup_num_tokens=4, cache_implementation="static"),
    }[drafts]
    with torch.no_grad():
        for seed in range(3):
            prompt = _prompt(model.config.vocab_size, seed)
            expected = model.generate(prompt, max_new_tokens=24, **GREEDY)
            crops.clear()
            got = model.generate(prompt, max_new_tokens=24, **GREEDY, **options)
            assert torch.equal(got, expected), (seed, got, expected)
            assert any(count > 0 for count in crops), crops  # drafts were rejected and cropped away


@needs_assisted_stateful
def test_drafts_that_grow_past_the_count_the_cache_was_told_are_verified_all_the_same():
    """transformers tells the cache the assistant's first draft length; the heuristic schedule then grows it by two
    after every round that accepts all drafts (the model's twin drafts, so all are accepted)."""
    model = packed_model("dense")
    twin = copy.deepcopy(model)
    twin.generation_config.update(
        num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0
    )
    verified = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: verified.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    with torch.no_grad():
        prompt = _prompt(model.config.vocab_size, 0)
        expected = model.generate(prompt, max_new_tokens=24, **GREEDY)
        verified.clear()
        got = model.generate(prompt, max_new_tokens=24, assistant_model=twin, **GREEDY)
    assert torch.equal(got, expected)
    assert max(verified[1:]) > 2 + 1, verified  # a verifying forward took more drafts than the cache was told


@needs_assisted_stateful
def test_the_cache_assisted_decoding_returns_records_no_more_and_continues_greedy_decoding():
    """A continuation of the returned cache would otherwise record every token it takes again."""
    model = packed_model("dense")
    with torch.no_grad():
        prompt = _prompt(model.config.vocab_size, 0)
        longer = model.generate(prompt, max_new_tokens=20, **GREEDY)
        out = model.generate(
            prompt, max_new_tokens=12, prompt_lookup_num_tokens=4, return_dict_in_generate=True, **GREEDY
        )
        cache = getattr(out, CACHE_FIELD)
        assert isinstance(cache, Qwen3_5PackedCache) and not cache.records_past
        continued = model.generate(out.sequences, **{CACHE_FIELD: cache}, max_new_tokens=8, **GREEDY)
    assert torch.equal(continued, longer)


@needs_assisted_stateful
def test_the_builtin_model_is_assisted_by_ours_and_ours_by_the_builtin():
    builtin, ours = builtin_pair("dense")
    builtin_assistant, assistant = builtin_pair("dense", seed=7)
    with torch.no_grad():
        prompt = _prompt(ours.config.vocab_size, 0)
        expected = ours.generate(prompt, max_new_tokens=16, **GREEDY)
        assert torch.equal(builtin.generate(prompt, max_new_tokens=16, **GREEDY), expected)
        for main, helper in ((builtin, assistant), (ours, builtin_assistant)):
            assert torch.equal(main.generate(prompt, max_new_tokens=16, assistant_model=helper, **GREEDY), expected)


@needs_assisted_stateful
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("drafts", ["assistant", "prompt_lookup"])
def test_sampled_assisted_decoding_scores_every_token_as_one_full_forward_does(kind, drafts):
    """Speculative sampling (an assistant's logits) and sampled prompt lookup: the logits each new token was drawn
    from are those of one forward of the final sequence without a cache, whichever drafts were rejected. (The
    built-in classes of transformers 5.25 miss this after a verification that rejects every draft of a forward longer
    than the states they keep: results/notes/2026-12-05-transformers-5.25-drop-in.md.)"""
    model, assistant = packed_model(kind, seed=0), packed_model(kind, seed=7)
    options = dict(assistant_model=assistant) if drafts == "assistant" else dict(prompt_lookup_num_tokens=3)
    with torch.no_grad():
        for seed in range(3):
            prompt = _prompt(model.config.vocab_size, seed)
            torch.manual_seed(seed)
            out = model.generate(
                prompt, do_sample=True, max_new_tokens=16, return_dict_in_generate=True, output_logits=True,
                pad_token_id=0, eos_token_id=-1, **options,
            )  # fmt: skip
            full = model(out.sequences, use_cache=False).logits[0, prompt.shape[1] - 1 : -1]
            torch.testing.assert_close(torch.cat(out.logits), full, atol=1e-5, rtol=1e-5)


def _recording_cache(model, prompt: torch.Tensor, keep: int, static: bool):
    cache = Qwen3_5PackedCache(model.config.layer_types, prompt.shape[0], capacity=64 if static else None)
    cache.activate_past_recording(recurrent_states_to_keep=keep)
    model(prompt, past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_crop_leaves_the_cache_as_if_the_dropped_tokens_never_came(kind, static):
    """Prompt, then two continuing forwards (3 tokens, then 1); crop(-j) for every j the recording covers: the next
    token's logits are those of a cache that took only the tokens kept, and a further crop of what the first
    left recorded is refused."""
    model = packed_model(kind)
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (1, 14), generator=torch.Generator().manual_seed(1))
    prompt, continuation, last, probe = tokens[:, :8], tokens[:, 8:11], tokens[:, 11:12], tokens[:, 12:13]
    with torch.no_grad():
        for dropped in range(0, 7):  # the last forward's token, the three before, and the prompt's two (keep=2)
            cache = _recording_cache(model, prompt, keep=2, static=static)
            model(continuation, past_key_values=cache, use_cache=True)
            model(last, past_key_values=cache, use_cache=True)
            cache.crop(-dropped)
            kept = tokens[:, : 12 - dropped]
            assert cache.get_seq_length() == kept.shape[1]
            fresh = model(kept, use_cache=True).past_key_values
            expected = model(probe, past_key_values=fresh, use_cache=True).logits
            got = model(probe, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        cache = _recording_cache(model, prompt, keep=2, static=static)
        model(continuation, past_key_values=cache, use_cache=True)
        before = copy.deepcopy(cache)
        with pytest.raises(ValueError, match="recorded the states of 5 tokens since the last crop"):
            cache.crop(-6)
        cache.crop(-1)  # a refused crop changed nothing: this one gives what it gives the copy
        before.crop(-1)
        torch.testing.assert_close(
            model(probe, past_key_values=cache, use_cache=True).logits,
            model(probe, past_key_values=before, use_cache=True).logits,
            atol=0,
            rtol=0,
        )


def test_a_crop_takes_a_count_to_remove_and_recording_needs_rows_alike():
    model = packed_model("dense")
    with torch.no_grad():
        cache = _recording_cache(model, torch.tensor([[4, 5, 6]]), keep=2, static=False)
        assert cache.is_croppable and cache.get_recurrent_states_to_keep() == 2
        with pytest.raises(ValueError, match="count <= 0"):
            cache.crop(2)
        ids = torch.tensor([[4, 5, 6, 7], [0, 0, 8, 9]])  # a left-padded row takes fewer new tokens
        cache = Qwen3_5PackedCache(model.config.layer_types, 2)
        cache.activate_past_recording(recurrent_states_to_keep=2)
        with pytest.raises(NotImplementedError, match="same number of new tokens in every row"):
            model(ids, attention_mask=(ids > 0).long(), past_key_values=cache, use_cache=True)


@pytest.mark.skipif(not HAS_BUILTIN_QWEN35, reason="needs transformers' DynamicCache for this config")
def test_an_empty_transformers_cache_passes_its_past_recording_on():
    """transformers asks the empty DynamicCache it made to record the past; the forward replaces it by this model's
    cache, which records with the same count."""
    from transformers import DynamicCache

    model = packed_model("dense")
    given = DynamicCache(config=model.config)
    if not hasattr(given, "get_recurrent_states_to_keep"):
        pytest.skip("transformers before 5.25 has no past recording")
    given.activate_past_recording(recurrent_states_to_keep=3)
    with torch.no_grad():
        cache = model(torch.tensor([[4, 5, 6, 7]]), past_key_values=given, use_cache=True).past_key_values
    assert isinstance(cache, Qwen3_5PackedCache) and cache.get_recurrent_states_to_keep() == 3


@needs_assisted_stateful
def test_a_vision_language_prompt_is_assisted_like_a_text_one(crops):
    """An image in the prompt: the first forward encodes it with the drafts after the prompt (text), later ones
    continue the text; the tokens are those of greedy decoding."""
    from vl_tiny import PAD, grid_tensor, image_tokens, packed_vl_model, pixels_for, token_types

    model, assistant = packed_vl_model("dense", seed=0), packed_vl_model("dense", seed=7)
    grids = [[1, 4, 4]]
    ids = torch.tensor([[5, 6, *image_tokens(grids[0]), 7, 8, 9, 5, 6, 7, 8]])
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=pixels_for(grids, torch.Generator().manual_seed(0)),
        image_grid_thw=grid_tensor(grids),
        mm_token_type_ids=token_types(ids),
    )
    greedy = dict(GREEDY, pad_token_id=PAD, max_new_tokens=12)
    with torch.no_grad():
        expected = model.generate(**inputs, **greedy)
        for drafts in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=assistant)):
            assert torch.equal(model.generate(**inputs, **greedy, **drafts), expected), drafts
    assert any(count > 0 for count in crops), crops
