"""Layout validation before any weight is read (`distributed/layout.check_layout`): errors name the flag,
the config field and the numbers; the full models pass at TP8 and DP8+EP8 and fit an H200 there (ledger)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsaserve.config import load_config
from dsaserve.distributed.layout import check_layout
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
    code = ("import sys; from dsaserve.distributed.layout import check_layout; "
            "from dsaserve.config import load_config; check_layout(load_config('glm-5.3'), 8, 8, True); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
