"""output_attentions: the attention probabilities of the full-attention layers (attention_probabilities.py), equal
to the built-in's eager ones on unpacked input, per document on packed input, without changing any other output."""

import pytest
import torch
from conftest import builtin_pair, packed_model, tiny_kwargs

from qwen35_packed import Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM


def _full_attention_layers(config) -> int:
    return sum(kind == "full_attention" for kind in config.layer_types)


def test_attentions_match_builtin_eager_on_real_queries(kind):
    ref, ours = builtin_pair(kind)
    ref.set_attn_implementation("eager")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, use_cache=False, output_attentions=True).attentions
        got = ours(ids, attention_mask=mask, use_cache=False, output_attentions=True).attentions
    assert len(got) == len(expected) == _full_attention_layers(ours.config)
    real = mask.bool()
    for layer_got, layer_expected in zip(got, expected):
        assert layer_got.shape == layer_expected.shape == (2, ours.config.num_attention_heads, 24, 24)
        # real queries; pad queries are zeros here (the built-in spreads them over masked keys)
        torch.testing.assert_close(layer_got.transpose(1, 2)[real], layer_expected.transpose(1, 2)[real])
        assert layer_got.transpose(1, 2)[~real].abs().max().item() == 0.0
        assert layer_got[1, :, :, :7].abs().max().item() == 0.0  # no real query attends to padding


def test_packed_attentions_equal_each_document_alone():
    model = packed_model("dense").eval()
    docs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 1, 9)]
    cu = torch.tensor([0, 5, 6, 15])
    with torch.no_grad():
        packed = model(torch.cat(docs)[None], cu_seqlens=cu, use_cache=False, output_attentions=True).attentions
        alone = [model(doc[None], use_cache=False, output_attentions=True).attentions for doc in docs]
    for layer, probabilities in enumerate(packed):
        for d, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            block = probabilities[0, :, start:end]
            torch.testing.assert_close(block[:, :, start:end], alone[d][layer][0], rtol=0, atol=1e-6)
            outside = torch.cat([block[:, :, :start], block[:, :, end:]], dim=-1)
            assert outside.numel() == 0 or outside.abs().max().item() == 0.0  # never across a boundary
        torch.testing.assert_close(probabilities.sum(-1), torch.ones_like(probabilities.sum(-1)))


def test_output_attentions_changes_no_other_output():
    model = packed_model("dense").eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = model(ids, use_cache=False, output_hidden_states=True)
        asked = model(ids, use_cache=False, output_hidden_states=True, output_attentions=True)
    assert plain.attentions is None
    torch.testing.assert_close(asked.logits, plain.logits, rtol=0, atol=0)
    for got, expected in zip(asked.hidden_states, plain.hidden_states):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_config_output_attentions_is_honoured_and_the_argument_wins():
    config = Qwen3_5PackedConfig(**tiny_kwargs("dense"), output_attentions=True)
    asking = Qwen3_5PackedForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        assert len(asking(ids).attentions) == _full_attention_layers(config)
        assert asking(ids, output_attentions=False).attentions is None


@pytest.mark.parametrize("holes", [False, True], ids=["left-padded", "with-holes"])
def test_generate_attentions_match_builtin_per_step(kind, holes):
    ref, ours = builtin_pair(kind)
    ref.set_attn_implementation("eager")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    if holes:  # masked tokens inside both rows: the cached keys sit in their columns, none at the holes
        mask[0, 5] = 0
        mask[1, 2:4] = 0
    options = dict(max_new_tokens=4, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=mask, **options)
        got = ours.generate(ids, attention_mask=mask, **options)
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert len(got.attentions) == len(expected.attentions) == 4
    for step, (step_got, step_expected) in enumerate(zip(got.attentions, expected.attentions)):
        real = mask.bool() if step == 0 else torch.ones(2, 1, dtype=torch.bool)  # the prompt's real queries
        for layer_got, layer_expected in zip(step_got, step_expected):
            assert layer_got.shape == layer_expected.shape
            torch.testing.assert_close(layer_got.transpose(1, 2)[real], layer_expected.transpose(1, 2)[real])


def test_attentions_are_on_the_gradient_path_and_change_no_value_or_gradient():
    """With output_attentions the returned probabilities get the gradient of the loss (the layer's backward runs
    through them, as the built-in's eager attention does), while the loss stays bitwise the same and the parameter
    gradients the same up to rounding."""
    model = packed_model("dense").train()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(9))
    mask = torch.tensor([[0, 0] + [1] * 8, [1] * 10])
    plain = model(ids, attention_mask=mask, labels=ids)
    plain.loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=ids, output_attentions=True)
    for probabilities in out.attentions:
        probabilities.retain_grad()
    out.loss.backward()
    assert torch.equal(out.loss, plain.loss)
    for probabilities in out.attentions:
        assert probabilities.grad is not None and probabilities.grad.abs().sum().item() > 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], atol=1e-6, rtol=1e-5)


def test_returned_hidden_states_are_in_the_graph_with_unchanged_values():
    """retain_grad() on a returned hidden state gets its gradient, as in the built-in (the stream continues from the
    returned tensor), with padding (a gather, not a view) and without; the values and logits are unchanged."""
    model = packed_model("dense").eval()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(8))
    for mask in (None, torch.tensor([[0, 0, 0] + [1] * 7, [1] * 10])):
        with torch.no_grad():
            plain = model(ids, attention_mask=mask, use_cache=False)
        out = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
        torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        for hidden in out.hidden_states:
            hidden.retain_grad()
        out.logits[:, -1].sum().backward()
        for hidden in out.hidden_states:
            assert hidden.grad is not None and hidden.grad[:, -1].abs().sum().item() > 0
        if mask is not None:  # pad positions feed nothing
            assert out.hidden_states[0].grad[0, :3].abs().max().item() == 0.0


def test_vl_text_config_output_attentions_is_honoured():
    """A vision-language model returns the text layers' probabilities when its text_config asks (as the built-in's
    text model reads its own config) or the composite does; the argument wins."""
    from vl_tiny import our_vl_model

    model = our_vl_model("dense").eval()
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(9))
    layers = _full_attention_layers(model.config.text_config)
    for config in (model.config, model.config.text_config):
        config._attn_implementation = "eager"  # transformers' config refuses output_attentions otherwise
    with torch.no_grad():
        assert model(input_ids=ids).attentions is None
        model.config.text_config.output_attentions = True
        assert len(model(input_ids=ids).attentions) == layers
        assert model(input_ids=ids, output_attentions=False).attentions is None
        model.config.text_config.output_attentions = False
        model.config.output_attentions = True
        assert len(model(input_ids=ids).attentions) == layers
