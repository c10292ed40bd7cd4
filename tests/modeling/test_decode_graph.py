"""The static cache and its decode steps replayed as graphs (qwen35_packed/modeling/decode_graph.py, cache.py).

On the CPU the graphs are traced instead of captured: `torch.fx`'s make_fx in real mode records the step's aten
ops on the tensors they touch, and a replay reruns exactly those ops on the same tensors, without the Python around
them, as a CUDA graph replays its kernels. A step that read a device value on the host fails to trace (as a capture
fails on the GPU); a step whose shapes or tensors came from the host and went stale replays wrong values; a step
whose host counts the replay does not redo leaves generate() out of step. The CUDA graphs themselves are tested in
tests/gpu/test_gpu.py."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import transformers
from conftest import builtin_pair, packed_model
from torch.fx.experimental.proxy_tensor import make_fx

from qwen35_packed.modeling.cache import Qwen3_5PackedCache
from qwen35_packed.modeling.decode_graph import DecodeGraphs
from qwen35_packed.modeling.kernel_selection import KernelChoice
from qwen35_packed.modeling.kernel_set import kernel_set
from qwen35_packed.modeling.outputs import CACHE_FIELD


class TracedGraphs:
    """A graph backend for the CPU: each capture traces the step; counts the captures and replays."""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def __call__(self, step):
        produced = []

        def record():
            produced.append(step())
            return produced[-1]

        graph = make_fx(record, tracing_mode="real")()
        self.captures += 1

        def replay():
            self.replays += 1
            return graph()

        return produced[0], replay


def _model(kind: str):
    model = packed_model(kind)
    if kind == "moe":  # the grouped experts (the GPU's path; the per-expert loop sizes its chunks on the host)
        model.model.inject_kernels(kernel_set(KernelChoice("torch", "sdpa", moe="grouped_mm")))
    return model


def _prompts(vocab: int, rows: int = 3, columns: int = 7, seed: int = 1):
    ids = torch.randint(3, vocab, (rows, columns), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one row left-padded
    return ids, mask


def _cache_of(output):
    return getattr(output, CACHE_FIELD)


@pytest.mark.parametrize("kind, lora", [("dense", False), ("moe", False), ("moe", True)])
def test_replayed_steps_equal_the_dynamic_cache_steps(kind, lora):
    """Prefill, then decode steps fed back greedily, on a static cache whose steps are traced graphs and on the
    dynamic cache: the same logits at every step (within fp32 rounding once attention runs over a grown capacity),
    the same counts, one capture until a row outgrows the capacity, then one more. With `lora`: PEFT LoRA (non-zero
    B) on every projection and the experts, as GRPO generates without vLLM."""
    model = _model(kind)
    if lora:
        from peft import get_peft_model

        from qwen35_packed.integrations.lora import lora_config

        torch.manual_seed(2)
        model = get_peft_model(model, lora_config(model, r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False))
    ids, mask = _prompts(model.config.vocab_size)
    graphs = TracedGraphs()
    static = Qwen3_5PackedCache(model.config.layer_types, ids.shape[0], capacity=9)
    static.decode_graphs = DecodeGraphs(capture=graphs)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, cache=static, use_cache=True)
        dynamic = _cache_of(model(input_ids=ids, attention_mask=mask, use_cache=True))
        token = first.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(8):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            ours = model(input_ids=token, attention_mask=mask, cache=static, use_cache=True).logits
            want = model(input_ids=token, attention_mask=mask, cache=dynamic, use_cache=True).logits
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
            assert static.consumed_columns == dynamic.consumed_columns
            assert torch.equal(static.seen_tokens, dynamic.seen_tokens)
            attention = [i for i, kind_ in enumerate(model.config.layer_types) if kind_ == "full_attention"]
            assert static.layers[attention[0]].host_lengths == dynamic.layers[attention[0]].host_lengths
            assert torch.equal(static.real_columns, dynamic.real_columns)
            token = want[:, -1].argmax(-1, keepdim=True)
    assert not static.decode_graphs.disabled
    # step 0 eager; step 1 captured (7 prompt tokens + 2 fill the capacity of 9); step 2 grows the buffers: a second
    # capture; steps 3-7 replayed
    assert (graphs.captures, graphs.replays) == (2, 5)
    assert static.layers[attention[0]].capacity == 18


def test_a_replayed_step_keeps_the_cache_tensors_and_refuses_token_ids_outside_the_vocabulary():
    model = _model("dense")
    ids, mask = _prompts(model.config.vocab_size)
    static = Qwen3_5PackedCache(model.config.layer_types, ids.shape[0], capacity=32)
    static.decode_graphs = DecodeGraphs(capture=TracedGraphs())
    with torch.no_grad():
        token = model(input_ids=ids, cache=static, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(3):
            token = model(input_ids=token, cache=static, use_cache=True).logits[:, -1:].argmax(-1)
        held = static.decode_state()
        token = model(input_ids=token, cache=static, use_cache=True).logits[:, -1:].argmax(-1)
        assert all(a is b for a, b in zip(static.decode_state(), held))
        # beam search reorders rows between steps: in place, so the captured step stays valid
        static.reorder_cache(torch.tensor([2, 0, 1]))
        assert all(a is b for a, b in zip(static.decode_state(), held))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model(input_ids=torch.full_like(token, model.config.vocab_size), cache=static, use_cache=True)


def test_a_failed_capture_is_said_and_the_steps_run_eagerly(caplog):
    def failing(step):
        # A capture runs the forward's Python (and so its host counts) but none of its device work, then fails: the
        # step runs here and the cache's tensors are put back as they were.
        state = static.decode_state()
        saved = [t.clone() for t in state]
        step()
        for tensor, before in zip(state, saved):
            tensor.copy_(before)
        raise RuntimeError("operation not permitted when stream is capturing")

    model = _model("dense")
    ids, _ = _prompts(model.config.vocab_size)
    static = Qwen3_5PackedCache(model.config.layer_types, ids.shape[0], capacity=32)
    static.decode_graphs = DecodeGraphs(capture=failing)
    with torch.no_grad():
        dynamic = _cache_of(model(input_ids=ids, use_cache=True))
        token = model(input_ids=ids, cache=static, use_cache=True).logits[:, -1:].argmax(-1)
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                ours = model(input_ids=token, cache=static, use_cache=True).logits
                want = model(input_ids=token, cache=dynamic, use_cache=True).logits
                torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
                assert static.consumed_columns == dynamic.consumed_columns
                token = want[:, -1:].argmax(-1)
    assert static.decode_graphs.disabled
    assert "could not be captured as a CUDA graph" in caplog.text


def test_the_garbage_collector_is_paused_while_a_step_is_captured():
    """A collection inside a capture could free another cache's graphs there (module docstring of decode_graph.py):
    the collector is off while the graph backend runs, and on again after, also after a failed capture."""

    seen = []

    def recording(step, fail):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return TracedGraphs()(step)

    model = _model("dense")
    ids, _ = _prompts(model.config.vocab_size)
    for fail in (False, True):
        static = Qwen3_5PackedCache(model.config.layer_types, ids.shape[0], capacity=32)
        static.decode_graphs = DecodeGraphs(capture=lambda step, fail=fail: recording(step, fail))
        with torch.no_grad():
            token = model(input_ids=ids, cache=static, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(2):
                token = model(input_ids=token, cache=static, use_cache=True).logits[:, -1:].argmax(-1)
        assert gc.isenabled()
        assert static.decode_graphs.disabled == fail
    assert seen == [False, False]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_generate_with_a_static_cache_gives_the_dynamic_caches_sequences(kind):
    """Greedy, beam search and seeded sampling with several sequences per prompt (rows expanded before the
    prefill), left-padded prompts: cache_implementation="static" gives the sequences of the default cache, with a
    static cache of the prompt's columns plus max_new_tokens per row."""
    model = _model(kind)
    ids, mask = _prompts(model.config.vocab_size)
    settings = [
        {"do_sample": False},
        {"do_sample": False, "num_beams": 2},
        {"do_sample": True, "num_return_sequences": 2, "top_k": 20},
    ]
    for setting in settings:
        runs = {}
        for implementation in ("dynamic", "static"):
            torch.manual_seed(5)
            with torch.no_grad():
                runs[implementation] = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=6,
                    min_new_tokens=6,
                    pad_token_id=0,
                    cache_implementation=implementation,
                    return_dict_in_generate=True,
                    **setting,
                )
        assert torch.equal(runs["static"].sequences, runs["dynamic"].sequences), setting
        cache = _cache_of(runs["static"])
        assert cache.static and cache.capacity == ids.shape[1] + 6


@pytest.mark.parametrize("where", ["argument", "generation_config", "model_generation_config"])
@pytest.mark.parametrize("implementation", ["static", "dynamic"])
def test_generate_passes_transformers_no_cache_implementation_to_ignore(implementation, where, monkeypatch):
    """transformers makes no cache for this model and warns that a cache_implementation it gets "will be ignored":
    the one a caller chose is honoured by this model's own cache, so transformers is given none and says nothing."""
    model = _model("dense")
    ids, mask = _prompts(model.config.vocab_size)
    said = []
    generation_logger = transformers.generation.utils.logger
    monkeypatch.setattr(generation_logger, "warning", lambda message, *args, **kwargs: said.append(message))
    transformers.utils.logging.warning_once.cache_clear()  # a warning said before in this process would not repeat
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    if where == "argument":
        options["cache_implementation"] = implementation
    elif where == "generation_config":
        options = {"generation_config": transformers.GenerationConfig(cache_implementation=implementation, **options)}
    else:
        monkeypatch.setattr(model.generation_config, "cache_implementation", implementation)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **options)
    assert _cache_of(out).static == (implementation == "static")
    assert not [message for message in said if "cache_implementation" in message], said


def test_generate_with_a_static_cache_equals_the_builtin_greedy():
    """The built-in model's greedy sequences (its own default cache), on left-padded prompts, fp32."""
    builtin, ours = builtin_pair("dense")
    ids, mask = _prompts(ours.config.vocab_size)
    with torch.no_grad():
        want = builtin.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = ours.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static"
        )
    assert torch.equal(got, want)


def test_a_static_cache_needs_a_capacity_of_a_token():
    with pytest.raises(ValueError, match="capacity of at least one token"):
        Qwen3_5PackedCache(["full_attention"], 2, capacity=0)


def test_generate_fills_a_static_cache_the_caller_passes():
    model = _model("dense")
    ids, mask = _prompts(model.config.vocab_size)
    given = Qwen3_5PackedCache(model.config.layer_types, ids.shape[0], capacity=40)
    options = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, return_dict_in_generate=True, **{CACHE_FIELD: given}, **options)
        want = model.generate(ids, **options)
    assert _cache_of(out) is given and given.consumed_columns == ids.shape[1] + 4
    assert given.layers[model.config.layer_types.index("full_attention")].capacity == 40
    assert torch.equal(out.sequences, want)


def test_models_whose_forward_moves_or_gathers_weights_are_not_captured():
    """Parameters that forward hooks gather (ZeRO-3) or move (Accelerate's offloading), or a model dispatched over
    devices: the decode steps run eagerly."""
    from qwen35_packed.modeling.decode_graph import graph_refusal

    model = _model("dense")
    assert graph_refusal(model) is None
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    assert "several devices" in graph_refusal(model)
    del model.hf_device_map
    model.model.layers[0]._hf_hook = object()
    assert "Accelerate hooks" in graph_refusal(model)
    del model.model.layers[0]._hf_hook
    next(model.parameters()).ds_id = 0
    assert "ZeRO-3" in graph_refusal(model)


def test_vision_language_decode_steps_replay_after_a_prefill_with_images():
    """The vision-language class: a prefill with images (the next text position is the prompt's largest 3D position
    + 1), then traced graph steps against the dynamic cache's steps: the same logits and 3D rope positions."""
    from vl_tiny import PAD, grid_tensor, image_tokens, packed_vl_model, pixels_for, token_types

    model = packed_vl_model("dense")
    grids = [[1, 4, 4], [1, 2, 4]]
    rows = [[5, 6] + image_tokens(grids[0]) + [7, 8, 9], [10] + image_tokens(grids[1]) + [11]]
    width = max(len(row) for row in rows)
    ids, mask = torch.full((2, width), PAD), torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    vision = dict(
        pixel_values=pixels_for(grids, torch.Generator().manual_seed(0)),
        image_grid_thw=grid_tensor(grids),
        mm_token_type_ids=token_types(ids),
    )
    graphs = TracedGraphs()
    layer_types = model.config.get_text_config().layer_types
    static = Qwen3_5PackedCache(layer_types, 2, capacity=width + 8)
    static.decode_graphs = DecodeGraphs(capture=graphs)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, cache=static, use_cache=True, **vision)
        dynamic = _cache_of(model(input_ids=ids, attention_mask=mask, use_cache=True, **vision))
        token = first.logits[:, -1:].argmax(-1)
        for _ in range(5):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            ours = model(input_ids=token, attention_mask=mask, cache=static, use_cache=True)
            want = model(input_ids=token, attention_mask=mask, cache=dynamic, use_cache=True)
            torch.testing.assert_close(ours.logits, want.logits, rtol=1e-5, atol=1e-5)
            assert torch.equal(ours.rope_position_ids, want.rope_position_ids)
            token = want.logits[:, -1:].argmax(-1)
    assert not static.decode_graphs.disabled and (graphs.captures, graphs.replays) == (1, 3)
