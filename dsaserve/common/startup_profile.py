"""`profiled(name)`: a block of a process's start-up under cProfile when DSASERVE_STARTUP_PROFILE names a directory.

Owns: the switch's effect: `<dir>/<name>.prof` (pstats, for snakeviz or `python -m pstats`) and `<dir>/<name>.txt`
(the top functions by cumulative and by own time) written when the block ends, whether it ended well or not.

Why: the manifest's phases say which step of a start was slow; this says which Python inside it. cProfile sees the
main thread only (the early CUDA context and Triton's key hash run on threads), and it slows Python-heavy phases by
roughly 1.5-2x, so a profiled start's times are not the start's times. Standard library only.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

from dsaserve.common import envs

TOP = 60  # functions listed per ordering in the text summary


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    where = envs.DSASERVE_STARTUP_PROFILE
    if not where:
        yield
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        out = Path(where)
        out.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(out / f"{name}.prof")
        text = io.StringIO()
        for order in ("cumulative", "tottime"):
            text.write(f"==== by {order} ====\n")
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(TOP)
        (out / f"{name}.txt").write_text(text.getvalue())
