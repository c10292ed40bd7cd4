"""Where a LoRA training step's bf16 elementwise adds come from: a census by call site, on the CPU.

On the GPU one elementwise add kernel takes a large share of the whole 35B-A3B's RL step (results/notes/), and a
profile names the kernel, not the sums it serves. The adds are the same operator calls on every device, so this
counts them where they are issued: one forward + backward of a model with the Qwen3.5-35B-A3B's layer shapes (its
3:1 pattern of GDN and attention layers, PEFT LoRA r=16 on GDN, attention and the experts as bench_workload.py's
`lora` rows, low-rank expert products, grouped expert GEMMs, decoder-layer checkpointing), under a dispatch mode that
records every `aten.add` / `add_` whose bf16 result has at least one element per token. Each is attributed to the
innermost frame in this project's code, else PEFT's, TRL's or transformers' (memory_peak.py's sites), or, with none
on the stack, to autograd's own sum of the gradients of a tensor with several consumers, named by its shape.

Reported per site: elements per token per layer (the layer shapes make these the full model's: the fewer experts
kept here for the CPU do not change the rows per token) and calls. An add moves three times its elements (two read,
one written), so the element counts rank the sites by memory traffic. What the CPU path adds and a GPU kernel fuses
(the reference GDN, conv and norms) is not a site here: those ops add in fp32 or below the threshold.

    python benchmarks/add_census.py [--tokens 2048] [--layers 4] [--autocast] [--out FILE] [--tiny]

`--autocast` keeps PEFT's default fp32 adapters and runs the step under bf16 autocast (TRL's `bf16=True`); without
it the adapters are bf16. --tiny runs a small config (a check of the script, and what the tests read).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import traceback
from pathlib import Path

import torch
from bench_moe import layer_shapes
from bench_workload import LORA_GROUPS
from memory_peak import SITE_OWNERS, site_of
from torch.utils._python_dispatch import TorchDispatchMode

from qwen35_packed import Qwen3_5MoePackedConfig, Qwen3_5MoePackedForCausalLM

ROOT = Path(__file__).resolve().parent
ADDS = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}


class AddCensus(TorchDispatchMode):
    """Elements and calls of the bf16 adds of at least one element per token, by call site."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.elements, self.calls = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in ADDS and out.dtype == torch.bfloat16 and out.numel() >= self.tokens:
            site = call_site(traceback.extract_stack(), out, self.tokens)
            self.elements[site] += out.numel()
            self.calls[site] += 1
        return out


def call_site(stack: traceback.StackSummary, out: torch.Tensor, tokens: int) -> str:
    """Where an add was issued, as memory_peak.py names an allocation's site; with no frame of this project or the
    libraries around it on the stack, autograd's own gradient sum, named by the summed tensor's rows per token (the
    expert rows: top-k) and width."""
    frames = [{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(stack)]
    if any(owner in frame["filename"] for frame in frames for owner in SITE_OWNERS):
        return site_of(frames)
    rows = out.shape[:-1].numel() / tokens
    return f"autograd: gradient sum of a [{rows:g} x tokens, {out.shape[-1]}] tensor"


def build(layers: int, tiny: bool, autocast: bool):
    """The 35B-A3B's layer shapes (32 experts, top-8) in bf16 with PEFT LoRA, checkpointed, in training mode."""
    from peft import get_peft_model

    from qwen35_packed.integrations.lora import lora_config

    torch.manual_seed(0)
    kwargs = layer_shapes(layers, 4096, tiny)
    if not tiny:
        kwargs["num_experts"] = 32  # the rows per token (top-8) and the widths are the model's
    kwargs["moe_kernel"] = "grouped_mm"  # the grouped path the GPU runs (the CPU's default is the loop)
    model = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**kwargs)).to(torch.bfloat16)
    config = lora_config(model, r=16, lora_alpha=32, lora_dropout=0.0, targets=LORA_GROUPS["lora"])
    model = get_peft_model(model, config, autocast_adapter_dtype=autocast)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def run(tokens: int, layers: int, tiny: bool, autocast: bool) -> dict:
    model = build(layers, tiny, autocast)
    vocab = model.config.vocab_size
    lengths = [tokens // 4, tokens // 2, tokens - tokens // 4 - tokens // 2]  # three documents in one row
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    census = AddCensus(tokens)
    step = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with census, step:
        model(input_ids=ids, labels=ids, cu_seqlens=cu, use_cache=False).loss.backward()
    per_token_layer = {site: n / tokens / layers for site, n in census.elements.most_common()}
    total = sum(per_token_layer.values())
    return {
        "tokens": tokens,
        "layers": layers,
        "adapters": "fp32 under bf16 autocast" if autocast else "bf16",
        "elements_per_token_per_layer": round(total),
        "sites": [
            {
                "site": site,
                "elements_per_token_per_layer": round(n),
                "share": round(n / total, 4),
                "calls": census.calls[site],
            }  # fmt: skip
            for site, n in per_token_layer.items()
        ],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4, help="a multiple of 4 keeps the 3:1 layer pattern whole")
    parser.add_argument("--autocast", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__}
    result.update(run(args.tokens, args.layers, args.tiny, args.autocast))
    print(f"{'elements/token/layer':>21}  {'share':>6}  {'calls':>5}  site")
    for row in result["sites"]:
        print(f"{row['elements_per_token_per_layer']:>21,}  {row['share']:>6.1%}  {row['calls']:>5}  {row['site']}")
    out = Path(args.out or ROOT.parent / "results" / "cpu" / f"{result['date']}-add-census.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
