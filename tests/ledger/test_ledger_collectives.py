"""Collective plans per topology and bytes -> time."""

from __future__ import annotations

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.collective_plan import hidden_reduction_rows, row_time, step_plan, wire_factor
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.hardware import PRESETS

GLM, DS = load_config("glm-5.3"), load_config("deepseek-v3.2")
TP8, DPEP8 = Deployment(tp=8), Deployment(tp=8, ep=8, dp_attention=True)


def test_ring_factors():
    assert wire_factor("all_reduce", 8) == 2 * 7 / 8
    assert wire_factor("all_gather", 8) == wire_factor("reduce_scatter", 8) == 7 / 8
    assert wire_factor("all_to_all", 8) == 1.0
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
    assert by["MoE dispatch (FP8)"].message_bytes == 256 * 8 * 6144
    assert by["MoE combine (BF16)"].message_bytes == 256 * 8 * 6144 * 2
    assert "embedding (vocab-parallel)" not in by
    per_layer = step_plan(GLM, DPEP8, Assumptions(dp_gather="per_layer", dp_embed_allreduce=True), 32)
    assert sum(r.calls for r in per_layer if r.kind in ("all_gather", "reduce_scatter") and r.point[0] != "v") == 156
    assert any(r.point.startswith("embedding") for r in per_layer)


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
    assert wire == pytest.approx(78 * 256 * 6144 * 2 * 1.75 / 450e9 + 78 * 5e-6)
    assert msg == pytest.approx(78 * 256 * 6144 * 2 / 450e9 + 78 * 5e-6)
    assert row_time(row, hw, Assumptions(), "ib") == pytest.approx(78 * 256 * 6144 * 2 * 1.75 / 50e9 + 78 * 15e-6)


def test_ep_must_divide_the_experts():
    from dsaserve.ledger.inputs import LedgerInputs

    with pytest.raises(ValueError, match="--ep: 3 does not divide n_routed_experts 256"):
        LedgerInputs(GLM, Deployment(tp=8, ep=3), PRESETS["h200"])
