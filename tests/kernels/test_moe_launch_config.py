"""Which kernel and tiles `fused_moe` takes for a batch (`triton_moe.launch_config`, on the CPU: nothing launched):
the unsorted swap-AB kernel up to UNSORTED_MAX_PAIRS pairs, the sorted swap-AB kernel above, the A-operand kernel's
wide tiles once the experts are busy (BUSY_EXPERT_PAIRS an expert; FP8 activations, no kernel named, no other rank's
pairs), the dense prefill path from PREFILL_MIN_PAIRS; a caller's config over all of it."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from dsaserve.kernels import triton_moe as M  # noqa: E402


def test_few_pairs_take_the_unsorted_swap_kernel():
    cfg = M.launch_config(8, 32, True)
    assert cfg["kernel"] == "unsorted" and cfg["block_m"] == 16 and cfg["fp8_act"]


def test_pairs_past_the_unsorted_limit_take_the_sorted_swap_kernel():
    pairs = M.UNSORTED_MAX_PAIRS + 8
    cfg = M.launch_config(pairs, 32, True)  # ~8 pairs an expert
    assert cfg["kernel"] == "swap" and cfg["block_m"] == 16
    assert M.launch_config(16 * 32, 32, True)["block_m"] == 32  # 16 an expert: 32-pair blocks


@pytest.mark.parametrize("experts", [16, 32, 64])
def test_busy_experts_take_the_wide_a_operand_tiles(experts):
    busy = M.BUSY_EXPERT_PAIRS * experts
    assert M.UNSORTED_MAX_PAIRS + 8 < busy < M.PREFILL_MIN_PAIRS
    assert M.launch_config(busy - 8, experts, True)["kernel"] == "swap"
    cfg = M.launch_config(busy, experts, True)
    assert {k: cfg[k] for k in M.BUSY_CONFIG} == M.BUSY_CONFIG
    if 2 * busy < M.PREFILL_MIN_PAIRS:  # busier still (a prefill chunk): the swap-AB kernel again
        assert M.launch_config(2 * busy, experts, True)["kernel"] == "swap"


def test_a_callers_tiles_are_both_gemms_unless_it_names_gemm2s():
    busy = M.BUSY_EXPERT_PAIRS * 32
    assert "gemm2" in M.launch_config(busy, 32, True)  # the busy tiles: GEMM2 on its own
    tiles = M.launch_config(busy, 32, True, {"block_n": 128, "num_warps": 8})
    assert "gemm2" not in tiles and tiles["block_n"] == 128  # one set of tiles for both
    own = {"block_n": 32}
    assert M.launch_config(busy, 32, True, {"num_warps": 8, "gemm2": own})["gemm2"] == own


def test_bf16_experts_keep_the_swap_kernel_when_busy():
    assert M.launch_config(M.BUSY_EXPERT_PAIRS * 32, 32, False)["kernel"] == "swap"


def test_prefill_sized_batches_take_the_dense_path_and_bf16_activations_the_gemm_kernel():
    assert M.launch_config(M.PREFILL_MIN_PAIRS, 32, True)["kernel"] == M.PREFILL_CONFIG["kernel"]
    assert M.launch_config(M.PREFILL_MIN_PAIRS, 32, False)["kernel"] == "gemm"
    assert M.launch_config(M.PREFILL_MIN_PAIRS, 32, True, {"fp8_act": False})["kernel"] == "gemm"


def test_busy_tiles_only_where_measured_fp8_activations_no_kernel_named_no_other_ranks_pairs():
    busy = M.BUSY_EXPERT_PAIRS * 32
    assert M.launch_config(busy, 32, True, {"fuse_shared": False})["kernel"] == "gemm"
    assert M.launch_config(busy, 32, True, {"fp8_act": False})["kernel"] == "swap"  # DSASERVE_FP8_ACTIVATIONS=0
    assert M.launch_config(busy, 32, True, absent=True)["kernel"] == "swap"  # EP: the pairs count other ranks'


def test_a_callers_config_wins():
    cfg = M.launch_config(1024, 32, True, {"kernel": "swap", "block_m": 16})
    assert cfg["kernel"] == "swap" and cfg["block_m"] == 16 and cfg["num_warps"] == 4 and cfg["block_n"] == 64
