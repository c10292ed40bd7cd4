"""MoE routing replay (qwen35_packed/modeling/routing_replay.py): the `routed_experts` forward input.

Replaying the model's own routing changes nothing (bitwise, fp32 CPU), packed and padded, with both expert kernels
(grouped_mm runs on CPU through torch's fallback, the same permutation code the GPU runs); replaying other experts
for one token changes that token (and what attends to it) only; the router weight gets gradients through the
replayed gates; bad inputs raise ValueError naming the problem; the vision-language MoE model replays too."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_kwargs

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.modeling import kernel_selection
from qwen35_packed.modeling.moe import FusedExperts

LENGTHS = [9, 1, 14, 6]
KERNELS = [
    "loop",
    pytest.param(
        "grouped_mm",
        marks=pytest.mark.skipif(
            not kernel_selection.grouped_mm_usable(torch.device("cpu"), torch.float32),
            reason="this torch has no grouped_mm on CPU",
        ),
    ),
]


def _model(moe_kernel="loop", **overrides):
    torch.manual_seed(0)
    config = Qwen3_5MoePackedConfig(**{**tiny_kwargs("moe"), "moe_kernel": moe_kernel, **overrides})
    model = Qwen3_5MoePackedForCausalLM(config).eval()
    with torch.no_grad():  # routers far from uniform: the top-k choice is clear, as in a trained model
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def _packed_batch(vocab):
    ids = torch.randint(0, vocab, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": ids, "cu_seqlens": cu}


def _padded_batch(vocab):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask}


def _own_routing(model, batch):
    """The experts the model picks itself, [batch * seq, moe layers, k] (the caller's flat layout; pads: any)."""
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    k = model.config.get_text_config().num_experts_per_tok
    return torch.stack([logits.softmax(-1).topk(k, dim=-1).indices for logits in out.router_logits], dim=1)


def _record_expert_calls(model):
    calls = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: calls.append(args[1].clone()))
        for m in model.modules()
        if isinstance(m, FusedExperts)
    ]
    return calls, hooks


@pytest.mark.parametrize("moe_kernel", KERNELS)
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_replaying_the_models_own_routing_changes_nothing(moe_kernel, form):
    model = _model(moe_kernel)
    batch = (_packed_batch if form == "packed" else _padded_batch)(model.config.vocab_size)
    own = _own_routing(model, batch)
    with torch.no_grad():
        plain = model(**batch).logits
        flat = model(**batch, routed_experts=own).logits
        rows, cols = batch["input_ids"].shape
        layered = own.reshape(rows, cols, *own.shape[1:])
        if form == "padded":  # pads are never computed: whatever they hold is ignored
            layered = layered.masked_fill(batch["attention_mask"][..., None, None] == 0, 3)
        caller_layout = model(**batch, routed_experts=layered).logits
    assert torch.equal(flat, plain) and torch.equal(caller_layout, plain)


def test_replay_counts_moe_layers_only_skipping_dense_ones():
    model = _model(mlp_only_layers=[1], intermediate_size=64)
    batch = _packed_batch(model.config.vocab_size)
    own = _own_routing(model, batch)
    assert own.shape[1] == 3
    with torch.no_grad():
        assert torch.equal(model(**batch, routed_experts=own).logits, model(**batch).logits)


@pytest.mark.parametrize("moe_kernel", KERNELS)
def test_replaying_other_experts_changes_exactly_those_tokens(moe_kernel):
    model = _model(moe_kernel)
    batch = _packed_batch(model.config.vocab_size)
    own = _own_routing(model, batch)
    k, num_experts = model.config.num_experts_per_tok, model.config.num_experts
    # Document 3 (tokens 10..23): token 15 gets other experts in MoE layer 2; every other token has no ids (-1).
    token, layer = 15, 2
    other = torch.tensor([e for e in range(num_experts) if e not in own[token, layer].tolist()][:k])
    replay = torch.full_like(own, -1)
    replay[token, layer] = other
    calls, hooks = _record_expert_calls(model)
    with torch.no_grad():
        plain = model(**batch).logits[0]
        calls.clear()
        replayed = model(**batch, routed_experts=replay).logits[0]
    for hook in hooks:
        hook.remove()
    assert torch.equal(calls[layer][token], other)  # the replayed experts ran for that token
    for i, index in enumerate(calls):  # and every other (token, layer) kept the router's own choice
        expected = own[:, i].clone()
        if i == layer:
            expected[token] = other
        assert torch.equal(index, expected), i
    changed = (replayed != plain).any(dim=-1)
    doc_start, doc_end = sum(LENGTHS[:2]), sum(LENGTHS[:3])
    # Causal: the token itself and later tokens of its document (through attention / the recurrence) change;
    # earlier tokens of the document and every other document are bitwise the same.
    assert changed[token] and changed[token + 1 : doc_end].all()
    assert not changed[:token].any() and not changed[doc_end:].any(), torch.nonzero(changed).flatten().tolist()
    assert doc_start < token < doc_end


def test_gates_are_the_routers_renormalised_probabilities_and_train_the_router():
    model = _model().train()
    batch = _packed_batch(model.config.vocab_size)
    own = _own_routing(model, batch)
    # Replaying its own routing gives the router the same gradients as routing itself.
    grads = []
    for routed in (None, own):
        model.zero_grad(set_to_none=True)
        model(**batch, labels=batch["input_ids"], routed_experts=routed).loss.backward()
        grads.append([layer.mlp.gate.weight.grad.clone() for layer in model.model.layers])
    for plain, replayed in zip(*grads):
        assert plain.abs().sum() > 0 and torch.equal(plain, replayed)
    # Other experts everywhere: each router still gets gradients, from the gates of the replayed experts.
    shifted = (own + 1) % model.config.num_experts
    gate = model.model.layers[0].mlp.gate
    seen = []
    hook = model.model.layers[0].mlp.experts.register_forward_hook(lambda m, args, out: seen.append(args[2]))
    model.zero_grad(set_to_none=True)
    model(**batch, labels=batch["input_ids"], routed_experts=shifted).loss.backward()
    hook.remove()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.model.layers)
    with torch.no_grad():
        inputs = []
        handle = gate.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
        model(**batch)
        handle.remove()
        probs = (inputs[0].float() @ gate.weight.float().T).softmax(-1).gather(-1, shifted[:, 0])
    assert torch.allclose(seen[0], probs / probs.sum(-1, keepdim=True), rtol=0, atol=1e-6)


def _bad_inputs(own):
    partial = own.clone()
    partial[3, 1, 0] = -1
    duplicate = own.clone()
    duplicate[5, 2] = duplicate[5, 2, 0]
    too_big, negative = own.clone(), own.clone()
    too_big[0, 0, 1] = 4
    negative[0, 0, 0] = -2
    return {
        "must be \\[batch, seq_len, 4, 2\\]": own[:-1],
        "has 3 layers, but the model has 4 MoE layers": own[:, :3],
        "top_k=1 experts per token .* num_experts_per_tok=2": own[..., :1],
        "outside \\[0, 4\\)": too_big,
        "expert id -2, outside": negative,
        "names an expert twice in one token's top-k \\(real token 5, MoE layer 2": duplicate,
        "some but not all of a token's top-k": partial,
        "integer expert ids": own.float(),
    }


@pytest.mark.parametrize("case", range(8))
def test_bad_routed_experts_raise(case):
    model = _model()
    batch = _packed_batch(model.config.vocab_size)
    message, routed = list(_bad_inputs(_own_routing(model, batch)).items())[case]
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(**batch, routed_experts=routed)


def test_dense_model_refuses_routed_experts():
    model = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**tiny_kwargs("dense"))).eval()
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="no MoE layer"), torch.no_grad():
        model(input_ids=ids, routed_experts=torch.zeros(1, 4, 4, 2, dtype=torch.long))


def test_vision_language_moe_model_replays_routing():
    from vl_tiny import grid_tensor, make_document, packed_vl_model, pixels_for

    model = packed_vl_model("moe", seed=1)
    gen = torch.Generator().manual_seed(3)
    docs = [make_document(gen, n) for n in (1, 0)]
    ids = torch.cat([d[0] for d in docs]).unsqueeze(0)
    grids = [g for d in docs for g in d[1]]
    cu = torch.tensor([0, len(docs[0][0]), ids.shape[1]], dtype=torch.int32)
    batch = {
        "input_ids": ids,
        "cu_seqlens": cu,
        "pixel_values": pixels_for(grids, gen),
        "image_grid_thw": grid_tensor(grids),
    }
    own = _own_routing(model, batch)
    replay = torch.full_like(own, -1)
    replay[-1, 0] = (own[-1, 0] + 1) % model.config.text_config.num_experts  # the last token, other experts
    with torch.no_grad():
        plain = model(**batch).logits[0]
        same = model(**batch, routed_experts=own.unsqueeze(0).reshape(1, ids.shape[1], *own.shape[1:])).logits[0]
        other = model(**batch, routed_experts=replay).logits[0]
    assert torch.equal(same, plain)
    assert not torch.equal(other[-1], plain[-1]) and torch.equal(other[:-1], plain[:-1])
