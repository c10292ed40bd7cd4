"""GRPO with a tiny packed vision-language model through PackedGRPOTrainer: the setup tests/integrations/test_grpo_vl.py uses
(a processor with a chat template that places one vision placeholder per image, conversational prompts with one
image each, a toy reward), and, run as a script in the vLLM environment, two GRPO steps with vLLM in colocate mode,
then the final weights pushed and vLLM's log-probs of image-prompt completions compared with the trained and the
initial model's.

    python tests/integrations/grpo_vl_worker.py MODEL_DIR OUT_DIR REPORT.json

The report: TRL's logged metrics per step, every completion the run sampled (token ids), and the push check
(`push_report`)."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

# The chat template of the tiny processor: text as is, an image part as the Qwen3.5 vision placeholder.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def vl_processor(folder):
    """The folder's Qwen3VLProcessor with CHAT_TEMPLATE. Its video processor needs torchvision, which CI's main
    environment does not install: there, the same processor for images only (the PIL image processor)."""
    import transformers
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        processor = transformers.AutoProcessor.from_pretrained(folder)
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
            def check_argument_for_proper_class(self, name, argument):
                if name == "video_processor" and argument is None:
                    return None
                return super().check_argument_for_proper_class(name, argument)

        config = json.loads((Path(folder) / "preprocessor_config.json").read_text())
        image_processor = Qwen2VLImageProcessorPil(
            **{k: v for k, v in config.items() if k not in ("processor_class", "image_processor_type")}
        )
        processor = ImageOnlyQwen3VLProcessor(
            image_processor=image_processor,
            video_processor=None,
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        )
    processor.chat_template = processor.tokenizer.chat_template = CHAT_TEMPLATE
    return processor


def image_dataset(n: int = 8, seed: int = 0):
    """Conversational prompts, each with one random image of 8 to 32 pixels a side (4 to 16 image tokens)."""
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows = [
        {
            "prompt": [{"role": "user", "content": "describe:"}],
            "image": Image.fromarray(
                rng.integers(0, 256, (int(rng.integers(8, 33)), int(rng.integers(8, 33)), 3), dtype=np.uint8)
            ),
        }
        for _ in range(n)
    ]
    return Dataset.from_list(rows)


def letter_count(completions, **kwargs):
    return [float(sum(ch.isalpha() for ch in c[0]["content"])) for c in completions]


def make_trainer(folder, output_dir, trust_remote_code: bool = True, **config):
    from trl import GRPOConfig

    from qwen35_packed.integrations.grpo import PackedGRPOTrainer

    args = GRPOConfig(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        bf16=False,
        trust_remote_code=trust_remote_code,
        model_init_kwargs={"trust_remote_code": trust_remote_code, "dtype": torch.float32},
        **{"max_completion_length": 8, **config},
    )
    return PackedGRPOTrainer(
        model=str(folder),
        reward_funcs=letter_count,
        args=args,
        train_dataset=image_dataset(),
        processing_class=vl_processor(folder),
    )


def push_report(trainer, folder, n_prompts: int = 4, max_tokens: int = 8, seed: int = 0) -> dict:
    """The final weights pushed through the trainer's sync, then completions of image prompts sampled by vLLM
    (with their log-probs) and scored by the trained model and by the model as loaded from the folder: the mean
    |delta log-prob| between each pair (as tests/integrations/grpo_vllm_worker.py does for text models)."""
    import transformers
    from grpo_vllm_worker import unmoved_parameters
    from vllm import SamplingParams

    from qwen35_packed.integrations.grpo import prompt_token_types

    trainer.vllm_generation.sync_weights()
    processor = trainer.processing_class
    config = trainer.model.config
    rows = trainer.train_dataset.select(range(n_prompts))
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["prompt"][0]["content"]}]}],
            tokenize=False,
        )
        for row in rows
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=0)
    outputs = trainer.vllm_generation.llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": [row["image"]]}} for t, row in zip(texts, rows)],
        params,
        use_tqdm=False,
    )
    initial = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()
    engine, scored = [], {"trained": [], "initial": []}
    for text, row, out in zip(texts, rows, outputs):
        inputs = dict(processor(text=[text], images=[row["image"]], return_tensors="pt"))
        if list(out.prompt_token_ids) != inputs["input_ids"][0].tolist():
            raise RuntimeError("vLLM expanded the image prompt into other token ids than the processor")
        completion = list(out.outputs[0].token_ids)
        engine += [entry[t].logprob for t, entry in zip(completion, out.outputs[0].logprobs)]
        ids = torch.cat([inputs["input_ids"], torch.tensor([completion], dtype=torch.long)], dim=1)
        types = prompt_token_types(ids, len(completion), config.image_token_id, config.video_token_id)
        for name, model in (("trained", trainer.model.eval()), ("initial", initial)):
            with torch.no_grad():
                logits = model(
                    input_ids=ids,
                    mm_token_type_ids=types,
                    pixel_values=inputs["pixel_values"],
                    image_grid_thw=inputs["image_grid_thw"],
                    use_cache=False,
                ).logits[0]
            logps = torch.log_softmax(logits[-len(completion) - 1 : -1].double(), -1)
            scored[name].append(logps.gather(-1, torch.tensor(completion, dtype=torch.long)[:, None]).squeeze(-1))
    engine = torch.tensor(engine, dtype=torch.float64)
    trained, initial_logps = torch.cat(scored["trained"]), torch.cat(scored["initial"])
    return {
        "completion_tokens": int(engine.numel()),
        "vllm_vs_trained": (engine - trained).abs().mean().item(),
        "vllm_vs_initial": (engine - initial_logps).abs().mean().item(),
        "trained_vs_initial": (trained - initial_logps).abs().mean().item(),
        "unmoved": unmoved_parameters(trainer.model, initial),
    }


def main(folder, output_dir, report):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # 16 tokens per completion: enough samples that some are vision placeholders (ids 99..102 of 128); a learning
    # rate that moves the weights (the whole model trains)
    trainer = make_trainer(
        folder, output_dir, use_vllm=True, vllm_mode="colocate", max_completion_length=16, learning_rate=1e-4
    )
    completions = []
    trl_generate = trainer.vllm_generation.generate

    def recording_generate(*args, **kwargs):
        result = trl_generate(*args, **kwargs)
        completions.extend(list(ids) for ids in result[1])
        return result

    trainer.vllm_generation.generate = recording_generate
    trainer.train()
    trainer.vllm_generation.generate = trl_generate
    steps = [entry for entry in trainer.state.log_history if "sampling/sampling_logp_difference/max" in entry]
    with open(report, "w") as f:
        json.dump(
            {
                "steps": steps,
                "completions": completions,
                "model_class": type(trainer.model).__name__,
                "push": push_report(trainer, folder),
            },
            f,
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
