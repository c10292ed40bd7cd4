"""Context parallelism: one packed row split into contiguous shards over a process group, every rank running the
model on its shard, with the result of the unsharded row. It enters a forward in two places only: the front door
(`open_shard`: the shard's boundaries, positions and targets) and the kernel set of the shard
(kernel_set.shard_kernel_set: the conv, delta rule and attention below); the layers do not know they run on a shard.

Turned on with `model.set_context_parallel(group)` (any torch.distributed group: gloo on CPU, NCCL on GPUs). Each
rank then passes its shard of the row, in rank order: `input_ids` (or `inputs_embeds`) [1, n_rank] and, sharded
the same way, `labels` / `shift_labels`, `routed_experts` and 3D `position_ids`; the document boundaries as the
whole row's `cu_seqlens` (the same on every rank) or as the shard of 1D per-document `position_ids` (a shard whose
positions do not start at 0 continues the document of the previous rank). `shard_packed_row` cuts a row so.

What crosses a shard boundary, and how (each exact up to the order of floating-point sums):
  * the GDN short conv reads the kernel-1 inputs before the shard from the previous ranks (`conv_history`), zero
    where they belong to an earlier document;
  * the GDN recurrence: every rank reduces its last document's stretch to an affine state map
    S -> A S + B (one extra run of the delta rule with [I | 0] as the initial state and [0 | v] as the values);
    the maps are gathered and composed in fp32 in rank order into the state each shard's first document starts
    from (`incoming_state`);
  * attention: the keys and values of all shards are gathered (Qwen3.5 has few KV heads); a shard's first document
    attends to its earlier part on other ranks too (`attention_across_shards`);
  * rope positions are the global ones; the loss targets cross shards (a shard's last token predicts the next
    shard's first when both are one document) and every rank's loss is its share of the row's token-weighted
    loss (`ShardLayout.loss_denominator`).
MoE routing, routing replay, norms and MLPs are token-local and run on the shard as they are. The
vision-language models compute the row's layout (modalities, 3D rope positions) on the gathered token ids, and
every rank encodes all the row's images, keeping the features of its shard's placeholders (`pixel_values` and the
grids are the whole row's on every rank).

The gathers are sums over the group of zero-filled buffers (`_GroupSum`): one collective (all_reduce) whose
backward is the same collective, available on every backend (gloo has no reduce_scatter), so each rank's gradient
reaches the rank whose tensor it came from. Every rank joins every collective of a forward and of its backward: a
rank that does not need a gathered tensor still keeps it in its graph with a zero weight (`_in_graph`).

The loss convention is transformers' for losses averaged over devices: a rank's loss is the sum over its targets
divided by the whole row's target count (`num_items_in_batch` when given, else counted over the group), so the
ranks' losses sum to the unsharded loss and their gradients sum to its gradient. The transformers Trainer with
`average_tokens_across_devices` multiplies each rank's loss by the number of processes before DDP / FSDP2 average
the gradients; a hand-written loop does the same (or sums the gradients over the group).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .packing import PackedSequence, build_packed_sequence
from .reference_kernels import sdpa_one_document

IGNORE_INDEX = -100


class _GroupSum(torch.autograd.Function):
    """all_reduce(SUM) over the group, forward and backward (the gradient of a sum shared by all ranks is the sum
    of the ranks' gradients)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _in_graph(x: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:
    """x, with the gathered tensors joined to its graph at zero weight: the rank's backward then reaches their
    collectives as every other rank's does (the values are finite: shards of activations and state maps)."""
    for tensor in gathered:
        if tensor.requires_grad:
            x = x + (tensor.sum() * 0).to(x.dtype)
    return x


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where this rank's shard sits in the row, read by every layer: built once per forward (`open_shard`)."""

    group: object
    rank: int
    lengths: tuple[int, ...]  # tokens of every rank's shard
    prefixes: tuple[int, ...]  # tokens of each shard's first document held by earlier ranks (0: it starts there)
    single_document: tuple[bool, ...]  # whether each shard holds one document only
    next_first_label: int  # the next shard's first label (IGNORE_INDEX where there is none)

    @property
    def world_size(self) -> int:
        return len(self.lengths)

    @property
    def offset(self) -> int:
        """The row index of this shard's first token."""
        return sum(self.lengths[: self.rank])

    @property
    def prefix(self) -> int:
        return self.prefixes[self.rank]

    @property
    def continues_into_next(self) -> bool:
        """Whether this shard's last document goes on in the next shard."""
        return self.rank + 1 < self.world_size and self.prefixes[self.rank + 1] > 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [n_rank, ...] (its shard's rows) in rank order: [row tokens, ...], differentiable."""
        total, offset = sum(self.lengths), self.offset
        placed = torch.cat(
            [x.new_zeros(offset, *x.shape[1:]), x, x.new_zeros(total - offset - x.shape[0], *x.shape[1:])]
        )
        return _GroupSum.apply(placed, self.group)

    def gather_one(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (same shape on all ranks) stacked in rank order: [world, ...], differentiable."""
        placed = x.new_zeros(self.world_size, *x.shape).index_copy(
            0, torch.tensor([self.rank], device=x.device), x.unsqueeze(0)
        )
        return _GroupSum.apply(placed, self.group)

    def loss_denominator(self, targets: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The row's target count (all shards): `num_items_in_batch` when given, else counted over the group."""
        if num_items_in_batch is not None:
            return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=targets.device)
        count = (targets != IGNORE_INDEX).sum().float().reshape(1)
        dist.all_reduce(count, group=self.group)
        return count.clamp(min=1)[0]


def _sum_over_group(values: list[int], group, device) -> list[int]:
    buffer = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(buffer, group=group)
    return buffer.tolist()


def _row_vector(world: int, rank: int, values: list[int]) -> list[int]:
    """values placed in rank's slot of a [world * len(values)] zero vector (summed over the group: all ranks')."""
    row = [0] * (world * len(values))
    row[rank * len(values) : (rank + 1) * len(values)] = values
    return row


def open_shard(group, arguments: dict, device) -> tuple[PackedSequence, torch.Tensor, ShardLayout]:
    """This rank's shard of the row -> (its PackedSequence, its global rope positions [N] or [3, N], its layout).

    Reads `input_ids` / `inputs_embeds`, `cu_seqlens` (or `cu_seq_lens_q` / `cu_seq_lens_k`: the whole row's),
    `position_ids`, `attention_mask` (all ones, if any) and `labels` of the shard; ValueError on any input a shard
    cannot have or on shards that do not fit together."""
    input_ids, inputs_embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    tokens = input_ids if input_ids is not None else inputs_embeds
    shape = tuple(tokens.shape[:2])
    if shape[0] != 1:
        raise ValueError(
            f"under context parallelism each rank passes its shard of one packed row, shape [1, tokens]; got "
            f"{shape[0]} rows (pack the batch into one row first, e.g. with shard_packed_row)"
        )
    mask = arguments.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("under context parallelism a shard holds real tokens only (no padding in attention_mask)")
    if arguments.get("seq_idx") is not None:
        raise ValueError("under context parallelism give the boundaries as the row's cu_seqlens or as position_ids")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = shape[1]
    lengths = _sum_over_group(_row_vector(world, rank, [count]), group, device)
    if min(lengths) == 0:
        raise ValueError(f"under context parallelism every rank needs at least one token; shard lengths {lengths}")
    offset = sum(lengths[:rank])

    row_bounds = next(
        (
            arguments[name]
            for name in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
            if arguments.get(name) is not None
        ),
        None,
    )
    position_ids = arguments.get("position_ids")
    positions = torch.as_tensor(position_ids, device=device) if position_ids is not None else None
    rope_3d = positions if positions is not None and positions.ndim == 3 else None
    if rope_3d is not None:
        rope_3d = rope_3d[1:] if rope_3d.shape[0] == 4 else rope_3d
        if tuple(rope_3d.shape) != (3, 1, count):
            raise ValueError(f"3D position_ids of a shard must be [3, 1, {count}], got {tuple(positions.shape)}")
        positions = None
    elif positions is not None:
        positions = positions.reshape(-1)
        if positions.numel() != count:
            raise ValueError(f"position_ids of a shard must be [1, {count}], got {tuple(position_ids.shape)}")
    if row_bounds is not None:
        bounds = torch.as_tensor(row_bounds).to("cpu", torch.int64)
        if int(bounds[0]) != 0 or int(bounds[-1]) != sum(lengths) or bool((bounds[1:] <= bounds[:-1]).any()):
            raise ValueError(
                f"cu_seqlens under context parallelism are the whole row's boundaries, from 0 to the row's "
                f"{sum(lengths)} tokens (the shards' lengths {lengths}), strictly increasing; got {bounds.tolist()}"
            )
        doc_start = int(bounds[bounds <= offset].max())
        prefix = offset - doc_start
        inside = bounds[(bounds > offset) & (bounds < offset + count)] - offset
        local = torch.cat([bounds.new_zeros(1), inside, bounds.new_tensor([count])])
    elif positions is not None:
        host = positions.to("cpu", torch.int64)
        prefix = int(host[0])
        starts = torch.nonzero(host == 0).flatten()
        local = torch.cat([host.new_zeros(1), starts[starts > 0], host.new_tensor([count])])
    else:
        raise ValueError(
            "under context parallelism the document boundaries must be given: the whole row's cu_seqlens, or the "
            "shard's 1D position_ids (per document, continuing across shards)"
        )
    packed = build_packed_sequence(shape, device, cu_seqlens=local)
    derived = packed.position_in_doc().clone()
    first_document = int(local[1])
    derived[:first_document] += prefix
    if positions is not None and not torch.equal(positions.long(), derived):
        bad = int(torch.nonzero(positions.long() != derived)[0])
        raise ValueError(
            f"position_ids of this shard must count on within each document of the row: token {bad} of the shard "
            f"has {int(positions[bad])} where {int(derived[bad])} follows"
        )
    rope_positions = rope_3d[:, 0] if rope_3d is not None else derived

    labels = arguments.get("labels")
    first_label = int(torch.as_tensor(labels).reshape(-1)[0]) if labels is not None else IGNORE_INDEX
    ends_with = int(derived[-1]) + 1  # tokens of the shard's last document up to the shard's end
    single = int(packed.num_docs == 1)
    gathered = _sum_over_group(_row_vector(world, rank, [prefix, single, ends_with, first_label]), group, device)
    prefixes = tuple(gathered[0::4])
    for r in range(1, world):
        if prefixes[r] not in (0, gathered[4 * (r - 1) + 2]):
            raise ValueError(
                f"the shards do not fit together: shard {r} continues a document after {prefixes[r]} tokens, but "
                f"shard {r - 1} ends with {gathered[4 * (r - 1) + 2]} tokens of its last document (pass each rank "
                "its contiguous shard of the row, in rank order)"
            )
    if prefixes[0] != 0:
        raise ValueError("the first shard of the row must start a document (position 0)")
    layout = ShardLayout(
        group=group,
        rank=rank,
        lengths=tuple(lengths),
        prefixes=prefixes,
        single_document=tuple(bool(s) for s in gathered[1::4]),
        next_first_label=gathered[4 * (rank + 1) + 3] if rank + 1 < world else IGNORE_INDEX,
    )
    return packed, rope_positions, layout


def shard_targets(targets: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Next-token targets from unshifted labels: the shard's last token predicts the next shard's first label when
    its document goes on there (the targets of packing.shift_labels_within_documents end every shard instead)."""
    if layout.continues_into_next:
        targets = targets.clone()
        targets[-1] = layout.next_first_label
    return targets


def conv_history(mixed: torch.Tensor, packed: PackedSequence, layout: ShardLayout, kernel: int) -> torch.Tensor:
    """The conv inputs preceding each document of the shard [n_docs, C, kernel-1] (oldest first): for the first
    document the row's kernel-1 tokens before the shard where they belong to it, zeros elsewhere."""
    width = kernel - 1
    tail = mixed[-width:]
    if tail.shape[0] < width:
        tail = torch.cat([tail.new_zeros(width - tail.shape[0], tail.shape[1]), tail])
    tails = layout.gather_one(tail)  # [world, width, C]
    # The rows before the shard, newest last: the real rows of the earlier ranks' tails (a tail shorter than
    # `width` holds zeros first), the last `width` of them.
    rows = [r * width + i for r in range(layout.rank) for i in range(width - min(layout.lengths[r], width), width)]
    rows = ([None] * width + rows)[-width:]
    flat = torch.cat([tails.reshape(-1, tails.shape[-1]), tails.new_zeros(1, tails.shape[-1])])
    index = torch.tensor([len(flat) - 1 if r is None else r for r in rows], device=mixed.device)
    before = flat.index_select(0, index)  # [width, C]
    # row j is (width - j) tokens before the shard: in the document when the document started that far back
    keep = torch.arange(width, 0, -1, device=mixed.device) <= layout.prefix
    before = before * keep.unsqueeze(1).to(before.dtype)
    history = torch.cat([before.t().unsqueeze(0), before.new_zeros(packed.num_docs - 1, before.shape[1], width)])
    return _in_graph(history, tails)


def _last_document(packed: PackedSequence) -> tuple[int, PackedSequence]:
    """(where the stream's last document starts, that document as a stream of its own), built once per stream and
    shared by every GDN layer (FLA memoises its varlen indices by the boundaries' identity)."""
    if "last_document" not in packed._derived:
        bounds = packed.cu_seqlens_cpu()
        start = int(bounds[-2])
        length = int(bounds[-1]) - start
        packed._derived["last_document"] = (start, build_packed_sequence((1, length), packed.cu_seqlens.device))
    return packed._derived["last_document"]


def conv_across_shards(x, weight, packed, split_sizes, initial_state=None, adapters=(), *, conv, layout: ShardLayout):
    """The kernel set's `conv` on a shard: `conv` continuing the row's inputs before the shard (conv_history)."""
    history = conv_history(x, packed, layout, weight.shape[-1])
    return conv(x, weight, packed, split_sizes, initial_state=history, adapters=adapters)


def delta_rule_across_shards(
    q, k, v, g, beta, packed, initial_state=None, output_final_state=False, *, delta_rule, layout: ShardLayout
):
    """The kernel set's `delta_rule` on a shard: `delta_rule` from the states the shard's documents start from
    (incoming_state)."""
    state = incoming_state(q, k, v, g, beta, packed, delta_rule, layout)
    return delta_rule(q, k, v, g, beta, packed, initial_state=state, output_final_state=output_final_state)


def incoming_state(q, k, v, g, beta, packed: PackedSequence, delta_rule, layout: ShardLayout) -> torch.Tensor:
    """The GDN states the shard's documents start from [n_docs, Hv, Dk, Dv] fp32: for the first one, the state the
    row reaches at the shard's start within that document; zeros for the others.

    Each rank's last document stretch maps the state it starts from to the state at the shard's end by
    S -> A S + B; running the delta rule on that stretch from [I | 0] with values [0 | v] gives [A | B] at once.
    Composing the earlier ranks' maps in rank order gives the incoming state."""
    start, last = _last_document(packed)
    heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    stretch = slice(start, None)
    values = torch.cat([v.new_zeros(v.shape[0] - start, heads, dk), v[stretch]], dim=-1)
    identity = torch.eye(dk, dk + dv, device=v.device, dtype=torch.float32).expand(1, heads, dk, dk + dv)
    _, maps = delta_rule(
        q[stretch],
        k[stretch],
        values,
        g[stretch],
        beta[stretch],
        last,
        initial_state=identity.contiguous(),
        output_final_state=True,
    )
    maps = layout.gather_one(maps[0].float())  # [world, Hv, Dk, Dk + Dv]
    state = maps.new_zeros(heads, dk, dv)
    for r in range(layout.rank):
        carried = state if layout.prefixes[r] > 0 and layout.single_document[r] else torch.zeros_like(state)
        state = maps[r, ..., :dk] @ carried + maps[r, ..., dk:]
    if layout.prefix == 0:
        state = torch.zeros_like(state)
    states = torch.cat([state.unsqueeze(0), state.new_zeros(packed.num_docs - 1, heads, dk, dv)])
    return _in_graph(states, maps)


def attention_across_shards(q, k, v, packed: PackedSequence, scale: float, *, attention, layout: ShardLayout):
    """The kernel set's `attention` on a shard: causal attention within each document of the row for the shard's
    queries: its documents attend to themselves (`attention`); the first one also to its tokens on earlier ranks
    (the gathered keys and values)."""
    out = attention(q, k, v, packed, scale)
    keys, values = layout.gather(k), layout.gather(v)
    if layout.prefix == 0:
        return _in_graph(out, keys, values)
    first = int(packed.cu_seqlens_cpu()[1])
    span = slice(layout.offset - layout.prefix, layout.offset + first)
    head = sdpa_one_document(q[:first], keys[span], values[span], scale, causal=True)
    return _in_graph(torch.cat([head.to(out.dtype), out[first:]]), keys, values)


def gather_row_tokens(ids: torch.Tensor, types, packed: PackedSequence, layout: ShardLayout):
    """The whole row's token ids [row tokens], token types (or None) and document boundaries (int32 cu_seqlens),
    gathered from the shards: what the vision-language layout (modalities, 3D rope positions) is computed on."""
    starts = torch.zeros_like(ids)
    starts[packed.cu_seqlens[:-1].long()] = 1
    if layout.prefix > 0:  # the shard's first document started on an earlier rank
        starts[0] = 0
    row_starts = torch.nonzero(layout.gather(starts).cpu()).flatten()
    cu_seqlens = torch.cat([row_starts, row_starts.new_tensor([sum(layout.lengths)])]).to(torch.int32)
    row_types = layout.gather(types) if types is not None else None
    return layout.gather(ids), row_types, cu_seqlens.to(ids.device)


def shard_slots(slots: torch.Tensor, features: torch.Tensor, layout: ShardLayout, tokens: int):
    """The row's vision placeholder positions `slots` (in row order, one per feature row) -> the shard's:
    (positions in the shard, their features)."""
    inside = (slots >= layout.offset) & (slots < layout.offset + tokens)
    return slots[inside] - layout.offset, features[inside]


def shard_packed_row(row: dict, rank: int, world_size: int) -> dict:
    """Rank `rank`'s shard of one packed row for context parallelism: the token tensors ([1, tokens, ...]:
    input_ids, inputs_embeds, labels, shift_labels, attention_mask, routed_experts; [1, tokens] or 3D
    position_ids) cut into `world_size` contiguous shards as even as the token count allows, and the row's
    boundaries as its cu_seqlens (given, or from position_ids that restart at 0 per document), the same on every
    rank. Other entries are passed through."""
    tokens = next(row[name] for name in ("input_ids", "inputs_embeds") if row.get(name) is not None)
    total = tokens.shape[1]
    if tokens.shape[0] != 1 or total < world_size:
        raise ValueError(f"shard_packed_row takes one row of at least {world_size} tokens, got {tuple(tokens.shape)}")
    base, extra = divmod(total, world_size)
    sizes = [base + (r < extra) for r in range(world_size)]
    start = sum(sizes[:rank])
    piece = slice(start, start + sizes[rank])
    shard = dict(row)
    if row.get("cu_seqlens") is None:
        positions = row.get("position_ids")
        if positions is None or torch.as_tensor(positions).ndim != 2:
            raise ValueError("shard_packed_row needs the row's cu_seqlens or its 2D position_ids")
        packed = build_packed_sequence((1, total), "cpu", position_ids=torch.as_tensor(positions).cpu())
        shard["cu_seqlens"] = packed.cu_seqlens_cpu().to(torch.int32)
    for name in ("input_ids", "inputs_embeds", "labels", "shift_labels", "attention_mask", "routed_experts"):
        if row.get(name) is not None:
            shard[name] = row[name][:, piece]
    if row.get("position_ids") is not None:
        positions = torch.as_tensor(row["position_ids"])
        shard["position_ids"] = positions[..., piece]
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
        shard.pop(name, None)
    return shard
