"""Checkpoint conversion between the official Qwen3.5 layouts and this project's packed text layout."""

from .convert import (
    COPIED_FILES,
    ConversionPlan,
    conversion_rules,
    convert,
    official_rules,
    plan_conversion,
    plan_official_mapping,
    plan_packed_mapping,
)
from .errors import ConversionError, NotInvertibleError
from .remote_code import copy_remote_code, remote_code_files
from .rope_readers import rope_table, rope_views
from .rules import Drop, FuseExperts, LazyTensor, MappingEngine, Rule, SplitExperts, StripPrefix
from .verify import folder_digests, verify_folders

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
    "folder_digests",
    "official_rules",
    "plan_conversion",
    "plan_official_mapping",
    "plan_packed_mapping",
    "remote_code_files",
    "rope_table",
    "rope_views",
    "verify_folders",
]
