"""The layout of tests/ that pyproject's pytest section relies on: every test folder is on sys.path and modules are
imported by basename (no __init__.py, pytest's default prepend import mode), so two files with one basename would
shadow each other (a run naming both fails to collect); and no module under tests/ imports a test module
(test_*.py): shared builders live in helper modules (conftest.py says which)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# pytest imports these per folder (conftest.py under a name of its own), so they may repeat, as pytest allows
PER_FOLDER = {"__init__.py", "conftest.py"}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def duplicate_basenames(root: Path) -> dict[str, list[str]]:
    """Basenames that more than one .py file under `root` has -> those files (relative to `root`)."""
    places = defaultdict(list)
    for path in python_files(root):
        if path.name not in PER_FOLDER:
            places[path.name].append(path.relative_to(root).as_posix())
    return {name: paths for name, paths in places.items() if len(paths) > 1}


def _imported_modules(node: ast.AST) -> list[str]:
    """The dotted module names an import statement (or `importlib.import_module` / `__import__` of a literal) names,
    the imported names included where they may be modules (`from . import x`, `from tests.a import x`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        names = [module] if module else []
        if node.level or not module or module.split(".")[0] == "tests":
            names += [f"{module}.{alias.name}" if module else alias.name for alias in node.names]
        return names
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def imports_of_test_modules(root: Path) -> list[str]:
    """`file:line imports module` for every import, anywhere in a module under `root` (functions and worker scripts
    included), of a test module (a test_*.py under `root`), by basename, relative or through the tests package."""
    test_modules = {p.stem for p in python_files(root) if p.name.startswith("test_")}
    found = []
    for path in python_files(root):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            hits = [m for m in _imported_modules(node) if any(part in test_modules for part in m.split("."))]
            if hits:
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} imports {hits[0]}")
    return found


def test_every_python_file_under_tests_has_a_basename_of_its_own():
    assert duplicate_basenames(TESTS) == {}


def test_no_module_under_tests_imports_a_test_module():
    assert imports_of_test_modules(TESTS) == []


def test_the_checks_find_a_planted_duplicate_and_planted_imports(tmp_path):
    files = {
        "a/conftest.py": "",
        "b/conftest.py": "",
        "a/worker.py": "",
        "b/worker.py": "from test_two import build\n",
        "a/fixtures_a.py": "import json\n",
        "a/test_one.py": "from fixtures_a import thing\nfrom conftest import kind\n\ndef f():\n    import test_two\n",
        "b/test_two.py": "from . import test_one\nfrom .test_one import x\nfrom tests.a.test_one import y\n",
        "b/test_three.py": "import importlib\nmodule = importlib.import_module('test_two')\nfrom tests.a import fixtures_a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert duplicate_basenames(tmp_path) == {"worker.py": ["a/worker.py", "b/worker.py"]}
    assert imports_of_test_modules(tmp_path) == [
        "a/test_one.py:5 imports test_two",
        "b/test_three.py:2 imports test_two",
        "b/test_two.py:1 imports test_one",
        "b/test_two.py:2 imports test_one",
        "b/test_two.py:3 imports tests.a.test_one",
        "b/worker.py:1 imports test_two",
    ]
