"""vLLM's routed experts for MoE routing replay: starting an engine that returns them, placing them in GRPO's padded
layout, and a recorder that stands in for vLLM's own capture where the engine cannot run it (vLLM-CPU).

vLLM 0.32: `LLM(..., enable_return_routed_experts=True)` gives every `CompletionOutput` a `routed_experts` numpy
array `[tokens, num_hidden_layers, top_k]` (`SamplingParams.routed_experts_prompt_start` skips leading prompt
tokens; 0 keeps them all): one row per token the engine ran a forward on, from the first prompt token on (the last
sampled token is never run, so it may be missing), one column per decoder layer (MoE layers only carry routing).
The capture is wired into vLLM's Model Runner V2 only, and vLLM-CPU starts that runner only with Triton's CPU
backend (triton-cpu, which PyPI's triton lacks): there the engine refuses the option at start ("AuxOutput Connector
requires Model Runner V2", or with VLLM_USE_V2_MODEL_RUNNER=1 "Model Runner V2 requires Triton").

`RouterRecorder` records the same ids on such an engine, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): it binds a
callback to every MoE router of the engine's model, the hook vLLM's own capturer binds (`BaseRouter.set_capture_fn`,
called with the top-k ids of every token the router routes), runs a generate() call's requests one at a time (so
every routed row belongs to the one running request), and attaches the array to each `CompletionOutput`.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

ENGINE_OPTION = "enable_return_routed_experts"
NO_EXPERT = -1  # the model's marker for a token without replayed ids (modeling/routing_replay.py)


def check_vllm_returns_routed_experts() -> None:
    """ValueError unless the installed vLLM has `LLM(..., enable_return_routed_experts=...)`."""
    try:
        import vllm
        from vllm import LLM
    except ImportError as error:
        raise ValueError(f"routing replay needs vLLM (with {ENGINE_OPTION}); it does not import: {error}") from error
    if ENGINE_OPTION not in inspect.signature(LLM.__init__).parameters:
        raise ValueError(
            f"routing replay needs a vLLM that returns routed experts (LLM({ENGINE_OPTION}=True), "
            f"vLLM 0.32 has it); vLLM {vllm.__version__} has no such option"
        )


def start_engine_returning_routed_experts(llm_class, *args, **kwargs):
    """`llm_class(*args, enable_return_routed_experts=True, **kwargs)`; an engine that refuses the option at start
    raises ValueError saying so (vLLM-CPU does: see the module doc)."""
    try:
        return llm_class(*args, **{**kwargs, ENGINE_OPTION: True})
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        raise ValueError(
            f"routing replay: this vLLM refuses {ENGINE_OPTION}=True at start ({error}). vLLM 0.32 "
            "returns routed experts from its Model Runner V2 only, which needs Triton with a backend "
            "for this device (on CPU: triton-cpu)"
        ) from error


def moe_layer_columns(config, num_columns: int) -> list[int]:
    """Which columns of an engine's array are this model's MoE layers, in order: all of them when the array has one
    column per MoE layer, else (one per decoder layer, vLLM's layout) the MoE layers' indices."""
    text = config.get_text_config()
    moe_layers = [i for i in range(text.num_hidden_layers) if text.layer_uses_moe(i)]
    if num_columns == len(moe_layers):
        return list(range(num_columns))
    if num_columns == text.num_hidden_layers:
        return moe_layers
    raise ValueError(
        f"routed experts have {num_columns} layers; the model has {text.num_hidden_layers} decoder "
        f"layers, {len(moe_layers)} of them MoE"
    )


def padded_routed_experts(
    arrays, prompt_lengths, completion_lengths, prompt_width: int, completion_width: int, config
) -> torch.Tensor:
    """Per-completion engine arrays -> long [batch, prompt_width + completion_width, MoE layers, top_k] in GRPO's
    layout (left-padded prompt, right-padded completion); -1 on pads and on any token the engine did not run (the
    last sampled token), which then route normally."""
    top_k = config.get_text_config().num_experts_per_tok
    first = np.asarray(arrays[0])
    columns = moe_layer_columns(config, first.shape[1])
    out = torch.full((len(arrays), prompt_width + completion_width, len(columns), top_k), NO_EXPERT, dtype=torch.long)
    for row, (array, prompt_len, completion_len) in enumerate(
        zip(arrays, prompt_lengths, completion_lengths, strict=True)
    ):
        array = np.asarray(array)
        total = prompt_len + completion_len
        if array.ndim != 3 or array.shape[0] not in (total - 1, total) or array.shape[2] != top_k:
            raise ValueError(
                f"completion {row}: routed experts of shape {array.shape}, expected [{total - 1} or "
                f"{total} tokens (prompt {prompt_len} + completion {completion_len}), layers, {top_k}]"
            )
        start = prompt_width - prompt_len
        out[row, start : start + array.shape[0]] = torch.from_numpy(array[:, columns].astype(np.int64))
    return out


class RouterRecorder:
    """Records the experts an in-process vLLM engine routes every token to and attaches them to its outputs as
    `CompletionOutput.routed_experts` (`[prompt + completion - 1, num_hidden_layers, top_k]`, vLLM's layout).

    `install()` binds the routers and wraps `llm.generate`, which then runs its requests one at a time; `recorded`
    holds the arrays of the last call's completions, in order. Rows that do not add up to one per run token (a
    prefix-cache hit skips prompt tokens) raise RuntimeError: start the engine with `enable_prefix_caching=False`.
    The engine must run eagerly (`enforce_eager=True`): a graph compiled before `install()` keeps the routers as
    they were traced, without the callback."""

    def __init__(self, llm):
        from vllm.config import CompilationMode
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.llm = llm
        if llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError(
                "RouterRecorder needs an eager engine (LLM(..., enforce_eager=True)): a compiled graph "
                "never calls a router callback bound after it was traced"
            )
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        self.runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not self.runners:
            raise ValueError("this vLLM model has no MoE router to record")
        self.num_layers = llm.llm_engine.model_config.get_total_num_hidden_layers()
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.recorded: list[np.ndarray] = []

    def install(self):
        for runner in self.runners:
            runner.router.set_capture_fn(lambda ids, layer=runner.layer_id: self.rows[layer].append(ids.clone()))
        generate = self.llm.generate

        def generate_recording(prompts, sampling_params=None, *args, **kwargs):
            prompts = prompts if isinstance(prompts, list) else [prompts]
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
            outputs, self.recorded = [], []
            for prompt, param in zip(prompts, params, strict=True):
                if param is not None and param.n != 1:
                    raise ValueError(
                        "RouterRecorder records one completion per request (SamplingParams.n=1, as "
                        "TRL's colocate mode asks); repeat the prompt instead"
                    )
                self.rows = {runner.layer_id: [] for runner in self.runners}
                (output,) = generate([prompt], param, *args, **kwargs)
                self._attach(output)
                outputs.append(output)
            return outputs

        self.llm.generate = generate_recording
        return self

    def _attach(self, output) -> None:
        for completion in output.outputs:
            expected = len(output.prompt_token_ids) + len(completion.token_ids) - 1
            layers = {layer: torch.cat(chunks) for layer, chunks in self.rows.items()}
            counts = {layer: ids.shape[0] for layer, ids in layers.items()}
            if set(counts.values()) != {expected}:
                raise RuntimeError(
                    f"recorded routing rows per layer {counts}, expected {expected} (prompt "
                    f"{len(output.prompt_token_ids)} + completion {len(completion.token_ids)} - 1): "
                    "a prefix-cache hit? start the engine with enable_prefix_caching=False"
                )
            top_k = next(iter(layers.values())).shape[1]
            array = np.zeros((expected, self.num_layers, top_k), dtype=np.int64)
            for layer, ids in layers.items():
                array[:, layer] = ids.cpu().numpy()
            completion.routed_experts = array
            self.recorded.append(array)


@torch.no_grad()
def model_routing(model, docs) -> list[torch.Tensor]:
    """The experts the model picks itself for every token of each document (all documents packed in one row):
    per document long [len, MoE layers, top_k]."""
    device = next(model.parameters()).device
    ids = torch.tensor([[t for d in docs for t in d]], device=device)
    cu = torch.tensor([0] + [len(d) for d in docs], device=device).cumsum(0)
    out = model(input_ids=ids, cu_seqlens=cu, output_router_logits=True, use_cache=False)
    top_k = model.config.get_text_config().num_experts_per_tok
    stream = torch.stack([layer.float().softmax(-1).topk(top_k, dim=-1).indices for layer in out.router_logits], 1)
    return list(stream.cpu().split([len(d) for d in docs]))


def routing_disagreement(engine_arrays, model_routes, config) -> dict:
    """How often the model's own top-k set differs from the engine's, over every (token, MoE layer) the engine
    reports (`engine_arrays`: per document [tokens, layers, top_k]; `model_routes`: `model_routing`'s)."""
    columns = moe_layer_columns(config, np.asarray(engine_arrays[0]).shape[1])
    differ = []
    for array, own in zip(engine_arrays, model_routes, strict=True):
        engine = torch.from_numpy(np.asarray(array)[:, columns].astype(np.int64))
        own = own[: engine.shape[0]]
        differ.append((engine.sort(-1).values != own.sort(-1).values).any(-1))  # [tokens, layers]
    differ = torch.cat(differ)
    return {
        "token_layer_sets": int(differ.numel()),
        "disagreement_rate": differ.float().mean().item(),
        "tokens_with_any_layer_disagreeing": differ.any(-1).float().mean().item(),
        "per_layer": differ.float().mean(0).tolist(),
    }
