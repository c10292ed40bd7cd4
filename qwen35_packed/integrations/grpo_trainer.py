"""`PackedGRPOTrainer`, TRL's GRPOTrainer for packed Qwen3.5 models (what it changes and why: the doc of
integrations/grpo.py). This module imports TRL; `qwen35_packed.integrations.grpo` imports it only when the trainer is
asked for, so that the package imports without TRL.

MoE routing replay goes through GRPOTrainer's own steps:
- `_generate_single_turn` takes the routed experts of the completions vLLM just generated from the engine;
- `_generate_and_score_completions` returns them in the batch (`routed_experts`, GRPO's padded layout), which TRL
  shuffles and splits with the batch's other row tensors;
- `compute_loss` hands the training step's rows their routing from that batch;
- `_get_per_token_logps_and_entropies` calls the model through `RoutedModel`, which passes each forward the routing
  of its rows as the `routed_experts=` keyword. TRL scores a freshly generated batch (old and reference log-probs)
  inside `_generate_and_score_completions`, before that batch exists: there the routing is the one kept from the
  generation.

Where TRL 1.16 has no method to override, the trainer replaces attributes of TRL objects: integrations/trl_patches.py
holds those patches, each with the TRL version it targets.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer

from . import trl_patches
from .grpo_support import (
    RoutedModel,
    RoutingFeed,
    activation_offload_context,
    check_aux_loss_coef,
    check_routing_replay,
    default_generation_cache,
    prompt_token_types,
)

logger = logging.getLogger(__name__)

# The base classes of this project's text and vision-language models (built-in classes have neither).
_PACKED_BASES = ("Qwen3_5PackedPreTrainedModel", "Qwen3_5PackedVLPreTrainedModel")


def _check_packed_model(model) -> None:
    base = model.get_base_model() if is_peft_model(model) else model
    names = {cls.__name__ for cls in type(base).__mro__}
    if not names.intersection(_PACKED_BASES):
        raise ValueError(
            f"PackedGRPOTrainer needs a packed Qwen3.5 model, got {type(base).__name__} "
            f"({type(base).__module__}); load the folder with trust_remote_code=True "
            "(GRPOConfig(trust_remote_code=True) when passing a path)"
        )


class PackedGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` for packed Qwen3.5 models: no LM-head work on padding, MoE aux loss only when asked,
    generate() on CUDA with the static cache unless the caller chose a cache (`default_generation_cache`, logged).

    Same constructor as GRPOTrainer. `args.router_aux_loss_coef`: None (default) turns the MoE load-balancing
    loss off whatever the config declares; a number > 0 turns it on with that coefficient (logged once).
    Vision-language models: image placeholder runs collapsed in what colocate vLLM gets, token types from the
    prompt only (see the doc of integrations/grpo.py). `routing_replay=True` (or `args.routing_replay`): MoE
    routing replay with vLLM colocate (see the same doc, and this module's). `activation_offloading=True` (or
    `args.activation_offloading`): each training step runs in TRL's activation offloading, as SFTTrainer's does
    (`activation_offload_context`; an accelerator only).
    """

    def __init__(
        self,
        model,
        reward_funcs,
        args=None,
        *rest,
        routing_replay: bool = False,
        activation_offloading: bool = False,
        **kwargs,
    ):
        coef = check_aux_loss_coef(getattr(args, "router_aux_loss_coef", None))
        self.routing_replay = bool(routing_replay or getattr(args, "routing_replay", False))
        # Routing replay, only from a generation to the end of its scoring: vLLM's arrays, then their padded layout.
        self._engine_routing, self._rollout_routing = None, None
        if self.routing_replay:
            check_routing_replay(model, args)
        with trl_patches.engine_keeping_routing() if self.routing_replay else nullcontext():
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        _check_packed_model(self.model)
        text_config = self.model.config.get_text_config()
        is_moe = hasattr(text_config, "output_router_logits") and getattr(text_config, "num_experts", 0)
        self.router_aux_loss_coef = coef or 0.0
        self.aux_loss_enabled = bool(is_moe) and self.router_aux_loss_coef > 0
        if self.aux_loss_enabled:
            logger.warning(
                "GRPO: MoE load-balancing loss on, router_aux_loss_coef=%s (set by the caller)",
                self.router_aux_loss_coef,
            )
        config = self.model.config
        self.vision_token_ids = (
            (config.image_token_id, config.video_token_id) if hasattr(config, "vision_config") else None
        )
        cache = default_generation_cache(self.args, self.accelerator.device)
        if cache is not None:
            # TRL hands generate() both: the generation config, and these kwargs over the model's own config
            self.generation_config.cache_implementation = cache
            self.generation_kwargs["cache_implementation"] = cache
            logger.warning(
                "GRPO: completions from generate() with cache_implementation=%r (decode steps replayed as CUDA "
                "graphs); GRPOConfig(cache_implementation='dynamic') keeps the growing cache",
                cache,
            )
        generation = getattr(self, "vllm_generation", None)
        if generation is not None:
            from .vllm_sync import check_adapters_mergeable

            check_adapters_mergeable(self.model)
        if generation is not None and generation.mode == "colocate":
            trl_patches.configure_colocate_sync(generation)
            if self.vision_token_ids is not None:
                trl_patches.send_unexpanded_images(generation, config.image_token_id)
        if self.routing_replay:
            logger.warning(
                "GRPO: MoE routing replay on: the trainer's forwards route every token to the experts "
                "vLLM used for it (gate weights from the trainer's router)"
            )
        self.activation_offloading = bool(activation_offloading or getattr(args, "activation_offloading", False))
        self._offload_context = (
            activation_offload_context(self.model, self.accelerator.device)
            if self.activation_offloading
            else nullcontext()
        )

    def training_step(self, *args, **kwargs):
        # As SFTTrainer: the whole step, whose generation and scoring run without autograd and so save nothing
        with self._offload_context:
            return super().training_step(*args, **kwargs)

    def _generate_single_turn(self, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        if self.routing_replay:
            self._engine_routing = self.vllm_generation.llm.take_routing()
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        self._rollout_routing = None
        output = super()._generate_and_score_completions(inputs)
        if self.routing_replay:
            output["routed_experts"] = self._rollout_routing_for(
                torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                output["completion_ids"].shape[1],
            )
            # from here on, routing comes with the rows only (TRL shuffles and splits them)
            self._engine_routing, self._rollout_routing = None, None
        return output

    def _rollout_routing_for(self, attention_mask, completion_width: int) -> torch.Tensor:
        """The generation batch's routed experts in its padded layout (built once per generation; only while
        that batch is being scored)."""
        if self._rollout_routing is None:
            from .vllm_routing import padded_routed_experts

            if self._engine_routing is None:
                raise RuntimeError(
                    "routing replay: a log-prob step on rows that carry no routed experts (outside "
                    "the scoring of a freshly generated batch, the rows must bring them)"
                )
            if len(self._engine_routing) != attention_mask.shape[0]:
                raise RuntimeError(
                    f"routing replay: vLLM's routed experts of "
                    f"{len(self._engine_routing)} completions for a batch of "
                    f"{attention_mask.shape[0]} rows"
                )
            prompt_lengths, completion_lengths, arrays = zip(*self._engine_routing)
            prompt_width = attention_mask.shape[1] - completion_width
            real_prompts = attention_mask[:, :prompt_width].sum(dim=1).tolist()
            if list(prompt_lengths) != real_prompts:
                raise RuntimeError(
                    f"routing replay: vLLM's prompts have {list(prompt_lengths)} tokens, the batch's {real_prompts}"
                )
            self._rollout_routing = padded_routed_experts(
                arrays, prompt_lengths, completion_lengths, prompt_width, completion_width, self.model.config
            )
        return self._rollout_routing

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        routing = inputs.get("routed_experts")
        if self.routing_replay and routing is not None:
            # TRL's loss step passes its log-prob step a fixed set of the batch's keys: the routing goes with the model.
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            model = RoutedModel(model, RoutingFeed(routing, input_ids))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, mm_token_type_ids=None, **kwargs
    ):
        # Token types from the prompt only, also for text-only batches (TRL gives none there): a vision
        # placeholder sampled in a completion is text, as vLLM generated it.
        if mm_token_type_ids is None and self.vision_token_ids is not None:
            mm_token_type_ids = prompt_token_types(input_ids, logits_to_keep, *self.vision_token_ids)
        if self.routing_replay and not isinstance(model, RoutedModel):
            # the scoring of a freshly generated batch: its rows' routing is the one kept from the generation
            routing = self._rollout_routing_for(attention_mask, logits_to_keep)
            model = RoutedModel(model, RoutingFeed(routing, input_ids))
        # TRL's fused LM head projects only the scored positions (the real completion tokens) on every device
        with trl_patches.lm_head_on_scored_positions():
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                *args,
                mm_token_type_ids=mm_token_type_ids,
                **kwargs,
            )
