"""Generation cache: per-row GDN conv/recurrent states and attention keys/values of the real tokens only.

A cached forward treats every batch row as one document of the packed stream, so prefill and decode go through
the same varlen layers as training. Keys/values are kept per row without padding, so left-padded prompts decode
exactly like unpadded ones.

It is this model's own class, not a transformers `Cache`: keys/values of different lengths per row and the GDN
states do not fit transformers' per-layer tensors. generate() reads the few attributes it asks of a cache
(`get_seq_length`, `is_linear`, `is_compileable`), and `as_packed_cache` takes the cache argument a caller or
generate() passes: an empty transformers cache (e.g. `DynamicCache()`) is replaced by this one, a filled one refused.
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
        # long [B] or None: added to the rope position of every cached step. After a multimodal prefill the next text
        # position is the prompt's largest (t, h, w) position + 1, not its token count (the built-in's rope_deltas).
        self.position_offset: torch.Tensor | None = None

    @property
    def has_state(self) -> bool:
        return self.seen_tokens is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.consumed_columns

    @property
    def is_linear(self) -> list[bool]:
        # What generate() asks of a cache it was handed: False for every layer lets it count the consumed columns
        # with get_seq_length(); prepare_inputs_for_generation slices the new columns itself either way.
        return [False] * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def decode_sequence(self, batch: int, q_len: int, device) -> PackedSequence:
        """The packed view of a cached step: row b is document b, positions continue after its cached tokens."""
        if batch != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} rows but the input has {batch}")
        host_cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int64)
        start = self.seen_tokens.to(device)
        if self.position_offset is not None:
            start = start + self.position_offset.to(device)
        positions = (start.unsqueeze(1) + torch.arange(q_len, device=device)).reshape(-1)
        # The boundaries are built on the host, so no decode step copies them back from the device.
        return PackedSequence(
            host_cu.to(device, torch.int32), q_len, positions, None, (batch, q_len), host_cu_seqlens=host_cu
        )

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
        if self.position_offset is not None:
            self.position_offset = self.position_offset.index_select(0, beam_idx.to(self.position_offset.device))


def as_packed_cache(cache):
    """This model's cache from the caller's (or generate()'s) cache argument: ours as is; an empty transformers
    Cache becomes None (the forward then creates ours); a transformers Cache with content is refused."""
    if cache is None or isinstance(cache, Qwen3_5PackedCache):
        return cache
    if hasattr(cache, "get_seq_length") and cache.get_seq_length() == 0:
        return None
    raise ValueError(
        f"a filled {type(cache).__name__} cannot be continued by the packed Qwen3.5 model, which keeps its own "
        "Qwen3_5PackedCache (per-row keys/values without padding and GDN states); continue with the "
        "past_key_values this model returned, or pass an empty cache"
    )
