"""Chunked linear cross-entropy: equal to plain cross-entropy on full logits and to the previous per-chunk
formulation (F.cross_entropy + softmax gradient), compiled equal to eager, kept logits in the caller's layout, and
`return_logits_with_loss=False` changing nothing but the returned logits; the targets of packed documents (written
out: none crosses a document end) and the model's loss over them divided by `num_items_in_batch`."""

import re
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import packed_model, tiny_kwargs

from qwen35_packed.modeling import causal_lm_head, kernels
from qwen35_packed.modeling.kernel_selection import KernelChoice
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.loss import (
    LogitsNotKept,
    LogitsNotKeptError,
    chunk_cross_entropy,
    chunked_linear_cross_entropy,
    default_chunk_tokens,
)
from qwen35_packed.modeling.projection import RowInvariantLinear, row_invariant_product

# On CUDA, elementwise="triton" sends the chunk math (no kernel of its own) through torch.compile; forced here on
# CPU, where inductor's C++ backend compiles it.
# the chunk math as a kernel set with the fused elementwise kernels binds it: through torch.compile
COMPILED = kernel_set(KernelChoice(gdn="torch", attention="sdpa", elementwise="triton")).loss_chunk


def _previous_chunk_math(logits, targets):
    """The formulation the chunk math replaced: F.cross_entropy's log_softmax for the loss, a second softmax for
    the gradient, onehot subtracted on target rows, ignored rows zeroed, cast to the logits' dtype."""
    logits32 = logits.float()
    total = F.cross_entropy(logits32, targets, ignore_index=-100, reduction="sum")
    grad = logits32.softmax(dim=-1)
    valid = targets != -100
    rows = torch.nonzero(valid).flatten()
    grad[rows, targets[rows]] -= 1.0
    grad[~valid] = 0.0
    return total, grad.to(logits.dtype)


def _previous_chunked_loss(hidden, weight, targets, chunk_tokens):
    """(loss, d loss/d hidden, d loss/d weight) of the previous chunked loop, token-weighted."""
    grad_hidden = torch.zeros_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32)
    total = torch.zeros(())
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        chunk_total, grad_logits = _previous_chunk_math(h @ weight.t(), targets[start : start + chunk_tokens])
        total += chunk_total
        grad_hidden[start : start + chunk_tokens] = grad_logits @ weight
        grad_weight += (grad_logits.t() @ h).float()
    denominator = (targets != -100).sum().clamp(min=1).float()
    scale = 1.0 / denominator  # as the backward scales them (d loss = 1)
    return total / denominator, grad_hidden * scale.to(hidden.dtype), (grad_weight * scale).to(weight.dtype)


def _inputs(dtype, n=50, hidden_size=16, vocab=40, seed=0):
    """Random hidden / weight / targets with scattered ignored targets and an all-ignored block of rows 16:24
    (one whole chunk at chunk_tokens=8)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, hidden_size, generator=gen) * 2).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::7] = -100
    targets[16:24] = -100
    return hidden, weight, targets


def _run(hidden, weight, targets, **kwargs):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, logits = chunked_linear_cross_entropy(hidden, weight, targets, **kwargs)
    loss.backward()
    return loss.detach(), logits, hidden.grad, weight.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("num_items", [None, 7])
def test_chunked_matches_full_logits(num_items):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=gen, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (50,), generator=gen)
    targets[::7] = -100
    loss, logits = chunked_linear_cross_entropy(hidden, weight, targets, num_items, chunk_tokens=8)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    full = hidden @ weight.t()
    denominator = num_items if num_items is not None else (targets != -100).sum()
    expected = F.cross_entropy(full, targets, ignore_index=-100, reduction="sum") / denominator
    expected.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(logits, full.detach(), atol=1e-6) and not logits.requires_grad
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6)
    assert torch.allclose(grads[1], weight.grad, atol=1e-6)


@pytest.mark.parametrize(
    "vocab, element_size, tokens",
    [(248_320, 2, 1024), (151_936, 2, 1536), (65_536, 2, 4096), (248_320, 4, 512), (32, 2, 4096), (10**7, 2, 256)],
)
def test_default_chunk_is_sized_by_the_bytes_of_its_logits(vocab, element_size, tokens):
    """The 35B-A3B's vocab gets chunks whose [chunk x vocab] tensors stay within the byte budget; a small vocab
    keeps the largest chunk, a huge one the smallest step."""
    assert default_chunk_tokens(vocab, element_size) == tokens


def test_a_chunks_logits_and_gradient_are_freed_before_the_next_chunks_logits(monkeypatch):
    """At most one chunk's [chunk x vocab] tensors are alive when the next chunk's logits are allocated: the
    previous chunk's logits and gradient are gone by the time its product runs (a loop that only rebinds the names
    keeps three such tensors at that moment)."""
    from qwen35_packed.modeling import loss as loss_module

    alive = []
    previous = []

    def recording_product(h, weight):
        alive.append(sum(ref() is not None for ref in previous))
        logits = row_invariant_product(h, weight)
        previous.append(weakref.ref(logits))
        return logits

    def recording_chunk_loss(logits, targets, with_grad):
        loss, grad = chunk_cross_entropy(logits, targets, with_grad)
        previous.append(weakref.ref(grad))
        return loss, grad

    monkeypatch.setattr(loss_module, "row_invariant_product", recording_product)
    hidden = torch.randn(40, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    loss, _ = chunked_linear_cross_entropy(
        hidden, weight, torch.randint(0, 30, (40,)), chunk_tokens=8, keep_logits=False, chunk_loss=recording_chunk_loss
    )
    loss.backward()
    assert alive == [0] * 5


def test_no_gradient_work_without_grad():
    hidden, weight = torch.randn(10, 4), torch.randn(6, 4, requires_grad=True)
    with torch.no_grad():
        loss, _ = chunked_linear_cross_entropy(hidden, weight, torch.randint(0, 6, (10,)))
    assert not loss.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_math_equals_previous_formulation(dtype):
    """One chunk: one log_softmax vs log_softmax + softmax. The per-row losses are the same log_softmax but are
    summed in another order (nll_loss vs where + sum), and exp(log_softmax) rounds differently from softmax's
    exp(x - max) / sum, so: loss and gradient to fp32 rounding (bf16: at most one bf16 step apart after the cast)."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(13, 40, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 40, (13,), generator=gen)
    targets[[0, 5, 6]] = -100
    total, grad = chunk_cross_entropy(logits, targets, True)
    ref_total, ref_grad = _previous_chunk_math(logits, targets)
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert abs(total.item() - ref_total.item()) <= 1e-6 * abs(ref_total.item())
    assert torch.equal(grad[targets == -100], torch.zeros_like(grad[targets == -100]))
    step = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert ((grad.float() - ref_grad.float()).abs() <= step * ref_grad.float().abs() + 1e-7).all()
    loss_only, no_grad = chunk_cross_entropy(logits, targets, False)
    assert no_grad is None and torch.equal(loss_only, total)  # the same ops up to the loss


def test_all_ignored_chunk_and_batch_give_zero():
    logits = torch.randn(5, 9)
    targets = torch.full((5,), -100)
    total, grad = chunk_cross_entropy(logits, targets, True)
    assert total.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    loss, _, grad_hidden, grad_weight = _run(torch.randn(5, 4), torch.randn(9, 4), targets, chunk_tokens=2)
    assert loss.item() == 0.0 and not grad_hidden.any() and not grad_weight.any()


def test_bad_target_raises():
    """A target that is neither in [0, V) nor ignore_index fails like F.cross_entropy, it is never clamped."""
    for chunk_math in (chunk_cross_entropy, kernels.compiled_chain(chunk_cross_entropy)):
        for bad in (-1, 9):
            targets = torch.tensor([1, bad, -100])
            with pytest.raises((RuntimeError, IndexError)):
                chunk_math(torch.randn(3, 9), targets, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [8, 7, 64])
def test_chunked_loss_equals_previous_formulation(dtype, chunk_tokens):
    """The whole loop against the previous one: chunk sizes dividing N or not (50 = 7 x 7 + 1) or exceeding it, an
    all-ignored chunk. The logits matmuls are the same; the chunk math rounds differently in fp32 (see above), so
    fp32 agrees to ~1e-6 and bf16 to the bf16 rounding of the logits' gradient that the matmuls then sum."""
    hidden, weight, targets = _inputs(dtype)
    loss, logits, grad_hidden, grad_weight = _run(hidden, weight, targets, chunk_tokens=chunk_tokens)
    ref_loss, ref_grad_hidden, ref_grad_weight = _previous_chunked_loss(hidden, weight, targets, chunk_tokens)
    tol = 1e-6 if dtype == torch.float32 else 2**-8  # bf16: one rounding step of the logits' gradient
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    assert _rel(grad_hidden, ref_grad_hidden) <= tol and _rel(grad_weight, ref_grad_weight) <= tol
    assert grad_hidden.dtype == dtype and grad_weight.dtype == dtype
    # Rows whose target is ignored get no gradient at all.
    assert not grad_hidden[targets == -100].any()
    # The kept logits are the same per-chunk row-invariant products, bit for bit.
    expected = torch.cat([row_invariant_product(h, weight) for h in hidden.split(chunk_tokens)])
    assert torch.equal(logits, expected) and logits.dtype == dtype


def test_logits_written_into_the_callers_layout():
    """With logits_index the kept logits land in their rows of a zero-filled [rows, V] tensor: the same values as
    the [N, V] logits scattered there, and no other result changes."""
    hidden, weight, targets = _inputs(torch.float32, n=20)
    rows = torch.tensor([1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22])
    plain = _run(hidden, weight, targets, chunk_tokens=6)
    placed = _run(hidden, weight, targets, chunk_tokens=6, logits_index=rows, logits_rows=24)
    expected = torch.zeros(24, weight.shape[0]).index_copy(0, rows, plain[1])
    assert torch.equal(placed[1], expected)
    assert all(torch.equal(a, b) for a, b in zip(plain[::2] + plain[3:], placed[::2] + placed[3:]))
    with pytest.raises(ValueError, match="logits_rows"):
        chunked_linear_cross_entropy(hidden, weight, targets, logits_index=rows)


def test_keep_logits_false_changes_nothing_else():
    hidden, weight, targets = _inputs(torch.bfloat16)
    kept = _run(hidden, weight, targets, chunk_tokens=8)
    dropped = _run(hidden, weight, targets, chunk_tokens=8, keep_logits=False)
    assert dropped[1] is None
    # Same matmuls (into the kept buffer or not) and the same chunk math: identical.
    assert torch.equal(kept[0], dropped[0]) and torch.equal(kept[2], dropped[2]) and torch.equal(kept[3], dropped[3])


def test_autocast_keeps_logits_in_the_autocast_dtype():
    """Under autocast the projection is a bf16 matmul of fp32 inputs (an out= matmul would bypass autocast): the
    kept logits are those bf16 logits and the loss equals the fp32 cross-entropy of them."""
    hidden, weight, targets = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, logits, grad_hidden, grad_weight = _run(hidden, weight, targets, chunk_tokens=8)
        expected_logits = torch.cat([h @ weight.t() for h in hidden.split(8)])
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected_logits)
    reference = F.cross_entropy(expected_logits.float(), targets, ignore_index=-100)
    assert abs(loss.item() - reference.item()) <= 1e-6 * reference.item()
    assert grad_hidden.dtype == torch.float32 and grad_weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_math_equals_eager(dtype):
    """The chunk math through torch.compile (inductor's C++ backend on CPU) against eager. The kept logits come from
    the same matmul outside the compiled graph (bit-identical); the fused reductions sum in another order, so loss
    and gradients agree to fp32 rounding (bf16: to the rounding of the logits' gradient)."""
    hidden, weight, targets = _inputs(dtype)
    eager = _run(hidden, weight, targets, chunk_tokens=7)
    compiled = _run(hidden, weight, targets, chunk_tokens=7, chunk_loss=COMPILED)
    assert torch.equal(compiled[1], eager[1])
    assert abs(compiled[0].item() - eager[0].item()) <= 1e-6 * eager[0].item()
    tol = 1e-6 if dtype == torch.float32 else 2**-8  # bf16: one rounding step of the logits' gradient
    assert _rel(compiled[2], eager[2]) <= tol and _rel(compiled[3], eager[3]) <= tol
    assert not compiled[2][targets == -100].any()


def test_models_kernel_choice_reaches_the_loss(monkeypatch):
    """The chunk math is the kernel set's the model bound for its device and dtype (on CUDA the compiled one; here
    the eager chunk_cross_entropy), never a default."""
    seen = []
    chunked = causal_lm_head.chunked_linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("chunk_loss"))
        return chunked(*args, **kwargs)

    monkeypatch.setattr(causal_lm_head, "chunked_linear_cross_entropy", spy)
    model = packed_model("dense")
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        model(ids, labels=ids)
    bound = model.model.kernels_for(ids.device, torch.float32).loss_chunk
    assert seen == [bound] and bound is chunk_cross_entropy


def _model_loss_and_grads(model, **inputs):
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _labelled_inputs(layout: str, vocab: int = 128) -> dict:
    gen = torch.Generator().manual_seed(3)
    if layout == "packed":
        ids = torch.randint(0, vocab, (1, 30), generator=gen)
        return dict(input_ids=ids, labels=ids, cu_seqlens=torch.tensor([0, 11, 12, 30], dtype=torch.int32))
    ids = torch.randint(0, vocab, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    return dict(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_return_logits_with_loss_settings(layout):
    """Training mode: "auto" (the default) and False return the LogitsNotKept placeholder, True the logits, with the
    loss and every gradient identical (torch.equal: the same computation, only the logits are not kept); the kept
    logits equal the model's logits without labels. Eval mode: "auto" keeps them."""
    model = packed_model("dense").train()
    inputs = _labelled_inputs(layout)
    assert model.config.return_logits_with_loss == "auto"
    runs = {}
    for setting in (True, "auto", False):
        model.config.return_logits_with_loss = setting
        runs[setting] = _model_loss_and_grads(model, **inputs)
    kept, kept_grads = runs[True]
    assert isinstance(kept.logits, torch.Tensor)
    for setting in ("auto", False):
        dropped, dropped_grads = runs[setting]
        assert isinstance(dropped.logits, LogitsNotKept)
        assert torch.equal(kept.loss, dropped.loss)
        assert kept_grads.keys() == dropped_grads.keys() and all(
            torch.equal(kept_grads[n], dropped_grads[n]) for n in kept_grads
        )
    model.eval()
    model.config.return_logits_with_loss = "auto"
    with torch.no_grad():
        evaluated = model(**inputs)
        no_labels = {k: v for k, v in inputs.items() if k != "labels"}
        plain = model(**no_labels, use_cache=False).logits
    assert torch.equal(evaluated.loss, kept.loss) and torch.equal(evaluated.logits, kept.logits)
    assert kept.logits.shape == plain.shape and torch.allclose(kept.logits, plain, atol=1e-5)
    if layout == "padded":
        assert not kept.logits[inputs["attention_mask"] == 0].any()  # pad positions are zeros


@pytest.mark.parametrize("setting", ["auto", False])
def test_logits_not_kept_fail_loudly(setting):
    """The placeholder takes the logits' place (attribute, key, tuple position: to_tuple() keeps the positions of
    a forward that kept them) and every use raises LogitsNotKeptError naming the setting and the switch; attribute
    probes (Accelerate's fp32 conversion of outputs) see an object without the attribute."""
    model = packed_model("dense").train()
    inputs = _labelled_inputs("packed")
    model.config.return_logits_with_loss = True
    kept_tuple = model(**inputs, return_dict=False)
    model.config.return_logits_with_loss = setting
    out = model(**inputs)
    dropped_tuple = model(**inputs, return_dict=False)
    assert out["logits"] is out.logits and isinstance(dropped_tuple[1], LogitsNotKept)
    assert len(dropped_tuple) == len(kept_tuple) and torch.equal(dropped_tuple[0], kept_tuple[0])
    said = "return_logits_with_loss='auto'" if setting == "auto" else "return_logits_with_loss=False"
    uses = (
        lambda logits: logits.shape,
        lambda logits: logits[:, -1],
        lambda logits: logits.float(),
        lambda logits: torch.softmax(logits, -1),
        lambda logits: torch.cat([logits]),
        lambda logits: logits / 2.0,
        lambda logits: len(logits),
    )
    for use in uses:
        with pytest.raises(LogitsNotKeptError, match=f"not kept: it had labels and {re.escape(said)}.*= True"):
            use(out.logits)
    assert not hasattr(out.logits, "dtype")
    assert "LogitsNotKept" in repr(out)


def test_no_logits_sized_tensor_outlives_a_training_forward():
    """Every tensor the forward produces with the vocabulary as its last dimension and at least tokens x vocab
    elements is tracked: in training mode with "auto" none is alive once the forward has returned (the loss saves
    no such tensor for the backward either); with True the kept logits are."""
    import gc
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = 131  # no other dimension of the tiny model
    model = packed_model("dense", vocab_size=vocab).train()
    inputs = _labelled_inputs("packed", vocab)
    logits_numel = inputs["input_ids"].numel() * vocab

    def logits_sized(t):
        return isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == vocab and t.numel() >= logits_numel

    class Track(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.produced = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if logits_sized(t):
                    self.produced.append(weakref.ref(t))
            return out

    alive = {}
    for setting in (True, "auto"):
        model.config.return_logits_with_loss = setting
        saved_sizes = []

        def pack(t):
            saved_sizes.append(logits_sized(t))
            return t

        with Track() as track, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**inputs)
        gc.collect()
        assert track.produced and saved_sizes  # the chunk's logits existed during the forward; autograd saved
        assert not any(saved_sizes)
        alive[setting] = sum(ref() is not None for ref in track.produced)
        out.loss.backward()
        del out
    assert alive[True] > 0 and alive["auto"] == 0  # kept: the logits (and the buffer they view)


def test_return_logits_with_loss_is_validated_and_saved(tmp_path):
    from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5PackedConfig

    assert Qwen3_5PackedConfig(**tiny_kwargs("dense")).return_logits_with_loss == "auto"
    assert Qwen3_5MoePackedConfig(**tiny_kwargs("moe")).return_logits_with_loss == "auto"
    for setting in (True, False):
        config = Qwen3_5PackedConfig(**tiny_kwargs("dense"), return_logits_with_loss=setting)
        config.save_pretrained(tmp_path)
        assert Qwen3_5PackedConfig.from_pretrained(tmp_path).return_logits_with_loss is setting
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match="return_logits_with_loss"):
            Qwen3_5PackedConfig(return_logits_with_loss=bad)


def test_vision_language_model_shares_the_loss_path():
    """The composite classes use the same lm_head_outputs: return_logits_with_loss on the text config decides
    there too ("auto": not kept in training mode), with the identical loss."""
    from vl_tiny import packed_vl_model

    model = packed_vl_model("dense")
    ids = torch.randint(0, 100, (1, 16))
    kept = model.eval()(input_ids=ids, labels=ids)
    dropped = model.train()(input_ids=ids, labels=ids)
    model.config.text_config.return_logits_with_loss = True
    forced = model(input_ids=ids, labels=ids)
    assert kept.logits.shape == (1, 16, model.config.text_config.vocab_size)
    assert isinstance(dropped.logits, LogitsNotKept) and torch.equal(forced.logits, kept.logits)
    assert torch.equal(kept.loss, dropped.loss) and torch.equal(kept.loss, forced.loss)


def test_trainer_reads_the_loss_in_training_and_the_logits_in_evaluation(tmp_path):
    """transformers' Trainer: its training steps read only the loss (the forwards with labels keep no logits under
    "auto"), its evaluation hands `compute_metrics` the logits, equal to the model's own, and reports the loss; with
    False the evaluation that needs the logits fails naming the placeholder, and a loss-only evaluation runs."""
    pytest.importorskip("accelerate")
    import transformers

    model = packed_model("dense")
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    ]
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append((module.training, type(out.logits))))
    received = []

    def compute_metrics(prediction):
        received.append(torch.as_tensor(prediction.predictions))
        return {}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        learning_rate=0.1,
        optim="sgd",
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, compute_metrics=compute_metrics
    )
    trainer.train()
    assert seen == [(True, LogitsNotKept)] * 2
    seen.clear()
    assert trainer.evaluate()["eval_loss"] > 0  # the labels reach the evaluation (Trainer's label_names)
    assert seen == [(False, torch.Tensor)]
    with torch.no_grad():
        expected = model(torch.stack([d["input_ids"] for d in data])).logits
    assert len(received) == 1 and torch.allclose(received[0], expected, atol=1e-6)
    model.config.return_logits_with_loss = False
    with pytest.raises(TypeError, match="LogitsNotKept"):  # Accelerate's gathering refuses the placeholder
        trainer.evaluate()
    args.prediction_loss_only = True
    assert "eval_loss" in trainer.evaluate()


def test_backward_allocates_nothing_of_logits_size():
    """The kept logits get no gradient. Autograd would otherwise pass the backward a zero-filled tensor of their
    size (tokens x vocab) at the start of the backward. Every op the backward runs is recorded; none may produce
    a tensor with as many elements as the logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel())
            return out

    gen = torch.Generator().manual_seed(0)
    tokens, vocab, hidden_size = 64, 512, 8
    hidden = torch.randn(tokens, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
    loss, logits = chunked_linear_cross_entropy(
        hidden, weight, torch.randint(0, vocab, (tokens,), generator=gen), chunk_tokens=16
    )
    assert logits.numel() == tokens * vocab
    with LargestOutput():
        loss.backward()
    assert 0 < LargestOutput.largest < tokens * vocab // 4  # the largest is the lm_head weight gradient
    assert hidden.grad is not None and weight.grad is not None


# ------------------------------------------------------------------------------------------ targets on the stream

# Three documents of 3, 1 and 4 tokens in one row (token values = 10 + their index, so a target names its token).
# Token t predicts token t+1 of its own document; each document's last token, the 1-token document included, has
# no target: none predicts the next document's first token.
PACKED_IDS = torch.arange(10, 18)[None]
PACKED_CU = torch.tensor([0, 3, 4, 8])
PACKED_TARGETS = [11, 12, -100, -100, 15, 16, 17, -100]


def _packed_stream(**packing):
    from qwen35_packed.modeling.packing import build_packed_sequence

    return build_packed_sequence(tuple(PACKED_IDS.shape), torch.device("cpu"), **packing)


@pytest.mark.parametrize(
    "packing",
    [
        dict(cu_seqlens=PACKED_CU),
        dict(position_ids=torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])),
        dict(seq_idx=torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2]])),
    ],
    ids=["cu_seqlens", "position_ids", "seq_idx"],
)
def test_targets_never_cross_a_document_end(packing):
    """The targets of the packed stream from `labels` (shifted within documents) and from `shift_labels` (used as
    given, with -100 at document ends), written out."""
    from qwen35_packed.modeling.packing import loss_targets

    packed = _packed_stream(**packing)
    assert loss_targets(packed, labels=PACKED_IDS).tolist() == PACKED_TARGETS
    shift_labels = torch.tensor([PACKED_TARGETS])
    assert loss_targets(packed, shift_labels=shift_labels).tolist() == PACKED_TARGETS
    for end in (2, 3):  # the last token of the first document, and the 1-token document
        crossing = shift_labels.clone()
        crossing[0, end] = 10 + end + 1  # the first token of the next document
        with pytest.raises(ValueError, match=f"real token {end}, the last of its document"):
            loss_targets(packed, shift_labels=crossing)
    # The stream's last token may keep a target (a row can be one chunk of a longer sequence).
    continued = shift_labels.clone()
    continued[0, -1] = 3
    assert loss_targets(packed, shift_labels=continued).tolist() == PACKED_TARGETS[:-1] + [3]


class _WrappedHead(torch.nn.Linear):
    """An lm_head that is not a plain nn.Linear (as an adapter makes it): the model's unchunked loss path."""


def _model_with_head(head: str):
    model = packed_model("dense")
    if head == "wrapped":
        plain = model.lm_head
        model.lm_head = _WrappedHead(plain.in_features, plain.out_features, bias=False)
        model.lm_head.weight = plain.weight
    return model


@pytest.mark.parametrize("head", ["plain", "wrapped"])
@pytest.mark.parametrize("num_items_in_batch", [None, 13, torch.tensor(13)], ids=["none", "13", "tensor-13"])
def test_model_loss_is_the_cross_entropy_of_the_written_targets(head, num_items_in_batch):
    """The model's loss on a packed row equals the cross-entropy of its own logits against the targets written out
    above, summed and divided by `num_items_in_batch` (gradient accumulation: the target count of all micro-batches,
    here 13) or, without it, by the 5 targets of the row. Both heads: the chunked loss of a plain lm_head and the
    plain cross-entropy of a wrapped one."""
    model = _model_with_head(head)
    kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    with torch.no_grad():
        out = model(PACKED_IDS, labels=PACKED_IDS, cu_seqlens=PACKED_CU, **kwargs)
    assert (head == "plain") == (type(model.lm_head) is RowInvariantLinear)
    total = F.cross_entropy(out.logits[0], torch.tensor(PACKED_TARGETS), ignore_index=-100, reduction="sum")
    denominator = 5 if num_items_in_batch is None else 13
    torch.testing.assert_close(out.loss, total / denominator, rtol=1e-6, atol=0)
    # The same logits scored with one shift across the row (what a missing document end would do) differ.
    crossing = F.cross_entropy(out.logits[0, :-1], PACKED_IDS[0, 1:], reduction="sum") / denominator
    assert abs(crossing.item() - out.loss.item()) > 1e-2


@pytest.mark.parametrize("head", ["plain", "wrapped"])
def test_padded_batch_loss_uses_num_items_in_batch(head):
    """A padded batch (left and right padding, a row of two documents by restarting position_ids): the loss is the
    written-out targets' cross-entropy over `num_items_in_batch`, and the gradient scales with 1 / it."""
    model = _model_with_head(head).train()
    model.config.return_logits_with_loss = True  # the logits of the training forward are read
    ids = torch.tensor([[0, 0, 20, 21, 22, 23], [30, 31, 32, 40, 41, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    positions = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 0, 1, 0]])
    targets = torch.tensor([[-100, -100, 21, 22, 23, -100], [31, 32, -100, 41, -100, -100]])
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for n in (6, 24):
        model.zero_grad()
        out = model(ids, attention_mask=mask, position_ids=positions, labels=labels, num_items_in_batch=n)
        out.loss.backward()
        total = F.cross_entropy(out.logits.detach().reshape(-1, 128), targets.reshape(-1), reduction="sum")
        torch.testing.assert_close(out.loss.detach(), total / n, rtol=1e-6, atol=0)
        grads[n] = model.lm_head.weight.grad.clone()
    torch.testing.assert_close(grads[6], 4 * grads[24], rtol=1e-5, atol=1e-7)
