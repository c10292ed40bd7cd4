"""Packed == per-document for every entry form of the packing contract, plus the contract's errors."""

import dataclasses

import pytest
import torch
from conftest import packed_model, random_doc_lengths

from qwen35_packed.modeling import reference_kernels
from qwen35_packed.modeling.packing import PackedSequence, build_packed_sequence, loss_targets

N_DOCS = 22


def _docs(seed=0, n_docs=N_DOCS):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_doc_lengths(gen, n_docs)
    return [torch.randint(0, 128, (n,), generator=gen) for n in lengths]


def _per_doc_logits(model, docs):
    with torch.no_grad():
        return [model(doc.unsqueeze(0), use_cache=False).logits[0] for doc in docs]


def _packed_row(docs):
    ids = torch.cat(docs).unsqueeze(0)
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    positions = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    return ids, cu, positions, int(lengths.max())


FORMS = ["position_ids", "cu_seq_lens", "cu_seqlens", "cu_seqlens+position_ids", "seq_idx", "flattening collator"]


@pytest.mark.parametrize("form", FORMS)
def test_packed_row_equals_per_document(kind, form):
    model = packed_model(kind)
    docs = _docs()
    ids, cu, positions, max_len = _packed_row(docs)
    seq_idx = torch.repeat_interleave(torch.arange(len(docs), dtype=torch.int32), cu.diff())[None]
    cu_seq_lens = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    kwargs = {
        "position_ids": {"position_ids": positions},
        "cu_seq_lens": cu_seq_lens,
        "cu_seqlens": {"cu_seqlens": cu},
        "cu_seqlens+position_ids": {"cu_seqlens": cu, "position_ids": positions},
        "seq_idx": {"seq_idx": seq_idx},
        # what TRL's padding-free collator sends (DataCollatorWithFlattening with return_seq_idx adds the same)
        "flattening collator": {"position_ids": positions, "seq_idx": seq_idx, **cu_seq_lens},
    }[form]
    with torch.no_grad():
        packed = model(ids, use_cache=False, **kwargs).logits[0]
    expected = torch.cat(_per_doc_logits(model, docs))
    assert (packed - expected).abs().max().item() <= 1e-5


def test_padded_batch_equals_per_document(kind):
    """Form (a): one document per row, mixed left and right padding."""
    model = packed_model(kind)
    docs = _docs(seed=1)
    width = max(len(d) for d in docs) + 3
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, doc in enumerate(docs):
        start = (width - len(doc)) if i % 2 else (i % 3)  # left padding on odd rows, right (+ some left) on even
        ids[i, start : start + len(doc)] = doc
        mask[i, start : start + len(doc)] = 1
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=False).logits
    expected = _per_doc_logits(model, docs)
    for i, exp in enumerate(expected):
        assert (logits[i][mask[i].bool()] - exp).abs().max().item() <= 1e-5


def test_several_packed_rows_with_position_ids(kind):
    """Form (b) with batch > 1: each row holds several documents."""
    model = packed_model(kind)
    docs = _docs(seed=2, n_docs=20)
    rows = [docs[:10], docs[10:]]
    width = max(sum(len(d) for d in r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    positions = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for r, row_docs in enumerate(rows):
        row_ids, _, row_pos, _ = _packed_row(row_docs)
        n = row_ids.shape[1]
        ids[r, :n], positions[r, :n], mask[r, :n] = row_ids[0], row_pos[0], 1
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    for r, row_docs in enumerate(rows):
        expected = torch.cat(_per_doc_logits(model, row_docs))
        assert (logits[r, : expected.shape[0]] - expected).abs().max().item() <= 1e-5


def test_packed_loss_and_gradients_equal_per_document(kind):
    model = packed_model(kind)
    model.train()
    docs = _docs(seed=3)
    ids, cu, _, _ = _packed_row(docs)
    # Sum reduction (num_items_in_batch=1): the packed gradient must be the sum of per-document gradients.
    packed_loss = model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=1).loss
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    doc_losses, doc_targets = [], []
    for doc in docs:
        out = model(doc.unsqueeze(0), labels=doc.unsqueeze(0), num_items_in_batch=1)
        out.loss.backward()
        doc_losses.append(out.loss.item())
        doc_targets.append(len(doc) - 1)
    assert abs(packed_loss.item() - sum(doc_losses)) <= 1e-5 * max(1.0, abs(sum(doc_losses)))
    for name, param in model.named_parameters():
        assert torch.allclose(packed_grads[name], param.grad, atol=1e-5, rtol=1e-4), name

    # Mean reduction: token-weighted average of the per-document mean losses.
    with torch.no_grad():
        mean_loss = model(ids, labels=ids, cu_seqlens=cu).loss.item()
    assert abs(mean_loss - sum(doc_losses) / sum(doc_targets)) <= 1e-5


def test_no_prediction_across_documents():
    """The last token of a document never predicts the next document's first token; the controls show the loss
    does read the labels: the second token of a document is a target, and a row without boundaries (where the
    shift crosses them) gives a different loss."""
    model = packed_model("dense")
    docs = _docs(seed=4, n_docs=3)
    ids, cu, _, _ = _packed_row(docs)
    labels = ids.clone()
    with torch.no_grad():
        base = model(ids, labels=labels, cu_seqlens=cu, num_items_in_batch=1).loss
        labels[0, cu[1]] = (labels[0, cu[1]] + 1) % 128  # first token of doc 2: not a target of anything
        changed = model(ids, labels=labels, cu_seqlens=cu, num_items_in_batch=1).loss
        labels[0, cu[1] + 1] = (labels[0, cu[1] + 1] + 1) % 128  # second token of doc 2: the first's target
        target_changed = model(ids, labels=labels, cu_seqlens=cu, num_items_in_batch=1).loss
        logits = model(ids, cu_seqlens=cu).logits[0]
    assert base.item() == changed.item()
    assert target_changed.item() != changed.item()
    # The same per-document logits scored with one shift over the whole row: the cross-boundary targets count.
    crossing = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
    assert abs(crossing.item() - base.item()) > 1e-3


def _leaky_conv(x, weight, packed, split_sizes, initial_state=None, adapters=()):
    """The GDN conv without document boundaries (what transformers' built-in does with position_ids alone)."""
    out = reference_kernels.torch_causal_conv1d_varlen(x, weight, torch.arange(x.shape[0], device=x.device))
    return torch.split(out, list(split_sizes), dim=-1)


def test_bf16_packed_row_equals_per_document_within_rounding(kind):
    """bf16 on CPU: packed vs per-document no further apart than bf16 is from fp32 (the same bf16-representable
    weights) on the same documents; a conv that lets three tokens through each boundary exceeds that bound."""
    model = packed_model(kind).to(torch.bfloat16)
    fp32 = packed_model(kind)
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    docs = _docs(seed=5, n_docs=10)
    ids, cu, _, _ = _packed_row(docs)
    with torch.no_grad():
        alone = torch.cat(_per_doc_logits(model, docs)).float()
        rounding = (torch.cat(_per_doc_logits(fp32, docs)) - alone).abs().max().item()
        packed = model(ids, cu_seqlens=cu, use_cache=False).logits[0].float()
        bound = model.model.kernels_for(ids.device, torch.bfloat16)
        model.model.inject_kernels(dataclasses.replace(bound, conv=_leaky_conv))
        leaky = model(ids, cu_seqlens=cu, use_cache=False).logits[0].float()
    assert 0 < rounding
    assert (packed - alone).abs().max().item() <= rounding
    assert (leaky - alone).abs().max().item() > 1.5 * rounding


# ------------------------------------------------------------------------------------------------ bad input


def _build(**kwargs):
    shape = kwargs.pop("shape", (1, 10))
    return build_packed_sequence(shape, torch.device("cpu"), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cu_seqlens": torch.tensor([1, 5, 10])}, "must start at 0"),
        ({"cu_seqlens": torch.tensor([0, 6, 4, 10])}, "must be increasing"),
        ({"cu_seqlens": torch.tensor([0, 4, 9])}, "must end at the token count 10"),
        ({"cu_seqlens": torch.tensor([0, 4, 4, 10])}, "empty document"),
        ({"cu_seqlens": torch.tensor([0, 4, 10]), "position_ids": torch.arange(10)[None]}, "position_ids contradict"),
        ({"cu_seqlens": torch.tensor([0, 4, 10]), "shape": (2, 5)}, "batch has 2 rows"),
        ({"cu_seq_lens_q": torch.tensor([0, 4, 10]), "cu_seq_lens_k": torch.tensor([0, 5, 10])}, "differ"),
        ({"cu_seq_lens_q": torch.tensor([0, 4, 10]), "max_length_q": 4}, "max_length_q=4"),
        # a row with holes is one document: no seq_idx, no position restart, positions count its real tokens
        (
            {"attention_mask": torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1, 0]]), "seq_idx": torch.zeros(1, 10).long()},
            "seq_idx cannot be combined with an attention_mask with holes",
        ),
        (
            {
                "attention_mask": torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1, 0]]),
                "position_ids": torch.tensor([[0, 1, 0, 0, 1, 2, 3, 4, 5, 0]]),
            },
            "a row whose attention_mask has holes is one document",
        ),
        (
            {"attention_mask": torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1, 0]]), "position_ids": torch.arange(10)[None]},
            "positions count its real tokens",
        ),
        ({"attention_mask": torch.zeros(1, 10, dtype=torch.long)}, "no real token"),
        ({"attention_mask": torch.ones(1, 1, 10, 10).tril()}, "4D or custom masks are not accepted"),
        ({"position_ids": torch.tensor([[0, 1, 2, 4, 5, 6, 0, 1, 2, 3]])}, "count 0, 1, 2"),
        (
            {"cu_seqlens": torch.tensor([0, 4, 10]), "attention_mask": torch.tensor([[1] * 9 + [0]])},
            "cannot be combined",
        ),
        # seq_idx must change exactly where another source starts a document
        (
            {"cu_seqlens": torch.tensor([0, 4, 10]), "seq_idx": torch.tensor([[0] * 5 + [1] * 5])},
            "seq_idx contradicts cu_seqlens: at real token 4 seq_idx does not start",
        ),
        (
            {"cu_seq_lens_q": torch.tensor([0, 4, 10]), "seq_idx": torch.zeros(1, 10, dtype=torch.long)},
            "seq_idx contradicts cu_seq_lens_q/k",
        ),
        (
            {"position_ids": torch.arange(10)[None], "seq_idx": torch.tensor([[0] * 4 + [1] * 6])},
            "seq_idx contradicts position_ids: at real token 4 seq_idx starts",
        ),
        ({"seq_idx": torch.zeros(1, 9, dtype=torch.long)}, r"seq_idx must be \[batch, seq_len\]"),
        ({"seq_idx": torch.zeros(1, 10)}, "seq_idx must be an integer tensor"),
    ],
)
def test_bad_packing_input_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _build(**kwargs)


def test_seq_idx_alone_sets_boundaries_and_padding_starts_rows():
    # seq_idx alone splits rows like restarting position_ids; with left padding a row's first real token starts a
    # document whatever seq_idx holds at the pad positions before it.
    packed = _build(seq_idx=torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2]]))
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 10]
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    packed = _build(
        shape=(2, 5),
        attention_mask=mask,
        seq_idx=torch.tensor([[7, 7, 7, 7, 8], [0, 0, 1, 1, 1]]),
        position_ids=torch.tensor([[0, 0, 0, 1, 0], [0, 1, 0, 1, 2]]),
    )
    assert packed.cu_seqlens.tolist() == [0, 2, 3, 5, 8]


def test_3d_position_ids_are_the_rope_positions_of_the_stream_whichever_form_gives_the_documents():
    # Multimodal rope positions [3, batch, seq] (or transformers' [4, ...] with a leading text row) set no boundary:
    # the stream carries them, packed like the tokens, and the documents come from the other form given.
    rope = torch.arange(30).reshape(3, 1, 10)
    with_text_row = torch.cat([torch.full((1, 1, 10), -1), rope])
    for kwargs in (
        {"cu_seqlens": torch.tensor([0, 4, 10])},
        {"cu_seq_lens_q": torch.tensor([0, 4, 10]), "cu_seq_lens_k": torch.tensor([0, 4, 10])},
        {"seq_idx": torch.tensor([[0] * 4 + [1] * 6])},
    ):
        for positions in (rope, with_text_row):
            packed = _build(position_ids=positions, **kwargs)
            assert packed.cu_seqlens.tolist() == [0, 4, 10]
            assert torch.equal(packed.position_ids, rope[:, 0])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    padded_rope = torch.arange(30).reshape(3, 2, 5)
    packed = _build(shape=(2, 5), attention_mask=mask, position_ids=padded_rope)
    assert packed.cu_seqlens.tolist() == [0, 3, 7]
    assert torch.equal(packed.position_ids, padded_rope.reshape(3, -1)[:, mask.flatten().bool()])


def test_a_mask_with_holes_keeps_the_masked_tokens_for_the_recurrent_layers_only():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0]])
    packed = _build(shape=(2, 8), attention_mask=mask)
    # every layer but the GDN ones: the real tokens, one document per row, positions counting them
    assert packed.token_index.tolist() == [1, 2, 5, 6, 8, 9, 10, 11]
    assert packed.cu_seqlens.tolist() == [0, 4, 8] and packed.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # the GDN layers: each row from its first to its last real token, the masked tokens between them zero inputs
    spans = packed.spans
    assert spans.stream.token_index.tolist() == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
    assert spans.stream.cu_seqlens.tolist() == [0, 6, 10]
    assert spans.real.tolist() == [0, 1, 4, 5, 6, 7, 8, 9] and spans.masked_columns.tolist() == [3, 4]
    x = torch.arange(1.0, 9.0)[:, None]
    assert spans.spread(x).flatten().tolist() == [1, 2, 0, 0, 3, 4, 5, 6, 7, 8]
    assert torch.equal(spans.gather(spans.spread(x)), x)
    assert _build(shape=(2, 8), attention_mask=mask.sort(dim=1).values).spans is None  # padding alone: none


def test_targets_with_holes_come_from_shift_labels_only():
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    packed = _build(shape=(1, 5), attention_mask=mask)
    ids = torch.arange(5)[None]
    with pytest.raises(ValueError, match="labels with an attention_mask with holes"):
        loss_targets(packed, labels=ids)
    with pytest.raises(ValueError, match="shift_labels give masked tokens"):
        loss_targets(packed, shift_labels=torch.tensor([[1, 2, 3, 4, -100]]))
    assert loss_targets(packed, shift_labels=torch.tensor([[1, 3, -100, 4, -100]])).tolist() == [1, 3, 4, -100]


def test_model_rejects_cache_with_packed_documents():
    model = packed_model("dense")
    ids, cu, _, _ = _packed_row(_docs(seed=5, n_docs=3))
    with pytest.raises(ValueError, match="one document per row"):
        model(ids, cu_seqlens=cu, use_cache=True)


# ------------------------------------------------------------------------------------------------ boundaries for kernels


@pytest.mark.parametrize("form", ["cu_seqlens", "cu_seqlens list", "cu_seq_lens", "position_ids", "attention_mask"])
def test_stream_boundaries_are_built_once_and_shared(form):
    # Every form leaves the int64 CPU copy of the boundaries with the stream (the builder has them on the host, so
    # kernels never copy them back from the device), and the int64 device tensor FLA receives is one object.
    cu = torch.tensor([0, 3, 4, 9, 10])
    kwargs = {
        "cu_seqlens": {"cu_seqlens": cu},
        "cu_seqlens list": {"cu_seqlens": cu.tolist()},
        "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone()},
        "position_ids": {"position_ids": torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4, 0]])},
        "attention_mask": {
            "attention_mask": torch.tensor([[1] * 3 + [0] * 7, [1] * 1 + [0] * 9, [1] * 5 + [0] * 5, [0] * 9 + [1]])
        },
    }[form]
    shape = (4, 10) if form == "attention_mask" else (1, 10)
    packed = build_packed_sequence(shape, torch.device("cpu"), **kwargs)
    assert packed.host_cu_seqlens is not None
    host = packed.cu_seqlens_cpu()
    assert host is packed.cu_seqlens_cpu() and host.dtype == torch.int64 and host.device.type == "cpu"
    wide = packed.cu_seqlens_int64()
    assert wide is packed.cu_seqlens_int64() and wide.dtype == torch.int64
    assert host.tolist() == wide.tolist() == packed.cu_seqlens.tolist() == cu.tolist()
    assert packed.num_tokens == 10 and packed.max_seqlen == 5
    if form == "cu_seqlens":
        cu[1] = 2  # the caller's tensor is not the stream's
        assert packed.cu_seqlens_cpu().tolist() == [0, 3, 4, 9, 10]


def test_stream_without_host_boundaries_copies_them_once():
    packed = PackedSequence(torch.tensor([0, 2, 7], dtype=torch.int32), 5, None, None, (1, 7))
    host = packed.cu_seqlens_cpu()
    assert host is packed.cu_seqlens_cpu() and host.tolist() == [0, 2, 7] and host.dtype == torch.int64
    assert packed.position_in_doc().tolist() == [0, 1, 0, 1, 2, 3, 4]
    assert packed.doc_index().tolist() == [0, 0, 1, 1, 1, 1, 1]


def test_unpack_writes_the_padded_output_once_in_place_and_passes_gradients():
    # The head's logits go through unpack: at the 35B-A3B's vocabulary a padded batch's logits are tens of GiB, and an
    # out-of-place copy into the filled buffer holds two of them at once (an H100 ran out of memory on that copy).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    packed = _build(shape=(2, 4), attention_mask=mask)
    x = torch.randn(5, 3, requires_grad=True)
    with Ops() as ops:
        out = packed.unpack(x, fill=-1.0)
    assert torch.ops.aten.index_copy_.default in ops.seen and torch.ops.aten.index_copy.default not in ops.seen
    assert out.shape == (2, 4, 3) and (out[mask == 0] == -1).all()
    assert torch.equal(packed.pack(out), x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
