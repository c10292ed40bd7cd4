"""Packed == per-document on the real checkpoint, in seconds: the first layers of the model (up to and including
the first full-attention layer, so the GDN conv, the delta rule and attention all run) with the real weights, on a
short random stream of documents whose lengths hit the edge cases (a 1-token document, documents shorter than the
conv kernel, a 64-token delta-rule chunk and one past it). The same kernels run as in training on this device
(`modeling/kernel_selection.py` with the config's forced choices); a kernel path that lets one document see another makes
the later documents' logits differ from running them alone."""

from __future__ import annotations

import copy
import time

import torch

from ..conversion.rules import materialize
from ..conversion.schema import expected_text_tensors
from .folder import ModelFolder
from .report import FAIL, PASS, SKIP, DoctorReport, Measurement

DOC_LENGTHS = (1, 3, 17, 64, 65, 5, 40)
# max |packed - per-document logit| over max |logit|: above what this package gives in each dtype and below what a
# conv or an attention that ignores boundaries gives (both measured on CPU and an H200: docs/doctor.md).
# A sequence-classification folder has no lm_head: its backbone's last hidden states are compared, token by token
# (its score reads one of them per document).
RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def doctor_layer_count(layer_types: list[str]) -> int:
    """Layers 0..first full-attention layer (at least two layers, at most all)."""
    first_full = next((i for i, t in enumerate(layer_types) if t == "full_attention"), len(layer_types) - 1)
    return min(len(layer_types), max(2, first_full + 1))


def load_first_layers(folder: ModelFolder, n_layers: int, device: torch.device, dtype: torch.dtype):
    """This package's model with the first `n_layers` decoder layers and the real weights of those layers, the
    embedding, the final norm and the head (a sequence-classification folder: the text model, without its score
    head); only those tensors are read from the shards."""
    from safetensors import safe_open

    from .. import Qwen3_5MoePackedForCausalLM, Qwen3_5PackedForCausalLM
    from ..modeling import Qwen3_5MoePackedTextModel, Qwen3_5PackedTextModel

    text = copy.deepcopy(folder.text)
    text["num_hidden_layers"] = n_layers
    text["layer_types"] = list(folder.packed_config.layer_types[:n_layers])
    if "mlp_only_layers" in text:
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < n_layers]
    config = type(folder.packed_config).from_dict(text)
    config.tie_word_embeddings = folder.tied
    if folder.sequence_classifier:
        model_class = Qwen3_5MoePackedTextModel if folder.is_moe else Qwen3_5PackedTextModel
        keys = {
            folder.text_key(key): key.removeprefix("model.")
            for key in expected_text_tensors(config, sequence_classifier=True)
            if key.startswith("model.")
        }
    else:
        model_class = Qwen3_5MoePackedForCausalLM if folder.is_moe else Qwen3_5PackedForCausalLM
        keys = {folder.text_key(key): key for key in expected_text_tensors(config)}
    with torch.device("meta"):
        model = model_class(config)
    stored = folder.as_loaded(keys)  # experts stored one by one are fused as the classes fuse them

    def load(key: str) -> torch.Tensor:
        with safe_open(folder.path / folder.headers[key][2], framework="pt") as handle:
            return handle.get_tensor(key)

    state = {keys[key]: tensor for key, tensor in materialize(((k, stored[k]) for k in keys), load)}
    if config.tie_word_embeddings and not folder.sequence_classifier:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"not loaded: {left[:5]}")
    return model.to(device=device, dtype=dtype).eval(), config


def _per_token(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The model's per-token output of row 0: the logits, or the last hidden states of a text model (the backbone
    `load_first_layers` builds for a sequence-classification folder)."""
    out = model(ids, use_cache=False, **kwargs)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state)[0].float()


@torch.no_grad()
def packed_vs_per_document(model, vocab_size: int, device: torch.device, seed: int = 0) -> tuple[float, float]:
    """(max |packed - per-document output|, max |output|) over every token of DOC_LENGTHS random documents, the
    output being the logits (the last hidden states of a text model)."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab_size, (n,), generator=generator) for n in DOC_LENGTHS]
    ids = torch.cat(docs).unsqueeze(0).to(device)
    cu_seqlens = torch.tensor([0, *DOC_LENGTHS]).cumsum(0).to(device)
    packed = _per_token(model, ids, cu_seqlens=cu_seqlens)
    alone = torch.cat([_per_token(model, d.unsqueeze(0).to(device)) for d in docs])
    return (packed - alone).abs().max().item(), alone.abs().max().item()


def numerics_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """fp32 everywhere (tight: catches a leak of a few tokens, like a conv that ignores boundaries); on CUDA also
    bf16, where the varlen attention kernels run (their leaks move logits by their own scale)."""
    return (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)


def run_packed_numerics(folder: ModelFolder, device: torch.device, report: DoctorReport) -> None:
    name = "numerics.packed_vs_per_document"
    if folder.packed_config is None or report.status("config.weights") in (FAIL, SKIP) \
            or report.status("kernels.selection") in (FAIL, SKIP):  # fmt: skip
        report.add(name, SKIP, "needs a config that builds, complete weights and runnable kernels (see above)")
        return
    from ..modeling.kernel_selection import select_kernels

    started = time.perf_counter()
    n_layers = doctor_layer_count(folder.packed_config.layer_types)
    model, config = load_first_layers(folder, n_layers, device, torch.float32)
    quantity = "hidden state" if folder.sequence_classifier else "logit"
    parts, leaks = [], []
    for dtype in numerics_dtypes(device):
        model.to(dtype)  # A_log / dt_bias stay fp32 (GatedDeltaNet._apply)
        choice = select_kernels(config, device, dtype)
        diff, scale = packed_vs_per_document(model, config.vocab_size, device)
        relative, tolerance = diff / max(scale, 1e-12), RELATIVE_TOLERANCE[dtype]
        dtype_name = str(dtype).removeprefix("torch.")
        paths = f"GDN {choice.gdn}, attention {choice.attention}"
        report.measurements.append(Measurement(
            name, diff, f"max |{quantity} diff|", dtype_name, device.type,
            f"packed vs per-document; {len(DOC_LENGTHS)} documents / {sum(DOC_LENGTHS)} tokens, layers "
            f"0-{n_layers - 1} of {folder.packed_config.num_hidden_layers}, {paths}"))  # fmt: skip
        part = (
            f"{dtype_name} ({paths}): {diff:.3g} = {relative:.2g} of the {quantity} scale {scale:.3g} "
            f"(tolerance {tolerance:g})"
        )
        parts.append(part)
        if relative > tolerance:
            leaks.append(part)
    detail = (
        f"max |packed - per-document {quantity}| {'; '.join(parts)}; {len(DOC_LENGTHS)} documents / "
        f"{sum(DOC_LENGTHS)} tokens, layers 0-{n_layers - 1} of {folder.packed_config.num_hidden_layers}; "
        f"{time.perf_counter() - started:.1f} s"
    )
    if leaks:
        report.add(name, FAIL, "documents leak into each other: " + detail,
                   "a kernel path ignores document boundaries: set gdn_kernel / attention_kernel to 'auto' (or the "
                   "path this check passes with) and report the leaking kernel")  # fmt: skip
    else:
        report.add(name, PASS, detail)


__all__ = [
    "DOC_LENGTHS",
    "doctor_layer_count",
    "load_first_layers",
    "numerics_dtypes",
    "packed_vs_per_document",
    "run_packed_numerics",
]
