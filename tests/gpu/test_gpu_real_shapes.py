"""GPU checks at the shapes users train (run on the H200, skipped elsewhere): packed == per-document bit for bit in
bf16 for Qwen3.5-4B (its official config, first 8 of 32 layers) and for Qwen3.5-35B-A3B's layer shapes (first 4 of
40 layers, vocab 248,320), in eval and in train mode, with the kernels `auto` picks; every token-layer of the MoE
routed to the same experts; and packed vs per-document gradients at the 35B-A3B shapes within the bf16 bound.

The batch is bench_train_step.py's RL batch (16 documents of 192 to 3,600 tokens, 26,354 tokens) packed into one
row (cu_seqlens), against each document run alone through the same model. Documents of a few dozen tokens are not
covered at these shapes: alone, their dense projections run through other cuBLAS algorithms
(benchmarks/moe_batch_invariance.py --extra-docs, docs/guarantees.md). Random weights (seed 0,
norm weights moved off zero so every layer's scale matters). The small-config MoE test in test_gpu.py stays: it
passed while these shapes did not (their GEMMs reach other cuBLAS algorithms). QWEN35_GPU_RESULTS=FILE writes the
measured numbers."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_moe import layer_shapes  # noqa: E402
from bench_train_step import batches, default_dtype, model_kwargs  # noqa: E402
from test_gpu import _routing  # noqa: E402

from qwen35_packed import (  # noqa: E402
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.modeling import kernel_selection  # noqa: E402

RESULTS: dict = {}
LENGTHS = batches()["rl_longtail_x16"]
# Parameter groups of the gradient check, by name fragment (first match).
GROUPS = (
    ("embed_tokens", "embed_tokens"),
    ("lm_head", "lm_head"),
    ("router", "mlp.gate."),
    ("shared_expert_gate", "shared_expert_gate"),
    ("shared_expert", "shared_expert."),
    ("experts", "mlp.experts"),
    ("gdn", "linear_attn"),
    ("attention", "self_attn"),
    ("norms", "norm"),
)


@pytest.fixture(scope="module", autouse=True)
def write_results():
    yield
    path = os.environ.get("QWEN35_GPU_RESULTS")
    if path:
        RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, documents=LENGTHS)
        Path(path).write_text(json.dumps(RESULTS, indent=2))


def build(kind: str):
    """Qwen3.5-4B (8 layers) or the 35B-A3B layer shapes (4 layers, real vocab), bf16 on the GPU, seed 0."""
    torch.manual_seed(0)
    if kind == "dense_4b_8_layers":
        config = Qwen3_5PackedConfig(**model_kwargs("qwen35_4b", layers=8))
        cls = Qwen3_5PackedForCausalLM
    else:
        config = Qwen3_5MoePackedConfig(**layer_shapes(4, 248_320, tiny=False))
        cls = Qwen3_5MoePackedForCausalLM
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def documents(vocab: int):
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, vocab, (n,), generator=gen).cuda() for n in LENGTHS]
    cu = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    return docs, torch.cat(docs)[None], cu


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("kind", ["dense_4b_8_layers", "moe_35b_a3b_shapes_4_layers"])
def test_packed_equals_per_document_bitwise_at_real_shapes(kind, mode):
    model = build(kind)
    model.train(mode == "train")
    choice = kernel_selection.select_kernels(model.config, torch.device("cuda"), torch.bfloat16)
    docs, ids, cu = documents(model.config.vocab_size)
    moe = kind.startswith("moe")
    with torch.set_grad_enabled(mode == "train"):
        packed, packed_routes = _routing(model, lambda: model(ids, cu_seqlens=cu, use_cache=False).logits[0].detach())
        worst, differing, same_routes, start = 0.0, 0, 0, 0
        for doc in docs:
            alone, routes = _routing(model, lambda d=doc: model(d[None], use_cache=False).logits[0].detach())
            rows = packed[start : start + doc.shape[0]]
            worst = max(worst, (rows.float() - alone.float()).abs().max().item())
            differing += int((rows != alone).any(-1).sum())
            same_routes += sum(
                int((whole[start : start + doc.shape[0]] == part).all(-1).sum())
                for whole, part in zip(packed_routes, routes)
            )
            start += doc.shape[0]
    token_layers = sum(r.shape[0] for r in packed_routes)
    row = RESULTS.setdefault(kind, {})[mode] = {
        "kernels": {"gdn": choice.gdn, "conv": choice.conv, "attention": choice.attention, "moe": choice.moe},
        "max_abs_logit_diff": worst,
        "rows_not_bitwise_equal": differing,
        "tokens": ids.shape[1],
    }
    if moe:
        row.update(same_routing=same_routes, token_layers=token_layers)
    print(kind, mode, row)
    assert choice.gdn in ("flash_qla", "fla") and choice.attention in ("flash_attn", "torch_varlen")
    assert differing == 0 and worst == 0.0
    if moe:
        assert choice.moe == "grouped_mm" and same_routes == token_layers


def group_of(name: str) -> str:
    return next(group for group, fragment in GROUPS if fragment in name)


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
def test_gradients_packed_vs_per_document_at_35b_a3b_shapes_bf16():
    """Summed-token loss (num_items_in_batch=1): the packed step's gradient against the sum of the per-document
    steps' gradients, relative error per parameter group. The forwards are bit for bit equal (the test above) and
    route alike, so only summation order differs: a weight gradient is one GEMM over the whole stream packed and one
    per document alone, added in bf16 into .grad. Each group's error is that rounding, a few bf16 ulps of the
    group's norm; a leak between documents or a wrong target moves whole rows."""
    model = build("moe_35b_a3b_shapes_4_layers").train()
    docs, ids, cu = documents(model.config.vocab_size)
    model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=1, use_cache=False).loss.backward()
    packed = {n: p.grad.float() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for doc in docs:
        model(doc[None], labels=doc[None], num_items_in_batch=1, use_cache=False).loss.backward()
    diff, norm = {}, {}
    for n, p in model.named_parameters():
        group = group_of(n)
        diff[group] = diff.get(group, 0.0) + (packed[n] - p.grad.float()).pow(2).sum().item()
        norm[group] = norm.get(group, 0.0) + p.grad.float().pow(2).sum().item()
    errors = {group: (diff[group] / max(norm[group], 1e-30)) ** 0.5 for group in diff}
    RESULTS["moe_35b_a3b_shapes_4_layers"] = {
        **RESULTS.get("moe_35b_a3b_shapes_4_layers", {}),
        "grad_relative_error_packed_vs_per_document": errors,
    }
    print(errors)
    assert set(errors) == {group for group, _ in GROUPS}
    assert max(errors.values()) <= 3e-2, errors
