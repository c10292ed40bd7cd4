"""Packed-varlen Qwen3.5 vision-language models: `Qwen3_5PackedForConditionalGeneration` (dense) and
`Qwen3_5MoePackedForConditionalGeneration` (MoE).

Remote code: imports only torch, transformers and sibling files. State-dict keys and shapes are those of
transformers' `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` (`model.visual.*`,
`model.language_model.*`, `lm_head`); the architecture names differ on purpose (see modeling_qwen3_5_packed.py).

A forward resolves the batch into one packed stream of real tokens with document boundaries (the packing contract
of packing.py, every entry form), then:
  1. encodes all images (and videos) of all documents in one vision-tower call (`pixel_values` /
     `image_grid_thw` in the order the images appear in the batch, row by row);
  2. computes 3D rope positions on the packed stream (mrope_positions.py): they restart per document, image
     tokens get grid positions, text after an image continues after it; 3D `position_ids` given by the caller
     are used as given instead;
  3. writes the image features onto the image placeholder tokens of the stream (the i-th image onto the i-th run
     of image tokens, so features land on their own documents);
  4. runs the packed text decoder (`Qwen3_5PackedTextModel.run_layers`) on the embeddings with those positions
     and boundaries, and computes logits / loss per document.
The outputs carry the vision tower's outputs as the built-in's do (`image_outputs` / `video_outputs`: vision.py
says which fields; `pooler_output` split per image / video), None where the forward encoded none.
Text-only batches need no pixel values. See configuration_qwen3_5_packed_vl.py for `freeze_vision` and
`vision_dummy_pass` (the FSDP-symmetric vision pass on ranks without images).
"""

from __future__ import annotations

import logging

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .adapter_products import adopt_adapter_products

# transformers 4.x copies into its module cache only the files this module names in its own `from .name import`
# lines, not the ones those import: every file of the text model is named here too (the imports marked
# `noqa: F401`), so that a folder loads with a fresh cache (tests/conversion/test_remote_code_audit.py checks the list).
from .attention import GatedAttention  # noqa: F401
from .attention_probabilities import stream_attention_probabilities  # noqa: F401
from .cache import Qwen3_5PackedCache  # noqa: F401
from .causal_lm_head import LM_HEAD_TP_PLAN, PackedCausalLMHead
from .checkpoint_granularity import SegmentCheckpointing  # noqa: F401
from .checkpoint_keys import IGNORED_UNEXPECTED_EXPERT_KEYS, from_official_layout
from .configuration_qwen3_5_packed import Qwen3_5PackedConfig  # noqa: F401
from .configuration_qwen3_5_packed_vl import Qwen3_5MoePackedVLConfig, Qwen3_5PackedVLConfig
from .context_parallel import shard_packed_row  # noqa: F401
from .conv_lora import effective_conv  # noqa: F401
from .decode_graph import decode_step_outputs
from .expert_lora import ExpertWeight  # noqa: F401
from .gated_deltanet import GatedDeltaNet  # noqa: F401
from .generation import PackedGeneration
from .kernel_selection import select_kernels  # noqa: F401
from .kernel_set import kernel_set  # noqa: F401
from .kernels import causal_attention  # noqa: F401
from .layer_pieces import run_in_pieces  # noqa: F401
from .loss import chunked_linear_cross_entropy  # noqa: F401
from .model_conventions import PackedModelConventions, init_dense_weights
from .modeling_qwen3_5_packed import Qwen3_5MoePackedTextModel, Qwen3_5PackedTextModel
from .moe import SparseMoeBlock  # noqa: F401
from .mrope_positions import IMAGE, VIDEO, modality_of_tokens
from .norms import ZeroCenteredRMSNorm  # noqa: F401
from .numerics import enable_numerics_check  # noqa: F401
from .outputs import CACHE_FIELD, DecoderRun, output_class
from .packed_batch import (
    VISION_ARGUMENTS,
    PackedBatch,
    check_extra_arguments,
    open_packed_batch,
    returns_dict,
    wants_attentions,
)
from .packing import PackedSequence  # noqa: F401
from .projection import RowInvariantLinear
from .recompute import recompute_enabled  # noqa: F401
from .reference_kernels import torch_gated_delta_rule_varlen  # noqa: F401
from .rope import MRotaryEmbedding  # noqa: F401
from .routing_replay import routed_experts_stream  # noqa: F401
from .triton_conv import TRITON_CONV_AVAILABLE  # noqa: F401
from .triton_decode import TRITON_DECODE_AVAILABLE  # noqa: F401
from .triton_elementwise import TRITON_ELEMENTWISE_AVAILABLE  # noqa: F401
from .triton_gather_sum import TRITON_GATHER_SUM_AVAILABLE  # noqa: F401
from .triton_support import INTERPRETED  # noqa: F401
from .utils import TRANSFORMERS_MAJOR, TransformersKwargs, Unpack
from .vision import Qwen3_5PackedVisionModel
from .vision_layout import VisionInputs, placeholder_ids, scatter_features

logger = logging.getLogger(__name__)

Qwen3_5PackedVLModelOutput = output_class(
    "Qwen3_5PackedVLModelOutput",
    "Decoder output in the caller's layout (pad positions are zeros), router_logits included; rope_position_ids: "
    "the 3D positions used, [3, batch, seq] (zeros at pad positions); `attentions`: the attention "
    "probabilities of the text layers (one per full-attention layer, with output_attentions; attention_probabilities.py); "
    "image_outputs / video_outputs: the vision tower's outputs for the images / videos encoded (vision.py).",
    [
        "last_hidden_state",
        CACHE_FIELD,
        "hidden_states",
        "attentions",
        "router_logits",
        "rope_position_ids",
        "image_outputs",
        "video_outputs",
    ],
    __name__,
)
Qwen3_5PackedVLCausalLMOutput = output_class(
    "Qwen3_5PackedVLCausalLMOutput",
    "Causal-LM output in the caller's layout; aux_loss is set when router logits were requested. "
    "rope_position_ids: the 3D positions used, [3, batch, seq] (zeros at pad positions); `attentions`: the attention "
    "probabilities of the text layers (one per full-attention layer, with output_attentions; attention_probabilities.py); "
    "image_outputs / video_outputs: the vision tower's outputs for the images / videos encoded (vision.py).",
    [
        "loss",
        "aux_loss",
        "logits",
        CACHE_FIELD,
        "hidden_states",
        "attentions",
        "router_logits",
        "rope_position_ids",
        "image_outputs",
        "video_outputs",
    ],
    __name__,
)


class Qwen3_5PackedVLPreTrainedModel(PackedModelConventions, PreTrainedModel):
    config_class = Qwen3_5PackedVLConfig
    _no_split_modules = ["Qwen3_5PackedDecoderLayer", "Qwen3_5PackedVisionBlock"]
    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", *IGNORED_UNEXPECTED_EXPERT_KEYS]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # Experts fused or per expert, every parameter accounted for: checkpoint_keys.py.
        result = from_official_layout(cls, super().from_pretrained, pretrained_model_name_or_path, args, kwargs, None)
        # Loading replaces the parameters (requires_grad back to True): re-apply freeze_vision afterwards.
        model = result[0] if isinstance(result, tuple) else result
        if getattr(model.config, "freeze_vision", False):
            model.set_vision_frozen(True)
        return result

    def _init_weights(self, module):
        # The vision tower and the text decoder are PreTrainedModels that initialise their own modules;
        # what is left here is lm_head.
        init_dense_weights(module, self.config.text_config.initializer_range)


class Qwen3_5PackedVLModel(Qwen3_5PackedVLPreTrainedModel):
    """`model`: the vision tower (`visual`) and the packed text decoder (`language_model`)."""

    def __init__(self, config):
        super().__init__(config)
        self.visual = Qwen3_5PackedVisionModel(config.vision_config)
        text_model = Qwen3_5MoePackedTextModel if config.text_config.is_moe else Qwen3_5PackedTextModel
        self.language_model = text_model(config.text_config)
        if config.vision_config.out_hidden_size != config.text_config.hidden_size:
            raise ValueError(
                f"vision_config.out_hidden_size={config.vision_config.out_hidden_size} must equal "
                f"text_config.hidden_size={config.text_config.hidden_size}"
            )
        self.post_init()
        if getattr(config, "freeze_vision", False):
            self.set_vision_frozen(True)

    def get_input_embeddings(self):
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value):
        self.language_model.embed_tokens = value

    def set_vision_frozen(self, frozen: bool = True) -> None:
        """Freeze (or unfreeze) the vision tower: no gradients for its parameters, and it runs without autograd."""
        self.config.freeze_vision = bool(frozen)
        self.visual.requires_grad_(not frozen)

    def encode_vision(
        self,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> BaseModelOutputWithPooling:
        """All images (or videos) of the batch in one vision-tower call; `pooler_output`: [placeholder tokens,
        text hidden]."""
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        # the text model's kernel set for the tower's device and dtype: its varlen attention runs the images
        attention = self.language_model.kernels_for(pixel_values.device, pixel_values.dtype).varlen_attention
        arguments = (pixel_values, grid_thw, attention, output_hidden_states, output_attentions)
        if getattr(self.config, "freeze_vision", False):
            with torch.no_grad():
                return self.visual(*arguments)
        return self.visual(*arguments)

    def placeholder_ids(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """long [...] for embeddings [..., H]: the image / video token id where an embedding equals that token's
        embedding, -1 elsewhere (enough to locate images and videos and compute their positions)."""
        return placeholder_ids(
            self.get_input_embeddings(), inputs_embeds, self.config.image_token_id, self.config.video_token_id
        )

    def dummy_vision_output(self, device) -> torch.Tensor:
        """The vision tower on one all-zero image of merge x merge patches (the FSDP-symmetric pass)."""
        merge = self.visual.spatial_merge_size
        grid = torch.tensor([[1, merge, merge]], device=device)
        pixels = torch.zeros(merge * merge, self.visual.patch_embed.patch_dim, device=device)
        return self.encode_vision(pixels, grid).pooler_output

    def open_batch(
        self,
        *,
        pixel_values=None,
        pixel_values_videos=None,
        image_grid_thw=None,
        video_grid_thw=None,
        mm_token_type_ids=None,
        **inputs,
    ) -> PackedBatch:
        """The front door (packed_batch.open_packed_batch) for the text decoder, with the vision inputs laid out
        there (vision_layout.py): which tokens show which image or video, the 3D rope positions. Without use_cache a cache is made in eval mode for one document per
        row, as the built-in makes one by its config's use_cache."""
        vision = VisionInputs(
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
            image_token_id=self.config.image_token_id,
            video_token_id=self.config.video_token_id,
            spatial_merge_size=self.visual.spatial_merge_size,
        )
        return open_packed_batch(self.language_model, **inputs, vision=vision)

    def run(self, batch: PackedBatch) -> DecoderRun:
        """A forward's decoder part on its batch: the embeddings with the encoded images and videos written onto
        their placeholder tokens, then the text decoder with the 3D rope positions."""
        text = self.language_model
        embeds = text.embed(batch)
        # The tower records its hidden states / attention outputs when the forward records the text layers' or
        # the vision config asks (the built-in's tower reads the forward's switches, else its own config).
        vision_config = self.config.vision_config
        record_hidden = batch.output_hidden_states or bool(getattr(vision_config, "output_hidden_states", False))
        record_attentions = batch.output_attentions or bool(getattr(vision_config, "output_attentions", False))
        encoder_outputs = {}
        for pixels, grid, modality, name in batch.vision.items:
            encoded = self.encode_vision(pixels, grid, record_hidden, record_attentions)
            features = encoded.pooler_output
            # The caller sees the features per image / video, as the built-in splits them (views, no copy).
            tokens_per_item = (grid.prod(-1) // self.visual.spatial_merge_size**2).tolist()
            encoded.pooler_output = torch.split(features, tokens_per_item)
            encoder_outputs[name] = encoded
            embeds = scatter_features(embeds, batch.vision, modality, features, batch.packed, batch.shard)
        if not batch.vision.items and not batch.continues_cache and getattr(self.config, "vision_dummy_pass", False):
            dummy = self.dummy_vision_output(embeds.device)
            embeds = embeds + (dummy.sum() * 0.0).to(embeds.dtype)

        run = text.run_layers(embeds, batch)
        run.encoder_outputs = encoder_outputs
        if batch.cache is not None and not batch.continues_cache:
            # Text after the prompt continues at its largest position + 1.
            packed, positions = batch.packed, batch.rope_positions
            last = torch.zeros(packed.num_docs, dtype=positions.dtype, device=positions.device).scatter_reduce(
                0, packed.doc_index(), positions.amax(dim=0), reduce="amax"
            )
            batch.cache.position_offset = last + 1 - packed.doc_lengths().to(last.dtype)
        return run

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Qwen3_5PackedCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.FloatTensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        cache: Qwen3_5PackedCache | None = None,
        routed_experts: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Qwen3_5PackedVLModelOutput | tuple:
        check_extra_arguments(kwargs)
        adopt_adapter_products(self)  # PEFT's LoRA wrappers: row-invariant products, the sum in place
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
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
        )
        run = self.run(batch)
        output = Qwen3_5PackedVLModelOutput(
            last_hidden_state=batch.packed.unpack(run.hidden),
            rope_position_ids=_unpack_positions(batch),
            image_outputs=run.encoder_outputs.get("image"),
            video_outputs=run.encoder_outputs.get("video"),
            **run.caller_outputs(),
        )
        return output if returns_dict(self.config, return_dict) else output.to_tuple()


class Qwen3_5MoePackedVLModel(Qwen3_5PackedVLModel):
    config_class = Qwen3_5MoePackedVLConfig


def repeat_vision_per_row(
    pixels: torch.Tensor, grid_thw, tokens_per_row: torch.Tensor, expand_size: int, spatial_merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels, grid_thw) with each row's images (or videos) repeated `expand_size` times as a group, for rows
    repeated `expand_size` times each. Images are assigned to rows in order by their placeholder-token counts
    (`tokens_per_row`, long [rows]); a count that does not split into whole images raises."""
    grid = torch.as_tensor(grid_thw, device=pixels.device)
    patches = grid.prod(-1)
    tokens = (patches // spatial_merge_size**2).tolist()
    first_patch = [0, *torch.cumsum(patches, 0).tolist()]
    pixel_index, grid_index, image = [], [], 0
    for row, wanted in enumerate(tokens_per_row.tolist()):
        row_images = []
        while wanted > 0 and image < len(tokens):
            row_images.append(image)
            wanted -= tokens[image]
            image += 1
        if wanted != 0:
            raise ValueError(
                f"row {row}'s image / video placeholder tokens do not match the grids in order: cannot repeat its "
                "images for num_beams / num_return_sequences"
            )
        row_patches = [p for i in row_images for p in range(first_patch[i], first_patch[i + 1])]
        pixel_index += row_patches * expand_size
        grid_index += row_images * expand_size
    if image != len(tokens):
        raise ValueError(f"{len(tokens) - image} images / videos have no placeholder tokens in the rows")
    pixel_index = torch.tensor(pixel_index, dtype=torch.long, device=pixels.device)
    grid_index = torch.tensor(grid_index, dtype=torch.long, device=grid.device)
    return pixels.index_select(0, pixel_index), grid.index_select(0, grid_index)


def _unpack_positions(batch: PackedBatch) -> torch.Tensor:
    """The 3D rope positions used, [3, batch, seq] in the caller's layout (zeros at pad positions)."""
    return torch.stack([batch.packed.unpack(p) for p in batch.rope_positions])


# GenerationMixin: generate() with this model's own cache (the prefill encodes the images, later steps add text);
# TRL's GRPOTrainer also reads the `generation_config` transformers gives only to models that can generate.
class Qwen3_5PackedForConditionalGeneration(
    PackedCausalLMHead, PackedGeneration, Qwen3_5PackedVLPreTrainedModel, GenerationMixin
):
    config_class = Qwen3_5PackedVLConfig
    _tied_weights_keys = (
        {"lm_head.weight": "model.language_model.embed_tokens.weight"}
        if TRANSFORMERS_MAJOR >= 5
        else ["lm_head.weight"]
    )
    _tp_plan = LM_HEAD_TP_PLAN

    def __init__(self, config):
        super().__init__(config)
        self.model = (Qwen3_5MoePackedVLModel if config.text_config.is_moe else Qwen3_5PackedVLModel)(config)
        self.lm_head = RowInvariantLinear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    @property
    def visual(self):
        return self.model.visual

    @property
    def language_model(self):
        return self.model.language_model

    def set_vision_frozen(self, frozen: bool = True) -> None:
        self.model.set_vision_frozen(frozen)

    def get_input_embeddings(self):
        return self.model.language_model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.language_model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model.language_model

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Qwen3_5PackedCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.FloatTensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        cache: Qwen3_5PackedCache | None = None,
        routed_experts: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Qwen3_5PackedVLCausalLMOutput | tuple:
        check_extra_arguments(kwargs)
        adopt_adapter_products(self)  # PEFT's LoRA wrappers: row-invariant products, the sum in place
        cache = cache if cache is not None else past_key_values
        asked = dict(
            labels=labels,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            use_cache=use_cache,
            routed_experts=routed_experts,
            output_attentions=kwargs.get("output_attentions"),
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            others=(kwargs.get("shift_labels"), cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, seq_idx, pixel_values,
                    pixel_values_videos, image_grid_thw, video_grid_thw, mm_token_type_ids),
        )  # fmt: skip
        step = decode_step_outputs(
            self, cache, input_ids, attention_mask, logits_to_keep, asked, ("logits", "rope_position_ids")
        )
        if step is not None:  # a decode step of a static cache, replayed as a CUDA graph (decode_graph.py)
            output = Qwen3_5PackedVLCausalLMOutput(**step, **{CACHE_FIELD: cache})
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
            output_attentions=wants_attentions(self.config, kwargs.get("output_attentions")),
            logits_to_keep=logits_to_keep,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            cu_seqlens=cu_seqlens,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            routed_experts=routed_experts,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
        )
        run = self.model.run(batch)
        loss, aux_loss, logits = self.lm_head_outputs(run)
        output = Qwen3_5PackedVLCausalLMOutput(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            rope_position_ids=_unpack_positions(batch),
            image_outputs=run.encoder_outputs.get("image"),
            video_outputs=run.encoder_outputs.get("video"),
            **run.caller_outputs(),
        )
        return output if returns_dict(self.config, return_dict) else output.to_tuple()

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        # generate() repeats batch-first tensors per beam / returned sequence (row i becomes rows i*k .. i*k+k-1);
        # pixel values and grids are image-first (the images of all rows in one tensor), so each row's images are
        # repeated as a group instead, in the same row order, as transformers does for the built-in's encoded images.
        vision = {}
        if expand_size > 1 and any(model_kwargs.get(k) is not None for k in ("pixel_values", "pixel_values_videos")):
            rows = input_ids if input_ids is not None and input_ids.shape[-1] > 0 else None
            if rows is None:
                rows = self.model.placeholder_ids(model_kwargs["inputs_embeds"])
            kind = modality_of_tokens(
                rows, self.config.image_token_id, self.config.video_token_id, model_kwargs.get("mm_token_type_ids")
            )
            for pixels_key, grid_key, modality in (
                ("pixel_values", "image_grid_thw", IMAGE),
                ("pixel_values_videos", "video_grid_thw", VIDEO),
            ):
                pixels, grid = model_kwargs.pop(pixels_key, None), model_kwargs.pop(grid_key, None)
                if pixels is not None and grid is not None:
                    pixels, grid = repeat_vision_per_row(
                        pixels, grid, (kind == modality).sum(-1), expand_size, self.model.visual.spatial_merge_size
                    )
                vision.update({pixels_key: pixels, grid_key: grid})
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs
        )
        return input_ids, {**model_kwargs, **vision}

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, static_cache_capacity=None, **kwargs):
        """The text model's inputs; images, videos and their token types go into the prefill only. `inputs_embeds`
        and `static_cache_capacity` are named: generate() reads this signature to decide whether a model can start
        from embeddings and which model kwargs it takes."""
        vision = {name: kwargs.pop(name, None) for name in VISION_ARGUMENTS}
        inputs = super().prepare_inputs_for_generation(
            input_ids, inputs_embeds=inputs_embeds, static_cache_capacity=static_cache_capacity, **kwargs, **vision
        )
        cache = inputs.get(CACHE_FIELD)
        if cache is not None and cache.has_state:  # a cached step: the prefill took the images
            for name in VISION_ARGUMENTS:
                inputs.pop(name, None)
            return inputs
        types, ids = inputs.get("mm_token_type_ids"), inputs.get("input_ids")
        if types is not None and ids is not None and types.shape[1] < ids.shape[1]:
            # A prefill with generated tokens after the prompt (assisted decoding's drafts): text, type 0.
            inputs["mm_token_type_ids"] = torch.nn.functional.pad(types, (0, ids.shape[1] - types.shape[1]))
        return inputs


# GenerationMixin named directly: transformers' Auto classes otherwise wrap a remote class in a copy that adds it
# (`add_generation_mixin_to_remote_model`), so the loaded model would not be an instance of this class.
class Qwen3_5MoePackedForConditionalGeneration(Qwen3_5PackedForConditionalGeneration, GenerationMixin):
    config_class = Qwen3_5MoePackedVLConfig


__all__ = [
    "Qwen3_5MoePackedForConditionalGeneration",
    "Qwen3_5MoePackedVLModel",
    "Qwen3_5PackedForConditionalGeneration",
    "Qwen3_5PackedVLModel",
    "Qwen3_5PackedVLPreTrainedModel",
]
