"""Row-invariant projections (modeling/projection.py): every projection of the model, and every low-rank product
PEFT's LoRA adds around one, runs through the row-invariant product, whose result for a row does not depend on how
many rows share the call; the GPU forms are checked at the real shapes in tests/gpu/test_gpu_real_shapes.py."""

import threading

import pytest
import torch
from conftest import packed_model
from torch.utils._python_dispatch import TorchDispatchMode

from qwen35_packed.modeling import projection
from qwen35_packed.modeling.projection import RowInvariantLinear, RowInvariantProduct, row_block_product

MATMULS = ("mm", "addmm", "bmm", "matmul", "baddbmm")


class WeightProducts(TorchDispatchMode):
    """Records, for every matrix product whose operand is one of `weights` (by storage), the row count of the other
    operand: the row-invariant product on CPU multiplies fixed blocks of CPU_ROW_BLOCK rows, a plain F.linear the
    caller's row count."""

    def __init__(self, weights: dict):
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr(): name for name, w in weights.items()}
        self.rows: dict[str, set[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in MATMULS:
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
            for i, operand in enumerate(operands):
                name = self.storages.get(operand.untyped_storage().data_ptr())
                if name is not None:
                    other = operands[1 - i] if len(operands) == 2 else operands[-2]
                    self.rows.setdefault(name, set()).add(other.shape[0])
        return func(*args, **(kwargs or {}))


def two_dimensional_weights(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n}


def lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj",
                        "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    return get_peft_model(model, config)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
def test_every_projection_runs_the_row_invariant_product(kind, adapters):
    """A packed forward with labels (the chunked loss's head product too): each 2-D weight of the model, PEFT's
    lora_A / lora_B included, is multiplied in blocks of CPU_ROW_BLOCK rows only. A projection left a plain
    nn.Linear multiplies the 173 real rows at once and fails here."""
    model = packed_model(kind, tie_word_embeddings=False)
    if adapters:
        model = lora(model)
    lengths = [64, 1, 37, 3, 68]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)))
    cu = torch.tensor([0, *lengths]).cumsum(0)
    weights = two_dimensional_weights(model)
    assert any("lora_A" in n for n in weights) == adapters
    with torch.no_grad(), WeightProducts(weights) as seen:
        model(ids, cu_seqlens=cu, labels=ids, use_cache=False)
    assert set(seen.rows) == set(weights), sorted(set(weights) - set(seen.rows))
    assert all(rows == {projection.CPU_ROW_BLOCK} for rows in seen.rows.values()), seen.rows
    adapter_products = [m for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    assert all(type(m) is RowInvariantLinear for m in adapter_products) and len(adapter_products) == 2 * len(
        [n for n in weights if "lora_A" in n]
    )


@pytest.mark.parametrize("rows", [1, 3, 64, 65, 200])
def test_row_block_product_rows_do_not_depend_on_the_row_count(rows):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(200, 96, generator=g), torch.randn(40, 96, generator=g)
    full = row_block_product(x, weight, rows=64)
    assert torch.equal(row_block_product(x[:rows], weight, rows=64), full[:rows])
    assert torch.equal(row_block_product(x[200 - rows :], weight, rows=64), full[200 - rows :])
    assert (full - x @ weight.t()).abs().max() <= 1e-4


def test_row_invariant_linear_under_autocast_returns_the_autocast_dtype():
    layer = RowInvariantLinear(32, 16, bias=True)
    x = torch.randn(5, 7, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert out.dtype == reference.dtype == torch.bfloat16 and out.shape == (5, 7, 16)
    assert (out.float() - reference.float()).abs().max() <= 2e-2 * reference.float().abs().max()


def test_row_invariant_linear_gradients_equal_nn_linear():
    torch.manual_seed(0)
    layer, plain = RowInvariantLinear(24, 12, bias=True), torch.nn.Linear(24, 12, bias=True)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(70, 24, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    grad = torch.randn(70, 12)
    layer(x).backward(grad)
    plain(x_plain).backward(grad)
    for ours, theirs in ((x.grad, x_plain.grad), (layer.weight.grad, plain.weight.grad), (layer.bias.grad, plain.bias.grad)):  # fmt: skip
        assert (ours - theirs).abs().max() <= 1e-5


def test_row_invariant_linear_backward_under_autocast_runs_in_the_autocast_dtype():
    """Under autocast the backward's GEMMs run in the autocast dtype, as autograd through an autocast F.linear runs
    them: the same gradients, bit for bit (a backward kept in fp32 differs)."""
    torch.manual_seed(1)
    layer = RowInvariantLinear(32, 16, bias=False)
    x = torch.randn(40, 32, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    grad = torch.randn(40, 16).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, plain = layer(x), torch.nn.functional.linear(x_plain, layer.weight)
    out.backward(grad)
    ours = (x.grad.clone(), layer.weight.grad.clone())
    layer.weight.grad = None
    plain.backward(grad)
    assert torch.equal(ours[0], x_plain.grad) and torch.equal(ours[1], layer.weight.grad)


def test_plain_products_turns_the_blocks_off_for_its_block_only():
    x, weight = torch.randn(10, 8), torch.randn(4, 8)
    with WeightProducts({"w": weight}) as seen, projection.plain_products():
        RowInvariantProduct.apply(x, weight, torch.float32)
    assert seen.rows == {"w": {10}}
    with WeightProducts({"w": weight}) as seen:
        RowInvariantProduct.apply(x, weight, torch.float32)
    assert seen.rows == {"w": {projection.CPU_ROW_BLOCK}}


def test_plain_products_hold_in_their_own_thread_only():
    x, weight = torch.randn(10, 8), torch.randn(4, 8)
    entered, done, rows = threading.Event(), threading.Event(), {}

    def plain_elsewhere():
        with projection.plain_products():
            entered.set()
            done.wait(timeout=60)

    other = threading.Thread(target=plain_elsewhere)
    other.start()
    entered.wait(timeout=60)
    with WeightProducts({"w": weight}) as seen:  # while the other thread is inside its block
        RowInvariantProduct.apply(x, weight, torch.float32)
        rows.update(seen.rows)
    done.set()
    other.join()
    assert rows == {"w": {projection.CPU_ROW_BLOCK}}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_generation_steps_run_plain_products_and_everything_else_the_invariant_ones(kind):
    """A cached step with one new token in each of 3 rows, without autograd (what generate() runs): every projection
    multiplies the 3 rows at once (projection.plain_products). The prefill before it, a step of two new tokens per
    row, and the one-token step with autograd recording run the fixed blocks."""
    model = packed_model(kind, tie_word_embeddings=False)
    weights = {n: w for n, w in two_dimensional_weights(model).items() if "lm_head" not in n}
    ids = torch.randint(3, model.config.vocab_size, (3, 9))

    def step_rows(columns: int, grad: bool) -> dict:
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        new = torch.randint(3, model.config.vocab_size, (3, columns))
        with torch.set_grad_enabled(grad), WeightProducts(weights) as seen:
            model(new, past_key_values=cache, use_cache=True)
        return seen.rows

    with torch.no_grad(), WeightProducts(weights) as prefill:
        model(ids, use_cache=True)
    assert set(prefill.rows) == set(weights)
    assert all(rows == {projection.CPU_ROW_BLOCK} for rows in prefill.rows.values()), prefill.rows
    decode = step_rows(1, grad=False)
    assert set(decode) == set(weights) and all(rows == {3} for rows in decode.values()), decode
    for columns, grad in ((2, False), (1, True)):
        seen = step_rows(columns, grad)
        assert all(rows == {projection.CPU_ROW_BLOCK} for rows in seen.values()), (columns, grad, seen)
