"""Where one training step spends its GPU time and where the GPU waits for the host: a profiler trace of the RL batch
step, the kernel time summed by kernel name, and the gaps between consecutive GPU kernels, attributed to the host
operator that launched the kernel after each gap.

When kernel time is below step time (v4: 468 ms of kernels in a 498 ms step), the difference is time the GPU sat idle
because the host had not launched the next kernel yet: Python, dispatch, a synchronisation. The table sums the
gaps by the outermost operator around the launch that ended them (e.g. an autograd Function's forward or a backward
node) and lists the longest gaps with their launching operator chain.

    python benchmarks/trace_train_step.py [--model hybrid_1p4b | moe_35b_a3b_shapes] [--batch rl_longtail_x16]
                                          [--out FILE] [--trace FILE.json]

moe_35b_a3b_shapes is bench_moe.py's model (4 layers with the Qwen3.5-35B-A3B layer shapes, vocab 65,536).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conv import cuda_ms  # noqa: E402
from bench_moe import layer_shapes  # noqa: E402
from bench_train_step import MODELS, batches, model_kwargs  # noqa: E402

from qwen35_packed import (  # noqa: E402
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)

MOE_MODEL = "moe_35b_a3b_shapes"


def trace_events(prof, path: str | None = None) -> list[dict]:
    """The events of a finished torch.profiler run, through its Chrome trace (written to `path`, or a temporary file)."""
    trace = Path(path) if path else Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    return json.loads(trace.read_text())["traceEvents"]


# Kernel names are cut to this many characters where they are keys (CUTLASS's templates run to thousands)
NAME_WIDTH = 100


def kernel_time_by_name(events: list[dict], top: int = 30, width: int | None = NAME_WIDTH) -> dict[str, float]:
    """GPU kernel milliseconds summed per kernel name (names cut to `width` characters), the largest `top`."""
    total = collections.Counter()
    for e in events:
        if e.get("cat") == "kernel":
            total[e["name"][:width]] += e["dur"] / 1e3
    return {name: round(ms, 3) for name, ms in total.most_common(top)}


def cpu_ops_by_thread(events: list[dict]) -> dict[int, list[dict]]:
    """The host operators of a Chrome trace per thread, in start order (an enclosing operator before the ones it
    encloses)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            by_thread[e["tid"]].append(e)
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
    return by_thread


def launching_ops(events: list[dict]):
    """kernel event -> names of the host operators around its launch, outermost first ([] when its launch is not in
    the trace). Runtime-API launches (cudaLaunchKernel: aten, cuBLAS) and driver-API ones (cuLaunchKernel: Triton, so
    FLA's, this project's Triton kernels and the compiled loss chunk) are matched to their kernel by correlation id."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops_by_thread = cpu_ops_by_thread(events)
    starts = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_thread.items()}

    def chain(kernel: dict) -> list[str]:
        launch = launches.get(kernel["args"].get("correlation"))
        if launch is None:
            return []
        ops, ts = ops_by_thread.get(launch["tid"], []), launch["ts"]
        return [
            op["name"]
            for op in ops[: bisect.bisect_right(starts.get(launch["tid"], []), ts)]
            if op["ts"] <= ts <= op["ts"] + op["dur"]
        ]

    return chain


def kernel_time_by_launching_ops(events: list[dict], names: list[str], depth: int = 3) -> dict[str, dict[str, float]]:
    """For each kernel name of `names` (as kernel_time_by_name cuts them): its milliseconds summed by the innermost
    `depth` host operators around its launches, joined by ' > ', largest first: which calls a kernel's time comes
    from (e.g. the adapters' in-place sums or autograd's gradient sums, both one elementwise add kernel)."""
    chain = launching_ops(events)
    split = {name: collections.Counter() for name in names}
    for e in events:
        if e.get("cat") == "kernel" and e["name"][:NAME_WIDTH] in split:
            split[e["name"][:NAME_WIDTH]][" > ".join(chain(e)[-depth:]) or "(unknown)"] += e["dur"] / 1e3
    return {name: {ops: round(ms, 3) for ops, ms in by_ops.most_common()} for name, by_ops in split.items()}


def idle_gaps(events: list[dict], min_gap_us: float = 20.0) -> dict:
    """From a Chrome trace's events: total kernel time, the span from the first kernel's start to the last one's end,
    and every gap >= min_gap_us between consecutive kernels with the host operators that launched the next one.
    Kernels are ordered by start; overlapping kernels (several streams) close no gap."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    enclosing_ops = launching_ops(events)
    gaps, busy_until, kernel_us = [], None, 0.0
    for kernel in kernels:
        kernel_us += kernel["dur"]
        if busy_until is not None and kernel["ts"] - busy_until >= min_gap_us:
            chain = enclosing_ops(kernel)
            gaps.append(
                {
                    "gap_us": kernel["ts"] - busy_until,
                    "next_kernel": kernel["name"][:80],
                    "launched_by": chain[-3:],
                    "outermost": chain[0] if chain else "(unknown)",
                }
            )
        end = kernel["ts"] + kernel["dur"]
        busy_until = end if busy_until is None else max(busy_until, end)
    span = (busy_until - kernels[0]["ts"]) if kernels else 0.0
    by_outer = collections.Counter()
    for gap in gaps:
        by_outer[gap["outermost"]] += gap["gap_us"]
    return {
        "kernel_ms": kernel_us / 1e3,
        "span_ms": span / 1e3,
        "gaps": len(gaps),
        "idle_in_gaps_ms": sum(g["gap_us"] for g in gaps) / 1e3,
        "idle_by_outermost_op_ms": {k: v / 1e3 for k, v in by_outer.most_common(25)},
        "longest_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:40],
    }


def host_time_by_outermost_op(events: list[dict], top: int = 25) -> dict[str, float]:
    """Host milliseconds of the outermost operators (those no other operator of their thread encloses) summed by
    name, over every thread (the autograd engine runs the backward on its own): where the host spends the step."""
    total = collections.Counter()
    for ops in cpu_ops_by_thread(events).values():
        open_until = None
        for op in ops:
            if open_until is None or op["ts"] >= open_until:
                total[op["name"][:100]] += op["dur"] / 1e3
                open_until = op["ts"] + op["dur"]
    return {name: round(ms, 3) for name, ms in total.most_common(top)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="hybrid_1p4b", choices=sorted(MODELS) + [MOE_MODEL])
    parser.add_argument("--batch", default="rl_longtail_x16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None, help="also keep the Chrome trace here")
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    if args.model == MOE_MODEL:
        kwargs = layer_shapes(4, 65536, tiny=False)
        model = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**kwargs))
    else:
        kwargs = model_kwargs(args.model)
        model = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**kwargs))
    model = model.to("cuda", torch.bfloat16).train()
    lengths = batches()[args.batch]
    gen = torch.Generator().manual_seed(2)
    ids = torch.cat([torch.randint(0, kwargs["vocab_size"], (n,), generator=gen) for n in lengths])[None].cuda()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, cu_seqlens=cu, labels=ids, use_cache=False).loss.backward()

    step_ms = cuda_ms(step, reps=3)  # after 3 warm-up steps: compiled, autotuned, allocator warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = trace_events(prof, args.trace)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "batch": args.batch,
        "tokens": sum(lengths),
        "step_ms_unprofiled": step_ms,
        "kernel_ms_by_name": kernel_time_by_name(events),
        "host_ms_by_outermost_op": host_time_by_outermost_op(events),
        **idle_gaps(events),
    }
    print(
        f"step {step_ms:.1f} ms unprofiled; profiled: kernels {result['kernel_ms']:.1f} ms in a "
        f"{result['span_ms']:.1f} ms span, {result['gaps']} gaps >= 20 us = {result['idle_in_gaps_ms']:.1f} ms idle"
    )
    print(f"\n{'GPU ms':>9}  kernel")
    for name, ms in result["kernel_ms_by_name"].items():
        print(f"{ms:>9.2f}  {name}")
    print(f"\n{'host ms':>9}  outermost host operator")
    for name, ms in result["host_ms_by_outermost_op"].items():
        print(f"{ms:>9.2f}  {name[:100]}")
    print(f"\n{'idle ms':>9}  outermost host operator before the next kernel")
    for name, ms in result["idle_by_outermost_op_ms"].items():
        print(f"{ms:>9.2f}  {name[:100]}")
    print(f"\n{'gap us':>9}  launched by (innermost last) -> next kernel")
    for gap in result["longest_gaps"][:15]:
        print(f"{gap['gap_us']:>9.0f}  {' > '.join(gap['launched_by'])[:90]} -> {gap['next_kernel'][:40]}")
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).resolve().parent.parent
        / "results"
        / "gpu"
        / (f"{result['date']}-trace-{args.model}-{args.batch}.json")
    )
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
