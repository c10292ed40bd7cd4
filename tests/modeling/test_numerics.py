"""Numerical guards: the debug check that names the first non-finite weight, input or layer output, and the
fp32-sensitive parts (GDN decay, gated RMSNorm, zero-centred RMSNorm, router, chunked loss) fed half-precision
inputs of large magnitude: finite, and close to a float64 reference computed from the same half-precision values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import builtin_pair, tiny_kwargs

from qwen35_packed import Qwen3_5MoePackedConfig
from qwen35_packed.modeling.kernel_set import REFERENCE_KERNELS
from qwen35_packed.modeling.loss import chunked_linear_cross_entropy
from qwen35_packed.modeling.moe import TopKRouter
from qwen35_packed.modeling.numerics import NonFiniteError


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ------------------------------------------------------------------------------------------------- the debug check


def test_off_by_default_and_removable():
    _, model = builtin_pair("dense")
    assert _hooks(model) == 0  # nothing runs unless asked
    check = model.enable_numerics_check()
    assert _hooks(model) == len(list(model.modules())) + 1
    check.remove()
    assert _hooks(model) == 0


def test_non_finite_weight_is_named_when_enabled():
    _, model = builtin_pair("dense")
    with torch.no_grad():
        model.model.layers[1].linear_attn.A_log[0] = float("nan")
        model.model.layers[3].mlp.up_proj.weight[2, :3] = float("inf")
    with pytest.raises(NonFiniteError) as info:
        model.enable_numerics_check()
    assert "model.layers.1.linear_attn.A_log (nan: 1, inf: 0 of 2 values)" in str(info.value)
    assert "model.layers.3.mlp.up_proj.weight (nan: 0, inf: 3 of 8192 values)" in str(info.value)
    assert _hooks(model) == 0


def test_non_finite_input_is_named():
    _, model = builtin_pair("dense")
    model.enable_numerics_check()
    embeds = torch.randn(1, 6, 64)
    embeds[0, 2, 5] = float("inf")
    with pytest.raises(NonFiniteError, match=r"non-finite input inputs_embeds of Qwen3_5PackedForCausalLM \(nan: 0, "
                                             r"inf: 1 of 384 values\)"):  # fmt: skip
        model(inputs_embeds=embeds, use_cache=False)


def test_first_bad_layer_is_named():
    """A weight that goes bad after the check was enabled (as an optimizer step can make it): without the check the
    logits are silently non-finite; with it the error names the module whose output first holds a NaN / inf."""
    _, model = builtin_pair("dense")
    ids = torch.randint(0, 128, (1, 9))
    check = model.enable_numerics_check()
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"non-finite output of model\.layers\.2\.mlp\.down_proj \(nan: \d+, "
                                             r"inf: \d+ of 576 values\)"):  # fmt: skip
        model(ids, use_cache=False)
    check.remove()  # the same forward without the check
    with torch.no_grad():
        assert not bool(torch.isfinite(model(ids, use_cache=False).logits).all())


def test_the_check_changes_nothing_on_a_healthy_model(kind):
    _, model = builtin_pair(kind, return_logits_with_loss=True)  # the logits of training forwards are compared
    model.train()
    ids = torch.randint(0, 128, (1, 30))
    cu = torch.tensor([0, 7, 30], dtype=torch.int32)
    plain = model(ids, labels=ids, cu_seqlens=cu)
    plain.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.enable_numerics_check()
    checked = model(ids, labels=ids, cu_seqlens=cu)
    checked.loss.backward()
    assert torch.equal(checked.logits, plain.logits) and torch.equal(checked.loss, plain.loss)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


# --------------------------------------------------------------------------------- fp32-sensitive parts, half inputs


def _large(shape, magnitude, dtype, seed=0):
    """Random values spread over [magnitude / 100, magnitude] in size, both signs, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    scale = magnitude * 10 ** (-2 * torch.rand(shape, generator=g))
    return (torch.randn(shape, generator=g).sign() * scale).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_gdn_decay_stays_fp32_for_large_bf16_gate_inputs():
    _, model = builtin_pair("dense")
    model.to(torch.bfloat16)
    gdn = model.model.layers[0].linear_attn
    a = _large((50, gdn.num_v_heads), 3e4, torch.bfloat16)
    b = _large((50, gdn.num_v_heads), 1e3, torch.bfloat16, seed=1)
    g, beta = gdn.decay_and_beta(a, b)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all()) and bool(torch.isfinite(beta).all())
    a_log, dt_bias = gdn.A_log.double(), gdn.dt_bias.double()
    reference = -a_log.exp() * F.softplus(a.double() + dt_bias)
    assert _rel(g, reference) <= 1e-6
    # what a bf16-rounded A_log would give: far from the reference (the reason it stays fp32)
    rounded = -a_log.to(torch.bfloat16).double().exp() * F.softplus(a.double() + dt_bias)
    assert _rel(rounded, reference) > 1e-4


@pytest.mark.parametrize("dtype, magnitude", [(torch.float16, 6e4), (torch.bfloat16, 1e15)],
                         ids=["fp16", "bf16"])  # fmt: skip
def test_gated_rms_norm_of_large_half_inputs(dtype, magnitude):
    """fp16 squares overflow from |x| = 256 on; bf16 keeps the range but not the precision of the sum."""
    x = _large((40, 2, 64), magnitude, dtype)
    gate = _large((40, 2, 64), 1e3, dtype, seed=1)
    weight = (1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(2))).to(dtype)
    out = REFERENCE_KERNELS.gated_norm(x, gate, weight, 1e-6)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double()
    reference = weight.double() * normed * F.silu(gate.double())
    assert _rel(out, reference) <= 1e-2
    if dtype == torch.float16:  # the same formula in fp16 overflows: the fp32 path is what keeps it finite
        assert not bool(torch.isfinite(x.pow(2).mean(-1)).all())


@pytest.mark.parametrize("dtype, magnitude", [(torch.float16, 6e4), (torch.bfloat16, 1e15)],
                         ids=["fp16", "bf16"])  # fmt: skip
def test_zero_centred_rms_norm_of_large_half_inputs(dtype, magnitude):
    x = _large((40, 64), magnitude, dtype)
    weight = (0.1 * torch.randn(64, generator=torch.Generator().manual_seed(2))).to(dtype)
    out = REFERENCE_KERNELS.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    xd = x.double()
    reference = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.double())
    assert _rel(out, reference) <= 1e-2


def test_router_softmax_in_fp32_for_large_bf16_hidden_states():
    """Router inputs of up to 30 in bf16 (logits of tens): fp32 softmax, top-k and renormalisation equal float64's on
    the same bf16 values (index sets compared where the k-th and (k+1)-th probabilities are not a near-tie)."""
    config = Qwen3_5MoePackedConfig(**tiny_kwargs("moe"))
    router = TopKRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    router.to(torch.bfloat16)
    x = _large((256, 64), 30, torch.bfloat16)
    logits, top_weights, top_index = router(x)
    assert logits.dtype == top_weights.dtype == torch.float32
    assert bool(torch.isfinite(logits).all()) and bool(torch.isfinite(top_weights).all())
    k = config.num_experts_per_tok
    probs = (x.double() @ router.weight.double().t()).softmax(-1)
    ordered = probs.sort(-1, descending=True)
    clear = (ordered.values[:, k - 1] - ordered.values[:, k]) > 1e-6
    assert clear.float().mean() > 0.9
    assert torch.equal(top_index[clear].sort(-1).values, ordered.indices[clear, :k].sort(-1).values)
    reference = ordered.values[:, :k] / ordered.values[:, :k].sum(-1, keepdim=True)
    assert _rel(top_weights.sort(-1, descending=True).values[clear], reference[clear]) <= 1e-5
    assert torch.allclose(top_weights.sum(-1), torch.ones(256), atol=1e-6)


def test_chunked_loss_in_fp32_for_large_bf16_logits():
    """bf16 hidden states and LM head giving logits of ~1e4 (a cross-entropy in bf16 would be meaningless there):
    the loss equals the float64 cross-entropy of the same bf16 logits, over several chunks, and the gradients are
    finite and close to float64 autograd."""
    g = torch.Generator().manual_seed(4)
    hidden = (torch.randn(37, 64, generator=g) * 30).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(128, 64, generator=g) * 10).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 128, (37,), generator=g)
    targets[::5] = -100
    loss, _ = chunked_linear_cross_entropy(hidden, weight, targets, chunk_tokens=8)
    loss.backward()
    logits = (hidden.detach() @ weight.detach().t()).double().requires_grad_()  # the same bf16 matmul
    assert logits.abs().max() > 5e3
    reference = F.cross_entropy(logits, targets, ignore_index=-100)
    assert torch.isfinite(loss) and abs(loss.item() - reference.item()) <= 1e-6 * reference.item()
    reference.backward()
    valid = targets != -100
    assert bool(torch.isfinite(hidden.grad).all()) and bool(torch.isfinite(weight.grad).all())
    assert _rel(hidden.grad[valid], (logits.grad @ weight.detach().double())[valid]) <= 1e-2
    assert _rel(weight.grad, logits.grad.t() @ hidden.detach().double()) <= 1e-2


def test_bf16_model_with_large_activations_passes_the_check(kind):
    """The whole bf16 model on inputs 1000x larger than embeddings: no non-finite value anywhere (checked per
    module), logits close to the fp32 model's on the same inputs."""
    _, model = builtin_pair(kind)
    embeds = _large((1, 40, 64), 1e3, torch.float32)
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    with torch.no_grad():
        reference = model(inputs_embeds=embeds, cu_seqlens=cu, use_cache=False).logits
    model.to(torch.bfloat16)
    model.enable_numerics_check()
    with torch.no_grad():
        logits = model(inputs_embeds=embeds.to(torch.bfloat16), cu_seqlens=cu, use_cache=False).logits
    assert logits.dtype == torch.bfloat16
    assert _rel(logits, reference) <= 2e-2  # measured 0.3% (dense and MoE)
