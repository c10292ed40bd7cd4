"""Selective recompute (qwen35_packed/modeling/checkpoint_granularity.py): with `checkpoint_granularity` "mlp" or
"mixer", the backward of a checkpointed decoder layer reruns only that segment. Loss and gradients are bit for bit
those of whole-layer checkpointing and of none, with either use_reentrant, under LoRA, with router logits, attention
probabilities and routing replay crossing the segments; only the chosen segment reruns and only its activations
are dropped. At any granularity, and in layer pieces, no autograd node keeps a tensor outside its saved tensors."""

from __future__ import annotations

import collections
import contextlib
import weakref

import pytest
import torch
from conftest import (
    random_routed_experts,
    recorded_autograd_contexts,
    tensors_held_by_autograd_contexts,
    tiny_kwargs,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.modeling import kernel_selection

GRANULARITIES = ("layer", "mlp", "mixer")
# The submodules of a decoder layer each segment runs, by name.
SEGMENT_MODULES = {"mixer": ("input_layernorm", "linear_attn", "self_attn"), "mlp": ("post_attention_layernorm", "mlp")}


def _model(kind: str, **config_fields):
    """(model in training mode, its text config) for `kind`: dense or moe, `_lora` wrapped in PEFT LoRA on every
    group of the model (experts included) with non-zero B, so that every adapter gets a gradient; `config_fields`
    set on the MoE config."""
    torch.manual_seed(0)
    if kind.startswith("moe"):
        model = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), **config_fields))
    else:
        model = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**tiny_kwargs("dense")))
    config = model.config
    if kind.endswith("_lora"):
        from peft import get_peft_model

        from qwen35_packed.integrations.lora import lora_config

        model = get_peft_model(model, lora_config(model, r=4, lora_dropout=0.0))
        # The embeddings require grad, as trainers set them up for PEFT with checkpointing (transformers 5's
        # gradient_checkpointing_enable does it itself, 4.x only for adapters it loaded): with use_reentrant=True, a
        # layer checkpointed whole on a frozen input would give its adapters no gradient.
        model.enable_input_require_grads()
        torch.manual_seed(2)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
    return model.train(), config


def _inputs(config, extras: tuple[str, ...] = ()) -> dict:
    """A packed row of five documents, two of one token; `extras` ask for router logits, attention probabilities
    or replayed experts (one random top-k per token and MoE layer); "offloaded" is the step's."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 70, 1, 23, 1]
    ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = dict(input_ids=ids, cu_seqlens=cu, labels=ids)
    if "router_logits" in extras:
        inputs["output_router_logits"] = True
    if "attentions" in extras:
        inputs["output_attentions"] = True
    if "replay" in extras:
        inputs["routed_experts"] = random_routed_experts(config, ids.shape[1], g)
    return inputs


def _set_checkpointing(
    model, config, granularity: str | None, reentrant: bool = False, every_n_layers: int = 1
) -> None:
    """Checkpointing off (None) or on at `granularity`; `every_n_layers` > 1 checkpoints layers 0, n, 2n, ... only,
    through transformers' `activation_checkpointing_enable(every_n_layers=...)` (5.25 and later)."""
    if granularity is None:
        model.gradient_checkpointing_disable()
        return
    config.checkpoint_granularity = granularity  # read at every forward
    if every_n_layers == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.activation_checkpointing_enable({"use_reentrant": reentrant}, every_n_layers=every_n_layers)
    flags = [layer.gradient_checkpointing for layer in _decoder_layers(model)]
    assert flags == [index % every_n_layers == 0 for index in range(len(flags))], flags


def _decoder_layers(model) -> list:
    """The decoder layers of a model, PEFT-wrapped or not, in order."""
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def _step(model, config, inputs: dict, granularity: str | None, reentrant: bool, offloaded: bool = False):
    """One forward + backward -> (loss, {parameter: gradient}). The loss takes in the load-balancing term and a
    weighted sum of the attention probabilities where they were asked for, so that their gradients cross the
    segments too. `offloaded`: the forward under PyTorch's save_on_cpu (a caller's saved-tensors hooks, which see
    what the checkpoint keeps and the other segment's activations)."""
    _set_checkpointing(model, config, granularity, reentrant)
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.save_on_cpu() if offloaded else contextlib.nullcontext():
        out = model(**inputs)
    loss = out.loss
    if inputs.get("output_router_logits"):
        loss = loss + out.aux_loss
    for i, probabilities in enumerate(out.attentions or ()):
        weights = torch.rand(probabilities.shape, generator=torch.Generator().manual_seed(i))
        loss = loss + (probabilities * weights).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize(
    "kind, extras",
    [
        ("dense", ()),
        ("moe", ()),
        ("dense_lora", ()),
        ("moe_lora", ()),
        ("moe", ("router_logits",)),
        ("moe", ("replay", "router_logits")),
        ("dense", ("attentions",)),
        ("moe", ("offloaded",)),
    ],
    ids=["dense", "moe", "dense_lora", "moe_lora", "moe_router_logits", "moe_replay", "dense_attentions", "offloaded"],
)
def test_segment_checkpointing_gives_the_loss_and_gradients_of_whole_layers_and_of_none(kind, extras, reentrant):
    model, config = _model(kind)
    inputs = _inputs(config, extras)
    offloaded = "offloaded" in extras
    loss, grads = _step(model, config, inputs, None, reentrant)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(grads) == sorted(trainable) and len(grads) > 10  # every trainable parameter got a gradient
    for granularity in GRANULARITIES:
        checkpointed_loss, checkpointed = _step(model, config, inputs, granularity, reentrant, offloaded)
        assert torch.equal(checkpointed_loss, loss), granularity
        assert checkpointed.keys() == grads.keys(), granularity
        for name, grad in grads.items():
            assert torch.equal(checkpointed[name], grad), (granularity, name)


def _segment_modules(model, segments) -> list[tuple[int, str]]:
    """The submodules of `segments` in every decoder layer, as (layer, name), sorted."""
    return sorted(
        (index, name)
        for index, layer in enumerate(model.model.layers)
        for segment in segments
        for name in SEGMENT_MODULES[segment]
        if hasattr(layer, name)
    )


def _started_in_backward(
    model, config, granularity: str | None, reentrant: bool, every_n_layers: int = 1
) -> list[tuple[int, str]]:
    """The segments' submodules that started a forward during the backward, as (layer, name), sorted."""
    started, in_backward = [], False

    def record(key):
        def hook(*_):
            if in_backward:
                started.append(key)

        return hook

    layers = model.model.layers
    handles = [
        getattr(layers[index], name).register_forward_pre_hook(record((index, name)))
        for index, name in _segment_modules(model, SEGMENT_MODULES)
    ]
    _set_checkpointing(model, config, granularity, reentrant, every_n_layers)
    loss = model(**_inputs(config)).loss
    in_backward = True
    loss.backward()
    for handle in handles:
        handle.remove()
    return sorted(started)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_backward_reruns_the_chosen_segment_only(kind, reentrant):
    model, config = _model(kind)
    assert _started_in_backward(model, config, None, reentrant) == []
    rerun = {"layer": ("mixer", "mlp"), "mlp": ("mlp",), "mixer": ("mixer",)}
    for granularity, segments in rerun.items():
        # every submodule of the rerun segments once in each layer, nothing of the other
        assert _started_in_backward(model, config, granularity, reentrant) == _segment_modules(model, segments)


def _alive_between_forward_and_backward(
    model, config, granularity: str | None, reentrant: bool, every_n_layers: int = 1
) -> set[tuple]:
    """The outputs of the decoder layers' submodules still alive after the forward, as (layer, segment, name)."""
    outputs = []

    def record(key):
        def hook(module, args, out):
            outputs.extend((key, weakref.ref(t)) for t in (out if isinstance(out, tuple) else (out,)) if t is not None)

        return hook

    handles = []
    for index, layer in enumerate(model.model.layers):
        for segment, names in SEGMENT_MODULES.items():
            for name, module in layer.named_modules():
                if name.split(".")[0] in names:
                    handles.append(module.register_forward_hook(record((index, segment, name))))
    _set_checkpointing(model, config, granularity, reentrant, every_n_layers)
    loss = model(**_inputs(config)).loss
    for handle in handles:
        handle.remove()
    alive = {key for key, ref in outputs if ref() is not None}
    loss.backward()
    return alive


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_other_segment_keeps_its_activations_as_without_checkpointing(kind, reentrant):
    model, config = _model(kind)
    kept = _alive_between_forward_and_backward(model, config, None, reentrant)
    # the control: without checkpointing, outputs of both segments are kept for the backward
    assert {segment for _, segment, _ in kept} == {"mixer", "mlp"}, kept
    assert _alive_between_forward_and_backward(model, config, "layer", reentrant) == set()
    for granularity, other in (("mlp", "mixer"), ("mixer", "mlp")):
        alive = _alive_between_forward_and_backward(model, config, granularity, reentrant)
        assert alive == {key for key in kept if key[1] == other}, granularity


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_checkpointing_every_other_layer_reruns_those_and_the_others_recompute_their_chains(kind, reentrant):
    """transformers 5.25's `every_n_layers`: the layers left out run as without checkpointing, with their norm /
    SwiGLU / gate outputs recomputed in the backward (recompute.py), not kept; the loss and gradients stay bitwise."""
    model, config = _model(kind)
    if not hasattr(model, "activation_checkpointing_enable"):
        pytest.skip("transformers before 5.25 checkpoints every layer")
    inputs = _inputs(config)
    loss, grads = _step(model, config, inputs, None, reentrant)
    kept = _alive_between_forward_and_backward(model, config, None, reentrant)
    assert {layer for layer, _, _ in kept} == set(range(len(model.model.layers)))  # the control: every layer keeps
    rerun = {"layer": ("mixer", "mlp"), "mlp": ("mlp",), "mixer": ("mixer",)}
    for granularity, segments in rerun.items():
        _set_checkpointing(model, config, granularity, reentrant, every_n_layers=2)
        model.zero_grad(set_to_none=True)
        every_other_loss = model(**inputs).loss
        every_other_loss.backward()
        assert torch.equal(every_other_loss.detach(), loss), granularity
        for name, grad in grads.items():
            assert torch.equal(model.get_parameter(name).grad, grad), (granularity, name)
        started = _started_in_backward(model, config, granularity, reentrant, every_n_layers=2)
        assert started == [key for key in _segment_modules(model, segments) if key[0] % 2 == 0], granularity
        alive = _alive_between_forward_and_backward(model, config, granularity, reentrant, every_n_layers=2)
        # the checkpointed layers keep what their granularity keeps, the others what no checkpointing keeps
        assert alive == {
            (layer, segment, name)
            for layer, segment, name in kept
            if layer % 2 == 1 or (granularity != "layer" and segment not in segments)
        }, granularity


def test_without_checkpointing_or_without_gradients_the_granularity_changes_nothing():
    model, config = _model("moe")
    inputs = _inputs(config, ("router_logits",))
    loss, grads = _step(model, config, inputs, None, reentrant=False)
    with torch.no_grad():
        scored = model(**inputs).loss
    for granularity in ("mlp", "mixer"):
        config.checkpoint_granularity = granularity
        again_loss, again = _step(model, config, inputs, None, reentrant=False)
        assert torch.equal(again_loss, loss) and all(torch.equal(again[n], g) for n, g in grads.items())
        assert _started_in_backward(model, config, None, reentrant=False) == []
        _set_checkpointing(model, config, granularity)
        with torch.no_grad():
            assert torch.equal(model(**inputs).loss, scored)


def test_a_forward_without_gradients_never_calls_the_checkpoint_function():
    """Generation from a model in training mode with checkpointing on (GRPO without vLLM): nothing to rerun, so no
    layer goes through the checkpoint function, whatever the transformers version decides around it."""
    model, config = _model("dense")
    _set_checkpointing(model, config, "layer")
    calls = []
    for layer in model.model.layers:
        installed = layer.checkpoint_function
        layer.checkpoint_function = lambda *args, installed=installed, **kwargs: (
            calls.append(1) or installed(*args, **kwargs)
        )
    with torch.no_grad():
        model(**_inputs(config))
    assert calls == []
    model(**_inputs(config)).loss.backward()
    assert len(calls) == len(model.model.layers)


@pytest.mark.parametrize("config_class", [Qwen3_5PackedConfig, Qwen3_5MoePackedConfig])
def test_an_unknown_granularity_raises(config_class):
    kind = "moe" if config_class.is_moe else "dense"
    assert config_class(**tiny_kwargs(kind)).checkpoint_granularity == "layer"
    with pytest.raises(ValueError, match="checkpoint_granularity must be one of 'layer', 'mlp', 'mixer', got 'attn'"):
        config_class(**tiny_kwargs(kind), checkpoint_granularity="attn")


def test_an_unknown_granularity_set_on_a_loaded_model_raises_at_the_forward():
    model, config = _model("dense")
    _set_checkpointing(model, config, "layer")
    config.checkpoint_granularity = "block"
    with pytest.raises(ValueError, match="checkpoint_granularity must be one of"):
        model(**_inputs(config))


@pytest.mark.parametrize("granularity", ["mlp", "mixer"])
def test_save_and_load_keep_the_granularity(granularity, tmp_path):
    torch.manual_seed(0)
    config = Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), checkpoint_granularity=granularity)
    Qwen3_5MoePackedForCausalLM(config).save_pretrained(tmp_path)
    assert Qwen3_5MoePackedConfig.from_pretrained(tmp_path).checkpoint_granularity == granularity
    loaded = Qwen3_5MoePackedForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.checkpoint_granularity == granularity
    assert all(layer.granularity() == granularity for layer in loaded.model.layers)
    overridden = Qwen3_5MoePackedForCausalLM.from_pretrained(tmp_path, checkpoint_granularity="layer")
    assert all(layer.granularity() == "layer" for layer in overridden.model.layers)


@pytest.mark.parametrize(
    "kind, granularity, piece",
    [
        ("dense", "layer", None),
        ("moe", "layer", None),
        ("moe_lora", "layer", None),
        ("moe", "mlp", None),
        ("moe", "mixer", None),
        ("dense_lora", "layer", 64),
        ("moe_lora", "layer", 64),
    ],
)
def test_a_checkpointed_forward_leaves_tensors_in_no_autograd_node_outside_its_saved_tensors(kind, granularity, piece):
    """A checkpoint drops a node's saved tensors and remakes them in the backward, and activation offloading moves
    them to the host; a tensor a node (a custom autograd Function's context) holds as an attribute escapes both and
    lives until the whole graph is freed, so every layer's would be on the device at the end of the backward. The
    expert-row map of the MoE blocks was one (checked: the move's node holding it fails here)."""
    moe_kernel = "grouped_mm" if kernel_selection.grouped_mm_usable(torch.device("cpu"), torch.float32) else "loop"
    model, config = _model(kind, **({"moe_kernel": moe_kernel} if kind.startswith("moe") else {}))
    config.layer_token_chunk = piece
    _set_checkpointing(model, config, granularity)
    inputs = _inputs(config, ("replay",) if kind.startswith("moe") else ())
    with recorded_autograd_contexts() as created:
        out = model(**inputs)
    contexts, held = tensors_held_by_autograd_contexts(out.loss)
    # the walk from the loss reaches every context the forward created (the GPU test relies on the recording)
    assert contexts == collections.Counter(type(node).__name__ for node in created), dict(contexts)
    projection = "AdapterSumProductBackward" if kind.endswith("lora") else "RowInvariantProductBackward"
    expected = {"_ChunkedLinearCrossEntropyBackward", projection}
    if kind.startswith("moe") and moe_kernel == "grouped_mm":
        expected.add("_MoveBackward")
    assert expected <= set(contexts), f"the walk missed Functions the model ran: {dict(contexts)}"
    assert not held, [path for path, _ in held]
    out.loss.backward()
