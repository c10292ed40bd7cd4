"""The doctor's result: one `Check` per question, the printed table, the exit status and the JSON report.

A check has a dotted name (`config.rope`, `loading.trl`, `numerics.packed_vs_per_document`, ...), a status and, for
anything but PASS, a one-line fix. SKIP means the check could not run because something it needs failed or is
absent (the failing check says why); it is not a failure by itself. Measured numbers travel next to the checks in
the model-card report's `parity` format (`{check, value, unit, dtype, device, notes}`), so `--json` writes a
`qwen35_packed_report.json` that `hub_upload.py` renders.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..report_schema import FAIL, PASS, REPORT_SCHEMA, SKIP, STATUSES, WARN, read_report_file
from .folder import DoctorError


@dataclass
class Check:
    check: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")
        if self.status in (WARN, FAIL) and not self.fix:
            raise ValueError(f"{self.check}: a {self.status} needs a fix")


@dataclass
class Measurement:
    """One measured number, in the model-card report's parity entry format."""

    check: str
    value: float
    unit: str
    dtype: str
    device: str
    notes: str


@dataclass
class DoctorReport:
    model_dir: str
    device: str
    checks: list[Check] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)

    def add(self, check: str, status: str, detail: str, fix: str = "") -> Check:
        entry = Check(check, status, detail, fix)
        self.checks.append(entry)
        return entry

    def status(self, name: str) -> str | None:
        return next((c.status for c in self.checks if c.check == name), None)

    @property
    def overall(self) -> str:
        found = {c.status for c in self.checks}
        return FAIL if FAIL in found else WARN if WARN in found else PASS

    @property
    def exit_code(self) -> int:
        return 1 if self.overall == FAIL else 0

    def lines(self) -> list[str]:
        width = max([len(c.check) for c in self.checks] + [5])
        out = [f"qwen35-packed doctor {self.model_dir} (device {self.device})", ""]
        out.append(f"{'check'.ljust(width)}  status  detail")
        for c in self.checks:
            out.append(f"{c.check.ljust(width)}  {c.status.ljust(6)}  {c.detail}")
            if c.fix and c.status != PASS:
                out.append(f"{''.ljust(width)}  {''.ljust(6)}  fix: {c.fix}")
        counts = {s: sum(c.status == s for c in self.checks) for s in STATUSES}
        out += ["", f"{self.overall}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
        return out

    def doctor_section(self) -> dict:
        """The `doctor` section of the model-card report (schema in qwen35_packed/report_schema.py)."""
        return {"status": self.overall, "device": self.device, "versions": dict(self.versions),
                "checks": [asdict(c) for c in self.checks]}  # fmt: skip

    def write_json(self, path) -> Path:
        """Write this run into a model-card report at `path`: an existing report keeps its other sections; the
        doctor section and the parity entries of earlier doctor runs (checks named `numerics.*`) are replaced; a
        malformed existing report raises DoctorError."""
        path = Path(path)
        report = read_report_file(path, DoctorError) if path.is_file() else {"schema": REPORT_SCHEMA}
        report["doctor"] = self.doctor_section()
        kept = [e for e in report.get("parity", []) if not e["check"].startswith("numerics.")]
        report["parity"] = kept + [asdict(m) for m in self.measurements]
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        return path


__all__ = ["FAIL", "PASS", "SKIP", "STATUSES", "WARN", "Check", "DoctorReport", "Measurement"]
