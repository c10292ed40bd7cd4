"""Render the README's performance table from the benchmark result files (benchmarks/results/*-train-step*.json).

    python benchmarks/render_table.py            # prints the markdown table
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def rows():
    for path in sorted(RESULTS.glob("*-train-step*.json")):
        data = json.loads(path.read_text())
        for model, per_model in data.items():
            if not isinstance(per_model, dict) or "params" not in per_model:
                continue
            for batch, entry in per_model.items():
                if not isinstance(entry, dict) or "runs" not in entry:
                    continue
                for run, row in entry["runs"].items():
                    yield path.name, data, model, batch, entry, run, row


def render() -> str:
    lines = [
        "| model | batch (real / padded tokens) | run | real tokens/s | x built-in | MFU | peak GiB | result file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, data, model, batch, entry, run, row in rows():
        size = f"{batch} ({entry['real_tokens']:,} / {entry['padded_tokens']:,})"
        if "error" in row:
            lines.append(f"| {model} | {size} | {run} | {row['error']} | | | {row['peak_GiB']} | {name} |")
            continue
        ratio = row.get("ratio_to_builtin", "")
        lines.append(f"| {model} | {size} | {run} | {row['real_tok_per_s']:,} | {ratio} | {row['mfu']:.0%} | "
                     f"{row['peak_GiB']} | {name} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
