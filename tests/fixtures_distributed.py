"""The tests' multi-process workers (tests/*/..._worker.py, scripts run under torchrun over gloo): their launcher,
and their start."""

import argparse
import os
import subprocess
import sys

import torch.distributed as dist


def run_worker_script(worker, *args, nproc: int | None = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the script `worker` with `args` under torchrun (`--standalone`, `nproc` processes; `nproc=None`: one plain
    process), one intra-op thread per process; asserts it exited 0 (the ends of its output in the message) and
    returns the finished process."""
    torchrun = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    done = subprocess.run(
        [sys.executable, *torchrun, str(worker), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def start_gloo_worker(*options: str) -> tuple[argparse.Namespace, int, int]:
    """A worker's start: its required string options (`options` and --out) parsed, gloo's process group up; returns
    (the parsed options, this process's rank, the number of processes)."""
    parser = argparse.ArgumentParser()
    for option in (*options, "--out"):
        parser.add_argument(option, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    return args, dist.get_rank(), dist.get_world_size()
