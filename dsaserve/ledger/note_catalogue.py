"""The notes' figures, both catalogues together: `note_figures()`.

Owns: evaluating `notes_001.py` and `notes_000.py` under one `NoteContext` and refusing duplicate figure ids.
It sits above the catalogues (which import `notes.py` for `Figure` and the notes' inputs), so the three
import in one direction. Pure Python.
"""

from __future__ import annotations

from dsaserve.ledger import notes_000, notes_001
from dsaserve.ledger.notes import Figure, NoteContext


def note_figures(ctx: NoteContext | None = None) -> list[Figure]:
    ctx = ctx or NoteContext()
    figs = notes_001.figures(ctx) + notes_000.figures(ctx)
    ids = [f.id for f in figs]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise AssertionError(f"duplicate figure ids: {sorted(dupes)}")
    return figs
