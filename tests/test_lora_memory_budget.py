"""benchmarks/lora_memory_budget.py counts, on a meta-device model, exactly the bytes a real training step leaves
held: every weight, the trained parameters' gradients and AdamW's two states (tiny dense and MoE configs, every
setup, one real forward + backward + AdamW step on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_generate import config_kwargs  # noqa: E402
from lora_memory_budget import SETUPS, WITHOUT_EXPERTS, bf16_model, prepare, training_state_bytes  # noqa: E402

TINY_MODELS = {"dense": "qwen35_4b", "moe": "qwen35_35b_a3b"}  # their tiny configs (bench_generate.py --tiny)


def _held_after_a_step(model) -> dict[str, int]:
    """What a real step leaves allocated: weights, gradients, AdamW's state tensors (its step counts left out)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.tensor([0, 9, 24], dtype=torch.int32)
    model(input_ids=ids, cu_seqlens=cu_seqlens, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    states = [t for state in optimizer.state.values() for key, t in state.items() if key != "step"]
    return {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trained_parameters": sum(p.numel() for p in trained),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in trained),
        "adamw_states": sum(t.numel() * t.element_size() for t in states),
    }


@pytest.mark.parametrize("setup, groups, bf16_adapters", SETUPS, ids=[s[0] for s in SETUPS])
@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_the_meta_device_count_is_what_a_real_step_holds(kind, setup, groups, bf16_adapters):
    _, key, kwargs = config_kwargs(TINY_MODELS[kind], tiny=True)
    if kind == "dense" and groups is not None:
        groups = WITHOUT_EXPERTS  # as the script treats a dense model: it has no experts to adapt
    counted = training_state_bytes(
        prepare(bf16_model(key, kwargs, torch.device("meta")), groups, bf16_adapters, rank=4)
    )
    real = prepare(bf16_model(key, kwargs, torch.device("cpu")), groups, bf16_adapters, rank=4).train()
    held = _held_after_a_step(real)
    assert held["trained_parameters"] > 0
    assert {key: counted[key] for key in held} == held
    assert counted["total"] == held["weights"] + held["gradients"] + held["adamw_states"]
    if groups is not None:  # adapters in fp32 beside the bf16 base unless asked for in bf16
        adapter_dtypes = {p.dtype for p in real.parameters() if p.requires_grad}
        assert adapter_dtypes == {torch.bfloat16 if bf16_adapters else torch.float32}
