"""benchmarks/bench_generate.py's lower bound of a decode step: the weights it must read, on meta-device models of the
tiny dense and MoE configs, and the time that takes at a card's data-sheet bandwidth."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_generate import build, config_kwargs, decode_bound, weight_bytes_per_decode_step  # noqa: E402


def _model(key: str, impl: str = "ours", **fields):
    _, key, kwargs = config_kwargs(key, tiny=True)
    return build(key, impl, {**kwargs, **fields}, torch.device("meta"), torch.bfloat16)


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("impl", ["ours", "builtin"])
def test_a_dense_step_reads_every_weight_once_and_one_embedding_row_per_sequence(impl):
    model = _model("qwen35_4b", impl, tie_word_embeddings=False)
    embedding = model.get_input_embeddings().weight
    row = embedding.shape[1] * embedding.element_size()
    others = _bytes(p for p in model.parameters() if p is not embedding)
    assert weight_bytes_per_decode_step(model, 1) == others + row
    assert weight_bytes_per_decode_step(model, 16) == others + 16 * row


def test_a_head_that_shares_the_embedding_reads_all_of_it_whatever_the_batch():
    model = _model("qwen35_4b", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (
        weight_bytes_per_decode_step(model, 1) == weight_bytes_per_decode_step(model, 64) == _bytes(model.parameters())
    )


@pytest.mark.parametrize("impl", ["ours", "builtin"])
def test_routed_experts_count_by_the_share_a_batch_hits(impl):
    model = _model("qwen35_35b_a3b", impl, tie_word_embeddings=True)  # the embedding counts the same at any batch
    config = model.config
    experts = _bytes(p for name, p in model.named_parameters() if ".experts." in name)
    others = _bytes(model.parameters()) - experts
    assert experts > 0

    def share(batch):  # of the routed experts' weights: 1 - (1 - k/E)^batch
        return 1 - (1 - config.num_experts_per_tok / config.num_experts) ** batch

    # one token reads k of E experts per layer; a batch far larger than E / k reads nearly all of them
    assert share(1) == config.num_experts_per_tok / config.num_experts
    for batch in (1, 4, 10_000):
        assert weight_bytes_per_decode_step(model, batch) == pytest.approx(others + experts * share(batch), abs=2)
    assert share(10_000) > 0.999


def test_a_batch_larger_than_the_vocabulary_reads_the_embedding_once():
    model = _model("qwen35_4b", tie_word_embeddings=False)
    vocab = model.config.vocab_size
    assert weight_bytes_per_decode_step(model, vocab) == weight_bytes_per_decode_step(model, 4 * vocab)
    assert weight_bytes_per_decode_step(model, vocab) == _bytes(model.parameters())


def test_the_bound_is_the_weights_over_the_cards_bandwidth_and_absent_for_an_unknown_card():
    model = _model("qwen35_4b")
    weights = weight_bytes_per_decode_step(model, 16)
    h200 = decode_bound(model, 16, "NVIDIA H200")
    assert h200["weight_gb_per_step"] == round(weights / 1e9, 3)
    assert h200["bandwidth_bound_ms"] == round(weights / 4.8e12 * 1e3, 3)
    assert decode_bound(model, 16, "NVIDIA H100 80GB HBM3")["bandwidth_bound_ms"] == round(weights / 3.35e12 * 1e3, 3)
    assert decode_bound(model, 16, "cpu")["bandwidth_bound_ms"] is None
