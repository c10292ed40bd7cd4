"""benchmarks/bench_grpo_step.py's StepTimer: each step's seconds split where TRL's methods split them, and the part
of the step an error struck in (a row that runs out of memory records it)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_grpo_step import StepTimer  # noqa: E402


class FakeTrainer:
    """TRL's call structure: training_step -> _generate_and_score_completions -> _generate."""

    def __init__(self, fail_in: str | None = None):
        self.fail_in = fail_in

    def _generate(self):
        if self.fail_in == "_generate":
            raise torch.OutOfMemoryError("out of memory")

    def _generate_and_score_completions(self):
        self._generate()
        if self.fail_in == "_generate_and_score_completions":
            raise torch.OutOfMemoryError("out of memory")

    def training_step(self):
        self._generate_and_score_completions()
        if self.fail_in == "training_step":
            raise torch.OutOfMemoryError("out of memory")


def test_a_step_splits_into_generation_scoring_and_training():
    trainer = FakeTrainer()
    timer = StepTimer(trainer, torch.device("cpu"))
    trainer.training_step()
    trainer.training_step()
    assert len(timer.steps) == 2
    for step in timer.steps:
        assert step["total_s"] == pytest.approx(step["generation_s"] + step["scoring_s"] + step["training_s"])
    assert timer.phase().startswith("outside the timed methods")


@pytest.mark.parametrize(
    "method, phase",
    [("_generate", "generation"), ("_generate_and_score_completions", "scoring"), ("training_step", "training")],
)
def test_an_error_is_placed_in_the_phase_it_struck(method, phase):
    trainer = FakeTrainer()
    timer = StepTimer(trainer, torch.device("cpu"))
    trainer.training_step()
    trainer.fail_in = method
    with pytest.raises(torch.OutOfMemoryError):
        trainer.training_step()
    assert timer.phase() == f"{phase} (step 1)"


def test_the_memory_allocated_when_each_part_started_is_kept_for_a_failure():
    """What was allocated when generation, scoring and training last started: the failing step's parts that ran."""
    trainer = FakeTrainer()
    allocated = iter(range(1, 100))
    timer = StepTimer(trainer, torch.device("cpu"), allocated=lambda: next(allocated) * 2**30)
    trainer.training_step()
    assert timer.allocated_at_start == {"training": 1.0, "scoring": 2.0, "generation": 3.0}
    trainer.fail_in = "_generate"
    with pytest.raises(torch.OutOfMemoryError):
        trainer.training_step()
    assert timer.allocated_at_start == {"training": 4.0, "scoring": 5.0, "generation": 6.0}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--impls", "ours,builtin", "--activation-offloading"], "--activation-offloading is an option of ours"),
        (["--micro-batches", "0"], "--micro-batches must be at least 1"),
        (["--micro-batches", "4", "--generation-rounds", "3"], "a divisor of --micro-batches"),
        (["--prompts", "2", "--micro-batches", "4", "--generation-rounds", "4"], "a divisor of --prompts"),
        (["--impls", "ours,builtin", "--config", "moe_token_chunk=64"], "--config sets fields of ours only"),
    ],
)
def test_argument_refusals(flags, message, monkeypatch, capsys):
    import bench_grpo_step

    monkeypatch.setattr(sys, "argv", ["bench_grpo_step.py", *flags, "--device", "cpu", "--tiny"])
    with pytest.raises(SystemExit) as exit_info:
        bench_grpo_step.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


class AccumulatingTrainer(FakeTrainer):
    """TRL under gradient accumulation: every `steps_per_generation`-th training_step generates and scores the
    completions of that many calls, each call trains on its share."""

    def __init__(self, steps_per_generation: int):
        super().__init__()
        self.steps_per_generation, self.calls = steps_per_generation, 0

    def _generate(self):
        time.sleep(0.01)

    def training_step(self):
        if self.calls % self.steps_per_generation == 0:
            self._generate_and_score_completions()
        self.calls += 1


@pytest.mark.parametrize("steps_per_generation", [3, 1])  # one generation per step, or one per micro-batch
def test_micro_batches_make_one_step_of_their_training_step_calls(steps_per_generation):
    trainer = AccumulatingTrainer(steps_per_generation)
    timer = StepTimer(trainer, torch.device("cpu"), calls_per_step=3)
    for _ in range(5):
        trainer.training_step()
    assert len(timer.steps) == 1  # the second step is two calls short
    trainer.training_step()
    assert len(timer.steps) == 2
    for step in timer.steps:
        assert step["generation_s"] >= 0.01 * (3 // steps_per_generation)  # every round of the step counts
        assert step["total_s"] == pytest.approx(step["generation_s"] + step["scoring_s"] + step["training_s"])


def test_each_step_that_ends_is_handed_on_so_a_run_cut_short_keeps_it():
    trainer, seen = FakeTrainer(), []
    StepTimer(trainer, torch.device("cpu"), on_step=lambda steps: seen.append(len(steps)))
    trainer.training_step()
    trainer.fail_in = "training_step"
    with pytest.raises(torch.OutOfMemoryError):
        trainer.training_step()
    assert seen == [1]  # the failed step never ended
