"""Report section "notes_check": every figure of the two design notes next to the ledger's value.

Owns: turning note_catalogue.note_figures() into a `Section` (the note's text, the ledger's value in the same
unit, agrees/differs, and the reason). Pure Python.
"""

from __future__ import annotations

from dsaserve.ledger.note_catalogue import note_figures
from dsaserve.ledger.notes import UNITS, Figure
from dsaserve.ledger.report import Column, Section


def _row(f: Figure) -> dict[str, object]:
    scale = UNITS[f.unit]
    reason = f.reason
    if f.default is not None:
        reason = (reason + "; " if reason else "") + (f"ledger default {f.default / scale:.4g} {f.unit}: "
                                                      f"{f.default_why}")
    elif f.default_why:
        reason = (reason + "; " if reason else "") + f.default_why
    return {"id": f.id, "note": f.note, "where": f.where, "quantity": f.quantity, "note_value": f.note_text,
            "ledger_value": round(f.ledger / scale, 6), "unit": f.unit, "status": f.status,
            "ledger_si": f.ledger, "default_si": f.default, "why": reason}


def notes_check(figures: list[Figure] | None = None) -> Section:
    figs = figures if figures is not None else note_figures()
    differs = sum(not f.agrees for f in figs)
    cols = [Column("id", "id"), Column("quantity", "quantity"), Column("note_value", "note"),
            Column("ledger_value", "ledger"), Column("unit", "unit"), Column("status", "status"),
            Column("why", "why they differ / remark")]
    return Section("notes_check", "The notes' figures against the ledger (GLM-5.3, the notes' stated inputs)",
                   f"{len(figs)} figures, {len(figs) - differs} agree, {differs} differ",
                   cols, [_row(f) for f in figs],
                   ["inputs as the notes state them: H200 141 GB / 4.8 TB/s, NVLink 787 GB/s effective on "
                    "message bytes, IB 25 GB/s, TP8 layer-split KV, mem_fraction_static 0.85, every expert touched"])
