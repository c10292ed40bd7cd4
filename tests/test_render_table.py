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
