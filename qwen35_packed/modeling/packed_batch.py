"""The front door of every forward: the inputs, in any form of the packing contract, resolved once into one
complete, immutable `PackedBatch` that the layers and the head read; nothing after the door reads the caller's
inputs.

A public forward (written out in the modeling files, parameter by parameter as transformers' built-in classes write
theirs) checks its extra keyword arguments (`check_extra_arguments`) and calls its model's `open_batch` with named
arguments, which calls `open_packed_batch` here. The door holds the packing, the cache rules and their errors, the
loss targets, the checks of the inputs' values (token ids and targets in the vocabulary, `check_token_ranges`;
`inputs_embeds` in the embedding's dtype, `check_inputs_embeds`; the attention mask's values are checked where the
packing reads it), the rope positions (the vision-language layout's 3D positions decided here too,
vision_layout.py) and their (cos, sin) tables, what the head needs, and the kernel set bound for the stream's device
and dtype (kernel_set.py).

Its entry forms: a stream of documents (packing.py's contract), a generation step continuing a cache, and, with the
model's context parallelism on, a rank's shard of one packed row (context_parallel.open_shard; the shard's kernel
set does the rest). It refuses to run under torch's context parallelism (a shard of the sequence the model was not
told about: `refuse_context_parallel`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import NamedTuple

import torch

from . import context_parallel
from .cache import Qwen3_5PackedCache, as_packed_cache, carry_past_recording
from .context_parallel import ShardLayout
from .kernel_set import KernelSet
from .loss import IGNORE_INDEX
from .packing import PackedSequence, build_packed_sequence, input_shape, loss_targets, padding_mask_values
from .utils import log_once
from .vision_layout import VisionInputs, VisionLayout, lay_out_vision

logger = logging.getLogger(__name__)

# The keyword arguments of the packing contract (packing.py), in the order the public signatures list them.
PACKING_ARGUMENTS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Those that place document boundaries inside a row (generate() refuses them: it continues one document per row).
BOUNDARY_ARGUMENTS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")
# Keyword arguments trainers and generate() pass that carry nothing for this model, and output_attentions (taken
# through **kwargs as the built-in takes it; attention_probabilities.py).
IGNORED_ARGUMENTS = frozenset({"cache_position", "output_attentions"})
# transformers' loss keyword arguments, taken through **kwargs as the built-in takes them: a parameter whose name
# contains "label" would join the Trainer's `label_names` (from the signature), and its evaluation would then find
# no labels in batches without that key (no eval_loss, no compute_metrics).
LOSS_ARGUMENTS = frozenset({"num_items_in_batch", "shift_labels"})
# The vision-language inputs (generate() passes them to the prefill only).
VISION_ARGUMENTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids")


def check_extra_arguments(extra: dict) -> None:
    """Refuse keyword arguments beyond a forward's parameters that it does not know."""
    unknown = sorted(set(extra) - IGNORED_ARGUMENTS - LOSS_ARGUMENTS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments for a packed Qwen3.5 forward: {unknown}")


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One forward's inputs as the layers and the head read them: the packed stream of real tokens, its token ids or
    embeddings, the cache it reads and advances, rope positions and tables, the kernels bound for its device and
    dtype, loss targets and the head's settings, and the output switches."""

    packed: PackedSequence
    kernels: KernelSet
    rope_positions: torch.Tensor  # long [N], or [3, N] for multimodal rope
    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin) at rope_positions, in the stream's dtype
    token_ids: torch.Tensor | None  # long [N]: the stream's input_ids (None when the caller gave inputs_embeds)
    inputs_embeds: torch.Tensor | None  # [N, H]: the caller's inputs_embeds packed
    cache: Qwen3_5PackedCache | None
    continues_cache: bool  # a generation step after the prefill (the cache held state on entry)
    one_token_per_row: bool  # a generation step with one new token in every row: the decode kernels run
    columns: int  # the caller's sequence length: a cache advances by it
    targets: torch.Tensor | None  # long [N] next-token targets on the stream; None without labels
    num_items_in_batch: torch.Tensor | int | None  # the loss denominator the Trainer gives
    logits_to_keep: int | torch.Tensor
    routed_experts: torch.Tensor | None  # experts to replay, in the caller's layout (routing_replay.py)
    output_hidden_states: bool
    output_router_logits: bool
    output_attentions: bool  # the full-attention layers return their probabilities (attention_probabilities.py)
    vision: VisionLayout | None = None  # the vision-language models' images and videos, and where they go
    shard: ShardLayout | None = None  # under context parallelism: where this rank's shard sits in the row


def _switch(config, name: str, requested, default: bool = False) -> bool:
    return bool(getattr(config, name, default) if requested is None else requested)


def wants_hidden_states(config, requested) -> bool:
    """output_hidden_states by argument, else by config."""
    return _switch(config, "output_hidden_states", requested)


def wants_attentions(config, requested) -> bool:
    """output_attentions by argument, else by config; a vision-language config's switch is on the composite or on
    its text_config (the built-in's text model reads its own config, so setting text_config's is enough there)."""
    if requested is not None:
        return bool(requested)
    text_config = getattr(config, "text_config", None)
    return bool(getattr(config, "output_attentions", False) or getattr(text_config, "output_attentions", False))


def returns_dict(config, return_dict) -> bool:
    """return_dict=False (or the config's return_dict) gives a plain tuple of the output's set fields."""
    return _switch(config, "return_dict", return_dict, default=True)


def wants_router_logits(config, requested) -> bool:
    """Router logits are returned (and the aux loss computed) for MoE models when asked, by argument or config."""
    return bool(getattr(config, "is_moe", False)) and _switch(config, "output_router_logits", requested)


# torch's context parallelism, which Accelerate's `ParallelismConfig(cp_size > 1)` and the transformers Trainer use
# (`Accelerator.maybe_context_parallel` enters `torch.distributed.tensor.experimental.context_parallel` around each
# step); older torch kept it in `..._attention`, now a stub that re-exports it.
_CONTEXT_PARALLEL_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._attention",
)

CONTEXT_PARALLEL_ERROR = (
    "torch's context parallelism is active (torch.distributed.tensor.experimental.context_parallel, which "
    "Accelerate's ParallelismConfig(cp_size > 1) and the transformers Trainer enter around every step): this rank "
    "holds only a shard of each row's sequence, which torch's context parallelism shards for attention only. The "
    "packed Qwen3.5 model's Gated DeltaNet layers carry a recurrent state and a causal convolution along the "
    "sequence, which would restart from zero at every shard boundary, and packed document boundaries would be cut, "
    "so training would run silently wrong. Use the model's own context parallelism instead: leave Accelerate's "
    "cp_size=1 (no context_parallel(...) block), call model.set_context_parallel(group) and give each rank its "
    "shard of the packed row (qwen35_packed.modeling.context_parallel; docs/training.md, 'Context parallelism')."
)


def context_parallel_active() -> bool:
    """Whether torch's context parallelism is on in this process, by the state it sets while it is: inside a
    `context_parallel(...)` block (the path Accelerate and the Trainer take) `F.scaled_dot_product_attention` is a
    ring-attention wrapper that torch records in `_replaced_functions`; with the module-wrapper API
    (`_enable_context_parallel_dispatcher`) DTensor's op dispatcher routes SDPA to the CP handler. A few attribute
    reads and a dict lookup, no device work or host sync."""
    for name in _CONTEXT_PARALLEL_MODULES:
        cp = sys.modules.get(name)
        if cp is None or not hasattr(cp, "_replaced_functions"):
            continue  # not imported (no context parallelism), or the compatibility stub that re-exports it
        if torch.nn.functional.scaled_dot_product_attention in cp._replaced_functions:
            return True
        handlers = getattr(getattr(getattr(cp, "DTensor", None), "_op_dispatcher", None), "_custom_op_handlers", None)
        if handlers is None or handlers is getattr(cp, "existing_custom_ops", None):
            return False
        return any(handlers.get(op) is handler for op, handler in getattr(cp, "custom_ops", {}).items())
    return False


def refuse_context_parallel() -> None:
    """Raise instead of running on a sequence shard (`CONTEXT_PARALLEL_ERROR`)."""
    if context_parallel_active():
        raise NotImplementedError(CONTEXT_PARALLEL_ERROR)


def check_token_ranges(vocab_size: int, ids: torch.Tensor | None, targets: torch.Tensor | None, labels_name: str):
    """Refuse token ids outside the vocabulary [0, vocab_size) in `ids` (the packed input_ids: real tokens only) and
    in the loss `targets` (taken from the caller's `labels_name`), where IGNORE_INDEX also counts as valid: the
    embedding would fail with an index error (a device-side assert on CUDA), the loss with one that does not mention
    labels. One reduction per tensor, read on the host together: the one host synchronisation these checks add to a
    forward. Skipped inside a CUDA graph capture, which cannot read the device: the captured decode step's runner
    checks the token ids it copies in (decode_graph.py)."""
    if ids is not None and ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    found = []
    if ids is not None and ids.numel():
        found += list(torch.aminmax(ids))
    if targets is not None:
        found.append(((targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))).any())
    if not found:
        return
    device = found[0].device
    values = torch.stack([value.to(device, torch.long) for value in found]).tolist()
    vocabulary = f"the vocabulary of {vocab_size} tokens (ids 0 to {vocab_size - 1})"
    if ids is not None and ids.numel() and (values[0] < 0 or values[1] >= vocab_size):
        bad = values[0] if values[0] < 0 else values[1]
        raise ValueError(f"input_ids hold token id {bad}, outside {vocabulary}")
    if targets is not None and values[-1]:
        bad = targets[(targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))][0].item()
        raise ValueError(
            f"{labels_name} hold {bad} as a target, outside {vocabulary}; {IGNORE_INDEX} marks a token without target"
        )


def check_inputs_embeds(inputs_embeds: torch.Tensor | None, embedding_dtype: torch.dtype | None) -> None:
    """`inputs_embeds` must have the embedding's dtype: the layers would run in the embeddings' dtype, not the
    model's (transformers' built-in raises a dtype mismatch in its first matmul). Under torch.autocast for their
    device the dtypes may differ, as with the built-in, which autocast makes run."""
    if inputs_embeds is None or embedding_dtype is None or inputs_embeds.dtype == embedding_dtype:
        return
    if torch.is_autocast_enabled(inputs_embeds.device.type):
        return
    raise ValueError(
        f"inputs_embeds are {inputs_embeds.dtype} but the model's embeddings are {embedding_dtype}: cast them "
        f"(inputs_embeds.to({embedding_dtype})) or run under torch.autocast"
    )


class _Stream(NamedTuple):
    """The packing part of a batch, from one entry form."""

    packed: PackedSequence
    cache: Qwen3_5PackedCache | None
    continues_cache: bool
    positions: torch.Tensor
    targets: torch.Tensor | None
    shard: ShardLayout | None = None


def open_packed_batch(
    model,
    *,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    output_hidden_states: bool | None = None,
    output_router_logits: bool | None = None,
    output_attentions: bool = False,
    logits_to_keep: int | torch.Tensor = 0,
    num_items_in_batch=None,
    cu_seqlens=None,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
    max_length_q=None,
    max_length_k=None,
    seq_idx=None,
    routed_experts: torch.Tensor | None = None,
    vision: VisionInputs | None = None,
) -> PackedBatch:
    """The PackedBatch of a forward of the text backbone `model` (its config, mode, embedding, rope and kernel
    sets; `Qwen3_5PackedTextModel.open_batch`) on the caller's inputs, named as in the public forwards.

    A filled cache continues every row by its new tokens (one document per row, no packing arguments, only real
    new tokens); otherwise the boundaries come from the packing contract and a cache is made when `use_cache` asks
    for one: None means the config's `use_cache` in eval mode for one document per row. With the model's context
    parallelism on, the inputs are this rank's shard of one packed row (context_parallel.open_shard). Under torch's
    context parallelism (Accelerate's cp_size > 1) it raises: the inputs are a shard of the sequence the model was
    not told about. `vision`: the vision-language inputs, laid out here (vision_layout.py)."""
    config = model.config
    refuse_context_parallel()
    embedding_dtype = model.embed_tokens.weight.dtype
    check_inputs_embeds(inputs_embeds, embedding_dtype)
    shape = input_shape(input_ids, inputs_embeds)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    given_cache, cache = cache, as_packed_cache(cache)
    boundaries = {
        "cu_seqlens": cu_seqlens,
        "cu_seq_lens_q": cu_seq_lens_q,
        "cu_seq_lens_k": cu_seq_lens_k,
        "max_length_q": max_length_q,
        "max_length_k": max_length_k,
        "seq_idx": seq_idx,
    }
    output_router_logits = wants_router_logits(config, output_router_logits)
    if model.context_parallel_group is not None:
        _refuse_on_a_shard(config, cache, use_cache, output_attentions, output_router_logits)
        stream = _shard_stream(
            model.context_parallel_group, device, shape, input_ids, inputs_embeds, attention_mask, position_ids,
            labels, shift_labels, boundaries,
        )  # fmt: skip
    elif cache is not None and cache.has_state:
        stream = _continued_stream(cache, device, shape, attention_mask, position_ids, boundaries)
    else:
        stream = _new_stream(
            config, model.training, cache, use_cache, device, shape, attention_mask, position_ids, boundaries
        )
        carry_past_recording(given_cache, stream.cache)  # an empty transformers cache replaced here
    packed = stream.packed
    targets = stream.targets
    if stream.shard is None and (labels is not None or shift_labels is not None):
        targets = loss_targets(packed, labels, shift_labels)
    token_ids = packed.pack(input_ids) if input_ids is not None else None
    check_token_ranges(config.vocab_size, token_ids, targets, "labels" if shift_labels is None else "shift_labels")
    packed_embeds = packed.pack(inputs_embeds) if inputs_embeds is not None else None

    positions, vision_layout = stream.positions, None
    if vision is not None:
        positions, vision_layout = lay_out_vision(
            vision,
            packed,
            token_ids,
            packed_embeds,
            model.embed_tokens,
            stream.shard,
            positions,
            continues_cache=stream.continues_cache,
            given_3d_positions=position_ids is not None and torch.as_tensor(position_ids).ndim == 3,
        )
    dtype = inputs_embeds.dtype if inputs_embeds is not None else embedding_dtype
    return PackedBatch(
        packed=packed,
        kernels=model.kernels_for(device, dtype, stream.shard),
        rope_positions=positions,
        rope=model.rotary_emb.cos_sin(positions, dtype),
        token_ids=token_ids,
        inputs_embeds=packed_embeds,
        cache=stream.cache,
        continues_cache=stream.continues_cache,
        one_token_per_row=stream.continues_cache and packed.num_tokens == packed.num_docs,
        columns=shape[1],
        targets=targets,
        num_items_in_batch=num_items_in_batch,
        logits_to_keep=logits_to_keep,
        routed_experts=routed_experts,
        output_hidden_states=wants_hidden_states(config, output_hidden_states),
        output_router_logits=output_router_logits,
        output_attentions=bool(output_attentions),
        vision=vision_layout,
        shard=stream.shard,
    )


def _continued_stream(cache, device, shape, attention_mask, position_ids, boundaries) -> _Stream:
    """A generation step: every row continues its cached document by its new tokens."""
    if any(boundaries[name] is not None for name in BOUNDARY_ARGUMENTS):
        raise ValueError("packing kwargs (cu_seqlens / cu_seq_lens_q/k / seq_idx) cannot be used with a filled cache")
    new_real = None
    if attention_mask is not None:
        if attention_mask.ndim != 2 or attention_mask.shape[1] < shape[1]:
            raise ValueError(
                "with a cache, attention_mask must be a 2D [batch, columns] padding mask covering the new tokens, "
                f"got shape {tuple(attention_mask.shape)} for {shape[1]} new tokens"
            )
        new_real = padding_mask_values(attention_mask[:, -shape[1] :])
        new_real = None if bool(new_real.all()) else new_real.to(device)
    packed = cache.decode_sequence(shape[0], shape[1], device, new_real)
    if position_ids is not None and torch.as_tensor(position_ids).dim() == 2:
        if not torch.equal(packed.pack(position_ids).to(packed.position_ids), packed.position_ids):
            raise ValueError("position_ids contradict the cache: generation positions continue per row")
    return _Stream(packed, cache, True, packed.position_ids, None)


def _new_stream(config, training, cache, use_cache, device, shape, attention_mask, position_ids, boundaries):
    """A stream of documents (the packing contract), with a new cache where one is asked for."""
    packed = build_packed_sequence(
        shape, device, attention_mask, position_ids, *(boundaries[name] for name in PACKING_ARGUMENTS)
    )
    if packed.spans is not None and position_ids is None:
        log_once(
            logger,
            "holes-positions",
            "attention_mask with holes: the positions count each row's real tokens, as generate() gives them "
            "(transformers' built-in text classes count columns, holes included, in a forward without "
            "position_ids); pass position_ids to set them",
        )
    # A cache holds one document per row: of the cache given, else of the batch.
    one_doc_per_row = packed.num_docs == (cache.batch_size if cache is not None else shape[0])
    if use_cache is None:
        use_cache = bool(config.use_cache) and not training and one_doc_per_row
    if use_cache and not one_doc_per_row:
        raise ValueError("use_cache=True needs one document per row; packed documents cannot be continued")
    if not use_cache:
        cache = None
    elif cache is None:
        cache = Qwen3_5PackedCache(config.layer_types, shape[0])
    return _Stream(packed, cache, False, packed.position_ids, None)


def _refuse_on_a_shard(config, cache, use_cache, output_attentions, output_router_logits) -> None:
    """What a rank's shard under context parallelism cannot do."""
    if cache is not None or use_cache:
        raise ValueError("context parallelism runs training and scoring forwards: no cache (use_cache=False)")
    if output_attentions:
        raise ValueError("output_attentions is not available under context parallelism")
    if output_router_logits and getattr(config, "router_aux_loss_coef", 0):
        raise ValueError(
            "router logits with router_aux_loss_coef > 0 under context parallelism: the MoE load-balancing loss "
            "averages router statistics over the whole row, which a shard does not hold, and trainers (TRL) would "
            "add it computed on the shard. Set router_aux_loss_coef=0 (or do not request router logits: "
            "output_router_logits=False, also in the config)"
        )


def _shard_stream(group, device, shape, input_ids, inputs_embeds, attention_mask, position_ids, labels,
                  shift_labels, boundaries) -> _Stream:  # fmt: skip
    """A rank's shard of one packed row under the model's context parallelism (context_parallel.py)."""
    shard_inputs = {
        "input_ids": input_ids,
        "inputs_embeds": inputs_embeds,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "labels": labels,
        **boundaries,
    }
    packed, positions, layout = context_parallel.open_shard(group, shard_inputs, device)
    targets = None
    if shift_labels is not None:  # already shifted over the row: used as given
        targets = loss_targets(packed, None, shift_labels)
    elif labels is not None:
        targets = context_parallel.shard_targets(loss_targets(packed, labels), layout)
    return _Stream(packed, None, False, positions, targets, layout)
