"""benchmarks/bench_workload.py's `_adamw` rows: the step a trainer runs (forward, backward, AdamW's step), the
optimizer's state in the row, and nothing of it left for the next row (tiny MoE config on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_workload import Workload, batch_lengths, config_fields, measure, parse_setup  # noqa: E402


def test_adamw_is_the_last_suffix_of_a_setup():
    setup = parse_setup("lora_low_rank_bf16_adapters_moe_chunk_adamw")
    assert (setup.optimizer, setup.bf16_adapters, setup.moe_token_chunk) == ("adamw", True, 16384)
    assert parse_setup("lora_low_rank").optimizer is None
    setup = parse_setup("lora_low_rank_offload_moe_chunk_gdn_chunk_adamw")
    assert (setup.offloading, setup.moe_token_chunk, setup.gdn_token_chunk, setup.optimizer) == (
        "trl",
        16384,
        16384,
        "adamw",
    )
    with pytest.raises(SystemExit, match="unknown setup"):
        parse_setup("lora_adamw_bf16_adapters")


def test_a_layer_chunk_row_runs_every_decoder_layer_in_pieces():
    """`_layer_chunk` sets layer_token_chunk (16,384; --tiny's documents are 64x shorter, so are its pieces) and the
    row's step runs the layers piece by piece."""
    assert parse_setup("lora_low_rank_offload_autocast_layer_chunk_adamw").layer_token_chunk == 16384
    workload = Workload("qwen35_35b_a3b", "ours", torch.device("cpu"), tiny=True)
    workload.apply(parse_setup("lora_low_rank_layer_chunk"))
    assert workload.base.config.layer_token_chunk == 256
    lengths = batch_lengths("doc_131072", tiny=True)
    assert sum(lengths) > 256
    calls = []
    layer = workload.base.model.layers[0]
    hook = layer.input_layernorm.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    row = measure(workload, workload.step_fn(lengths), n_tokens=sum(lengths), warmup=0, reps=1)
    hook.remove()
    assert "error" not in row and calls and max(calls) <= 256


def _adapters(workload) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in workload.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("setup_name", ["lora_low_rank", "lora_low_rank_adamw", "lora_low_rank_bf16_adapters_adamw"])
def test_an_adamw_row_updates_the_adapters_and_reports_the_optimizers_state(setup_name):
    workload = Workload("qwen35_35b_a3b", "ours", torch.device("cpu"), tiny=True)
    setup = parse_setup(setup_name)
    workload.apply(setup)
    step = workload.step_fn(batch_lengths("rl", tiny=True))
    before = _adapters(workload)
    row = measure(workload, step, n_tokens=1, warmup=1, reps=1)
    after = _adapters(workload)
    assert "error" not in row
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    if setup.optimizer is None:
        assert not changed and "optimizer_state_bytes" not in row
        return
    assert changed  # lora_B starts at zero: a step moves it
    trained_bytes = sum(t.numel() * t.element_size() for t in after.values())
    # two states per parameter in its dtype, and a float32 step count per parameter tensor
    assert row["optimizer_state_bytes"] == 2 * trained_bytes + 4 * len(after)
    assert all(p.grad is None for p in workload.model.parameters())  # zeroed as a trainer does after its step


@pytest.mark.parametrize(
    ("option", "chosen_rows", "refusal"),
    [
        ("--memory-at-peak", "rl:lora,doc_131072:lora", "--memory-at-peak: not among --rows"),
        ("--memory-at-peak", "rl:lora_adamw", "optimizer step is not in it"),
        ("--profile", "rl:lora,doc_131072:lora", "--profile: not among --rows"),
    ],
)
def test_rows_to_profile_or_record_at_peak_are_rows_of_the_run_and_no_optimizer_row(
    monkeypatch, option, chosen_rows, refusal
):
    import bench_workload

    argv = ["bench_workload.py", "--model", "qwen35_35b_a3b", "--impl", "ours", "--rows", "rl:lora,rl:lora_adamw"]
    monkeypatch.setattr(sys, "argv", [*argv, option, chosen_rows, "--device", "cpu", "--tiny"])
    with pytest.raises(SystemExit, match=refusal):
        bench_workload.main()


def test_config_fields_read_numbers_as_numbers_and_the_rest_as_strings():
    """--config of bench_workload.py and bench_grpo_step.py: a config validates its fields' types, so 8192 must
    arrive as a number."""
    fields = config_fields("moe_token_chunk=8192,long_document_attention=sdpa,gdn_token_chunk=null")
    assert fields == {"moe_token_chunk": 8192, "long_document_attention": "sdpa", "gdn_token_chunk": None}
    assert config_fields("") == {}
    with pytest.raises(SystemExit, match="not FIELD=VALUE"):
        config_fields("moe_token_chunk")
