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
            "doc_128:full": {"tokens": 128, "real_tok_per_s": 5, "peak_GiB": 5.0, "warmup_steps": 1, "defect": "x"},
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
    # a row measured with a defect found later keeps its number, marked
    assert "| doc_128:full | 128 | 5 (measured with a defect: see the row's `defect`) | 5.0 |" in table


def test_workload_summary_gives_each_batch_the_fastest_and_the_smallest_run(tmp_path, monkeypatch):
    import json

    def row(rate, peak):
        return {"tokens": 16, "real_tok_per_s": rate, "peak_GiB": peak, "warmup_steps": 1}

    ours = {
        "model": "qwen35_4b (official)",
        "impl": "ours",
        "device": "NVIDIA H200",
        "rows": {
            "doc_16:full": row(300, 9.0),
            "doc_16:full_offload": row(290, 5.0),
            "doc_16:full_no_ckpt": {"tokens": 16, "error": "out of memory", "peak_GiB": 99.0},
            "rl:full": row(500, 7.0),
            "rl:full_offload": {**row(5000, 0.5), "defect": "x"},  # measured with a defect: never the summary's
        },
    }
    tuned = {
        "model": "qwen35_4b (official)",
        "impl": "ours",
        "config_fields_set": {"k": "v"},
        "device": "NVIDIA H200",
        "rows": {"rl:full": row(600, 8.0)},
    }
    builtin = {
        "model": "qwen35_4b (official)",
        "impl": "builtin",
        "device": "NVIDIA H200",
        "rows": {"rl:full": row(100, 50.0), "doc_16:full": {"tokens": 16, "error": "out of memory", "peak_GiB": 90.0}},
    }
    # another card's rows (faster and smaller here) stay out of the H200's summary
    other_card = {"model": "qwen35_4b (official)", "impl": "ours", "device": "NVIDIA H100 80GB HBM3"}
    other_card["rows"] = {"rl:full": row(900, 1.0), "doc_16:full": row(900, 1.0)}
    for name, data in (("ours", ours), ("ours-tuned", tuned), ("builtin", builtin), ("ours-h100", other_card)):
        (tmp_path / f"2026-01-01-workload-qwen35_4b-{name}.json").write_text(json.dumps(data))
    monkeypatch.setattr(render_table, "RESULTS", tmp_path)
    lines = render_table.render_workload_summary().splitlines()
    assert lines[2] == (
        "| qwen35_4b | RL batch (16) | 100 tokens/s in 50.0 GiB (`full`) | 600 tokens/s in 8.0 GiB (`full, k=v`) | "
        "500 tokens/s in 7.0 GiB (`full`) |"
    )
    assert lines[3] == (
        "| qwen35_4b | one document (16) | out of memory | 300 tokens/s in 9.0 GiB (`full`) | "
        "290 tokens/s in 5.0 GiB (`full_offload`) |"
    )


def test_grpo_step_table_lists_the_rows_of_the_newest_files_card(tmp_path, monkeypatch):
    import json

    setup = {"prompts": 8, "generations": 8, "prompt": 512, "completion": 256, "steps": 2, "warmup": 1}
    timed = {"generation_s": 9.5, "scoring_s": 0.05, "training_s": 3.0, "total_s": 12.6, "peak_gib": 23.6}
    ours = {"model": "m", "impl": "ours", "cache": "static", "result": {"warmup_steps": [{"total_s": 30.04}], **timed}}
    builtin = {
        "model": "m",
        "impl": "builtin",
        "cache": "dynamic",
        "result": {"error": "out of memory: x", "peak_gib": 1},
    }
    bf16 = {**setup, "bf16_adapters": True}
    files = {
        "2026-01-01-grpo-step-h200.json": ("H200", setup, [builtin]),  # another card: left out
        "2026-01-02-grpo-step-h200.json": ("H200", setup, [builtin]),
        "2026-01-02-grpo-step-h100.json": ("H100", setup, [{**ours, "result": {"error": "replaced"}}]),
        "2026-01-02-grpo-step-builtin-h100.json": ("H100", setup, [builtin]),
        "2026-01-02-grpo-step-h100-v2.json": ("H100", setup, [ours]),  # a later file's row replaces the same row
        "2026-01-03-grpo-step-bf16-h100.json": ("H100", bf16, [{**ours, "result": {"error": "out of memory: y"}}]),
        "2026-01-04-grpo-step-offload-h100.json": (
            "H100",
            {**setup, "activation_offloading": True, "micro_batches": 4},
            [ours],
        ),
        "2026-01-05-grpo-step-h100.json": (  # --warmup 0: the process's first step timed
            "H100",
            {**setup, "warmup": 0, "steps": 1, "micro_batches": 2},
            [{**ours, "model": "n", "result": {**ours["result"], "warmup_steps": []}}],
        ),
        "2026-01-05-grpo-step-builtin-bf16-h100.json": (  # a run cut short: the steps that ended
            "H100",
            {**bf16, "generation_rounds": 4, "micro_batches": 8},
            [
                {
                    **builtin,
                    "result": {
                        "in_progress": "1 of 2 steps ended",
                        "steps_ended": [{"total_s": 428.24}],
                        "peak_gib": 70.1,
                    },
                }
            ],  # fmt: skip
        ),
    }
    for name, (device, file_setup, rows) in files.items():
        (tmp_path / name).write_text(json.dumps({"device": device, "setup": file_setup, "rows": rows}))
    monkeypatch.setattr(render_table, "RESULTS", tmp_path)
    table = render_table.render_grpo_step().splitlines()
    assert table[2:] == [
        "| m | ours, static cache | 8 x 8, 256 after 512 | 9.5 | 0.05 | 3.0 | 12.6 | 30.0 | 23.6 "
        "| 2026-01-02-grpo-step-h100-v2.json |",
        "| m | ours, static cache, activation offloading | 8 x 8, 256 after 512, trained in 4 micro-batches | 9.5 "
        "| 0.05 | 3.0 | 12.6 | 30.0 | 23.6 | 2026-01-04-grpo-step-offload-h100.json |",
        "| m | ours, static cache, bf16 adapters | 8 x 8, 256 after 512 | failed: out of memory: y | | | | | "
        "| 2026-01-03-grpo-step-bf16-h100.json |",
        "| m | builtin, dynamic cache | 8 x 8, 256 after 512 | failed: out of memory: x | | | | | "
        "| 2026-01-02-grpo-step-builtin-h100.json |",
        "| m | builtin, dynamic cache, bf16 adapters | 8 x 8, 256 after 512, generated in 4 rounds, trained in 8 "
        "micro-batches | cut short, 1 of 2 steps ended | | | | 428.2 | 70.1 | 2026-01-05-grpo-step-builtin-bf16-h100.json |",
        "| n | ours, static cache | 8 x 8, 256 after 512, trained in 2 micro-batches | 9.5 | 0.05 | 3.0 | 12.6 "
        "| none: the first step of its process, timed | 23.6 | 2026-01-05-grpo-step-h100.json |",
        "",
        "(H100)",
    ]


def test_generate_table_lists_the_rows_of_the_newest_session_with_their_files(tmp_path, monkeypatch):
    import json

    def row(impl, cache, batch, step_ms, mode="greedy"):
        result = {"decode_step_ms": step_ms, "new_tokens_per_s": 100.0, "first_call_s": 1.0, "peak_gib": 2.0}
        result["bandwidth_bound_ms"] = 0.5
        return {
            "model": "m",
            "impl": impl,
            "cache": cache,
            "batch": batch,
            "prompt": 512,
            "mode": mode,
            "result": result,
        }

    files = {
        "2026-01-01-generate-h100.json": ("H100", 64, [row("ours", "static", 16, 9.0)]),  # an older session
        "2026-01-02-generate-h100.json": (
            "H100",
            64,
            [row("builtin", "dynamic", 16, 20.0), row("ours", "static", 16, 9.0)],
        ),
        "2026-01-02-generate-h100-v2.json": ("H100", 64, [row("ours", "static", 16, 2.0)]),  # replaces the same row
        "2026-01-02-generate-h100-v3.json": (
            "H100",
            256,  # other new tokens: other rows
            [row("ours", "static", 1, 1.5), {**row("ours", "static", 64, 0, "sampled"), "result": {"error": "E"}}],
        ),
    }
    for name, (device, new_tokens, rows) in files.items():
        (tmp_path / name).write_text(json.dumps({"device": device, "new_tokens": new_tokens, "rows": rows}))
    monkeypatch.setattr(render_table, "RESULTS", tmp_path)
    assert render_table.render_generate().splitlines()[2:] == [
        "| m | ours, static cache | 16 x 512, 64 greedy | 2.0 | 4.0 | 100.0 | 1.0 | 2.0 | 2026-01-02-generate-h100-v2.json |",
        "| m | builtin | 16 x 512, 64 greedy | 20.0 | 40.0 | 100.0 | 1.0 | 2.0 | 2026-01-02-generate-h100.json |",
        "| m | ours, static cache | 1 x 512, 256 greedy | 1.5 | 3.0 | 100.0 | 1.0 | 2.0 | 2026-01-02-generate-h100-v3.json |",
        "| m | ours, static cache | 64 x 512, 256 sampled | failed: E | | | | | 2026-01-02-generate-h100-v3.json |",
        "",
        "(H100)",
    ]


def test_a_tables_kind_is_matched_right_after_the_date(tmp_path, monkeypatch):
    """A newer workload file whose name holds another kind's word ("moe-chunk") does not become the MoE tables'
    source: both keep reading the newest MoE result file."""
    import shutil

    source = render_table.RESULTS / "2026-12-02-moe-h200-v6.json"
    shutil.copy(source, tmp_path / source.name)
    (tmp_path / "2026-12-31-workload-m-ours-moe-chunk-h100.json").write_text('{"rows": {}}')
    monkeypatch.setattr(render_table, "RESULTS", tmp_path)
    for render in (render_table.render_moe, render_table.render_moe_summary):
        table = render()
        assert "2026-12-02-moe-h200-v6.json" in table and "moe-chunk" not in table


def test_train_step_and_moe_tables_read_one_cards_files(tmp_path, monkeypatch):
    """The H200 tables (the README's among them) read H200 files only; an H100 file, newer, fills its own sections."""
    import shutil

    for name in ("2026-12-02-moe-h200-v6.json", "2026-12-02-train-step-h200-v9.json"):
        shutil.copy(render_table.RESULTS / name, tmp_path / name)
    for name in ("2026-12-06-moe-h100.json", "2026-12-06-train-step-h100.json"):
        shutil.copy(render_table.RESULTS / name, tmp_path / name)
    monkeypatch.setattr(render_table, "RESULTS", tmp_path)
    for h200 in (render_table.render_moe(), render_table.render_moe_summary(), render_table.render()):
        assert "h200" in h200 and "h100" not in h200
    for h100 in (render_table.render_moe("h100"), render_table.render(card="h100")):
        assert "h100" in h100 and "h200" not in h100
