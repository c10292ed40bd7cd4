"""benchmarks/memory_peak.py's reading of an allocator history: the peak of one step and what is live then, by the
site that allocated it, on hand-made histories."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from memory_peak import GIB, live_at_peak, site_of  # noqa: E402

MOE = [{"filename": "/x/qwen35_packed/modeling/moe.py", "line": 120, "name": "experts"},
       {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]  # fmt: skip
GDN = [{"filename": "/x/site-packages/fla/ops/chunk.py", "line": 9, "name": "fwd"},
       {"filename": "/x/qwen35_packed/modeling/gated_deltanet.py", "line": 95, "name": "_run"}]  # fmt: skip
PEFT = [{"filename": "/x/site-packages/peft/tuners/lora/layer.py", "line": 7, "name": "forward"}]


def alloc(addr, gib, frames):
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": frames}


def free(addr, gib):
    return {"action": "free_completed", "addr": addr, "size": int(gib * GIB)}


def test_the_peak_is_where_the_most_is_live_and_is_split_by_allocating_site():
    events = [
        alloc(1, 2, MOE),
        alloc(2, 1, GDN),
        free(1, 2),  # 3 GiB, then 1
        alloc(3, 4, MOE),
        alloc(4, 0.5, PEFT),
        alloc(5, 1, MOE),  # the peak: 1 + 4 + 0.5 + 1 = 6.5 GiB
        free(3, 4),
        alloc(6, 3, GDN),
        free(5, 1),  # 5.5, then 4.5
    ]
    result = live_at_peak(events, before_bytes=int(65 * GIB))
    assert result["peak_during_step_GiB"] == 6.5 and result["peak_total_GiB"] == 71.5 and result["peak_event"] == 5
    assert result["live_at_peak_by_site_GiB"] == {
        "moe.py:120 experts": [5.0, 2],
        "gated_deltanet.py:95 _run": [1.0, 1],
        "layer.py:7 forward": [0.5, 1],
    }


def test_freeing_a_block_from_before_the_history_counts_down_and_small_sites_are_summed():
    events = [free(99, 2), alloc(1, 1, MOE), alloc(2, 1.5, GDN), alloc(3, 0.25, PEFT)]
    result = live_at_peak(events, before_bytes=int(10 * GIB), top=1)
    assert result["peak_during_step_GiB"] == 0.75 and result["peak_total_GiB"] == 10.75
    assert result["live_at_peak_by_site_GiB"] == {"gated_deltanet.py:95 _run": [1.5, 1], "(other sites)": [1.25, 2]}


def test_a_site_is_this_projects_frame_before_a_library_frame():
    assert site_of(GDN) == "gated_deltanet.py:95 _run"  # FLA's frame is innermost, ours is named
    assert site_of(PEFT) == "layer.py:7 forward"
    assert site_of([{"filename": "/x/torch/functional.py", "line": 3, "name": "f"}]) == "functional.py:3 f"
    assert site_of([]) == "(no Python frame)"


def test_a_step_that_ran_out_of_memory_reads_what_was_live_at_the_failure_and_the_request():
    events = [
        alloc(1, 3, MOE),
        alloc(2, 2, GDN),  # the peak before the failure: 5 GiB
        free(1, 3),
        alloc(3, 1, PEFT),
        {"action": "oom", "size": int(6 * GIB), "device_free": int(0.5 * GIB), "frames": MOE},
        free(2, 2),  # the exception unwinds the step
        free(3, 1),
    ]
    result = live_at_peak(events, before_bytes=int(70 * GIB))
    assert result["peak_during_step_GiB"] == 5.0 and result["peak_total_GiB"] == 75.0
    failure = result["out_of_memory"]
    assert failure["requested_GiB"] == 6.0 and failure["requested_at"] == "moe.py:120 experts"
    assert failure["device_free_GiB"] == 0.5 and failure["event"] == 4
    assert failure["allocated_during_step_GiB"] == 3.0 and failure["needed_at_least_GiB"] == 79.0
    assert failure["live_by_site_GiB"] == {"gated_deltanet.py:95 _run": [2.0, 1], "layer.py:7 forward": [1.0, 1]}


def test_a_step_without_a_failure_has_no_out_of_memory_reading():
    assert "out_of_memory" not in live_at_peak([alloc(1, 1, MOE), free(1, 1)])
