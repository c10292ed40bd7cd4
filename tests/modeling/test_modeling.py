"""Model features: fp32 decay parameters under bf16, router logits and aux loss, checkpointing, kernel forcing."""

import logging

import pytest
import torch
from conftest import packed_model, requires_builtin_qwen35, tiny_kwargs

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM


def test_decay_parameters_stay_fp32_when_cast_to_bf16():
    model = packed_model("dense")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("A_log", "dt_bias"))}
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name in before:
            assert param.dtype == torch.float32 and torch.equal(param, before[name]), name
        else:
            assert param.dtype == torch.bfloat16, name
    ids = torch.randint(0, 128, (1, 20))
    assert model(ids, use_cache=False).logits.dtype == torch.bfloat16


def test_decay_parameters_stay_fp32_through_from_pretrained_bf16(tmp_path):
    model = packed_model("dense")
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16)
    a_log = loaded.model.layers[0].linear_attn.A_log
    assert a_log.dtype == torch.float32
    assert torch.equal(a_log, model.model.layers[0].linear_attn.A_log)


def _moe(coef):
    kwargs = tiny_kwargs("moe")
    kwargs["router_aux_loss_coef"] = coef
    torch.manual_seed(0)
    return Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**kwargs))


@requires_builtin_qwen35  # the aux loss is compared with transformers' Qwen3.5-MoE function
def test_router_logits_and_aux_loss_only_when_asked(caplog):
    model = _moe(0.01)
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    plain = model(ids, attention_mask=mask, labels=ids)
    assert plain.router_logits is None and plain.aux_loss is None
    with caplog.at_level(logging.WARNING):
        asked = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    n_moe_layers = model.config.num_hidden_layers
    assert len(asked.router_logits) == n_moe_layers
    # The built-in's layout: [batch * seq, experts] per layer, zeros at pad positions, so transformers' own
    # load-balancing function with the attention_mask (what TRL calls) gives the model's aux loss.
    assert asked.router_logits[0].shape == (ids.numel(), 4)
    assert asked.router_logits[0].reshape(2, 16, 4)[0, :4].eq(0).all()
    assert asked.router_logits[0].reshape(2, 16, 4)[0, 4:].ne(0).any()
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    reference = load_balancing_loss_func(asked.router_logits, 4, model.config.num_experts_per_tok, mask)
    assert torch.allclose(asked.aux_loss, reference, atol=1e-6)
    assert torch.allclose(asked.loss, plain.loss + 0.01 * asked.aux_loss)
    assert "router_aux_loss_coef=0.01" in caplog.text

    silent = _moe(0.0)(ids, labels=ids, output_router_logits=True)
    assert silent.aux_loss is not None and torch.allclose(silent.loss, _moe(0.0)(ids, labels=ids).loss)


def _layer_forwards_in_backward(model, ids) -> list[int]:
    """Forward + backward of the loss; per decoder layer, how many times it ran during the backward (recomputed)."""
    layers = model.model.layers
    calls = [0] * len(layers)
    in_backward = False

    def count(index):
        def hook(module, args):
            if in_backward:
                calls[index] += 1

        return hook

    # Counted at the layer's first submodule: transformers 5.2x checkpoints a layer's `forward` (its own module
    # hooks stay outside the recompute), 4.x its `__call__`; the submodules run again either way.
    handles = [layer.input_layernorm.register_forward_pre_hook(count(i)) for i, layer in enumerate(layers)]
    try:
        loss = model(ids, labels=ids).loss
        in_backward = True
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def test_gradient_checkpointing_gives_same_gradients():
    """The same gradients with checkpointing, and every decoder layer really recomputed once in the backward
    (none without checkpointing): a checkpointing that keeps activations would pass the gradient check alone."""
    model = packed_model("moe")
    model.train()
    ids = torch.randint(0, 128, (2, 30))
    assert _layer_forwards_in_backward(model, ids) == [0] * len(model.model.layers)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert _layer_forwards_in_backward(model, ids) == [1] * len(model.model.layers)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, grads[name], atol=1e-6), name


def test_forcing_an_unavailable_kernel_raises():
    model = packed_model("dense")
    model.config.gdn_kernel = "fla"
    with pytest.raises(RuntimeError, match="gdn_kernel='fla' was forced"):
        model(torch.randint(0, 128, (1, 8)))


def test_unknown_kwargs_are_refused():
    model = packed_model("dense")
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(TypeError, match="token_type_ids"):
        model(ids, token_type_ids=torch.zeros_like(ids))


def test_logits_to_keep_and_hidden_states():
    model = packed_model("dense")
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        full = model(ids, use_cache=False, output_hidden_states=True)
        last = model(ids, use_cache=False, logits_to_keep=1).logits
    assert last.shape == (2, 1, 128)
    assert torch.allclose(last[:, 0], full.logits[:, -1], atol=1e-6)
    assert len(full.hidden_states) == model.config.num_hidden_layers + 1
