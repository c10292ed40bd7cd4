"""Worker for tests/gpu/test_gpu_context_parallel.py: 2 processes on one GPU (torchrun, gloo: NCCL refuses two ranks
on one device), the 35B-A3B layer shapes (first 4 of 40 layers; vocab cut to 32,768), random weights, bf16. One
packed row of 8,192 tokens whose 4,500-token document straddles the shard boundary, run with context parallelism
over the two processes (4,096 tokens each) and unsharded, with the GPU kernels `auto` picks (FLA's delta rule), all
runs replaying one routing (rank 0's, of the unsharded bf16 row). The control, on rank 0: the unsharded bf16 run against the same weights in fp32 through the PyTorch kernels (bf16
rounding). Rank 0 writes the report: the largest logit difference, the loss difference, and per parameter group the
relative (norm-wise) gradient difference, sharded (summed over the ranks) vs unsharded and for the control."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_moe import layer_shapes  # noqa: E402
from bench_train_step import default_dtype  # noqa: E402
from fixtures_distributed import start_gloo_worker  # noqa: E402
from fixtures_gpu import move_norms_off_init  # noqa: E402

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM  # noqa: E402
from qwen35_packed.modeling import kernel_selection  # noqa: E402

LENGTHS = [1_500, 4_500, 1, 2_191]  # 8,192 tokens; the boundary at 4,096 cuts the 4,500-token document
VOCAB = 32_768
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


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, num_items_in_batch=sum(LENGTHS))
    out.loss.backward()
    return out.loss.detach().float(), out.logits.detach()


def progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} rank {dist.get_rank()}: {message}", flush=True)


def to_rank0(tensor: torch.Tensor, rank: int) -> torch.Tensor | None:
    """Rank 1's tensor on rank 0 (gloo point to point, through host memory: gloo sends no CUDA tensors; None on
    rank 1)."""
    if rank == 1:
        dist.send(tensor.detach().cpu().contiguous(), dst=0)
        return None
    received = torch.empty(tensor.shape, dtype=tensor.dtype)
    dist.recv(received, src=1)
    return received.to(tensor.device)


def main():
    args, rank, world = start_gloo_worker()
    assert world == 2
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    config = Qwen3_5MoePackedConfig(**layer_shapes(4, VOCAB, tiny=False), return_logits_with_loss=True)
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = Qwen3_5MoePackedForCausalLM(config)
    move_norms_off_init(model)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=gen).cuda()
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    half = ids.shape[1] // 2
    piece = slice(rank * half, (rank + 1) * half)
    choice = kernel_selection.select_kernels(model.config, ids.device, torch.bfloat16)
    report = {"documents": LENGTHS, "shard_tokens": half, "vocab": VOCAB, "kernels": str(choice)}

    # Every run replays rank 0's routing of the row (routing replay): at these shapes bf16 rounding flips near-tie
    # routing choices, which would move the logits by far more than the arithmetic compared here.
    with torch.no_grad():
        router_logits = model(ids, cu_seqlens=cu, output_router_logits=True).router_logits
    routed = torch.stack([layer.topk(config.num_experts_per_tok, dim=-1).indices for layer in router_logits], dim=1)
    routed = routed.cpu()[None]  # [1, tokens, MoE layers, top-k]
    dist.broadcast(routed, src=0)
    routed = routed.to(ids.device)

    progress("sharded step")
    model.set_context_parallel(dist.group.WORLD)
    loss, logits = step(
        model,
        {"input_ids": ids[:, piece], "labels": ids[:, piece], "cu_seqlens": cu, "routed_experts": routed[:, piece]},
    )
    model.set_context_parallel(None)
    other_logits = to_rank0(logits[0], rank)
    other_loss = to_rank0(loss.reshape(1), rank)
    grads = {}
    for n, p in model.named_parameters():
        other = to_rank0(p.grad, rank)
        if rank == 0:
            grads[n] = p.grad.float() + other.float()
    progress("sharded step done")
    if rank == 0:
        sharded_logits = torch.cat([logits[0], other_logits])
        sharded_loss = (loss + other_loss).item()
        progress("unsharded step, bf16")
        full_loss, full_logits = step(
            model, {"input_ids": ids, "labels": ids, "cu_seqlens": cu, "routed_experts": routed}
        )
        reference = {n: p.grad.float() for n, p in model.named_parameters()}
        report["sharded_vs_unsharded"] = {
            "max_abs_logit_diff": (sharded_logits.float() - full_logits[0].float()).abs().max().item(),
            "loss_diff": abs(sharded_loss - full_loss.item()),
            "grad_relative_diff": grad_gaps(grads, reference),
        }
        del grads
        progress("unsharded step, fp32, PyTorch kernels (the control)")
        model.float()
        model.config.gdn_kernel, model.config.attention_kernel = "torch", "sdpa"
        fp32_loss, fp32_logits = step(
            model, {"input_ids": ids, "labels": ids, "cu_seqlens": cu, "routed_experts": routed}
        )
        report["control_bf16_vs_fp32"] = {
            "max_abs_logit_diff": (full_logits[0].float() - fp32_logits[0]).abs().max().item(),
            "loss_diff": abs(full_loss.item() - fp32_loss.item()),
            "grad_relative_diff": grad_gaps(reference, {n: p.grad.float() for n, p in model.named_parameters()}),
        }
        report["loss"] = fp32_loss.item()
        report["logit_abs_max"] = fp32_logits.abs().max().item()
        report["peak_gib_rank0"] = torch.cuda.max_memory_allocated() / 2**30
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        progress("done")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
