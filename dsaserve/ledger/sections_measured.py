"""Report for `dsaserve ledger --measured RUN.json`: a GPU run's decode steps against the ledger's bound, and the
time model fitted to them (ledger/measured.py).

Owns: turning measured.py's rows and fit into a `Section` and wrapping it in a `Report` whose header describes
the run (model, layout, the copy rate it measured). Pure Python.
"""

from __future__ import annotations

import statistics

from dsaserve.ledger.build import model_summary
from dsaserve.ledger.deployment import Workload
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.measured import (
    RUN_ASSUMPTIONS,
    MeasuredRun,
    measured_rows,
    predict,
    predictions,
    run_hardware,
    step_bytes,
)
from dsaserve.ledger.report import Column, Report, Section
from dsaserve.ledger.units import CONVENTIONS


def measured_section(run: MeasuredRun, ask: tuple[int, int] | None = None) -> Section:
    """`ask`: (batch, context) of a step to price with the fitted model (the report's last note)."""
    rows = measured_rows(run)
    coef, fitted, loo = predictions(rows)
    out = []
    for r, f, lo in zip(rows, fitted, loo, strict=True):
        top = "weight read" if r["weights"] >= r["kv"] else "KV + indexer read"
        out.append({**{k: r[k] for k in ("batch", "context", "measured_s", "bound_s", "ratio", "ledger_bytes",
                                         "run_bytes")},
                    "fitted_s": f, "loo_s": lo, "loo_error": lo / r["measured_s"] - 1,
                    "why": f"bytes: {top} the larger; {r['measured_s'] - r['bound_s']:.2e} s past the bound"})
    errs = [abs(r["loo_error"]) for r in out]
    counted = [abs(r["ledger_bytes"] / r["run_bytes"] - 1) for r in out if r["run_bytes"]]
    fixed, per_w, per_kv, per_req = coef
    rate = lambda c: f"{1 / c / 1e12:.2f} TB/s" if c > 0 else "no cost fitted (the term left out)"  # noqa: E731
    cols = [Column("batch", "batch"), Column("context", "context", "tokens"), Column("measured_s", "measured", "s"),
            Column("bound_s", "ledger bound", "s"), Column("ratio", "measured / bound", "x"),
            Column("ledger_bytes", "ledger bytes", "B"), Column("run_bytes", "run's bytes", "B"),
            Column("fitted_s", "fitted", "s"), Column("loo_s", "fitted without the row", "s"),
            Column("loo_error", "its error", "%"), Column("why", "why")]
    return Section("measured_steps", f"Measured decode steps against the ledger: {run.path}",
                   f"{run.device}; bound = the ledger's HBM bytes / the run's copy rate "
                   f"{run.copy_bw / 1e12:.2f} TB/s; the measured step is the overlapped one where the run has it",
                   cols, out,
                   [f"time model (least squares relative to each step, every term >= 0): step = "
                    f"{fixed * 1e6:.1f} us + weight bytes at {rate(per_w)} + KV and indexer bytes at {rate(per_kv)} + "
                    f"{per_req * 1e6:.2f} us a request",
                    f"each row predicted from the others: median error {statistics.median(errs):.1%}, largest "
                    f"{max(errs):.1%} ({len(out)} rows)",
                    f"the ledger's bytes against the run's own count: largest difference {max(counted):.3%}" if counted
                    else "the run counted no bytes of its own", *_asked(run, coef, ask)])


def _asked(run: MeasuredRun, coef, ask: tuple[int, int] | None) -> list[str]:
    if ask is None:
        return []
    batch, context = ask
    weights, kv = step_bytes(run, batch, context)
    t, bound = predict(coef, weights, kv, batch), (weights + kv) / run.copy_bw
    return [f"batch {batch}, context {context:,} (--batch, --decode-context): the time model gives {t * 1e3:.3f} ms "
            f"a step, {t / bound:.2f}x its bound {bound * 1e3:.3f} ms"]


def measured_report(run: MeasuredRun, ask: tuple[int, int] | None = None) -> Report:
    hw = run_hardware(run)
    li = LedgerInputs(run.cfg, run.dep, hw, Workload(kv_layout=run.kv_layout), RUN_ASSUMPTIONS)
    return Report(dict(CONVENTIONS), model_summary(li), run.dep.to_dict(), hw.to_dict() | {"name": "measured run"},
                  li.work.to_dict(), li.asm.to_dict(), [measured_section(run, ask)])
