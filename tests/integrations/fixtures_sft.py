"""TRL SFT runs shared by the SFT tests (test_trl_sft.py, test_context_parallel_trainer.py and its torchrun worker
sft_context_parallel_worker.py). trl is imported where the arguments are built, so that importing this module does
not need it (each test module skips on its own)."""

from pathlib import Path

import torch

# Four documents of 1 to 30 tokens: each rank's batch holds two, the group's row all four.
TEXTS_CP = ["hello world, count to ten: 1 2 3", "abc", "say something nice about packing", "?"]


def sgd_sft_config(out_dir, **fields):
    """TRL's SFT arguments for SGD steps on the CPU (learning rate 0.1, seed 0) writing under OUT_DIR/run, nothing
    saved or reported, plus `fields`."""
    import trl

    return trl.SFTConfig(
        output_dir=str(Path(out_dir) / "run"),
        learning_rate=0.1,
        optim="sgd",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=0,
        **fields,
    )


def sft_context_parallel_config(out_dir, **fields):
    """One SGD step, fp32 on the CPU, padding-free, nothing saved or reported."""
    return sgd_sft_config(
        out_dir,
        max_steps=1,
        padding_free=True,
        max_length=None,
        model_init_kwargs={"trust_remote_code": True, "dtype": torch.float32},
        **fields,
    )
