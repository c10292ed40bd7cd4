"""The model API as transformers users (and its generation and training utilities) call it: input checks on labels
and generate(), shift_labels, return_dict / output_hidden_states from the config, token ids on configs, the MoE text
backbone class, gradient checkpointing layers."""

import pytest
import torch
import torch.nn.functional as F
from conftest import packed_model, requires_builtin_qwen35

from qwen35_packed.modeling import utils

DOCS = [7, 1, 12]  # a packed row of three documents, one of a single token


def _packed_row(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (1, sum(DOCS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return ids, positions


# ------------------------------------------------------------------------------------------------ labels


@pytest.mark.parametrize(
    "name, shape", [("labels", (2, 20)), ("labels", (1, 10)), ("shift_labels", (1, 19)), ("labels", (20,))]
)
def test_labels_of_another_shape_than_input_ids_raise(name, shape):
    model = packed_model("dense")
    ids, _ = _packed_row()
    with pytest.raises(ValueError, match=rf"{name} must have the shape of input_ids \[1, 20\]"):
        model(ids, **{name: torch.randint(3, 120, shape)})


def test_shift_labels_give_the_labels_loss_and_respect_document_boundaries():
    model = packed_model("dense")
    ids, positions = _packed_row()
    labels = ids.clone()
    starts = (positions == 0).nonzero()[:, 1]
    labels[0, starts] = -100  # as TRL's and transformers' flattening collators mark document starts
    shift_labels = torch.cat([labels[:, 1:], torch.full((1, 1), -100)], dim=1)
    with torch.no_grad():
        expected = model(ids, position_ids=positions, labels=labels).loss
        got = model(ids, position_ids=positions, shift_labels=shift_labels).loss
        # a target at the last token of a row is used as given (the row may be one chunk of a longer sequence)
        single = ids[:, :7]
        chunk_targets = torch.randint(3, 120, (1, 7))
        logits = model(single).logits
        chunk_loss = model(single, shift_labels=chunk_targets).loss
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert chunk_loss.item() == pytest.approx(F.cross_entropy(logits[0], chunk_targets[0]).item(), rel=1e-5)

    crossing = shift_labels.clone()
    crossing[0, 6] = ids[0, 7]  # the first document's last token would predict the second document's first token
    with pytest.raises(ValueError, match="real token 6, the last of its document, a target in the next document"):
        model(ids, position_ids=positions, shift_labels=crossing)


# ------------------------------------------------------------------------------------------------ input values

VOCAB = 128  # the tiny models' vocabulary


@pytest.mark.parametrize("value", [VOCAB, VOCAB + 1000, -1, -5])
@pytest.mark.parametrize("name", ["labels", "shift_labels"])
def test_targets_outside_the_vocabulary_are_refused_naming_the_labels(name, value):
    """The loss would fail with an index error that does not mention the labels; -100 is the one value outside
    [0, vocab) that is valid (no target)."""
    model = packed_model("dense")
    ids, positions = _packed_row()
    labels = ids.clone()
    labels[positions == 0] = -100  # no target at a document's first token (as collators mark them)
    if name == "shift_labels":
        labels = torch.cat([labels[:, 1:], torch.full((1, 1), -100)], dim=1)
    labels[0, 3] = -100
    with torch.no_grad():
        model(ids, position_ids=positions, **{name: labels})
        labels[0, 4] = value
        with pytest.raises(ValueError, match=rf"^{name} hold {value} as a target, outside the vocabulary of {VOCAB}"):
            model(ids, position_ids=positions, **{name: labels})


def test_a_label_that_is_no_target_is_not_checked():
    """Unshifted labels at a document's first token are no target of any token (the built-in's loss never reads
    them either): any value there leaves the loss unchanged."""
    model = packed_model("dense")
    ids, positions = _packed_row()
    labels = ids.clone()
    with torch.no_grad():
        expected = model(ids, position_ids=positions, labels=labels).loss
        labels[0, [0, DOCS[0], DOCS[0] + DOCS[1]]] = VOCAB + 7
        assert torch.equal(model(ids, position_ids=positions, labels=labels).loss, expected)


@pytest.mark.parametrize("value", [VOCAB, -1])
def test_token_ids_outside_the_vocabulary_are_refused_naming_input_ids(value):
    model = packed_model("dense")
    ids = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(1))
    bad = ids.clone()
    bad[1, 5] = value
    message = rf"^input_ids hold token id {value}, outside the vocabulary of {VOCAB} tokens \(ids 0 to {VOCAB - 1}\)"
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            model(bad)
        cache = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=message):  # a cached step
            model(bad[:, 5:6], past_key_values=cache)
        # padding is never embedded: what a pad column holds is not read
        mask = torch.ones_like(ids)
        mask[1, :6] = 0
        expected = model(ids, attention_mask=mask).logits
        assert torch.equal(model(bad, attention_mask=mask).logits, expected)


def test_inputs_embeds_of_another_dtype_are_refused_outside_autocast():
    """The layers would run in the embeddings' dtype, not the model's; transformers' built-in fails in its first
    matmul there. Under autocast both run, returning the autocast dtype."""
    model = packed_model("dense")
    ids = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(1))
    embeds = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        for given in (torch.bfloat16, torch.float16, torch.float64):
            with pytest.raises(ValueError, match=rf"^inputs_embeds are {given} but the model's embeddings are "
                               r"torch.float32"):  # fmt: skip
                model(inputs_embeds=embeds.to(given))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs_embeds=embeds.bfloat16()).logits
        assert logits.dtype == torch.bfloat16
        with pytest.raises(ValueError, match=r"^inputs_embeds are torch.float32 but the model's embeddings are "):
            model.bfloat16()(inputs_embeds=embeds)


@pytest.mark.parametrize("value", [2, -1, 0.5])
def test_attention_mask_values_other_than_0_and_1_are_refused(value):
    """A mask of 2s would read as 1 (and 0.5 as 1 too): only 0 and 1 (bool, integer or float) are padding masks."""
    model = packed_model("dense")
    ids = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    bad = mask.to(torch.float32 if isinstance(value, float) else torch.long, copy=True)
    bad[1, 4] = value
    message = rf"^attention_mask must hold only 0 and 1 \(or True / False\), got {value}"
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        for dtype in (torch.bool, torch.int32, torch.float32, torch.bfloat16):
            assert torch.equal(model(ids, attention_mask=mask.to(dtype)).logits, expected), dtype
        with pytest.raises(ValueError, match=message):
            model(ids, attention_mask=bad)
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        step = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1).to(bad.dtype)
        step[1, -1] = value
        with pytest.raises(ValueError, match=message):  # a cached step's new columns
            model(ids[:, :1], attention_mask=step, past_key_values=cache)


# ------------------------------------------------------------------------------------------------ generate()


@pytest.mark.parametrize("form", ["cu_seqlens", "cu_seq_lens", "seq_idx", "position_ids"])
def test_generate_refuses_packed_boundaries(form):
    model = packed_model("dense")
    ids, positions = _packed_row()
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    kwargs = {
        "cu_seqlens": {"cu_seqlens": cu},
        "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu},
        "seq_idx": {"seq_idx": torch.repeat_interleave(torch.arange(3), torch.tensor(DOCS))[None]},
        "position_ids": {"position_ids": positions},
    }[form]
    with pytest.raises(ValueError, match="generate\\(\\) got packed document boundaries .* one document per row"):
        model.generate(ids, max_new_tokens=2, do_sample=False, **kwargs)


@pytest.mark.parametrize("how", ["attention_mask", "pad_token_id"])
def test_generate_continues_a_prompt_ending_in_padding_from_its_last_real_token(how, caplog, monkeypatch):
    """The first new token is predicted at the last column, which this model does not compute where it is masked:
    such a row continues from its last real token, as the same prompt without padding does, said in the log,
    whether the caller's mask or generate()'s own (from a pad_token_id ending a row) masks the column."""
    monkeypatch.setattr(utils, "_logged_once", set())  # the line is said once per process
    model = packed_model("dense")
    ids = torch.randint(3, 120, (2, 8), generator=torch.Generator().manual_seed(4))
    kwargs = {"do_sample": False, "max_new_tokens": 4}
    if how == "attention_mask":
        kwargs["attention_mask"] = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
        real = 6
    else:
        ids[1, -1] = 0
        kwargs["pad_token_id"] = 0
        real = 7
    with torch.no_grad(), caplog.at_level("WARNING"):
        got = model.generate(ids, **kwargs)
        alone = [model.generate(ids[row : row + 1, :length], do_sample=False, max_new_tokens=4)
                 for row, length in ((0, 8), (1, real))]  # fmt: skip
    assert got[0].tolist() == alone[0][0].tolist()
    assert got[1, 8:].tolist() == alone[1][0, real:].tolist()
    assert "prompts end in padding in rows [1]; each continues from its last real token" in caplog.text


def test_generate_accepts_position_ids_of_one_document_per_row():
    model = packed_model("dense")
    ids, _ = _packed_row()
    plain = model.generate(ids, max_new_tokens=3, do_sample=False)
    given = model.generate(ids, max_new_tokens=3, do_sample=False, position_ids=torch.arange(20)[None])
    assert torch.equal(plain, given)


# ------------------------------------------------------------------------------------------------ outputs


@pytest.mark.parametrize("part", ["causal_lm", "backbone"])
def test_return_dict_false_gives_a_tuple_and_config_output_hidden_states_is_honoured(part):
    model = packed_model("moe")
    module = model if part == "causal_lm" else model.model
    ids, positions = _packed_row()
    with torch.no_grad():
        as_dict = module(ids, position_ids=positions, output_router_logits=True)
        as_tuple = module(ids, position_ids=positions, output_router_logits=True, return_dict=False)
        assert as_dict.hidden_states is None
        model.config.return_dict = False
        from_config = module(ids, position_ids=positions, output_router_logits=True)
        model.config.return_dict, model.config.output_hidden_states = True, True
        hidden = module(ids, position_ids=positions).hidden_states
    assert isinstance(as_tuple, tuple) and isinstance(from_config, tuple)
    expected = as_dict.to_tuple()  # the set fields in order (aux_loss, logits, ... for the causal LM)
    assert len(as_tuple) == len(from_config) == len(expected) >= 2
    assert torch.equal(as_tuple[0], expected[0]) and torch.equal(from_config[0], expected[0])
    assert torch.equal(as_tuple[-1][0], expected[-1][0])  # router logits of the first layer
    assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1


# ------------------------------------------------------------------------------------------------ token ids, classes


def test_configs_built_in_code_have_token_id_attributes(tmp_path):
    from transformers import GenerationConfig

    from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig, Qwen3_5PackedVLConfig

    for config in (Qwen3_5PackedConfig(), Qwen3_5MoePackedConfig(), Qwen3_5PackedVLConfig().text_config):
        assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (None, None, None)
    config = Qwen3_5PackedConfig(pad_token_id=0, bos_token_id=2, eos_token_id=1)
    config.save_pretrained(tmp_path)
    loaded = Qwen3_5PackedConfig.from_pretrained(tmp_path)
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 2, 1)
    generation = GenerationConfig.from_model_config(loaded)
    assert (generation.pad_token_id, generation.eos_token_id) == (0, 1)


def test_moe_text_backbone_class():
    from qwen35_packed.modeling import Qwen3_5MoePackedTextModel, Qwen3_5PackedTextModel

    model = packed_model("moe")
    assert type(model.model) is Qwen3_5PackedTextModel  # the causal LM's backbone is built by the dense class
    backbone = Qwen3_5MoePackedTextModel(model.config)
    backbone.load_state_dict(model.model.state_dict())
    ids, positions = _packed_row()
    with torch.no_grad():
        assert torch.equal(
            backbone(ids, position_ids=positions).last_hidden_state,
            model.model(ids, position_ids=positions).last_hidden_state,
        )


@requires_builtin_qwen35  # the tiny folder is written by the built-in classes
def test_automodel_on_a_converted_moe_folder_gives_the_moe_backbone(tmp_path):
    from transformers import AutoModel

    from qwen35_packed.tiny import build_tiny_folder

    folder = build_tiny_folder(tmp_path / "moe", "moe")
    loaded = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(loaded).__name__ == "Qwen3_5MoePackedTextModel"
    assert loaded.layers[0].mlp.experts.gate_up_proj.abs().sum() > 0


def test_decoder_layers_are_gradient_checkpointing_layers_with_the_callers_kwargs():
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = packed_model("dense").train()
    ids, positions = _packed_row()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    for layer in model.model.layers:
        assert isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing
        # the caller's checkpoint function, which the layer calls unless it runs its stream in pieces
        assert layer.checkpoint_function.keywords == {"use_reentrant": False}
        layer.input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    model(ids, position_ids=positions, labels=ids).loss.backward()
    # every layer ran twice: once in the forward, once recomputed in the backward (which stops early, once the
    # last tensor it needs is recomputed: the norm at the start of the layer runs again)
    assert len(calls) == 2 * model.config.num_hidden_layers


# ------------------------------------------------------------------------------------------------ generation API


def _generate(model, case, ids, mask):
    import transformers

    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    if case == "beam_search":
        return model.generate(ids, num_beams=3, **greedy)
    if case == "sample_with_dict":
        torch.manual_seed(0)
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=True,
            top_k=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
        return torch.cat([out.sequences.float().flatten(), torch.stack(out.scores).flatten()])
    if case == "inputs_embeds":
        return model.generate(inputs_embeds=model.get_input_embeddings()(ids), **greedy)
    if case == "empty_dynamic_cache":
        return model.generate(ids, past_key_values=transformers.DynamicCache(config=model.config), **greedy)
    # continue_from_cache: a second generate() picks up the cache and the sequence the first one returned
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    grown = torch.cat([mask, mask.new_ones(mask.shape[0], first.sequences.shape[1] - ids.shape[1])], dim=1)
    return model.generate(
        first.sequences, attention_mask=grown, past_key_values=first.past_key_values, max_new_tokens=3, do_sample=False
    )


@pytest.mark.parametrize(
    "case", ["beam_search", "sample_with_dict", "inputs_embeds", "empty_dynamic_cache", "continue_from_cache"]
)
def test_generation_api_equals_the_builtin(case):
    from conftest import builtin_pair

    ref, ours = builtin_pair("dense")
    for model in (ref, ours):
        model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 120, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        expected, got = _generate(ref, case, ids, mask), _generate(ours, case, ids, mask)
    assert got.shape == expected.shape
    if case == "sample_with_dict":
        assert (got - expected).abs().max().item() <= 1e-4
    else:
        assert torch.equal(got, expected)


def test_a_filled_transformers_cache_is_refused():
    from conftest import builtin_pair

    ref, ours = builtin_pair("dense")
    ids = torch.randint(3, 120, (1, 6))
    with torch.no_grad():
        filled = ref(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="cannot be continued by the packed Qwen3.5 model"):
            ours(ids[:, -1:], past_key_values=filled)


# ------------------------------------------------------------------------------------------------ generation API


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_generate_from_inputs_embeds_without_attention_mask_equals_generate_from_ids(kind):
    """Prefill from inputs_embeds, then decode: the cached steps must take the generated token (a cache that counted
    the columns from input_ids alone fed none, `step must be nonzero`)."""
    model = packed_model(kind)
    ids = torch.randint(3, 120, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        from_ids = model.generate(ids, max_new_tokens=4, do_sample=False)
        from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1] :])
    # continuing a cache with embeddings of the prompt and the tokens generated so far (3 + 1 = 4 tokens)
    with torch.no_grad():
        first = model.generate(
            inputs_embeds=model.get_input_embeddings()(ids),
            max_new_tokens=3,
            do_sample=False,
            return_dict_in_generate=True,
        )
        continued = model.generate(
            inputs_embeds=model.get_input_embeddings()(torch.cat([ids, first.sequences], dim=1)),
            past_key_values=first.past_key_values,
            max_new_tokens=1,
            do_sample=False,
        )
    assert torch.equal(torch.cat([first.sequences, continued], dim=1), from_embeds)


def test_prepare_inputs_for_generation_passes_other_kwargs_on():
    model = packed_model("dense")
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    extra = {"output_hidden_states": True, "custom_arg": "value", "numeric_arg": 42}
    inputs = model.prepare_inputs_for_generation(ids, position_ids=torch.arange(3).repeat(2, 1), **extra)
    assert torch.equal(inputs["input_ids"], ids)
    assert {k: inputs[k] for k in extra} == extra
    assert "position_ids" not in inputs  # positions come from the mask and the cache


def test_generate_passes_model_kwargs_to_forward():
    model = packed_model("dense")
    ids = torch.randint(3, 120, (1, 4))
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_hidden_states=True
        )
    # one tuple per step, each with the embeddings + one state per layer
    assert len(out.hidden_states) == 2 and len(out.hidden_states[0]) == model.config.num_hidden_layers + 1
    assert out.hidden_states[1][0].shape == (1, 1, model.config.hidden_size)
    with pytest.raises((TypeError, ValueError), match="custom_arg"):  # generate() or forward refuses it
        model.generate(ids, max_new_tokens=1, custom_arg=1)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_outputs_carry_attentions_as_none_and_moe_classes_generate(kind):
    from transformers import GenerationMixin

    model = packed_model(kind)
    assert GenerationMixin in type(model).__bases__
    ids = torch.randint(3, 120, (1, 4))
    with torch.no_grad():
        assert model(ids).attentions is None and model.model(ids).attentions is None
        out = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert out.attentions is None and out.sequences.shape == (1, 6)


@pytest.mark.parametrize("how", ["argument", "generation_config"])
@pytest.mark.parametrize("implementation", ["offloaded", "sliding_window", "quantized"])
def test_caches_other_than_its_own_are_refused_by_generate(how, implementation):
    from transformers import GenerationConfig

    model = packed_model("dense")
    ids = torch.randint(3, 120, (1, 4))
    kwargs = (
        {"cache_implementation": implementation}
        if how == "argument"
        else {"generation_config": GenerationConfig(cache_implementation=implementation, max_new_tokens=2)}
    )
    with pytest.raises(ValueError, match=f"cache_implementation='{implementation}' is not supported"):
        model.generate(ids, max_new_tokens=2, **kwargs)


def test_set_attn_implementation_maps_to_the_attention_kernel_or_raises():
    model = packed_model("moe")
    ids = torch.randint(3, 120, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
        for implementation in ("eager", "sdpa"):
            model.set_attn_implementation(implementation)
            assert model.config.attention_kernel == "sdpa"
            assert model.config._attn_implementation == model.model.config._attn_implementation == implementation
            assert torch.equal(model(ids).logits, expected)
    model.set_attn_implementation("flash_attention_2")
    assert model.config.attention_kernel == "flash_attn"
    with pytest.raises(ValueError, match='`attn_implementation="flex_attention"` is not supported by the packed'):
        model.set_attn_implementation("flex_attention")


def test_no_name_of_ours_shadows_one_of_transformers_by_accident():
    """Every attribute our model classes define that transformers' PreTrainedModel / GenerationMixin / nn.Module
    also have (on the installed release) is an intended override: a helper named like one of transformers' own
    (a model's `use_kernels` switch, for instance) would be read by transformers as its own."""
    import transformers

    from qwen35_packed.modeling.modeling_qwen3_5_packed import (
        Qwen3_5PackedForCausalLM,
        Qwen3_5PackedForSequenceClassification,
        Qwen3_5PackedTextModel,
    )
    from qwen35_packed.modeling.modeling_qwen3_5_packed_vl import (
        Qwen3_5PackedForConditionalGeneration,
        Qwen3_5PackedVLModel,
    )

    intended = {
        "forward", "from_pretrained", "generate", "prepare_inputs_for_generation", "_reorder_cache",
        "_expand_inputs_for_generation", "_apply", "_init_weights", "set_attn_implementation",
        "get_input_embeddings", "set_input_embeddings", "get_output_embeddings", "set_output_embeddings",
        "get_decoder", "post_init", "config_class", "visual", "language_model", "base_model_prefix",
        "supports_gradient_checkpointing", "main_input_name", "input_modalities",
    }  # fmt: skip
    theirs = set(dir(transformers.PreTrainedModel)) | set(dir(transformers.GenerationMixin)) | set(dir(torch.nn.Module))
    for cls in (Qwen3_5PackedTextModel, Qwen3_5PackedForCausalLM, Qwen3_5PackedForSequenceClassification,
                Qwen3_5PackedVLModel, Qwen3_5PackedForConditionalGeneration):  # fmt: skip
        ours = {
            name
            for klass in cls.__mro__
            if klass.__module__.startswith("qwen35_packed")
            for name in vars(klass)
            if not (name.startswith("__") and name.endswith("__"))
        }
        clashes = {name for name in ours & theirs if not name.startswith("_") or name in intended} - intended
        assert not clashes, f"{cls.__name__} defines {sorted(clashes)}, which transformers' classes also have"
