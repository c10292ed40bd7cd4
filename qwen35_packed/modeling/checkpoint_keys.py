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
    raises ValueError naming it, never leaves random weights behind a load report. The account is made from the
    checkpoint files' keys before transformers reads a tensor (`account_before_loading`, which the classes'
    `_load_pretrained_model` calls), so the refusal comes before transformers' load report, which would announce
    the tensors as newly initialised. Two exceptions, each reported in `missing_keys` and in one warning log line:
      - a task head a class adds to the backbone (its `new_task_head_modules`, e.g. a reward model's `score` loaded
        from a causal-LM folder): transformers initialises it as a new head;
      - `output_loading_info=True`: the caller asked for transformers' load report (model, info) to inspect it, so
        the missing tensors stay randomly initialised, as transformers leaves them, and `info["missing_keys"]`
        names every one of them, fused experts included.
  * a checkpoint file that does not read (truncated or damaged: safetensors' own error names no file) is a
    ValueError naming the file.
"""

from __future__ import annotations

import contextvars
import dataclasses
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


def _checkpoint_paths(name_or_path, kwargs: dict) -> list[str]:
    """The checkpoint files `from_pretrained` reads for `name_or_path` (empty when not found): the shards an index
    names, else the single file."""
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
            return list(get_checkpoint_shard_files(name_or_path, index, **hub)[0])
        single = found(single_name)
        if single is not None:
            return [single]
    return []


def _file_keys(path: str) -> list[str]:
    """The tensor names of one checkpoint file (its header only, for safetensors)."""
    from transformers.modeling_utils import load_state_dict

    return list(load_state_dict(path, map_location="meta"))


def _damaged_file_error(name_or_path, kwargs: dict) -> ValueError | None:
    """A ValueError naming the first checkpoint file of `name_or_path` that does not read, None when all do."""
    for path in _checkpoint_paths(name_or_path, kwargs):
        try:
            _file_keys(path)
        except Exception as exc:  # noqa: BLE001 - any failure to read the file is the finding
            return ValueError(
                f"the checkpoint file {path} does not read: it is truncated or damaged ({type(exc).__name__}: "
                f"{exc}); download or copy it again"
            )
    return None


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
        """The names no checkpoint tensor supplies, leaving out those tied to a supplied one: the same tensor, or
        declared tied (transformers 5's `all_tied_weights_keys`, {target: source}; before loading the model is not
        tied yet)."""
        group: dict[str, str] = {}  # name -> the name standing for its tied group
        first_of_tensor: dict[int, str] = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            group[name] = first_of_tensor.setdefault(id(tensor), name)
        for target, source in (getattr(self.model, "all_tied_weights_keys", None) or {}).items():
            if target in group and source in group:
                old, new = group[target], group[source]
                group = {name: new if root == old else root for name, root in group.items()}
        given = {group[name] for name in supplied if name in group}
        return {name for name, root in group.items() if root not in given}


def _fuse_per_expert(model, groups: dict[str, dict[str, dict[int, str]]], files, where) -> None:
    """Fuse the per-expert tensors of `groups` (complete: `_account` checked them) into the model's fused
    parameters."""
    from transformers.modeling_utils import load_state_dict

    needed = {key for projs in groups.values() for experts in projs.values() for key in experts.values()}
    tensors: dict[str, torch.Tensor] = {}
    for path, file_keys in files.items():
        if needed.intersection(file_keys):
            shard = load_state_dict(path)
            tensors.update((k, shard[k]) for k in needed.intersection(shard))
            del shard
    keys = _ModelKeys(model)
    params = dict(model.named_parameters())
    for prefix, projs in groups.items():
        n_experts, _ = missing_per_expert_keys(prefix, projs)
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


@dataclasses.dataclass
class _Account:
    """Which checkpoint keys supply which parameters: the per-expert groups to fuse after loading
    ({fused prefix: {proj: {expert: checkpoint key}}}) and the parameters nothing supplies."""

    files: dict[str, list[str]]  # checkpoint file -> its keys
    groups: dict[str, dict[str, dict[int, str]]]
    missing: set[str]


def _account(model, files: dict[str, list[str]], key_mapping: dict, where: str) -> _Account:
    """The account of `files` against the model's parameters, before any tensor is read: raises for experts stored
    both fused and per expert, or per expert with some missing."""
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
    for prefix, projs in groups.items():
        _, absent = missing_per_expert_keys(prefix, projs)
        if absent:
            raise ValueError(f"{where} stores the experts of {prefix!r} per expert but lacks {_shown(absent)}")
        supplied |= {keys.of(f"{prefix}.gate_up_proj"), keys.of(f"{prefix}.down_proj")}
    return _Account(files, groups, keys.untied_missing(supplied))


@dataclasses.dataclass
class _Load:
    """One `from_official_layout` call in progress: what the account before loading needs, and that account."""

    cls: type
    where: str
    key_mapping: dict
    want_info: bool
    account: _Account | None = None


# The load in progress in this context (from_official_layout sets it around transformers' from_pretrained).
_LOAD_IN_PROGRESS: contextvars.ContextVar[_Load | None] = contextvars.ContextVar("qwen35_packed_load", default=None)


def _refuse_missing(cls, where: str, missing: set[str]) -> None:
    """Raise for the parameters of `missing` other than a new task head's (see the module docstring)."""
    backbone = missing - _new_head(cls, missing)
    if backbone:
        raise ValueError(
            f"{where} lacks {len(backbone)} tensors that {cls.__name__} needs: {_shown(backbone)}. They would stay "
            "randomly initialised. Is this the right class for the folder (text classes read `model.*` or a "
            "composite folder's `model.language_model.*`; vision-language classes also need `model.visual.*`)?"
        )


def _new_head(cls, missing: set[str]) -> set[str]:
    """The names of `missing` in a task head the class adds to the backbone (a reward model's `score` from a
    causal-LM folder): the checkpoint cannot hold them, transformers initialises them as a new head."""
    return {name for name in missing if name.split(".")[0] in getattr(cls, "new_task_head_modules", ())}


def account_before_loading(model, checkpoint_files) -> None:
    """The checkpoint files' account for the load in progress, made from their keys before transformers reads any
    tensor (the classes' `_load_pretrained_model` calls this first); raises for a missing tensor unless the caller
    asked for the load report. Outside `from_official_layout` (and for a later load inside it, such as an adapter's)
    it does nothing."""
    load = _LOAD_IN_PROGRESS.get()
    if load is None or load.account is not None or not checkpoint_files or not isinstance(model, load.cls):
        return
    files = {path: _file_keys(path) for path in checkpoint_files}
    load.account = _account(model, files, load.key_mapping, load.where)
    if not load.want_info:
        _refuse_missing(load.cls, load.where, load.account.missing)


def from_official_layout(cls, load, name_or_path, args: tuple, kwargs: dict, key_mapping: dict | None):
    """`load(name_or_path, *args, **kwargs)` (the transformers `from_pretrained`) with `key_mapping` applied,
    per-expert experts fused, and every parameter accounted for (see the module docstring)."""
    if name_or_path is None or any(kwargs.get(k) is not None for k in ("state_dict", "gguf_file")):
        return load(name_or_path, *args, **kwargs)
    want_info = kwargs.pop("output_loading_info", False)
    key_mapping = kwargs.pop("key_mapping", None) or key_mapping
    if key_mapping:
        kwargs["key_mapping"] = key_mapping
    where = f"the checkpoint at {name_or_path}"
    in_progress = _Load(cls, where, key_mapping or {}, want_info)
    token = _LOAD_IN_PROGRESS.set(in_progress)
    try:
        model, info = load(name_or_path, *args, output_loading_info=True, **kwargs)
    except Exception as exc:
        damaged = _damaged_file_error(name_or_path, kwargs)  # safetensors' own error names no file
        if damaged is None:
            raise
        raise damaged from exc
    finally:
        _LOAD_IN_PROGRESS.reset(token)
    account = in_progress.account
    if account is not None:
        if account.groups:
            _fuse_per_expert(model, account.groups, account.files, where)
        missing = account.missing
    else:  # transformers did not hand the files over: its own report (fused experts unchecked), refused after it
        missing = set(info["missing_keys"])
        if not want_info:
            _refuse_missing(cls, where, missing)
    new_head = _new_head(cls, missing)
    backbone = missing - new_head
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
    "account_before_loading",
    "from_official_layout",
    "fuse_gate_up",
    "rename_key",
]
