"""Decoder layers in pieces of tokens (qwen35_packed/modeling/layer_pieces.py, the config's `layer_token_chunk`): how a
stream is cut; the logits and loss of whole layers, and gradients as close to the exact ones as whole layers' (the
state, conv inputs, keys and values a cut document's pieces pass on carry their gradients back), with and without
checkpointing, with replayed experts and with PEFT LoRA on the conv; packed == per-document with pieces; a
checkpointed layer's activations exist one piece at a time in the forward and in the backward; forwards the pieces
do not serve run whole and say so once; the setting is checked and saved."""

import pytest
import torch
from conftest import packed_model, random_routed_experts, tiny_kwargs, training_step

from qwen35_packed import Qwen3_5PackedConfig
from qwen35_packed.modeling import utils
from qwen35_packed.modeling.layer_pieces import stream_pieces
from qwen35_packed.modeling.packing import build_packed_sequence

# Longer than a piece of 64 (200 by more than three pieces), exactly one piece, short ones to group.
LENGTHS = [200, 5, 130, 64, 65, 1, 30, 40]
PIECE = 64


def _bounds(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_whole_documents_are_grouped_and_longer_ones_cut_from_their_start():
    packed = build_packed_sequence((1, sum(LENGTHS)), torch.device("cpu"), cu_seqlens=_bounds(LENGTHS))
    pieces = stream_pieces(packed, PIECE)
    described = [(p.start, p.end, (p.packed.cu_seqlens_cpu().diff()).tolist(), p.prefix, p.continues) for p in pieces]
    assert described == [
        (0, 64, [64], 0, True),  # the 200-token document: three pieces of 64 and its last 8
        (64, 128, [64], 64, True),
        (128, 192, [64], 128, True),
        (192, 200, [8], 192, False),
        (200, 205, [5], 0, False),  # 5 alone: the next document is cut
        (205, 269, [64], 0, True),
        (269, 333, [64], 64, True),
        (333, 335, [2], 128, False),
        (335, 399, [64], 0, False),  # exactly one piece: whole
        (399, 463, [64], 0, True),
        (463, 464, [1], 64, False),
        (464, 495, [1, 30], 0, False),  # grouped up to 64 tokens
        (495, 535, [40], 0, False),
    ]
    assert stream_pieces(packed, PIECE) is pieces  # built once per stream: every layer shares them
    assert [p.cuts_document for p in pieces] == [True] * 4 + [False] + [True] * 3 + [False] + [True] * 2 + [False] * 2


def _inputs(model, replay: bool) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (1, sum(LENGTHS)), generator=g)
    inputs = dict(input_ids=ids, cu_seqlens=_bounds(LENGTHS), labels=ids, use_cache=False)
    if getattr(model.config, "is_moe", False):
        inputs["output_router_logits"] = True
    if replay:
        inputs["routed_experts"] = random_routed_experts(model.config, ids.shape[1], g)
    return inputs


def _step(model, piece, inputs, checkpointing: bool):
    """(logits, router logits or None, loss, gradients) of one training step with layer_token_chunk=piece."""
    out, grads = training_step(model, inputs, checkpointing, layer_token_chunk=piece, return_logits_with_loss=True)
    router = None if out.router_logits is None else torch.stack(out.router_logits).detach()
    return out.logits.detach(), router, out.loss.detach(), grads


def _model(kind: str, setup: str, dtype=torch.float32):
    if setup != "conv_lora":
        return packed_model(kind).to(dtype).train()
    peft = pytest.importorskip("peft")
    # head dims of 16: 64 conv channels, PEFT's smallest conv rank (a multiple of the conv's groups)
    base = packed_model(kind, linear_key_head_dim=16, linear_value_head_dim=16)
    config = peft.LoraConfig(r=64, lora_alpha=128, target_modules=["conv1d", "in_proj_qkv", "q_proj"])
    wrapped = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    return wrapped.to(dtype).train()


@pytest.mark.parametrize(
    "kind, setup",
    [("dense", "plain"), ("dense", "checkpointed"), ("dense", "conv_lora"), ("moe", "checkpointed"), ("moe", "replay")],
)
def test_layers_in_pieces_give_whole_layers_outputs_and_gradients(kind, setup):
    """The logits, router logits and loss of whole layers within fp32 rounding (a piece's tensors are other tensors
    than the whole stream's, and the CPU rounds a few of their rows differently; the MoE's CPU expert products also
    round by their row counts), and every gradient as close to the fp64 model's as the whole layers' gradients are:
    a gradient that missed the path through the carried state, conv inputs, keys or values would be off by far
    more."""
    checkpointing = setup != "plain"
    model = _model(kind, setup)
    inputs = _inputs(model, replay=setup == "replay")
    whole = _step(model, None, inputs, checkpointing)
    pieces = _step(model, PIECE, inputs, checkpointing)
    exact = _step(_model(kind, setup, torch.float64), None, inputs, checkpointing)[3]
    for ours, theirs in zip(pieces[:3], whole[:3]):
        if theirs is None:
            assert ours is None
        else:
            assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    assert pieces[3].keys() == whole[3].keys() == exact.keys() and len(exact) > 10
    for name, ref in exact.items():
        whole_error = (whole[3][name].double() - ref).norm()
        assert (pieces[3][name].double() - ref).norm() <= 4 * whole_error + 1e-6 * ref.norm(), name


def test_packed_equals_per_document_with_pieces():
    """Where a document is cut depends on its own length: packed with others or alone, its logits are the same bits."""
    model = packed_model("dense")
    model.config.layer_token_chunk = PIECE
    ids = torch.randint(3, model.config.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(6))
    bounds = _bounds(LENGTHS).tolist()
    with torch.no_grad():
        packed = model(input_ids=ids, cu_seqlens=_bounds(LENGTHS), use_cache=False).logits[0]
        for start, end in zip(bounds[:-1], bounds[1:]):
            alone = model(input_ids=ids[:, start:end], use_cache=False).logits[0]
            assert torch.equal(packed[start:end], alone), (start, end)


def _rows_through(model, step) -> list[int]:
    """The row counts of every call of a GDN layer's in_proj_qkv and the attention layer's q_proj while `step()`
    runs (forward, and the backward's recompute)."""
    rows = []
    hooks = [
        module.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
        for name, module in model.named_modules()
        if name.endswith(("linear_attn.in_proj_qkv", "self_attn.q_proj"))
    ]
    try:
        step()
    finally:
        for hook in hooks:
            hook.remove()
    return rows


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_checkpointed_layer_holds_one_pieces_activations_at_a_time(kind):
    """With checkpointing each piece is checkpointed and the layer is not: the projections run on at most one piece's
    rows, once per piece in the forward and once in the backward (a whole-layer checkpoint around them would rerun
    them a third time); without pieces they run on the whole stream."""
    model = packed_model(kind).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = _inputs(model, replay=False)
    mixers = sum(1 for name, _ in model.named_modules() if name.endswith(("linear_attn", "self_attn")))
    model.config.layer_token_chunk = None
    assert _rows_through(model, lambda: model(**inputs).loss.backward()) == [sum(LENGTHS)] * 2 * mixers
    model.config.layer_token_chunk = PIECE
    rows = _rows_through(model, lambda: model(**inputs).loss.backward())
    pieces = stream_pieces(build_packed_sequence((1, sum(LENGTHS)), torch.device("cpu"), cu_seqlens=_bounds(LENGTHS)), PIECE)  # fmt: skip
    assert max(rows) == PIECE
    assert len(rows) == 2 * len(pieces) * mixers
    assert sum(rows) == 2 * sum(LENGTHS) * mixers


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_what_a_checkpointed_piece_saves_no_other_piece_saves(kind, monkeypatch):
    """What a checkpointed piece saves for the backward (its rows, what the piece before handed on) shares no
    storage with the layer's input or with what another piece saves: TRL's activation offloading moves a storage to
    the host once and keeps any further tensor of it on the device, so views of the layer's input, or keys handed to
    every later piece, would stay there for every layer."""
    from qwen35_packed.modeling import layer_pieces

    model = packed_model(kind).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.layer_token_chunk = PIECE
    saved, carried_count = [], []

    def recording(function, rows, *carried, **options):
        saved.extend(t.untyped_storage().data_ptr() for t in (rows, *carried))
        carried_count.append(len(carried))
        return torch.utils.checkpoint.checkpoint(function, rows, *carried, **options)

    inputs = []  # the layers' inputs, kept alive so that no saved tensor can take an address of theirs
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    monkeypatch.setattr(layer_pieces, "checkpoint", recording)
    model(**_inputs(model, replay=False)).loss.backward()
    pieces = len(stream_pieces(build_packed_sequence((1, sum(LENGTHS)), torch.device("cpu"), cu_seqlens=_bounds(LENGTHS)), PIECE))  # fmt: skip
    assert len(carried_count) == pieces * model.config.num_hidden_layers and any(carried_count)
    # every saved tensor in a storage of its own (each alive until the backward: no address reused)
    assert len(set(saved)) == len(saved) and not set(saved) & {t.untyped_storage().data_ptr() for t in inputs}


def test_a_forward_with_a_cache_or_attention_probabilities_runs_whole_layers_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(utils, "_logged_once", set())
    model = packed_model("dense")
    model.config.layer_token_chunk = PIECE
    ids = torch.randint(3, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(7))
    layers = model.config.num_hidden_layers
    with torch.no_grad(), caplog.at_level("WARNING"):
        assert _rows_through(model, lambda: model(input_ids=ids, use_cache=True)) == [150] * layers
        assert "layer_token_chunk: a forward with a cache runs every decoder layer whole" in caplog.text
        caplog.clear()
        model(input_ids=ids, use_cache=True)
        assert "layer_token_chunk" not in caplog.text  # said once
        run = lambda: model(input_ids=ids, use_cache=False, output_attentions=True)  # noqa: E731
        assert _rows_through(model, run) == [150] * layers
        assert "layer_token_chunk: output_attentions runs every decoder layer whole" in caplog.text
        holes = torch.ones(1, 150, dtype=torch.long)
        holes[0, 70:75] = 0
        run = lambda: model(input_ids=ids, attention_mask=holes, use_cache=False)  # noqa: E731
        assert max(_rows_through(model, run)) > PIECE
        assert "layer_token_chunk: an attention mask with holes runs every decoder layer whole" in caplog.text


@pytest.mark.parametrize("value", [0, 100, -64, True, "64"])
def test_layer_token_chunk_must_be_a_positive_multiple_of_the_chunk(value):
    with pytest.raises(ValueError, match="layer_token_chunk must be None or a positive multiple of 64"):
        Qwen3_5PackedConfig(**tiny_kwargs("dense"), layer_token_chunk=value)


def test_layer_token_chunk_is_saved_and_loaded(tmp_path):
    Qwen3_5PackedConfig(**tiny_kwargs("dense"), layer_token_chunk=16384).save_pretrained(tmp_path)
    assert Qwen3_5PackedConfig.from_pretrained(tmp_path).layer_token_chunk == 16384
