"""Worker for tests/integrations/test_fsdp2.py, run under torchrun on CPU (gloo): one packed training step of a tiny model
with FSDP2 (bf16 compute, fp32 master weights and reduction; GDN decay units from shard_gdn_decay_fp32, then the
decoder layers and the root, as Accelerate's FSDP2 config does), or the same step unsharded in bf16 (--single).
--moe: the tiny MoE model; --meta: every rank builds the model on the meta device, shards it, materialises its
shards with to_empty() and receives rank 0's weights (broadcast_from_rank0), as Accelerate's
cpu_ram_efficient_loading does. Writes a JSON report (global loss, gradient norm, forward dtypes, logits of a probe
and of a saved full state dict) and every parameter's full gradient to OUT.grads.pt."""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import tiny_kwargs  # noqa: E402

from qwen35_packed import (  # noqa: E402
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.integrations.fsdp2 import gated_deltanet_modules, shard_gdn_decay_fp32  # noqa: E402
from qwen35_packed.modeling.decode_graph import graph_refusal  # noqa: E402

LENGTHS = [37, 5, 64, 19, 80, 33, 1, 50]


def build(lora: bool, moe: bool = False, meta: bool = False):
    """The tiny model with its test weights; on the meta device (no storage, random init skipped) with `meta`."""
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return build(lora, moe)
    if moe:
        model = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**tiny_kwargs("moe")))
    else:
        model = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**tiny_kwargs("dense")))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    if lora:
        from peft import get_peft_model

        from qwen35_packed.integrations.lora import lora_config

        config = lora_config(model, r=4, lora_dropout=0.0, targets=("gdn", "attention", "mlp"))
        model = get_peft_model(model, config)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05)
    return model


def documents():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def row(docs):
    cu = torch.tensor([0] + torch.tensor([len(d) for d in docs]).cumsum(0).tolist(), dtype=torch.int32)
    return torch.cat(docs)[None], cu


def watch_dtypes(model):
    seen = {}
    gdn = next(m for _, m in gated_deltanet_modules(model))
    gdn.register_forward_pre_hook(lambda m, a: seen.setdefault("A_log", str(m.A_log.dtype)) and None)
    gdn.register_forward_pre_hook(lambda m, a: seen.setdefault("dt_bias", str(m.dt_bias.dtype)) and None)
    proj = gdn.in_proj_qkv
    proj.register_forward_pre_hook(
        lambda m, a: seen.setdefault("in_proj_qkv", str(getattr(m, "base_layer", m).weight.dtype)) and None
    )
    return seen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--plain", action="store_true", help="FSDP2 without shard_gdn_decay_fp32")
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--meta", action="store_true", help="build on meta, load rank 0's weights")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    docs = documents()
    n_tokens = sum(len(d) - 1 for d in docs)
    probe = docs[2][None]
    if args.single:
        model = build(args.lora, args.moe)
        model = model.to(torch.bfloat16)
        seen = watch_dtypes(model)
        ids, cu = row(docs)
        loss = model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=n_tokens).loss
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        torch.save(grads, f"{args.out}.grads.pt")
        report = {
            "loss": loss.item(),
            "grad_norm": torch.stack([g.norm() for g in grads.values()]).norm().item(),
            "forward_dtypes": seen,
        }
        with torch.no_grad():
            report["probe_logits"] = model.eval()(probe).logits.float().flatten().tolist()
        args.out.write_text(json.dumps(report))
        return

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    model = build(args.lora, args.moe, meta=args.meta)
    # rank 0's weights: in a real run read from the checkpoint on rank 0 alone
    source = build(args.lora, args.moe).state_dict() if (args.meta and rank == 0) else None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = 0 if args.plain else shard_gdn_decay_fp32(model, policy, mesh=mesh)
    for layer in (m for m in model.modules() if type(m).__name__ == "Qwen3_5PackedDecoderLayer"):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    meta_report = {}
    if args.meta:
        model.to_empty(device="cpu")
        set_model_state_dict(
            model,
            source if rank == 0 else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        meta_report["meta_left"] = sum(p.device.type == "meta" for p in model.parameters())
    seen = watch_dtypes(model)
    ids, cu = row(docs[rank::world])
    loss = model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=n_tokens / world).loss
    loss.backward()
    grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters() if p.grad is not None}
    norm_sq = sum(g.pow(2).sum() for g in grads.values())
    total = loss.detach().clone()
    dist.all_reduce(total)

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        probe_logits = model.eval()(probe).logits.float()
    if rank == 0:
        torch.save(grads, f"{args.out}.grads.pt")
        fresh = build(args.lora, args.moe)
        fresh.load_state_dict(state, strict=True)
        fresh = fresh.to(torch.bfloat16).eval()
        with torch.no_grad():
            fresh_logits = fresh(probe).logits.float()
        gdn = next(m for _, m in gated_deltanet_modules(fresh))
        report = {
            "loss": (total / world).item(),
            "grad_norm": norm_sq.sqrt().item(),
            "forward_dtypes": seen,
            "gdn_decay_units": units,
            "state_dict_dtypes": sorted({str(v.dtype) for v in state.values()}),
            "state_dict_A_log_dtype": str(next(v for k, v in state.items() if k.endswith("A_log")).dtype),
            "fresh_A_log_dtype_after_bf16_cast": str(gdn.A_log.dtype),
            "fresh_vs_sharded_max_abs_logit_diff": (fresh_logits - probe_logits).abs().max().item(),
            "probe_logits": probe_logits.flatten().tolist(),
            # why a static cache's decode steps of the sharded model are not replayed as CUDA graphs
            "decode_graph_refusal": graph_refusal(model),
            **meta_report,
        }
        args.out.write_text(json.dumps(report))
    # every rank leaves together: gloo can abort a rank that tears down while its peer is still working
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
