"""Render the performance tables of README.md and docs/ from the benchmark result files (results/benchmarks/).

    python benchmarks/render_table.py            # the newest H200 train-step file of every model, as a markdown table
    python benchmarks/render_table.py --all      # every H200 train-step file (the history)
    python benchmarks/render_table.py --moe      # the newest *-moe-h200*.json file (bench_moe.py)
    (H100 train-step and MoE files: the dense-h100 / moe-h100 sections)
    (generate(): the newest *-generate-h100* / *-generate-h200* file, bench_generate.py, and the same for
    *-changing-lengths-*, bench_changing_lengths.py, in marked sections only)
    python benchmarks/render_table.py --write    # rewrite every marked section of the markdown files below
    python benchmarks/render_table.py --check    # exit 1 when a marked section differs from what the files give

A marked section is `<!-- table:NAME -->`, the generated lines, `<!-- /table -->`, with NAME a key of TABLES; the
lines in between are owned by this script (tests/test_render_table.py fails when one is out of date).
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

from bench_train_step import result_rows

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "benchmarks"
# A result file's name: its date, then its kind (moe, workload, ...). The kind is matched right after the date, so
# that a word of another file's name (a workload file's "moe-chunk") does not pick it.
DATED = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]-"
MARKDOWN_FILES = (ROOT / "README.md", ROOT / "docs" / "performance.md")
SECTION = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)


def chains(row: dict) -> str:
    """The suffix ' (<mode> chains)' for a row that records its elementwise mode, else '': what the default ran changed
    (compiled chains before the Triton kernels, see the result files' provenance)."""
    return f" ({row['elementwise_kernel']} chains)" if "elementwise_kernel" in row else ""


def run_label(run: str, row: dict) -> str:
    """The run's name, with the elementwise mode of an `ours_packed` row."""
    return run + chains(row) if run == "ours_packed" else run


def ours_rate(row: dict) -> str:
    return f"{row['real_tok_per_s']:,}{chains(row)}"


def rows(newest_only: bool = True, card: str = "h200"):
    """The rows of the train-step files measured on `card` (bench_train_step.py): of the newest file of each model, or
    of every file."""
    paths = result_files(f"{DATED}train-step-{card}*.json")
    newest = {}
    for path in paths:
        for model, per_model in json.loads(path.read_text()).items():
            if isinstance(per_model, dict) and "params" in per_model:
                newest[model] = path
    for path in paths:
        data = json.loads(path.read_text())
        for model, per_model in data.items():
            if not isinstance(per_model, dict) or "params" not in per_model:
                continue
            if newest_only and newest[model] != path:
                continue
            for batch, entry in per_model.items():
                if not isinstance(entry, dict) or "runs" not in entry:
                    continue
                for run, row in entry["runs"].items():
                    yield path.name, data, model, batch, entry, run, row


def render(newest_only: bool = True, card: str = "h200") -> str:
    lines = [
        "| model | batch (real / padded tokens) | run | real tokens/s | x built-in | MFU (6 x non-embedding) | "
        "MFU (every matmul) | peak GiB | result file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, data, model, batch, entry, run, row in rows(newest_only, card):
        size = f"{batch} ({entry['real_tokens']:,} / {entry['padded_tokens']:,})"
        if "source" in row:  # a row this file copies from an earlier file (see its provenance)
            name = f"{name} ({row['source']})"
        run = run_label(run, row)
        if "wrong" in row:  # e.g. the built-in's leaking path: listed, never a baseline
            run = f"{run} (wrong: {row['wrong']})"
        if "error" in row:
            lines.append(f"| {model} | {size} | {run} | {row['error']} | | | | {row['peak_GiB']} | {name} |")
            continue
        ratio = row.get("ratio_to_builtin", "")
        every = f"{row['mfu_all_matmuls']:.0%}" if row.get("mfu_all_matmuls") is not None else ""
        lines.append(
            f"| {model} | {size} | {run} | {row['real_tok_per_s']:,} | {ratio} | {row['mfu']:.0%} | "
            f"{every} | {row['peak_GiB']} | {name} |"
        )
    return "\n".join(lines)


def render_dense_summary() -> str:
    """Ours packed against the baseline run of each batch, newest H200 train-step file of every model."""
    lines = [
        "| model | batch (real tokens) | ours tokens/s | built-in tokens/s (run) | x built-in | peak GiB (ours / "
        "built-in) | result file |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, _, model, batch, entry, run, row in rows(newest_only=True):
        if run != "ours_packed" or "error" in row:
            continue
        if entry.get("baseline") is None:  # no built-in run finished: say why the first one did not
            failed = next((r for n, r in entry["runs"].items() if n.startswith("builtin") and "error" in r), {})
            lines.append(
                f"| {model} | {batch} ({entry['real_tokens']:,}) | {ours_rate(row)} | "
                f"{failed.get('error', 'not run')} | | {row['peak_GiB']} / {failed.get('peak_GiB', '')} | {name} |"
            )
            continue
        base = entry["runs"][entry["baseline"]]
        lines.append(
            f"| {model} | {batch} ({entry['real_tokens']:,}) | {ours_rate(row)} | "
            f"{base['real_tok_per_s']:,} ({entry['baseline']}) | {row['ratio_to_builtin']} | "
            f"{row['peak_GiB']} / {base['peak_GiB']} | {name} |"
        )
    return "\n".join(lines)


def by_date_and_version(path: Path):
    """Sort key of a result file name: its date, then its -vN suffix (none counts as v1)."""
    version = re.search(r"-v(\d+)$", path.stem)
    return path.name[:10], int(version.group(1)) if version else 1


def result_files(pattern: str) -> list[Path]:
    """The result files matching `pattern`, oldest first (by date, then -vN, then name)."""
    return sorted(RESULTS.glob(pattern), key=lambda path: (*by_date_and_version(path), path.name))


def newest(pattern: str) -> tuple[str, dict]:
    """(name, contents) of the newest result file matching `pattern`."""
    path = result_files(pattern)[-1]
    return path.name, json.loads(path.read_text())


def render_moe(card: str = "h200") -> str:
    """Every row of the newest bench_moe.py file measured on `card`."""
    name, data = newest(f"{DATED}moe-{card}*.json")
    lines = [
        "| model | batch (real tokens) | run | real tokens/s | x built-in | x built-in LoRA | MFU (active) | "
        "peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, batch, entry, run, row in result_rows(data):
        if "error" in row:
            lines.append(f"| {model} | {batch} ({entry['real_tokens']:,}) | {run} | {row['error']} | | | | |")
            continue
        run = run_label(run, row)
        if "source" in row:  # a row copied from an earlier run (see the file's provenance)
            run = f"{run} ({row['source']})"
        lines.append(
            f"| {model} | {batch} ({entry['real_tokens']:,}) | {run} | {row['real_tok_per_s']:,} | "
            f"{row.get('ratio_to_builtin', '')} | {row.get('ratio_to_builtin_lora', '')} | "
            f"{row['mfu_active']:.0%} | {row['peak_GiB']} |"
        )
    for model, per_model in data.items():
        if not isinstance(per_model, dict):
            continue
        for run, row in per_model.get("experts_alone_rl_tokens", {}).items():
            run = f"{run} ({row['source']})" if "source" in row else run
            lines.append(f"| {model} | experts of one layer alone, RL tokens | {run} | {row.get('ms')} ms | | | | |")
    return "\n".join(lines) + f"\n\n({name})"


def render_moe_summary() -> str:
    """Per model and batch of the newest H200 MoE file: ours packed against the baseline, and LoRA against LoRA."""
    name, data = newest(f"{DATED}moe-h200*.json")
    lines = [
        "| model | batch (real tokens) | ours tokens/s | built-in tokens/s | x built-in | peak GiB (ours / "
        "built-in) | LoRA x built-in LoRA |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, batch, entry, run, row in result_rows(data):
        if run != "ours_packed" or "error" in row:
            continue
        base = entry["runs"][entry["baseline"]]
        lora_row = entry["runs"].get("ours_lora", {})
        lora = lora_row.get("ratio_to_builtin_lora", "")
        if lora and "source" in lora_row:
            lora = f"{lora} ({lora_row['source']})"
        copied = f" (copied from {row['source']})" if "source" in row else ""
        base_copied = f" (copied from {base['source']})" if "source" in base else ""
        lines.append(
            f"| {model} | {batch} ({entry['real_tokens']:,}){copied} | {ours_rate(row)} | "
            f"{base['real_tok_per_s']:,}{base_copied} | {row['ratio_to_builtin']} | {row['peak_GiB']} / "
            f"{base['peak_GiB']} | {lora} |"
        )
    return "\n".join(lines) + f"\n\n({name})"


def workload_rows():
    """(result file name, model, implementation with its config settings, row name, row, card) for every row of the
    newest bench_workload.py file of each model and implementation (a file's key: its name without date and -vN)."""
    newest = {}
    for path in result_files(f"{DATED}workload-*.json"):
        newest[re.sub(r"^\d{4}-\d{2}-\d{2}-workload-|-v\d+$", "", path.stem)] = path
    for key in sorted(newest):
        data = json.loads(newest[key].read_text())
        settings = data.get("config_fields_set") or {}
        impl = data["impl"] + "".join(f" ({name}={value})" for name, value in settings.items())
        for row_name, row in data["rows"].items():
            yield newest[key].name, data["model"].split(" ")[0], impl, row_name, row, data.get("device", "")


def timed(row: dict) -> bool:
    """Whether a workload row has a rate: it ran, after at least one warm-up step."""
    return "error" not in row and row.get("warmup_steps") != 0


def workload_rate(row: dict) -> str:
    # a row measured with a defect found later keeps its number, marked (the file's row says which defect)
    defect = " (measured with a defect: see the row's `defect`)" if "defect" in row else ""
    if "error" in row:
        return row["error"] + (" (see the row's note)" if "note" in row else "") + defect
    if not timed(row):
        return "trains (first step, compile included: no rate)" + defect
    return f"{row['real_tok_per_s']:,}{defect}"


def render_workload() -> str:
    """What one GPU trains (bench_workload.py): every row of the newest file of each model and implementation."""
    lines = [
        "| model | implementation | batch:setup | tokens | real tokens/s | peak GiB | result file |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, model, impl, row_name, row, _ in workload_rows():
        lines.append(
            f"| {model} | {impl} | {row_name} | {row['tokens']:,} | {workload_rate(row)} | {row['peak_GiB']} | {name} |"
        )
    return "\n".join(lines)


def render_workload_summary(card: str = "H200") -> str:
    """Per model and batch of the workload rows measured on `card` (the README's "What one H200 trains"; rows of
    other cards are in the full table): the built-in's fastest run (or that every setup ran out of memory), ours's
    fastest run and ours's smallest, each with its setup."""
    groups = collections.defaultdict(list)
    for _, model, impl, row_name, row, device in workload_rows():
        if card not in device:
            continue
        batch, setup = row_name.split(":")
        settings = re.findall(r"\((.*?)\)", impl)
        groups[model, batch].append((impl.split(" ")[0], ", ".join([setup, *settings]), row))

    def cell(entry) -> str:
        _, setup, row = entry
        return f"{row['real_tok_per_s']:,} tokens/s in {row['peak_GiB']} GiB (`{setup}`)"

    lines = [
        "| model | batch (tokens) | the built-in | ours, fastest | ours, least memory |",
        "|---|---|---|---|---|",
    ]

    def batch_order(key):  # per model: the RL batch, then documents by length
        return key[0], key[1] != "rl", int(key[1][4:]) if key[1].startswith("doc_") else 0

    for model, batch in sorted(groups, key=batch_order):
        entries = groups[model, batch]
        ours = [e for e in entries if e[0] == "ours" and timed(e[2]) and "defect" not in e[2]]
        builtin_timed = [e for e in entries if e[0] == "builtin" and timed(e[2])]
        builtin_all = [e for e in entries if e[0] == "builtin"]
        if builtin_timed:
            builtin = cell(max(builtin_timed, key=lambda e: e[2]["real_tok_per_s"]))
        elif builtin_all:
            builtin = "out of memory" + (f" (all {len(builtin_all)} setups)" if len(builtin_all) > 1 else "")
        else:
            builtin = "not run"
        fastest = max(ours, key=lambda e: e[2]["real_tok_per_s"]) if ours else None
        smallest = min(ours, key=lambda e: e[2]["peak_GiB"]) if ours else None
        tokens = entries[0][2]["tokens"]
        label = "RL batch" if batch == "rl" else "one document" if batch.startswith("doc_") else batch
        lines.append(
            f"| {model} | {label} ({tokens:,}) | {builtin} | {cell(fastest) if fastest else 'not run'} | "
            f"{cell(smallest) if smallest and smallest is not fastest else ''} |"
        )
    return "\n".join(lines)


def render_generate() -> str:
    """generate() on the GPU (bench_generate.py): the rows of the newest session's generate files of an H100 or H200
    (a later file's row replaces an earlier one of the same model, implementation, cache, batch, prompt, mode and new
    tokens), each with its file: rows of one file come from one machine."""
    rows, device = session_rows(
        f"{DATED}generate-h[12]00*.json",
        lambda data, row: (
            row["model"],
            data["new_tokens"],
            row["prompt"],
            row["batch"],
            row["mode"],
            row["impl"] != "ours",
            row.get("cache") or "",
        ),
    )
    lines = [
        "| model | implementation | batch x prompt, new tokens | decode step ms | x bandwidth bound | new tokens/s "
        "| first call s | peak GiB | result file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rows):
        name, data, row = rows[key]
        r = row["result"]
        impl = row["impl"] + (", static cache" if row.get("cache") == "static" else "")
        shape = f"{row['batch']} x {row['prompt']}, {data['new_tokens']} {row['mode']}"
        if "error" in r:
            lines.append(f"| {row['model']} | {impl} | {shape} | failed: {r['error'][:80]} | | | | | {name} |")
            continue
        bound = r.get("bandwidth_bound_ms")  # the weights' reading time at the card's data-sheet bandwidth
        over_bound = f"{r['decode_step_ms'] / bound:.1f}" if bound else ""
        lines.append(
            f"| {row['model']} | {impl} | {shape} | {r['decode_step_ms']} | {over_bound} "
            f"| {r['new_tokens_per_s']:,} | {r['first_call_s']} | {r['peak_gib']} | {name} |"
        )
    return "\n".join(lines + ["", f"({device})"])


def render_changing_lengths() -> str:
    """Training steps on rows of changing length (bench_changing_lengths.py): every row of the newest file of an H100
    or H200, the rounds after warm-up."""
    name, data = newest(f"{DATED}changing-lengths-h[12]00*.json")
    lines = [
        "| model | implementation | new lengths after warm-up | median step s (seen length) | median / largest stall s "
        "| stalls over 0.5 s |",
        "|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        r = row["result"]
        if "error" in r:
            lines.append(f"| {row['model']} | {row['impl']} | failed: {r['error'][:60]} | | | |")
            continue
        rounds = sum(not x["warmup"] for x in r["rounds"])
        lines.append(
            f"| {row['model']} | {row['impl']} | {rounds} | {r['median_seen_s']} "
            f"| {r['median_stall_s']} / {r['max_stall_s']} | {r['rounds_over_half_second']} |"
        )
    return "\n".join(lines + ["", f"({name}, {data['device']})"])


def one_session(pattern: str, every_date: bool = False) -> list[tuple[str, dict]]:
    """The newest result file matching `pattern` and every other one of its date and card (a session's stages, one
    file each), oldest first; with `every_date`, every file of its card. Two sessions of one day on two machines of
    one card land together: the tables name each row's file, whose provenance says where it ran."""
    files = [(path.name, json.loads(path.read_text())) for path in result_files(pattern)]
    date, device = files[-1][0][:10], files[-1][1]["device"]
    return [(name, data) for name, data in files if (every_date or name[:10] == date) and data["device"] == device]


def session_rows(pattern: str, key, every_date: bool = False) -> tuple[dict, str]:
    """({key(file contents, row): (file name, file contents, row)} over the rows of `one_session(pattern,
    every_date)`, a later file's row replacing an earlier one of the same key; the session's card)."""
    files = one_session(pattern, every_date)
    rows = {key(data, row): (name, data, row) for name, data in files for row in data["rows"]}
    return rows, files[-1][1]["device"]


def render_grpo_step() -> str:
    """One GRPO step without vLLM (bench_grpo_step.py): every row of the files of the newest file's card, H100 or
    H200 (a later file's row replaces an earlier one of the same model, implementation, cache, adapter dtype and
    offloading: a stage runs one implementation, so a session's rows are spread over sessions), the timed steps' mean
    seconds split as the benchmark splits them, and the warm-up steps (compiles) apart."""
    # each model's rows: ours (dynamic, then static cache), then the built-in; PEFT's default adapters first
    rows, device = session_rows(
        f"{DATED}grpo-step*-h[12]00*.json",
        lambda data, row: (
            row["model"],
            row["impl"] != "ours",
            row["cache"],
            bool(data["setup"].get("bf16_adapters")),
            bool(data["setup"].get("activation_offloading")),
        ),
        every_date=True,
    )
    lines = [
        "| model | implementation | prompts x completions, tokens | generation s | scoring s | training s | step s "
        "| warm-up step s | peak GiB | result file |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rows):
        name, data, row = rows[key]
        setup = data["setup"]
        shape = f"{setup['prompts']} x {setup['generations']}, {setup['completion']} after {setup['prompt']}"
        if setup.get("generation_rounds", 1) > 1:
            shape += f", generated in {setup['generation_rounds']} rounds"
        if setup.get("micro_batches", 1) > 1:
            shape += f", trained in {setup['micro_batches']} micro-batches"
        r = row["result"]
        impl = f"{row['impl']}, {row['cache']} cache" + (", bf16 adapters" if setup.get("bf16_adapters") else "")
        impl += ", activation offloading" if setup.get("activation_offloading") else ""
        if "error" in r:
            phase = f" in {r['phase']}" if r.get("phase") else ""
            lines.append(f"| {row['model']} | {impl} | {shape} | failed{phase}: {r['error'][:80]} | | | | | | {name} |")
            continue
        if "in_progress" in r:  # a run cut short: the steps that ended (the first of them warm-up steps)
            ended = round(sum(step["total_s"] for step in r["steps_ended"]), 1)
            peak = r["peak_gib"] or ""
            lines.append(
                f"| {row['model']} | {impl} | {shape} | cut short, {r['in_progress']} | | | | {ended} | {peak} | {name} |"
            )
            continue
        # --warmup 0: the process's first step timed (see the file's provenance)
        warmup = (
            round(sum(step["total_s"] for step in r["warmup_steps"]), 1)
            if r["warmup_steps"]
            else "none: the first step of its process, timed"
        )
        lines.append(
            f"| {row['model']} | {impl} | {shape} | {r['generation_s']} | {r['scoring_s']} | {r['training_s']} "
            f"| {r['total_s']} | {warmup} | {r['peak_gib']} | {name} |"
        )
    return "\n".join(lines + ["", f"({device})"])


TABLES = {
    "dense": render,
    "dense-history": lambda: render(newest_only=False),
    "dense-h100": lambda: render(card="h100"),
    "dense-summary": render_dense_summary,
    "moe": render_moe,
    "moe-h100": lambda: render_moe("h100"),
    "moe-summary": render_moe_summary,
    "workload": render_workload,
    "workload-summary": render_workload_summary,
    "generate": render_generate,
    "changing-lengths": render_changing_lengths,
    "grpo-step": render_grpo_step,
}


def update(text: str) -> str:
    """`text` with every marked section replaced by its table as the result files give it now."""

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r} in a marked section (known: {', '.join(TABLES)})")
        return f"{match.group(1)}{TABLES[name]()}\n{match.group(4)}"

    return SECTION.sub(replace, text)


def stale_files(paths=MARKDOWN_FILES) -> list[Path]:
    return [path for path in paths if update(path.read_text()) != path.read_text()]


def main(argv: list[str]) -> int:
    if "--write" in argv:
        for path in MARKDOWN_FILES:
            path.write_text(update(path.read_text()))
        return 0
    if "--check" in argv:
        stale = stale_files()
        for path in stale:
            print(
                f"{path.relative_to(ROOT)}: a generated table is out of date; run python benchmarks/render_table.py "
                "--write"
            )
        return 1 if stale else 0
    print(render_moe() if "--moe" in argv else render(newest_only="--all" not in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
