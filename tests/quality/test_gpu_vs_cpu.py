"""The GPU path against the CPU reference on the trained built-in model (issue 18), as `dsaserve eval` asks it.

glm-5.3-mini, 10 held-out prompts x 32 greedy tokens, both with the engine's default fp8_ds_mla KV layout: the
GPU path (bf16, the Triton kernels, FP8 activations on) must continue >= 9 of 10 prompts exactly as the CPU
reference (fp32 on dequantised weights). The same run with FP8 activations off is printed beside it (how much
of a parting the activation rounding explains). The settings, prompts and agreement metric are eval's own
(`quality/report.py`: make_plan's "fp8_act" and "cpu_ref" groups, heldout_data, agreement).
Needs a GPU: `pytest -s tests/quality/test_gpu_vs_cpu.py` on the H200.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.quality.report import EvalArgs, agreement, heldout_data, make_plan
from dsaserve.quality.runs import run_setting
from dsaserve.weights.checkpoint_cache import packaged_checkpoint

CKPT = packaged_checkpoint("glm-5.3-mini")
pytestmark = [pytest.mark.skipif(CKPT is None, reason="dsaserve/builtin/glm-5.3-mini is not in this checkout"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs CUDA")]
TOKENS = 32


def test_gpu_greedy_equals_the_cpu_reference_on_9_of_10_heldout_prompts(set_switch):
    set_switch("DSASERVE_KERNELS", None)  # the default kernels, whatever the shell set
    args = EvalArgs(model=str(CKPT), device="cuda", groups=("fp8_act", "cpu_ref"), windows=1, prompts=10,
                    max_tokens=TOKENS)
    wins, prompts, _ = heldout_data(args)
    plan = make_plan(args)
    results = {s.name: run_setting(str(CKPT), s, wins[:1], prompts, TOKENS, 1) for s in plan.settings}
    gpu, gpu_bf16_act, cpu = (f"cuda:{args.kv_layout}", f"cuda:{args.kv_layout}:bf16act", f"cpu:{args.kv_layout}")
    assert set(results) == {gpu, gpu_bf16_act, cpu}
    on = agreement(results[gpu]["greedy"], results[cpu]["greedy"])
    off = agreement(results[gpu_bf16_act]["greedy"], results[cpu]["greedy"])
    print(f"\nGPU vs CPU reference, {len(prompts)} prompts x {TOKENS} greedy tokens: FP8 activations on "
          f"{on['identical']}/{on['of']} identical (mean agreeing prefix {on['mean_prefix']}), off "
          f"{off['identical']}/{off['of']} ({off['mean_prefix']})")
    assert len(prompts) == 10 and on["identical"] >= 9, on
