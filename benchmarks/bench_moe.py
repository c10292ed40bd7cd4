"""MoE training-step benchmark on one GPU: qwen35-packed vs transformers' built-in Qwen3.5-MoE, side by side.

A model with the per-layer shapes of Qwen3.5-35B-A3B (hidden 2048, 256 experts, top-8, moe_intermediate 512,
shared expert 512, GDN 16/32 heads x 128, attention 16 heads x 256 with 2 kv heads) and fewer layers, so that both
models fit one GPU, with vocab 65,536 and the real 248,320. bf16 forward + backward on bench_train_step's batches
(same seeds), one model on the GPU at a time, in one process. Runs per batch:

  * ours_packed             this project, packed (cu_seqlens), experts as the kernel choice picks (grouped_mm)
  * ours_packed_loop        the same with moe_kernel="loop" (the per-expert reference), first model only
  * ours_packed_eager_combine   the same with moe_combine_kernel="eager" (the gather and sum instead of the Triton
                            top-k combine), first model only
  * ours_packed_plain_gemms the same with every projection (GDN, attention, shared expert and its gate, router,
                            lm_head) as a plain cuBLAS GEMM instead of the row-invariant product
                            (modeling/projection.py; not batch-invariant: the cost of invariance), first model only
  * builtin_correct_packed  the built-in with grouped_mm experts (its default) on its correct packed path:
                            cu_seq_lens + seq_idx, with FLA and causal_conv1d installed (the baseline)
  * builtin_correct_packed_eager   the same with experts_implementation="eager"
  * ours_lora / builtin_lora       PEFT LoRA r=16 on GDN, attention and the experts (target_parameters), same
                                   config for both, base frozen; ours with moe_lora_kernel="auto"
  * ours_lora_low_rank      ours_lora with moe_lora_kernel="low_rank": the expert adapters as low-rank products on
                            the expert rows (modeling/expert_lora.py; auto's choice on CPU, opt-in on CUDA until
                            measured there), first model only
  * ours_lora_peft_fold     ours_lora with moe_lora_kernel="peft": PEFT's own path, the adapted expert weights
                            rebuilt every forward, first model only

Rows: real tokens/s, ratio_to_builtin (against builtin_correct_packed), MFU over active parameters (6 x active
non-embedding parameters + lm_head, x tokens, against the bf16 rate measured in the same run), peak GiB, loss
difference to the baseline. Then the experts of one layer alone (forward + backward on the RL batch's token count):
ours grouped (with the Triton and the eager top-k combine), the built-in's grouped_mm, and the bare grouped GEMMs
(the floor). Writes
results/benchmarks/<date>-moe-<tag>.json after every row.

    python benchmarks/bench_moe.py [--layers 4] [--vocabs 65536,248320] [--batches B,..] [--runs R,..]
                                   [--tag TAG] [--device cuda] [--tiny]

--tiny (with --device cpu) runs every row on a small config to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

import torch
import transformers
from bench_train_step import (
    ROPE,
    batches,
    build_pair,
    chosen_names,
    config_fields,
    matmul_rate,
    only_on,
    peak_gib,
    result_rows,
    sync,
    time_step,
)

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM
from qwen35_packed.integrations.lora import lora_config
from qwen35_packed.modeling import kernel_selection, kernels, triton_elementwise
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.projection import plain_products

ROOT = Path(__file__).resolve().parent


def layer_shapes(layers: int, vocab: int, tiny: bool) -> dict:
    if tiny:
        return dict(
            vocab_size=vocab,
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            router_aux_loss_coef=0.0,
            rope_parameters=dict(ROPE, mrope_section=[3, 3, 2], partial_rotary_factor=0.5),
        )
    return dict(
        vocab_size=vocab,
        hidden_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        router_aux_loss_coef=0.0,
        full_attention_interval=4,
        rope_parameters=ROPE,
    )


def timed(device, fn, reps: int, warmup: int = 2) -> float:
    """Seconds per call of fn (which runs its own backward), after warm-up calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def active_parameters(config) -> int:
    """Parameters one token multiplies through, embeddings excluded, lm_head included: attention / GDN / norms,
    the router, the shared expert and top-k of the experts."""
    h, moe_i = config.hidden_size, config.moe_intermediate_size
    per_expert = 3 * h * moe_i
    with torch.device("meta"):
        model = Qwen3_5MoePackedForCausalLM(config)
    total = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if config.tie_word_embeddings:
        total += model.lm_head.weight.numel()
    unused = config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * per_expert
    return total - unused


def lora(model, reference):
    from peft import get_peft_model

    config = lora_config(reference, r=16, lora_dropout=0.0, targets=("gdn", "attention", "experts"))
    return get_peft_model(model, config)


def experts_alone(block, builtin_block, n_tokens, device, reps):
    """Forward + backward of one layer's experts on n_tokens, with a fixed routing; and the bare grouped GEMMs."""
    h = block.experts.gate_up_proj.shape[-1]
    x = torch.randn(n_tokens, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        _, weights, index = block.gate(x)
    on_cuda = device.type == "cuda"
    choice = kernel_selection.KernelChoice(
        gdn="torch",
        attention="sdpa",
        elementwise="triton" if on_cuda and triton_elementwise.TRITON_ELEMENTWISE_AVAILABLE else "eager",
        moe="grouped_mm",
        combine="triton" if on_cuda and kernel_selection.TRITON_GATHER_SUM_AVAILABLE else "eager",
    )
    rows = {}

    def ours(choice=choice):
        block.experts(x, index, weights, kernel_set(choice)).float().square().mean().backward()

    def builtin():
        builtin_block.experts(x, index, weights.to(x.dtype)).float().square().mean().backward()

    e, two_i, _ = block.experts.gate_up_proj.shape
    k = index.shape[-1]
    counts = torch.bincount(index.reshape(-1), minlength=e)
    offsets = counts.cumsum(0).to(torch.int32)
    a = torch.randn(n_tokens * k, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    mid = torch.randn(n_tokens * k, two_i // 2, device=device, dtype=torch.bfloat16, requires_grad=True)

    def gemms():
        up = kernels.grouped_linear(a, block.experts.gate_up_proj, offsets)
        down = kernels.grouped_linear(mid, block.experts.down_proj, offsets)
        torch.autograd.backward((up, down), (torch.ones_like(up), torch.ones_like(down)))

    for name, fn in (
        ("experts_ours_grouped", ours),
        ("experts_ours_grouped_eager_combine", lambda: ours(dataclasses.replace(choice, combine="eager"))),
        ("experts_builtin_grouped_mm", builtin),
        ("grouped_gemms_alone", gemms),
    ):
        try:
            rows[name] = {"ms": round(timed(device, fn, reps) * 1e3, 3)}
        except Exception as exc:  # a dispatch error is a result too
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, rows[name], flush=True)
    return rows


def run_vocab(vocab, args, device, rate, results, save):
    kwargs = layer_shapes(args.layers, vocab, args.tiny)
    name = f"moe_35b_a3b_shapes_{args.layers}l_vocab{vocab}"
    builtin, ours = build_pair(
        transformers.Qwen3_5MoeForCausalLM,
        transformers.Qwen3_5MoeTextConfig,
        Qwen3_5MoePackedForCausalLM,
        Qwen3_5MoePackedConfig,
        kwargs,
        device,
    )
    models = (builtin, ours)
    n_active = active_parameters(ours.config)
    choice = kernel_selection.select_kernels(ours.config, device, torch.bfloat16)
    entry = results.setdefault(
        name,
        {
            "params": sum(p.numel() for p in ours.parameters()),
            "active_params_with_lm_head": n_active,
            "layer_kwargs": kwargs,
            "kernels": dataclasses.asdict(choice),
        },
    )
    selected_runs = set(filter(None, args.runs.split(",")))
    selected_batches = chosen_names(args.batches, batches(), "batches")
    inputs = {}
    for batch_name, lengths in batches().items():
        if selected_batches and batch_name not in selected_batches:
            continue
        if args.tiny:
            lengths = [max(1, n // 32) for n in lengths]
        g = torch.Generator().manual_seed(2)
        docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
        flat = torch.cat(docs)[None].to(device)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        builtin_packing = dict(
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None].to(device),
            seq_idx=torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(device),
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        )
        inputs[batch_name] = (lengths, flat, cu, builtin_packing)

    def ours_step(model):
        return lambda: model(input_ids=flat, cu_seqlens=cu, labels=flat, use_cache=False).loss

    def builtin_step(model, impl):
        chosen = []

        def step():
            if not chosen:  # once per run, outside the timed steps' steady state
                model.set_experts_implementation(impl)
                chosen.append(impl)
            return model(input_ids=flat, labels=flat, use_cache=False, **builtin_packing).loss

        return step

    def measure(batch_name, run_name, model, step, n_real):
        rows = entry.setdefault(batch_name, {"real_tokens": n_real, "baseline": "builtin_correct_packed", "runs": {}})[
            "runs"
        ]
        if selected_runs and run_name not in selected_runs:
            return
        only_on(device, model, models)
        try:
            seconds, loss, kept = time_step(model, step, device, args.reps)
            rows[run_name] = {
                "s_per_step": round(seconds, 4),
                "real_tok_per_s": round(n_real / seconds),
                "mfu_active": round(6 * n_active * n_real / seconds / rate, 3) if rate else None,
                "peak_GiB": peak_gib(device),
                "forward_kept_GiB": round(kept / 2**30, 2),
                "loss": loss,
            }
        except torch.OutOfMemoryError:
            rows[run_name] = {"error": "out of memory", "peak_GiB": peak_gib(device)}
        except Exception as exc:
            rows[run_name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        model.zero_grad(set_to_none=True)
        base, base_lora = rows.get("builtin_correct_packed", {}), rows.get("builtin_lora", {})
        for row_name, row in rows.items():
            if "real_tok_per_s" in row and "real_tok_per_s" in base:
                row["ratio_to_builtin"] = round(row["real_tok_per_s"] / base["real_tok_per_s"], 2)
                row["loss_diff_to_builtin"] = abs(row["loss"] - base["loss"])
            if row_name.endswith("_lora") and "real_tok_per_s" in row and "real_tok_per_s" in base_lora:
                row["ratio_to_builtin_lora"] = round(row["real_tok_per_s"] / base_lora["real_tok_per_s"], 2)
        print(name, batch_name, run_name, rows[run_name], flush=True)
        save()

    for batch_name, (lengths, flat, cu, builtin_packing) in inputs.items():
        n_real = sum(lengths)
        measure(batch_name, "builtin_correct_packed", builtin, builtin_step(builtin, "grouped_mm"), n_real)
        measure(batch_name, "ours_packed", ours, ours_step(ours), n_real)
        if vocab == args.first_vocab:
            measure(batch_name, "builtin_correct_packed_eager", builtin, builtin_step(builtin, "eager"), n_real)
            with config_fields(ours, moe_kernel="loop"):
                measure(batch_name, "ours_packed_loop", ours, ours_step(ours), n_real)
            with config_fields(ours, moe_combine_kernel="eager"):
                measure(batch_name, "ours_packed_eager_combine", ours, ours_step(ours), n_real)
            with plain_products():
                measure(batch_name, "ours_packed_plain_gemms", ours, ours_step(ours), n_real)
    if not args.skip_experts and vocab == args.first_vocab and "rl_longtail_x16" in inputs:
        only_on(device, ours, models)
        builtin.to(device)
        builtin.set_experts_implementation("grouped_mm")
        entry["experts_alone_rl_tokens"] = experts_alone(
            ours.model.layers[0].mlp,
            builtin.model.layers[0].mlp,
            sum(inputs["rl_longtail_x16"][0]),
            device,
            args.reps * 3,
        )
        save()
    if not args.skip_lora:
        builtin.to("cpu")
        reference = ours
        builtin_lora, ours_lora = lora(builtin, reference), lora(ours, reference)
        models = (builtin_lora, ours_lora)
        for batch_name, (lengths, flat, cu, builtin_packing) in inputs.items():
            measure(batch_name, "builtin_lora", builtin_lora, builtin_step(builtin_lora, "grouped_mm"), sum(lengths))
            measure(batch_name, "ours_lora", ours_lora, ours_step(ours_lora), sum(lengths))
            if vocab == args.first_vocab:
                with config_fields(ours_lora, moe_lora_kernel="low_rank"):
                    measure(batch_name, "ours_lora_low_rank", ours_lora, ours_step(ours_lora), sum(lengths))
                with config_fields(ours_lora, moe_lora_kernel="peft"):
                    measure(batch_name, "ours_lora_peft_fold", ours_lora, ours_step(ours_lora), sum(lengths))
    builtin = ours = models = None  # release the GPU memory before the next model (the closures above are done)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_table(results):
    print(f"\n{'model':<40}{'batch':<20}{'run':<30}{'tok/s':>9}{'x built-in':>11}{'MFU':>7}{'GiB':>8}{'dloss':>10}")
    for model_name, batch_name, _, run_name, row in result_rows(results):
        if "error" in row:
            print(f"{model_name:<40}{batch_name:<20}{run_name:<30} {row['error'][:60]}")
            continue
        print(
            f"{model_name:<40}{batch_name:<20}{run_name:<30}{row['real_tok_per_s']:>9}"
            f"{row.get('ratio_to_builtin', float('nan')):>11}{row['mfu_active'] or float('nan'):>7}"
            f"{row['peak_GiB'] or float('nan'):>8}{row.get('loss_diff_to_builtin', float('nan')):>10.2e}"
        )
    for model_name, per_model in results.items():
        for name, row in (per_model.get("experts_alone_rl_tokens", {}) if isinstance(per_model, dict) else {}).items():
            print(f"{model_name:<40}{'experts alone':<20}{name:<30}{row.get('ms', row.get('error'))} ms")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocabs", default="65536,248320")
    parser.add_argument("--batches", default="")
    parser.add_argument("--runs", default="")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--skip-lora", action="store_true")
    parser.add_argument("--skip-experts", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    vocabs = [int(v) for v in args.vocabs.split(",")]
    args.first_vocab = vocabs[0]
    rate = matmul_rate() if device.type == "cuda" else None
    results = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fla_available": kernel_selection.FLA_AVAILABLE,
        "bf16_matmul_tflops": round(rate / 1e12, 1) if rate else None,
    }
    out = (
        Path(args.out)
        if args.out
        else ROOT.parent / "results" / "benchmarks" / f"{results['date']}-moe-{args.tag}.json"
    )
    save = lambda: out.write_text(json.dumps(results, indent=1))  # noqa: E731
    for vocab in vocabs:
        run_vocab(vocab, args, device, rate, results, save)
        save()
    print_table(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
