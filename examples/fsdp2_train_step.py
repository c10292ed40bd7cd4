"""One packed training step under FSDP2 against the same step on one GPU; writes a JSON report.

    python examples/fsdp2_train_step.py --single --out single.json            # the one-GPU reference (bf16)
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/fsdp2_train_step.py --out fsdp2.json
    (add --lora to both for LoRA on the GDN, attention and MLP projections)

The MoE model (Qwen3.5-35B-A3B's config, with --layers of its 40 layers), built on the meta device on every rank but
rank 0, which holds the weights that Accelerate's cpu_ram_efficient_loading broadcasts after sharding:
    accelerate launch --config_file examples/accelerate/fsdp2-moe.yaml examples/fsdp2_train_step.py \
        --config examples/configs/Qwen3.5-35B-A3B.config.json --layers 4 --meta-init --out fsdp2-moe.json
    (--lora adds the experts, through PEFT target_parameters, to the GDN and attention targets)

The model is the Qwen3.5-0.8B text config (examples/configs/, 248,320 vocab) with random weights (seed 0); the
batch is 16 documents of 256-2047 tokens (seed 1). FSDP2 rank r packs documents r, r + world, ... in one row and
scales its token-sum loss so that FSDP2's gradient average equals the full-batch mean-loss gradient. Reported:
the global loss, the total gradient norm, the dtypes A_log and the projections have inside the forward, and (FSDP2)
the max |logit difference| between the sharded model and a fresh model loaded from the full state dict it saved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.integrations.fsdp2 import gated_deltanet_modules

CONFIG = Path(__file__).resolve().parent / "configs" / "Qwen3.5-0.8B.config.json"


def build_model(config_path: Path, dtype: torch.dtype, lora: bool, layers: int | None = None, meta: bool = False):
    """The model of `config_path` with random weights (seed 0); `layers` keeps the first ones; `meta`: on the meta
    device (no storage: the weights arrive from rank 0 after sharding)."""
    data = json.loads(config_path.read_text())
    text = dict(data.get("text_config", data))
    text.setdefault("tie_word_embeddings", data.get("tie_word_embeddings", False))
    for key in ("model_type", "architectures", "dtype", "torch_dtype"):
        text.pop(key, None)
    if layers is not None:
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
    moe = text.get("num_experts") is not None
    if moe:
        text["router_aux_loss_coef"] = 0.0  # measure the language-model loss alone
    config = Qwen3_5MoePackedConfig(**text) if moe else Qwen3_5PackedConfig(**text)
    cls = Qwen3_5MoePackedForCausalLM if moe else Qwen3_5PackedForCausalLM
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = cls(config).to(dtype)
    if lora:
        from peft import get_peft_model

        from qwen35_packed.integrations.lora import lora_config

        targets = ("gdn", "attention", "experts") if moe else ("gdn", "attention", "mlp")
        config = lora_config(model, r=8, lora_dropout=0.0, targets=targets)
        model = get_peft_model(model, config)
        torch.manual_seed(1)
        with torch.no_grad():  # nonzero B so that LoRA changes the forward and A gets gradients
            for name, param in model.named_parameters():
                if "lora_B" in name and not meta:
                    param.normal_(0.0, 0.01)
    return model


def documents(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(256, 2048, (16,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def record_forward_dtypes(model) -> dict:
    """Dtypes of A_log / in_proj_qkv.weight as the first GDN layer's forward sees them."""
    seen = {}
    gdn = next(m for _, m in gated_deltanet_modules(model))

    proj = gdn.in_proj_qkv

    def decay_hook(module, args):
        seen.setdefault("A_log", str(module.A_log.dtype))
        seen.setdefault("dt_bias", str(module.dt_bias.dtype))

    def projection_hook(module, args):  # the projections are their own FSDP2 unit, gathered at their first use
        seen.setdefault("in_proj_qkv", str(getattr(module, "base_layer", module).weight.dtype))
        seen.setdefault("gdn_input", str(args[0].dtype))

    gdn.register_forward_pre_hook(decay_hook)
    proj.register_forward_pre_hook(projection_hook)
    return seen


def packed_row(docs: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(docs)[None].to(device)
    cu = torch.tensor([0] + torch.tensor([len(d) for d in docs]).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return ids, cu


def run_single(args) -> dict:
    device = torch.device("cuda")
    model = build_model(args.config, torch.bfloat16, args.lora, args.layers).to(device).train()
    seen = record_forward_dtypes(model)
    docs = documents(model.config.vocab_size)
    ids, cu = packed_row(docs, device)
    n_tokens = sum(len(d) - 1 for d in docs)
    loss = model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=n_tokens).loss
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    return {
        "mode": "single",
        "lora": args.lora,
        "loss": loss.item(),
        "grad_norm": grad_norm.item(),
        "forward_dtypes": seen,
        "tokens": int(ids.shape[1]),
        "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
    }


def run_fsdp2(args) -> dict:
    from accelerate import Accelerator

    from qwen35_packed.integrations.fsdp2 import shard_gdn_decay_fp32

    accelerator = Accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    # With --meta-init (and fsdp_cpu_ram_efficient_loading in the Accelerate config) only rank 0 holds weights.
    model = build_model(args.config, torch.float32, args.lora, args.layers, meta=args.meta_init and rank != 0)
    n_decay_units = shard_gdn_decay_fp32(model, accelerator.state.fsdp_plugin.mixed_precision_policy)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = record_forward_dtypes(model)
    model.train()

    docs = documents(model.config.vocab_size)
    n_tokens = sum(len(d) - 1 for d in docs)
    ids, cu = packed_row(docs[rank::world], accelerator.device)
    # FSDP2 averages gradients over ranks: scale each rank's token-sum loss by world / global token count.
    loss = model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=n_tokens / world).loss
    accelerator.backward(loss)
    grad_norm = accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    global_loss = accelerator.reduce(loss.detach(), reduction="sum") / world

    # Full state dict -> fresh model -> same logits as the sharded model on the same input.
    model.eval()
    probe = docs[0][:512][None].to(accelerator.device)
    with torch.no_grad():
        sharded_logits = model(probe).logits.float()
    # torch's own full-state-dict gather (a collective: every rank calls it), as the CPU test does; a dict with
    # missing tensors must not pass for a saved model.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    report = {
        "mode": "fsdp2",
        "world": world,
        "lora": args.lora,
        "loss": global_loss.item(),
        "grad_norm": grad_norm.item(),
        "forward_dtypes": seen,
        "gdn_decay_units": n_decay_units,
        "peak_GiB_rank0": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }
    if accelerator.is_main_process:
        expected = len(accelerator.unwrap_model(model).state_dict())
        if len(state) != expected:
            raise RuntimeError(f"the gathered full state dict has {len(state)} tensors, the model {expected}")
        # Counted now: save_pretrained empties the dict it is given as it writes the shards.
        report["saved_state_dict_tensors"] = len(state)
        if args.lora:  # the PEFT model's full state dict (base + adapters) into a fresh PEFT model
            reloaded = build_model(args.config, torch.float32, True, args.layers)
            reloaded.load_state_dict(state, strict=True)
        else:
            with tempfile.TemporaryDirectory() as folder:
                accelerator.unwrap_model(model).save_pretrained(folder, state_dict=state, safe_serialization=True)
                reloaded = type(accelerator.unwrap_model(model)).from_pretrained(folder, dtype=torch.float32)
        reloaded = reloaded.to(accelerator.device, torch.bfloat16).eval()
        with torch.no_grad():
            fresh_logits = reloaded(probe).logits.float()
        report["reloaded_vs_sharded_max_abs_logit_diff"] = (fresh_logits - sharded_logits).abs().max().item()
        report["reloaded_forward_A_log_dtype"] = str(next(m for _, m in gated_deltanet_modules(reloaded)).A_log.dtype)
    accelerator.wait_for_everyone()
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--single", action="store_true", help="one GPU, no FSDP (the reference)")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--layers", type=int, default=None, help="keep the config's first N layers")
    parser.add_argument("--meta-init", action="store_true", help="ranks > 0 build on the meta device")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = run_single(args) if args.single else run_fsdp2(args)
    if report.get("mode") == "single" or torch.distributed.get_rank() == 0:
        print(json.dumps(report, indent=1))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
