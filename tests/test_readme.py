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


def test_documented_trl_commands_say_how_to_run_on_cpu():
    """TRL turns bf16 on by default and transformers refuses it without a GPU unless use_cpu is set: every
    documented `trl sft` / `trl grpo` command block passes `--use_cpu true` (the CPU runs on tiny folders that
    tests/integrations/test_recipes.py runs as written) or says to add it on CPU."""
    for name in ("README.md", "docs/training.md"):
        text = (ROOT / name).read_text()
        blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
        commands = [b for b in blocks if re.search(r"^\s*(PYTHONPATH=\S+ )?trl (sft|grpo) ", b, re.MULTILINE)]
        assert len(commands) == 2, (name, commands)
        for block in commands:
            assert "--use_cpu true" in block, (name, block)
