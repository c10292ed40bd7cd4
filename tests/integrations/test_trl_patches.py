"""The TRL attributes PackedGRPOTrainer replaces at run time (integrations/trl_patches.py), checked against the
installed TRL: it is the version each patch targets, every patched attribute exists, and TRL still reads it where
the patch expects. A TRL release that renames or stops reading one fails here, not in a training run."""

import importlib
import importlib.util
import inspect
import re
import types

import pytest

trl = pytest.importorskip("trl")

from packaging.version import Version  # noqa: E402

from qwen35_packed.integrations import trl_patches  # noqa: E402
from qwen35_packed.integrations.trl_patches import PATCHES  # noqa: E402

IDS = [patch.patch.__name__ for patch in PATCHES]


def _resolve(dotted: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for name in parts[end:]:
            target = getattr(target, name)
        return target
    raise ImportError(dotted)


def _names_read(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code reads, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def test_every_patch_is_listed():
    patches = {
        name
        for name, value in vars(trl_patches).items()
        if inspect.isfunction(value) and value.__module__ == trl_patches.__name__ and not name.startswith("_")
    }
    assert patches == set(IDS)


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_installed_trl_is_the_version_the_patch_targets(patch):
    assert Version(trl.__version__).release[:2] == Version(patch.trl_version).release[:2], (
        f"{patch.patch.__name__} was written for TRL {patch.trl_version}, TRL {trl.__version__} is installed: "
        "check the patch against it and update its trl_version"
    )


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_patched_attribute_exists(patch):
    owner = _resolve(patch.owner)
    if not hasattr(owner, patch.attribute) and importlib.util.find_spec("vllm") is None:
        # vLLM's names in TRL's generation module are bound only when vLLM imports (not in the main environment)
        source = inspect.getsource(owner)
        assert re.search(rf"^\s+from vllm import .*\b{patch.attribute}\b", source, re.MULTILINE), patch
    else:
        assert hasattr(owner, patch.attribute), patch


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_trl_reads_the_patched_attribute_where_the_patch_expects(patch):
    reader = inspect.unwrap(_resolve(patch.read_by))
    assert patch.attribute in _names_read(reader.__code__), patch


def test_what_the_replacements_call_exists():
    from trl.generation.vllm_generation import VLLMGeneration

    # send_unexpanded_images passes these on to TRL's generate by position; GRPOTrainer passes them by name
    assert list(inspect.signature(VLLMGeneration.generate).parameters)[1:5] == [
        "prompts",
        "images",
        "num_generations",
        "profiler",
    ]
    # the reload sync of configure_colocate_sync pushes TRL's own name iteration
    assert inspect.isgeneratorfunction(VLLMGeneration._iter_named_params)


def test_scored_positions_switch_lasts_for_its_block_only():
    import torch
    from trl.trainer import utils

    trl_switch = utils._use_triton
    with pytest.raises(RuntimeError, match="inside"), trl_patches.lm_head_on_scored_positions():
        assert utils._use_triton(torch.device("cpu"))
        raise RuntimeError("inside")
    assert utils._use_triton is trl_switch
