"""The model-card report (`qwen35_packed_report.json`): the names its writers and its reader share, and its
validation.

`qwen35-packed doctor --json` and `convert --verify --report-to` write the report, `hub.py` renders it into the card.
Writers and reader import the names and `read_report_file` from here, so neither imports the other.
"""

from __future__ import annotations

import math
from pathlib import Path

from .json_files import read_json_object

REPORT_NAME = "qwen35_packed_report.json"
REPORT_SCHEMA = "qwen35_packed_report/1"

# The status of one doctor check, as the report's `doctor` section stores it.
PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
STATUSES = (PASS, WARN, FAIL, SKIP)


def read_report_file(path, error: type[Exception]) -> dict:
    """The report stored in `path`, validated against REPORT_SCHEMA; else `error` (the caller's class) saying what is
    wrong with it.

    Schema `qwen35_packed_report/1` (every section optional):
      {"schema": "qwen35_packed_report/1",
       "source": {"base_model": "Qwen/Qwen3.5-0.8B", "license": "apache-2.0"},
       "round_trip": {"identical": true, "tensors": 488, "digest": "<convert --verify digest>"},
       "parity": [{"check": str, "value": number, "unit": str, "dtype": str, "device": str, "notes": str}, ...],
       "performance": [same fields as parity],
       "doctor": {"status": "PASS" | "WARN" | "FAIL", "device": "cpu", "versions": {package: version},
                  "checks": [{"check": str, "status": "PASS" | "WARN" | "FAIL" | "SKIP", "detail": str, "fix": str}]}}
    `doctor` is written by `qwen35-packed doctor --json`, which also puts its measured numbers into `parity`.
    """
    report = read_json_object(path, error, Path(path).name)
    if report.get("schema") != REPORT_SCHEMA:
        raise error(f"{REPORT_NAME}: schema must be {REPORT_SCHEMA!r}, got {report.get('schema')!r}")
    source = report.get("source", {})
    if not isinstance(source, dict) or any(not isinstance(v, str) for v in source.values()):
        raise error(f"{REPORT_NAME}: source must be an object of strings")
    for section in ("parity", "performance"):
        entries = report.get(section, [])
        if not isinstance(entries, list):
            raise error(f"{REPORT_NAME}: {section} must be a list")
        for i, entry in enumerate(entries):
            value = entry.get("value") if isinstance(entry, dict) else None
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("check"), str)
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise error(f"{REPORT_NAME}: {section}[{i}] needs a string 'check' and a finite number 'value'")
            extra = sorted(set(entry) - {"check", "value", "unit", "dtype", "device", "notes"})
            if extra or any(not isinstance(entry.get(k, ""), str) for k in ("unit", "dtype", "device", "notes")):
                raise error(f"{REPORT_NAME}: {section}[{i}] has unknown or non-string fields {extra}")
    _check_doctor_section(report.get("doctor"), error)
    round_trip = report.get("round_trip")
    if round_trip is not None and not (isinstance(round_trip, dict) and isinstance(round_trip.get("identical"), bool)):
        raise error(f"{REPORT_NAME}: round_trip needs a boolean 'identical'")
    return report


def _check_doctor_section(doctor, error: type[Exception]) -> None:
    if doctor is None:
        return
    if (
        not isinstance(doctor, dict)
        or doctor.get("status") not in STATUSES
        or not isinstance(doctor.get("checks"), list)
    ):
        raise error(f"{REPORT_NAME}: doctor needs a status and a list of checks")
    for i, entry in enumerate(doctor["checks"]):
        if (
            not isinstance(entry, dict)
            or entry.get("status") not in STATUSES
            or any(not isinstance(entry.get(k), str) for k in ("check", "detail", "fix"))
        ):
            raise error(f"{REPORT_NAME}: doctor.checks[{i}] needs string check, status, detail and fix")
