"""Collective plans per topology and bytes -> time."""

from __future__ import annotations

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.collective_plan import a2a_tokens, hidden_reduction_rows, row_time, step_plan, wire_factor
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.hardware import PRESETS

LAT = PRESETS["h200"].nvlink_overhead_s  # the per-collective latency the H200 preset assumes (or measured)
GLM, DS = load_config("glm-5.3"), load_config("deepseek-v3.2")
TP8, DPEP8 = Deployment(tp=8), Deployment(tp=8, ep=8, dp_attention=True)


def test_ring_factors():
    assert wire_factor("all_reduce", 8) == 2 * 7 / 8
    assert wire_factor("all_gather", 8) == wire_factor("reduce_scatter", 8) == 7 / 8
    assert wire_factor("all_to_all", 8) == 7 / 8  # 1/8 of the (token, expert) copies stay on the rank
    assert wire_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="broadcastx"):
        wire_factor("broadcastx", 8)


def test_pure_tp_glm_has_157_hidden_reductions_plus_one_logits_gather():
    plan = step_plan(GLM, TP8, Assumptions(), 256)
    red = hidden_reduction_rows(plan)
    assert sum(r.calls for r in red) == 1 + 78 + 78
    assert {r.message_bytes for r in red} == {256 * 6144 * 2}
    gather = [r for r in plan if r.point.startswith("vocab")]
    assert gather[0].message_bytes == 256 * 154_880 * 4 and gather[0].wire_bytes == 256 * 154_880 * 4 * 7 / 8


def test_dp_attention_ep8_table_rows():
    plan = step_plan(GLM, DPEP8, Assumptions(), 256)
    by = {r.point: r for r in plan}
    assert by["DP all-gather of hidden states"].calls == 1
    assert by["attention output reduce-scatter"].calls == 78
    assert by["dense-layer MLP all-reduce"].calls == 3
    assert by["MoE dispatch (FP8)"].calls == by["MoE combine (BF16)"].calls == 75
    # one rank dispatches only its own ceil(256/8) = 32 tokens' copies
    assert by["MoE dispatch (FP8)"].message_bytes == 32 * 8 * 6144
    assert by["MoE combine (BF16)"].message_bytes == 32 * 8 * 6144 * 2
    notes = {r.point: r for r in step_plan(GLM, DPEP8, Assumptions(a2a_count="deployment"), 256)}
    assert notes["MoE dispatch (FP8)"].message_bytes == 256 * 8 * 6144  # the notes' table: all b tokens
    assert "embedding (vocab-parallel)" not in by
    per_layer = step_plan(GLM, DPEP8, Assumptions(dp_gather="per_layer", dp_embed_allreduce=True), 32)
    assert sum(r.calls for r in per_layer if r.kind in ("all_gather", "reduce_scatter") and r.point[0] != "v") == 156
    assert any(r.point.startswith("embedding") for r in per_layer)


def test_dsaserve_dp_attention_is_three_all_to_alls_per_moe_layer_and_replicates_the_rest():
    """dp_moe=a2a (the engine's DP-attention): count exchange + dispatch (row + 8 B of routing) + combine."""
    from dsaserve.ledger.weights import inventory, stored_per_gpu

    asm = Assumptions(dp_moe="a2a")
    by = {r.point: r for r in step_plan(GLM, DPEP8, asm, 256)}
    assert set(by) == {"MoE count exchange", "MoE dispatch (+ expert id, weight)", "MoE combine"}
    assert {r.calls for r in by.values()} == {75} and {r.kind for r in by.values()} == {"all_to_all"}
    assert by["MoE count exchange"].message_bytes == 8 * 8 * 8
    assert by["MoE dispatch (+ expert id, weight)"].message_bytes == 256 * 8 * (6144 * 1 + 8)
    assert by["MoE combine"].message_bytes == 256 * 8 * 6144 * 2
    assert sum(r.calls for r in step_plan(GLM, DPEP8, asm, 0, mtp=True)) == 3 * 76  # idle ranks: same calls
    stored = stored_per_gpu(inventory(GLM), DPEP8, asm)
    full = inventory(GLM).bytes
    assert all(stored[g] == full[g] for g in stored if g != "experts")
    assert stored["experts"] == full["experts"] / 8


def test_deepseek_v32_tp8_reductions_follow_its_61_layers():
    red = hidden_reduction_rows(step_plan(DS, TP8, Assumptions(), 1))
    assert sum(r.calls for r in red) == 1 + 61 + 61
    assert {r.message_bytes for r in red} == {7168 * 2}


def test_one_rank_issues_no_collective():
    assert step_plan(GLM, Deployment(tp=1), Assumptions(), 64) == []


def test_wire_basis_vs_message_basis():
    hw = PRESETS["h200"]
    row = hidden_reduction_rows(step_plan(GLM, TP8, Assumptions(), 256))[1]  # 78 attention all-reduces
    wire = row_time(row, hw, Assumptions())
    msg = row_time(row, hw, Assumptions(comm_basis="message"))
    assert wire == pytest.approx(78 * 256 * 6144 * 2 * 1.75 / 450e9 + 78 * LAT)
    assert msg == pytest.approx(78 * 256 * 6144 * 2 / 450e9 + 78 * LAT)
    assert row_time(row, hw, Assumptions(), "ib") == pytest.approx(78 * 256 * 6144 * 2 * 1.75 / 50e9 + 78 * 15e-6)


def test_ep_must_divide_the_experts():
    from dsaserve.ledger.inputs import LedgerInputs

    with pytest.raises(ValueError, match="--ep 3: n_routed_experts 256 is not divisible by 3"):
        LedgerInputs(GLM, Deployment(tp=8, ep=3), PRESETS["h200"])


def test_tp_must_split_the_model_as_the_engine_splits_it():
    """The engine's rule (distributed/layout.check_divisions): heads, dense MLPs, vocab and experts divide exactly."""
    from dsaserve.ledger.inputs import LedgerInputs

    with pytest.raises(ValueError, match="--tp 6: num_attention_heads 64 is not divisible by 6"):
        LedgerInputs(GLM, Deployment(tp=6), PRESETS["h200"])
    LedgerInputs(GLM, Deployment(tp=4, ep=8, n_gpus=8), PRESETS["h200"])  # a layout the engine lacks, still exact


def test_dispatch_counts_one_ranks_own_tokens():
    asm = Assumptions()
    assert a2a_tokens(DPEP8, asm, 32) == 4  # DP-attention: 32 requests over 8 ranks
    assert a2a_tokens(DPEP8, asm, 33) == 5  # the busiest rank holds ceil(33/8)
    assert a2a_tokens(DPEP8, asm, 32768, one_request=True) == 32768  # one request's prefill chunk: one rank
    assert a2a_tokens(Deployment(tp=8, ep=8), asm, 33) == 5  # TP attention: tokens scattered over the EP group
    assert a2a_tokens(DPEP8, Assumptions(a2a_count="deployment"), 33) == 33


def test_worked_step_dispatch_and_combine_per_gpu():
    # `dsaserve ledger --tp 8 --ep 8 --dp-attention --batch 32`: one rank sends 75 layers x 4 tokens x 8 copies
    # x 6144 x (1 + 2) B, and 7/8 of it leaves the GPU
    a2a = [r for r in step_plan(GLM, DPEP8, Assumptions(), 32) if r.kind == "all_to_all"]
    assert sum(r.total_message for r in a2a) == 75 * 4 * 8 * 6144 * 3 == 44_236_800
    assert sum(r.wire_bytes for r in a2a) == pytest.approx(44_236_800 * 7 / 8)
    t = sum(row_time(r, PRESETS["h200"], Assumptions()) for r in a2a)
    assert t == pytest.approx(38_707_200 / 450e9 + 150 * LAT)  # 0.836 ms, not 1.536 ms


def test_dsaserve_padded_dp_attention_gathers_and_scatters_every_ranks_padded_rows():
    """dp_moe=padded (the engine's graph-safe DP decode): per MoE layer one all-gather and one reduce-scatter of
    dp x padded rows, the same on every rank whatever its own count; weights as under a2a."""
    from dsaserve.ledger.weights import inventory, stored_per_gpu

    asm = Assumptions(dp_moe="padded")
    by = {r.kind: r for r in step_plan(GLM, DPEP8, asm, 30, rank_rows=8)}  # 30 tokens, busiest rank padded to 8
    assert set(by) == {"all_gather", "reduce_scatter"} and {r.calls for r in by.values()} == {75}
    assert by["all_gather"].message_bytes == by["reduce_scatter"].message_bytes == 8 * 8 * 6144 * 2
    assert by["all_gather"].wire_bytes == pytest.approx(75 * 8 * 8 * 6144 * 2 * 7 / 8)
    even = {r.kind: r for r in step_plan(GLM, DPEP8, asm, 30)}  # default: ceil(30 / 8) = 4 rows per rank
    assert even["all_gather"].message_bytes == 8 * 4 * 6144 * 2
    assert sum(r.calls for r in step_plan(GLM, DPEP8, asm, 0, mtp=True, rank_rows=1)) == 2 * 76
    assert stored_per_gpu(inventory(GLM), DPEP8, asm) == stored_per_gpu(inventory(GLM), DPEP8,
                                                                        Assumptions(dp_moe="a2a"))
