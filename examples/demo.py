"""Demo: build a tiny official-layout Qwen3.5 checkpoint, convert it, load it with trust_remote_code, and print
packed-vs-per-document parity next to what transformers' built-in class does with the same packed batch.

    python examples/demo.py [WORKDIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from qwen35_packed.cli import main as cli


def build_official_checkpoint(path: Path) -> transformers.PreTrainedModel:
    config = transformers.Qwen3_5TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def main(workdir: Path) -> None:
    src, out = workdir / "official", workdir / "packed"
    builtin = build_official_checkpoint(src)
    cli(["convert", str(src), str(out), "--no-progress"])
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    print(f"loaded {type(ours).__module__}.{type(ours).__name__}")

    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in (37, 1, 3, 64, 90, 12)]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        per_doc_ours = torch.cat([ours(d[None], use_cache=False).logits[0] for d in docs])
        per_doc_builtin = torch.cat([builtin(d[None], use_cache=False).logits[0] for d in docs])
        packed_ours = ours(ids, position_ids=positions, use_cache=False).logits[0]
        packed_builtin = builtin(ids, position_ids=positions, use_cache=False).logits[0]
    rows = [
        ("qwen35-packed, packed vs per-document", (packed_ours - per_doc_ours).abs().max().item()),
        ("qwen35-packed vs built-in, per-document", (per_doc_ours - per_doc_builtin).abs().max().item()),
        ("built-in, packed vs per-document", (packed_builtin - per_doc_builtin).abs().max().item()),
    ]
    print(f"\n{len(docs)} documents, {ids.shape[1]} tokens packed in one row (position_ids restart per document)")
    print(f"{'comparison':<45} max |logit diff|")
    for name, value in rows:
        print(f"{name:<45} {value:.3e}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
