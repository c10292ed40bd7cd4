"""Triton kernels for the elementwise chains, each forward and backward one launch inside an autograd Function.

The same formulas as the eager chains of reference_kernels.py (`elementwise_kernel="triton"`), in fp32 and rounded once to
the input dtype, like their `torch.compile`d forms. What differs from the compiled forms is the host: a compiled
call goes through dynamo's frame evaluation and AOTAutograd's runtime wrappers, forward and backward, which on a
host-bound step (small batches, many layers) costs more than the kernels; here a call is one `Function.apply` and
one launch each way.

- `rms_norm(x, weight, eps)`: zero-centred RMSNorm `x * rsqrt(mean(x^2) + eps) * (1 + weight)` over the last dim of
  a 2-D x; keeps x and the per-row rstd (fp32) for the backward. The weight gradient is summed over rows in fixed
  per-program partials, then by torch: deterministic, no atomics.
- `gated_rms_norm(x, gate, weight, eps)`: the GDN output norm `x * rsqrt(mean(x^2) + eps) * weight * silu(gate)` over
  the last dim (the head), as FLA's fused gated norm computes it (fp32 throughout, one rounding); keeps x, gate and
  the row scales. Its tile is fixed by the width, where FLA's is autotuned per key `NB` = the rows (tokens x heads)
  in blocks of 65,536: a new key every 2,048 tokens at 32 heads, so a packed row of a length in a bucket not seen
  before re-tuned both kernels inside the training step, and a stream and its documents alone could get different
  tiles.
- `swiglu(gate, up)`: `silu(gate) * up`; `sigmoid_gate(x, gate)`: `x * sigmoid(gate)`; each keeps its two inputs.
- `weighted_swiglu(gate_up, weight)`: the MoE experts' `silu(gate) * up * weight` with one routing weight per row;
  the weight's gradient is each row's own sum.
- `gdn_gates(a, b, A_log, dt_bias)`: the GDN decay `-exp(A_log) * softplus(a + dt_bias)` (fp32) and
  `beta = sigmoid(b)` (b's dtype), with the A_log / dt_bias gradients summed over rows like the norm's weight.

Every row is computed on its own, so a packed document gets the same values as alone.
"""

from __future__ import annotations

import torch

from .triton_support import INTERPRETED, launch, tl, triton

TRITON_ELEMENTWISE_AVAILABLE = triton is not None

_BLOCK = 1024  # elements per program of the flat elementwise kernels
SWIGLU, SIGMOID_GATE = 0, 1  # the two-input chains of _pair_fwd / _pair_bwd (their OP)
_TILE = 8192  # elements per program of the row kernels (rows x the width rounded up to a power of two)
_ROW_BLOCKS = 16  # row blocks per program of the row backwards (fewer weight-gradient partials)


if TRITON_ELEMENTWISE_AVAILABLE:
    _SWIGLU_OP = tl.constexpr(SWIGLU)  # what a kernel may read of a global

    @triton.jit(do_not_specialize=["n_rows"])
    def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, width, eps, BLOCK_M: tl.constexpr,
                      BLOCK_H: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_H)
        ok = (rows < n_rows)[:, None] & (cols < width)[None, :]
        offsets = rows[:, None] * width + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        scale = 1.0 + tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
        tl.store(y_ptr + offsets, (x * rstd[:, None] * scale[None, :]).to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)

    @triton.jit(do_not_specialize=["n_rows"])
    def _rms_norm_bwd(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_partial_ptr, n_rows, width,
                      BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, ROW_BLOCKS: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < width
        scale = 1.0 + tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_H], dtype=tl.float32)
        for block in range(ROW_BLOCKS):
            rows = (pid.to(tl.int64) * ROW_BLOCKS + block) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            ok = row_ok[:, None] & col_ok[None, :]
            offsets = rows[:, None] * width + cols[None, :]
            x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            x_hat = x * rstd[:, None]
            scaled_dy = dy * scale[None, :]
            # d(x_hat)/dx = rstd (I - x_hat x_hat^T / width)
            inner = tl.sum(scaled_dy * x_hat, axis=1) / width
            dx = (scaled_dy - x_hat * inner[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=ok)
            dw += tl.sum(dy * x_hat, axis=0)
        tl.store(dw_partial_ptr + pid.to(tl.int64) * width + cols, dw, mask=col_ok)

    @triton.jit(do_not_specialize=["n_rows"])
    def _gated_rms_norm_fwd(x_ptr, g_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, width, eps, BLOCK_M: tl.constexpr,
                            BLOCK_H: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_H)
        ok = (rows < n_rows)[:, None] & (cols < width)[None, :]
        offsets = rows[:, None] * width + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
        y = x * rstd[:, None] * w[None, :] * (g * tl.sigmoid(g))
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)

    @triton.jit(do_not_specialize=["n_rows"])
    def _gated_rms_norm_bwd(x_ptr, g_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dg_ptr, dw_partial_ptr, n_rows, width,
                            BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, ROW_BLOCKS: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < width
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_H], dtype=tl.float32)
        for block in range(ROW_BLOCKS):
            rows = (pid.to(tl.int64) * ROW_BLOCKS + block) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            ok = row_ok[:, None] & col_ok[None, :]
            offsets = rows[:, None] * width + cols[None, :]
            x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            x_hat = x * rstd[:, None]
            sig = tl.sigmoid(g)
            silu = g * sig
            # y = x_hat * w * silu(g): silu'(g) = sig (1 + g (1 - sig)); d(x_hat)/dx = rstd (I - x_hat x_hat^T / width)
            dg = dy * x_hat * w[None, :] * sig * (1.0 + g * (1.0 - sig))
            d_hat = dy * w[None, :] * silu
            inner = tl.sum(d_hat * x_hat, axis=1) / width
            dx = (d_hat - x_hat * inner[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=ok)
            tl.store(dg_ptr + offsets, dg.to(dg_ptr.dtype.element_ty), mask=ok)
            dw += tl.sum(dy * x_hat * silu, axis=0)
        tl.store(dw_partial_ptr + pid.to(tl.int64) * width + cols, dw, mask=col_ok)

    @triton.jit
    def _pair_fwd(p_ptr, q_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
        # OP: SWIGLU, y = silu(p) * q; SIGMOID_GATE, y = p * sigmoid(q)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        p = tl.load(p_ptr + i, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + i, mask=ok, other=0.0).to(tl.float32)
        if OP == _SWIGLU_OP:
            y = p * tl.sigmoid(p) * q
        else:
            y = p * tl.sigmoid(q)
        tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _pair_bwd(p_ptr, q_ptr, dy_ptr, dp_ptr, dq_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        p = tl.load(p_ptr + i, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + i, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + i, mask=ok, other=0.0).to(tl.float32)
        if OP == _SWIGLU_OP:
            sig = tl.sigmoid(p)
            dp = dy * q * sig * (1.0 + p * (1.0 - sig))
            dq = dy * p * sig
        else:
            sig = tl.sigmoid(q)
            dp = dy * sig
            dq = dy * p * sig * (1.0 - sig)
        tl.store(dp_ptr + i, dp.to(dp_ptr.dtype.element_ty), mask=ok)
        tl.store(dq_ptr + i, dq.to(dq_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["n_rows"])
    def _weighted_swiglu_fwd(gate_up_ptr, weight_ptr, y_ptr, n_rows, inter, BLOCK_M: tl.constexpr,
                             BLOCK_I: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_I)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & (cols < inter)[None, :]
        gate_at = gate_up_ptr + rows[:, None] * (2 * inter) + cols[None, :]  # row: gate | up
        g = tl.load(gate_at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_at + inter, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(y_ptr + rows[:, None] * inter + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["n_rows"])
    def _weighted_swiglu_bwd(gate_up_ptr, weight_ptr, dy_ptr, dgate_up_ptr, dweight_ptr, n_rows, inter,
                             BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_I)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & (cols < inter)[None, :]
        gate_at = rows[:, None] * (2 * inter) + cols[None, :]
        g = tl.load(gate_up_ptr + gate_at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + gate_at + inter, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * inter + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dgate = dy * w[:, None] * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(dgate_up_ptr + gate_at, dgate.to(dgate_up_ptr.dtype.element_ty), mask=ok)
        tl.store(dgate_up_ptr + gate_at + inter, (dy * w[:, None] * silu).to(dgate_up_ptr.dtype.element_ty), mask=ok)
        tl.store(dweight_ptr + rows, tl.sum(dy * silu * u, axis=1), mask=row_ok)  # the row's own sum

    @triton.jit
    def _softplus(x):
        # torch's softplus (beta 1, threshold 20): x itself above the threshold, else log1p(exp(x)), with log1p as
        # log(w) * u / (w - 1) for w = 1 + u (exact where w rounds to 1: u itself), which keeps the digits of a
        # small exp(x) that log(1 + u) would drop.
        u = tl.exp(tl.minimum(x, 20.0))
        w = 1.0 + u
        log1p = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
        return tl.where(x > 20.0, x, log1p)

    @triton.jit(do_not_specialize=["n_rows"])
    def _gdn_gates_fwd(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, n_rows, heads,
                       BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_V)
        col_ok = cols < heads
        ok = (rows < n_rows)[:, None] & col_ok[None, :]
        offsets = rows[:, None] * heads + cols[None, :]
        a = tl.load(a_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        decay_rate = tl.exp(tl.load(a_log_ptr + cols, mask=col_ok, other=0.0).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(g_ptr + offsets, -decay_rate[None, :] * _softplus(a + dt_bias[None, :]), mask=ok)
        tl.store(beta_ptr + offsets, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["n_rows"])
    def _gdn_gates_bwd(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, dg_ptr, dbeta_ptr, da_ptr, db_ptr, partial_ptr,
                       n_rows, heads, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                       ROW_BLOCKS: tl.constexpr):  # fmt: skip
        # partial[pid, 0] sums dA_log, partial[pid, 1] sums ddt_bias over this program's rows.
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_V)
        col_ok = cols < heads
        decay_rate = tl.exp(tl.load(a_log_ptr + cols, mask=col_ok, other=0.0).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        d_a_log = tl.zeros([BLOCK_V], dtype=tl.float32)
        d_dt_bias = tl.zeros([BLOCK_V], dtype=tl.float32)
        for block in range(ROW_BLOCKS):
            rows = (pid.to(tl.int64) * ROW_BLOCKS + block) * BLOCK_M + tl.arange(0, BLOCK_M)
            ok = (rows < n_rows)[:, None] & col_ok[None, :]
            offsets = rows[:, None] * heads + cols[None, :]
            z = tl.load(a_ptr + offsets, mask=ok, other=0.0).to(tl.float32) + dt_bias[None, :]
            dg = tl.load(dg_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            # d softplus(z) / dz = sigmoid(z) (1 above the threshold, where sigmoid(z) rounds to 1 in fp32)
            da = tl.where(z > 20.0, 1.0, tl.sigmoid(z)) * dg * -decay_rate[None, :]
            tl.store(da_ptr + offsets, da.to(da_ptr.dtype.element_ty), mask=ok)
            d_dt_bias += tl.sum(tl.where(ok, da, 0.0), axis=0)
            d_a_log += tl.sum(tl.where(ok, dg * -decay_rate[None, :] * _softplus(z), 0.0), axis=0)
            beta = tl.sigmoid(tl.load(b_ptr + offsets, mask=ok, other=0.0).to(tl.float32))
            dbeta = tl.load(dbeta_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
            tl.store(db_ptr + offsets, (dbeta * beta * (1.0 - beta)).to(db_ptr.dtype.element_ty), mask=ok)
        tl.store(partial_ptr + (pid.to(tl.int64) * 2) * heads + cols, d_a_log, mask=col_ok)
        tl.store(partial_ptr + (pid.to(tl.int64) * 2 + 1) * heads + cols, d_dt_bias, mask=col_ok)


def _check(*tensors: torch.Tensor) -> None:
    if not TRITON_ELEMENTWISE_AVAILABLE:
        raise RuntimeError("the Triton elementwise kernels need Triton")
    for t in tensors:
        if not t.is_cuda and not INTERPRETED:
            raise ValueError(f"the Triton elementwise kernels run on CUDA tensors, got {t.device}")


def _row_tiles(width: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of a row kernel's tile: up to _TILE elements, 16 elements a thread at most (the
    norm's backward fits sm_90's registers without spills at that, from 256 to 5120 columns)."""
    block_h = triton.next_power_of_2(width)
    block_m = max(1, min(16, _TILE // block_h))
    return block_m, block_h, max(4, min(16, block_m * block_h // 512))


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n_rows, width = x.shape
        block_m, block_h, warps = _row_tiles(width)
        y = torch.empty_like(x)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(n_rows, block_m),)
        launch(_rms_norm_fwd, grid, x, weight, y, rstd, n_rows, width, eps, block_m, block_h, num_warps=warps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        n_rows, width = x.shape
        block_m, block_h, warps = _row_tiles(width)
        programs = triton.cdiv(n_rows, block_m * _ROW_BLOCKS)
        dx = torch.empty_like(x)
        partial = torch.zeros(programs, width, dtype=torch.float32, device=x.device)
        launch(_rms_norm_bwd, (programs,), x, weight, rstd, dy.contiguous(), dx, partial, n_rows, width, block_m,
               block_h, _ROW_BLOCKS, num_warps=warps)  # fmt: skip
        dweight = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dweight, None


class _GatedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        n_rows, width = x.shape
        block_m, block_h, warps = _row_tiles(width)
        y = torch.empty_like(x)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        launch(_gated_rms_norm_fwd, (triton.cdiv(n_rows, block_m),), x, gate, weight, y, rstd, n_rows, width, eps,
               block_m, block_h, num_warps=warps)  # fmt: skip
        ctx.save_for_backward(x, gate, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        n_rows, width = x.shape
        block_m, block_h, warps = _row_tiles(width)
        programs = triton.cdiv(n_rows, block_m * _ROW_BLOCKS)
        dx, dgate = torch.empty_like(x), torch.empty_like(gate)
        partial = torch.zeros(programs, width, dtype=torch.float32, device=x.device)
        launch(_gated_rms_norm_bwd, (programs,), x, gate, weight, rstd, dy.contiguous(), dx, dgate, partial, n_rows,
               width, block_m, block_h, _ROW_BLOCKS, num_warps=warps)  # fmt: skip
        dweight = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return dx, dgate, dweight, None


class _TwoInputElementwise(torch.autograd.Function):
    """y = f(p, q) elementwise over two same-shape contiguous tensors (f: SWIGLU or SIGMOID_GATE); the backward
    kernel writes both gradients."""

    @staticmethod
    def forward(ctx, p, q, op):
        y = torch.empty_like(p)
        n = p.numel()
        launch(_pair_fwd, (triton.cdiv(n, _BLOCK),), p, q, y, n, op, _BLOCK)
        ctx.save_for_backward(p, q)
        ctx.op = op
        return y

    @staticmethod
    def backward(ctx, dy):
        p, q = ctx.saved_tensors
        dp, dq = torch.empty_like(p), torch.empty_like(q)
        n = p.numel()
        launch(_pair_bwd, (triton.cdiv(n, _BLOCK),), p, q, dy.contiguous(), dp, dq, n, ctx.op, _BLOCK)
        return dp, dq, None


class _WeightedSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, weight):
        n_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        block_m, block_i, warps = _row_tiles(inter)
        y = gate_up.new_empty(n_rows, inter)
        grid = (triton.cdiv(n_rows, block_m),)
        launch(_weighted_swiglu_fwd, grid, gate_up, weight, y, n_rows, inter, block_m, block_i, num_warps=warps)
        ctx.save_for_backward(gate_up, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate_up, weight = ctx.saved_tensors
        n_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        block_m, block_i, warps = _row_tiles(inter)
        dgate_up = torch.empty_like(gate_up)
        dweight = torch.empty(n_rows, dtype=torch.float32, device=gate_up.device)
        launch(_weighted_swiglu_bwd, (triton.cdiv(n_rows, block_m),), gate_up, weight, dy.contiguous(), dgate_up,
               dweight, n_rows, inter, block_m, block_i, num_warps=warps)  # fmt: skip
        return dgate_up, dweight.to(weight.dtype)


class _GdnGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_log, dt_bias):
        n_rows, heads = a.shape
        block_m, block_v, warps = _row_tiles(heads)
        g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
        beta = torch.empty_like(b)
        launch(_gdn_gates_fwd, (triton.cdiv(n_rows, block_m),), a, b, a_log, dt_bias, g, beta, n_rows, heads,
               block_m, block_v, num_warps=warps)  # fmt: skip
        ctx.save_for_backward(a, b, a_log, dt_bias)
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        a, b, a_log, dt_bias = ctx.saved_tensors
        n_rows, heads = a.shape
        block_m, block_v, warps = _row_tiles(heads)
        programs = triton.cdiv(n_rows, block_m * _ROW_BLOCKS)
        dg, dbeta = dg.contiguous(), dbeta.contiguous()  # zeros for an output without a gradient (materialised)
        da, db = torch.empty_like(a), torch.empty_like(b)
        partial = torch.zeros(programs, 2, heads, dtype=torch.float32, device=a.device)
        launch(_gdn_gates_bwd, (programs,), a, b, a_log, dt_bias, dg, dbeta, da, db, partial, n_rows, heads, block_m,
               block_v, _ROW_BLOCKS, num_warps=warps)  # fmt: skip
        sums = partial.sum(0)
        return da, db, sums[0].to(a_log.dtype), sums[1].to(dt_bias.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of a 2-D x over its last dim, fp32 inside, x's dtype out."""
    _check(x, weight)
    return _RmsNorm.apply(x.contiguous(), weight.contiguous(), float(eps))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight * silu(gate) over the last dim, fp32 inside, x's dtype out; x and gate of
    one shape, weight [x.shape[-1]]."""
    _check(x, gate, weight)
    width = x.shape[-1]
    out = _GatedRmsNorm.apply(x.reshape(-1, width).contiguous(), gate.reshape(-1, width).contiguous(),
                              weight.contiguous(), float(eps))  # fmt: skip
    return out.reshape(x.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, gate's dtype out (same shapes)."""
    _check(gate, up)
    return _TwoInputElementwise.apply(gate.contiguous(), up.contiguous(), SWIGLU)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) in fp32, x's dtype out (same shapes)."""
    _check(x, gate)
    return _TwoInputElementwise.apply(x.contiguous(), gate.contiguous(), SIGMOID_GATE)


def weighted_swiglu(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up * weight in fp32, gate_up's dtype out: gate_up [M, 2I] (gate | up halves), weight [M] (the
    routing weight of each MoE expert row)."""
    _check(gate_up, weight)
    return _WeightedSwiglu.apply(gate_up.contiguous(), weight.contiguous())


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b) in b's dtype); a, b [N, Hv]."""
    _check(a, b, a_log, dt_bias)
    return _GdnGates.apply(a.contiguous(), b.contiguous(), a_log.contiguous(), dt_bias.contiguous())
