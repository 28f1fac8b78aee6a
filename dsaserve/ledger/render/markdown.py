"""Markdown for a ledger `Report` (`dsaserve ledger --markdown`): a heading and a GitHub table per section.

Owns: escaping and layout only; values are formatted by render.fmt_value like the text tables. Pure Python.
"""

from __future__ import annotations

from dsaserve.ledger.render import cell
from dsaserve.ledger.report import Report, Section


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def md_table(sec: Section) -> str:
    head = "| " + " | ".join(_esc(c.header) for c in sec.columns) + " |"
    rule = "|" + "|".join(" ---: " if c.unit and c.key != "why" else " --- " for c in sec.columns) + "|"
    rows = ["| " + " | ".join(_esc(cell(r, c)) for c in sec.columns) + " |" for r in sec.rows]
    return "\n".join([head, rule, *rows])


def render_markdown(report: Report) -> str:
    d, m, h = report.deployment, report.model, report.hardware
    out = [f"# dsaserve ledger: {m['name']} on {d['topology']} ({h['name']})", "",
           *(f"> **Warning:** {_esc(w['message'])}\n" for w in report.warnings),
           "**Conventions.** " + " ".join(f"{k}: {v}." for k, v in report.conventions.items()), ""]
    for sec in report.sections:
        out += [f"## {sec.title}", "", f"_{_esc(sec.why)}_", "", md_table(sec), ""]
        out += [f"> {_esc(n)}" for n in sec.notes] + ([""] if sec.notes else [])
    return "\n".join(out)
