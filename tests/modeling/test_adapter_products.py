"""PEFT's LoRA on the model's projections (modeling/adapter_products.py): a plain adapter's sum taken in place gives
PEFT's forward bit for bit and its gradients within a rounding, saves no more for the backward, keeps packed ==
per-document, and leaves everything else (several adapters, DoRA, merges, adapter_names, PEFT's fp32 adapter path)
to PEFT's own forward."""

import copy

import pytest
import torch
from conftest import packed_model, saved_storage_bytes

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from qwen35_packed.modeling import adapter_products  # noqa: E402
from qwen35_packed.modeling.adapter_products import RowInvariantLoraForward, peft_adapter_sums  # noqa: E402
from qwen35_packed.modeling.projection import RowInvariantLinear  # noqa: E402

TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
           "gate_proj", "up_proj", "down_proj"]  # fmt: skip
LENGTHS = [9, 1, 14, 2, 21]


def lora(model, **overrides):
    settings = {"r": 8, "lora_alpha": 16, "init_lora_weights": False, "target_modules": TARGETS, **overrides}
    return get_peft_model(model, LoraConfig(**settings))


def batch(vocab: int, seed: int = 3):
    ids = torch.randint(0, vocab, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(seed))
    return ids, torch.tensor([0, *LENGTHS]).cumsum(0)


class SumCounter:
    """Counts the wrappers' forwards that took the in-place sum (`adapter_sum_linear`) while installed."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = adapter_products.adapter_sum_linear

        def counting(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(adapter_products, "adapter_sum_linear", counting)


def wrappers(model) -> list:
    return [m for m in model.modules() if isinstance(m._modules.get("base_layer"), RowInvariantLinear)]


def step(model, ids, cu, autocast: bool = False):
    """Loss and every parameter gradient of one packed training forward and backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, cu_seqlens=cu, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_gradients_close(ours: dict, theirs: dict, rtol: float) -> None:
    assert set(ours) == set(theirs) and any("lora_A" in n for n in ours)
    for name, grad in ours.items():
        scale = theirs[name].float().abs().max().clamp_min(1e-30)
        assert (grad.float() - theirs[name].float()).abs().max() <= rtol * scale, name


def relative_error(grads: dict, reference: dict) -> float:
    """||grads - reference|| / ||reference|| over every gradient together."""
    error = sum(((grads[n].float() - g) ** 2).sum() for n, g in reference.items())
    return (error / sum((g**2).sum() for g in reference.values())).sqrt().item()


SETUPS = {
    # (model dtype, adapter dtype, autocast)
    "fp32": (torch.float32, torch.float32, False),
    "bf16_adapters": (torch.bfloat16, torch.bfloat16, False),
    "fp32_adapters_autocast": (torch.bfloat16, torch.float32, True),
}


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_in_place_sum_gives_pefts_loss_bitwise_and_its_gradients(kind, setup, monkeypatch):
    """Every adapted projection takes the in-place sum (counted), in fp32, with bf16 adapters on a bf16 model and
    with PEFT's default fp32 adapters under bf16 autocast (TRL's bf16=True): the loss equals PEFT's own forward
    bit for bit (scaling 2). The gradients differ by the rounding of the input gradient's in-place sum: in fp32
    they agree to 1e-4 of each gradient's largest entry; in bf16 both are as far from the fp32 gradients, within
    a tenth."""
    model_dtype, adapter_dtype, autocast = SETUPS[setup]
    wrapped = lora(packed_model(kind, tie_word_embeddings=False))
    reference = copy.deepcopy(wrapped)
    wrapped.to(model_dtype)
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    ids, cu = batch(wrapped.config.vocab_size)
    counter = SumCounter(monkeypatch)
    ours = step(wrapped, ids, cu, autocast)
    assert counter.calls == len(wrappers(wrapped)) > 0
    assert all(isinstance(m, RowInvariantLoraForward) for m in wrappers(wrapped))
    with peft_adapter_sums():
        theirs = step(wrapped, ids, cu, autocast)
        exact = step(reference, ids, cu)[1]
    assert counter.calls == len(wrappers(wrapped))  # PEFT's own forward inside the block
    assert torch.equal(ours[0], theirs[0])
    if model_dtype == torch.float32:
        assert_gradients_close(ours[1], theirs[1], 1e-4)
    else:
        assert set(ours[1]) == set(theirs[1]) == set(exact)
        assert relative_error(ours[1], exact) <= 1.1 * relative_error(theirs[1], exact)


def test_adapters_with_dropout_take_the_in_place_sum_with_pefts_masks(monkeypatch):
    """lora_dropout > 0 in training: the adapter reads dropout(x), drawn where PEFT draws it, so the same seed gives
    PEFT's loss bit for bit; the dropped input gets its own gradient."""
    wrapped = lora(packed_model("dense", tie_word_embeddings=False), lora_dropout=0.3).train()
    ids, cu = batch(wrapped.config.vocab_size)
    counter = SumCounter(monkeypatch)
    torch.manual_seed(11)
    ours = step(wrapped, ids, cu)
    assert counter.calls == len(wrappers(wrapped))
    torch.manual_seed(11)
    with peft_adapter_sums():
        theirs = step(wrapped, ids, cu)
    assert torch.equal(ours[0], theirs[0])
    assert_gradients_close(ours[1], theirs[1], 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [False, True])
def test_adapter_sum_rows_do_not_depend_on_the_row_count(dtype, dropout):
    """A row's adapted projection is the same bits in a call of any row count (the products are row-invariant, the
    sum elementwise), as the model's packed == per-document guarantee needs."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(150, 48, generator=g).to(dtype)
    weight, lora_a, lora_b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((40, 48), (8, 48), (40, 8)))
    adapter_input = x * (torch.rand(x.shape, generator=g) > 0.3).to(dtype) if dropout else None

    def rows(sl):
        return adapter_products.adapter_sum_linear(
            x[sl], None if adapter_input is None else adapter_input[sl], weight, lora_a, lora_b, 2.0, dtype
        )

    full = rows(slice(None))
    for count in (1, 3, 64, 65, 149):
        assert torch.equal(rows(slice(0, count)), full[:count])
        assert torch.equal(rows(slice(150 - count, None)), full[150 - count :])


def saved_activation_bytes(model, ids, cu) -> int:
    """Bytes autograd saves for the backward of one training forward, parameters left out."""
    return saved_storage_bytes(
        lambda: model(ids, cu_seqlens=cu, labels=ids, use_cache=False).loss.backward(), exclude=model.parameters()
    )


def test_in_place_sum_saves_no_more_than_pefts_forward():
    wrapped = lora(packed_model("dense", tie_word_embeddings=False))
    ids, cu = batch(wrapped.config.vocab_size)
    saved_activation_bytes(wrapped, ids, cu)  # the first forward also builds what later ones reuse
    ours = saved_activation_bytes(wrapped, ids, cu)
    with peft_adapter_sums():
        theirs = saved_activation_bytes(wrapped, ids, cu)
    assert ours <= theirs


def _count_with(wrapped, monkeypatch, **forward_kwargs) -> tuple[int, torch.Tensor]:
    ids, cu = batch(wrapped.config.vocab_size)
    counter = SumCounter(monkeypatch)
    with torch.no_grad():
        logits = wrapped(ids, cu_seqlens=cu, use_cache=False, **forward_kwargs).logits
    return counter.calls, logits


def test_pefts_forward_runs_what_the_in_place_sum_does_not_cover(monkeypatch):
    """Several active adapters, DoRA, merged or disabled adapters, PEFT's fp32 adapters on a bf16 model outside
    autocast (PEFT computes them in fp32): PEFT's own forward, with its numbers."""
    # several active adapters
    wrapped = lora(packed_model("dense", tie_word_embeddings=False))
    wrapped.add_adapter("second", LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS))
    wrapped.base_model.set_adapter(["default", "second"])
    calls, ours = _count_with(wrapped, monkeypatch)
    assert calls == 0
    with peft_adapter_sums():
        assert torch.equal(_count_with(wrapped, monkeypatch)[1], ours)
    # DoRA
    calls, _ = _count_with(lora(packed_model("dense", tie_word_embeddings=False), use_dora=True), monkeypatch)
    assert calls == 0
    # disabled, then merged adapters
    wrapped = lora(packed_model("dense", tie_word_embeddings=False))
    with wrapped.disable_adapter():
        assert _count_with(wrapped, monkeypatch)[0] == 0
    unmerged = _count_with(wrapped, monkeypatch)[1]
    wrapped.base_model.merge_adapter()
    calls, merged = _count_with(wrapped, monkeypatch)
    assert calls == 0 and (merged - unmerged).abs().max() <= 1e-4 * unmerged.abs().max()
    # fp32 adapters on a bf16 model, no autocast: PEFT's input cast, its fp32 adapter products
    wrapped = lora(packed_model("dense", tie_word_embeddings=False).to(torch.bfloat16))
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    assert _count_with(wrapped, monkeypatch)[0] == 0


def test_pefts_forward_says_why_once_and_not_when_asked_for(monkeypatch, caplog):
    """Where an active adapter takes PEFT's forward the reason is logged, once per process and reason; disabled
    adapters and `peft_adapter_sums()` (asked for) log nothing."""
    from qwen35_packed.modeling import utils

    monkeypatch.setattr(utils, "_logged_once", set())
    wrapped = lora(packed_model("dense", tie_word_embeddings=False).to(torch.bfloat16))
    with caplog.at_level("WARNING", logger="qwen35_packed"):
        with wrapped.disable_adapter():
            _count_with(wrapped, monkeypatch)
        with peft_adapter_sums():
            _count_with(wrapped, monkeypatch)
        assert "PEFT's own LoRA forward" not in caplog.text
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
        for _ in range(2):
            assert _count_with(wrapped, monkeypatch)[0] == 0
    said = [r.getMessage() for r in caplog.records if "PEFT's own LoRA forward" in r.getMessage()]
    assert len(said) == 1 and "float32 adapters on a bfloat16 input outside autocast" in said[0], said


@pytest.mark.parametrize("how", ["pre_hook", "hook", "accelerate", "zero3"])
def test_pefts_forward_runs_where_calling_a_product_does_more_than_its_forward(how, monkeypatch):
    """The in-place sum reads the weights without calling the products: where a call would run hooks (FSDP2's or
    DeepSpeed's gathering, a user's), Accelerate's replaced forward, or meet ZeRO-3 placeholders, that wrapper runs
    PEFT's forward, which calls them; the others keep the in-place sum."""
    wrapped = lora(packed_model("dense", tie_word_embeddings=False))
    target = wrappers(wrapped)[0]
    calls = []
    if how == "pre_hook":
        target.base_layer.register_forward_pre_hook(lambda module, args: calls.append(module))
    elif how == "hook":
        target.lora_B["default"].register_forward_hook(lambda module, args, out: calls.append(module))
    elif how == "accelerate":
        original = target.lora_A["default"].forward
        target.lora_A["default"]._hf_hook = object()
        target.lora_A["default"].forward = lambda x: calls.append(x) or original(x)
    else:
        target.base_layer.weight.ds_id = 0
    ids, cu = batch(wrapped.config.vocab_size)
    counter = SumCounter(monkeypatch)
    with torch.no_grad():
        wrapped(ids, cu_seqlens=cu, use_cache=False)
    assert counter.calls == len(wrappers(wrapped)) - 1
    assert len(calls) == (0 if how == "zero3" else 1)


def test_adopted_wrappers_merge_unload_save_and_copy_as_pefts(tmp_path):
    """After the first forward adopted them: merge_and_unload gives back the model's own projections with the
    adapted outputs, the saved adapter has PEFT's keys, a deep copy (TRL's reference model) computes the same."""
    wrapped = lora(packed_model("dense", tie_word_embeddings=False))
    ids, cu = batch(wrapped.config.vocab_size)
    with torch.no_grad():
        adapted = wrapped(ids, cu_seqlens=cu, use_cache=False).logits
        copied = copy.deepcopy(wrapped)(ids, cu_seqlens=cu, use_cache=False).logits
    assert torch.equal(copied, adapted)
    wrapped.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert keys and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys)
    merged = wrapped.merge_and_unload()
    assert not any(isinstance(m, RowInvariantLoraForward) for m in merged.modules())
    with torch.no_grad():
        out = merged(ids, cu_seqlens=cu, use_cache=False).logits
    assert (out - adapted).abs().max() <= 1e-4 * adapted.abs().max()


def _default_adapters_step(model, ids, cu, cast: bool):
    """One autocast bf16 training step of PEFT's default (fp32) adapters on a bf16 model through PEFT's own
    forward: the wrapped model, the loss, the gradients, and whether PEFT copied an adapted projection's input to
    fp32; `cast` forces PEFT's input cast on."""
    wrapped = lora(model)
    with torch.no_grad():
        wrapped(ids[:, :2], use_cache=False)  # the first forward adopts the adapters
    layers = wrappers(wrapped)
    copies = []
    for layer in layers:
        if cast:
            layer.cast_input_dtype_enabled = True
        original = layer._cast_input_dtype

        def spying(x, dtype, original=original):
            out = original(x, dtype)
            copies.append(out is not x)
            return out

        layer._cast_input_dtype = spying
    with peft_adapter_sums():
        loss, grads = step(wrapped, ids, cu, autocast=True)
    return wrapped, loss, grads, any(copies)


def test_default_adapters_under_autocast_skip_pefts_input_cast_and_change_no_bit():
    """PEFT's default adapters (fp32 weights) on a bf16 model under bf16 autocast, through PEFT's own forward (what
    runs where the in-place sum does not): the adapted projections' inputs are not copied to fp32 (PEFT casts them
    outside autocast only), and loss and every gradient equal those with PEFT's cast bit for bit. The adapters stay
    fp32, get fp32 gradients, and an optimizer step moves them."""
    ids, cu = batch(128)
    runs = {}
    for cast in (False, True):
        torch.manual_seed(0)
        runs[cast] = _default_adapters_step(packed_model("dense").to(torch.bfloat16), ids, cu, cast)
    wrapped, loss, grads, copied = runs[False]
    assert not copied and runs[True][3]  # the spy sees the cast when it is forced on
    assert torch.equal(loss, runs[True][1])
    assert set(grads) == set(runs[True][2]) and all(torch.equal(grads[n], runs[True][2][n]) for n in grads)
    adapters = {n: p for n, p in wrapped.named_parameters() if "lora_" in n}
    assert adapters and all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in adapters.values())
    before = {n: p.detach().clone() for n, p in adapters.items()}
    torch.optim.AdamW(adapters.values(), lr=1e-3).step()
    assert all(not torch.equal(p, before[n]) for n, p in adapters.items())
    # outside autocast PEFT's cast stays: the adapters' products run in fp32 as PEFT computes them
    assert bool(wrappers(wrapped)[0].cast_input_dtype_enabled)


def test_adapters_injected_again_after_unload_are_adopted_too(monkeypatch):
    """`unload()` and a new `get_peft_model` (a benchmark's next setup, a user's next experiment) inject new wrappers
    under the same adapter name: they too get row-invariant products and the in-place sum, as the first ones did."""
    model = packed_model("dense", tie_word_embeddings=False)
    ids, cu = batch(model.config.vocab_size)
    for _ in range(2):
        wrapped = lora(model)
        counter = SumCounter(monkeypatch)
        with torch.no_grad():
            wrapped(ids, cu_seqlens=cu, use_cache=False)
        layers = wrappers(wrapped)
        assert layers and all(isinstance(m, RowInvariantLoraForward) for m in layers)
        assert all(type(p) is RowInvariantLinear for m in layers for p in (*m.lora_A.values(), *m.lora_B.values()))
        assert counter.calls == len(layers)
        model = wrapped.unload()
