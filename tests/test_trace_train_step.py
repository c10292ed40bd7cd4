"""benchmarks/trace_train_step.py's reading of a profiler trace: the gaps between GPU kernels and the host
operators that launched the kernel ending each one, on a hand-made Chrome trace."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from trace_train_step import idle_gaps  # noqa: E402


def _kernel(name, ts, dur, correlation):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _launch(cat, ts, correlation, tid=1):
    return {"cat": cat, "name": "launch", "ts": ts, "dur": 2, "tid": tid, "args": {"correlation": correlation}}


def _op(name, ts, dur, tid=1):
    return {"cat": "cpu_op", "ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_gaps_are_attributed_to_the_operator_around_runtime_and_driver_launches():
    # Triton kernels (FLA's, this project's) are launched through the driver API: a gap before one of them
    # belongs to the operator around its cuLaunchKernel, not to "(unknown)".
    events = [
        _op("aten::mm", 0, 10),
        _launch("cuda_runtime", 5, 1),
        _kernel("gemm", 10, 50, 1),
        _op("ChunkGatedDeltaRuleFunction", 100, 200),
        _launch("cuda_driver", 250, 2),
        _kernel("chunk_fwd_kernel_o", 260, 40, 2),
        _launch("cuda_runtime", 305, 3),
        _kernel("add", 310, 5, 3),  # a 10 us gap: below the 20 us threshold
    ]
    result = idle_gaps(events)
    assert result["gaps"] == 1 and result["kernel_ms"] == (50 + 40 + 5) / 1e3
    (gap,) = result["longest_gaps"]
    assert gap["gap_us"] == 200 and gap["next_kernel"] == "chunk_fwd_kernel_o"
    assert gap["outermost"] == "ChunkGatedDeltaRuleFunction"
    assert result["idle_by_outermost_op_ms"] == {"ChunkGatedDeltaRuleFunction": 0.2}
    assert result["span_ms"] == (315 - 10) / 1e3


def test_host_time_counts_each_outermost_operator_once_per_thread():
    from trace_train_step import host_time_by_outermost_op

    events = [
        _op("aten::linear", 0, 100),
        _op("aten::mm", 10, 80),  # inside aten::linear: not counted again
        _op("aten::add", 150, 20),
        _op("autograd::engine::evaluate_function: MmBackward0", 5, 60, tid=2),  # the backward's own thread
        _op("aten::linear", 300, 50),
    ]
    assert host_time_by_outermost_op(events) == {
        "aten::linear": 0.15,
        "autograd::engine::evaluate_function: MmBackward0": 0.06,
        "aten::add": 0.02,
    }


def test_a_kernels_time_is_split_by_the_operators_that_launched_it():
    """One elementwise add kernel serves the adapters' in-place sums and autograd's gradient sums: its time is split
    by the innermost host operators around each launch."""
    from trace_train_step import kernel_time_by_launching_ops

    events = [
        _op("AdapterSumProduct", 0, 50),
        _op("aten::add_", 10, 5),
        _launch("cuda_runtime", 12, 1),
        _kernel("add", 20, 30, 1),
        _op("autograd::engine::evaluate_function: AddBackward0", 100, 50, tid=2),
        _op("aten::add", 110, 5, tid=2),
        _launch("cuda_runtime", 112, 2, tid=2),
        _kernel("add", 120, 10, 2),
        _launch("cuda_runtime", 200, 3, tid=3),  # no host operator around it
        _kernel("add", 210, 4, 3),
        _kernel("add", 300, 2, 99),  # its launch is not in the trace
        _kernel("gemm", 400, 100, 4),
    ]
    assert kernel_time_by_launching_ops(events, ["add"], depth=2) == {
        "add": {
            "AdapterSumProduct > aten::add_": 0.03,
            "autograd::engine::evaluate_function: AddBackward0 > aten::add": 0.01,
            "(unknown)": 0.006,
        }
    }
