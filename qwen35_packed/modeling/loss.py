"""Causal-LM loss over the packed stream without materialising fp32 [tokens x vocab] logits.

`chunked_linear_cross_entropy` projects hidden states to the vocabulary chunk by chunk, takes the fp32
cross-entropy of each chunk and, in the same pass, the chunk's gradients with respect to the hidden states and
the lm_head weight (the loss is a scalar, so its backward only rescales them). Peak memory is one chunk of fp32
logits instead of several full copies. Gradients are exact up to the order of floating-point sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DEFAULT_CHUNK_TOKENS = 4096


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, denominator, chunk_tokens, keep_logits, grad_hidden_wanted,
                grad_weight_wanted):
        needs_grad = grad_hidden_wanted or grad_weight_wanted
        grad_hidden = torch.zeros_like(hidden) if grad_hidden_wanted else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if (
            grad_weight_wanted) else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kept = [] if keep_logits else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start:start + chunk_tokens]
            t = targets[start:start + chunk_tokens]
            logits = h @ weight.t()
            if kept is not None:
                kept.append(logits)
            logits = logits.float()
            total += F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum")
            if needs_grad:
                # d(sum CE)/d(logits) = softmax - onehot on target rows, 0 on ignored rows.
                grad_logits = logits.softmax(dim=-1)
                valid = t != IGNORE_INDEX
                rows = torch.nonzero(valid).flatten()
                grad_logits[rows, t[rows]] -= 1.0
                grad_logits[~valid] = 0.0
                grad_logits = grad_logits.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:start + chunk_tokens] = grad_logits @ weight
                if grad_weight is not None:
                    grad_weight += (grad_logits.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight, denominator)
        ctx.weight_dtype = weight.dtype
        loss = total / denominator
        logits_out = torch.cat(kept) if kept is not None else None
        if logits_out is not None:
            ctx.mark_non_differentiable(logits_out)
        return loss, logits_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_logits):
        grad_hidden, grad_weight, denominator = ctx.saved_tensors
        scale = grad_loss / denominator
        gh = (grad_hidden * scale.to(grad_hidden.dtype)) if grad_hidden is not None else None
        gw = (grad_weight * scale).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None, None, None


def chunked_linear_cross_entropy(hidden, weight, targets, num_items_in_batch=None,
                                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, keep_logits: bool = True):
    """Token-weighted fp32 cross-entropy of `hidden @ weight.T` against `targets` (ignore_index -100).

    hidden [N, H]; weight [V, H]; targets long [N]. The sum is divided by `num_items_in_batch` when given (HF
    Trainer's gradient accumulation), else by the number of targets. Returns (loss, logits [N, V] in the hidden
    dtype, detached, or None when `keep_logits` is False).
    """
    targets = targets.to(hidden.device)
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    else:
        denominator = (targets != IGNORE_INDEX).sum().clamp(min=1).float()
    grad_on = torch.is_grad_enabled()
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, targets, denominator, chunk_tokens, keep_logits,
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
    )
