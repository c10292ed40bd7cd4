"""generate() for the packed causal-LM classes (text and vision-language), with this model's own cache: one
document per row, continued by its new tokens (cache.py), dynamic or, with `cache_implementation="static"`, static
(its decode steps replayed as CUDA graphs on the GPU: decode_graph.py). Packed rows and transformers' other caches
are refused, prompts ending in padding are continued from their last real token, and the cached steps take only
the columns the cache has not consumed."""

from __future__ import annotations

import copy
import logging

import torch
from transformers import GenerationMixin

from .cache import Qwen3_5PackedCache, as_packed_cache, carry_past_recording
from .outputs import CACHE_FIELD
from .packed_batch import BOUNDARY_ARGUMENTS
from .packing import build_packed_sequence
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


# The cache implementations generate() takes: this model's own cache, grown as it decodes ("dynamic", the default)
# or allocated once and written in place ("static": its decode steps replayed as CUDA graphs, decode_graph.py).
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")


def requested_cache(default_generation_config, kwargs: dict) -> str | None:
    """The cache_implementation a generate() call asks for (argument, else its generation config); any other than
    CACHE_IMPLEMENTATIONS would build a transformers cache that this model cannot fill (per-row keys / values without
    padding and GDN states): refused rather than ignored."""
    generation_config = kwargs.get("generation_config") or default_generation_config
    requested = kwargs.get("cache_implementation", getattr(generation_config, "cache_implementation", None))
    if requested not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation={requested!r} is not supported: the packed Qwen3.5 model keeps its own cache "
            "(Qwen3_5PackedCache: per-row keys / values without padding and the GDN states); use 'dynamic' (the "
            "default, grown as it decodes) or 'static' (allocated once, decode steps replayed as CUDA graphs)"
        )
    return requested


def own_cache_arguments(kwargs: dict, **settings) -> dict:
    """generate()'s arguments with no cache_implementation for transformers (and `settings`): it makes no cache for
    this model (`_supports_default_dynamic_cache`), the prefill makes this model's own, and transformers warns that
    any cache_implementation it is given "will be ignored". Set on the caller's generation config (a copy) where there
    is one: transformers warns when one comes with such arguments."""
    kwargs = dict(kwargs)
    settings = {"cache_implementation": None, **settings}
    if kwargs.get("generation_config") is not None:
        kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
        kwargs.pop("cache_implementation", None)
        for name, value in settings.items():
            setattr(kwargs["generation_config"], name, value)
    else:
        kwargs.update(settings)
    return kwargs


def static_cache_arguments(args: tuple, kwargs: dict, default_generation_config) -> dict:
    """generate()'s arguments for a static cache of this model: no cache_implementation for transformers (its
    StaticCache is not this model's: `own_cache_arguments`), the capacity per row passed on to
    `prepare_inputs_for_generation`, which makes the cache at the prefill (it knows the row count after generate()
    expands the rows for beams or several sequences), and transformers' torch.compile of the forward off (the decode
    steps are captured as CUDA graphs instead).

    The capacity is the prompt's columns plus max_new_tokens (else generate()'s max_length): a row that outgrows it
    still grows the cache, so it is a size to allocate, not a limit."""
    kwargs = dict(kwargs)
    generation_config = kwargs.get("generation_config") or default_generation_config
    if kwargs.get("compile_config") is not None or getattr(generation_config, "compile_config", None) is not None:
        log_once(
            logger,
            "static-cache-compile",
            "generate(cache_implementation='static'): compile_config is not used; the packed model replays its "
            "decode steps as CUDA graphs instead of compiling the forward",
        )
    kwargs = own_cache_arguments(kwargs, disable_compile=True)
    prompt = args[0] if args else next((kwargs[k] for k in ("input_ids", "inputs") if kwargs.get(k) is not None), None)
    columns = prompt.shape[-1] if prompt is not None else 0
    if kwargs.get("inputs_embeds") is not None:
        columns = max(columns, kwargs["inputs_embeds"].shape[1])
    max_new_tokens = kwargs.get("max_new_tokens", generation_config.max_new_tokens)
    if max_new_tokens is not None:
        capacity = columns + max_new_tokens
    else:
        capacity = max(kwargs.get("max_length", generation_config.max_length) or 0, columns + 1)
    kwargs["static_cache_capacity"] = capacity
    return kwargs


class PackedGeneration:
    """Mixed into the causal-LM classes before PreTrainedModel and GenerationMixin: generate() and the
    generation hooks transformers calls (`prepare_inputs_for_generation`, `_reorder_cache`)."""

    def generate(self, *args, **kwargs):
        """GenerationMixin.generate, refusing packed rows (generation continues one document per row) and caches
        other than this model's own; `cache_implementation="static"` makes this model's cache static
        (`static_cache_arguments`). The cache it is done with stops recording the past (cache.py)."""
        refuse_packed_generation(args, kwargs)
        requested = requested_cache(self.generation_config, kwargs)
        if requested == "static":
            kwargs = static_cache_arguments(args, kwargs, self.generation_config)
        elif requested is not None:
            kwargs = own_cache_arguments(kwargs)
        result = GenerationMixin.generate(self, *args, **kwargs)
        # Assisted decoding left the cache recording the past; a later continuation would record every token again.
        # An assistant's cache goes on recording: its caller crops it between calls.
        generation_config = kwargs.get("generation_config") or self.generation_config
        if not getattr(generation_config, "is_assistant", False):
            returned = getattr(result, CACHE_FIELD, None) if not torch.is_tensor(result) else None
            for cache in (returned, kwargs.get(CACHE_FIELD), kwargs.get("past_key_values")):
                if isinstance(cache, Qwen3_5PackedCache):
                    cache.stop_recording_past()
        return result

    def prepare_inputs_for_generation(
        self,
        input_ids,
        past_key_values=None,
        attention_mask=None,
        inputs_embeds=None,
        cache=None,
        use_cache=True,
        static_cache_capacity=None,
        **kwargs,
    ):
        given = cache if cache is not None else past_key_values
        cache = as_packed_cache(given)
        inputs = {"attention_mask": attention_mask, "use_cache": use_cache}
        if cache is None and static_cache_capacity is not None and use_cache:  # the prefill makes the static cache
            rows = (input_ids if input_ids is not None and input_ids.numel() else inputs_embeds).shape[0]
            layer_types = self.config.get_text_config().layer_types
            cache = Qwen3_5PackedCache(layer_types, rows, capacity=static_cache_capacity)
            carry_past_recording(given, cache)  # assisted decoding asked the cache it made to record the past
        if cache is not None:  # this model's cache, filled or to be filled by the prefill
            inputs[CACHE_FIELD] = cache
        if cache is not None and cache.has_state:
            count = new_columns(input_ids, attention_mask, inputs_embeds, cache)
            if count <= input_ids.shape[1]:
                inputs["input_ids"] = input_ids[:, -count:]
            else:  # continuing a cache from inputs_embeds that extend the cached prompt
                inputs["inputs_embeds"] = inputs_embeds[:, -count:]
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
        prefill = cache is None or not cache.has_state
        if prefill and attention_mask is not None and attention_mask.ndim == 2:
            if not bool(attention_mask[:, -1].bool().all()):  # a prefill with prompts ending in padding
                per_column = {name: inputs[name] for name in PER_COLUMN_INPUTS if inputs.get(name) is not None}
                inputs.update(padding_moved_left(per_column, attention_mask))
        return inputs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size, *args):
        """transformers makes no cache for this model (`_supports_default_dynamic_cache`): the prefill makes its own.
        Except for assisted decoding (transformers 5.25 on), which wants the cache before the first forward, to have
        it record the past, and for an assistant model's own generate(), whose cache comes back to be cropped: this
        model's cache then, static with `cache_implementation="static"`, recording where the assistant's is."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size, *args)
        assisted = generation_mode == "assisted_generation" or getattr(generation_config, "is_assistant", False)
        if not assisted or model_kwargs.get(CACHE_FIELD) is not None or generation_config.use_cache is False:
            return
        layer_types = self.config.get_text_config().layer_types
        cache = Qwen3_5PackedCache(layer_types, batch_size, capacity=model_kwargs.get("static_cache_capacity"))
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording(generation_config.num_assistant_tokens)
        model_kwargs[CACHE_FIELD] = cache

    def _reorder_cache(self, cache, beam_idx):
        cache.reorder_cache(beam_idx)
        return cache
