"""Decode steps of a static cache replayed as CUDA graphs: one launch of the whole step instead of the Python of
every layer, which is what a decode step at small batch spends its time on.

When: the causal-LM forward of a static cache (`generate(cache_implementation="static")`, cache.py) on CUDA, with
autograd off, for a decode step: one new token id per row and nothing else asked of the forward (no labels,
embeddings, hidden states, router logits, attentions, routed experts or packing arguments). Everything else runs the
eager forward, which computes the same step.

How: the first decode step of a cache runs eagerly (it compiles the Triton kernels and settles the GEMMs'
workspaces). The next one is captured: the eager forward runs inside `torch.cuda.graph` on a token-id tensor owned
here, recording its kernels on the cache's buffers, which a static cache writes in place; the graph is then
replayed for that step and every later one, after the new token ids are copied in. What the forward does on the
host (the cache's counts of columns and row lengths) ran once during the capture; each replay repeats it with
`Qwen3_5PackedCache.count_decode_step_on_host`. A step is captured again when a tensor it holds is no longer the
cache's (a row outgrew the capacity, rows were dropped, a dtype widened) or when its settings differ
(`logits_to_keep`, the row count).

Not captured where the forward's Python does more than launch kernels on tensors that stay put: parameters
sharded by FSDP2 or tensor parallelism (DTensors gathered in forward hooks), partitioned by DeepSpeed ZeRO-3, or
moved by Accelerate's offloading hooks (`graph_refusal`); those steps run eagerly, said once in the log.

The token ids a replay copies in are checked against the vocabulary first, as the eager forward checks them (one
read on the host per step). A capture that fails (a kernel that reads the device on the host, e.g. a rope variant
that sizes itself by the largest position) is said once in the log and the cache's steps run eagerly from then on;
torch's random generators are taken out of the failed capture's state first, so that sampling goes on. The garbage
collector is paused during a capture: a collection there could free another cache's graphs (cyclic garbage) inside
it, which invalidates the capture.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable

import torch

from .cache import Qwen3_5PackedCache
from .packed_batch import check_token_ranges, wants_attentions, wants_hidden_states, wants_router_logits
from .projection import is_dtensor
from .utils import log_once

logger = logging.getLogger(__name__)


def cuda_graph_capture(step: Callable[[], tuple]) -> tuple[tuple, Callable[[], tuple]]:
    """Capture `step` (device work only, on tensors that outlive the graph) as a CUDA graph and run it once ->
    (its output tensors, a function that replays it and returns the same tensors, rewritten)."""
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: a CUDA call of another thread (a data loader, a logger) does not invalidate this capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = step()
    except RuntimeError:
        with contextlib.suppress(RuntimeError):  # the capture's own error is the one to report
            end_generators_capture()
        raise
    graph.replay()  # capturing ran nothing

    def replay() -> tuple:
        graph.replay()
        return output

    return output, replay


def end_generators_capture() -> None:
    """Take torch's default CUDA generators out of a failed capture. A capture whose end fails (it was invalidated)
    raises before the generators' epilogue, so they stay marked as capturing, and the next random op outside a
    capture (generate()'s sampling) fails with "Offset increment outside graph capture encountered unexpectedly". A
    capture that succeeds runs their prologue and epilogue, which clears the mark."""
    probe = torch.zeros(1, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
        probe.add_(1)


@contextlib.contextmanager
def garbage_collector_paused():
    """No automatic garbage collection inside: one during a capture could free another cache's CUDA graphs (cyclic
    garbage left by a caller) and their memory inside the capture, which invalidates it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CapturedStep:
    """One decode step's graph: its token-id input, its replay and the cache tensors it holds."""

    def __init__(self, token_ids: torch.Tensor, replay: Callable[[], tuple], state: list[torch.Tensor]):
        self.token_ids = token_ids
        self.replay = replay
        self.state = state

    def holds(self, state: list[torch.Tensor]) -> bool:
        return len(state) == len(self.state) and all(a is b for a, b in zip(state, self.state))


class DecodeGraphs:
    """The captured decode steps of one static cache (kept on it as `cache.decode_graphs`)."""

    def __init__(self, capture=cuda_graph_capture):
        self.capture = capture  # the graph backend; tests replay traced graphs on the CPU
        self.eager_steps = 0
        self.disabled = False
        self.capturing = False  # the forward that a capture runs is the eager one
        self.steps: dict[tuple, CapturedStep] = {}

    def run(self, forward, cache: Qwen3_5PackedCache, input_ids: torch.Tensor, logits_to_keep) -> tuple | None:
        """The output tensors of the decode step `input_ids` [B, 1] through a graph, or None where the step is to
        run eagerly (the first one, or after a failed capture). `forward(input_ids)` runs the eager forward of the
        step and returns those tensors."""
        if self.disabled or self.eager_steps == 0:
            self.eager_steps += 1
            return None
        check_token_ranges(forward.vocab_size, input_ids, None, "labels")
        cache.make_room_for_decode_step()
        key = (input_ids.shape[0], _settings_key(logits_to_keep), forward.fields)
        captured = self.steps.get(key)
        if captured is not None and captured.holds(cache.decode_state()):
            captured.token_ids.copy_(input_ids)
            outputs = captured.replay()
            cache.count_decode_step_on_host()
            return tuple(t.clone() for t in outputs)
        return self._capture(forward, cache, input_ids, key)

    def _capture(self, forward, cache, input_ids, key) -> tuple | None:
        self.steps.pop(key, None)  # its graph's memory goes back before the new capture takes its own
        token_ids = input_ids.clone()
        counts = cache.host_counts()
        self.capturing = True
        try:
            with garbage_collector_paused():
                outputs, replay = self.capture(lambda: forward(token_ids))
        except RuntimeError as error:  # e.g. "operation not permitted when stream is capturing"
            cache.restore_host_counts(counts)  # the capture ran the forward's Python, not its device work
            self.disabled = True
            log_once(
                logger,
                ("decode-graph", type(error).__name__, str(error)[:200]),
                "qwen35-packed: a decode step of the static cache could not be captured as a CUDA graph (%s); the "
                "decode steps run eagerly (the same results, without the graph's speed)",
                error,
            )
            return None
        finally:
            self.capturing = False
        self.steps[key] = CapturedStep(token_ids, replay, cache.decode_state())
        return tuple(t.clone() for t in outputs)


def _settings_key(logits_to_keep):
    return ("index", tuple(logits_to_keep.tolist())) if isinstance(logits_to_keep, torch.Tensor) else logits_to_keep


def graph_refusal(model) -> str | None:
    """Why the decode steps of `model` cannot be replayed as a graph (module docstring), or None."""
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "the model is dispatched over several devices (device_map)"
    for module in model.modules():
        if getattr(module, "_hf_hook", None) is not None:
            return "Accelerate hooks move its weights in the forward (offloading)"
    for parameter in model.parameters():
        if is_dtensor(parameter):
            return "its parameters are sharded (DTensor: FSDP2 or tensor parallelism)"
        if hasattr(parameter, "ds_id"):
            return "its parameters are partitioned by DeepSpeed ZeRO-3"
    return None


def asks_only_logits(
    config,
    *,
    labels,
    inputs_embeds,
    position_ids,
    use_cache,
    routed_experts,
    output_attentions,
    output_hidden_states,
    output_router_logits,
    others=(),
) -> bool:
    """Whether a causal-LM forward asks for nothing but the logits of its token ids (what a captured decode step
    gives): no labels, embeddings, positions, hidden states, attentions, router logits or replayed experts, a cache
    not refused, and every argument in `others` (packing boundaries, vision inputs, shift_labels) None."""
    return not (
        labels is not None
        or inputs_embeds is not None
        or position_ids is not None
        or use_cache is False
        or routed_experts is not None
        or wants_attentions(config, output_attentions)
        or wants_hidden_states(config, output_hidden_states)
        or wants_router_logits(config, output_router_logits)
        or any(value is not None for value in others)
    )


def decode_step_outputs(
    model, cache, input_ids, attention_mask, logits_to_keep, asked: dict, fields: tuple[str, ...] = ("logits",)
) -> dict | None:
    """The output `fields` (tensors of the model's output, by name) of a causal-LM forward's decode step through the
    cache's graphs, or None: the forward runs eagerly (the step is not a graph's: module docstring). `asked`: the
    forward's other arguments, by `asks_only_logits`' names, read only for a decode step of a static cache (every
    other forward, training included, stops at the first checks)."""
    if not (
        isinstance(cache, Qwen3_5PackedCache)
        and cache.static
        and cache.has_state
        and input_ids is not None
        # CUDA, or graphs a test set up on the cache (traced ones on the CPU)
        and (input_ids.is_cuda or cache.decode_graphs is not None)
        and input_ids.dim() == 2
        and input_ids.shape[1] == 1
        and input_ids.shape[0] == cache.batch_size
        and not torch.is_grad_enabled()
        and not (cache.decode_graphs is not None and cache.decode_graphs.capturing)
        and not cache.records_past  # assisted decoding: each step hands the cache what a crop needs (cache.py)
        and asks_only_logits(model.config, **asked)
    ):
        return None
    if attention_mask is not None and not bool(attention_mask[:, -1].bool().all()):
        return None  # a masked new token: the eager forward drops it
    if cache.decode_graphs is None:
        cache.decode_graphs = DecodeGraphs()
        refusal = graph_refusal(model)
        if refusal is not None:
            cache.decode_graphs.disabled = True
            log_once(
                logger,
                ("decode-graph-refused", refusal),
                "qwen35-packed: the static cache's decode steps run eagerly, not as CUDA graphs: %s",
                refusal,
            )
    step = _EagerStep(model, cache, logits_to_keep, fields)
    outputs = cache.decode_graphs.run(step, cache, input_ids, logits_to_keep)
    return None if outputs is None else dict(zip(fields, outputs))


class _EagerStep:
    """The eager forward of a decode step, as the graphs capture it: its output `fields`."""

    def __init__(self, model, cache, logits_to_keep, fields: tuple[str, ...]):
        self.model, self.cache, self.logits_to_keep, self.fields = model, cache, logits_to_keep, fields
        self.vocab_size = model.config.get_text_config().vocab_size

    def __call__(self, token_ids: torch.Tensor) -> tuple:
        output = self.model(
            input_ids=token_ids, cache=self.cache, use_cache=True, logits_to_keep=self.logits_to_keep, return_dict=True
        )
        return tuple(getattr(output, name) for name in self.fields)
