"""Layout validation before any weight is read (`distributed/layout.check_layout`): errors name the flag,
the config field and the numbers; the full models pass at TP8 and DP8+EP8 and fit an H200 there (ledger)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources

import pytest

from dsaserve.config import config_from_dict, load_config
from dsaserve.distributed.layout import Layout, check_gpu_count, check_layout
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.weights import inventory, stored_per_gpu

H200_BYTES = 141e9  # the H200's HBM (GB = 1e9)


@pytest.mark.parametrize(("tp", "ep", "dp", "msg"), [
    (3, 1, False, "--tp 3: num_attention_heads 64 is not divisible by 3"),
    (1, 3, False, "--ep 3: n_routed_experts 256 is not divisible by 3"),
    (32, 1, False, r"--tp 32: mlp.shared_experts would keep 64 rows of 2048 per rank \(2048 / 32\), not a "
                   "multiple of the FP8 block 128"),
    (6, 1, False, "--tp 6: num_attention_heads 64 is not divisible by 6"),
    (2, 1, True, "--enable-dp-attention: needs --ep = the world size 2"),
    (0, 1, False, "--tp: must be a positive integer, got 0"),
    (2, 4, False, "--tp 2: must be 1 or the world size 4"),
])
def test_bad_layouts_name_the_flag_field_and_numbers(tp, ep, dp, msg):
    cfg = load_config("glm-5.3")
    with pytest.raises(ValueError, match=msg):
        check_layout(cfg, tp, ep, dp)


def test_fp8_block_alignment_only_binds_the_gpu_path():
    cfg = load_config("glm-5.3-tiny")  # 4 heads x 48 q_b rows: 96 per rank at TP2
    with pytest.raises(ValueError, match=r"--tp 2: self_attn.q_b_proj would keep 96 rows of 192 per rank "
                                         r"\(2 heads x 48\)"):
        check_layout(cfg, 2, 1, keep_fp8=True)
    assert check_layout(cfg, 2, 1, keep_fp8=False).attn_tp == 2
    assert check_layout(cfg, 2, 2, dp_attention=True, keep_fp8=True).attn_tp == 1  # DP: nothing is cut
    assert check_layout(load_config("glm-5.3"), 4, 2).moe_tp == 2  # 1024-row expert parts: whole blocks


def test_more_ranks_than_gpus_names_both_counts():
    assert check_gpu_count(Layout(8, 8, True), visible=8) == 8
    assert check_gpu_count(Layout(8, 8), visible=4, nnodes=2) == 4
    with pytest.raises(ValueError, match=r"--tp 8 --ep 8 --enable-dp-attention: needs 8 GPUs per node \(8 ranks "
                                         r"over 1 node\(s\)\), this node sees 2"):
        check_gpu_count(Layout(8, 8, True), visible=2)
    with pytest.raises(ValueError, match="--nnodes 3: does not divide the 8 ranks"):
        check_gpu_count(Layout(8, 1), visible=8, nnodes=3)


@pytest.mark.parametrize("name", ["glm-5.3", "deepseek-v3.2"])
@pytest.mark.parametrize(("dep", "asm"), [
    (Deployment(tp=8), Assumptions(speculative=True)),
    (Deployment(tp=8, ep=8, dp_attention=True), Assumptions(dp_moe="a2a", speculative=True)),
], ids=["tp8", "dp8_ep8"])
def test_full_models_pass_validation_and_fit_an_h200(name, dep, asm):
    cfg = load_config(name)
    check_layout(cfg, dep.tp, dep.ep, dep.dp_attention, keep_fp8=True)
    per_gpu = sum(stored_per_gpu(inventory(cfg), dep, asm).values())  # MTP layer included
    assert per_gpu < H200_BYTES, (name, dep.topology, per_gpu / 1e9)


def test_check_layout_needs_no_torch():
    code = ("import sys; from dsaserve.distributed.layout import Layout, check_gpu_count, check_layout; "
            "from dsaserve.config import load_config; check_layout(load_config('glm-5.3'), 8, 8, True); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


GiB = 1 << 30
H200_TOTAL_GIB, MEM_FRACTION, GRAPH_RESERVE_GIB = 139, 0.88, 1
ACTIVATIONS_GIB = 12  # assumed peak of the memory profile (the slice measured 10.7 GiB at a 32K chunk)
X2_LAYOUTS = [(Deployment(tp=2, ep=2, dp_attention=True), Assumptions(dp_moe="a2a", speculative=True)),
              (Deployment(tp=2, ep=2), Assumptions(speculative=True))]


def _kv_pool_gib(cfg, dep, asm) -> float:
    """The memory profile's formula with the ledger's weights per GPU (the MTP layer loaded)."""
    weights = sum(stored_per_gpu(inventory(cfg), dep, asm).values())
    return (H200_TOTAL_GIB * MEM_FRACTION - GRAPH_RESERVE_GIB - ACTIVATIONS_GIB) - weights / GiB


def test_glm_x2_keeps_glm_shapes_and_leaves_40_gib_of_kv_per_h200_at_ep2():
    x2, full = load_config("glm-5.3-x2"), load_config("glm-5.3")
    same = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "index_topk",
            "first_k_dense_replace", "vocab_size")
    assert {k: getattr(x2, k) for k in same} == {k: getattr(full, k) for k in same}
    assert x2.indexer_types == full.indexer_types[: x2.num_hidden_layers]  # full/shared pattern kept
    for dep, asm in X2_LAYOUTS:
        check_layout(x2, dep.tp, dep.ep, dep.dp_attention, keep_fp8=True)
        assert _kv_pool_gib(x2, dep, asm) >= 40, dep.topology
    # as many layers as fit: one more leaves DP-attention2+EP2 under 40 GiB
    raw = json.loads((resources.files("dsaserve.configs") / "glm-5.3-x2.json").read_text())
    bigger = config_from_dict(raw | {"num_hidden_layers": x2.num_hidden_layers + 1})
    assert _kv_pool_gib(bigger, *X2_LAYOUTS[0]) < 40
