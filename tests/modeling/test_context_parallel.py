"""Context parallelism (context_parallel.py) against the unsharded model: gloo on CPU, fp32, 2 and 4 ranks
(context_parallel_worker.py under torchrun). For every case the shard's logits, the sum of the ranks' losses and
the sum of the ranks' parameter gradients must equal the unsharded row's within 1e-5; each planted fault (one
mechanism replaced by what a shard does without it) must break a case it is run on. Single-process checks of the
inputs a shard refuses are below."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import packed_model, tiny_kwargs
from fixtures_distributed import run_worker_script

from qwen35_packed.modeling.context_parallel import shard_packed_row

WORKER = Path(__file__).resolve().parent / "context_parallel_worker.py"
sys.path.insert(0, str(WORKER.parent))
from context_parallel_worker import CASES, FAULT_CASES  # noqa: E402

TOLERANCE = 1e-5


def run_worker(tmp_path_factory, world: int) -> dict:
    out = tmp_path_factory.mktemp(f"cp{world}") / "report.json"
    run_worker_script(WORKER, "--out", out, nproc=world, timeout=900)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return {world: run_worker(tmp_path_factory, world) for world in (2, 4)}


@pytest.mark.parametrize(
    "world,case", [(world, case) for world, cases in CASES.items() for case in [*cases, "fsdp2_on_the_same_ranks"]]
)
def test_sharded_row_equals_unsharded(reports, world, case):
    result = reports[world]["exact"][case]
    assert result["logits"] <= TOLERANCE, result
    assert result["loss"] <= TOLERANCE, result
    assert result["grads"] <= TOLERANCE, result
    assert result["grad_scale"] > 1e-2  # the gradients compared are not all zero


@pytest.mark.parametrize("world,fault", [(world, fault) for world, faults in FAULT_CASES.items() for fault in faults])
def test_planted_fault_is_caught(reports, world, fault):
    """Each mechanism is needed: without it the forward (or, for the targets, the loss and gradients) of some case
    differs from the unsharded row's by at least ten times the tolerance."""
    results = reports[world][fault]
    assert set(results) == set(FAULT_CASES[world][fault]) and results
    worst = max(max(result["logits"], result["loss"], result["grads"]) for result in results.values())
    assert worst > 10 * TOLERANCE, results


def test_shard_packed_row_cuts_contiguous_even_shards():
    positions = torch.cat([torch.arange(4), torch.arange(7)])[None]
    ids = torch.arange(11)[None]
    shards = [shard_packed_row({"input_ids": ids, "position_ids": positions, "labels": ids}, r, 3) for r in range(3)]
    assert [s["input_ids"].shape[1] for s in shards] == [4, 4, 3]
    assert torch.equal(torch.cat([s["input_ids"] for s in shards], dim=1), ids)
    assert torch.equal(torch.cat([s["position_ids"] for s in shards], dim=1), positions)
    for shard in shards:  # the row's boundaries on every rank
        assert shard["cu_seqlens"].tolist() == [0, 4, 11]
    with pytest.raises(ValueError, match="at least 3 tokens"):
        shard_packed_row({"input_ids": ids[:, :2], "position_ids": positions[:, :2]}, 0, 3)


@pytest.fixture
def single_rank_group(tmp_path):
    """A gloo group of one process (the model's context-parallel path with nothing to exchange); a group of this
    process alone where an earlier test of the session left a default group (Accelerate's state does)."""
    if dist.is_initialized():
        yield dist.new_group([dist.get_rank()], backend="gloo")
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_one_rank_group_equals_the_plain_forward(single_rank_group):
    model = packed_model("dense")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    plain = model(input_ids=ids, cu_seqlens=cu, labels=ids)
    model.set_context_parallel(single_rank_group)
    sharded = model(input_ids=ids, cu_seqlens=cu, labels=ids)
    torch.testing.assert_close(sharded.logits, plain.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(sharded.loss, plain.loss, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "inputs,message",
    [
        ({"input_ids": torch.zeros(2, 6, dtype=torch.long)}, "one packed row"),
        ({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, "boundaries must be given"),
        ({"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]])}, "no padding"),
        ({"position_ids": torch.tensor([[2, 3, 4, 0, 1, 2]])}, "first shard of the row must start a document"),
        ({"position_ids": torch.tensor([[0, 1, 3, 0, 1, 2]])}, "count on within each document"),
        ({"cu_seqlens": torch.tensor([0, 4, 9])}, "whole row's boundaries"),
        ({"cu_seqlens": torch.tensor([0, 6]), "use_cache": True}, "no cache"),
        ({"cu_seqlens": torch.tensor([0, 6]), "output_attentions": True}, "output_attentions"),
    ],
)
def test_refused_shard_inputs(single_rank_group, inputs, message):
    model = packed_model("dense")
    model.set_context_parallel(single_rank_group)
    given = {"input_ids": torch.zeros(1, 6, dtype=torch.long), **inputs}
    with pytest.raises(ValueError, match=message):
        model(**given)


def test_router_logits_with_an_aux_loss_are_refused(single_rank_group):
    """TRL adds the load-balancing loss of the router logits it gets back: on a shard's logits that would be a
    different number, so a forward asked for them with a nonzero coefficient raises."""
    model = packed_model("moe", router_aux_loss_coef=0.01)
    model.set_context_parallel(single_rank_group)
    ids = torch.zeros(1, 6, dtype=torch.long)
    cu = torch.tensor([0, 6])
    with pytest.raises(ValueError, match="router_aux_loss_coef > 0 under context parallelism"):
        model(input_ids=ids, cu_seqlens=cu, labels=ids, output_router_logits=True)
    with pytest.raises(ValueError, match="router_aux_loss_coef > 0 under context parallelism"):
        model.model(input_ids=ids, cu_seqlens=cu, output_router_logits=True)  # the backbone, as TRL calls it
    model(input_ids=ids, cu_seqlens=cu, labels=ids)  # without router logits it runs
    model.config.router_aux_loss_coef = 0.0
    assert len(model(input_ids=ids, cu_seqlens=cu, output_router_logits=True).router_logits) > 0


def test_sequence_classification_is_refused(single_rank_group):
    from qwen35_packed import Qwen3_5PackedConfig, Qwen3_5PackedForSequenceClassification

    model = Qwen3_5PackedForSequenceClassification(Qwen3_5PackedConfig(**tiny_kwargs("dense"), num_labels=2))
    model.set_context_parallel(single_rank_group)
    with pytest.raises(ValueError, match="sequence classification is not available under context parallelism"):
        model(input_ids=torch.zeros(1, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 6]))
