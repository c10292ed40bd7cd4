"""Context parallelism in TRL's SFTTrainer (integrations/context_parallel.py): one SGD step with 2 processes, each
holding half of the group's packed row (sft_context_parallel_worker.py under torchrun, gloo, DDP), gives the loss
and the weights of one process training on the whole row; and the collator's shards, checked in one process."""

import json
from pathlib import Path

import pytest
import torch

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

from fixtures_distributed import run_worker_script  # noqa: E402
from fixtures_sft import TEXTS_CP, sft_context_parallel_config  # noqa: E402

from qwen35_packed.tiny import build_tiny_folder  # noqa: E402

WORKER = Path(__file__).resolve().parent / "sft_context_parallel_worker.py"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sft_step_with_context_parallelism_equals_the_whole_row(kind, tmp_path):
    # no MoE load-balancing loss: it is refused under context parallelism (tests/modeling/test_context_parallel.py)
    folder = build_tiny_folder(tmp_path / "model", kind, router_aux_loss_coef=0.0)
    out = tmp_path / "cp" / "report.json"
    out.parent.mkdir()
    run_worker_script(WORKER, "--folder", folder, "--out", out, timeout=900)
    report = json.loads(out.read_text())

    # the same step in one process on the whole row
    trainer = trl.SFTTrainer(
        model=str(folder),
        args=sft_context_parallel_config(tmp_path / "single", per_device_train_batch_size=len(TEXTS_CP)),
        train_dataset=datasets.Dataset.from_dict({"text": TEXTS_CP}),
    )
    losses, compute_loss = [], trainer.compute_loss
    trainer.compute_loss = lambda *a, **k: losses.append(compute_loss(*a, **k)) or losses[-1]
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    single = losses[0].item()
    expected = {n: p.detach() for n, p in trainer.model.named_parameters()}

    ranks = [steps[0] for steps in report["steps"]]
    # each rank held its half of the row, with the row's targets shifted before cutting
    tokens = [step["tokens"] for step in ranks]
    assert abs(tokens[0] - tokens[1]) <= 1
    assert all({"cu_seqlens", "shift_labels", "position_ids"} <= set(step["keys"]) for step in ranks)
    # the Trainer's loss on a rank is its share times the process count: their mean is the row's loss
    assert sum(step["loss"] for step in ranks) / 2 == pytest.approx(single, rel=1e-5)
    got = torch.load(f"{out}.weights.pt")
    moved = max(float((expected[n] - p).abs().max()) for n, p in got.items())
    assert moved < 1e-5, moved
    assert max(float((expected[n] - p).abs().max()) for n, p in initial.items()) > 1e-3  # the step moved them
