"""The generated performance tables of README.md and docs/ match the benchmark result files.

benchmarks/render_table.py owns the lines between `<!-- table:NAME -->` and `<!-- /table -->`; after a result
file is added or changed, `python benchmarks/render_table.py --write` rewrites them.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import render_table  # noqa: E402


@pytest.mark.parametrize("path", render_table.MARKDOWN_FILES, ids=lambda p: p.name)
def test_generated_sections_are_up_to_date(path):
    text = path.read_text()
    assert "<!-- table:" in text, f"{path.name} has no generated table"
    assert render_table.update(text) == text, f"run python benchmarks/render_table.py --write ({path.name} is stale)"


def test_a_hand_edited_row_is_rewritten():
    text = render_table.MARKDOWN_FILES[0].read_text()
    start = text.index("<!-- table:moe-summary -->\n") + len("<!-- table:moe-summary -->\n")
    first_row = text.index("\n", text.index("|---", start)) + 1  # the line after the header's separator
    edited = text[:first_row] + "| hand-edited |" + text[text.index("\n", first_row) :]
    assert render_table.update(edited) == text


def test_an_unknown_table_name_is_an_error():
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        render_table.update("<!-- table:nope -->\n| x |\n<!-- /table -->")


def test_workload_table_lists_every_row_of_the_newest_files(tmp_path, monkeypatch):
    import json

    older = {"model": "qwen35_4b (official)", "impl": "ours", "rows": {"doc_8:full": {"tokens": 8, "peak_GiB": 1.0}}}
    newer = {
        "model": "qwen35_4b (official)",
        "impl": "ours",
        "rows": {
            "doc_16:full": {"tokens": 16, "real_tok_per_s": 1234, "peak_GiB": 2.0, "warmup_steps": 1},
            "doc_32:full": {"tokens": 32, "real_tok_per_s": 1, "peak_GiB": 3.0, "warmup_steps": 0},
            "doc_64:full": {"tokens": 64, "error": "out of memory", "peak_GiB": 4.0},
        },
    }
    (tmp_path / "2026-01-01-workload-qwen35_4b-ours.json").write_text(json.dumps(older))
    (tmp_path / "2026-01-02-workload-qwen35_4b-ours.json").write_text(json.dumps(newer))
    monkeypatch.setattr(render_table, "RESULTS", tmp_path)
    table = render_table.render_workload()
    assert "doc_8:full" not in table  # only the newest file of a model and implementation
    assert "| doc_16:full | 16 | 1,234 | 2.0 |" in table
    assert "| doc_32:full | 32 | trains (first step, compile included: no rate) | 3.0 |" in table  # no warm-up: no rate
    assert "| doc_64:full | 64 | out of memory | 4.0 |" in table
