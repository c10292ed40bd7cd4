"""The pure-PyTorch kernels against naive per-token references, with varlen cases."""

import torch
import torch.nn.functional as F

from qwen35_packed.modeling import kernels
from qwen35_packed.modeling.packing import PackedSequence


def _packed(lengths):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSequence(cu, max(lengths), None, None, (1, int(cu[-1])))


def naive_delta_rule(q, k, v, g, beta, state=None):
    """Token-by-token gated delta rule for one document (fp64), GVA by repeat-interleave."""
    ratio = v.shape[1] // k.shape[1]
    q = F.normalize(q, dim=-1, eps=1e-6).repeat_interleave(ratio, 1) * q.shape[-1] ** -0.5
    k = F.normalize(k, dim=-1, eps=1e-6).repeat_interleave(ratio, 1)
    heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    s = torch.zeros(heads, dk, dv, dtype=q.dtype) if state is None else state.clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + torch.einsum("hk,hv->hkv", k[t], delta)
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def test_delta_rule_varlen_matches_naive_per_document():
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 64, 65, 130, 7]
    n, hk, hv, d = sum(lengths), 2, 4, 16
    q, k = torch.randn(n, hk, d, generator=gen), torch.randn(n, hk, d, generator=gen)
    v = torch.randn(n, hv, d, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 3
    beta = torch.rand(n, hv, generator=gen)
    init = torch.randn(len(lengths), hv, d, d, generator=gen) * 0.1
    packed = _packed(lengths)
    out, final = kernels.torch_gated_delta_rule_varlen(q, k, v, g, beta, packed.cu_seqlens, init, True)
    start = 0
    for i, length in enumerate(lengths):
        sl = slice(start, start + length)
        exp_out, exp_state = naive_delta_rule(*(t[sl].double() for t in (q, k, v, g, beta)), init[i].double())
        assert torch.allclose(out[sl].double(), exp_out, atol=2e-5), length
        assert torch.allclose(final[i].double(), exp_state, atol=2e-5), length
        start += length


def naive_conv(x, weight, history=None):
    """One document: x [L, C], weight [C, K], history [C, K-1] of preceding inputs (zeros if None)."""
    kernel = weight.shape[1]
    hist = torch.zeros(x.shape[1], kernel - 1) if history is None else history
    full = torch.cat([hist.T, x])
    out = torch.stack([(full[t:t + kernel] * weight.T).sum(0) for t in range(x.shape[0])])
    return F.silu(out), full[-(kernel - 1):].T


def test_conv_varlen_never_crosses_documents_and_uses_history():
    gen = torch.Generator().manual_seed(1)
    lengths, channels, kernel = [1, 2, 3, 4, 9, 1], 5, 4
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    history = torch.randn(len(lengths), channels, kernel - 1, generator=gen)
    packed = _packed(lengths)
    for init in (None, history):
        out = kernels.torch_causal_conv1d_varlen(x, weight, packed.position_in_doc(), packed.doc_index(), init)
        final = kernels.conv_final_state(x, packed.cu_seqlens, kernel, init)
        start = 0
        for i, length in enumerate(lengths):
            sl = slice(start, start + length)
            exp_out, exp_final = naive_conv(x[sl], weight, None if init is None else init[i])
            assert torch.allclose(out[sl], exp_out, atol=1e-6)
            assert torch.allclose(final[i], exp_final, atol=0)
            start += length


def test_sdpa_per_document_attention_matches_masked_reference():
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 5, 17]
    n, heads, kv_heads, d = sum(lengths), 4, 2, 8
    q = torch.randn(n, heads, d, generator=gen)
    k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
    packed = _packed(lengths)
    out = kernels.varlen_causal_attention(q, k, v, packed, d**-0.5, kernels.KernelChoice("torch", "sdpa"))
    doc = packed.doc_index()
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * d**-0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    assert torch.allclose(out, expected, atol=1e-6)


def _saved_bytes(fn):
    """Bytes autograd keeps for the backward of fn() (tensors packed by saved-tensor hooks, storages counted once)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def test_compiled_elementwise_equals_eager_and_keeps_less_for_backward():
    # The compiled chains (what CUDA runs) against the eager formulas (what CPU runs), forced on CPU through
    # inductor: same values and gradients, and autograd keeps the bf16 inputs instead of fp32 temporaries.
    eager, compiled = kernels.KernelChoice("torch", "sdpa", "eager"), kernels.KernelChoice("torch", "sdpa", "compiled")
    gen = torch.Generator().manual_seed(0)
    n, h = 37, 64
    residual = torch.randn(n, h, generator=gen)
    update = torch.randn(n, h, generator=gen)
    weight = torch.randn(h, generator=gen) * 0.1
    heads = torch.randn(n, 4, 16, generator=gen)
    head_weight = torch.randn(16, generator=gen) * 0.1
    gate, up = torch.randn(n, 96, generator=gen), torch.randn(n, 96, generator=gen)

    def run(choice, dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (residual, update, weight, heads, head_weight, gate, up)]
        r, u, w, x, hw, g, p = leaves

        def forward():
            return (kernels.zero_centred_rms_norm(r + u, w, 1e-6, choice),
                    kernels.zero_centred_rms_norm(x, hw, 1e-6, choice),
                    kernels.swiglu(g, p, choice), kernels.sigmoid_gate(g, p, choice))

        outs, saved = _saved_bytes(forward)
        cotangents = torch.Generator().manual_seed(1)
        sum((o.float() * torch.randn(o.shape, generator=cotangents)).sum() for o in outs).backward()
        return outs, [t.grad for t in leaves], saved

    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        outs_e, grads_e, saved_e = run(eager, dtype)
        outs_c, grads_c, saved_c = run(compiled, dtype)
        for a, b in zip([*outs_e, *grads_e], [*outs_c, *grads_c]):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(b.float(), a.float(), atol=atol, rtol=atol)
        if dtype == torch.bfloat16:
            assert saved_c < 0.75 * saved_e, (saved_c, saved_e)


def test_elementwise_choice_follows_device_and_config():
    from qwen35_packed.configuration.configuration_qwen3_5_packed import Qwen3_5PackedConfig

    assert kernels.select_kernels(Qwen3_5PackedConfig(), torch.device("cpu"), torch.float32).elementwise == "eager"
    forced = Qwen3_5PackedConfig(elementwise_kernel="compiled")
    assert kernels.select_kernels(forced, torch.device("cpu"), torch.float32).elementwise == "compiled"
    import pytest

    with pytest.raises(ValueError, match="elementwise_kernel"):
        Qwen3_5PackedConfig(elementwise_kernel="fused")
