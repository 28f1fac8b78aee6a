"""Report: the ledger's output as plain data — sections of rows with a one-line "why" each.

Owns: the `Report` / `Section` / `Column` dataclasses every formatter (text, markdown, JSON, plots)
reads, and their dict form (the `--json` schema, documented in docs/LEDGER.md). Values are SI base
units (bytes, seconds, FLOP, tokens); a column's `unit` says which, so formatting stays a separate
layer. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA = "dsaserve.ledger/1"
ROW_UNIT = "*"  # a column whose unit is given per row, in the row's "unit" field


@dataclass
class Column:
    key: str
    header: str
    unit: str = ""  # "B", "s", "FLOP", "B/s", "FLOP/s", "tokens", "x", "%", "*" or "" (plain)

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "header": self.header, "unit": self.unit}


@dataclass
class Section:
    key: str
    title: str
    why: str
    columns: list[Column]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "why": self.why, "columns": [c.to_dict() for c in self.columns],
                "rows": [dict(r) for r in self.rows], "notes": list(self.notes)}

    @staticmethod
    def from_dict(key: str, d: dict[str, Any]) -> Section:
        return Section(key, d["title"], d["why"], [Column(**c) for c in d["columns"]], [dict(r) for r in d["rows"]],
                       list(d.get("notes", [])))

    def column(self, key: str) -> list[Any]:
        return [r.get(key) for r in self.rows]

    def row(self, **match: Any) -> dict[str, Any]:
        for r in self.rows:
            if all(r.get(k) == v for k, v in match.items()):
                return r
        raise KeyError(f"section {self.key}: no row with {match}")


@dataclass
class Report:
    conventions: dict[str, str]
    model: dict[str, Any]
    deployment: dict[str, Any]
    hardware: dict[str, Any]
    workload: dict[str, Any]
    assumptions: dict[str, Any]
    sections: list[Section]
    # what makes the plan impossible or wasteful, each {"code", "message", ...}: weights that do not fit
    # (sections_memory.memory_warnings, with "excess_bytes"), GPUs past whole replicas (Deployment.warnings)
    warnings: list[dict[str, Any]] = field(default_factory=list)

    def section(self, key: str) -> Section:
        for s in self.sections:
            if s.key == key:
                return s
        raise KeyError(f"report has no section {key!r} (has {', '.join(s.key for s in self.sections)})")

    def has(self, key: str) -> bool:
        return any(s.key == key for s in self.sections)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "conventions": dict(self.conventions), "model": dict(self.model),
                "deployment": dict(self.deployment), "hardware": dict(self.hardware),
                "workload": dict(self.workload), "assumptions": dict(self.assumptions),
                "warnings": [dict(w) for w in self.warnings], "sections": {s.key: s.to_dict() for s in self.sections}}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Report:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"ledger JSON: schema {d.get('schema')!r} is not {SCHEMA!r}")
        return Report(d["conventions"], d["model"], d["deployment"], d["hardware"], d["workload"],
                      d["assumptions"], [Section.from_dict(k, v) for k, v in d["sections"].items()],
                      [dict(w) for w in d.get("warnings", [])])
