"""Reading the JSON files of a model folder (config, index, adapter config) for the tooling: one reader, each
caller's error class."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path, error: type[Exception], name: str | None = None) -> dict:
    """The JSON object stored in `path`; else `error` naming the file (`name`, default the path) and what is wrong
    with it: unreadable, not JSON, or JSON that is not an object."""
    label = name or str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{label} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise error(f"cannot read {label}: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{label} is not a JSON object")
    return data
