"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block.

MoE: softmax router in fp32 -> top-k -> renormalised weights; experts stored fused as 3D tensors
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, the official checkpoint layout); a shared expert scaled by
sigmoid(shared_expert_gate). The (token, expert) pairs are sorted by expert once; then either

* `grouped_mm` (the kernel choice on CUDA in bf16): one grouped GEMM per projection over all experts, with the
  permutation, counts and offsets computed on the device, so the block never waits for the host. The SwiGLU and
  the routing-weight product run as one fused chain, recomputed in the backward instead of kept, and the gathered
  expert inputs are recomputed from the block input. Tokens reach their expert rows and come back through a pair
  of gathers that are each other's backward (`ExpertRows`): no scatter, no index_put, and every token's k rows are
  summed in a fixed order, so the gradients are deterministic. On CUDA the gather-and-sum is one Triton pass
  (`kernels.gather_sum`, the `combine` kernel choice).
* `loop` (the reference, the CPU default): one matmul per expert over its tokens, after reading the counts on the
  host.

The forward reads the expert tensors as module attributes, so PEFT's `target_parameters` can wrap them; its LoRA
then runs as two low-rank products on the expert rows, not through a rebuilt adapted weight (expert_lora.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

from .expert_lora import ExpertWeight
from .kernel_set import REFERENCE_KERNELS, KernelSet
from .projection import RowInvariantLinear, RowInvariantProduct
from .recompute import remember
from .routing_replay import replayed_top_k


class SwiGLUMLP(nn.Module):
    """gate_proj / up_proj / down_proj with SwiGLU (the dense MLP and the MoE block's shared expert)."""

    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.gate_proj = RowInvariantLinear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = RowInvariantLinear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = RowInvariantLinear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.is_swiglu = config.hidden_act == "silu"

    def forward(self, x: torch.Tensor, kernels: KernelSet = REFERENCE_KERNELS) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.is_swiglu:  # down_proj keeps its input for the weight gradient: recomputed instead (recompute.py)
            hidden = remember(kernels.swiglu(gate, up), kernels.swiglu, gate, up)
        else:
            hidden = self.act_fn(gate) * up
        return self.down_proj(hidden)


class TopKRouter(nn.Module):
    """Owns the router weight `mlp.gate.weight [E, H]`; returns fp32 logits (an fp32 product: on CUDA fixed row
    blocks, projection.py), top-k weights and indices. `routed_experts` [N, k] (ids, -1 = none) replaces the top-k
    choice of the tokens it gives (routing_replay.py)."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor, routed_experts: torch.Tensor | None = None):
        logits = RowInvariantProduct.apply(x, self.weight, torch.float32)
        probs = logits.softmax(dim=-1)
        top_weights, top_index = probs.topk(self.top_k, dim=-1)
        if routed_experts is not None:
            return (logits, *replayed_top_k(probs, top_index, routed_experts))
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return logits, top_weights, top_index


class FusedExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, config.moe_intermediate_size))
        self.act_fn = ACT2FN[config.hidden_act]
        self.is_swiglu = config.hidden_act == "silu"

    def forward(
        self,
        x: torch.Tensor,
        top_index: torch.Tensor,
        top_weights: torch.Tensor,
        kernels: KernelSet = REFERENCE_KERNELS,
        lora: dict | None = None,
    ) -> torch.Tensor:
        """x [N, H]; top_index [N, k] expert ids; top_weights [N, k] fp32 -> [N, H] in x's dtype. `lora`: LoRA
        factors per tensor name (expert_lora.low_rank_plan), applied on the expert rows."""
        if kernels.grouped_experts:
            return self.grouped(x, top_index, top_weights, kernels, lora)
        return self.looped(x, top_index, top_weights, lora)

    def expert_weight(self, name: str, lora: dict | None) -> ExpertWeight:
        # not `weight`: PEFT reads `weight` off a wrapped module to find its device
        factors = lora.get(name, ()) if lora else ()
        return ExpertWeight(getattr(self, name), *factors)

    def looped(self, x, top_index, top_weights, lora=None):
        top_k = top_index.shape[-1]
        flat_expert = top_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token = order // top_k
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        gate_up, down = self.expert_weight("gate_up_proj", lora), self.expert_weight("down_proj", lora)
        outputs = []
        for expert, chunk in enumerate(torch.split(x[token], counts)):
            if chunk.shape[0] == 0:
                continue
            gate, up = gate_up.linear(chunk, expert).chunk(2, dim=-1)
            outputs.append(down.linear(self.act_fn(gate) * up, expert))
        routed = torch.cat(outputs) * top_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token, routed.to(x.dtype))

    def grouped(self, x, top_index, top_weights, kernels: KernelSet, lora=None):
        n, top_k = top_index.shape
        flat_expert = top_index.reshape(-1)
        # order: the (token, slot) pairs sorted by expert = which pair each expert row holds; slot_of: the row each
        # pair went to (the inverse permutation).
        order = torch.argsort(flat_expert, stable=True)
        slot_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        rows_of = ExpertRows(order, slot_of, top_k, kernels.combine)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat_expert, torch.ones_like(flat_expert, dtype=torch.int32)
        )
        offsets = counts.cumsum(0, dtype=torch.int32)
        # The first grouped GEMM keeps its input for the weight gradient: [N * k, H], k times the block input.
        # Recomputed from x in the backward instead (recompute.py).
        rows = remember(rows_of.expand(x), rows_of.expand, x)
        gate_up = self.expert_weight("gate_up_proj", lora).grouped_linear(rows, offsets)
        weight = rows_of.permute(top_weights.reshape(-1).float())
        if self.is_swiglu:
            swiglu = kernels.weighted_swiglu
            hidden = remember(swiglu(gate_up, weight), swiglu, gate_up, weight)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = (self.act_fn(gate) * up * weight.unsqueeze(-1)).to(gate_up.dtype)
        # the down product and its adapter's are summed by the combine as it reads them (ExpertRows.combine)
        out, adapter_out = self.expert_weight("down_proj", lora).grouped_parts(hidden, offsets)
        return rows_of.combine(out, adapter_out).to(x.dtype)


class ExpertRows:
    """The map between tokens and expert rows: row r holds (token, slot) pair order[r], i.e. token order[r] // k;
    pair p sits in row slot_of[p]. Three differentiable moves:

    * expand: token rows -> expert rows, x[order // k]; backward: each token's k row gradients gathered and summed;
    * combine: expert rows -> token rows, the same gather-and-sum; backward: the expand gather. Given the rows in
      two parts (a product and its LoRA adapter's), it sums each row's parts as it reads them, rounded as their own
      add would be: the combine of their sum, bit for bit, without a pass that writes the sum;
    * permute: a per-pair vector (the routing weights) into row order; backward: the inverse gather.

    Each backward is a gather, never a scatter-add or index_put over repeated indices (whose CUDA kernels sort the
    indices and accumulate in an order of their own)."""

    def __init__(self, order, slot_of, top_k, combine):
        self.order, self.slot_of, self.top_k, self.gather_sum = order, slot_of, top_k, combine

    @functools.cached_property
    def token_of_row(self):  # where a move reads it: a map rebuilt for a backward may not
        return self.order // self.top_k

    def expand(self, x):
        return _Move.apply(x, self, "_to_rows", "_sum_rows")

    def combine(self, rows, addend=None):
        if addend is None:
            return _Move.apply(rows, self, "_sum_rows", "_to_rows")
        return _CombineParts.apply(rows, addend, self)

    def permute(self, values):
        return _Move.apply(values, self, "_permute", "_unpermute")

    def _to_rows(self, x):
        return x[self.token_of_row]

    def _sum_rows(self, rows, addend=None):
        return self.gather_sum(rows, self.slot_of, self.top_k, addend)

    def _permute(self, values):
        return values[self.order]

    def _unpermute(self, values):
        return values[self.slot_of]

    def save_for_backward(self, ctx) -> None:
        """The map in an autograd context: its index tensors as saved tensors (see `_Move`), the rest as attributes."""
        ctx.save_for_backward(self.order, self.slot_of)
        ctx.top_k, ctx.gather_sum = self.top_k, self.gather_sum

    @classmethod
    def saved_in(cls, ctx) -> ExpertRows:
        """The map `save_for_backward` put in `ctx`, in a backward."""
        return cls(*ctx.saved_tensors, ctx.top_k, ctx.gather_sum)


class _Move(torch.autograd.Function):
    """y = rows.there(x) for a linear move of rows whose transpose is rows.back (a gather and its gather-and-sum, or a
    permutation and its inverse): the backward is back(grad). The map's index tensors are saved for the backward
    like any activation, not held by the node: a node lives until its whole graph is freed, so indices it held would
    stay on the device through a checkpointed forward (which discards saved tensors and recomputes them) and through
    activation offloading (which moves saved tensors only), every layer's until the backward ends."""

    @staticmethod
    def forward(ctx, x, rows: ExpertRows, there: str, back: str):
        rows.save_for_backward(ctx)
        ctx.back = back
        return getattr(rows, there)(x)

    @staticmethod
    def backward(ctx, grad):
        return getattr(ExpertRows.saved_in(ctx), ctx.back)(grad), None, None, None


class _CombineParts(torch.autograd.Function):
    """rows.combine(part + addend) without the [M, H] sum (ExpertRows): the gather-and-sum reads both parts. Its
    backward is the combine's, the expand gather, whose result is the gradient of each part. The map is saved as
    `_Move` saves it."""

    @staticmethod
    def forward(ctx, part, addend, rows: ExpertRows):
        rows.save_for_backward(ctx)
        return rows._sum_rows(part, addend)

    @staticmethod
    def backward(ctx, grad):
        grad_rows = ExpertRows.saved_in(ctx)._to_rows(grad)
        return grad_rows, grad_rows, None


class SparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config  # read at each forward: `moe_token_chunk` may be set after the model is built
        self.gate = TopKRouter(config)
        self.experts = FusedExperts(config)
        # The shared expert and its [hidden -> 1] gate are row-invariant projections like every other
        # (projection.py); the routed experts' grouped GEMMs are too, by the same kernel.
        self.shared_expert = SwiGLUMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = RowInvariantLinear(config.hidden_size, 1, bias=False)

    def forward(
        self, x: torch.Tensor, kernels: KernelSet = REFERENCE_KERNELS, routed_experts: torch.Tensor | None = None
    ):
        """x [N, H] -> (out [N, H], router logits [N, E] fp32); `routed_experts` [N, k]: see TopKRouter. With the
        config's `moe_token_chunk` and more tokens than that, the block runs chunk by chunk, each chunk checkpointed
        while autograd records: only one chunk's expert rows are alive at a time, in the forward and in the
        backward. On CUDA in bf16 every op of the block computes a token's row alone (row-invariant products and
        grouped GEMMs, per-token routing and combine), so the outputs are those of one call, bit for bit; the CPU's
        expert products round by their row counts."""
        chunk = getattr(self.config, "moe_token_chunk", None)
        if not chunk or x.shape[0] <= chunk:
            return self._tokens(x, kernels, routed_experts)
        outs, logits = [], []
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            replay = None if routed_experts is None else routed_experts[rows]
            if torch.is_grad_enabled():  # the block draws no random numbers: no RNG state to restore
                out, part = checkpoint(self._tokens, x[rows], kernels, replay, use_reentrant=False, preserve_rng_state=False)  # fmt: skip
            else:
                out, part = self._tokens(x[rows], kernels, replay)
            outs.append(out)
            logits.append(part)
        return torch.cat(outs), torch.cat(logits)

    def _tokens(self, x: torch.Tensor, kernels: KernelSet, routed_experts: torch.Tensor | None):
        logits, top_weights, top_index = self.gate(x, routed_experts)
        plan = kernels.expert_lora(self.experts)  # PEFT LoRA on the experts: the bare experts and its factors
        if plan is None:
            routed = self.experts(x, top_index, top_weights, kernels)
        else:
            experts, lora = plan
            routed = experts(x, top_index, top_weights, kernels, lora)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, kernels)
        return routed + shared, logits


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-style auxiliary loss over the real tokens of all MoE layers: E * sum_e f_e * p_e, where f_e is the
    share of top-k assignments that went to expert e and p_e its mean router probability. Router logits of the
    packed stream are real tokens only; with `attention_mask`, they are in the caller's layout
    ([batch * seq, experts] per layer, see `router_logits_in_caller_layout`) and only the mask's real rows count."""
    if attention_mask is not None:
        real = attention_mask.reshape(-1).bool()
        router_logits = tuple(layer[real.to(layer.device)] for layer in router_logits)
    logits = torch.cat(router_logits).float()
    probs = logits.softmax(dim=-1)
    selected = probs.topk(top_k, dim=-1).indices
    assignment_share = torch.bincount(selected.reshape(-1), minlength=num_experts).float() / logits.shape[0]
    return num_experts * (assignment_share * probs.mean(dim=0)).sum()


def add_load_balancing_loss(loss, router_logits, text_config, attention_mask: torch.Tensor | None = None):
    """A forward's MoE aux term -> (loss, aux_loss): aux_loss is `load_balancing_loss` of its router logits with the
    config's expert counts (`attention_mask` as there); `loss` (None without labels) gets
    `router_aux_loss_coef * aux_loss` added when that coefficient is > 0."""
    aux_loss = load_balancing_loss(
        tuple(router_logits), text_config.num_experts, text_config.num_experts_per_tok, attention_mask
    )
    coef = text_config.router_aux_loss_coef
    if loss is not None and coef > 0:
        loss = loss + coef * aux_loss.to(loss.device)
    return loss, aux_loss
