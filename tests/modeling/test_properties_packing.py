"""Property tests of the packing contract (README "The packing contract").

Random batches: document counts and lengths (1-token documents, documents shorter than the conv kernel, lengths
around the delta-rule chunk of 64), rows, left / right / both-sided padding, every entry form and their agreeing
combinations, tensors or plain lists, and single random corruptions of a valid batch. The oracle below is a
plain-Python reading of the README rules, independent of `packing.py`: it gives either the documents (as flat
token indices) or the set of rules the batch breaks. Invariant: the model's packed logits equal each document run
alone (pad positions hold zeros, the loss equals the per-document sum), or a ValueError names a broken rule.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import packed_model
from hypothesis import given
from hypothesis import strategies as st
from properties import property_settings

from qwen35_packed.modeling.packing import build_packed_sequence

VOCAB = 128
CHUNK = 64  # the delta-rule chunk of the torch path
# Edge lengths (1 token, shorter than the conv kernel of 4, around the chunk of 64) and ordinary ones.
doc_length = st.one_of(st.sampled_from([1, 2, 3, 63, 64, 65]), st.integers(1, 40))
EXPLICIT_FORMS = ("cu_seqlens", "cu_seq_lens", "cu_seq_lens_q", "cu_seqlens+cu_seq_lens")
ROW_FORMS = ("mask", "position_ids", "position_ids+mask", "position_ids_1d")
MUTATIONS = ("position", "cu_entry", "cu_start", "cu_end", "mask_zero", "all_padding", "max_length", "k_differs",
             "explicit_with_padding", "two_rows")  # fmt: skip


@st.composite
def batches(draw, mutate: str = "sometimes", min_docs: int = 1, form: str | None = None, long_doc: bool = False):
    """(kwargs for build_packed_sequence / forward, (batch, seq_len), input_ids, description).

    mutate: "sometimes", "never" or "always" (one corruption, see MUTATIONS); min_docs: documents per row (rows
    for the one-document-per-row mask form); form: one of EXPLICIT_FORMS + ROW_FORMS, else drawn; long_doc: one
    document of the first row, at a drawn place, spans more than one delta-rule chunk (65-96 tokens)."""
    form = form or draw(st.sampled_from(EXPLICIT_FORMS + ROW_FORMS))
    explicit = form in EXPLICIT_FORMS
    if explicit or form == "position_ids_1d":
        rows = [draw(st.lists(doc_length, min_size=min_docs, max_size=5))]
    elif form == "mask":  # one document per row
        rows = [[n] for n in draw(st.lists(doc_length, min_size=min_docs, max_size=4))]
    else:
        rows = draw(st.lists(st.lists(doc_length, min_size=min_docs, max_size=4), min_size=1, max_size=3))
    if long_doc:
        first = rows[0] if form != "mask" else [n for row in rows for n in row]
        first[draw(st.integers(0, len(first) - 1))] = draw(st.integers(CHUNK + 1, CHUNK + 32))
        if form == "mask":
            rows = [[n] for n in first]
    padded = "mask" in form
    left = [draw(st.integers(0, 3)) if padded else 0 for _ in rows]
    width = max(lp + sum(r) for lp, r in zip(left, rows)) + (draw(st.integers(0, 3)) if padded else 0)
    batch = len(rows)
    seed = draw(st.integers(0, 2**16))
    ids = torch.randint(0, VOCAB, (batch, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(batch, width, dtype=torch.long)
    pad_value = draw(st.sampled_from([0, 1, -1, 7]))  # whatever a collator puts at pad positions
    positions = torch.full((batch, width), pad_value, dtype=torch.long)
    for r, (lp, docs) in enumerate(zip(left, rows)):
        if not padded:  # without a mask every position is real: the last document fills the row
            docs[-1] += width - sum(docs)
        mask[r, lp : lp + sum(docs)] = 1
        positions[r, lp : lp + sum(docs)] = torch.cat([torch.arange(n) for n in docs])
    kwargs: dict = {}
    as_list = draw(st.booleans())

    def boundary(values):
        return list(values) if as_list else torch.tensor(values, dtype=draw(st.sampled_from([torch.int32, torch.long])))

    if explicit:
        cu = [0]
        for n in rows[0]:
            cu.append(cu[-1] + n)
        longest = max(rows[0])
        if form in ("cu_seqlens", "cu_seqlens+cu_seq_lens"):
            kwargs["cu_seqlens"] = boundary(cu)
        if form in ("cu_seq_lens", "cu_seqlens+cu_seq_lens"):
            kwargs.update(cu_seq_lens_q=boundary(cu), cu_seq_lens_k=boundary(cu), max_length_q=longest,
                          max_length_k=longest)  # fmt: skip
        if form == "cu_seq_lens_q":
            kwargs["cu_seq_lens_q"] = boundary(cu)
        if draw(st.booleans()):
            kwargs["position_ids"] = positions
        if draw(st.booleans()):
            kwargs["attention_mask"] = mask
    else:
        if "mask" in form:
            kwargs["attention_mask"] = mask if draw(st.booleans()) else mask.to(draw(st.sampled_from(
                [torch.bool, torch.float32, torch.int32])))  # fmt: skip
        if form == "position_ids_1d":
            kwargs["position_ids"] = positions[0]
        elif "position_ids" in form:
            kwargs["position_ids"] = positions
    mutation = None
    if mutate != "never":
        choices = tuple(m for m in MUTATIONS if _applies(m, kwargs))
        mutation = draw(st.sampled_from(choices if mutate == "always" else (None,) + choices))
    if mutation == "two_rows":  # an explicit boundary list with a batch of two rows
        batch, ids = 2, ids.repeat(2, 1)
        kwargs.update({k: kwargs[k].repeat(2, 1) for k in ("attention_mask", "position_ids") if k in kwargs})
    elif mutation is not None:
        _mutate(draw, mutation, kwargs, batch, width)
    return kwargs, (batch, width), ids, f"form={form} mutation={mutation}"


def _applies(mutation, kwargs) -> bool:
    explicit = any(k in kwargs for k in ("cu_seqlens", "cu_seq_lens_q"))
    needs = {"position": "position_ids" in kwargs, "mask_zero": "attention_mask" in kwargs,
             "all_padding": "attention_mask" in kwargs, "max_length": "max_length_q" in kwargs,
             "k_differs": "cu_seq_lens_k" in kwargs}  # fmt: skip
    return needs.get(mutation, explicit)


def _mutate(draw, mutation, kwargs, batch, width):
    """Corrupt one part of a valid batch in place (in-range changes may still leave a valid batch: the oracle
    decides)."""
    cu_names = [n for n in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k") if n in kwargs]
    if mutation == "position":
        pos = kwargs["position_ids"].clone()
        flat = pos.reshape(-1)
        i = draw(st.integers(0, flat.numel() - 1))
        flat[i] = draw(st.sampled_from([0, 1, int(flat[i]) + 1, int(flat[i]) - 1, 1000]))
        kwargs["position_ids"] = pos
    elif mutation in ("cu_entry", "cu_start", "cu_end"):
        name = draw(st.sampled_from(cu_names))
        cu = [int(v) for v in kwargs[name]]
        if mutation == "cu_entry":
            i = draw(st.integers(0, len(cu) - 1))
        else:
            i = 0 if mutation == "cu_start" else len(cu) - 1
        cu[i] = max(0, cu[i] + draw(st.sampled_from([-2, -1, 1, 2])))
        kwargs[name] = torch.tensor(cu)
    elif mutation == "all_padding":
        kwargs["attention_mask"] = torch.zeros_like(kwargs["attention_mask"])
    elif mutation == "mask_zero":
        mask = kwargs["attention_mask"].clone()
        r, c = draw(st.integers(0, batch - 1)), draw(st.integers(0, width - 1))
        mask[r, c] = 0
        kwargs["attention_mask"] = mask
    elif mutation == "max_length":
        kwargs[draw(st.sampled_from(["max_length_q", "max_length_k"]))] += draw(st.sampled_from([-1, 1]))
    elif mutation == "k_differs":
        cu = [int(v) for v in kwargs["cu_seq_lens_k"]]
        if len(cu) > 2:
            del cu[1]  # two documents merged: still a valid boundary list, but not q's
            kwargs["cu_seq_lens_k"] = torch.tensor(cu)
    elif mutation == "explicit_with_padding":
        mask = torch.ones(batch, width, dtype=torch.long)
        mask[0, draw(st.sampled_from([0, width - 1]))] = 0
        kwargs["attention_mask"] = mask


def contract_oracle(shape, kwargs):
    """('ok', documents as lists of flat token indices) or ('error', regexes of the broken rules), from the README
    rules alone."""
    batch, width = shape
    errors: list[str] = []
    mask = kwargs.get("attention_mask")
    mask = None if mask is None else mask.to(torch.long).tolist()
    pos = kwargs.get("position_ids")
    if pos is not None:
        pos = pos.tolist()
        pos = [pos] * batch if not isinstance(pos[0], list) else pos

    def runs_of_real(row):  # number of separate runs of real tokens in a mask row
        return sum(1 for i, v in enumerate(row) if v and (i == 0 or not row[i - 1]))

    # a row with holes (real tokens after padding inside it) is one document
    holes = [mask is not None and runs_of_real(row) > 1 for row in (mask or [None] * batch)]

    def boundaries(name):
        cu = [int(v) for v in kwargs[name]]
        ok = True
        if cu[0] != 0:
            errors.append("must start at 0")
            ok = False
        steps = [b - a for a, b in zip(cu, cu[1:])]
        if any(s < 0 for s in steps):
            errors.append("must be increasing")
            ok = False
        if any(s == 0 for s in steps):
            errors.append("empty document")
            ok = False
        return cu if ok else None

    explicit = {n: boundaries(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens") if n in kwargs}
    if explicit:
        if any(cu is None for cu in explicit.values()):
            return "error", errors
        values = list(explicit.values())
        if any(cu != values[0] for cu in values):
            errors.append("differ")
        cu = explicit.get("cu_seqlens") or values[0]
        if batch != 1:
            errors.append(f"batch has {batch} rows")
        if cu[-1] != width:
            errors.append(f"must end at the token count {width}")
        if mask is not None and not all(all(row) for row in mask):
            errors.append("cannot be combined")
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        for name in ("max_length_q", "max_length_k"):
            if name in kwargs and int(kwargs[name]) != longest:
                errors.append(f"{name}={int(kwargs[name])} but the longest")
        docs = [list(range(a, b)) for a, b in zip(cu, cu[1:])]
        if pos is not None and cu[-1] == width:
            if any(pos[0][t] != i for doc in docs for i, t in enumerate(doc)):
                errors.append("position_ids contradict")
        return ("error", errors) if errors else ("ok", docs)

    docs = []
    for r in range(batch):
        real = [c for c in range(width) if mask is None or mask[r][c]]
        for i, c in enumerate(real):
            if i == 0 or (pos is not None and pos[r][c] == 0 and not holes[r]):
                docs.append([])
            docs[-1].append(r * width + c)
    if not docs:
        errors.append("no real token")
    if pos is not None:
        for doc in docs:
            if any(pos[t // width][t % width] != i for i, t in enumerate(doc)):
                errors.append("must count 0, 1, 2")
                break
    return ("error", errors) if errors else ("ok", docs)


def _expected_cu(docs):
    cu = [0]
    for doc in docs:
        cu.append(cu[-1] + len(doc))
    return cu


@property_settings(max_examples=300)
@given(batches())
def test_contract_resolution_matches_the_rules(case):
    """build_packed_sequence against the oracle: the same documents, tokens and positions, or a ValueError naming
    one of the broken rules."""
    kwargs, shape, _, description = case
    verdict, detail = contract_oracle(shape, kwargs)
    if verdict == "error":
        with pytest.raises(ValueError) as info:
            build_packed_sequence(shape, torch.device("cpu"), **kwargs)
        assert any(message in str(info.value) for message in detail), (description, str(info.value), detail)
        return
    packed = build_packed_sequence(shape, torch.device("cpu"), **kwargs)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == _expected_cu(detail), description
    flat = [t for doc in detail for t in doc]
    got_index = torch.arange(shape[0] * shape[1]) if packed.token_index is None else packed.token_index
    assert got_index.tolist() == flat, description
    assert packed.position_ids.tolist() == [i for doc in detail for i in range(len(doc))]
    assert packed.max_seqlen == max(len(doc) for doc in detail)
    # pack / unpack round trip: real tokens come back in place, pad positions get the fill value
    values = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + 1
    back = packed.unpack(packed.pack(values.unsqueeze(-1)), fill=0.0).squeeze(-1)
    real = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    real[flat] = True
    assert torch.equal(back.reshape(-1)[real], values.reshape(-1)[real]) and not back.reshape(-1)[~real].any()


@functools.lru_cache(maxsize=2)
def _model(kind: str = "dense"):
    # One layer of each kind (hundreds of examples run it); random norms and routers: zero-initialised ones would
    # hide a wrong (1 + w).
    return packed_model(kind, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


@functools.lru_cache(maxsize=8192)
def _alone(tokens: tuple[int, ...], kind: str = "dense") -> torch.Tensor:
    with torch.no_grad():
        return _model(kind)(torch.tensor([tokens]), use_cache=False).logits[0]


@pytest.mark.parametrize("form", EXPLICIT_FORMS + ROW_FORMS)
@property_settings(max_examples=25, shrink=False)
@given(data=st.data())
def test_packed_forward_equals_per_document(form, data):
    """The model (dense or MoE, drawn) on random valid batches of every form, each with one document longer than a
    delta-rule chunk: logits of every document equal the document run alone (<= 1e-5), pad positions hold zeros,
    the summed loss equals the per-document sum."""
    kind = data.draw(st.sampled_from(["dense", "moe"]))
    kwargs, shape, ids, description = data.draw(batches(mutate="never", min_docs=2, form=form, long_doc=True))
    description += f" kind={kind}"
    verdict, docs = contract_oracle(shape, kwargs)
    assert verdict == "ok", (description, docs)
    assert max(len(doc) for doc in docs) > CHUNK, description
    with torch.no_grad():
        out = _model(kind)(ids, labels=ids, num_items_in_batch=1, use_cache=False, **kwargs)
    logits = out.logits.reshape(-1, VOCAB)
    flat_ids = ids.reshape(-1)
    expected_loss = 0.0
    real = torch.zeros(flat_ids.numel(), dtype=torch.bool)
    for doc in docs:
        alone = _alone(tuple(flat_ids[doc].tolist()), kind)
        assert (logits[doc] - alone).abs().max().item() <= 1e-5, description
        expected_loss += F.cross_entropy(alone[:-1], flat_ids[doc][1:], reduction="sum").item()
        real[doc] = True
    assert not logits[~real].any(), description
    assert abs(out.loss.item() - expected_loss) <= 1e-5 * max(1.0, expected_loss), description


@property_settings(max_examples=30, shrink=False)
@given(batches(mutate="always"))
def test_model_forward_raises_what_the_contract_says(case):
    """Corrupted batches through the model's forward: a ValueError naming a broken rule, or (for corruptions that
    leave a valid batch) per-document logits."""
    kwargs, shape, ids, description = case
    verdict, detail = contract_oracle(shape, kwargs)
    if verdict == "error":
        with pytest.raises(ValueError) as info:
            _model()(ids, use_cache=False, **kwargs)
        assert any(message in str(info.value) for message in detail), (description, str(info.value), detail)
        return
    with torch.no_grad():
        logits = _model()(ids, use_cache=False, **kwargs).logits.reshape(-1, VOCAB)
    width = shape[1]
    for doc in detail:
        tokens = ids.reshape(-1)[doc]
        row, first, last = doc[0] // width, doc[0] % width, doc[-1] % width
        if last - first + 1 == len(doc):
            expected = _alone(tuple(tokens.tolist()))
        else:  # a row with holes: its span alone, with its mask (the masked tokens are inputs of the GDN layers)
            span_mask = kwargs["attention_mask"][row : row + 1, first : last + 1]
            with torch.no_grad():
                expected = _model()(ids[row : row + 1, first : last + 1], attention_mask=span_mask, use_cache=False)
            expected = expected.logits[0][span_mask[0].bool()]
        assert (logits[doc] - expected).abs().max().item() <= 1e-5, description
