"""Side-by-side training-step benchmark on one GPU: qwen35-packed vs transformers' built-in Qwen3.5.

Forward + backward in bf16 on the same batches and the same weights, one model on the GPU at a time (the other
waits on the CPU, so each peak is the running model's own):
  * uniform: 8 documents, lengths uniform in [128, 2048) (seed 1);
  * rl: 16 RL-shaped sequences, prompt 128-512 + completion 64-512 (60%) or 1024-3584 (40%) (seed 1);
for a 1.386B hybrid config (vocab 65,536) and the real Qwen3.5-0.8B text config (vocab 248,320). Prints a table
(real tokens/s, ratio to the built-in's padded path, MFU, peak memory, loss difference to the built-in's padded
loss) and writes JSON under benchmarks/results/ (or --out).

MFU = 6 x non-embedding parameters x real tokens / step time / bf16 matmul rate measured in the same run.

    python benchmarks/bench_train_step.py [--models hybrid_1p4b,qwen35_0p8b] [--runs R,..] [--batches B,..]
                                           [--out FILE] [--profile]
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

from qwen35_packed import Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM

ROOT = Path(__file__).resolve().parent
# The official Qwen/Qwen3.5-0.8B config.json, byte for byte (tests/test_configuration.py checks it).
QWEN35_0P8B_CONFIG = ROOT.parent / "examples" / "configs" / "Qwen3.5-0.8B.config.json"
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}
MODELS = {
    "hybrid_1p4b": dict(vocab_size=65536, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                        rope_parameters=ROPE),
    "qwen35_0p8b": None,  # the text_config of QWEN35_0P8B_CONFIG (vocab 248,320, tied embeddings)
}


def model_kwargs(name: str) -> dict:
    if MODELS[name] is not None:
        return MODELS[name]
    composite = json.loads(QWEN35_0P8B_CONFIG.read_text())
    text = {k: v for k, v in composite["text_config"].items() if k not in ("model_type", "dtype", "torch_dtype")}
    text.setdefault("tie_word_embeddings", composite.get("tie_word_embeddings", False))
    return text


def batches() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    uniform = torch.randint(128, 2048, (8,), generator=g).tolist()
    prompt = torch.randint(128, 512, (16,), generator=g)
    completion = torch.where(torch.rand(16, generator=g) < 0.6, torch.randint(64, 512, (16,), generator=g),
                             torch.randint(1024, 3584, (16,), generator=g))
    return {"uniform_128_2048_x8": uniform, "rl_longtail_x16": [int(p + c) for p, c in zip(prompt, completion)]}


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


def time_step(model, fn, reps=3):
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        fn().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    # Memory the forward leaves for the backward (activations, kept logits), outside the timed steps.
    model.zero_grad(set_to_none=True)
    before = torch.cuda.memory_allocated()
    loss = fn()
    kept = torch.cuda.memory_allocated() - before
    loss.backward()
    return seconds, loss.item(), kept


def _with_config(model, fn, **fields):
    """fn() with config fields changed for the call: `elementwise_kernel="eager"` (what the compiled chains buy),
    `return_logits_with_loss=False` (a trainer that reads only the loss: no [tokens x vocab] logits kept)."""
    saved = {name: getattr(model.config, name) for name in fields}
    for name, value in fields.items():
        setattr(model.config, name, value)
    try:
        return fn()
    finally:
        for name, value in saved.items():
            setattr(model.config, name, value)


def _only_on_gpu(model, models):
    """Move `model` to the GPU and every other model to the CPU: a run's peak memory is its own model's (both
    models on the GPU would add the other's weights, 2.6 GiB for the 1.4B config, to every peak)."""
    for other in models:
        if other is not model:
            other.zero_grad(set_to_none=True)
            other.to("cpu")
    model.to("cuda")
    torch.cuda.empty_cache()


def run_model(name, kwargs, rate, results, profile, selected, selected_batches, save):
    builtin_config = transformers.Qwen3_5TextConfig(**kwargs)
    torch.manual_seed(0)
    builtin = transformers.Qwen3_5ForCausalLM(builtin_config).to(torch.bfloat16).train()
    ours = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**kwargs))
    ours.load_state_dict(builtin.state_dict(), strict=True)
    ours = ours.to(torch.bfloat16).train()
    n_all = sum(p.numel() for p in ours.parameters())
    n_embed = ours.model.embed_tokens.weight.numel() + (
        0 if ours.config.tie_word_embeddings else ours.lm_head.weight.numel())
    from qwen35_packed.modeling import kernels, triton_conv

    choice = kernels.select_kernels(ours.config, torch.device("cuda"), torch.bfloat16)
    results[name] = {"params": n_all, "non_embedding_params": n_all - n_embed,
                     "kernels": dataclasses.asdict(choice),
                     "conv_blocks": dataclasses.asdict(triton_conv.DEFAULT_BLOCKS) if choice.conv == "triton" else None}
    vocab = kwargs["vocab_size"]
    for batch_name, lengths in batches().items():
        if selected_batches and batch_name not in selected_batches:
            continue
        longest, n_real = max(lengths), sum(lengths)
        g = torch.Generator().manual_seed(2)
        docs = [torch.randint(0, vocab, (n,), generator=g).cuda() for n in lengths]
        ids = torch.zeros(len(lengths), longest, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for i, doc in enumerate(docs):
            ids[i, : len(doc)], mask[i, : len(doc)] = doc, 1
        labels = ids.masked_fill(mask == 0, -100)
        flat = torch.cat(docs)[None]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
        runs = {
            "ours_packed": (ours, lambda: ours(input_ids=flat, cu_seqlens=cu, labels=flat, use_cache=False).loss),
            "ours_packed_no_logits": (ours, lambda: _with_config(
                ours, lambda: ours(input_ids=flat, cu_seqlens=cu, labels=flat, use_cache=False).loss,
                return_logits_with_loss=False)),
            "ours_packed_eager_elementwise": (ours, lambda: _with_config(
                ours, lambda: ours(input_ids=flat, cu_seqlens=cu, labels=flat, use_cache=False).loss,
                elementwise_kernel="eager")),
            "ours_padded_input": (ours, lambda: ours(input_ids=ids, attention_mask=mask, labels=labels,
                                                     use_cache=False).loss),
            "builtin_padded": (builtin, lambda: builtin(input_ids=ids, attention_mask=mask, labels=labels,
                                                        use_cache=False).loss),
            "builtin_packed_leaky": (builtin, lambda: builtin(input_ids=flat, position_ids=positions,
                                                              cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                              max_length_q=longest, max_length_k=longest,
                                                              labels=flat, use_cache=False).loss),
        }
        rows = {}
        for run_name, (model, fn) in runs.items():
            if selected and run_name not in selected:
                continue
            _only_on_gpu(model, (ours, builtin))
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                seconds, loss, kept = time_step(model, fn)
                rows[run_name] = {
                    "s_per_step": round(seconds, 4), "real_tok_per_s": round(n_real / seconds),
                    "mfu": round(6 * (n_all - n_embed) * n_real / seconds / rate, 3),
                    "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                    "forward_kept_GiB": round(kept / 2**30, 2), "loss": loss,
                }
            except torch.OutOfMemoryError:
                rows[run_name] = {"error": "out of memory",
                                  "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            model.zero_grad(set_to_none=True)
            print(name, batch_name, run_name, rows[run_name], flush=True)
            save()  # after every run: a later failure or time limit keeps what was measured
        base = rows.get("builtin_padded", {})
        base_tps = base.get("real_tok_per_s") or rows.get("builtin_packed_leaky", {}).get("real_tok_per_s")
        for row in rows.values():
            if "real_tok_per_s" in row and base_tps:
                row["ratio_to_builtin"] = round(row["real_tok_per_s"] / base_tps, 2)
            if "loss" in row and "loss" in base:
                row["loss_diff_to_builtin_padded"] = abs(row["loss"] - base["loss"])
        results[name][batch_name] = {"real_tokens": n_real, "padded_tokens": len(lengths) * longest,
                                     "baseline": "builtin_padded" if "real_tok_per_s" in base else
                                     "builtin_packed_leaky", "runs": rows}
        if profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            for run_name, (model, fn) in runs.items():
                if run_name != "ours_packed" or (selected and run_name not in selected):
                    continue
                _only_on_gpu(model, (ours, builtin))
                # Kernels by CUDA time, and the operators that launched them with their input shapes (which
                # reduction, copy or add a kernel belongs to).
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                    model.zero_grad(set_to_none=True)
                    fn().backward()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
                ops = prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60, max_shapes_column_width=80)
                print(name, batch_name, run_name, "\n" + table, flush=True)
                results[name][batch_name].setdefault("profile_top_cuda", {})[run_name] = table
                results[name][batch_name].setdefault("profile_ops_by_shape", {})[run_name] = ops
    del builtin, ours
    torch.cuda.empty_cache()


def print_table(results):
    print(f"\n{'model':<13}{'batch':<20}{'run':<31}{'tok/s':>9}{'x built-in':>11}{'MFU':>7}{'GiB':>7}{'dloss':>10}")
    for model_name, per_model in results.items():
        if not isinstance(per_model, dict) or "params" not in per_model:
            continue
        for batch_name, entry in per_model.items():
            if not isinstance(entry, dict) or "runs" not in entry:
                continue
            for run_name, row in entry["runs"].items():
                if "error" in row:
                    print(f"{model_name:<13}{batch_name:<20}{run_name:<31}{row['error']:>9} (peak {row['peak_GiB']} GiB)")
                    continue
                print(f"{model_name:<13}{batch_name:<20}{run_name:<31}{row['real_tok_per_s']:>9}"
                      f"{row.get('ratio_to_builtin', float('nan')):>11}{row['mfu']:>7}{row['peak_GiB']:>7}"
                      f"{row.get('loss_diff_to_builtin_padded', float('nan')):>10.2e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="hybrid_1p4b,qwen35_0p8b")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--runs", default="", help="comma-separated subset of runs (default: all)")
    parser.add_argument("--batches", default="", help="comma-separated subset of batches (default: both)")
    args = parser.parse_args()
    from qwen35_packed.modeling import kernels

    rate = matmul_rate()
    results = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "fla_available": kernels.FLA_AVAILABLE, "bf16_matmul_tflops": round(rate / 1e12, 1)}
    out = Path(args.out) if args.out else ROOT / "results" / f"{results['date']}-train-step.json"
    for name in args.models.split(","):
        kwargs = model_kwargs(name)
        run_model(name, kwargs, rate, results, args.profile, set(filter(None, args.runs.split(","))),
                  set(filter(None, args.batches.split(","))), lambda: out.write_text(json.dumps(results, indent=1)))
        out.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
