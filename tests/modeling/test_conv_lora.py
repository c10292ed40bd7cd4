"""PEFT LoRA on the GDN short conv (modeling/conv_lora.py): the packed conv computes what PEFT's own forward of
the wrapped nn.Conv1d computes on each document alone (logits and every gradient), packed == per-document, the
adapter acts, a disabled one does not, every conv backend applies it, a cached decode step equals the full forward,
and what cannot be reproduced is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import packed_model
from torch import nn

from qwen35_packed.modeling import gated_deltanet, utils
from qwen35_packed.modeling.conv_lora import effective_conv
from qwen35_packed.modeling.kernel_selection import KernelChoice
from qwen35_packed.modeling.kernel_set import REFERENCE_KERNELS, kernel_set
from qwen35_packed.modeling.packing import build_packed_sequence

peft = pytest.importorskip("peft")

# Head dims of 16: 64 conv channels, so PEFT's smallest conv rank (a multiple of the groups, = channels) is 64.
SMALL_CONV = dict(linear_key_head_dim=16, linear_value_head_dim=16)
CHANNELS = 64
GDN_LAYERS = (0, 1, 2)


def _adapted(seed=0, adapters=("default",), lora_b_scale=0.05, **config):
    """(base model, PEFT model with conv LoRA adapters `adapters`, all active, lora_B random), eval mode."""
    base = packed_model("dense", seed=seed, **SMALL_CONV)
    options = dict(r=CHANNELS, lora_alpha=2 * CHANNELS, target_modules=["conv1d"], **config)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(**options), adapter_name=adapters[0])
    for name in adapters[1:]:
        wrapped.add_adapter(name, peft.LoraConfig(**{**options, "lora_alpha": CHANNELS}))
    wrapped.base_model.set_adapter(list(adapters))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * lora_b_scale)
    return base, wrapped.eval()


def _conv(wrapped, layer=0):
    return wrapped.base_model.model.model.layers[layer].linear_attn.conv1d


def _ids(shape, seed=0):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def _peft_forward_per_document(monkeypatch, wrapped):
    """Make every GDN layer of `wrapped` run its conv as PEFT's own forward of the (wrapped) conv1d module, on each
    document of the stream alone with the module's causal padding (its first L outputs): the reference. The layer
    hands the module itself to the kernel set's conv, which is injected."""

    def module_itself(conv, where):
        return SimpleNamespace(weight=conv, adapters=())

    def per_document(x, conv, packed, split_sizes, initial_state=None, adapters=()):
        assert initial_state is None
        bounds = packed.cu_seqlens_cpu().tolist()
        outs = [conv(x[s:e].t()[None])[0, :, : e - s].t() for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.split(F.silu(torch.cat(outs)), list(split_sizes), dim=-1)

    monkeypatch.setattr(gated_deltanet, "effective_conv", module_itself)
    backbone = wrapped.base_model.model.model
    backbone.inject_kernels(dataclasses.replace(REFERENCE_KERNELS, conv=per_document))
    try:
        yield
    finally:
        backbone.inject_kernels(None)


def _logits_and_gradients(model, embeds, probe):
    """Logits of `inputs_embeds` and the gradients of every parameter (all made trainable) and of the input."""
    model.zero_grad(set_to_none=True)
    embeds = embeds.detach().clone().requires_grad_()
    logits = model(inputs_embeds=embeds, use_cache=False).logits
    (logits * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, embeds.grad


CASES = {
    "one adapter": dict(),
    "lora_bias and rslora": dict(lora_bias=True, use_rslora=True),
    "two active adapters": dict(adapters=("first", "second")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_equal_peft_conv_forward(case, monkeypatch):
    """Unpacked rows: our packed conv with the adapter gives PEFT's own wrapped-conv forward's logits and the
    same gradients of lora_A, lora_B (every adapter), every other parameter and the input embeddings (fp32)."""
    _, wrapped = _adapted(seed=3, **CASES[case])
    for param in wrapped.parameters():
        param.requires_grad_(True)
    embeds = wrapped.get_input_embeddings()(_ids((2, 13), seed=4)).detach()
    probe = torch.randn(2, 13, 128, generator=torch.Generator().manual_seed(5))
    ours = _logits_and_gradients(wrapped, embeds, probe)
    with monkeypatch.context() as patch, _peft_forward_per_document(patch, wrapped):
        reference = _logits_and_gradients(wrapped, embeds, probe)
    assert (ours[0] - reference[0]).abs().max().item() <= 1e-5
    lora = [name for name in reference[1] if ".conv1d.lora_" in name]
    assert len(lora) == 2 * len(GDN_LAYERS) * len(CASES[case].get("adapters", ("default",))) + (
        len(GDN_LAYERS) if CASES[case].get("lora_bias") else 0
    )
    assert set(ours[1]) == set(reference[1])
    for name, grad in reference[1].items():
        assert (ours[1][name] - grad).abs().max().item() <= 1e-5 * max(1.0, grad.abs().max().item()), name
    assert min(reference[1][name].abs().max().item() for name in lora) > 0
    assert (ours[2] - reference[2]).abs().max().item() <= 1e-5 * max(1.0, reference[2].abs().max().item())


def test_packed_row_equals_each_document_alone():
    """Documents of 1, 2 (shorter than the kernel), 3 and more tokens in one row: each gets its alone logits, and
    the adapter's gradients are the sums of the per-document ones."""
    _, wrapped = _adapted(seed=6)
    lengths = [5, 1, 2, 9, 3, 7]
    docs = [_ids((1, n), seed=10 + i) for i, n in enumerate(lengths)]
    probes = [torch.randn(1, n, 128, generator=torch.Generator().manual_seed(20 + i)) for i, n in enumerate(lengths)]
    lora = {name: p for name, p in wrapped.named_parameters() if ".conv1d.lora_" in name}

    wrapped.zero_grad(set_to_none=True)
    alone = []
    for doc, probe in zip(docs, probes):
        logits = wrapped(doc, use_cache=False).logits
        (logits * probe).sum().backward()
        alone.append(logits.detach())
    alone_grads = {name: p.grad.clone() for name, p in lora.items()}

    wrapped.zero_grad(set_to_none=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = wrapped(torch.cat(docs, dim=1), cu_seqlens=cu_seqlens, use_cache=False).logits
    (packed * torch.cat(probes, dim=1)).sum().backward()
    assert (packed - torch.cat(alone, dim=1)).abs().max().item() <= 1e-5
    for name, p in lora.items():
        assert (p.grad - alone_grads[name]).abs().max().item() <= 1e-5 * max(1.0, p.grad.abs().max().item()), name


def test_the_adapter_acts_and_a_disabled_one_does_not():
    """A nonzero lora_B moves the logits; disable_adapter() gives the base model's logits bit for bit; a freshly
    initialised adapter (lora_B = 0, where training starts) gets a gradient on every lora_B."""
    base, wrapped = _adapted(seed=7)
    ids = _ids((2, 11), seed=8)
    with torch.no_grad():
        adapted = wrapped(ids, use_cache=False).logits
        with wrapped.disable_adapter():
            disabled = wrapped(ids, use_cache=False).logits
    reference = packed_model("dense", seed=7, **SMALL_CONV)
    with torch.no_grad():
        plain = reference(ids, use_cache=False).logits
    assert (adapted - plain).abs().max().item() > 1e-3
    assert torch.equal(disabled, plain)

    _, fresh = _adapted(seed=7, lora_b_scale=0.0)
    logits = fresh(ids, use_cache=False).logits
    assert torch.equal(logits.detach(), plain)
    (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    lora_b = [p for name, p in fresh.named_parameters() if ".conv1d.lora_B" in name]
    assert len(lora_b) == len(GDN_LAYERS) and all(p.grad.abs().max().item() > 0 for p in lora_b)


@pytest.mark.parametrize("backend", ["torch", "compiled", "triton", "fla"])
def test_every_conv_backend_applies_the_adapter(backend, caplog, monkeypatch):
    """The kernel set's conv with adapters, whichever backend the KernelChoice names, computes PEFT's forward of the
    wrapped conv on each document (the Triton and FLA kernels need CUDA: on CPU tensors they would raise), and says
    once that the formula runs instead of that backend."""
    monkeypatch.setattr(utils, "_logged_once", set())
    _, wrapped = _adapted(seed=11, lora_bias=True)
    conv = _conv(wrapped)
    lengths = [4, 1, 2, 6]
    x = torch.randn(sum(lengths), CHANNELS, generator=torch.Generator().manual_seed(12))
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    packed = build_packed_sequence((1, bounds[-1]), x.device, cu_seqlens=torch.tensor(bounds))
    effective = effective_conv(conv, "conv")
    assert len(effective.adapters) == 1
    conv_kernel = kernel_set(KernelChoice("torch", "sdpa", conv=backend)).conv
    with caplog.at_level(logging.WARNING):
        outs = conv_kernel(x, effective.weight, packed, [16, 16, 32], adapters=effective.adapters)
        conv_kernel(x, effective.weight, packed, [16, 16, 32], adapters=effective.adapters)
    with torch.no_grad():
        want = torch.cat([F.silu(conv(x[s:e].t()[None])[0, :, : e - s].t()) for s, e in zip(bounds[:-1], bounds[1:])])
        without = REFERENCE_KERNELS.conv(x, effective.weight, packed, [CHANNELS])
    assert (torch.cat(outs, dim=-1) - want).abs().max().item() <= 1e-5
    assert (without[0] - want).abs().max().item() > 1e-3
    said = [r.getMessage() for r in caplog.records if "conv_lora.py" in r.getMessage()]
    assert len(said) == 1 and f"instead of the {backend!r} conv backend" in said[0]


@pytest.mark.parametrize("prompt_length", [2, 6])
def test_cached_decoding_equals_the_full_forward(prompt_length):
    """Prefill, then one token per step and then three at once: the logits of the full forward, with the conv's
    cached history (shorter than the kernel for a 2-token prompt) read through the adapter too."""
    _, wrapped = _adapted(seed=13)
    ids = _ids((2, prompt_length + 5), seed=14)
    with torch.no_grad():
        full = wrapped(ids, use_cache=False).logits
        out = wrapped(ids[:, :prompt_length], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(prompt_length, prompt_length + 2):
            out = wrapped(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
        steps.append(wrapped(ids[:, prompt_length + 2 :], past_key_values=cache, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


class _SignDropout(nn.Dropout):
    """A deterministic stand-in for PEFT's nn.Dropout: elementwise, so it acts on PEFT's [1, C, L] input and on the
    packed [N, C] stream alike (keeps positive inputs, doubled)."""

    def forward(self, x):
        return x * (x > 0) * 2.0


def test_lora_dropout_applies_to_the_adapters_input(monkeypatch):
    """In training mode PEFT's dropout module acts on the adapter's input once, before the taps read it: with a
    deterministic elementwise stand-in, ours equals PEFT's forward exactly; with the real nn.Dropout, p = 1 removes
    the adapter (the base model's logits)."""
    _, wrapped = _adapted(seed=15, lora_dropout=0.5)
    for layer in GDN_LAYERS:
        _conv(wrapped, layer).lora_dropout["default"] = _SignDropout(0.5)
    wrapped.train()
    ids = _ids((2, 9), seed=16)
    with torch.no_grad():
        ours = wrapped(ids, use_cache=False).logits
        with monkeypatch.context() as patch, _peft_forward_per_document(patch, wrapped):
            reference = wrapped(ids, use_cache=False).logits
        with wrapped.disable_adapter():
            plain = wrapped(ids, use_cache=False).logits
    assert (ours - reference).abs().max().item() <= 1e-5
    assert (ours - plain).abs().max().item() > 1e-3

    _, dropped = _adapted(seed=15, lora_dropout=1.0)
    with torch.no_grad():
        assert torch.equal(dropped.train()(ids, use_cache=False).logits, plain)


def test_refusals():
    """What the packed conv cannot reproduce raises a ValueError naming the layer: DoRA, dropout in training mode
    with a cached history, forward hooks on the wrapper (PEFT's per-request adapter_names), another PEFT tuner."""
    ids = _ids((1, 6), seed=17)

    _, dora = _adapted(seed=17, use_dora=True)
    with pytest.raises(ValueError, match=r"layer 0's linear_attn.conv1d \(adapter 'default'\): DoRA"):
        dora(ids, use_cache=False)

    _, dropping = _adapted(seed=17, lora_dropout=0.1)
    dropping.train()
    cache = dropping(ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="LoRA dropout \\(p=0.1\\) in training mode with a conv history"):
        dropping(ids[:, :1], past_key_values=cache, use_cache=True)

    _, wrapped = _adapted(seed=17, adapters=("first", "second"))
    with pytest.raises(ValueError, match="forward hooks on PEFT's LoRA wrapper"):
        wrapped(input_ids=ids, use_cache=False, adapter_names=["first"])

    base = packed_model("dense", seed=17, **SMALL_CONV)
    loha = peft.get_peft_model(base, peft.LoHaConfig(r=4, target_modules=["conv1d"]))
    with pytest.raises(ValueError, match="wrapped by peft.tuners.loha"):
        loha(ids, use_cache=False)


def test_peft_refuses_to_merge_and_the_adapter_still_runs():
    """PEFT cannot merge a grouped conv's LoRA (its delta mixes channels): merge_adapter raises and leaves the
    adapter unmerged, and the forward goes on applying it."""
    _, wrapped = _adapted(seed=18)
    ids = _ids((1, 8), seed=19)
    with torch.no_grad():
        before = wrapped(ids, use_cache=False).logits
        with pytest.raises(NotImplementedError, match="groups > 1"):
            wrapped.merge_adapter()
        assert not _conv(wrapped).merged
        assert torch.equal(wrapped(ids, use_cache=False).logits, before)


def test_modules_to_save_trains_the_convs_own_taps():
    """PEFT's modules_to_save on conv1d (the whole [C, 1, K] weight trained, the cheap alternative to a conv
    LoRA): the conv reads the active adapter's copy, and the original taps with the adapter disabled."""
    base = packed_model("dense", seed=21, **SMALL_CONV)
    ids = _ids((1, 7), seed=22)
    with torch.no_grad():
        plain = base(ids, use_cache=False).logits
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["conv1d"]))
    conv = _conv(wrapped)
    with torch.no_grad():
        conv.modules_to_save["default"].weight.mul_(-1.0)
        flipped = wrapped(ids, use_cache=False).logits
        with wrapped.disable_adapter():
            disabled = wrapped(ids, use_cache=False).logits
    assert (flipped - plain).abs().max().item() > 1e-3
    assert torch.equal(disabled, plain)
