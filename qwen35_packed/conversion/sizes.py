"""Byte sizes as `convert` reads them (`--max-shard-size 5GB`) and as the tools print them."""

from __future__ import annotations

import re

from .errors import ConversionError

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(size: int | str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, 1000 -> 1000."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if not m or m[2].upper() not in _SIZE_UNITS:
            raise ConversionError(f"Cannot read the size {size!r}; use e.g. 5GB, 500MB, 2GiB or a number of bytes")
        value = int(float(m[1]) * _SIZE_UNITS[m[2].upper()])
    if value <= 0:
        raise ConversionError(f"The shard size must be positive, got {size!r}")
    return value


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
