"""Report for `dsaserve ledger --reconcile`: predicted vs measured per term of one run.

Owns: turning reconcile.ReconcileRow lists into a `Section` and wrapping it in a `Report` whose header
describes the run (model, deployment, workload). Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict

from dsaserve.ledger.deployment import Assumptions
from dsaserve.ledger.reconcile import ReconcileRow, RunRecord
from dsaserve.ledger.report import Column, Report, Section
from dsaserve.ledger.units import CONVENTIONS


def _unit(term: str) -> str:
    return "B" if "bytes" in term else ""


def reconcile_section(rows: list[ReconcileRow]) -> Section:
    out = [{"term": r.term, "predicted": r.predicted, "measured": r.measured, "ratio": r.ratio,
            "tolerance": r.tolerance, "ok": r.ok, "unit": _unit(r.term), "why": r.why} for r in rows]
    bad = [r.term for r in rows if r.ok is False]
    cols = [Column("term", "term"), Column("predicted", "predicted", "*"), Column("measured", "measured", "*"),
            Column("ratio", "measured/predicted", "x"), Column("tolerance", "accepted"), Column("ok", "ok"),
            Column("why", "why")]
    return Section("reconcile", "Predicted vs measured", "counts exact; bytes exact or within the stated range",
                   cols, out, [f"{len(rows) - len(bad)} of {len(rows)} terms ok" + (f"; off: {', '.join(bad)}"
                                                                                    if bad else "")])


def reconcile_report(run: RunRecord) -> Report:
    cfg = run.model()
    s = run.shape
    model = {"name": run.config, "model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
             "num_hidden_layers": cfg.num_hidden_layers, "full_indexer_layers": len(cfg.full_indexer_layers),
             "moe_layers": len(cfg.moe_layers), "n_routed_experts": cfg.n_routed_experts,
             "num_experts_per_tok": cfg.num_experts_per_tok, "vocab_size": cfg.vocab_size}
    dep = {"tp": s.tp, "ep": s.ep, "dp_attention": s.dp_attention, "pd": False, "n_gpus": s.tp,
           "topology": f"measured run, TP{s.tp}" + (f"+EP{s.ep}" if s.ep > 1 else "")}
    hw = {"name": "measured", "hbm_bytes": 0.0, "hbm_bw": 0.0, "bf16_flops": 0.0, "fp8_flops": 0.0,
          "nvlink_bw": 0.0, "ib_bw": 0.0, "nvlink_overhead_s": 0.0, "ib_overhead_s": 0.0, "sources": {}}
    work = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()}
    return Report(dict(CONVENTIONS), model, dep, hw, work, Assumptions().to_dict(),
                  [reconcile_section(run.rows())])
