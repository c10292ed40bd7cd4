"""Context parallelism (Accelerate's `ParallelismConfig(cp_size=N)`, which the transformers Trainer and
`Accelerator.maybe_context_parallel` apply through torch's `context_parallel`) hands each rank a shard of the
sequence for attention only; the GDN recurrence and causal conv would restart from zero at every shard boundary. So
every way into torch's context parallelism must raise, naming the model's own (`set_context_parallel`,
context_parallel.py, tested in tests/modeling/test_context_parallel.py), never train silently wrong.

The run (context_parallel_guard_worker.py under torchrun, 2 CPU processes over gloo, one CP group of 2) is as close as
CPU allows: `Accelerator(parallelism_config=ParallelismConfig(cp_size=2))` itself refuses to be built on CPU
(Accelerate enables CP only with FSDP2 on a GPU-like device; on MULTI_CPU it raises "ParallelismConfig is only
compatible DistributedType.FSDP (version 2) or ..."), so the worker gives Accelerate's and the Trainer's own methods
(`Accelerator._prepare_cp`, `Trainer._prepare_context_parallel_inputs`, `Accelerator.maybe_context_parallel`)
stand-in objects holding what their constructors would hold: the ParallelismConfig and the device mesh Accelerate
builds from it. torch's `context_parallel` then runs for real: the buffers are sharded in place (each rank sees 8 of
16 columns) and SDPA is patched. Not run here: Accelerate's CP on GPUs with FSDP2 and a real Accelerator/Trainer
object, where the varlen attention kernels never call the patched SDPA, so without the check a shard would train
without any error; the check sits before any kernel is chosen, so it does not depend on them."""

import json
from pathlib import Path

import pytest
from conftest import packed_model
from fixtures_distributed import run_worker_script

from qwen35_packed.modeling.packed_batch import context_parallel_active

WORKER = Path(__file__).resolve().parent / "context_parallel_guard_worker.py"
REFUSAL = "NotImplementedError: torch's context parallelism is active"


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "report.json"
    run_worker_script(WORKER, "--out", out)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def test_accelerate_prepare_refuses_the_model(cp_run):
    # Accelerator.prepare(model) with cp_size > 1 reads transformers' `supports_context_parallel` and raises.
    for report in cp_run:
        assert report["world_size"] == 2 and report["supports_context_parallel"] is False
        assert report["prepare"].startswith("ValueError: Qwen3_5PackedForCausalLM does not support context parallelism")


@pytest.mark.parametrize(
    "path",
    [
        "trainer_step",  # Trainer: its context-parallel inputs and `with cp_context():` around the loss
        "accelerate_loop",  # accelerator.maybe_context_parallel(buffers=[ids, labels, position_ids])
        "accelerate_loop_ids_only",  # the same without position_ids
        "module_wrapper",  # torch's module-wrapper API (`_enable_context_parallel_dispatcher`)
    ],
)
def test_forward_on_a_sequence_shard_raises_naming_the_fix(cp_run, path):
    for report in cp_run:
        assert report["shard_columns"] == 8  # torch really sharded the 16-column row across the 2 ranks
        assert report[path].startswith(REFUSAL), report[path]
        assert "Gated DeltaNet" in report[path] and "cp_size=1" in report[path]
        assert "model.set_context_parallel(group)" in report[path]  # names the way that works


def test_no_refusal_once_context_parallelism_is_off(cp_run):
    assert [report["after"] for report in cp_run] == ["ran", "ran"]
    assert not context_parallel_active()  # nor in an ordinary process


def test_every_config_refuses_context_parallelism():
    # Also with attention layers only (transformers' own check would allow those): packed documents would be cut.
    model = packed_model("dense", full_attention_interval=1)
    assert set(model.config.layer_types) == {"full_attention"}
    assert model.supports_context_parallel is False
    assert packed_model("moe").supports_context_parallel is False
    from peft import get_peft_model

    from qwen35_packed.integrations.lora import lora_config

    # Accelerate reads the attribute on what it is given: a PEFT model passes it through.
    base = packed_model("dense")
    wrapped = get_peft_model(base, lora_config(base, r=2, targets=("attention",)))
    assert getattr(wrapped, "supports_context_parallel", True) is False
