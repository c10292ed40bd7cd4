"""What the GPU tests share (test_gpu*.py, context_parallel_gpu_worker.py): the 4-layer text config at hidden size
512, the writer of the measured numbers, norm weights moved off their init, and the MoE routing a forward takes."""

import json
import os

import torch

GPU_CONFIG = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [6, 5, 5]},
)


def write_gpu_results(results: dict, env: str, **extra) -> None:
    """Where the environment variable `env` names a file: `results`, the device, torch's version, whether FLA is
    available and `extra`, written to it as JSON."""
    from qwen35_packed.modeling import kernel_selection

    path = os.environ.get(env)
    if path:
        results["device"] = torch.cuda.get_device_name()
        results["torch"] = torch.__version__
        results["fla_available"] = kernel_selection.FLA_AVAILABLE
        results.update(extra)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def move_norms_off_init(model) -> None:
    """Every norm weight moved off its init (+ 0.1 N(0, 1)), so that every layer's scale matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)


def routes_of(model, run):
    """(what `run()` returns, each MoE layer's top-k expert ids of every token, captured while it ran: [layers,
    tokens, k])."""
    captured, hooks = [], []
    for module in model.modules():
        if type(module).__name__ == "TopKRouter":
            hooks.append(module.register_forward_hook(lambda m, a, out: captured.append(out[2].sort(-1).values)))
    try:
        return run(), captured
    finally:
        for h in hooks:
            h.remove()
