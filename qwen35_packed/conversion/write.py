"""Writing a planned conversion: stream SRC's tensors into OUT's shards, then rename the finished folder to OUT.

Output shards are built one at a time, each output tensor from just the source tensors it needs, and a source shard
is closed (its memory map released) as soon as no later output needs it, so memory stays around one input plus one
output shard whatever the model size. Everything goes into a temporary folder next to OUT (config.json last) that is
renamed to OUT at the end; SRC and the `*_from` folders are only read.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import ConversionError
from .plan import WEIGHTS_INDEX_NAME, ConversionPlan
from .remote_code import copy_remote_code
from .rules import materialize


class _ShardReader:
    """Open source shards lazily (memory-mapped by safetensors) and close each one after its last use.

    An open safetensors handle keeps its memory map, and every page read through it stays resident in this process;
    closing a shard once no later output needs it keeps memory at about one input shard.
    """

    def __init__(self, locations: dict[str, Path], order: list[list[str]]):
        from safetensors import safe_open

        self._open = safe_open
        self.locations = locations
        self.handles: dict[Path, object] = {}
        self.last_use: dict[Path, int] = {}
        for step, keys in enumerate(order):
            for key in keys:
                self.last_use[locations[key]] = step

    def load(self, key: str):
        path = self.locations[key]
        if path not in self.handles:
            try:
                self.handles[path] = self._open(path, framework="pt")
            except Exception as exc:
                raise ConversionError(f"cannot read {path.name}: {exc}") from exc
        try:
            return self.handles[path].get_tensor(key)
        except Exception as exc:
            raise ConversionError(f"cannot read {key!r} from {path.name} (truncated or damaged?): {exc}") from exc

    def done(self, step: int) -> None:
        """Close every shard whose last use is at or before `step`."""
        for path in [p for p in self.handles if self.last_use.get(p, -1) <= step]:
            del self.handles[path]

    def close(self) -> None:
        self.handles.clear()


def _check_tied_lm_head(plan: ConversionPlan) -> None:
    """A tied SRC that still stores lm_head.weight: it is dropped, so it must equal the embedding."""
    import torch
    from safetensors import safe_open

    if not plan.output_config.config.tie_word_embeddings or "lm_head.weight" not in plan.source.tensors:
        return
    embed_key = next(k for k in plan.source.tensors if k.endswith("embed_tokens.weight") and not k.startswith("mtp."))
    with safe_open(plan.source.path_of("lm_head.weight"), framework="pt") as a:
        with safe_open(plan.source.path_of(embed_key), framework="pt") as b:
            same = torch.equal(a.get_tensor("lm_head.weight"), b.get_tensor(embed_key))
    if not same:
        raise ConversionError(
            f"config.json says tie_word_embeddings is true, but SRC stores an lm_head.weight that differs from "
            f"{embed_key}; dropping it would change the model. Fix tie_word_embeddings in SRC's config.json."
        )


def write_conversion(plan: ConversionPlan, *, progress: bool = True, log: Callable[[str], None] = print) -> Path:
    """Carry out a plan: write everything into a temporary folder next to OUT, then rename it to OUT."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = plan.out
    order = [plan.mapping.outputs[k].source_keys() for keys in plan.shards for k in keys]
    reader = _ShardReader(plan.locations, order)
    _check_tied_lm_head(plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.parent.glob(f".{out.name}.tmp-*"))
    if stale:
        log(f"note: {len(stale)} temporary folder(s) of an interrupted conversion next to OUT: {', '.join(stale)}")
    # Created inside the try, so an interrupt at any later point removes it; a plain mkdir gives OUT the
    # permissions of any new folder (mkdtemp's are private).
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(6)}"
    bar = None
    try:
        tmp.mkdir()
        if progress:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="convert")
            except ImportError:
                bar = None
        weight_map: dict[str, str] = {}
        step = 0
        for keys, name in zip(plan.shards, plan.shard_names):
            items = [(k, plan.mapping.outputs[k]) for k in keys]
            tensors = {}
            for key, tensor in materialize(items, reader.load):
                tensors[key] = tensor.contiguous()
                weight_map[key] = name
                reader.done(step)
                step += 1
                if bar is not None:
                    bar.update(plan.mapping.outputs[key].nbytes)
            try:
                save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            except SafetensorError as exc:  # safetensors reports a failed write (EFBIG, ENOSPC) as its own error
                raise OSError(f"cannot write {name}: {exc}") from exc
            del tensors
        if len(plan.shard_names) > 1:
            index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if plan.remote_code:
            copy_remote_code(tmp)
        for item in plan.copied:
            item.write(tmp)
        # config.json last: a temporary folder left by a killed conversion never looks like a checkpoint
        (tmp / "config.json").write_text(json.dumps(plan.output_config.data, indent=2, sort_keys=True) + "\n")
        if out.exists():
            raise ConversionError(f"OUT {out} appeared while converting; nothing was written to it")
        os.rename(tmp, out)
    except OSError as exc:  # a full disk, a read-only or vanished folder: say so instead of a traceback
        raise ConversionError(
            f"writing the output failed: {exc}; is the disk full or the folder not writable? nothing was written to "
            "OUT (the temporary folder is removed)"
        ) from exc
    finally:
        reader.close()
        if bar is not None:
            bar.close()
        if tmp.exists():  # only when something failed before the rename
            shutil.rmtree(tmp, ignore_errors=True)
    return out
