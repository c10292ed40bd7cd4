"""The recipes of the README and docs/ run as written, on CPU, on the folders `qwen35-packed tiny` writes.

The convention: a shell or Python block is runnable when the line right above its ```bash / ```python fence (at the
same indentation) is `<!-- runnable -->`, which a rendered page does not show. The runnable blocks of a file run in
order, each with `bash -e` or `python`, in one empty folder per file (so a block uses the tiny folders an earlier block of the file wrote), with
the repository's `examples/` linked into it; `pip install` commands are the environment these tests already run in
and are left out. Nothing is downloaded (the Hub is offline for them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import requires_builtin_qwen35

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
FENCED = re.compile(r"^(?P<indent>[ \t]*)(?P<marker><!-- runnable -->\n(?P=indent))?```(?P<lang>bash|python)\n(?P<body>.*?)^(?P=indent)```",
                    re.MULTILINE | re.DOTALL)  # fmt: skip
TINY_WRITES = re.compile(r"qwen35-packed tiny (\S+?)/?(?=\s|$)(?:.*?--data (\S+?)/?(?=\s|$))?")
TINY_PATH = re.compile(r"(?<![\w/-])(tiny-[\w-]+)")


def shell_blocks(path: Path) -> list[tuple[bool, str]]:
    """(marked runnable, the block's text without its indentation) for every ```bash block of the file."""
    text = path.read_text()
    return [(bool(m["marker"]), textwrap.dedent(m["body"])) for m in FENCED.finditer(text) if m["lang"] == "bash"]


def runnable_command(m: re.Match) -> list[str]:
    """The command that runs a marked block as written."""
    body = textwrap.dedent(m["body"])
    if m["lang"] == "python":
        return [sys.executable, "-c", body]
    return ["bash", "-e", "-o", "pipefail", "-c", runnable_script(body)]


def runnable_script(block: str) -> str:
    """The block as one script: continuation lines joined, `pip install` commands left out."""
    lines = block.replace("\\\n", " ").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("pip install"))


RUNNABLE = {
    path.name: [runnable_command(m) for m in FENCED.finditer(path.read_text()) if m["marker"]] for path in DOCUMENTS
}
RUNNABLE = {name: commands for name, commands in RUNNABLE.items() if commands}


def test_the_marker_is_only_used_above_shell_blocks():
    """A misplaced marker (not right above a ```bash fence) would silently leave its block unrun."""
    for path in DOCUMENTS:
        marked = sum(bool(m["marker"]) for m in FENCED.finditer(path.read_text()))
        lines = sum(line.strip() == MARKER for line in path.read_text().splitlines())
        assert lines == marked, path.name


def tiny_outputs(line: str) -> set[str]:
    """The folders a `qwen35-packed tiny` command of the line writes (OUT and the --data folder)."""
    return {name for match in TINY_WRITES.finditer(line) for name in match.groups() if name}


def test_every_block_on_a_tiny_folder_is_run_and_uses_only_folders_written_before():
    """A shell block that names a tiny folder (one that `qwen35-packed tiny` writes somewhere in the docs) is marked
    runnable, and the folders it names were written earlier in the same file (the order the test runs them in)."""
    blocks = {path.name: shell_blocks(path) for path in DOCUMENTS}
    tiny = {name for found in blocks.values() for _, block in found for name in tiny_outputs(runnable_script(block))}
    assert {"tiny-dense", "tiny-data"} <= tiny
    for name, found in blocks.items():
        written: set[str] = set()
        for marked, block in found:
            for line in runnable_script(block).splitlines():
                written |= tiny_outputs(line)
                named = set(TINY_PATH.findall(line)) & tiny
                assert not named or marked, (name, block)
                assert named <= written, (name, line, sorted(named - written))


def test_the_readme_quick_start_trains_on_a_tiny_folder():
    scripts = "\n".join(command[-1] for command in RUNNABLE.get("README.md", []))
    assert "qwen35-packed tiny tiny-dense/ --data tiny-data/" in scripts
    assert re.search(r"^trl sft --model_name_or_path tiny-dense .*--use_cpu true", scripts, re.MULTILINE)
    assert re.search(r"^PYTHONPATH=examples trl grpo --model_name_or_path tiny-dense .*--use_cpu true", scripts,
                     re.MULTILINE)  # fmt: skip


@pytest.mark.slow
@requires_builtin_qwen35  # tiny folders are saved from the built-in classes
@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_runnable_blocks_run_as_written(name, tmp_path):
    pytest.importorskip("trl")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "examples").symlink_to(ROOT / "examples")
    env = {
        **os.environ,
        # this interpreter's environment first (trl, qwen35-packed), and this checkout for `qwen35_packed`
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    for command in RUNNABLE[name]:
        proc = subprocess.run(command, cwd=workspace, env=env, capture_output=True, text=True, timeout=900)
        output = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"{name}: exit status {proc.returncode} of\n{command[-1]}\n---\n{output}"
