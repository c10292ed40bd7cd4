"""GRPO with vLLM in colocate mode through examples/grpo.py, then what the run delivered, as a JSON report: run as a
script in the vLLM environment (tests/integrations/test_vllm.py drives it), from the examples folder.

    python tests/integrations/grpo_vllm_worker.py REPORT.json GRPO_ARGS...

After `grpo.main(GRPO_ARGS)` has trained, the trainer's own weight sync pushes the final weights once more (TRL
syncs before generating, so the engine still holds the weights of the step before the last), vLLM samples
completions of the dataset's prompts with their log-probs, and the same completion tokens are scored by the trained
model and by the model as loaded from the folder (the initial weights). The report: the mean |delta log-prob|
between each pair, TRL's logged metrics per step, and the trained parameters that did not move (LoRA: the `lora_B`
tensors still all zeros; full training: the tensors equal to the initial ones)."""

import json
import os
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def unmoved_parameters(model, initial) -> list[str]:
    """LoRA: every `lora_B` (zero at the start) still all zeros; otherwise every parameter equal to `initial`'s."""
    from accelerate.utils import is_peft_model

    if is_peft_model(model):
        lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
        if not lora_b:
            raise RuntimeError("a PEFT model without lora_B parameters")
        return sorted(n for n, p in lora_b.items() if not p.detach().any())
    reference = dict(initial.named_parameters())
    return sorted(n for n, p in model.named_parameters() if torch.equal(p.detach().float(), reference[n].float()))


def sample_completions(trainer, n_prompts: int = 8, max_tokens: int = 8, seed: int = 0):
    """The engine's samples (at the pushed weights) for the dataset's first prompts: per prompt, the prompt +
    completion token ids, the prompt's length and vLLM's log-prob of each sampled token (as GRPO gets them)."""
    from vllm import SamplingParams

    tokenizer = trainer.processing_class
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in trainer.train_dataset.select(range(n_prompts))]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=0)
    outputs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    samples = []
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        logps = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        samples.append((list(prompt) + list(completion.token_ids), len(prompt), logps))
    return samples


def completion_logps(model, samples) -> torch.Tensor:
    """The model's log-probs of every sampled completion token (all sequences packed in one forward)."""
    from qwen35_packed.integrations.vllm_parity import model_logprobs

    docs = [ids for ids, _, _ in samples]
    rows = model_logprobs(model, docs, "packed")  # row t predicts token t + 1
    return torch.cat(
        [
            row[start - 1 :].gather(-1, torch.tensor(ids[start:], dtype=torch.long)[:, None]).squeeze(-1)
            for row, (ids, start, _) in zip(rows, samples)
        ]
    )


def push_report(trainer, folder) -> dict:
    """Push the trained weights through the trainer's sync, sample completions with vLLM, and compare vLLM's
    log-probs of them with the trained model's and the initial model's."""
    import transformers
    from accelerate.utils import is_peft_model

    trainer.vllm_generation.sync_weights()
    samples = sample_completions(trainer)
    engine = torch.tensor([lp for _, _, logps in samples for lp in logps], dtype=torch.float64)
    # with the adapters active: the model the trainer computes with
    trained = (trainer.model.get_base_model() if is_peft_model(trainer.model) else trainer.model).eval()
    initial = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()
    trained_logps, initial_logps = completion_logps(trained.float(), samples), completion_logps(initial, samples)

    def mean_abs(a, b):
        return (a - b).abs().mean().item()

    return {
        "completion_tokens": int(engine.numel()),
        "vllm_vs_trained": mean_abs(engine, trained_logps),
        "vllm_vs_initial": mean_abs(engine, initial_logps),
        "trained_vs_initial": mean_abs(trained_logps, initial_logps),
        "unmoved": unmoved_parameters(trainer.model, initial),
    }


def main(report, *grpo_args):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(EXAMPLES))
    import grpo

    trainer = grpo.main(list(grpo_args))
    folder = grpo_args[grpo_args.index("--model_name_or_path") + 1]
    result = push_report(trainer, folder)
    result["steps"] = [entry for entry in trainer.state.log_history if "reward_std" in entry]
    Path(report).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
