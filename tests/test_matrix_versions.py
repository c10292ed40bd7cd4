"""scripts/matrix_versions.py picks the compatibility matrix from the index's release list: the last patch of the
oldest, the median and the newest minor series inside pyproject.toml's range, never a pre-release."""

import importlib.util
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("matrix_versions", ROOT / "scripts" / "matrix_versions.py")
matrix_versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix_versions)


def versions(*names):
    return [Version(n) for n in names]


def test_oldest_middle_newest_by_last_patch():
    index = versions(
        "4.56.2", "4.57.0", "4.57.6", "5.0.0", "5.1.0", "5.1.2", "5.2.0", "5.3.0rc1", "5.2.1", "5.3.0.dev0"
    )
    chosen = matrix_versions.matrix(index, SpecifierSet(">=4.57"))
    assert chosen == versions("4.57.6", "5.0.0", "5.2.1")  # four series: the lower median


def test_fewer_series_than_three():
    assert matrix_versions.matrix(versions("5.0.0", "5.0.1"), SpecifierSet(">=4.57")) == versions("5.0.1")
    assert matrix_versions.matrix(versions("4.57.1", "5.0.0"), SpecifierSet(">=4.57")) == versions("4.57.1", "5.0.0")


def test_the_declared_range_is_pyprojects():
    assert Version("4.57.0") in matrix_versions.declared_range()
    assert Version("4.56.2") not in matrix_versions.declared_range()
