"""The forwards' outputs in the caller's layout: the ModelOutput classes' factory, the cache field's name, and what
the decoder hands a forward's head (`DecoderRun`)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.utils import ModelOutput

from .packed_batch import PackedBatch
from .packing import PackedSequence

# The name under which the installed `generate()` passes the cache around ("cache" from transformers 5.2x on).
CACHE_FIELD = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


def output_class(name: str, doc: str, field_names: list[str], module: str):
    """A ModelOutput dataclass whose cache field carries the name the installed transformers uses (newer
    releases alias `past_key_values` to `cache` and warn on the old name). Its tuple form turns a nested output
    (the vision-language forwards' `image_outputs` / `video_outputs`) into a tuple too, as transformers'
    multimodal outputs do."""

    def to_tuple(self) -> tuple:
        return tuple(
            value.to_tuple() if isinstance(value, ModelOutput) else value for value in (self[k] for k in self.keys())
        )

    cls = dataclasses.make_dataclass(
        name,
        [(f, Any, dataclasses.field(default=None)) for f in field_names],
        bases=(ModelOutput,),
        namespace={"to_tuple": to_tuple},
    )
    cls.__doc__, cls.__module__ = doc, module  # the modeling file that names it, for pickling
    return cls


def router_logits_in_caller_layout(router_logits, packed: PackedSequence):
    """Per-layer router logits as [batch * seq, num_experts] with zeros at pad positions, the layout of the
    built-in model: transformers' `load_balancing_loss_func(router_logits, ..., attention_mask)` (which TRL's GRPO
    calls) then weighs exactly the real tokens. Inside the model they stay packed (real tokens only)."""
    if not router_logits:
        return None
    return tuple(packed.unpack(layer).flatten(0, 1) for layer in router_logits)


@dataclasses.dataclass
class DecoderRun:
    """What the decoder gives a forward's head: the final hidden states of the packed stream, the batch they were
    computed for (its cache advanced) and what the layers returned."""

    hidden: torch.Tensor  # [N, H] after the final norm
    batch: PackedBatch
    all_hidden: list | None  # [B, S, H] per layer input, then the final one, when requested (in the graph)
    router_logits: list | None  # [N, E] per MoE layer, when requested
    attentions: list | None  # the attention probabilities per full-attention layer, when requested
    # The vision tower's outputs by modality ("image", "video") for the images / videos this forward encoded.
    encoder_outputs: dict = dataclasses.field(default_factory=dict)

    def caller_outputs(self) -> dict:
        """The output fields every forward returns in the caller's layout: hidden states, attention probabilities
        (one per full-attention layer, as the built-in records them), router logits, cache."""
        packed, attentions = self.batch.packed, self.attentions
        return {
            "hidden_states": tuple(self.all_hidden) if self.all_hidden is not None else None,
            "attentions": tuple(attentions) if attentions is not None else None,
            "router_logits": router_logits_in_caller_layout(self.router_logits, packed),
            CACHE_FIELD: self.batch.cache,
        }
