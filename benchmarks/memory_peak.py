"""What fills GPU memory at the peak of one training step: the blocks live at the moment the step's allocated memory
is highest, summed by the line of code that allocated them.

A peak above the budget (a long document on the 35B-A3B) says how much is over, not what: this reads PyTorch's
allocator history (`torch.cuda.memory._record_memory_history`) of one forward + backward, replays its allocations
and frees to find the peak, and sums the blocks live then (those allocated during the step, beside what was already
allocated before it: weights, optimizer state, offload buffers) by their allocation site: the innermost frame in this
project's code, else in PEFT / TRL / transformers, else the innermost Python frame.

A step that runs out of memory is read too: the history ends with the allocator's `oom` event, which names the
request that failed and its site. The reading then adds what was live at the failure, by site, and what the step
needed at least there (live + requested), so a row over its card's budget says which sites to shrink and by how much.

`bench_workload.py --memory-at-peak ROW` adds it to a row; `live_at_peak` is the reading, tested on hand-made
histories (tests/test_memory_peak.py).
"""

from __future__ import annotations

import collections

import torch

# Where a block's allocation is attributed: the innermost frame whose file path contains one of these, in this order.
SITE_OWNERS = ("qwen35_packed", "peft", "trl", "transformers")
GIB = 2**30


def site_of(frames: list[dict]) -> str:
    """`file.py:line function` of the allocating frame (innermost first in `frames`) the module docstring picks."""
    for owner in SITE_OWNERS:
        for frame in frames:
            if owner in frame.get("filename", ""):
                return _frame_name(frame)
    return _frame_name(frames[0]) if frames else "(no Python frame)"


def _frame_name(frame: dict) -> str:
    return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"


def live_at_peak(events: list[dict], before_bytes: int = 0, top: int = 25) -> dict:
    """Replay an allocator history (`alloc` / `free_completed` / `oom` events; `alloc` and `free_completed` with
    `addr`, `size`, `frames`): the peak of the bytes allocated beyond what was allocated when it began
    (`before_bytes`; freeing one of those blocks counts down), when it happened (event index), and the blocks
    allocated during the history and live then, summed by allocation site (the largest `top`; the rest as one
    entry). At the first `oom` event, `out_of_memory` adds the failed request (its size and site, what CUDA still
    reported free), the blocks live at that moment by site, and `needed_at_least_GiB`: the total then plus the
    request."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = peak_index = 0
    peak_live: dict[int, tuple[int, str]] = {}
    failure = None
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], site_of(event.get("frames") or []))
            current += event["size"]
            if current > peak:
                peak, peak_index, peak_live = current, index, dict(live)
        elif action == "free_completed":  # a block from before the history counts down from what was there
            current -= live.pop(event["addr"])[0] if event["addr"] in live else event["size"]
        elif action == "oom" and failure is None:
            failure = {
                "requested_GiB": round(event["size"] / GIB, 3),
                "requested_at": site_of(event.get("frames") or []),
                "device_free_GiB": round(event.get("device_free", 0) / GIB, 3),
                "event": index,
                "allocated_during_step_GiB": round(current / GIB, 2),
                "needed_at_least_GiB": round((before_bytes + current + event["size"]) / GIB, 2),
                "live_by_site_GiB": _by_site(live, top),
            }
    result = {
        "allocated_before_step_GiB": round(before_bytes / GIB, 2),
        "peak_during_step_GiB": round(peak / GIB, 2),
        "peak_total_GiB": round((before_bytes + peak) / GIB, 2),
        "peak_event": peak_index,
        "events": len(events),
        "live_at_peak_by_site_GiB": _by_site(peak_live, top),
    }
    if failure is not None:
        result["out_of_memory"] = failure
    return result


def _by_site(live: dict[int, tuple[int, str]], top: int) -> dict[str, list]:
    """Live blocks summed by site: {site: [GiB, blocks]}, the largest `top`, the rest as "(other sites)"."""
    by_site = collections.Counter()
    blocks = collections.Counter()
    for size, site in live.values():
        by_site[site] += size
        blocks[site] += 1
    shown = by_site.most_common(top)
    summary = {site: [round(size / GIB, 3), blocks[site]] for site, size in shown}
    rest = sum(by_site.values()) - sum(size for _, size in shown)
    if rest:
        summary["(other sites)"] = [round(rest / GIB, 3), len(by_site) - len(shown)]
    return summary


def record_step_memory(step, step_context, max_entries: int = 4_000_000) -> dict:
    """`live_at_peak` of one forward + backward of `step` (a callable returning the loss) inside `step_context()`,
    on the current CUDA device. Values are [GiB, blocks] per site. A step that runs out of memory is recorded up to
    its failure (`out_of_memory` in the result), not raised."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)
    try:
        try:
            with step_context():
                step().backward()
        except torch.OutOfMemoryError:
            pass  # the history holds the failure; the step's tensors go with the exception
        except RuntimeError as exc:  # a Triton kernel's own report of running out of memory: the same, unlogged
            if "out of memory" not in str(exc):
                raise
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    events = snapshot["device_traces"][device]
    result = live_at_peak(events, before)
    result["history_full"] = len(events) >= max_entries  # the oldest events were dropped: the replay is partial
    return result
