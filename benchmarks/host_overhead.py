"""Host time of the elementwise chains per call: eager, `torch.compile` of the eager formula, and this project's
Triton kernels (CUDA only).

On tensors so small that their kernels cost next to nothing, the wall time of a call is what the host spends on
it: Python, the dispatcher, autograd, and for the compiled form dynamo's frame evaluation and AOTAutograd's
runtime wrappers. A host-bound training step (small batches, many layers) pays that for every chain of every layer,
forward, backward and the recomputation in the backward. Times per call: forward with autograd recording, forward
under no_grad, forward + backward; then a whole tiny model's packed training step per elementwise mode the model
has (eager, and Triton on CUDA; the compiled form of the chains was a model mode until the Triton kernels replaced
it, results/gpu/2026-12-01-h200-host-overhead.json).

    python benchmarks/host_overhead.py [--device cpu|cuda] [--out FILE]

Writes results/cpu/<date>-host-overhead.json (results/gpu/ on CUDA) unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import tiny_kwargs  # noqa: E402

from qwen35_packed import Qwen3_5PackedConfig, Qwen3_5PackedForCausalLM  # noqa: E402
from qwen35_packed.modeling import kernel_selection, kernels, reference_kernels, triton_elementwise  # noqa: E402
from qwen35_packed.modeling.kernel_set import kernel_set  # noqa: E402


def per_call_us(fn, device, reps=300):
    for _ in range(20):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def chains(device):
    """name -> (eager formula, its Triton form, inputs): the chains of kernels.py on tiny leaves."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_()

    x, w, g, u, gate_up, rows_weight = leaf(8, 64), leaf(64), leaf(8, 64), leaf(8, 64), leaf(8, 128), leaf(8)
    a, b, a_log, dt_bias = leaf(8, 8), leaf(8, 8), leaf(8), leaf(8)
    return {
        "rms_norm": (reference_kernels.zero_centred_rms_norm, triton_elementwise.rms_norm, (x, w, 1e-6)),
        "swiglu": (reference_kernels.swiglu, triton_elementwise.swiglu, (g, u)),
        "sigmoid_gate": (reference_kernels.sigmoid_gate, triton_elementwise.sigmoid_gate, (g, u)),
        "weighted_swiglu": (
            reference_kernels.weighted_swiglu,
            triton_elementwise.weighted_swiglu,
            (gate_up, rows_weight),
        ),
        "gdn_gates": (reference_kernels.gdn_gates, triton_elementwise.gdn_gates, (a, b, a_log, dt_bias)),
    }


def forms(formula, triton_form, modes):
    return {
        mode: {"eager": formula, "compiled": kernels._compiled(formula), "triton": triton_form}[mode] for mode in modes
    }


def first(out):
    return out[0] if isinstance(out, tuple) else out


def model_step_ms(choice, device, reps=20):
    kwargs = tiny_kwargs("dense")
    torch.manual_seed(0)
    model = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**kwargs)).to(device).train()
    ids = torch.randint(0, kwargs["vocab_size"], (1, 64), device=device)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32, device=device)
    # The modes side by side on one device, whatever auto would pick there.
    model.model.inject_kernels(kernel_set(choice))
    return per_call_us(lambda: model(input_ids=ids, labels=ids, cu_seqlens=cu).loss.backward(), device, reps) / 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    modes = ["eager", "compiled"] + (["triton"] if device.type == "cuda" else [])
    choices = {mode: kernel_selection.KernelChoice("torch", "sdpa", mode) for mode in modes if mode != "compiled"}
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "chains_us_per_call": {},
        "tiny_model_step_ms": {},
        "tiny_model_layers": tiny_kwargs("dense")["num_hidden_layers"],
    }
    print(f"{'chain':<17}{'mode':<10}{'forward us':>12}{'no_grad us':>12}{'fwd+bwd us':>12}")
    for name, (formula, triton_form, inputs) in chains(device).items():
        for mode, fn in forms(formula, triton_form, modes).items():
            with torch.no_grad():
                no_grad = per_call_us(lambda: fn(*inputs), device)
            row = {
                "forward": per_call_us(lambda: fn(*inputs), device),
                "forward_no_grad": no_grad,
                "forward_backward": per_call_us(lambda: first(fn(*inputs)).sum().backward(), device),
            }
            result["chains_us_per_call"].setdefault(name, {})[mode] = {k: round(v, 1) for k, v in row.items()}
            print(f"{name:<17}{mode:<10}{row['forward']:>12.1f}{no_grad:>12.1f}{row['forward_backward']:>12.1f}")
    for mode, choice in choices.items():
        result["tiny_model_step_ms"][mode] = round(model_step_ms(choice, device), 2)
        print(
            f"tiny model ({result['tiny_model_layers']} layers) step, {mode}: {result['tiny_model_step_ms'][mode]} ms"
        )
    folder = "gpu" if device.type == "cuda" else "cpu"
    out = Path(args.out) if args.out else ROOT / "results" / folder / f"{result['date']}-host-overhead.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
