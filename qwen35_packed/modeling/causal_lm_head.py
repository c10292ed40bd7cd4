"""The causal-LM head shared by the text and vision-language models: lm_head, the token-weighted fp32 loss on the
packed stream and the MoE aux loss (generate() is generation.py's)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .loss import IGNORE_INDEX, LogitsNotKept, chunked_linear_cross_entropy, keeps_logits_with_loss
from .moe import add_load_balancing_loss
from .outputs import DecoderRun
from .packed_batch import PackedBatch
from .projection import RowInvariantLinear
from .utils import log_once

logger = logging.getLogger(__name__)


# The causal-LM classes' tensor-parallel plan beyond the backbone's (config.base_model_tp_plan): the built-in's.
LM_HEAD_TP_PLAN = {"lm_head": "colwise_gather_output"}


def whole_weight(weight: torch.Tensor) -> torch.Tensor:
    """The head's weight as one tensor: under tensor parallelism (a DTensor sharded by vocabulary rows) gathered,
    differentiably, so the loss covers every token of the vocabulary and the gradient goes back to the shards."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):
            return weight.full_tensor()
    return weight


class PackedCausalLMHead:
    """Mixed into the causal-LM classes (text and vision-language) before PreTrainedModel and GenerationMixin: the
    head reads `self.lm_head`, `self.config.get_text_config()` and `self.generation_config`."""

    def lm_head_outputs(self, run: DecoderRun):
        """lm_head, loss and MoE aux loss on the packed stream -> (loss, aux_loss, logits in the caller's layout).
        Shared with the vision-language classes: the text settings come from `config.get_text_config()`."""
        text_config = self.config.get_text_config()
        hidden, batch, logits_to_keep = run.hidden, run.batch, run.batch.logits_to_keep
        packed = batch.packed
        full_logits = isinstance(logits_to_keep, int) and logits_to_keep == 0
        loss = None
        if batch.targets is not None:
            if not full_logits:
                raise ValueError("labels need the full logits: leave logits_to_keep at 0 when computing the loss")
            keep_logits = keeps_logits_with_loss(text_config.return_logits_with_loss, self.training)
            loss, logits = self.packed_loss(hidden, batch, keep_logits)
            if not keep_logits:
                logits = LogitsNotKept(text_config.return_logits_with_loss)
        elif full_logits:
            logits = packed.unpack(self.lm_head(hidden))  # lm_head on real tokens only
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(packed.unpack(hidden)[:, keep, :])

        aux_loss = None
        if batch.output_router_logits and run.router_logits:
            if loss is not None and text_config.router_aux_loss_coef > 0:
                log_once(
                    logger,
                    "aux",
                    "MoE load-balancing loss added to the loss with router_aux_loss_coef=%s "
                    "(set it to 0 or do not request router logits to train without it, e.g. for RL)",
                    text_config.router_aux_loss_coef,
                )
            loss, aux_loss = add_load_balancing_loss(loss, run.router_logits, text_config)
        return loss, aux_loss, logits

    def packed_loss(self, hidden: torch.Tensor, batch: PackedBatch, keep_logits: bool = True):
        """Token-weighted fp32 cross-entropy of `batch.targets` on the packed stream (over `batch.num_items_in_batch`
        when the trainer gives it); returns (loss, logits in the
        caller's layout [batch, seq, V], or None when `keep_logits` is False).

        With an unwrapped linear head the loss runs chunked (chunked_linear_cross_entropy): fp32 [N, V] logits never
        exist in full, the per-chunk cross-entropy runs compiled when the elementwise chains are fused, and the returned
        logits are detached (they carry no gradient; the loss does) and written straight into the caller's layout.
        A wrapped head (e.g. an adapter) keeps the plain path, so its forward is never bypassed.
        """
        packed, targets, num_items_in_batch = batch.packed, batch.targets, batch.num_items_in_batch
        if batch.shard is not None:  # this rank's share of the row's loss (context_parallel.py)
            num_items_in_batch = batch.shard.loss_denominator(targets.to(hidden.device), num_items_in_batch)
        if type(self.lm_head) in (nn.Linear, RowInvariantLinear) and self.lm_head.bias is None:
            rows, seq_len = packed.batch_shape
            loss, logits = chunked_linear_cross_entropy(
                hidden,
                whole_weight(self.lm_head.weight),
                targets,
                num_items_in_batch,
                keep_logits=keep_logits,
                logits_index=packed.token_index,
                logits_rows=rows * seq_len,
                chunk_loss=batch.kernels.loss_chunk,
            )
            return loss, (logits.view(rows, seq_len, -1) if logits is not None else None)
        logits = self.lm_head(hidden)
        total = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        denominator = (
            num_items_in_batch if num_items_in_batch is not None else ((targets != IGNORE_INDEX).sum().clamp(min=1))
        )
        return total / denominator, (packed.unpack(logits) if keep_logits else None)
