"""Measure what PackedGRPOTrainer saves in GRPO's per-token log-prob step on a long-tail batch (CPU).

Builds a small packed model with a Qwen-sized vocabulary (so the LM head weighs what it does in real models), then
runs `_get_per_token_logps_and_entropies` (forward + backward), as GRPO does for its loss, with TRL's stock
GRPOTrainer and with PackedGRPOTrainer on the same weights and the same batch: left-padded prompts, right-padded
completions, one long completion and many short ones. Prints the LM-head rows and FLOPs each projects, the times,
and the largest differences of log-probs, entropies and gradients (expected: 0).

    python examples/grpo_lm_head_padding.py [--vocab 151936] [--hidden 256] [--repeats 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def long_tail_batch(generator, prompt_lengths, completion_lengths, vocab_low=3, vocab_high=90):
    """input_ids / attention_mask as GRPO builds them: prompts left-padded, completions right-padded."""
    batch, p, c = len(prompt_lengths), max(prompt_lengths), max(completion_lengths)
    ids = torch.randint(vocab_low, vocab_high, (batch, p + c), generator=generator)
    mask = torch.zeros(batch, p + c, dtype=torch.long)
    for i, (pl, cl) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[i, p - pl : p + cl] = 1
    return ids.masked_fill(mask == 0, 0), mask, c


def make_trainer(cls, path, data, out):
    import datasets
    from trl import GRPOConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo_rewards import distinct_characters

    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_cpu=True,
        report_to=[],
        beta=0.0,
        trust_remote_code=True,
    )
    dataset = datasets.load_dataset("json", data_files=str(Path(data) / "train.jsonl"))["train"]
    return cls(model=str(path), reward_funcs=distinct_characters, args=args, train_dataset=dataset)


def logprob_step(trainer, ids, mask, completion_len):
    trainer.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, mask, completion_len, compute_entropy=True
    )
    (logps * mask[:, -completion_len:]).sum().backward()
    elapsed = time.perf_counter() - start
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return elapsed, logps.detach(), entropies.detach(), grads


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from trl import GRPOTrainer

    from qwen35_packed.integrations.grpo import PackedGRPOTrainer
    from qwen35_packed.tiny import build_tiny_folder, write_prompt_dataset

    torch.manual_seed(0)
    prompt_lengths = [64, 40, 23, 16, 57, 31, 48, 20]
    completion_lengths = [512, 37, 16, 64, 21, 96, 18, 45]
    ids, mask, completion_len = long_tail_batch(torch.Generator().manual_seed(0), prompt_lengths, completion_lengths)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_folder(
            Path(tmp) / "model",
            "dense",
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
        )
        data = write_prompt_dataset(Path(tmp) / "data")
        stock = make_trainer(GRPOTrainer, path, data, Path(tmp) / "o1")
        ours = make_trainer(PackedGRPOTrainer, path, data, Path(tmp) / "o2")
        ours.model.load_state_dict(stock.model.state_dict())
        times = {"stock": [], "ours": []}
        for _ in range(args.repeats):
            for name, trainer in (("stock", stock), ("ours", ours)):
                elapsed, logps, entropies, grads = logprob_step(trainer, ids, mask, completion_len)
                times[name].append(elapsed)
                if name == "stock":
                    reference = (logps, entropies, grads)
        diff = {
            "logps": (reference[0] - logps).abs().max().item(),
            "entropies": (reference[1] - entropies).abs().max().item(),
            "grads": max((reference[2][n] - grads[n]).abs().max().item() for n in grads),
        }

    batch, seq = ids.shape
    stock_rows = batch * (seq - 1)  # TRL without Triton: every position of the padded batch but the last
    our_rows = sum(completion_lengths)  # scored positions: one per real completion token
    flops_per_row = 2 * args.hidden * args.vocab
    result = {
        "batch": {
            "rows": batch,
            "seq_len": seq,
            "real_tokens": int(mask.sum()),
            "completion_tokens": our_rows,
            "prompt_lengths": prompt_lengths,
            "completion_lengths": completion_lengths,
        },
        "model": {"hidden": args.hidden, "vocab": args.vocab, "layers": 4},
        "lm_head_rows": {"stock": stock_rows, "ours": our_rows},
        "lm_head_forward_gflop": {"stock": stock_rows * flops_per_row / 1e9, "ours": our_rows * flops_per_row / 1e9},
        "step_seconds_fwd_bwd": {k: min(v) for k, v in times.items()},
        "max_abs_diff": diff,
        "torch_threads": torch.get_num_threads(),
    }
    result["speedup"] = result["step_seconds_fwd_bwd"]["stock"] / result["step_seconds_fwd_bwd"]["ours"]
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
