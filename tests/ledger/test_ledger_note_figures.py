"""Every figure of the two design notes: the note's value, the ledger's value, and whether they agree.

Each row of EXPECTED states the note's number (as the note writes it), the ledger's value written out as
independent arithmetic (tests/ledger/glm_arithmetic.py and the products below), and the status. Where the
note's own arithmetic is off (units, layouts, a mis-multiplied product) the row pins the ledger's value
and the figure must carry the reason the report prints.
"""

from __future__ import annotations

import math
from dataclasses import replace

import glm_arithmetic as g
import pytest

from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.note_catalogue import note_figures
from dsaserve.ledger.notes import UNITS, Figure

LAT = PRESETS["h200"].nvlink_overhead_s  # the per-collective latency the H200 preset assumes (or measured)
NV, IB, HBM = 787.5e9, 25e9, 4.8e12  # the notes' NVLink "ring effective", IB, and HBM bandwidths
W_DP, V, H = g.W_DP_READ, g.V, g.H
POOL85, POOL95 = 0.85 * 141e9 - g.W_TP8, 0.95 * 141e9 - g.W_TP8
TOK_GPU = math.floor(POOL85 / (53_940 / 8 * 64)) * 64
LAUNCHES = 1 + 6 * 78 + 2 * 21 + 3 * 75 + 78 + 2  # operator list: embed + per-layer ops + lm_head + sample

# worked step (batch 32, 128K) under the note's inputs, as the ledger sums it for the shares: one GPU of the
# DP-attention deployment attends ceil(32/8) = 4 requests and dispatches its own 4 tokens' copies
REQ = 4
_T = {"dp": 156 * 32 * H * 2 / NV + 156 * 5e-6, "a2a": 75 * REQ * 8 * H * 3 / NV,
      "kv": REQ * 2048 * 656 * 78 / HBM, "idx": REQ * 131_072 * 132 * 21 / HBM, "w": W_DP / HBM, "lm": 32 * V * 4 / NV}
_STEP = sum(_T.values())
# the note's own times of that table (ms): its '<15 %' checked against them
NOTE_REST = (0.078 + 0.8 + 0.43 + 0.6 + 2.4 + 0.02) / (0.078 + 0.8 + 0.43 + 0.6 + 2.4 + 0.02 + 23)
GLM4_V = 151_552  # GLM-4's vocabulary

# id: (note text as written, the ledger's value in SI units or None if only bounds are checked, status)
EXPECTED: dict[str, tuple[str, float | None, str]] = {
    "001.model.total_params": ("744", g.P_MAIN, "agrees"),
    "001.model.active_params": ("40", g.ACTIVE, "agrees"),
    "001.model.layers": ("78", 78, "agrees"),
    "001.model.hidden": ("6144", 6144, "agrees"),
    "001.model.experts": ("256", 256, "agrees"),
    "001.model.experts_per_token": ("8", 8, "agrees"),
    "001.model.routed_expert_params": ("724", 75 * 256 * 3 * 2048 * 6144, "agrees"),
    "001.ops.a_proj_width": ("2624", 2048 + 512 + 64, "agrees"),
    "001.ops.q_up_width": ("16384", 64 * 256, "agrees"),
    "001.ops.indexer_layers": ("21", 21, "agrees"),
    "001.ops.moe_layers": ("75", 75, "agrees"),
    "001.sched.chunks_1m": ("32", 32, "agrees"),
    "001.sched.reserve_1m": ("57", 53_940 * g.G, "agrees"),
    "001.batch.block_table_ids": ("524288", 256 * 2048, "agrees"),
    "001.batch.block_table_bytes": ("100-999", 256 * 2048 * 4, "differs"),
    "001.kv.pages_100k": ("1563", 1563, "agrees"),
    "001.kv.full_pages_100k": ("1563", 1562, "differs"),
    "001.prefix.hashes_19k": ("300", 296, "agrees"),
    "001.prefix.prefill_tokens": ("1", 20_000 - 296 * 64, "differs"),
    "001.embed.rows_per_rank": ("19360", 154_880 // 8, "agrees"),
    "001.embed.msg_b256": ("3", 256 * H * 2, "agrees"),
    "001.embed.msg_chunk32k": ("400", 32768 * H * 2, "agrees"),
    "001.coll.tp_calls": ("157", 1 + 78 + 78, "agrees"),
    "001.coll.dp_calls": ("82", 1 + 78 + 3, "agrees"),
    "001.coll.tp8_b256_bytes": ("494", 157 * 256 * H * 2, "agrees"),
    "001.coll.tp8_b256_nvlink": ("0.63", 157 * 256 * H * 2 / NV, "agrees"),
    "001.coll.dp_b256_bytes": ("261", 82 * 256 * H * 2, "differs"),
    "001.coll.dp_b256_nvlink": ("0.33", 82 * 256 * H * 2 / NV, "agrees"),
    "001.coll.dispatch_layer_b256": ("12.6", 256 * 8 * H, "agrees"),
    "001.coll.combine_layer_b256": ("25.2", 256 * 8 * H * 2, "agrees"),
    "001.coll.a2a_step_b256": ("2.83", 75 * 256 * 8 * H * 3, "agrees"),
    "001.coll.a2a_step_nvlink": ("3.6", 75 * 256 * 8 * H * 3 / NV, "agrees"),
    "001.pd.main_per_token": ("51.2", 78 * 656, "agrees"),
    "001.pd.main_1m": ("53.7", 78 * 656 * g.G, "agrees"),
    "001.pd.indexer_1m": ("2.9", 21 * 132 * g.G, "agrees"),
    "001.pd.total_1m": ("56.6", 53_940 * g.G, "agrees"),
    "001.ep.experts_per_gpu": ("91", g.EXPERTS_MAIN / 8, "agrees"),
    "001.b2t.b1_bytes": ("1.9", 157 * H * 2, "agrees"),
    "001.b2t.b1_nvlink": ("2", 157 * H * 2 / NV, "agrees"),
    "001.b2t.b1_ib": ("77", 157 * H * 2 / IB, "agrees"),
    "001.b2t.b256_ib": ("20", 157 * 256 * H * 2 / IB, "agrees"),
    "001.b2t.ep_layer_bytes": ("38", 256 * 8 * H * 3, "agrees"),
    "001.b2t.ep_layer_nvlink": ("48", 256 * 8 * H * 3 / NV, "agrees"),
    "001.b2t.ep_layer_ib": ("1.5", 256 * 8 * H * 3 / IB, "agrees"),
    "001.b2t.b1_overhead_lo": ("0.5", 157 * 3e-6, "agrees"),
    "001.b2t.b1_overhead_hi": ("0.8", 157 * 5e-6, "agrees"),
    "001.tp2.allreduce_ratio": ("4", (2 * 1 / 2) / (2 * 7 / 8), "differs"),
    "001.worked.dp_bytes": ("61", 156 * 32 * H * 2, "agrees"),
    "001.worked.dp_calls": ("156", 156, "agrees"),
    "001.worked.dp_time": ("78", 156 * 32 * H * 2 / NV, "agrees"),
    "001.worked.dp_launch": ("0.8", 156 * 5e-6, "agrees"),
    "001.worked.a2a_bytes": ("339", 75 * 32 * 8 * H * 3, "differs"),
    "001.worked.a2a_calls": ("150", 150, "agrees"),
    "001.worked.a2a_time": ("0.43", 75 * 32 * 8 * H * 3 / NV, "differs"),
    "001.worked.kv_per_token": ("92", 2048 * 656 * 78, "differs"),
    "001.worked.kv_step": ("2.9", REQ * 2048 * 656 * 78, "differs"),
    "001.worked.kv_time": ("0.6", REQ * 2048 * 656 * 78 / HBM, "differs"),
    "001.worked.idx_per_token": ("352", 131_072 * 132 * 21, "differs"),
    "001.worked.idx_step": ("11.3", REQ * 131_072 * 132 * 21, "differs"),
    "001.worked.idx_time": ("2.4", REQ * 131_072 * 132 * 21 / HBM, "differs"),
    "001.worked.replicated": ("18", g.REPLICATED, "differs"),
    "001.worked.weights": ("109", W_DP, "differs"),
    "001.worked.weights_time": ("23", W_DP / HBM, "agrees"),
    "001.worked.lm_bytes": ("17", 32 * V * 4 * 7 / 8, "agrees"),
    "001.worked.lm_time": ("20", 32 * V * 4 * 7 / 8 / NV, "agrees"),
    "001.worked.weights_share": ("85", _T["w"] / _STEP, "differs"),
    "001.worked.indexer_share": ("10", _T["idx"] / _STEP, "differs"),
    "001.worked.rest_share": ("<15", 1 - _T["w"] / _STEP, "differs"),
    "001.marginal.tp_per_token": ("1.9", 157 * H * 2, "agrees"),
    "001.marginal.dp_per_token": ("1", 82 * H * 2, "agrees"),
    "001.marginal.a2a_per_token": ("11", 75 * 8 * H * 3, "agrees"),
    "001.marginal.steps_per_s": ("44", HBM / W_DP, "agrees"),
    "001.marginal.weights_b32": ("3.4", W_DP / 32, "agrees"),
    "001.marginal.weights_b256": ("425", W_DP / 256, "agrees"),
    "001.marginal.idx_1m": ("2.8", 21 * 132 * g.G, "differs"),
    "001.marginal.idx_1m_time": ("0.6", 21 * 132 * g.G / HBM, "agrees"),
    "001.marginal.idx_1m_b4": ("11.2", 4 * 21 * 132 * g.G, "differs"),
    "001.marginal.kv_budget": ("250", 8 * POOL85, "differs"),
    "001.marginal.requests_1m": ("4", TOK_GPU // g.G, "differs"),
    "001.lm.b192_bytes": ("102", 192 * V * 4 * 7 / 8, "differs"),
    "001.lm.b192_time": ("0.13", 192 * V * 4 * 7 / 8 / NV, "agrees"),
    "001.lm.b16_bytes": ("8.5", 16 * V * 4 * 7 / 8, "differs"),
    "001.idx.reuse_factor": ("3.7", 78 / 21, "agrees"),
    "001.idx.saved_share": ("75", 57 / 78, "agrees"),
    "001.idx.per_layer_1m": ("132", 132 * g.G, "differs"),
    "001.idx.total_1m": ("2.8", 21 * 132 * g.G, "differs"),
    "001.prefill.gemm_chunk": ("3.1", g.PREFILL_GEMM_CHUNK, "differs"),
    "001.prefill.gemm_total": ("100", g.PREFILL_GEMM_TOTAL, "differs"),
    "001.prefill.indexer_total": ("94", g.INDEXER_FLOPS, "agrees"),
    "001.prefill.indexer_read": ("47", g.INDEXER_READ_Q32, "agrees"),
    "001.prefill.kv_write_chunk": ("1.7", 32768 * 78 * 656, "agrees"),
    "001.prefill.kv_write_total": ("53.7", g.G * 78 * 656, "agrees"),
    "001.prefill.reduction_calls": ("156", 156, "agrees"),
    "001.prefill.reduction_calls_total": ("4992", 156 * 32, "agrees"),
    "001.prefill.a2a_calls_total": ("4800", 150 * 32, "agrees"),
    "001.prefill.msg_chunk": ("403", 32768 * H * 2, "agrees"),
    "001.prefill.msg_156": ("63", 156 * 32768 * H * 2, "agrees"),
    "001.prefill.flops_total": ("194", g.PREFILL_GEMM_TOTAL + g.INDEXER_FLOPS, "differs"),
    "001.prefill.compute_lo": ("16", (g.PREFILL_GEMM_TOTAL + g.INDEXER_FLOPS) / 12e15, "agrees"),
    "001.prefill.compute_hi": ("20", (g.PREFILL_GEMM_TOTAL + g.INDEXER_FLOPS) / 10e15, "agrees"),
    "001.prefill.indexer_read_bound": ("1-9", g.INDEXER_READ_Q32 / (8 * HBM), "agrees"),
    "001.prefill.ttft": ("<55", None, "agrees"),
    "001.prefill.cross_chunk": ("97", 1 - 32 * g.keys(32768) / g.keys(g.G), "agrees"),
    "001.layout.fp8_ds_mla": ("656", 512 + 4 * 4 + 64 * 2, "agrees"),
    "001.layout.fp8_e4m3": ("576", 576, "agrees"),
    "001.layout.nvfp4": ("352", 512 // 2 + 512 // 16 + 64, "agrees"),
    "001.layout.indexer": ("132", 128 + 4, "agrees"),
    "001.layout.scale_share": ("2.4", 16 / 656, "agrees"),
    "001.layout.rope_share": ("20", 128 / 656, "agrees"),
    "001.layout.extra_bytes": ("80", 656 - 576, "agrees"),
    "001.layout.extra_pct": ("14", 80 / 576, "agrees"),
    "001.layout.rope_extra": ("64", 128 - 64, "agrees"),
    "001.graph.launches": ("1000-1999", LAUNCHES, "differs"),
    **{f"000.model.{k}": (str(v), v, "agrees") for k, v in {
        "hidden_size": 6144, "num_hidden_layers": 78, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_intermediate_size": 2048, "num_attention_heads": 64, "q_lora_rank": 2048,
        "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "MTP_layer_index": 78}.items()},
    "000.weights.on_disk": ("700-799", g.CHECKPOINT, "agrees"),
    "000.ep.experts_per_rank": ("32", 256 // 8, "agrees"),
    "000.ep.matrix_bytes": ("12.6", 2048 * 6144, "agrees"),
    "000.ep.expert_bytes": ("37.7", g.EXPERT, "agrees"),
    "000.ep.layer_experts": ("1.2", 32 * g.EXPERT, "agrees"),
    "000.mtp.eh_proj_in": ("12288", 2 * 6144, "agrees"),
    "000.kv.main_per_layer": ("656", 656, "agrees"),
    "000.kv.described_layout": ("584", 656, "differs"),
    "000.kv.indexer_per_layer": ("132", 132, "agrees"),
    "000.kv.main_per_token": ("51168", 78 * 656, "agrees"),
    "000.kv.indexer_per_token": ("2772", 21 * 132, "agrees"),
    "000.kv.per_token": ("53940", 78 * 656 + 21 * 132, "agrees"),
    "000.kv.request_1m": ("53.9", 53_940 * g.G, "differs"),
    "000.prefill.main_1m": ("53.9", 51_168 * g.G, "differs"),
    "000.prefill.indexer_1m": ("2.8", 2772 * g.G, "differs"),
    "000.cap.weights_per_gpu": ("93", g.W_TP8, "differs"),
    "000.cap.pool_per_gpu": ("20-30", POOL85, "agrees"),
    "000.cap.bytes_per_token_gpu": ("6742", 53_940 / 8, "agrees"),
    "000.cap.tokens_20gb": ("3", 20e9 / (53_940 / 8), "agrees"),
    "000.cap.tokens_30gb": ("4", 30e9 / (53_940 / 8), "differs"),
    "000.cap.cluster_tokens": ("24-32", TOK_GPU, "differs"),
    "000.cap.request_per_gpu": ("6.7", 53_940 / 8 * g.G, "differs"),
    "000.cap.requests_fit": ("2-9", TOK_GPU // g.G, "agrees"),
    "000.case3.pool_shrink": ("10", 1 - POOL85 / POOL95, "differs"),
    "000.first.pages_8k": ("128", 8192 // 64, "agrees"),
    "000.first.chunks_1m": ("32", 32, "agrees"),
    "000.first.eager_ms_lo": ("3", LAUNCHES * 3e-6, "differs"),
    "000.first.eager_ms_hi": ("5", LAUNCHES * 5e-6, "differs"),
    "000.first.eager_100_tokens": ("100-999", 100 * LAUNCHES * 4e-6, "agrees"),
    "000.case2.tpot_step": ("2-3", LAUNCHES * 3e-6, "agrees"),
}

FIGURES = {f.id: f for f in note_figures()}


def test_every_figure_of_both_notes_has_an_expected_row_and_vice_versa():
    assert set(FIGURES) == set(EXPECTED)
    assert {f.note for f in FIGURES.values()} == {"000", "001"}


@pytest.mark.parametrize("fid", sorted(EXPECTED))
def test_note_figure(fid: str):
    note_text, ledger, status = EXPECTED[fid]
    f: Figure = FIGURES[fid]
    assert f.note_text == note_text, f"{fid}: the note says {f.note_text}, expected {note_text}"
    if ledger is not None:
        assert f.ledger == pytest.approx(ledger, rel=1e-9), \
            f"{fid}: note {note_text} {f.unit}, ledger {f.ledger / UNITS[f.unit]:.6g} {f.unit}, " \
            f"hand arithmetic {ledger / UNITS[f.unit]:.6g}"
    assert f.status == status, f"{fid}: note {note_text} {f.unit} vs ledger {f.ledger_in_unit():.6g} -> {f.status}"
    if status == "differs":
        assert f.reason, f"{fid}: a figure that differs must say why"


def test_ttft_lower_bound_sits_below_the_notes_55_to_65_s_estimate_and_above_the_compute_bound():
    f = FIGURES["001.prefill.ttft"]
    flops = g.PREFILL_GEMM_TOTAL + g.INDEXER_FLOPS
    assert flops / (8 * 1979e12) * 0.9 < f.ledger < 55.0


def test_figures_that_depend_on_the_ledgers_own_conventions_also_carry_the_default():
    # TP8 b=256 reductions: the note's 0.63 ms is message bytes / 787 GB/s; the ledger's default is ring wire bytes
    f = FIGURES["001.coll.tp8_b256_nvlink"]
    assert f.default == pytest.approx(157 * 256 * H * 2 * 1.75 / 450e9 + 157 * LAT)



def test_docs_list_every_figure_that_differs():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "LEDGER.md").read_text()
    missing = [f.id for f in FIGURES.values() if not f.agrees and f"`{f.id}`" not in doc]
    assert not missing, f"docs/LEDGER.md lacks the differing figures {missing}"


def test_dispatch_and_combine_defaults_are_one_ranks_own_tokens():
    # the note's table counts all b tokens' copies; one DP rank sends its ceil(b/8) tokens', 7/8 of them off the GPU
    worked = FIGURES["001.worked.a2a_time"]
    assert worked.default == pytest.approx(75 * 4 * 8 * H * 3 * 7 / 8 / 450e9 + 150 * LAT)  # 0.836 ms
    assert FIGURES["001.worked.a2a_bytes"].default == pytest.approx(75 * 4 * 8 * H * 3 * 7 / 8)
    b256 = FIGURES["001.coll.a2a_step_nvlink"]
    assert b256.default == pytest.approx(75 * 32 * 8 * H * 3 * 7 / 8 / 450e9 + 150 * LAT)


def test_worked_step_reads_report_the_notes_own_8x():
    for fid in ("kv_step", "kv_time", "idx_step", "idx_time", "indexer_share", "weights_share"):
        f = FIGURES[f"001.worked.{fid}"]
        assert "ceil(32/8) = 4 requests" in f.reason and "(8x)" in f.reason, fid
    # the note's 2.4 ms is 32 requests x 352 MB / 4.8 TB/s; one GPU reads 4 requests' keys (of 132 B)
    assert FIGURES["001.worked.idx_time"].ledger == pytest.approx(4 * 131_072 * 132 * 21 / HBM)
    assert FIGURES["001.worked.idx_time"].ledger < 2.4e-3 / 7


def test_rest_share_differs_because_the_notes_own_times_give_15_8_percent():
    f = FIGURES["001.worked.rest_share"]
    assert f.note_own == pytest.approx(NOTE_REST) and round(NOTE_REST, 3) == 0.158
    lo, hi = f.bounds
    assert lo <= f.ledger <= hi  # one GPU's 5.6 % sits under 15 % ...
    assert not f.consistent and f.status == "differs"  # ... but the note's '<15 %' contradicts its own times
    assert "15.8%" in f.reason


def test_indexer_read_default_is_the_default_q_tile_and_names_q_tile_1():
    from dsaserve.ledger.sections_notes import notes_check

    f = FIGURES["001.prefill.indexer_read"]
    assert f.default == pytest.approx(g.INDEXER_READ_Q32)  # q-tile 32: 47.62 TB, what prefill_totals prints
    why = notes_check([f]).rows[0]["why"]
    assert round(g.INDEXER_READ_Q32 / 1e12, 2) == 47.62 and "ledger default 47.62 TB" in why
    assert f"{g.INDEXER_READ_Q32 * 32 / 1e12:.0f} TB" in why  # q-tile 1: 1524 TB, labelled as such


def test_lm_head_figures_match_glm4s_vocabulary_exactly():
    hand = {"001.lm.b192_bytes": 192 * GLM4_V * 4 * 7 / 8, "001.lm.b16_bytes": 16 * GLM4_V * 4 * 7 / 8,
            "001.lm.b192_time": 192 * GLM4_V * 4 * 7 / 8 / NV, "001.worked.lm_bytes": 32 * GLM4_V * 4 * 7 / 8}
    for fid, value in hand.items():
        assert replace(FIGURES[fid], ledger=value).agrees, f"{fid}: {value} outside the note's {FIGURES[fid].bounds}"
    for fid in ("001.lm.b192_bytes", "001.lm.b16_bytes"):
        assert "151,552 (GLM-4's)" in FIGURES[fid].reason and f"{hand['001.lm.b16_bytes'] / 1e6:.2f} MB" \
            in FIGURES[fid].reason


def test_replicated_and_request_1m_reasons_add_up():
    rep = FIGURES["001.worked.replicated"].reason
    assert f"{g.REPLICATED / 1e9:.2f} + {g.LM_HEAD / 1e9:.2f} = {(g.REPLICATED + g.LM_HEAD) / 1e9:.2f} GB" in rep
    assert "18.73 GB" in rep
    assert "10^6 against 2^20 tokens" in FIGURES["000.kv.request_1m"].reason
    # the whole gap: the ledger's bytes per token over 10^6 tokens instead of 2^20 give the note's 53.9 GB
    req = FIGURES["000.kv.request_1m"]
    assert req.ledger == 53_940 * g.G and replace(req, ledger=req.ledger / g.G * 10**6).agrees
