"""Generation cache: per-row GDN conv/recurrent states and attention keys/values of the real tokens only.

A cached forward treats every batch row as one document of the packed stream, so prefill and decode go through
the same varlen layers as training. Keys/values are kept per row without padding, so left-padded prompts decode
exactly like unpadded ones.
"""

from __future__ import annotations

import torch

from .packing import PackedSequence


class Qwen3_5PackedCache:
    is_compileable = False

    def __init__(self, num_layers: int, batch_size: int):
        self.batch_size = batch_size
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers  # [B, C, K-1]
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers  # [B, Hv, Dk, Dv] fp32
        self.keys: list[list[torch.Tensor | None]] = [[None] * batch_size for _ in range(num_layers)]
        self.values: list[list[torch.Tensor | None]] = [[None] * batch_size for _ in range(num_layers)]
        self.seen_tokens: torch.Tensor | None = None  # long [B]: real tokens consumed per row
        self.consumed_columns = 0  # columns of the caller's input_ids consumed (padding included)

    @property
    def has_state(self) -> bool:
        return self.seen_tokens is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.consumed_columns

    def decode_sequence(self, batch: int, q_len: int, device) -> PackedSequence:
        """The packed view of a cached step: row b is document b, positions continue after its cached tokens."""
        if batch != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} rows but the input has {batch}")
        host_cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int64)
        positions = (self.seen_tokens.to(device).unsqueeze(1) + torch.arange(q_len, device=device)).reshape(-1)
        # The boundaries are built on the host, so no decode step copies them back from the device.
        return PackedSequence(host_cu.to(device, torch.int32), q_len, positions, None, (batch, q_len),
                              host_cu_seqlens=host_cu)

    def advance(self, packed: PackedSequence, columns: int) -> None:
        lengths = packed.doc_lengths().long()
        self.seen_tokens = lengths if self.seen_tokens is None else self.seen_tokens.to(lengths.device) + lengths
        self.consumed_columns += columns

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows follow `beam_idx`."""
        order = beam_idx.tolist()
        for i, state in enumerate(self.conv_states):
            if state is not None:
                self.conv_states[i] = state.index_select(0, beam_idx.to(state.device))
        for i, state in enumerate(self.recurrent_states):
            if state is not None:
                self.recurrent_states[i] = state.index_select(0, beam_idx.to(state.device))
        self.keys = [[layer[j] for j in order] for layer in self.keys]
        self.values = [[layer[j] for j in order] for layer in self.values]
        self.seen_tokens = self.seen_tokens.index_select(0, beam_idx.to(self.seen_tokens.device))
