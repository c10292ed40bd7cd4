"""The Triton elementwise kernels (modeling/triton_elementwise.py) against the eager formulas of reference_kernels.py.

Triton's interpreter runs the kernels on CPU tensors when TRITON_INTERPRET=1 is set before they are decorated, so
the checks run in a fresh process with it set and report their measured errors as JSON; the tests below assert on
them. fp32: outputs and every gradient against the eager chain with autograd; bf16: against the fp32 chain on the
same rounded inputs. Then a whole tiny model, packed, forward and backward with elementwise="triton" against
"eager".
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_triton_interpreted

pytest.importorskip("triton")

from qwen35_packed.modeling import kernel_selection, triton_elementwise, triton_support  # noqa: E402

INTERPRETED_CHECKS = r"""
import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "tests")
from conftest import tiny_kwargs
from qwen35_packed import (Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM, Qwen3_5PackedConfig,
                           Qwen3_5PackedForCausalLM)
from qwen35_packed.modeling import kernel_selection, modeling_qwen3_5_packed, reference_kernels, triton_elementwise as te
from qwen35_packed.modeling.kernel_set import kernel_set

results = {}


def compare(name, make_inputs, eager_fn, triton_fn, dtype, seed):
    # Activations (2-D) in `dtype`, parameters (1-D) in fp32; the eager chain in fp32 on the same rounded values.
    inputs = make_inputs(torch.Generator().manual_seed(seed))
    rounded = [t.to(dtype if t.dim() > 1 else torch.float32) for t in inputs]
    runs = {}
    for label, fn, leaves in (
        ("eager", eager_fn, [t.float().clone().requires_grad_() for t in rounded]),
        ("triton", triton_fn, [t.clone().requires_grad_() for t in rounded]),
    ):
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        cot = torch.Generator().manual_seed(seed + 1)
        sum((o.float() * torch.randn(o.shape, generator=cot)).sum() for o in outs).backward()
        runs[label] = ([o.detach().float() for o in outs], [t.grad.float() for t in leaves], [str(o.dtype) for o in outs])
    (eo, eg, _), (to, tg, dtypes) = runs["eager"], runs["triton"]
    results[name] = {
        "out": max(((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item() for a, b in zip(eo, to)),
        "grads": [((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item() for a, b in zip(eg, tg)],
        "dtypes": dtypes,
    }


def norm_inputs(rows, width):
    return lambda gen: (torch.randn(rows, width, generator=gen) * 3, torch.randn(width, generator=gen) * 0.2)


def pair_inputs(rows, width):
    return lambda gen: (torch.randn(rows, width, generator=gen) * 3, torch.randn(rows, width, generator=gen) * 3)


def gate_inputs(rows, heads):
    # a spans both sides of softplus's threshold (20) and far below zero (where log1p keeps the digits)
    return lambda gen: (torch.randn(rows, heads, generator=gen) * 15, torch.randn(rows, heads, generator=gen) * 4,
                        torch.rand(heads, generator=gen).mul(16).add(0.01).log(), torch.randn(heads, generator=gen))


for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    for rows, width in ((37, 64), (5, 100), (300, 256)):  # partial row blocks, a width that is no power of two
        compare(f"rms_norm_{tag}_{rows}x{width}", norm_inputs(rows, width),
                lambda x, w: reference_kernels.zero_centred_rms_norm(x, w, 1e-6), lambda x, w: te.rms_norm(x, w, 1e-6),
                dtype, rows)
    for rows, width in ((37, 64), (300, 128), (9, 100)):  # the GDN head widths, and one that is no power of two
        compare(f"gated_rms_norm_{tag}_{rows}x{width}",
                lambda gen: (*pair_inputs(rows, width)(gen), torch.rand(width, generator=gen) + 0.5),
                lambda x, g, w: reference_kernels.gated_rms_norm(x, g, w, 1e-6),
                lambda x, g, w: te.gated_rms_norm(x, g, w, 1e-6), dtype, rows)
    compare(f"swiglu_{tag}", pair_inputs(41, 96), reference_kernels.swiglu, te.swiglu, dtype, 1)
    compare(f"sigmoid_gate_{tag}", pair_inputs(41, 96), reference_kernels.sigmoid_gate, te.sigmoid_gate, dtype, 2)
    compare(f"gdn_gates_{tag}", gate_inputs(300, 12), lambda a, b, al, dt: reference_kernels.gdn_gates(a, b, al, dt),
            te.gdn_gates, dtype, 3)
    compare(f"weighted_swiglu_{tag}", lambda gen: (torch.randn(70, 2 * 24, generator=gen) * 3,
                                                   torch.rand(70, generator=gen)),
            reference_kernels.weighted_swiglu, te.weighted_swiglu, dtype, 4)

# softplus far below zero: log(1 + exp(a)) would round to 0 where log1p keeps exp(a)
a = torch.tensor([[-30.0, -17.0, 0.0, 19.9, 20.1, 40.0]])
g, _ = te.gdn_gates(a, torch.zeros_like(a), torch.zeros(6), torch.zeros(6))
results["softplus_relative"] = ((g + F.softplus(a)).abs() / F.softplus(a)).max().item()

# Rows are computed on their own: a slice of rows gives the same values.
x, w = torch.randn(50, 64), torch.randn(64)
full = te.rms_norm(x, w, 1e-6)
results["rms_norm_rows_independent"] = all(torch.equal(te.rms_norm(x[a:b], w, 1e-6), full[a:b])
                                           for a, b in ((0, 1), (3, 20), (20, 50)))
g = torch.randn(50, 64)
full = te.gated_rms_norm(x, g, w, 1e-6)
results["gated_rms_norm_rows_independent"] = all(torch.equal(te.gated_rms_norm(x[a:b], g[a:b], w, 1e-6), full[a:b])
                                                 for a, b in ((0, 1), (3, 20), (20, 50)))
results["empty"] = [list(te.rms_norm(torch.randn(0, 64), w, 1e-6).shape), list(te.swiglu(*pair_inputs(0, 8)(
    torch.Generator()))[0:0].shape)]

# What autograd keeps for the backward: the kernels keep their bf16 inputs (and the norm's fp32 row scales), the
# eager chains their fp32 temporaries as well.
def saved_bytes(fn, *inputs):
    total = 0

    def pack(t):
        nonlocal total
        total += t.untyped_storage().nbytes()
        return t

    leaves = [t.clone().requires_grad_() for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return total


gen = torch.Generator().manual_seed(6)
x, w = torch.randn(64, 256, generator=gen).bfloat16(), torch.randn(256, generator=gen).bfloat16()
p, q = torch.randn(64, 256, generator=gen).bfloat16(), torch.randn(64, 256, generator=gen).bfloat16()
gu, rw = torch.randn(64, 512, generator=gen).bfloat16(), torch.rand(64, generator=gen)
results["saved_bytes"] = {
    name: {"eager": saved_bytes(eager, *args), "triton": saved_bytes(fused, *args)}
    for name, eager, fused, args in (
        ("rms_norm", lambda a, b: reference_kernels.zero_centred_rms_norm(a, b, 1e-6), lambda a, b: te.rms_norm(a, b, 1e-6),
         (x, w)),
        ("swiglu", reference_kernels.swiglu, te.swiglu, (p, q)),
        ("sigmoid_gate", reference_kernels.sigmoid_gate, te.sigmoid_gate, (p, q)),
        ("weighted_swiglu", reference_kernels.weighted_swiglu, te.weighted_swiglu, (gu, rw)),
    )
}

# A whole tiny model, packed, with every chain through the kernels: logits and gradients against eager, both
# measured against the eager model in fp64 (the GDN decay parameters' gradients are sums with cancellation, where
# fp32 summation order alone moves them by ~1e-4).
cu = torch.tensor([0, 7, 30, 45], dtype=torch.int32)
for kind, model_class, config_class, moe in (
    ("dense", Qwen3_5PackedForCausalLM, Qwen3_5PackedConfig, "loop"),
    # grouped_mm: torch's CPU fallback runs it in fp32; the experts' weighted SwiGLU is a chain there
    ("moe", Qwen3_5MoePackedForCausalLM, Qwen3_5MoePackedConfig, "grouped_mm"),
):
    ids = torch.randint(0, tiny_kwargs(kind)["vocab_size"], (1, 45), generator=torch.Generator().manual_seed(5))
    runs = {}
    # fp64: the per-expert loop (grouped_mm has no fp64 kernel); a route that fp32 flips moves both fp32 runs alike
    for label, mode, dtype, experts in (("eager", "eager", torch.float32, moe), ("triton", "triton", torch.float32, moe),
                                        ("fp64", "eager", torch.float64, "loop")):
        CHOICE = kernel_selection.KernelChoice("torch", "sdpa", mode, moe=experts)
        torch.manual_seed(0)
        model = model_class(config_class(**tiny_kwargs(kind), return_logits_with_loss=True)).train().to(dtype)
        model.model.inject_kernels(kernel_set(CHOICE))
        out = model(input_ids=ids, labels=ids, cu_seqlens=cu)
        out.loss.backward()
        runs[label] = (out.logits.detach().double(),
                       {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None})
    reference_logits, reference_grads = runs["fp64"]
    every_reference = torch.cat([g.flatten() for g in reference_grads.values()])
    results[f"model_{kind}"] = {
        label: {
            "logits": (runs[label][0] - reference_logits).abs().max().item(),
            "grads": {n: ((g - reference_grads[n]).norm() / (reference_grads[n].norm() + 1e-30)).item()
                      for n, g in runs[label][1].items()},
            "all_grads": ((torch.cat([runs[label][1][n].flatten() for n in reference_grads]) - every_reference).norm()
                          / every_reference.norm()).item(),
        }
        for label in ("eager", "triton")
    }

# Recomputed chain outputs (modeling/recompute.py) rerun the same kernels in the backward: bf16 gradients equal
# those of keeping the outputs, bit for bit, for a dense and a MoE model.
import contextlib
for kind, model_class, config_class, moe in (
    ("dense", Qwen3_5PackedForCausalLM, Qwen3_5PackedConfig, "loop"),
    ("moe", Qwen3_5MoePackedForCausalLM, Qwen3_5MoePackedConfig, "grouped_mm"),
):
    CHOICE = kernel_selection.KernelChoice("torch", "sdpa", "triton", moe=moe)
    torch.manual_seed(0)
    model = model_class(config_class(**tiny_kwargs(kind))).train().to(torch.bfloat16)
    model.model.inject_kernels(kernel_set(CHOICE))
    ids = torch.randint(0, tiny_kwargs(kind)["vocab_size"], (1, 45), generator=torch.Generator().manual_seed(7))
    grads = {}
    original = modeling_qwen3_5_packed.RecomputedActivations
    for mode in ("recomputed", "kept"):
        modeling_qwen3_5_packed.RecomputedActivations = original if mode == "recomputed" else contextlib.nullcontext
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, cu_seqlens=cu).loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    modeling_qwen3_5_packed.RecomputedActivations = original
    results[f"recompute_bitwise_{kind}"] = {
        "parameters": len(grads["kept"]),
        "unequal": sorted(n for n, g in grads["kept"].items() if not torch.equal(g, grads["recomputed"][n])),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreted(INTERPRETED_CHECKS)


CHAINS = [
    "rms_norm_{}_37x64",
    "gated_rms_norm_{}_37x64",
    "gated_rms_norm_{}_300x128",
    "gated_rms_norm_{}_9x100",
    "rms_norm_{}_5x100",
    "rms_norm_{}_300x256",
    "swiglu_{}",
    "sigmoid_gate_{}",
    "gdn_gates_{}",
    "weighted_swiglu_{}",
]


@pytest.mark.parametrize("chain", CHAINS)
def test_fp32_outputs_and_gradients_match_the_eager_chain(interpreted, chain):
    result = interpreted[chain.format("fp32")]
    assert result["out"] <= 1e-6 and max(result["grads"]) <= 1e-5, result


@pytest.mark.parametrize("chain", CHAINS)
def test_bf16_is_the_fp32_chain_rounded(interpreted, chain):
    # fp32 inside, one rounding of the output (Triton's interpreter truncates to bf16: up to one ulp); gradients
    # rounded to bf16 once more
    result = interpreted[chain.format("bf16")]
    assert result["out"] <= 2**-7 and max(result["grads"]) <= 2**-6, result
    want = ["torch.float32", "torch.bfloat16"] if chain.startswith("gdn_gates") else ["torch.bfloat16"]
    assert result["dtypes"] == want, result


def test_softplus_keeps_the_digits_far_below_zero(interpreted):
    assert interpreted["softplus_relative"] <= 1e-6


def test_rows_are_computed_on_their_own(interpreted):
    assert interpreted["rms_norm_rows_independent"] is True
    assert interpreted["gated_rms_norm_rows_independent"] is True
    assert interpreted["empty"] == [[0, 64], [0, 8]]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_packed_model_with_triton_chains_is_as_close_to_fp64_as_eager(interpreted, kind):
    eager, triton = interpreted[f"model_{kind}"]["eager"], interpreted[f"model_{kind}"]["triton"]
    assert sorted(triton["grads"]) == sorted(eager["grads"])
    assert triton["logits"] <= 1e-5 and eager["logits"] <= 1e-5, (triton["logits"], eager["logits"])
    assert triton["all_grads"] <= 2 * eager["all_grads"] + 1e-7, (triton["all_grads"], eager["all_grads"])
    # Per parameter, fp32 noise reaches ~5e-4 of the GDN decay parameters' gradients (sums over tokens with
    # cancellation, where an ulp upstream moves them): the bound catches a wrong formula, not that noise, which the
    # per-chain tests above hold tightly.
    for name, error in triton["grads"].items():
        assert error <= 2 * eager["grads"][name] + 1e-3, (name, error, eager["grads"][name])


@pytest.mark.parametrize("chain", ["rms_norm", "swiglu", "sigmoid_gate", "weighted_swiglu"])
def test_the_kernels_keep_less_for_the_backward_than_the_eager_chain(interpreted, chain):
    saved = interpreted["saved_bytes"][chain]
    assert 0 < saved["triton"] < 0.75 * saved["eager"], saved


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_recomputed_outputs_give_the_kept_outputs_gradients_bit_for_bit(interpreted, kind):
    result = interpreted[f"recompute_bitwise_{kind}"]
    assert result["parameters"] > 10 and result["unequal"] == [], result


def test_triton_chains_are_chosen_only_where_they_run():
    from qwen35_packed.configuration.configuration_qwen3_5_packed import Qwen3_5PackedConfig

    with pytest.raises(RuntimeError, match="elementwise_kernel='triton' was forced"):
        kernel_selection.select_kernels(
            Qwen3_5PackedConfig(elementwise_kernel="triton"), torch.device("cpu"), torch.float32
        )
    assert (
        kernel_selection.select_kernels(Qwen3_5PackedConfig(), torch.device("cpu"), torch.float32).elementwise
        == "eager"
    )


@pytest.mark.skipif(triton_support.INTERPRETED, reason="kernels interpreted in this process (TRITON_INTERPRET=1)")
def test_cpu_tensors_need_the_interpreter():
    with pytest.raises(ValueError, match="run on CUDA tensors"):
        triton_elementwise.swiglu(torch.randn(4, 4), torch.randn(4, 4))
