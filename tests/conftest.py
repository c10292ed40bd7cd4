"""Tiny configurations and helpers shared by the tests (fp32, CPU).

Where shared test code lives: a test module (test_*.py) holds its tests and what only they use, and never imports
another test module. Builders, assertions and pytest fixtures that several modules use live in modules pytest does
not collect: this file (the tiny configs and models, the `kind` fixture); topic modules (vl_tiny.py,
reference_model.py, properties.py, integrations/tensor_parallel_case.py); and `fixtures_<topic>.py` beside the tests
that use them (conversion/fixtures_conversion.py, integrations/fixtures_vllm.py, ...; fixtures_distributed.py, for
several folders, in tests/ itself). Every test folder is on sys.path (pyproject.toml), so they are imported by
basename (`from fixtures_conversion import build_builtin`), and every basename under tests/ is unique. A shared
fixture is imported by name into each module that requests it (a module-scoped one is built once per module).
Fixture modules import the optional training stack (trl, datasets) inside the builders that use it, so importing one
never skips a module: each test module keeps its own `pytest.importorskip`. tests/test_layout.py checks the unique
basenames and that no module under tests/ imports a test module."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers

from qwen35_packed.tiny import TINY_DENSE, TINY_ROPE  # noqa: F401 (one definition for all tiny models)

# One intra-op thread per test process (and its subprocesses): the suite's models are tiny, so a second thread buys
# nothing, while two threads per process on a busy 2-core machine spin against each other (a tiny forward measured
# 25x slower than with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# transformers' built-in Qwen3.5 (the parity reference) exists from transformers 5 on; on 4.x the references are
# this project's own unpacked path and the pure-PyTorch per-document model of tests/reference_model.py.
HAS_BUILTIN_QWEN35 = hasattr(transformers, "Qwen3_5ForCausalLM")
_NO_BUILTIN = f"transformers {transformers.__version__} has no built-in Qwen3.5 to compare with"
requires_builtin_qwen35 = pytest.mark.skipif(not HAS_BUILTIN_QWEN35, reason=_NO_BUILTIN)


def run_triton_interpreted(script: str) -> dict:
    """Run `script` in a fresh Python with TRITON_INTERPRET=1 set before any kernel is decorated, so that this
    project's Triton kernels run on CPU tensors; returns the JSON object its last output line prints."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The core suite (`pytest -m core`): the model, its configuration and conversion to the remote-code folder, with no
# training or serving stack. It runs on every transformers version of the compatibility matrix
# (scripts/test-matrix.sh); the whole suite runs on the version the README installs.
CORE_TEST_FILES = frozenset(
    {
        "test_cache.py",
        "test_compat.py",
        "test_configuration.py",
        "test_kernels.py",
        "test_loading_official.py",
        "test_loss.py",
        "test_modeling.py",
        "test_model_api.py",
        "test_mrope_positions.py",
        "test_packing.py",
        "test_parity_builtin.py",
        "test_rope_types.py",
        "test_user_path.py",
        "test_vl_modeling.py",
        "test_vl_remote_code.py",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).name in CORE_TEST_FILES:
            item.add_marker(pytest.mark.core)


TINY_MOE = dict(
    TINY_DENSE,
    intermediate_size=None,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    router_aux_loss_coef=0.0,
)


def tiny_kwargs(kind: str) -> dict:
    base = TINY_MOE if kind == "moe" else TINY_DENSE
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items() if v is not None}


def builtin_pair(kind: str, seed: int = 0, **overrides):
    """(transformers' built-in model, ours) with identical random weights, eval mode, fp32; `overrides` replace
    fields of the tiny config. Skips the test where transformers has no built-in Qwen3.5."""
    if not HAS_BUILTIN_QWEN35:
        pytest.skip(_NO_BUILTIN)
    from qwen35_packed import (
        Qwen3_5MoePackedConfig,
        Qwen3_5MoePackedForCausalLM,
        Qwen3_5PackedConfig,
        Qwen3_5PackedForCausalLM,
    )

    kwargs = {**tiny_kwargs(kind), **overrides}
    torch.manual_seed(seed)
    if kind == "moe":
        ref = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kwargs))
        ours = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**kwargs))
    else:
        ref = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kwargs))
        ours = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**kwargs))
    _randomize_zero_init(ref)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def packed_model(kind: str, seed: int = 0, **overrides):
    """This project's model alone with random weights (no built-in needed), eval mode, fp32; `overrides` change
    the tiny config."""
    from qwen35_packed import (
        Qwen3_5MoePackedConfig,
        Qwen3_5MoePackedForCausalLM,
        Qwen3_5PackedConfig,
        Qwen3_5PackedForCausalLM,
    )

    torch.manual_seed(seed)
    kwargs = {**tiny_kwargs(kind), **overrides}
    if kind == "moe":
        model = Qwen3_5MoePackedForCausalLM(Qwen3_5MoePackedConfig(**kwargs))
    else:
        model = Qwen3_5PackedForCausalLM(Qwen3_5PackedConfig(**kwargs))
    _randomize_zero_init(model)
    return model.eval()


def _randomize_zero_init(model) -> None:
    """Zero-initialised norms and routers would hide bugs (a wrong (1 + w) is invisible at w = 0)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.1)


def assert_same_loss_and_gradients(ref, ours, ref_loss, our_loss) -> None:
    """The two models' losses within 1e-5 and, after their backward passes, every parameter's gradient of `ours`
    within atol 1e-5 / rtol 1e-4 of `ref`'s parameter of the same name."""
    ref_loss.backward()
    our_loss.backward()
    assert abs(ref_loss.item() - our_loss.item()) <= 1e-5
    ref_grads = dict(ref.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.allclose(param.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-4), name


def random_doc_lengths(generator: torch.Generator, n_docs: int, kernel: int = 4) -> list[int]:
    """Lengths that cover the edge cases: 1-token documents, documents shorter than the conv kernel, multiples
    of 64 (the delta-rule chunk), and ordinary ones."""
    fixed = [1, 1, kernel - 1, 2, 64, 128, 63, 65]
    rest = torch.randint(3, 90, (max(0, n_docs - len(fixed)),), generator=generator).tolist()
    lengths = fixed + rest
    order = torch.randperm(len(lengths), generator=generator).tolist()
    return [lengths[i] for i in order][:n_docs]


@pytest.fixture(params=["dense", "moe"])
def kind(request):
    return request.param


def training_step(model, inputs: dict, checkpointing: bool, **config) -> tuple:
    """One forward + backward of `model` on `inputs` with the config fields `config` set (the model reads them at
    every forward) and decoder-layer checkpointing on or off -> (the output, {parameter name: its gradient})."""
    for name, value in config.items():
        setattr(model.config, name, value)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def random_routed_experts(config, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Experts to replay [tokens, MoE layers, top-k], drawn at random without repeats per token and layer (the
    `routed_experts` forward input, routing_replay.py)."""
    layers = sum(config.layer_uses_moe(i) for i in range(config.num_hidden_layers))
    scores = torch.rand(tokens, layers, config.num_experts, generator=generator)
    return scores.argsort(dim=-1)[..., : config.num_experts_per_tok]


def saved_storage_bytes(step, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves while `step()` runs a forward and its backward, without those of
    the tensors in `exclude` (e.g. parameters, held anyway); each is kept alive until counted, so no address is
    reused."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in excluded:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storage.nbytes() for storage in storages.values())


def _graph_nodes(root):
    """Every node of the autograd graph behind `root`."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            yield node
            stack.extend(function for function, _ in node.next_functions)


def _tensors_reachable(value, path: str, seen: set, depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of the tensors reachable from `value` through attributes, bound methods, closures and
    containers (a few levels deep); parameters and modules are left out: they are held by the model anyway."""
    if id(value) in seen or depth > 4 or isinstance(value, (torch.nn.Parameter, torch.nn.Module, type)):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, types.MethodType):
        return _tensors_reachable(value.__self__, f"{path}.__self__", seen, depth + 1)
    if isinstance(value, types.FunctionType):
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
        return [p for i, c in enumerate(cells) for p in _tensors_reachable(c, f"{path}.<cell {i}>", seen, depth + 1)]
    if isinstance(value, (list, tuple, set)):
        return [p for i, v in enumerate(value) for p in _tensors_reachable(v, f"{path}[{i}]", seen, depth + 1)]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _tensors_reachable(v, f"{path}.{k}", seen, depth + 1)]
    if hasattr(value, "__dict__") and not isinstance(value, types.ModuleType):
        return _tensors_reachable(vars(value), path, seen, depth + 1)
    return []


@contextlib.contextmanager
def recorded_autograd_contexts():
    """Yields a list that collects the context (its output's node) of every custom autograd Function applied while the
    block runs, whether or not a walk from the loss reaches it later: `torch.autograd.Function.apply` is wrapped for
    the block's duration (Functions that define their own `apply` are not seen)."""
    created = []
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        out = original.__func__(cls, *args, **kwargs)
        first = next((t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)), None)
        if first is not None and isinstance(first.grad_fn, torch.autograd.function.BackwardCFunction):
            created.append(first.grad_fn)
        return out

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield created
    finally:
        torch.autograd.Function.apply = original


def tensors_held_by(contexts) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor one of `contexts` holds as an attribute, outside its saved tensors."""
    return [found for node in contexts for found in _tensors_reachable(vars(node), type(node).__name__, set())]


def tensors_held_by_autograd_contexts(
    output: torch.Tensor,
) -> tuple[collections.Counter, list[tuple[str, torch.Tensor]]]:
    """(how many contexts of each custom autograd Function, by its node's type name, the graph behind `output` has,
    the (path, tensor) of every tensor one of them holds as an attribute, outside its saved tensors): such a tensor
    escapes checkpointing and activation offloading, and lives until the whole graph is freed. A caller asserts which
    Functions it expected to find: a walk that reached none of them checked nothing."""
    # every custom Function's node is its context, attributes or not (one that only saved tensors has none)
    contexts = [
        node for node in _graph_nodes(output.grad_fn) if isinstance(node, torch.autograd.function.BackwardCFunction)
    ]
    return collections.Counter(type(node).__name__ for node in contexts), tensors_held_by(contexts)
