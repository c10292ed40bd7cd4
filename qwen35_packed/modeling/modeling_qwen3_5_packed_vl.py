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

import dataclasses
import logging

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from . import context_parallel  # called through the module: tests swap its functions for planted faults

# transformers 4.x copies into its module cache only the files this module names in its own `from .name import`
# lines, not the ones those import: every file of the text model is named here too (the imports marked
# `noqa: F401`), so that a folder loads with a fresh cache (tests/conversion/test_remote_code_audit.py checks the list).
from .attention import GatedAttention  # noqa: F401
from .attention_probabilities import stream_attention_probabilities  # noqa: F401
from .cache import Qwen3_5PackedCache  # noqa: F401
from .causal_lm_head import LM_HEAD_TP_PLAN, PackedCausalLMHead
from .checkpoint_keys import IGNORED_UNEXPECTED_EXPERT_KEYS, from_official_layout
from .configuration_qwen3_5_packed import Qwen3_5PackedConfig  # noqa: F401
from .configuration_qwen3_5_packed_vl import Qwen3_5MoePackedVLConfig, Qwen3_5PackedVLConfig
from .context_parallel import shard_packed_row  # noqa: F401
from .conv_lora import effective_conv  # noqa: F401
from .expert_lora import ExpertWeight  # noqa: F401
from .gated_deltanet import GatedDeltaNet  # noqa: F401
from .kernel_selection import bound_kernels  # noqa: F401
from .kernels import varlen_causal_attention  # noqa: F401
from .loss import chunked_linear_cross_entropy  # noqa: F401
from .model_conventions import PackedModelConventions, init_dense_weights
from .modeling_qwen3_5_packed import Qwen3_5MoePackedTextModel, Qwen3_5PackedTextModel
from .moe import SparseMoeBlock  # noqa: F401
from .mrope_positions import IMAGE, TEXT, VIDEO, modality_of_tokens, packed_mrope_positions
from .norms import ZeroCenteredRMSNorm  # noqa: F401
from .numerics import enable_numerics_check  # noqa: F401
from .outputs import CACHE_FIELD, DecoderRun, output_class
from .packed_batch import (
    VISION_ARGUMENTS,
    VL_CAUSAL_LM_PARAMETERS,
    VL_MODEL_PARAMETERS,
    PackedBatch,
    public_forward,
    returns_dict,
)
from .packing import PackedSequence  # noqa: F401
from .projection import RowInvariantLinear
from .recompute import recompute_enabled  # noqa: F401
from .reference_kernels import torch_gated_delta_rule_varlen  # noqa: F401
from .rope import MRotaryEmbedding  # noqa: F401
from .routing_replay import routed_experts_stream  # noqa: F401
from .triton_conv import TRITON_CONV_AVAILABLE  # noqa: F401
from .triton_elementwise import TRITON_ELEMENTWISE_AVAILABLE  # noqa: F401
from .triton_gather_sum import TRITON_GATHER_SUM_AVAILABLE  # noqa: F401
from .triton_support import INTERPRETED  # noqa: F401
from .utils import TRANSFORMERS_MAJOR, log_once
from .vision import Qwen3_5PackedVisionModel

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
        arguments = (pixel_values, grid_thw, self.config.text_config, output_hidden_states, output_attentions)
        if getattr(self.config, "freeze_vision", False):
            with torch.no_grad():
                return self.visual(*arguments)
        return self.visual(*arguments)

    def placeholder_ids(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """long [...] for embeddings [..., H]: the image / video token id where an embedding equals that token's
        embedding, -1 elsewhere (enough to locate images and videos and compute their positions)."""
        table = self.get_input_embeddings()
        ids = torch.full(inputs_embeds.shape[:-1], -1, dtype=torch.long, device=inputs_embeds.device)
        for token in (self.config.image_token_id, self.config.video_token_id):
            embedding = table(torch.tensor(token, device=inputs_embeds.device)).to(inputs_embeds.dtype)
            ids[(inputs_embeds == embedding).all(-1)] = token
        return ids

    def dummy_vision_output(self, device) -> torch.Tensor:
        """The vision tower on one all-zero image of merge x merge patches (the FSDP-symmetric pass)."""
        merge = self.visual.spatial_merge_size
        grid = torch.tensor([[1, merge, merge]], device=device)
        pixels = torch.zeros(merge * merge, self.visual.patch_embed.patch_dim, device=device)
        return self.encode_vision(pixels, grid).pooler_output

    def run(self, arguments: dict) -> DecoderRun:
        """A forward's decoder part: the front door (the text model's: without use_cache, a cache in eval mode for
        one document per row, as the built-in makes one by its config's use_cache), then
        a generation step's new text tokens, or the prefill's embeddings with the vision features and 3D rope."""
        text = self.language_model
        batch = text.open_batch(arguments)
        pixel_values, pixel_values_videos = arguments["pixel_values"], arguments["pixel_values_videos"]
        if batch.continues_cache:
            if pixel_values is not None or pixel_values_videos is not None:
                raise ValueError("images and videos go into the prefill; a cached step takes new text tokens only")
            positions = batch.packed.position_ids.unsqueeze(0).expand(3, -1)  # text: one position on every axis
            batch = dataclasses.replace(batch, rope_positions=positions)
            return text.run_layers(text.embed(batch, arguments), batch)

        image_grid_thw, video_grid_thw = arguments["image_grid_thw"], arguments["video_grid_thw"]
        for pixels, grid, what in (
            (pixel_values, image_grid_thw, "image"),
            (pixel_values_videos, video_grid_thw, "video"),
        ):
            pixel_name = "pixel_values" if what == "image" else "pixel_values_videos"
            if (pixels is None) != (grid is None):
                given, missing = (pixel_name, f"{what}_grid_thw") if grid is None else (f"{what}_grid_thw", pixel_name)
                raise ValueError(f"{given} was given without {missing}; {what}s need both")
        has_vision = pixel_values is not None or pixel_values_videos is not None
        input_ids, inputs_embeds = arguments["input_ids"], arguments["inputs_embeds"]
        # Without input_ids the placeholder tokens are found by their embedding, as the built-in does; the 3D
        # positions are then computed from them exactly as from input_ids.
        layout_ids = input_ids if input_ids is not None or not has_vision else self.placeholder_ids(inputs_embeds)
        packed, shard = batch.packed, batch.shard
        ids = packed.pack(layout_ids) if layout_ids is not None else None
        # the token ids packed once: for the embeddings and for the layout
        embeds = text.embed_tokens(ids) if input_ids is not None else packed.pack(inputs_embeds)
        if ids is not None:
            types = None
            if arguments["mm_token_type_ids"] is not None:
                mm = torch.as_tensor(arguments["mm_token_type_ids"], device=ids.device)
                if tuple(mm.shape) != packed.batch_shape:
                    raise ValueError(
                        f"mm_token_type_ids must have the shape of input_ids {packed.batch_shape}, got "
                        f"{tuple(mm.shape)}"
                    )
                types = packed.pack(mm)
            row_cu_seqlens = packed.cu_seqlens
            if shard is not None:
                # Under context parallelism the layout (modalities, 3D positions, which image a placeholder shows)
                # is the whole row's: computed on the gathered row, then this shard's part is taken.
                ids, types, row_cu_seqlens = context_parallel.gather_row_tokens(ids, types, packed, shard)
            # Which tokens are vision tokens: a placeholder id typed text by mm_token_type_ids is a text token.
            kind = modality_of_tokens(ids, self.config.image_token_id, self.config.video_token_id, types)
            if image_grid_thw is None and video_grid_thw is None and bool((kind != TEXT).any()):
                # No images or videos given: the built-in embeds placeholder tokens as the text tokens they are and
                # positions them as text; so do we, and say so once.
                log_once(
                    logger,
                    "placeholders-as-text",
                    "image / video placeholder tokens without pixel inputs (no image_grid_thw / video_grid_thw) are "
                    "embedded and positioned as text tokens, as transformers' Qwen3.5 does",
                )
                kind = torch.full_like(kind, TEXT)
            # Also the check that image/video token runs match the grids one to one, in order.
            positions = packed_mrope_positions(
                ids,
                row_cu_seqlens,
                image_grid_thw,
                video_grid_thw,
                image_token_id=self.config.image_token_id,
                video_token_id=self.config.video_token_id,
                spatial_merge_size=self.visual.spatial_merge_size,
                mm_token_type_ids=kind,
            )
            if shard is not None:
                positions = positions[:, shard.offset : shard.offset + packed.num_tokens]
        else:
            text_positions = batch.rope_positions  # the row's positions under context parallelism too
            positions = text_positions.unsqueeze(0).expand(3, -1) if text_positions.dim() == 1 else None
        position_ids = arguments["position_ids"]
        if position_ids is not None and torch.as_tensor(position_ids).ndim == 3:  # the caller's 3D positions
            positions = batch.rope_positions

        # The tower records its hidden states / attention outputs when the forward records the text layers' or
        # the vision config asks (the built-in's tower reads the forward's switches, else its own config).
        vision_config = self.config.vision_config
        record_hidden = batch.output_hidden_states or bool(getattr(vision_config, "output_hidden_states", False))
        record_attentions = arguments["output_attentions"] or bool(getattr(vision_config, "output_attentions", False))
        encoder_outputs = {}
        for pixels, grid, modality, name in (
            (pixel_values, image_grid_thw, IMAGE, "image"),
            (pixel_values_videos, video_grid_thw, VIDEO, "video"),
        ):
            if pixels is None:
                continue
            # Under context parallelism every rank encodes all the row's images and keeps the features of its
            # shard's placeholders (the vision tower is small next to the decoder).
            grid = torch.as_tensor(grid, device=pixels.device)
            encoded = self.encode_vision(pixels, grid, record_hidden, record_attentions)
            features = encoded.pooler_output
            # The caller sees the features per image / video, as the built-in splits them (views, no copy).
            tokens_per_item = (grid.prod(-1) // self.visual.spatial_merge_size**2).tolist()
            encoded.pooler_output = torch.split(features, tokens_per_item)
            encoder_outputs[name] = encoded
            slots = torch.nonzero(kind == modality).flatten()
            if shard is not None:
                slots, features = context_parallel.shard_slots(slots, features, shard, packed.num_tokens)
            if slots.numel() != features.shape[0]:  # guaranteed by the checks above; a last line of defence
                raise ValueError(f"{slots.numel()} placeholder tokens but {features.shape[0]} vision features")
            embeds = embeds.index_copy(0, slots, features.to(device=embeds.device, dtype=embeds.dtype))
        if not has_vision and getattr(self.config, "vision_dummy_pass", False):
            dummy = self.dummy_vision_output(embeds.device)
            embeds = embeds + (dummy.sum() * 0.0).to(embeds.dtype)

        # The text decoder runs on this forward's packing directly (one packing step, boundaries copied to the host
        # at most once), with the 3D rope positions.
        run = text.run_layers(embeds, dataclasses.replace(batch, rope_positions=positions))
        run.encoder_outputs = encoder_outputs
        if batch.cache is not None:
            # Text after the prompt continues at its largest position + 1.
            last = torch.zeros(packed.num_docs, dtype=positions.dtype, device=positions.device).scatter_reduce(
                0, packed.doc_index(), positions.amax(dim=0), reduce="amax"
            )
            batch.cache.position_offset = last + 1 - packed.doc_lengths().to(last.dtype)
        return run

    @public_forward(VL_MODEL_PARAMETERS)
    def forward(self, arguments: dict):
        run = self.run(arguments)
        output = Qwen3_5PackedVLModelOutput(
            last_hidden_state=run.batch.packed.unpack(run.hidden),
            rope_position_ids=_unpack_positions(run.batch),
            image_outputs=run.encoder_outputs.get("image"),
            video_outputs=run.encoder_outputs.get("video"),
            **run.caller_outputs(),
        )
        return output if returns_dict(self.config, arguments) else output.to_tuple()


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
class Qwen3_5PackedForConditionalGeneration(PackedCausalLMHead, Qwen3_5PackedVLPreTrainedModel, GenerationMixin):
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

    @public_forward(VL_CAUSAL_LM_PARAMETERS)
    def forward(self, arguments: dict):
        run = self.model.run(arguments)
        loss, aux_loss, logits = self.lm_head_outputs(run, arguments)
        output = Qwen3_5PackedVLCausalLMOutput(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            rope_position_ids=_unpack_positions(run.batch),
            image_outputs=run.encoder_outputs.get("image"),
            video_outputs=run.encoder_outputs.get("video"),
            **run.caller_outputs(),
        )
        return output if returns_dict(self.config, arguments) else output.to_tuple()

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

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs):
        """The text model's inputs; images, videos and their token types go into the prefill only. `inputs_embeds`
        is named: generate() reads this signature to decide whether a model can start from embeddings."""
        vision = {name: kwargs.pop(name, None) for name in VISION_ARGUMENTS}
        inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs, **vision)
        if CACHE_FIELD in inputs:
            for name in VISION_ARGUMENTS:
                inputs.pop(name, None)
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
