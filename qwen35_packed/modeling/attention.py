"""Gated full attention on a packed stream.

q_proj holds, per head, [q | gate] (2 x head_dim rows per head) when `attn_output_gate` is set (all official
checkpoints); q and k get a zero-centred RMSNorm over head_dim, then partial MRoPE; the attention output is
multiplied by sigmoid(gate) before o_proj. Attention never crosses a document boundary; it runs through the
batch's kernel set (which, on a context-parallel shard, also reads the earlier shards of a document). A piece of a
document the decoder layer cut (layer_pieces.py) attends to the keys of the document's earlier pieces too
(`continue_piece`).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_probabilities import (
    cached_attention_probabilities,
    on_the_output_path,
    stream_attention_probabilities,
)
from .norms import ZeroCenteredRMSNorm
from .packed_batch import PackedBatch
from .projection import RowInvariantLinear
from .recompute import remember
from .rope import apply_rotary


class GatedAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.output_gate = config.attn_output_gate
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        q_out = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = RowInvariantLinear(config.hidden_size, q_out, bias=bias)
        self.k_proj = RowInvariantLinear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = RowInvariantLinear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = RowInvariantLinear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [N, hidden] (the packed stream of `batch`) -> (output [N, hidden], the attention
        probabilities when the batch asks for them, else None)."""
        kernels = batch.kernels
        q, gate, k, v = self._project(hidden_states, batch)
        cache, packed = batch.cache, batch.packed
        if not batch.continues_cache:  # a forward, or a prefill that fills the cache: the stream's kernel
            out = kernels.attention(q, k, v, packed, self.scaling)
            if cache is not None:
                cache.layers[self.layer_idx].append(k, v, packed.cu_seqlens_cpu().tolist())
        elif batch.one_token_per_row:  # all rows in one call
            out = kernels.attention_step(q, k, v, cache.layers[self.layer_idx], self.scaling)
        else:
            out = kernels.cached_attention(q, k, v, packed, cache.layers[self.layer_idx], self.scaling)
        probabilities = None
        if batch.output_attentions:  # the slow reference path, only when asked; `out` is the kernel's
            if batch.continues_cache:
                key_rows = batch.cache.layers[self.layer_idx].key_rows
                probabilities = cached_attention_probabilities(
                    q, key_rows, batch.packed, batch.cache.real_columns, self.scaling
                )
            else:
                probabilities = stream_attention_probabilities(q, k, batch.packed, self.scaling)
                if out.requires_grad:
                    out = on_the_output_path(out, probabilities, v, batch.packed)
        return self._output(out, gate, kernels), probabilities

    def continue_piece(self, hidden_states: torch.Tensor, batch: PackedBatch, carried: tuple, continues: bool):
        """The layer on a piece of one document that the decoder layer cut (layer_pieces.py; `batch`: the piece's),
        -> (output [n, hidden], what the piece hands on to the next one: the document's keys and values so far, its
        own included (normed and rotated), or () unless `continues`). `carried`: the keys and values the piece before
        handed on, which the piece's queries attend to before its own; () where the piece starts the document."""
        kernels = batch.kernels
        q, gate, k, v = self._project(hidden_states, batch)
        if carried:
            keys, values = torch.cat([carried[0], k]), torch.cat([carried[1], v])
            out = kernels.continued_attention(q, keys, values, self.scaling)
        else:
            keys, values = k, v
            out = kernels.attention(q, k, v, batch.packed, self.scaling)
        return self._output(out, gate, kernels), (keys, values) if continues else ()

    def _project(self, hidden_states: torch.Tensor, batch: PackedBatch):
        """hidden_states [n, hidden] -> (q [n, H, D] normed and rotated, the output gate [n, H * D] or None, k and
        v [n, Hkv, D], k normed and rotated)."""
        n, kernels = hidden_states.shape[0], batch.kernels
        # head counts from the projections' outputs, not the config: under a tensor-parallel plan each rank holds
        # a slice of the heads
        q = self.q_proj(hidden_states)
        gate = None
        if self.output_gate:
            q, gate = q.view(n, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(n, -1)
        q = self.q_norm(q.reshape(n, -1, self.head_dim), kernels)
        k = self.k_norm(self.k_proj(hidden_states).view(n, -1, self.head_dim), kernels)
        v = self.v_proj(hidden_states).view(n, -1, self.head_dim)
        cos, sin = batch.rope
        return apply_rotary(q, cos, sin), gate, apply_rotary(k, cos, sin), v

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None, kernels) -> torch.Tensor:
        """Attention's output [n, H, D] -> the output gate -> o_proj [n, hidden]."""
        out = out.reshape(out.shape[0], -1)
        if gate is not None:
            out = remember(kernels.sigmoid_gate(out, gate), kernels.sigmoid_gate, out, gate)
        return self.o_proj(out)
