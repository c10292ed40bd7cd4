"""Gated DeltaNet (GDN) linear-attention layer on a packed stream.

Projections (keys as in the official checkpoints): in_proj_qkv -> short causal depthwise conv (conv1d, no bias)
+ SiLU -> split q, k, v; in_proj_b -> beta = sigmoid(b); in_proj_a -> g = -exp(A_log) * softplus(a + dt_bias)
(fp32); gated delta rule with qk l2-norm; gated RMSNorm with in_proj_z; out_proj.

Document boundaries: the conv and the recurrence both restart at every document of the PackedSequence. Masked
tokens between real ones (an attention mask with holes) are zero inputs here, as in the built-in. The conv and the
recurrence run through the batch's kernel set (which, on a context-parallel shard, continues the first document
from the earlier shards).
While the cache records the past (transformers' assisted decoding, cache.py), the recurrence of the tokens a crop may
drop runs one token at a time after the chunked rest, and the layer hands the cache the state before each of them.
With the config's `gdn_token_chunk`, a document longer than that runs its delta rule in pieces, each from the state
the one before reached (`delta_rule_in_pieces`). With its `layer_token_chunk` the decoder layer runs the whole layer
in pieces (layer_pieces.py); a piece of a cut document continues its conv and recurrence (`continue_piece`).
The conv reads its taps, and the factors of a PEFT LoRA around conv1d, through conv_lora.effective_conv: the layer
never calls the conv module, so PEFT's forward of it cannot run (conv_lora.py applies what it would compute).
A_log and dt_bias stay fp32 whatever the model is cast to (see `_apply`): the decay compounds over the whole
sequence, so bf16 rounding of these two vectors would change every later state.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .conv_lora import effective_conv
from .kernel_set import REFERENCE_KERNELS, KernelSet
from .kernels import conv_final_state
from .norms import GatedRMSNorm
from .packed_batch import PackedBatch
from .packing import PackedSequence, build_packed_sequence, continuation_sequence
from .projection import RowInvariantLinear

FP32_PARAMETERS = ("A_log", "dt_bias")


def _uniform_rows(packed) -> tuple[int, int]:
    """(rows, tokens per row) of a cached forward whose rows all take the same number of new tokens, none masked:
    what a recording cache can crop alike in every row."""
    bounds = packed.cu_seqlens_cpu()
    rows, tokens = bounds.numel() - 1, int(bounds[1])
    if packed.spans is not None or not torch.equal(bounds, tokens * torch.arange(rows + 1)):
        raise NotImplementedError(
            "a cache recording the past (assisted decoding) takes the same number of new tokens in every row, none "
            "masked"
        )
    return rows, tokens


def delta_rule_in_pieces(kernels: KernelSet, q, k, v, g, beta, packed, piece: int) -> torch.Tensor:
    """The delta rule of the stream `packed` (no initial state), every document longer than `piece` tokens run in
    pieces of `piece` tokens: round r takes the r-th piece of every document that long, from the state its piece
    r - 1 reached, so that the chunk states of a long document (and, in the backward, their gradients) exist one
    round at a time. `piece` is a multiple of the kernels' chunk, so each piece runs the chunks the whole document
    does. -> o [N, Hv, Dv]."""
    bounds = packed.cu_seqlens_cpu().tolist()
    starts, lengths = bounds[:-1], [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    outputs, rows, state, carried = [], [], None, []
    for first in range(0, max(lengths), piece):
        docs = [d for d, length in enumerate(lengths) if length > first]
        counts = [min(lengths[d] - first, piece) for d in docs]
        index = torch.cat([torch.arange(starts[d] + first, starts[d] + first + n) for d, n in zip(docs, counts)])
        index = index.to(q.device)
        host_cu = torch.tensor([0, *itertools.accumulate(counts)])
        # The delta rule reads the boundaries only (no positions).
        part = PackedSequence(host_cu.to(q.device, torch.int32), max(counts), None, None, (1, sum(counts)), host_cu)
        initial = None if state is None else state[[carried.index(d) for d in docs]]
        delta_rule = kernels.delta_rule if initial is None else kernels.delta_rule_from_state
        continues = any(lengths[d] > first + piece for d in docs)
        inputs = (t.index_select(0, index) for t in (q, k, v, g, beta))
        out, state = delta_rule(*inputs, part, initial_state=initial, output_final_state=continues)
        outputs.append(out)
        rows.append(index)
        carried = docs
    rows = torch.cat(rows)  # the stream row of every output row
    back = torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=rows.device))
    return torch.cat(outputs).index_select(0, back)


def _widened(packed: PackedSequence, width: int) -> PackedSequence:
    """The one document of `packed` with `width` more tokens before it, as a stream (built once per piece)."""
    key = ("widened", width)
    if key not in packed._derived:
        packed._derived[key] = build_packed_sequence((1, packed.num_tokens + width), packed.cu_seqlens.device)
    return packed._derived[key]


class GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config  # read at each forward: `gdn_token_chunk` may be set after the model is built
        self.layer_idx = layer_idx
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_split = (self.key_dim, self.key_dim, self.value_dim)  # the conv's output channels: q | k | v
        self.conv_kernel_size = config.linear_conv_kernel_dim

        self.in_proj_qkv = RowInvariantLinear(config.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = RowInvariantLinear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = RowInvariantLinear(config.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = RowInvariantLinear(config.hidden_size, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = RowInvariantLinear(self.value_dim, config.hidden_size, bias=False)

    def _apply(self, fn, *args, **kwargs):
        # Keep A_log / dt_bias (and their gradients) fp32 across .to(dtype) / .half() / .bfloat16(): where `fn`
        # would down-cast one of them, it is moved instead. Every other conversion (to_empty() from the meta
        # device, device moves) is fn's own, so nn.Module decides as usual how to swap the parameter in.
        fp32 = {
            id(t)
            for name in FP32_PARAMETERS
            for t in (self._parameters[name], self._parameters[name].grad)
            if t is not None and t.dtype == torch.float32
        }

        def keep_fp32(t):
            out = fn(t)
            if id(t) in fp32 and out.is_floating_point() and out.dtype != torch.float32:
                return t.to(device=out.device)
            return out

        return super()._apply(keep_fp32, *args, **kwargs)

    def decay_and_beta(self, a: torch.Tensor, b: torch.Tensor, kernels: KernelSet = REFERENCE_KERNELS):
        return kernels.gdn_gates(a, b, self.A_log, self.dt_bias)

    def forward(self, hidden_states: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """hidden_states [N, hidden] (the packed stream of `batch`); reads and advances `batch.cache` if any."""
        spans = batch.packed.spans
        if spans is None:
            return self._run(hidden_states, batch.packed, batch)
        # Masked tokens between real ones: zero inputs the conv and the recurrence run through (packing.py)
        return spans.gather(self._run(spans.spread(hidden_states), spans.stream, batch))

    def _run(self, hidden_states: torch.Tensor, packed, batch: PackedBatch) -> torch.Tensor:
        """The layer on the stream `packed` (the batch's own, or its RecurrentSpans' stream)."""
        kernels, cache = batch.kernels, batch.cache
        mixed, z, g, beta = self._project(hidden_states, kernels)

        conv_state, recurrent_state = cache.linear_states(self.layer_idx) if cache is not None else (None, None)
        conv = self._effective_conv()
        recording = cache is not None and cache.records_past
        # a generation step: the batched decode kernels
        step = batch.one_token_per_row and not conv.adapters and not recording
        if step:
            out, conv_state = kernels.conv_step(mixed, conv.weight, conv_state)
            q, k, v = torch.split(out, list(self.conv_split), dim=-1)
        else:
            # The cache keeps the last K conv inputs (transformers' layout); the conv reads the last K-1 of them.
            history = conv_state[..., 1:] if conv_state is not None else None
            q, k, v = kernels.conv(
                mixed, conv.weight, packed, self.conv_split, initial_state=history, adapters=conv.adapters
            )
        q, k, v = self._heads(q, k, v)
        if step:
            # a static cache's state is updated where it is (the tensor a captured decode step holds): no copy
            in_place = cache.static and recurrent_state.is_contiguous()
            core, final_state = kernels.delta_rule_step(
                q, k, v, g, beta, recurrent_state, out_state=recurrent_state if in_place else None
            )
        elif recording:
            rows, tokens = _uniform_rows(batch.packed)
            kept = cache.states_to_record(tokens, continues=recurrent_state is not None)
            core, final_state, states = self._recorded_delta_rule(
                q, k, v, g, beta, rows, tokens, kept, recurrent_state, kernels
            )
            conv_inputs = mixed.reshape(rows, tokens, -1).transpose(1, 2)
            cache.record_linear_past(self.layer_idx, states, conv_inputs, conv_state, self.conv_kernel_size)
        elif self._in_pieces(packed, cache, batch):
            core, final_state = (
                delta_rule_in_pieces(kernels, q, k, v, g, beta, packed, self.config.gdn_token_chunk),
                None,
            )
        else:
            core, final_state = kernels.delta_rule(
                q, k, v, g, beta, packed, initial_state=recurrent_state, output_final_state=cache is not None
            )
        if cache is not None and not step:
            # conv_final_state keeps the inputs a conv of the given kernel reads (kernel - 1): one wider keeps K.
            conv_state = conv_final_state(mixed, packed.cu_seqlens, self.conv_kernel_size + 1, conv_state)
        if cache is not None:
            cache.store_linear_states(self.layer_idx, conv_state, final_state)
        return self._output(core, z, kernels)

    def continue_piece(self, hidden_states: torch.Tensor, batch: PackedBatch, carried: tuple, continues: bool):
        """The layer on a piece of one document that the decoder layer cut (layer_pieces.py; `batch`: the piece's),
        -> (output [n, hidden], what the piece hands on to the next one: (its last K-1 conv inputs [K-1, C], the state
        it reached [1, Hv, Dk, Dv] fp32), or () unless `continues`). `carried`: what the document's piece before
        handed on, () where the piece starts the document."""
        kernels, packed = batch.kernels, batch.packed
        mixed, z, g, beta = self._project(hidden_states, kernels)
        conv = self._effective_conv()
        history, state = carried or (None, None)
        if history is None:
            q, k, v = kernels.conv(mixed, conv.weight, packed, self.conv_split, adapters=conv.adapters)
        elif conv.adapters:
            initial = history.t().unsqueeze(0)  # [1, C, K-1], oldest first
            q, k, v = kernels.conv(
                mixed, conv.weight, packed, self.conv_split, initial_state=initial, adapters=conv.adapters
            )
        else:
            # The stateless conv over the document's K-1 inputs before the piece and the piece (each output reads
            # its K inputs only: the outputs of the whole document), the first K-1 outputs dropped.
            width = history.shape[0]
            outputs = kernels.conv(torch.cat([history, mixed]), conv.weight, _widened(packed, width), self.conv_split)
            q, k, v = (t[width:] for t in outputs)
        q, k, v = self._heads(q, k, v)
        if state is None:
            core, final_state = kernels.delta_rule(q, k, v, g, beta, packed, output_final_state=continues)
        else:
            core, final_state = kernels.delta_rule_from_state(
                q, k, v, g, beta, packed, initial_state=state, output_final_state=continues
            )
        # a copy: a view would keep the whole piece's `mixed` alive while the document's later pieces run
        leaves = (mixed[-(self.conv_kernel_size - 1) :].clone(), final_state) if continues else ()
        return self._output(core, z, kernels), leaves

    def _effective_conv(self):
        """The conv's taps and PEFT LoRA factors (conv_lora.effective_conv)."""
        return effective_conv(self.conv1d, f"layer {self.layer_idx}'s linear_attn.conv1d")

    def _project(self, hidden_states: torch.Tensor, kernels: KernelSet):
        """hidden_states [n, hidden] -> (the conv's inputs [n, C], z [n, value_dim], g fp32, beta)."""
        mixed = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states)
        g, beta = self.decay_and_beta(self.in_proj_a(hidden_states), self.in_proj_b(hidden_states), kernels)
        return mixed, z, g, beta

    def _heads(self, q, k, v):
        n = q.shape[0]
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )

    def _output(self, core: torch.Tensor, z: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        """The delta rule's output [n, Hv, Dv] -> gated norm -> out_proj [n, hidden]."""
        return self.out_proj(self.norm(core.reshape(core.shape[0], self.value_dim), z, kernels))

    def _in_pieces(self, packed, cache, batch: PackedBatch) -> bool:
        """Whether the config's `gdn_token_chunk` cuts a document of this stream: a forward without a cache, off a
        context-parallel shard (whose rows are cut across ranks already)."""
        piece = getattr(self.config, "gdn_token_chunk", None)
        return bool(piece) and cache is None and batch.shard is None and packed.max_seqlen > piece

    def _recorded_delta_rule(self, q, k, v, g, beta, rows, tokens, kept, initial_state, kernels: KernelSet):
        """The delta rule of `rows` rows of `tokens` tokens each, the last `kept` of every row one at a time after
        the chunked rest -> (o [rows * tokens, Hv, Dv], final state, [the state before each kept token])."""
        q, k, v, g, beta = (t.reshape(rows, tokens, *t.shape[1:]) for t in (q, k, v, g, beta))
        head = tokens - kept
        outputs, state = [], initial_state
        if head:
            first = torch.zeros(rows, dtype=torch.long, device=q.device)  # positions: unread by the delta rule
            part = continuation_sequence(None, rows, head, first, q.device)
            flat = (t[:, :head].reshape(rows * head, *t.shape[2:]) for t in (q, k, v, g, beta))
            out, state = kernels.delta_rule(*flat, part, initial_state=initial_state, output_final_state=True)
            outputs.append(out.reshape(rows, head, *out.shape[1:]))
        elif state is None:  # the prompt, every token kept: the recurrence starts from zeros
            shape = (rows, self.num_v_heads, self.head_k_dim, self.head_v_dim)
            state = torch.zeros(shape, dtype=torch.float32, device=q.device)
        else:
            state = state.clone()  # a static cache overwrites the state it holds
        states = []
        for t in range(head, tokens):
            states.append(state)
            out, state = kernels.delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            outputs.append(out.unsqueeze(1))
        return torch.cat(outputs, dim=1).reshape(rows * tokens, *outputs[0].shape[2:]), state, states
