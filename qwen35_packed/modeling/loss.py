"""Causal-LM loss over the packed stream without materialising fp32 [tokens x vocab] logits.

`chunked_linear_cross_entropy` projects hidden states to the vocabulary chunk by chunk, takes the fp32
cross-entropy of each chunk and, in the same pass, the chunk's gradients with respect to the hidden states and
the lm_head weight (the loss is a scalar, so its backward only rescales them). Gradients are exact up to the order
of floating-point sums.

Per chunk, `chunk_cross_entropy` computes the fp32 log-softmax (logit - logsumexp) once and derives both the loss
(-log_softmax[target]) and the logits' gradient (its exp minus onehot(target)) from it. Ignored targets are masked
with gather / where, never selected with `nonzero`, so the loop runs without a device-to-host sync. Where the kernel
set fuses the elementwise chains (the CUDA default) it goes through `torch.compile` (its `loss_chunk`,
kernels.compiled_chain; it has no kernel of its own): the fp32 temporaries then live in registers,
not in [chunk x vocab] buffers. The returned logits (hidden dtype, detached) are written chunk by chunk into one
preallocated tensor, optionally straight into the caller's padded layout, so they are never copied again.

The lm_head weight gradient is an fp32 sum over chunks. On CUDA each chunk's product accumulates into it inside
one GEMM (cuBLAS, fp32 output): no bf16 [vocab x hidden] product per chunk, no cast and no separate add.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from .projection import matmul_dtype, row_invariant_product

IGNORE_INDEX = -100
# A chunk's [chunk x vocab] tensors (its logits, then their gradient) are sized by bytes, not by a token count: at
# the 35B-A3B's vocab a fixed token count made them the largest tensors of an 80 GB card's failing peak
# (results/notes/2026-12-06-h100-loss-chunks-moe-chunks.md). The chunk stays a multiple of CHUNK_TOKENS_STEP tokens
# (GEMM-friendly) and at most MAX_CHUNK_TOKENS.
CHUNK_LOGITS_BYTES = 512 * 2**20
CHUNK_TOKENS_STEP = 256
MAX_CHUNK_TOKENS = 4096


def default_chunk_tokens(vocab_size: int, element_size: int = 2) -> int:
    """Tokens per loss chunk for a vocabulary: as many as keep one [chunk x vocab] tensor of `element_size` bytes
    within CHUNK_LOGITS_BYTES, rounded down to a multiple of CHUNK_TOKENS_STEP, between one step and
    MAX_CHUNK_TOKENS."""
    fitting = CHUNK_LOGITS_BYTES // (vocab_size * element_size)
    return min(MAX_CHUNK_TOKENS, max(CHUNK_TOKENS_STEP, fitting // CHUNK_TOKENS_STEP * CHUNK_TOKENS_STEP))


def keeps_logits_with_loss(setting: bool | str, training: bool) -> bool:
    """Whether a forward with labels also returns the logits, for the config's `return_logits_with_loss`: "auto"
    keeps them in eval mode only. A training forward with labels is read for its loss (transformers' Trainer,
    which passes no labels where it needs the logits), an eval forward for its logits too (the Trainer's
    `compute_metrics`)."""
    return not training if setting == "auto" else setting


class LogitsNotKeptError(AttributeError):
    """Reading the logits of a forward that did not keep them. An AttributeError, so that probes such as
    `hasattr(value, "dtype")` (Accelerate's fp32 conversion of outputs) see an object without that attribute."""


class LogitsNotKept:
    """What `logits` holds when a forward with labels did not keep them: it takes the logits' place in the output
    (attribute, key and tuple position alike, where None would shift `to_tuple()`), and any use of it raises
    LogitsNotKeptError saying why and how to get the logits, instead of a None that fails somewhere else."""

    def __init__(self, setting: bool | str):
        reason = (
            "return_logits_with_loss='auto' returns the loss only in training mode"
            if setting == "auto"
            else "return_logits_with_loss=False"
        )
        self._message = (
            f"the logits of this forward were not kept: it had labels and {reason} (the [tokens x vocab] logits are "
            "most of a long sequence's memory). Set config.return_logits_with_loss = True (the text config, "
            "config.get_text_config(), for the vision-language classes), or call the model without labels to get "
            "the logits with their gradient."
        )

    def __repr__(self) -> str:
        return "LogitsNotKept()"

    def __getattr__(self, name):
        if name.startswith("_"):  # protocol probes (copy, pickle) and attributes not yet set
            raise AttributeError(name)
        raise LogitsNotKeptError(self._message)

    def _refuse(self, *args, **kwargs):
        raise LogitsNotKeptError(self._message)

    __getitem__ = __iter__ = __len__ = __bool__ = __float__ = __array__ = __neg__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __matmul__ = __rmatmul__ = _refuse

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch hands a torch function any argument whose type defines this, nested in lists too (torch.cat)
        placeholder = next(leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, cls))
        raise LogitsNotKeptError(placeholder._message)


def chunk_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, with_grad: bool):
    """fp32 cross-entropy of one chunk -> (sum over the rows whose target is not IGNORE_INDEX, d(sum)/d(logits)
    in the logits' dtype with zero rows for ignored targets, or None without `with_grad`).

    logits [n, V]; targets long [n]. A target outside [0, V) other than IGNORE_INDEX fails in `gather` (eager and
    compiled alike), as `F.cross_entropy` would; ignored rows read column 0 and are masked out.
    """
    valid = targets != IGNORE_INDEX
    safe_targets = targets.masked_fill(~valid, 0).unsqueeze(1)
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # logit - logsumexp, one fused pass
    target_log_prob = log_probs.gather(1, safe_targets).squeeze(1)
    loss = torch.where(valid, -target_log_prob, 0.0).sum()
    if not with_grad:
        return loss, None
    # softmax - onehot(target): the softmax in place of the log-probabilities, then the n target entries
    # (softmax - 1, in fp32 like the rest) written over it, so no [n, V] onehot is ever formed. The target entries
    # come from the gathered log-probability, not from the softmax, so that compiled the softmax is never stored in
    # fp32. (index_put_, not scatter_: CPU's scatter_ round-trips a bf16 tensor through fp32.)
    at_target = torch.where(valid, torch.exp(target_log_prob) - 1.0, 0.0).to(logits.dtype)
    grad = log_probs.exp_().masked_fill_(~valid.unsqueeze(1), 0.0).to(logits.dtype)
    rows = torch.arange(logits.shape[0], device=logits.device)
    return loss, grad.index_put_((rows, safe_targets.squeeze(1)), at_target)


# cuBLAS accumulating a half-precision product straight into an fp32 matrix (torch.addmm with out_dtype, CUDA).
_ADDMM_FP32_OUT = hasattr(torch.ops.aten.addmm, "dtype_out")


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight (fp32) += grad_logits.T @ h. On CUDA with bf16 / fp16 inputs one GEMM accumulates into
    grad_weight in fp32 (no [V, H] product in the input dtype, no cast, no separate add); elsewhere the product is
    formed in the inputs' dtype and added in fp32."""
    if (
        grad_weight.is_cuda
        and _ADDMM_FP32_OUT
        and grad_logits.dtype in (torch.bfloat16, torch.float16)
        and (h.dtype == grad_logits.dtype)
    ):
        torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight += (grad_logits.t() @ h).float()


def _project_chunk(h, weight, kept, logits_index, start: int, end: int):
    """h @ weight.T for tokens start:end, a row-invariant product (projection.py: a token's logits do not depend on
    the chunk's row count, so a document's logits packed equal its logits alone), in the dtype autocast gives a
    matmul; recorded in `kept` when logits are kept."""
    dtype = matmul_dtype(h)
    logits = row_invariant_product(h.to(dtype), weight.to(dtype))
    if kept is not None:
        if logits_index is None:
            kept[start:end] = logits
        else:
            kept.index_copy_(0, logits_index[start:end], logits)
    return logits


class _PassOptions(NamedTuple):
    """The settings of one `_ChunkedLinearCrossEntropy` pass; its tensors are the Function's own arguments."""

    chunk_tokens: int
    chunk_loss: Callable  # chunk_cross_entropy, eager or compiled
    keep_logits: bool
    logits_rows: int | None  # rows of the kept logits when they go through logits_index
    grad_hidden: bool  # whether to compute the gradient of hidden
    grad_weight: bool  # and of the weight


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, denominator, logits_index, options: _PassOptions):
        needs_grad = options.grad_hidden or options.grad_weight
        num_tokens = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if options.grad_hidden else None  # every row is written below
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if options.grad_weight else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        autocast = torch.is_autocast_enabled(hidden.device.type)  # an out= matmul would bypass it
        kept = None
        if options.keep_logits:
            dtype = matmul_dtype(hidden)
            if logits_index is None:
                kept = hidden.new_empty((num_tokens, weight.shape[0]), dtype=dtype)
            else:  # rows not in logits_index (the caller's pad positions) stay zero
                kept = hidden.new_zeros((options.logits_rows, weight.shape[0]), dtype=dtype)
        for start in range(0, num_tokens, options.chunk_tokens):
            end = min(start + options.chunk_tokens, num_tokens)
            h = hidden[start:end]
            logits = _project_chunk(h, weight, kept, logits_index, start, end)
            loss, grad_logits = options.chunk_loss(logits, targets[start:end], needs_grad)
            total += loss
            if needs_grad:
                grad_logits = grad_logits.to(hidden.dtype)
                if grad_hidden is not None:
                    if grad_logits.dtype == weight.dtype == grad_hidden.dtype and not autocast:
                        torch.mm(grad_logits, weight, out=grad_hidden[start:end])  # contiguous rows: no copy
                    else:
                        grad_hidden[start:end] = grad_logits @ weight
                if grad_weight is not None:
                    _accumulate_weight_grad(grad_weight, grad_logits, h)
            # Freed before the next chunk's logits are allocated (rebinding the names would free them only after)
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight, denominator)
        ctx.weight_dtype = weight.dtype
        if kept is not None:
            ctx.mark_non_differentiable(kept)
        # The kept logits never receive a gradient: without this, autograd would hand backward a zero-filled
        # [tokens x vocab] tensor for them (as large as the logits, at the start of the backward).
        ctx.set_materialize_grads(False)
        return total / denominator, kept

    @staticmethod
    def backward(ctx, grad_loss, _grad_logits):
        if grad_loss is None:
            return (None,) * 6
        grad_hidden, grad_weight, denominator = ctx.saved_tensors
        scale = grad_loss / denominator
        gh = (grad_hidden * scale.to(grad_hidden.dtype)) if grad_hidden is not None else None
        gw = (grad_weight * scale).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None


def chunked_linear_cross_entropy(
    hidden,
    weight,
    targets,
    num_items_in_batch=None,
    chunk_tokens: int | None = None,
    keep_logits: bool = True,
    logits_index: torch.Tensor | None = None,
    logits_rows: int | None = None,
    chunk_loss: Callable | None = None,
):
    """Token-weighted fp32 cross-entropy of `hidden @ weight.T` against `targets` (ignore_index -100).

    hidden [N, H]; weight [V, H]; targets long [N]. The sum is divided by `num_items_in_batch` when given (HF
    Trainer's gradient accumulation), else by the number of targets. Returns (loss, logits in the hidden dtype,
    detached, or None when `keep_logits` is False). The logits are [N, V]; with `logits_index` (long [N]) they are
    [logits_rows, V] instead, token i in row logits_index[i] and zeros elsewhere (a caller's padded layout,
    filled without a second copy). `chunk_loss` is the per-chunk cross-entropy as the kernel set binds it (its
    `loss_chunk`: compiled with the fused elementwise kernels), `chunk_cross_entropy` eagerly by default.
    `chunk_tokens` defaults to `default_chunk_tokens` of the vocabulary and the matmul dtype.
    """
    targets = targets.to(hidden.device)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], matmul_dtype(hidden).itemsize)
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    else:
        denominator = (targets != IGNORE_INDEX).sum().clamp(min=1).float()
    if logits_index is not None and logits_rows is None:
        raise ValueError("logits_index needs logits_rows, the number of rows of the returned logits")
    grad_on = torch.is_grad_enabled()
    options = _PassOptions(
        chunk_tokens=chunk_tokens,
        chunk_loss=chunk_loss or chunk_cross_entropy,
        keep_logits=keep_logits,
        logits_rows=logits_rows,
        grad_hidden=grad_on and hidden.requires_grad,
        grad_weight=grad_on and weight.requires_grad,
    )
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, denominator, logits_index, options)
