"""MoE experts (qwen35_packed/modeling/moe.py): the grouped-GEMM path against the per-expert loop, the reference.

torch's grouped_mm has a CPU fallback, so `moe_kernel="grouped_mm"` runs here in fp32: the permutation, the
offsets, the fused SwiGLU x routing weight, the recomputed inputs and the per-token top-k sum are the code the GPU
runs (only the GEMM kernel differs). Routing corner cases: experts without tokens, one token, every token on one
expert."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from conftest import random_routed_experts, saved_storage_bytes, tiny_kwargs, training_step

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM
from qwen35_packed.modeling import kernel_selection, moe
from qwen35_packed.modeling.kernel_selection import KernelChoice, select_kernels
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.moe import FusedExperts
from qwen35_packed.modeling.recompute import RecomputedActivations

pytestmark = pytest.mark.skipif(
    not kernel_selection.grouped_mm_usable(torch.device("cpu"), torch.float32),
    reason="this torch has no grouped_mm on CPU",
)

GROUPED = kernel_set(KernelChoice(gdn="torch", attention="sdpa", moe="grouped_mm"))
LOOP = kernel_set(KernelChoice(gdn="torch", attention="sdpa", moe="loop"))


def _experts(num_experts=8, hidden=16, intermediate=12, seed=0):
    config = types.SimpleNamespace(
        num_experts=num_experts, moe_intermediate_size=intermediate, hidden_size=hidden, hidden_act="silu"
    )
    torch.manual_seed(seed)
    experts = FusedExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    return experts


def _routing(n, top_k, num_experts, case, seed=1):
    g = torch.Generator().manual_seed(seed)
    if case == "all_on_one":  # expert 5 gets every token, in slot 0; the other slots pick distinct experts
        rest = torch.stack([torch.randperm(num_experts - 1, generator=g)[: top_k - 1] for _ in range(n)])
        index = torch.cat([torch.full((n, 1), 5), rest + (rest >= 5).long()], dim=1)
    elif case == "few_experts":  # experts 0, 1 and 2 only: most experts empty, including the first and the last
        index = torch.stack([torch.randperm(3, generator=g)[:top_k] for _ in range(n)])
    else:
        index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=g) + 0.05
    return index, (weights / weights.sum(-1, keepdim=True)).requires_grad_()


def _run(experts, x, index, weights, choice):
    x = x.detach().clone().requires_grad_()
    w = weights.detach().clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = experts(x, index, w, choice)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
    return out.detach(), x.grad, w.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()


@pytest.mark.parametrize(
    "n, top_k, case",
    [(37, 2, "random"), (1, 2, "random"), (40, 3, "all_on_one"), (25, 2, "few_experts"), (64, 8, "random")],
)
def test_grouped_experts_equal_the_loop_in_values_and_gradients(n, top_k, case):
    experts = _experts()
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(3))
    index, weights = _routing(n, top_k, 8, case)
    loop = _run(experts, x, index, weights, LOOP)
    grouped = _run(experts, x, index, weights, GROUPED)
    for name, a, b in zip(("out", "x", "weights", "gate_up_proj", "down_proj"), loop, grouped):
        scale = a.abs().max().clamp(min=1e-6)
        assert (a - b).abs().max() <= 1e-5 * scale, name
    if case == "few_experts":  # experts that got no token get exactly zero gradient
        assert grouped[3][3:].abs().max() == 0 and grouped[4][3:].abs().max() == 0


def test_grouped_experts_are_deterministic():
    experts = _experts()
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(3))
    index, weights = _routing(50, 4, 8, "random")
    first, second = _run(experts, x, index, weights, GROUPED), _run(experts, x, index, weights, GROUPED)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_grouped_experts_keep_neither_the_gathered_rows_nor_the_swiglu_output():
    # Both GEMM inputs of [N * k, ...] rows are recomputed in the backward (from the block input and the first
    # GEMM's output), not kept through the forward.
    experts = _experts()
    x = torch.randn(30, 16, requires_grad=True)
    index, weights = _routing(30, 2, 8, "random")
    seen = []
    original = kernel_selection.GROUPED_MM

    def watching(a, b, offs):
        seen.append(weakref.ref(a))
        return original(a, b, offs=offs)

    kernel_selection.GROUPED_MM = watching
    try:
        with RecomputedActivations():
            out = experts(x, index, weights, GROUPED)
        alive = [ref() is not None for ref in seen]
        out.sum().backward()
    finally:
        kernel_selection.GROUPED_MM = original
    assert len(seen) >= 2 and not any(alive[:2]), alive


def test_a_checkpointed_expert_block_keeps_its_expert_row_map_only_as_saved_tensors(monkeypatch):
    """Under a non-reentrant checkpoint the forward's saved tensors are dropped and remade in the backward. The map
    between tokens and expert rows must be among them, not held by the graph's nodes: a node lives until the whole
    graph is freed, so it would keep every layer's map on the device through the forward and the backward, and
    activation offloading would not see it. Gradients stay those without the checkpoint."""
    experts = _experts()
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))
    index, weights = _routing(40, 4, 8, "random")
    plain = _run(experts, x, index, weights, GROUPED)
    maps = []
    original_init = moe.ExpertRows.__init__

    def recording_init(self, *args):
        original_init(self, *args)
        maps.append([weakref.ref(t) for t in (self.order, self.slot_of, self.token_of_row)])

    monkeypatch.setattr(moe.ExpertRows, "__init__", recording_init)
    xc, wc = x.clone().requires_grad_(), weights.detach().clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = torch.utils.checkpoint.checkpoint(experts, xc, index, wc, GROUPED, use_reentrant=False)
    gc.collect()
    assert len(maps) == 1 and all(ref() is None for ref in maps[0])
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
    checkpointed = (out.detach(), xc.grad, wc.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    for name, a, b in zip(("out", "x", "weights", "gate_up_proj", "down_proj"), plain, checkpointed):
        assert torch.equal(a, b), name


def _model(moe_kernel: str):
    torch.manual_seed(0)
    # return_logits_with_loss=True: the tests compare the logits of training forwards with labels
    return Qwen3_5MoePackedForCausalLM(
        Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_kernel=moe_kernel, return_logits_with_loss=True)
    )


def _packed_step(model):
    g = torch.Generator().manual_seed(4)
    lengths = [20, 1, 70, 9]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, cu_seqlens=cu, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads, ids, lengths


def test_model_with_grouped_experts_equals_the_loop_and_stays_packed_exact():
    logits_loop, loss_loop, grads_loop, ids, lengths = _packed_step(_model("loop").train())
    model = _model("grouped_mm").train()
    logits, loss, grads, _, _ = _packed_step(model)
    assert (logits - logits_loop).abs().max() <= 1e-5
    assert abs(loss - loss_loop) <= 1e-6
    assert grads.keys() == grads_loop.keys()
    for name, grad in grads.items():  # absolute floor: deep A_log / dt_bias gradients are ~1e-6 in all
        ref = grads_loop[name]
        assert (grad - ref).norm() <= 1e-5 * ref.norm() + 1e-9, name
    # packed == each document alone, through the grouped path
    model.eval()
    start = 0
    with torch.no_grad():
        for length in lengths:
            alone = model(input_ids=ids[:, start : start + length]).logits
            assert (alone - logits[:, start : start + length]).abs().max() <= 1e-5
            start += length


def test_moe_kernel_choice():
    config = Qwen3_5MoePackedConfig(**tiny_kwargs("moe"))
    assert select_kernels(config, torch.device("cpu"), torch.float32).moe == "loop"  # auto: the reference on CPU
    config.moe_kernel = "grouped_mm"
    assert select_kernels(config, torch.device("cpu"), torch.float32).moe == "grouped_mm"
    with pytest.raises(ValueError, match="moe_kernel must be one of"):
        Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_kernel="batched")


def test_moe_combine_kernel_choice():
    # The Triton top-k combine is a CUDA kernel (the CPU runs it only in Triton's interpreter, in
    # tests/modeling/test_triton_gather_sum.py): auto picks the eager combine here, forcing Triton raises.
    config = Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_kernel="grouped_mm")
    assert select_kernels(config, torch.device("cpu"), torch.float32).combine == "eager"
    config.moe_combine_kernel = "triton"
    with pytest.raises(RuntimeError, match="moe_combine_kernel='triton' was forced"):
        select_kernels(config, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="moe_combine_kernel must be one of"):
        Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_combine_kernel="atomic")


def test_grouped_mm_probe_answers_the_same_in_every_autograd_mode():
    # The answer is cached for the process, and an eval forward or generate() may ask first: under no_grad the
    # probe's backward had no graph, it answered False for good, and the MoE ran the per-expert loop from then on
    # (forcing grouped_mm raised). On the H200 that made packed != per-document: the loop is not batch-invariant.
    config = Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_kernel="grouped_mm")
    answers = {}
    try:
        for mode, context in (
            ("no_grad", torch.no_grad),
            ("inference", torch.inference_mode),
            ("grad", torch.enable_grad),
        ):
            kernel_selection._grouped_mm_runs.cache_clear()
            with context():
                answers[mode] = select_kernels(config, torch.device("cpu"), torch.float32).moe
    finally:
        kernel_selection._grouped_mm_runs.cache_clear()
    assert answers == {"no_grad": "grouped_mm", "inference": "grouped_mm", "grad": "grouped_mm"}


def test_forcing_grouped_mm_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(kernel_selection, "grouped_mm_usable", lambda device, dtype: False)
    config = Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_kernel="grouped_mm")
    with pytest.raises(RuntimeError, match="moe_kernel='grouped_mm' was forced"):
        select_kernels(config, torch.device("cpu"), torch.float32)
    config.moe_kernel = "auto"
    assert select_kernels(config, torch.device("cpu"), torch.float32).moe == "loop"


@pytest.mark.parametrize("moe_kernel", ["loop", "grouped_mm"])
def test_lora_on_experts_through_peft_target_parameters(moe_kernel):
    # PEFT's ParamWrapper swaps the expert tensors for W + BA while the experts run: the grouped path reads them
    # as module attributes too, so LoRA acts, trains, merges and unmerges there as in the loop.
    from peft import LoraConfig, get_peft_model

    reference = _model("loop")
    model = _model(moe_kernel)
    config = dict(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    reference, model = get_peft_model(reference, LoraConfig(**config)), get_peft_model(model, LoraConfig(**config))
    torch.manual_seed(5)
    with torch.no_grad():
        for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 0.1)
            q.copy_(p)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    outs = []
    for m in (reference, model):
        out = m(input_ids=ids, cu_seqlens=cu, labels=ids)
        out.loss.backward()
        outs.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if "lora_" in n}))
    assert (outs[0][0] - outs[1][0]).abs().max() <= 1e-5
    assert outs[1][1] and all(g is not None and g.abs().max() > 0 for g in outs[1][1].values())
    for name, grad in outs[1][1].items():
        assert (grad - outs[0][1][name]).norm() <= 1e-5 * outs[0][1][name].norm(), name
    with torch.no_grad():
        with model.disable_adapter():
            base_logits = model(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
        model.merge_adapter()
        merged = model(input_ids=ids).logits
        model.unmerge_adapter()
        unmerged = model(input_ids=ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapter acts
    assert (merged - adapted).abs().max() <= 1e-5 and (unmerged - adapted).abs().max() <= 1e-5


def test_router_logits_of_a_document_do_not_depend_on_what_runs_with_it():
    # BLAS picks its algorithm by the row count, so one plain GEMM gave a document alone logits an ulp away from
    # the same rows packed (some rows here on CPU, every row on the H200), and near-tie tokens changed experts.
    from qwen35_packed.modeling.moe import TopKRouter

    config = types.SimpleNamespace(num_experts=32, num_experts_per_tok=4, hidden_size=512)
    router = TopKRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.05)
    lengths = [700, 1030, 1, 37, 500, 64, 3, 211, 129, 90]
    x = torch.randn(sum(lengths), 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        logits, _, index = router(x)
        start = 0
        for length in lengths:
            alone, _, alone_index = router(x[start : start + length])
            assert torch.equal(alone, logits[start : start + length])
            assert torch.equal(alone_index, index[start : start + length])
            start += length


def test_router_logits_gradients_equal_one_plain_gemm():
    # The fixed row blocks serve the forward only; the backward is one GEMM per input: same gradients as autograd
    # through a plain fp32 F.linear, for bf16 inputs too (cast back to the input's dtype).
    from qwen35_packed.modeling.projection import RowInvariantProduct

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1100, 32, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
        weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).requires_grad_()
        grad = torch.randn(1100, 8, generator=torch.Generator().manual_seed(4))
        logits = RowInvariantProduct.apply(x, weight, torch.float32)
        logits.backward(grad)
        x_ref, weight_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        reference = torch.nn.functional.linear(x_ref.float(), weight_ref.float())
        reference.backward(grad)
        assert logits.dtype == torch.float32 and x.grad.dtype == dtype
        assert (logits - reference).abs().max() <= 1e-5
        assert (x.grad.float() - x_ref.grad.float()).abs().max() <= 1e-5 + 1e-2 * (dtype == torch.bfloat16)
        assert (weight.grad - weight_ref.grad).abs().max() <= 1e-4 * weight_ref.grad.abs().max()


def test_router_logits_backward_in_bf16_when_both_inputs_are_bf16():
    # bf16 training (both x and the router weight bf16): the backward GEMMs run in bf16 with fp32 accumulation, the
    # gradients autograd gives through a bf16 F.linear fed the same bf16 gradient, bit for bit.
    from qwen35_packed.modeling.projection import RowInvariantProduct

    x = torch.randn(1100, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(1100, 8, generator=torch.Generator().manual_seed(4))
    logits = RowInvariantProduct.apply(x, weight, torch.float32)
    assert logits.dtype == torch.float32
    logits.backward(grad)
    x_ref, weight_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    torch.nn.functional.linear(x_ref, weight_ref).backward(grad.to(torch.bfloat16))
    assert x.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(weight.grad, weight_ref.grad)


def test_grouped_experts_move_rows_by_gathers_only():
    # Deterministic on CUDA needs more than equal results here: scatter-add, index_add and index_put with
    # accumulation (autograd's backward of an indexing gather) sum in an order of their own there. The forward and
    # the backward of the grouped experts use gathers only; the one scatter_add counts integer tokens per expert.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(
                (func.__name__.split(".")[0], args[0].dtype if args and isinstance(args[0], torch.Tensor) else None)
            )
            return func(*args, **(kwargs or {}))

    experts = _experts()
    x = torch.randn(30, 16, requires_grad=True)
    index, weights = _routing(30, 4, 8, "random")
    with Ops() as ops:
        with RecomputedActivations():
            out = experts(x, index, weights, GROUPED)
        out.backward(torch.randn_like(out))
    accumulating = [
        (name, dtype)
        for name, dtype in ops.names
        if name
        in (
            "index_put",
            "index_put_",
            "_index_put_impl_",
            "index_add",
            "index_add_",
            "scatter_add",
            "scatter_add_",
            "scatter_reduce",
        )
    ]
    assert accumulating == [("scatter_add_", torch.int32)], accumulating


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combining_two_parts_equals_combining_their_sum_in_values_and_gradients(dtype):
    """The down product and its LoRA adapter's reach the combine in two parts (no pass writes their sum): the tokens'
    rows and each part's gradient must be those of combining `part + addend`, bit for bit."""
    g = torch.Generator().manual_seed(4)
    top_k, n = 4, 30
    index, _ = _routing(n, top_k, 8, "random")
    order = torch.argsort(index.reshape(-1), stable=True)
    slot_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    rows_of = moe.ExpertRows(order, slot_of, top_k, GROUPED.combine)
    part, addend = (torch.randn(n * top_k, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    grad_out = torch.randn(n, 16, generator=g).to(dtype)
    combined = rows_of.combine(part, addend)
    combined.backward(grad_out)
    grads = part.grad, addend.grad
    part.grad = addend.grad = None
    summed = part + addend
    reference = rows_of.combine(summed)
    reference.backward(grad_out)
    assert combined.grad_fn.name().startswith("_CombineParts")  # the two-part path ran, not the sum
    assert torch.equal(combined, reference)
    assert torch.equal(grads[0], part.grad) and torch.equal(grads[1], addend.grad)


def test_gather_sum_of_a_group_does_not_depend_on_the_others():
    # The combine of the top-k outputs: a token's sum must not depend on how many tokens ran with it, or a packed
    # document's next-layer routing can differ from the same document alone.
    from qwen35_packed.modeling.kernels import gather_sum

    g = torch.Generator().manual_seed(0)
    src = torch.randn(96, 40, generator=g).to(torch.bfloat16) * 10
    index = torch.randperm(96, generator=g)
    full = gather_sum(src, index, 8)
    assert full.dtype == torch.bfloat16 and full.shape == (12, 40)
    for start, stop in ((0, 1), (1, 4), (4, 12), (11, 12)):
        assert torch.equal(gather_sum(src, index[start * 8 : stop * 8], 8), full[start:stop])
    reference = torch.stack([sum(src[i].float() for i in index[t * 8 : (t + 1) * 8].tolist()) for t in range(12)])
    assert (full.float() - reference).abs().max() <= 2**-7 * reference.abs().max()


def test_router_logits_backward_under_autocast():
    # Trainers run the forward under autocast (TRL's bf16 on CPU): the router's block GEMMs write into an fp32
    # result (an out= matmul is not autocast), so its logits stay those of the fp32 GEMM; the incoming gradient may
    # be bf16, and the backward must still give the plain fp32 GEMM's gradients in the inputs' dtypes.
    from qwen35_packed.modeling.projection import RowInvariantProduct

    x = torch.randn(600, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = RowInvariantProduct.apply(x, weight, torch.float32)
    reference = torch.nn.functional.linear(x.float(), weight.float())
    assert logits.dtype == torch.float32 and torch.equal(logits, reference)
    grad_x, grad_weight = torch.autograd.grad(logits.to(torch.bfloat16).float().sum(), (x, weight))
    grad_x_ref, grad_weight_ref = torch.autograd.grad(reference.sum(), (x, weight))
    assert grad_x.dtype == x.dtype and grad_weight.dtype == weight.dtype
    assert (grad_x - grad_x_ref).abs().max() <= 2e-2 * grad_x_ref.abs().max()
    assert (grad_weight - grad_weight_ref).abs().max() <= 2e-2 * grad_weight_ref.abs().max()


def test_shared_expert_and_its_gate_do_not_depend_on_what_runs_with_them():
    """The MoE block's shared expert (gate_proj, up_proj, down_proj) and its [hidden -> 1] gate give each document
    the rows it gets alone, bit for bit. In fp32 the CPU BLAS blocks a plain product by its row count and rounds
    some rows differently alone and packed: an nn.Linear in place of any of the four fails here."""
    from qwen35_packed.modeling.moe import SparseMoeBlock

    config = types.SimpleNamespace(
        hidden_size=512, shared_expert_intermediate_size=256, hidden_act="silu", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip
    block = SparseMoeBlock(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for projection in (block.shared_expert_gate, *block.shared_expert.children()):
            if isinstance(projection, torch.nn.Linear):
                projection.weight.normal_(0, 0.05)
    lengths = [700, 1030, 1, 37, 500, 64, 3, 211, 129, 90]
    x = torch.randn(sum(lengths), config.hidden_size, generator=torch.Generator().manual_seed(1))
    modules = {"shared_expert": block.shared_expert, "shared_expert_gate": block.shared_expert_gate}
    with torch.no_grad():
        for name, module in modules.items():
            packed = module(x)
            for start, length in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths):
                alone = module(x[start : start + length])
                assert torch.equal(alone, packed[start : start + length]), (name, start, length)


def _chunk_inputs(model, replay: bool) -> dict:
    """A packed row of four documents (100 tokens), with router logits asked for, optionally replayed experts."""
    g = torch.Generator().manual_seed(8)
    lengths = [20, 1, 70, 9]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = dict(input_ids=ids, cu_seqlens=cu, labels=ids, output_router_logits=True, use_cache=False)
    if replay:
        inputs["routed_experts"] = random_routed_experts(model.config, ids.shape[1], g)
    return inputs


def _chunked_step(model, chunk, inputs, checkpointing: bool):
    out, grads = training_step(model, inputs, checkpointing, moe_token_chunk=chunk)
    return out.logits.detach(), torch.stack(out.router_logits).detach(), out.loss.detach(), grads


@pytest.mark.parametrize("moe_kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("setup", ["plain", "lora", "replay", "checkpointing"])
def test_moe_token_chunks_give_one_calls_outputs(moe_kernel, setup):
    """moe_token_chunk splits each MoE block's 100 tokens into chunks of 32 (the last of 4), each checkpointed: the
    first MoE layer's router logits are those of one call bit for bit (its input is the same and the router's
    product row-invariant); the logits, the other router logits, the loss and the gradients agree within fp32
    rounding (the CPU's expert products are not row-invariant; on the GPU the outputs are bitwise:
    tests/gpu/test_gpu_real_shapes.py), with LoRA on the experts and the shared expert, with replayed experts, and
    inside checkpointed decoder layers."""
    model = _model(moe_kernel).train()
    if setup == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_modules=["gate_proj", "up_proj", "down_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ))  # fmt: skip
    inputs = _chunk_inputs(model, setup == "replay")
    whole = _chunked_step(model, None, inputs, setup == "checkpointing")
    chunked = _chunked_step(model, 32, inputs, setup == "checkpointing")
    assert torch.equal(chunked[1][0], whole[1][0])
    for ours, theirs in zip(chunked[:3], whole[:3]):
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    assert chunked[3].keys() == whole[3].keys() and chunked[3]
    for name, grad in chunked[3].items():
        ref = whole[3][name]
        assert (grad - ref).norm() <= 1e-5 * ref.norm() + 1e-9, name


def test_moe_token_chunks_keep_one_chunks_expert_rows_for_the_backward():
    """A training forward with chunks saves, for the MoE blocks' backward, each chunk's input and not its expert
    rows: fewer saved bytes than one call, which keeps the (token, expert) rows of the whole stream."""
    model = _model("grouped_mm").train()
    inputs = _chunk_inputs(model, replay=False)

    def saved_bytes(chunk) -> int:
        model.config.moe_token_chunk = chunk
        return saved_storage_bytes(lambda: model(**inputs).loss.backward())

    whole, chunked = saved_bytes(None), saved_bytes(16)
    assert chunked < whole


@pytest.mark.parametrize("value", [0, -4, True, 2.5, "64"])
def test_moe_token_chunk_must_be_a_positive_count(value):
    with pytest.raises(ValueError, match="moe_token_chunk"):
        Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_token_chunk=value)


def test_moe_token_chunk_is_saved_and_loaded(tmp_path):
    config = Qwen3_5MoePackedConfig(**tiny_kwargs("moe"), moe_token_chunk=4096)
    config.save_pretrained(tmp_path)
    assert Qwen3_5MoePackedConfig.from_pretrained(tmp_path).moe_token_chunk == 4096
