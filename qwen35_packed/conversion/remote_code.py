"""The list of remote-code files a model folder needs (one place; `convert` and later tools reuse it).

transformers loads `auto_map` classes from `.py` files that sit flat next to `config.json`. This project's
remote code is every module of `qwen35_packed/configuration/` and `qwen35_packed/modeling/` except the
package `__init__.py` files. They are copied flat, so they must import one another in a way that works both
inside the package and side by side in a model folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# Sub-packages of qwen35_packed whose modules are remote code, in the order they are listed.
REMOTE_CODE_PACKAGES = ("configuration", "modeling")


def _package_root() -> Path:
    # qwen35_packed/conversion/remote_code.py -> qwen35_packed/
    return Path(__file__).resolve().parent.parent


def remote_code_files() -> list[Path]:
    """Paths of every remote-code module (`*.py` except `__init__.py`) of the configuration and modeling packages.

    Sorted by package, then file name. Raises RuntimeError if two packages hold a module of the same name (they
    are copied flat, so one would overwrite the other) or if no configuration module is found.
    """
    root = _package_root()
    files: list[Path] = []
    seen: dict[str, Path] = {}
    for package in REMOTE_CODE_PACKAGES:
        folder = root / package
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.py")):
            if path.name == "__init__.py":
                continue
            if path.name in seen:
                raise RuntimeError(
                    f"Two remote-code modules are both named {path.name!r} ({seen[path.name]} and {path}); they are "
                    "copied flat into model folders, so the names must be unique."
                )
            seen[path.name] = path
            files.append(path)
    if not any(path.parent.name == "configuration" for path in files):
        raise RuntimeError(f"No configuration module found under {root / 'configuration'}; is the package complete?")
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


__all__ = ["REMOTE_CODE_PACKAGES", "copy_remote_code", "remote_code_files"]
