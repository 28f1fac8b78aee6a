"""Decode step terms, marginal cost per token, switch points, and the first-request model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.first_request import first_request
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.marginal import marginal, switch_points
from dsaserve.ledger.timeline import STAGES, decode_launches, operator_list

LAT = PRESETS["h200"].nvlink_overhead_s  # the per-collective latency the H200 preset assumes (or measured)
LI = LedgerInputs(load_config("glm-5.3"), Deployment(tp=8, ep=8, dp_attention=True), PRESETS["h200"])


def test_worked_step_terms():
    st = LI.step(32, 131_072)
    assert st.requests_per_gpu == 4  # DP-attention: 32 requests over 8 ranks
    assert st.term("kv").bytes == 4 * 2048 * 656 * 78
    assert st.term("indexer").bytes == 4 * 131_072 * 132 * 21
    assert st.term("moe_a2a").calls == 150
    # this rank's 4 tokens x 8 copies x 6144 x (1 + 2) B x 75 MoE layers, 7/8 of it over NVLink
    assert st.term("moe_a2a").bytes == pytest.approx(75 * 4 * 8 * 6144 * 3 * 7 / 8)
    assert st.term("moe_a2a").time_s == pytest.approx(75 * 4 * 8 * 6144 * 3 * 7 / 8 / 450e9 + 150 * LAT)
    assert st.serial_s == pytest.approx(sum(t.time_s for t in st.terms))
    assert st.overlapped_s <= st.serial_s


def test_only_the_weight_read_amortises_over_the_batch_and_only_the_indexer_grows_with_context():
    small, big = marginal(LI.step(8, 131_072)), marginal(LI.step(256, 131_072))
    assert big.weights_s < small.weights_s
    short, long_ = marginal(LI.step(32, 8192)), marginal(LI.step(32, 2**20))
    assert long_.kv_s > 10 * short.kv_s
    assert long_.weights_s == pytest.approx(short.weights_s) and long_.comm_s == pytest.approx(short.comm_s)


def test_a_step_within_the_top_k_reads_no_indexer_key_and_no_query_weights():
    """GLM-5.3 selects 2048 keys: at 2048 every key is taken unscored (`common/causal.takes_every_key`), at 2049 the
    indexer scores all of them; the weight read drops the 21 full layers' wq_b + weights_proj (replicated)."""
    within, past = LI.step(32, 2048), LI.step(32, 2049)
    assert within.term("indexer").bytes == 0 and "within the top-2048" in within.term("indexer").why
    assert past.term("indexer").bytes == 4 * 2049 * 132 * 21
    assert within.term("kv").bytes == past.term("kv").bytes == 4 * 2048 * 656 * 78
    wq_b = 2048 * 32 * 128 + 16 * 32 * 4  # q_lora x (32 heads x 128) FP8 + its 128 x 128 block scales (FP32)
    weights_proj = 6144 * 32 * 2  # hidden x heads, bf16 (not converted)
    assert past.term("weights").bytes - within.term("weights").bytes == 21 * (wq_b + weights_proj)


def test_switch_points_are_real_crossings():
    pts = {p.name: p for p in switch_points(LI.step, 32, 131_072)}
    b = pts["weight read -> communication"].value
    assert b is not None
    m, before = marginal(LI.step(b, 131_072)), marginal(LI.step(b - 1, 131_072))
    assert m.weights_s <= m.comm_s and before.weights_s > before.comm_s
    c = pts["weight read -> KV + indexer read"].value
    assert c is not None
    assert marginal(LI.step(32, c)).kv_s >= marginal(LI.step(32, c)).weights_s
    assert marginal(LI.step(32, c - 1)).kv_s < marginal(LI.step(32, c - 1)).weights_s


def test_operator_counts_follow_the_config_and_deployment():
    glm = {o.no: o for o in operator_list(load_config("glm-5.3"), Deployment(tp=8), Assumptions())}
    assert (glm[5].decode, glm[9].decode, glm[10].decode, glm[11].decode) == (21, 75, 0, 78)
    ds = {o.no: o for o in operator_list(load_config("deepseek-v3.2"), Deployment(tp=8, ep=8), Assumptions())}
    assert (ds[5].decode, ds[10].decode) == (61, 58)
    ops = operator_list(load_config("glm-5.3"), Deployment(tp=8, ep=8, dp_attention=True), Assumptions())
    assert decode_launches(ops, Assumptions()) == 816
    assert decode_launches(ops, Assumptions(kernels_per_op=1.5)) == 816 * 1.5


def test_first_request_pays_eager_only_above_the_largest_graph_bucket():
    a = Assumptions(cuda_graph_max_bs=8, launch_overhead_s=3e-6, first_request_tokens=100)
    hit = first_request(a, 16, 816, 0.01, 0.02, 0.5)
    miss = first_request(a, 8, 816, 0.01, 0.02, 0.5)
    eager = {p.key: p for p in hit.paths}["eager_decode"]
    assert eager.hit and eager.seconds == pytest.approx(100 * 815 * 3e-6)
    assert not {p.key: p for p in miss.paths}["eager_decode"].hit
    assert hit.first_s - miss.first_s == pytest.approx(eager.seconds)
    assert miss.first_s == pytest.approx(miss.steady_s + 0.48)  # the empty prefix cache


def test_first_request_section_builds_for_a_prompt_without_prefix_hit():
    from dsaserve.ledger.sections_prefill import first_request as section

    li = LedgerInputs(load_config("glm-5.3"), Deployment(tp=8), PRESETS["h200"], Workload(prompt=8192, prefix_hit=0))
    rows = {r["quantity"]: r["value"] for r in section(li).rows}
    assert rows["steady TTFT (prefix hit)"] == pytest.approx(rows["cold TTFT (empty prefix cache)"])


def test_timeline_cites_only_modules_that_exist():
    pkg = Path(__file__).resolve().parents[2] / "dsaserve"
    cited = [(s.no, m) for s in STAGES for m in re.findall(r"[\w/]+\.py|[\w/]+/\*", s.module)]
    assert len(cited) >= 10
    missing = [(no, m) for no, m in cited if not (list(pkg.glob(m)) if "*" in m else (pkg / m).is_file())]
    assert not missing, f"the timeline cites modules that do not exist: {missing}"
    assert not [s.no for s in STAGES if "not built yet" in s.module]  # every stage is built (MTP: engine/mtp.py)
