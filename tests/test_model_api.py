"""The model API as transformers users (and its generation and training utilities) call it: input checks on labels
and generate(), shift_labels, return_dict / output_hidden_states from the config, token ids on configs, the MoE text
backbone class, gradient checkpointing layers."""

import pytest
import torch
import torch.nn.functional as F

from conftest import packed_model

DOCS = [7, 1, 12]  # a packed row of three documents, one of a single token


def _packed_row(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (1, sum(DOCS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return ids, positions


# ------------------------------------------------------------------------------------------------ labels


@pytest.mark.parametrize("name, shape", [("labels", (2, 20)), ("labels", (1, 10)), ("shift_labels", (1, 19)),
                                         ("labels", (20,))])
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


# ------------------------------------------------------------------------------------------------ generate()


@pytest.mark.parametrize("form", ["cu_seqlens", "cu_seq_lens", "seq_idx", "position_ids"])
def test_generate_refuses_packed_boundaries(form):
    model = packed_model("dense")
    ids, positions = _packed_row()
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    kwargs = {"cu_seqlens": {"cu_seqlens": cu}, "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu},
              "seq_idx": {"seq_idx": torch.repeat_interleave(torch.arange(3), torch.tensor(DOCS))[None]},
              "position_ids": {"position_ids": positions}}[form]
    with pytest.raises(ValueError, match="generate\\(\\) got packed document boundaries .* one document per row"):
        model.generate(ids, max_new_tokens=2, do_sample=False, **kwargs)


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
