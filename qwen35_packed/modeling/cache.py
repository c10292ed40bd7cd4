"""Generation cache: per-row GDN conv/recurrent states and attention keys/values of the real tokens only.

A cached forward treats every batch row as one document of the packed stream, so prefill and decode go through
the same varlen layers as training.

It is a transformers `Cache`, so generate(), beam search and code that reads transformers' cache layout take it.
`layers` holds one entry per decoder layer:
- a Gated DeltaNet layer is transformers' own `LinearAttentionLayer` (on transformers 4.x, which has none,
  `RecurrentStateLayer` with the same fields): `conv_states[0]` [B, C, K] holds the last K conv inputs as
  transformers keeps them (the conv of the next token reads the last K-1), `recurrent_states[0]` [B, Hv, Dk, Dv]
  the fp32 delta-rule state.
- a full-attention layer is `PerRowKeysValues`: the keys/values of every row's real tokens only, without padding
  (`key_rows[b]` [tokens of row b, kv_heads, head_dim]; held in one buffer for all rows), so left-padded prompts
  decode like unpadded ones.
  Its `keys` / `values` give transformers' layout [B, kv_heads, columns, head_dim], built when read: each row's
  tokens in their columns (`real_columns`), zeros in the columns of its padding (where a DynamicCache holds the
  padding tokens' keys).
`get_seq_length()` counts the caller's columns consumed, padding included, as transformers' caches do.

With a `capacity` (generate(cache_implementation="static"), generation.py) the cache is static: its buffers are
allocated for that many tokens per row and every decode step writes them in place (keys / values at each row's
length, the GDN states copied into theirs, the lengths and token counts incremented), so the device work of a step
touches the same memory every time and can be replayed as a CUDA graph (decode_graph.py). A row that outgrows the
capacity still grows the buffers (a new graph is captured then). The host-side counts of a step (columns consumed,
each layer's row lengths) are kept apart from its device work (`count_decode_step_on_host`), since a replayed graph
does only the latter.

Past recording and `crop` (transformers' assisted decoding: an assistant model or prompt lookup drafts tokens, one
forward checks them, `crop(-j)` drops the j rejected ones): a GDN state cannot be rolled back, so while recording
(`activate_past_recording`) each GDN layer hands the cache the state before each token it may have to drop and its
conv inputs (gated_deltanet.py), and `crop(-j)` puts back the state and conv window of j tokens earlier; attention
layers drop their last j keys. A forward that continues the cache records a state before each of its tokens, the
first forward (the prompt) before each of its last `recurrent_states_to_keep`; what accumulates is dropped at the
next crop, and generate() stops the recording of the cache it is done with (not an assistant's, which its caller
crops between calls). Rows must take the same number of new tokens, none masked; a crop beyond what was recorded
raises.

Supported: generate(), continuing generation from a returned cache (with the returned sequences or with
inputs_embeds that extend the cached prompt; new tokens may be masked, as in a forward with holes: packing.py),
beam search (`reorder_cache`), `batch_repeat_interleave` / `batch_select_indices`, past recording and `crop`.
Refused with an error: `update` and the conv/recurrent state updates (the packed layers write this cache
themselves), `reset`, and transformers' attention masks (`get_mask_sizes`). `as_packed_cache` takes the cache
argument a caller or generate() passes: an empty transformers cache (e.g. `DynamicCache()`) is replaced by this one
(`carry_past_recording` passes its past recording on), a filled one refused.
"""

from __future__ import annotations

import copy
import weakref

import torch
from transformers.cache_utils import Cache

from .packing import PackedSequence, continuation_sequence

try:
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # transformers 4.x: no linear-attention cache layer
    LinearAttentionLayer = None


class RecurrentStateLayer:
    """A GDN layer's states where transformers has no `LinearAttentionLayer` (4.x): the same fields, so readers of
    `layers[i].conv_states[0]` work on every supported version."""

    number_of_states = 1
    record_past = False
    supports_early_init = False

    def __init__(self):
        self.conv_states = {0: None}
        self.recurrent_states = {0: None}
        self.is_conv_states_initialized = {0: False}
        self.is_recurrent_states_initialized = {0: False}
        self.has_previous_state = {0: False}
        self.conv_kernel_size = {0: None}
        self.device = None
        self.dtype = None


class PerRowKeysValues:
    """A full-attention layer: keys/values of each row's real tokens, row b's `lengths[b]` of them in row b of one
    buffer [B, capacity, kv_heads, head_dim] (the capacity doubles when a row outgrows it), so a generation step
    appends every row's new key at once and attends with one call over all rows (kernels.attention_step).
    `key_rows[b]` / `value_rows[b]` are row b's [tokens, kv_heads, head_dim] (views)."""

    is_sliding = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, cache: Qwen3_5PackedCache, batch_size: int):
        # Weak: a cache and its layers go when the last reference to the cache does, not at a later pass of the
        # garbage collector, which could come during another cache's CUDA-graph capture and free the old graphs'
        # memory inside it (decode_graph.py).
        self._cache_ref = weakref.ref(cache)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.host_lengths = [0] * batch_size  # tokens held per row, on the host (slicing needs no device read)
        self.lengths: torch.Tensor | None = None  # the same, long [B] on the buffers' device (the step's mask)

    def __deepcopy__(self, memo: dict) -> PerRowKeysValues:
        """A deep copy of the cache gives layers that belong to the copy (copy.deepcopy keeps a weak reference as
        it is, which would leave the copy's layers reading the original cache)."""
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name != "_cache_ref":
                setattr(copied, name, copy.deepcopy(value, memo))
        owner = self._cache_ref()
        copied._cache_ref = self._cache_ref if owner is None else weakref.ref(memo.get(id(owner), owner))
        return copied

    @property
    def _cache(self) -> Qwen3_5PackedCache:
        """The cache this layer belongs to (its capacity, column counts and row selection)."""
        cache = self._cache_ref()
        if cache is None:
            raise RuntimeError(
                "this attention layer's Qwen3_5PackedCache was freed; keep the cache, not only its layers"
            )
        return cache

    @property
    def key_rows(self) -> list[torch.Tensor | None]:
        return self._rows(self.key_buffer)

    @property
    def value_rows(self) -> list[torch.Tensor | None]:
        return self._rows(self.value_buffer)

    def _rows(self, buffer: torch.Tensor | None) -> list[torch.Tensor | None]:
        if buffer is None:
            return [None] * len(self.host_lengths)
        return [buffer[b, :length] for b, length in enumerate(self.host_lengths)]

    def _reserve(self, k: torch.Tensor, longest: int) -> None:
        """Buffers for rows of up to `longest` tokens, of k's kind, grown by doubling; in the wider of their dtype
        and k's (the prefill and the steps may run under different autocast settings). A static cache allocates its
        capacity at once."""
        if self.key_buffer is None:
            shape = (len(self.host_lengths), max(longest, self._cache.capacity or 16), *k.shape[1:])
            self.key_buffer, self.value_buffer = k.new_zeros(shape), k.new_zeros(shape)
            self.lengths = torch.zeros(len(self.host_lengths), dtype=torch.long, device=k.device)
            self._row_index = torch.arange(len(self.host_lengths), device=k.device)
            return
        dtype = torch.promote_types(self.key_buffer.dtype, k.dtype)
        if dtype != self.key_buffer.dtype:
            self.key_buffer, self.value_buffer = self.key_buffer.to(dtype), self.value_buffer.to(dtype)
        self.make_room(longest)

    @property
    def static(self) -> bool:
        return self._cache.static

    @property
    def capacity(self) -> int:
        """Tokens per row the buffers hold now (0 before the prefill)."""
        return 0 if self.key_buffer is None else self.key_buffer.shape[1]

    def make_room(self, longest: int) -> None:
        """Grow the buffers (by doubling) so that rows of `longest` tokens fit."""
        capacity = self.capacity
        if longest > capacity:
            grow = max(longest, 2 * capacity) - capacity
            self.key_buffer = torch.nn.functional.pad(self.key_buffer, (0, 0, 0, 0, 0, grow))
            self.value_buffer = torch.nn.functional.pad(self.value_buffer, (0, 0, 0, 0, 0, grow))

    def append(self, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> None:
        """Row b's new keys / values are k[bounds[b]:bounds[b + 1]] (the stream of a cached forward)."""
        counts = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        self._reserve(k, max(length + count for length, count in zip(self.host_lengths, counts)))
        for row, (start, count) in enumerate(zip(bounds[:-1], counts)):
            if count:
                length = self.host_lengths[row]
                self.key_buffer[row, length : length + count] = k[start : start + count]
                self.value_buffer[row, length : length + count] = v[start : start + count]
        self.host_lengths = [length + count for length, count in zip(self.host_lengths, counts)]
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=k.device)

    def append_one_each(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A generation step: one new key / value per row, k / v [B, kv_heads, head_dim], written at once, in place
        (the device work reads no host value: a CUDA graph replays it)."""
        self._reserve(k, max(self.host_lengths) + 1)
        self.key_buffer[self._row_index, self.lengths] = k.to(self.key_buffer.dtype)
        self.value_buffer[self._row_index, self.lengths] = v.to(self.value_buffer.dtype)
        self.lengths.add_(1)
        self.count_one_each()

    def count_one_each(self) -> None:
        """The host side of `append_one_each`: every row holds one more token."""
        self.host_lengths = [length + 1 for length in self.host_lengths]

    @property
    def keys(self) -> torch.Tensor | None:
        return self._as_columns(self.key_rows)

    @property
    def values(self) -> torch.Tensor | None:
        return self._as_columns(self.value_rows)

    def _as_columns(self, rows: list[torch.Tensor | None]) -> torch.Tensor | None:
        if rows[0] is None:
            return None
        real = self._cache.real_columns
        out = rows[0].new_zeros(len(rows), real.shape[1], *rows[0].shape[1:])
        for b, row in enumerate(rows):
            out[b, real[b].to(row.device)] = row
        return out.transpose(1, 2)

    def get_max_length(self) -> int:
        return -1  # grows with the sequence, like a DynamicLayer

    def drop_last(self, counts: list[int]) -> None:
        """Forget row b's last counts[b] keys / values (a crop); the buffers keep their size."""
        self.host_lengths = [length - count for length, count in zip(self.host_lengths, counts)]
        if self.lengths is not None:
            self.lengths.sub_(torch.tensor(counts, dtype=torch.long).to(self.lengths.device))  # in place: graphs

    def select_rows(self, index: torch.Tensor) -> None:
        order = index.tolist()
        self.host_lengths = [self.host_lengths[j] for j in order]
        if self.key_buffer is not None:
            index = index.to(self.key_buffer.device)
            take = self._cache.take_rows
            self.key_buffer = take(self.key_buffer, index)
            self.value_buffer = take(self.value_buffer, index)
            self.lengths = take(self.lengths, index)
            if len(order) != self._row_index.numel():
                self._row_index = torch.arange(len(order), device=index.device)


def _new_linear_layer():
    return LinearAttentionLayer() if LinearAttentionLayer is not None else RecurrentStateLayer()


class Qwen3_5PackedCache(Cache):
    # Not for transformers' torch.compile of the forward: a static cache's steps are captured by decode_graph.py.
    is_compileable = False

    def __init__(self, layer_types: list[str], batch_size: int, capacity: int | None = None):
        """`capacity`: tokens per row to allocate at the prefill, which makes the cache static (module docstring);
        None: a dynamic cache, grown as it decodes."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"a static cache needs a capacity of at least one token per row, got {capacity}")
        self._batch_size = batch_size
        self.capacity = capacity
        super().__init__(
            layers=[
                _new_linear_layer() if kind == "linear_attention" else PerRowKeysValues(self, batch_size)
                for kind in layer_types
            ]
        )
        self.seen_tokens: torch.Tensor | None = None  # long [B]: real tokens consumed per row
        self.consumed_columns = 0  # columns of the caller's input_ids consumed (padding included)
        # The consumed columns in order: bool [B, c] where some are masked, a count where all of them are real (every
        # decode step), so a long generation keeps a few entries (real_columns).
        self._column_chunks: list[torch.Tensor | int] = []
        # long [B] or None: added to the rope position of every cached step. After a multimodal prefill the next text
        # position is the prompt's largest (t, h, w) position + 1, not its token count (the built-in's rope_deltas).
        self.position_offset: torch.Tensor | None = None
        # The boundaries of a step's stream by (rows, new tokens per row, device), made once (`decode_sequence`).
        self._step_boundaries: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # The captured decode steps of a static cache on CUDA (decode_graph.DecodeGraphs), made on first use.
        self.decode_graphs = None
        # Past recording (module docstring): the states the first forward keeps (None: not recording), and per GDN
        # layer what was recorded since the last crop: (its last conv inputs [B, C, K + n], n states [B, Hv, Dk, Dv]).
        self.past_to_keep: int | None = None
        self._linear_past: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    @property
    def static(self) -> bool:
        """Whether the buffers were allocated for `capacity` tokens and every step writes them in place."""
        return self.capacity is not None

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def real_columns(self) -> torch.Tensor:
        """bool [B, consumed columns]: True at the columns of real tokens (where the keys of `PerRowKeysValues` sit)."""
        device = next((c.device for c in self._column_chunks if isinstance(c, torch.Tensor)), None)
        return torch.cat(
            [
                c if isinstance(c, torch.Tensor) else torch.ones(self.batch_size, c, dtype=torch.bool, device=device)
                for c in self._column_chunks
            ],
            dim=1,
        )

    @property
    def has_state(self) -> bool:
        return self.seen_tokens is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.consumed_columns

    @property
    def is_linear(self) -> list[bool]:
        # Not every layer is linear, so generate() counts the consumed columns with get_seq_length().
        return [not isinstance(layer, PerRowKeysValues) for layer in self.layers]

    def linear_states(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A GDN layer's (conv [B, C, K], recurrent [B, Hv, Dk, Dv]) states; (None, None) before the prefill."""
        layer = self.layers[layer_idx]
        return layer.conv_states[0], layer.recurrent_states[0]

    def store_linear_states(self, layer_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """A GDN layer's new states; a static cache copies them into the tensors it holds (same memory every step)."""
        layer = self.layers[layer_idx]
        held_conv, held_recurrent = layer.conv_states[0], layer.recurrent_states[0]
        if self.static and _same_kind(held_conv, conv) and _same_kind(held_recurrent, recurrent):
            for held, new in ((held_conv, conv), (held_recurrent, recurrent)):
                if held is not new:  # the delta-rule step writes the recurrent state in place
                    held.copy_(new)
            return
        layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.device, layer.dtype = conv.device, conv.dtype
        for flags in (
            layer.is_conv_states_initialized,
            layer.is_recurrent_states_initialized,
            layer.has_previous_state,
        ):
            flags[0] = True

    @property
    def records_past(self) -> bool:
        return self.past_to_keep is not None

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can put the cache back as it was: while it records the past."""
        return self.records_past

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Record what `crop` needs from now on (module docstring); `recurrent_states_to_keep`: how many of the
        first forward's last tokens can be dropped (at least one)."""
        self.past_to_keep = max(1, recurrent_states_to_keep or 1)

    def stop_recording_past(self) -> None:
        """Record nothing more, and drop what was recorded (generate() calls it when assisted decoding is done)."""
        self.past_to_keep = None
        self._linear_past.clear()

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return self.records_past

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return self.past_to_keep or 0

    def states_to_record(self, tokens: int, continues: bool) -> int:
        """How many of a forward's `tokens` (per row) get their state recorded: every one where the forward
        continues the cache, else the last `past_to_keep`."""
        return tokens if continues else min(tokens, self.past_to_keep)

    def record_linear_past(
        self,
        layer_idx: int,
        states: list[torch.Tensor],
        conv_inputs: torch.Tensor,
        conv_before: torch.Tensor | None,
        kernel: int,
    ) -> None:
        """A recording GDN layer's forward: `states` the recurrent states before each of its last len(states)
        tokens (tensors of their own: a static cache overwrites the one it holds), `conv_inputs` [B, C, tokens] its
        conv inputs, `conv_before` [B, C, kernel] the conv state before it (None before the prompt). Call before
        `store_linear_states`, which overwrites a static cache's conv state."""
        held = self._linear_past.get(layer_idx)
        if held is not None and len(states) == conv_inputs.shape[-1]:  # every token recorded: continues what is held
            base, history = held[0], held[1] + list(states)
        else:
            base = conv_before if conv_before is not None else conv_inputs.new_zeros(*conv_inputs.shape[:2], kernel)
            history = list(states)
        columns = torch.cat([base.to(conv_inputs.dtype), conv_inputs], dim=-1)
        self._linear_past[layer_idx] = (columns[..., -(kernel + len(history)) :], history)

    def crop(self, tokens_to_remove: int = 0) -> None:
        """Drop the last `-tokens_to_remove` tokens of every row (transformers 5.25's convention: a count <= 0),
        then what was recorded for it (module docstring). Checked whole before anything changes."""
        if not self.records_past:
            raise _unsupported("crop without past recording", "call activate_past_recording() before the forwards")
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a count <= 0, got {tokens_to_remove}")
        count = -tokens_to_remove
        if count:
            removed = self._removed_real_tokens(count)
            if any(r != count for r in removed):
                raise ValueError(f"crop({tokens_to_remove}): the last {count} columns hold masked tokens")
            for layer_idx, layer in enumerate(self.layers):
                if not isinstance(layer, PerRowKeysValues):
                    recorded = len(self._linear_past.get(layer_idx, (None, []))[1])
                    if recorded < count:
                        raise ValueError(
                            f"crop({tokens_to_remove}): layer {layer_idx} recorded the states of {recorded} tokens "
                            "since the last crop; pass a larger recurrent_states_to_keep to activate_past_recording()"
                        )
            for layer_idx, layer in enumerate(self.layers):
                if isinstance(layer, PerRowKeysValues):
                    layer.drop_last(removed)
                    continue
                columns, history = self._linear_past[layer_idx]
                end = columns.shape[-1] - count
                conv = columns[..., end - layer.conv_kernel_size[0] : end].contiguous()
                self.store_linear_states(layer_idx, conv, history[-count])
            self.seen_tokens.sub_(torch.tensor(removed, dtype=torch.long).to(self.seen_tokens.device))
            self._uncount_columns(count)
        self._linear_past.clear()

    def _removed_real_tokens(self, columns: int) -> list[int]:
        """Real tokens per row in the last `columns` consumed columns."""
        if columns > self.consumed_columns:
            raise ValueError(f"crop: the cache holds {self.consumed_columns} columns, not {columns}")
        removed, left = [0] * self.batch_size, columns
        for chunk in reversed(self._column_chunks):
            taken = min(left, chunk if isinstance(chunk, int) else chunk.shape[1])
            real = [taken] * self.batch_size if isinstance(chunk, int) else chunk[:, -taken:].sum(1).tolist()
            removed = [a + b for a, b in zip(removed, real)]
            left -= taken
            if not left:
                return removed
        return removed

    def _uncount_columns(self, columns: int) -> None:
        self.consumed_columns -= columns
        while columns:
            chunk = self._column_chunks.pop()
            width = chunk if isinstance(chunk, int) else chunk.shape[1]
            taken = min(columns, width)
            if taken < width:
                self._column_chunks.append(chunk - taken if isinstance(chunk, int) else chunk[:, : width - taken])
            columns -= taken

    def decode_sequence(self, batch: int, q_len: int, device, new_real: torch.Tensor | None = None) -> PackedSequence:
        """The packed view of a cached step: row b is document b, positions continue after its cached tokens;
        `new_real` (bool [batch, q_len]) marks the real new tokens when some are masked
        (packing.continuation_sequence)."""
        if batch != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} rows but the input has {batch}")
        start = self.seen_tokens.to(device)
        if self.position_offset is not None:
            start = start + self.position_offset.to(device)
        boundaries = None
        if new_real is None:  # built once per shape: a step copies nothing from the host to the device
            key = (batch, q_len, torch.device(device))
            if key not in self._step_boundaries:
                host = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int64)
                self._step_boundaries[key] = (host.to(device, torch.int32), host)
            boundaries = self._step_boundaries[key]
        return continuation_sequence(new_real, batch, q_len, start, device, boundaries)

    def advance(self, packed: PackedSequence, columns: int) -> None:
        """The cache has consumed `packed` (the stream of a forward) and `columns` of the caller's layout."""
        lengths = packed.doc_lengths().long()
        if self.seen_tokens is None:
            self.seen_tokens = lengths.clone()
        elif self.seen_tokens.device == lengths.device:
            self.seen_tokens.add_(lengths)  # in place: a captured step's graph reads and writes this tensor
        else:
            self.seen_tokens = self.seen_tokens.to(lengths.device) + lengths
        self._count_columns(columns, packed.real_mask() if packed.token_index is not None else None)

    def count_decode_step_on_host(self) -> None:
        """The host-side counts of a decode step with one real token per row, which a replayed CUDA graph of the
        step does not make: the column consumed, each attention layer's row lengths."""
        for layer in self.layers:
            if isinstance(layer, PerRowKeysValues):
                layer.count_one_each()
        self._count_columns(1, None)

    def host_counts(self) -> tuple:
        """The host-side counts (columns consumed, their chunks, each attention layer's row lengths), to put back
        with `restore_host_counts`."""
        lengths = [list(layer.host_lengths) for layer in self.layers if isinstance(layer, PerRowKeysValues)]
        return self.consumed_columns, list(self._column_chunks), lengths

    def restore_host_counts(self, counts: tuple) -> None:
        self.consumed_columns, chunks, lengths = counts
        self._column_chunks = list(chunks)
        for layer, held in zip((layer for layer in self.layers if isinstance(layer, PerRowKeysValues)), lengths):
            layer.host_lengths = list(held)

    def make_room_for_decode_step(self) -> None:
        """Grow the attention buffers, where a row is full, before a decode step whose device work is replayed (a
        captured step cannot grow them)."""
        for layer in self.layers:
            if isinstance(layer, PerRowKeysValues) and layer.key_buffer is not None:
                layer.make_room(max(layer.host_lengths) + 1)

    def decode_state(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes in place: a captured step is valid while these stay the same
        tensors (decode_graph.py)."""
        held = [self.seen_tokens, self.position_offset]
        for layer in self.layers:
            if isinstance(layer, PerRowKeysValues):
                held += [layer.key_buffer, layer.value_buffer, layer.lengths, layer._row_index]
            else:
                held += [layer.conv_states[0], layer.recurrent_states[0]]
        return [t for t in held if t is not None]

    def take_rows(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """t's rows `index` (t [B, ...]); a static cache writes them into t itself when the row count stays, so the
        tensors a captured step holds stay valid (beam search reorders rows every step)."""
        rows = t.index_select(0, index.to(t.device))
        if self.static and rows.shape == t.shape:
            return t.copy_(rows)
        return rows

    def _count_columns(self, columns: int, real_mask: torch.Tensor | None) -> None:
        self.consumed_columns += columns
        if real_mask is not None:
            self._column_chunks.append(real_mask)
        elif self._column_chunks and not isinstance(self._column_chunks[-1], torch.Tensor):
            self._column_chunks[-1] += columns
        else:
            self._column_chunks.append(columns)

    def _select_rows(self, index: torch.LongTensor) -> None:
        """Row b becomes the old row index[b] (index may repeat rows or drop them)."""
        self._linear_past.clear()  # recorded for the old rows
        for layer in self.layers:
            if isinstance(layer, PerRowKeysValues):
                layer.select_rows(index)
                continue
            for states in (layer.conv_states, layer.recurrent_states):
                if states[0] is not None:
                    states[0] = self.take_rows(states[0], index)
        self._column_chunks = [
            c.index_select(0, index.to(c.device)) if isinstance(c, torch.Tensor) else c for c in self._column_chunks
        ]
        for name in ("seen_tokens", "position_offset"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, self.take_rows(value, index))
        self._batch_size = index.numel()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows follow `beam_idx`."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.long())

    # transformers' Cache operations this cache cannot honour: an error, never a silently wrong cache.

    def update(self, *args, **kwargs):
        raise _unsupported("update", "the packed model's layers write its keys/values per row themselves")

    def update_conv_state(self, *args, **kwargs):
        raise _unsupported("update_conv_state", "the packed model's GDN layers write their states themselves")

    def update_recurrent_state(self, *args, **kwargs):
        raise _unsupported("update_recurrent_state", "the packed model's GDN layers write their states themselves")

    def reset(self):
        raise _unsupported("reset", "it is grown per row; start a new generation with a fresh cache instead")

    def get_mask_sizes(self, *args, **kwargs):
        raise _unsupported("get_mask_sizes", "the packed model builds no transformers attention mask")


def _same_kind(held: torch.Tensor | None, new: torch.Tensor) -> bool:
    return held is not None and held.shape == new.shape and held.dtype == new.dtype and held.device == new.device


def _unsupported(operation: str, reason: str) -> NotImplementedError:
    return NotImplementedError(f"Qwen3_5PackedCache does not support {operation}: {reason}")


def _recorded_past(cache) -> int | None:
    """The `recurrent_states_to_keep` a cache records the past with (`activate_past_recording`, which transformers
    calls on the empty cache it made for assisted decoding before this model replaces it), or None."""
    if isinstance(cache, Qwen3_5PackedCache):
        return cache.past_to_keep
    if isinstance(cache, Cache) and any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", ())):
        return max(1, cache.get_recurrent_states_to_keep() or 1)
    return None


def carry_past_recording(given, cache: Qwen3_5PackedCache | None) -> None:
    """`cache`, made in place of the cache argument `given`, records the past as `given` was asked to."""
    past_to_keep = _recorded_past(given)
    if past_to_keep is not None and cache is not None and not cache.records_past:
        cache.activate_past_recording(past_to_keep)


def as_packed_cache(cache):
    """This model's cache from the caller's (or generate()'s) cache argument: ours as is; an empty transformers
    Cache becomes None (the forward then creates ours); a transformers Cache with content is refused."""
    if cache is None or isinstance(cache, Qwen3_5PackedCache):
        return cache
    if isinstance(cache, Cache) and cache.get_seq_length() == 0:
        return None
    raise ValueError(
        f"a filled {type(cache).__name__} cannot be continued by the packed Qwen3.5 model, which keeps its own "
        "Qwen3_5PackedCache (per-row keys/values without padding and GDN states); continue with the "
        "past_key_values this model returned, or pass an empty cache"
    )
