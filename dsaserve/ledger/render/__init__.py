"""Formatting layer of the ledger: one `Report` -> aligned text, markdown, JSON or PNG plots.

Owns: nothing numeric — only how a value with a unit is written (`fmt_value`). Pure Python; the plot
module imports matplotlib (Agg) only when called.
"""

from __future__ import annotations

import json
from typing import Any

from dsaserve.ledger.report import ROW_UNIT, Column, Report

_PREFIX = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]
PLAIN_UNITS = ("", "batch", "requests", "pages", "calls", "launches")


def _sig(v: float, digits: int = 4) -> str:
    s = f"{v:.{digits}g}"
    if "e" in s:
        return f"{v:,.0f}"
    return s


def _scaled(v: float, unit: str) -> str:
    for scale, p in _PREFIX:
        if abs(v) >= scale:
            return f"{_sig(v / scale)} {p}{unit}"
    return f"{_sig(v)} {unit}"


def fmt_value(v: Any, unit: str) -> str:
    """Human form of an SI value: bytes decimal (GB = 1e9), seconds in s/ms/us, FLOP with P/T/G prefixes."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if not isinstance(v, int | float):
        return str(v)
    if unit == "B":
        return _scaled(v, "B")
    if unit == "s":
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(v) >= scale:
                return f"{_sig(v / scale)} {name}"
        return "0 s" if v == 0 else f"{_sig(v / 1e-9)} ns"
    if unit in ("FLOP", "B/s", "FLOP/s"):
        return _scaled(v, unit)
    if unit == "params":
        return f"{_sig(v / 1e9)} G params" if abs(v) >= 1e9 else f"{_sig(v / 1e6)} M params"
    if unit == "%":
        return f"{v * 100:.3g} %"
    if unit == "x":
        return f"{_sig(v, 3)}x"
    if unit == "tokens" or (unit in PLAIN_UNITS and isinstance(v, int)):
        return f"{v:,}" + ("" if unit in ("", "tokens") else f" {unit}")
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return f"{int(v):,}" + (f" {unit}" if unit not in ("", "tokens") else "")
    return _sig(v) + (f" {unit}" if unit else "")


def cell(row: dict[str, Any], col: Column) -> str:
    unit = row.get("unit", "") if col.unit == ROW_UNIT else col.unit
    return fmt_value(row.get(col.key), unit or "")


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=1, ensure_ascii=False)
