"""Decoder layers over a long stream in pieces of tokens (the text config's `layer_token_chunk`).

A layer over a long stream holds several [tokens x width] activations at once (the GDN's qkv projection, conv outputs,
gate and delta-rule output; attention's queries with their gate), in its forward and again in its backward's
recompute. Cut into pieces, a layer holds one piece's:
  * documents that fit are grouped, in stream order, into pieces of at most `layer_token_chunk` tokens, which the
    layer runs as a stream of their own (every document still starts from nothing);
  * a longer document is cut from its own start into pieces of exactly that many tokens (a multiple of the delta
    rule's chunk, so each piece runs the chunks the whole document runs) and a last, shorter one. Such a piece holds
    that document only, and its token mixer continues from what the document's piece before handed on
    (`continue_piece` of gated_deltanet.py / attention.py): the GDN its last conv inputs and its recurrent state,
    attention the keys and values of the document so far (each piece hands on a longer copy, so what a cut document's
    attention keeps for the backward grows with the square of its pieces: small beside its activations, with few
    key heads).
Where a document is cut depends on its own length only, so packed == per-document holds as without pieces. The
norms and the MLP / MoE block are per token. Each piece returns what it hands on as outputs, so the gradient of the
state and of the keys and values reaches the earlier pieces.

Checkpointing: while the layer is checkpointed (`gradient_checkpointing_enable()`, under any
`checkpoint_granularity`), each piece is checkpointed whole with torch's non-reentrant checkpoint, and the layer is
not checkpointed as a whole (`SegmentCheckpointing` asks `layer_pieces`): the backward reruns one piece at a time.
What a piece keeps for the backward is a copy of its input rows and what the piece before handed on: tensors no other
piece saves, which activation offloading (TRL's, or `save_on_cpu`) moves to the host one by one.
The pieces are built once per stream and shared by every layer (held in the stream's derived values).

Not where a forward continues or fills a cache, on a context-parallel shard (whose row the ranks cut already), with
holes in the attention mask (the GDN layers run another stream there) or with output_attentions (the probabilities
are computed over whole documents): the layers then run whole, said once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch.utils.checkpoint import checkpoint

from .packed_batch import PackedBatch
from .packing import PackedSequence
from .utils import log_once

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StreamPiece:
    """Rows [start, end) of a stream, with their documents as a stream of their own (`packed`)."""

    start: int
    end: int
    packed: PackedSequence
    prefix: int  # tokens of the piece's document before the piece (a later piece of a cut document), else 0
    continues: bool  # the piece's document goes on in the next piece

    @property
    def cuts_document(self) -> bool:
        """Whether the piece is part of a document cut into pieces (not its whole)."""
        return self.prefix > 0 or self.continues


def stream_pieces(packed: PackedSequence, tokens: int) -> tuple[StreamPiece, ...]:
    """The pieces of `packed` for pieces of `tokens` tokens (module docstring), in stream order; built once per stream
    and length."""
    key = ("layer_pieces", tokens)
    if key not in packed._derived:
        bounds = packed.cu_seqlens_cpu().tolist()
        pieces, group = [], [bounds[0]]  # group: the boundaries of whole documents not yet in a piece

        def close_group():
            if len(group) > 1:
                pieces.append(_piece(packed, group, prefix=0, continues=False))
            group[:] = [group[-1]]

        for start, end in zip(bounds[:-1], bounds[1:]):
            if end - start > tokens:
                close_group()
                for first in range(start, end, tokens):
                    last = min(first + tokens, end)
                    pieces.append(_piece(packed, [first, last], prefix=first - start, continues=last < end))
                group[:] = [end]
                continue
            if end - group[0] > tokens:
                close_group()
            group.append(end)
        close_group()
        packed._derived[key] = tuple(pieces)
    return packed._derived[key]


def _piece(packed: PackedSequence, bounds: list[int], prefix: int, continues: bool) -> StreamPiece:
    start, end = bounds[0], bounds[-1]
    host_cu = torch.tensor([b - start for b in bounds])
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    stream = PackedSequence(
        host_cu.to(packed.cu_seqlens.device, torch.int32),
        longest,
        None if packed.position_ids is None else packed.position_ids[..., start:end],
        None,
        (1, end - start),
        host_cu,
    )
    return StreamPiece(start, end, stream, prefix, continues)


def layer_pieces(config, batch: PackedBatch) -> tuple[StreamPiece, ...] | None:
    """The pieces a decoder layer runs `batch`'s stream in, or None where it runs the stream whole: no
    `layer_token_chunk`, a stream not longer, or a forward the pieces do not serve (said once)."""
    tokens = getattr(config, "layer_token_chunk", None)
    packed = batch.packed
    if not tokens or packed.num_tokens <= tokens:
        return None
    reason = (
        "a forward with a cache" if batch.cache is not None
        else "context parallelism" if batch.shard is not None
        else "an attention mask with holes" if packed.spans is not None
        else "output_attentions" if batch.output_attentions
        else None
    )  # fmt: skip
    if reason is not None:
        log_once(logger, ("layer-pieces", reason), "layer_token_chunk: %s runs every decoder layer whole", reason)
        return None
    return stream_pieces(packed, tokens)


def piece_batch(batch: PackedBatch, piece: StreamPiece) -> PackedBatch:
    """`batch` as the layers read it on the rows of `piece`: its documents, rope tables and positions."""
    rows = slice(piece.start, piece.end)
    cos, sin = batch.rope
    return dataclasses.replace(
        batch,
        packed=piece.packed,
        rope=(cos[rows], sin[rows]),
        rope_positions=batch.rope_positions[..., rows],
        token_ids=None,
        inputs_embeds=None,
        targets=None,
        routed_experts=None,
    )


def run_in_pieces(layer, hidden: torch.Tensor, batch: PackedBatch, routed_experts, pieces) -> tuple:
    """`layer` (a decoder layer) over the stream `hidden` [N, H] of `batch`, piece by piece through its
    `forward_piece`; -> (output [N, H], router logits [N, E] or None, None): the layer's forward's outputs (no
    attention probabilities: the pieces do not run with output_attentions)."""
    checkpointed = layer.recomputed_segment() is not None
    outputs, logits, carried = [], [], ()
    for piece in pieces:
        rows = slice(piece.start, piece.end)
        run = functools.partial(
            layer.forward_piece,
            batch=piece_batch(batch, piece),
            piece=piece,
            routed_experts=None if routed_experts is None else routed_experts[rows],
        )
        if checkpointed:  # the layers draw no random numbers: no RNG state to restore
            # The rows saved for the backward get a storage of their own: TRL's activation offloading moves a storage
            # to the host once and keeps a second tensor of it on the device, which would hold the whole layer input
            # of every layer there.
            rows_in = hidden[rows].clone()
            out, router_logits, *leaves = checkpoint(run, rows_in, *carried, use_reentrant=False, preserve_rng_state=False)  # fmt: skip
        else:
            out, router_logits, *leaves = run(hidden[rows], *carried)
        # what the piece hands on to the document's next piece: there only, so that each carried tensor is saved by
        # one checkpoint (offloading moves a storage saved twice once and keeps it on the device for the second)
        carried = tuple(leaves) if piece.continues else ()
        outputs.append(out)
        logits.append(router_logits)
    return torch.cat(outputs), None if logits[0] is None else torch.cat(logits), None


__all__ = ["StreamPiece", "layer_pieces", "run_in_pieces", "stream_pieces"]
