"""Reward modelling with TRL 1.16's RewardTrainer on a converted folder: `AutoModelForSequenceClassification` with
trust_remote_code builds this project's head from the folder's auto_map (the score head newly initialised and
reported, the backbone from the causal-LM checkpoint), the trainer's loss on its padded chosen / rejected batch is
the loss of the built-in head on the same weights (dense) or of each sequence scored alone (MoE), training moves
the score head, and the saved reward model reloads with the same scores (ours, and dense the built-in head)."""

import logging

import pytest
import torch

# The training stack is not in the matrix environments of the core suite (scripts/test-matrix.sh).
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

import transformers  # noqa: E402

from qwen35_packed.tiny import build_tiny_folder  # noqa: E402

# Chosen / rejected pairs of different lengths, so the collator pads (right) every batch.
PAIRS = {
    "chosen": ["a helpful and complete answer", "yes", "the sum of 2 and 3 is 5", "ok, done"],
    "rejected": ["no", "I will not say", "2 + 3 = 7", "?"],
}
STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    return {kind: build_tiny_folder(root / kind, kind) for kind in ("dense", "moe")}


def _reference_loss(kind, folder, model, inputs) -> float:
    """The RewardTrainer's loss (-logsigmoid(chosen - rejected), mean) from rewards computed without our packing:
    the built-in head with the same weights (dense), or each sequence scored alone, unpadded (MoE: transformers has
    no built-in MoE head)."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad():
        if kind == "dense":
            ref = transformers.Qwen3_5TextForSequenceClassification.from_pretrained(folder, num_labels=1)
            ref.load_state_dict(model.state_dict())
            ref.config.pad_token_id = model.config.pad_token_id
            rewards = ref.eval()(ids, attention_mask=mask, use_cache=False).logits.squeeze(-1)
        else:
            rewards = torch.cat(
                [model(row[m.bool()][None], use_cache=False).logits.squeeze(-1) for row, m in zip(ids, mask)]
            )
    chosen, rejected = rewards.chunk(2)
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean().item()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reward_trainer_trains_our_head_with_the_reference_loss(kind, folders, tmp_path, caplog):
    folder = folders[kind]
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=len(PAIRS["chosen"]),
        max_steps=STEPS,
        learning_rate=0.1,
        optim="sgd",
        use_cpu=True,
        bf16=False,  # fp32 throughout (TRL's default is bf16 autocast), for the comparison with the reference loss
        report_to=[],
        save_strategy="no",
        seed=0,
        trust_remote_code=True,
        model_init_kwargs={"dtype": torch.float32},
    )
    with caplog.at_level(logging.WARNING):
        trainer = trl.RewardTrainer(model=str(folder), args=args, train_dataset=datasets.Dataset.from_dict(PAIRS))
    expected_class = (
        "Qwen3_5MoePackedForSequenceClassification" if kind == "moe" else "Qwen3_5PackedForSequenceClassification"
    )
    assert type(trainer.model).__name__ == expected_class
    # this project's one line (transformers' own load report lists the head as MISSING besides)
    assert [r.getMessage() for r in caplog.records if "newly initialised" in r.getMessage()] == [
        f"{expected_class}: score.weight not in {folder}, newly initialised (a new task head; train it before use)"
    ]
    initial_head = trainer.model.score.weight.detach().clone()
    losses, reference, compute_loss = [], [], trainer.compute_loss

    def recording(model, inputs, *rest, **kwargs):
        if not reference:
            assert bool((inputs["attention_mask"] == 0).any())  # the batch is padded
            reference.append(_reference_loss(kind, folder, model, inputs))
        loss = compute_loss(model, inputs, *rest, **kwargs)
        losses.append(loss.item())
        return loss

    trainer.compute_loss = recording
    trainer.train()
    assert len(losses) == STEPS
    assert abs(losses[0] - reference[0]) <= 1e-5
    assert losses[-1] < losses[0]  # the same batch every step: SGD lowers its loss
    assert not torch.equal(trainer.model.score.weight.detach(), initial_head)

    # The trained reward model's folder: ours again through its auto_map, and (dense) transformers' built-in head
    # without trust_remote_code, with the trained scores.
    trainer.save_model(str(tmp_path / "reward"))
    trained = trainer.model.eval()
    ids = torch.tensor([[5, 9, 14, 3, 1], [7, 22, 1, 0, 0]])
    mask = (torch.arange(5) < torch.tensor([[5], [3]])).long()
    loaders = [
        lambda path: transformers.AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True)
    ]
    if kind == "dense":
        loaders.append(transformers.AutoModelForSequenceClassification.from_pretrained)
    with torch.no_grad():
        expected = trained(ids, attention_mask=mask, use_cache=False).logits
        for load, name in zip(loaders, (expected_class, "Qwen3_5TextForSequenceClassification")):
            reloaded = load(tmp_path / "reward").eval()
            assert type(reloaded).__name__ == name
            assert reloaded.config.num_labels == 1 and reloaded.config.pad_token_id == trained.config.pad_token_id
            got = reloaded(ids, attention_mask=mask, use_cache=False).logits
            assert (got - expected).abs().max().item() <= 1e-5, type(reloaded).__name__
