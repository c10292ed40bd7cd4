"""The kernels written out in PyTorch: the exact references every other path is tested against, and what runs on
the CPU (and wherever a faster kernel is not installed). Exact for packed input: every function here keeps documents
apart by construction (per-document loops or boundary masks), in fp32 where the kernels accumulate in fp32.
`kernels.py` dispatches to these or to the GPU kernels; `kernel_selection.py` decides which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------------------------
# Elementwise chains (the formulas the Triton kernels of triton_elementwise.py compute)
# --------------------------------------------------------------------------------------------------------------


def zero_centred_rms_norm(x, weight, eps: float):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def swiglu(gate, up):
    return F.silu(gate) * up


def sigmoid_gate(x, gate):
    return x * torch.sigmoid(gate)


def gdn_gates(a, b, a_log, dt_bias):
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float()), torch.sigmoid(b)


def weighted_swiglu(gate_up, weight):
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float() * weight.unsqueeze(-1)).to(gate_up.dtype)


def gated_rms_norm(x, gate, weight, eps):
    """weight * rmsnorm(x) * silu(gate): norm in fp32, gate in fp32 (the GDN output norm)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# Causal depthwise conv over a packed stream
# --------------------------------------------------------------------------------------------------------------


def lagged_input(
    x: torch.Tensor,
    lag: int,
    position_in_doc: torch.Tensor,
    kernel: int,
    doc_index: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """The conv input `lag` tokens before each token, in fp32 [N, C]: zeros where that reaches before the token's
    document start, or the document's cached history there when `initial_state` [n_docs, C, kernel-1] is given (then
    doc_index long [N] says which document a token belongs to)."""
    shifted = (F.pad(x, (0, 0, lag, 0))[: x.shape[0]] if lag else x).float()
    if lag == 0:
        return shifted
    inside = (position_in_doc >= lag).unsqueeze(-1)
    if initial_state is None:
        return shifted * inside
    # Tokens closer than `lag` to their document start read the cached history instead.
    hist_pos = (position_in_doc - lag + kernel - 1).clamp(min=0, max=kernel - 2)
    return torch.where(inside, shifted, initial_state[doc_index, :, hist_pos].float())


def causal_conv1d_pre_activation(
    x: torch.Tensor,
    weight: torch.Tensor,
    position_in_doc: torch.Tensor,
    doc_index: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """The depthwise causal conv of x [N, C] with taps weight [C, K] on a packed stream, before the SiLU, in fp32
    [N, C]; the inputs it reads as `lagged_input` gives them."""
    kernel = weight.shape[-1]
    out = x.float() * weight[:, kernel - 1].float()
    for lag in range(1, kernel):
        tap = weight[:, kernel - 1 - lag].float()
        out = out + lagged_input(x, lag, position_in_doc, kernel, doc_index, initial_state) * tap
    return out


def torch_causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    position_in_doc: torch.Tensor,
    doc_index: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU on a packed stream; no token of one document reaches another.

    x [N, C]; weight [C, K]; position_in_doc long [N]; initial_state [n_docs, C, K-1] holds the K-1 inputs
    preceding each document (cached decode), zeros when None; doc_index long [N] is read only with it. Computed in
    x's dtype with fp32 accumulation, like a conv kernel. Without initial_state this is also what
    conv_kernel="compiled" runs, through torch.compile.
    """
    return F.silu(causal_conv1d_pre_activation(x, weight, position_in_doc, doc_index, initial_state)).to(x.dtype)


def torch_causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """One generation step of the conv + SiLU, one new input per row: x [B, C]; weight [C, K]; state [B, C, K] the
    row's last K inputs (transformers' layout) -> (output [B, C] in x's dtype, the new last K inputs). The sum runs
    in the order of `causal_conv1d_pre_activation`, so a step gives the stream formula's bits."""
    window = torch.cat([state[..., 1:].to(x.dtype), x.unsqueeze(-1)], dim=-1)
    kernel = weight.shape[-1]
    out = x.float() * weight[:, kernel - 1].float()
    for lag in range(1, kernel):
        out = out + window[..., kernel - 1 - lag].float() * weight[:, kernel - 1 - lag].float()
    return F.silu(out).to(x.dtype), window


# --------------------------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Gated delta rule for ONE document, chunked, fp32.

    q, k [L, H, Dk] (already l2-normalised, q scaled); v [L, H, Dv]; g (log decay), beta [L, H];
    initial_state [H, Dk, Dv]. Recurrence per head: S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,
    o_t = S_t^T q_t. Within a chunk the WY form gives new values U - W S0 with T = (I + tril(b K K^T Gamma, -1))^-1.
    Returns (o [L, H, Dv], final state [H, Dk, Dv]).
    """
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    # Zero padding at the end: k = v = beta = 0 and g = 0 leave the state and earlier outputs untouched.
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n_chunks = (length + pad) // chunk_size
    # -> [H, n_chunks, C, ...]
    q, k, v = (t.reshape(n_chunks, chunk_size, heads, -1).permute(2, 0, 1, 3) for t in (q, k, v))
    g, beta = (t.reshape(n_chunks, chunk_size, heads).permute(2, 0, 1) for t in (g, beta))

    g_cum = g.cumsum(dim=-1)  # [H, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H,n,C,C]
    k_beta = k * beta.unsqueeze(-1)
    strictly_lower = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    system = eye + strictly_lower
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g_cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # causal incl. diagonal (decay is 0 above it)

    state = q.new_zeros(heads, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outputs = []
    for c in range(n_chunks):
        new_v = u[:, c] - w[:, c] @ state
        out = (q[:, c] * g_cum[:, c].exp().unsqueeze(-1)) @ state + attn[:, c] @ new_v
        outputs.append(out)
        to_end = (g_cum[:, c, -1:] - g_cum[:, c]).exp().unsqueeze(-1)  # [H, C, 1]
        state = state * g_cum[:, c, -1].exp()[:, None, None] + (k[:, c] * to_end).transpose(-1, -2) @ new_v
    o = torch.stack(outputs, dim=1).reshape(heads, -1, dv)[:, :length].permute(1, 0, 2)
    return o, state


def _delta_rule_inputs(q, k, v, g, beta):
    """fp32 inputs of the delta rule over [tokens, heads, dim]: q and k l2-normalised (q scaled by Dk^-0.5), and
    repeated for grouped value attention (each q/k head serves `ratio` consecutive value heads)."""
    ratio = v.shape[1] // k.shape[1]
    q = l2norm(q.float()).repeat_interleave(ratio, dim=1) * q.shape[-1] ** -0.5
    k = l2norm(k.float()).repeat_interleave(ratio, dim=1)
    return q, k, v.float(), g.float(), beta.float()


def torch_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, initial_state=None, output_final_state=False):
    """Per-document chunked delta rule over a packed stream; q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv];
    cu_seqlens on the CPU (PackedSequence.cu_seqlens_cpu), as the loop over documents reads it."""
    dtype = v.dtype
    q, k, v, g, beta = _delta_rule_inputs(q, k, v, g, beta)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_state is None else initial_state[i]
        o, s = torch_chunk_gated_delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], init
        )
        outs.append(o)
        states.append(s)
    final = torch.stack(states) if output_final_state else None
    return torch.cat(outs).to(dtype), final


def torch_gated_delta_rule_step(q, k, v, g, beta, state, out_state=None):
    """One generation step of the delta rule, one new token per row, all rows at once: q, k [B, Hk, Dk]; v [B, Hv,
    Dv]; g, beta [B, Hv]; state [B, Hv, Dk, Dv] fp32 -> (o [B, Hv, Dv] in v's dtype, the new state fp32, written into
    `out_state` when given: `state` itself for a static cache). The chunked form's arithmetic for a one-token chunk
    (torch_chunk_gated_delta_rule), batched over the rows."""
    dtype = v.dtype
    q, k, v, g, beta = _delta_rule_inputs(q, k, v, g, beta)
    decay = g.exp()
    w = k * (beta * decay).unsqueeze(-1)
    new_v = v * beta.unsqueeze(-1) - (w.unsqueeze(-2) @ state).squeeze(-2)
    out = ((q * decay.unsqueeze(-1)).unsqueeze(-2) @ state).squeeze(-2) + (q * k).sum(-1, keepdim=True) * new_v
    state = state * decay[..., None, None] + k.unsqueeze(-1) @ new_v.unsqueeze(-2)
    return out.to(dtype), (state if out_state is None else out_state.copy_(state))


# --------------------------------------------------------------------------------------------------------------
# Attention over one document
# --------------------------------------------------------------------------------------------------------------


def sdpa_one_document(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """SDPA over one document: q [Lq, H, D], k / v [Lk, Hkv, D] (kv heads repeated for grouped-query attention) ->
    [Lq, H, D]. Causal with the queries as the last Lq of the Lk positions (Lk > Lq: cached keys come first)."""
    groups = q.shape[1] // k.shape[1]
    qd = q.transpose(0, 1)
    kd, vd = (t.transpose(0, 1).repeat_interleave(groups, dim=0) for t in (k, v))
    q_len, kv_len = q.shape[0], k.shape[0]
    if causal and kv_len != q_len:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale).transpose(0, 1)
    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale).transpose(0, 1)
