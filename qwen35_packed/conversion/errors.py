"""Errors of the conversion tools."""


class ConversionError(Exception):
    """A conversion cannot proceed; the message says why and what to do. The CLI prints it without a traceback."""


class NotInvertibleError(ConversionError):
    """A mapping rule has no inverse (e.g. dropped tensors cannot be recreated from the output alone)."""


__all__ = ["ConversionError", "NotInvertibleError"]
