"""The Gated DeltaNet layer's long documents in pieces (qwen35_packed/modeling/gated_deltanet.py, the config's
`gdn_token_chunk`): the loss and every gradient bit for bit those of whole documents; only documents longer than a
piece are cut, each round runs one piece of each from the state the one before reached; forwards with a cache run
whole; the setting is checked and saved."""

import dataclasses

import pytest
import torch
from conftest import packed_model, tiny_kwargs, training_step

from qwen35_packed import Qwen3_5PackedConfig
from qwen35_packed.modeling.kernel_set import REFERENCE_KERNELS

LENGTHS = [
    200,
    5,
    130,
    64,
    65,
    1,
]  # longer than a piece of 64 (two of them by more than two pieces), exactly one, short


def _batch(vocab: int):
    ids = torch.randint(3, vocab, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu


def _step(model, piece, checkpointing: bool):
    ids, cu = _batch(model.config.vocab_size)
    out, grads = training_step(
        model, dict(input_ids=ids, cu_seqlens=cu, labels=ids), checkpointing, gdn_token_chunk=piece
    )
    return out.loss.detach(), grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_documents_in_pieces_give_the_loss_and_gradients_of_whole_documents(kind, checkpointing):
    model = packed_model(kind).train()
    loss, grads = _step(model, None, checkpointing)
    assert len(grads) > 10
    for piece in (64, 128):
        piece_loss, piece_grads = _step(model, piece, checkpointing)
        assert torch.equal(piece_loss, loss), piece
        assert piece_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert torch.equal(piece_grads[name], grad), (piece, name)


def _recording_kernels(calls: list):
    """The reference kernels, recording each delta-rule call: (which, document lengths, whether it had a state)."""

    def recording(which, function):
        def call(q, k, v, g, beta, packed, initial_state=None, output_final_state=False):
            bounds = packed.cu_seqlens_cpu().tolist()
            calls.append((which, [b - a for a, b in zip(bounds[:-1], bounds[1:])], initial_state is not None))
            return function(q, k, v, g, beta, packed, initial_state, output_final_state)

        return call

    return dataclasses.replace(
        REFERENCE_KERNELS,
        delta_rule=recording("whole", REFERENCE_KERNELS.delta_rule),
        delta_rule_from_state=recording("from state", REFERENCE_KERNELS.delta_rule_from_state),
    )


def test_each_round_runs_one_piece_of_every_document_that_long_from_the_state_before():
    model = packed_model("dense").eval()  # scoring: a forward without a cache is cut too
    calls = []
    model.model.inject_kernels(_recording_kernels(calls))
    model.config.gdn_token_chunk = 64
    ids, cu = _batch(model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=ids, cu_seqlens=cu, use_cache=False)
    layers = sum(kind == "linear_attention" for kind in model.config.layer_types)
    rounds = [
        ("whole", [64, 5, 64, 64, 64, 1], False),  # every document's first piece
        ("from state", [64, 64, 1], True),  # 200, 130 and 65 go on
        ("from state", [64, 2], True),
        ("from state", [8], True),
    ]
    assert calls == rounds * layers


def test_a_forward_with_a_cache_runs_whole_documents():
    model = packed_model("dense").eval()
    calls = []
    model.model.inject_kernels(_recording_kernels(calls))
    model.config.gdn_token_chunk = 64
    ids = torch.randint(3, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True)
    layers = sum(kind == "linear_attention" for kind in model.config.layer_types)
    assert calls == [("whole", [150], False)] * layers


@pytest.mark.parametrize("value", [0, 100, -64, True, "64"])
def test_gdn_token_chunk_must_be_a_positive_multiple_of_the_chunk(value):
    with pytest.raises(ValueError, match="gdn_token_chunk must be None or a positive multiple of 64"):
        Qwen3_5PackedConfig(**tiny_kwargs("dense"), gdn_token_chunk=value)


def test_gdn_token_chunk_is_saved_and_loaded(tmp_path):
    Qwen3_5PackedConfig(**tiny_kwargs("dense"), gdn_token_chunk=16384).save_pretrained(tmp_path)
    assert Qwen3_5PackedConfig.from_pretrained(tmp_path).gdn_token_chunk == 16384
