"""The list of remote-code files a model folder needs (one place; `convert`, `hub.py` and the doctor reuse it).

transformers loads `auto_map` classes from `.py` files that sit flat next to `config.json`. This project's
remote code is the bundle `qwen35_packed/modeling/`: every module there except the package `__init__.py`, the
configuration files included. They are copied flat and import only each other (by relative, sibling names), so they
work the same inside the package and side by side in a model folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

BUNDLE = Path(__file__).resolve().parent.parent / "modeling"
# The files auto_map names for AutoConfig: a bundle without them is not a loadable model folder.
CONFIGURATION_FILES = ("configuration_qwen3_5_packed.py", "configuration_qwen3_5_packed_vl.py")


def remote_code_files() -> list[Path]:
    """Paths of every remote-code module (`*.py` of the bundle except `__init__.py`), sorted by file name. Raises
    RuntimeError when a configuration file is missing (an incomplete install)."""
    files = sorted(path for path in BUNDLE.glob("*.py") if path.name != "__init__.py")
    missing = [name for name in CONFIGURATION_FILES if not (BUNDLE / name).is_file()]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found in {BUNDLE}; is the package complete?")
    return files


def copy_remote_code(dest: str | Path) -> list[Path]:
    """Copy `remote_code_files()` flat into `dest` (an existing folder); return the written paths."""
    dest = Path(dest)
    written = []
    for path in remote_code_files():
        target = dest / path.name
        shutil.copyfile(path, target)
        written.append(target)
    return written


__all__ = ["BUNDLE", "CONFIGURATION_FILES", "copy_remote_code", "remote_code_files"]
