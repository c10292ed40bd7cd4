"""Which part of the MoE block gives a token a different bf16 result when its document runs alone than when it runs
packed with others (batch-size dependence of a kernel), on the GPU.

tests/test_gpu.py checks packed == per-document for the MoE model; a kernel whose rounding depends on how many
rows it multiplies at once changes hidden states by an ulp, and the router then sends near-tie tokens to other
experts. This script runs each part of one MoE block on the whole packed stream and on each document's rows alone
and counts the rows that are not bitwise equal:

  router      fp32 router logits through one F.linear
  router_blocked   the same through moe.batch_invariant_linear (fixed-size row blocks: what the router runs)
  gate        shared_expert_gate: a [rows, hidden] x [hidden, 1] product
  shared      the shared expert (three bf16 linears)
  grouped     the experts through grouped_mm, with the routing of the packed run
  loop        the experts through the per-expert loop, same routing
  block       the whole block
  experts_gate_up / _swiglu / _down / _combined   the grouped experts' intermediate results (each token's k expert
              rows side by side), to tell a GEMM from the elementwise chain or the combine

With --model it runs a whole 4-layer MoE model instead (the config and documents of tests/test_gpu.py's
packed == per-document test): the packed stream once and each document alone, recording the output of every
module and of the kernel functions the layers call (conv, delta rule, attention), and lists them in the order the
packed forward ran them with the rows that are not bitwise equal. The first row with a difference is where a
token's result starts to depend on the other documents.

    python benchmarks/moe_batch_invariance.py [--model] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM
from qwen35_packed.modeling import attention, expert_lora, gated_deltanet, kernels, moe
from qwen35_packed.modeling.moe import SparseMoeBlock, batch_invariant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [700, 1030, 1, 37, 500, 64, 3, 211, 129, 90]


def moe_config(layers: int) -> Qwen3_5MoePackedConfig:
    return Qwen3_5MoePackedConfig(
        vocab_size=1024,
        hidden_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        router_aux_loss_coef=0.0,
        rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [6, 5, 5]},
    )


# The kernel functions the layers call by name, wrapped in the module that imported them.
TRACED_FUNCTIONS = {
    gated_deltanet: ("causal_conv1d_varlen", "gated_delta_rule_varlen"),
    attention: ("varlen_causal_attention", "apply_rotary", "sigmoid_gate"),
}


def _token_rows(value, n_tokens: int):
    """The first tensor of a module's output with one row per token ([N, ...] or [1, N, ...]) as [N, -1]."""
    if isinstance(value, (tuple, list)):
        for item in value:
            rows = _token_rows(item, n_tokens)
            if rows is not None:
                return rows
        return None
    if hasattr(value, "logits"):
        value = value.logits
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() == 0:
        return None
    if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == n_tokens:
        value = value[0]
    if value.shape[0] != n_tokens:
        return None
    return value.reshape(n_tokens, -1).detach().clone()


@contextlib.contextmanager
def recording(model, n_tokens: int):
    """Yields an ordered dict name -> [N, -1] outputs of every module and traced kernel function of one forward
    (a name called more than once gets #1, #2, ... for its later calls)."""
    outputs: dict[str, torch.Tensor] = {}
    calls = collections.Counter()

    def keep(name, value):
        rows = _token_rows(value, n_tokens)
        if rows is not None:
            calls[name] += 1
            outputs[name if calls[name] == 1 else f"{name}#{calls[name] - 1}"] = rows

    hooks = [
        module.register_forward_hook(lambda m, a, out, name=name: keep(name or "model", out))
        for name, module in model.named_modules()
    ]
    originals = []
    for owner, names in TRACED_FUNCTIONS.items():
        for fn_name in names:
            original = getattr(owner, fn_name)
            originals.append((owner, fn_name, original))

            def traced(*args, _fn=original, _name=f"{owner.__name__.rsplit('.', 1)[-1]}.{fn_name}", **kwargs):
                out = _fn(*args, **kwargs)
                keep(_name, out)
                return out

            setattr(owner, fn_name, traced)
    try:
        yield outputs
    finally:
        for h in hooks:
            h.remove()
        for owner, fn_name, original in originals:
            setattr(owner, fn_name, original)


def compare_rows(whole: torch.Tensor, per_doc: torch.Tensor) -> dict:
    """Rows of the packed result that are not bitwise the rows of the documents run alone, and the largest gap."""
    return {
        "rows_not_bitwise_equal": int((~(per_doc == whole).all(-1)).sum()),
        "max_abs_diff": (per_doc.float() - whole.float()).abs().max().item(),
    }


def locate_in_model(out_path):
    """Every recorded output of a 4-layer MoE model, packed vs each document alone, in execution order."""
    torch.manual_seed(0)
    config = moe_config(layers=4)
    model = Qwen3_5MoePackedForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(DEVICE, torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, config.vocab_size, (n,), generator=gen).to(DEVICE) for n in LENGTHS]
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0, *LENGTHS], device=DEVICE).cumsum(0).to(torch.int32)
    with torch.no_grad():
        with recording(model, ids.shape[1]) as packed:
            model(ids, cu_seqlens=cu, use_cache=False)
        alone = []
        for doc in docs:
            with recording(model, doc.shape[0]) as outputs:
                model(doc[None], use_cache=False)
            alone.append(outputs)
    report = {"choice": kernels.select_kernels(config, torch.device(DEVICE), torch.bfloat16).__dict__, "rows": {}}
    first = None
    for name, whole in packed.items():
        if not all(name in outputs for outputs in alone):
            report["rows"][name] = {"missing_alone": True}
            continue
        per_doc = torch.cat([outputs[name] for outputs in alone])
        if per_doc.shape != whole.shape:
            report["rows"][name] = {"shape_packed": list(whole.shape), "shape_alone": list(per_doc.shape)}
            continue
        row = report["rows"][name] = compare_rows(whole, per_doc)
        if row["rows_not_bitwise_equal"] and first is None:
            first = name
        print(
            f"{name:<60} {row['rows_not_bitwise_equal']:>5} / {whole.shape[0]}   max |diff| {row['max_abs_diff']:.3g}",
            flush=True,
        )
    report["first_differing"] = first
    print("first output that differs:", first)
    if first is not None and ".mlp" in first:  # inside an MoE block: its router weights and expert stages
        layer = first.split(".mlp")[0]
        block = model.get_submodule(f"{layer}.mlp")
        name = f"{layer}.post_attention_layernorm"
        choice = dataclasses.replace(
            kernels.select_kernels(config, torch.device(DEVICE), torch.bfloat16), moe="grouped_mm"
        )
        with torch.no_grad():
            _, weights, index = block.gate(packed[name])
            stages = expert_stages(block.experts, packed[name], index, weights, choice)
            stages["router_weights"] = weights
            alone_stages = []
            for outputs in alone:
                _, doc_weights, doc_index = block.gate(outputs[name])
                alone_stages.append(expert_stages(block.experts, outputs[name], doc_index, doc_weights, choice))
                alone_stages[-1]["router_weights"] = doc_weights
        for stage, whole in stages.items():
            row = report["rows"][f"{layer}.mlp.experts:{stage}"] = compare_rows(
                whole, torch.cat([a[stage] for a in alone_stages])
            )
            print(f"{layer}.mlp.experts:{stage:<20} {row['rows_not_bitwise_equal']:>5} / {whole.shape[0]}", flush=True)
    if out_path:
        Path(out_path).write_text(json.dumps(report, indent=1))


def expert_stages(experts, rows, index, weights, choice) -> dict[str, torch.Tensor]:
    """The grouped experts' intermediate results for these tokens, one row per token (its k expert rows side by
    side in slot order): the first GEMM, the SwiGLU x routing weight, the second GEMM and the combined output."""
    seen, maps = collections.defaultdict(list), []
    # where each is looked up: the expert GEMMs run through expert_lora's ExpertWeight
    wrapped = {"grouped_linear": expert_lora, "weighted_swiglu": moe, "gather_sum": moe}
    originals = {name: getattr(module, name) for name, module in wrapped.items()}
    original_rows = moe.ExpertRows

    class RecordedRows(original_rows):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            maps.append(self)

    def recorder(name):
        def fn(*args, **kwargs):
            out = originals[name](*args, **kwargs)
            seen[name].append(out)
            return out

        return fn

    for name, module in wrapped.items():
        setattr(module, name, recorder(name))
    moe.ExpertRows = RecordedRows
    try:
        experts(rows, index, weights, choice)
    finally:
        for name, module in wrapped.items():
            setattr(module, name, originals[name])
        moe.ExpertRows = original_rows
    n, k = index.shape

    def per_token(t):
        return t[: n * k][maps[0].slot_of].reshape(n, -1)

    return {
        "gate_up": per_token(seen["grouped_linear"][0]),
        "swiglu": per_token(seen["weighted_swiglu"][0]),
        "down": per_token(seen["grouped_linear"][1]),
        "combined": seen["gather_sum"][0],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", action="store_true", help="locate the first differing output of a whole model")
    args = parser.parse_args()
    if args.model:
        return locate_in_model(args.out)
    torch.manual_seed(0)
    config = moe_config(layers=1)
    block = SparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    block = block.to(DEVICE, torch.bfloat16)
    config.moe_kernel = "grouped_mm"
    choice = kernels.select_kernels(config, torch.device(DEVICE), torch.bfloat16)
    x = torch.randn(sum(LENGTHS), 512, device=DEVICE).to(torch.bfloat16)
    bounds = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    with torch.no_grad():
        _, weights, index = block.gate(x)
        parts = {
            "router": lambda rows, sl: F.linear(rows.float(), block.gate.weight.float()),
            "router_blocked": lambda rows, sl: batch_invariant_linear(rows.float(), block.gate.weight.float()),
            "gate": lambda rows, sl: block.shared_expert_gate(rows),
            "shared": lambda rows, sl: block.shared_expert(rows, choice),
            "grouped": lambda rows, sl: block.experts(rows, index[sl], weights[sl], choice),
            "loop": lambda rows, sl: block.experts.looped(rows, index[sl], weights[sl]),
            "block": lambda rows, sl: block(rows, choice)[0],
        }
        slices = [slice(start, end) for start, end in zip(bounds[:-1], bounds[1:])]
        results = {name: (fn(x, slice(None)), [fn(x[sl], sl) for sl in slices]) for name, fn in parts.items()}
        # The experts' stages, each run once for the whole stream and once per document.
        whole_stages = expert_stages(block.experts, x, index, weights, choice)
        doc_stages = [expert_stages(block.experts, x[sl], index[sl], weights[sl], choice) for sl in slices]
        for stage, whole in whole_stages.items():
            results[f"experts_{stage}"] = (whole, [stages[stage] for stages in doc_stages])
        report = {"choice": choice.moe, "rows": len(x), "documents": LENGTHS, "parts": {}}
        for name, (whole, alone) in results.items():
            row = report["parts"][name] = compare_rows(whole, torch.cat(alone))
            print(
                f"{name:<8} rows not bitwise equal {row['rows_not_bitwise_equal']:>5} / {len(x)}   "
                f"max |diff| {row['max_abs_diff']:.3g}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
