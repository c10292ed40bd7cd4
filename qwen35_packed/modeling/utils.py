"""Helpers the bundle's modules share: messages said once per process, the installed transformers' major version,
and the comparison of two readings of one config value.

Remote code like its siblings: copied flat into model folders, so it imports only the standard library and
transformers.
"""

from __future__ import annotations

import logging
import math

import transformers

# The installed transformers' major version: the remote-code files switch on it where 4.x and 5.x differ.
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

# The annotation of the built-in forwards' **kwargs (`Unpack[TransformersKwargs]`), where tools look up which keyword
# arguments a forward takes (output_attentions, the loss and packing kwargs); an empty TypedDict where the installed
# transformers has none.
try:
    from transformers.processing_utils import Unpack
    from transformers.utils import TransformersKwargs
except ImportError:
    from typing import TypedDict, Unpack

    class TransformersKwargs(TypedDict, total=False):
        pass


_logged_once: set = set()


def first_time(key) -> bool:
    """True the first time `key` is asked about in this process: for messages the remote code says once."""
    if key in _logged_once:
        return False
    _logged_once.add(key)
    return True


def log_once(log: logging.Logger, key, message: str, *args) -> None:
    """`log.warning(message, *args)` the first time `key` comes by."""
    if first_time(key):
        log.warning(message, *args)


def same_value(a, b) -> bool:
    """Whether two readings of one config value agree: numbers within 1e-9 relative, lists element-wise; a boolean
    on either side is compared as Python compares it (`True == 1`), never with the float tolerance, so that the
    order of the two sides does not matter."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


__all__ = ["TRANSFORMERS_MAJOR", "TransformersKwargs", "Unpack", "first_time", "log_once", "same_value"]
