"""Checkpoint conversion between the official Qwen3.5 layouts and this project's packed text layout."""

from .convert import COPIED_FILES, ConversionPlan, conversion_rules, convert, plan_conversion
from .errors import ConversionError, NotInvertibleError
from .remote_code import copy_remote_code, remote_code_files
from .rules import Drop, FuseExperts, LazyTensor, MappingEngine, Rule, SplitExperts, StripPrefix

__all__ = [
    "COPIED_FILES",
    "ConversionError",
    "ConversionPlan",
    "Drop",
    "FuseExperts",
    "LazyTensor",
    "MappingEngine",
    "NotInvertibleError",
    "Rule",
    "SplitExperts",
    "StripPrefix",
    "conversion_rules",
    "convert",
    "copy_remote_code",
    "plan_conversion",
    "remote_code_files",
]
