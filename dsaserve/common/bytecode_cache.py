"""Python's bytecode, cached where it can be written: `enable()`, called by `dsaserve` first thing.

Owns: the decision, for this process and the processes it starts, of where compiled modules (`.pyc`) are read and
written. In place (`__pycache__` beside each source, Python's default) when the installed packages' directories are
writable and writing is allowed; else under `<dsaserve cache>/pycache` (Python's own `PYTHONPYCACHEPREFIX`
mechanism), so the second start of the same install reads what the first compiled. `DSASERVE_PYCACHE=0` leaves
Python's defaults alone.

Why (issue 16: "compile caches reused across restarts"): on the H200 machine's image torch's package carries no
bytecode and cannot be written, so every process compiled ~940 modules from source on every start: 1.95 s of a
6.5 s warm start in the scheduler alone (cProfile, bench/startup_cold_warm.py's warm_profiled), and the HTTP
process and the detokenizer paid the same for their own imports. Container images are often built that way
(read-only packages, PYTHONDONTWRITEBYTECODE=1, set to keep the image small). Writing under the user's cache
directory changes no installed file; when this moves the cache it also lets Python write there despite
PYTHONDONTWRITEBYTECODE. Standard library only: it runs before any heavy import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from dsaserve.common import envs

_report: dict[str, Any] = {"status": "not run"}
# the packages whose imports dominate a start (torch alone ~4 s from source): where their bytecode would go decides
PROBES = ("torch", "dsaserve")


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _writable_in_place(package: Path) -> bool:
    """Whether Python could keep this package's bytecode beside its sources (its __pycache__, or the directory
    that would hold one, writable)."""
    cache = package / "__pycache__"
    return os.access(cache if cache.is_dir() else package, os.W_OK)


def enable() -> dict[str, Any]:
    """Decide (once per process; the children inherit the environment it sets) and return what was done."""
    _report.clear()
    if not envs.DSASERVE_PYCACHE:
        _report.update(status="off")
    elif sys.pycache_prefix:
        _report.update(status="prefix set", dir=sys.pycache_prefix)
    else:
        dirs = [d for d in map(_package_dir, PROBES) if d is not None]
        if not sys.dont_write_bytecode and all(_writable_in_place(d) for d in dirs):
            _report.update(status="in place")
        else:
            prefix = envs.cache_root() / "pycache"
            try:
                prefix.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                _report.update(status="not cached", error=f"{type(e).__name__}: {e}"[:200])
                return dict(_report)
            why = "writing disabled" if sys.dont_write_bytecode else "packages not writable"
            sys.pycache_prefix, sys.dont_write_bytecode = str(prefix), False
            os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)  # the children read it when their interpreter starts
            os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
            _report.update(status="cached", dir=str(prefix), why=why)
    return dict(_report)


def report() -> dict[str, Any]:
    return dict(_report)
