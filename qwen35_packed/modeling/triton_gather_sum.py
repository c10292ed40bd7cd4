"""Triton kernel for the MoE top-k combine: rows gathered by index and summed in groups, in one pass.

`gather_sum_rows(src, index, group)` computes, for src [M, H] and index [G * group],

    out[g] = src[index[g * group]] + src[index[g * group + 1]] + ... + src[index[g * group + group - 1]]

in fp32, in that order, rounded once to src's dtype. With `addend` (a second [M, H] tensor) each source row is
first `src[i] + addend[i]` rounded to src's dtype, as that add alone would give it: the MoE's down-projection output
and its LoRA's, combined without writing their sum. The eager form (`src[index].view(G, group, H).sum(1)`) writes
the gathered [G * group, H] copy and reads it back for the reduction; this kernel reads each source row once and
writes only the [G, H] result. Each group is summed on its own, in slot order: the result of a group does not depend
on the other groups, so a packed document combines exactly as it does alone.

A program sums BLOCK_G groups over BLOCK_H columns: per slot it loads the groups' row indices and their
[BLOCK_G, BLOCK_H] tile of source rows (contiguous along H) and adds it to an fp32 accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_support import INTERPRETED, check_matrix, launch, tl, triton

TRITON_GATHER_SUM_AVAILABLE = triton is not None


@dataclass(frozen=True)
class GatherSumBlocks:
    """Groups and columns per program (powers of two) and warps per program."""

    groups: int = 4
    columns: int = 512
    warps: int = 4


DEFAULT_BLOCKS = GatherSumBlocks()


if TRITON_GATHER_SUM_AVAILABLE:

    @triton.jit(do_not_specialize=["n_groups"])
    def _gather_sum_kernel(
        src_ptr, addend_ptr, index_ptr, out_ptr, n_groups, width,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ADDEND: tl.constexpr,
    ):  # fmt: skip
        groups = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        group_ok = groups < n_groups
        tile_ok = group_ok[:, None] & (cols < width)[None, :]
        acc = tl.zeros([BLOCK_G, BLOCK_H], dtype=tl.float32)
        for slot in tl.static_range(GROUP):  # slot order: the reference's summation order
            rows = tl.load(index_ptr + groups * GROUP + slot, mask=group_ok, other=0).to(tl.int64)
            at = rows[:, None] * width + cols[None, :]
            row = tl.load(src_ptr + at, mask=tile_ok, other=0.0)
            if HAS_ADDEND:  # the two parts' sum, rounded to their dtype as their own add would round it
                part = tl.load(addend_ptr + at, mask=tile_ok, other=0.0)
                row = (row.to(tl.float32) + part.to(tl.float32)).to(src_ptr.dtype.element_ty)
            acc += row.to(tl.float32)
        tl.store(out_ptr + groups[:, None] * width + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


def gather_sum_rows(
    src: torch.Tensor,
    index: torch.Tensor,
    group: int,
    blocks: GatherSumBlocks = DEFAULT_BLOCKS,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """src[index] summed over consecutive groups of `group` rows, in slot order with fp32 accumulation: src [M, H]
    contiguous (bf16 / fp16 / fp32), index integer [G * group] of valid rows of src (not checked on the device: that
    would cost a host sync; the MoE permutation is valid by construction). Returns [G, H] in src's dtype. `addend`
    (src's shape, dtype and device): the rows of `src + addend` instead (module docstring)."""
    if not TRITON_GATHER_SUM_AVAILABLE:
        raise RuntimeError("gather_sum_rows needs Triton")
    check_matrix("src", src, "[M, H]")
    if group < 1 or index.dim() != 1 or index.numel() % group or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be an integer tensor [G * group] with group={group} >= 1, got "
                         f"{tuple(index.shape)} {index.dtype}")  # fmt: skip
    if index.device != src.device:
        raise ValueError(f"src and index must be on one device, got {src.device} and {index.device}")
    if addend is not None:
        check_matrix("addend", addend, "[M, H]")
        if (addend.shape, addend.dtype, addend.device) != (src.shape, src.dtype, src.device):
            raise ValueError(f"addend must match src: got {tuple(addend.shape)} {addend.dtype} {addend.device}, "
                             f"src {tuple(src.shape)} {src.dtype} {src.device}")  # fmt: skip
    if not src.is_cuda and not INTERPRETED:
        raise ValueError(f"gather_sum_rows runs on CUDA tensors, got {src.device}")
    n_groups, width = index.numel() // group, src.shape[1]
    out = src.new_empty(n_groups, width)
    grid = (triton.cdiv(n_groups, blocks.groups), triton.cdiv(width, blocks.columns))
    launch(
        _gather_sum_kernel, grid, src, src if addend is None else addend, index.contiguous(), out, n_groups, width,
        GROUP=group, BLOCK_G=blocks.groups, BLOCK_H=blocks.columns, HAS_ADDEND=addend is not None,
        num_warps=blocks.warps,
    )  # fmt: skip
    return out
