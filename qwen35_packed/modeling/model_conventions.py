"""What every packed PreTrainedModel class declares to transformers alike (text, vision-language, the vision tower's
weight initialisation): the loading rules, the fp32 GDN parameters, the cache this model makes itself, and the
initialisation transformers' own classes give linear, conv and embedding weights."""

from __future__ import annotations

import transformers
from torch import nn

from .checkpoint_keys import IGNORED_MISSING_EXPERT_KEYS, account_before_loading
from .gated_deltanet import FP32_PARAMETERS
from .numerics import enable_numerics_check


class PackedModelConventions:
    """Mixed in before PreTrainedModel by the text and vision-language base classes."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _keys_to_ignore_on_load_missing = list(IGNORED_MISSING_EXPERT_KEYS)
    _keep_in_fp32_modules_strict = list(FP32_PARAMETERS)
    _supports_sdpa = True
    # Never under context parallelism, whatever the layer types: the GDN state and conv would restart at every shard
    # boundary and packed documents would be cut. transformers' `supports_context_parallel` reads this (it already
    # says False for configs with linear_attention layers), and Accelerate's `prepare` refuses the model when
    # cp_size > 1; the forward refuses too (packed_batch.refuse_context_parallel), for any other way in.
    _supports_context_parallel = False
    _is_stateful = True
    enable_numerics_check = enable_numerics_check  # debug: name the first NaN / inf (modeling/numerics.py)

    def set_context_parallel(self, group=None) -> None:
        """Context parallelism over the process group `group` (None turns it off): every forward then takes this
        rank's contiguous shard of one packed row and computes what the unsharded row gives there, the GDN state, the
        conv inputs and attention carried across shard boundaries (context_parallel.py; `shard_packed_row` cuts a
        row). Not torch's context parallelism, which this model refuses (`_supports_context_parallel`)."""
        for module in self.modules():
            if hasattr(module, "context_parallel_group"):
                module.context_parallel_group = group

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, checkpoint_files, *args, **kwargs):
        # transformers' step that reads the checkpoint into the model (a staticmethod in 5.x, a classmethod in 4.x;
        # both take these three first). The checkpoint's keys are accounted for first, so that a missing tensor is
        # refused before transformers reports it as newly initialised (checkpoint_keys.py).
        account_before_loading(model, checkpoint_files)
        return super()._load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a transformers DynamicCache: the text decoder creates its own cache.
        return False


def weight_init():
    """transformers' initialisation functions (they skip tensors loaded from a checkpoint), or torch's before 5.x."""
    return getattr(transformers, "initialization", None) or nn.init


def init_dense_weights(module: nn.Module, std: float) -> bool:
    """Linear, conv and embedding weights from N(0, std), their biases zero; False for any other module."""
    if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv3d, nn.Embedding)):
        return False
    init = weight_init()
    init.normal_(module.weight, mean=0.0, std=std)
    if getattr(module, "bias", None) is not None:
        init.zeros_(module.bias)
    return True
