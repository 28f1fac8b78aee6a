"""DP2 + EP2 on two GPUs over NCCL (skipped without them): the scenario of test_dp_attention.py — each rank
its own requests, idle steps through `forward_idle` — on the GPU kernels (FP8 weights, bf16, fp32 KV),
against one GPU's logits for the same requests (its decode steps replayed from CUDA graphs; DP-attention's
run eager).

With bf16 activations (DSASERVE_FP8_ACTIVATIONS=0) the bound is the single-GPU tests' "same math, another
kernel order" (tests/engine/test_engine_gpu.py). With FP8 activations a rank's batch takes another GEMM path
than one GPU's batch of every request when its row count crosses a dispatch threshold (rank 1's 41-token
prefill: the skinny kernel; one GPU's 116 rows: the tiled one). Each quantises the same bf16 rows the same
way, but a last-bit difference in a GEMM's bf16 output flips an e4m3 rounding (1/16 relative) in the next
layer, and the random tiny model amplifies it: measured on two H200s, 0.13 at that prefill and 0.01-0.08 at
the decode steps after it, 0.0000 wherever the paths agree. A wrong exchange gives ~1.3 (every row another
token's, measured before the fix of the tests' graph-buffer aliasing).
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.config import load_config
from tests.distributed.dp_harness import dp_worker, expected_logits
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
NAME = "glm-5.3-tiny"  # EP2 and DP-attention cut no FP8 block of it (TP2 would: 96 q_b rows per rank)
GPU = {"device": "cuda", "dtype": "bfloat16", "num_pages": 32, "cuda_graph_max_bs": 4}


BOUND = {"0": 1e-2, "1": 0.25}  # by DSASERVE_FP8_ACTIVATIONS: see the module docstring


@pytest.fixture(scope="module", params=["0", "1"], ids=["bf16_activations", "fp8_activations"])
def runs(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the spawned ranks inherit it; the registry keys its cache on it
        mp.setenv("DSASERVE_FP8_ACTIVATIONS", request.param)
        return request.param, run_ranks(dp_worker, 3, tmp_path_factory.mktemp("dp_gpu"), (NAME,), **GPU)


def test_dp2_ep2_on_two_gpus_gives_each_rank_one_gpus_logits(runs):
    fp8_act, (refs, ranks) = runs
    cfg = load_config(NAME)
    errors = {}
    for rank, res in enumerate(ranks):
        assert res[NAME]["parallel"]["backend"] == "nccl"
        steps = res[NAME]["steps"]
        for i, s in enumerate(steps):
            mtp = i == len(steps) - 1  # the last step also runs the MTP layer
            assert s["counters"]["collective_calls.all_to_all"] == 3 * (len(cfg.moe_layers) + mtp)
            if s["what"][0] == "idle":
                continue
            want = expected_logits(refs[NAME], cfg, rank, s["what"]).float().cpu()
            got = s["logits"].float().cpu()
            assert not got.isnan().any()
            errors[(rank, i, s["what"])] = round(float((got - want).norm() / want.norm()), 4)
    print(f"DSASERVE_FP8_ACTIVATIONS={fp8_act}: relative logit distance per (rank, step):", errors)
    assert max(errors.values()) < BOUND[fp8_act], errors
