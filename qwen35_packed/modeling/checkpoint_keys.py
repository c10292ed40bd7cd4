"""Official Qwen3.5 checkpoint layouts -> this project's parameters, inside `from_pretrained`.

Remote code: imports only torch, transformers and the standard library.

transformers applies its checkpoint conversions (the composite prefix strip, per-expert -> fused experts) only to
its own classes, never to remote code, so these classes map the keys themselves, the same way on 4.57 and 5.x:
  * text classes read a composite folder's `model.language_model.*` as `model.*` (a `key_mapping` regex, which
    `from_pretrained` applies on both major versions); `model.visual.*` and `mtp.*` are ignored;
  * MoE experts stored per expert (`experts.{e}.gate_proj/up_proj/down_proj.weight`, what transformers'
    `save_pretrained` writes) are fused after loading into `experts.gate_up_proj [E, 2I, H]` (gate_up[e] =
    cat(gate_e, up_e)) and `experts.down_proj [E, H, I]`, as transformers' loader does for its own classes;
  * every parameter must come from the checkpoint (weights tied to one that does count as given): a missing one
    raises ValueError naming it, never leaves random weights behind a load report. Two exceptions, each reported in
    `missing_keys` and in one warning log line:
      - a task head a class adds to the backbone (its `new_task_head_modules`, e.g. a reward model's `score` loaded
        from a causal-LM folder): transformers initialises it as a new head;
      - `output_loading_info=True`: the caller asked for transformers' load report (model, info) to inspect it, so
        the missing tensors stay randomly initialised, as transformers leaves them, and `info["missing_keys"]`
        names every one of them, fused experts included.
"""

from __future__ import annotations

import functools
import logging
import re

import torch

# Per-expert and fused MoE expert keys (conversion/rules.py reuses these).
PER_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# The key_mapping of the text classes: a composite checkpoint's text model is this project's text model.
TEXT_KEY_MAPPING = {r"^model\.language_model\.": "model."}
# The fused experts are built after loading, from the per-expert tensors: transformers' own load report on them
# (fused MISSING, per expert UNEXPECTED) would announce random weights that are not there, so the classes leave
# these keys out of it (`_keys_to_ignore_on_load_*`); `from_official_layout` accounts for them instead.
IGNORED_UNEXPECTED_EXPERT_KEYS = (r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$",)
IGNORED_MISSING_EXPERT_KEYS = (r"\.experts\.(gate_up_proj|down_proj)$",)
_SHOWN = 8

logger = logging.getLogger(__name__)


def fuse_gate_up(tensors: list[torch.Tensor]) -> torch.Tensor:
    """gate_0, up_0, gate_1, up_1, ... ([I, H] each) -> gate_up_proj [E, 2I, H], gate_up[e] = cat(gate_e, up_e)."""
    gate0 = tensors[0]
    n_experts, inter = len(tensors) // 2, gate0.shape[0]
    out = torch.empty((n_experts, 2 * inter, gate0.shape[1]), dtype=gate0.dtype, device=gate0.device)
    for e in range(n_experts):
        out[e, :inter].copy_(tensors[2 * e])
        out[e, inter:].copy_(tensors[2 * e + 1])
    return out


def missing_per_expert_keys(prefix: str, members: dict) -> tuple[int, list[str]]:
    """For the per-expert tensors found under `prefix` (`members[proj]`: the expert indices present for gate_proj,
    up_proj and down_proj): how many experts there are (the highest index + 1) and the keys of those that are
    absent. Shared with the conversion rules, which fuse the same layout while streaming."""
    n_experts = 1 + max(max(members[proj], default=-1) for proj in ("gate_proj", "up_proj", "down_proj"))
    missing = [
        f"{prefix}.{e}.{proj}.weight"
        for e in range(n_experts)
        for proj in ("gate_proj", "up_proj", "down_proj")
        if e not in members[proj]
    ]
    return n_experts, missing


def rename_key(key: str, key_mapping: dict[str, str]) -> str:
    """`key` after the first pattern of `key_mapping` that matches it (transformers' `key_mapping` semantics)."""
    for pattern, replacement in key_mapping.items():
        new_key, count = re.subn(pattern, replacement, key)
        if count:
            return new_key
    return key


def _shown(keys) -> str:
    keys = sorted(keys)
    more = f", ... ({len(keys)} in all)" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def _hub_kwargs(kwargs: dict) -> dict:
    names = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
    return {name: kwargs[name] for name in names if kwargs.get(name) is not None}


def _checkpoint_files(name_or_path, kwargs: dict) -> dict[str, list[str]]:
    """{checkpoint file: its keys} of the checkpoint `from_pretrained` just read (empty when not found)."""
    from transformers.modeling_utils import load_state_dict
    from transformers.utils import cached_file
    from transformers.utils.hub import get_checkpoint_shard_files

    hub = _hub_kwargs(kwargs)
    found = functools.partial(
        cached_file,
        name_or_path,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub,
    )
    formats = [
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ]
    if kwargs.get("use_safetensors") is False:
        formats.reverse()
    for index_name, single_name in formats:
        index = found(index_name)
        if index is not None:
            files, metadata = get_checkpoint_shard_files(name_or_path, index, **hub)
            by_name: dict[str, list[str]] = {}
            for key, shard in metadata["weight_map"].items():
                by_name.setdefault(shard, []).append(key)
            return {path: by_name.get(path.replace("\\", "/").rsplit("/", 1)[-1], []) for path in files}
        single = found(single_name)
        if single is not None:
            return {single: list(load_state_dict(single, map_location="meta"))}
    return {}


class _ModelKeys:
    """The model's state-dict names, and which checkpoint key lands on which of them (the base-model prefix
    added or removed, as `from_pretrained` does)."""

    def __init__(self, model):
        self.names = set(model.state_dict())
        self.prefix = model.base_model_prefix + "."
        self.model = model

    def of(self, key: str) -> str | None:
        if key in self.names:
            return key
        if key.startswith(self.prefix) and key[len(self.prefix) :] in self.names:
            return key[len(self.prefix) :]
        if self.prefix + key in self.names:
            return self.prefix + key
        return None

    def untied_missing(self, supplied: set[str]) -> set[str]:
        """The names no checkpoint tensor supplies, leaving out those tied to (the same tensor as) a supplied one."""
        tensors: dict[int, list[str]] = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            tensors.setdefault(id(tensor), []).append(name)
        missing = set()
        for names in tensors.values():
            if not supplied.intersection(names):
                missing.update(names)
        return missing


def _fuse_per_expert(model, keys: _ModelKeys, groups: dict[str, dict[str, dict[int, str]]], files, where) -> set:
    """Fuse the per-expert tensors of `groups` ({fused prefix: {proj: {expert: checkpoint key}}}) into the
    model's fused parameters; returns the names it filled."""
    from transformers.modeling_utils import load_state_dict

    needed = {key for projs in groups.values() for experts in projs.values() for key in experts.values()}
    tensors: dict[str, torch.Tensor] = {}
    for path, file_keys in files.items():
        if needed.intersection(file_keys):
            shard = load_state_dict(path)
            tensors.update((k, shard[k]) for k in needed.intersection(shard))
            del shard
    params = dict(model.named_parameters())
    filled = set()
    for prefix, projs in groups.items():
        n_experts, absent = missing_per_expert_keys(prefix, projs)
        if absent:
            raise ValueError(f"{where} stores the experts of {prefix!r} per expert but lacks {_shown(absent)}")
        gates = [tensors[projs["gate_proj"][e]] for e in range(n_experts)]
        ups = [tensors[projs["up_proj"][e]] for e in range(n_experts)]
        fused = {
            "gate_up_proj": fuse_gate_up([t for pair in zip(gates, ups) for t in pair]),
            "down_proj": torch.stack([tensors[projs["down_proj"][e]] for e in range(n_experts)]),
        }
        for proj, value in fused.items():
            name = keys.of(f"{prefix}.{proj}")
            param = params[name]
            if param.device.type == "meta":
                raise ValueError(
                    f"{name} is offloaded (device_map): per-expert checkpoints cannot be fused into "
                    "offloaded parameters; convert the folder first (`qwen35-packed convert`)"
                )
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"{where}: the per-expert tensors of {prefix!r} fuse to {list(value.shape)} but "
                    f"{name} is {list(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)
            filled.add(name)
    return filled


def _fill_and_account(model, files: dict[str, list[str]], key_mapping: dict, where: str) -> set[str]:
    """Fuse the checkpoint's per-expert experts into the model; return the parameters it did not supply."""
    keys = _ModelKeys(model)
    supplied: set[str] = set()
    groups: dict[str, dict[str, dict[int, str]]] = {}
    for key in (k for file_keys in files.values() for k in file_keys):
        renamed = rename_key(key, key_mapping)
        per_expert = PER_EXPERT_KEY.match(renamed)
        if per_expert and keys.of(f"{per_expert['prefix']}.down_proj") is not None:
            experts = groups.setdefault(per_expert["prefix"], {"gate_proj": {}, "up_proj": {}, "down_proj": {}})
            experts[per_expert["proj"]][int(per_expert["idx"])] = key
        elif keys.of(renamed) is not None:
            supplied.add(keys.of(renamed))
    twice = sorted(p for p in groups if {keys.of(f"{p}.gate_up_proj"), keys.of(f"{p}.down_proj")} & supplied)
    if twice:
        raise ValueError(f"{where} stores the experts of {_shown(twice)} both fused and per expert")
    if groups:
        supplied |= _fuse_per_expert(model, keys, groups, files, where)
    return keys.untied_missing(supplied)


def from_official_layout(cls, load, name_or_path, args: tuple, kwargs: dict, key_mapping: dict | None):
    """`load(name_or_path, *args, **kwargs)` (the transformers `from_pretrained`) with `key_mapping` applied,
    per-expert experts fused, and every parameter accounted for (see the module docstring)."""
    if name_or_path is None or any(kwargs.get(k) is not None for k in ("state_dict", "gguf_file")):
        return load(name_or_path, *args, **kwargs)
    want_info = kwargs.pop("output_loading_info", False)
    key_mapping = kwargs.pop("key_mapping", None) or key_mapping
    if key_mapping:
        kwargs["key_mapping"] = key_mapping
    model, info = load(name_or_path, *args, output_loading_info=True, **kwargs)
    files = _checkpoint_files(name_or_path, kwargs)
    where = f"the checkpoint at {name_or_path}"
    if files:
        missing = _fill_and_account(model, files, key_mapping or {}, where)
    else:  # a format whose keys cannot be listed here: transformers' own report (fused experts unchecked)
        missing = set(info["missing_keys"])
    # A task head the class adds to the backbone (a reward model's `score` from a causal-LM folder) cannot be in the
    # checkpoint: transformers initialised it as a new head; report it, refuse every other missing tensor.
    new_head = {name for name in missing if name.split(".")[0] in getattr(cls, "new_task_head_modules", ())}
    backbone = missing - new_head
    if backbone and not want_info:
        raise ValueError(
            f"{where} lacks {len(backbone)} tensors that {cls.__name__} needs: {_shown(backbone)}. They would stay "
            "randomly initialised. Is this the right class for the folder (text classes read `model.*` or a "
            "composite folder's `model.language_model.*`; vision-language classes also need `model.visual.*`)?"
        )
    if backbone:
        # The caller asked for the load report (transformers' contract): report instead of raising, loudly.
        logger.warning(
            "%s: %d tensors not in %s, left randomly initialised (output_loading_info=True reports them in "
            "missing_keys instead of raising): %s",
            cls.__name__,
            len(backbone),
            name_or_path,
            _shown(backbone),
        )
    if new_head:
        logger.warning(
            "%s: %s not in %s, newly initialised (a new task head; train it before use)",
            cls.__name__,
            _shown(new_head),
            name_or_path,
        )
    # Our account replaces transformers' list, which leaves out the fused experts (`_keys_to_ignore_on_load_missing`).
    info["missing_keys"] = type(info["missing_keys"])(sorted(missing))
    return (model, info) if want_info else model


__all__ = [
    "FUSED_EXPERT_KEY",
    "IGNORED_MISSING_EXPERT_KEYS",
    "IGNORED_UNEXPECTED_EXPERT_KEYS",
    "PER_EXPERT_KEY",
    "TEXT_KEY_MAPPING",
    "from_official_layout",
    "fuse_gate_up",
    "rename_key",
]
