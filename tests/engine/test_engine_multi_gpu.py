"""Two GPUs over NCCL (skipped with fewer): the offline Engine at TP2, TP2+EP2 and DP2+EP2 gives one GPU's
greedy tokens on `glm-5.3-slice` (GLM-5.3's real per-layer shapes, dummy weights), and its ranks start,
step and stop as processes of their own.

Exact mode, as the CPU multi-rank tests: float32 activations, fp32 KV and the PyTorch reference kernels
(`DSASERVE_KERNELS=reference`, inherited by the follower ranks), so TP / EP only reorder float32 sums. The
fast path (bf16, Triton) is measured for agreement by bench/bench_multi_gpu.py instead: random weights have
near-ties that any rounding moves (bench/RESULTS.md, "Greedy outputs").
"""

from __future__ import annotations

import pytest
import torch

from dsaserve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")

LAYOUTS = {"tp2": {"tensor_parallel_size": 2},
           "tp2_ep2": {"tensor_parallel_size": 2, "expert_parallel_size": 2},
           "dp2_ep2": {"enable_dp_attention": True, "expert_parallel_size": 2}}
EXACT = {"load_format": "dummy", "device": "cuda", "dtype": "float32", "kv_layout": "fp32", "num_pages": 64,
         "disable_cuda_graph": True, "max_model_len": 2048}


def greedy(**layout) -> list[list[int]]:
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(100 + 37 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine("glm-5.3-slice", **EXACT, **layout) as eng:
        return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.fixture(scope="module")
def one_gpu(set_switch_module):
    return greedy()


@pytest.fixture(scope="module")
def set_switch_module():
    mp = pytest.MonkeyPatch()
    from dsaserve.common import envs

    mp.setenv("DSASERVE_KERNELS", "reference")
    envs.reload()
    yield
    mp.undo()
    envs.reload()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_gpus_give_one_gpus_greedy_tokens(one_gpu, name):
    assert greedy(**LAYOUTS[name]) == one_gpu
