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
explicitly; when on, it is logged once with its coefficient and computed over the real tokens of the batch (TRL's
own computation expects router logits in the padded layout, ours cover real tokens only).

With vLLM in colocate mode on CPU, the weight sync goes through vLLM's in-place reload (`vllm_sync`): TRL's
per-tensor `load_weights` cannot work on vLLM's CPU backend.

The stock `trl grpo` CLI uses TRL's GRPOTrainer unchanged: it works with our model folders (see the README), but on
a device without Triton its LM head projects padding, and for MoE models pass `--router_aux_loss_coef 0` (or use
`examples/grpo.py`, which uses this trainer).
"""

from __future__ import annotations

import logging
import numbers
import types
from contextlib import nullcontext

import torch

logger = logging.getLogger(__name__)

_POLICY_OUTPUTS = ("log_probs", "entropy")
_REF_OUTPUTS = ("log_probs",)


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


def add_unpadded_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                         outputs: tuple[str, ...] = _REF_OUTPUTS) -> None:
    """Patch `model` (already patched by TRL's `add_fused_lm_head`) so that `model(..., fused_lm_head=True)`
    projects only the positions whose next-token label is not -100. Same outputs as TRL's fused forward
    (`FusedCausalLMOutput`, zeros where the label is -100); pre-shifted `shift_labels` go to TRL's forward."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

    from ..modeling.moe import load_balancing_loss

    trl_forward = model.forward
    text_config = model.config.get_text_config()
    if getattr(text_config, "final_logit_softcapping", None) or getattr(text_config, "logit_scale", None):
        raise ValueError("add_unpadded_lm_head is for packed Qwen3.5 models (no logit scaling or softcapping)")

    def _unpadded_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                          num_items_in_batch=None, **kwargs):
        if not fused_lm_head or shift_labels is not None:
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
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
            aux_loss = load_balancing_loss(tuple(backbone.router_logits), text_config.num_experts,
                                           text_config.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss.to(loss.device)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy,
                                   log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1,
                                   label_mask=mask, aux_loss=aux_loss)

    model.forward = types.MethodType(_unpadded_forward, model)


def _check_packed_model(model) -> None:
    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    names = [cls.__name__ for cls in type(base).__mro__]
    if "Qwen3_5PackedPreTrainedModel" not in names:
        raise ValueError(f"PackedGRPOTrainer needs a packed Qwen3.5 model, got {type(base).__name__} "
                         f"({type(base).__module__}); load the folder with trust_remote_code=True "
                         "(GRPOConfig(trust_remote_code=True) when passing a path)")


def _chunk_size() -> int:
    from trl.trainer import utils

    return utils._CHUNKED_LOGPROB_CHUNK_SIZE


def _make_trainer_class():
    GRPOTrainer = _get_trainer_base()

    class PackedGRPOTrainer(GRPOTrainer):
        """`trl.GRPOTrainer` for packed Qwen3.5 models: no LM-head work on padding, MoE aux loss only when asked.

        Same constructor as GRPOTrainer. `args.router_aux_loss_coef`: None (default) turns the MoE load-balancing
        loss off whatever the config declares; a number > 0 turns it on with that coefficient (logged once).
        """

        def __init__(self, model, reward_funcs, args=None, *rest, **kwargs):
            coef = check_aux_loss_coef(getattr(args, "router_aux_loss_coef", None))
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
            _check_packed_model(self.model)
            text_config = self.model.config.get_text_config()
            is_moe = hasattr(text_config, "output_router_logits") and getattr(text_config, "num_experts", 0)
            self.router_aux_loss_coef = coef or 0.0
            self.aux_loss_enabled = bool(is_moe) and self.router_aux_loss_coef > 0
            if self.aux_loss_enabled:
                logger.warning("GRPO: MoE load-balancing loss on, router_aux_loss_coef=%s (set by the caller)",
                               self.router_aux_loss_coef)
            from accelerate.utils import is_peft_model

            policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
            add_unpadded_lm_head(policy, self.temperature, self.args.cast_lm_head_to_fp32, _POLICY_OUTPUTS)
            if self.ref_model is not None:
                add_unpadded_lm_head(self.ref_model, self.temperature, self.args.cast_lm_head_to_fp32, _REF_OUTPUTS)
            generation = getattr(self, "vllm_generation", None)
            if generation is not None and generation.mode == "colocate":
                from .vllm_sync import use_reload_sync, vllm_runs_on_cpu

                if vllm_runs_on_cpu():  # TRL's per-tensor load_weights cannot work there (see vllm_sync)
                    use_reload_sync(generation)

    return PackedGRPOTrainer


def __getattr__(name):
    # TRL is an optional dependency (the `train` extra): import it only when the trainer is asked for.
    if name == "PackedGRPOTrainer":
        cls = _make_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
