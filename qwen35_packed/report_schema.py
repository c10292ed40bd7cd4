"""The names the model-card report (`qwen35_packed_report.json`) shares between its writers and its reader.

`qwen35-packed doctor --json` and `convert --verify --report-to` write the report, `hub.py` validates it and renders
it into the card (the schema is documented at `hub.load_report_file`). Both sides import these names from here, so
neither imports the other for them.
"""

REPORT_NAME = "qwen35_packed_report.json"
REPORT_SCHEMA = "qwen35_packed_report/1"

# The status of one doctor check, as the report's `doctor` section stores it.
PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
STATUSES = (PASS, WARN, FAIL, SKIP)
