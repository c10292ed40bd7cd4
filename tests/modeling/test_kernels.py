"""The pure-PyTorch kernels against naive per-token references, with varlen cases."""

import functools

import pytest
import torch
import torch.nn.functional as F

from qwen35_packed.modeling import kernel_selection, kernels, reference_kernels
from qwen35_packed.modeling.kernel_selection import KernelChoice
from qwen35_packed.modeling.kernel_set import kernel_set
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


@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-state", "initial-state"])
def test_delta_rule_varlen_matches_naive_per_document(with_initial_state):
    """Every document of the stream runs the recurrence from its own state: zeros without `initial_state` (the
    training path; nothing carries over from the previous document), else its row of `initial_state`. The decays
    are mild (g in [-0.3, 0]) so a state carried across a boundary would still be visible many tokens later."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 64, 65, 130, 7]
    n, hk, hv, d = sum(lengths), 2, 4, 16
    q, k = torch.randn(n, hk, d, generator=gen), torch.randn(n, hk, d, generator=gen)
    v = torch.randn(n, hv, d, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 0.3
    beta = torch.rand(n, hv, generator=gen)
    init = torch.randn(len(lengths), hv, d, d, generator=gen) * 0.1 if with_initial_state else None
    packed = _packed(lengths)
    out, final = reference_kernels.torch_gated_delta_rule_varlen(q, k, v, g, beta, packed.cu_seqlens, init, True)
    start = 0
    for i, length in enumerate(lengths):
        sl = slice(start, start + length)
        state = init[i].double() if with_initial_state else None  # None: the naive recurrence starts from zeros
        exp_out, exp_state = naive_delta_rule(*(t[sl].double() for t in (q, k, v, g, beta)), state)
        where = f"document {i} ({length} tokens)"
        torch.testing.assert_close(out[sl].double(), exp_out, atol=2e-5, rtol=0, msg=lambda m: f"{where} output: {m}")
        torch.testing.assert_close(final[i].double(), exp_state, atol=2e-5, rtol=0, msg=lambda m: f"{where} state: {m}")
        start += length


def naive_conv(x, weight, history=None):
    """One document: x [L, C], weight [C, K], history [C, K-1] of preceding inputs (zeros if None)."""
    kernel = weight.shape[1]
    hist = torch.zeros(x.shape[1], kernel - 1) if history is None else history
    full = torch.cat([hist.T, x])
    out = torch.stack([(full[t : t + kernel] * weight.T).sum(0) for t in range(x.shape[0])])
    return F.silu(out), full[-(kernel - 1) :].T


def test_conv_varlen_never_crosses_documents_and_uses_history():
    gen = torch.Generator().manual_seed(1)
    lengths, channels, kernel = [1, 2, 3, 4, 9, 1], 5, 4
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    history = torch.randn(len(lengths), channels, kernel - 1, generator=gen)
    packed = _packed(lengths)
    for init in (None, history):
        out = reference_kernels.torch_causal_conv1d_varlen(
            x, weight, packed.position_in_doc(), packed.doc_index(), init
        )
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
    out = kernel_set(KernelChoice("torch", "sdpa")).attention(q, k, v, packed, d**-0.5)
    doc = packed.doc_index()
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * d**-0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    assert torch.allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize(
    "lengths",
    [[3, 9, 2], [1, 12, 9, 2], [9, 10, 4], [2, 5, 11], [16]],
    ids=["long-inside", "long-runs-around", "two-long-first", "long-last", "one-long"],
)
def test_long_documents_alone_through_sdpa_match_the_varlen_kernel(lengths):
    # long_documents="sdpa": documents of at least `alone_from` tokens run alone through SDPA, the runs of shorter
    # ones between them through the varlen kernel with boundaries relative to the run. The varlen kernel given is the
    # per-document reference (the real ones need a GPU), which records what it receives; values and every gradient
    # must equal the varlen kernel over the whole stream, and each document must get the same as alone.
    calls = []

    def recording_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal):
        assert causal
        calls.append((cu_seqlens.tolist(), max_seqlen, q.shape[0]))
        return kernels.attention_sdpa(q, k, v, cu_seqlens, max_seqlen, scale, causal)

    gen = torch.Generator().manual_seed(4)
    n, heads, kv_heads, d = sum(lengths), 4, 2, 8
    q0 = torch.randn(n, heads, d, generator=gen, dtype=torch.float64)
    k0, v0 = (torch.randn(n, kv_heads, d, generator=gen, dtype=torch.float64) for _ in range(2))
    cotangent = torch.randn(n, heads, d, generator=gen, dtype=torch.float64)

    def run(alone_from, lens):
        q, k, v = (t[: sum(lens)].clone().requires_grad_() for t in (q0, k0, v0))
        attention = functools.partial(
            kernels.causal_attention, varlen=recording_varlen, host_bounds=False, alone_from=alone_from
        )
        out = attention(q, k, v, _packed(lens), d**-0.5)
        out.mul(cotangent[: sum(lens)]).sum().backward()
        return out, q.grad, k.grad, v.grad

    whole = run(None, lengths)
    calls.clear()
    split = run(9, lengths)
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, atol=1e-12)
    # the varlen kernel saw only the runs of short documents, each from 0
    runs, current = [], [0]
    for length in lengths:
        if length >= 9:
            runs += [current] if len(current) > 1 else []
            current = [0]
        else:
            current.append(current[-1] + length)
    runs += [current] if len(current) > 1 else []
    assert [c[0] for c in calls] == runs
    # a long document at the front of a stream gets bitwise what it gets alone
    first = next(i for i, length in enumerate(lengths) if length >= 9)
    if first == 0:
        alone = run(9, lengths[:1])
        assert torch.equal(alone[0], split[0][: lengths[0]])


def test_the_kernel_set_runs_long_documents_alone_where_a_varlen_kernel_runs_the_rest():
    bound = {
        (attention, long_documents): kernel_set(KernelChoice("torch", attention, long_documents)).attention.keywords
        for attention in ("torch_varlen", "sdpa")
        for long_documents in ("varlen", "sdpa")
    }
    assert bound[("torch_varlen", "sdpa")]["alone_from"] == kernel_selection.LONG_DOCUMENT_TOKENS
    assert bound[("torch_varlen", "varlen")]["alone_from"] is None
    assert bound[("sdpa", "sdpa")]["alone_from"] is None  # SDPA already runs every document alone
    assert bound[("sdpa", "varlen")]["host_bounds"] and not bound[("torch_varlen", "varlen")]["host_bounds"]


def test_long_document_attention_follows_the_attention_kernel_and_is_validated():
    """auto: long documents alone through SDPA where a varlen kernel runs the rest (CUDA, half precision: the GPU
    tests), the varlen path where SDPA already runs every document alone (here)."""
    from qwen35_packed.configuration.configuration_qwen3_5_packed import Qwen3_5PackedConfig

    cpu = torch.device("cpu")
    assert kernel_selection.select_kernels(Qwen3_5PackedConfig(), cpu, torch.float32).attention == "sdpa"
    assert kernel_selection.select_kernels(Qwen3_5PackedConfig(), cpu, torch.float32).long_documents == "varlen"
    forced = Qwen3_5PackedConfig(long_document_attention="sdpa")
    assert kernel_selection.select_kernels(forced, cpu, torch.float32).long_documents == "sdpa"
    with pytest.raises(ValueError, match="long_document_attention must be one of 'auto', 'varlen', 'sdpa'"):
        Qwen3_5PackedConfig(long_document_attention="cudnn")


def test_elementwise_choice_follows_device_and_config():
    from qwen35_packed.configuration.configuration_qwen3_5_packed import Qwen3_5PackedConfig

    assert (
        kernel_selection.select_kernels(Qwen3_5PackedConfig(), torch.device("cpu"), torch.float32).elementwise
        == "eager"
    )
    forced = Qwen3_5PackedConfig(elementwise_kernel="eager")
    assert kernel_selection.select_kernels(forced, torch.device("cpu"), torch.float32).elementwise == "eager"
    for unknown in ("fused", "compiled"):  # "compiled": the torch.compile form the Triton kernels replaced
        with pytest.raises(ValueError, match="elementwise_kernel must be one of 'auto', 'triton', 'eager'"):
            Qwen3_5PackedConfig(elementwise_kernel=unknown)


# ------------------------------------------------------------------------------------------------ GDN short conv


def _conv_inputs(lengths, channels, kernel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype)
    return x, weight


def _conv_with_grads(choice, lengths, x, weight, cotangent):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = torch.cat(kernel_set(choice).conv(x, weight, _packed(lengths), [x.shape[1]]), dim=-1)
    out.float().mul(cotangent).sum().backward()
    return out, x.grad, weight.grad


def test_compiled_conv_equals_eager_conv_and_per_document():
    # conv_kernel="compiled" (torch.compile of the boundary-masked formula; inductor's C++ backend here) against the
    # eager formula, on streams with 1-token documents and documents shorter than the kernel: outputs and the
    # gradients of x and weight; then every document run alone through the compiled conv equals its packed slice.
    eager, compiled = (
        kernel_selection.KernelChoice("torch", "sdpa"),
        kernel_selection.KernelChoice("torch", "sdpa", conv="compiled"),
    )
    kernel, channels = 4, 6
    lengths = [1, 2, 3, 1, 9, 4, 1, 5]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, weight = _conv_inputs(lengths, channels, kernel, dtype, seed=3)
        cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
        expected = _conv_with_grads(eager, lengths, x, weight, cotangent)
        got = _conv_with_grads(compiled, lengths, x, weight, cotangent)
        for name, a, b in zip(("out", "grad x", "grad weight"), expected, got):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol, msg=f"{dtype} {name}")

    x, weight = _conv_inputs(lengths, channels, kernel, torch.float32, seed=5)
    (packed_out,) = kernel_set(compiled).conv(x, weight, _packed(lengths), [channels])
    start = 0
    for length in lengths:
        (alone,) = kernel_set(compiled).conv(x[start : start + length], weight, _packed([length]), [channels])
        torch.testing.assert_close(packed_out[start : start + length], alone, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(alone, naive_conv(x[start : start + length], weight)[0], atol=1e-5, rtol=1e-5)
        start += length


def test_conv_choice_follows_gdn_and_config():
    from qwen35_packed.configuration.configuration_qwen3_5_packed import Qwen3_5PackedConfig

    cpu = torch.device("cpu")
    assert kernel_selection.select_kernels(Qwen3_5PackedConfig(), cpu, torch.float32).conv == "torch"
    for forced in ("compiled", "torch"):
        assert (
            kernel_selection.select_kernels(Qwen3_5PackedConfig(conv_kernel=forced), cpu, torch.float32).conv == forced
        )
    if not kernel_selection.FLA_AVAILABLE:
        with pytest.raises(RuntimeError, match="conv_kernel='fla'"):
            kernel_selection.select_kernels(Qwen3_5PackedConfig(conv_kernel="fla"), cpu, torch.float32)
    with pytest.raises(RuntimeError, match="conv_kernel='triton'"):  # a CUDA kernel (CPU only in the interpreter)
        kernel_selection.select_kernels(Qwen3_5PackedConfig(conv_kernel="triton"), cpu, torch.float32)
    with pytest.raises(ValueError, match="conv_kernel"):
        Qwen3_5PackedConfig(conv_kernel="cuda")


# ------------------------------------------------------------------------------------------------ FLA dispatch


def test_fla_dispatch_passes_one_cu_seqlens_object_and_a_cpu_copy(monkeypatch):
    # FLA memoises its varlen index helpers by tensor identity and reads the boundaries back from the device unless
    # it gets a CPU copy: every layer's conv and delta-rule call must receive the same int64 device tensor and the
    # same CPU tensor, both equal to the stream's cu_seqlens. The fakes record what FLA would receive and compute the
    # reference result, so the calls run as in a model.
    from qwen35_packed.modeling.packing import build_packed_sequence

    calls = []

    def fake_conv(x, weight, activation, cu_seqlens, cu_seqlens_cpu):
        calls.append(("conv", cu_seqlens, cu_seqlens_cpu))
        position = torch.cat([torch.arange(int(e - s)) for s, e in zip(cu_seqlens_cpu[:-1], cu_seqlens_cpu[1:])])
        return reference_kernels.torch_causal_conv1d_varlen(x[0], weight, position).unsqueeze(0), None

    def fake_gdn(
        q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu
    ):
        calls.append(("gdn", cu_seqlens, cu_seqlens_cpu))
        o, final = reference_kernels.torch_gated_delta_rule_varlen(
            q[0], k[0], v[0], g[0], beta[0], cu_seqlens_cpu, initial_state, output_final_state
        )
        return o.unsqueeze(0), final

    monkeypatch.setattr(kernel_selection, "fla_causal_conv1d", fake_conv, raising=False)
    monkeypatch.setattr(kernel_selection, "fla_chunk_gated_delta_rule", fake_gdn, raising=False)
    fla = kernel_set(KernelChoice(gdn="fla", attention="sdpa", conv="fla"))

    gen = torch.Generator().manual_seed(6)
    lengths = [3, 1, 70, 2]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = build_packed_sequence((1, sum(lengths)), torch.device("cpu"), position_ids=positions)
    n, heads, d, kernel = sum(lengths), 2, 8, 4
    weight = torch.randn(3 * heads * d, kernel, generator=gen, requires_grad=True)
    hidden = torch.randn(n, 3 * heads * d, generator=gen, requires_grad=True)
    mixed = hidden
    for _ in range(3):  # three GDN layers on one stream
        q, k, v = (t.view(n, heads, d) for t in fla.conv(mixed, weight, packed, [heads * d] * 3))
        g, beta = -torch.rand(n, heads, generator=gen), torch.rand(n, heads, generator=gen)
        o, _ = fla.delta_rule(q, k, v, g, beta, packed)
        mixed = mixed + o.repeat(1, 3, 1).reshape(n, -1)
    mixed.sum().backward()

    assert [c[0] for c in calls] == ["conv", "gdn"] * 3
    device_cu, host_cu = calls[0][1], calls[0][2]
    assert all(c[1] is device_cu and c[2] is host_cu for c in calls)
    assert device_cu.dtype == torch.int64 and device_cu.device == packed.cu_seqlens.device
    assert host_cu.dtype == torch.int64 and host_cu.device.type == "cpu"
    assert device_cu.tolist() == host_cu.tolist() == packed.cu_seqlens.tolist() == [0, 3, 4, 74, 76]
    assert hidden.grad is not None and weight.grad is not None


# ------------------------------------------------------------------------------------------------ generation steps


def test_decode_steps_equal_the_stream_kernels_continuing_a_state():
    """One new token per row, all rows at once: the conv step gives the stream formula's bits continuing the cached
    inputs (and the last K inputs as the new state), the delta-rule step the chunked delta rule from the cached state
    (fp32 rounding), the attention step SDPA over each row's own keys only (rows of different lengths)."""
    from qwen35_packed.modeling.cache import Qwen3_5PackedCache

    gen = torch.Generator().manual_seed(11)
    rows, channels, kernel = 5, 12, 4
    x = torch.randn(rows, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    state = torch.randn(rows, channels, kernel, generator=gen)
    one_each = _packed([1] * rows)
    out, new_state = reference_kernels.torch_causal_conv1d_step(x, weight, state)
    stream = reference_kernels.torch_causal_conv1d_varlen(
        x, weight, one_each.position_in_doc(), one_each.doc_index(), state[..., 1:]
    )
    assert torch.equal(out, stream)
    assert torch.equal(new_state, torch.cat([state[..., 1:], x.unsqueeze(-1)], dim=-1))

    hk, hv, dk, dv = 2, 4, 8, 6
    q, k = torch.randn(rows, hk, dk, generator=gen), torch.randn(rows, hk, dk, generator=gen)
    v = torch.randn(rows, hv, dv, generator=gen)
    g, beta = -torch.rand(rows, hv, generator=gen), torch.rand(rows, hv, generator=gen)
    recurrent = torch.randn(rows, hv, dk, dv, generator=gen)
    o, final = reference_kernels.torch_gated_delta_rule_step(q, k, v, g, beta, recurrent)
    o_ref, final_ref = reference_kernels.torch_gated_delta_rule_varlen(
        q, k, v, g, beta, one_each.cu_seqlens_cpu(), recurrent, True
    )
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(final, final_ref, atol=1e-6, rtol=1e-6)

    heads, kv_heads, d = 4, 2, 8
    prompt = [3, 1, 7, 2, 5]
    cache = Qwen3_5PackedCache(["full_attention"], rows)
    layer = cache.layers[0]
    keys, values = (torch.randn(sum(prompt), kv_heads, d, generator=gen) for _ in range(2))
    layer.append(keys, values, [0, *torch.tensor(prompt).cumsum(0).tolist()])
    q_new = torch.randn(rows, heads, d, generator=gen)
    k_new, v_new = (torch.randn(rows, kv_heads, d, generator=gen) for _ in range(2))
    got = kernels.attention_step(q_new, k_new, v_new, layer, d**-0.5)
    for row in range(rows):
        alone = reference_kernels.sdpa_one_document(
            q_new[row : row + 1], layer.key_rows[row], layer.value_rows[row], d**-0.5, causal=True
        )
        assert layer.key_rows[row].shape[0] == prompt[row] + 1 and torch.equal(layer.key_rows[row][-1], k_new[row])
        torch.testing.assert_close(got[row : row + 1], alone, atol=1e-6, rtol=1e-6)


def test_the_pytorch_delta_rule_step_writes_a_given_state_in_place():
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(3, 4, 8, generator=gen)
    g, beta = -torch.rand(3, 4, generator=gen), torch.rand(3, 4, generator=gen)
    state = torch.randn(3, 4, 16, 8, generator=gen)
    want_out, want_state = reference_kernels.torch_gated_delta_rule_step(q, k, v, g, beta, state)
    held = state.clone()
    out, new_state = reference_kernels.torch_gated_delta_rule_step(q, k, v, g, beta, held, out_state=held)
    assert new_state is held and torch.equal(held, want_state) and torch.equal(out, want_out)
