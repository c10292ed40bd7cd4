"""Selective recompute: what the backward of a checkpointed decoder layer reruns (`checkpoint_granularity`).

`gradient_checkpointing_enable()` checkpoints every decoder layer as a whole (transformers' GradientCheckpointingLayer):
the backward reruns the layer's token mixer and its MLP / MoE block. The text config's `checkpoint_granularity`
narrows the rerun to one segment of the layer:
  * "layer" (default): the whole layer, transformers' checkpointing as it is;
  * "mlp": post_attention_layernorm and the MLP / MoE block; the token mixer keeps its activations;
  * "mixer": input_layernorm and the token mixer (Gated DeltaNet or attention); the MLP / MoE block keeps its
    activations.
"layer" keeps the least memory; a segment keeps the other segment's activations and saves its rerun.

How: GradientCheckpointingLayer runs the whole layer through `_gradient_checkpointing_func`, the function
`gradient_checkpointing_enable` installed (torch's checkpoint with the caller's gradient_checkpointing_kwargs),
whenever the layer's checkpointing is on. Under a segment granularity that attribute reads as a plain call, and the
layer runs its segment through the installed function instead (`run_segment`): use_reentrant and the other kwargs
apply as the caller gave them, and `gradient_checkpointing` still says that the layer is checkpointed. The segment
outside runs as without checkpointing, its norm / SwiGLU / gate outputs recomputed by recompute.py
(`run_layers` installs it unless a layer is checkpointed whole). Loss and gradients are bitwise those of
checkpointing whole layers (tests/modeling/test_checkpoint_granularity.py).

Across a segment's boundary: the router logits leave the MLP segment and the attention probabilities the mixer
segment as outputs of the checkpointed function, so a gradient on them (the load-balancing loss) reaches the
segment's rerun as under whole-layer checkpointing; the experts a MoE layer replays (routing_replay.py) enter the MLP
segment as an argument without a gradient.
"""

from __future__ import annotations

from functools import partial

import torch

from .configuration_qwen3_5_packed import CHECKPOINT_GRANULARITIES


def _run_unchecked(function, *args):
    """GradientCheckpointingLayer's call of the whole layer when only a segment of it is checkpointed."""
    return function(*args)


class SegmentCheckpointing:
    """Mixin of a GradientCheckpointingLayer made of a "mixer" and an "mlp" segment that holds its text config as
    `self.config`: checkpoints the whole layer or one segment, as `config.checkpoint_granularity` says (read at every
    forward, so it can be changed on a loaded model). The layer's `stream_pieces(batch)` says where it runs a stream
    in pieces instead, each checkpointed whole (layer_pieces.py)."""

    # The checkpoint function `gradient_checkpointing_enable` installed (through `_gradient_checkpointing_func`).
    checkpoint_function = None

    @property
    def _gradient_checkpointing_func(self):
        # Without autograd recording there is no backward to rerun anything: a plain call, as transformers 5 decides
        # itself (4.x checkpoints a training-mode layer even then, e.g. generating in training mode, where a checkpoint
        # would read the RNG state, which a CUDA graph capture of the step refuses: decode_graph.py).
        if self.granularity() == "layer" and torch.is_grad_enabled():
            return self._checkpoint_whole_layer
        return _run_unchecked

    def _checkpoint_whole_layer(self, function, *args):
        """The installed checkpoint function around GradientCheckpointingLayer's call of the layer (`function`: the
        forward with its keyword arguments bound), except where the layer runs its stream in pieces: those are
        checkpointed one by one (layer_pieces.py)."""
        batch = getattr(function, "keywords", {}).get("batch")
        if batch is not None and self.stream_pieces(batch) is not None:
            return function(*args)
        return self.checkpoint_function(function, *args)

    @_gradient_checkpointing_func.setter
    def _gradient_checkpointing_func(self, function):
        self.checkpoint_function = function

    def granularity(self) -> str:
        granularity = self.config.checkpoint_granularity
        if granularity not in CHECKPOINT_GRANULARITIES:  # set on the config after it was validated
            raise ValueError(
                f"checkpoint_granularity must be one of {', '.join(map(repr, CHECKPOINT_GRANULARITIES))}, got "
                f"{granularity!r}"
            )
        return granularity

    def recomputed_segment(self) -> str | None:
        """What the backward of a forward starting now reruns: "layer", "mlp", "mixer", or None (nothing)."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self.granularity()
        return None

    def run_segment(self, segment: str, function, hidden: torch.Tensor, **arguments):
        """function(hidden, **arguments), checkpointed when `segment` is what the backward reruns. `hidden` goes
        positionally: with use_reentrant=True only positional tensors carry a gradient out of the checkpoint."""
        if self.recomputed_segment() == segment:
            return self.checkpoint_function(partial(function, **arguments), hidden)
        return function(hidden, **arguments)


__all__ = ["SegmentCheckpointing"]
