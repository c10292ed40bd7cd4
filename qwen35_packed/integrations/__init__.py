"""Integrations with the training and serving stack: vLLM plugin, PEFT LoRA config, TRL GRPO trainer.

Each module imports its library (vllm, peft, trl) only when used; none of them is a dependency of the model.
"""
