"""Tiny local model folders, tokenizer and prompt dataset for smoke runs of the training stack without the Hub.

`build_tiny_folder(out, kind)` follows the user path: transformers' built-in Qwen3.5 text model with random
weights is saved in the official layout, then converted with `qwen35-packed convert` into OUT, with a character
tokenizer saved beside it. Linear-attention head dims are 64, the smallest vLLM's CPU kernels accept.
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"

TINY_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [3, 3, 2],
    "mrope_interleaved": True,
}
# Linear head dims of 64: vLLM's CPU kernels accept only 64/128 (the test suite's tiny models are these too).
TINY_DENSE = dict(
    vocab_size=128,
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
    linear_conv_kernel_dim=4,
    rope_parameters=TINY_ROPE,
)
# MoE additions; the load-balancing coefficient of the official configs, which RL must not get unasked.
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                router_aux_loss_coef=0.001)


def tiny_config_kwargs(kind: str = "dense") -> dict:
    if kind not in ("dense", "moe"):
        raise ValueError(f"kind must be 'dense' or 'moe', got {kind!r}")
    kwargs = json.loads(json.dumps(TINY_DENSE))
    if kind == "moe":
        kwargs.pop("intermediate_size")
        kwargs.update(TINY_MOE)
    return kwargs


def build_char_tokenizer():
    """A character-level fast tokenizer (ASCII printable, <pad>=0, <eos>=1, <unk>=2), built in-process."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_tiny_folder(out, kind: str = "dense", seed: int = 0, lm_head_std: float | None = None,
                      **config_overrides) -> Path:
    """Write a converted packed model folder (config, weights, remote code, tokenizer) to OUT and return it.

    `lm_head_std` re-draws the LM head with that std: random tiny models otherwise predict nearly uniform
    distributions, on which log-prob comparisons say little."""
    import transformers

    from ..conversion import convert

    out = Path(out)
    kwargs = {**tiny_config_kwargs(kind), "tie_word_embeddings": False, **config_overrides}
    tokenizer = build_char_tokenizer()
    kwargs.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if len(tokenizer) > kwargs["vocab_size"]:
        raise ValueError(f"vocab_size {kwargs['vocab_size']} < tokenizer size {len(tokenizer)}")
    torch.manual_seed(seed)
    if kind == "moe":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kwargs))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kwargs))
    with torch.no_grad():  # zero-initialised norms and routers would make a degenerate model
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.1)
        if lm_head_std is not None:
            model.lm_head.weight.normal_(0.0, lm_head_std)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "official"
        model.save_pretrained(src)
        convert(src, out, progress=False, log=lambda *_: None)
    tokenizer.save_pretrained(out)
    generation = out / "generation_config.json"
    if generation.exists():  # generation stops at <eos>, pads with <pad>
        config = json.loads(generation.read_text())
        config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        generation.write_text(json.dumps(config, indent=2))
    return out


def write_prompt_dataset(out, n: int = 16, seed: int = 0) -> Path:
    """A local dataset folder (`train.jsonl` with a `prompt` column) that `datasets.load_dataset(OUT)` and
    `trl grpo --dataset_name OUT` read."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = torch.Generator().manual_seed(seed)
    words = ["count", "to", "ten", "say", "abc", "hello", "list", "a", "b", "c", "1", "2", "3"]
    with open(out / "train.jsonl", "w") as f:
        for _ in range(n):
            k = int(torch.randint(2, 8, (1,), generator=rng))
            prompt = " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=rng))
            f.write(json.dumps({"prompt": prompt + ":"}) + "\n")
    return out


def copy_folder(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)
