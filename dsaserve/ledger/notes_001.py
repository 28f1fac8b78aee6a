"""Note 001 ("系列总账") figure by figure: the note's number, the ledger's, and why they differ.

Owns: the catalogue of note 001's arithmetic — model constants, scheduler and block-table sizes, the
decode-step collective table (TP8 / DP-attention + EP8 / PD), bytes -> time on NVLink and IB, marginal
cost per token, the LM-head gather (whose figures match GLM-4's 151,552-token vocabulary), page and
prefix-hash counts, indexer reuse, the 1M chunked prefill and the KV-layout shares; the worked step
(batch 32, 128K) is notes_001_worked.py. Each entry is computed by the ledger's own
functions under the inputs the note states (notes.NOTE_HW / NOTE_ASM). Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from dsaserve.config import ModelConfig
from dsaserve.ledger import notes_001_worked
from dsaserve.ledger.collective_plan import a2a_tokens, hidden_reduction_rows, row_time, step_plan, wire_factor
from dsaserve.ledger.deployment import Assumptions, Workload
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.kv import block_table_bytes, kv_bytes_per_token_layer, kv_capacity, prefix_hit
from dsaserve.ledger.notes import NOTE_DP_EP8, NOTE_TP8, Figure, NoteContext
from dsaserve.ledger.prefill import chunked_prefill
from dsaserve.ledger.timeline import decode_launches, operator_list
from dsaserve.ledger.units import GB, M_TOKENS, MB
from dsaserve.ledger.weights import active_params_per_token, step_read_per_gpu, stored_per_gpu

F = partial(Figure, note="001")
GLM4_VOCAB = 151_552  # GLM-4's vocabulary: the one every LM-head figure of note 001 matches
_LAT_US = round(PRESETS["h200"].nvlink_overhead_s * 1e6, 2)  # the preset's per-collective latency (measured)
WIRE = (f"the ledger's default: ring wire bytes 2(n-1)/n x M per rank over 450 GB/s each way + {_LAT_US:g} us per "
        "call (h200)")


def _sum_msg(rows) -> float:
    return sum(r.total_message for r in rows)


def _t(rows, hw, asm) -> float:
    return sum(row_time(r, hw, asm) for r in rows)


def figures(c: NoteContext) -> list[Figure]:
    return (_constants(c) + _scheduler(c) + _collectives(c) + _bytes_to_time(c) + notes_001_worked.figures(c)
            + _marginal(c) + _output(c) + _indexer(c) + _prefill(c) + _layout(c))


def _constants(c: NoteContext) -> list[Figure]:
    cfg, inv = c.cfg, c.inv
    w = "所有数字沿用前七篇的口径"
    return [
        F(id="001.model.total_params", where=w, quantity="total parameters (main model, no MTP)", note_text="744",
          unit="B params", ledger=inv.total_params(mtp=False), tol=1),
        F(id="001.model.active_params", where=w, quantity="active parameters per token (incl. lm_head)",
          note_text="40", unit="B params", ledger=active_params_per_token(cfg, inv)),
        F(id="001.model.layers", where=w, quantity="decoder layers", note_text="78", unit="",
          ledger=cfg.num_hidden_layers),
        F(id="001.model.hidden", where=w, quantity="hidden size", note_text="6144", unit="",
          ledger=cfg.hidden_size),
        F(id="001.model.experts", where=w, quantity="routed experts", note_text="256", unit="",
          ledger=cfg.n_routed_experts),
        F(id="001.model.experts_per_token", where=w, quantity="experts per token", note_text="8", unit="",
          ledger=cfg.num_experts_per_tok),
        F(id="001.model.routed_expert_params", where="拓扑对账本的重塑", quantity="routed-expert parameters",
          note_text="724", unit="B params", ledger=inv.params["experts"], tol=1),
        F(id="001.ops.a_proj_width", where="逐层前向:算子清单", quantity="A-projection output width",
          note_text="2624", unit="", ledger=cfg.q_lora_rank + cfg.kv_latent_dim),
        F(id="001.ops.q_up_width", where="逐层前向:算子清单", quantity="Q up-projection output (64 x 256)",
          note_text="16384", unit="", ledger=cfg.num_attention_heads * cfg.qk_head_dim),
        F(id="001.ops.indexer_layers", where="逐层前向:算子清单", quantity="layers that score (full)",
          note_text="21", unit="", ledger=len(cfg.full_indexer_layers)),
        F(id="001.ops.moe_layers", where="逐层前向:算子清单", quantity="MoE layers (router, dispatch, combine)",
          note_text="75", unit="", ledger=len(cfg.moe_layers)),
    ]


def _scheduler(c: NoteContext) -> list[Figure]:
    kv, asm = c.kv(), c.asm
    ids, nbytes = block_table_bytes(256, 128 * 1024, asm)
    pages_100k = -(-100_000 // asm.page_size)
    hashes, reused, to_prefill = prefix_hit(20_000, 19_000, asm.page_size)
    return [
        F(id="001.sched.chunks_1m", where="阶段 3", quantity="32K chunks of a 1M prompt", note_text="32", unit="",
          ledger=-(-M_TOKENS // 32768)),
        F(id="001.sched.reserve_1m", where="阶段 3 的另外一半", quantity="KV reserved for one 1M request",
          note_text="57", unit="GB", ledger=kv.total * M_TOKENS, tol=0.5),
        F(id="001.batch.block_table_ids", where="阶段 4 的代价", quantity="page ids for 256 x 128K",
          note_text="524288", unit="", ledger=ids),
        F(id="001.batch.block_table_bytes", where="阶段 4 的代价", quantity="block-table copy for 256 x 128K",
          note_text="100-999", unit="KB", ledger=nbytes, tol=0,
          reason="524,288 page ids x 4 B (int32) = 2.1 MB (4.2 MB as int64); 'a few hundred KB' would need "
                 "under 2 B per page id"),
        F(id="001.kv.pages_100k", where="KV 回收的 CPU 账", quantity="pages of a 100,000-token request",
          note_text="1563", unit="", ledger=pages_100k),
        F(id="001.kv.full_pages_100k", where="KV 回收的 CPU 账", quantity="full pages of a 100,000-token request "
          "('按满块计')", note_text="1563", unit="", ledger=100_000 // asm.page_size,
          reason="100,000 = 1,562 x 64 + 32: 1,562 full pages plus one partial; 1,563 is the pages allocated"),
        F(id="001.prefix.hashes_19k", where="前缀缓存命中如何改写账本", quantity="page hashes for a 19,000-token "
          "prefix hit", note_text="300", unit="", ledger=hashes, tol=15,
          reason=f"19,000 = {hashes} x 64 + {19_000 - reused}: {hashes} full pages are hashed; the prefix spans "
                 f"{hashes + 1} pages (the issue's ~297)"),
        F(id="001.prefix.prefill_tokens", where="前缀缓存命中如何改写账本", quantity="tokens still prefilled "
          "(20K prompt, 19K cached)", note_text="1", unit="K", ledger=to_prefill, tol=0,
          reason=f"only full pages are shared: {hashes} x 64 = {reused:,} tokens hit, {to_prefill:,} to prefill "
                 "(the note's 'K' here is 1,000)"),
    ]


def _collectives(c: NoteContext) -> list[Figure]:
    cfg, hw, asm = c.cfg, c.hw, c.asm
    tp = step_plan(cfg, NOTE_TP8, asm, 256, logits_rows=256)
    dp = step_plan(cfg, NOTE_DP_EP8, asm, 256, logits_rows=256)
    tp_red, dp_red = hidden_reduction_rows(tp), hidden_reduction_rows(dp)
    a2a = [r for r in dp if r.kind == "all_to_all"]
    dp83 = hidden_reduction_rows(step_plan(cfg, NOTE_DP_EP8, replace(asm, dp_embed_allreduce=True), 256))
    dflt = Assumptions()
    tp_default = _t(hidden_reduction_rows(step_plan(cfg, NOTE_TP8, dflt, 256)), PRESETS["h200"], dflt)
    a2a_rank = [r for r in step_plan(cfg, NOTE_DP_EP8, dflt, 256) if r.kind == "all_to_all"]
    a2a_default = _t(a2a_rank, PRESETS["h200"], dflt)
    kv = c.kv()
    w = "一次 decode step 的集合通信总账"
    return [
        F(id="001.embed.rows_per_rank", where="阶段 5", quantity="vocab rows per rank under TP8", note_text="19360",
          unit="", ledger=cfg.vocab_size // 8),
        F(id="001.embed.msg_b256", where="阶段 5", quantity="embedding all-reduce message, b=256",
          note_text="3", unit="MB", ledger=256 * cfg.hidden_size * 2),
        F(id="001.embed.msg_chunk32k", where="阶段 5", quantity="embedding all-reduce message, 32K chunk",
          note_text="400", unit="MB", ledger=32768 * cfg.hidden_size * 2, tol=5),
        F(id="001.coll.tp_calls", where=w, quantity="TP8 hidden reductions per step (1 + 78 + 78)",
          note_text="157", unit="", ledger=sum(r.calls for r in tp_red)),
        F(id="001.coll.dp_calls", where=w, quantity="DP-attention + EP8 hidden collectives per step (table rows)",
          note_text="82", unit="", ledger=sum(r.calls for r in dp_red)),
        F(id="001.coll.tp8_b256_bytes", where=w, quantity="TP8 reductions per step, b=256", note_text="494",
          unit="MB", ledger=_sum_msg(tp_red)),
        F(id="001.coll.tp8_b256_nvlink", where=w, quantity="TP8 reductions per step on NVLink, b=256",
          note_text="0.63", unit="ms", ledger=_t(tp_red, hw, asm), default=tp_default,
          default_why=WIRE + f": 157 x 3.15 MB x 1.75 / 450 GB/s + 157 x {_LAT_US:g} us = {tp_default * 1e3:.2f} ms"),
        F(id="001.coll.dp_b256_bytes", where=w, quantity="DP-attention + EP8 hidden collectives per step, b=256",
          note_text="261", unit="MB", ledger=_sum_msg(dp_red),
          reason=f"the note's table has 1 all-gather + 78 reduce-scatters + 3 dense all-reduces = 82 calls "
                 f"({_sum_msg(dp_red) / MB:.1f} MB); its sum '1+1+78+3' = 83 adds an embedding all-reduce that "
                 f"DP-attention does not have (--assume dp_embed_allreduce=true gives {_sum_msg(dp83) / MB:.1f} MB)"),
        F(id="001.coll.dp_b256_nvlink", where=w, quantity="DP-attention + EP8 hidden collectives on NVLink",
          note_text="0.33", unit="ms", ledger=_t(dp_red, hw, asm)),
        F(id="001.coll.dispatch_layer_b256", where=w, quantity="MoE dispatch per layer, b=256 (FP8)",
          note_text="12.6", unit="MB", ledger=a2a[0].message_bytes),
        F(id="001.coll.combine_layer_b256", where=w, quantity="MoE combine per layer, b=256 (BF16)",
          note_text="25.2", unit="MB", ledger=a2a[1].message_bytes),
        F(id="001.coll.a2a_step_b256", where=w, quantity="dispatch + combine per step, 75 layers, b=256",
          note_text="2.83", unit="GB", ledger=_sum_msg(a2a)),
        F(id="001.coll.a2a_step_nvlink", where=w, quantity="dispatch + combine per step on NVLink (787 GB/s)",
          note_text="3.6", unit="ms", ledger=_t(a2a, hw, asm), default=a2a_default,
          default_why=f"one rank sends its own ceil(256/8) = "
                      f"{a2a_tokens(NOTE_DP_EP8, dflt, 256)} tokens' copies, {_sum_msg(a2a_rank) / MB:.1f} MB, 7/8 "
                      f"of them off the GPU: {sum(r.wire_bytes for r in a2a_rank) / MB:.1f} MB / 450 GB/s + "
                      f"{sum(r.calls for r in a2a_rank)} x {_LAT_US:g} us"),
        F(id="001.pd.main_per_token", where=w, quantity="main KV per token, 78 layers (fp8_ds_mla)",
          note_text="51.2", unit="KB", ledger=kv.main),
        F(id="001.pd.main_1m", where=w, quantity="main KV of a 1M request", note_text="53.7", unit="GB",
          ledger=kv.main * M_TOKENS),
        F(id="001.pd.indexer_1m", where=w, quantity="indexer K of a 1M request (21 x 132 x 2^20)", note_text="2.9",
          unit="GB", ledger=kv.indexer * M_TOKENS),
        F(id="001.pd.total_1m", where=w, quantity="PD handoff of a 1M request", note_text="56.6", unit="GB",
          ledger=kv.total * M_TOKENS),
        F(id="001.ep.experts_per_gpu", where=w, quantity="routed-expert bytes per GPU under EP8", note_text="91",
          unit="GB", ledger=stored_per_gpu(c.inv, NOTE_DP_EP8, asm)["experts"]),
    ]


def _bytes_to_time(c: NoteContext) -> list[Figure]:
    cfg, hw, asm = c.cfg, c.hw, c.asm
    b1 = hidden_reduction_rows(step_plan(cfg, NOTE_TP8, asm, 1))
    b256 = hidden_reduction_rows(step_plan(cfg, NOTE_TP8, asm, 256))
    one_layer = [replace(r, calls=1) for r in step_plan(cfg, NOTE_DP_EP8, asm, 256) if r.kind == "all_to_all"]
    ib = lambda rows: sum(row_time(r, hw, asm, "ib") for r in rows)  # noqa: E731
    calls = sum(r.calls for r in b1)
    w = "从字节到毫秒"
    return [
        F(id="001.b2t.b1_bytes", where=w, quantity="TP8 reductions per step, b=1", note_text="1.9", unit="MB",
          ledger=_sum_msg(b1)),
        F(id="001.b2t.b1_nvlink", where=w, quantity="b=1 on NVLink (787 GB/s)", note_text="2", unit="us",
          ledger=_t(b1, hw, asm)),
        F(id="001.b2t.b1_ib", where=w, quantity="b=1 on IB (25 GB/s)", note_text="77", unit="us", ledger=ib(b1)),
        F(id="001.b2t.b256_ib", where=w, quantity="b=256 TP8 on IB", note_text="20", unit="ms", ledger=ib(b256)),
        F(id="001.b2t.ep_layer_bytes", where=w, quantity="EP8 dispatch + combine of one layer, b=256",
          note_text="38", unit="MB", ledger=_sum_msg(one_layer)),
        F(id="001.b2t.ep_layer_nvlink", where=w, quantity="one layer's dispatch + combine on NVLink",
          note_text="48", unit="us", ledger=_t(one_layer, hw, asm)),
        F(id="001.b2t.ep_layer_ib", where=w, quantity="one layer's dispatch + combine on IB", note_text="1.5",
          unit="ms", ledger=ib(one_layer)),
        F(id="001.b2t.b1_overhead_lo", where=w, quantity="157 calls x 3 us fixed overhead", note_text="0.5",
          unit="ms", ledger=calls * 3e-6),
        F(id="001.b2t.b1_overhead_hi", where=w, quantity="157 calls x 5 us fixed overhead", note_text="0.8",
          unit="ms", ledger=calls * 5e-6),
        F(id="001.tp2.allreduce_ratio", where="两卡规模的账", quantity="per-rank bytes of one all-reduce, TP2 / TP8",
          note_text="4", unit="x", ledger=wire_factor("all_reduce", 2) / wire_factor("all_reduce", 8),
          reason="a ring all-reduce sends 2(n-1)/n of the message per rank: 1.0 at TP2, 1.75 at TP8, so TP2 moves "
                 "0.57x the bytes per rank, not 4x; the note's 4 is 8/2 GPUs"),
    ]


def _marginal(c: NoteContext) -> list[Figure]:
    cfg, hw, asm = c.cfg, c.hw, c.asm
    h = cfg.hidden_size
    weights = sum(step_read_per_gpu(cfg, c.inv, NOTE_DP_EP8, asm, 256).values())
    idx_1m = M_TOKENS * c.kv().indexer
    tp_asm = replace(asm, moe_dense_tp_size=0)  # pure TP8 splits the dense MLPs (note 000's 93 GB per GPU)
    cap = kv_capacity(cfg, NOTE_TP8, hw, Workload(), tp_asm, sum(stored_per_gpu(c.inv, NOTE_TP8, tp_asm).values()))
    budget = cap.pool_bytes * 8
    frac_250 = (250 * GB / 8 + cap.weights_bytes) / hw.hbm_bytes
    w = "单位 token 的边际成本"
    dp_rows = hidden_reduction_rows(step_plan(cfg, NOTE_DP_EP8, asm, 1))
    return [
        F(id="001.marginal.tp_per_token", where=w, quantity="TP communication per token (157 x 6144 x 2)",
          note_text="1.9", unit="MB", ledger=157 * h * 2),
        F(id="001.marginal.dp_per_token", where=w, quantity="DP-attention reductions per token (82 x 6144 x 2)",
          note_text="1", unit="MB", ledger=_sum_msg(dp_rows)),
        F(id="001.marginal.a2a_per_token", where=w, quantity="dispatch + combine per token (75 x 8 x 6144 x 3)",
          note_text="11", unit="MB", ledger=75 * 8 * h * 3),
        F(id="001.marginal.steps_per_s", where=w, quantity="weight-bound steps per second", note_text="44",
          unit="steps/s", ledger=hw.hbm_bw / weights, tol=1.0,
          reason="" if abs(hw.hbm_bw / weights - 44) <= 1 else "follows the weight read"),
        F(id="001.marginal.weights_b32", where=w, quantity="weight read per token at b=32", note_text="3.4",
          unit="GB", ledger=weights / 32),
        F(id="001.marginal.weights_b256", where=w, quantity="weight read per token at b=256", note_text="425",
          unit="MB", ledger=weights / 256, tol=6,
          reason="" if abs(weights / 256 / MB - 425) <= 0.5 else
          f"{weights / GB:.1f} GB / 256 (the note divides 109 GB)"),
        F(id="001.marginal.idx_1m", where=w, quantity="indexer read per token at 1M", note_text="2.8", unit="GB",
          ledger=idx_1m, reason="2^20 keys x 132 B x 21 layers = 2.91 GB; the note uses 128 B (2.82 GB)"),
        F(id="001.marginal.idx_1m_time", where=w, quantity="indexer read time per token at 1M", note_text="0.6",
          unit="ms", ledger=idx_1m / hw.hbm_bw),
        F(id="001.marginal.idx_1m_b4", where=w, quantity="indexer read per step, 4 x 1M", note_text="11.2",
          unit="GB", ledger=4 * idx_1m, reason="4 x 2.91 GB (132 B keys); with 128 B keys 11.27 GB"),
        F(id="001.marginal.kv_budget", where=w, quantity="KV budget of 8 x H200 after 744 GB of weights",
          note_text="250", unit="GB", ledger=budget, tol=10,
          reason=f"8 x (0.85 x 141 GB - {cap.weights_bytes / GB:.1f} GB) = {budget / GB:.0f} GB; 250 GB needs "
                 f"mem_fraction_static ~ {frac_250:.2f}"),
        F(id="001.marginal.requests_1m", where=w, quantity="1M requests that fit on 8 x H200", note_text="4",
          unit="", ledger=cap.requests_fit,
          reason="" if cap.requests_fit == 4 else f"follows the {budget / GB:.0f} GB budget"),
    ]


def _output(c: NoteContext) -> list[Figure]:
    cfg, hw, asm = c.cfg, c.hw, c.asm
    g192, g16 = (_lm_gather(cfg, asm, b) for b in (192, 16))
    glm4 = replace(cfg, vocab_size=GLM4_VOCAB)
    o192, o16 = (_lm_gather(glm4, asm, b) for b in (192, 16))
    w = "输出侧:GPU 之外的两笔账"
    vocab = (f"every LM-head figure of the note matches a vocabulary of {GLM4_VOCAB:,} (GLM-4's) exactly: "
             f"192 x {GLM4_VOCAB:,} x 4 B x 7/8 = {o192 / MB:.2f} MB ('102', {o192 / hw.nvlink_bw * 1e3:.3f} ms "
             f"at 787 GB/s: '0.13'), 16 x {GLM4_VOCAB:,} x 4 B x 7/8 = {o16 / MB:.2f} MB ('8.5'); GLM-5.3's "
             f"vocabulary is {cfg.vocab_size:,}")
    return [
        F(id="001.lm.b192_bytes", where=w, quantity="LM-head gather at B=192 (x 7/8 ring)", note_text="102",
          unit="MB", ledger=g192,
          reason=f"192 x {cfg.vocab_size:,} x 4 B x 7/8 = {g192 / MB:.1f} MB; {vocab}"),
        F(id="001.lm.b192_time", where=w, quantity="LM-head gather time at B=192", note_text="0.13", unit="ms",
          ledger=g192 / hw.nvlink_bw),
        F(id="001.lm.b16_bytes", where=w, quantity="LM-head gather at B=16", note_text="8.5", unit="MB",
          ledger=g16, reason=f"16 x {cfg.vocab_size:,} x 4 B x 7/8 = {g16 / MB:.2f} MB; {vocab}"),
    ]


def _lm_gather(cfg: ModelConfig, asm: Assumptions, rows: int) -> float:
    """Bytes one rank sends in the vocab all-gather of `rows` logits rows under TP8 (ring, 7/8)."""
    return next(r.wire_bytes for r in step_plan(cfg, NOTE_TP8, asm, rows) if r.point.startswith("vocab"))


def _indexer(c: NoteContext) -> list[Figure]:
    cfg, kv = c.cfg, c.kv()
    n, full = cfg.num_hidden_layers, len(cfg.full_indexer_layers)
    w = "索引器的两笔账"
    per_layer = kv.indexer_per_layer * M_TOKENS
    return [
        F(id="001.idx.reuse_factor", where=w, quantity="scoring work if all 78 layers scored (78/21)",
          note_text="3.7", unit="x", ledger=n / full),
        F(id="001.idx.saved_share", where=w, quantity="scoring saved by reuse (57/78)", note_text="75", unit="%",
          ledger=(n - full) / n, tol=3),
        F(id="001.idx.per_layer_1m", where=w, quantity="indexer K of one layer at 1M", note_text="132", unit="MB",
          ledger=per_layer, reason="132 B x 2^20 = 138.4 MB; 132 MB is 132 B x 10^6 tokens"),
        F(id="001.idx.total_1m", where=w, quantity="indexer K of the 21 full layers at 1M", note_text="2.8",
          unit="GB", ledger=kv.indexer * M_TOKENS,
          reason="21 x 132 B x 2^20 = 2.91 GB (2.77 GB with 10^6 tokens, 2.82 GB with 128 B keys)"),
    ]


def _prefill(c: NoteContext) -> list[Figure]:
    cfg, hw, asm = c.cfg, c.hw, c.asm
    p = chunked_prefill(cfg, c.inv, NOTE_DP_EP8, hw, replace(asm, dp_gather="per_layer"), Workload())
    ch = p.chunks[0]
    plan = step_plan(cfg, NOTE_DP_EP8, replace(asm, dp_gather="per_layer"), 32768, logits_rows=0)
    per_layer = [r for r in plan if r.kind in ("all_gather", "reduce_scatter")]
    a2a = [r for r in plan if r.kind == "all_to_all"]
    gemm = p.total("gemm_flops") + p.total("attn_flops")
    flops = gemm + p.total("indexer_flops")
    dflt = chunked_prefill(cfg, c.inv, NOTE_DP_EP8, c.h200, Assumptions(), Workload())
    bound = sum(x.lower_bound_s for x in dflt.chunks)
    # the ledger's default q-tile (what --sections prefill_totals prints), and every query re-reading every key
    q1 = chunked_prefill(cfg, c.inv, NOTE_DP_EP8, c.h200, Assumptions(indexer_q_tile=1), Workload())
    w = "一次 1M prefill"
    split = (f"2 x {(ch.gemm_flops / 2 / 32768) / 1e9:.2f} B GEMM params x 32,768 = {ch.gemm_flops / 1e15:.2f} PFLOP "
             f"+ sparse-MLA core 2 x 64 heads x (576 + 512) x 2,048 slots x 78 layers x 32,768 = "
             f"{ch.attn_flops / 1e15:.2f} PFLOP")
    return [
        F(id="001.prefill.gemm_chunk", where=w, quantity="GEMM + attention FLOPs per 32K chunk", note_text="3.1",
          unit="PFLOP", ledger=ch.gemm_flops + ch.attn_flops, reason=split),
        F(id="001.prefill.gemm_total", where=w, quantity="GEMM + attention FLOPs, 32 chunks", note_text="100",
          unit="PFLOP", ledger=gemm, tol=3, reason=split + "; x 32"),
        F(id="001.prefill.indexer_total", where=w, quantity="indexer scoring FLOPs, 1M causal",
          note_text="94", unit="PFLOP", ledger=p.total("indexer_flops"), tol=1,
          reason="2^20(2^20+1)/2 pairs x 32 heads x 128 x 2 x 21 = 94.6 PFLOP; the note truncates to 94"),
        F(id="001.prefill.indexer_read", where=w, quantity="indexer K read, q-tile 32, 132 B", note_text="47",
          unit="TB", ledger=p.total("indexer_read"), tol=1, default=dflt.total("indexer_read"),
          default_why=f"--indexer-q-tile {Assumptions().indexer_q_tile} (the default); q-tile 1 (every query "
                      f"re-reads every key) gives {q1.total('indexer_read') / 1e12:.0f} TB"),
        F(id="001.prefill.kv_write_chunk", where=w, quantity="main KV written per chunk", note_text="1.7",
          unit="GB", ledger=ch.kv_write),
        F(id="001.prefill.kv_write_total", where=w, quantity="main KV written, 1M", note_text="53.7", unit="GB",
          ledger=p.total("kv_write")),
        F(id="001.prefill.reduction_calls", where=w, quantity="per-layer gather/scatter calls per chunk",
          note_text="156", unit="", ledger=sum(r.calls for r in per_layer)),
        F(id="001.prefill.reduction_calls_total", where=w, quantity="per-layer calls, 32 chunks", note_text="4992",
          unit="", ledger=32 * sum(r.calls for r in per_layer)),
        F(id="001.prefill.a2a_calls_total", where=w, quantity="dispatch + combine calls, 32 chunks",
          note_text="4800", unit="", ledger=32 * sum(r.calls for r in a2a)),
        F(id="001.prefill.msg_chunk", where=w, quantity="one reduction's message, 32K chunk", note_text="403",
          unit="MB", ledger=per_layer[0].message_bytes),
        F(id="001.prefill.msg_156", where=w, quantity="156 reductions of a chunk", note_text="63", unit="GB",
          ledger=_sum_msg(per_layer)),
        F(id="001.prefill.flops_total", where=w, quantity="all prefill FLOPs, 1M", note_text="194", unit="PFLOP",
          ledger=flops, tol=3, reason="" if abs(flops / 1e15 - 194) <= 0.5 else "follows the GEMM + attention line"),
        F(id="001.prefill.compute_lo", where=w, quantity="compute bound at 12 PFLOP/s", note_text="16", unit="s",
          ledger=flops / 12e15, tol=1),
        F(id="001.prefill.compute_hi", where=w, quantity="compute bound at 10 PFLOP/s", note_text="20", unit="s",
          ledger=flops / 10e15, tol=1),
        F(id="001.prefill.indexer_read_bound", where=w, quantity="indexer read over 8 x 4.8 TB/s ('秒级')",
          note_text="1-9", unit="s", ledger=p.total("indexer_read") / (8 * hw.hbm_bw), tol=0),
        F(id="001.prefill.ttft", where=w, quantity="1M TTFT (note 3's estimate) vs the ledger's lower bound",
          note_text="<55", unit="s", ledger=bound,
          default_why="the ledger gives a lower bound (perfect overlap, dense peak); the note's 55-65 s is an "
                      "estimate above it"),
        F(id="001.prefill.cross_chunk", where="把账本用于排障", quantity="share of indexer pairs across chunks",
          note_text="97", unit="%", ledger=p.cross_chunk_share),
    ]


def _layout(c: NoteContext) -> list[Figure]:
    cfg = c.cfg
    d = kv_bytes_per_token_layer(cfg, "fp8_ds_mla")
    e4m3 = kv_bytes_per_token_layer(cfg, "fp8_e4m3")
    w = "KV 布局如何进入账本"
    return [
        F(id="001.layout.fp8_ds_mla", where="数字从哪里来", quantity="fp8_ds_mla bytes/token/layer",
          note_text="656", unit="B", ledger=d),
        F(id="001.layout.fp8_e4m3", where="数字从哪里来", quantity="fp8_e4m3 bytes/token/layer", note_text="576",
          unit="B", ledger=e4m3),
        F(id="001.layout.nvfp4", where="数字从哪里来", quantity="nvfp4_ds_mla bytes/token/layer", note_text="352",
          unit="B", ledger=kv_bytes_per_token_layer(cfg, "nvfp4_ds_mla")),
        F(id="001.layout.indexer", where="数字从哪里来", quantity="indexer bytes/token/layer", note_text="132",
          unit="B", ledger=c.kv().indexer_per_layer),
        F(id="001.layout.scale_share", where=w, quantity="scales' share of 656 B", note_text="2.4", unit="%",
          ledger=16 / d),
        F(id="001.layout.rope_share", where=w, quantity="BF16 rope's share of 656 B ('近五分之一')", note_text="20",
          unit="%", ledger=2 * cfg.qk_rope_head_dim / d, tol=1),
        F(id="001.layout.extra_bytes", where=w, quantity="fp8_ds_mla over fp8_e4m3", note_text="80", unit="B",
          ledger=d - e4m3),
        F(id="001.layout.extra_pct", where=w, quantity="that extra as a share of 576 B", note_text="14", unit="%",
          ledger=(d - e4m3) / e4m3),
        F(id="001.layout.rope_extra", where=w, quantity="rope bytes BF16 vs FP8", note_text="64", unit="B",
          ledger=cfg.qk_rope_head_dim),
        F(id="001.graph.launches", where="CUDA Graph 在账本里的位置", quantity="eager launches per decode step",
          note_text="1000-1999", unit="", ledger=decode_launches(operator_list(cfg, NOTE_DP_EP8, c.asm), c.asm),
          tol=0, reason="at one kernel per operator the 15-operator list gives this many launches; 'over a "
                        "thousand' needs ~1.2 kernels per operator (--assume kernels_per_op)"),
    ]
