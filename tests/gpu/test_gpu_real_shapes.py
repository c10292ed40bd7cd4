"""GPU checks at the shapes users train (run on the H200, skipped elsewhere): packed == per-document bit for bit in
bf16 for Qwen3.5-4B (its official config, first 8 of 32 layers) and for Qwen3.5-35B-A3B's layer shapes (first 4 of
40 layers, vocab 248,320), on random batches, with the kernels `auto` picks; every token-layer of the MoE routed to
the same experts; and packed vs per-document gradients at the 35B-A3B shapes within the bf16 bound.

A guarantee about any batch is tested on batches nobody tuned to: every case draws its document lengths
(bench_train_step.random_longtail: 1- to 3-token documents, short ones, RL-sized ones and long ones, shuffled) from
a seed that changes every run and is printed (QWEN35_GPU_SEED=N repeats a run). Cases: eval and train mode, one
packed row (cu_seqlens) and the same documents over three padded rows (position_ids restarting per document plus
an attention mask), without and with PEFT LoRA (r=16, non-zero B, PEFT's default fp32 adapters) on every GDN,
attention and MLP projection and, for the MoE, on the experts (target_parameters), and the LoRA model under bf16
autocast as TRL's bf16=True trains it (the adapters' in-place sum, adapter_products.py). Each document is compared with
itself run alone through the same model. Random weights (seed 0, norm weights moved off zero so every layer's scale
matters). QWEN35_GPU_RESULTS=FILE writes the measured numbers."""

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import recorded_autograd_contexts, tensors_held_by, tensors_held_by_autograd_contexts
from fixtures_gpu import move_norms_off_init, routes_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_moe import layer_shapes  # noqa: E402
from bench_train_step import default_dtype, model_kwargs, random_longtail  # noqa: E402

from qwen35_packed import (  # noqa: E402
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.modeling import kernel_selection  # noqa: E402

BASE_SEED = int(os.environ.get("QWEN35_GPU_SEED", time.time_ns() % 1_000_000))
print(f"\nrandom batches of this run: QWEN35_GPU_SEED={BASE_SEED}")
RESULTS: dict = {"base_seed": BASE_SEED}
KINDS = ("dense_4b_8_layers", "moe_35b_a3b_shapes_4_layers")
# (mode, layout, lora, autocast): each case its own random batch
CASES = (
    ("eval", "one_row", False, False), ("train", "one_row", True, False), ("eval", "rows", True, False),
    ("train", "rows", False, False), ("train", "one_row", True, True),
)  # fmt: skip
LORA_MODULES = [
    "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
]  # fmt: skip
# Parameter groups of the gradient check, by name fragment (first match).
GROUPS = (
    ("embed_tokens", "embed_tokens"),
    ("lm_head", "lm_head"),
    ("router", "mlp.gate."),
    ("shared_expert_gate", "shared_expert_gate"),
    ("shared_expert", "shared_expert."),
    ("experts", "mlp.experts"),
    ("gdn", "linear_attn"),
    ("attention", "self_attn"),
    ("norms", "norm"),
)


@pytest.fixture(scope="module", autouse=True)
def write_results():
    yield
    path = os.environ.get("QWEN35_GPU_RESULTS")
    if path:
        RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
        Path(path).write_text(json.dumps(RESULTS, indent=2))


def build(kind: str):
    """Qwen3.5-4B (8 layers) or the 35B-A3B layer shapes (4 layers, real vocab), bf16 on the GPU, seed 0."""
    torch.manual_seed(0)
    if kind == "dense_4b_8_layers":
        config = Qwen3_5PackedConfig(**model_kwargs("qwen35_4b", layers=8))
        cls = Qwen3_5PackedForCausalLM
    else:
        config = Qwen3_5MoePackedConfig(**layer_shapes(4, 248_320, tiny=False))
        cls = Qwen3_5MoePackedForCausalLM
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = cls(config)
    move_norms_off_init(model)
    return model


def with_lora(model):
    """PEFT LoRA r=16 with a random (non-zero) B on every projection, and on the MoE experts."""
    from peft import LoraConfig, get_peft_model

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if model.config.is_moe else None
    config = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_MODULES, target_parameters=experts,
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(1)
    return get_peft_model(model, config)


def draw_documents(seed: int, vocab: int):
    lengths = random_longtail(seed)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).cuda() for n in lengths]


def one_row(docs) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents packed in one row: (input_ids [1, tokens], cu_seqlens int32 on the GPU)."""
    cu = torch.tensor([0, *[d.shape[0] for d in docs]], device="cuda").cumsum(0).to(torch.int32)
    return torch.cat(docs)[None], cu


def packed_forward(model, docs, layout: str):
    """The documents' logits in document order [tokens, vocab] from one packed forward: one row with cu_seqlens,
    or three right-padded rows of whole documents with position_ids restarting per document."""
    if layout == "one_row":
        ids, cu = one_row(docs)
        return model(ids, cu_seqlens=cu, use_cache=False).logits[0].detach()
    rows = [list(range(r, len(docs), 3)) for r in range(3)]
    width = max(sum(docs[i].shape[0] for i in row) for row in rows)
    ids = torch.zeros(3, width, dtype=torch.long, device="cuda")
    positions = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    where = {}
    for r, row in enumerate(rows):
        column = 0
        for i in row:
            n = docs[i].shape[0]
            ids[r, column : column + n] = docs[i]
            positions[r, column : column + n] = torch.arange(n, device="cuda")
            mask[r, column : column + n] = 1
            where[i] = (r, column, n)
            column += n
    logits = model(ids, position_ids=positions, attention_mask=mask, use_cache=False).logits.detach()
    return torch.cat([logits[r, column : column + n] for r, column, n in (where[i] for i in range(len(docs)))])


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c[:2]) + ("-lora" if c[2] else "-base") + ("-autocast" if c[3] else "") for c in CASES])  # fmt: skip
@pytest.mark.parametrize("kind", KINDS)
def test_packed_equals_per_document_bitwise_on_random_batches(kind, case):
    mode, layout, lora, autocast = CASES[case]
    seed = BASE_SEED + 10 * KINDS.index(kind) + case
    model = build(kind)
    if lora:
        model = with_lora(model)
    model.train(mode == "train")
    config = model.config
    choice = kernel_selection.select_kernels(config, torch.device("cuda"), torch.bfloat16)
    docs = draw_documents(seed, config.vocab_size)
    with torch.set_grad_enabled(mode == "train"), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        packed, packed_routes = routes_of(model, lambda: packed_forward(model, docs, layout))
        worst, differing, same_routes, start = 0.0, 0, 0, 0
        for doc in docs:
            alone, routes = routes_of(model, lambda d=doc: model(d[None], use_cache=False).logits[0].detach())
            rows = packed[start : start + doc.shape[0]]
            worst = max(worst, (rows.float() - alone.float()).abs().max().item())
            differing += int((rows != alone).any(-1).sum())
            if layout == "one_row":  # the padded rows' routes hold the pad columns too
                same_routes += sum(
                    int((whole[start : start + doc.shape[0]] == part).all(-1).sum())
                    for whole, part in zip(packed_routes, routes)
                )
            start += doc.shape[0]
    row = {
        "seed": seed, "mode": mode, "layout": layout, "lora": lora, "autocast": autocast,
        "documents": [d.shape[0] for d in docs], "tokens": start,
        "kernels": {"gdn": choice.gdn, "conv": choice.conv, "attention": choice.attention, "moe": choice.moe},
        "max_abs_logit_diff": worst, "rows_not_bitwise_equal": differing,
    }  # fmt: skip
    token_layers = start * len(packed_routes) if layout == "one_row" else None
    if config.is_moe and token_layers is not None:
        row.update(same_routing=same_routes, token_layers=token_layers)
    RESULTS.setdefault(kind, []).append(row)
    print(kind, row)
    assert choice.gdn in ("flash_qla", "fla") and choice.attention in ("flash_attn", "torch_varlen")
    assert differing == 0 and worst == 0.0, f"seed {seed}: {row}"
    if config.is_moe and token_layers is not None:
        assert choice.moe == "grouped_mm" and same_routes == token_layers


def group_of(name: str) -> str:
    return next(group for group, fragment in GROUPS if fragment in name)


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
def test_gradients_packed_vs_per_document_at_35b_a3b_shapes_bf16():
    """Summed-token loss (num_items_in_batch=1) on a random batch: the packed step's gradient against the sum of
    the per-document steps' gradients, relative error per parameter group. The forwards are bit for bit equal (the
    test above) and route alike, so only summation order differs: a weight gradient is one GEMM over the whole
    stream packed and one per document alone, added in bf16 into .grad. Each group's error is that rounding, a few
    bf16 ulps of the group's norm; a leak between documents or a wrong target moves whole rows."""
    model = build("moe_35b_a3b_shapes_4_layers").train()
    docs = draw_documents(BASE_SEED + 99, model.config.vocab_size)
    ids, cu = one_row(docs)
    model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=1, use_cache=False).loss.backward()
    packed = {n: p.grad.float() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for doc in docs:
        if doc.shape[0] > 1:  # a 1-token document has no target
            model(doc[None], labels=doc[None], num_items_in_batch=1, use_cache=False).loss.backward()
    diff, norm = {}, {}
    for n, p in model.named_parameters():
        group = group_of(n)
        grad = p.grad.float() if p.grad is not None else torch.zeros_like(packed[n])
        diff[group] = diff.get(group, 0.0) + (packed[n] - grad).pow(2).sum().item()
        norm[group] = norm.get(group, 0.0) + grad.pow(2).sum().item()
    errors = {group: (diff[group] / max(norm[group], 1e-30)) ** 0.5 for group in diff}
    RESULTS["grad_relative_error_packed_vs_per_document"] = {"seed": BASE_SEED + 99, "errors": errors}
    print(errors)
    assert set(errors) == {group for group, _ in GROUPS}
    assert max(errors.values()) <= 3e-2, errors


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
def test_in_place_adapter_sum_gives_pefts_logits_bitwise_at_35b_a3b_shapes():
    """PEFT's default adapters under bf16 autocast (TRL's bf16=True), a random batch: the adapters' in-place sum
    gives the loss of PEFT's own LoRA forward bit for bit (scaling 2), and the gradients of every adapter
    within the bf16 bound of the in-place input-gradient sum."""
    from qwen35_packed.modeling.adapter_products import peft_adapter_sums

    model = with_lora(build("moe_35b_a3b_shapes_4_layers")).train()
    docs = draw_documents(BASE_SEED + 77, model.config.vocab_size)
    ids, cu = one_row(docs)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            out = model(ids, labels=ids, cu_seqlens=cu, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
        return out.loss.detach(), grads

    ours = step()
    with peft_adapter_sums():
        theirs = step()
    errors = {n: ((g - theirs[1][n]).norm() / theirs[1][n].norm().clamp_min(1e-30)).item() for n, g in ours[1].items()}
    worst = max(errors, key=errors.get)
    RESULTS["in_place_adapter_sum"] = {"seed": BASE_SEED + 77, "tokens": int(cu[-1]), "loss_equal": bool(torch.equal(ours[0], theirs[0])), "worst_adapter_grad_relative_error": [worst, errors[worst]]}  # fmt: skip
    print(RESULTS["in_place_adapter_sum"])
    assert torch.equal(ours[0], theirs[0]) and set(errors) == set(theirs[1]) and errors
    assert errors[worst] <= 3e-2


def against_whole(model, seed: int, field: str, value: int) -> dict:
    """A random batch's eval logits, training loss and gradients with the config's `field` (read at every forward)
    None and `value`: whether the logits and the loss are equal, the worst gradient's relative error, and the
    longest document."""
    docs = draw_documents(seed, model.config.vocab_size)
    ids, cu = one_row(docs)

    def run(setting):
        setattr(model.config, field, setting)
        model.eval()
        with torch.no_grad():
            logits = model(ids, cu_seqlens=cu, use_cache=False).logits
        model.train().zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, cu_seqlens=cu, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return logits, loss.detach(), grads

    whole, cut = run(None), run(value)
    errors = {n: ((g - whole[2][n]).norm() / whole[2][n].norm().clamp_min(1e-30)).item() for n, g in cut[2].items()}
    worst = max(errors, key=errors.get)
    # [tokens x vocab] in fp32 would not fit beside the model: compared a block of rows at a time
    gap_max, gap_sum, size_sum = 0.0, 0.0, 0.0
    for ours, theirs in zip(cut[0][0].split(2048), whole[0][0].split(2048)):
        gap = (ours.float() - theirs.float()).abs()
        gap_max, gap_sum, size_sum = max(gap_max, gap.max().item()), gap_sum + gap.sum().item(), size_sum + theirs.float().abs().sum().item()  # fmt: skip
    return {"seed": seed, "tokens": int(cu[-1]), "longest_document": max(d.shape[0] for d in docs), field: value,
            "logits_equal": bool(torch.equal(cut[0], whole[0])), "loss_equal": bool(torch.equal(cut[1], whole[1])),
            "logits_max_difference": gap_max, "logits_mean_relative_difference": gap_sum / size_sum,
            "loss_relative_difference": ((cut[1] - whole[1]).abs() / whole[1].abs()).item(),
            "gradients": sorted(errors) == sorted(whole[2]) and bool(errors),
            "worst_grad_relative_error": [worst, errors[worst]]}  # fmt: skip


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
def test_moe_token_chunks_give_one_calls_logits_bitwise_at_35b_a3b_shapes():
    """moe_token_chunk=4096 on a random batch (tens of thousands of tokens) at the 35B-A3B layer shapes with expert
    LoRA: the eval logits and the training loss are those of unchunked MoE blocks bit for bit (every op of the block
    is row-invariant on the GPU), the adapters' gradients within the bf16 bound of summing them chunk by chunk."""
    result = RESULTS["moe_token_chunks"] = against_whole(
        with_lora(build("moe_35b_a3b_shapes_4_layers")), BASE_SEED + 55, "moe_token_chunk", 4096
    )
    print(result)
    assert result["tokens"] > 4096 and result["logits_equal"] and result["loss_equal"] and result["gradients"]
    assert result["worst_grad_relative_error"][1] <= 3e-2


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
def test_gdn_pieces_give_whole_documents_logits_bitwise_at_35b_a3b_shapes():
    """gdn_token_chunk=1024 on a random batch (its long documents cut into several pieces) at the 35B-A3B layer
    shapes with LoRA: the eval logits and the training loss are those of whole documents bit for bit (a piece runs
    the chunks the whole document runs, from the fp32 state the one before reached), the gradients within the bf16
    bound (the state's gradient crosses the pieces in fp32, as FLA's backward carries it between chunks). FLA's
    kernel on both sides: where FlashQLA is chosen, the pieces after the first run FLA's."""
    model = with_lora(build("moe_35b_a3b_shapes_4_layers"))
    model.config.gdn_kernel = "fla"
    result = RESULTS["gdn_pieces"] = against_whole(model, BASE_SEED + 56, "gdn_token_chunk", 1024)
    print(result)
    assert result["longest_document"] > 1024 and result["logits_equal"] and result["loss_equal"] and result["gradients"]
    assert result["worst_grad_relative_error"][1] <= 3e-2


def test_continued_attention_is_a_documents_attention_for_its_last_queries():
    """The kernel a later piece of a cut document attends with (kernels.continued_attention: the varlen kernel `auto`
    picks, the keys bounded apart from the queries) gives the rows of the whole document's causal attention at the
    35B-A3B's attention shapes (16 query heads, 2 key heads of 256), random bf16 inputs: its causal mask is aligned to
    the end of the keys."""
    from qwen35_packed.modeling.kernel_selection import KernelSettings, select_kernels
    from qwen35_packed.modeling.kernel_set import kernel_set
    from qwen35_packed.modeling.packing import build_packed_sequence

    config = Qwen3_5MoePackedConfig(**layer_shapes(4, 248_320, tiny=False))
    kernels = kernel_set(select_kernels(KernelSettings.of(config), torch.device("cuda"), torch.bfloat16))
    seed = BASE_SEED + 57
    gen = torch.Generator(device="cuda").manual_seed(seed)
    length = 12_288
    q = torch.randn(length, 16, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(length, 2, 256, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    packed = build_packed_sequence((1, length), torch.device("cuda"))
    whole = kernels.attention(q, k, v, packed, 256**-0.5)
    result = {"seed": seed, "attention": kernels.choice.attention, "pieces": []}
    for start, end in ((4096, 8192), (8192, length), (1024, 1025)):
        piece = kernels.continued_attention(q[start:end], k[:end], v[:end], 256**-0.5)
        gap = (piece.float() - whole[start:end].float()).abs().max().item()
        result["pieces"].append(
            {"rows": [start, end], "equal": bool(torch.equal(piece, whole[start:end])), "max_difference": gap}
        )
    RESULTS["continued_attention"] = result
    print(result)
    scale = whole.float().abs().max().item()
    assert all(p["max_difference"] <= 2**-7 * scale for p in result["pieces"])


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
def test_layer_pieces_give_whole_layers_logits_at_35b_a3b_shapes():
    """layer_token_chunk=1024 with checkpointed decoder layers on a random batch (its long documents cut into several
    pieces) at the 35B-A3B layer shapes with LoRA: the eval logits and the training loss within bf16 rounding of whole
    layers (a cut document's attention runs the continued kernel, its delta rule from the carried fp32 state), the
    gradients within the bf16 bound. FLA's delta rule on both sides: where FlashQLA is chosen, the pieces after a
    document's first run FLA's."""
    model = with_lora(build("moe_35b_a3b_shapes_4_layers"))
    model.config.gdn_kernel = "fla"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    result = RESULTS["layer_pieces"] = against_whole(model, BASE_SEED + 58, "layer_token_chunk", 1024)
    print(result)
    assert result["longest_document"] > 1024 and result["gradients"]
    assert result["logits_mean_relative_difference"] <= 1e-2 and result["loss_relative_difference"] <= 1e-3
    assert result["worst_grad_relative_error"][1] <= 3e-2


@pytest.mark.skipif(not kernel_selection.FLA_AVAILABLE, reason="flash-linear-attention not installed")
def test_autograd_contexts_hold_no_tensor_of_a_row_per_token_at_35b_a3b_shapes():
    """The GPU kernels' autograd Functions (FLA, FlashQLA, this project's Triton kernels) with checkpointed layers,
    whole and in pieces, LoRA on the experts, a random batch: no context holds, outside its saved tensors, a tensor of
    as many elements as the batch has tokens (it would escape the checkpoint and offloading in every layer until the
    backward ended), and every adapter weight gets a gradient. The contexts are those the forward created (recorded
    as each Function is applied); which of them the walk from the loss reaches is recorded beside them."""
    model = with_lora(build("moe_35b_a3b_shapes_4_layers")).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seed = BASE_SEED + 59
    docs = draw_documents(seed, model.config.vocab_size)
    ids, cu = one_row(docs)
    found = RESULTS["autograd_contexts"] = {"seed": seed, "tokens": ids.shape[1]}  # recorded also when it fails
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    for piece in (None, 1024):
        model.config.layer_token_chunk = piece
        model.zero_grad(set_to_none=True)
        with recorded_autograd_contexts() as created:
            loss = model(ids, labels=ids, cu_seqlens=cu, use_cache=False).loss
        walked, _ = tensors_held_by_autograd_contexts(loss)
        held = tensors_held_by(created)
        names = collections.Counter(type(node).__name__ for node in created)
        found[f"layer_token_chunk={piece}"] = entry = {
            "created": dict(names),
            "reached_from_the_loss": dict(walked),
            "held_bytes": sum(t.numel() * t.element_size() for _, t in held),
            "largest": max(((p, t.numel()) for p, t in held), key=lambda pair: pair[1], default=None),
        }
        del created
        loss.backward()
        entry["adapters_without_gradient"] = [n for n, p in adapters.items() if p.grad is None or not p.grad.any()]
        # the Functions of the kernels this batch runs: the delta rule's (FLA's or FlashQLA's), the expert-row moves,
        # the projections (PEFT's fp32 adapters on the bf16 base run PEFT's own forward around them)
        assert any("GatedDelta" in name for name in names), found
        assert {"_MoveBackward", "RowInvariantProductBackward"} <= set(names), found
        assert all(t.numel() < ids.shape[1] for _, t in held), found
        assert not entry["adapters_without_gradient"], found
    print(found)
