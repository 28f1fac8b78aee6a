"""Aligned text tables for a ledger `Report` (the default output of `dsaserve ledger`).

Owns: the header block (conventions, model, deployment, hardware, the assumptions that differ from the
defaults) and one aligned table per section; numbers right-aligned, text left. Pure Python.
"""

from __future__ import annotations

from dsaserve.ledger.deployment import Assumptions
from dsaserve.ledger.render import cell
from dsaserve.ledger.report import Report, Section


def _is_numeric(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def table(sec: Section) -> str:
    cells = [[cell(r, c) for c in sec.columns] for r in sec.rows]
    heads = [c.header for c in sec.columns]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    right = [any(_is_numeric(r.get(c.key)) for r in sec.rows) and c.key != "why" for c in sec.columns]
    last = len(heads) - 1

    def line(vals: list[str]) -> str:
        out = [v.rjust(w) if right[i] else (v if i == last else v.ljust(w))
               for i, (v, w) in enumerate(zip(vals, widths, strict=True))]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    body = [line(heads), rule] + [line(r) for r in cells]
    return "\n".join(body)


def _hw_line(h: dict) -> str:
    if not h.get("hbm_bytes"):
        return f"{h['name']} (no hardware model: a measured run)"
    return (f"{h['name']}: {h['hbm_bytes'] / 1e9:.1f} GB HBM at {h['hbm_bw'] / 1e12:g} TB/s, "
            f"{h['fp8_flops'] / 1e12:g} TFLOP/s FP8 dense, NVLink {h['nvlink_bw'] / 1e9:g} GB/s/dir, "
            f"IB {h['ib_bw'] / 1e9:g} GB/s/dir")


def header(report: Report) -> str:
    d, h, m = report.deployment, report.hardware, report.model
    defaults = Assumptions().to_dict()
    changed = {k: v for k, v in report.assumptions.items() if not k.startswith("_") and defaults.get(k) != v}
    lines = ["dsaserve ledger", "=" * 15,
             f"model      {m['name']} ({m['model_type']}): {m['num_hidden_layers']} layers "
             f"({m['full_indexer_layers']} full), {m['n_routed_experts']} experts / {m['num_experts_per_tok']}",
             f"deployment {d['topology']}",
             "hardware   " + _hw_line(h),
             "workload   " + ", ".join(f"{k}={v}" for k, v in report.workload.items()),
             "assumed    " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "all defaults") +
             " (docs/LEDGER.md lists every assumption)",
             *(f"warning    {w['message']}" for w in report.warnings), "", "conventions:"]
    lines += [f"  {k:11s} {v}" for k, v in report.conventions.items()]
    return "\n".join(lines)


def render_text(report: Report) -> str:
    parts = [header(report)]
    for sec in report.sections:
        title = f"[{sec.key}] {sec.title}"
        parts.append("\n".join([title, "-" * len(title), f"why: {sec.why}", table(sec)]
                               + [f"note: {n}" for n in sec.notes]))
    return "\n\n".join(parts) + "\n"
