"""PEFT LoRA on the fused expert tensors (qwen35_packed/modeling/expert_lora.py): the low-rank products on the
expert rows against PEFT's own path (the adapted weight, `moe_lora_kernel="peft"`) in values and every gradient,
on the per-expert loop and the grouped path (torch's CPU grouped_mm in fp32), packed input included; the adapted
weight never built; disabled and merged adapters; the fallback for several adapters and what it says; grouped_mm's
CUDA layout checks (its meta kernel) on the padded rank."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from conftest import packed_model
from torch import nn

from qwen35_packed.modeling import kernel_selection, kernels
from qwen35_packed.modeling.expert_lora import ExpertWeight
from qwen35_packed.modeling.kernel_selection import KernelChoice
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.moe import SparseMoeBlock

peft = pytest.importorskip("peft")
from peft.tuners.lora.layer import _LoraFactorsProxy  # noqa: E402

from qwen35_packed.integrations.lora import EXPERT_PARAMETERS, lora_config  # noqa: E402

pytestmark = pytest.mark.skipif(
    not kernel_selection.grouped_mm_usable(torch.device("cpu"), torch.float32),
    reason="this torch has no grouped_mm on CPU",
)

DOCUMENTS = (37, 1, 22, 14)


@pytest.fixture
def folds(monkeypatch):
    """How often PEFT's factor proxy built an adapted weight."""
    calls = []
    forward = _LoraFactorsProxy.forward

    def counted(self, weight):
        calls.append(weight.shape)
        return forward(self, weight)

    monkeypatch.setattr(_LoraFactorsProxy, "forward", counted)
    return calls


def _randomize_lora(model, seed=0):
    """Nonzero A and B (PEFT starts B at 0, which would hide a wrong B-side gradient of A)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _adapted_model(moe_kernel, r=4, **config):
    model = packed_model("moe", seed=5, moe_kernel=moe_kernel)
    wrapped = peft.get_peft_model(model, lora_config(model, r=r, targets=["experts"], **config))
    _randomize_lora(wrapped)
    return model, wrapped.train()


def _step(model, wrapped, embeds, lora_kernel):
    """Packed logits and the gradients of every trainable parameter and of the input embeddings."""
    model.config.moe_lora_kernel = lora_kernel
    wrapped.zero_grad(set_to_none=True)
    embeds = embeds.detach().clone().requires_grad_()
    cu = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()])
    logits = wrapped(inputs_embeds=embeds, cu_seqlens=cu, use_cache=False).logits
    logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(9)))
    grads = {n: p.grad.clone() for n, p in wrapped.named_parameters() if p.requires_grad}
    return logits.detach(), grads, embeds.grad


def _close(a, b, name, bound=1e-5):
    scale = b.abs().max().clamp(min=1e-6)
    assert (a - b).abs().max() <= bound * scale, (name, ((a - b).abs().max() / scale).item())


@pytest.mark.parametrize("moe_kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize(
    "r, scaling_config",
    [(4, {}), (8, dict(lora_alpha=7, use_rslora=True))],  # rank padded / not; PEFT's scaling 2 / 7 / sqrt(8)
)
def test_low_rank_products_equal_peft_fold(moe_kernel, r, scaling_config, folds):
    model, wrapped = _adapted_model(moe_kernel, r=r, **scaling_config)
    hidden = model.config.hidden_size
    embeds = torch.randn(1, sum(DOCUMENTS), hidden, generator=torch.Generator().manual_seed(4))

    low_rank = _step(model, wrapped, embeds, "auto")
    assert not folds  # no adapted [E, out, in] weight was built
    fold = _step(model, wrapped, embeds, "peft")
    # the reference really is PEFT's fold: twice per tensor (torch's registration check, then the read)
    assert len(folds) == 2 * 2 * model.config.num_hidden_layers

    _close(low_rank[0], fold[0], "logits")
    _close(low_rank[2], fold[2], "input embeddings")
    assert set(low_rank[1]) == set(fold[1]) and len(low_rank[1]) == 4 * model.config.num_hidden_layers
    for name in fold[1]:
        assert "lora_" in name and low_rank[1][name].abs().max() > 0, name  # base frozen, every factor trained
        _close(low_rank[1][name], fold[1][name], name)


class _Holder(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


@pytest.mark.parametrize("moe_kernel", ["loop", "grouped_mm"])
def test_moe_block_with_empty_experts_equals_peft_fold(moe_kernel, folds):
    """One MoE block whose tokens (replayed routing) reach experts 2, 3 and 4 of 8 only: the values, the input
    gradient and every factor gradient, the empty experts' exactly zero, and rank 3 padded to the grouped GEMM's."""
    torch.manual_seed(0)
    config = types.SimpleNamespace(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=8,
        hidden_size=16,
        hidden_act="silu",
    )
    holder = _Holder(SparseMoeBlock(config))
    with torch.no_grad():
        for p in holder.parameters():
            p.normal_(0, 0.3)
    lora = peft.LoraConfig(r=3, lora_alpha=5, target_modules=[], target_parameters=list(EXPERT_PARAMETERS))
    holder = peft.inject_adapter_in_model(lora, holder)
    _randomize_lora(holder)
    g = torch.Generator().manual_seed(1)
    n = 29
    routed = torch.stack([torch.randperm(3, generator=g)[:2] + 2 for _ in range(n)])
    x = torch.randn(n, 16, generator=g)
    results = {}
    for mode in ("auto", "peft"):
        holder.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        kernels = kernel_set(KernelChoice(gdn="torch", attention="sdpa", moe=moe_kernel, expert_lora=mode))
        out, _ = holder.mlp(xi, kernels, routed)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        grads = {name: p.grad.clone() for name, p in holder.named_parameters() if p.requires_grad}
        results[mode] = (out.detach(), xi.grad, grads)
        assert len(folds) == (0 if mode == "auto" else 4)  # PEFT: the registration check and the read, per tensor
    _close(results["auto"][0], results["peft"][0], "out")
    _close(results["auto"][1], results["peft"][1], "x")
    assert len(results["peft"][2]) == 4
    for name, grad in results["peft"][2].items():
        _close(results["auto"][2][name], grad, name)
    # lora_A [r * E, in]: rows e * r : (e + 1) * r are expert e's; lora_B [out, r * E]: columns r_i * E + e
    for name, grad in results["auto"][2].items():
        per_expert = grad.view(8, 3, -1) if "lora_A" in name else grad.view(-1, 3, 8).movedim(-1, 0)
        assert per_expert[[0, 1, 5, 6, 7]].abs().max() == 0 and per_expert[2:5].abs().amax(dim=(1, 2)).min() > 0


@pytest.mark.parametrize("moe_kernel", ["loop", "grouped_mm"])
def test_disabled_and_merged_adapters(moe_kernel):
    model, wrapped = _adapted_model(moe_kernel)
    wrapped.eval()
    ids = torch.randint(0, 128, (1, sum(DOCUMENTS)), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()])
    with torch.no_grad():
        adapted = wrapped(ids, cu_seqlens=cu, use_cache=False).logits
        with wrapped.disable_adapter():
            disabled = wrapped(ids, cu_seqlens=cu, use_cache=False).logits
        merged_model = wrapped.merge_and_unload()
        merged = merged_model(ids, cu_seqlens=cu, use_cache=False).logits
        base = packed_model("moe", seed=5, moe_kernel=moe_kernel)(ids, cu_seqlens=cu, use_cache=False).logits
    assert (disabled - base).abs().max() <= 1e-6
    assert (adapted - base).abs().max() > 1e-3
    assert (merged - adapted).abs().max() <= 1e-5


def test_several_active_adapters_run_peft_fold_and_say_so(caplog):
    model, wrapped = _adapted_model("grouped_mm")
    second = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=list(EXPERT_PARAMETERS))
    wrapped.add_adapter("second", second)
    _randomize_lora(wrapped, seed=1)
    wrapped.base_model.set_adapter(["default", "second"])
    wrapped.eval()
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="qwen35_packed"):
        auto = wrapped(ids, use_cache=False).logits
        wrapped(ids, use_cache=False)
        model.config.moe_lora_kernel = "peft"
        fold = wrapped(ids, use_cache=False).logits
        model.config.moe_lora_kernel = "low_rank"
        with pytest.raises(RuntimeError, match=r"'low_rank' was forced but experts\.\w+ has 2 active adapters"):
            wrapped(ids, use_cache=False)
    assert torch.equal(auto, fold)  # the fallback is PEFT's own path
    said = [r.getMessage() for r in caplog.records if "runs PEFT's own path" in r.getMessage()]
    assert len(said) == 1 and "has 2 active adapters (default, second)" in said[0], said
    wrapped.base_model.set_adapter("default")
    model.config.moe_lora_kernel = "low_rank"
    with torch.no_grad():
        one = wrapped(ids, use_cache=False).logits
    assert (one - auto).abs().max() > 1e-4  # the second adapter did act above


@pytest.mark.parametrize("rank", [1, 4, 8, 12, 16])
def test_grouped_operands_meet_grouped_mm_cuda_layout_checks(rank):
    """grouped_mm's meta kernel runs the CUDA kernel's checks (bf16, strides aligned to 16 bytes) without a GPU:
    forward and backward of the low-rank products with PEFT's factor views, any rank."""
    experts, out_features, in_features, rows = 4, 64, 32, 40
    with torch.device("meta"):
        base = torch.empty(experts, out_features, in_features, dtype=torch.bfloat16)
        lora_a = torch.empty(rank * experts, in_features, dtype=torch.bfloat16, requires_grad=True)
        lora_b = torch.empty(out_features, rank * experts, dtype=torch.bfloat16, requires_grad=True)
        x = torch.empty(rows, in_features, dtype=torch.bfloat16, requires_grad=True)
        offsets = torch.empty(experts, dtype=torch.int32)
    # the views PEFT's get_delta_factors hands over (B's is not contiguous)
    a = lora_a.reshape(experts, rank, in_features)
    b = lora_b.reshape(out_features, rank, experts).permute(2, 0, 1)
    out = ExpertWeight(base, a, b, 2.0).grouped_linear(x, offsets)
    out.backward(torch.empty_like(out))
    assert out.shape == (rows, out_features) and lora_a.grad.shape == lora_a.shape and x.grad.shape == x.shape
    if rank % 8:  # the check does bite unpadded ranks
        with pytest.raises(RuntimeError, match="16 bytes"):
            kernels.grouped_linear(kernels.grouped_linear(x, a.contiguous(), offsets), b.contiguous(), offsets)
