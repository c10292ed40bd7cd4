"""Attention probabilities for `output_attentions`: an explicit reference computation, the slow path.

The varlen kernels never form the attention matrix. When a caller asks for the probabilities (argument or config),
each full-attention layer recomputes them from the queries and keys its kernel used (after the q / k norms and
rope) with the built-in's eager formula, a scaled matmul and a softmax in fp32, masked as this model attends: a
token sees only the earlier tokens of its own document. The layer's output still comes from its kernel, so hidden
states, logits and loss are the same with or without output_attentions. With autograd recording, the layer's
gradient then runs through the probabilities (`on_the_output_path`), so they get a gradient as the built-in's eager
ones do. The cost is the eager one: [batch, heads, seq, keys] per layer, formed only when asked.

The layout is the built-in's, [batch, heads, query columns, key columns] in the caller's columns: pad positions
hold zeros (as queries and as keys), and in a cached step each row's keys sit in the columns of its real tokens
(the cache's `real_columns`).
"""

from __future__ import annotations

import torch

from .packing import PackedSequence


def _softmax(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B, Sq, H, D], k [B, Sk, Hkv, D], allowed bool [B, Sq, Sk] -> [B, H, Sq, Sk] in q's dtype; rows without an
    allowed key (pad queries) are zeros."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # grouped-query attention: kv head i serves a group
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scaling
    mask = allowed[:, None]
    probabilities = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return probabilities.masked_fill(~mask, 0.0).nan_to_num(0.0).to(q.dtype)


def stream_attention_probabilities(
    q: torch.Tensor, k: torch.Tensor, packed: PackedSequence, scaling: float
) -> torch.Tensor:
    """A forward without earlier keys: q [N, H, D], k [N, Hkv, D] on the packed stream -> [B, H, S, S]."""
    document = packed.unpack(packed.doc_index() + 1)  # [B, S], 0 at pad positions
    columns = document.shape[1]
    causal = torch.ones(columns, columns, dtype=torch.bool, device=q.device).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & (document[:, :, None] > 0) & causal
    return _softmax(packed.unpack(q), packed.unpack(k), allowed, scaling)


def cached_attention_probabilities(
    q: torch.Tensor, key_rows: list[torch.Tensor], packed: PackedSequence, earlier: torch.Tensor, scaling: float
) -> torch.Tensor:
    """A cached step: q [N, H, D] of the new real tokens (one document per row), key_rows[b] [L_b, Hkv, D] the
    row's keys so far, the new ones last, `earlier` bool [B, consumed columns] the columns of the row's earlier real
    tokens (the cache's real_columns) -> [B, H, new columns, all columns]."""
    queries = packed.unpack(q)
    new_real = packed.real_mask()
    batch, new = new_real.shape
    real = torch.cat([earlier.to(new_real.device), new_real], dim=1)
    columns = real.shape[1]
    keys = key_rows[0].new_zeros(batch, columns, *key_rows[0].shape[1:])
    for row, row_keys in enumerate(key_rows):
        keys[row, real[row]] = row_keys
    # a real query sees the real keys in its own column and before it
    query_column = earlier.shape[1] + torch.arange(new, device=q.device)
    causal = torch.arange(columns, device=q.device)[None, :] <= query_column[:, None]
    allowed = real[:, None, :] & causal[None] & new_real[:, :, None]
    return _softmax(queries, keys, allowed, scaling)


def on_the_output_path(out: torch.Tensor, probabilities: torch.Tensor, v: torch.Tensor, packed) -> torch.Tensor:
    """The kernel's attention output `out` [N, H, D] with its gradient taken through `probabilities` [B, H, S, S]:
    the value stays the kernel's (bitwise), the backward runs the eager formula probabilities @ values (the same
    function), so a gradient reaches the returned probabilities, as in the built-in's eager attention."""
    values = packed.unpack(v)  # [B, S, Hkv, D]
    values = values.repeat_interleave(probabilities.shape[1] // values.shape[2], dim=2)
    eager = packed.pack(torch.einsum("bhqk,bkhd->bqhd", probabilities.to(values.dtype), values))
    return out.detach() + (eager - eager.detach())


__all__ = ["cached_attention_probabilities", "on_the_output_path", "stream_attention_probabilities"]
