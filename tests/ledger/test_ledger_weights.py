"""Weight inventory, per-GPU placement, per-step reads and parameter counts."""

from __future__ import annotations

import glm_arithmetic as g
import pytest

from dsaserve.config import load_config
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.weights import (
    active_params_per_token,
    experts_touched_fraction,
    inventory,
    step_read_per_gpu,
    stored_per_gpu,
)
from dsaserve.weights.spec import checkpoint_specs

GLM = load_config("glm-5.3")


@pytest.mark.parametrize("model", ["glm-5.3", "deepseek-v3.2", "glm-5.3-tiny"])
def test_groups_cover_every_checkpoint_byte(model: str):
    cfg = load_config(model)
    assert inventory(cfg).total_bytes() == sum(t.nbytes for t in checkpoint_specs(cfg))


def test_glm_groups_match_hand_arithmetic():
    inv = inventory(GLM)
    assert inv.expert_bytes == g.EXPERT == 37_757_952
    assert inv.main("experts") == g.EXPERTS_MAIN
    assert inv.total_bytes() == g.CHECKPOINT
    assert inv.total_params(mtp=False) == g.P_MAIN


def test_active_params_glm_40b_and_deepseek_37b():
    assert active_params_per_token(GLM, inventory(GLM)) == g.ACTIVE
    ds = load_config("deepseek-v3.2")
    assert active_params_per_token(ds, inventory(ds)) == pytest.approx(37.5e9, rel=0.01)


def test_tp8_stores_one_eighth_of_experts_and_replicates_the_a_projections():
    s = stored_per_gpu(inventory(GLM), Deployment(tp=8), Assumptions())
    assert s["experts"] == g.EXPERTS_MAIN / 8
    assert s["attn_a"] == 78 * g.ATTN_A
    assert sum(s.values()) == pytest.approx(g.W_TP8)
    assert not any(k.startswith("mtp.") for k in s)  # MTP only with speculation


def test_bf16_absorbed_heads_hold_twice_kv_b_values_and_no_scales():
    """dsaserve's GPU path keeps kv_b as bf16 W_uk / W_uv (`--assume absorbed_heads=bf16`): GLM-5.3's 78 layers of
    64 heads x (192 + 256) x 512 values, 2 B each, in place of their e4m3 bytes and 224 x 4 block scales a layer."""
    values = 64 * (192 + 256) * 512
    dep = Deployment(tp=8, ep=8, dp_attention=True)  # attention replicated: whole kv_b on every rank
    ckpt = stored_per_gpu(inventory(GLM), dep, Assumptions())
    bf16 = stored_per_gpu(inventory(GLM), dep, Assumptions(absorbed_heads="bf16"))
    assert bf16["attn_b"] - ckpt["attn_b"] == 78 * (values - 224 * 4 * 4)
    assert {k: v for k, v in bf16.items() if k != "attn_b"} == {k: v for k, v in ckpt.items() if k != "attn_b"}
    read = step_read_per_gpu(GLM, inventory(GLM), dep, Assumptions(absorbed_heads="bf16"), 32)
    assert read["attn_b"] == bf16["attn_b"]


def test_dp_attention_replicates_attention_and_ep_shards_whole_experts():
    s = stored_per_gpu(inventory(GLM), Deployment(tp=8, ep=8, dp_attention=True), Assumptions())
    assert s["attn_b"] == 78 * g.ATTN_B
    assert s["experts"] == 75 * 32 * g.EXPERT
    assert s["shared"] == 75 * g.SHARED / 8  # moe_dense_tp_size 0 = TP


def test_experts_touched_follow_uniform_routing():
    assert experts_touched_fraction(GLM, 1, "uniform") == pytest.approx(8 / 256)
    assert experts_touched_fraction(GLM, 32, "uniform") == pytest.approx(1 - (1 - 8 / 256) ** 32)
    assert experts_touched_fraction(GLM, 32, "all") == 1.0
    assert experts_touched_fraction(GLM, 0, "uniform") == 0.0


def test_step_read_skips_the_embedding_and_scales_experts():
    dep, asm = Deployment(tp=8, ep=8, dp_attention=True), Assumptions(moe_dense_tp_size=1, expert_routing="all")
    r = step_read_per_gpu(GLM, inventory(GLM), dep, asm, 256)
    assert "embed" not in r
    assert sum(r.values()) == pytest.approx(g.W_DP_READ)
    low = step_read_per_gpu(GLM, inventory(GLM), dep, Assumptions(moe_dense_tp_size=1), 1)
    assert low["experts"] == pytest.approx(g.EXPERTS_MAIN / 8 * 8 / 256)
