"""TRL GRPO runs shared by the GRPO tests (test_trl_grpo.py, test_grpo_routing_replay.py, test_vllm.py): tiny
folders and a prompt dataset, a trainer of either class on them, the command-line flags of a short CPU run, and a
padded GRPO batch. trl and datasets are imported where a trainer is built, so that importing this module needs
neither (each test module skips on its own)."""

import sys
from pathlib import Path

import pytest
import torch

from qwen35_packed.tiny import build_tiny_folder, write_prompt_dataset

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# two GRPO steps of 4 prompts x 4 completions of 8 tokens on the CPU, logged every step, nothing saved
GRPO_CPU_STEPS = [
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "4",
    "--num_generations",
    "4",
    "--max_completion_length",
    "8",
    "--use_cpu",
    "true",
    "--report_to",
    "none",
    "--logging_steps",
    "1",
    "--save_strategy",
    "no",
    "--seed",
    "0",
]


def grpo_run_args(model, data, out) -> list[str]:
    """The flags of a GRPO run (the `trl grpo` CLI, examples/grpo.py) of `model` on the prompt dataset `data`,
    rewarded by examples/grpo_rewards.py's letter_fraction, writing to `out`."""
    return [
        "--model_name_or_path",
        str(model),
        "--trust_remote_code",
        "true",
        "--reward_funcs",
        "grpo_rewards.letter_fraction",
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    return {
        "dense": build_tiny_folder(root / "dense", "dense"),
        "moe": build_tiny_folder(root / "moe", "moe"),
        "data": write_prompt_dataset(root / "data"),
    }


def _trainer(cls, folders, kind, tmp_path, trainer_kwargs=None, **config):
    import datasets
    import trl

    sys.path.insert(0, str(EXAMPLES))
    from grpo_rewards import letter_fraction

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_cpu=True,
        report_to=[],
        **{"beta": 0.04, "trust_remote_code": True, **config},
    )
    dataset = datasets.load_dataset("json", data_files=str(folders["data"] / "train.jsonl"))["train"]
    return cls(
        model=str(folders[kind]),
        reward_funcs=letter_fraction,
        args=args,
        train_dataset=dataset,
        **(trainer_kwargs or {}),
    )


def _long_tail_batch():
    """Left-padded prompts + right-padded completions, as GRPO builds them; one long completion."""
    prompt_lengths, completion_lengths = [12, 5, 8, 3, 12, 7], [40, 4, 2, 9, 1, 17]
    p, c = max(prompt_lengths), max(completion_lengths)
    ids = torch.randint(3, 90, (len(prompt_lengths), p + c), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    for i, (pl, cl) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[i, p - pl : p + cl] = 1
    return ids.masked_fill(mask == 0, 0), mask, c, sum(completion_lengths)
