"""DP2 + EP2 on two GPUs over NCCL (skipped without them): the scenario of test_dp_attention.py — each rank
its own requests, idle steps through `forward_idle` — on the GPU kernels (FP8 weights, bf16, fp32 KV),
against one GPU's logits for the same requests. Written on a CPU-only machine and not yet run: the bound
is the one the single-GPU tests use for "the same math, another kernel order" (tests/engine/test_engine_gpu.py).
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(dp_worker, 3, tmp_path_factory.mktemp("dp_gpu"), (NAME,), **GPU)


def test_dp2_ep2_on_two_gpus_gives_each_rank_one_gpus_logits(runs):
    refs, ranks = runs
    cfg = load_config(NAME)
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
            assert (got - want).norm() / want.norm() < 1e-2, (rank, i, s["what"])
