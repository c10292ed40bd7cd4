"""Triton kernel for the GDN short conv: depthwise causal conv + SiLU over a packed stream, split outputs.

`causal_conv1d_silu_split(x, weight, position_in_doc, split_sizes)` computes, for x [N, C] and taps weight [C, K],

    pre[t, c] = sum_j weight[c, j] * x[t - (K-1-j), c]   (taps reaching before t's document start read zero)
    out[t, c] = silu(pre[t, c])

in fp32, and returns one contiguous tensor per channel segment (`split_sizes`, e.g. q | k | v) in x's dtype. The
consumers get contiguous q, k and v without a copy, and the backward reads their three gradients where they are
instead of concatenating them into an [N, C] tensor first.

Forward: grid (row blocks, channel blocks) per segment; a program reads its [BLOCK_T, BLOCK_C] tile of x at the K
lags (the K-1 extra rows come from cache), writes its tile of the segment's output: about one read of x and one
write of the outputs.

Backward: dpre = dy * silu'(pre); dx[t] = sum_j weight[c, K-1-j] * dpre[t + j] over the tokens t + j of t's
document; dw[c, K-1-j] = sum_t dpre[t] * x[t - j]. A program owns BLOCK_C channels of a segment and CHUNKS
consecutive row chunks. A chunk is BLOCK_T rows of which the last K-1 are lookahead (chunks advance by
BLOCK_T - (K-1) rows): it loads x at the K lags once, computes the pre-activation and dpre once per row, and reads
dpre at the K row shifts its dx needs through `tl.gather` along the rows. The program keeps K fp32 per-row dw
tiles that it reduces over rows at the end into its [BLOCK_C, K] dw partial. The partials ([row programs, C, K]
fp32) are summed with torch: deterministic, no atomics. A segment whose gradient is None contributes zeros. No
[N, C] temporaries. (Recomputing the pre-activation and its sigmoid at each of the K shifts instead, from 2K-1 loads
of x, gives the same dx bit for bit and is slower: results/benchmarks/2026-12-01-conv.json.)

Boundaries come from `position_in_doc` (offset of every token from its document start): tap j of token t is read
only when position_in_doc[t] >= K-1-j, so no token reaches another document, and documents shorter than K work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_support import INTERPRETED, KERNEL_DTYPES, TRITON_VERSION, check_matrix, launch, tl, triton

# The kernels keep tuples of tiles (Triton's tuple support). Verified with triton 3.6.0 (CPU interpreter, ptxas for
# sm_90, the H200); older releases are not offered.
TRITON_CONV_AVAILABLE = TRITON_VERSION is not None and TRITON_VERSION >= (3, 6)


@dataclass(frozen=True)
class ConvBlocks:
    """Tile sizes (powers of two) and warps per program. A forward program covers forward_rows x forward_channels;
    a backward program backward_chunks chunks of backward_rows x backward_channels, the K-1 lookahead rows included
    (a kernel longer than the tile gets a tile of the smallest power of two >= K instead).

    The defaults are the fastest of the configurations benchmarks/bench_conv.py checked and timed on an H200 (RL
    batch, q | k | v of the 1.4B config; results/benchmarks/2026-12-01-conv.json, against FLA's causal_conv1d)."""

    forward_rows: int = 32
    forward_channels: int = 128
    forward_warps: int = 4
    backward_rows: int = 32
    backward_channels: int = 64
    backward_chunks: int = 16
    backward_warps: int = 4


DEFAULT_BLOCKS = ConvBlocks()


if TRITON_CONV_AVAILABLE:

    @triton.jit(do_not_specialize=["n_rows"])
    def _conv_silu_forward_kernel(
        x_ptr, w_ptr, pos_ptr, y_ptr, n_rows, n_channels, channel_offset, seg_channels,
        KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok = rows < n_rows
        col_ok = cols < seg_channels
        channels = channel_offset + cols
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
        pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for lag in tl.static_range(KERNEL):  # lag 0 first: the order of the reference's sum
            tap = tl.load(w_ptr + channels * KERNEL + (KERNEL - 1 - lag), mask=col_ok, other=0.0).to(tl.float32)
            inside = row_ok & (pos >= lag)  # the tap stays inside the token's document
            x = tl.load(x_ptr + (rows - lag)[:, None] * n_channels + channels[None, :],
                        mask=inside[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
            pre += x * tap[None, :]
        out = pre * tl.sigmoid(pre)
        tl.store(y_ptr + rows[:, None] * seg_channels + cols[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip

    @triton.jit
    def _taps_by_lag(w_ptr, channels, col_ok, KERNEL: tl.constexpr):
        # w[lag] = weight[:, K-1-lag] in fp32: the tap applied to the input `lag` rows back.
        w = ()
        for lag in tl.static_range(KERNEL):
            w = w + (tl.load(w_ptr + channels * KERNEL + (KERNEL - 1 - lag), mask=col_ok, other=0.0).to(tl.float32),)
        return w

    @triton.jit
    def _zero_dw_rows(KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        # dw_rows[lag]: per-row partial sums of dw[:, K-1-lag], reduced over rows once at the end.
        dw_rows = ()
        for lag in tl.static_range(KERNEL):
            dw_rows = dw_rows + (tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32),)
        return dw_rows

    @triton.jit
    def _store_dw_partial(
        dw_partial_ptr, dw_rows, pid_t, n_channels, channels, col_ok,
        KERNEL: tl.constexpr, KERNEL_POW2: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # The program's [BLOCK_C, K] dw partial: dw_rows reduced over rows.
        taps = tl.arange(0, KERNEL_POW2)
        dw = tl.zeros([BLOCK_C, KERNEL_POW2], dtype=tl.float32)
        for lag in tl.static_range(KERNEL):
            dw += tl.where(taps[None, :] == KERNEL - 1 - lag, tl.sum(dw_rows[lag], axis=0)[:, None], 0.0)
        tl.store(dw_partial_ptr + (pid_t.to(tl.int64) * n_channels + channels[:, None]) * KERNEL + taps[None, :], dw,
                 mask=col_ok[:, None] & (taps < KERNEL)[None, :])  # fmt: skip

    @triton.jit(do_not_specialize=["n_rows"])
    def _conv_silu_backward_kernel(
        x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dw_partial_ptr, n_rows, n_channels, channel_offset, seg_channels,
        KERNEL: tl.constexpr, KERNEL_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
        CHUNKS: tl.constexpr,
    ):  # fmt: skip
        OWN: tl.constexpr = BLOCK_T - (KERNEL - 1)  # rows whose dx and dw a chunk writes; the rest is lookahead
        pid_t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < seg_channels
        channels = channel_offset + cols
        lanes = tl.arange(0, BLOCK_T)
        own = (lanes < OWN)[:, None]
        w = _taps_by_lag(w_ptr, channels, col_ok, KERNEL)
        dw_rows = _zero_dw_rows(KERNEL, BLOCK_T, BLOCK_C)
        first_row = pid_t.to(tl.int64) * (OWN * CHUNKS)
        for chunk in range(CHUNKS):
            rows = first_row + chunk * OWN + lanes
            in_stream = rows < n_rows
            pos = tl.load(pos_ptr + rows, mask=in_stream, other=0)
            # x[rows - lag] where the tap stays inside the token's document, else zero; kept for dw.
            xs = ()
            pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for lag in tl.static_range(KERNEL):  # lag 0 first: the forward's summation order
                x = tl.load(
                    x_ptr + (rows - lag)[:, None] * n_channels + channels[None, :],
                    mask=(in_stream & (pos >= lag))[:, None] & col_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                xs = xs + (x,)
                pre += x * w[lag][None, :]
            dy = tl.load(dy_ptr + rows[:, None] * seg_channels + cols[None, :],
                         mask=in_stream[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
            sig = tl.sigmoid(pre)
            dpre = dy * sig * (1.0 + pre * (1.0 - sig))  # zero past the stream's end (dy reads zero there)
            dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for shift in tl.static_range(KERNEL):
                if shift == 0:
                    later = dpre
                else:
                    # dpre of row + shift; own rows reach at most the chunk's last row, lookahead rows are not kept.
                    ahead = tl.minimum(lanes + shift, BLOCK_T - 1)
                    later = tl.gather(dpre, tl.broadcast_to(ahead[:, None], (BLOCK_T, BLOCK_C)), 0)
                    # A token whose lag-`shift` tap leaves its document does not reach this row.
                    pos_ahead = tl.load(pos_ptr + rows + shift, mask=rows + shift < n_rows, other=0)
                    later = tl.where((pos_ahead >= shift)[:, None], later, 0.0)
                dx += later * w[shift][None, :]
            tl.store(dx_ptr + rows[:, None] * n_channels + channels[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=own & in_stream[:, None] & col_ok[None, :])  # fmt: skip
            updated = ()
            for lag in tl.static_range(KERNEL):
                updated = updated + (dw_rows[lag] + tl.where(own, dpre * xs[lag], 0.0),)
            dw_rows = updated
        _store_dw_partial(dw_partial_ptr, dw_rows, pid_t, n_channels, channels, col_ok, KERNEL, KERNEL_POW2, BLOCK_C)


def _segments(split_sizes):
    offset = 0
    for size in split_sizes:
        yield offset, size
        offset += size


class _CausalConv1dSiluSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, position_in_doc, split_sizes, blocks):
        n_rows, n_channels = x.shape
        kernel = weight.shape[1]
        outs = tuple(x.new_empty(n_rows, size) for size in split_sizes)
        for out, (offset, size) in zip(outs, _segments(split_sizes)):
            grid = (triton.cdiv(n_rows, blocks.forward_rows), triton.cdiv(size, blocks.forward_channels))
            launch(
                _conv_silu_forward_kernel, grid, x, weight, position_in_doc, out, n_rows, n_channels, offset, size,
                KERNEL=kernel, BLOCK_T=blocks.forward_rows, BLOCK_C=blocks.forward_channels,
                num_warps=blocks.forward_warps,
            )  # fmt: skip
        ctx.save_for_backward(x, weight, position_in_doc)
        ctx.split_sizes, ctx.blocks = split_sizes, blocks
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, weight, position_in_doc = ctx.saved_tensors
        blocks = ctx.blocks
        n_rows, n_channels = x.shape
        kernel = weight.shape[1]
        tile_rows = max(blocks.backward_rows, triton.next_power_of_2(kernel))  # more rows than the K-1 lookahead
        chunk_rows = tile_rows - (kernel - 1)  # the rows a chunk writes
        # Few chunks for short streams: no program loops over rows that do not exist.
        chunks = max(1, min(blocks.backward_chunks, triton.cdiv(max(n_rows, 1), chunk_rows)))
        row_programs = triton.cdiv(n_rows, chunk_rows * chunks)
        dx = torch.empty_like(x)
        dw_partial = torch.empty(row_programs, n_channels, kernel, dtype=torch.float32, device=x.device)
        for grad, (offset, size) in zip(grads, _segments(ctx.split_sizes)):
            if grad is None:  # this output does not reach the loss
                dx[:, offset : offset + size].zero_()
                dw_partial[:, offset : offset + size].zero_()
                continue
            grid = (row_programs, triton.cdiv(size, blocks.backward_channels))
            launch(
                _conv_silu_backward_kernel, grid,
                x, weight, position_in_doc, grad.contiguous(), dx, dw_partial, n_rows, n_channels, offset, size,
                KERNEL=kernel, KERNEL_POW2=triton.next_power_of_2(kernel), BLOCK_T=tile_rows,
                BLOCK_C=blocks.backward_channels, CHUNKS=chunks, num_warps=blocks.backward_warps,
            )  # fmt: skip
        dweight = dw_partial.sum(0).to(weight.dtype)
        return dx, dweight, None, None, None


def causal_conv1d_silu_split(
    x: torch.Tensor,
    weight: torch.Tensor,
    position_in_doc: torch.Tensor,
    split_sizes,
    blocks: ConvBlocks = DEFAULT_BLOCKS,
) -> tuple[torch.Tensor, ...]:
    """silu(depthwise causal conv of x with `weight`, per document), one contiguous output per channel segment.

    x [N, C] contiguous (bf16 / fp16 / fp32); weight [C, K] (`conv1d.weight.squeeze(1)`); position_in_doc integer
    [N] (`PackedSequence.position_in_doc()`); split_sizes positive ints summing to C. Returns tensors [N, size] in
    x's dtype, computed with fp32 accumulation; differentiable in x and weight.
    """
    if not TRITON_CONV_AVAILABLE:
        raise RuntimeError(
            "causal_conv1d_silu_split needs Triton >= 3.6 (installed: "
            f"{'none' if TRITON_VERSION is None else '.'.join(map(str, TRITON_VERSION))})"
        )
    check_matrix("x", x, "[N, C]")
    n_rows, n_channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != n_channels or weight.shape[1] < 1 or weight.dtype not in KERNEL_DTYPES:
        raise ValueError(f"weight must be [C={n_channels}, K] in bf16, fp16 or fp32, got {tuple(weight.shape)} "
                         f"{weight.dtype}")  # fmt: skip
    if position_in_doc.shape != (n_rows,) or position_in_doc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"position_in_doc must be an integer tensor [N={n_rows}], got "
                         f"{tuple(position_in_doc.shape)} {position_in_doc.dtype}")  # fmt: skip
    split_sizes = tuple(int(s) for s in split_sizes)
    if not split_sizes or any(s <= 0 for s in split_sizes) or sum(split_sizes) != n_channels:
        raise ValueError(f"split_sizes {list(split_sizes)} must be positive and sum to C={n_channels}")
    devices = {x.device, weight.device, position_in_doc.device}
    if len(devices) != 1:
        raise ValueError(f"x, weight and position_in_doc must be on one device, got {sorted(map(str, devices))}")
    if not x.is_cuda and not INTERPRETED:
        raise ValueError(f"causal_conv1d_silu_split runs on CUDA tensors, got {x.device}")
    return _CausalConv1dSiluSplit.apply(x, weight.contiguous(), position_in_doc.contiguous(), split_sizes, blocks)
