"""Parity with transformers' built-in Qwen3.5 classes on unpacked input (fp32, max |logit diff| <= 1e-4)."""

import torch
from conftest import assert_same_loss_and_gradients, builtin_pair

from qwen35_packed.modeling import utils


def test_logits_match_builtin_unpacked(kind):
    ref, ours = builtin_pair(kind)
    ids = torch.randint(0, 128, (3, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids, use_cache=False).logits
        got = ours(ids, use_cache=False).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_loss_and_gradients_match_builtin(kind):
    ref, ours = builtin_pair(kind)
    ref.train()
    ours.train()
    ids = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(2))
    ref_loss = ref(ids, labels=ids, use_cache=False).loss
    our_loss = ours(ids, labels=ids).loss
    assert_same_loss_and_gradients(ref, ours, ref_loss, our_loss)


def test_left_padded_batch_matches_builtin_on_real_tokens(kind):
    ref, ours = builtin_pair(kind)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, use_cache=False).logits
        got = ours(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max().item() <= 1e-4
    assert got[~real].abs().max().item() == 0.0  # pad positions are not computed


def test_greedy_generate_matches_builtin(kind):
    ref, ours = builtin_pair(kind)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        alone = ours.generate(ids[1:, 5:], max_new_tokens=10, do_sample=False)
    assert got.tolist() == expected.tolist()
    assert got[1, 12:].tolist() == alone[0, 7:].tolist()  # the padded row decodes like the unpadded prompt


def _holes_batch(seed: int, width: int = 30):
    """Rows with holes (real tokens after padding inside a row), left padding, and one unmasked row; the positions
    generate() gives (the real tokens counted)."""
    ids = torch.randint(0, 128, (3, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[1, 6:9] = 0
    mask[2, 5] = 0
    mask[2, 10:12] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_mask_with_holes_matches_builtin_on_real_tokens(kind, caplog, monkeypatch):
    """A mask with holes as the built-in reads it: attention skips the masked tokens, the Gated DeltaNet layers read
    them as zero inputs and run through them. Without position_ids the positions count the real tokens, said once."""
    monkeypatch.setattr(utils, "_logged_once", set())
    ref, ours = builtin_pair(kind)
    ids, mask, positions = _holes_batch(seed=6)
    real = mask.bool()
    with torch.no_grad(), caplog.at_level("WARNING"):
        expected = ref(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        got = ours(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        assert "attention_mask with holes" not in caplog.text
        by_default = ours(ids, attention_mask=mask, use_cache=False).logits  # positions count the real tokens
        squeezed = ours(ids[2][real[2]][None], use_cache=False).logits[0]  # the real tokens without the holes
    assert (got[real] - expected[real]).abs().max().item() <= 1e-4
    assert got[~real].abs().max().item() == 0.0
    assert torch.equal(by_default, got)
    assert "attention_mask with holes: the positions count each row's real tokens" in caplog.text
    # the masked tokens are inputs of the recurrence, not absent: dropping them changes the row
    assert (squeezed - got[2][real[2]]).abs().max().item() > 1e-3


def test_shift_labels_with_holes_give_the_builtin_loss_and_gradients(kind):
    ref, ours = builtin_pair(kind)
    ref.train()
    ours.train()
    ids, mask, positions = _holes_batch(seed=7)
    # the next real token of the row at every real token, none at masked ones and at a row's last real token
    shift_labels = torch.full_like(ids, -100)
    for row in range(ids.shape[0]):
        columns = torch.nonzero(mask[row]).flatten()
        shift_labels[row, columns[:-1]] = ids[row, columns[1:]]
    inputs = dict(attention_mask=mask, position_ids=positions, shift_labels=shift_labels)
    ref_loss = ref(ids, labels=ids, use_cache=False, **inputs).loss
    our_loss = ours(ids, labels=ids, **inputs).loss
    assert_same_loss_and_gradients(ref, ours, ref_loss, our_loss)


def test_generate_with_holes_matches_builtin(kind):
    ref, ours = builtin_pair(kind)
    ids, mask, _ = _holes_batch(seed=8, width=14)
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert got.tolist() == expected.tolist()
