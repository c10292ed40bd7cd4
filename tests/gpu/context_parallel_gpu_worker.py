"""Worker for tests/gpu/test_gpu_context_parallel.py: 2 processes on one GPU (torchrun, gloo: NCCL refuses two ranks
on one device), the 35B-A3B layer shapes (first 4 of 40 layers, vocab cut to 32,768 to fit two processes in fp32),
random weights. One packed row of 16,384 tokens whose middle document straddles the shard boundary, run unsharded
and with context parallelism over the two processes (each holding 8,192 tokens), in fp32 and then in bf16 (the
same weights rounded), with the kernels `auto` picks on the GPU (FLA's delta rule, its conv for the unsharded row).
Rank 0 writes the report: per dtype the largest logit difference, the loss difference, and per parameter group the
relative (norm-wise) gradient difference between the sharded (summed over ranks) and unsharded runs; for
bf16 also the control, the unsharded bf16 run against the unsharded fp32 run."""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_moe import layer_shapes  # noqa: E402
from bench_train_step import default_dtype  # noqa: E402

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM  # noqa: E402
from qwen35_packed.modeling import kernel_selection  # noqa: E402

LENGTHS = [3_000, 9_000, 1, 4_383]  # 16,384 tokens; the boundary at 8,192 cuts the 9,000-token document
GROUPS = (
    ("embed_tokens", "embed_tokens"),
    ("lm_head", "lm_head"),
    ("router", "mlp.gate."),
    ("experts", "mlp.experts"),
    ("shared_expert", "shared_expert"),
    ("gdn", "linear_attn"),
    ("attention", "self_attn"),
    ("norms", "norm"),
)


def group_of(name: str) -> str:
    return next(group for group, fragment in GROUPS if fragment in name)


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, num_items_in_batch=sum(LENGTHS))
    out.loss.backward()
    return out.loss.detach().float(), out.logits.detach().float()


def grad_gaps(grads: dict, reference: dict) -> dict:
    """Per parameter group, |grads - reference| / |reference| over the group's parameters together (one group's
    near-zero gradients, such as A_log's, do not dominate)."""
    squares = {}
    for name, grad in grads.items():
        error, norm = squares.get(group_of(name), (0.0, 0.0))
        squares[group_of(name)] = (
            error + (grad - reference[name]).double().pow(2).sum().item(),
            norm + reference[name].double().pow(2).sum().item(),
        )
    return {group: (error / max(norm, 1e-300)) ** 0.5 for group, (error, norm) in squares.items()}


def compare(model, ids, cu, rank, world, fp32_run=None) -> tuple[dict, dict]:
    """The sharded run against the unsharded one in the model's dtype -> (report, the unsharded logits and
    gradients). `fp32_run`: the unsharded fp32 run's, against which the report also measures this unsharded run
    (the control: bf16 rounding)."""
    model.set_context_parallel(None)
    full_loss, full_logits = step(model, {"input_ids": ids, "labels": ids, "cu_seqlens": cu})
    reference = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    half = ids.shape[1] // world
    piece = slice(rank * half, (rank + 1) * half)
    model.set_context_parallel(dist.group.WORLD)
    loss, logits = step(model, {"input_ids": ids[:, piece], "labels": ids[:, piece], "cu_seqlens": cu})
    model.set_context_parallel(None)
    logit_gap = (logits[0] - full_logits[0, piece]).abs().max().reshape(1)
    dist.all_reduce(logit_gap, op=dist.ReduceOp.MAX)
    loss = loss.reshape(1)
    dist.all_reduce(loss)
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = p.grad.float()
        dist.all_reduce(grads[n])
    report = {
        "max_abs_logit_diff": logit_gap.item(),
        "logit_abs_max": full_logits.abs().max().item(),
        "loss_diff": abs(loss.item() - full_loss.item()),
        "loss": full_loss.item(),
        "grad_relative_diff": grad_gaps(grads, reference),
    }
    del grads
    if fp32_run is not None:
        report["control_unsharded_vs_fp32"] = {
            "max_abs_logit_diff": (full_logits - fp32_run["logits"]).abs().max().item(),
            "grad_relative_diff": grad_gaps(reference, fp32_run["grads"]),
        }
    return report, {"logits": full_logits, "grads": reference}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    with default_dtype(torch.float32), torch.device("cuda"):
        model = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**layer_shapes(4, 32_768, tiny=False), return_logits_with_loss=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32_768, (1, sum(LENGTHS)), generator=gen).cuda()
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    report = {"documents": LENGTHS, "shard_tokens": sum(LENGTHS) // world, "world": world}
    fp32_run = None
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        choice = kernel_selection.select_kernels(model.config, ids.device, dtype)
        result, run = compare(model, ids, cu, rank, world, fp32_run)
        report[str(dtype).removeprefix("torch.")] = {"kernels": str(choice), **result}
        fp32_run = run
        torch.cuda.empty_cache()
    report["peak_gib_per_process"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
