"""GDN short conv on one GPU: our Triton kernel (tile configurations) against FLA's causal_conv1d.

The RL-shaped batch of bench_train_step.py (16 documents, 26,354 tokens) through the conv of the 1.4B benchmark
config (C = 8192 = q 2048 | k 2048 | v 4096, K = 4, bf16). Each Triton configuration is first checked against the
boundary-masked PyTorch formula (outputs and gradients), then timed with CUDA events: forward, and forward +
backward with the gradient of all three outputs. Prints a table, writes JSON (--out), and with --best FILE writes
the fastest checked configuration as ConvBlocks keyword arguments.

    python benchmarks/bench_conv.py [--out FILE] [--best FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_step import batches  # noqa: E402

from qwen35_packed.modeling import kernel_selection, reference_kernels  # noqa: E402
from qwen35_packed.modeling.packing import build_packed_sequence  # noqa: E402
from qwen35_packed.modeling.triton_conv import DEFAULT_BLOCKS, ConvBlocks, causal_conv1d_silu_split  # noqa: E402

SPLIT = (2048, 2048, 4096)


def cuda_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def candidates():
    yield DEFAULT_BLOCKS
    for f_rows, f_ch, f_warps in itertools.product((32, 64), (64, 128, 256), (4, 8)):
        yield dataclasses.replace(DEFAULT_BLOCKS, forward_rows=f_rows, forward_channels=f_ch, forward_warps=f_warps)
    # Backward tiles include the K-1 = 3 lookahead rows, so they start at 16 rows.
    for b_rows, b_ch, b_chunks, b_warps in itertools.product((16, 32, 64), (32, 64, 128), (8, 16), (4, 8)):
        yield dataclasses.replace(
            DEFAULT_BLOCKS,
            backward_rows=b_rows,
            backward_channels=b_ch,
            backward_chunks=b_chunks,
            backward_warps=b_warps,
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--best", default=None)
    args = parser.parse_args()
    lengths = batches()["rl_longtail_x16"]
    n = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    packed = build_packed_sequence((1, n), torch.device("cuda"), cu_seqlens=cu)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, sum(SPLIT), device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = (torch.randn(sum(SPLIT), 4, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.5).requires_grad_()
    grads = [torch.randn(n, s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in SPLIT]
    pos = packed.position_in_doc()

    # Reference: the boundary-masked formula in fp32.
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = reference_kernels.torch_causal_conv1d_varlen(x32, w32, pos)
    ref.backward(torch.cat(grads, dim=1).float())
    ref_out, ref_dx, ref_dw = ref.detach(), x32.grad, w32.grad

    def check(blocks):
        outs = causal_conv1d_silu_split(x, weight, pos, SPLIT, blocks)
        torch.autograd.backward(outs, grads)
        out = torch.cat(outs, dim=1).float()
        half_ulp = (ref_out.abs() * torch.finfo(x.dtype).eps / 2).clamp(min=1e-30)
        err = {
            "out_in_half_ulps": ((out - ref_out).abs() / half_ulp).max().item(),
            "dx_rel": ((x.grad.float() - ref_dx).norm() / ref_dx.norm()).item(),
            "dw_rel": ((weight.grad.float() - ref_dw).norm() / ref_dw.norm()).item(),
        }
        x.grad = weight.grad = None
        return err

    rows, seen = [], set()
    for blocks in candidates():
        if blocks in seen:
            continue
        seen.add(blocks)
        try:
            err = check(blocks)
            fwd = cuda_ms(lambda: causal_conv1d_silu_split(x.detach(), weight.detach(), pos, SPLIT, blocks))
            both = cuda_ms(
                lambda: torch.autograd.backward(causal_conv1d_silu_split(x, weight, pos, SPLIT, blocks), grads)
            )
        except Exception as exc:  # a tile configuration the compiler rejects (registers, shared memory)
            rows.append({"blocks": dataclasses.asdict(blocks), "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        x.grad = weight.grad = None
        # One rounding of an fp32 result (half an ulp, a little slack for summation order); bf16 gradients.
        ok = err["out_in_half_ulps"] <= 1.01 and err["dx_rel"] < 1e-2 and err["dw_rel"] < 1e-2
        rows.append(
            {
                "blocks": dataclasses.asdict(blocks),
                "forward_ms": fwd,
                "forward_backward_ms": both,
                "backward_ms": both - fwd,
                "errors": err,
                "ok": ok,
            }
        )
        print(rows[-1], flush=True)

    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": n,
        "documents": len(lengths),
        "split": SPLIT,
        "rows": rows,
    }
    if kernel_selection.FLA_AVAILABLE:
        # Own leaves: FLA's timed backwards must not accumulate into the gradients the final check reads.
        x_fla, w_fla = x.detach().unsqueeze(0).requires_grad_(), weight.detach().requires_grad_()
        cu64, cu_cpu = packed.cu_seqlens_int64(), packed.cu_seqlens_cpu()
        dy = torch.cat(grads, dim=1).unsqueeze(0)

        def fla():
            return kernel_selection.fla_causal_conv1d(
                x_fla, weight=w_fla, activation="silu", cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu
            )[0]

        with torch.no_grad():
            fla_fwd = cuda_ms(fla)

        # FLA's q, k, v are slices of one output: the consumers copy them to contiguous memory, and their
        # gradients are concatenated before its backward; those copies are timed with it.
        def fla_split_both():
            out = fla()
            parts = [p.contiguous() for p in out.split(SPLIT, dim=-1)]
            torch.autograd.backward(parts, [g.unsqueeze(0) for g in grads])

        result["fla"] = {
            "forward_ms": fla_fwd,
            "forward_backward_ms": cuda_ms(lambda: fla().backward(dy)),
            "forward_backward_with_split_copies_ms": cuda_ms(fla_split_both),
        }
    good = [r for r in rows if r.get("ok")]
    best_fwd = min(good, key=lambda r: r["forward_ms"])["blocks"]
    best_bwd = min(good, key=lambda r: r["backward_ms"])["blocks"]
    best = {
        **{k: v for k, v in best_fwd.items() if k.startswith("forward")},
        **{k: v for k, v in best_bwd.items() if k.startswith("backward")},
    }
    best_blocks = ConvBlocks(**best)
    err = check(best_blocks)
    result["best"] = {
        "blocks": best,
        "errors": err,
        "forward_ms": cuda_ms(lambda: causal_conv1d_silu_split(x.detach(), weight.detach(), pos, SPLIT, best_blocks)),
        "forward_backward_ms": cuda_ms(
            lambda: torch.autograd.backward(causal_conv1d_silu_split(x, weight, pos, SPLIT, best_blocks), grads)
        ),
    }
    print(f"\n{'kernel':<40}{'forward ms':>12}{'fwd+bwd ms':>12}")
    default = next(r for r in rows if r["blocks"] == dataclasses.asdict(DEFAULT_BLOCKS))
    print(
        f"{'triton, default blocks':<40}{default.get('forward_ms', float('nan')):>12.3f}"
        f"{default.get('forward_backward_ms', float('nan')):>12.3f}"
    )
    print(
        f"{'triton, fastest checked blocks':<40}{result['best']['forward_ms']:>12.3f}"
        f"{result['best']['forward_backward_ms']:>12.3f}"
    )
    if "fla" in result:
        print(
            f"{'FLA causal_conv1d':<40}{result['fla']['forward_ms']:>12.3f}{result['fla']['forward_backward_ms']:>12.3f}"
        )
        print(f"{'FLA + split copies':<40}{'':>12}{result['fla']['forward_backward_with_split_copies_ms']:>12.3f}")
    print("fastest blocks:", best)
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).resolve().parent.parent / "results" / "benchmarks" / (f"{result['date']}-conv.json")
    )
    out.write_text(json.dumps(result, indent=1))
    if args.best:
        Path(args.best).write_text(json.dumps(best))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
