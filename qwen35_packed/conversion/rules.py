"""Declarative, invertible key/tensor mappings between checkpoint layouts.

A checkpoint is handled as an ordered mapping `key -> LazyTensor`: the shape, the dtype and a recipe that builds
the tensor from source tensors. A `Rule` maps such a mapping to a new one (rename, drop, fuse, split) and reports
what it did; `MappingEngine` applies a list of rules in order. Planning never reads tensor data, so the whole plan
of a large checkpoint (and its validation) costs only the safetensors headers; `materialize` then builds output
tensors one batch at a time, loading only the source tensors they need.

Each rule that can be undone has `inverse()`; `MappingEngine.inverse()` reverses the list and inverts every rule,
so the same declarations serve both directions (`Drop` has no inverse: what it removes is gone from the output).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..modeling.checkpoint_keys import FUSED_EXPERT_KEY as _FUSED_EXPERT
from ..modeling.checkpoint_keys import PER_EXPERT_KEY as _PER_EXPERT
from ..modeling.checkpoint_keys import fuse_gate_up as _fuse_gate_up
from ..modeling.checkpoint_keys import missing_per_expert_keys as _missing_per_expert_keys
from .errors import ConversionError, NotInvertibleError

# Bytes per element of the safetensors dtype names.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor that is not loaded yet: a source tensor (`key`) or `fn(materialised inputs)`.

    Compared by identity: two nodes are the same node only if they are the same object (a node shared by several
    outputs is built once per batch by `materialize`).
    """

    shape: tuple[int, ...]
    dtype: str
    key: str | None = None  # source key, for leaves
    inputs: tuple[LazyTensor, ...] = ()
    fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = field(default=None, repr=False)
    op: str = "source"

    @classmethod
    def source(cls, key: str, shape: Iterable[int], dtype: str) -> LazyTensor:
        return cls(shape=tuple(int(s) for s in shape), dtype=dtype, key=key)

    @classmethod
    def derived(cls, op: str, inputs: Iterable[LazyTensor], shape: Iterable[int], dtype: str, fn) -> LazyTensor:
        return cls(shape=tuple(int(s) for s in shape), dtype=dtype, inputs=tuple(inputs), fn=fn, op=op)

    @property
    def is_source(self) -> bool:
        return self.key is not None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def source_keys(self) -> list[str]:
        """The source keys this tensor is built from, in input order, without repeats."""
        out: list[str] = []
        seen: set[str] = set()
        stack = [self]
        while stack:
            node = stack.pop()
            if node.is_source:
                if node.key not in seen:
                    seen.add(node.key)
                    out.append(node.key)
            else:
                stack.extend(reversed(node.inputs))
        return out


@dataclass
class RuleReport:
    """What one rule did during one `MappingEngine.plan`."""

    rule: str
    consumed: list[str] = field(default_factory=list)  # input keys the rule matched
    produced: list[str] = field(default_factory=list)  # output keys it created (empty for drops)
    reason: str | None = None  # why, for drops
    label: str | None = None  # what the rule does, in words (`outcome`); the rule's description when unset

    def summary(self) -> str:
        if not self.consumed:
            return f"{self.rule}: no match"
        if not self.produced:
            because = f": {self.reason}" if self.reason else ""
            return f"{self.rule}: dropped {len(self.consumed)} tensors{because}"
        return f"{self.rule}: {len(self.consumed)} tensors -> {len(self.produced)}"

    def outcome(self) -> str | None:
        """What the rule did, in words (None when it matched nothing): the plan's line without `-v`."""
        if not self.consumed:
            return None
        if not self.produced:
            return f"{len(self.consumed)} dropped ({self.reason})" if self.reason else f"{len(self.consumed)} dropped"
        return f"{len(self.consumed)} -> {len(self.produced)} {self.label or self.rule}"


class Rule:
    """A mapping `dict[key, LazyTensor] -> dict[key, LazyTensor]`. Subclasses set `apply` and (if they can) `inverse`."""

    def apply(self, tensors: dict[str, LazyTensor], report: RuleReport) -> dict[str, LazyTensor]:
        raise NotImplementedError

    def inverse(self) -> Rule:
        raise NotInvertibleError(f"{self!r} has no inverse")

    def describe(self) -> str:
        return repr(self)

    def label(self) -> str:
        """What the rule does, in words (RuleReport.outcome)."""
        return self.describe()


def _put(out: dict[str, LazyTensor], key: str, value: LazyTensor, rule: Rule) -> None:
    if key in out:
        raise ConversionError(
            f"{rule.describe()} maps two tensors to {key!r}; the source holds the same weight twice (e.g. both with "
            "and without a prefix, or both fused and per-expert)."
        )
    out[key] = value


@dataclass(frozen=True)
class Drop(Rule):
    """Remove every tensor whose key matches `pattern` (re.search); `reason` is printed with the count."""

    pattern: str
    reason: str

    def apply(self, tensors, report):
        regex = re.compile(self.pattern)
        report.reason = self.reason
        out = {}
        for key, value in tensors.items():
            if regex.search(key):
                report.consumed.append(key)
            else:
                out[key] = value
        return out

    def inverse(self) -> Rule:
        raise NotInvertibleError(
            f"Drop({self.pattern!r}) cannot be inverted: the dropped tensors are not in the output; re-inserting them "
            "needs the original checkpoint."
        )

    def describe(self) -> str:
        return f"Drop({self.pattern!r})"


@dataclass(frozen=True)
class StripPrefix(Rule):
    """Rename keys that start with `prefix` to start with `replacement` instead.

    The inverse is `StripPrefix(replacement, prefix)`: exact on every mapping in which all keys starting with
    `replacement` came from `prefix` (true for the Qwen3.5 layouts: every `model.*` key of the text model lives
    under `model.language_model.*` in the composite one).
    """

    prefix: str
    replacement: str = ""

    def apply(self, tensors, report):
        out: dict[str, LazyTensor] = {}
        for key, value in tensors.items():
            if key.startswith(self.prefix):
                new_key = self.replacement + key[len(self.prefix) :]
                report.consumed.append(key)
                report.produced.append(new_key)
                _put(out, new_key, value, self)
            else:
                _put(out, key, value, self)
        return out

    def inverse(self) -> Rule:
        return StripPrefix(self.replacement, self.prefix)

    def describe(self) -> str:
        return f"StripPrefix({self.prefix!r} -> {self.replacement!r})"

    def label(self) -> str:
        return f"renamed {self.prefix}* -> {self.replacement}*"


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors, dim=0)


def _in_scope(scope: str | None, key: str) -> bool:
    """Whether `key` matches the regex `scope` (re.search); every key does when there is none."""
    return scope is None or re.search(scope, key) is not None


def per_expert_groups(keys: Iterable[str], scope: str | None = None) -> dict[str, dict[str, dict[int, str]]]:
    """`{experts prefix: {"gate_proj" | "up_proj" | "down_proj": {expert index: key}}}` of the per-expert MoE keys
    among `keys` (those matching the regex `scope`, re.search, when given): the layout `FuseExperts` fuses, and what
    `convert --verify` and the doctor read as the fused tensors it becomes."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    for key in keys:
        m = _PER_EXPERT.match(key)
        if m and _in_scope(scope, key):
            projs = groups.setdefault(m["prefix"], {"gate_proj": {}, "up_proj": {}, "down_proj": {}})
            projs[m["proj"]][int(m["idx"])] = key
    return groups


@dataclass(frozen=True)
class _ScopedExpertRule(Rule):
    """What `FuseExperts` and `SplitExperts` share: `scope` (a regex, re.search) limits the rule to matching keys;
    `describe` names the rule, its `MAPPING` and the scope."""

    MAPPING = ""
    scope: str | None = None

    def _in_scope(self, key: str) -> bool:
        return _in_scope(self.scope, key)

    def describe(self) -> str:
        where = f" in {self.scope!r}" if self.scope else ""
        return f"{type(self).__name__}({self.MAPPING}{where})"


@dataclass(frozen=True)
class FuseExperts(_ScopedExpertRule):
    """Per-expert MoE weights -> the fused 3-D parameters of transformers' MoE experts module.

    `<p>.experts.{e}.gate_proj.weight [I, H]` and `.up_proj.weight [I, H]` -> `<p>.experts.gate_up_proj [E, 2I, H]`
    with `gate_up_proj[e] = cat([gate_e, up_e], dim=0)`; `<p>.experts.{e}.down_proj.weight [H, I]` ->
    `<p>.experts.down_proj [E, H, I]`. This is what transformers' own loader does for `qwen3_5_moe_text`
    (conversion_mapping.py, "qwen2_moe": MergeModulelist(dim=0) then Concatenate(dim=1)), and what the experts'
    forward undoes with `linear(x, gate_up_proj[e]).chunk(2, dim=-1)` -> (gate, up). Every expert 0..E-1 must have
    all three tensors with consistent shapes and one dtype. The fused tensors take the place of the first
    per-expert tensor in the key order.

    `scope` (a regex, re.search) limits the rule to matching keys: official checkpoints store the MTP layer's
    experts per expert, and `--to official` keeps them so.
    """

    MAPPING = "experts.{e}.{gate,up,down}_proj.weight -> experts.{gate_up_proj,down_proj}"

    def apply(self, tensors, report):
        groups = {
            prefix: {proj: {e: (key, tensors[key]) for e, key in experts.items()} for proj, experts in projs.items()}
            for prefix, projs in per_expert_groups(tensors, self.scope).items()
        }
        first_member: dict[str, str] = {}
        for key in tensors:
            m = _PER_EXPERT.match(key) if self._in_scope(key) else None
            if m:
                first_member.setdefault(m["prefix"], key)
                report.consumed.append(key)
        if not groups:
            return dict(tensors)
        fused = {prefix: self._fuse(prefix, members) for prefix, members in groups.items()}
        emit_at = {key: prefix for prefix, key in first_member.items()}
        out: dict[str, LazyTensor] = {}
        for key, value in tensors.items():
            if key in emit_at:
                for new_key, new_value in fused[emit_at[key]].items():
                    report.produced.append(new_key)
                    _put(out, new_key, new_value, self)
            elif not (_PER_EXPERT.match(key) and self._in_scope(key)):
                _put(out, key, value, self)
        return out

    def _fuse(self, prefix: str, members: dict[str, dict[int, tuple[str, LazyTensor]]]) -> dict[str, LazyTensor]:
        n_experts, missing = _missing_per_expert_keys(prefix, members)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ConversionError(f"Incomplete per-expert weights under {prefix!r}: missing {shown}")
        gates = [members["gate_proj"][e][1] for e in range(n_experts)]
        ups = [members["up_proj"][e][1] for e in range(n_experts)]
        downs = [members["down_proj"][e][1] for e in range(n_experts)]
        dtypes = {t.dtype for t in gates + ups + downs}
        if len(dtypes) != 1:
            raise ConversionError(f"Experts under {prefix!r} mix dtypes {sorted(dtypes)}; they cannot be fused")
        shapes_in = {t.shape for t in gates + ups}
        shapes_down = {t.shape for t in downs}
        if len(shapes_in) != 1 or len(shapes_down) != 1:
            raise ConversionError(
                f"Experts under {prefix!r} have inconsistent shapes: gate/up {sorted(shapes_in)}, down "
                f"{sorted(shapes_down)}"
            )
        shape_in, shape_down = next(iter(shapes_in)), next(iter(shapes_down))
        if len(shape_in) != 2 or shape_down != (shape_in[1], shape_in[0]):
            raise ConversionError(
                f"Experts under {prefix!r}: gate/up_proj are {list(shape_in)}, so down_proj must be their transpose "
                f"(2-D [H, I]); got {list(shape_down)}"
            )
        inter, hidden = shape_in
        (dtype,) = dtypes
        interleaved = [t for pair in zip(gates, ups) for t in pair]
        return {
            f"{prefix}.gate_up_proj": LazyTensor.derived(
                "fuse_gate_up", interleaved, (n_experts, 2 * inter, hidden), dtype, _fuse_gate_up
            ),
            f"{prefix}.down_proj": LazyTensor.derived("stack", downs, (n_experts, hidden, inter), dtype, _stack),
        }

    def inverse(self) -> Rule:
        return SplitExperts(self.scope)

    def label(self) -> str:
        return "per-expert expert tensors fused"


def fused_view(tensors: dict[str, LazyTensor], fused_keys) -> dict[str, LazyTensor]:
    """`tensors` with each per-expert group whose fused keys (`<p>.gate_up_proj` / `<p>.down_proj`) are among
    `fused_keys` replaced by the fused tensors `FuseExperts` makes of it, the rest as given: a per-expert folder
    as the fused one it converts to. Raises ConversionError for an incomplete or inconsistent group."""
    fused_keys = set(fused_keys)
    prefixes = sorted(p for p in per_expert_groups(tensors) if {f"{p}.gate_up_proj", f"{p}.down_proj"} & fused_keys)
    if not prefixes:
        return dict(tensors)
    scope = "^(?:" + "|".join(re.escape(p) for p in prefixes) + r")\.\d+\."
    return FuseExperts(scope).apply(tensors, RuleReport("fused view"))


@dataclass(frozen=True)
class SplitExperts(_ScopedExpertRule):
    """Inverse of `FuseExperts`: fused `<p>.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` -> per expert."""

    MAPPING = "experts.{gate_up_proj,down_proj} -> experts.{e}.{gate,up,down}_proj.weight"

    def apply(self, tensors, report):
        out: dict[str, LazyTensor] = {}
        for key, value in tensors.items():
            m = _FUSED_EXPERT.match(key) if self._in_scope(key) else None
            if not m:
                _put(out, key, value, self)
                continue
            if len(value.shape) != 3:
                raise ConversionError(f"{key}: fused experts must be 3-D, got shape {list(value.shape)}")
            report.consumed.append(key)
            prefix, n_experts = m["prefix"], value.shape[0]
            if m["proj"] == "gate_up_proj":
                if value.shape[1] % 2:
                    raise ConversionError(f"{key}: dim 1 ({value.shape[1]}) must be even (gate and up halves)")
                inter, hidden = value.shape[1] // 2, value.shape[2]
                pieces = []
                for e in range(n_experts):
                    pieces.append((f"{prefix}.{e}.gate_proj.weight", _slice(value, e, 0, inter), (inter, hidden)))
                    pieces.append((f"{prefix}.{e}.up_proj.weight", _slice(value, e, inter, 2 * inter), (inter, hidden)))
            else:
                pieces = [
                    (f"{prefix}.{e}.down_proj.weight", _slice(value, e, None, None), value.shape[1:])
                    for e in range(n_experts)
                ]
            for new_key, fn, shape in pieces:
                report.produced.append(new_key)
                _put(out, new_key, LazyTensor.derived("slice", (value,), shape, value.dtype, fn), self)
        return out

    def inverse(self) -> Rule:
        return FuseExperts(self.scope)

    def label(self) -> str:
        return "fused expert tensors split per expert"


def _slice(value: LazyTensor, expert: int, start: int | None, stop: int | None):
    def fn(tensors: list[torch.Tensor]) -> torch.Tensor:
        piece = tensors[0][expert] if start is None else tensors[0][expert, start:stop]
        return piece.clone()  # own storage: safetensors refuses tensors that share memory

    return fn


@dataclass
class MappingPlan:
    """The result of planning: the output tensors (in emission order) and one report per rule."""

    outputs: dict[str, LazyTensor]
    reports: list[RuleReport]

    def dropped(self) -> list[RuleReport]:
        return [r for r in self.reports if r.reason is not None and r.consumed]


class MappingEngine:
    """Applies a list of rules in order; keys no rule touches pass through unchanged."""

    def __init__(self, rules: Iterable[Rule]):
        self.rules = list(rules)

    def plan(self, sources: dict[str, LazyTensor]) -> MappingPlan:
        tensors = dict(sources)
        reports = []
        for rule in self.rules:
            report = RuleReport(rule.describe(), label=rule.label())
            tensors = rule.apply(tensors, report)
            reports.append(report)
        return MappingPlan(tensors, reports)

    def inverse(self) -> MappingEngine:
        return MappingEngine(rule.inverse() for rule in reversed(self.rules))

    def map_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply the rules to in-memory tensors (small checkpoints and tests)."""
        specs = {k: LazyTensor.source(k, v.shape, _dtype_name(v.dtype)) for k, v in tensors.items()}
        plan = self.plan(specs)
        return dict(materialize(plan.outputs.items(), tensors.__getitem__))


_TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    for attr, name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
        if getattr(torch, attr, None) == dtype:
            return name
    return _TORCH_TO_ST[dtype]


def materialize(
    items: Iterable[tuple[str, LazyTensor]], load: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Build the given output tensors, yielding `(key, tensor)` in order.

    A node used by several outputs of this batch (a fused tensor split into experts) is built once and kept only
    until its last use; everything else is freed as soon as its consumer is built.
    """
    items = list(items)
    uses: Counter[int] = Counter()
    visited: set[int] = set()

    def count(node: LazyTensor) -> None:
        uses[id(node)] += 1
        if id(node) in visited:
            return
        visited.add(id(node))
        for child in node.inputs:
            count(child)

    for _, node in items:
        count(node)
    cache: dict[int, torch.Tensor] = {}

    def build(node: LazyTensor) -> torch.Tensor:
        nid = id(node)
        if nid in cache:
            value = cache[nid]
        else:
            value = load(node.key) if node.is_source else node.fn([build(child) for child in node.inputs])
            if tuple(value.shape) != node.shape:
                raise ConversionError(
                    f"Built a tensor of shape {list(value.shape)} for {node.key or node.op}, expected {list(node.shape)}"
                )
        uses[nid] -= 1
        if uses[nid] > 0:
            cache[nid] = value
        else:
            cache.pop(nid, None)
        return value

    for key, node in items:
        yield key, build(node)


__all__ = [
    "DTYPE_SIZES",
    "Drop",
    "FuseExperts",
    "LazyTensor",
    "MappingEngine",
    "MappingPlan",
    "Rule",
    "RuleReport",
    "SplitExperts",
    "StripPrefix",
    "fused_view",
    "materialize",
    "per_expert_groups",
]
