"""The ledger: note 001's and note 000's arithmetic as pure functions of (ModelConfig, Deployment, Hardware,
Workload, Assumptions) — predict every byte, FLOP and collective of a step, plan KV capacity, and reconcile
against the engine's counters (DESIGN.md "The ledger"; docs/LEDGER.md for keys and conventions).

Owns: the planning tool behind `dsaserve ledger`; no stage of the request path. Never imports torch nor the engine (the
engine run `--reconcile` needs is cli/reconcile_driver.py). Layout: units / hardware / deployment (inputs),
weights / kv / collective_plan / timeline / marginal / prefill / first_request (computations), notes_* (the
notes' figures), sections_* + build + report (dataclasses -> sections), render/ (text, markdown, JSON,
plots), reconcile (measured vs predicted; the engine run that feeds it is cli/reconcile_driver.py).
"""

from __future__ import annotations

from dsaserve.ledger.build import SECTIONS, build_report
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import PRESETS, Hardware, get_hardware
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.report import Report, Section

__all__ = ["SECTIONS", "Assumptions", "Deployment", "Hardware", "LedgerInputs", "PRESETS", "Report", "Section",
           "Workload", "build_report", "get_hardware"]
