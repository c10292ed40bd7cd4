"""The front door (modeling/packed_batch.py): the public signatures every class writes out, the binding of
positional and keyword calls, the refusals the door owns, the complete immutable batch it returns, and the kernel set
bound once per (device, dtype) and kernel settings (kernel_set.py)."""

import dataclasses
import inspect

import pytest
import torch
import transformers
from conftest import packed_model, requires_builtin_qwen35

from qwen35_packed.modeling import modeling_qwen3_5_packed, packed_batch
from qwen35_packed.modeling.kernel_selection import KernelChoice
from qwen35_packed.modeling.kernel_set import KernelSet, kernel_set
from qwen35_packed.modeling.modeling_qwen3_5_packed import (
    Qwen3_5PackedForCausalLM,
    Qwen3_5PackedForSequenceClassification,
    Qwen3_5PackedTextModel,
)
from qwen35_packed.modeling.modeling_qwen3_5_packed_vl import (
    Qwen3_5PackedForConditionalGeneration,
    Qwen3_5PackedVLModel,
)

OURS_AND_BUILTIN = [
    (Qwen3_5PackedForCausalLM, "Qwen3_5ForCausalLM"),
    (Qwen3_5PackedTextModel, "Qwen3_5TextModel"),
    (Qwen3_5PackedForSequenceClassification, "Qwen3_5TextForSequenceClassification"),
    (Qwen3_5PackedForConditionalGeneration, "Qwen3_5ForConditionalGeneration"),
    (Qwen3_5PackedVLModel, "Qwen3_5Model"),
]


@requires_builtin_qwen35
@pytest.mark.parametrize("ours, builtin_name", OURS_AND_BUILTIN, ids=[row[1] for row in OURS_AND_BUILTIN])
def test_public_signature_keeps_the_builtins_parameters(ours, builtin_name):
    """TRL and the Trainer read forward's signature (dataset columns, logits_to_keep): the built-in's positional
    inputs come first in its order (its cache is `cache` or `past_key_values`, accepted under both names), every
    other parameter of the built-in's is declared or taken through **kwargs, and the packing arguments default to
    None."""
    builtin = getattr(transformers, builtin_name, None)
    if builtin is None:
        pytest.skip(f"transformers {transformers.__version__} has no {builtin_name}")
    theirs = [name for name in inspect.signature(builtin.forward).parameters if name != "self"]
    parameters = inspect.signature(ours.forward).parameters
    mine = list(parameters)
    assert mine[0] == "self" and parameters[mine[-1]].kind is inspect.Parameter.VAR_KEYWORD
    cache_names = {"cache", "past_key_values"}
    assert [("cache" if n in cache_names else n) for n in mine[1:6]] == [
        ("cache" if n in cache_names else n) for n in theirs[:5]
    ]
    # taken through **kwargs: output_attentions (attention_probabilities.py), cache_position (ignored); mm_encoder_outputs (vision
    # features computed by the caller) is not supported and raises as an unknown argument
    assert set(theirs) - set(mine) <= {"kwargs", "output_attentions", "cache_position", "mm_encoder_outputs"}
    for name in packed_batch.PACKING_ARGUMENTS:
        assert parameters[name].default is None
    # **kwargs annotated as the built-in's (Unpack[TransformersKwargs]), where tools look up output_attentions & co
    assert _unpacked_name(parameters[mine[-1]].annotation) == _unpacked_name(
        inspect.signature(builtin.forward).parameters["kwargs"].annotation
    )


def _unpacked_name(annotation) -> str:
    """The TypedDict a `**kwargs: Unpack[...]` annotation names (some modules keep annotations as strings)."""
    if isinstance(annotation, str):
        return annotation.removeprefix("Unpack[").removesuffix("]")
    return annotation.__args__[0].__name__


def test_positional_and_keyword_calls_bind_like_the_written_signature():
    model = packed_model("dense").eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        by_name = model(input_ids=ids, attention_mask=mask).logits
        by_position = model(ids, mask).logits
        tuple_out = model(ids, mask, None, None, None, None, False, None, None, 0, return_dict=False)
    torch.testing.assert_close(by_position, by_name, rtol=0, atol=0)
    torch.testing.assert_close(tuple_out[0], by_name, rtol=0, atol=0)
    with pytest.raises(TypeError, match="multiple values for argument 'attention_mask'"):
        model(ids, mask, attention_mask=mask)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments for a packed Qwen3.5 forward: \['masks'\]"):
        model(ids, masks=mask)


def test_the_front_door_resolves_every_packing_form_to_one_stream():
    backbone = packed_model("dense").model.train()
    ids = torch.zeros(1, 10, dtype=torch.long)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    seq_idx = torch.tensor([[0] * 4 + [1] * 6])
    forms = {
        "cu_seqlens": {"cu_seqlens": cu},
        "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 6, "max_length_k": 6},
        "position_ids": {"position_ids": positions},
        "seq_idx": {"seq_idx": seq_idx},
    }
    for name, given in forms.items():
        batch = backbone.open_batch(input_ids=ids, **given)
        assert batch.packed.cu_seqlens.tolist() == cu.tolist(), name
        assert batch.rope_positions.tolist() == positions[0].tolist(), name
        assert batch.cache is None and batch.targets is None, name
        # complete: the token ids, the rope tables at those positions and the kernels come with it
        assert batch.token_ids.tolist() == ids[0].tolist() and isinstance(batch.kernels, KernelSet), name
        cos, sin = backbone.rotary_emb.cos_sin(batch.rope_positions, torch.float32)
        assert torch.equal(batch.rope[0], cos) and torch.equal(batch.rope[1], sin), name
    labels = torch.arange(10).unsqueeze(0)
    batch = backbone.open_batch(input_ids=ids, cu_seqlens=cu, labels=labels, logits_to_keep=3, num_items_in_batch=7)
    assert batch.targets.tolist() == [1, 2, 3, -100, 5, 6, 7, 8, 9, -100]  # no target across the boundary
    assert batch.logits_to_keep == 3 and batch.num_items_in_batch == 7  # what the head reads
    with pytest.raises(dataclasses.FrozenInstanceError):  # immutable: nothing writes into a batch after the door
        batch.targets = None


def test_cache_rules_are_the_front_doors():
    backbone = packed_model("dense").model
    ids = torch.zeros(1, 10, dtype=torch.long)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="use_cache=True needs one document per row"):
        backbone.eval().open_batch(input_ids=ids, cu_seqlens=cu, use_cache=True)
    # use_cache None: a cache for one document per row in eval mode, none in training or for packed rows
    one_doc = backbone.eval().open_batch(input_ids=ids)
    assert one_doc.cache is not None and not one_doc.continues_cache
    assert backbone.train().open_batch(input_ids=ids).cache is None
    assert backbone.eval().open_batch(input_ids=ids, cu_seqlens=cu).cache is None


def test_kernels_are_bound_once_per_device_dtype_and_settings(monkeypatch):
    model = packed_model("dense").eval()
    calls = []
    select = modeling_qwen3_5_packed.select_kernels

    def counting(settings, device, dtype):
        calls.append((device.type, dtype, settings["attention_kernel"]))
        return select(settings, device, dtype)

    monkeypatch.setattr(modeling_qwen3_5_packed, "select_kernels", counting)
    ids = torch.randint(3, 100, (1, 8))
    with torch.no_grad():
        for _ in range(3):
            model(ids, use_cache=False)
        model.config.attention_kernel = "sdpa"  # a changed setting binds anew
        model(ids, use_cache=False)
        model(ids, use_cache=False)
        model.to(torch.float64)  # a new dtype binds anew, and .to() drops what was bound
        assert model.model.kernel_sets == {}
        model(ids, use_cache=False)
        model.set_attn_implementation("sdpa")  # rebuilt on set_attn_implementation
        assert model.model.kernel_sets == {}
        model(ids, use_cache=False)
    assert calls == [
        ("cpu", torch.float32, "auto"),
        ("cpu", torch.float32, "sdpa"),
        ("cpu", torch.float64, "sdpa"),
        ("cpu", torch.float64, "sdpa"),
    ]


def test_an_injected_kernel_set_runs_instead_of_the_selection():
    """Tests and benchmarks inject a set (`inject_kernels`) instead of patching globals: every layer calls its members."""
    model = packed_model("dense").eval()
    ids = torch.randint(3, 100, (1, 8))
    seen = []
    reference = kernel_set(KernelChoice("torch", "sdpa"))

    def recorded(name):
        def call(*args, **kwargs):
            seen.append(name)
            return getattr(reference, name)(*args, **kwargs)

        return call

    members = ("rms_norm", "conv", "delta_rule", "gated_norm", "attention", "sigmoid_gate", "swiglu", "gdn_gates")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        model.model.inject_kernels(dataclasses.replace(reference, **{name: recorded(name) for name in members}))
        got = model(ids, use_cache=False).logits
        model.model.inject_kernels(None)
    assert torch.equal(got, expected)
    assert set(seen) == set(members)
