"""The sequence-classification (reward / value) head: one score per document, read at its last token; packed ==
per-document (fp32, <= 1e-5); parity with transformers' built-in head on unpacked and padded input (logits, loss for
every problem type, gradients); folders interchangeable with the built-in's; loading from a causal-LM folder
initialises and reports the new head and still refuses a missing backbone tensor."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from conftest import (
    HAS_BUILTIN_QWEN35,
    _randomize_zero_init,
    assert_same_loss_and_gradients,
    requires_builtin_qwen35,
    tiny_kwargs,
)
from fixtures_conversion import read_folder, write_shards

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5MoePackedForSequenceClassification,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
    Qwen3_5PackedForSequenceClassification,
)

PAD = 0
CLASSES = {
    "dense": (Qwen3_5PackedConfig, Qwen3_5PackedForSequenceClassification, Qwen3_5PackedForCausalLM),
    "moe": (Qwen3_5MoePackedConfig, Qwen3_5MoePackedForSequenceClassification, Qwen3_5MoePackedForCausalLM),
}


def _builtin_classifier(kind: str, kwargs: dict):
    """transformers' built-in sequence-classification head on the Qwen3.5 text backbone. transformers has no MoE
    one: its generic head (the class the dense one is made of) on the built-in MoE backbone stands in for it."""
    if kind == "dense":
        return transformers.Qwen3_5TextForSequenceClassification(transformers.Qwen3_5TextConfig(**kwargs))
    from transformers.modeling_layers import GenericForSequenceClassification

    class Qwen3_5MoeTextForSequenceClassification(
        GenericForSequenceClassification, transformers.Qwen3_5MoePreTrainedModel
    ):
        pass

    return Qwen3_5MoeTextForSequenceClassification(transformers.Qwen3_5MoeTextConfig(**kwargs))


def classifier_pair(kind: str, seed: int = 0, **overrides):
    """(built-in head, ours) with identical random weights, eval mode, fp32."""
    if not HAS_BUILTIN_QWEN35:
        pytest.skip("no built-in Qwen3.5 in this transformers")
    kwargs = {**tiny_kwargs(kind), "pad_token_id": PAD, **overrides}
    torch.manual_seed(seed)
    ref = _builtin_classifier(kind, kwargs)
    config_class, classifier_class, _ = CLASSES[kind]
    ours = classifier_class(config_class(**kwargs))
    _randomize_zero_init(ref)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def our_classifier(kind: str, seed: int = 0, **overrides):
    config_class, classifier_class, _ = CLASSES[kind]
    torch.manual_seed(seed)
    model = classifier_class(config_class(**{**tiny_kwargs(kind), "pad_token_id": PAD, **overrides}))
    _randomize_zero_init(model)
    return model.eval()


def _right_padded(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(d) for d in docs)
    ids = torch.full((len(docs), width), PAD)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)], mask[row, : len(doc)] = doc, 1
    return ids, mask


def _docs(seed: int) -> list[torch.Tensor]:
    """Documents of 1 to 70 tokens (shorter than the conv kernel, longer than a delta-rule chunk), some ending in pad
    ids (the built-in scores the last token that is not the pad id) and one made of pad ids only."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 128, (n,), generator=gen) for n in (5, 1, 3, 70, 12, 2, 33)]
    docs[2][-1] = PAD
    docs[4][-3:] = PAD
    docs.append(torch.full((2,), PAD))
    return docs


def test_state_dict_keys_are_the_builtins(kind):
    ref, ours = classifier_pair(kind, num_labels=3)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    assert {k for k in ours.state_dict() if not k.startswith("model.")} == {"score.weight"}
    assert ours.score.weight.shape == (3, ours.config.hidden_size)


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_logits_match_builtin(kind, padding):
    ref, ours = classifier_pair(kind, num_labels=3)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (3, 40), generator=gen)
    mask = torch.ones_like(ids)
    if padding == "right":
        ids[1, 25:], mask[1, 25:] = PAD, 0
        ids[2, 39:], mask[2, 39:] = PAD, 0
    elif padding == "left":
        ids[1, :15], mask[1, :15] = PAD, 0
    ids[0, -2:] = PAD  # a real row ending in pad ids: both score its last other token
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, use_cache=False).logits
        got = ours(ids, attention_mask=mask, use_cache=False).logits
    assert got.shape == expected.shape == (3, 3)
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("problem_type", ["regression", "single_label_classification", "multi_label_classification"])
def test_loss_and_gradients_match_builtin(kind, problem_type):
    num_labels = 1 if problem_type == "regression" else 3
    ref, ours = classifier_pair(kind, num_labels=num_labels, problem_type=problem_type)
    ref.train()
    ours.train()
    gen = torch.Generator().manual_seed(2)
    ids, mask = _right_padded([torch.randint(1, 128, (n,), generator=gen) for n in (30, 17, 24, 9)])
    if problem_type == "regression":
        labels = torch.randn(4, generator=gen)
    elif problem_type == "single_label_classification":
        labels = torch.randint(0, num_labels, (4,), generator=gen)
    else:
        labels = torch.randint(0, 2, (4, num_labels), generator=gen).float()
    ref_loss = ref(ids, attention_mask=mask, labels=labels, use_cache=False).loss
    our_loss = ours(ids, attention_mask=mask, labels=labels).loss
    assert_same_loss_and_gradients(ref, ours, ref_loss, our_loss)


def test_problem_type_inferred_like_builtin():
    ref, ours = classifier_pair("dense", num_labels=3)
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    ours(ids, labels=torch.tensor([0, 2]), use_cache=False)
    ref(ids, labels=torch.tensor([0, 2]), use_cache=False)
    assert ours.config.problem_type == ref.config.problem_type == "single_label_classification"


@pytest.mark.parametrize("form", ["cu_seqlens", "cu_seq_lens_q", "position_ids", "seq_idx", "padded_rows"])
def test_packed_scores_equal_per_document_scores(kind, form):
    model = our_classifier(kind, num_labels=2)
    docs = _docs(seed=4)
    with torch.no_grad():
        alone = torch.cat([model(doc[None], use_cache=False).logits for doc in docs])
        lengths = torch.tensor([len(d) for d in docs])
        row = torch.cat(docs)[None]
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        if form == "cu_seqlens":
            packed = model(row, cu_seqlens=cu_seqlens, use_cache=False).logits
        elif form == "cu_seq_lens_q":  # DataCollatorWithFlattening's flash-attention kwargs
            packed = model(row, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, use_cache=False).logits
        elif form == "position_ids":
            packed = model(row, position_ids=positions, use_cache=False).logits
        elif form == "seq_idx":
            packed = model(row, seq_idx=torch.repeat_interleave(torch.arange(len(docs)), lengths)[None]).logits
        else:  # two right-padded rows holding 5 and 3 documents (position_ids restarting within each row)
            first, second = torch.cat(docs[:5]), torch.cat(docs[5:])
            ids, mask = _right_padded([first, second])
            position_ids = torch.zeros_like(ids)
            for r, part in enumerate((docs[:5], docs[5:])):
                position_ids[r, : mask[r].sum()] = torch.cat([torch.arange(len(d)) for d in part])
            packed = model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    assert packed.shape == (len(docs), 2)
    assert (packed - alone).abs().max().item() <= 1e-5


def test_packed_loss_is_the_loss_of_the_per_document_scores(kind):
    model = our_classifier(kind, num_labels=1, problem_type="regression")
    docs = _docs(seed=5)
    labels = torch.randn(len(docs), generator=torch.Generator().manual_seed(5))
    cu_seqlens = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()])
    with torch.no_grad():
        out = model(torch.cat(docs)[None], cu_seqlens=cu_seqlens, labels=labels, use_cache=False)
        alone = torch.cat([model(doc[None], use_cache=False).logits for doc in docs])
    assert abs(out.loss.item() - torch.nn.functional.mse_loss(alone.squeeze(-1), labels).item()) <= 1e-5


def test_without_pad_token_id_scores_the_last_real_token():
    """No pad id: the built-in refuses batches of several rows; the packing contract still tells each document's
    last real token, so every row is scored there (pad ids inside a document are ordinary tokens)."""
    model = our_classifier("dense", pad_token_id=None)
    docs = _docs(seed=6)
    ids, mask = _right_padded(docs)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, use_cache=False)
        alone = torch.cat([model(doc[None], use_cache=False).logits for doc in docs])
        hidden = model.model(ids, attention_mask=mask, use_cache=False).last_hidden_state
    last = hidden[torch.arange(len(docs)), mask.sum(1) - 1]
    assert (batched.logits - alone).abs().max().item() <= 1e-5
    assert (batched.logits - model.score(last)).abs().max().item() <= 1e-6


def test_inputs_embeds_scores_the_last_real_token():
    model = our_classifier("dense")
    docs = _docs(seed=7)
    ids, mask = _right_padded([docs[i] for i in (0, 1, 3, 5, 6)])  # documents that do not end in pad ids
    with torch.no_grad():
        by_ids = model(ids, attention_mask=mask, use_cache=False).logits
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, use_cache=False).logits
    assert (by_embeds - by_ids).abs().max().item() <= 1e-6


def test_labels_need_one_entry_per_document():
    model = our_classifier("dense", num_labels=1)
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="labels hold 1 entries for 3 documents"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 9, 12]), labels=torch.tensor([0.5]), use_cache=False)


@requires_builtin_qwen35
def test_folders_are_interchangeable_with_the_builtins(tmp_path):
    ref, ours = classifier_pair("dense", num_labels=2)
    ids, mask = _right_padded(_docs(seed=9)[:4])
    ours.save_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "ref")
    from_ours = transformers.Qwen3_5TextForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    from_ref = Qwen3_5PackedForSequenceClassification.from_pretrained(tmp_path / "ref").eval()
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, use_cache=False).logits
        for model in (from_ours, from_ref):
            assert (model(ids, attention_mask=mask, use_cache=False).logits - expected).abs().max().item() <= 1e-5


def test_loading_from_a_causal_lm_folder_initialises_and_reports_the_head(kind, tmp_path, caplog):
    config_class, classifier_class, causal_class = CLASSES[kind]
    torch.manual_seed(0)
    causal = causal_class(config_class(**tiny_kwargs(kind), pad_token_id=PAD))
    _randomize_zero_init(causal)
    causal.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="qwen35_packed"):
        model, info = classifier_class.from_pretrained(tmp_path, num_labels=1, output_loading_info=True)
    reports = [
        r.getMessage() for r in caplog.records if r.name.startswith("qwen35_packed") and "score" in r.getMessage()
    ]
    assert reports == [f"{classifier_class.__name__}: score.weight not in {tmp_path}, newly initialised (a new task "
                       "head; train it before use)"]  # fmt: skip
    assert set(info["missing_keys"]) == {"score.weight"}
    head = model.score.weight.detach()
    std = causal.config.initializer_range
    assert head.shape == (1, causal.config.hidden_size) and bool(head.isfinite().all())
    assert 0.5 * std < head.std().item() < 1.5 * std  # transformers' init of a Linear: normal(0, initializer_range)
    backbone = causal.model.state_dict()
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(tensor, backbone[name]), name


def test_loading_from_a_causal_lm_folder_still_refuses_missing_backbone_tensors(tmp_path):
    torch.manual_seed(0)
    Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**tiny_kwargs("dense"))).save_pretrained(tmp_path)
    tensors = read_folder(tmp_path)
    del tensors["model.layers.1.linear_attn.dt_bias"]
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()
    write_shards(tmp_path, tensors, n_shards=1)
    with pytest.raises(
        ValueError, match=r"lacks 1 tensors that Qwen3_5PackedForSequenceClassification needs: model\.layers\.1\."
    ):
        Qwen3_5PackedForSequenceClassification.from_pretrained(tmp_path, num_labels=1)


def test_moe_router_logits_on_request_without_an_aux_loss():
    """Like transformers' generic head: no load-balancing loss in the loss; the router logits when asked for."""
    model = our_classifier("moe", num_labels=1, router_aux_loss_coef=0.5)
    ids, mask = _right_padded(_docs(seed=10)[:3])
    labels = torch.randn(3, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, labels=labels, use_cache=False)
        routed = model(ids, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False)
    assert plain.router_logits is None
    assert len(routed.router_logits) == model.config.num_hidden_layers
    assert routed.router_logits[0].shape == (ids.numel(), model.config.num_experts)
    assert routed.loss.item() == plain.loss.item()


@requires_builtin_qwen35
def test_builtin_composite_head_folder_loads_into_the_text_class(tmp_path):
    """A folder of transformers' vision-language `Qwen3_5ForSequenceClassification` (keys `model.language_model.*`,
    `model.visual.*`, `score.weight`): the text class reads its text model and head, with its scores on text."""
    from vl_tiny import composite_kwargs

    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(**composite_kwargs("dense"))
    config.text_config.pad_token_id, config.num_labels = PAD, 2
    ref = transformers.Qwen3_5ForSequenceClassification(config).eval()
    ref.save_pretrained(tmp_path)
    ours = Qwen3_5PackedForSequenceClassification.from_pretrained(tmp_path).eval()
    ids, mask = _right_padded(_docs(seed=11)[:4])
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, use_cache=False).logits
        got = ours(ids, attention_mask=mask, use_cache=False).logits
    assert got.shape == expected.shape == (4, 2)
    assert (got - expected).abs().max().item() <= 1e-5
