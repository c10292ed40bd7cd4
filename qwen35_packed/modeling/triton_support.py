"""What the Triton kernel files share: Triton's optional import, whether kernels run in its CPU interpreter, and the
device a launch goes to.

`triton` and `tl` are None without Triton. Kernels decorated while TRITON_INTERPRET=1 is set run on CPU tensors in
Triton's interpreter (the tests' way of running them without a GPU): `INTERPRETED` says whether that is the case in
this process, read off a kernel decorated here, as the kernel files' are, at import.
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


def launch_device(t: torch.Tensor):
    """Context for a launch on t's device: Triton launches on the current CUDA device, and t may live on another."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
