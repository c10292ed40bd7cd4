"""Tiny local checkpoint folders and datasets, without the Hub: what `qwen35-packed tiny` writes, for running the
recipes of the README and docs/ on CPU, and the test suite's model folders.

The folders follow the user path: transformers' built-in Qwen3.5 class with a tiny config and random weights is
saved in the official layout with a tokenizer beside it, then converted with `qwen35-packed convert` into OUT
(config with auto_map, remote code, tokenizer and generation files). OUT appears only when complete, as with
`convert`. The tokenizer is character-level (ASCII printable), built in-process with `tokenizers`, with a chat
template. Linear-attention head dims are 64, the smallest vLLM's CPU kernels accept.

* `build_tiny_folder(out, kind)`: a text model, dense or MoE.
* `build_tiny_vl_folder(out, kind)`: the vision-language model (the composite class with its vision tower) and the
  files of a `Qwen3VLProcessor`: the tokenizer with the Qwen3.5 vision tokens and the official image / video
  processor configs with a 4-pixel patch. Writing them needs no torchvision; loading them with `AutoProcessor`
  does (its video processor), which the `vl` extra installs.
* `build_tiny_reward_folder(out, kind)`: the folder a reward model trained from a converted folder saves.
* `write_tiny_datasets(root)`: `root/chat` (conversations, `trl sft`) and `root/prompts` (a `prompt` column,
  `trl grpo`), each a folder with `train.jsonl` that `datasets.load_dataset` and TRL's `--dataset_name` read.
"""

from __future__ import annotations

import json
import random
import string
import tempfile
from pathlib import Path

KINDS = ("dense", "moe")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# `role: content` per message, the assistant's turn ended by eos and marked for TRL's `assistant_only_loss`; image
# and video parts of a message as the Qwen3.5 vision placeholders (which only the vision-language tokenizer has as
# tokens).
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{ message['role'] + ': ' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ render(message['content']) }}{{ eos_token }}{% endgeneration %}"
    "{%- else -%}{{ render(message['content']) }}{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant: ' }}{%- endif -%}"
)

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
# The vision tower of the tiny vision-language models: 2 blocks, head dim 32; out_hidden_size is the text hidden size.
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
# What loading the processor files needs beyond the base install, as the error that names it says.
VL_EXTRA_HINT = "pip install 'qwen35-packed[vl]' (from a clone: pip install -e \".[vl]\")"


class TinyFolderError(ValueError):
    """A tiny folder or dataset that cannot be written as asked (an existing output, a transformers without Qwen3.5)."""


def tiny_config_kwargs(kind: str = "dense") -> dict:
    """The tiny text config's fields for `kind` ("dense" or "moe"), a fresh copy."""
    if kind not in KINDS:
        raise ValueError(f"kind must be 'dense' or 'moe', got {kind!r}")
    kwargs = json.loads(json.dumps(TINY_DENSE))
    if kind == "moe":
        kwargs.pop("intermediate_size")
        kwargs.update(TINY_MOE)
    return kwargs


def build_char_tokenizer():
    """A character-level fast tokenizer (ASCII printable, <pad>=0, <eos>=1, <unk>=2) with CHAT_TEMPLATE."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_vl_tokenizer():
    """The character tokenizer plus the Qwen3.5 vision special tokens (ids 99..102)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def _builtin_qwen35():
    """transformers, which must have the built-in Qwen3.5 classes the folders are saved from."""
    import transformers

    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        raise TinyFolderError(
            f"tiny folders are saved from transformers' built-in Qwen3.5 classes, which transformers "
            f"{transformers.__version__} does not have (transformers 5.17 or later has them)"
        )
    return transformers


def _refuse_existing(*paths) -> None:
    for path in paths:
        if path is not None and Path(path).exists():
            raise TinyFolderError(f"{path} exists; give a path that does not")


def _move_norms_off_zero(model, lm_head_std: float | None) -> None:
    """Zero-initialised norms and routers would make a degenerate model; `lm_head_std` re-draws the LM head (random
    tiny models otherwise predict nearly uniform distributions, on which log-prob comparisons say little)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.1)
        if lm_head_std is not None:
            model.lm_head.weight.normal_(0.0, lm_head_std)


def _convert_saved(model, tokenizer, out: Path, extra_files: dict | None = None) -> Path:
    """Save `model` and `tokenizer` in the official layout (plus `extra_files`, name -> JSON object) and convert them
    into OUT."""
    from .conversion import convert

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "official"
        model.save_pretrained(src)
        tokenizer.save_pretrained(src)
        for name, content in (extra_files or {}).items():
            (src / name).write_text(json.dumps(content, indent=2))
        convert(src, out, progress=False, log=lambda *_: None)
    return out


def build_tiny_folder(
    out, kind: str = "dense", seed: int = 0, lm_head_std: float | None = None, **config_overrides
) -> Path:
    """Write a converted packed text model folder (config, weights, remote code, tokenizer, generation config that
    stops at <eos> and pads with <pad>) to OUT, which must not exist, and return it. `config_overrides` replace
    fields of the tiny config."""
    import torch

    transformers = _builtin_qwen35()
    out = Path(out)
    tokenizer = build_char_tokenizer()
    kwargs = {**tiny_config_kwargs(kind), "tie_word_embeddings": False, **config_overrides}
    kwargs.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if len(tokenizer) > kwargs["vocab_size"]:
        raise ValueError(f"vocab_size {kwargs['vocab_size']} < tokenizer size {len(tokenizer)}")
    torch.manual_seed(seed)
    if kind == "moe":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kwargs))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kwargs))
    _move_norms_off_zero(model, lm_head_std)
    return _convert_saved(model, tokenizer, out)


def build_tiny_vl_folder(out, kind: str = "dense", seed: int = 0, lm_head_std: float | None = None) -> Path:
    """Write a converted packed vision-language folder (composite config and weights with the vision tower, remote
    code, tokenizer and processor files) to OUT, which must not exist, and return it.

    The vision merger's output layer is scaled up so image features are as large as word embeddings (otherwise the
    images would hardly move the logits and a wrong image placement would go unnoticed)."""
    import torch

    transformers = _builtin_qwen35()
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
    _move_norms_off_zero(model, lm_head_std)
    with torch.no_grad():
        model.model.visual.merger.linear_fc2.weight.mul_(10.0)
    processor_files = {
        "preprocessor_config.json": TINY_IMAGE_PROCESSOR,
        "video_preprocessor_config.json": TINY_VIDEO_PROCESSOR,
    }
    return _convert_saved(model, tokenizer, out, processor_files)


def build_tiny_reward_folder(out, kind: str = "dense", seed: int = 0, **config_overrides) -> Path:
    """The folder a reward model saves: a converted tiny folder (`build_tiny_folder`) loaded as
    AutoModelForSequenceClassification with trust_remote_code (one label, the score head newly initialised), then
    written by its save_pretrained (architectures our sequence-classification class, the folder's auto_map and
    remote code, `score.weight`), with the tokenizer beside it."""
    transformers = _builtin_qwen35()
    out = Path(out)
    _refuse_existing(out)
    with tempfile.TemporaryDirectory() as tmp:
        causal = build_tiny_folder(Path(tmp) / "causal", kind, seed, **config_overrides)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            causal, trust_remote_code=True, num_labels=1
        )
        model.save_pretrained(out)
        transformers.AutoTokenizer.from_pretrained(causal).save_pretrained(out)
    return out


_WORDS = ("count", "to", "ten", "say", "abc", "hello", "list", "a", "b", "c", "1", "2", "3")


def _write_jsonl(out, rows: list[dict]) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return out


def write_prompt_dataset(out, n: int = 16, seed: int = 0) -> Path:
    """A dataset folder (`train.jsonl` with a plain-text `prompt` column) that `trl grpo --dataset_name OUT` reads."""
    import torch

    rng = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(2, 8, (1,), generator=rng))
        prompt = " ".join(_WORDS[int(i)] for i in torch.randint(0, len(_WORDS), (k,), generator=rng))
        rows.append({"prompt": prompt + ":"})
    return _write_jsonl(out, rows)


def write_chat_dataset(out, n: int = 32, seed: int = 0) -> Path:
    """A dataset folder (`train.jsonl` with a `messages` column: a user turn and the assistant's answer) that
    `trl sft --dataset_name OUT` reads, rendered with the tiny tokenizer's chat template."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, count = rng.randint(0, 9), rng.randint(2, 8)
        question = f"count from {start}, {count} numbers"
        answer = " ".join(str(start + i) for i in range(count))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return _write_jsonl(out, rows)


def write_tiny_datasets(root, seed: int = 0) -> dict[str, Path]:
    """`root/chat` (`write_chat_dataset`) and `root/prompts` (`write_prompt_dataset`); neither may exist."""
    root = Path(root)
    paths = {"chat": root / "chat", "prompts": root / "prompts"}
    _refuse_existing(*paths.values())
    write_chat_dataset(paths["chat"], seed=seed)
    write_prompt_dataset(paths["prompts"], seed=seed)
    return paths


def write_tiny(out, *, moe: bool = False, vl: bool = False, seed: int = 0, data=None) -> list[Path]:
    """What `qwen35-packed tiny` writes: the folder (text or vision-language, dense or MoE) and, with `data`, the
    datasets. Every output is checked to be absent before anything is written. Returns the paths written."""
    data_paths = [Path(data) / "chat", Path(data) / "prompts"] if data is not None else []
    _refuse_existing(out, *data_paths)
    kind = "moe" if moe else "dense"
    build = build_tiny_vl_folder if vl else build_tiny_folder
    written = [build(out, kind, seed=seed)]
    if data is not None:
        written += list(write_tiny_datasets(data, seed=seed).values())
    return written


__all__ = [
    "CHAT_TEMPLATE",
    "TINY_DENSE",
    "TINY_MOE",
    "TINY_ROPE",
    "TINY_VISION",
    "VISION_TOKENS",
    "VL_EXTRA_HINT",
    "TinyFolderError",
    "build_char_tokenizer",
    "build_tiny_folder",
    "build_tiny_reward_folder",
    "build_tiny_vl_folder",
    "build_vl_tokenizer",
    "tiny_config_kwargs",
    "write_chat_dataset",
    "write_prompt_dataset",
    "write_tiny",
    "write_tiny_datasets",
]
