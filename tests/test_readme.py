"""README.md gives the test command `.ci/run` runs, word for word (CI runs exactly what the README says)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _words(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


def test_readme_gives_the_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^pip install torch==.*?(?<!\\)$", ci, re.MULTILINE | re.DOTALL).group(0)
    assert "pytest" in command and "ruff" in command
    assert _words(command) in _words((ROOT / "README.md").read_text())
    assert _words(command) in _words((ROOT / "docs" / "development.md").read_text())
