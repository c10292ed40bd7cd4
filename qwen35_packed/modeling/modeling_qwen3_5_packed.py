"""Packed-varlen Qwen3.5 text models: `Qwen3_5PackedForCausalLM` (dense) and `Qwen3_5MoePackedForCausalLM` (MoE).

Remote code: imports only torch, transformers, its sibling files, and optionally FLA / flash-attn.

Every forward resolves its batch into one varlen stream (see packing.py for the contract and its precedence),
runs all layers on the real tokens only, with exact document boundaries in the conv, the recurrence, attention,
rope positions and the loss, and scatters the outputs back to the caller's layout (pad positions hold zeros).
State-dict keys and shapes are those of transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM. The
architecture names differ on purpose: TRL resolves `getattr(transformers, architectures[0])` before `auto_map`, so a
remote class named like a built-in one would silently be replaced by the built-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

from .attention import GatedAttention
from .cache import Qwen3_5PackedCache, as_packed_cache
from .checkpoint_keys import (
    IGNORED_MISSING_EXPERT_KEYS,
    IGNORED_UNEXPECTED_EXPERT_KEYS,
    TEXT_KEY_MAPPING,
    from_official_layout,
)
from .configuration_qwen3_5_packed import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig
from .expert_lora import ExpertWeight  # noqa: F401  (moe.py's; named for transformers 4.x, see below)
from .gated_deltanet import FP32_PARAMETERS, GatedDeltaNet
from .kernel_selection import select_kernels

# transformers 4.x copies into its module cache only the files this module names in its own `from .name import`
# lines (not what those import): the files the layers need (kernels.py, reference_kernels.py, the triton_*.py
# kernel files, moe.py's expert_lora.py) are named here too, in the imports marked `noqa: F401`
# (tests/conversion/test_remote_code_audit.py checks that nothing is missing).
from .kernels import varlen_causal_attention  # noqa: F401
from .loss import IGNORE_INDEX, LogitsNotKept, chunked_linear_cross_entropy, keeps_logits_with_loss
from .moe import FusedExperts, SparseMoeBlock, SwiGLUMLP, TopKRouter, load_balancing_loss
from .norms import GatedRMSNorm, ZeroCenteredRMSNorm
from .numerics import enable_numerics_check
from .packing import PackedSequence, build_packed_sequence, input_shape, loss_targets
from .recompute import RecomputedActivations, recompute_enabled
from .reference_kernels import torch_gated_delta_rule_varlen  # noqa: F401
from .rope import MRotaryEmbedding
from .routing_replay import routed_experts_stream
from .triton_conv import TRITON_CONV_AVAILABLE  # noqa: F401
from .triton_elementwise import TRITON_ELEMENTWISE_AVAILABLE  # noqa: F401
from .triton_gather_sum import TRITON_GATHER_SUM_AVAILABLE  # noqa: F401
from .triton_support import INTERPRETED  # noqa: F401
from .utils import TRANSFORMERS_MAJOR, log_once

logger = logging.getLogger(__name__)

# The name under which the installed `generate()` passes the cache around ("cache" from transformers 5.2x on).
_CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
# Keyword arguments trainers and generate() pass that carry nothing for this model.
_IGNORED_KWARGS = frozenset({"cache_position", "output_attentions"})
# transformers' loss keyword arguments, taken through **kwargs as the built-in takes them: a parameter whose name
# contains "label" would join the Trainer's `label_names` (from the signature), and its evaluation would then find
# no labels in batches without that key (no eval_loss, no compute_metrics).
_LOSS_KWARGS = frozenset({"num_items_in_batch", "shift_labels"})
# transformers' attention implementations this model can honour, and the attention_kernel each runs as.
ATTENTION_KERNEL_OF_IMPLEMENTATION = {"sdpa": "sdpa", "eager": "sdpa", "flash_attention_2": "flash_attn"}
# Keyword arguments that place document boundaries inside a row (the packing contract, packing.py).
_PACKING_KWARGS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def _output_class(name: str, doc: str, field_names: list[str]):
    """A ModelOutput dataclass whose cache field carries the name the installed transformers uses (newer
    releases alias `past_key_values` to `cache` and warn on the old name)."""
    cls = dataclasses.make_dataclass(
        name, [(f, Any, dataclasses.field(default=None)) for f in field_names], bases=(ModelOutput,)
    )
    cls.__doc__, cls.__module__ = doc, __name__
    return cls


Qwen3_5PackedModelOutput = _output_class(
    "Qwen3_5PackedModelOutput",
    "Decoder output in the caller's layout (pad positions are zeros), router_logits included; `attentions` is always "
    "None (the varlen kernels never form the attention matrix).",
    ["last_hidden_state", _CACHE_KWARG, "hidden_states", "attentions", "router_logits"],
)
Qwen3_5PackedCausalLMOutput = _output_class(
    "Qwen3_5PackedCausalLMOutput",
    "Causal-LM output in the caller's layout; aux_loss is set when router logits were requested; `attentions` is "
    "always None (the varlen kernels never form the attention matrix).",
    ["loss", "aux_loss", "logits", _CACHE_KWARG, "hidden_states", "attentions", "router_logits"],
)


class Qwen3_5PackedDecoderLayer(GradientCheckpointingLayer):
    """A decoder layer; `gradient_checkpointing_enable()` checkpoints it as transformers checkpoints the built-in's
    (GradientCheckpointingLayer: the hidden states positional, everything else keyword arguments)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config, layer_idx)
        if config.layer_uses_moe(layer_idx):
            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = SwiGLUMLP(config, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, packed, cos, sin, choice, cache=None, routed_experts=None):
        """hidden_states [N, H] -> (hidden_states [N, H], router logits [N, E] or None); `routed_experts` [N, k]:
        the experts to replay in this layer's MoE block (routing_replay.py)."""
        normed = self.input_layernorm(hidden_states, choice)
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(normed, packed, choice, cache)
        else:
            mixed = self.self_attn(normed, packed, cos, sin, choice, cache)
        # A separate add, not one fused add + norm kernel: the norm's backward keeps the sum, from which the
        # backward recomputes the normed input of the MLP exactly (recompute.py).
        residual = hidden_states + mixed
        normed = self.post_attention_layernorm(residual, choice)
        mlp_out = self.mlp(normed, choice, routed_experts) if routed_experts is not None else self.mlp(normed, choice)
        router_logits = None
        if isinstance(mlp_out, tuple):
            mlp_out, router_logits = mlp_out
        return residual + mlp_out, router_logits


class Qwen3_5PackedPreTrainedModel(PreTrainedModel):
    config_class = Qwen3_5PackedConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3_5PackedDecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", r"^model\.visual\.", *IGNORED_UNEXPECTED_EXPERT_KEYS]
    _keys_to_ignore_on_load_missing = list(IGNORED_MISSING_EXPERT_KEYS)
    _keep_in_fp32_modules_strict = list(FP32_PARAMETERS)
    _supports_sdpa = True
    _is_stateful = True
    enable_numerics_check = enable_numerics_check  # debug: name the first NaN / inf (modeling/numerics.py)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # Any official layout (composite or text, experts fused or per expert): checkpoint_keys.py.
        return from_official_layout(
            cls, super().from_pretrained, pretrained_model_name_or_path, args, kwargs, TEXT_KEY_MAPPING
        )

    def _init_weights(self, module):
        init = getattr(transformers, "initialization", None) or nn.init
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ZeroCenteredRMSNorm):
            init.zeros_(module.weight)
        elif isinstance(module, GatedRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, GatedDeltaNet):
            init.ones_(module.dt_bias)
            with torch.no_grad():  # A = exp(A_log) uniform in [0.01, 16], kept away from 0 so log(A) is finite
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log_())
        elif isinstance(module, FusedExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, TopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)

    def set_attn_implementation(self, attn_implementation, allow_all_kernels: bool = False):
        """transformers' attention implementations, mapped to this project's `attention_kernel` (the varlen kernels
        are the only attention this model has): "sdpa" and "eager" (the same attention, which the built-in computes
        with a matmul) run per-document SDPA, "flash_attention_2" flash-attn varlen; any other raises."""
        requested = attn_implementation
        if isinstance(attn_implementation, dict):
            requested = attn_implementation.get("", attn_implementation.get("text_config"))
        kernel = ATTENTION_KERNEL_OF_IMPLEMENTATION.get(requested)
        if kernel is None:
            raise ValueError(  # opening with transformers' own sentence for an unknown implementation
                f'Specified `attn_implementation="{requested}"` is not supported by the packed Qwen3.5 model; it '
                f"accepts {', '.join(map(repr, ATTENTION_KERNEL_OF_IMPLEMENTATION))} (config field attention_kernel: "
                "'auto', 'flash_attn', 'torch_varlen', 'sdpa')"
            )
        self.config.get_text_config().attention_kernel = kernel
        for module in self.modules():  # the name transformers reads back, on every config a submodel holds
            if isinstance(module, PreTrainedModel):
                module.config._attn_implementation = requested
        log_once(
            logger,
            ("attn-implementation", requested),
            "attn_implementation=%r runs as attention_kernel=%r",
            requested,
            kernel,
        )

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a transformers DynamicCache: this model creates its own cache.
        return False


class Qwen3_5PackedTextModel(Qwen3_5PackedPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.layers = nn.ModuleList([Qwen3_5PackedDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def resolve_packing(
        self,
        shape: tuple[int, int],
        device,
        *,
        attention_mask=None,
        position_ids=None,
        cache: Qwen3_5PackedCache | None = None,
        use_cache: bool | None = None,
        cu_seqlens=None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        max_length_k=None,
        seq_idx=None,
    ) -> tuple[PackedSequence, Qwen3_5PackedCache | None]:
        """The packing step of a forward over a (batch, seq) = `shape` batch: its PackedSequence and the cache to
        use (None without one). A filled cache continues every row by its new tokens; otherwise the boundaries
        come from the packing contract (packing.py) and a cache is made when `use_cache` asks for one."""
        cache = as_packed_cache(cache)
        explicit_packing = any(x is not None for x in (cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, seq_idx))
        if cache is not None and cache.has_state:
            if explicit_packing:
                raise ValueError(
                    "packing kwargs (cu_seqlens / cu_seq_lens_q/k / seq_idx) cannot be used with a filled cache"
                )
            if attention_mask is not None and not bool(attention_mask[:, -shape[1] :].bool().all()):
                raise ValueError("with a cache, the new tokens must all be real (attention_mask 1 on them)")
            packed = cache.decode_sequence(shape[0], shape[1], device)
            if position_ids is not None and position_ids.dim() == 2:
                if not torch.equal(position_ids.reshape(-1).to(packed.position_ids), packed.position_ids):
                    raise ValueError("position_ids contradict the cache: generation positions continue per row")
            return packed, cache
        packed = build_packed_sequence(
            shape,
            device,
            attention_mask,
            position_ids,
            cu_seqlens,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            max_length_k,
            seq_idx,
        )
        # A cache holds one document per row: of the cache given, else of the batch.
        one_doc_per_row = packed.num_docs == (cache.batch_size if cache is not None else shape[0])
        if use_cache is None:
            use_cache = bool(self.config.use_cache) and not self.training and one_doc_per_row
        if use_cache and not one_doc_per_row:
            raise ValueError("use_cache=True needs one document per row; packed documents cannot be continued")
        if not use_cache:
            return packed, None
        return packed, cache if cache is not None else Qwen3_5PackedCache(self.config.layer_types, shape[0])

    def run_layers(
        self,
        hidden: torch.Tensor,
        packed: PackedSequence,
        *,
        rope_positions=None,
        cache: Qwen3_5PackedCache | None = None,
        columns: int = 0,
        output_hidden_states: bool = False,
        output_router_logits: bool = False,
        routed_experts=None,
    ):
        """Run the decoder layers and the final norm on the packed stream `hidden` [N, H] of `packed`, with rope at
        `rope_positions` (packed.position_ids by default; the vision-language model passes its [3, N] positions).
        A cache advances by the stream and `columns` caller columns. `routed_experts`: experts to replay per token
        and MoE layer, in the caller's layout (routing_replay.py). Returns (hidden [N, H], all hidden states or
        None, router logits or None)."""
        choice = select_kernels(self.config, hidden.device, hidden.dtype)
        cos, sin = self.rotary_emb.cos_sin(
            packed.position_ids if rope_positions is None else rope_positions, hidden.dtype
        )
        replay = None
        if routed_experts is not None:
            stream = routed_experts_stream(routed_experts, packed, self.config, hidden.device)
            replay = iter(stream.unbind(dim=1))  # one [N, k] per MoE layer, in order

        all_hidden = [] if output_hidden_states else None
        router_logits = [] if output_router_logits else None
        checkpointing = (
            self.training and torch.is_grad_enabled() and any(layer.gradient_checkpointing for layer in self.layers)
        )
        # With autograd recording (and no checkpointing, which keeps nothing), norm / SwiGLU / gate outputs are
        # recomputed in the backward rather than kept (recompute.py): bitwise the same gradients, less memory.
        recompute = RecomputedActivations() if recompute_enabled() and not checkpointing else contextlib.nullcontext()
        with recompute:
            for layer in self.layers:
                if all_hidden is not None:
                    all_hidden.append(hidden)
                routed = next(replay) if replay is not None and isinstance(layer.mlp, SparseMoeBlock) else None
                hidden, logits = layer(
                    hidden, packed=packed, cos=cos, sin=sin, choice=choice, cache=cache, routed_experts=routed
                )
                if router_logits is not None and logits is not None:
                    router_logits.append(logits)
        hidden = self.norm(hidden, choice)
        if all_hidden is not None:
            all_hidden.append(hidden)
        if cache is not None:
            cache.advance(packed, columns)
        return hidden, all_hidden, router_logits

    def run_packed(
        self,
        input_ids=None,
        *,
        inputs_embeds=None,
        output_hidden_states: bool = False,
        output_router_logits: bool = False,
        routed_experts=None,
        **packing,
    ):
        """Resolve the packing (`resolve_packing`: attention_mask, position_ids, cache, use_cache and the packing
        kwargs), embed and run the layers. Returns (hidden [N, H], packed, cache, all hidden, router logits)."""
        shape = input_shape(input_ids, inputs_embeds)
        device = (input_ids if input_ids is not None else inputs_embeds).device
        packed, cache = self.resolve_packing(shape, device, **packing)
        if inputs_embeds is None:
            hidden = self.embed_tokens(packed.pack(input_ids.unsqueeze(-1)).squeeze(-1))
        else:
            hidden = packed.pack(inputs_embeds)
        hidden, all_hidden, router_logits = self.run_layers(
            hidden,
            packed,
            cache=cache,
            columns=shape[1],
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            routed_experts=routed_experts,
        )
        return hidden, packed, cache, all_hidden, router_logits

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        output_router_logits=None,
        cu_seqlens=None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        max_length_k=None,
        seq_idx=None,
        cache=None,
        return_dict=None,
        routed_experts=None,
        **kwargs,
    ):
        _check_kwargs(kwargs, self.config)
        want_router = _wants_router_logits(self.config, output_router_logits)
        if want_router and self.config.router_aux_loss_coef:
            # The backbone returns router logits; trainers such as TRL then add coef * load-balancing loss.
            log_once(
                logger,
                "aux-backbone",
                "router logits returned with router_aux_loss_coef=%s: trainers that add "
                "the load-balancing loss (TRL does) use this coefficient; set it to 0 to train without it, e.g. "
                "for RL",
                self.config.router_aux_loss_coef,
            )
        hidden, packed, cache, all_hidden, router_logits = self.run_packed(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            use_cache=use_cache,
            output_hidden_states=_wants_hidden_states(self.config, output_hidden_states),
            output_router_logits=want_router,
            cu_seqlens=cu_seqlens,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            routed_experts=routed_experts,
        )
        output = Qwen3_5PackedModelOutput(
            last_hidden_state=packed.unpack(hidden),
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden is not None else None,
            router_logits=router_logits_in_caller_layout(router_logits, packed),
            **{_CACHE_KWARG: cache},
        )
        return output if _wants_dict(self.config, return_dict) else output.to_tuple()


class Qwen3_5MoePackedTextModel(Qwen3_5PackedTextModel):
    """The MoE text backbone (the counterpart of transformers' Qwen3_5MoeTextModel; AutoModel on a MoE folder)."""

    config_class = Qwen3_5MoePackedConfig


def _check_kwargs(kwargs: dict, config) -> None:
    unknown = sorted(set(kwargs) - _IGNORED_KWARGS - _LOSS_KWARGS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments for a packed Qwen3.5 forward: {unknown}")
    requested = kwargs.get("output_attentions")
    if requested or (requested is None and getattr(config, "output_attentions", False)):
        raise ValueError(
            "output_attentions is not supported (nor config.output_attentions=True): the varlen "
            "attention kernels never form the attention matrix"
        )


def refuse_packed_generation(args: tuple, kwargs: dict) -> None:
    """generate() would silently drop packing kwargs; boundaries inside a row (cu_seqlens, cu_seq_lens_q/k,
    seq_idx, or position_ids that restart within a row) raise instead."""
    given = [name for name in _PACKING_KWARGS if kwargs.get(name) is not None]
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


def router_logits_in_caller_layout(router_logits, packed: PackedSequence):
    """Per-layer router logits as [batch * seq, num_experts] with zeros at pad positions, the layout of the
    built-in model: transformers' `load_balancing_loss_func(router_logits, ..., attention_mask)` (which TRL's GRPO
    calls) then weighs exactly the real tokens. Inside the model they stay packed (real tokens only)."""
    if not router_logits:
        return None
    return tuple(packed.unpack(layer).flatten(0, 1) for layer in router_logits)


def _wants_hidden_states(config, requested) -> bool:
    return bool(getattr(config, "output_hidden_states", False) if requested is None else requested)


def _wants_dict(config, requested) -> bool:
    """return_dict=False (or the config's return_dict) gives a plain tuple of the output's set fields."""
    return bool(getattr(config, "return_dict", True) if requested is None else requested)


def _wants_router_logits(config, requested) -> bool:
    if not getattr(config, "is_moe", False):
        return False
    return bool(config.output_router_logits if requested is None else requested)


class Qwen3_5PackedForCausalLM(Qwen3_5PackedPreTrainedModel, GenerationMixin):
    config_class = Qwen3_5PackedConfig
    # transformers 5 declares tied weights as {target: source}; 4.x as a list of the tied keys.
    _tied_weights_keys = (
        {"lm_head.weight": "model.embed_tokens.weight"} if TRANSFORMERS_MAJOR >= 5 else ["lm_head.weight"]
    )
    # No tensor-parallel entry for lm_head (the built-in shards it by columns): the loss reads its weight directly
    # (chunked cross-entropy), which a sharded weight would silently cut to a slice of the vocabulary.

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen3_5PackedTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_hidden_states=None,
        output_router_logits=None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens=None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        max_length_k=None,
        seq_idx=None,
        cache=None,
        return_dict=None,
        routed_experts=None,
        **kwargs,
    ):
        _check_kwargs(kwargs, self.config)
        want_router = _wants_router_logits(self.config, output_router_logits)
        hidden, packed, cache, all_hidden, router_logits = self.model.run_packed(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            use_cache=use_cache,
            output_hidden_states=_wants_hidden_states(self.config, output_hidden_states),
            output_router_logits=want_router,
            cu_seqlens=cu_seqlens,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            routed_experts=routed_experts,
        )

        loss, aux_loss, logits = self.lm_head_outputs(
            hidden,
            packed,
            labels,
            logits_to_keep,
            kwargs.get("num_items_in_batch"),
            router_logits,
            want_router,
            kwargs.get("shift_labels"),
        )

        output = Qwen3_5PackedCausalLMOutput(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden is not None else None,
            router_logits=router_logits_in_caller_layout(router_logits, packed),
            **{_CACHE_KWARG: cache},
        )
        return output if _wants_dict(self.config, return_dict) else output.to_tuple()

    def lm_head_outputs(
        self, hidden, packed, labels, logits_to_keep, num_items_in_batch, router_logits, want_router, shift_labels=None
    ):
        """lm_head, loss and MoE aux loss on the packed stream -> (loss, aux_loss, logits in the caller's layout).
        Shared with the vision-language classes: the text settings come from `config.get_text_config()`."""
        text_config = self.config.get_text_config()
        full_logits = isinstance(logits_to_keep, int) and logits_to_keep == 0
        loss = None
        if labels is not None or shift_labels is not None:
            if not full_logits:
                raise ValueError("labels need the full logits: leave logits_to_keep at 0 when computing the loss")
            targets = loss_targets(packed, labels, shift_labels)
            keep_logits = keeps_logits_with_loss(text_config.return_logits_with_loss, self.training)
            loss, logits = self.packed_loss(hidden, targets, packed, num_items_in_batch, keep_logits=keep_logits)
            if not keep_logits:
                logits = LogitsNotKept(text_config.return_logits_with_loss)
        elif full_logits:
            logits = packed.unpack(self.lm_head(hidden))  # lm_head on real tokens only
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(packed.unpack(hidden)[:, keep, :])

        aux_loss = None
        if want_router and router_logits:
            aux_loss = load_balancing_loss(
                tuple(router_logits), text_config.num_experts, text_config.num_experts_per_tok
            )
            coef = text_config.router_aux_loss_coef
            if loss is not None and coef > 0:
                log_once(
                    logger,
                    "aux",
                    "MoE load-balancing loss added to the loss with router_aux_loss_coef=%s "
                    "(set it to 0 or do not request router logits to train without it, e.g. for RL)",
                    coef,
                )
                loss = loss + coef * aux_loss.to(loss.device)
        return loss, aux_loss, logits

    def packed_loss(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        packed: PackedSequence,
        num_items_in_batch=None,
        keep_logits: bool = True,
    ):
        """Token-weighted fp32 cross-entropy on the packed stream; returns (loss, logits in the caller's layout
        [batch, seq, V], or None when `keep_logits` is False).

        With a plain nn.Linear head the loss runs chunked (chunked_linear_cross_entropy): fp32 [N, V] logits never
        exist in full, the per-chunk cross-entropy runs compiled when the elementwise chains are fused, and the returned
        logits are detached (they carry no gradient; the loss does) and written straight into the caller's layout.
        A wrapped head (e.g. an adapter) keeps the plain path, so its forward is never bypassed.
        """
        if type(self.lm_head) is nn.Linear and self.lm_head.bias is None:
            choice = select_kernels(self.config.get_text_config(), hidden.device, hidden.dtype)
            batch, seq_len = packed.batch_shape
            loss, logits = chunked_linear_cross_entropy(
                hidden,
                self.lm_head.weight,
                targets,
                num_items_in_batch,
                keep_logits=keep_logits,
                logits_index=packed.token_index,
                logits_rows=batch * seq_len,
                choice=choice,
            )
            return loss, (logits.view(batch, seq_len, -1) if logits is not None else None)
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
        next_sequence_length=None,
        is_first_iteration=None,
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
            inputs[_CACHE_KWARG] = cache
        elif inputs_embeds is not None:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids
        # Everything else goes on to forward as given (generate's and the caller's model kwargs), as the built-in's
        # does: forward refuses what it cannot honour. Position ids come from the cache and the attention mask.
        kwargs.pop("position_ids", None)
        kwargs.pop("cache_position", None)
        inputs.update(kwargs)
        return inputs

    def _reorder_cache(self, cache, beam_idx):
        cache.reorder_cache(beam_idx)
        return cache


class Qwen3_5MoePackedForCausalLM(Qwen3_5PackedForCausalLM, GenerationMixin):
    # GenerationMixin named again among the bases, as transformers expects of every class that generates
    config_class = Qwen3_5MoePackedConfig


Qwen3_5PackedSequenceClassifierOutput = _output_class(
    "Qwen3_5PackedSequenceClassifierOutput",
    "Sequence-classification output: `logits` [documents, num_labels], one row per document in stream order (for a "
    "padded batch with one document per row: one per row, like the built-in's [batch, num_labels]).",
    ["loss", "logits", _CACHE_KWARG, "hidden_states", "router_logits"],
)


def document_score_index(packed: PackedSequence, input_ids, pad_token_id) -> torch.Tensor:
    """The stream index [num_docs] of the token each document is scored at: its last real token, or with
    `pad_token_id` set and `input_ids` given, its last token whose id is not the pad id (its first token if all are).

    This is the built-in's rule (the rightmost non-pad token of a row) applied to each document: the same
    position as the built-in for any row whose pad positions hold the pad id, and for a packed row the position the
    built-in picks for each document alone. No host synchronisation."""
    starts = packed.cu_seqlens[:-1].long()
    if pad_token_id is None or input_ids is None:
        return packed.cu_seqlens[1:].long() - 1
    ids = packed.pack(input_ids.unsqueeze(-1)).squeeze(-1)
    stream = torch.arange(ids.numel(), device=ids.device)
    candidates = torch.where(ids != pad_token_id, stream, starts[packed.doc_index()])
    return starts.scatter_reduce(0, packed.doc_index(), candidates, "amax", include_self=True)


class Qwen3_5PackedForSequenceClassification(Qwen3_5PackedPreTrainedModel):
    """A score head on the packed text backbone (reward / value models: TRL's RewardTrainer, PPO), one score per
    document: `logits` [documents, num_labels], read at each document's last token (`document_score_index`).

    Keys and loss are those of transformers' `Qwen3_5TextForSequenceClassification` (`model.*` + `score.weight`;
    `self.loss_function`, i.e. regression / single-label / multi-label by `config.problem_type`), so folders are
    interchangeable. Loaded from a causal-LM folder, the `score` head is the one tensor allowed to be missing: it is
    initialised as transformers initialises a new head and reported (checkpoint_keys.py)."""

    config_class = Qwen3_5PackedConfig
    # Modules the checkpoint of a causal LM cannot hold; every other tensor must come from it (checkpoint_keys.py).
    new_task_head_modules = ("score",)

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = Qwen3_5PackedTextModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_hidden_states=None,
        output_router_logits=None,
        cu_seqlens=None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        max_length_k=None,
        seq_idx=None,
        cache=None,
        return_dict=None,
        routed_experts=None,
        **kwargs,
    ):
        """`labels`: one per document ([documents] or [documents, num_labels]), in the order of `logits`."""
        _check_kwargs(kwargs, self.config)
        hidden, packed, cache, all_hidden, router_logits = self.model.run_packed(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            use_cache=use_cache,
            output_hidden_states=_wants_hidden_states(self.config, output_hidden_states),
            output_router_logits=_wants_router_logits(self.config, output_router_logits),
            cu_seqlens=cu_seqlens,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            routed_experts=routed_experts,
        )
        scored = document_score_index(packed, input_ids, self.config.get_text_config().pad_token_id)
        logits = self.score(hidden.index_select(0, scored))
        loss = None
        if labels is not None:
            if (labels.shape[0] if labels.dim() else 1) != packed.num_docs:
                raise ValueError(
                    f"labels hold {labels.shape[0] if labels.dim() else 1} entries for {packed.num_docs} documents: "
                    "a sequence-classification head scores every document of the batch, labels need one per document"
                )
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        output = Qwen3_5PackedSequenceClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden is not None else None,
            router_logits=router_logits_in_caller_layout(router_logits, packed),
            **{_CACHE_KWARG: cache},
        )
        return output if _wants_dict(self.config, return_dict) else output.to_tuple()


class Qwen3_5MoePackedForSequenceClassification(Qwen3_5PackedForSequenceClassification):
    config_class = Qwen3_5MoePackedConfig


__all__ = [
    "Qwen3_5PackedForCausalLM",
    "Qwen3_5MoePackedForCausalLM",
    "Qwen3_5PackedForSequenceClassification",
    "Qwen3_5MoePackedForSequenceClassification",
    "Qwen3_5PackedTextModel",
    "Qwen3_5MoePackedTextModel",
    "Qwen3_5PackedPreTrainedModel",
    "Qwen3_5PackedCache",
    "PackedSequence",
]
