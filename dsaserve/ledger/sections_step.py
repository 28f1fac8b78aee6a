"""Report sections about one decode step: the ten-stage timeline, the operator list, the collective
table (pure TP, DP-attention + EP, PD), bytes -> time at b=1 and b=256, the worked step, and the
marginal cost per token against batch and context with the switch points.

Owns: turning timeline.py / collective_plan.py / marginal.py results into `Section`s. Request-path stages
described: 1-10 (timeline), 5-8 (collectives, step). Pure Python.
"""

from __future__ import annotations

from dataclasses import replace

from dsaserve.ledger.collective_plan import (
    CollectiveRow,
    a2a_tokens,
    hidden_reduction_rows,
    pd_transfer_bytes,
    row_time,
    step_plan,
    transfer_time,
)
from dsaserve.ledger.deployment import Deployment
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.marginal import MarginalPoint, marginal, switch_points
from dsaserve.ledger.report import ROW_UNIT, Column, Section
from dsaserve.ledger.timeline import STAGES, decode_launches, operator_list
from dsaserve.ledger.units import K_TOKENS

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def timeline(li: LedgerInputs) -> Section:
    plan = step_plan(li.cfg, li.dep, li.asm, li.work.batch)
    by_stage = {5: [r for r in plan if r.point.startswith("embedding")],
                8: [r for r in plan if r.point.startswith("vocab")]}
    by_stage[6] = [r for r in plan if r not in by_stage[5] + by_stage[8]]
    rows = [{"no": s.no, "stage": s.name, "side": s.side, "module": s.module,
             "decode_calls": sum(r.calls for r in by_stage.get(s.no, [])),
             "decode_bytes": sum(r.total_message for r in by_stage.get(s.no, [])),
             "why": s.work + (f" | {s.collective}" if s.collective else "")} for s in STAGES]
    cols = [Column("no", "#"), Column("stage", "stage"), Column("side", "runs on"), Column("module", "dsaserve"),
            Column("decode_calls", "collectives/step"), Column("decode_bytes", "message bytes/step", "B"),
            Column("why", "what happens")]
    return Section("timeline", "One request, ten stages", f"collectives at batch {li.work.batch}, "
                   f"{li.dep.topology}; stages 1-4 and 10 are CPU time, measured per step in us", cols, rows)


def operators(li: LedgerInputs) -> Section:
    ops = operator_list(li.cfg, li.dep, li.asm)
    rows = [{"no": o.no, "operator": o.name, "decode": o.decode, "prefill": o.prefill, "fusion": o.fusion,
             "why": o.why} for o in ops]
    launches = decode_launches(ops, li.asm)
    return Section("operators", "Operators per forward: decode vs prefill", "counts per forward from the config",
                   [Column("no", "#"), Column("operator", "operator"), Column("decode", "per decode step"),
                    Column("prefill", "per prefill chunk"), Column("fusion", "fusion"), Column("why", "why")], rows,
                   [f"eager kernel launches per decode step: {launches:,.0f} (kernels_per_op {li.asm.kernels_per_op})"])


def _coll_row(topology: str, r: CollectiveRow, per_token: float, li: LedgerInputs) -> dict[str, object]:
    return {"topology": topology, "point": r.point, "kind": r.kind, "calls": r.calls, "per_token": per_token,
            "message": r.message_bytes, "total_message": r.total_message, "wire": r.wire_bytes,
            "nvlink_s": row_time(r, li.hw, li.asm, "nvlink"), "ib_s": row_time(r, li.hw, li.asm, "ib"), "why": r.why}


def _plans(li: LedgerInputs) -> dict[str, Deployment]:
    ep = li.dep.ep if li.dep.ep > 1 else li.dep.tp
    return {f"TP{li.dep.tp}": Deployment(tp=li.dep.tp),
            f"DP-attention{li.dep.tp}+EP{ep}": Deployment(tp=li.dep.tp, ep=ep, dp_attention=True)}


def collectives(li: LedgerInputs) -> Section:
    b, rows = li.work.batch, []
    for name, dep in _plans(li).items():
        plan, unit = step_plan(li.cfg, dep, li.asm, b), step_plan(li.cfg, dep, li.asm, 1)
        for r, u in zip(plan, unit, strict=True):
            rows.append(_coll_row(name, r, u.message_bytes, li))
        red = hidden_reduction_rows(plan)
        rows.append({"topology": name, "point": "total", "kind": "", "calls": sum(r.calls for r in plan),
                     "per_token": sum(u.total_message for u in unit), "message": None,
                     "total_message": sum(r.total_message for r in plan), "wire": sum(r.wire_bytes for r in plan),
                     "nvlink_s": sum(row_time(r, li.hw, li.asm) for r in plan),
                     "ib_s": sum(row_time(r, li.hw, li.asm, "ib") for r in plan),
                     "why": f"hidden-size reductions alone: {sum(r.calls for r in red)} calls, "
                            f"{sum(r.total_message for r in red) / 1e6:,.1f} MB"})
    pd = pd_transfer_bytes(li.kv.main, li.kv.indexer, li.work.context)
    rows.append({"topology": "PD", "point": "KV + indexer handoff per request", "kind": "transfer", "calls": 1,
                 "per_token": li.kv.total, "message": pd, "total_message": pd, "wire": pd,
                 "nvlink_s": transfer_time(pd, li.hw.nvlink_bw, li.dep.n_gpus),
                 "ib_s": transfer_time(pd, li.hw.ib_bw, li.dep.n_gpus),
                 "why": f"once per request of {li.work.context:,} tokens: d x L x {li.kv.kv_layers} + "
                        f"{li.kv.indexer_per_layer} x L x {li.kv.indexer_layers}, over {li.dep.n_gpus} links"})
    cols = [Column("topology", "topology"), Column("point", "where"), Column("kind", "kind"),
            Column("calls", "calls"), Column("per_token", "bytes/call at b=1", "B"),
            Column("message", f"bytes/call at b={b}", "B"), Column("total_message", "message total", "B"),
            Column("wire", "sent per rank", "B"), Column("nvlink_s", "NVLink", "s"), Column("ib_s", "IB", "s"),
            Column("why", "why")]
    return Section("collectives", f"Collectives of one decode step (b = {b})",
                   f"times = bytes / link + calls x overhead ({li.asm.comm_basis} basis)", cols, rows)


def bytes_to_time(li: LedgerInputs) -> Section:
    plans, rows = _plans(li), []
    tp_name, dp_name = list(plans)
    cases = [(f"b=1 {tp_name} reductions", hidden_reduction_rows(step_plan(li.cfg, plans[tp_name], li.asm, 1))),
             (f"b=256 {tp_name} reductions", hidden_reduction_rows(step_plan(li.cfg, plans[tp_name], li.asm, 256))),
             (f"b=256 {dp_name} dispatch + combine, one layer, one rank's "
              f"{a2a_tokens(plans[dp_name], li.asm, 256)} tokens",
              [replace(r, calls=1) for r in step_plan(li.cfg, plans[dp_name], li.asm, 256) if r.kind == "all_to_all"])]
    for name, rs in cases:
        calls = sum(r.calls for r in rs)
        bw_only = replace(li.hw, nvlink_overhead_s=0.0, ib_overhead_s=0.0)
        rows.append({"case": name, "calls": calls, "message": sum(r.total_message for r in rs),
                     "wire": sum(r.wire_bytes for r in rs),
                     "nvlink_bytes_s": sum(row_time(r, bw_only, li.asm) for r in rs),
                     "nvlink_s": sum(row_time(r, li.hw, li.asm) for r in rs),
                     "ib_bytes_s": sum(row_time(r, bw_only, li.asm, "ib") for r in rs),
                     "ib_s": sum(row_time(r, li.hw, li.asm, "ib") for r in rs),
                     "why": f"{calls} calls x {li.hw.nvlink_overhead_s * 1e6:g} us (NVLink) / "
                            f"{li.hw.ib_overhead_s * 1e6:g} us (IB) fixed cost"})
    cols = [Column("case", "case"), Column("calls", "calls"), Column("message", "message", "B"),
            Column("wire", "sent per rank", "B"), Column("nvlink_bytes_s", "NVLink bytes only", "s"),
            Column("nvlink_s", "NVLink + overhead", "s"), Column("ib_bytes_s", "IB bytes only", "s"),
            Column("ib_s", "IB + overhead", "s"), Column("why", "why")]
    return Section("bytes_to_time", "From bytes to time: b=1 and b=256",
                   "small batches pay the per-call overhead, large ones the bytes", cols, rows)


def decode_step(li: LedgerInputs) -> Section:
    st = li.step(li.work.batch, li.work.decode_context)
    rows = [{"term": t.name, "bytes": t.bytes, "calls": t.calls, "time_s": t.time_s,
             "share": t.time_s / st.serial_s if st.serial_s else 0.0, "why": t.why} for t in st.terms]
    rows.append({"term": "step (serial sum)", "bytes": sum(t.bytes for t in st.terms), "calls": None,
                 "time_s": st.serial_s, "share": 1.0, "why": "every term one after another"})
    rows.append({"term": "step (perfect overlap)", "bytes": None, "calls": None, "time_s": st.overlapped_s,
                 "share": st.overlapped_s / st.serial_s if st.serial_s else 0.0,
                 "why": "HBM terms add; collectives hide under them"})
    cols = [Column("term", "term"), Column("bytes", "bytes per GPU", "B"), Column("calls", "calls"),
            Column("time_s", "time", "s"), Column("share", "share", "%"), Column("why", "why")]
    return Section("decode_step", f"Worked decode step: batch {st.batch}, context {st.context:,}",
                   f"{li.dep.topology} on {li.hw.name}; {st.requests_per_gpu} requests per GPU; "
                   f"{st.experts_touched:.0%} of experts touched ({li.asm.expert_routing} routing)", cols, rows)


def _marginal_row(m: MarginalPoint, x_key: str) -> dict[str, object]:
    parts = {"communication": m.comm_s, "weight read": m.weights_s, "KV + indexer read": m.kv_s}
    top = max(parts, key=parts.get)
    return {x_key: m.batch if x_key == "batch" else m.context, "comm_s": m.comm_s, "weights_s": m.weights_s,
            "kv_s": m.kv_s, "step_s": m.step_s, "why": f"largest: {top}"}


def _marginal_cols(x_key: str, unit: str) -> list[Column]:
    return [Column(x_key, x_key, unit), Column("comm_s", "communication/token", "s"),
            Column("weights_s", "weight read/token", "s"), Column("kv_s", "KV + indexer/token", "s"),
            Column("step_s", "step (serial)", "s"), Column("why", "why")]


def contexts(li: LedgerInputs) -> list[int]:
    out, c = [], 4 * K_TOKENS
    while c <= max(li.work.context, li.work.decode_context):
        out.append(c)
        c *= 2
    return out


def marginal_vs_batch(li: LedgerInputs) -> Section:
    rows = [_marginal_row(marginal(li.step(b, li.work.decode_context)), "batch") for b in BATCHES]
    return Section("marginal_vs_batch", f"Marginal cost per token against batch (context {li.work.decode_context:,})",
                   "only the weight read amortises over the batch", _marginal_cols("batch", ""), rows)


def marginal_vs_context(li: LedgerInputs) -> Section:
    rows = [_marginal_row(marginal(li.step(li.work.batch, c)), "context") for c in contexts(li)]
    return Section("marginal_vs_context", f"Marginal cost per token against context (batch {li.work.batch})",
                   "only the indexer read grows with context", _marginal_cols("context", "tokens"), rows)


def switch_point_section(li: LedgerInputs) -> Section:
    pts = switch_points(li.step, li.work.batch, li.work.decode_context)
    rows = [{"switch": p.name, "value": p.value, "unit": p.unit if p.value is not None else "", "why": p.why}
            for p in pts]
    return Section("switch_points", "Where one ledger overtakes another", "None = not within batch 8192 / 16M tokens",
                   [Column("switch", "switch"), Column("value", "at", ROW_UNIT), Column("why", "why")], rows)
