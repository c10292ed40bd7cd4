"""generate() throughput and latency, qwen35-packed vs transformers' built-in Qwen3.5, one model at a time.

For each model, implementation, batch size, prompt length and decoding mode: random prompt ids (a new draw for every
call, seeded), `generate()` with exactly `--new-tokens` new tokens (min_new_tokens = max_new_tokens), timed as the
first call (kernel compilation and autotuning included) and then warm (the mean of `--reps` further calls with new
prompts). From the warm calls: the prefill (a call with one new token) and the decode step ((full call - prefill) /
(new tokens - 1)), new tokens per second (batch x new tokens / full call), peak GPU memory. Weights are random
(seed 0, bf16 on CUDA); both implementations get the same shapes, not the same weights (one model is built at a
time, so a 35B-A3B fits).

Models: Qwen3.5-0.8B, 4B and 35B-A3B text configs (examples/configs; vocab 248,320); `name:L` keeps the first L
layers. On the built-in: transformers' own fast paths where installed (FLA, causal_conv1d).

    python benchmarks/bench_generate.py [--models qwen35_4b:8,qwen35_35b_a3b] [--impls ours,ours:static,builtin]
        [--batches 1,16,64] [--prompts 512,4096] [--new-tokens 256] [--modes greedy,sampled] [--reps 2]
        [--profile] [--device cuda] [--tiny] [--out FILE] [--bound-only]

An implementation `NAME:static` runs generate(cache_implementation="static"): ours then writes a static cache in
place and replays its decode steps as CUDA graphs; the built-in builds transformers' StaticCache (and compiles its
forward, as generate() does for a static cache). The rows record the cache.

--profile (CUDA) adds where a decode step goes to every row: a call with one new token and one with all of them
under torch.profiler, their difference per decode step: kernel launches, kernel milliseconds by class and by name,
the time the GPU waited for the host (the step's wall time minus its kernel time), and the host milliseconds by
outermost operator (trace_train_step.py's readings of the trace).

Every row also records the weights a decode step must read at least (`weight_gb_per_step`, every parameter once; of
the routed experts the share its tokens hit) and, on a card whose data-sheet memory bandwidth is known, the time
that reading takes (`bandwidth_bound_ms`): the step's lower bound. `--bound-only` prints those two for the given
models and batches from meta-device models, without a GPU.

--tiny runs a small config (on CPU it measures the host work of a decode step, which a GPU run at small shapes is
bound by as well). Prints a table and writes JSON under results/benchmarks/ (or --out) after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch
import transformers
from bench_train_step import TINY, default_dtype, model_kwargs, model_spec, peak_gib, sync
from bench_workload import MODELS as MOE_MODELS
from bench_workload import classes, kernel_ms_by_class, text_config
from trace_train_step import host_time_by_outermost_op, kernel_time_by_name, trace_events

ROOT = Path(__file__).resolve().parent
MOE_MODEL = "qwen35_35b_a3b"
# Peak memory bandwidth in TB/s from NVIDIA's data sheets, by a part of the device name: a decode step's lower bound.
PEAK_BANDWIDTH_TB_S = {"H100 80GB HBM3": 3.35, "H200": 4.8}


def weight_bytes_per_decode_step(model, batch: int) -> int:
    """The bytes of weights one decode step of `batch` rows must read: every parameter once, of the input embedding
    only the rows looked up (all of it where the output head shares it), and of each layer's routed experts
    the share that `batch` tokens, each choosing k of E, hit on average under uniform routing (random weights route
    near uniformly): 1 - (1 - k/E)^batch."""
    config = model.config
    experts = getattr(config, "num_experts", None)
    hit = 1.0 if not experts else 1 - (1 - config.num_experts_per_tok / experts) ** batch
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if p is embedding and not tied:
            size = min(batch, p.shape[0]) * p.shape[1] * p.element_size()
        elif experts and ".experts." in name and p.shape[0] == experts:
            size *= hit
        total += size
    return round(total)


def peak_bandwidth_tb_s(device_name: str) -> float | None:
    return next((tb for part, tb in PEAK_BANDWIDTH_TB_S.items() if part in device_name), None)


def decode_bound(model, batch: int, device_name: str) -> dict:
    """weight_gb_per_step and, where the card's bandwidth is known, bandwidth_bound_ms (see the module docstring)."""
    weights = weight_bytes_per_decode_step(model, batch)
    bandwidth = peak_bandwidth_tb_s(device_name)
    bound = None if bandwidth is None else round(weights / (bandwidth * 1e12) * 1e3, 3)
    return {"weight_gb_per_step": round(weights / 1e9, 3), "bandwidth_bound_ms": bound}


def config_kwargs(spec: str, tiny: bool) -> tuple[str, str, dict]:
    """(result name, model key, config fields) of 'qwen35_4b', 'qwen35_4b:8' or 'qwen35_35b_a3b[:L]'."""
    key, _, layers = spec.partition(":")
    if tiny:
        kwargs = text_config(MOE_MODEL, True) if key == MOE_MODEL else dict(TINY)
        return f"{key}_tiny", key, kwargs
    if key in MOE_MODELS:
        kwargs = text_config(key, False)
        name = key
        if layers:
            total = kwargs["num_hidden_layers"]
            kwargs["layer_types"] = kwargs["layer_types"][: int(layers)]
            kwargs["num_hidden_layers"] = int(layers)
            name = f"{key}_{layers}_of_{total}_layers"
        return name, key, kwargs
    name, key, kept = model_spec(spec)
    return name, key, model_kwargs(key, kept)


def implementation_and_cache(spec: str) -> tuple[str, str]:
    """'ours' -> ('ours', 'dynamic'); 'ours:static' -> ('ours', 'static'): an --impls entry."""
    impl, _, cache = spec.partition(":")
    if impl not in ("ours", "builtin") or cache not in ("", "dynamic", "static"):
        raise SystemExit(f"--impls: {spec!r} is not ours or builtin, optionally :dynamic or :static")
    return impl, cache or "dynamic"


def build(key: str, impl: str, kwargs: dict, device: torch.device, dtype: torch.dtype):
    model_cls, config_cls = classes(MOE_MODEL if key == MOE_MODEL else "qwen35_4b", impl)
    torch.manual_seed(0)
    with default_dtype(dtype), torch.device(device):
        model = model_cls(config_cls(**kwargs))
    return model.eval()


def timed_generate(model, batch: int, prompt: int, new_tokens: int, mode: str, seed: int, device, cache: str) -> float:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=generator).to(device)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"
    if mode == "sampled":
        options.update(do_sample=True, top_k=50, temperature=1.0)
    else:
        options.update(do_sample=False)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    sync(device)
    assert out.shape == (batch, prompt + new_tokens), out.shape
    return time.perf_counter() - start


def measure(model, batch, prompt, new_tokens, mode, reps, device, cache) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    first = timed_generate(model, batch, prompt, new_tokens, mode, 1, device, cache)
    full = [timed_generate(model, batch, prompt, new_tokens, mode, 2 + r, device, cache) for r in range(reps)]
    prefill = [timed_generate(model, batch, prompt, 1, mode, 100 + r, device, cache) for r in range(reps)]
    full_s, prefill_s = sum(full) / reps, sum(prefill) / reps
    step_ms = (full_s - prefill_s) / max(new_tokens - 1, 1) * 1e3
    return {
        "first_call_s": round(first, 3),
        "warm_call_s": round(full_s, 3),
        "prefill_s": round(prefill_s, 4),
        "decode_step_ms": round(step_ms, 3),
        "new_tokens_per_s": round(batch * new_tokens / full_s, 1),
        "peak_gib": peak_gib(device),
    }


def profile_decode(model, batch, prompt, new_tokens, mode, device, cache) -> dict:
    """Per decode step, from two profiled calls (one new token: the prefill; `new_tokens`: prefill and steps)."""
    if device.type != "cuda":
        return {"skipped": "kernel times are read from a CUDA trace"}
    if new_tokens < 2:
        return {"skipped": "a decode step needs --new-tokens >= 2"}
    from torch.profiler import ProfilerActivity, profile

    readings = {}
    for tokens in (1, new_tokens):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = timed_generate(model, batch, prompt, tokens, mode, 300 + tokens, device, cache)
        events = trace_events(prof)
        by_name = kernel_time_by_name(events, top=None)
        readings[tokens] = {
            "wall_ms": wall * 1e3,
            "launches": sum(e.get("cat") == "kernel" for e in events),
            "kernel_ms": sum(by_name.values()),
            "by_name": by_name,
            "host": host_time_by_outermost_op(events, top=None),
        }
    first, full, steps = readings[1], readings[new_tokens], new_tokens - 1

    def per_step(before: dict, after: dict, top: int) -> dict:
        change = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / steps for k in after}
        return {k: round(v, 4) for k, v in sorted(change.items(), key=lambda kv: -kv[1])[:top]}

    kernels_per_step = per_step(first["by_name"], full["by_name"], top=None)
    wall = (full["wall_ms"] - first["wall_ms"]) / steps
    kernels = (full["kernel_ms"] - first["kernel_ms"]) / steps
    return {
        "step_wall_ms_profiled": round(wall, 3),
        "kernel_launches_per_step": round((full["launches"] - first["launches"]) / steps, 1),
        "kernel_ms_per_step": round(kernels, 3),
        "gpu_waiting_for_host_ms_per_step": round(wall - kernels, 3),
        "kernel_ms_per_step_by_class": {k: round(v, 4) for k, v in kernel_ms_by_class(kernels_per_step).most_common()},
        "top_kernels_ms_per_step": dict(list(kernels_per_step.items())[:15]),
        "host_ms_per_step_by_outermost_op": per_step(first["host"], full["host"], top=15),
    }


def git_commit() -> str | None:
    """The commit of the qwen35_packed tree that runs (PYTHONPATH may point at another checkout than this script's),
    with "+changes" where tracked files differ from it: a tree copied to another machine keeps the checkout's first
    commit as HEAD, so HEAD alone would name a commit that did not run (the sending side records the tree's own)."""
    import qwen35_packed

    def git(*args: str) -> str:
        where = Path(qwen35_packed.__file__).parent
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=where).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return None
    return f"{head}+changes" if head and changed else head or None


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<28}{'impl':<16}{'batch':>6}{'prompt':>7}{'mode':>9}{'step ms':>9}{'tok/s':>9}{'first s':>9}")
    for row in rows:
        r = row["result"]
        impl = f"{row['impl']}:{row['cache']}"
        head = f"{row['model']:<28}{impl:<16}{row['batch']:>6}{row['prompt']:>7}{row['mode']:>9}"
        if "error" in r:
            print(f"{head}  {r['error']}")
            continue
        print(f"{head}{r['decode_step_ms']:>9.2f}{r['new_tokens_per_s']:>9.1f}{r['first_call_s']:>9.2f}")


def print_bounds(args) -> None:
    """--bound-only: each model's weights per decode step and the bound on each card of PEAK_BANDWIDTH_TB_S."""
    cards = list(PEAK_BANDWIDTH_TB_S)
    print(f"{'model':<28}{'batch':>6}{'GB/step':>9}" + "".join(f"{card + ' ms':>20}" for card in cards))
    for spec in args.models.split(","):
        name, key, kwargs = config_kwargs(spec, args.tiny)
        model = build(key, "ours", kwargs, torch.device("meta"), torch.bfloat16)
        for batch in map(int, args.batches.split(",")):
            bounds = [decode_bound(model, batch, card) for card in cards]
            line = f"{name:<28}{batch:>6}{bounds[0]['weight_gb_per_step']:>9.2f}"
            print(line + "".join(f"{b['bandwidth_bound_ms']:>20.3f}" for b in bounds))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen35_0p8b,qwen35_4b,qwen35_35b_a3b")
    parser.add_argument("--impls", default="ours,ours:static,builtin", help="NAME or NAME:static (see above)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompts", default="512,4096")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="where a decode step goes (CUDA, see above)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--bound-only", action="store_true", help="weights per step and the bound (see above)")
    args = parser.parse_args()
    if args.bound_only:
        print_bounds(args)
        return
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT.parent / "results" / "benchmarks" / f"{date}-generate-{device.type}.json"
    report = {
        "date": date,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
        "dtype": str(dtype),
        "new_tokens": args.new_tokens,
        "rows": [],
    }
    for spec in args.models.split(","):
        name, key, kwargs = config_kwargs(spec, args.tiny)
        for impl, cache in map(implementation_and_cache, args.impls.split(",")):
            model = build(key, impl, kwargs, device, dtype)
            for batch in map(int, args.batches.split(",")):
                for prompt in map(int, args.prompts.split(",")):
                    for mode in args.modes.split(","):
                        try:
                            result = measure(model, batch, prompt, args.new_tokens, mode, args.reps, device, cache)
                        except Exception as error:  # e.g. the built-in's static cache: recorded, the next rows run
                            result = {"error": f"{type(error).__name__}: {error}"[:500]}
                        else:
                            result.update(decode_bound(model, batch, report["device"]))
                        if args.profile and "error" not in result:
                            result["profile"] = profile_decode(
                                model, batch, prompt, args.new_tokens, mode, device, cache
                            )
                        row = {"model": name, "impl": impl, "cache": cache, "batch": batch, "prompt": prompt}
                        row["mode"] = mode
                        report["rows"].append({**row, "result": result})
                        print_table(report["rows"][-1:])
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_text(json.dumps(report, indent=1) + "\n")
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    print_table(report["rows"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
