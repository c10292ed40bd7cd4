"""Worker for tests/integrations/test_context_parallel_trainer.py, run under torchrun on CPU (gloo, 2 processes):
one SGD step of TRL's SFTTrainer (padding_free=True, DDP over the processes) with the model's own context
parallelism over a group of its own and `ContextParallelCollator`, so the two ranks train on the union of their
batches, each holding half of the row. Rank 0 writes the report: every rank's loss as `compute_loss` returned it,
the keys and token counts of each rank's batch, and the weights after the step (OUT.weights.pt)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datasets  # noqa: E402
import trl  # noqa: E402
from fixtures_distributed import start_gloo_worker  # noqa: E402
from fixtures_sft import TEXTS_CP, sft_context_parallel_config  # noqa: E402

from qwen35_packed.integrations.context_parallel import ContextParallelCollator  # noqa: E402


def main():
    args, rank, world = start_gloo_worker("--folder")
    group = dist.new_group(list(range(world)))  # the model's collectives apart from DDP's
    config = sft_context_parallel_config(Path(args.out).parent, per_device_train_batch_size=len(TEXTS_CP) // world)
    trainer = trl.SFTTrainer(
        model=args.folder, args=config, train_dataset=datasets.Dataset.from_dict({"text": TEXTS_CP})
    )
    trainer.model.set_context_parallel(group)
    trainer.data_collator = ContextParallelCollator(trainer.data_collator, group)
    seen, compute_loss = [], trainer.compute_loss

    def recording(model, inputs, *a, **k):
        loss = compute_loss(model, inputs, *a, **k)
        seen.append({"loss": loss.item(), "keys": sorted(inputs), "tokens": int(inputs["input_ids"].shape[1])})
        return loss

    trainer.compute_loss = recording
    trainer.train()
    steps = [None] * world
    dist.all_gather_object(steps, seen)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"world": world, "steps": steps}))
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, f"{args.out}.weights.pt")
    # every rank leaves together: gloo can abort a rank that tears down while its peer is still working
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
