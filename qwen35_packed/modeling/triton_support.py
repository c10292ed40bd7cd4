"""What the Triton kernel files share: Triton's optional import, whether kernels run in its CPU interpreter, the
checks of a kernel's 2-D input, and the launch.

`triton` and `tl` are None without Triton. Kernels decorated while TRITON_INTERPRET=1 is set run on CPU tensors in
Triton's interpreter (the tests' way of running them without a GPU): `INTERPRETED` says whether that is the case in
this process, read off a kernel decorated here, as the kernel files' are, at import.

A kernel argument that counts a row's tokens (`n_rows`, `n_groups`) is declared `do_not_specialize`: Triton keys a
compiled kernel on whether each int argument is 1 or a multiple of 16, so a packed row whose length first falls in
another of those classes would compile the kernel again inside a training step. Those counts bound row masks, which
are constant along the contiguous columns, so the knowledge buys no vectorisation there
(tests/modeling/test_triton_compile.py checks the keys). The flat kernels' element count `n` (tokens x width) stays
specialized: it bounds the mask along the contiguous axis, where a multiple of 16 allows vector loads, and it is one
a multiple of 16 for every official width, whatever the token count.
"""

from __future__ import annotations

import contextlib

import torch

try:  # optional: Triton (the GPU kernel language; also runs on CPU tensors under TRITON_INTERPRET=1)
    import triton
    import triton.language as tl

    TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())

    @triton.jit
    def _decorated():
        pass

    INTERPRETED = not isinstance(_decorated, triton.runtime.JITFunction)
except ImportError:
    triton = tl = None
    TRITON_VERSION = None
    INTERPRETED = False


# The floating dtypes the kernels read and write.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_matrix(name: str, t: torch.Tensor, dims: str) -> None:
    """Raise ValueError unless `t` (called `name`, of dims `dims`, e.g. "[N, C]") is 2-D, contiguous and in one of
    KERNEL_DTYPES."""
    if t.dim() != 2 or t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name} must be {dims} in bf16, fp16 or fp32, got {tuple(t.shape)} {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """`kernel[grid](*args, **meta)` on the device of the first argument (a tensor): Triton launches on the current
    CUDA device, and the tensors may live on another. Nothing is launched for a grid with an empty axis (no rows)."""
    if not all(grid):
        return
    first = args[0]
    with torch.cuda.device(first.device) if first.is_cuda else contextlib.nullcontext():
        kernel[grid](*args, **meta)
