"""The front door of every forward: the public arguments, in any form of the packing contract, resolved once into a
`PackedBatch` that every layer reads.

The public forward signatures are declared here once (`public_forward`), parameter by parameter as transformers'
built-in classes declare them, because transformers, TRL, PEFT and Accelerate read them by inspection (the
Trainer's dataset columns, `logits_to_keep` support, generate()'s argument check). A forward body receives the
bound arguments as one mapping and hands it to `open_packed_batch`, which holds the packing, the cache rules and
their errors, the loss targets, the checks of the inputs' values (token ids and targets in the vocabulary,
`check_token_ranges`; `inputs_embeds` in the embedding's dtype, `check_inputs_embeds`; the attention mask's values
are checked where the packing reads it) and the kernel choice: no internal function takes the packing keywords one
by one.
It also refuses to run under torch's context parallelism (a shard of the sequence: `refuse_context_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys

import torch

from . import context_parallel
from .cache import Qwen3_5PackedCache, as_packed_cache
from .context_parallel import ShardLayout
from .kernel_selection import KernelChoice
from .loss import IGNORE_INDEX
from .packing import PackedSequence, build_packed_sequence, input_shape, loss_targets, padding_mask_values
from .projection import adopt_adapter_products
from .utils import log_once

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

# The first five are positional in the built-in classes, with the cache fourth ("cache" in transformers >= 5.2x,
# "past_key_values" before; both are accepted by name).
_INPUTS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds")
# The vision-language inputs (generate() passes them to the prefill only).
VISION_ARGUMENTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids")
_OUTPUTS = ("output_hidden_states", "output_router_logits")
_TEXT_TAIL = (*PACKING_ARGUMENTS, "cache", "return_dict", "routed_experts")
_VL_TAIL = (*PACKING_ARGUMENTS, "use_cache", "return_dict", "cache", "routed_experts")

# The public parameter lists, in the built-in classes' order where they share names.
TEXT_MODEL_PARAMETERS = (*_INPUTS, "use_cache", *_OUTPUTS, *_TEXT_TAIL)
CAUSAL_LM_PARAMETERS = (*_INPUTS, "labels", "use_cache", *_OUTPUTS, "logits_to_keep", *_TEXT_TAIL)
SEQUENCE_CLASSIFICATION_PARAMETERS = (*_INPUTS, "labels", "use_cache", *_OUTPUTS, *_TEXT_TAIL)
VL_MODEL_PARAMETERS = (*_INPUTS, *VISION_ARGUMENTS, *_OUTPUTS, *_VL_TAIL)
VL_CAUSAL_LM_PARAMETERS = (*_INPUTS, "labels", *VISION_ARGUMENTS, *_OUTPUTS, "logits_to_keep", *_VL_TAIL)

_DEFAULTS = {"logits_to_keep": 0}
# **kwargs annotated as the built-in's (`Unpack[TransformersKwargs]`): tools read which keyword arguments a forward
# takes through it (output_attentions, the loss and packing kwargs); absent from older transformers.
try:
    from transformers.processing_utils import Unpack
    from transformers.utils import TransformersKwargs

    _KWARGS_ANNOTATION = Unpack[TransformersKwargs]
except ImportError:
    _KWARGS_ANNOTATION = inspect.Parameter.empty
_ANNOTATIONS = {"logits_to_keep": "int | torch.Tensor"}


def public_forward(parameters: tuple[str, ...]):
    """Give `forward(self, arguments)` the public signature `parameters` (then **kwargs): positional and keyword
    calls bind as they would to the written-out signature, extra keyword arguments are checked
    (`check_extra_arguments`), and the body receives every parameter (defaults filled) and the extras in one
    dict."""
    signature = inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *(
                inspect.Parameter(
                    name,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=_DEFAULTS.get(name),
                    annotation=_ANNOTATIONS.get(name, inspect.Parameter.empty),
                )
                for name in parameters
            ),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=_KWARGS_ANNOTATION),
        ]
    )

    def decorate(body):
        @functools.wraps(body)
        def forward(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            del arguments["self"]
            extra = arguments.pop("kwargs")
            check_extra_arguments(extra)
            arguments.update(extra)
            # resolved here, with the forward's own config (wants_attentions)
            arguments["output_attentions"] = wants_attentions(self.config, extra.get("output_attentions"))
            adopt_adapter_products(self)  # PEFT's LoRA products made row-invariant like the projections they wrap
            return body(self, arguments)

        forward.__signature__ = signature
        return forward

    return decorate


def check_extra_arguments(extra: dict) -> None:
    """Refuse keyword arguments beyond a forward's parameters that it does not know."""
    unknown = sorted(set(extra) - IGNORED_ARGUMENTS - LOSS_ARGUMENTS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments for a packed Qwen3.5 forward: {unknown}")


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One forward's inputs as the layers read them: the packed stream of real tokens, the cache it reads and
    advances, the kernels bound for its device and dtype, rope positions, loss targets and the output switches."""

    packed: PackedSequence
    cache: Qwen3_5PackedCache | None
    continues_cache: bool  # a generation step after the prefill (the cache held state on entry)
    columns: int  # the caller's sequence length: a cache advances by it
    rope_positions: torch.Tensor  # long [N], or [3, N] for multimodal rope
    targets: torch.Tensor | None  # long [N] next-token targets on the stream; None without labels
    routed_experts: torch.Tensor | None  # experts to replay, in the caller's layout (routing_replay.py)
    output_hidden_states: bool
    output_router_logits: bool
    # Bound where the layers run, for the embedded stream's device and dtype: the kernels (kernel_selection
    # .bound_kernels) and (cos, sin) at rope_positions.
    kernels: KernelChoice | None = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # output_attentions: the full-attention layers append their probabilities (attention_probabilities.py)
    attentions: list | None = None
    # Under context parallelism (context_parallel.py): where this rank's shard sits in the row.
    shard: ShardLayout | None = None


def _switch(config, name: str, requested, default: bool = False) -> bool:
    return bool(getattr(config, name, default) if requested is None else requested)


def wants_attentions(config, requested) -> bool:
    """output_attentions by argument, else by config; a vision-language config's switch is on the composite or on
    its text_config (the built-in's text model reads its own config, so setting text_config's is enough there)."""
    if requested is not None:
        return bool(requested)
    text_config = getattr(config, "text_config", None)
    return bool(getattr(config, "output_attentions", False) or getattr(text_config, "output_attentions", False))


def returns_dict(config, arguments: dict) -> bool:
    """return_dict=False (or the config's return_dict) gives a plain tuple of the output's set fields."""
    return _switch(config, "return_dict", arguments.get("return_dict"), default=True)


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
    forward."""
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


def open_packed_batch(
    config, arguments: dict, *, training: bool, context_parallel_group=None, embedding_dtype: torch.dtype | None = None
) -> PackedBatch:
    """Resolve a forward's `arguments` (the dict `public_forward` gives) into its PackedBatch.

    `config` is the text configuration; `embedding_dtype` the dtype of the model's input embeddings, which
    `inputs_embeds` must have (`check_inputs_embeds`).
    A filled cache continues every row by its new tokens (one document per row, no packing arguments, only real
    new tokens); otherwise the boundaries come from the packing contract and a cache is made when `use_cache` asks
    for one: None means the config's `use_cache` in eval mode for one document per row. With a
    `context_parallel_group` (the model's `set_context_parallel`) the inputs are this rank's shard of one packed
    row (context_parallel.open_shard). Under torch's context parallelism (Accelerate's cp_size > 1) it raises: the
    inputs are a shard of the sequence the model was not told about."""
    refuse_context_parallel()
    check_inputs_embeds(arguments.get("inputs_embeds"), embedding_dtype)
    if context_parallel_group is not None:
        return _open_shard_batch(config, arguments, context_parallel_group)
    input_ids, inputs_embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    shape = input_shape(input_ids, inputs_embeds)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    attention_mask, position_ids = arguments.get("attention_mask"), arguments.get("position_ids")
    cache = arguments.get("cache")
    cache = as_packed_cache(cache if cache is not None else arguments.get("past_key_values"))
    use_cache = arguments.get("use_cache")
    continues_cache = cache is not None and cache.has_state
    if continues_cache:
        if any(arguments.get(name) is not None for name in BOUNDARY_ARGUMENTS):
            raise ValueError(
                "packing kwargs (cu_seqlens / cu_seq_lens_q/k / seq_idx) cannot be used with a filled cache"
            )
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
    else:
        packed = build_packed_sequence(
            shape, device, attention_mask, position_ids, *(arguments.get(name) for name in PACKING_ARGUMENTS)
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
        cache = (
            (cache if cache is not None else Qwen3_5PackedCache(config.layer_types, shape[0])) if use_cache else None
        )

    labels, shift_labels = arguments.get("labels"), arguments.get("shift_labels")
    targets = loss_targets(packed, labels, shift_labels) if labels is not None or shift_labels is not None else None
    _check_token_ranges(config, input_ids, packed, targets, shift_labels)
    return PackedBatch(
        packed=packed,
        cache=cache,
        continues_cache=continues_cache,
        columns=shape[1],
        rope_positions=packed.position_ids,
        targets=targets,
        routed_experts=arguments.get("routed_experts"),
        output_hidden_states=_switch(config, "output_hidden_states", arguments.get("output_hidden_states")),
        output_router_logits=wants_router_logits(config, arguments.get("output_router_logits")),
        attentions=[] if arguments.get("output_attentions") else None,  # resolved by public_forward
    )


def _check_token_ranges(config, input_ids, packed: PackedSequence, targets, shift_labels) -> None:
    """check_token_ranges on a forward's real input tokens and its targets (named by the argument they came from)."""
    ids = packed.pack(input_ids) if input_ids is not None else None
    check_token_ranges(config.vocab_size, ids, targets, "labels" if shift_labels is None else "shift_labels")


def _open_shard_batch(config, arguments: dict, group) -> PackedBatch:
    """open_packed_batch for a rank's shard of a row under context parallelism (context_parallel.py)."""
    cache = arguments.get("cache") if arguments.get("cache") is not None else arguments.get("past_key_values")
    if cache is not None or arguments.get("use_cache"):
        raise ValueError("context parallelism runs training and scoring forwards: no cache (use_cache=False)")
    if arguments.get("output_attentions"):
        raise ValueError("output_attentions is not available under context parallelism")
    output_router_logits = wants_router_logits(config, arguments.get("output_router_logits"))
    if output_router_logits and getattr(config, "router_aux_loss_coef", 0):
        raise ValueError(
            "router logits with router_aux_loss_coef > 0 under context parallelism: the MoE load-balancing loss "
            "averages router statistics over the whole row, which a shard does not hold, and trainers (TRL) would "
            "add it computed on the shard. Set router_aux_loss_coef=0 (or do not request router logits: "
            "output_router_logits=False, also in the config)"
        )
    input_ids, inputs_embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    shape = input_shape(input_ids, inputs_embeds)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    packed, rope_positions, layout = context_parallel.open_shard(group, arguments, device)
    labels, shift_labels = arguments.get("labels"), arguments.get("shift_labels")
    targets = None
    if shift_labels is not None:  # already shifted over the row: used as given
        targets = loss_targets(packed, None, shift_labels)
    elif labels is not None:
        targets = context_parallel.shard_targets(loss_targets(packed, labels), layout)
    _check_token_ranges(config, input_ids, packed, targets, shift_labels)
    return PackedBatch(
        packed=packed,
        cache=None,
        continues_cache=False,
        columns=shape[1],
        rope_positions=rope_positions,
        targets=targets,
        routed_experts=arguments.get("routed_experts"),
        output_hidden_states=_switch(config, "output_hidden_states", arguments.get("output_hidden_states")),
        output_router_logits=output_router_logits,
        shard=layout,
    )
