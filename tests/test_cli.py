"""The `qwen35-packed` command itself: its help and version load no modeling stack, and the doctor says what it
checks as it goes (the commands' own behaviour is tested with each: conversion, doctor, hub, tiny)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_packed import __version__, cli

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers")

# In a fresh interpreter: the help of the command and of every subcommand, and --version, then which of HEAVY
# were imported on the way.
HELP_SCRIPT = """
import json, sys
from qwen35_packed.cli import build_parser, main

commands = list(build_parser()._subparsers._group_actions[0].choices)
printed = {}
for argv in [["--help"], ["--version"]] + [[name, "--help"] for name in commands]:
    try:
        main(argv)
    except SystemExit as exc:
        printed[" ".join(argv)] = exc.code
print(json.dumps({"commands": commands, "exit": printed, "heavy": [m for m in %r if m in sys.modules]}))
"""


def test_help_and_version_import_neither_torch_nor_transformers():
    proc = subprocess.run([sys.executable, "-c", HELP_SCRIPT % (HEAVY,)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"convert", "rope", "doctor", "tiny", "upload"} <= set(result["commands"])
    assert set(result["exit"].values()) == {0}, result["exit"]
    assert result["heavy"] == [], f"--help / --version imported {result['heavy']}"


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"qwen35-packed {__version__}"


def test_the_package_version_has_one_source():
    """pyproject.toml reads the version from qwen35_packed.__version__ (what --version prints)."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qwen35_packed.__version__"}


@pytest.mark.skipif(not hasattr(__import__("transformers"), "Qwen3_5ForCausalLM"), reason="tiny folders need 5.x")
def test_the_doctor_announces_each_group_of_checks_on_stderr_before_it_runs(tmp_path, capsys, monkeypatch):
    """One `checking ...` line on stderr as each group starts: what stderr holds when each group's function is
    entered is recorded, and the group's own line is the last one there."""
    from qwen35_packed.doctor import config_checks, environment_checks, loading_checks, numerics
    from qwen35_packed.tiny import build_tiny_folder

    folder = build_tiny_folder(tmp_path / "dense")
    capsys.readouterr()
    seen = {}

    def recording(module, name):
        function = getattr(module, name)

        def wrapper(*args, **kwargs):
            seen[name] = capsys.readouterr().err.splitlines()
            return function(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    recording(config_checks, "run_config_checks")
    recording(loading_checks, "run_loading_checks")
    recording(environment_checks, "run_environment_checks")
    recording(numerics, "run_packed_numerics")
    assert cli.main(["doctor", str(folder), "--device", "cpu"]) == 0
    expected = {
        "run_config_checks": "checking the config and the tensors it implies...",
        "run_loading_checks": "checking the classes transformers, TRL and vLLM build...",
        "run_environment_checks": "checking kernels and versions...",
        "run_packed_numerics": "checking packed vs per-document numerics on the first layers...",
    }
    assert list(seen) == list(expected)
    for name, line in expected.items():
        assert seen[name][-1:] == [line], (name, seen[name])
    assert "numerics.packed_vs_per_document" in capsys.readouterr().out
