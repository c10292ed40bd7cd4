"""Tiny local model folders, tokenizer and prompt dataset: the tests' fixtures, and smoke runs of the examples
(`--build_tiny`, which put this folder on sys.path), without the Hub.

`build_tiny_folder(out, kind)` follows the user path: transformers' built-in Qwen3.5 text model with random
weights is saved in the official layout, then converted with `qwen35-packed convert` into OUT, with a character
tokenizer saved beside it. Linear-attention head dims are 64, the smallest vLLM's CPU kernels accept.
`build_tiny_vl_folder(out, kind)` does the same for the vision-language model: transformers' built-in composite
class, converted with its vision tower, and the files of a real `Qwen3VLProcessor` (the character tokenizer with
the Qwen3.5 vision tokens, the official image / video processor configs with a 4-pixel patch).
`build_tiny_reward_folder(out, kind)`: the folder a reward model trained from a converted folder saves.
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
TINY_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    router_aux_loss_coef=0.001,
)


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


def build_tiny_folder(
    out, kind: str = "dense", seed: int = 0, lm_head_std: float | None = None, **config_overrides
) -> Path:
    """Write a converted packed model folder (config, weights, remote code, tokenizer) to OUT and return it.

    `lm_head_std` re-draws the LM head with that std: random tiny models otherwise predict nearly uniform
    distributions, on which log-prob comparisons say little."""
    import transformers

    from qwen35_packed.conversion import convert

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


# The vision tower of the tiny VL models: 2 blocks, head dim 32; out_hidden_size is the text hidden size.
TINY_VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The official preprocessor_config.json / video_preprocessor_config.json (Qwen3.5-0.8B) with the tiny patch size and
# pixel limits of 8x8 to 48x48 pixels (1 to 36 image tokens).
TINY_PIXELS = {"shortest_edge": 8 * 8, "longest_edge": 48 * 48}
_PROCESSOR_COMMON = {
    "size": TINY_PIXELS,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
}
TINY_IMAGE_PROCESSOR = {**_PROCESSOR_COMMON, "image_processor_type": "Qwen2VLImageProcessorFast"}
TINY_VIDEO_PROCESSOR = {**_PROCESSOR_COMMON, "video_processor_type": "Qwen3VLVideoProcessor"}


def build_vl_tokenizer():
    """The character tokenizer plus the Qwen3.5 vision special tokens (ids 99..102)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def build_tiny_vl_folder(out, kind: str = "dense", seed: int = 0, lm_head_std: float | None = None) -> Path:
    """Write a converted packed vision-language folder (composite config and weights with the vision tower, remote
    code, tokenizer and processor files) to OUT and return it.

    The vision merger's output layer is scaled up so image features are as large as word embeddings (otherwise the
    images would hardly move the logits and a wrong image placement would go unnoticed)."""
    import transformers

    from qwen35_packed.conversion import convert

    out = Path(out)
    tokenizer = build_vl_tokenizer()
    ids = dict(
        zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)),
        )
    )
    text = {**tiny_config_kwargs(kind), "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if len(tokenizer) > text["vocab_size"]:
        raise ValueError(f"vocab_size {text['vocab_size']} < tokenizer size {len(tokenizer)}")
    kwargs = dict(text_config=text, vision_config=dict(TINY_VISION), tie_word_embeddings=False, **ids)
    torch.manual_seed(seed)
    if kind == "moe":
        model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(**kwargs))
    else:
        model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(**kwargs))
    with torch.no_grad():  # zero-initialised norms and routers would make a degenerate model
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.1)
        model.model.visual.merger.linear_fc2.weight.mul_(10.0)
        if lm_head_std is not None:
            model.lm_head.weight.normal_(0.0, lm_head_std)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "official"
        model.save_pretrained(src)
        tokenizer.save_pretrained(src)
        (src / "preprocessor_config.json").write_text(json.dumps(TINY_IMAGE_PROCESSOR, indent=2))
        (src / "video_preprocessor_config.json").write_text(json.dumps(TINY_VIDEO_PROCESSOR, indent=2))
        convert(src, out, progress=False, log=lambda *_: None)
    return out


def build_tiny_reward_folder(out, kind: str = "dense", seed: int = 0, **config_overrides) -> Path:
    """The folder a reward model saves: a converted tiny folder (`build_tiny_folder`) loaded as
    AutoModelForSequenceClassification with trust_remote_code (one label, the score head newly initialised), then
    written by its save_pretrained (architectures our sequence-classification class, the folder's auto_map and
    remote code, `score.weight`), with the tokenizer beside it."""
    import transformers

    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        causal = build_tiny_folder(Path(tmp) / "causal", kind, seed, **config_overrides)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            causal, trust_remote_code=True, num_labels=1
        )
        model.save_pretrained(out)
        transformers.AutoTokenizer.from_pretrained(causal).save_pretrained(out)
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
