"""The causal-LM head shared by the text and vision-language models: lm_head, the token-weighted fp32 loss on the
packed stream, the MoE aux loss, and generate() with this model's own cache (one document per row)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin

from .cache import Qwen3_5PackedCache, as_packed_cache
from .loss import IGNORE_INDEX, LogitsNotKept, chunked_linear_cross_entropy, keeps_logits_with_loss
from .moe import add_load_balancing_loss
from .outputs import CACHE_FIELD, DecoderRun
from .packed_batch import BOUNDARY_ARGUMENTS, PackedBatch
from .packing import build_packed_sequence
from .projection import RowInvariantLinear
from .utils import log_once

logger = logging.getLogger(__name__)


def refuse_packed_generation(args: tuple, kwargs: dict) -> None:
    """generate() would silently drop packing kwargs; boundaries inside a row (cu_seqlens, cu_seq_lens_q/k,
    seq_idx, or position_ids that restart within a row) raise instead."""
    given = [name for name in BOUNDARY_ARGUMENTS if kwargs.get(name) is not None]
    position_ids = kwargs.get("position_ids")
    if not given and position_ids is not None and torch.as_tensor(position_ids).ndim == 2:
        ids = (
            args[0]
            if args
            else next((kwargs[k] for k in ("input_ids", "inputs", "inputs_embeds") if kwargs.get(k) is not None), None)
        )
        if ids is not None:
            packed = build_packed_sequence(tuple(ids.shape[:2]), ids.device, kwargs.get("attention_mask"), position_ids)
            if packed.num_docs != ids.shape[0]:
                given = ["position_ids that restart within a row"]
    if given:
        raise ValueError(
            f"generate() got packed document boundaries ({', '.join(given)}); generation continues one document "
            "per row: pass one document per row instead (left-padded, with attention_mask)"
        )


def new_columns(input_ids, attention_mask, inputs_embeds, cache: Qwen3_5PackedCache) -> int:
    """How many of the caller's last columns a cached generation step has not consumed yet. input_ids hold the whole
    sequence when the prompt came as token ids, only the generated tokens after a prefill from inputs_embeds (none
    when a cache is continued from longer inputs_embeds); the attention mask, when there is one, spans it all."""
    if attention_mask is not None:
        total = attention_mask.shape[1]
    else:
        total = input_ids.shape[1] + (inputs_embeds.shape[1] if inputs_embeds is not None else 0)
    count = total - cache.consumed_columns
    # the new columns are generated tokens (input_ids), or, continuing from embeddings, all embeddings
    fits = count <= input_ids.shape[1] or (input_ids.shape[1] == 0 and count <= total)
    if count <= 0 or not fits:
        raise ValueError(
            f"cannot tell the new tokens of a cached step: the cache consumed {cache.consumed_columns} columns of "
            f"{total}, with {input_ids.shape[1]} input_ids given"
        )
    return count


# The generation inputs laid out [batch, columns, ...] like the attention mask.
PER_COLUMN_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "mm_token_type_ids")


def padding_moved_left(tensors: dict, attention_mask: torch.Tensor) -> dict:
    """A generation prefill whose prompts end in padding in some rows: those rows rolled so that their padding
    comes first (the row's tokens in order, then nothing), applied to every [batch, seq, ...] tensor of `tensors`.

    generate() predicts each row's first new token at its last column. The built-in computes a prediction at a
    masked token there (a query that sees the row's real tokens, at position 0); this model computes none at masked
    tokens, so it continues such a row from its last real token, as it continues a left-padded row: the same tokens
    as the prompt without its padding. Said once in the log."""
    columns = attention_mask.shape[1]
    # the padding after each row's last real token (argmax finds the first real token from the end; 0 for a row
    # without any)
    shift = attention_mask.bool().flip(1).to(torch.int8).argmax(dim=1)
    log_once(
        logger,
        "right-padded-prompt",
        "generate(): prompts end in padding in rows %s; each continues from its last real token, as a left-padded "
        "prompt does (transformers' built-in classes predict at the pad column); pad prompts on the left "
        "(tokenizer.padding_side = 'left') to avoid this",
        torch.nonzero(shift).flatten().tolist(),
    )
    source = (torch.arange(columns, device=shift.device)[None, :] - shift[:, None]) % columns  # [batch, columns]
    moved = {}
    for name, tensor in tensors.items():
        index = source.to(tensor.device).view(*source.shape, *([1] * (tensor.dim() - 2))).expand_as(tensor)
        moved[name] = tensor.gather(1, index)
    return moved


def refuse_other_caches(default_generation_config, kwargs: dict) -> None:
    """generate() with `cache_implementation` "static" (or any other than "dynamic") would build a transformers cache
    that this model cannot fill (per-row keys / values without padding and GDN states): refused rather than ignored.
    "dynamic" is what this model's own cache is (it grows with the sequence)."""
    generation_config = kwargs.get("generation_config") or default_generation_config
    requested = kwargs.get("cache_implementation", getattr(generation_config, "cache_implementation", None))
    if requested not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={requested!r} is not supported: the packed Qwen3.5 model keeps its own cache "
            "(Qwen3_5PackedCache: per-row keys / values without padding and the GDN states, grown as it decodes); "
            "leave cache_implementation unset (or 'dynamic')"
        )


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

    def lm_head_outputs(self, run: DecoderRun, arguments: dict):
        """lm_head, loss and MoE aux loss on the packed stream -> (loss, aux_loss, logits in the caller's layout).
        Shared with the vision-language classes: the text settings come from `config.get_text_config()`."""
        text_config = self.config.get_text_config()
        hidden, batch, logits_to_keep = run.hidden, run.batch, arguments["logits_to_keep"]
        packed = batch.packed
        full_logits = isinstance(logits_to_keep, int) and logits_to_keep == 0
        loss = None
        if batch.targets is not None:
            if not full_logits:
                raise ValueError("labels need the full logits: leave logits_to_keep at 0 when computing the loss")
            keep_logits = keeps_logits_with_loss(text_config.return_logits_with_loss, self.training)
            loss, logits = self.packed_loss(hidden, batch, arguments.get("num_items_in_batch"), keep_logits)
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

    def packed_loss(self, hidden: torch.Tensor, batch: PackedBatch, num_items_in_batch=None, keep_logits: bool = True):
        """Token-weighted fp32 cross-entropy of `batch.targets` on the packed stream; returns (loss, logits in the
        caller's layout [batch, seq, V], or None when `keep_logits` is False).

        With an unwrapped linear head the loss runs chunked (chunked_linear_cross_entropy): fp32 [N, V] logits never
        exist in full, the per-chunk cross-entropy runs compiled when the elementwise chains are fused, and the returned
        logits are detached (they carry no gradient; the loss does) and written straight into the caller's layout.
        A wrapped head (e.g. an adapter) keeps the plain path, so its forward is never bypassed.
        """
        packed, targets = batch.packed, batch.targets
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
                choice=batch.kernels,
            )
            return loss, (logits.view(rows, seq_len, -1) if logits is not None else None)
        logits = self.lm_head(hidden)
        total = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        denominator = (
            num_items_in_batch if num_items_in_batch is not None else ((targets != IGNORE_INDEX).sum().clamp(min=1))
        )
        return total / denominator, (packed.unpack(logits) if keep_logits else None)

    def generate(self, *args, **kwargs):
        """GenerationMixin.generate, refusing packed rows (generation continues one document per row) and caches
        other than this model's own."""
        refuse_packed_generation(args, kwargs)
        refuse_other_caches(self.generation_config, kwargs)
        return GenerationMixin.generate(self, *args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids,
        past_key_values=None,
        attention_mask=None,
        inputs_embeds=None,
        cache=None,
        use_cache=True,
        **kwargs,
    ):
        cache = as_packed_cache(cache if cache is not None else past_key_values)
        inputs = {"attention_mask": attention_mask, "use_cache": use_cache}
        if cache is not None and cache.has_state:
            count = new_columns(input_ids, attention_mask, inputs_embeds, cache)
            if count <= input_ids.shape[1]:
                inputs["input_ids"] = input_ids[:, -count:]
            else:  # continuing a cache from inputs_embeds that extend the cached prompt
                inputs["inputs_embeds"] = inputs_embeds[:, -count:]
            inputs[CACHE_FIELD] = cache
        elif inputs_embeds is not None:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids
        # Everything else goes on to forward as given (generate's and the caller's model kwargs), as the built-in's
        # does: forward refuses what it cannot honour. Position ids come from the cache and the attention mask;
        # generate()'s own bookkeeping is not forward's input.
        for name in ("position_ids", "cache_position", "next_sequence_length", "is_first_iteration"):
            kwargs.pop(name, None)
        inputs.update(kwargs)
        if CACHE_FIELD not in inputs and attention_mask is not None and attention_mask.ndim == 2:
            if not bool(attention_mask[:, -1].bool().all()):  # a prefill with prompts ending in padding
                per_column = {name: inputs[name] for name in PER_COLUMN_INPUTS if inputs.get(name) is not None}
                inputs.update(padding_moved_left(per_column, attention_mask))
        return inputs

    def _reorder_cache(self, cache, beam_idx):
        cache.reorder_cache(beam_idx)
        return cache
