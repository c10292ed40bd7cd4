"""Packed vs per-document logits of a whole model (the official Qwen3.5-35B-A3B config, all 40 layers, vocab 248,320,
or Qwen3.5-4B's, all 32 layers), on one GPU in bf16.

Documents packed in one row against each document run alone through the same model; random weights (seed 0,
built by this project's class on the GPU: 68 GiB for the 35B-A3B). For each run: the largest |logit difference|,
the mean KL(alone || packed) over tokens, the share of tokens whose argmax agrees, and the rows that are not
bitwise equal.

Without --random-batches: the RL batch of bench_train_step.py (16 documents, 26,354 tokens), ours and (35B-A3B)
transformers' built-in sharing our weights (its parameters are assigned ours, no copy) on its correct packed path
(cu_seq_lens + seq_idx, with FLA and causal_conv1d installed: transformers 5.24 on the H200 recipe; without them it
is skipped and says why). Writes results/gpu/<date>-full-depth-exactness.json (or --out).

With --random-batches N: N batches drawn by bench_train_step.random_longtail (1- to 3-token documents among long
ones, shuffled) from --seed (default: from the clock, printed), ours only, optionally with PEFT LoRA (--lora: r=16
with a random B on every GDN, attention and MLP projection and the experts, PEFT's default fp32 adapters) and
under bf16 autocast as TRL's bf16=True runs a model (--autocast: the fp32 adapters then compute in bf16, through
the adapters' in-place sum). Writes results/gpu/<date>-h200-any-batch-<model>.json (or --out), one entry per batch.

    python benchmarks/full_depth_exactness.py [--model 35b_a3b|4b] [--layers N] [--skip-builtin]
                                              [--random-batches N] [--seed S] [--lora] [--autocast] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import transformers
from bench_train_step import CONFIGS, batches, default_dtype, model_kwargs, random_longtail

from qwen35_packed import (
    Qwen3_5MoePackedConfig,
    Qwen3_5MoePackedForCausalLM,
    Qwen3_5PackedConfig,
    Qwen3_5PackedForCausalLM,
)
from qwen35_packed.modeling import kernel_selection

ROOT = Path(__file__).resolve().parent
LENGTHS = batches()["rl_longtail_x16"]


def official_text_config(layers: int) -> dict:
    composite = json.loads((CONFIGS / "Qwen3.5-35B-A3B.config.json").read_text())
    kwargs = {k: v for k, v in composite["text_config"].items() if k not in ("model_type", "dtype", "torch_dtype")}
    kwargs["layer_types"] = kwargs["layer_types"][:layers]
    kwargs["num_hidden_layers"] = layers
    return kwargs


class Agreement:
    """Packed rows against the same document alone, accumulated document by document (fp32, on the GPU)."""

    def __init__(self):
        self.max_abs, self.kl_sum, self.same_argmax, self.tokens, self.rows_differing = 0.0, 0.0, 0, 0, 0

    def add(self, packed_rows: torch.Tensor, alone: torch.Tensor):
        self.rows_differing += int((packed_rows != alone).any(-1).sum())
        for start in range(0, alone.shape[0], 1024):  # fp32 [1024, vocab] at a time
            p, a = packed_rows[start : start + 1024].float(), alone[start : start + 1024].float()
            self.max_abs = max(self.max_abs, (p - a).abs().max().item())
            log_p, log_a = p.log_softmax(-1), a.log_softmax(-1)
            self.kl_sum += (log_a.exp() * (log_a - log_p)).sum().item()
            self.same_argmax += int((p.argmax(-1) == a.argmax(-1)).sum())
        self.tokens += alone.shape[0]

    def result(self) -> dict:
        return {
            "max_abs_logit_diff": self.max_abs,
            "mean_kl_alone_vs_packed": self.kl_sum / self.tokens,
            "same_argmax": self.same_argmax / self.tokens,
            "rows_not_bitwise_equal": self.rows_differing,
            "tokens": self.tokens,
        }


def compare(packed_forward, alone_forward, docs) -> dict:
    start_time = time.perf_counter()
    with torch.no_grad():
        packed = packed_forward()
        agreement = Agreement()
        start = 0
        for doc in docs:
            agreement.add(packed[start : start + doc.shape[0]], alone_forward(doc))
            start += doc.shape[0]
    del packed
    torch.cuda.empty_cache()
    return {**agreement.result(), "seconds": round(time.perf_counter() - start_time, 1)}


def builtin_sharing_weights(ours, kwargs):
    """The built-in Qwen3_5MoeForCausalLM built on the meta device, its parameters assigned ours (same keys and
    shapes), its rotary buffers built on the GPU."""
    with torch.device("meta"):
        builtin = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kwargs))
    builtin.load_state_dict(ours.state_dict(), strict=True, assign=True)
    rotary = builtin.model.rotary_emb
    with torch.device("cuda"):
        builtin.model.rotary_emb = type(rotary)(config=builtin.config)
    if hasattr(builtin, "set_experts_implementation"):
        builtin.set_experts_implementation("grouped_mm")  # its default, as bench_moe.py's baseline runs it
    left = [n for n, t in [*builtin.named_parameters(), *builtin.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"built-in tensors left on the meta device: {left[:5]}")
    return builtin.eval()


def builtin_missing() -> str | None:
    """Why the built-in's correct packed path cannot run here, or None."""
    import importlib.util

    missing = [m for m in ("fla", "causal_conv1d") if importlib.util.find_spec(m) is None]
    return f"not importable: {', '.join(missing)}" if missing else None


LORA_MODULES = [
    "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
]  # fmt: skip


def build_ours(model: str, layers: int | None):
    """Our model with random weights (seed 0), bf16 on the GPU, eval mode, and its text config kwargs."""
    torch.manual_seed(0)
    if model == "35b_a3b":
        kwargs = official_text_config(layers or 40)
        cls, config_cls = Qwen3_5MoePackedForCausalLM, Qwen3_5MoePackedConfig
    else:
        kwargs = model_kwargs("qwen35_4b", layers=layers)
        cls, config_cls = Qwen3_5PackedForCausalLM, Qwen3_5PackedConfig
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        return cls(config_cls(**kwargs)).eval(), kwargs


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if model.config.is_moe else None
    config = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_MODULES, target_parameters=experts,
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(1)
    return get_peft_model(model, config).eval()


def random_batches(args):
    """--random-batches: each batch from its own seed, ours only; one result entry per batch."""
    ours, kwargs = build_ours(args.model, args.layers)
    if args.lora:
        ours = with_lora(ours)
    layers = kwargs["num_hidden_layers"]
    name = f"Qwen3.5-{'35B-A3B' if args.model == '35b_a3b' else '4B'} official config, {layers} layers"
    choice = kernel_selection.select_kernels(ours.config, torch.device("cuda"), torch.bfloat16)
    out = Path(
        args.out or ROOT.parent / "results" / "gpu" / f"{datetime.date.today()}-h200-any-batch-{args.model}.json"
    )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "ours_kernels": {"gdn": choice.gdn, "conv": choice.conv, "attention": choice.attention, "moe": choice.moe},
        "base_seed": args.seed,
        "batches": [],
    }
    for index in range(args.random_batches):
        seed = args.seed + index
        lengths = random_longtail(seed)
        gen = torch.Generator().manual_seed(seed)
        docs = [torch.randint(0, kwargs["vocab_size"], (n,), generator=gen).cuda() for n in lengths]
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
        flat = torch.cat(docs)[None]
        with torch.autocast("cuda", torch.bfloat16, enabled=args.autocast):
            measured = compare(
                lambda: ours(flat, cu_seqlens=cu, use_cache=False).logits[0],
                lambda doc: ours(doc[None], use_cache=False).logits[0],
                docs,
            )
        entry = {"model": name, "seed": seed, "documents": lengths, "lora": bool(args.lora), "autocast": args.autocast}
        entry.update(measured)
        entry["tokens"] = sum(lengths)
        result["batches"].append(entry)
        print(entry, flush=True)
        out.write_text(json.dumps(result, indent=2))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("35b_a3b", "4b"), default="35b_a3b")
    parser.add_argument("--layers", type=int, default=None, help="default: every layer of the official config")
    parser.add_argument("--skip-builtin", action="store_true")
    parser.add_argument("--random-batches", type=int, default=0)
    parser.add_argument("--seed", type=int, default=time.time_ns() % 1_000_000)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--autocast", action="store_true", help="--random-batches: every forward under bf16 autocast")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.random_batches:
        print(f"random batches from --seed {args.seed}", flush=True)
        return random_batches(args)
    if args.model != "35b_a3b":
        raise SystemExit("the RL-batch comparison with the built-in runs the 35B-A3B; use --random-batches for 4b")
    ours, kwargs = build_ours("35b_a3b", args.layers)
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, kwargs["vocab_size"], (n,), generator=gen).cuda() for n in LENGTHS]
    flat = torch.cat(docs)[None]
    cu = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    choice = kernel_selection.select_kernels(ours.config, torch.device("cuda"), torch.bfloat16)
    out = Path(args.out or ROOT.parent / "results" / "gpu" / f"{datetime.date.today()}-full-depth-exactness.json")
    result = {
        "model": f"Qwen3.5-35B-A3B official config, {kwargs['num_hidden_layers']} of 40 layers, random weights (seed 0)",
        "documents": LENGTHS,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ours_kernels": {"gdn": choice.gdn, "conv": choice.conv, "attention": choice.attention, "moe": choice.moe},
    }

    def save():
        out.write_text(json.dumps(result, indent=2))

    result["ours"] = compare(
        lambda: ours(flat, cu_seqlens=cu, use_cache=False).logits[0],
        lambda doc: ours(doc[None], use_cache=False).logits[0],
        docs,
    )
    print("ours", result["ours"], flush=True)
    save()
    why = "--skip-builtin" if args.skip_builtin else builtin_missing()
    if why:
        result["builtin"] = {"skipped": why}
    else:
        builtin = builtin_sharing_weights(ours, kwargs)
        packing = dict(
            position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda(),
            seq_idx=torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENGTHS)])[None].cuda(),
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(LENGTHS),
            max_length_k=max(LENGTHS),
        )
        result["builtin"] = compare(
            lambda: builtin(input_ids=flat, use_cache=False, **packing).logits[0],
            lambda doc: builtin(doc[None], use_cache=False).logits[0],
            docs,
        )
    print("builtin", result["builtin"], flush=True)
    save()


if __name__ == "__main__":
    main()
