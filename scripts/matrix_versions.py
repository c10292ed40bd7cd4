"""The transformers releases the compatibility matrix tests: the oldest, one middle and the newest final release
on the package index at the time of the run, within the range pyproject.toml declares.

Each minor series counts once, by its last patch release (patches are what users of a series install); the middle
is the median series between the oldest and the newest. Prints the three versions, space-separated, oldest first
(fewer when the range holds fewer series). The list comes from `pip index versions transformers`, so it follows
the index pip is configured with, as the install does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def declared_range() -> SpecifierSet:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d.removeprefix("transformers") for d in dependencies if re.match(r"transformers\b", d)]
    return SpecifierSet(spec)


def released_versions() -> list[Version]:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "transformers"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    line = next(line for line in listing.splitlines() if line.startswith("Available versions:"))
    return [Version(v) for v in line.removeprefix("Available versions:").replace(",", " ").split()]


def matrix(versions: list[Version], allowed: SpecifierSet) -> list[Version]:
    last_patch: dict[tuple[int, int], Version] = {}
    for version in versions:
        if version.is_prerelease or version.is_devrelease or version not in allowed:
            continue
        series = (version.major, version.minor)
        last_patch[series] = max(last_patch.get(series, version), version)
    series = sorted(last_patch)
    if not series:
        raise SystemExit(f"no transformers release on the index satisfies {allowed}")
    chosen = [series[0], series[(len(series) - 1) // 2], series[-1]]
    return [last_patch[s] for s in dict.fromkeys(chosen)]


if __name__ == "__main__":
    print(" ".join(str(v) for v in matrix(released_versions(), declared_range())))
