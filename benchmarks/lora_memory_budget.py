"""What a training run holds on the GPU before its first activation: the weights, the trained parameters' gradients
and AdamW's two states, for the official text configs with bench_workload.py's setups.

bench_workload.py's rows (and the workload tables) measure the peak of a forward + backward without an optimizer
(`_adamw` rows add its step). A trainer also holds its optimizer's state from its first step to its last:
transformers' default `adamw_torch_fused` keeps two tensors per trained parameter in that parameter's dtype. So a
card must hold a row's peak plus the state counted here. The counts are exact byte counts of meta-device models
(no memory, no accelerator), not measurements; AdamW's per-parameter step counts (4 bytes each) are left out.

Setups, LoRA r=16 on `lora_config`'s default targets (GDN, attention and MLP projections, a MoE's shared expert and
experts: what bench_grpo_step.py trains; bench_workload.py's `lora` leaves the MLP projections out):
  lora             adapters fp32 (PEFT's default beside a bf16 base, `autocast_adapter_dtype=True`)
  lora_bf16_adapters  adapters bf16 (`autocast_adapter_dtype=False`)
  lora_no_experts  (MoE models) the same targets without the experts, either adapter dtype
  full             every parameter trains, in the base's bf16 (torch's AdamW keeps bf16 states for bf16 parameters)

    python benchmarks/lora_memory_budget.py [--models qwen35_0p8b,qwen35_4b,qwen35_9b,qwen35_35b_a3b] [--rank 16]
        [--out FILE]

Prints a table and writes JSON (default results/cpu/DATE-lora-memory-budget.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from bench_generate import build, config_kwargs

from qwen35_packed.integrations.lora import DEFAULT_GROUPS, lora_config

ROOT = Path(__file__).resolve().parent
MODELS = ("qwen35_0p8b", "qwen35_4b", "qwen35_9b", "qwen35_35b_a3b")  # bench_generate.py's model keys
WITHOUT_EXPERTS = tuple(group for group in DEFAULT_GROUPS if group != "experts")
# (setup, LoRA target groups or None for a full fine-tune, whether the adapters are bf16)
SETUPS = (
    ("lora", DEFAULT_GROUPS, False),
    ("lora_bf16_adapters", DEFAULT_GROUPS, True),
    ("lora_no_experts", WITHOUT_EXPERTS, False),
    ("lora_no_experts_bf16_adapters", WITHOUT_EXPERTS, True),
    ("full", None, True),
)
GIB = 2**30


def bf16_model(key: str, kwargs: dict, device: torch.device) -> torch.nn.Module:
    """The text model in bf16 on `device` (the meta device: shapes and dtypes only)."""
    return build(key, "ours", kwargs, device, torch.bfloat16)


def prepare(model: torch.nn.Module, groups: tuple[str, ...] | None, bf16_adapters: bool, rank: int):
    """The model as the setup trains it: PEFT-wrapped with its adapters (the base frozen), or every parameter
    trained."""
    if groups is None:
        return model.requires_grad_(True)
    from peft import get_peft_model

    config = lora_config(model.config, r=rank, lora_dropout=0.0, targets=groups)
    return get_peft_model(model, config, autocast_adapter_dtype=not bf16_adapters)


def training_state_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes held through training before any activation: every weight (trained or frozen, in its dtype), the
    trained parameters' gradients (their dtype) and AdamW's two states per trained parameter (their dtype)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]
    trained_bytes = sum(p.numel() * p.element_size() for p in trained)
    return {
        "weights": weights,
        "trained_parameters": sum(p.numel() for p in trained),
        "gradients": trained_bytes,
        "adamw_states": 2 * trained_bytes,
        "total": weights + 3 * trained_bytes,
    }


def budget_rows(models: list[str], rank: int) -> list[dict]:
    rows = []
    for spec in models:
        name, key, kwargs = config_kwargs(spec, tiny=False)
        for setup, groups, bf16_adapters in SETUPS:
            moe = bool(kwargs.get("num_experts"))
            if groups is not None and not moe:
                if "experts" not in groups:
                    continue  # a dense model's "lora_no_experts" is its "lora"
                groups = WITHOUT_EXPERTS
            model = prepare(bf16_model(key, kwargs, torch.device("meta")), groups, bf16_adapters, rank)
            counts = training_state_bytes(model)
            rows.append(
                {
                    "model": name,
                    "setup": setup,
                    "trained_parameters": counts["trained_parameters"],
                    **{f"{k}_GiB": round(v / GIB, 2) for k, v in counts.items() if k != "trained_parameters"},
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<16}{'setup':<32}{'trained':>15}{'weights':>9}{'grads':>8}{'AdamW':>8}{'total GiB':>11}")
    for r in rows:
        print(
            f"{r['model']:<16}{r['setup']:<32}{r['trained_parameters']:>15,}{r['weights_GiB']:>9}"
            f"{r['gradients_GiB']:>8}{r['adamw_states_GiB']:>8}{r['total_GiB']:>11}"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    date = datetime.date.today().isoformat()
    rows = budget_rows(args.models.split(","), args.rank)
    print_table(rows)
    out = Path(args.out) if args.out else ROOT.parent / "results" / "cpu" / f"{date}-lora-memory-budget.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": date,
        "how": f"python benchmarks/lora_memory_budget.py --models {args.models} --rank {args.rank}",
        "counted": "meta-device models of the official text configs (examples/configs), bf16 base: exact bytes",
        "rank": args.rank,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
