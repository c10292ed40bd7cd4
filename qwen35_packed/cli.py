"""Command line interface: `qwen35-packed <command> ...` (also `python -m qwen35_packed.cli`).

Each subcommand is registered by one `_add_<name>` function that builds its parser and sets `handler`; a handler
returns the exit status. A handler imports what its command needs when it runs, so that `--help`, `--version` and
the parsing of any command load neither torch nor transformers. Errors the user can fix (ConversionError) are
printed as one `error: ...` message with exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys

# The convert command's options that conversion.plan_conversion takes, under their argparse destinations.
_PLANNING_OPTIONS = ("to", "text_only", "mtp_from", "vision_from", "router_aux_loss_coef", "max_shard_size")


def _run_convert(args: argparse.Namespace) -> int:
    from .conversion import ConversionError, convert

    if args.verify:
        return _run_verify(args)
    if args.json is not None or args.report_to is not None:
        raise ConversionError("--json and --report-to belong to --verify")
    planning = {name: getattr(args, name) for name in _PLANNING_OPTIONS}
    convert(args.src, args.out, dry_run=args.dry_run, progress=not args.no_progress, verbose=args.verbose, **planning)
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    import json

    from .conversion import ConversionError
    from .conversion.verify import verify_folders

    used = [flag for flag, value in (("--text-only", args.text_only), ("--dry-run", args.dry_run),
                                      ("--mtp-from", args.mtp_from), ("--vision-from", args.vision_from),
                                      ("--router-aux-loss-coef", args.router_aux_loss_coef),
                                      ("--to", args.to != "packed")) if value]  # fmt: skip
    if used:
        raise ConversionError(f"--verify A B compares two folders; {', '.join(used)} do not apply")
    result, digests = verify_folders(args.src, args.out)
    for line in result.lines():
        print(line)
    if args.json is not None:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result.to_json(digests), handle, indent=2)
            handle.write("\n")
    if args.report_to is not None:
        from .hub import UploadError, record_round_trip

        try:
            path = record_round_trip(args.report_to, result)
        except UploadError as exc:
            raise ConversionError(str(exc)) from exc
        print(f"recorded in {path}")
    return 0 if result.identical else 1


def _coefficient(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a Qwen3.5 checkpoint folder between the official layout and this project's",
        description=(
            "Default (--to packed): convert a local official Qwen3.5 checkpoint folder (what transformers' built-in "
            "text classes save, or the official composite vision-language layout) into this project's layout: fused "
            "MoE experts, config.json with auto_map and normalised rope, the remote-code files, and the tokenizer / "
            "generation files; a composite SRC stays composite (model.visual.* and the processor files kept) unless "
            "--text-only asks for its language model alone; mtp.* tensors are dropped. --to official goes back: transformers' architectures, no auto_map, fused experts, mtp.* "
            "re-inserted from --mtp-from, and with --vision-from the composite checkpoint (its vision tower and "
            "processor files); a composite SRC in this project's vision-language layout keeps its own. --verify A B compares the tensors of two folders by checksum. Inputs are never "
            "modified; OUT must not exist and appears only when complete."
        ),
    )
    p.add_argument("src", metavar="SRC", help="source checkpoint folder (config.json + safetensors); A with --verify")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist); B with --verify")
    p.add_argument("--to", choices=("packed", "official"), default="packed",
                   help="direction: this project's layout (default) or the official one")  # fmt: skip
    p.add_argument(
        "--text-only",
        action="store_true",
        help="composite (vision-language) SRC: convert its language model only (vision tower dropped)",
    )
    p.add_argument(
        "--mtp-from",
        metavar="DIR",
        help="--to official: copy the mtp.* tensors (MTP head) of this official checkpoint, as stored",
    )
    p.add_argument("--vision-from", metavar="DIR",
                   help="--to official: write a composite checkpoint with the vision tower, config and processor files "
                        "of this official composite checkpoint")  # fmt: skip
    p.add_argument("--router-aux-loss-coef", type=_coefficient, metavar="X",
                   help="MoE: write this router_aux_loss_coef (e.g. 0 for RL) instead of SRC's")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest output shard, e.g. 5GB, 500MB, 2GiB or bytes (default: %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print every mapping rule (matched or not) and the remote-code file names",
    )
    p.add_argument("--verify", action="store_true",
                   help="compare the tensors of the folders A and B (dtype, shape, sha256 of the bytes); exit status 0 "
                        "when identical, 1 when not")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="--verify: write the result and every tensor's checksum of A here")
    p.add_argument("--report-to", metavar="FOLDER",
                   help="--verify: record the result as round_trip in FOLDER/qwen35_packed_report.json (the model "
                        "card shows it)")  # fmt: skip
    p.set_defaults(handler=_run_convert)


def _run_rope(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .conversion import ConversionError
    from .conversion.rope_readers import disagreements, rope_table, rope_views

    path = Path(args.path)
    path = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"cannot read {path}: {exc}") from exc
    text = data.get("text_config", data) if isinstance(data, dict) else None
    if not isinstance(text, dict):
        raise ConversionError(f"{path} is not a config object")
    views = rope_views(text)
    where = "text_config of " if text is not data else ""
    for line in rope_table(views, f"rope as each reader sees the {where}{path}:"):
        print(line)
    if disagreements(views):
        print("the readers disagree: `qwen35-packed convert` writes a config every reader reads the same way")
        return 1
    return 0


def _add_rope(subparsers) -> None:
    p = subparsers.add_parser(
        "rope",
        help="print the rope values of a config as each reader sees them",
        description=(
            "Print rope_theta, partial_rotary_factor, mrope_section and mrope_interleaved as transformers v5, a "
            "v4-style getattr reader and vLLM (with transformers 5 and 4) read them from a config.json (a folder or "
            "the file; composite configs: their text_config). Exit status 1 when the readers disagree."
        ),
    )
    p.add_argument("path", metavar="PATH", help="model folder or config.json")
    p.set_defaults(handler=_run_rope)


def _doctor_progress(group: str) -> None:
    print(f"checking {group}...", file=sys.stderr, flush=True)


def _run_doctor(args: argparse.Namespace) -> int:
    from .doctor import DoctorError, run_doctor

    try:
        report = run_doctor(args.model_dir, device=args.device, with_vllm=args.vllm, progress=_doctor_progress)
    except DoctorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    if args.json is not None:
        print(f"report written to {report.write_json(args.json)}")
    return report.exit_code


def _add_doctor(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check a model folder for silent train / inference mismatches before a run",
        description=(
            "Check MODEL_DIR: rope as every reader sees it, mrope sections, layer types, tensors against the config, "
            "MTP head, tied embeddings, the MoE load-balancing coefficient; the class transformers (with and without "
            "trust_remote_code), TRL and vLLM build; the kernels that run on the device and known-bad versions; "
            "packed == per-document on the first layers of the real weights; with --vllm, vLLM's log-probs against "
            "this model's. Prints PASS / WARN / FAIL / SKIP per check with a fix; exit status 1 on any FAIL."
        ),
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="model folder (config.json + safetensors)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the numerics run (default: cuda when available)")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="also compare vLLM's log-probs (vLLM's environment: $QWEN35_VLLM_PYTHON or .venv-vllm-cpu)",
    )
    p.add_argument("--json", metavar="FILE",
                   help="write the results into this model-card report (e.g. MODEL_DIR/qwen35_packed_report.json; "
                        "other sections of an existing report are kept)")  # fmt: skip
    p.set_defaults(handler=_run_doctor)


def _run_tiny(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from .tiny import VL_EXTRA_HINT, TinyFolderError, write_tiny

    transformers_logging.disable_progress_bar()  # the bar of saving the temporary official folder says nothing here
    try:
        written = write_tiny(args.out, moe=args.moe, vl=args.vl, seed=args.seed, data=args.data)
    except TinyFolderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if args.vl:
        try:
            import torchvision  # noqa: F401
        except Exception as exc:  # absent, or (PyPI's builds beside a CPU torch) failing to load its operators
            print(f"note: the processor files are written, but AutoProcessor.from_pretrained({str(args.out)!r}) needs "
                  f"torchvision (its video processor), which does not import here ({type(exc).__name__}: {exc}); "
                  f"install the vl extra: {VL_EXTRA_HINT}", file=sys.stderr)  # fmt: skip
    return 0


def _add_tiny(subparsers) -> None:
    p = subparsers.add_parser(
        "tiny",
        help="write a tiny random checkpoint folder with a tokenizer (and datasets) to try the recipes on CPU",
        description=(
            "Write OUT: a tiny random Qwen3.5 checkpoint, saved by transformers' built-in "
            "class and converted with `qwen35-packed convert`, with a character-level tokenizer and chat template; "
            "--vl the vision-language model with its processor files. Every recipe of the README and docs/ runs on "
            "it on CPU. --data DIR also writes DIR/chat (conversations, for `trl sft`) and DIR/prompts (a prompt "
            "column, for `trl grpo`). No output may exist; nothing is downloaded."
        ),
    )
    p.add_argument("out", metavar="OUT", help="output folder (must not exist)")
    p.add_argument("--moe", action="store_true", help="a mixture-of-experts model (default: dense)")
    p.add_argument("--vl", action="store_true", help="the vision-language model, with its processor files")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and data (default: %(default)s)")
    p.add_argument("--data", metavar="DIR", help="also write the datasets DIR/chat and DIR/prompts")
    p.set_defaults(handler=_run_tiny)


def _run_upload(args: argparse.Namespace) -> int:
    from .hub import run_upload

    return run_upload(args)


def _add_upload(subparsers) -> None:
    from .hub import UPLOAD_DESCRIPTION, add_upload_arguments

    p = subparsers.add_parser(
        "upload", help="upload a model or adapter folder to the Hugging Face Hub", description=UPLOAD_DESCRIPTION
    )
    add_upload_arguments(p)
    p.set_defaults(handler=_run_upload)


_COMMANDS = (_add_convert, _add_rope, _add_doctor, _add_tiny, _add_upload)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="qwen35-packed", description="Tools for packed Qwen3.5 checkpoints.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .conversion.errors import ConversionError

    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        return args.handler(args)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # `convert` has logged what the interrupt left (OUT complete, or nothing)
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    # SIGTERM (e.g. a job scheduler) unwinds like Ctrl-C, so the temporary output folder is removed.
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
