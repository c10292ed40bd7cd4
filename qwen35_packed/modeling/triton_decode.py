"""Triton kernels for a generation step with one new token per row: the GDN conv update and the delta-rule update,
each one launch for all rows (the PyTorch forms in reference_kernels.py run a dozen small kernels per layer).

`conv_step_silu(x, weight, state)`: x [B, C] the new conv inputs, weight [C, K], state [B, C, K] the rows' last K
inputs -> (silu(conv) [B, C] in x's dtype, the new last K inputs [B, C, K] in x's dtype). A program takes one row and
BLOCK_C channels; the sum runs in the order of `reference_kernels.causal_conv1d_pre_activation`, in fp32.

`delta_rule_step(q, k, v, g, beta, state, out_state=None)`: q, k [B, Hk, Dk] (before their l2 norm), v [B, Hv, Dv],
g, beta [B, Hv], state [B, Hv, Dk, Dv] fp32 -> (o [B, Hv, Dv] in v's dtype, the new state fp32, written into
`out_state` when given, which may be `state` itself: each program writes the tile it read): q and k l2-normalised
(q scaled by Dk^-0.5), value head h reads key head h // (Hv / Hk), and with decay = exp(g)

    new_v = beta v - (beta decay k)^T S,   o = (decay q)^T S + (q . k) new_v,   S' = decay S + k new_v^T,

the chunked form's arithmetic for a one-token chunk (reference_kernels.torch_gated_delta_rule_step). A program takes
one (row, value head) and BLOCK_V columns of the state: the whole key dimension of its columns is in registers, so
each state element is read and written once.
"""

from __future__ import annotations

import torch

from .triton_support import INTERPRETED, launch, tl, triton

TRITON_DECODE_AVAILABLE = triton is not None
CONV_CHANNELS = 256  # channels per program of the conv step
STATE_COLUMNS = 32  # state columns (value dim) per program of the delta-rule step
L2_EPS = 1e-6  # reference_kernels.l2norm's


if TRITON_DECODE_AVAILABLE:

    @triton.jit
    def _conv_step_kernel(
        x_ptr, w_ptr, state_ptr, out_ptr, new_state_ptr, channels,
        KERNEL: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < channels
        x = tl.load(x_ptr + row * channels + cols, mask=ok, other=0.0)
        state_row = state_ptr + (row * channels + cols) * KERNEL
        acc = x.to(tl.float32) * tl.load(w_ptr + cols * KERNEL + KERNEL - 1, mask=ok, other=0.0).to(tl.float32)
        for lag in tl.static_range(1, KERNEL):  # the window's input `lag` steps back is state[KERNEL - lag]
            earlier = tl.load(state_row + KERNEL - lag, mask=ok, other=0.0).to(x_ptr.dtype.element_ty)
            tap = tl.load(w_ptr + cols * KERNEL + KERNEL - 1 - lag, mask=ok, other=0.0).to(tl.float32)
            acc += earlier.to(tl.float32) * tap
            tl.store(new_state_ptr + (row * channels + cols) * KERNEL + KERNEL - 1 - lag, earlier, mask=ok)
        tl.store(new_state_ptr + (row * channels + cols) * KERNEL + KERNEL - 1, x, mask=ok)
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * channels + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _delta_rule_step_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, new_state_ptr,
        key_heads, value_heads, key_dim, value_dim, scale, eps,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        row_head = tl.program_id(0).to(tl.int64)  # row * value_heads + value head
        row = row_head // value_heads
        head = row_head % value_heads
        key_head = head // (value_heads // key_heads)
        ks = tl.arange(0, BLOCK_K)
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        k_ok, v_ok = ks < key_dim, vs < value_dim
        key_at = (row * key_heads + key_head) * key_dim + ks
        q = tl.load(q_ptr + key_at, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + key_at, mask=k_ok, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        v = tl.load(v_ptr + row_head * value_dim + vs, mask=v_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + row_head).to(tl.float32))
        beta = tl.load(beta_ptr + row_head).to(tl.float32)
        tile = row_head * key_dim * value_dim + ks[:, None] * value_dim + vs[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0)
        new_v = v * beta - tl.sum((k * (beta * decay))[:, None] * state, axis=0)
        out = tl.sum((q * decay)[:, None] * state, axis=0) + tl.sum(q * k, axis=0) * new_v
        tl.store(new_state_ptr + tile, state * decay + k[:, None] * new_v[None, :], mask=tile_ok)
        tl.store(out_ptr + row_head * value_dim + vs, out.to(out_ptr.dtype.element_ty), mask=v_ok)


def conv_step_silu(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """One generation step of the GDN conv + SiLU in one launch (the module docstring); the kernel set's `conv_step`
    on CUDA."""
    if not TRITON_DECODE_AVAILABLE:
        raise RuntimeError("conv_step_silu needs Triton")
    rows, channels = x.shape
    if weight.shape[0] != channels or tuple(state.shape) != (rows, channels, weight.shape[1]):
        raise ValueError(
            f"conv step: x {tuple(x.shape)}, weight {tuple(weight.shape)} and state {tuple(state.shape)} must be "
            "[B, C], [C, K] and [B, C, K]"
        )
    x, weight, state = x.contiguous(), weight.contiguous(), state.contiguous()
    out, new_state = torch.empty_like(x), torch.empty(state.shape, dtype=x.dtype, device=x.device)
    grid = (rows, triton.cdiv(channels, CONV_CHANNELS))
    launch(_conv_step_kernel, grid, x, weight, state, out, new_state, channels,
           KERNEL=weight.shape[1], BLOCK_C=CONV_CHANNELS)  # fmt: skip
    return out, new_state


def delta_rule_step(q, k, v, g, beta, state, out_state=None):
    """One generation step of the gated delta rule in one launch (the module docstring); the kernel set's
    `delta_rule_step` on CUDA."""
    if not TRITON_DECODE_AVAILABLE:
        raise RuntimeError("delta_rule_step needs Triton")
    rows, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[1:]
    if tuple(state.shape) != (rows, value_heads, key_dim, value_dim) or state.dtype != torch.float32:
        raise ValueError(f"delta-rule step: state must be fp32 [B, Hv, Dk, Dv], got {tuple(state.shape)} {state.dtype}")
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    if out_state is not None and (out_state.shape != state.shape or out_state.dtype != state.dtype):
        raise ValueError(
            f"delta-rule step: out_state {tuple(out_state.shape)} {out_state.dtype} is not the state's kind"
        )
    if out_state is not None and not out_state.is_contiguous():
        raise ValueError("delta-rule step: out_state must be contiguous")
    q, k, v, g, beta, state = (t.contiguous() for t in (q, k, v, g, beta, state))
    out = torch.empty_like(v)
    new_state = torch.empty_like(state) if out_state is None else out_state
    block_k = triton.next_power_of_2(key_dim)
    block_v = min(STATE_COLUMNS, triton.next_power_of_2(value_dim))
    grid = (rows * value_heads, triton.cdiv(value_dim, block_v))
    launch(_delta_rule_step_kernel, grid, q, k, v, g, beta, state, out, new_state,
           key_heads, value_heads, key_dim, value_dim, key_dim**-0.5, L2_EPS,
           BLOCK_K=block_k, BLOCK_V=block_v)  # fmt: skip
    return out, new_state


__all__ = ["INTERPRETED", "TRITON_DECODE_AVAILABLE", "conv_step_silu", "delta_rule_step"]
