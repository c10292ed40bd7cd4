"""Recomputed activations (qwen35_packed/modeling/recompute.py): the backward reruns norm / SwiGLU / gate chains
instead of keeping their outputs. Same gradients bit for bit, and those outputs no longer outlive the forward."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_kwargs

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.modeling import modeling_qwen3_5_packed as modeling
from qwen35_packed.modeling.recompute import RecomputedActivations, remember

# Inputs of the linear layers whose input is a recomputable chain output, by module name suffix.
CONSUMERS = (
    "linear_attn.in_proj_qkv",
    "linear_attn.out_proj",
    "self_attn.q_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.down_proj",
    "shared_expert.down_proj",
)


def _model(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "moe":
        model = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**{**tiny_kwargs("moe"), **overrides}))
    else:
        model = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**{**tiny_kwargs("dense"), **overrides}))
    return model.train()


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    lengths = [5, 70, 1, 23]
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu


def _step(model, recompute: bool, watch: list | None = None):
    """One forward + backward; returns the gradients. `watch` collects weakrefs to the consumers' inputs, and
    reports whether they were still alive between the forward and the backward."""
    ids, cu = _batch(model.config.vocab_size)
    handles = []
    if watch is not None:
        for name, module in model.named_modules():
            if name.endswith(CONSUMERS):
                handles.append(
                    module.register_forward_pre_hook(
                        lambda m, args, name=name: watch.append((name, weakref.ref(args[0])))
                    )
                )
    model.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as stack:
        if not recompute:
            stack.enter_context(_recompute_disabled())
        loss = model(input_ids=ids, cu_seqlens=cu, labels=ids).loss
    alive = [name for name, ref in watch or () if ref() is not None]
    loss.backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, alive


@contextlib.contextmanager
def _recompute_disabled():
    original = modeling.RecomputedActivations
    modeling.RecomputedActivations = contextlib.nullcontext
    try:
        yield
    finally:
        modeling.RecomputedActivations = original


@pytest.mark.parametrize("kind", ["dense", "moe", "dense_lora"])
def test_recompute_gives_bitwise_equal_gradients_and_frees_chain_outputs(kind):
    model = _model(kind.removesuffix("_lora"))
    if kind.endswith("_lora"):  # LoRA's A projection reads the same input as the frozen base layer
        from peft import get_peft_model

        from qwen35_packed.integrations.lora import lora_config

        model = get_peft_model(model, lora_config(model, r=4, lora_dropout=0.0, targets=("gdn", "attention", "mlp")))
        torch.manual_seed(2)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
    kept_watch, recomputed_watch = [], []
    kept, kept_alive = _step(model, recompute=False, watch=kept_watch)
    recomputed, recomputed_alive = _step(model, recompute=True, watch=recomputed_watch)
    assert kept.keys() == recomputed.keys() and len(kept) > 10
    for name in kept:
        assert torch.equal(kept[name], recomputed[name]), name
    # Without recomputation every watched input is alive until the backward (the control: this test can fail).
    assert {n for n, _ in kept_watch} <= set(kept_alive) and len(kept_watch) >= 6
    # With it, the chain outputs are gone after the forward. q_proj / in_proj_qkv / gate_proj read the input norm
    # (or the post-attention norm), down_proj / out_proj / o_proj SwiGLU / the gated norm / the output gate.
    assert recomputed_alive == [], recomputed_alive


@pytest.mark.parametrize("ending", ["dropped", "raised"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_forward_that_never_reaches_a_backward_frees_its_graph(kind, ending):
    """A training forward whose loss is dropped, or that raises halfway (an out-of-memory error a caller catches
    to retry with a smaller batch), must free every activation: nothing of its graph may stay alive. The embeddings
    it was given are saved by the first layer, so they live exactly as long as the graph."""
    model = _model(kind)
    ids, cu = _batch(model.config.vocab_size)

    def forward() -> weakref.ref:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        if ending == "dropped":
            model(inputs_embeds=embeds, cu_seqlens=cu, labels=ids)
            return weakref.ref(embeds)
        failing = model.model.layers[-1]
        handle = failing.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
        try:
            model(inputs_embeds=embeds, cu_seqlens=cu, labels=ids)
        except torch.OutOfMemoryError:
            pass
        finally:
            handle.remove()
        return weakref.ref(embeds)

    ref = forward()
    gc.collect()
    assert ref() is None, "the forward's graph outlived it"
    loss = model(input_ids=ids, cu_seqlens=cu, labels=ids).loss  # and the model still trains afterwards
    loss.backward()


def test_inputs_modified_after_the_forward_raise():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    with RecomputedActivations():
        h = x * 2.0
        y = remember(F.silu(h), F.silu, h)
        out = F.linear(y, w).sum()
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()


def test_output_modified_before_it_is_saved_is_kept_not_recomputed():
    # An output changed in place after `remember` no longer equals fn(inputs): it must be kept as it is.
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    with RecomputedActivations():
        y = remember(F.silu(x * 1.0), lambda a: F.silu(a * 1.0), x)
        y.mul_(3.0)
        out = F.linear(y, w).sum()
    out.backward()
    torch.testing.assert_close(w.grad, (F.silu(x.detach()) * 3.0).sum(0).expand(3, 8), rtol=0, atol=0)


def test_no_recipes_outside_a_training_forward():
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad(), RecomputedActivations() as registry:
        remember(F.silu(x), F.silu, x)
        assert not registry._recipes
    y = F.silu(x)
    assert remember(y, F.silu, x) is y  # no registry active: a no-op


def test_whole_model_torch_compile_trains_without_recompiling_per_call():
    # torch.compile(model) traces the forward as a whole and plans its own saved tensors: the recompute hooks step
    # aside there (they would guard on tensor identities and recompile on every call).
    model = _model("dense", num_hidden_layers=2)
    ids, cu = _batch(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, cu_seqlens=cu, labels=ids).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    guard_failures = torch._dynamo.utils.guard_failures  # code object -> reasons it was compiled again
    guard_failures.clear()
    compiled = torch.compile(model)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        compiled(input_ids=ids, cu_seqlens=cu, labels=ids).loss.backward()
    recompiled = sorted({code.co_name for code in guard_failures})
    torch._dynamo.reset()
    for name, grad in reference.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-6)
    assert "remember" not in recompiled, recompiled


def test_hooks_active_around_the_forward_keep_deciding_about_every_saved_tensor():
    # A caller's own saved-tensors hooks (save_on_cpu, offloading, checkpointing of the whole call) see every saved
    # tensor, chain outputs included, as without recomputation: the innermost hooks would replace them silently.
    model = _model("dense")
    ids, cu = _batch(model.config.vocab_size)
    kept, _ = _step(model, recompute=False)

    def run(recompute: bool):
        calls = {"pack": 0, "unpack": 0}

        def pack(t):
            calls["pack"] += 1
            return t.clone()

        def unpack(t):
            calls["unpack"] += 1
            return t

        model.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if not recompute:
                stack.enter_context(_recompute_disabled())
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = model(input_ids=ids, cu_seqlens=cu, labels=ids).loss
        loss.backward()
        return calls, {n: p.grad.clone() for n, p in model.named_parameters()}

    with_recompute, grads = run(True)
    without_recompute, _ = run(False)
    assert with_recompute == without_recompute and with_recompute["pack"] > 50, (with_recompute, without_recompute)
    for name, grad in kept.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_layer_checkpointing_under_activation_offloading_is_exact(kind):
    # Long documents fit one GPU with the decoder layers checkpointed and the saved tensors offloaded (TRL's
    # `activation_offloading=True`, PyTorch's `save_on_cpu`): the outer hooks then receive the checkpointed layers'
    # inputs and whatever the layers outside saved. Loss and gradients must be those of checkpointing alone.
    model = _model(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, cu = _batch(model.config.vocab_size)
    hidden = model.config.hidden_size

    def run(offload: bool):
        layer_inputs = []

        def pack(t):
            if t.shape == (ids.shape[1], hidden):  # the packed stream, [tokens, hidden]
                layer_inputs.append(t.shape)
            return t.to("cpu", copy=True)  # what save_on_cpu keeps: a copy, not the tensor itself

        model.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if offload:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            loss = model(input_ids=ids, cu_seqlens=cu, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(layer_inputs)

    loss, grads, _ = run(offload=False)
    offloaded_loss, offloaded_grads, offloaded_layer_inputs = run(offload=True)
    assert offloaded_layer_inputs >= model.config.num_hidden_layers
    assert torch.equal(offloaded_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(offloaded_grads[name], grad), name
