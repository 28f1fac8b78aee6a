"""Report sections about bytes at rest: model constants, weights per GPU, KV bytes per token, KV-pool
capacity (and against context), and the scheduler's page arithmetic.

Owns: turning the dataclasses of weights.py / kv.py into `Section`s, one "why" per row. Startup-chain
steps they describe: load weights, memory profile, allocate the KV pool. Pure Python.
"""

from __future__ import annotations

from dsaserve.common.kv_layout import KV_LAYOUTS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.kv import (
    block_table_bytes,
    indexer_parts,
    kv_per_token,
    kv_share_per_gpu,
    layout_parts,
    prefix_hit,
)
from dsaserve.ledger.marginal import decode_weight_read
from dsaserve.ledger.report import ROW_UNIT, Column, Section
from dsaserve.ledger.speculative import drafts
from dsaserve.ledger.units import GB, K_TOKENS, ceil_div
from dsaserve.ledger.weights import GROUPS, active_params_per_token, divisor, stored_per_gpu

QTY = [Column("quantity", "quantity"), Column("value", "value", ROW_UNIT), Column("why", "why")]


def _q(quantity: str, value: object, unit: str, why: str) -> dict[str, object]:
    return {"quantity": quantity, "value": value, "unit": unit, "why": why}


def model_constants(li: LedgerInputs) -> Section:
    c, inv = li.cfg, li.inv
    full, n = len(c.full_indexer_layers), c.num_hidden_layers
    rows = [
        _q("model_type", c.model_type, "", "config.json model_type"),
        _q("hidden_size", c.hidden_size, "", "width of every hidden state on the wire"),
        _q("num_hidden_layers", n, "", "KV layers (the MTP layer is extra)"),
        _q("full / shared indexer layers", f"{full} / {n - full}", "", "indexer_types: shared layers reuse indices"),
        _q("dense / MoE layers", f"{len(c.dense_layers)} / {len(c.moe_layers)}", "", "first_k_dense_replace"),
        _q("routed experts, per token", f"{c.n_routed_experts}, {c.num_experts_per_tok}", "",
           "n_routed_experts, num_experts_per_tok"),
        _q("shared experts", c.n_shared_experts, "", "n_shared_experts"),
        _q("vocab_size", c.vocab_size, "", "rows of embed_tokens and lm_head"),
        _q("attention heads", c.num_attention_heads, "", "num_attention_heads"),
        _q("q_lora / kv_lora rank", f"{c.q_lora_rank} / {c.kv_lora_rank}", "", "MLA low-rank widths"),
        _q("nope / rope / v head dim", f"{c.qk_nope_head_dim} / {c.qk_rope_head_dim} / {c.v_head_dim}", "",
           "the cached latent is kv_lora + rope = " + str(c.kv_latent_dim)),
        _q("indexer heads x dim, top-k", f"{c.index_n_heads} x {c.index_head_dim}, {c.index_topk}", "",
           "index_n_heads, index_head_dim, index_topk"),
        _q("MTP layers", c.num_nextn_predict_layers, "", "num_nextn_predict_layers (index num_hidden_layers..)"),
        _q("parameters (main model)", inv.total_params(mtp=False), "params", "sum over checkpoint_specs, no scales"),
        _q("parameters incl. MTP", inv.total_params(), "params", "the MTP layer is a full decoder layer"),
        _q("active parameters per token", active_params_per_token(c, inv), "params",
           "attention + indexer + router + top-k and shared experts + dense MLPs + lm_head"),
        _q("checkpoint bytes", inv.total_bytes(), "B", "FP8 weights + FP32 block scales + BF16 unconverted modules"),
        _q("routed expert bytes (main)", inv.main("experts"), "B", "the part EP shards"),
        _q("one routed expert", inv.expert_bytes, "B", "gate + up + down, FP8 + scales"),
        _q("checkpoint tensors", inv.num_tensors, "", "entries of model.safetensors.index.json"),
    ]
    return Section("model_constants", f"Model constants: {li.name}", "every later number derives from these",
                   QTY, rows)


def weights_per_gpu(li: LedgerInputs) -> Section:
    stored = stored_per_gpu(li.inv, li.dep, li.asm)
    read = decode_weight_read(li.cfg, li.inv, li.dep, li.asm, li.work.batch, li.work.decode_context)
    rows = [{"group": g, "checkpoint": li.inv.bytes[g], "ranks_sharing": divisor(g, li.dep, li.asm),
             "stored_per_gpu": stored[g], "read_per_step": read.get(g, 0.0), "why": GROUPS[g.removeprefix("mtp.")]}
            for g in stored]
    rows.append({"group": "total", "checkpoint": sum(li.inv.bytes[g] for g in stored), "ranks_sharing": None,
                 "stored_per_gpu": sum(stored.values()), "read_per_step": sum(read.values()),
                 "why": f"read at batch {li.work.batch}, context {li.work.decode_context:,}: routed experts as far as "
                        + _drafts_note(li)})
    cols = [Column("group", "group"), Column("checkpoint", "checkpoint", "B"), Column("ranks_sharing", "/ranks"),
            Column("stored_per_gpu", "stored per GPU", "B"), Column("read_per_step", "read per decode step", "B"),
            Column("why", "why")]
    return Section("weights_per_gpu", f"Weights per GPU: {li.dep.topology}",
                   "what each rank holds after loading, and what one decode step reads", cols, rows)


def kv_bytes(li: LedgerInputs) -> Section:
    rows = []
    for layout in KV_LAYOUTS:
        kv = kv_per_token(li.cfg, layout, li.asm)
        parts = " + ".join(f"{what} ({b} B)" for what, b in layout_parts(li.cfg, layout, li.asm.nvfp4_rope))
        idx = " + ".join(f"{what}" for what, _ in indexer_parts(li.cfg, layout))
        rows.append({"layout": layout + (" *" if layout == li.work.kv_layout else ""),
                     "main_per_layer": kv.main_per_layer, "indexer_per_layer": kv.indexer_per_layer,
                     "main_per_token": kv.main, "indexer_per_token": kv.indexer, "total_per_token": kv.total,
                     "per_context": kv.total * li.work.context, "why": f"{parts}; indexer {idx}"})
    cols = [Column("layout", "layout"), Column("main_per_layer", "main/layer", "B"),
            Column("indexer_per_layer", "indexer/layer", "B"), Column("main_per_token", "main/token", "B"),
            Column("indexer_per_token", "indexer/token", "B"), Column("total_per_token", "total/token", "B"),
            Column("per_context", f"per {li.work.context:,} tokens", "B"), Column("why", "why")]
    kv = li.kv
    return Section("kv_bytes", "KV bytes per token", f"main KV on {kv.kv_layers} layers + indexer K on "
                   f"{kv.indexer_layers} full layers; * = --kv-layout", cols, rows,
                   ["fp32 is the engine's exact-reference layout; nvfp4_ds_mla rope dtype: --assume nvfp4_rope"])


def _gb(v: float) -> str:
    return f"{v / GB:.1f} GB"


def memory_warnings(li: LedgerInputs) -> list[dict[str, object]]:
    """Weights that do not fit: every later number assumes a pool that is not there (the report's `warnings`)."""
    cap = li.capacity()
    if cap.weights_bytes > cap.hbm_bytes:
        excess = cap.weights_bytes - cap.hbm_bytes
        return [{"code": "weights_exceed_gpu_memory", "excess_bytes": excess,
                 "message": f"weights per GPU ({_gb(cap.weights_bytes)}) exceed the GPU's memory "
                            f"({_gb(cap.hbm_bytes)}, {li.hw.name}) by {_gb(excess)}: this deployment cannot load "
                            f"the model (more GPUs: --tp / --ep); KV pool 0"}]
    if cap.shortfall_bytes > 0:
        other = f" + other static ({_gb(cap.reserved_bytes)})" if cap.reserved_bytes else ""
        return [{"code": "weights_exceed_static_share", "excess_bytes": cap.shortfall_bytes,
                 "message": f"weights per GPU ({_gb(cap.weights_bytes)}){other} exceed the static share "
                            f"(--mem-fraction-static {li.asm.mem_fraction_static} x {_gb(cap.hbm_bytes)} = "
                            f"{_gb(cap.static_bytes)}) by {_gb(cap.shortfall_bytes)}: KV pool 0"}]
    return []


def kv_capacity(li: LedgerInputs) -> Section:
    cap, a = li.capacity(), li.asm
    share = kv_share_per_gpu(li.dep, a)
    holders = (f"{li.dep.dp} DP ranks each hold their own requests" if li.dep.dp_attention else
               "every rank holds " + ("1/TP of each token's layers" if share < 1 else "the whole latent"))
    rows = [
        _q("device memory", cap.hbm_bytes, "B", li.hw.sources.get("hbm_bytes", "hardware preset")),
        _q("static share", cap.static_bytes, "B", f"mem_fraction_static {a.mem_fraction_static}"),
        _q("weights per GPU", cap.weights_bytes, "B", "see weights_per_gpu"),
        _q("other static", cap.reserved_bytes, "B", "--assume reserved_bytes"),
        _q("KV pool per GPU", cap.pool_bytes, "B", "static share - weights - other static" +
           (f" = -{_gb(cap.shortfall_bytes)}: no pool (see the warning)" if cap.shortfall_bytes > 0 else "")),
        _q("KV bytes per token on this GPU", cap.bytes_per_token_gpu, "B",
           f"{li.kv.total:,} B x {share:g} ({a.mla_kv if not li.dep.dp_attention else 'DP-attention'})"),
        _q("pages per GPU", cap.pages_per_gpu, "pages", f"pool / (bytes per token x {a.page_size})"),
        _q("tokens per GPU", cap.tokens_per_gpu, "tokens", "pages x page size"),
        _q("tokens the deployment holds", cap.cluster_tokens, "tokens", holders +
           (f", x {cap.replicas} replicas" if cap.replicas > 1 else "")),
        _q("one request", cap.request_tokens, "tokens", "--context"),
        _q("its pages", cap.request_pages, "pages", f"ceil(context / {a.page_size})"),
        _q("its KV, all GPUs", cap.request_bytes, "B", "the PD handoff / the prefix it reserves"),
        _q("its KV per GPU", cap.request_bytes_per_gpu, "B", "x the share above"),
        _q("requests of this context that fit", cap.requests_fit, "requests",
           "whole requests per pool (a request never straddles two DP ranks)"),
    ]
    return Section("kv_capacity", f"KV pool capacity: {li.hw.name}, {li.dep.topology}",
                   "note 000: N_tok = B_avail / (B_token x L_local / L)", QTY, rows)


def kv_capacity_vs_context(li: LedgerInputs) -> Section:
    rows, ctx = [], 4 * K_TOKENS
    while ctx <= max(li.work.context, li.cfg.max_position_embeddings):
        cap = li.capacity(ctx)
        rows.append({"context": ctx, "pages": cap.request_pages, "requests_fit": cap.requests_fit,
                     "kv_per_request": cap.request_bytes,
                     "why": f"{cap.tokens_per_gpu:,} tokens per GPU / {cap.request_pages * li.asm.page_size:,}"})
        ctx *= 2
    cols = [Column("context", "context", "tokens"), Column("pages", "pages/request"),
            Column("requests_fit", "requests that fit"), Column("kv_per_request", "KV per request", "B"),
            Column("why", "why")]
    return Section("kv_capacity_vs_context", "KV capacity against context", "concurrency the pool allows", cols,
                   rows)


def scheduler_pages(li: LedgerInputs) -> Section:
    w, a = li.work, li.asm
    ids, nbytes = block_table_bytes(w.batch, w.decode_context, a)
    hashes, reused, to_prefill = prefix_hit(w.prompt, w.prefix_hit, a.page_size)
    rows = [
        _q("pages of a --context request", ceil_div(w.context, a.page_size), "pages",
           f"ceil({w.context:,} / {a.page_size}); full pages {w.context // a.page_size:,}"),
        _q("block-table page ids", ids, "", f"{w.batch} requests x ceil({w.decode_context:,} / {a.page_size})"),
        _q("block-table bytes", nbytes, "B", f"x {a.page_id_bytes} B per id: the stage-4 copy per step"),
        _q("prefix-cache page hashes", hashes, "", f"full pages of the {w.prefix_hit:,} cached tokens"),
        _q("tokens reused", reused, "tokens", "only full pages are shared"),
        _q("tokens still prefilled", to_prefill, "tokens", f"of the {w.prompt:,}-token prompt"),
    ]
    return Section("scheduler_pages", "Scheduler page arithmetic", "stage 3/4 CPU work that scales with pages", QTY,
                   rows)


def _drafts_note(li: LedgerInputs) -> str:
    k = drafts(li.asm)
    return (f"the verify's {li.work.batch * (k + 1)} tokens touch them (speculation, {k} drafts a request), then the "
            f"MTP layer and the lm_head in each of {k} draft forwards") if k else f"{li.work.batch} tokens touch them"
