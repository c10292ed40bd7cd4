"""Training steps on packed rows whose total length changes every step, as RL batches come: what a new length costs.

Every benchmark of train steps repeats one batch, so it cannot see a cost that is paid once per new shape (Triton
compiling a kernel for a new integer specialization, autotuning, a JIT keyed on a length). Here each round draws a
new packed row (`--docs` documents of `--min-doc`..`--max-doc` tokens, from a seed that changes every run and is
printed), runs one forward + backward on it (a length not seen before), then the same row again (a seen length).
The round's stall is the first step's seconds minus the second's. `--warmup` rounds come first and are reported
apart (the first shapes of a process compile everything). Each step also records the Triton kernels it compiled
(Triton's `jit_cache_hook`: a kernel's name and the integer specialization that missed the cache), which says
whether a stall is Triton's; one without a compile there is elsewhere (tilelang, cuBLAS's heuristics, the allocator).

qwen35-packed (one row, `cu_seqlens`) and the built-in on its correct packed path (cu_seq_lens + seq_idx; FLA and
causal_conv1d where installed), the same random weights (bench_train_step.build_pair), bf16, one model on the GPU
at a time. Models: `qwen35_4b:8` (Qwen3.5-4B's first 8 layers, bench_train_step.model_spec) and `moe_35b_a3b_shapes`
(the 35B-A3B layer shapes, 4 layers, bench_moe.layer_shapes, vocab 248,320).

    python benchmarks/bench_changing_lengths.py [--models qwen35_4b:8,moe_35b_a3b_shapes] [--impls ours,builtin]
        [--rounds 8] [--warmup 2] [--docs 8] [--min-doc 200] [--max-doc 3000] [--seed S] [--device cuda]
        [--tiny] [--out FILE]

Prints a table and writes JSON under results/benchmarks/ (or --out) after every model and implementation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from bench_generate import git_commit
from bench_moe import layer_shapes
from bench_train_step import TINY, build_pair, model_kwargs, model_spec, only_on, packed_inputs, peak_gib, sync

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)

ROOT = Path(__file__).resolve().parent
MOE = "moe_35b_a3b_shapes"


def build(spec: str, tiny: bool, device: torch.device):
    """(result name, built-in, ours) for `qwen35_4b[:L]` / `qwen35_0p8b[:L]` / `moe_35b_a3b_shapes`."""
    if spec == MOE:
        kwargs = layer_shapes(4, 512 if tiny else 248_320, tiny)
        classes = (transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig)
        ours = (Qwen3_5MoePackedForCausalLM, Qwen3_5MoePackedConfig)
        name = f"{MOE}_4l_vocab{kwargs['vocab_size']}"
    else:
        name, key, layers = model_spec(spec)
        kwargs = dict(TINY) if tiny else model_kwargs(key, layers)
        classes = (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig)
        ours = (Qwen3_5PackedForCausalLM, Qwen3_5PackedConfig)
    builtin, ours_model = build_pair(*classes, *ours, kwargs, device)
    return name, builtin, ours_model


def draw_lengths(seed: int, args) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(args.min_doc, args.max_doc + 1, (args.docs,), generator=gen).tolist()


class TritonCompiles:
    """The Triton kernels compiled while it is installed (Triton's jit_cache_hook sees every in-memory cache miss),
    as {kernel name: count}; `take()` returns them and starts again. `available` is False where Triton or its hook
    is missing (then nothing is recorded, and the report says so)."""

    def __init__(self):
        self.names: dict[str, int] = {}
        try:
            from triton import knobs
        except ImportError:
            knobs = None
        self.available = hasattr(getattr(knobs, "runtime", None), "jit_cache_hook")
        if not self.available:
            return
        previous = knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            name = kwargs["fn"].name if "fn" in kwargs else "?"
            self.names[name] = self.names.get(name, 0) + 1
            return previous(*args, **kwargs) if previous else None

        knobs.runtime.jit_cache_hook = hook

    def take(self) -> dict[str, int]:
        names, self.names = self.names, {}
        return names


def timed_step(model, impl: str, x: dict, device: torch.device) -> float:
    model.zero_grad(set_to_none=True)
    sync(device)
    start = time.perf_counter()
    if impl == "ours":
        loss = model(input_ids=x["flat"], cu_seqlens=x["cu"], labels=x["flat"], use_cache=False).loss
    else:
        loss = model(input_ids=x["flat"], labels=x["flat"], use_cache=False, **x["builtin_correct"]).loss
    loss.backward()
    sync(device)
    return time.perf_counter() - start


def run(model, impl: str, vocab: int, args, device: torch.device, compiles: TritonCompiles) -> dict:
    """Warm-up rounds, then the measured rounds: each a new row (new length) and the same row again (seen)."""
    rounds, seen_lengths = [], set()
    for index in range(args.warmup + args.rounds):
        seed = args.seed + index
        lengths = draw_lengths(seed, args)
        total = sum(lengths)
        if total in seen_lengths:  # a repeat would not measure a new length
            continue
        seen_lengths.add(total)
        x = packed_inputs(lengths, vocab, device)
        compiles.take()
        new = timed_step(model, impl, x, device)
        compiled_new = compiles.take()
        seen = timed_step(model, impl, x, device)
        rounds.append({"seed": seed, "tokens": total, "new_s": round(new, 4), "seen_s": round(seen, 4),
                       "stall_s": round(new - seen, 4), "warmup": index < args.warmup,
                       "triton_compiled_new": compiled_new, "triton_compiled_seen": compiles.take()})  # fmt: skip
    measured = [r for r in rounds if not r["warmup"]]
    stalls = [r["stall_s"] for r in measured]
    return {
        "rounds": rounds,
        "median_seen_s": round(statistics.median(r["seen_s"] for r in measured), 4),
        "median_stall_s": round(statistics.median(stalls), 4),
        "max_stall_s": round(max(stalls), 4),
        "rounds_over_half_second": sum(s > 0.5 for s in stalls),
        "peak_gib": peak_gib(device),
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<32}{'impl':<9}{'rounds':>7}{'seen s':>9}{'median stall':>14}{'max stall':>11}{'> 0.5 s':>9}")
    for row in rows:
        r = row["result"]
        if "error" in r:
            print(f"{row['model']:<32}{row['impl']:<9}  {r['error'][:80]}")
            continue
        measured = sum(not x["warmup"] for x in r["rounds"])
        print(
            f"{row['model']:<32}{row['impl']:<9}{measured:>7}{r['median_seen_s']:>9.3f}{r['median_stall_s']:>14.3f}"
            f"{r['max_stall_s']:>11.3f}{r['rounds_over_half_second']:>9}"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=f"qwen35_4b:8,{MOE}")
    parser.add_argument("--impls", default="ours,builtin")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--min-doc", type=int, default=200)
    parser.add_argument("--max-doc", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=time.time_ns() % 1_000_000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rounds < 1 or not 1 <= args.min_doc <= args.max_doc:
        raise SystemExit("--rounds must be >= 1 and 1 <= --min-doc <= --max-doc")
    print(f"rows drawn from --seed {args.seed}", flush=True)
    device = torch.device(args.device)
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT.parent / "results" / "benchmarks" / f"{date}-changing-lengths-{device.type}.json")
    report = {
        "date": date,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
        "seed": args.seed,
        "setup": {k: getattr(args, k) for k in ("rounds", "warmup", "docs", "min_doc", "max_doc")},
        "rows": [],
    }
    compiles = TritonCompiles()
    report["triton_compile_hook"] = compiles.available
    for spec in args.models.split(","):
        name, builtin, ours = build(spec, args.tiny, device)
        for impl in args.impls.split(","):
            model = ours if impl == "ours" else builtin
            only_on(device, model, (builtin, ours))
            try:
                result = run(model, impl, model.config.vocab_size, args, device, compiles)
            except torch.OutOfMemoryError as error:
                result = {"error": f"out of memory: {str(error).splitlines()[0]}", "peak_gib": peak_gib(device)}
            report["rows"].append({"model": name, "impl": impl, "result": result})
            print_table(report["rows"][-1:])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1) + "\n")
        del builtin, ours
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    print_table(report["rows"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
