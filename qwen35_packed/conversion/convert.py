"""`qwen35-packed convert`: official Qwen3.5 layouts <-> this project's layout.

Two directions, one engine:

* `to="packed"` (default): an official text checkpoint -> this project's text layout (fused experts, `auto_map`,
  remote code, normalised rope; `mtp.*` dropped); an official composite checkpoint -> this project's composite
  (vision-language) layout (`model.visual.*` kept, processor files copied), or with `text_only` its language model
  in the text layout (`model.visual.*` dropped too).
* `to="official"`: a text model (this project's layout, or what transformers' text classes save) -> the official
  layout: transformers' architectures and model_type, no `auto_map`, fused main-layer experts; `mtp.*` tensors
  re-inserted as stored in `mtp_from`; with `vision_from` (the composite checkpoint the text model came from) a
  composite checkpoint: `model.language_model.*` from SRC, `model.visual.*` from `vision_from`.

Planning (`plan.py`) reads only safetensors headers and JSON to map and validate every tensor; writing
(`write.py`) streams the tensors shard by shard into a temporary folder next to OUT, renamed to OUT at the end; SRC
and the `*_from` folders are only read. `convert` runs both and reports an interrupt.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .plan import (
    COPIED_FILES,
    DIRECTIONS,
    PROCESSOR_FILES,
    ConversionPlan,
    conversion_rules,
    official_rules,
    plan_conversion,
    plan_official_mapping,
    plan_packed_mapping,
    read_source,
    validate_mtp,
)
from .sizes import format_bytes, parse_size
from .write import write_conversion


def convert(
    src,
    out,
    *,
    dry_run: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    verbose: bool = False,
    **options,
) -> ConversionPlan:
    """Convert SRC into OUT; `options` are `plan_conversion`'s (`to`: 'packed' or 'official', `text_only`,
    `mtp_from`, `vision_from`, `router_aux_loss_coef`, `max_shard_size`), taken from there so that the two never
    disagree; see the module doc.

    With `dry_run` the plan is printed and nothing is written; `verbose` adds every mapping rule's line and the
    remote-code file names to the printed plan. Raises ConversionError with a readable message. An
    interrupt (Ctrl-C, or SIGTERM through the CLI) is logged with what it left: OUT complete, or nothing.
    """
    existed = Path(out).exists()  # then planning refuses it; an interrupt before that must not call it ours
    try:
        plan = plan_conversion(src, out, **options)
        for i, line in enumerate(plan.lines):
            if verbose or i not in plan.verbose_only:
                log(line)
        if dry_run:
            log("dry run: nothing written")
            return plan
        write_conversion(plan, progress=progress, log=log)
        log(f"wrote {plan.out}")
    except KeyboardInterrupt:
        if not existed and Path(out).exists():  # the interrupt came after the final rename
            log(f"interrupted after the conversion finished: OUT is complete ({out})")
        else:
            log(f"interrupted: nothing was written to OUT ({out}); temporary files removed")
        raise
    return plan


__all__ = [
    "COPIED_FILES",
    "DIRECTIONS",
    "PROCESSOR_FILES",
    "ConversionPlan",
    "conversion_rules",
    "convert",
    "format_bytes",
    "official_rules",
    "parse_size",
    "plan_conversion",
    "plan_official_mapping",
    "plan_packed_mapping",
    "read_source",
    "validate_mtp",
    "write_conversion",
]
