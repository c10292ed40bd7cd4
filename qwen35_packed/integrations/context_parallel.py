"""Context parallelism in a trainer: a data collator wrapper that turns each rank's packed batch into its shard of
the context-parallel group's row, for the model's own context parallelism (modeling/context_parallel.py).

Trainers (transformers' Trainer, TRL's SFTTrainer) give every rank a batch of its own. `ContextParallelCollator`
collates the rank's batch as the wrapped collator does (a padding-free row: TRL's `padding_free=True` or
`packing=True`, transformers' `DataCollatorWithFlattening`), gathers the rows of all ranks of the group, joins them
into one row (rank 0's documents first) and hands the rank its contiguous shard of it, with the row's boundaries
(`cu_seqlens`) and the row's next-token targets (`shift_labels`, shifted within documents before cutting). The group
then trains on the union of its ranks' batches with every rank holding an equal share of the tokens: a document
longer than one GPU can hold is split over the group.

Losses and gradients follow the Trainer's convention for token-averaged losses across devices (the Trainer counts
`num_items_in_batch` over all ranks from `shift_labels`, each rank's loss is its targets' share, multiplied by the
number of processes, and DDP / FSDP2 average the gradients): the step is the unsharded row's step. The group must
be one of its own (`torch.distributed.new_group`), not the group DDP / FSDP2 reduce gradients over, so that their
collectives never interleave with the model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..modeling.context_parallel import shard_packed_row
from ..modeling.packing import build_packed_sequence, shift_labels_within_documents

# Per-token entries of a padding-free batch that the row's shards carry; the boundary entries are replaced by the
# row's cu_seqlens (shard_packed_row).
_BOUNDARY_ENTRIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")


class ContextParallelCollator:
    """`collator` (giving one padding-free packed row with `position_ids`) -> this rank's shard of the group's row.

    `group`: the context-parallel process group (the one given to `model.set_context_parallel`)."""

    def __init__(self, collator, group):
        self.collator = collator
        self.group = group

    def __call__(self, examples):
        batch = dict(self.collator(examples))
        ids = batch.get("input_ids")
        if ids is None or ids.shape[0] != 1 or batch.get("position_ids") is None or "attention_mask" in batch:
            raise ValueError(
                "ContextParallelCollator needs a padding-free collator (one packed row with position_ids and no "
                "attention_mask): TRL's padding_free=True or packing=True, or transformers' DataCollatorWithFlattening"
            )
        length = ids.shape[1]
        for name in _BOUNDARY_ENTRIES:  # the shards carry the row's boundaries instead
            batch.pop(name, None)
        tokens = {name: value for name, value in batch.items() if _per_token(name, value, length)}
        rows = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(rows, tokens, group=self.group)
        if any(set(r) != set(tokens) for r in rows):
            raise ValueError("the ranks' batches hold different entries; they cannot be joined into one row")
        row = {name: torch.cat([r[name] for r in rows], dim=-1 if name == "position_ids" else 1) for name in tokens}
        if "labels" in row:  # the row's next-token targets, shifted within its documents before cutting
            packed = build_packed_sequence(tuple(row["labels"].shape), "cpu", position_ids=row["position_ids"].cpu())
            row["shift_labels"] = shift_labels_within_documents(row["labels"].cpu(), packed).view(1, -1)
        shard = shard_packed_row(row, dist.get_rank(self.group), len(rows))
        return {**batch, **{name: shard[name] for name in (*row, "cu_seqlens")}}


def _per_token(name: str, value, length: int) -> bool:
    """Whether a batch entry holds one value per token of the row: [1, n, ...], or position_ids [..., 1, n]."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    if name == "position_ids":
        return value.shape[-1] == length
    return value.shape[0] == 1 and value.shape[1] == length
