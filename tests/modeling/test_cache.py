"""The generation cache (qwen35_packed/modeling/cache.py) as transformers code reads it: a `Cache` whose layers
give transformers' layout, continued by a later generate() exactly, rows selected on request, unsupported
operations refused."""

import copy
import gc
import weakref

import pytest
import torch
from conftest import builtin_pair, packed_model
from transformers import Cache

from qwen35_packed.modeling.cache import LinearAttentionLayer, PerRowKeysValues, Qwen3_5PackedCache

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=-1)


def _left_padded_prompt(seed=0):
    ids = torch.randint(3, 120, (2, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def _assert_caches_equal(a: Qwen3_5PackedCache, b: Qwen3_5PackedCache):
    assert len(a) == len(b) and a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers):
        assert type(la) is type(lb)
        if isinstance(la, PerRowKeysValues):
            torch.testing.assert_close(la.keys, lb.keys)
            torch.testing.assert_close(la.values, lb.values)
        else:
            torch.testing.assert_close(la.conv_states[0], lb.conv_states[0])
            torch.testing.assert_close(la.recurrent_states[0], lb.recurrent_states[0])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_cache_is_a_transformers_cache_in_its_layout(kind):
    model = packed_model(kind)
    config = model.config
    ids, mask = _left_padded_prompt()
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
    assert isinstance(cache, Cache) and len(cache) == config.num_hidden_layers
    assert cache.get_seq_length() == ids.shape[1] and cache.batch_size == ids.shape[0]
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    for kind_of_layer, layer in zip(config.layer_types, cache.layers):
        if kind_of_layer == "linear_attention":
            if LinearAttentionLayer is not None:  # transformers 5: its own class, as its cache checks ask
                assert type(layer) is LinearAttentionLayer
            assert layer.number_of_states == 1 and not layer.record_past
            assert layer.conv_states[0].shape == (2, conv_dim, config.linear_conv_kernel_dim)
            assert layer.recurrent_states[0].shape == (
                2,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
            )
            continue
        assert isinstance(layer, PerRowKeysValues)
        shape = (2, config.num_key_value_heads, ids.shape[1], config.head_dim)
        assert layer.keys.shape == shape and layer.values.shape == shape
        # storage stays per row without padding; the transformers layout right-aligns it, zeros where padding was
        assert [row.shape[0] for row in layer.key_rows] == mask.sum(1).tolist()
        assert torch.equal(layer.keys[1, :, 2:], layer.key_rows[1].transpose(0, 1))
        assert not layer.keys[1, :, :2].any() and not layer.values[1, :, :2].any()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_cache_holds_what_the_builtin_cache_holds(kind):
    """Same weights, same unpadded prompt: every GDN state (the conv's last K inputs included) and every key/value
    equals the built-in's."""
    ref, ours = builtin_pair(kind)
    ids = torch.randint(3, 120, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids, use_cache=True).past_key_values
        got = ours(ids, use_cache=True).past_key_values
    assert got.get_seq_length() == expected.get_seq_length()
    for ours_layer, ref_layer in zip(got.layers, expected.layers):
        if isinstance(ours_layer, PerRowKeysValues):
            torch.testing.assert_close(ours_layer.keys, ref_layer.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(ours_layer.values, ref_layer.values, atol=1e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(ours_layer.conv_states[0], ref_layer.conv_states[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(
                ours_layer.recurrent_states[0], ref_layer.recurrent_states[0], atol=1e-5, rtol=1e-4
            )


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("form", ["input_ids", "inputs_embeds"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_continuing_from_a_returned_cache_equals_one_generate_call(kind, form, cache):
    """3 tokens, then 1 more from the returned cache: the tokens and the final cache of a single 4-token call. A
    static cache continues as one (its capacity of prompt + 3 grows for the fourth token)."""
    model = packed_model(kind)
    ids, mask = _left_padded_prompt(seed=1)
    embed = model.get_input_embeddings()
    options = {**GREEDY, "cache_implementation": cache}
    with torch.no_grad():
        if form == "input_ids":
            whole = model.generate(ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, **options)
            first = model.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, **options)
            grown = torch.cat([mask, mask.new_ones(2, first.sequences.shape[1] - ids.shape[1])], dim=1)
            rest = model.generate(
                first.sequences, attention_mask=grown, past_key_values=first.past_key_values, max_new_tokens=1,
                return_dict_in_generate=True, **GREEDY,
            )  # fmt: skip
            assert torch.equal(rest.sequences, whole.sequences)
        else:  # without a mask: generate() continues embeddings of the prompt and the tokens so far
            prompt = embed(ids)
            whole = model.generate(inputs_embeds=prompt, max_new_tokens=4, return_dict_in_generate=True, **options)
            first = model.generate(inputs_embeds=prompt, max_new_tokens=3, return_dict_in_generate=True, **options)
            rest = model.generate(
                inputs_embeds=torch.cat([prompt, embed(first.sequences)], dim=1), past_key_values=first.past_key_values,
                max_new_tokens=1, return_dict_in_generate=True, **GREEDY,
            )  # fmt: skip
            assert torch.equal(torch.cat([first.sequences, rest.sequences], dim=1), whole.sequences)
    _assert_caches_equal(rest.past_key_values, whole.past_key_values)
    assert rest.past_key_values.static == whole.past_key_values.static == (cache == "static")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_cached_step_with_masked_new_tokens_equals_one_forward(kind):
    """A cached step whose new tokens start with masked ones in one row (a prompt continued after padding) gives the
    logits of one forward over the whole mask with holes, and that forward the built-in's; the cache then holds
    each row's keys in the columns of its real tokens, where the built-in's cache holds them."""
    ref, ours = builtin_pair(kind)
    ids = torch.randint(3, 120, (2, 20), generator=torch.Generator().manual_seed(9))
    first, masked = 11, 4
    mask = torch.ones_like(ids)
    mask[1, first : first + masked] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        whole = ours(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache = ours(ids[:, :first], attention_mask=mask[:, :first], use_cache=True).past_key_values
        step = ours(ids[:, first:], attention_mask=mask, past_key_values=cache, use_cache=True)
    assert (whole.logits[real] - expected.logits[real]).abs().max().item() <= 1e-4
    assert (step.logits[real[:, first:]] - whole.logits[:, first:][real[:, first:]]).abs().max().item() <= 1e-5
    assert not step.logits[~real[:, first:]].any()
    for got, built_in in zip(step.past_key_values.layers, expected.past_key_values.layers):
        if isinstance(got, PerRowKeysValues):
            torch.testing.assert_close(got.keys.transpose(1, 2)[real], built_in.keys.transpose(1, 2)[real])
            assert not got.keys.transpose(1, 2)[~real].any()
        else:  # the recurrence ran through the masked tokens as the built-in's did
            torch.testing.assert_close(got.recurrent_states[0], built_in.recurrent_states[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("prompt", ["left-padded", "unpadded"])
def test_a_cached_step_of_several_tokens_equals_one_uncached_forward(kind, prompt):
    """A prefill, then 3 real tokens at once with the cache (a chunked prefill, a speculative step's check): their
    logits are those of one forward over all the tokens, the cache is the one a prefill of all of them makes (keys
    in their columns, columns consumed, GDN states), and the decode step after it agrees too."""
    model = packed_model(kind)
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if prompt == "left-padded":
        mask[1, :3] = 0
    prefill, step = 8, 3

    def masked(columns):  # the mask of the first `columns` columns, as generate() passes it; none when unpadded
        return {"attention_mask": mask[:, :columns]} if prompt == "left-padded" else {}

    with torch.no_grad():
        whole = model(ids, **masked(12), use_cache=False).logits
        expected_cache = model(ids[:, : prefill + step], **masked(prefill + step), use_cache=True).past_key_values
        cache = model(ids[:, :prefill], **masked(prefill), use_cache=True).past_key_values
        several = model(ids[:, prefill : prefill + step], **masked(prefill + step), past_key_values=cache)
        assert several.past_key_values is cache
        torch.testing.assert_close(several.logits, whole[:, prefill : prefill + step], atol=1e-5, rtol=0)
        assert torch.equal(cache.real_columns, expected_cache.real_columns)
        _assert_caches_equal(cache, expected_cache)
        next_step = model(ids[:, prefill + step :], **masked(12), past_key_values=cache).logits
    torch.testing.assert_close(next_step, whole[:, prefill + step :], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_row_selection_moves_every_state_of_a_row(kind):
    """batch_select_indices / batch_repeat_interleave / reorder_cache: the next step of a selected row gives the
    logits its source row gives."""
    model = packed_model(kind)
    ids, mask = _left_padded_prompt(seed=2)
    step = torch.tensor([[5], [9]])
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        expected = model(step, attention_mask=torch.ones(2, 7, dtype=torch.long), past_key_values=copy.deepcopy(cache))
        for select, index in (
            (lambda c: c.batch_select_indices(torch.tensor([1, 0])), [1, 0]),
            (lambda c: c.reorder_cache(torch.tensor([1, 1])), [1, 1]),
            (lambda c: c.batch_repeat_interleave(2), [0, 0, 1, 1]),
        ):
            selected = copy.deepcopy(cache)
            select(selected)
            assert selected.batch_size == len(index)
            got = model(
                step[index], attention_mask=torch.ones(len(index), 7, dtype=torch.long), past_key_values=selected
            )
            torch.testing.assert_close(got.logits, expected.logits[index], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "operation, call",
    [
        ("crop without past recording", lambda c: c.crop(-1)),
        ("update", lambda c: c.update(torch.zeros(1), torch.zeros(1), 0)),
        ("update_conv_state", lambda c: c.update_conv_state(torch.zeros(1), 0)),
        ("reset", lambda c: c.reset()),
        ("get_mask_sizes", lambda c: c.get_mask_sizes(1, 0)),
    ],
)
def test_operations_the_cache_cannot_honour_raise(operation, call):
    model = packed_model("dense")
    with torch.no_grad():
        cache = model(torch.tensor([[4, 5, 6]]), use_cache=True).past_key_values
    with pytest.raises(NotImplementedError, match=f"Qwen3_5PackedCache does not support {operation}"):
        call(cache)
    assert not cache.is_compileable and not cache.is_croppable


def test_the_row_count_of_a_cache_must_match_the_input():
    model = packed_model("dense")
    with torch.no_grad():
        cache = model(torch.tensor([[4, 5, 6]]), use_cache=True).past_key_values
        with pytest.raises(ValueError, match="cache holds 1 rows but the input has 2"):
            model(torch.tensor([[1], [2]]), past_key_values=cache)


def test_generation_steps_run_the_step_kernels():
    """A generate() step with one new token per row calls the kernel set's step kernels, for every GDN and attention
    layer, and never the stream kernels; the prefill runs the stream kernels of an uncached forward."""
    import dataclasses

    from qwen35_packed.modeling.kernel_set import REFERENCE_KERNELS

    model = packed_model("dense").eval()
    calls = []

    def recorded(name):
        def call(*args, **kwargs):
            calls.append(name)
            return getattr(REFERENCE_KERNELS, name)(*args, **kwargs)

        return call

    members = ("conv", "delta_rule", "attention", "cached_attention", "conv_step", "delta_rule_step", "attention_step")
    model.model.inject_kernels(dataclasses.replace(REFERENCE_KERNELS, **{name: recorded(name) for name in members}))
    ids = torch.randint(3, 100, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3, min_new_tokens=3, pad_token_id=0)
    gdn = sum(t == "linear_attention" for t in model.config.layer_types)
    attention = len(model.config.layer_types) - gdn
    prefill = calls[: 2 * gdn + attention]
    assert sorted(set(prefill)) == ["attention", "conv", "delta_rule"]
    steps = calls[len(prefill) :]
    assert sorted(set(steps)) == ["attention_step", "conv_step", "delta_rule_step"]
    assert len(steps) == 2 * (2 * gdn + attention)  # two steps after the prefill's first token


def test_a_step_under_autocast_continues_a_prefill_run_without_it():
    """TRL's GRPO generates under the trainer's autocast while a cache may come from outside it: the step's bf16
    keys join the prefill's fp32 ones (the buffer keeps the wider dtype, as concatenation promoted them), and the
    step equals one full forward under the same autocast within bf16 rounding."""
    model = packed_model("dense").eval()
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).past_key_values
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step = model(ids[:, 6:], past_key_values=cache, use_cache=True).logits[:, -1]
            full = model(ids, use_cache=False).logits[:, -1]
    layer = next(layer for layer in cache.layers if isinstance(layer, PerRowKeysValues))
    assert layer.key_buffer.dtype == torch.float32 and layer.host_lengths == [7, 7]
    assert (step.float() - full.float()).abs().max().item() <= 5e-2


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_prefill_gives_the_uncached_forwards_logits_bit_for_bit(kind):
    """Filling a cache runs the stream's kernels of an uncached forward (and copies the keys into the cache), so the
    prompt's logits are the uncached forward's, left-padded rows included."""
    model = packed_model(kind).eval()
    ids = torch.randint(3, 100, (3, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        cached = model(ids, attention_mask=mask, use_cache=True)
        uncached = model(ids, attention_mask=mask, use_cache=False).logits
    assert cached.past_key_values is not None and torch.equal(cached.logits, uncached)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_a_cache_goes_with_its_last_reference(kind, implementation, monkeypatch):
    """No reference cycle holds a cache: with the garbage collector off, the caches generate() made are gone once its
    output is. (A static cache holds its CUDA graphs; freed by a later collection, they could go inside another
    capture and invalidate it.)"""

    made = []
    construct = Qwen3_5PackedCache.__init__

    def recorded(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Qwen3_5PackedCache, "__init__", recorded)
    model = packed_model(kind)
    ids, mask = _left_padded_prompt()
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            output = model.generate(
                ids, attention_mask=mask, max_new_tokens=3, cache_implementation=implementation, **GREEDY
            )
        del output
        assert made and all(ref() is None for ref in made)
    finally:
        gc.enable()


def test_an_attention_layer_outliving_its_cache_says_so():
    cache = Qwen3_5PackedCache(["full_attention"], batch_size=1)
    layer = cache.layers[0]
    del cache
    with pytest.raises(RuntimeError, match="was freed"):
        layer.static


def test_a_deep_copy_of_a_cache_has_layers_of_its_own():
    """The layers of a copied cache read the copy (its columns, capacity), not the original."""
    cache = Qwen3_5PackedCache(["linear_attention", "full_attention"], batch_size=1, capacity=8)
    copied = copy.deepcopy(cache)
    assert copied.layers[1]._cache is copied and cache.layers[1]._cache is cache
    assert copy.deepcopy(cache.layers[1])._cache is cache  # a layer copied alone still belongs to its cache
