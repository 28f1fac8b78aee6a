"""Report sections about a long request: the chunked prefill (per chunk and totals), the PD handoff,
and the first request after deployment (steady time + cold paths).

Owns: turning prefill.py / collective_plan.py / first_request.py results into `Section`s. Request-path
stages: 3 + 6 (chunked prefill), PD handoff between instances; startup chain: warmup / graph capture
coverage (first request). Pure Python.
"""

from __future__ import annotations

from dsaserve.common.causal import (
    STAGED_KV_LORA,
    STAGED_LAYOUT,
    STAGING_MIN_TOKENS,
    STAGING_ROWS_PER_TOKEN,
    staged_row_bytes,
    stages_latent,
)
from dsaserve.ledger.collective_plan import pd_transfer_bytes, transfer_time
from dsaserve.ledger.first_request import first_request as first_request_model
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.prefill import Prefill
from dsaserve.ledger.report import ROW_UNIT, Column, Section
from dsaserve.ledger.timeline import decode_launches, operator_list

QTY = [Column("quantity", "quantity"), Column("value", "value", ROW_UNIT), Column("why", "why")]


def _q(quantity: str, value: object, unit: str, why: str) -> dict[str, object]:
    return {"quantity": quantity, "value": value, "unit": unit, "why": why}


def _bound(c) -> str:
    parts = {"compute": c.compute_s, "memory": c.memory_s, "collectives": c.comm_s}
    return max(parts, key=parts.get) + "-bound"


def prefill_chunks(li: LedgerInputs, p: Prefill) -> Section:
    rows = [{"chunk": c.index, "prefix": c.prefix, "tokens": c.tokens, "gemm_flops": c.gemm_flops + c.attn_flops,
             "indexer_flops": c.indexer_flops, "indexer_read": c.indexer_read, "kv_write": c.kv_write + c.indexer_write,
             "kv_read": c.kv_read, "kv_staged": c.kv_staged, "collective_calls": c.collective_calls,
             "collective_bytes": c.collective_bytes,
             "compute_s": c.compute_s, "memory_s": c.memory_s, "comm_s": c.comm_s, "lower_bound_s": c.lower_bound_s,
             "why": _bound(c)} for c in p.chunks]
    cols = [Column("chunk", "#"), Column("prefix", "prefix", "tokens"), Column("tokens", "tokens", "tokens"),
            Column("gemm_flops", "GEMM + attention", "FLOP"), Column("indexer_flops", "indexer", "FLOP"),
            Column("indexer_read", "indexer K read", "B"), Column("kv_write", "KV write", "B"),
            Column("kv_read", "KV gathered", "B"), Column("kv_staged", "staged", "B"),
            Column("collective_calls", "collectives"), Column("collective_bytes", "sent per rank", "B"),
            Column("compute_s", "compute", "s"), Column("memory_s", "HBM", "s"), Column("comm_s", "comm", "s"),
            Column("lower_bound_s", "lower bound", "s"), Column("why", "why")]
    return Section("prefill_chunks", f"Chunked prefill of {p.context:,} tokens in chunks of {p.chunk:,}",
                   "only the indexer terms grow with the prefix: later chunks cost more", cols, rows,
                   [f"indexer q-tile {li.asm.indexer_q_tile}: one key read serves that many queries; "
                    f"{'spread over all GPUs' if li.asm.indexer_split else 'every rank scores every query'}",
                    "KV gathered: sparse MLA's top-k rows (bf16 in a staged chunk); staged: the prefill staging's "
                    "read + bf16 write of the request's pages (0: the chunk reads the cache)"])


def prefill_totals(li: LedgerInputs, p: Prefill) -> Section:
    hw, a, n = li.hw, li.asm, li.dep.n_gpus
    flops = p.total("gemm_flops") + p.total("attn_flops") + p.total("indexer_flops")
    rows = [
        _q("chunks", len(p.chunks), "", f"ceil({p.context:,} / {p.chunk:,})"),
        _q("GEMM FLOPs", p.total("gemm_flops"), "FLOP", "2 x GEMM params per token x tokens (+ lm_head once)"),
        _q("sparse-MLA FLOPs", p.total("attn_flops"), "FLOP",
           "2 x heads x (latent + kv_lora) x top-k slots x layers, absorbed MLA"),
        _q("indexer FLOPs", p.total("indexer_flops"), "FLOP",
           "causal pairs x 2 x index heads x index dim x full layers"),
        _q("all FLOPs", flops, "FLOP", "sum"),
        _q("indexer K read", p.total("indexer_read"), "B",
           f"causal pairs x indexer bytes / q-tile {a.indexer_q_tile}"),
        _q("main KV written", p.total("kv_write"), "B", "tokens x main bytes/token"),
        _q("indexer K written", p.total("indexer_write"), "B", "tokens x indexer bytes/token"),
        *_kv_rows(li, p),
        _q("collective calls", sum(c.collective_calls for c in p.chunks), "", "every chunk is one forward"),
        _q("collective bytes per rank", p.total("collective_bytes"), "B", "ring wire bytes"),
        _q("indexer pairs across chunks", p.cross_chunk_share, "%", "keys from earlier chunks: the quadratic part"),
        _q("compute time (dense peak)", p.total("compute_s"), "s",
           f"{n} GPUs x {hw.fp8_flops / 1e15:g} PFLOP/s FP8 x efficiency {a.compute_efficiency}"),
        _q("HBM time", p.total("memory_s"), "s", f"{n} GPUs x {hw.hbm_bw / 1e12:g} TB/s: indexer K read, KV + "
           "indexer written, the gather's HBM bytes, the staging, the weights once a chunk"),
        _q("collective time", p.total("comm_s"), "s", "NVLink"),
        _q("TTFT lower bound", p.total("lower_bound_s"), "s", "per chunk the largest of the three, summed"),
    ]
    return Section("prefill_totals", f"Chunked prefill totals ({p.context:,} tokens)",
                   "lower bounds: perfect overlap at datasheet peaks", QTY, rows)


def _kv_rows(li: LedgerInputs, p: Prefill) -> list[dict[str, object]]:
    """Sparse MLA's KV gather and the prefill staging (model/layers/prefill_staging.py), each its own line."""
    cfg, kv, layout = li.cfg, li.kv, li.work.kv_layout
    bf16, cache = staged_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim), kv.main_per_layer
    staged = sum(c.staged for c in p.chunks)
    hbm = ("each context row once a layer" if li.asm.prefill_kv_gather == "rows" else "every slot") + \
        " (--assume prefill_kv_gather)"
    if not li.asm.prefill_staging:
        why = "none: --assume prefill_staging=false (DSASERVE_PREFILL_STAGING=0)"
    elif not stages_latent(layout, cfg.kv_lora_rank):
        why = f"none: the engine stages {STAGED_LAYOUT} at kv_lora {STAGED_KV_LORA} only, not {layout} at " \
              f"{cfg.kv_lora_rank}"
    else:
        why = (f"{staged} of {len(p.chunks)} chunks (>= {STAGING_MIN_TOKENS} tokens, <= {STAGING_ROWS_PER_TOKEN} "
               f"context rows a token): their whole pages x ({cache} B read + {bf16} B bf16 written) x "
               f"{kv.kv_layers} layers, once a chunk; in the HBM time")
    rows = {0: f"{cache} B {layout} rows", len(p.chunks): f"{bf16} B bf16 rows (every chunk staged)"}.get(
        staged, f"({bf16} B bf16 rows in staged chunks, {cache} B {layout} rows in the others)")
    return [
        _q("sparse-MLA KV gathered", p.total("kv_read"), "B",
           f"top-k slots x {rows} x {kv.kv_layers} layers; in the HBM time: {hbm}"),
        _q("prefill staging", p.total("kv_staged"), "B", why),
    ]


def pd_transfer(li: LedgerInputs) -> Section:
    kv, ctx, n = li.kv, li.work.context, li.dep.n_gpus
    total = pd_transfer_bytes(kv.main, kv.indexer, ctx)
    rows = [
        _q("main KV", kv.main * ctx, "B", f"{kv.main_per_layer} B x {kv.kv_layers} layers x {ctx:,} tokens"),
        _q("indexer K", kv.indexer * ctx, "B", f"{kv.indexer_per_layer} B x {kv.indexer_layers} layers x {ctx:,}"),
        _q("per request", total, "B", "handed from the prefill instance to the decode instance once"),
        _q("over IB", transfer_time(total, li.hw.ib_bw, n, li.hw.ib_overhead_s), "s",
           f"{n} NICs x {li.hw.ib_bw / 1e9:g} GB/s in parallel"),
        _q("over NVLink (same node)", transfer_time(total, li.hw.nvlink_bw, n, li.hw.nvlink_overhead_s), "s",
           f"{n} GPUs x {li.hw.nvlink_bw / 1e9:g} GB/s"),
    ]
    return Section("pd_transfer", f"PD handoff per request ({ctx:,} tokens)", "large and rare: fits across nodes",
                   QTY, rows)


def first_request(li: LedgerInputs) -> Section:
    w, a = li.work, li.asm
    launches = decode_launches(operator_list(li.cfg, li.dep, a), a)
    steady_tpot = li.step(w.batch, w.prompt).overlapped_s
    reused = min(w.prefix_hit // a.page_size * a.page_size, w.prompt - 1)  # the last token is always computed
    cold = li.prefill(w.prompt).total("lower_bound_s")
    warm = li.prefill(w.prompt, start=reused).total("lower_bound_s")
    fr = first_request_model(a, w.batch, launches, steady_tpot, warm, cold)
    rows = [
        _q("steady TTFT (prefix hit)", fr.steady_ttft_s, "s",
           f"prefill lower bound of the uncached {w.prompt - reused:,} tokens"),
        _q("cold TTFT (empty prefix cache)", fr.cold_ttft_s, "s", f"all {w.prompt:,} tokens"),
        _q("steady TPOT", fr.steady_tpot_s, "s", f"decode step at batch {w.batch} (graph replay)"),
        _q("launches per decode step", fr.launches_per_step, "", "operator list x kernels_per_op"),
        _q("eager extra per step", fr.eager_step_extra_s, "s", f"(launches - 1) x {a.launch_overhead_s * 1e6:g} us"),
    ]
    rows += [_q(("[hit] " if p.hit else "[not hit] ") + p.name, p.seconds, "s", p.why) for p in fr.paths]
    rows += [_q("T_steady", fr.steady_s, "s", f"TTFT + {fr.tokens} x TPOT"),
             _q("T_first", fr.first_s, "s", "T_steady + the cold paths this request hits"),
             _q("first / steady", fr.first_s / fr.steady_s if fr.steady_s else 0.0, "x", "note 000: measure both")]
    return Section("first_request", f"First request: {w.prompt:,}-token prompt, {fr.tokens} tokens out",
                   "note 000: T_first = T_steady + sum of cold-path costs", QTY, rows)
