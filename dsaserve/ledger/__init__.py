"""The ledger: note 001's and note 000's arithmetic as pure functions of (ModelConfig, Deployment, Hardware,
Workload, Assumptions) — predict every byte, FLOP and collective of a step, plan KV capacity, and reconcile
against the engine's counters (DESIGN.md "The ledger"; docs/LEDGER.md for keys and conventions).

Owns: the planning tool behind `dsaserve ledger`; no stage of the request path. Never imports torch nor the engine (the
engine run `--reconcile` needs is cli/reconcile_driver.py). Layout: units / hardware / deployment (inputs),
weights / kv / collective_plan / timeline / marginal / prefill / first_request (computations), notes_* (the
notes' figures), sections_* + build + report (dataclasses -> sections), render/ (text, markdown, JSON,
plots), reconcile (measured vs predicted; the engine run that feeds it is cli/reconcile_driver.py).

The names below are imported on first use (PEP 562): the engine's start-up reads only `ledger.kv` (the KV
pool's prediction in its manifest), and importing the whole report builder with it cost the scheduler ~80 ms.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SECTIONS", "Assumptions", "Deployment", "Hardware", "LedgerInputs", "PRESETS", "Report", "Section",
           "Workload", "build_report", "get_hardware"]


def __getattr__(name: str) -> Any:
    if name in ("SECTIONS", "build_report"):
        from dsaserve.ledger import build as module
    elif name in ("Assumptions", "Deployment", "Workload"):
        from dsaserve.ledger import deployment as module
    elif name in ("PRESETS", "Hardware", "get_hardware"):
        from dsaserve.ledger import hardware as module
    elif name == "LedgerInputs":
        from dsaserve.ledger import inputs as module
    elif name in ("Report", "Section"):
        from dsaserve.ledger import report as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
