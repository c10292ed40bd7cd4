"""README.md and docs/*.md stay within the line budget that docs/development.md states ("Result files, generated
tables, line budget"): the budgets are read from that table, never repeated here.

A file's lines are `wc -l` lines, except where its budget reads `generated tables + N`: there only the lines outside
the sections benchmarks/render_table.py owns (`<!-- table:NAME -->` ... `<!-- /table -->`, markers included) count.
The `total` row bounds the sum of the counted lines of every file.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUDGET_DOC = ROOT / "docs" / "development.md"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = re.compile(r"^<!-- table:[\w-]+ -->\n.*?^<!-- /table -->\n", re.MULTILINE | re.DOTALL)
ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<budget>[^|]+?) \|", re.MULTILINE)
BUDGET = re.compile(r"^(?:(?P<tables>generated tables) \+ )?(?P<lines>\d[\d,]*)$")


def read_budgets(text: str) -> tuple[dict[str, tuple[int, bool]], int]:
    """({file: (lines, whether generated tables are left out)}, total) from the budget table of development.md: the
    table whose header's first two cells are `file` and `budget (lines)`."""
    header = re.search(r"^\| file \| budget \(lines\) \|.*\n\|[-| ]+\|\n", text, re.MULTILINE)
    assert header, "docs/development.md has no line-budget table (| file | budget (lines) | ...)"
    table = text[header.end() :].split("\n\n", 1)[0]
    budgets, total = {}, None
    for row in ROW.finditer(table):
        budget = BUDGET.match(row["budget"].strip())
        assert budget, f"unreadable budget {row['budget']!r} for {row['name']!r}"
        lines = int(budget["lines"].replace(",", ""))
        if row["name"] == "total":
            total = lines
        else:
            budgets[row["name"]] = (lines, bool(budget["tables"]))
    assert total is not None, "the line-budget table has no total row"
    return budgets, total


def counted_lines(text: str, without_tables: bool) -> int:
    if without_tables:
        text = GENERATED.sub("", text)
    return len(text.splitlines())


BUDGETS, TOTAL = read_budgets(BUDGET_DOC.read_text())


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_every_document_has_a_budget_and_every_budget_a_document():
    assert sorted(BUDGETS) == sorted(name(p) for p in DOCUMENTS)


@pytest.mark.parametrize("path", DOCUMENTS, ids=name)
def test_document_is_within_its_budget(path):
    assert name(path) in BUDGETS, f"{name(path)} has no row in the line-budget table of docs/development.md"
    budget, without_tables = BUDGETS[name(path)]
    lines = counted_lines(path.read_text(), without_tables)
    what = "lines outside the generated tables" if without_tables else "lines"
    assert lines <= budget, (
        f"{name(path)}: {lines} {what}, budget {budget} (docs/development.md): move a dated log to results/notes/ "
        "or keep a fact in one place and link it"
    )


def test_documents_are_within_the_total():
    counted = sum(counted_lines(p.read_text(), BUDGETS.get(name(p), (0, False))[1]) for p in DOCUMENTS)
    assert counted <= TOTAL, f"README.md and docs/ count {counted} lines, total budget {TOTAL} (docs/development.md)"


def test_generated_tables_are_left_out_only_where_the_budget_says_so():
    """The `generated tables + N` count leaves out exactly the marked sections: the same markers render_table.py
    rewrites."""
    text = "a\n<!-- table:dense -->\n| x |\n|---|\n<!-- /table -->\nb\n"
    assert counted_lines(text, without_tables=True) == 2
    assert counted_lines(text, without_tables=False) == 6
    budgets, total = read_budgets(
        "| file | budget (lines) | note |\n|---|---|---|\n| a.md | 1,200 | x |\n"
        "| b.md | generated tables + 60 | y |\n| total | 1,500 | z |\n"
    )
    assert budgets == {"a.md": (1200, False), "b.md": (60, True)} and total == 1500
