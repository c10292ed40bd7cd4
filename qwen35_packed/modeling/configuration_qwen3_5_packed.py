"""Configuration of the packed-varlen Qwen3.5 text models (dense and MoE).

This file is remote code: it is copied flat into model folders next to the modeling files, so it imports only
the standard library, transformers and its sibling `utils.py`.

Rope has one source of truth, resolved once in `resolve_rope_parameters`:
  * transformers v5 writes `rope_parameters` = {rope_type, rope_theta, partial_rotary_factor, mrope_section,
    mrope_interleaved};
  * transformers v4 (and many third-party readers) use top-level `rope_theta`, `partial_rotary_factor` and a
    `rope_scaling` dict (which carries `mrope_section` / `mrope_interleaved` for multimodal rope).
Every source that is present must agree; a value given twice with different numbers raises ValueError. The
resolved values are stored in `rope_parameters` *and* mirrored to the legacy top-level keys, so a v4-style reader
(`getattr(config, "rope_theta", 1e6)`) sees the same theta as a v5 reader; the saved config.json carries
`rope_scaling` too. When no rope key is present at all the
official Qwen3.5 values are used and a warning says so once.
"""

from __future__ import annotations

import inspect
import logging

import transformers
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .utils import log_once, same_value

logger = logging.getLogger(__name__)

# The values every official Qwen3.5 checkpoint carries (text_config.rope_parameters).
QWEN3_5_ROPE_DEFAULTS = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
_ROPE_KEYS = tuple(QWEN3_5_ROPE_DEFAULTS)

LAYER_TYPES = ("linear_attention", "full_attention")
# model_type of the official composite (vision-language) configs, whose `text_config` is a text config.
COMPOSITE_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def text_config_dict(config_dict: dict) -> dict:
    """The text model's part of a config.json: `text_config` of a composite one, with the top-level fields that
    speak for the text model (`tie_word_embeddings`, which the composite model ties by, and the writer's
    `transformers_version`, which `resolve_rope_parameters` reads); any other dict unchanged."""
    text = config_dict.get("text_config")
    if config_dict.get("model_type") not in COMPOSITE_MODEL_TYPES or not isinstance(text, dict):
        return config_dict
    text = dict(text)
    if "tie_word_embeddings" in config_dict:
        text["tie_word_embeddings"] = config_dict["tie_word_embeddings"]
    if "transformers_version" in config_dict:
        text.setdefault("transformers_version", config_dict["transformers_version"])
    return text


# Project-only kernel choices (modeling/kernel_selection.py) and the values each accepts.
KERNEL_FIELDS = {
    "gdn_kernel": ("auto", "flash_qla", "fla", "torch"),
    "conv_kernel": ("auto", "fla", "triton", "compiled", "torch"),
    "attention_kernel": ("auto", "flash_attn", "torch_varlen", "sdpa"),
    # how a document of at least kernel_selection.LONG_DOCUMENT_TOKENS runs its attention: with the others through the varlen
    # kernel, or alone through SDPA
    "long_document_attention": ("auto", "varlen", "sdpa"),
    "elementwise_kernel": ("auto", "triton", "eager"),
    "moe_kernel": ("auto", "grouped_mm", "loop"),  # read by MoE models only
    "moe_combine_kernel": ("auto", "triton", "eager"),  # read by MoE models only: the grouped experts' top-k combine
    "moe_lora_kernel": ("auto", "low_rank", "peft"),  # read by MoE models only: PEFT LoRA on the experts
}
# The delta rule's chunk (FLA's, FlashQLA's and the reference's): gdn_token_chunk pieces start on its boundaries.
GDN_CHUNK_TOKENS = 64
# What the backward of a checkpointed decoder layer recomputes (modeling/checkpoint_granularity.py).
CHECKPOINT_GRANULARITIES = ("layer", "mlp", "mixer")


def _delta_rule_pieces(name: str, tokens):
    """A config's piece length that cuts documents for the delta rule: None (off) or a positive multiple of
    GDN_CHUNK_TOKENS, so that every piece starts on a chunk boundary of its document."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
                               or tokens % GDN_CHUNK_TOKENS):  # fmt: skip
        raise ValueError(
            f"{name} must be None or a positive multiple of {GDN_CHUNK_TOKENS} tokens (the delta rule's chunk), got "
            f"{tokens!r}"
        )
    return tokens


def _written_by_transformers_5(writer_version) -> bool:
    try:
        return int(str(writer_version).split(".")[0]) >= 5
    except ValueError:
        return False


def resolve_rope_parameters(
    rope_parameters: dict | None = None,
    rope_scaling: dict | None = None,
    rope_theta: float | None = None,
    partial_rotary_factor: float | None = None,
    writer_version: str | None = None,
) -> dict:
    """Merge every rope source into one dict; raise ValueError on any contradiction.

    Sources, all optional: the v5 `rope_parameters` dict, the v4 `rope_scaling` dict (its legacy `type` key is read
    as `rope_type`), and top-level `rope_theta` / `partial_rotary_factor`.

    One exception, with a one-time warning: in a config.json written by transformers 5 (`writer_version`, its
    `transformers_version`) a top-level `partial_rotary_factor` that contradicts `rope_parameters` is ignored, as
    transformers 5 itself reads it: some 5.x releases save the class default there (0.25 next to the 0.5 of
    `rope_parameters` that the model uses).
    """
    stated = rope_parameters.get("partial_rotary_factor") if isinstance(rope_parameters, dict) else None
    if (
        _written_by_transformers_5(writer_version)
        and None not in (stated, partial_rotary_factor)
        and not same_value(stated, partial_rotary_factor)
    ):
        log_once(
            logger,
            "ignored-partial-rotary-factor",
            "config.json written by transformers %s has top-level partial_rotary_factor=%r but rope_parameters says "
            "%r; transformers 5 reads rope_parameters, so %r is used.",
            writer_version,
            partial_rotary_factor,
            stated,
            stated,
        )
        partial_rotary_factor = None
    merged: dict = {}
    origin: dict = {}

    def put(key, value, source):
        if value is None:
            return
        if key in merged and not same_value(merged[key], value):
            raise ValueError(
                f"Contradicting rope values: {key}={merged[key]!r} from {origin[key]} but {key}={value!r} from "
                f"{source}. Remove one of them or make them equal; this project never picks one silently."
            )
        merged.setdefault(key, value)
        origin.setdefault(key, source)

    for source_name, source in (("rope_parameters", rope_parameters), ("rope_scaling", rope_scaling)):
        if source is None:
            continue
        if not isinstance(source, dict):
            raise ValueError(f"{source_name} must be a dict, got {type(source).__name__}")
        for key, value in source.items():
            if key == "type":  # v4 spelling of rope_type
                key = "rope_type"
            if key == "rope_type" and value == "mrope":
                # v4 configs call it "mrope": the default inverse-frequency rope with sections, so it agrees with a
                # v5 "default" given beside it
                value = "default"
            if key in ("mrope_section",) and value is not None:
                value = [int(v) for v in value]
            put(key, value, source_name)
    put("rope_theta", rope_theta, "top-level rope_theta")
    put("partial_rotary_factor", partial_rotary_factor, "top-level partial_rotary_factor")

    if "rope_theta" not in merged and merged:
        log_once(
            logger,
            "rope-default",
            "No rope_theta in the config (neither rope_parameters, rope_scaling nor top-level rope_theta); "
            "using the official Qwen3.5 value %s.",
            QWEN3_5_ROPE_DEFAULTS["rope_theta"],
        )
    for key in _ROPE_KEYS:
        merged.setdefault(key, QWEN3_5_ROPE_DEFAULTS[key])
    supported = ("default", *ROPE_INIT_FUNCTIONS)
    if merged["rope_type"] not in supported:
        raise ValueError(
            f"rope_type {merged['rope_type']!r} is not one of the rope types transformers "
            f"{transformers.__version__} implements: {', '.join(supported)}"
        )
    merged["rope_theta"] = float(merged["rope_theta"])
    merged["partial_rotary_factor"] = float(merged["partial_rotary_factor"])
    if len(merged["mrope_section"]) != 3:
        raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {merged['mrope_section']}")
    return merged


class Qwen3_5PackedConfig(PretrainedConfig):
    """Text configuration of the dense Qwen3.5 models (`model_type` `qwen3_5_text`, as vLLM requires).

    Reads every field of the official `text_config`; every field is a parameter of `__init__` of its own (tools,
    transformers' model testers among them, build configs from the signature), with the defaults of the built-in
    `Qwen3_5TextConfig` / `Qwen3_5MoeTextConfig` (so the same keyword arguments give the same model; the MoE ones are
    Qwen3.5-35B-A3B's), except `max_position_embeddings`: 262,144 as in every official checkpoint. Fields the
    built-in classes ignore are honoured here:
    `attn_output_gate` (False gives a q_proj without the gate half), `mlp_only_layers` (MoE only: dense MLP
    layers), `mrope_interleaved`.

    `return_logits_with_loss` decides whether a forward with `labels` also returns the logits (detached,
    [batch, seq, vocab] in the compute dtype): "auto" (default) returns them in eval mode and not in training mode,
    where trainers read the loss only; True always (transformers' contract); False never. Where they are not kept
    the loss and gradients are the same, [tokens x vocab] is never materialised, and `logits` holds a
    `LogitsNotKept` placeholder that raises on use (modeling/loss.py).

    `checkpoint_granularity` decides what the backward of a decoder layer recomputes once
    `gradient_checkpointing_enable()` checkpoints it: "layer" (default) the whole layer, as transformers does; "mlp"
    only the post-attention norm and the MLP / MoE block; "mixer" only the input norm and the token mixer (Gated
    DeltaNet or attention). The other part keeps its activations. Without checkpointing it changes nothing
    (modeling/checkpoint_granularity.py).

    `gdn_token_chunk` (None: off; a multiple of 64, the delta rule's chunk) runs each Gated DeltaNet layer's delta
    rule over a document longer than that in pieces of that many tokens, one after another, each starting from the
    state the one before reached: the chunk states of a long document, and their gradients, live one piece at a time.
    A piece starts on a chunk boundary, so each piece runs the chunks the whole document runs (gated_deltanet.py);
    where FlashQLA is the GDN kernel, the pieces after the first run FLA's (FlashQLA takes no gradient into an initial
    state). Training and scoring forwards only: not with a cache, not under context parallelism (which splits the
    document across ranks already).

    `layer_token_chunk` (None: off; a multiple of 64) runs every decoder layer over a stream longer than that in
    pieces of about that many tokens, one after another: whole documents grouped up to that length, and a longer
    document cut at multiples of it from its start. A piece's Gated DeltaNet continues the conv inputs and the state
    its document's piece before left, its attention reads that piece's keys and values too; norms and the MLP / MoE
    block are per token. Under `gradient_checkpointing_enable()` each piece is checkpointed (the layer is not, as a
    whole), so a layer's activations live one piece at a time in the forward and in the backward. Training and
    scoring forwards only: not with a cache, under context parallelism, with holes in the attention mask or with
    output_attentions (said once; modeling/layer_pieces.py).
    """

    model_type = "qwen3_5_text"
    keys_to_ignore_at_inference = ["past_key_values"]
    # The built-in's tensor-parallel plan (same module names). The GDN projections gather their outputs, so every
    # rank runs the whole recurrence, as in the built-in.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.linear_attn.in_proj_qkv": "colwise_gather_output",
        "layers.*.linear_attn.in_proj_z": "colwise_gather_output",
        "layers.*.linear_attn.in_proj_b": "colwise_gather_output",
        "layers.*.linear_attn.in_proj_a": "colwise_gather_output",
        "layers.*.linear_attn.out_proj": "colwise_gather_output",
    }
    # transformers v5 validates rope dicts; the multimodal-rope keys are ours to read.
    ignore_keys_at_rope_validation = {"mrope_section", "mrope_interleaved"}
    is_moe = False

    def __init__(
        self,
        vocab_size: int = 248320,
        hidden_size: int = 4096,
        intermediate_size: int | None = 12288,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 4,
        head_dim: int = 256,
        hidden_act: str = "silu",
        max_position_embeddings: int = 262144,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        attn_output_gate: bool = True,
        linear_conv_kernel_dim: int = 4,
        linear_key_head_dim: int = 128,
        linear_value_head_dim: int = 128,
        linear_num_key_heads: int = 16,
        linear_num_value_heads: int = 32,
        layer_types: list[str] | None = None,
        full_attention_interval: int | None = None,
        rope_parameters: dict | None = None,
        rope_scaling: dict | None = None,
        rope_theta: float | None = None,
        partial_rotary_factor: float | None = None,
        gdn_kernel: str = "auto",
        attention_kernel: str = "auto",
        long_document_attention: str = "auto",
        elementwise_kernel: str = "auto",
        return_logits_with_loss: bool | str = "auto",
        checkpoint_granularity: str = "layer",
        gdn_token_chunk: int | None = None,
        layer_token_chunk: int | None = None,
        conv_kernel: str = "auto",
        moe_kernel: str = "auto",
        moe_combine_kernel: str = "auto",
        moe_lora_kernel: str = "auto",
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.attn_output_gate = attn_output_gate
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        # Kernel selection ("auto" picks the fastest exact path for the device; see modeling/kernel_selection.py).
        self.gdn_kernel = gdn_kernel
        self.attention_kernel = attention_kernel
        self.long_document_attention = long_document_attention
        self.elementwise_kernel = elementwise_kernel
        self.return_logits_with_loss = return_logits_with_loss
        self.checkpoint_granularity = checkpoint_granularity
        self.gdn_token_chunk = _delta_rule_pieces("gdn_token_chunk", gdn_token_chunk)
        self.layer_token_chunk = _delta_rule_pieces("layer_token_chunk", layer_token_chunk)
        self.conv_kernel = conv_kernel
        self.moe_kernel = moe_kernel
        self.moe_combine_kernel = moe_combine_kernel
        self.moe_lora_kernel = moe_lora_kernel

        if layer_types is None:
            interval = 4 if full_attention_interval is None else int(full_attention_interval)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_hidden_layers)
            ]
        elif full_attention_interval is not None:
            expected = [
                "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                for i in range(num_hidden_layers)
            ]
            if list(layer_types) != expected:
                raise ValueError(
                    f"layer_types contradicts full_attention_interval={full_attention_interval}: {layer_types}"
                )
        self.layer_types = list(layer_types)
        self.full_attention_interval = full_attention_interval

        rope = resolve_rope_parameters(
            rope_parameters,
            rope_scaling,
            rope_theta,
            partial_rotary_factor,
            writer_version=kwargs.get("transformers_version"),
        )
        self.rope_parameters = rope
        # Legacy mirrors for v4-style readers (getattr(config, "rope_theta", default)).
        self.rope_theta = rope["rope_theta"]
        self.partial_rotary_factor = rope["partial_rotary_factor"]

        self._init_moe_fields(kwargs)
        self.validate_layout()
        self._check_mrope_section()
        self._check_scaled_rope()  # before transformers 5's base __init__, whose own check raises a KeyError
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        # transformers v5's base __init__ may re-standardise rope; re-assert the single resolved dict.
        self.rope_parameters = rope
        # Attributes even when unset, as the built-in text configs have them (generation utilities read them);
        # set after the base __init__, which on transformers 4.x resets them to None unless found in kwargs.
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id

    def _check_mrope_section(self) -> None:
        """Interleaved sections (Qwen3.5's layout) that do not sum to the rotary half-dim: the built-in reads them
        whatever their sum, and so does this model (modeling/rope.py, the same frequencies), so they are accepted
        as the built-in accepts them, with a one-time warning (it usually means a config written for another head
        size). Contiguous ones that do not cover it raise in `validate_layout`. The official default [11, 11, 10],
        which a config without sections gets and saves, passes without a warning."""
        half = self.rotary_dim // 2
        sections = list(self.rope_parameters["mrope_section"])
        if sections == QWEN3_5_ROPE_DEFAULTS["mrope_section"] or sum(sections) == half:
            return
        log_once(
            logger,
            ("mrope_section", tuple(sections), half),
            "mrope_section %s does not sum to the rotary half-dim %d (head_dim %d x partial_rotary_factor %s / 2); "
            "read interleaved, as the built-in reads it",
            sections,
            half,
            self.head_dim,
            self.rope_parameters["partial_rotary_factor"],
        )

    def _check_scaled_rope(self) -> None:
        """Scaled rope types read their parameters through transformers' own functions (modeling/rope.py): run
        them once here, so that a missing or bad parameter is an error when the config is read."""
        rope = self.rope_parameters
        if rope["rope_type"] == "default":
            return
        if rope["rope_type"] in ("llama3", "yarn", "longrope"):
            # what transformers 5 fills in (standardize_rope_params), kept in the file for every reader
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        if not isinstance(getattr(type(self), "rope_scaling", None), property):
            # transformers 4's rope functions read `rope_scaling`, and longrope a top-level
            # `original_max_position_embeddings`
            self.rope_scaling = rope
            if "original_max_position_embeddings" in rope:
                self.original_max_position_embeddings = rope["original_max_position_embeddings"]
        try:
            ROPE_INIT_FUNCTIONS[rope["rope_type"]](self, "cpu")
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(
                f"rope_type {rope['rope_type']!r} with rope parameters {rope} cannot be computed by "
                f"transformers {transformers.__version__}: {type(err).__name__}: {err}"
            ) from err

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        # A composite (vision-language) folder loads into the text classes as its text model.
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        return text_config_dict(config_dict), kwargs

    def _init_moe_fields(self, kwargs: dict) -> None:
        """Dense models carry no MoE fields; the MoE subclass overrides this (it takes its fields out of `kwargs`)."""

    def validate_layout(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"Unknown layer types {unknown}; expected {LAYER_TYPES}")
        rotary_dim = int(self.head_dim * self.rope_parameters["partial_rotary_factor"])
        if rotary_dim % 2:
            raise ValueError(f"rotary dim head_dim * partial_rotary_factor = {rotary_dim} must be even")
        # Interleaved sections are read as the built-in reads them, whatever their sum; contiguous ones (a layout
        # only this project implements) must cover the rotary half-dim exactly.
        if not self.rope_parameters["mrope_interleaved"] and sum(self.rope_parameters["mrope_section"]) != (
            rotary_dim // 2
        ):
            raise ValueError(
                f"mrope_section {self.rope_parameters['mrope_section']} must sum to the rotary half-dim "
                f"{rotary_dim // 2} (head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.rope_parameters['partial_rotary_factor']} / 2) when mrope_interleaved is False"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.attention_dropout:
            raise ValueError(
                f"attention_dropout={self.attention_dropout} is not supported: the varlen attention kernels run "
                "without dropout (every official Qwen3.5 config has 0.0)"
            )
        if not (isinstance(self.return_logits_with_loss, bool) or self.return_logits_with_loss == "auto"):
            raise ValueError(
                f"return_logits_with_loss must be 'auto', True or False, got {self.return_logits_with_loss!r}"
            )
        if self.checkpoint_granularity not in CHECKPOINT_GRANULARITIES:
            raise ValueError(
                f"checkpoint_granularity must be one of {', '.join(map(repr, CHECKPOINT_GRANULARITIES))}, got "
                f"{self.checkpoint_granularity!r}"
            )
        for field_name, allowed in KERNEL_FIELDS.items():
            if getattr(self, field_name) not in allowed:
                raise ValueError(
                    f"{field_name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, field_name)!r}"
                )

    def to_dict(self) -> dict:
        # Every rope form in the saved config.json, as `convert` writes it, so that a reader of either major
        # transformers version sees the same values: 5.x reads `rope_parameters` (its `rope_scaling` is an unsaved
        # alias), 4.x-style readers `rope_scaling` and the top-level keys.
        output = super().to_dict()
        output["rope_scaling"] = dict(self.rope_parameters)
        return output

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters["partial_rotary_factor"])

    def layer_uses_moe(self, layer_idx: int) -> bool:
        return False


# The fields only the MoE models have, with the built-in `Qwen3_5MoeTextConfig`'s defaults (Qwen3.5-35B-A3B's) and
# their annotations, and the dense fields whose MoE default is Qwen3.5-35B-A3B's shape: the MoE config's parameters
# are the dense config's with these (`_moe_init_signature`).
MOE_FIELDS = {
    "num_experts": (256, "int"),
    "num_experts_per_tok": (8, "int"),
    "moe_intermediate_size": (512, "int"),
    "shared_expert_intermediate_size": (512, "int"),
    "mlp_only_layers": (None, "list[int] | None"),
    "output_router_logits": (False, "bool"),
    "router_aux_loss_coef": (0.001, "float"),
    "moe_token_chunk": (None, "int | None"),
}
MOE_SHAPE_DEFAULTS = {"hidden_size": 2048, "intermediate_size": None, "num_hidden_layers": 40, "num_key_value_heads": 2}


def _moe_init_signature() -> inspect.Signature:
    """The dense config's `__init__` signature with the MoE shape defaults, and the MoE fields after the model's
    other fields, before the kernel choices."""
    dense = [
        parameter.replace(default=MOE_SHAPE_DEFAULTS.get(parameter.name, parameter.default))
        for parameter in inspect.signature(Qwen3_5PackedConfig.__init__).parameters.values()
    ]
    first_kernel = next(i for i, parameter in enumerate(dense) if parameter.name in KERNEL_FIELDS)
    moe = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)
        for name, (default, annotation) in MOE_FIELDS.items()
    ]
    return inspect.Signature([*dense[:first_kernel], *moe, *dense[first_kernel:]])


_MOE_INIT_SIGNATURE = _moe_init_signature()


class Qwen3_5MoePackedConfig(Qwen3_5PackedConfig):
    """Text configuration of the MoE Qwen3.5 models (`model_type` `qwen3_5_moe_text`): the dense configuration's
    fields, with Qwen3.5-35B-A3B's shape as defaults, and the MoE fields (`MOE_FIELDS`).

    `router_aux_loss_coef` is kept as given, but the load-balancing loss is only added to the loss when the
    caller asks for router logits (`output_router_logits=True`) *and* the coefficient is > 0: RL must not get it
    by accident.

    `moe_token_chunk` (None: off) runs each MoE block over the packed stream in chunks of that many tokens, each
    chunk's activations recomputed in the backward: a long document's expert rows (k per token) then live one chunk
    at a time, for one more forward of the MoE block per step. On CUDA in bf16 each token's outputs are the same
    bits whatever the chunking (every op of the block is row-invariant there); weight gradients are summed chunk by
    chunk (modeling/moe.py).
    """

    model_type = "qwen3_5_moe_text"
    is_moe = True
    # The dense plan for attention, GDN and the shared expert. The routed experts stay replicated (no expert-parallel
    # plan either): the built-in's expert plans hook its own experts module, whose interface this project's grouped
    # experts do not share, so they are not claimed (transformers refuses an expert-parallel load without a plan).
    base_model_tp_plan = {
        **{k: v for k, v in Qwen3_5PackedConfig.base_model_tp_plan.items() if ".mlp." not in k},
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    }

    def __init__(self, *args, **kwargs):
        # Every field is a parameter of the signature (tools, transformers' model testers among them, build a config
        # from it); bound with its defaults, the dense __init__ gets every field, the MoE ones through
        # `_init_moe_fields`.
        bound = _MOE_INIT_SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        fields = dict(bound.arguments)
        del fields["self"]
        extra = fields.pop("kwargs")
        super().__init__(**fields, **extra)

    __init__.__signature__ = _MOE_INIT_SIGNATURE

    def _init_moe_fields(self, kwargs: dict) -> None:
        # every MoE field is there: __init__ binds them with their defaults
        self.num_experts = int(kwargs.pop("num_experts"))
        self.num_experts_per_tok = int(kwargs.pop("num_experts_per_tok"))
        self.moe_intermediate_size = int(kwargs.pop("moe_intermediate_size"))
        self.shared_expert_intermediate_size = int(kwargs.pop("shared_expert_intermediate_size"))
        self.mlp_only_layers = list(kwargs.pop("mlp_only_layers") or [])
        self.output_router_logits = bool(kwargs.pop("output_router_logits"))
        coef = kwargs.pop("router_aux_loss_coef")
        if isinstance(coef, bool) or not isinstance(coef, (int, float)):
            raise ValueError(f"router_aux_loss_coef must be a number, got {coef!r} ({type(coef).__name__})")
        self.router_aux_loss_coef = float(coef)
        chunk = kwargs.pop("moe_token_chunk")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"moe_token_chunk must be None or a positive number of tokens, got {chunk!r}")
        self.moe_token_chunk = chunk

    def validate_layout(self) -> None:
        super().validate_layout()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts], got {self.num_experts_per_tok}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers names layers that do not exist: {bad}")
        if self.mlp_only_layers and not self.intermediate_size:
            raise ValueError("mlp_only_layers needs intermediate_size for its dense MLP layers")

    def layer_uses_moe(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers


__all__ = ["Qwen3_5PackedConfig", "Qwen3_5MoePackedConfig", "resolve_rope_parameters", "QWEN3_5_ROPE_DEFAULTS"]
