"""The packing contract: turn any accepted batch form into one varlen token stream with exact boundaries.

Accepted entry forms (precedence from the most explicit to the least):
  (d) an explicit `cu_seqlens` [n_docs + 1] (batch size 1);
  (c) `cu_seq_lens_q` / `cu_seq_lens_k` (+ `max_length_q` / `max_length_k`), the flash-attention kwargs that
      transformers' DataCollatorWithFlattening path produces (batch size 1; q and k must be equal);
  (b) `position_ids` that restart at 0 for every document (one or more rows);
  (a) a padded batch with a 2D `attention_mask` (left and/or right padding; a row with holes, real tokens after
      padding inside it, is one document: see below).
`seq_idx` [batch, seq_len] (the document index of every token, as TRL's flattening collator and
DataCollatorWithFlattening(return_seq_idx=True) add it for linear-attention convs) may accompany any form: a
document starts wherever it changes within a row. Alone (or with padding only) it gives the boundaries, like
restarting position_ids; with another source it must agree with it.
Forms combine only when they agree: an explicit boundary source (c/d) given together with `position_ids` must
match the per-document positions it implies, `cu_seqlens` and `cu_seq_lens_q` must be equal, `seq_idx` must change
exactly at the documents' starts, and padding cannot be combined with c/d. Anything else raises ValueError naming
the problem.

Every row of a padded batch is one document (or several, when its position_ids restart); pad tokens are dropped
before the first layer, so no layer ever computes on them, and outputs are scattered back to the padded layout.

A mask with holes (real tokens after padding inside a row) is taken as transformers' built-in classes take it: the
row is one document whose masked tokens no attention query sees and no position counts, and which the Gated
DeltaNet layers read as zero inputs, their conv and recurrence running through them (the built-in zeroes the
hidden states of masked tokens before those layers: `apply_mask_to_padding_states`). The holes are kept for those
layers only (`RecurrentSpans`); every other layer runs on the real tokens. Such a row's `position_ids` must count
its real tokens (what generate() gives); `seq_idx` and unshifted `labels` are refused with it (see loss_targets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionSegment:
    """Tokens [start, end) of a stream: one long document attended alone, or a run of shorter documents attended
    through the varlen kernel with their boundaries relative to `start` (cu_seqlens on the stream's device)."""

    start: int
    end: int
    alone: bool
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0


@dataclass(frozen=True)
class RecurrentSpans:
    """The stream the Gated DeltaNet layers run on where masked tokens sit between real ones (a mask with holes,
    or padding in the new tokens of a cached step): each document spans its columns up to its last real token,
    from its first real token (or from the first new column, continuing a cache), and the masked tokens in it are
    zero inputs, as the built-in zeroes them."""

    stream: PackedSequence  # the documents with their masked tokens, in the order of the real stream
    real: torch.Tensor  # long [num_tokens of the real stream]: where each real token sits in `stream`
    masked_columns: torch.Tensor  # long: flat caller indices (batch * seq_len) of the masked tokens in `stream`

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] on the real stream -> [N', ...] on `stream`, zeros at the masked tokens."""
        return x.new_zeros(self.stream.num_tokens, *x.shape[1:]).index_copy(0, self.real, x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N', ...] on `stream` -> [N, ...] at the real tokens."""
        return x.index_select(0, self.real)


@dataclass
class PackedSequence:
    """One varlen stream of `num_tokens` real tokens, split into documents by `cu_seqlens`."""

    cu_seqlens: torch.Tensor  # int32 [n_docs + 1], starts at 0, strictly increasing, ends at num_tokens
    max_seqlen: int
    position_ids: torch.Tensor  # long [num_tokens] (or [3, num_tokens] for multimodal rope)
    token_index: torch.Tensor | None  # long [num_tokens]: flat index into batch * seq_len, None if nothing dropped
    batch_shape: tuple[int, int]  # (batch, seq_len) of the caller's layout
    # int64 CPU copy of cu_seqlens when the builder already holds the boundaries on the host; else made on first use.
    host_cu_seqlens: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # Masked tokens between real ones, which the Gated DeltaNet layers read as zero inputs (None: there are none).
    spans: RecurrentSpans | None = field(default=None, repr=False, compare=False)
    # Per-token indices derived from cu_seqlens (which never changes), computed once and shared by all layers.
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def cu_seqlens_cpu(self) -> torch.Tensor:
        """cu_seqlens as int64 on the CPU, one object per stream. Kernels that need the boundaries on the host
        (FLA's varlen index helpers, per-document loops) read them here instead of copying from the device in
        every layer: at most one device-to-host copy per stream, none when the builder had them on the host."""
        if self.host_cu_seqlens is None:
            self.host_cu_seqlens = self.cu_seqlens.to("cpu", torch.int64)
        return self.host_cu_seqlens

    def cu_seqlens_int64(self) -> torch.Tensor:
        """cu_seqlens as int64 on the device (FLA's index type), one object per stream: FLA memoises its varlen
        indices by tensor identity, so every layer's forward and backward must receive this same object."""
        if "cu_seqlens_int64" not in self._derived:
            self._derived["cu_seqlens_int64"] = self.cu_seqlens.long()
        return self._derived["cu_seqlens_int64"]

    @property
    def num_tokens(self) -> int:
        if "num_tokens" not in self._derived:
            self._derived["num_tokens"] = int(self.cu_seqlens_cpu()[-1])
        return self._derived["num_tokens"]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def doc_lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def position_in_doc(self) -> torch.Tensor:
        """Offset of every token from the start of its document (long [num_tokens])."""
        if "position_in_doc" not in self._derived:
            # output_size from the host copy: repeat_interleave would otherwise read the total back from the device.
            starts = torch.repeat_interleave(
                self.cu_seqlens[:-1].long(), self.doc_lengths().long(), output_size=self.num_tokens
            )
            self._derived["position_in_doc"] = torch.arange(self.num_tokens, device=self.cu_seqlens.device) - starts
        return self._derived["position_in_doc"]

    def doc_index(self) -> torch.Tensor:
        """Index of the document every token belongs to (long [num_tokens])."""
        if "doc_index" not in self._derived:
            self._derived["doc_index"] = torch.repeat_interleave(
                torch.arange(self.num_docs, device=self.cu_seqlens.device),
                self.doc_lengths().long(),
                output_size=self.num_tokens,
            )
        return self._derived["doc_index"]

    def attention_segments(self, long_tokens: int) -> list[AttentionSegment]:
        """The stream cut into documents of at least `long_tokens` (alone) and the runs of shorter documents between
        them, in stream order; built once per stream from the host boundaries (one small host-to-device copy per
        run), shared by every attention layer."""
        key = ("attention_segments", long_tokens)
        if key not in self._derived:
            bounds = self.cu_seqlens_cpu().tolist()
            segments, run = [], [bounds[0]]
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end - start < long_tokens:
                    run.append(end)
                    continue
                if len(run) > 1:
                    segments.append(self._varlen_run(run))
                segments.append(AttentionSegment(start, end, alone=True))
                run = [end]
            if len(run) > 1:
                segments.append(self._varlen_run(run))
            self._derived[key] = segments
        return self._derived[key]

    def _varlen_run(self, bounds: list[int]) -> AttentionSegment:
        cu = torch.tensor([b - bounds[0] for b in bounds], dtype=torch.int32).to(self.cu_seqlens.device)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return AttentionSegment(bounds[0], bounds[-1], alone=False, cu_seqlens=cu, max_seqlen=longest)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, ...] -> [num_tokens, ...] (real tokens only)."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.token_index is None else flat.index_select(0, self.token_index)

    def unpack(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[num_tokens, ...] -> [batch, seq, ...], pad positions filled with `fill`."""
        batch, seq_len = self.batch_shape
        if self.token_index is None:
            return x.reshape(batch, seq_len, *x.shape[1:])
        out = x.new_full((batch * seq_len, *x.shape[1:]), fill)
        out.index_copy_(0, self.token_index, x)  # in place: the padded logits of a long batch are tens of GiB, once
        return out.reshape(batch, seq_len, *x.shape[1:])

    def real_mask(self) -> torch.Tensor:
        """bool [batch, seq_len]: True at the caller's columns that hold a token of the stream."""
        batch, seq_len = self.batch_shape
        if self.token_index is None:
            return torch.ones(batch, seq_len, dtype=torch.bool, device=self.cu_seqlens.device)
        real = torch.zeros(batch * seq_len, dtype=torch.bool, device=self.token_index.device)
        return real.index_fill(0, self.token_index, True).view(batch, seq_len)


def input_shape(input_ids, inputs_embeds) -> tuple[int, int]:
    """(batch, seq_len) of the caller's tokens; exactly one of input_ids [B, T] / inputs_embeds [B, T, H]."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:2])
    if len(shape) != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {shape}")
    return shape


def _as_cu_seqlens(value, name: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 on `device`, int64 on the CPU) boundaries from the caller's value, validated on the host copy: one
    device-to-host copy when the caller's tensor is on the device, none for CPU tensors and lists."""
    given = torch.as_tensor(value)
    if given.dtype.is_floating_point or given.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {given.dtype}")
    if given.ndim != 1 or given.numel() < 2:
        raise ValueError(f"{name} must be 1D with at least 2 entries, got shape {tuple(given.shape)}")
    host = given.to("cpu", torch.int64, copy=True)  # never the caller's own tensor
    if int(host[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(host[0])}")
    steps = host[1:] - host[:-1]
    if bool((steps < 0).any()):
        raise ValueError(f"{name} must be increasing, got {host.tolist()}")
    if bool((steps == 0).any()):
        raise ValueError(f"{name} contains an empty document (two equal entries): {host.tolist()}")
    if given.device.type == "cpu":
        # non_blocking: from pageable memory the copy is staged at once and never waits for the device's queue.
        return host.to(torch.int32).to(device, non_blocking=True), host
    return given.to(device=device, dtype=torch.int32), host


def padding_mask_values(attention_mask: torch.Tensor) -> torch.Tensor:
    """The bool mask of a padding mask given as bool, or as integers or floats that are all 0 or 1; any other value
    (a 2 would read as True, a 0.5 as well) raises. One reduction read on the host for a mask that is not bool."""
    if attention_mask.dtype != torch.bool:
        other = (attention_mask != 0) & (attention_mask != 1)
        if bool(other.any()):
            value = attention_mask[other][0].item()
            raise ValueError(f"attention_mask must hold only 0 and 1 (or True / False), got {value}")
    return attention_mask.bool()


def _padding_mask(attention_mask: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch, seq_len):
        raise ValueError(
            f"attention_mask must be a 2D [batch, seq_len] = [{batch}, {seq_len}] padding mask of 0/1, got shape "
            f"{tuple(attention_mask.shape)} (4D or custom masks are not accepted: boundaries come from the packing "
            "contract)"
        )
    return padding_mask_values(attention_mask)


def _up_to_last_real(valid: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: True at every column up to and including the row's last real token."""
    return valid.to(torch.int8).flip(1).cummax(dim=1).values.flip(1).bool()


def _split_at_starts(starts: torch.Tensor, token_index: torch.Tensor | None) -> PackedSequence:
    """The stream of the caller's columns `token_index` (flat indices into batch * seq_len; None: every column),
    a document starting at each of them where `starts` (bool [batch, seq_len]) is True, the first one included;
    positions count within the documents."""
    batch, seq_len = starts.shape
    flat_starts = starts.reshape(-1)
    if token_index is not None:
        flat_starts = flat_starts.index_select(0, token_index)
    # Boundaries found on the host (the one device-to-host copy of the starts), then sent to the device: the host
    # copy stays with the stream for the kernels that need it (PackedSequence.cu_seqlens_cpu).
    start_index = torch.nonzero(flat_starts.cpu()).flatten()
    host = torch.cat([start_index, start_index.new_tensor([flat_starts.numel()])])
    packed = PackedSequence(
        host.to(torch.int32).to(starts.device, non_blocking=True),
        int((host[1:] - host[:-1]).max()),
        None,
        token_index,
        (batch, seq_len),
        host,
    )
    packed.position_ids = packed.position_in_doc()
    return packed


def _recurrent_spans(
    span: torch.Tensor, starts: torch.Tensor, valid: torch.Tensor, token_index: torch.Tensor
) -> RecurrentSpans:
    """RecurrentSpans of the columns `span` (bool [B, S], the real tokens and the masked ones the recurrent layers
    read), split where `starts` (bool [B, S]) is True; `token_index` the real stream's flat caller indices."""
    flat_span = span.reshape(-1)
    stream = _split_at_starts(starts, torch.nonzero(flat_span).flatten())
    rank = torch.cumsum(flat_span.to(torch.long), 0) - 1  # place of every spanned column in the span stream
    masked = torch.nonzero(flat_span & ~valid.reshape(-1)).flatten()
    return RecurrentSpans(stream, rank.index_select(0, token_index), masked)


def build_packed_sequence(
    input_shape: tuple[int, int],
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    seq_idx: torch.Tensor | None = None,
) -> PackedSequence:
    """Resolve the caller's batch into a PackedSequence, enforcing the packing contract (module docstring): the
    most explicit form given sets the documents (one builder per form below), and `position_ids` and `seq_idx`
    given beside it must agree with them."""
    batch, seq_len = input_shape
    seq_idx_changes = _seq_idx_changes(seq_idx, batch, seq_len, device) if seq_idx is not None else None
    position_ids, mrope_positions = _text_and_mrope_positions(position_ids, batch, seq_len, device)
    explicit = _explicit_cu_seqlens(cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, device)
    if explicit is not None:  # (d) or (c)
        packed = _from_cu_seqlens(*explicit, batch, seq_len, attention_mask, max_length_q, max_length_k)
        if position_ids is not None:
            _check_positions_agree(packed, position_ids, source=explicit[2])
        if seq_idx_changes is not None:
            _check_seq_idx_matches(packed, seq_idx_changes, source=explicit[2])
    else:
        real = _RealTokens.of(attention_mask, batch, seq_len, device)
        if seq_idx_changes is not None and real.holes is not None:
            rows = torch.nonzero(real.holes).flatten().tolist()
            raise ValueError(
                f"seq_idx cannot be combined with an attention_mask with holes (real tokens after padding inside "
                f"rows {rows}): such a row is one document"
            )
        if position_ids is not None:  # (b)
            packed = _from_position_ids(position_ids, real)
            if seq_idx_changes is not None:
                _check_seq_idx_matches(packed, seq_idx_changes, source="position_ids")
        elif seq_idx_changes is not None:
            packed = _from_seq_idx(seq_idx_changes, real)
        else:  # (a), or rows without padding
            packed = _one_document_per_row(real)
    if mrope_positions is not None:  # rope positions as given; the documents came from another form
        packed.position_ids = torch.stack([packed.pack(p) for p in mrope_positions])
    return packed


def _text_and_mrope_positions(
    position_ids, batch: int, seq_len: int, device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The caller's `position_ids` as (text positions [batch, seq_len], None), a 1D row standing for every row, or
    as (None, multimodal rope positions [3, batch, seq_len]); (None, None) without them."""
    if position_ids is None:
        return None, None
    position_ids = torch.as_tensor(position_ids, device=device)
    if position_ids.ndim == 3:
        # Multimodal rope positions [3 (t, h, w), batch, seq] (or [4, ...] with a leading text row, the layout
        # transformers' Qwen3.5 uses). Document boundaries must then come from another source.
        if position_ids.shape[0] == 4:
            position_ids = position_ids[1:]
        if position_ids.shape[0] != 3 or tuple(position_ids.shape[1:]) != (batch, seq_len):
            raise ValueError(f"3D position_ids must be [3, batch, seq_len], got {tuple(position_ids.shape)}")
        return None, position_ids
    if position_ids.ndim == 1:
        position_ids = position_ids.unsqueeze(0).expand(batch, -1)
    if tuple(position_ids.shape) != (batch, seq_len):
        raise ValueError(
            f"position_ids must be [batch, seq_len] = [{batch}, {seq_len}], got {tuple(position_ids.shape)}"
        )
    return position_ids, None


def _explicit_cu_seqlens(
    cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, device
) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """The explicit boundaries, (d) `cu_seqlens` or (c) `cu_seq_lens_q` / `cu_seq_lens_k`, each validated and all
    that are given equal: (int32 on `device`, int64 on the CPU, the name of the form); None when none is given."""
    explicit = None
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        q = _as_cu_seqlens(cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k, "cu_seq_lens_q", device)
        if cu_seq_lens_k is not None and cu_seq_lens_q is not None:
            k = _as_cu_seqlens(cu_seq_lens_k, "cu_seq_lens_k", device)
            if not torch.equal(q[1], k[1]):
                raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; causal self-attention needs them equal")
        explicit = (*q, "cu_seq_lens_q/k")
    if cu_seqlens is not None:
        d = _as_cu_seqlens(cu_seqlens, "cu_seqlens", device)
        if explicit is not None and not torch.equal(d[1], explicit[1]):
            raise ValueError("cu_seqlens and cu_seq_lens_q/k are both given and differ")
        explicit = (*d, "cu_seqlens")
    return explicit


def _from_cu_seqlens(
    cu: torch.Tensor,
    host: torch.Tensor,
    source: str,
    batch: int,
    seq_len: int,
    attention_mask: torch.Tensor | None,
    max_length_q: int | None,
    max_length_k: int | None,
) -> PackedSequence:
    """(d) / (c): the documents of the explicit boundaries `cu` (`host`, its CPU copy), which describe one row
    without padding; `max_length_q` / `max_length_k`, where given, must be the longest document."""
    if batch != 1:
        raise ValueError(
            f"{source} describes one packed row, but the batch has {batch} rows; concatenate the documents "
            "into a single row of shape [1, total_tokens]"
        )
    if int(host[-1]) != seq_len:
        raise ValueError(f"{source} must end at the token count {seq_len}, got {int(host[-1])}")
    if attention_mask is not None and not bool(_padding_mask(attention_mask, batch, seq_len).all()):
        raise ValueError(f"attention_mask with padding cannot be combined with {source}; drop the pad tokens")
    max_seqlen = int((host[1:] - host[:-1]).max())
    for name, given in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
        if given is not None and int(given) != max_seqlen:
            raise ValueError(f"{name}={int(given)} but the longest document in {source} has {max_seqlen} tokens")
    packed = PackedSequence(cu, max_seqlen, None, None, (batch, seq_len), host)
    packed.position_ids = packed.position_in_doc()
    return packed


@dataclass(frozen=True)
class _RealTokens:
    """The caller's columns that hold real tokens, as a 2D padding mask gives them (every column without one): what
    the forms without explicit boundaries split into documents."""

    valid: torch.Tensor | None  # bool [batch, seq_len]; None without a mask
    token_index: torch.Tensor | None  # long: flat caller indices of the real tokens; None when every column is real
    row_starts: torch.Tensor  # bool [batch, seq_len]: each row's first real token, which always starts a document
    span: torch.Tensor | None  # bool [batch, seq_len]: each row's columns from its first real token to its last
    holes: torch.Tensor | None  # bool [batch]: the rows with masked tokens inside their span; None when none has

    @classmethod
    def of(cls, attention_mask: torch.Tensor | None, batch: int, seq_len: int, device) -> _RealTokens:
        valid = _padding_mask(attention_mask, batch, seq_len) if attention_mask is not None else None
        span = holes = token_index = None
        if valid is not None:
            # between each row's first and last real token; a masked token there is a hole
            span = valid.to(torch.int8).cummax(dim=1).values.bool() & _up_to_last_real(valid)
            holes = (span & ~valid).any(dim=1)
            if not bool(holes.any()):
                holes = None
            if not bool(valid.all()):
                token_index = torch.nonzero(valid.reshape(-1)).flatten()
        if (batch * seq_len if token_index is None else token_index.numel()) == 0:
            raise ValueError("the batch holds no real token (attention_mask is all zeros)")
        row_starts = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
        if valid is None:
            row_starts[:, 0] = True
        else:
            row_starts[torch.arange(batch, device=device), valid.to(torch.int8).argmax(dim=1)] = True
        return cls(valid, token_index, row_starts, span, holes)

    def split_at(self, starts: torch.Tensor) -> PackedSequence:
        """The real tokens as documents starting where `starts` (bool [batch, seq_len]) is True; a row with holes
        keeps its masked tokens for the Gated DeltaNet layers (PackedSequence.spans)."""
        packed = _split_at_starts(starts, self.token_index)
        if self.holes is not None:
            packed.spans = _recurrent_spans(self.span, starts, self.valid, self.token_index)
        return packed


def _from_position_ids(position_ids: torch.Tensor, real: _RealTokens) -> PackedSequence:
    """(b): a document starts at every row's first real token and wherever `position_ids` restart at 0, and they
    must count 0, 1, 2, ... within it. A row with holes is one document: a 0 after its first real token breaks the
    count."""
    restarts = position_ids == 0
    if real.holes is not None:
        restarts = restarts & ~real.holes[:, None]
    packed = real.split_at(real.row_starts | restarts)
    mismatch = _first_position_mismatch(packed, position_ids)
    if mismatch is not None:
        token, given, expected = mismatch
        holes_note = (
            "; a row whose attention_mask has holes is one document, its positions count its real tokens"
            if real.holes is not None
            else ""
        )
        raise ValueError(
            "position_ids must count 0, 1, 2, ... within each document (restarting at 0 for a new document, "
            f"starting at the first real token of each row); real token {token} has position {given} "
            f"where {expected} was expected{holes_note}"
        )
    return packed


def _from_seq_idx(seq_idx_changes: torch.Tensor, real: _RealTokens) -> PackedSequence:
    """`seq_idx` as the boundary source: a document starts at every row's first real token and wherever seq_idx
    changes within a row (`seq_idx_changes`, bool [batch, seq_len])."""
    return real.split_at(real.row_starts | seq_idx_changes)


def _one_document_per_row(real: _RealTokens) -> PackedSequence:
    """(a), and rows given without any boundary source: every row is one document of its real tokens."""
    return real.split_at(real.row_starts)


def _first_position_mismatch(packed: PackedSequence, position_ids: torch.Tensor) -> tuple[int, int, int] | None:
    """(real token, its position in `position_ids` [batch, seq_len], its offset in its document) at the first real
    token where the two differ; None where they agree everywhere."""
    given = packed.pack(position_ids)
    expected = packed.position_in_doc()
    differ = given.to(expected.dtype) != expected
    if not bool(differ.any()):
        return None
    token = int(torch.nonzero(differ)[0])
    return token, int(given[token]), int(expected[token])


def _check_positions_agree(packed: PackedSequence, position_ids: torch.Tensor, source: str) -> None:
    """`position_ids` given beside explicit boundaries must count the tokens of each of their documents."""
    mismatch = _first_position_mismatch(packed, position_ids)
    if mismatch is not None:
        token, given, expected = mismatch
        raise ValueError(
            f"position_ids contradict {source}: at token {token} position_ids gives {given} but the document "
            f"boundaries imply {expected}"
        )


def continuation_sequence(
    new_real: torch.Tensor | None,
    batch: int,
    columns: int,
    first_position: torch.Tensor,
    device,
    boundaries: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PackedSequence:
    """The packed view of a cached step: row b is document b, continuing its cached tokens; its positions count
    on from `first_position[b]`. `new_real` (bool [batch, columns], None when every new token is real) marks the
    new tokens that are real: the masked ones are dropped, and where they come before a row's last real token the
    Gated DeltaNet layers read them as zero inputs (RecurrentSpans), as in a forward with holes. `boundaries`:
    (int32 on the device, int64 on the host) of `columns` tokens per row, when the caller keeps them."""
    if new_real is None:
        if boundaries is None:
            host_cu = torch.arange(0, (batch + 1) * columns, columns, dtype=torch.int64)
            boundaries = (host_cu.to(device, torch.int32), host_cu)
        positions = (first_position.unsqueeze(1) + torch.arange(columns, device=device)).reshape(-1)
        # The boundaries are built on the host, so no decode step copies them back from the device.
        device_cu, host_cu = boundaries
        packed = PackedSequence(device_cu, columns, positions, None, (batch, columns), host_cu_seqlens=host_cu)
        packed._derived["num_tokens"] = batch * columns  # known here: a decode step reads no tensor for it
        return packed
    counts = new_real.sum(dim=1).cpu()
    if bool((counts == 0).any()):
        rows = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"a cached step needs a real new token in every row; rows {rows} have none")
    host = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    token_index = torch.nonzero(new_real.reshape(-1)).flatten()
    packed = PackedSequence(
        host.to(torch.int32).to(device), int(counts.max()), None, token_index, (batch, columns), host
    )
    packed.position_ids = first_position.to(device)[packed.doc_index()] + packed.position_in_doc()
    # every new column up to the row's last real token: the row's recurrence runs on through masked ones
    span = _up_to_last_real(new_real)
    if bool((span & ~new_real).any()):
        starts = torch.zeros_like(span)
        starts[:, 0] = True
        packed.spans = _recurrent_spans(span, starts, new_real, token_index)
    return packed


def _seq_idx_changes(seq_idx, batch: int, seq_len: int, device) -> torch.Tensor:
    """bool [batch, seq_len]: True where seq_idx differs from the previous token of its row."""
    seq_idx = torch.as_tensor(seq_idx, device=device)
    if seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
        raise ValueError(f"seq_idx must be an integer tensor, got {seq_idx.dtype}")
    if seq_idx.ndim == 1:
        seq_idx = seq_idx.unsqueeze(0)
    if tuple(seq_idx.shape) != (batch, seq_len):
        raise ValueError(f"seq_idx must be [batch, seq_len] = [{batch}, {seq_len}], got {tuple(seq_idx.shape)}")
    changes = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    changes[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return changes


def _check_seq_idx_matches(packed: PackedSequence, changes: torch.Tensor, source: str) -> None:
    """seq_idx must change exactly at the documents' starts (a row's first real token always starts one)."""
    doc_starts = torch.zeros(packed.num_tokens, dtype=torch.bool, device=changes.device)
    doc_starts[packed.cu_seqlens[:-1].long()] = True
    # The first real token of a row starts a document whatever seq_idx says there (padding may precede it).
    seq_starts = packed.pack(changes) | _row_first_tokens(packed)
    if not torch.equal(seq_starts, doc_starts):
        bad = int(torch.nonzero(seq_starts != doc_starts)[0])
        what = "starts a new document" if bool(seq_starts[bad]) else "does not start a new document"
        raise ValueError(
            f"seq_idx contradicts {source}: at real token {bad} seq_idx {what} but {source} says otherwise"
        )


def _row_first_tokens(packed: PackedSequence) -> torch.Tensor:
    """bool [num_tokens]: True at the first real token of every caller row."""
    batch, seq_len = packed.batch_shape
    rows = (
        packed.token_index
        if packed.token_index is not None
        else torch.arange(batch * seq_len, device=packed.cu_seqlens.device)
    ) // seq_len
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    return first


def shift_labels_within_documents(labels: torch.Tensor, packed: PackedSequence, ignore_index: int = -100):
    """Next-token targets on the packed stream: the target of token t is label t+1 of the same document.

    The last token of every document gets `ignore_index`, so no document predicts the next one's first token,
    whatever the caller put at document starts.
    """
    flat = packed.pack(labels)
    targets = torch.full_like(flat, ignore_index)
    targets[:-1] = flat[1:]
    ends = packed.cu_seqlens[1:].long() - 1
    targets[ends] = ignore_index
    return targets


def loss_targets(packed: PackedSequence, labels=None, shift_labels=None, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets on the packed stream from the caller's `labels` (unshifted) or `shift_labels` (already
    shifted, transformers' loss kwarg: the target of token t is shift_labels[t]; it wins over `labels`, as in
    transformers' ForCausalLMLoss). Both must have the shape of input_ids.

    `shift_labels` are used as given, except that the last token of a document followed by another document in
    its row must have no target (ignore_index): packed documents never predict across a boundary. The last token of
    a row keeps its target (the row may be one chunk of a longer sequence, as under context parallelism).
    """
    for name, value in (("labels", labels), ("shift_labels", shift_labels)):
        if value is not None and tuple(value.shape) != packed.batch_shape:
            raise ValueError(
                f"{name} must have the shape of input_ids {list(packed.batch_shape)}, got {list(value.shape)}"
            )
    if packed.spans is not None:
        # The built-in shifts targets over columns, so with holes it scores the logits of masked tokens (which this
        # model does not compute) and gives the real token before a hole the hole's label.
        if shift_labels is None:
            raise ValueError(
                "labels with an attention_mask with holes (real tokens after padding inside a row) are ambiguous: "
                "shifted over columns they give the token before a hole the masked token's label, as the built-in "
                f"does. Pass shift_labels (the target of every real token, {ignore_index} at masked positions)"
            )
        at_masked = shift_labels.reshape(-1).index_select(0, packed.spans.masked_columns.to(shift_labels.device))
        if bool((at_masked != ignore_index).any()):
            raise ValueError(
                f"shift_labels give masked tokens inside a row (holes of the attention_mask) a target; put "
                f"{ignore_index} there: this model computes no prediction at masked tokens"
            )
    if shift_labels is None:
        return shift_labels_within_documents(labels, packed, ignore_index)
    targets = packed.pack(shift_labels)
    ends = packed.cu_seqlens[1:-1].long() - 1  # every document end but the stream's last
    inside_row = ~_row_first_tokens(packed)[ends + 1]
    crossing = targets[ends[inside_row]] != ignore_index
    if bool(crossing.any()):
        token = int(ends[inside_row][crossing][0])
        raise ValueError(
            f"shift_labels give real token {token}, the last of its document, a target in the next document of its "
            f"row; packed documents do not predict across a boundary: put {ignore_index} there (shifting labels "
            "that are -100 at each document's first token does)"
        )
    return targets
