"""Command line interface: `qwen35-packed <command> ...` (also `python -m qwen35_packed.cli`).

Each subcommand is registered by one `_add_<name>` function that builds its parser and sets `handler`; a handler
returns the exit status. Errors the user can fix (ConversionError) are printed as one `error: ...` message with
exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys


def _run_convert(args: argparse.Namespace) -> int:
    from .conversion import convert

    convert(
        args.src,
        args.out,
        text_only=args.text_only,
        dry_run=args.dry_run,
        max_shard_size=args.max_shard_size,
        progress=not args.no_progress,
    )
    return 0


def _add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert an official Qwen3.5 text checkpoint folder into this project's layout",
        description=(
            "Convert a local Qwen3.5 checkpoint folder (what transformers' built-in text classes save, or the "
            "official composite vision-language layout with --text-only) into this project's layout: the built-in "
            "text-class keys with fused MoE experts, config.json with auto_map and normalised rope, the remote-code "
            "files, and the tokenizer / generation files. mtp.* (and with --text-only model.visual.*) tensors are "
            "dropped. SRC is never modified; OUT must not exist."
        ),
    )
    p.add_argument("src", metavar="SRC", help="source checkpoint folder (config.json + safetensors)")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist)")
    p.add_argument(
        "--text-only",
        action="store_true",
        help="accept a composite (vision-language) SRC and convert its language model only",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest output shard, e.g. 5GB, 500MB, 2GiB or bytes (default: %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_run_convert)


_COMMANDS = (_add_convert,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen35-packed", description="Tools for packed Qwen3.5 checkpoints.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .conversion.errors import ConversionError

    try:
        return args.handler(args)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
