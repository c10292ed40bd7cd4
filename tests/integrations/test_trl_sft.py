"""SFT with TRL 1.16's SFTTrainer on packed Qwen3.5: `padding_free=True` and `packing=True` (both send
`position_ids`, `cu_seq_lens_q/k` and `seq_idx`, no attention mask) train with the padded run's losses, dense, MoE
and LoRA (experts included), and learn (the loss falls every step, every LoRA B moves); transformers'
DataCollatorWithFlattening batches give the padded batch's loss."""

import pytest
import torch

# The training stack is not in the matrix environments of the core suite (scripts/test-matrix.sh).
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from fixtures_sft import sgd_sft_config  # noqa: E402

from qwen35_packed.tiny import build_char_tokenizer, build_tiny_folder  # noqa: E402

# Lengths from 1 to 33 tokens: 1-token documents, documents shorter than the conv kernel, and longer ones.
TEXTS = [
    "hello world, count to ten: 1 2 3",
    "abc",
    "say something nice about packing",
    "a b c d e f g",
    "x" * 20,
    "12345",
    "?",
]
LORA_TARGETS = ["in_proj_qkv", "out_proj", "q_proj", "o_proj", "down_proj"]
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    return {kind: build_tiny_folder(root / kind, kind) for kind in ("dense", "moe")}


def _sft_config(tmp_path, **fields):
    """The SFT arguments every test here trains with (SGD on the CPU, fp32, nothing saved or reported), plus
    `fields`."""
    fields.setdefault("model_init_kwargs", {"trust_remote_code": True, "dtype": torch.float32})
    return sgd_sft_config(tmp_path, **fields)


def _sft_losses(folder, tmp_path, peft_config=None, batch_size=len(TEXTS), checkpointed=None, **config):
    """The loss of each of STEPS SGD steps over the whole dataset (one batch per step, so every run sees the same
    documents in each step, however the collator lays them out), the first batch's keys, and the LoRA B tensors
    still all zeros (as they start) after training. `checkpointed`: whether every decoder layer is checkpointed, or
    none (checked where given; SFTConfig's default is on)."""
    args = _sft_config(
        tmp_path, per_device_train_batch_size=batch_size, max_steps=STEPS, dataloader_drop_last=False, **config
    )
    trainer = trl.SFTTrainer(
        model=str(folder), args=args, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}), peft_config=peft_config
    )
    losses, batches, compute_loss = [], [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        batches.append(sorted(inputs))
        loss = compute_loss(model, inputs, *args, **kwargs)
        losses.append(loss.item())
        return loss

    trainer.compute_loss = recording
    trainer.train()
    flags = {m.gradient_checkpointing for m in trainer.model.modules() if hasattr(m, "recomputed_segment")}
    assert checkpointed is None or flags == {checkpointed}, flags
    lora_b = {n: p for n, p in trainer.model.named_parameters() if "lora_B" in n}
    assert bool(lora_b) == (peft_config is not None)
    return losses, batches[0], sorted(n for n, p in lora_b.items() if not p.detach().any())


@pytest.mark.parametrize("kind", ["dense", "moe", "dense-lora", "moe-lora"])
def test_padding_free_and_packing_train_with_the_padded_losses(kind, folders, tmp_path):
    folder = folders[kind.split("-")[0]]
    lora = None
    if "lora" in kind:
        lora = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            target_parameters=EXPERT_TARGETS if kind == "moe-lora" else None,
        )
    padded, padded_keys, padded_unmoved = _sft_losses(folder, tmp_path, lora)
    padding_free, free_keys, free_unmoved = _sft_losses(folder, tmp_path, lora, padding_free=True, max_length=None)
    # max_length above the dataset's token count: best-fit-decreasing packs every document into one row
    packing, packing_keys, packing_unmoved = _sft_losses(
        folder, tmp_path, lora, batch_size=1, packing=True, max_length=256
    )
    assert "attention_mask" in padded_keys and "seq_idx" not in padded_keys
    for keys in (free_keys, packing_keys):
        assert {"position_ids", "seq_idx", "cu_seq_lens_q"} <= set(keys) and "attention_mask" not in keys
    # The same documents every step: each run learns them, step after step.
    for losses in (padded, padding_free, packing):
        assert len(losses) == STEPS and all(b < a for a, b in zip(losses, losses[1:])), losses
    # The second step's loss follows the first step's gradients: equal losses there mean equal updates. (Later
    # steps compound the fp32 rounding differences of the layouts: MoE measured 1.5e-5 relative at the third.)
    for losses in (padding_free, packing):
        assert losses[:2] == pytest.approx(padded[:2], rel=1e-5, abs=0)
    # every LoRA B (zero at the start) moved: each adapted module took part, one by one
    assert padded_unmoved == free_unmoved == packing_unmoved == [], (padded_unmoved, free_unmoved, packing_unmoved)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_trls_selective_checkpointing_trains_with_the_losses_of_no_checkpointing(kind, folders, tmp_path):
    """TRL 1.16's `gradient_checkpointing_kwargs={"selective": True}`: the decoder layers checkpointed under its
    policy (attention kept, the rest recomputed), on packed rows, train as without checkpointing, step for step."""
    packed = dict(batch_size=1, packing=True, max_length=256)
    plain, _, _ = _sft_losses(folders[kind], tmp_path, **packed, gradient_checkpointing=False, checkpointed=False)
    selective, _, _ = _sft_losses(
        folders[kind],
        tmp_path,
        **packed,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"selective": True},
        checkpointed=True,
    )
    assert selective == plain


def test_flattening_collator_batch_gives_the_padded_loss(folders):
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

    model = AutoModelForCausalLM.from_pretrained(folders["dense"], trust_remote_code=True, dtype=torch.float32)
    tokenizer = build_char_tokenizer()
    features = [{"input_ids": tokenizer(text)["input_ids"]} for text in TEXTS]
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    assert "seq_idx" in flat
    padded = tokenizer.pad(features, return_tensors="pt")
    labels = padded["input_ids"].masked_fill(padded["attention_mask"] == 0, -100)
    with torch.no_grad():
        expected = model(**padded, labels=labels).loss
        got = model(**flat).loss
        # seq_idx that merges two documents contradicts the other boundaries
        flat["seq_idx"][0, : flat["cu_seq_lens_q"][2]] = 0
        with pytest.raises(ValueError, match="seq_idx contradicts"):
            model(**flat)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_sft_reads_no_logits_and_logs_the_full_logits_metrics(tmp_path):
    """TRL 1.16's SFTTrainer runs the backbone and its own chunked log-prob kernel (docs/training.md, "What
    trainers read"): whatever return_logits_with_loss says, the logged loss, entropy and mean_token_accuracy are
    the same and equal those computed from the model's full logits of the same batch and weights, and no tensor
    with the vocabulary as its last dimension and at least (label tokens x vocab) elements outlives a forward."""
    import gc
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = 131  # no other dimension of the tiny model
    # a peaked LM head: a random tiny model's near-uniform predictions would make accuracy and entropy say little
    folder = build_tiny_folder(tmp_path / "model", "dense", lm_head_std=1.0, vocab_size=vocab)

    class Track(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.produced = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == vocab and t.numel() >= self.numel:
                    self.produced.append(weakref.ref(t))
            return out

    logged, expected, outlived = {}, [], {}
    for setting in (True, "auto"):
        args = _sft_config(
            tmp_path,
            per_device_train_batch_size=len(TEXTS),
            max_steps=2,
            logging_steps=1,
            model_init_kwargs={"trust_remote_code": True, "dtype": torch.float32, "return_logits_with_loss": setting},
        )
        trainer = trl.SFTTrainer(
            model=str(folder), args=args, train_dataset=datasets.Dataset.from_dict({"text": TEXTS})
        )
        assert trainer.model.config.return_logits_with_loss == setting
        compute_loss, produced, alive = trainer.compute_loss, [], []

        def recording(model, inputs, *rest, **kwargs):
            labels = inputs["labels"][:, 1:]
            mask = labels != -100
            if setting is True:  # the metrics from the full logits, before this step's update
                with torch.no_grad():
                    plain = {k: v for k, v in inputs.items() if k != "labels"}
                    logits = model(**plain, use_cache=False).logits[:, :-1][mask]
                log_probs = logits.log_softmax(-1)
                expected.append(
                    {
                        "entropy": -(log_probs.exp() * log_probs).sum(-1).mean().item(),
                        "mean_token_accuracy": (logits.argmax(-1) == labels[mask]).float().mean().item(),
                    }
                )
            with Track(int(mask.sum()) * vocab) as track:
                loss = compute_loss(model, inputs, *rest, **kwargs)
            gc.collect()
            produced.append(len(track.produced))
            alive.append(sum(ref() is not None for ref in track.produced))
            return loss

        trainer.compute_loss = recording
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "entropy" in entry]
        logged[setting] = [e[key] for e in logs for key in ("loss", "entropy", "mean_token_accuracy")]
        assert len(logs) == 2 and all(produced), produced  # the vocabulary tiles existed during each forward
        outlived[setting] = alive
    assert outlived == {True: [0, 0], "auto": [0, 0]}
    assert logged[True] == pytest.approx(logged["auto"], rel=1e-5, abs=1e-6)
    for (_, entropy, accuracy), full in zip(zip(*[iter(logged["auto"])] * 3), expected):
        assert entropy == pytest.approx(full["entropy"], rel=1e-5, abs=1e-6)
        assert accuracy == pytest.approx(full["mean_token_accuracy"], rel=1e-5, abs=1e-6)
