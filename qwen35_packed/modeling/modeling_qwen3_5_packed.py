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
import logging

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from .adapter_products import adopt_adapter_products
from .attention import GatedAttention
from .attention_probabilities import stream_attention_probabilities  # noqa: F401
from .cache import Qwen3_5PackedCache
from .causal_lm_head import LM_HEAD_TP_PLAN, PackedCausalLMHead
from .checkpoint_granularity import SegmentCheckpointing
from .checkpoint_keys import (
    IGNORED_UNEXPECTED_EXPERT_KEYS,
    TEXT_KEY_MAPPING,
    from_official_layout,
)
from .configuration_qwen3_5_packed import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig
from .context_parallel import shard_packed_row  # noqa: F401
from .conv_lora import effective_conv  # noqa: F401  (gated_deltanet.py's and kernels.py's)
from .decode_graph import decode_step_outputs
from .expert_lora import ExpertWeight  # noqa: F401  (moe.py's; named for transformers 4.x, see below)
from .gated_deltanet import GatedDeltaNet
from .generation import PackedGeneration
from .kernel_selection import KernelSettings, select_kernels
from .kernel_set import KernelSet, kernel_set, shard_kernel_set

# transformers 4.x copies into its module cache only the files this module names in its own `from .name import`
# lines (not what those import): the files the layers need (kernels.py, reference_kernels.py, the triton_*.py
# kernel files, moe.py's expert_lora.py, the conv's conv_lora.py) are named here too, in the imports marked `noqa: F401`
# (tests/conversion/test_remote_code_audit.py checks that nothing is missing).
from .kernels import causal_attention  # noqa: F401
from .layer_pieces import StreamPiece, layer_pieces, run_in_pieces
from .loss import chunked_linear_cross_entropy  # noqa: F401
from .model_conventions import PackedModelConventions, init_dense_weights, weight_init
from .moe import FusedExperts, SparseMoeBlock, SwiGLUMLP, TopKRouter
from .mrope_positions import packed_mrope_positions  # noqa: F401  (vision_layout.py's)
from .norms import GatedRMSNorm, ZeroCenteredRMSNorm
from .numerics import enable_numerics_check  # noqa: F401
from .outputs import CACHE_FIELD, DecoderRun, output_class
from .packed_batch import (
    PackedBatch,
    check_extra_arguments,
    open_packed_batch,
    returns_dict,
    wants_attentions,
    wants_router_logits,
)
from .packing import PackedSequence
from .projection import RowInvariantLinear, plain_products
from .recompute import RecomputedActivations, recompute_enabled
from .reference_kernels import torch_gated_delta_rule_varlen  # noqa: F401
from .rope import MRotaryEmbedding
from .routing_replay import routed_experts_stream
from .triton_conv import TRITON_CONV_AVAILABLE  # noqa: F401
from .triton_decode import TRITON_DECODE_AVAILABLE  # noqa: F401
from .triton_elementwise import TRITON_ELEMENTWISE_AVAILABLE  # noqa: F401
from .triton_gather_sum import TRITON_GATHER_SUM_AVAILABLE  # noqa: F401
from .triton_support import INTERPRETED  # noqa: F401
from .utils import TRANSFORMERS_MAJOR, TransformersKwargs, Unpack, log_once
from .vision_layout import VisionInputs  # noqa: F401

logger = logging.getLogger(__name__)

# transformers' attention implementations this model can honour, and the attention_kernel each runs as.
ATTENTION_KERNEL_OF_IMPLEMENTATION = {"sdpa": "sdpa", "eager": "sdpa", "flash_attention_2": "flash_attn"}


Qwen3_5PackedModelOutput = output_class(
    "Qwen3_5PackedModelOutput",
    "Decoder output in the caller's layout (pad positions are zeros), router_logits included; `attentions`: the "
    "attention probabilities (one per full-attention layer, with output_attentions; attention_probabilities.py).",
    ["last_hidden_state", CACHE_FIELD, "hidden_states", "attentions", "router_logits"],
    __name__,
)
Qwen3_5PackedCausalLMOutput = output_class(
    "Qwen3_5PackedCausalLMOutput",
    "Causal-LM output in the caller's layout; aux_loss is set when router logits were requested; `attentions`: "
    "the attention probabilities (one per full-attention layer, with output_attentions; attention_probabilities.py).",
    ["loss", "aux_loss", "logits", CACHE_FIELD, "hidden_states", "attentions", "router_logits"],
    __name__,
)


class Qwen3_5PackedDecoderLayer(SegmentCheckpointing, GradientCheckpointingLayer):
    """A decoder layer; `gradient_checkpointing_enable()` checkpoints it as transformers checkpoints the built-in's
    (GradientCheckpointingLayer: the hidden states positional, everything else keyword arguments), or only its
    mixer or its MLP segment, as the config's `checkpoint_granularity` says (checkpoint_granularity.py)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
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

    def forward(self, hidden_states, batch: PackedBatch, routed_experts=None):
        """hidden_states [N, H] -> (hidden_states [N, H], router logits [N, E] or None, attention probabilities or
        None); `routed_experts` [N, k]: the experts to replay in this layer's MoE block (routing_replay.py). A
        stream longer than the config's `layer_token_chunk` runs in pieces (layer_pieces.py)."""
        pieces = self.stream_pieces(batch)
        if pieces is not None:
            return run_in_pieces(self, hidden_states, batch, routed_experts, pieces)
        mixed, probabilities = self.run_segment("mixer", self.mix, hidden_states, batch=batch)
        # A separate add, not one fused add + norm kernel: the norm's backward keeps the sum, from which the
        # backward recomputes the normed input of the MLP exactly (recompute.py).
        residual = hidden_states + mixed
        mlp_out, router_logits = self.run_segment(
            "mlp", self.feed_forward, residual, batch=batch, routed_experts=routed_experts
        )
        return residual + mlp_out, router_logits, probabilities

    def stream_pieces(self, batch: PackedBatch):
        """The pieces this layer runs `batch`'s stream in, or None (layer_pieces.layer_pieces)."""
        return layer_pieces(self.config, batch)

    def forward_piece(self, hidden_states, *carried, batch: PackedBatch, piece: StreamPiece, routed_experts=None):
        """The layer on one piece of a stream (layer_pieces.py; `batch`: the piece's): hidden_states [n, H] ->
        (hidden_states [n, H], router logits [n, E] or None, *what the piece hands on to its document's next piece).
        `carried`: what the document's piece before handed on."""
        if piece.cuts_document:
            normed = self.input_layernorm(hidden_states, batch.kernels)
            mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
            mixed, leaves = mixer.continue_piece(normed, batch, carried, piece.continues)
        else:
            (mixed, _), leaves = self.mix(hidden_states, batch), ()
        residual = hidden_states + mixed
        mlp_out, router_logits = self.feed_forward(residual, batch, routed_experts)
        return residual + mlp_out, router_logits, *leaves

    def mix(self, hidden_states, batch: PackedBatch):
        """The mixer segment, input_layernorm and the token mixer: hidden_states [N, H] -> (mixer output [N, H],
        attention probabilities or None)."""
        normed = self.input_layernorm(hidden_states, batch.kernels)
        if self.layer_type == "linear_attention":
            return self.linear_attn(normed, batch), None
        return self.self_attn(normed, batch)

    def feed_forward(self, residual, batch: PackedBatch, routed_experts=None):
        """The MLP segment, post_attention_layernorm and the MLP / MoE block: residual [N, H] -> (output [N, H],
        router logits [N, E] or None)."""
        kernels = batch.kernels
        normed = self.post_attention_layernorm(residual, kernels)
        out = self.mlp(normed, kernels, routed_experts) if routed_experts is not None else self.mlp(normed, kernels)
        return out if isinstance(out, tuple) else (out, None)


class Qwen3_5PackedPreTrainedModel(PackedModelConventions, PreTrainedModel):
    config_class = Qwen3_5PackedConfig
    _no_split_modules = ["Qwen3_5PackedDecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", r"^model\.visual\.", *IGNORED_UNEXPECTED_EXPERT_KEYS]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # Any official layout (composite or text, experts fused or per expert): checkpoint_keys.py.
        return from_official_layout(
            cls, super().from_pretrained, pretrained_model_name_or_path, args, kwargs, TEXT_KEY_MAPPING
        )

    def _init_weights(self, module):
        init, std = weight_init(), self.config.initializer_range
        if init_dense_weights(module, std):
            return
        if isinstance(module, ZeroCenteredRMSNorm):
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
            if isinstance(module, Qwen3_5PackedTextModel):
                module.kernel_sets.clear()
        log_once(
            logger,
            ("attn-implementation", requested),
            "attn_implementation=%r runs as attention_kernel=%r",
            requested,
            kernel,
        )


class Qwen3_5PackedTextModel(Qwen3_5PackedPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.layers = nn.ModuleList([Qwen3_5PackedDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(config)
        # The process group of context parallelism, set by `set_context_parallel` (None: off).
        self.context_parallel_group = None
        # The kernel sets bound so far, by (device, dtype, kernel settings) (`kernels_for`), and a set injected with
        # `inject_kernels`.
        self.kernel_sets: dict[tuple, KernelSet] = {}
        self.injected_kernels: KernelSet | None = None
        self.post_init()

    def _apply(self, fn, *args, **kwargs):
        # .to() / .half() / a device move: the kernels are bound anew for the new device and dtype
        self.kernel_sets = {}
        return super()._apply(fn, *args, **kwargs)

    def kernels_for(self, device: torch.device, dtype: torch.dtype, shard=None) -> KernelSet:
        """The kernel set of a stream on `device` in `dtype`: selected once per (device, dtype) and kernel settings
        of the config (kernel_selection.select_kernels), then read from the instance; a set injected with
        `inject_kernels` instead. On a context-parallel `shard`, the shard's set (kernel_set.shard_kernel_set)."""
        kernels = self.injected_kernels
        if kernels is None:
            settings = KernelSettings.of(self.config)
            key = (device.type, device.index, dtype, settings)
            kernels = self.kernel_sets.get(key)
            if kernels is None:
                kernels = self.kernel_sets[key] = kernel_set(select_kernels(settings, device, dtype))
        return kernels if shard is None else shard_kernel_set(kernels.choice, shard)

    def inject_kernels(self, kernels: KernelSet | None) -> None:
        """Run every forward with `kernels` (kernel_set.kernel_set(KernelChoice(...)), or a set of one's own: a
        test's reference kernels), whatever the device and dtype; None goes back to the selection."""
        self.injected_kernels = kernels

    def open_batch(self, **inputs) -> PackedBatch:
        """The front door (packed_batch.open_packed_batch) with this model's configuration, mode, embedding, rope,
        kernels and context parallelism; `inputs` are the public forwards' arguments, by name."""
        return open_packed_batch(self, **inputs)

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        """The packed stream's embeddings [N, H]: of its token ids, or the caller's inputs_embeds packed."""
        if batch.inputs_embeds is None:
            return self.embed_tokens(batch.token_ids)
        return batch.inputs_embeds

    def run_layers(self, hidden: torch.Tensor, batch: PackedBatch) -> DecoderRun:
        """Run the decoder layers and the final norm on the packed stream `hidden` [N, H] of `batch`: a cache
        advances by the stream and the caller's columns, MoE layers replay `batch.routed_experts`
        (routing_replay.py), a generation step without autograd runs plain products."""
        replay = None
        if batch.routed_experts is not None:
            stream = routed_experts_stream(batch.routed_experts, batch.packed, self.config, hidden.device)
            replay = iter(stream.unbind(dim=1))  # one [N, k] per MoE layer, in order

        all_hidden = [] if batch.output_hidden_states else None
        router_logits = [] if batch.output_router_logits else None
        attentions = [] if batch.output_attentions else None
        # With autograd recording, norm / SwiGLU / gate outputs are recomputed in the backward rather than kept
        # (recompute.py): bitwise the same gradients, less memory. Not when every layer is checkpointed whole: those
        # keep nothing. Layers left out of checkpointing (transformers' `every_n_layers`) keep theirs, and a layer
        # checkpointing one segment keeps the other's activations (checkpoint_granularity.py): recomputed there.
        every_layer_checkpointed = all(layer.recomputed_segment() == "layer" for layer in self.layers)
        recompute = (
            RecomputedActivations()
            if recompute_enabled() and not every_layer_checkpointed
            else contextlib.nullcontext()
        )
        # A generation step's few rows run plain products, which use the whole GPU (projection.plain_products); not
        # where autograd records: a checkpointed layer would rerun its forward with the invariant ones
        generation_step = batch.one_token_per_row and not torch.is_grad_enabled()
        products = plain_products() if generation_step else contextlib.nullcontext()
        with recompute, products:
            for layer in self.layers:
                if all_hidden is not None:
                    hidden = _record_hidden(hidden, batch, all_hidden)
                routed = next(replay) if replay is not None and isinstance(layer.mlp, SparseMoeBlock) else None
                hidden, logits, probabilities = layer(hidden, batch=batch, routed_experts=routed)
                if router_logits is not None and logits is not None:
                    router_logits.append(logits)
                if attentions is not None and probabilities is not None:
                    attentions.append(probabilities)
        hidden = self.norm(hidden, batch.kernels)
        if all_hidden is not None:
            hidden = _record_hidden(hidden, batch, all_hidden)
        if batch.cache is not None:
            batch.cache.advance(batch.packed, batch.columns)
        return DecoderRun(hidden, batch, all_hidden, router_logits, attentions)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Qwen3_5PackedCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        cache: Qwen3_5PackedCache | None = None,
        return_dict: bool | None = None,
        routed_experts: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Qwen3_5PackedModelOutput | tuple:
        check_extra_arguments(kwargs)
        adopt_adapter_products(self)  # PEFT's LoRA wrappers: row-invariant products, the sum in place
        if wants_router_logits(self.config, output_router_logits) and self.config.router_aux_loss_coef:
            # The backbone returns router logits; trainers such as TRL then add coef * load-balancing loss.
            log_once(
                logger,
                "aux-backbone",
                "router logits returned with router_aux_loss_coef=%s: trainers that add "
                "the load-balancing loss (TRL does) use this coefficient; set it to 0 to train without it, e.g. "
                "for RL",
                self.config.router_aux_loss_coef,
            )
        batch = self.open_batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            labels=None,
            shift_labels=kwargs.get("shift_labels"),
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            output_attentions=wants_attentions(self.config, kwargs.get("output_attentions")),
            cu_seqlens=cu_seqlens,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            routed_experts=routed_experts,
        )
        run = self.run_layers(self.embed(batch), batch)
        output = Qwen3_5PackedModelOutput(last_hidden_state=run.batch.packed.unpack(run.hidden), **run.caller_outputs())
        return output if returns_dict(self.config, return_dict) else output.to_tuple()


def _record_hidden(hidden: torch.Tensor, batch: PackedBatch, all_hidden: list) -> torch.Tensor:
    """Append the packed stream `hidden` [N, H] to `all_hidden` in the caller's layout [B, S, H] and return the
    stream re-gathered from that tensor (the same values): the computation continues from the returned hidden
    state, so a gradient reaches it (`retain_grad()` on `hidden_states[i]` works as in the built-in)."""
    padded = batch.packed.unpack(hidden)
    all_hidden.append(padded)
    return batch.packed.pack(padded)


class Qwen3_5MoePackedTextModel(Qwen3_5PackedTextModel):
    """The MoE text backbone (the counterpart of transformers' Qwen3_5MoeTextModel; AutoModel on a MoE folder)."""

    config_class = Qwen3_5MoePackedConfig


class Qwen3_5PackedForCausalLM(PackedCausalLMHead, PackedGeneration, Qwen3_5PackedPreTrainedModel, GenerationMixin):
    config_class = Qwen3_5PackedConfig
    # transformers 5 declares tied weights as {target: source}; 4.x as a list of the tied keys.
    _tied_weights_keys = (
        {"lm_head.weight": "model.embed_tokens.weight"} if TRANSFORMERS_MAJOR >= 5 else ["lm_head.weight"]
    )
    # Tensor parallelism shards lm_head by vocabulary rows and gathers its logits, as the built-in's plan does; the
    # chunked loss, which reads the weight itself, gathers the whole weight (PackedCausalLMHead.packed_loss).
    _tp_plan = LM_HEAD_TP_PLAN

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen3_5PackedTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = RowInvariantLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Qwen3_5PackedCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        cache: Qwen3_5PackedCache | None = None,
        return_dict: bool | None = None,
        routed_experts: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Qwen3_5PackedCausalLMOutput | tuple:
        check_extra_arguments(kwargs)
        adopt_adapter_products(self)  # PEFT's LoRA wrappers: row-invariant products, the sum in place
        cache = cache if cache is not None else past_key_values
        output_attentions = wants_attentions(self.config, kwargs.get("output_attentions"))
        asked = dict(
            labels=labels,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            use_cache=use_cache,
            routed_experts=routed_experts,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            others=(kwargs.get("shift_labels"), cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, seq_idx),
        )
        step = decode_step_outputs(self, cache, input_ids, attention_mask, logits_to_keep, asked)
        if step is not None:  # a decode step of a static cache, replayed as a CUDA graph (decode_graph.py)
            output = Qwen3_5PackedCausalLMOutput(**step, **{CACHE_FIELD: cache})
            return output if returns_dict(self.config, return_dict) else output.to_tuple()
        batch = self.model.open_batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            shift_labels=kwargs.get("shift_labels"),
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            output_attentions=output_attentions,
            logits_to_keep=logits_to_keep,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            cu_seqlens=cu_seqlens,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            routed_experts=routed_experts,
        )
        run = self.model.run_layers(self.model.embed(batch), batch)
        loss, aux_loss, logits = self.lm_head_outputs(run)
        output = Qwen3_5PackedCausalLMOutput(loss=loss, aux_loss=aux_loss, logits=logits, **run.caller_outputs())
        return output if returns_dict(self.config, return_dict) else output.to_tuple()


class Qwen3_5MoePackedForCausalLM(Qwen3_5PackedForCausalLM, GenerationMixin):
    # GenerationMixin named again among the bases, as transformers expects of every class that generates
    config_class = Qwen3_5MoePackedConfig


Qwen3_5PackedSequenceClassifierOutput = output_class(
    "Qwen3_5PackedSequenceClassifierOutput",
    "Sequence-classification output: `logits` [documents, num_labels], one row per document in stream order (for a "
    "padded batch with one document per row: one per row, like the built-in's [batch, num_labels]).",
    ["loss", "logits", CACHE_FIELD, "hidden_states", "attentions", "router_logits"],
    __name__,
)


def document_score_index(packed: PackedSequence, token_ids, pad_token_id) -> torch.Tensor:
    """The stream index [num_docs] of the token each document is scored at: its last real token, or with
    `pad_token_id` set and `token_ids` (the stream's, [N]) given, its last token whose id is not the pad id (its
    first token if all are).

    This is the built-in's rule (the rightmost non-pad token of a row) applied to each document: the same
    position as the built-in for any row whose pad positions hold the pad id, and for a packed row the position the
    built-in picks for each document alone. No host synchronisation."""
    starts = packed.cu_seqlens[:-1].long()
    if pad_token_id is None or token_ids is None:
        return packed.cu_seqlens[1:].long() - 1
    ids = token_ids
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
        self.score = RowInvariantLinear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Qwen3_5PackedCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        cache: Qwen3_5PackedCache | None = None,
        return_dict: bool | None = None,
        routed_experts: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Qwen3_5PackedSequenceClassifierOutput | tuple:
        """`labels`: one per document ([documents] or [documents, num_labels]), in the order of `logits`."""
        check_extra_arguments(kwargs)
        adopt_adapter_products(self)  # PEFT's LoRA wrappers: row-invariant products, the sum in place
        batch = self.model.open_batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            labels=None,  # document labels, not token targets
            shift_labels=kwargs.get("shift_labels"),
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            output_attentions=wants_attentions(self.config, kwargs.get("output_attentions")),
            cu_seqlens=cu_seqlens,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            routed_experts=routed_experts,
        )
        if batch.shard is not None:  # a document's score token may sit on another rank
            raise ValueError("sequence classification is not available under context parallelism")
        run = self.model.run_layers(self.model.embed(batch), batch)
        packed = batch.packed
        scored = document_score_index(packed, batch.token_ids, self.config.get_text_config().pad_token_id)
        logits = self.score(run.hidden.index_select(0, scored))
        loss = None
        if labels is not None:
            if (labels.shape[0] if labels.dim() else 1) != packed.num_docs:
                raise ValueError(
                    f"labels hold {labels.shape[0] if labels.dim() else 1} entries for {packed.num_docs} documents: "
                    "a sequence-classification head scores every document of the batch, labels need one per document"
                )
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        output = Qwen3_5PackedSequenceClassifierOutput(loss=loss, logits=logits, **run.caller_outputs())
        return output if returns_dict(self.config, return_dict) else output.to_tuple()


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
