"""Render the README's performance tables from the benchmark result files (benchmarks/results/).

    python benchmarks/render_table.py            # the newest train-step file of every model, as a markdown table
    python benchmarks/render_table.py --all      # every train-step file (the history)
    python benchmarks/render_table.py --moe      # the newest *-moe-*.json file (bench_moe.py)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_train_step import result_rows

RESULTS = Path(__file__).resolve().parent / "results"


def rows(newest_only: bool = True):
    paths = sorted(RESULTS.glob("*-train-step*.json"))  # names sort by date, then version
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


def render(newest_only: bool = True) -> str:
    lines = [
        "| model | batch (real / padded tokens) | run | real tokens/s | x built-in | MFU | peak GiB | result file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, data, model, batch, entry, run, row in rows(newest_only):
        size = f"{batch} ({entry['real_tokens']:,} / {entry['padded_tokens']:,})"
        if "source" in row:  # a row this file copies from an earlier file (see its provenance)
            name = f"{name} ({row['source']})"
        if "error" in row:
            lines.append(f"| {model} | {size} | {run} | {row['error']} | | | {row['peak_GiB']} | {name} |")
            continue
        ratio = row.get("ratio_to_builtin", "")
        lines.append(f"| {model} | {size} | {run} | {row['real_tok_per_s']:,} | {ratio} | {row['mfu']:.0%} | "
                     f"{row['peak_GiB']} | {name} |")
    return "\n".join(lines)


def render_moe() -> str:
    path = sorted(RESULTS.glob("*-moe-*.json"))[-1]
    data = json.loads(path.read_text())
    lines = ["| model | batch (real tokens) | run | real tokens/s | x built-in | x built-in LoRA | MFU (active) | "
             "peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for model, batch, entry, run, row in result_rows(data):
        if "error" in row:
            lines.append(f"| {model} | {batch} ({entry['real_tokens']:,}) | {run} | {row['error']} | | | | |")
            continue
        lines.append(f"| {model} | {batch} ({entry['real_tokens']:,}) | {run} | {row['real_tok_per_s']:,} | "
                     f"{row.get('ratio_to_builtin', '')} | {row.get('ratio_to_builtin_lora', '')} | "
                     f"{row['mfu_active']:.0%} | {row['peak_GiB']} |")
    for model, per_model in data.items():
        if not isinstance(per_model, dict):
            continue
        for run, row in per_model.get("experts_alone_rl_tokens", {}).items():
            lines.append(f"| {model} | experts of one layer alone, RL tokens | {run} | {row.get('ms')} ms | | | | |")
    return "\n".join(lines) + f"\n\n({path.name})"


if __name__ == "__main__":
    if "--moe" in sys.argv[1:]:
        print(render_moe())
    else:
        print(render(newest_only="--all" not in sys.argv[1:]))
