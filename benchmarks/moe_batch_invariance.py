"""Which part of the MoE block gives a token a different bf16 result when its document runs alone than when it runs
packed with others (batch-size dependence of a kernel), on the GPU.

tests/gpu/test_gpu.py checks packed == per-document for the MoE model; a kernel whose rounding depends on how many
rows it multiplies at once changes hidden states by an ulp, and the router then sends near-tie tokens to other
experts. This script runs each part of one MoE block on the whole packed stream and on each document's rows alone
and counts the rows that are not bitwise equal:

  router      fp32 router logits through one F.linear
  router_blocked   the same through projection.row_block_product (fixed-size row blocks: what the router runs)
  gate        shared_expert_gate: a [rows, hidden] x [hidden, 1] product
  shared      the shared expert (three bf16 linears)
  grouped     the experts through grouped_mm, with the routing of the packed run
  loop        the experts through the per-expert loop, same routing
  block       the whole block
  experts_gate_up / _swiglu / _down / _combined   the grouped experts' intermediate results (each token's k expert
              rows side by side), to tell a GEMM from the elementwise chain or the combine

Every part runs twice: as the model runs it (every projection row-invariant, modeling/projection.py) and with plain
GEMMs (suffix _plain, projection.plain_products()), to show which GEMM the invariant products are for.

With --model it runs a whole 4-layer MoE model instead, the packed stream once and each document alone, recording
the output of every module and of the kernel functions the layers call (conv, delta rule, attention), and lists
them in the order the packed forward ran them with the rows that are not bitwise equal. The first row with a
difference is where a token's result starts to depend on the other documents. It runs the model as it is and
again with plain GEMMs.

--shapes small: hidden 512, 32 experts, top-4 and ten documents of 1 to 1,030 tokens (tests/gpu/test_gpu.py's small
config). --shapes 35b-a3b: Qwen3.5-35B-A3B's layer shapes (hidden 2048, 256 experts, top-8, moe_intermediate and
shared expert 512; vocab 65,536 in the model) and the RL batch of bench_train_step.py (16 documents, 26,354
tokens). --extra-docs 1,7,64 appends documents of those lengths. The model's packed outputs are kept on the host
and each document's compared as it runs.

    python benchmarks/moe_batch_invariance.py [--shapes small|35b-a3b] [--model] [--extra-docs N,..] [--out FILE]
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
from bench_moe import layer_shapes
from bench_train_step import batches, default_dtype

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM
from qwen35_packed.modeling import attention, expert_lora, kernel_selection, moe
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.moe import SparseMoeBlock
from qwen35_packed.modeling.projection import plain_products, row_block_product

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_LENGTHS = [700, 1030, 1, 37, 500, 64, 3, 211, 129, 90]


def shapes_of(shapes: str, layers: int) -> tuple[Qwen3_5MoePackedConfig, list[int]]:
    """The config and document lengths of --shapes."""
    if shapes == "small":
        return small_config(layers), SMALL_LENGTHS
    return Qwen3_5MoePackedConfig(**layer_shapes(layers, 248_320, tiny=False)), batches()["rl_longtail_x16"] + [
        1,
        7,
        64,
    ]


def small_config(layers: int) -> Qwen3_5MoePackedConfig:
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


# The kernels the layers call through the model's kernel set, and the functions they call by name (wrapped in the
# module that imported them).
TRACED_KERNELS = {"gated_deltanet": ("conv", "delta_rule"), "attention": ("attention", "sigmoid_gate")}
TRACED_FUNCTIONS = {attention: ("apply_rotary",)}


def _token_rows(value, n_tokens: int, device=None):
    """The first tensor of a module's output with one row per token ([N, ...] or [1, N, ...]) as [N, -1]."""
    if isinstance(value, (tuple, list)):
        for item in value:
            rows = _token_rows(item, n_tokens, device)
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
    return value.reshape(n_tokens, -1).detach().to(device, copy=True)


@contextlib.contextmanager
def recording(model, n_tokens: int, device=None):
    """Yields an ordered dict name -> [N, -1] outputs of every module and traced kernel function of one forward
    (a name called more than once gets #1, #2, ... for its later calls), kept on `device` (default: where they
    are)."""
    outputs: dict[str, torch.Tensor] = {}
    calls = collections.Counter()

    def keep(name, value):
        rows = _token_rows(value, n_tokens, device)
        if rows is not None:
            calls[name] += 1
            outputs[name if calls[name] == 1 else f"{name}#{calls[name] - 1}"] = rows

    hooks = [
        module.register_forward_hook(lambda m, a, out, name=name: keep(name or "model", out))
        for name, module in model.named_modules()
    ]

    def traced(fn, name):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            keep(name, out)
            return out

        return call

    backbone = model.model
    kernels = backbone.kernels_for(next(model.parameters()).device, next(model.parameters()).dtype)
    backbone.inject_kernels(
        dataclasses.replace(
            kernels,
            **{
                member: traced(getattr(kernels, member), f"{owner}.{member}")
                for owner, members in TRACED_KERNELS.items()
                for member in members
            },
        )
    )
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
        backbone.inject_kernels(None)


def compare_rows(whole: torch.Tensor, per_doc: torch.Tensor) -> dict:
    """Rows of the packed result that are not bitwise the rows of the documents run alone, and the largest gap."""
    return {
        "rows_not_bitwise_equal": int((~(per_doc == whole).all(-1)).sum()),
        "max_abs_diff": (per_doc.float() - whole.float()).abs().max().item(),
    }


def locate_in_model(config, lengths, plain: bool) -> dict:
    """Every recorded output of a 4-layer MoE model, packed vs each document alone, in execution order. The packed
    outputs wait on the host; each document's are compared as it runs."""
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16), torch.device(DEVICE):
        model = Qwen3_5MoePackedForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, config.vocab_size, (n,), generator=gen).to(DEVICE) for n in lengths]
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
    rows: dict[str, dict] = {}
    with torch.no_grad(), plain_products() if plain else contextlib.nullcontext():
        with recording(model, ids.shape[1], device="cpu") as packed:
            model(ids, cu_seqlens=cu, use_cache=False)
        start = 0
        for doc in docs:
            with recording(model, doc.shape[0]) as outputs:
                model(doc[None], use_cache=False)
            for name, whole in packed.items():
                row = rows.setdefault(name, {"rows_not_bitwise_equal": 0, "max_abs_diff": 0.0})
                if name not in outputs or outputs[name].shape[1:] != whole.shape[1:]:
                    row["missing_alone"] = True
                    continue
                part = compare_rows(whole[start : start + doc.shape[0]].to(DEVICE), outputs[name])
                row["rows_not_bitwise_equal"] += part["rows_not_bitwise_equal"]
                row["max_abs_diff"] = max(row["max_abs_diff"], part["max_abs_diff"])
            start += doc.shape[0]
    print(f"--- model, {'plain GEMMs' if plain else 'as it runs (fixed row blocks)'}")
    first = next((name for name, row in rows.items() if row["rows_not_bitwise_equal"]), None)
    for name, row in rows.items():
        print(
            f"{name:<60} {row['rows_not_bitwise_equal']:>5} / {ids.shape[1]}   max |diff| {row['max_abs_diff']:.3g}",
            flush=True,
        )
    print("first output that differs:", first)
    return {
        "choice": kernel_selection.select_kernels(config, torch.device(DEVICE), torch.bfloat16).__dict__,
        "plain_gemms": plain,
        "first_differing": first,
        "rows": rows,
    }


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
        experts(rows, index, weights, kernel_set(choice))
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


def locate_in_block(config, lengths) -> dict:
    """Each part of one MoE block (random weights), the whole stream vs each document's rows alone."""
    torch.manual_seed(0)
    block = SparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    block = block.to(DEVICE, torch.bfloat16)
    config.moe_kernel = "grouped_mm"
    choice = kernel_selection.select_kernels(config, torch.device(DEVICE), torch.bfloat16)
    x = torch.randn(sum(lengths), config.hidden_size, device=DEVICE).to(torch.bfloat16)
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    slices = [slice(start, end) for start, end in zip(bounds[:-1], bounds[1:])]
    report = {"choice": choice.moe, "rows": len(x), "documents": lengths, "parts": {}}
    with torch.no_grad():
        _, weights, index = block.gate(x)
        parts = {
            "router": lambda rows, sl: F.linear(rows.float(), block.gate.weight.float()),
            "router_blocked": lambda rows, sl: row_block_product(rows.float(), block.gate.weight.float()),
            "gate": lambda rows, sl: block.shared_expert_gate(rows),
            "shared": lambda rows, sl: block.shared_expert(rows, kernel_set(choice)),
            "grouped": lambda rows, sl: block.experts(rows, index[sl], weights[sl], kernel_set(choice)),
            "loop": lambda rows, sl: block.experts.looped(rows, index[sl], weights[sl]),
            "block": lambda rows, sl: block(rows, kernel_set(choice))[0],
        }
        results = {}
        for plain in (False, True):
            with plain_products() if plain else contextlib.nullcontext():
                suffix = "_plain" if plain else ""
                for name, fn in parts.items():
                    if plain and name in ("router", "router_blocked", "grouped", "loop"):
                        continue  # the blocks do not reach them
                    results[name + suffix] = (fn(x, slice(None)), [fn(x[sl], sl) for sl in slices])
        # The experts' stages, each run once for the whole stream and once per document.
        whole_stages = expert_stages(block.experts, x, index, weights, choice)
        doc_stages = [expert_stages(block.experts, x[sl], index[sl], weights[sl], choice) for sl in slices]
        for stage, whole in whole_stages.items():
            results[f"experts_{stage}"] = (whole, [stages[stage] for stages in doc_stages])
        for name, (whole, alone) in results.items():
            row = report["parts"][name] = compare_rows(whole, torch.cat(alone))
            print(
                f"{name:<22} rows not bitwise equal {row['rows_not_bitwise_equal']:>5} / {len(x)}   "
                f"max |diff| {row['max_abs_diff']:.3g}",
                flush=True,
            )
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", choices=("small", "35b-a3b"), default="small")
    parser.add_argument("--model", action="store_true", help="locate the first differing output of a whole model")
    parser.add_argument("--extra-docs", default="", help="document lengths appended to the batch, e.g. 1,7,64")
    args = parser.parse_args()
    extra = [int(n) for n in args.extra_docs.split(",") if n]
    if args.model:
        config, lengths = shapes_of(args.shapes, layers=4)
        lengths = lengths + extra
        report = {
            "shapes": args.shapes,
            "documents": lengths,
            "as_it_runs": locate_in_model(config, lengths, plain=False),
            "plain_gemms": locate_in_model(config, lengths, plain=True),
        }
    else:
        config, lengths = shapes_of(args.shapes, layers=1)
        lengths = lengths + extra
        report = {"shapes": args.shapes, **locate_in_block(config, lengths)}
    report["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    report["torch"] = torch.__version__
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
