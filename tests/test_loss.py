"""Chunked linear cross-entropy equals plain cross-entropy on full logits (value and gradients)."""

import pytest
import torch
import torch.nn.functional as F

from qwen35_packed.modeling.loss import chunked_linear_cross_entropy


@pytest.mark.parametrize("num_items", [None, 7])
def test_chunked_matches_full_logits(num_items):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=gen, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (50,), generator=gen)
    targets[::7] = -100
    loss, logits = chunked_linear_cross_entropy(hidden, weight, targets, num_items, chunk_tokens=8)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    full = hidden @ weight.t()
    denominator = num_items if num_items is not None else (targets != -100).sum()
    expected = F.cross_entropy(full, targets, ignore_index=-100, reduction="sum") / denominator
    expected.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(logits, full.detach(), atol=1e-6) and not logits.requires_grad
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6)
    assert torch.allclose(grads[1], weight.grad, atol=1e-6)


def test_no_gradient_work_without_grad():
    hidden, weight = torch.randn(10, 4), torch.randn(6, 4, requires_grad=True)
    with torch.no_grad():
        loss, _ = chunked_linear_cross_entropy(hidden, weight, torch.randint(0, 6, (10,)))
    assert not loss.requires_grad
