"""Moved into the remote-code bundle: qwen35_packed/modeling/configuration_qwen3_5_packed.py. This import path re-exports its names
(a package, not a file, so that git follows the moved file)."""

from ...modeling import configuration_qwen3_5_packed as _moved

globals().update({name: value for name, value in vars(_moved).items() if not name.startswith("_")})
__all__ = _moved.__all__
