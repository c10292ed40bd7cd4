"""Side-by-side training-step benchmark on one GPU: qwen35-packed vs transformers' built-in Qwen3.5.

Forward + backward in bf16 on the same batches and the same weights, one model on the GPU at a time (the other
waits on the CPU, so each peak is the running model's own):
  * uniform: 8 documents, lengths uniform in [128, 2048) (seed 1);
  * rl: 16 RL-shaped sequences, prompt 128-512 + completion 64-512 (60%) or 1024-3584 (40%) (seed 1);
for a 1.386B hybrid config (vocab 65,536) and the real Qwen3.5-0.8B / 4B / 9B text configs (vocab 248,320, read
from examples/configs). Runs:
  * ours_packed (+ _logits_kept, _eager_elementwise, _plain_gemms, ours_padded_input): this project; ours_packed
    has the default return_logits_with_loss="auto" (the model is in training mode: the logits are not kept),
    ours_packed_logits_kept forces them (True), as the default did before; ours_packed_plain_gemms runs every
    projection as a plain cuBLAS GEMM instead of the row-invariant product (modeling/projection.py): its cost;
  * builtin_correct_packed: the built-in on its correct packed path, cu_seq_lens + seq_idx with FLA and
    causal_conv1d installed (what DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    gives): the baseline of ratio_to_builtin when it ran;
  * builtin_padded: the built-in on the padded batch (the baseline otherwise);
  * builtin_packed_leaky: position_ids + cu_seq_lens without seq_idx: fast but mixes documents (wrong; kept as a
    label of what that path costs).
Prints a table and writes JSON under results/benchmarks/ (or --out) after every run.

MFU: `mfu` = 6 x non-embedding parameters x real tokens / step time / bf16 matmul rate measured in the same run;
`mfu_all_matmuls` adds the lm_head GEMM (6 x its parameters x tokens) and the causal attention of each document in
each full-attention layer (3 x 2 x heads x head_dim x length^2: QK^T and PV, half of each, forward + backward).

    python benchmarks/bench_train_step.py [--models hybrid_1p4b,qwen35_0p8b,...] [--runs R,..] [--batches B,..]
                                           [--out FILE] [--profile] [--device cuda] [--tiny]

--tiny (with --device cpu) runs the rows on a small config to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import time
from pathlib import Path

import torch
import transformers

from qwen35_packed import Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM
from qwen35_packed.modeling.projection import plain_products

ROOT = Path(__file__).resolve().parent
# Official Qwen/Qwen3.5-* config.json files, byte for byte (tests/modeling/test_configuration.py checks them).
CONFIGS = ROOT.parent / "examples" / "configs"
ROPE = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
MODELS = {
    "hybrid_1p4b": dict(
        vocab_size=65536,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        rope_parameters=ROPE,
    ),
    # the text_config of the official file (vocab 248,320)
    "qwen35_0p8b": "Qwen3.5-0.8B.config.json",
    "qwen35_4b": "Qwen3.5-4B.config.json",
    "qwen35_9b": "Qwen3.5-9B.config.json",
}
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    rope_parameters=dict(ROPE, mrope_section=[3, 3, 2], partial_rotary_factor=0.5),
)


def model_kwargs(name: str, layers: int | None = None) -> dict:
    """The config fields of MODELS[name]; `layers` keeps only the first that many decoder layers (for a model whose
    built-in run cannot fit otherwise; the result's model name says so)."""
    if isinstance(MODELS[name], dict):
        kwargs = dict(MODELS[name])
    else:
        composite = json.loads((CONFIGS / MODELS[name]).read_text())
        kwargs = {k: v for k, v in composite["text_config"].items() if k not in ("model_type", "dtype", "torch_dtype")}
        kwargs.setdefault("tie_word_embeddings", composite.get("tie_word_embeddings", False))
    if layers is not None:
        if kwargs.get("layer_types"):
            kwargs["layer_types"] = kwargs["layer_types"][:layers]
        kwargs["num_hidden_layers"] = layers
    return kwargs


def model_spec(spec: str) -> tuple[str, str, int | None]:
    """'qwen35_9b' or 'qwen35_9b:16' (first 16 layers) -> (result name, MODELS key, layers)."""
    key, _, layers = spec.partition(":")
    if not layers:
        return key, key, None
    total = model_kwargs(key)["num_hidden_layers"]
    return f"{key}_{layers}_of_{total}_layers", key, int(layers)


def batches() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    uniform = torch.randint(128, 2048, (8,), generator=g).tolist()
    prompt = torch.randint(128, 512, (16,), generator=g)
    completion = torch.where(
        torch.rand(16, generator=g) < 0.6,
        torch.randint(64, 512, (16,), generator=g),
        torch.randint(1024, 3584, (16,), generator=g),
    )
    return {"uniform_128_2048_x8": uniform, "rl_longtail_x16": [int(p + c) for p, c in zip(prompt, completion)]}


def chosen_names(listed: str, known, what: str) -> set[str]:
    """The comma-separated names of `listed` (empty: all), refused when one is not among `known`: a misspelt name
    would otherwise select nothing and the benchmark would finish without a row."""
    names = set(filter(None, listed.split(",")))
    unknown = sorted(names - set(known))
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return names


def random_longtail(seed: int, max_tokens: int = 26_000) -> list[int]:
    """Document lengths of a random batch as users' RL and SFT batches come: a few of 1 to 3 tokens, short ones
    (4-64), RL-sized ones (100-3,600) and one or two long ones (4,000-7,000), shuffled, cut to at most
    `max_tokens` tokens. The packed-vs-alone checks draw their batches here with a seed that changes every run."""
    g = torch.Generator().manual_seed(seed)

    def draw(count_range, low, high):
        count = int(torch.randint(count_range[0], count_range[1] + 1, (1,), generator=g))
        return torch.randint(low, high + 1, (count,), generator=g).tolist()

    lengths = draw((3, 5), 1, 3) + draw((2, 4), 4, 64) + draw((6, 12), 100, 3600) + draw((1, 2), 4000, 7000)
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    kept, total = [], 0
    for n in lengths:
        if total + n <= max_tokens:
            kept.append(n)
            total += n
    return kept


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(model, fn, device: torch.device, reps: int = 3):
    """Seconds per forward + backward (after 2 warm-up steps), the last loss, and the memory the forward leaves for
    the backward (activations, kept logits), measured outside the timed steps."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        fn().backward()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
    sync(device)
    seconds = (time.perf_counter() - start) / reps
    model.zero_grad(set_to_none=True)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    loss = fn()
    kept = (torch.cuda.memory_allocated() - before) if device.type == "cuda" else 0
    loss.backward()
    return seconds, loss.item(), kept


@contextlib.contextmanager
def config_fields(model, **fields):
    """Config fields changed for the duration: `elementwise_kernel="eager"` (what the fused chains buy),
    `return_logits_with_loss=True` (a caller that reads the logits next to the loss), `moe_kernel="loop"`."""
    saved = {name: getattr(model.config, name) for name in fields}
    for name, value in fields.items():
        setattr(model.config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(model.config, name, value)


def only_on(device: torch.device, model, models) -> None:
    """Move `model` to the device and every other model to the CPU: a run's peak memory is its own model's (both
    models on the GPU would add the other's weights to every peak)."""
    for other in models:
        if other is not model:
            other.zero_grad(set_to_none=True)
            other.to("cpu")
    model.to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside: models built there get their parameters in it directly (a
    35B-A3B built in fp32 first would not fit the GPU)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_pair(builtin_cls, builtin_config_cls, ours_cls, ours_config_cls, kwargs, device):
    """The built-in model with random weights, built in bf16 on `device`, and ours built on the meta device and
    given the same weights (A_log / dt_bias fp32 holding the same values)."""
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        with torch.device(device):
            builtin = builtin_cls(builtin_config_cls(**kwargs))
        with torch.device("meta"):
            ours = ours_cls(ours_config_cls(**kwargs))
    ours.to_empty(device=device)
    ours.load_state_dict(builtin.state_dict(), strict=True)
    return builtin.train(), ours.train()


def packed_inputs(lengths, vocab, device):
    """The batch's documents padded ([rows, longest] + mask + labels), packed into one row for ours (cu_seqlens),
    and the built-in's packed kwargs: correct (cu_seq_lens + seq_idx) and leaky (without seq_idx)."""
    longest = max(lengths)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, doc in enumerate(docs):
        ids[i, : len(doc)], mask[i, : len(doc)] = doc, 1
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    leaky = dict(
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None].to(device),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
    )
    correct = dict(
        leaky,
        seq_idx=torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(device),
    )
    return dict(
        ids=ids.to(device),
        mask=mask.to(device),
        labels=ids.masked_fill(mask == 0, -100).to(device),
        flat=torch.cat(docs)[None].to(device),
        cu=cu,
        builtin_correct=correct,
        builtin_leaky=leaky,
    )


def attention_training_flops(config, lengths) -> float:
    """Causal attention FLOPs of one training step over the documents: per full-attention layer and document,
    QK^T and PV (2 x 2 x heads x head_dim x L^2 / 2 forward), x3 for forward + backward."""
    layers = sum(t == "full_attention" for t in config.layer_types)
    return layers * 6 * config.num_attention_heads * config.head_dim * sum(n * n for n in lengths)


def run_model(name, kwargs, rate, results, profile, selected, selected_batches, save, device, tiny):
    builtin, ours = build_pair(
        transformers.Qwen3_5ForCausalLM,
        transformers.Qwen3_5TextConfig,
        Qwen3_5PackedForCausalLM,
        Qwen3_5PackedConfig,
        kwargs,
        device,
    )
    n_all = sum(p.numel() for p in ours.parameters())
    n_embed = ours.model.embed_tokens.weight.numel() + (
        0 if ours.config.tie_word_embeddings else ours.lm_head.weight.numel()
    )
    n_lm_head = ours.lm_head.weight.numel()
    from qwen35_packed.modeling import kernel_selection, triton_conv

    choice = kernel_selection.select_kernels(ours.config, device, torch.bfloat16)
    results[name] = {
        "params": n_all,
        "non_embedding_params": n_all - n_embed,
        "lm_head_params": n_lm_head,
        "kernels": dataclasses.asdict(choice),
        "conv_blocks": dataclasses.asdict(triton_conv.DEFAULT_BLOCKS) if choice.conv == "triton" else None,
    }
    vocab = kwargs["vocab_size"]
    models = (ours, builtin)
    for batch_name, lengths in batches().items():
        if selected_batches and batch_name not in selected_batches:
            continue
        if tiny:
            lengths = [max(1, n // 32) for n in lengths]
        n_real = sum(lengths)
        x = packed_inputs(lengths, vocab, device)
        flops_all = 6 * (n_all - n_embed + n_lm_head) * n_real + attention_training_flops(ours.config, lengths)

        def ours_packed():
            return ours(input_ids=x["flat"], cu_seqlens=x["cu"], labels=x["flat"], use_cache=False).loss

        def ours_plain_products():  # every projection a plain cuBLAS GEMM: what row invariance costs
            with plain_products():
                return ours_packed()

        def ours_with(**fields):
            def step():
                with config_fields(ours, **fields):
                    return ours_packed()

            return step

        runs = {
            "ours_packed": (ours, ours_packed),
            "ours_packed_logits_kept": (ours, ours_with(return_logits_with_loss=True)),
            "ours_packed_eager_elementwise": (ours, ours_with(elementwise_kernel="eager")),
            "ours_packed_plain_gemms": (ours, ours_plain_products),
            "ours_padded_input": (
                ours,
                lambda: ours(input_ids=x["ids"], attention_mask=x["mask"], labels=x["labels"], use_cache=False).loss,
            ),
            "builtin_correct_packed": (
                builtin,
                lambda: builtin(input_ids=x["flat"], labels=x["flat"], use_cache=False, **x["builtin_correct"]).loss,
            ),
            "builtin_padded": (
                builtin,
                lambda: builtin(input_ids=x["ids"], attention_mask=x["mask"], labels=x["labels"], use_cache=False).loss,
            ),
            "builtin_packed_leaky": (
                builtin,
                lambda: builtin(input_ids=x["flat"], labels=x["flat"], use_cache=False, **x["builtin_leaky"]).loss,
            ),
        }
        if selected - runs.keys():  # a misspelt run would select nothing
            raise SystemExit(f"unknown runs: {sorted(selected - runs.keys())} (known: {sorted(runs)})")
        rows = {}
        entry = results[name][batch_name] = {
            "real_tokens": n_real,
            "padded_tokens": len(lengths) * max(lengths),
            "training_flops_all_matmuls": flops_all,
            "runs": rows,
        }
        for run_name, (model, fn) in runs.items():
            if selected and run_name not in selected:
                continue
            only_on(device, model, models)
            try:
                seconds, loss, kept = time_step(model, fn, device)
                rows[run_name] = {
                    "s_per_step": round(seconds, 4),
                    "real_tok_per_s": round(n_real / seconds),
                    "mfu": round(6 * (n_all - n_embed) * n_real / seconds / rate, 3) if rate else None,
                    "mfu_all_matmuls": round(flops_all / seconds / rate, 3) if rate else None,
                    "peak_GiB": peak_gib(device),
                    "forward_kept_GiB": round(kept / 2**30, 2),
                    "loss": loss,
                }
            except torch.OutOfMemoryError:
                rows[run_name] = {"error": "out of memory", "peak_GiB": peak_gib(device)}
            except Exception as exc:  # e.g. the built-in refusing packed input without its kernels: a result too
                rows[run_name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "peak_GiB": peak_gib(device)}
            model.zero_grad(set_to_none=True)
            if run_name == "builtin_packed_leaky" and "error" not in rows[run_name]:
                rows[run_name]["wrong"] = "mixes documents (no seq_idx): not a baseline"
            print(name, batch_name, run_name, rows[run_name], flush=True)
            baseline = next(
                (b for b in ("builtin_correct_packed", "builtin_padded") if "real_tok_per_s" in rows.get(b, {})), None
            )
            entry["baseline"] = baseline
            for row in rows.values():
                if baseline and "real_tok_per_s" in row:
                    row["ratio_to_builtin"] = round(row["real_tok_per_s"] / rows[baseline]["real_tok_per_s"], 2)
                    row["loss_diff_to_baseline"] = abs(row["loss"] - rows[baseline]["loss"])
            save()  # after every run: a later failure or time limit keeps what was measured
        if profile and device.type == "cuda" and (not selected or "ours_packed" in selected):
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            only_on(device, ours, models)
            # Kernels by CUDA time, and the operators that launched them with their input shapes.
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                ours.zero_grad(set_to_none=True)
                ours_packed().backward()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
            ops = prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60, max_shapes_column_width=80
            )
            print(name, batch_name, "ours_packed", "\n" + table, flush=True)
            entry["profile_top_cuda"] = {"ours_packed": table}
            entry["profile_ops_by_shape"] = {"ours_packed": ops}
    builtin = ours = models = None  # release the GPU memory before the next model (the closures above are done)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def result_rows(results):
    """(model, batch, entry, run, row) of every run in a results dict (this script's or bench_moe.py's)."""
    for model_name, per_model in results.items():
        if not isinstance(per_model, dict) or "params" not in per_model:
            continue
        for batch_name, entry in per_model.items():
            if isinstance(entry, dict) and "runs" in entry:
                for run_name, row in entry["runs"].items():
                    yield model_name, batch_name, entry, run_name, row


def print_table(results):
    print(
        f"\n{'model':<13}{'batch':<20}{'run':<31}{'tok/s':>9}{'x built-in':>11}{'MFU':>7}{'MFU all':>8}{'GiB':>7}"
        f"{'dloss':>10}"
    )
    for model_name, batch_name, _, run_name, row in result_rows(results):
        if "error" in row:
            print(f"{model_name:<13}{batch_name:<20}{run_name:<31} {row['error'][:70]}")
            continue
        print(
            f"{model_name:<13}{batch_name:<20}{run_name:<31}{row['real_tok_per_s']:>9}"
            f"{row.get('ratio_to_builtin', float('nan')):>11}{row['mfu'] or float('nan'):>7}"
            f"{row['mfu_all_matmuls'] or float('nan'):>8}{row['peak_GiB'] or float('nan'):>7}"
            f"{row.get('loss_diff_to_baseline', float('nan')):>10.2e}"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--models",
        default="hybrid_1p4b,qwen35_0p8b",
        help="comma-separated MODELS keys, each optionally NAME:LAYERS (the first LAYERS layers)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--runs", default="", help="comma-separated subset of runs (default: all)")
    parser.add_argument("--batches", default="", help="comma-separated subset of batches (default: both)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small config (script check, e.g. on CPU)")
    args = parser.parse_args()
    from qwen35_packed.modeling import kernel_selection

    device = torch.device(args.device)
    rate = matmul_rate() if device.type == "cuda" else None
    results = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fla_available": kernel_selection.FLA_AVAILABLE,
        "bf16_matmul_tflops": round(rate / 1e12, 1) if rate else None,
    }
    out = Path(args.out) if args.out else ROOT.parent / "results" / "benchmarks" / f"{results['date']}-train-step.json"
    for spec in args.models.split(","):
        name, key, layers = model_spec(spec)
        kwargs = TINY if args.tiny else model_kwargs(key, layers)
        run_model(
            name,
            kwargs,
            rate,
            results,
            args.profile,
            set(filter(None, args.runs.split(","))),
            chosen_names(args.batches, batches(), "batches"),
            lambda: out.write_text(json.dumps(results, indent=1)),
            device,
            args.tiny,
        )
        out.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
