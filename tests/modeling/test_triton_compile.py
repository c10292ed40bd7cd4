"""Every Triton kernel of the project compiles for the H200 (sm_90) here, without a GPU.

The CPU interpreter runs the kernels' Python, not Triton's compiler: a kernel can pass every interpreted test and
still fail to compile (a global that is not a constexpr, an unsupported construct). Triton compiles to a cubin on a
machine without a GPU (its wheel brings ptxas), so each kernel is compiled once with the tile sizes the launches
use.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qwen35_packed.modeling import (  # noqa: E402
    triton_conv,
    triton_decode,
    triton_elementwise,
    triton_gather_sum,
    triton_support,
)
from qwen35_packed.modeling.triton_conv import DEFAULT_BLOCKS  # noqa: E402

BF16, FP32, I64, I32 = "*bf16", "*fp32", "*i64", "i32"
CONV_BACKWARD = {"x_ptr": BF16, "w_ptr": BF16, "pos_ptr": I64, "dy_ptr": BF16, "dx_ptr": BF16, "dw_partial_ptr": FP32,
                 "n_rows": I32, "n_channels": I32, "channel_offset": I32, "seg_channels": I32}  # fmt: skip
PAIR = {"p_ptr": BF16, "q_ptr": BF16}

# (module, kernel name, runtime signature, constexprs, warps)
KERNELS = [
    (triton_conv, "_conv_silu_forward_kernel",
     {"x_ptr": BF16, "w_ptr": BF16, "pos_ptr": I64, "y_ptr": BF16, "n_rows": I32, "n_channels": I32,
      "channel_offset": I32, "seg_channels": I32},
     {"KERNEL": 4, "BLOCK_T": DEFAULT_BLOCKS.forward_rows, "BLOCK_C": DEFAULT_BLOCKS.forward_channels},
     DEFAULT_BLOCKS.forward_warps),
    (triton_conv, "_conv_silu_backward_kernel", CONV_BACKWARD,
     {"KERNEL": 4, "KERNEL_POW2": 4, "BLOCK_T": DEFAULT_BLOCKS.backward_rows,
      "BLOCK_C": DEFAULT_BLOCKS.backward_channels, "CHUNKS": DEFAULT_BLOCKS.backward_chunks},
     DEFAULT_BLOCKS.backward_warps),
    *[(triton_gather_sum, "_gather_sum_kernel",
       {"src_ptr": BF16, "addend_ptr": BF16, "index_ptr": I64, "out_ptr": BF16, "n_groups": I32, "width": I32},
       {"GROUP": 8, "BLOCK_G": triton_gather_sum.DEFAULT_BLOCKS.groups,
        "BLOCK_H": triton_gather_sum.DEFAULT_BLOCKS.columns, "HAS_ADDEND": has_addend},
       triton_gather_sum.DEFAULT_BLOCKS.warps) for has_addend in (False, True)],
    (triton_elementwise, "_rms_norm_fwd",
     {"x_ptr": BF16, "w_ptr": BF16, "y_ptr": BF16, "rstd_ptr": FP32, "n_rows": I32, "width": I32, "eps": "fp32"},
     {"BLOCK_M": 4, "BLOCK_H": 2048}, 16),
    (triton_elementwise, "_rms_norm_bwd",
     {"x_ptr": BF16, "w_ptr": BF16, "rstd_ptr": FP32, "dy_ptr": BF16, "dx_ptr": BF16, "dw_partial_ptr": FP32,
      "n_rows": I32, "width": I32}, {"BLOCK_M": 4, "BLOCK_H": 2048, "ROW_BLOCKS": 16}, 16),
    (triton_elementwise, "_gated_rms_norm_fwd",
     {"x_ptr": BF16, "g_ptr": BF16, "w_ptr": BF16, "y_ptr": BF16, "rstd_ptr": FP32, "n_rows": I32, "width": I32,
      "eps": "fp32"}, {"BLOCK_M": 16, "BLOCK_H": 128}, 4),
    (triton_elementwise, "_gated_rms_norm_bwd",
     {"x_ptr": BF16, "g_ptr": BF16, "w_ptr": BF16, "rstd_ptr": FP32, "dy_ptr": BF16, "dx_ptr": BF16, "dg_ptr": BF16,
      "dw_partial_ptr": FP32, "n_rows": I32, "width": I32}, {"BLOCK_M": 16, "BLOCK_H": 128, "ROW_BLOCKS": 16}, 4),
    (triton_elementwise, "_pair_fwd", {**PAIR, "y_ptr": BF16, "n": I32},
     {"OP": triton_elementwise.SWIGLU, "BLOCK": 1024}, 4),
    (triton_elementwise, "_pair_bwd", {**PAIR, "dy_ptr": BF16, "dp_ptr": BF16, "dq_ptr": BF16, "n": I32},
     {"OP": triton_elementwise.SIGMOID_GATE, "BLOCK": 1024}, 4),
    (triton_elementwise, "_weighted_swiglu_fwd",
     {"gate_up_ptr": BF16, "weight_ptr": FP32, "y_ptr": BF16, "n_rows": I32, "inter": I32},
     {"BLOCK_M": 16, "BLOCK_I": 512}, 16),
    (triton_elementwise, "_weighted_swiglu_bwd",
     {"gate_up_ptr": BF16, "weight_ptr": FP32, "dy_ptr": BF16, "dgate_up_ptr": BF16, "dweight_ptr": FP32,
      "n_rows": I32, "inter": I32}, {"BLOCK_M": 16, "BLOCK_I": 512}, 16),
    (triton_elementwise, "_gdn_gates_fwd",
     {"a_ptr": BF16, "b_ptr": BF16, "a_log_ptr": FP32, "dt_bias_ptr": FP32, "g_ptr": FP32, "beta_ptr": BF16,
      "n_rows": I32, "heads": I32}, {"BLOCK_M": 16, "BLOCK_V": 32}, 4),
    (triton_elementwise, "_gdn_gates_bwd",
     {"a_ptr": BF16, "b_ptr": BF16, "a_log_ptr": FP32, "dt_bias_ptr": FP32, "dg_ptr": FP32, "dbeta_ptr": BF16,
      "da_ptr": BF16, "db_ptr": BF16, "partial_ptr": FP32, "n_rows": I32, "heads": I32},
     {"BLOCK_M": 16, "BLOCK_V": 32, "ROW_BLOCKS": 16}, 4),
    (triton_decode, "_conv_step_kernel",
     {"x_ptr": BF16, "w_ptr": BF16, "state_ptr": BF16, "out_ptr": BF16, "new_state_ptr": BF16, "channels": I32},
     {"KERNEL": 4, "BLOCK_C": triton_decode.CONV_CHANNELS}, 4),
    (triton_decode, "_delta_rule_step_kernel",
     {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "g_ptr": FP32, "beta_ptr": BF16, "state_ptr": FP32,
      "out_ptr": BF16, "new_state_ptr": FP32, "key_heads": I32, "value_heads": I32, "key_dim": I32,
      "value_dim": I32, "scale": "fp32", "eps": "fp32"},
     {"BLOCK_K": 128, "BLOCK_V": triton_decode.STATE_COLUMNS}, 4),
]  # fmt: skip


def test_every_kernel_is_listed():
    # a kernel added to a module without a row here would never be compiled before a GPU run
    listed = {(module.__name__, name) for module, name, *_ in KERNELS}
    found = {
        (module.__name__, name)
        for module in (triton_conv, triton_decode, triton_elementwise, triton_gather_sum)
        for name, value in vars(module).items()
        if isinstance(value, triton.runtime.JITFunction) and name.endswith(("_kernel", "_fwd", "_bwd"))
    }
    assert found == listed


# The runtime arguments that count a packed row's tokens (the flat kernels' `n` is tokens x width: triton_support.py)
ROW_COUNTS = ("n_rows", "n_groups")
ROW_KERNELS = [row for row in KERNELS if set(row[2]) & set(ROW_COUNTS)]
POINTER_DTYPES = {BF16: torch.bfloat16, FP32: torch.float32, I64: torch.int64}


@pytest.mark.skipif(triton_support.INTERPRETED, reason="kernels interpreted in this process (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("module, name, signature, constexprs, warps", ROW_KERNELS, ids=[r[1] for r in ROW_KERNELS])
def test_a_new_row_length_reuses_the_compiled_kernel(module, name, signature, constexprs, warps):
    """The specialization Triton keys a compiled kernel on (with the sm_90 backend's rules) is the same for every
    token count, 1 and multiples of 16 included: a packed row of a length never seen reuses the kernel compiled for
    the first one, where a specialized count compiles it again inside the step (triton_support.py)."""
    from triton.compiler import make_backend

    bind = getattr(triton.runtime.jit, "create_function_from_signature", None)
    assert bind is not None, f"Triton {triton.__version__}: no create_function_from_signature to read the key with"
    kernel = getattr(module, name)
    binder = bind(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))

    def key(count: int):
        args = []
        for param in kernel.params:
            kind = signature.get(param.name)
            if param.name in constexprs:
                args.append(constexprs[param.name])
            elif kind in POINTER_DTYPES:
                args.append(torch.empty(64, dtype=POINTER_DTYPES[kind]))
            elif param.name in ROW_COUNTS:
                args.append(count)
            else:
                args.append(0.5 if kind == "fp32" else 96)
        return str(binder(*args)[1])

    assert {key(count) for count in (1, 16, 1000, 1024, 26_354, 65_536)} == {key(7)}
    assert set(signature) & set(ROW_COUNTS)


@pytest.mark.skipif(triton_support.INTERPRETED, reason="kernels interpreted in this process (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("module, name, signature, constexprs, warps", KERNELS, ids=[row[1] for row in KERNELS])
def test_kernel_compiles_for_sm90(module, name, signature, constexprs, warps):
    kernel = getattr(module, name)
    full = {**signature, **{key: "constexpr" for key in constexprs}}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=full, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    assert compiled.asm["cubin"]
